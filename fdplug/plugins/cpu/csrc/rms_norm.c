/* ---------------------------------------------------------------------------------------------
 * RMSNorm: out[r] = weight[r % weight_rows] * x[r] / sqrt(mean(x[r]^2) + eps), float32, rows of dim.
 *
 * Why: paddle runs it as five ops (square, mean, add, rsqrt, two multiplies), each a dispatch of
 * ~10 us on this machine; a decode step calls it twice a layer (plus Qwen3's q/k norm), ~1 ms of a
 * 9 ms step for the 12-layer bench model. weight_rows > 1 is the q/k norm: one weight row per head
 * of rows laid out [tokens, heads, dim]. The mean of squares is summed in float32 lanes in index
 * order, then the lanes in a fixed order: a row's result does not depend on the others.
 *
 * fdplug_add_rms_norm is the add_rms_norm op: total = x + residual written out, then the norm of
 * total, in one pass over each row (the decoder's residual adds ran as separate Paddle ops, ~15-30
 * us each in a decode step, two a layer).
 * ------------------------------------------------------------------------------------------- */

typedef struct {
    const float *x, *weight;
    const float *residual; /* NULL: plain norm of x; else the norm of x + residual, stored in total */
    float *total;
    float *out;
    int64_t rows, rows_per_piece, next_piece;
    int dim, weight_rows;
    float eps;
} rms_job;

static void rms_rows(const rms_job *job, int64_t begin, int64_t end) {
    const int dim = job->dim;
    for (int64_t r = begin; r < end; ++r) {
        const float *x = job->x + r * dim, *w = job->weight + (r % job->weight_rows) * dim;
        float *o = job->out + r * dim;
        if (job->residual != NULL) {
            float *t = job->total + r * dim;
            const float *res = job->residual + r * dim;
            for (int d = 0; d < dim; ++d) t[d] = x[d] + res[d];
            x = t;
        }
        float lanes[8] = {0}, sum = 0.0f;
        int d = 0;
        for (; d + 8 <= dim; d += 8)
            for (int l = 0; l < 8; ++l) lanes[l] += x[d + l] * x[d + l];
        for (; d < dim; ++d) sum += x[d] * x[d];
        for (int l = 0; l < 8; ++l) sum += lanes[l];
        const float inv = 1.0f / sqrtf(sum / (float)dim + job->eps);
        for (d = 0; d < dim; ++d) o[d] = w[d] * (x[d] * inv);
    }
}

static void *rms_worker(void *arg) {
    rms_job *job = arg;
    for (;;) {
        const int64_t begin = __atomic_fetch_add(&job->next_piece, 1, __ATOMIC_RELAXED) * job->rows_per_piece;
        if (begin >= job->rows) return NULL;
        rms_rows(job, begin, begin + job->rows_per_piece < job->rows ? begin + job->rows_per_piece : job->rows);
    }
}

static void rms_run(rms_job *job, int num_threads) {
    if (job->rows <= 0 || job->dim <= 0) return;
    job->rows_per_piece = 64;
    job->next_piece = 0;
    if (job->weight_rows <= 0) job->weight_rows = 1;
    const int64_t pieces = (job->rows + job->rows_per_piece - 1) / job->rows_per_piece;
    run_workers(rms_worker, job, (int64_t)num_threads < pieces ? num_threads : (int)pieces);
}

void fdplug_rms_norm(const float *x, const float *weight, float *out, int64_t rows, int dim, int weight_rows,
                     float eps, int num_threads) {
    rms_job job = {x, weight, NULL, NULL, out, rows, 0, 0, dim, weight_rows, eps};
    rms_run(&job, num_threads);
}

/* total = x + residual, out = norm(total) * weight; x, residual, total, out [rows, dim], weight [dim]. */
void fdplug_add_rms_norm(const float *x, const float *residual, const float *weight, float *total, float *out,
                         int64_t rows, int dim, float eps, int num_threads) {
    rms_job job = {x, weight, residual, total, out, rows, 0, 0, dim, 1, eps};
    rms_run(&job, num_threads);
}

/* ---------------------------------------------------------------------------------------------
 * RoPE (the rope op, NeoX rotation): out = x * cos + roll(x, dim / 2) * sin over rows of dim,
 * x, cos, sin and out all [rows, dim] (the tables tiled per row by the caller, sin's first half
 * negated). Each product rounded, then the sum: no FMA contraction (-std=c99 turns it off), so the
 * result is paddle's four ops' bit for bit. Replaces those four ops (~20 us in a decode step's
 * layer, where every op runs with caches the weights just streamed through).
 * ------------------------------------------------------------------------------------------- */
typedef struct {
    const float *x, *cos, *sin;
    float *out;
    int64_t rows, rows_per_piece, next_piece;
    int dim;
} rope_job;

static void *rope_worker(void *arg) {
    rope_job *job = arg;
    const int dim = job->dim, half = dim / 2;
    for (;;) {
        const int64_t begin = __atomic_fetch_add(&job->next_piece, 1, __ATOMIC_RELAXED) * job->rows_per_piece;
        if (begin >= job->rows) return NULL;
        const int64_t end = begin + job->rows_per_piece < job->rows ? begin + job->rows_per_piece : job->rows;
        for (int64_t r = begin; r < end; ++r) {
            const float *x = job->x + r * dim, *c = job->cos + r * dim, *s = job->sin + r * dim;
            float *o = job->out + r * dim;
            for (int d = 0; d < half; ++d) {
                const float a = x[d] * c[d], b = x[d + half] * s[d];
                o[d] = a + b;
            }
            for (int d = half; d < dim; ++d) {
                const float a = x[d] * c[d], b = x[d - half] * s[d];
                o[d] = a + b;
            }
        }
    }
}

void fdplug_rope(const float *x, const float *cos, const float *sin, float *out, int64_t rows, int dim,
                 int num_threads) {
    if (rows <= 0 || dim <= 0) return;
    rope_job job = {x, cos, sin, out, rows, 256, 0, dim};
    const int64_t pieces = (rows + job.rows_per_piece - 1) / job.rows_per_piece;
    run_workers(rope_worker, &job, (int64_t)num_threads < pieces ? num_threads : (int)pieces);
}
