/* ---------------------------------------------------------------------------------------------
 * bf16 weights, float32 compute: out[m, n] = sum_k x[m, k] * W[n, k], with x float32 [M, K] and W
 * the bf16 bit patterns (uint16) of an [N, K] weight in the checkpoint's layout, read in place.
 * A bf16 is the high half of a float32, so widening is exact (a shift by 16); the products and sums
 * are float32, so the result is the float32 model's with bf16-rounded weights, at half its weight
 * bytes: decode, which streams every weight once a step, reads half as much.
 *
 * Included by cpu_kernels.c (its thread pool). A tile is BF16_MR rows x BF16_NR columns: per 16
 * values of k it widens BF16_NR weight vectors and feeds BF16_MR * BF16_NR FMAs. Work items are
 * pieces of ~64 KiB of weight columns taken from one counter; a piece stays in L2 while every row
 * tile passes over it. Each output is one FMA chain per lane over k in index order (the k tail
 * through masked loads that read zeros), then its 16 lanes summed in a fixed order: the same bits
 * whatever the thread count, the tile it falls in and the other rows of the batch.
 * ------------------------------------------------------------------------------------------- */

#define BF16_MR 4
#define BF16_NR 4

typedef struct {
    const float *x;
    const uint16_t *w;
    float *out;
    int rows, cols, depth;
    int64_t cols_per_piece, next_piece;
} bf16_job;

static inline float bf16_to_float(uint16_t b) {
    const uint32_t bits = (uint32_t)b << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
static inline __m512 bf16_widen(__m256i v) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16)); }

/* Rows m0 .. m0 + MR - 1 times columns n0 .. n0 + NR - 1; MR and NR are constants at each call site. */
static inline __attribute__((always_inline)) void bf16_tile(const bf16_job *job, int m0, int n0, const int MR,
                                                            const int NR) {
    const int depth = job->depth;
    const float *x = job->x + (int64_t)m0 * depth;
    const uint16_t *w = job->w + (int64_t)n0 * depth;
    __m512 acc[BF16_MR][BF16_NR];
    for (int r = 0; r < MR; ++r)
        for (int c = 0; c < NR; ++c) acc[r][c] = _mm512_setzero_ps();
    int k = 0;
    for (; k + 16 <= depth; k += 16) {
        __m512 wv[BF16_NR];
        for (int c = 0; c < NR; ++c) wv[c] = bf16_widen(_mm256_loadu_si256((const __m256i *)(w + (int64_t)c * depth + k)));
        for (int r = 0; r < MR; ++r) {
            const __m512 xv = _mm512_loadu_ps(x + (int64_t)r * depth + k);
            for (int c = 0; c < NR; ++c) acc[r][c] = _mm512_fmadd_ps(xv, wv[c], acc[r][c]);
        }
    }
    if (k < depth) {
        const __mmask16 m = (__mmask16)((1u << (depth - k)) - 1);
        __m512 wv[BF16_NR];
        for (int c = 0; c < NR; ++c)
            wv[c] = bf16_widen(_mm256_maskz_loadu_epi16(m, w + (int64_t)c * depth + k));
        for (int r = 0; r < MR; ++r) {
            const __m512 xv = _mm512_maskz_loadu_ps(m, x + (int64_t)r * depth + k);
            for (int c = 0; c < NR; ++c) acc[r][c] = _mm512_fmadd_ps(xv, wv[c], acc[r][c]);
        }
    }
    for (int r = 0; r < MR; ++r)
        for (int c = 0; c < NR; ++c) job->out[(int64_t)(m0 + r) * job->cols + n0 + c] = _mm512_reduce_add_ps(acc[r][c]);
}

static void bf16_block(const bf16_job *job, int m0, int mr, int n0, int nr) {
#define BF16_NCASE(M)                          \
    switch (nr) {                              \
    case 1: bf16_tile(job, m0, n0, M, 1); break; \
    case 2: bf16_tile(job, m0, n0, M, 2); break; \
    case 3: bf16_tile(job, m0, n0, M, 3); break; \
    default: bf16_tile(job, m0, n0, M, 4); break; \
    }
    switch (mr) {
    case 1: BF16_NCASE(1) break;
    case 2: BF16_NCASE(2) break;
    case 3: BF16_NCASE(3) break;
    default: BF16_NCASE(4) break;
    }
#undef BF16_NCASE
}
#else
/* Without AVX-512: one float chain per output over k in index order (the compiler may vectorize
 * across the tile's outputs, never along k). */
static void bf16_block(const bf16_job *job, int m0, int mr, int n0, int nr) {
    const int depth = job->depth;
    for (int r = 0; r < mr; ++r)
        for (int c = 0; c < nr; ++c) {
            const float *x = job->x + (int64_t)(m0 + r) * depth;
            const uint16_t *w = job->w + (int64_t)(n0 + c) * depth;
            float sum = 0.0f;
            for (int k = 0; k < depth; ++k) sum += x[k] * bf16_to_float(w[k]);
            job->out[(int64_t)(m0 + r) * job->cols + n0 + c] = sum;
        }
}
#endif

static void *bf16_worker(void *arg) {
    bf16_job *job = arg;
    for (;;) {
        const int64_t begin = __atomic_fetch_add(&job->next_piece, 1, __ATOMIC_RELAXED) * job->cols_per_piece;
        if (begin >= job->cols) return NULL;
        const int end = (int)(begin + job->cols_per_piece < job->cols ? begin + job->cols_per_piece : job->cols);
        for (int m0 = 0; m0 < job->rows; m0 += BF16_MR) {
            const int mr = job->rows - m0 < BF16_MR ? job->rows - m0 : BF16_MR;
            for (int n0 = (int)begin; n0 < end; n0 += BF16_NR)
                bf16_block(job, m0, mr, n0, end - n0 < BF16_NR ? end - n0 : BF16_NR);
        }
    }
}

/* x [rows, depth] float32, w [cols, depth] bf16 bits -> out [rows, cols] float32, on up to
 * num_threads threads (the caller's included). */
void fdplug_bf16_linear(const float *x, const uint16_t *w, float *out, int rows, int cols, int depth, int num_threads) {
    if (rows <= 0 || cols <= 0) return;
    if (depth <= 0) {
        memset(out, 0, sizeof(float) * (size_t)rows * (size_t)cols);
        return;
    }
    int64_t cols_per_piece = ((int64_t)1 << 15) / depth; /* ~64 KiB of bf16 weights a piece */
    cols_per_piece = cols_per_piece < BF16_NR ? BF16_NR : cols_per_piece - cols_per_piece % BF16_NR;
    bf16_job job = {x, w, out, rows, cols, depth, cols_per_piece, 0};
    const int64_t pieces = (cols + cols_per_piece - 1) / cols_per_piece;
    run_workers(bf16_worker, &job, num_threads < pieces ? num_threads : (int)pieces);
}
