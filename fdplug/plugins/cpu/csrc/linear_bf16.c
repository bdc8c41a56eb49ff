/* ---------------------------------------------------------------------------------------------
 * The linear layer in bf16 math: out[m, n] = sum_k bf16(x[m, k]) * W[n, k], W bf16 [N, K] read in
 * place, x float32 [M, K] rounded to bf16 (to nearest even) once a call, sums in float32.
 *
 * Why: AVX512-BF16's vdpbf16ps multiplies 32 bf16 pairs into 16 float32 sums per instruction, twice
 * the multiply-adds of a float32 FMA, and reads the activations at half the bytes: where the
 * linears are compute-bound (prefill, big batches) a bf16 model runs them up to twice as fast as
 * linear.c's float32 math on widened bf16 weights. This is what --dtype bfloat16 means in vLLM and
 * transformers on CPU (both compute in bf16); fdplug rounds only the linears' inputs and keeps
 * float32 everywhere else, so it stays closer to the float32 result than they do.
 *
 * Exactness: a product of two bf16 values is exact in float32, so each vdpbf16ps lane adds two exact
 * products to its float32 sum in a fixed order (k = 32j + 2l, then 2l + 1: lane l over j in index
 * order); the 16 lanes are then summed in a fixed order. As in linear.c, an output's bits do not
 * depend on the batch, the tile or the thread count. Denormal inputs and results flush to zero
 * (the instruction's rule), far below what the rounding to bf16 already changes.
 *
 * Included by cpu_kernels.c after linear.c (bf16 helpers, thread pool).
 * ------------------------------------------------------------------------------------------- */

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define HAVE_BF16_DOT 1

typedef struct {
    linear_job base;    /* x float32, w [cols, depth] bf16 bits, out; first, for linear_pieces */
    uint16_t *xb;       /* [rows, padded] bf16 bits of x, zeros past depth */
    int padded;
    int64_t next_row;
} bf16dot_job;

/* Rows of x rounded to bf16 (vcvtne2ps2bf16: to nearest even, NaN kept a NaN), zero-padded. */
static void *bf16dot_convert_worker(void *arg) {
    bf16dot_job *job = arg;
    for (;;) {
        const int64_t r = __atomic_fetch_add(&job->next_row, 1, __ATOMIC_RELAXED);
        if (r >= job->base.rows) return NULL;
        const float *x = job->base.x + r * job->base.depth;
        uint16_t *xb = job->xb + r * job->padded;
        for (int k = 0; k < job->padded; k += 32) {
            const int left = job->base.depth - k;
            const __mmask16 lo = left >= 16 ? 0xFFFF : left > 0 ? (__mmask16)((1u << left) - 1) : 0;
            const __mmask16 hi = left >= 32 ? 0xFFFF : left > 16 ? (__mmask16)((1u << (left - 16)) - 1) : 0;
            const __m512 a = _mm512_maskz_loadu_ps(lo, x + k), b = _mm512_maskz_loadu_ps(hi, x + k + 16);
            _mm512_storeu_si512((void *)(xb + k), (__m512i)_mm512_cvtne2ps_pbh(b, a));
        }
    }
}

/* Rows m0 .. m0 + MR - 1 times columns n0 .. n0 + NR - 1 (MR, NR constants at each call site). */
static inline __attribute__((always_inline)) void bf16dot_tile(const bf16dot_job *job, int m0, int n0, const int MR,
                                                               const int NR) {
    const int depth = job->base.depth, padded = job->padded;
    const uint16_t *x = job->xb + (int64_t)m0 * padded;
    const uint16_t *w = (const uint16_t *)job->base.w + (int64_t)n0 * depth;
    __m512 acc[LIN_MR][LIN_NR];
    for (int r = 0; r < MR; ++r)
        for (int c = 0; c < NR; ++c) acc[r][c] = _mm512_setzero_ps();
    int k = 0;
    for (; k + 32 <= depth; k += 32) {
        __m512i wv[LIN_NR];
        for (int c = 0; c < NR; ++c) wv[c] = _mm512_loadu_si512((const void *)(w + (int64_t)c * depth + k));
        for (int r = 0; r < MR; ++r) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(x + (int64_t)r * padded + k));
            for (int c = 0; c < NR; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv, (__m512bh)wv[c]);
        }
    }
    if (k < depth) { /* x is zero-padded; the weights past depth are masked to zero */
        const __mmask32 m = (__mmask32)((1ull << (depth - k)) - 1);
        __m512i wv[LIN_NR];
        for (int c = 0; c < NR; ++c) wv[c] = _mm512_maskz_loadu_epi16(m, w + (int64_t)c * depth + k);
        for (int r = 0; r < MR; ++r) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(x + (int64_t)r * padded + k));
            for (int c = 0; c < NR; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv, (__m512bh)wv[c]);
        }
    }
    store_tile_sums(acc, job->base.out + (int64_t)m0 * job->base.cols + n0, job->base.cols, MR, NR);
}

static void bf16dot_block(const linear_job *base, int m0, int mr, int n0, int nr) {
    const bf16dot_job *job = (const bf16dot_job *)base;
#define BF16_TILE(M, N) bf16dot_tile(job, m0, n0, M, N)
    LIN_DISPATCH(BF16_TILE)
#undef BF16_TILE
}

static void *bf16dot_worker(void *arg) {
    linear_pieces(arg, bf16dot_block);
    return NULL;
}
#endif

int fdplug_linear_bf16dot_available(void) {
#ifdef HAVE_BF16_DOT
    return 1;
#else
    return 0;
#endif
}

/* x [rows, depth] float32, w [cols, depth] bf16 bits -> out [rows, cols] float32 in bf16 math, on up
 * to num_threads threads. Returns 0, or -1 where the CPU build has no AVX512-BF16 (nothing written)
 * or the activations' bf16 copy cannot be allocated. */
int fdplug_linear_bf16dot(const float *x, const uint16_t *w, float *out, int rows, int cols, int depth,
                          int num_threads) {
#ifdef HAVE_BF16_DOT
    if (rows <= 0 || cols <= 0) return 0;
    if (depth <= 0) {
        memset(out, 0, sizeof(float) * (size_t)rows * (size_t)cols);
        return 0;
    }
    const int padded = (depth + 31) / 32 * 32;
    void *buffer = NULL;
    if (posix_memalign(&buffer, 64, sizeof(uint16_t) * (size_t)rows * (size_t)padded) != 0) return -1;
    bf16dot_job job = {{x, w, out, rows, cols, depth, 0, 0, 0, 0, 0}, buffer, padded, 0};
    run_workers(bf16dot_convert_worker, &job, num_threads < rows ? num_threads : rows);
    linear_run(&job.base, bf16dot_worker, (int64_t)1 << 16, sizeof(uint16_t), num_threads); /* 64K weights: 128 KB */
    free(buffer);
    return 0;
#else
    (void)x, (void)w, (void)out, (void)rows, (void)cols, (void)depth, (void)num_threads;
    return -1;
#endif
}
