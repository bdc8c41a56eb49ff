/* ---------------------------------------------------------------------------------------------
 * linear.c's tiles on AVX2 + FMA (x86-64-v3: an AMD Zen 2/3, an Intel before AVX-512), with the
 * AVX-512 tiles' bits.
 *
 * Why: without AVX-512 the linear layer fell back to a scalar loop ~40x below paddle's matmul, and
 * a fleet that mixes AVX-512 and AVX2 machines should give a token the same logits on either.
 * Measured on this 2-core Zen 5 capped to avx2 (bench/gemm.py --quick, float32 weights): 0.8-1.5x
 * paddle's matmul at 1 row, 1.1-1.7x at 16, 0.85-1.15x at 64, 0.75-0.85x at 256-1,024 rows (~200
 * GFLOP/s against MKL's AVX2 ~250: each output ends in a horizontal sum, MKL's tiles have none);
 * a [49152, 576] lm_head 1.5x at 1 row, 1.6x at 16. bf16 weights the same or faster.
 *
 * Bits: the AVX-512 tiles keep, per output, 16 lanes (lane j: one FMA chain over k = j, j + 16, ...)
 * and sum them lanes j + j + 8, then j + j + 4, j + j + 2, then the last two (lanes_sum). Here each
 * 16-lane accumulator is two ymm, lanes 0-7 and 8-15: the same 16 chains, each the same FMAs in the
 * same order (an FMA rounds once whatever its width), the k tail's lanes past depth fed zeros as the
 * masked loads there do; the first step of the sum is then lo + hi, the rest lanes_sum's steps on
 * the 256-bit result. Tile shapes and batched sums change which instructions run, never an
 * output's chain or pairing.
 *
 * Included by linear.c where __AVX512F__ is not defined and HAVE_AVX2 is (cpu_kernels.c); the work
 * split (linear_pieces, linear_run: blocks of up to LIN_MR x LIN_NR) is linear.c's, shared.
 * ------------------------------------------------------------------------------------------- */

/* 16 ymm registers: a tile is up to LIN_MR (4) rows times one column, 8 accumulators (two per
 * output), the column's weight vector and an input vector: 8 independent FMA chains, what 2 FMA
 * pipes with a 4-cycle latency need, each weight loaded (and bf16 widened) once for 4 rows, the
 * block's 4 input rows reloaded from L1 for every column. Measured on this Zen 5 capped to avx2, one
 * thread, against 2 x 2 tiles (column pairs, each weight column loaded once a block), 2 x 3 (blocks
 * of 6 columns), 3 x 2 and 1 x 4: 63-66 GFLOP/s float32 and 68-74 bf16 at 4-256 rows, against 55-58
 * / 63-66 (2 x 2), 61-64 / 62-68 (2 x 3), 52-58 / 64-67 (3 x 2), 64-66 / 50-56 (1 x 4: 4 widenings
 * a k step). It is also decode's tile (one column at a time, linear.c: LIN_STREAM_ROWS). */

static inline __m256 bf16_widen8(__m128i v) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

/* 8 weights from element ``at`` as float32; F32 is a constant. */
static inline __attribute__((always_inline)) __m256 weights8(const void *w, int64_t at, const int F32) {
    if (F32) return _mm256_loadu_ps((const float *)w + at);
    return bf16_widen8(_mm_loadu_si128((const __m128i *)((const uint16_t *)w + at)));
}

/* lanes_sum of the 16-lane vector [lo | hi]: the same additions in the same pairing. */
static inline float lanes_sum8(__m256 lo, __m256 hi) {
    const __m256 t3 = _mm256_add_ps(lo, hi);
    const __m128 t6 = _mm_add_ps(_mm256_castps256_ps128(t3), _mm256_extractf128_ps(t3, 1));
    const __m128 t8 = _mm_add_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtss_f32(_mm_add_ss(t8, _mm_shuffle_ps(t8, t8, 1)));
}

/* lanes_sum8 of 4 outputs at once (lane i: output i), the same additions in the same pairing, as
 * lanes_sum16 does for 16 (3 shuffle-and-add steps instead of 4 reductions). */
static inline __m128 lanes_sum8x4(const __m256 lo[4], const __m256 hi[4]) {
    __m256 t[4];
    for (int i = 0; i < 4; ++i) t[i] = _mm256_add_ps(lo[i], hi[i]);
    /* [low 128 + high 128 of t[0] | of t[1]], the same for t[2], t[3] */
    const __m256 u0 = _mm256_add_ps(_mm256_permute2f128_ps(t[0], t[1], 0x20), _mm256_permute2f128_ps(t[0], t[1], 0x31));
    const __m256 u1 = _mm256_add_ps(_mm256_permute2f128_ps(t[2], t[3], 0x20), _mm256_permute2f128_ps(t[2], t[3], 0x31));
    /* lanes j + j + 2: 128-bit half h holds t[h]'s two in lanes 0, 1 and t[h + 2]'s in lanes 2, 3 */
    const __m256 w = _mm256_add_ps(_mm256_shuffle_ps(u0, u1, _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm256_shuffle_ps(u0, u1, _MM_SHUFFLE(3, 2, 3, 2)));
    /* the last two: half h holds [t[h], t[h + 2], ...] */
    const __m256 s = _mm256_add_ps(_mm256_shuffle_ps(w, w, _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm256_shuffle_ps(w, w, _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm_unpacklo_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

/* Rows m0 .. m0 + MR - 1 times column n; MR and F32 are constants at each call site. acc[r][0]
 * holds lanes 0-7 of the AVX-512 tile's accumulator for row r, acc[r][1] lanes 8-15. */
static inline __attribute__((always_inline)) void linear_tile8(const linear_job *job, int m0, int n, const int MR,
                                                               const int F32) {
    const int depth = job->depth;
    const float *x = job->x + (int64_t)m0 * depth;
    const void *w = job->w;
    const int64_t row = (int64_t)n * depth;
    __m256 acc[LIN_MR][2];
    for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    int k = 0;
    for (; k + 16 <= depth; k += 16)
        for (int h = 0; h < 2; ++h) {
            const __m256 wv = weights8(w, row + k + 8 * h, F32);
            for (int r = 0; r < MR; ++r)
                acc[r][h] = _mm256_fmadd_ps(_mm256_loadu_ps(x + (int64_t)r * depth + k + 8 * h), wv, acc[r][h]);
        }
    if (k < depth) {
        /* The last depth - k (1..15) values and zeros past them, as the AVX-512 masked loads give
         * (the zero lanes' FMAs included: acc + 0 * 0 is what AVX-512 computes there): float32
         * through vmaskmovps (lanes off the mask are neither read nor faulted), bf16 (no 16-bit
         * masked load in AVX2) copied into a zeroed buffer. */
        static const int32_t ones_then_zeros[24] = {-1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1};
        const int left = depth - k;
        const int lanes[2] = {left < 8 ? left : 8, left > 8 ? left - 8 : 0}; /* of each half */
        uint16_t tail[16] = {0};
        if (!F32) memcpy(tail, (const uint16_t *)w + row + k, sizeof(uint16_t) * left);
        for (int h = 0; h < 2; ++h) {
            const __m256i mask = _mm256_loadu_si256((const __m256i *)(ones_then_zeros + 16 - lanes[h]));
            const __m256 wv = F32 ? _mm256_maskload_ps((const float *)w + row + k + 8 * h, mask)
                                  : weights8(tail, 8 * h, 0);
            for (int r = 0; r < MR; ++r)
                acc[r][h] = _mm256_fmadd_ps(_mm256_maskload_ps(x + (int64_t)r * depth + k + 8 * h, mask), wv,
                                            acc[r][h]);
        }
    }
    float *out = job->out + (int64_t)m0 * job->cols + n;
    const int64_t ld = job->cols;
    if (MR == 4) {
        const __m256 lo[4] = {acc[0][0], acc[1][0], acc[2][0], acc[3][0]};
        const __m256 hi[4] = {acc[0][1], acc[1][1], acc[2][1], acc[3][1]};
        float sums[4];
        _mm_storeu_ps(sums, lanes_sum8x4(lo, hi));
        for (int r = 0; r < 4; ++r) out[r * ld] = sums[r];
        return;
    }
    for (int r = 0; r < MR; ++r) out[r * ld] = lanes_sum8(acc[r][0], acc[r][1]);
}

/* A block of mr x nr (1..LIN_MR, 1..LIN_NR) as nr tiles of mr x 1. */
static void linear_block(const linear_job *job, int m0, int mr, int n0, int nr) {
#define LIN8_TILES(F32)                                                                              \
    for (int n = n0; n < n0 + nr; ++n) switch (mr) {                                                 \
        case 1: linear_tile8(job, m0, n, 1, F32); break;                                             \
        case 2: linear_tile8(job, m0, n, 2, F32); break;                                             \
        case 3: linear_tile8(job, m0, n, 3, F32); break;                                             \
        default: linear_tile8(job, m0, n, 4, F32); break;                                            \
        }
    if (job->f32) {
        LIN8_TILES(1)
    } else {
        LIN8_TILES(0)
    }
#undef LIN8_TILES
}
