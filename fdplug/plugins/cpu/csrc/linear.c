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
 *
 * Three builds of the tiles, by what the compiler targets (isa.py: FDPLUG_CPU_ISA caps it): AVX-512
 * (below), AVX2 + FMA (linear_avx2.c: the same 16 lanes per output as two 8-lane halves, so the
 * same bits as AVX-512's), else a scalar loop (one chain per output: other bits, ~40x below paddle's
 * matmul). The work split (linear_pieces, linear_run) is shared: it never changes an output's bits.
 * ------------------------------------------------------------------------------------------- */

/* The work split's blocks (a piece's columns are a multiple of LIN_NR, a row block's rows of LIN_MR)
 * and the AVX-512 tile; linear_avx2.c runs a block as LIN_NR tiles of LIN_MR x 1 (16 ymm registers). */
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
    int64_t pieces, rows_per_block; /* work item i: row block i / pieces times piece i % pieces */
} linear_job;

/* bf16_to_float: kv_elements.c's */

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
static inline __m512 bf16_widen(__m256i v) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16)); }

/* 16 weights from element ``at`` as float32; F32 is a constant. Unmasked loads in the main loop:
 * with an all-ones mask register there gcc's code ran at half the speed (measured). */
static inline __attribute__((always_inline)) __m512 weights16(const void *w, int64_t at, const int F32) {
    if (F32) return _mm512_loadu_ps((const float *)w + at);
    return bf16_widen(_mm256_loadu_si256((const __m256i *)((const uint16_t *)w + at)));
}

/* The sum of a vector's 16 lanes in a fixed pairing: lanes j and j + 8, then j and j + 4 of those,
 * j and j + 2, then the last two (gcc's _mm512_reduce_add_ps; written out so that lanes_sum16,
 * which must give the same bits, does not depend on the compiler's choice). */
static inline float lanes_sum(__m512 a) {
    const __m256 t3 = _mm256_add_ps(_mm512_castps512_ps256(a),
                                    _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
    const __m128 t6 = _mm_add_ps(_mm256_castps256_ps128(t3), _mm256_extractf128_ps(t3, 1));
    const __m128 t8 = _mm_add_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtss_f32(_mm_add_ss(t8, _mm_shuffle_ps(t8, t8, 1)));
}

/* lanes_sum of 16 vectors at once, the same additions in the same pairing (so the same bits), with
 * 15 shuffle pairs and adds instead of 16 reductions: lane 4i + j of the result is lanes_sum(v[4j + i]).
 * A 4 x 4 tile over a depth of 512 spent ~40% of its instructions in its 16 reductions. */
static inline __m512 lanes_sum16(const __m512 v[16]) {
    __m512 s[8], u[4];
    for (int p = 0; p < 8; ++p) /* [lo256 + hi256 of v[2p] | of v[2p + 1]] */
        s[p] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * p], v[2 * p + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_f32x4(v[2 * p], v[2 * p + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int q = 0; q < 4; ++q) /* 128-bit lane i: the 4-lane sums of v[4q + i] */
        u[q] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * q], s[2 * q + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(s[2 * q], s[2 * q + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512 w0 = _mm512_add_ps(_mm512_shuffle_ps(u[0], u[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                    _mm512_shuffle_ps(u[0], u[1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 w1 = _mm512_add_ps(_mm512_shuffle_ps(u[2], u[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                    _mm512_shuffle_ps(u[2], u[3], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm512_add_ps(_mm512_shuffle_ps(w0, w1, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_ps(w0, w1, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* out[r * ld + c] = lanes_sum(acc[r][c]) for an MR x NR tile (constants at each call site). */
static inline __attribute__((always_inline)) void store_tile_sums(__m512 acc[LIN_MR][LIN_NR], float *out, int64_t ld,
                                                                  const int MR, const int NR) {
    if (MR == 4 && NR == 4) {
        __m512 v[16];
        for (int r = 0; r < 4; ++r)
            for (int c = 0; c < 4; ++c) v[4 * c + r] = acc[r][c];
        const __m512 sums = lanes_sum16(v); /* lane 4r + c: row r, column c */
        for (int r = 0; r < 4; ++r) _mm_storeu_ps(out + r * ld, _mm512_extractf32x4_ps(sums, r));
        return;
    }
    for (int r = 0; r < MR; ++r)
        for (int c = 0; c < NR; ++c) out[r * ld + c] = lanes_sum(acc[r][c]);
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
    store_tile_sums(acc, job->out + (int64_t)m0 * job->cols + n0, job->cols, MR, NR);
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
#elif defined(HAVE_AVX2)
#include "linear_avx2.c" /* AVX2 + FMA: the AVX-512 tiles' bits in 8-lane halves */
#else
/* Without AVX2: one float chain per output over k in index order. */
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

/* Work items (a block of rows times a piece of columns, row block by row block) taken from the
 * job's counter until none is left; in each, every row tile of the block times the piece's columns
 * through block(). Shared with linear_bf16.c (its job starts with a linear_job). */
static void linear_pieces(linear_job *job, void (*block)(const linear_job *, int m0, int mr, int n0, int nr)) {
    for (;;) {
        const int64_t item = __atomic_fetch_add(&job->next_piece, 1, __ATOMIC_RELAXED);
        const int64_t first_row = item / job->pieces * job->rows_per_block;
        if (first_row >= job->rows) return;
        const int64_t begin = item % job->pieces * job->cols_per_piece;
        const int end = (int)(begin + job->cols_per_piece < job->cols ? begin + job->cols_per_piece : job->cols);
        const int last_row = (int)(first_row + job->rows_per_block < job->rows ? first_row + job->rows_per_block
                                                                                : job->rows);
        for (int m0 = (int)first_row; m0 < last_row; m0 += LIN_MR) {
            const int mr = last_row - m0 < LIN_MR ? last_row - m0 : LIN_MR;
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
 * stays in L2 while every row tile passes over it) times blocks of rows whose input, x_bytes a
 * value, fits in LIN_X_BLOCK_BYTES (so it stays in L2 too: 1,024 rows of a 512-deep float32 input
 * are 2 MB, and every piece read them all again from L3), run by worker on up to num_threads
 * threads; up to LIN_STREAM_ROWS rows, pieces of at least a quarter of a thread's share. */
#define LIN_X_BLOCK_BYTES (384 << 10)
static void linear_run(linear_job *job, void *(*worker)(void *), int64_t piece_weights, int x_bytes,
                       int num_threads) {
    const int64_t block_rows = LIN_X_BLOCK_BYTES / ((int64_t)job->depth * x_bytes) / LIN_MR * LIN_MR;
    job->rows_per_block = block_rows < LIN_MR ? LIN_MR : block_rows;
    const int64_t stream_piece = (int64_t)job->cols * job->depth / (4 * (num_threads > 1 ? num_threads : 1));
    if (job->rows <= LIN_STREAM_ROWS && stream_piece > piece_weights) piece_weights = stream_piece;
    int64_t cols_per_piece = piece_weights / job->depth;
    job->cols_per_piece = cols_per_piece < LIN_NR ? LIN_NR : cols_per_piece - cols_per_piece % LIN_NR;
    job->next_piece = 0;
    job->pieces = (job->cols + job->cols_per_piece - 1) / job->cols_per_piece;
    const int64_t items = job->pieces * ((job->rows + job->rows_per_block - 1) / job->rows_per_block);
    run_workers(worker, job, num_threads < items ? num_threads : (int)items);
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
    linear_job job = {x, w, out, rows, cols, depth, f32 != 0, 0, 0, 0, 0};
    linear_run(&job, linear_worker, (int64_t)1 << 15, sizeof(float), num_threads);
}
