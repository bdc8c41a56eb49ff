/* ---------------------------------------------------------------------------------------------
 * RMSNorm: out[r] = weight[r % weight_rows] * x[r] / sqrt(mean(x[r]^2) + eps), float32, rows of dim.
 *
 * Why: paddle runs it as five ops (square, mean, add, rsqrt, two multiplies), each a dispatch of
 * ~10 us on this machine; a decode step calls it twice a layer (plus Qwen3's q/k norm), ~1 ms of a
 * 9 ms step for the 12-layer bench model. weight_rows > 1 is the q/k norm: one weight row per head
 * of rows laid out [tokens, heads, dim]. The mean of squares is summed in float32 lanes in index
 * order, then the lanes in a fixed order: a row's result does not depend on the others.
 * ------------------------------------------------------------------------------------------- */

typedef struct {
    const float *x, *weight;
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

void fdplug_rms_norm(const float *x, const float *weight, float *out, int64_t rows, int dim, int weight_rows,
                     float eps, int num_threads) {
    if (rows <= 0 || dim <= 0) return;
    rms_job job = {x, weight, out, rows, 64, 0, dim, weight_rows > 0 ? weight_rows : 1, eps};
    const int64_t pieces = (rows + job.rows_per_piece - 1) / job.rows_per_piece;
    run_workers(rms_worker, &job, (int64_t)num_threads < pieces ? num_threads : (int)pieces);
}
