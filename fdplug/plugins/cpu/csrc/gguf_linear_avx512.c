/* ---------------------------------------------------------------------------------------------
 * gguf_linear.c's vectors in AVX-512: each 32 weights (gguf_bytes.c's pair) widened into two
 * 16-float vectors. Output (m, n) is two FMA chains, the first and second 16 of each 32 weights
 * (two: one chain would wait on the FMA's latency in decode), over k in order, then added lane by
 * lane and summed across lanes (linear.c's lanes_sum). The tiles are gguf_tiles.c's.
 * ------------------------------------------------------------------------------------------- */

#define GG_V __m512
#define GG_VL 16
#define GG_NV 2
#ifndef GG_MR     /* (overridable, to measure other shapes) */
#define GG_MR 8   /* register route: 16 accumulators + 2 weight vectors */
#define GG_PMR 8  /* panel route: the same, on floats */
#endif

static inline __m512 gg_vload(const float *p) { return _mm512_loadu_ps(p); }
static inline void gg_vstore(float *p, __m512 v) { _mm512_storeu_ps(p, v); }
static inline __m512 gg_vzero(void) { return _mm512_setzero_ps(); }
static inline __m512 gg_vfma(__m512 a, __m512 b, __m512 c) { return _mm512_fmadd_ps(a, b, c); }
/* 16 float16 (or bfloat16) values at p, widened exactly */
static inline __m512 gg_vload_half(const uint8_t *p, int bf16) {
    const __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)) : _mm512_cvtph_ps(h);
}

static inline __attribute__((always_inline)) void gg_widen(const gg_pair *q, const int SIGNED, __m512 w[2]) {
    for (int h = 0; h < 2; ++h) {
        const __m512i i = SIGNED ? _mm512_cvtepi8_epi32(q->q[h]) : _mm512_cvtepu8_epi32(q->q[h]);
        w[h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), _mm512_set1_ps(q->d[h]), _mm512_set1_ps(q->o[h]));
    }
}

/* A Q4_0/Q4_1 block's 32 weights straight from its bytes: element i < 16 is byte i's low nibble, i + 16
 * its high one, so one widening load of the 16 bytes gives both halves (gg_pair_of + gg_widen's values). */
static inline __attribute__((always_inline)) void gg_widen_q4(const uint8_t *blk, const int QT, __m512 w[2]) {
    const __m128 dm = gg_f16x2(blk);
    const float d = _mm_cvtss_f32(dm), o = QT == GG_Q4_0 ? -8.0f * d : _mm_cvtss_f32(_mm_movehdup_ps(dm));
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + (QT == GG_Q4_0 ? 2 : 4))));
    const __m512i q[2] = {_mm512_and_si512(bytes, _mm512_set1_epi32(0x0F)), _mm512_srli_epi32(bytes, 4)};
    for (int h = 0; h < 2; ++h) w[h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q[h]), _mm512_set1_ps(d), _mm512_set1_ps(o));
}

static inline float gg_finish(const __m512 acc[2]) { return lanes_sum(_mm512_add_ps(acc[0], acc[1])); }

#include "gguf_tiles.c"
