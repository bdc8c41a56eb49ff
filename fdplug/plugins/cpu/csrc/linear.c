/* ---------------------------------------------------------------------------------------------
 * The linear layer: out[m, n] = sum_k x[m, k] * W[n, k], x float32 [M, K], W [N, K] in the
 * checkpoint's layout, read in place, either float32 or bf16 (its bit patterns, uint16).
 *
 * Why: paddle's MKL takes its AVX2 path on AMD CPUs (MKL_DEBUG_CPU_TYPE=5 is the best it offers
 * there); on this 2-core AVX-512 machine these tiles run 1.1-1.9x its float32 matmul (native_linear.py).
 * bf16 weights are widened in registers, exactly (a bf16 is the high half of a float32: a shift by
 * 16): the math is float32's on the bf16 values, at half the weight bytes, and decode, which
 * streams every weight once a step, reads half as much.
 *
 * Included by cpu_kernels.c (its thread pool). A tile is LIN_MR rows x LIN_NR columns: per 16
 * values of k it loads LIN_NR weight vectors and LIN_MR activation vectors and feeds LIN_MR * LIN_NR
 * FMAs. Work items are pieces of ~32 K weights of columns taken from one counter; a piece stays in
 * L2 while every row tile passes over it. Each output is one FMA chain per lane over k in index
 * order (the k tail through masked loads that read zeros), then its 16 lanes summed in a fixed
 * order: the same bits whatever the thread count, the tile it falls in and the other rows.
 * ------------------------------------------------------------------------------------------- */

#define LIN_MR 4
#define LIN_NR 4
/* Up to this many rows (one row tile: decode) a tile takes one column at a time, so each thread
 * reads its weights as one sequential stream, and a thread's pieces are a quarter of its share: no
 * row tile comes back to a piece, so the L2-sized pieces have nothing to save. Four interleaved
 * rows ran at 12.5 GB/s on one thread of this Zen 4 where one row after the other ran at 21.8 (the
 * hardware prefetcher follows one stream); a 1,536 x 512 float32 layer out of memory, 2 threads:
 * 157 -> ~120 us, bf16 107 -> ~73 us. Each output is the same FMA chain either way: same bits. */
#define LIN_STREAM_ROWS 4

typedef struct {
    const float *x;
    const void *w;  /* [cols, depth]: float32, or bf16 bits */
    float *out;
    int rows, cols, depth;
    int f32;        /* the weights are float32, else bf16 */
    int64_t cols_per_piece, next_piece;
} linear_job;

static inline float bf16_to_float(uint16_t b) {
    const uint32_t bits = (uint32_t)b << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
static inline __m512 bf16_widen(__m256i v) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16)); }

/* 16 weights from element ``at`` as float32; F32 is a constant. Unmasked loads in the main loop:
 * with an all-ones mask register there gcc's code ran at half the speed (measured). */
static inline __attribute__((always_inline)) __m512 weights16(const void *w, int64_t at, const int F32) {
    if (F32) return _mm512_loadu_ps((const float *)w + at);
    return bf16_widen(_mm256_loadu_si256((const __m256i *)((const uint16_t *)w + at)));
}

static inline __attribute__((always_inline)) __m512 weights16_masked(const void *w, int64_t at, __mmask16 m,
                                                                     const int F32) {
    if (F32) return _mm512_maskz_loadu_ps(m, (const float *)w + at);
    return bf16_widen(_mm256_maskz_loadu_epi16(m, (const uint16_t *)w + at));
}

/* Rows m0 .. m0 + MR - 1 times columns n0 .. n0 + NR - 1; MR, NR and F32 are constants at each call site. */
static inline __attribute__((always_inline)) void linear_tile(const linear_job *job, int m0, int n0, const int MR,
                                                              const int NR, const int F32) {
    const int depth = job->depth;
    const float *x = job->x + (int64_t)m0 * depth;
    const void *w = job->w;
    const int64_t row0 = (int64_t)n0 * depth;
    __m512 acc[LIN_MR][LIN_NR];
    for (int r = 0; r < MR; ++r)
        for (int c = 0; c < NR; ++c) acc[r][c] = _mm512_setzero_ps();
    int k = 0;
    for (; k + 16 <= depth; k += 16) {
        __m512 wv[LIN_NR];
        for (int c = 0; c < NR; ++c) wv[c] = weights16(w, row0 + (int64_t)c * depth + k, F32);
        for (int r = 0; r < MR; ++r) {
            const __m512 xv = _mm512_loadu_ps(x + (int64_t)r * depth + k);
            for (int c = 0; c < NR; ++c) acc[r][c] = _mm512_fmadd_ps(xv, wv[c], acc[r][c]);
        }
    }
    if (k < depth) {
        const __mmask16 m = (__mmask16)((1u << (depth - k)) - 1);
        __m512 wv[LIN_NR];
        for (int c = 0; c < NR; ++c) wv[c] = weights16_masked(w, row0 + (int64_t)c * depth + k, m, F32);
        for (int r = 0; r < MR; ++r) {
            const __m512 xv = _mm512_maskz_loadu_ps(m, x + (int64_t)r * depth + k);
            for (int c = 0; c < NR; ++c) acc[r][c] = _mm512_fmadd_ps(xv, wv[c], acc[r][c]);
        }
    }
    for (int r = 0; r < MR; ++r)
        for (int c = 0; c < NR; ++c) job->out[(int64_t)(m0 + r) * job->cols + n0 + c] = _mm512_reduce_add_ps(acc[r][c]);
}

/* A block of mr x nr (1..4 each) as the tile with those constant shapes: TILE(M, N) is the call. */
#define LIN_NCASE(TILE, M)                                                                           \
    switch (nr) {                                                                                    \
    case 1: TILE(M, 1); break;                                                                       \
    case 2: TILE(M, 2); break;                                                                       \
    case 3: TILE(M, 3); break;                                                                       \
    default: TILE(M, 4); break;                                                                      \
    }
#define LIN_DISPATCH(TILE)                                                                           \
    switch (mr) {                                                                                    \
    case 1: LIN_NCASE(TILE, 1) break;                                                                \
    case 2: LIN_NCASE(TILE, 2) break;                                                                \
    case 3: LIN_NCASE(TILE, 3) break;                                                                \
    default: LIN_NCASE(TILE, 4) break;                                                               \
    }

static void linear_block(const linear_job *job, int m0, int mr, int n0, int nr) {
#define LIN_F32_TILE(M, N) linear_tile(job, m0, n0, M, N, 1)
#define LIN_BF16_TILE(M, N) linear_tile(job, m0, n0, M, N, 0)
    if (job->f32) {
        LIN_DISPATCH(LIN_F32_TILE)
    } else {
        LIN_DISPATCH(LIN_BF16_TILE)
    }
#undef LIN_F32_TILE
#undef LIN_BF16_TILE
}
#else
/* Without AVX-512: one float chain per output over k in index order. */
static void linear_block(const linear_job *job, int m0, int mr, int n0, int nr) {
    const int depth = job->depth;
    for (int r = 0; r < mr; ++r)
        for (int c = 0; c < nr; ++c) {
            const float *x = job->x + (int64_t)(m0 + r) * depth;
            const int64_t row = (int64_t)(n0 + c) * depth;
            float sum = 0.0f;
            for (int k = 0; k < depth; ++k)
                sum += x[k] * (job->f32 ? ((const float *)job->w)[row + k]
                                        : bf16_to_float(((const uint16_t *)job->w)[row + k]));
            job->out[(int64_t)(m0 + r) * job->cols + n0 + c] = sum;
        }
}
#endif

/* Pieces of columns taken from the job's counter until none is left; in each, every row tile
 * times the piece's columns through block(). Shared with linear_bf16.c (its job starts with a
 * linear_job). */
static void linear_pieces(linear_job *job, void (*block)(const linear_job *, int m0, int mr, int n0, int nr)) {
    for (;;) {
        const int64_t begin = __atomic_fetch_add(&job->next_piece, 1, __ATOMIC_RELAXED) * job->cols_per_piece;
        if (begin >= job->cols) return;
        const int end = (int)(begin + job->cols_per_piece < job->cols ? begin + job->cols_per_piece : job->cols);
        for (int m0 = 0; m0 < job->rows; m0 += LIN_MR) {
            const int mr = job->rows - m0 < LIN_MR ? job->rows - m0 : LIN_MR;
            const int nr_max = m0 == 0 ? 1 : LIN_NR;
            for (int n0 = (int)begin; n0 < end; n0 += nr_max)
                block(job, m0, mr, n0, end - n0 < nr_max ? end - n0 : nr_max);
        }
    }
}

static void *linear_worker(void *arg) {
    linear_pieces(arg, linear_block);
    return NULL;
}

/* Pieces of about piece_weights weights of columns (a multiple of LIN_NR columns: ~128 KB, which
 * stays in L2 while every row tile passes over it), run by worker on up to num_threads threads;
 * up to LIN_STREAM_ROWS rows, pieces of at least a quarter of a thread's share. */
static void linear_run(linear_job *job, void *(*worker)(void *), int64_t piece_weights, int num_threads) {
    const int64_t stream_piece = (int64_t)job->cols * job->depth / (4 * (num_threads > 1 ? num_threads : 1));
    if (job->rows <= LIN_STREAM_ROWS && stream_piece > piece_weights) piece_weights = stream_piece;
    int64_t cols_per_piece = piece_weights / job->depth;
    job->cols_per_piece = cols_per_piece < LIN_NR ? LIN_NR : cols_per_piece - cols_per_piece % LIN_NR;
    job->next_piece = 0;
    const int64_t pieces = (job->cols + job->cols_per_piece - 1) / job->cols_per_piece;
    run_workers(worker, job, num_threads < pieces ? num_threads : (int)pieces);
}

/* x [rows, depth] float32, w [cols, depth] (float32 if f32, else bf16 bits) -> out [rows, cols]
 * float32, on up to num_threads threads (the caller's included). */
void fdplug_linear(const float *x, const void *w, int f32, float *out, int rows, int cols, int depth,
                   int num_threads) {
    if (rows <= 0 || cols <= 0) return;
    if (depth <= 0) {
        memset(out, 0, sizeof(float) * (size_t)rows * (size_t)cols);
        return;
    }
    linear_job job = {x, w, out, rows, cols, depth, f32 != 0, 0, 0};
    linear_run(&job, linear_worker, (int64_t)1 << 15, num_threads);
}
