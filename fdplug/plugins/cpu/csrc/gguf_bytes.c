/* ---------------------------------------------------------------------------------------------
 * GGML blocks to integers, 32 weights at a time (gguf_linear.c): the byte work that the AVX-512 and
 * the AVX2 tiles share, in 128-bit SSE4.1/SSSE3 (both levels have it; 16 weights a register is what
 * one 512-bit or two 256-bit float vectors hold once widened).
 *
 * gg_pair_of(b, j, QT) gives weights [32j, 32j + 32) of block b (j = 0 but in a K-quant's super-block,
 * whose factors gg_k_scales_sse has put in s) as two halves of 16 integers q
 * (bytes: signed for Q8_0, else unsigned) and, per half, d and o such that the weight is
 * q * d + o exactly as ggml computes it: Q8_0 d * q; Q4_0 (q - 8) * d = q * d - 8d, Q5_0's
 * (q - 16) * d and Q6_K's (d * sc) * (q - 32) likewise (exact: representable products, one FMA
 * rounding nothing); Q4_1, Q5_1 q * d + m; Q4_K, Q5_K d1 * q - m1. The layouts are gguf_blocks.py's (its docstrings say where each bit lives).
 * ------------------------------------------------------------------------------------------- */

typedef struct {
    __m128i q[2];   /* weights 0-15 and 16-31 of the pair */
    float d[2], o[2];
} gg_pair;

static inline int gg_signed(int qtype) { return qtype == GG_Q8_0; }

static inline __m128i gg_load16(const uint8_t *p) { return _mm_loadu_si128((const __m128i *)p); }

/* byte i of the result: 16 where bit i of ``bits`` is set, else 0 (Q5_0/Q5_1's fifth bits, all 32) */
static inline __m256i gg_bits256(uint32_t bits) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    return _mm256_maskz_mov_epi8((__mmask32)bits, _mm256_set1_epi8(16)); /* the mask register does the spreading */
#else
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits),
                                               _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                                                2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
    const __m256i select = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, select), select), _mm256_set1_epi8(16));
#endif
}

/* gg_bits256's two halves: bytes for bits 0-15 and 16-31 */
static inline void gg_bits32(uint32_t bits, __m128i *low, __m128i *high) {
    const __m256i r = gg_bits256(bits);
    *low = _mm256_castsi256_si128(r);
    *high = _mm256_extracti128_si256(r, 1);
}

/* the low (shift 0) or high (shift 4) nibbles of 16 bytes */
static inline __m128i gg_nibbles(__m128i v, int shift) {
    return _mm_and_si128(_mm_srl_epi16(v, _mm_cvtsi32_si128(shift)), _mm_set1_epi8(0x0F));
}

/* The float16 pair at b (d and m of Q4_1/Q5_1) in one conversion: [d, m] in the low two lanes. */
static inline __m128 gg_f16x2(const uint8_t *b) {
    uint32_t both;
    memcpy(&both, b, sizeof both);
    return _mm_cvtph_ps(_mm_cvtsi32_si128((int)both));
}

static inline void gg_same_scale(gg_pair *r, float d, float o) {
    r->d[0] = r->d[1] = d;
    r->o[0] = r->o[1] = o;
}

/* gg_k_scales 4 fields at a time: the same products (gcc left gg_k_scales' loops scalar, 4 ops a
 * field, a quarter of Q4_K's instructions in decode) */
static inline void gg_k_scales_sse(const uint8_t *b, int qtype, gg_scales *s) {
    if (qtype == GG_Q6_K) {
        const __m128 d = _mm_set1_ps(gg_f16(b + 208));
        const __m128i sc = gg_load16(b + 192);
        _mm_storeu_ps(s->d, _mm_mul_ps(d, _mm_cvtepi32_ps(_mm_cvtepi8_epi32(sc))));
        _mm_storeu_ps(s->d + 4, _mm_mul_ps(d, _mm_cvtepi32_ps(_mm_cvtepi8_epi32(_mm_srli_si128(sc, 4)))));
        _mm_storeu_ps(s->d + 8, _mm_mul_ps(d, _mm_cvtepi32_ps(_mm_cvtepi8_epi32(_mm_srli_si128(sc, 8)))));
        _mm_storeu_ps(s->d + 12, _mm_mul_ps(d, _mm_cvtepi32_ps(_mm_cvtepi8_epi32(_mm_srli_si128(sc, 12)))));
        return;
    }
    uint32_t w[3];
    memcpy(w, b + 4, 12);   /* gg_k_scales' words: scales 0-3, 4-7, then mins 0-3, 4-7 */
    const __m128i v = _mm_setr_epi32((int)(w[0] & 0x3F3F3F3F), (int)((w[2] & 0x0F0F0F0F) | ((w[0] >> 2) & 0x30303030)),
                                     (int)(w[1] & 0x3F3F3F3F),
                                     (int)(((w[2] >> 4) & 0x0F0F0F0F) | ((w[1] >> 2) & 0x30303030)));
    const __m128 d = _mm_set1_ps(gg_f16(b)), dmin = _mm_set1_ps(gg_f16(b + 2));
    _mm_storeu_ps(s->d, _mm_mul_ps(d, _mm_cvtepi32_ps(_mm_cvtepu8_epi32(v))));
    _mm_storeu_ps(s->d + 4, _mm_mul_ps(d, _mm_cvtepi32_ps(_mm_cvtepu8_epi32(_mm_srli_si128(v, 4)))));
    _mm_storeu_ps(s->m, _mm_mul_ps(dmin, _mm_cvtepi32_ps(_mm_cvtepu8_epi32(_mm_srli_si128(v, 8)))));
    _mm_storeu_ps(s->m + 4, _mm_mul_ps(dmin, _mm_cvtepi32_ps(_mm_cvtepu8_epi32(_mm_srli_si128(v, 12)))));
}

static inline __attribute__((always_inline)) gg_pair gg_pair_of(const uint8_t *b, const int j, const int QT,
                                                                  const gg_scales *s) {
    gg_pair r;
    if (QT == GG_Q8_0) {
        r.q[0] = gg_load16(b + 2);
        r.q[1] = gg_load16(b + 18);
        gg_same_scale(&r, gg_f16(b), 0.0f);
    } else if (QT == GG_Q4_0 || QT == GG_Q4_1) {   /* element i: low nibble of byte i, i + 16: high */
        const __m128i v = gg_load16(b + (QT == GG_Q4_0 ? 2 : 4));
        r.q[0] = gg_nibbles(v, 0);
        r.q[1] = gg_nibbles(v, 4);
        const __m128 dm = gg_f16x2(b);   /* (Q4_0: m's lane holds quants, unused) */
        const float d = _mm_cvtss_f32(dm);
        gg_same_scale(&r, d, QT == GG_Q4_0 ? -8.0f * d : _mm_cvtss_f32(_mm_movehdup_ps(dm)));
    } else if (QT == GG_Q5_0 || QT == GG_Q5_1) {   /* plus bit i of the uint32 qh as bit 4 */
        const int at = QT == GG_Q5_0 ? 2 : 4;
        uint32_t qh;
        memcpy(&qh, b + at, sizeof qh);
        const __m128i v = gg_load16(b + at + 4);
        __m128i low, high;
        gg_bits32(qh, &low, &high);
        r.q[0] = _mm_or_si128(gg_nibbles(v, 0), low);
        r.q[1] = _mm_or_si128(gg_nibbles(v, 4), high);
        const __m128 dm = gg_f16x2(b);   /* (Q5_0: m's lane holds qh, unused) */
        const float d = _mm_cvtss_f32(dm);
        gg_same_scale(&r, d, QT == GG_Q5_0 ? -16.0f * d : _mm_cvtss_f32(_mm_movehdup_ps(dm)));
    } else if (QT == GG_Q4_K || QT == GG_Q5_K) {   /* sub-block j: nibble j % 2 of qs chunk j / 2 */
        const uint8_t *qs = b + (QT == GG_Q4_K ? 16 : 48) + 32 * (j / 2);
        r.q[0] = gg_nibbles(gg_load16(qs), 4 * (j % 2));
        r.q[1] = gg_nibbles(gg_load16(qs + 16), 4 * (j % 2));
        if (QT == GG_Q5_K) {   /* element l's fifth bit: bit j of qh byte l */
            const __m128i one = _mm_set1_epi8(1), shift = _mm_cvtsi32_si128(j);
            r.q[0] = _mm_or_si128(r.q[0], _mm_slli_epi16(_mm_and_si128(_mm_srl_epi16(gg_load16(b + 16), shift), one), 4));
            r.q[1] = _mm_or_si128(r.q[1], _mm_slli_epi16(_mm_and_si128(_mm_srl_epi16(gg_load16(b + 32), shift), one), 4));
        }
        gg_same_scale(&r, s->d[j], -s->m[j]);
    } else { /* GG_Q6_K: sub-block j (of 8 of 32) is group g = j % 4 of half h = j / 4 */
        const int h = j / 4, g = j % 4;
        const uint8_t *ql = b + 64 * h + 32 * (g % 2), *qh = b + 128 + 32 * h;
        for (int half = 0; half < 2; ++half) {   /* bits 2g, 2g + 1 of qh moved to 4, 5 */
            const __m128i raw = gg_load16(qh + 16 * half);
            const __m128i high = _mm_and_si128(g == 3 ? _mm_srli_epi16(raw, 2) : _mm_sll_epi16(raw, _mm_cvtsi32_si128(4 - 2 * g)),
                                               _mm_set1_epi8(0x30));
            r.q[half] = _mm_or_si128(gg_nibbles(gg_load16(ql + 16 * half), 4 * (g / 2)), high);
            r.d[half] = s->d[2 * j + half];
            r.o[half] = -32.0f * s->d[2 * j + half];   /* q * d - 32d = (q - 32) * d exactly: 24 bits */
        }
    }
    return r;
}

/* Piece j of the block at blk as 32 byte integers (gg_pair's q: elements 0-15, then 16-31), with
 * its d and o (gg_pair's d[0], o[0]; Q4_0 and Q5_0: o = 0, their offset left to the caller). The
 * 32-weight types are read in 256-bit steps here (the low and high nibbles of the 16 bytes side by
 * side, the fifth bits spread in one pass): at one row ~1.2-1.3x gg_pair_of's two 128-bit halves.
 * For the types whose halves share d and o (all but Q6_K). */
static inline __attribute__((always_inline)) __m256i gg_piece_bytes(const uint8_t *blk, const int j, const int QT,
                                                                   const gg_scales *s, float *d, float *o) {
    if (QT == GG_Q4_0 || QT == GG_Q4_1 || QT == GG_Q5_0 || QT == GG_Q5_1) {
        const int five = QT == GG_Q5_0 || QT == GG_Q5_1, has_min = QT == GG_Q4_1 || QT == GG_Q5_1;
        const int at = has_min ? 4 : 2;   /* qh (Q5), then qs */
        const __m128i v = _mm_loadu_si128((const __m128i *)(blk + at + 4 * five));
        __m256i q = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), _mm256_set1_epi8(0x0F));
        if (five) {
            uint32_t qh;
            memcpy(&qh, blk + at, sizeof qh);
            q = _mm256_or_si256(q, gg_bits256(qh));
        }
        const __m128 dm = gg_f16x2(blk);   /* (Q4_0, Q5_0: m's lane holds other bytes, unused) */
        *d = _mm_cvtss_f32(dm);
        *o = has_min ? _mm_cvtss_f32(_mm_movehdup_ps(dm)) : 0.0f;   /* Q4_0, Q5_0: an offset instead */
        return q;
    }
    const gg_pair w = gg_pair_of(blk, j, QT, s);
    *d = w.d[0];
    *o = w.o[0];
    return _mm256_set_m128i(w.q[1], w.q[0]);
}
