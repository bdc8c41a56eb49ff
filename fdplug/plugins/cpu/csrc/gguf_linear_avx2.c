/* ---------------------------------------------------------------------------------------------
 * gguf_linear.c's vectors in AVX2 + FMA (x86-64-v3: AMD Zen 2/3, Intel before AVX-512), with the
 * AVX-512 tiles' bits: each of their two 16-lane chains per output is two ymm here (lanes 0-7 and
 * 8-15), the same FMAs in the same order, and the final sum pairs the lanes as lanes_sum does
 * (linear_avx2.c's lanes_sum8): a token's logits are the same on either kind of machine. The tiles
 * are gguf_tiles.c's.
 *
 * 16 ymm registers and 4 accumulators an output: 3 rows a tile (12 accumulators, a weight vector
 * being widened, an input vector); a block is decoded once per 3 rows. The panel route, where the
 * weights are already floats, runs the four chains one after the other (GG_CHAIN_PANEL: gguf_tiles.c's
 * gg_chain_tile), so a tile holds 3 rows x 4 columns: it loaded 16 vectors for 12 FMAs and ran at
 * ~105-130 GFLOP/s from 64 rows, now 7 and 160-185 (2 threads; AMD EPYC, avx512, capped to AVX2).
 * ------------------------------------------------------------------------------------------- */

#define GG_V __m256
#define GG_VL 8
#define GG_NV 4
#ifndef GG_MR     /* (overridable, to measure other shapes) */
#define GG_MR 3
#define GG_PMR 3
#endif
#define GG_CHAIN_PANEL 1  /* the panel route a chain at a time: 3 rows x 4 columns a tile */
#ifndef GG_CHAIN_NC
#define GG_CHAIN_NC 4
#endif

static inline __m256 gg_vload(const float *p) { return _mm256_loadu_ps(p); }
static inline void gg_vstore(float *p, __m256 v) { _mm256_storeu_ps(p, v); }
static inline __m256 gg_vzero(void) { return _mm256_setzero_ps(); }
static inline __m256 gg_vfma(__m256 a, __m256 b, __m256 c) { return _mm256_fmadd_ps(a, b, c); }
/* 8 float16 (or bfloat16) values at p, widened exactly */
static inline __m256 gg_vload_half(const uint8_t *p, int bf16) {
    const __m128i h = _mm_loadu_si128((const __m128i *)p);
    return bf16 ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)) : _mm256_cvtph_ps(h);
}

/* w[2h], w[2h + 1]: half h's 16 integers as 8 + 8 floats, q * d + o */
static inline __attribute__((always_inline)) void gg_widen(const gg_pair *q, const int SIGNED, __m256 w[4]) {
    for (int h = 0; h < 2; ++h) {
        const __m128i upper = _mm_unpackhi_epi64(q->q[h], q->q[h]);
        const __m256i a = SIGNED ? _mm256_cvtepi8_epi32(q->q[h]) : _mm256_cvtepu8_epi32(q->q[h]);
        const __m256i b = SIGNED ? _mm256_cvtepi8_epi32(upper) : _mm256_cvtepu8_epi32(upper);
        const __m256 d = _mm256_set1_ps(q->d[h]), o = _mm256_set1_ps(q->o[h]);
        w[2 * h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a), d, o);
        w[2 * h + 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(b), d, o);
    }
}

/* A Q4_0/Q4_1 block's 32 weights straight from its bytes (gguf_linear_avx512.c's gg_widen_q4): bytes 0-7
 * widened give elements 0-7 (low nibbles) and 16-23 (high), bytes 8-15 elements 8-15 and 24-31. */
static inline __attribute__((always_inline)) void gg_widen_q4(const uint8_t *blk, const int QT, __m256 w[4]) {
    const __m128 dm = gg_f16x2(blk);
    const float d = _mm_cvtss_f32(dm), o = QT == GG_Q4_0 ? -8.0f * d : _mm_cvtss_f32(_mm_movehdup_ps(dm));
    const uint8_t *qs = blk + (QT == GG_Q4_0 ? 2 : 4);
    const __m256 dv = _mm256_set1_ps(d), ov = _mm256_set1_ps(o);
    for (int v = 0; v < 2; ++v) {
        const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qs + 8 * v)));
        w[v] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(bytes, _mm256_set1_epi32(0x0F))), dv, ov);
        w[2 + v] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4)), dv, ov);
    }
}

/* acc[v]: lanes 8v .. 8v + 7 of the AVX-512 tile's [chain 0 | chain 1] */
static inline float gg_finish(const __m256 acc[4]) {
    return lanes_sum8(_mm256_add_ps(acc[0], acc[2]), _mm256_add_ps(acc[1], acc[3]));
}

#include "gguf_tiles.c"
