/* ---------------------------------------------------------------------------------------------
 * gguf_linear.c in q8 math: x quantized to 8-bit integers with a scale per run of 4 values, and
 * each 32 weights' products with it summed as integers, as llama.cpp computes (its runs are 32).
 *
 * Why: a decode step reads each weight once, so the float32 tiles spend most of their time widening
 * 4-bit blocks into floats (4-5 vector ops per 8 weights before the FMA). Here a block's integers
 * stay bytes and one vpmaddubsw (or vpdpbusd) multiplies 32 of them by 32 quantized inputs: 1.4-1.9x
 * the float32 tiles at 1-8 rows at AVX2 (bench/gguf_linear.py; AMD EPYC, avx512, capped to AVX2). With AVX-512
 * two pieces go through one 512-bit register (GG_Q8_PAIR: per lane the same operations, the same
 * bits): 1.2-1.5x the bf16 tiles at one row, 0.55-0.7x from 64 rows (AMD EPYC, avx512).
 *
 * Values: each run of 4 inputs, x[r, 4i .. 4i + 3], becomes d = amax / 127 and
 * xq = round(x * (1 / d)) in [-127, 127] (nearest even; zeros where amax is 0). A run is exactly one
 * lane of the integer sums (vpmaddwd / vpdpbusd add 4 byte products a lane), so its scale costs the
 * tiles nothing more than a run of 32's: the per-lane scale vector is loaded either way. Measured on
 * SmolLM2-135M (fixed text, tests/test_smollm2.py): perplexity +0.09% over float32 math with runs
 * of 4 (bf16 math: +0.11%), +0.87% with 16, +1.06% with 32 (llama.cpp's q8_0 size; llama.cpp itself
 * +0.38-0.77% on this file). A piece of 32 weights, q * d_w + o (gguf_bytes.c's gg_pair; Q4_0 and
 * Q5_0 with o = -8 d_w and -16 d_w; Q6_K as signed q - 32, with o = 0, its two int8 sub-block scales
 * as vpmaddwd's pair weights and its super-block d as d_w), against its 8 runs gives
 *     sum over lanes l of d_w * d_l * (lane l's integer sum) + o * sx,   sx = sum over l of d_l * sum(xq of run l)
 * the integer sums exact (vpmaddubsw's int16 pair sums cannot saturate: |q| <= 128, |xq| <= 127, and
 * q <= 63 where unsigned). Output (m, n) is two float chains, pieces alternating (piece p into chain
 * p & 1): an 8-lane vector chain of the scaled integer sums and a chain of the o * sx terms (a
 * scalar, or from GG_Q8_VEC_MINS rows a tile one lane of a vector: the same FMAs), added at the end in
 * one fixed order. Every row count, tile, route (registers or panel), thread count and level (AVX2,
 * AVX-512) gives the same bits: a token's logits do not depend on its batch.
 *
 * Included by gguf_linear.c where the build has AVX2 (gguf_bytes.c's decoders, gg_job).
 * ------------------------------------------------------------------------------------------- */

#define GG_HAVE_Q8 1
#define GG_CAP(MR, MAX) ((MR) < (MAX) ? (MR) : (MAX))
#ifndef GG_QMR
#define GG_QMR 8 /* rows a tile at most */
#endif
/* Rows a tile for QT (a tile's result does not depend on it): 8, or 6 for the 32-weight types with a
 * min or an offset but Q5_1 (Q4_0, Q4_1, Q5_0) and Q4_K. Measured at
 * 8 and 64 rows against 4 and the other (AVX2, 2 threads): 8 rows 1.05-1.2x 6 for Q4_0, Q5_0, Q5_1,
 * Q6_K; 6 rows 1.05-1.1x 8 for Q4_1, Q4_K, Q5_K while their o * sx chains were scalars; since those
 * run as one vector (GG_Q8_VEC_MINS), 8 rows 0.89-1.12x 6 for Q4_1 and Q4_K, 1.02-1.24x for Q5_K
 * (8-256 rows). 4 rows 0.85-1.0x the better one throughout. Q4_0 and Q5_0 since their offsets joined
 * the o * sx chain: 6 rows 1.1-1.4x 8 at 64-256 rows, 0.8-1.2x at 8 (the same day's drift). */
#define GG_Q8_MR(QT) \
    ((QT) == GG_Q4_0 || (QT) == GG_Q4_1 || (QT) == GG_Q5_0 || (QT) == GG_Q4_K ? GG_CAP(6, GG_QMR) : GG_QMR)

/* The 8 lanes' sum in a fixed pairing (4 + 4, 2 + 2, 1 + 1), the same at every level */
static inline float gg_q8_hsum(__m256 v) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    return _mm_cvtss_f32(_mm_add_ss(a, _mm_movehdup_ps(a)));
}

/* x [values / depth rows, depth] -> q (int8); for each piece of 32 values, scale: its 8 runs' d (a
 * run of 4 values is one lane of the piece's integer sums), and sx: sum over the runs of d * sum(q
 * of the run), in gg_q8_hsum's order; values a multiple of 32 */
static void gg_quantize_rows_q8(const float *x, int8_t *q, float *scale, float *sx, int64_t values) {
    const __m256 sign = _mm256_set1_ps(-0.0f), zero = _mm256_setzero_ps();
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t p = 0; p < values / 32; ++p) {
        __m256i i32[4];
        __m256 d[4];
        for (int i = 0; i < 4; ++i) {   /* runs 2i (lanes 0-3) and 2i + 1 (lanes 4-7) */
            const __m256 v = _mm256_loadu_ps(x + 32 * p + 8 * i), a = _mm256_andnot_ps(sign, v);
            __m256 m = _mm256_max_ps(a, _mm256_permute_ps(a, _MM_SHUFFLE(2, 3, 0, 1)));
            m = _mm256_max_ps(m, _mm256_permute_ps(m, _MM_SHUFFLE(1, 0, 3, 2)));   /* each lane: its run's amax */
            d[i] = _mm256_div_ps(m, _mm256_set1_ps(127.0f));
            const __m256 id = _mm256_and_ps(_mm256_div_ps(_mm256_set1_ps(1.0f), d[i]), _mm256_cmp_ps(d[i], zero, _CMP_NEQ_OQ));
            i32[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v, id));   /* nearest even */
        }
        const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(i32[0], i32[1]), _mm256_packs_epi32(i32[2], i32[3]));
        _mm256_storeu_si256((__m256i *)(q + 32 * p), _mm256_permutevar8x32_epi32(bytes, order));
        /* d[i] lanes 0 and 4 are runs 2i and 2i + 1: [d0 d2 d4 d6 | d1 d3 d5 d7] in order */
        const __m256 runs = _mm256_permutevar8x32_ps(
            _mm256_shuffle_ps(_mm256_shuffle_ps(d[0], d[1], _MM_SHUFFLE(0, 0, 0, 0)),
                              _mm256_shuffle_ps(d[2], d[3], _MM_SHUFFLE(0, 0, 0, 0)), _MM_SHUFFLE(2, 0, 2, 0)),
            order);
        _mm256_storeu_ps(scale + 8 * p, runs);
        const __m256i sums = _mm256_permutevar8x32_epi32(
            _mm256_hadd_epi32(_mm256_hadd_epi32(i32[0], i32[1]), _mm256_hadd_epi32(i32[2], i32[3])), order);
        sx[p] = gg_q8_hsum(_mm256_mul_ps(runs, _mm256_cvtepi32_ps(sums)));
    }
}

/* acc + the 8 int32 lanes of 32 byte products u[i] * s[i] (u unsigned, s signed), lane l the sum
 * of bytes 4l .. 4l + 3: one vpdpbusd where the build has VNNI (GG_DOT4_VNNI), else vpmaddubsw,
 * vpmaddwd by ones and vpaddd. The same integers either way where vpmaddubsw's int16 pair sums
 * cannot saturate (its callers' bytes: gg_q8_tile, gguf_packed_tiles.c). */
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
#define GG_DOT4_VNNI 1
#endif
static inline __m256i gg_dot4_add(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}
static inline __m256i gg_dot4(__m256i u, __m256i s) {
#ifdef GG_DOT4_VNNI
    return gg_dot4_add(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

/* Q6_K's vpmaddwd pair weights for piece j of the super-block at blk: its two halves' int8 scales */
static inline __m256i gg_q6_weights(const uint8_t *blk, int j) {
    return _mm256_set_m128i(_mm_set1_epi16((int8_t)blk[192 + 2 * j + 1]), _mm_set1_epi16((int8_t)blk[192 + 2 * j]));
}

/* Q6_K's weights are d * (q - 32) with an int8 scale per half of 16: its bytes go signed, q - 32 */
#define GG_Q8_OFFSET(QT) ((QT) == GG_Q6_K ? 32 : 0)
/* Q4_0's and Q5_0's are d * (q - offset) = d * q + o with o = -offset * d: their bytes stay unsigned, as
 * Q4_1's, and the offset joins the o * sx chain (o exact: the offset a power of two). Against signed
 * bytes (q - offset, no o * sx term) each row's vpsignb and each piece's vpsubb and vpabsb go: with
 * 6 rows a tile (GG_Q8_MR), Q5_0 1.1-1.5x and Q4_0 1.1-1.3x at 64-256 rows, ~1.1x at one row (AMD
 * EPYC family 25 (Zen 4), avx512, capped to AVX2, 2 threads, SmolLM2's shapes, 4 interleaved rounds;
 * this machine drifted +-20% that day). Q5_0 is most of a Q4_K_M file of a model whose rows are no
 * multiple of 256 (SmolLM2's). */
#define GG_Q8_MIN_OFFSET(QT) ((QT) == GG_Q4_0 ? 8.0f : (QT) == GG_Q5_0 ? 16.0f : 0.0f)
#define GG_Q8_SIGNED(QT) ((QT) == GG_Q8_0 || GG_Q8_OFFSET(QT))

/* Piece j of the block at blk as the tiles multiply it: its bytes (Q6_K's signed, q - 32, so no o * sx
 * term), d_w and o; Q6_K's d_w is the super-block's d (q6_d), its halves' int8 scales go to the pair
 * weights instead */
static inline __attribute__((always_inline)) __m256i gg_q8_piece(const uint8_t *blk, const int j, const int QT,
                                                                 const gg_scales *s, float q6_d, float *dw,
                                                                 float *wo) {
    __m256i wsign = gg_piece_bytes(blk, j, QT, s, dw, wo);
    if (GG_Q8_OFFSET(QT)) wsign = _mm256_sub_epi8(wsign, _mm256_set1_epi8(GG_Q8_OFFSET(QT)));
    if (GG_Q8_MIN_OFFSET(QT)) *wo = -GG_Q8_MIN_OFFSET(QT) * *dw;
    if (QT == GG_Q6_K) *dw = q6_d;
    return wsign;
}

/* From this many rows a tile, its rows' o * sx chains (the types with a min) run as the lanes of one
 * vector (sxt: the rows' sx piece by piece, gg_q8_transpose_sx): per lane the FMA each row's scalar
 * chain does, so the same bits, in one instruction instead of MR: 1.14-1.34x for Q4_1, 1.07-1.30x
 * for Q4_K and 1.17-1.41x for Q5_1 at 4-256 rows (AMD EPYC, avx512, capped to AVX2, 2 threads, 2
 * interleaved rounds). Below, each row's scalar chain (at one row reading the lane back cost ~20%). */
#define GG_Q8_VEC_MINS 4
/* acc[r][C] and row r's o * sx chain C (C: the chain, a compile-time constant) += the piece p whose
 * bytes are wsign (gg_q8_piece's), pair weights `weights`, d_w dw and o wo, against each row's
 * quantized x */
#define GG_Q8_MULS(wsign, weights, dw, wo, p, C)                                                     \
    do {                                                                                             \
        const int SIGNED = GG_Q8_SIGNED(QT);                                                         \
        const __m256i wq = SIGNED ? _mm256_abs_epi8(wsign) : (wsign); /* |q| * (xq with q's sign) */ \
        GG_UNROLL                                                                                    \
        for (int r = 0; r < MR; ++r) {                                                               \
            __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + (int64_t)r * depth + 32 * (p)));   \
            if (SIGNED) xv = _mm256_sign_epi8(xv, wsign);                                            \
            const __m256i sums = QT == GG_Q6_K ? _mm256_madd_epi16(_mm256_maddubs_epi16(wq, xv), weights) \
                                               : gg_dot4(wq, xv);                                    \
            const __m256 scale = _mm256_mul_ps(_mm256_set1_ps(dw), _mm256_loadu_ps(dx + ((int64_t)r * pieces + (p)) * 8)); \
            acc[r][C] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scale, acc[r][C]);                 \
            if (!SIGNED && MR < GG_Q8_VEC_MINS) mins1[r][C] = fmaf(wo, sx[(int64_t)r * pieces + (p)], mins1[r][C]); \
        }                                                                                            \
        if (!SIGNED && MR >= GG_Q8_VEC_MINS)                                                         \
            mins[C] = _mm256_fmadd_ps(_mm256_set1_ps(wo), _mm256_loadu_ps(sxt + 8 * (p)), mins[C]);   \
    } while (0)

/* GG_Q8_MULS of piece p (weights [32j, 32j + 32) of the block at blk), decoded here */
#define GG_Q8_PIECE(blk, j, p, C)                                                                    \
    do {                                                                                             \
        float dw_, wo_;                                                                              \
        const __m256i wsign_ = gg_q8_piece(blk, j, QT, &s, q6_d, &dw_, &wo_);                       \
        const __m256i weights_ = QT == GG_Q6_K ? gg_q6_weights(blk, j) : _mm256_set1_epi16(1);       \
        GG_Q8_MULS(wsign_, weights_, dw_, wo_, p, C);                                                \
    } while (0)

#if defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define GG_Q8_512 1
/* gg_dot4_add and gg_dot4 on 64 bytes: lanes 0-7 the first 32 bytes', 8-15 the second's */
static inline __m512i gg_dot4_add_512(__m512i acc, __m512i u, __m512i s) {
#ifdef __AVX512VNNI__
    return _mm512_dpbusd_epi32(acc, u, s);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1)));
#endif
}
static inline __m512i gg_dot4_512(__m512i u, __m512i s) {
#ifdef __AVX512VNNI__
    return gg_dot4_add_512(_mm512_setzero_si512(), u, s);
#else
    return _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1));
#endif
}

/* GG_Q8_PIECE for pieces p (chain 0: lanes 0-7 of wide[r]) and p + 1 (chain 1: lanes 8-15) at once
 * in 512-bit registers (AVX-512): per lane the same integer sums, products and FMAs as the two
 * 256-bit steps, so the same bits. Weights [32 j0, ...) of blk0 and [32 j1, ...) of blk1. */
#define GG_Q8_PAIR(blk0, j0, blk1, j1, p)                                                             \
    do {                                                                                             \
        float d0, o0, d1, o1;                                                                        \
        const __m256i w0 = gg_q8_piece(blk0, j0, QT, &s, q6_d, &d0, &o0); /* (its offsets applied) */  \
        const __m256i w1 = gg_q8_piece(blk1, j1, QT, &s, q6_d, &d1, &o1);                             \
        const __m512i wsign = _mm512_inserti64x4(_mm512_castsi256_si512(w0), w1, 1);                  \
        const __m512i weights = QT == GG_Q6_K ? _mm512_inserti64x4(_mm512_castsi256_si512(gg_q6_weights(blk0, j0)), \
                                                                   gg_q6_weights(blk1, j1), 1)        \
                                              : _mm512_set1_epi16(1);                                 \
        const int SIGNED = GG_Q8_SIGNED(QT);                                                         \
        const __m512i wq = SIGNED ? _mm512_abs_epi8(wsign) : wsign;                                  \
        const __mmask64 negative = SIGNED ? _mm512_movepi8_mask(wsign) : 0;                          \
        const __m512 dw = _mm512_insertf32x8(_mm512_set1_ps(d0), _mm256_set1_ps(d1), 1);             \
        GG_UNROLL                                                                                    \
        for (int r = 0; r < MR; ++r) {                                                               \
            __m512i xv = _mm512_loadu_si512((const void *)(xq + (int64_t)r * depth + 32 * (p)));     \
            if (SIGNED) xv = _mm512_mask_sub_epi8(xv, negative, _mm512_setzero_si512(), xv);         \
            const __m512i sums = QT == GG_Q6_K ? _mm512_madd_epi16(_mm512_maddubs_epi16(wq, xv), weights) \
                                               : gg_dot4_512(wq, xv);                                \
            const __m512 scale = _mm512_mul_ps(dw, _mm512_loadu_ps(dx + ((int64_t)r * pieces + (p)) * 8)); \
            wide[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), scale, wide[r]);                     \
            if (!SIGNED && MR < GG_Q8_VEC_MINS) {                                                    \
                mins1[r][0] = fmaf(o0, sx[(int64_t)r * pieces + (p)], mins1[r][0]);                  \
                mins1[r][1] = fmaf(o1, sx[(int64_t)r * pieces + (p) + 1], mins1[r][1]);              \
            }                                                                                        \
        }                                                                                            \
        if (!SIGNED && MR >= GG_Q8_VEC_MINS) {                                                       \
            mins[0] = _mm256_fmadd_ps(_mm256_set1_ps(o0), _mm256_loadu_ps(sxt + 8 * (p)), mins[0]);   \
            mins[1] = _mm256_fmadd_ps(_mm256_set1_ps(o1), _mm256_loadu_ps(sxt + 8 * ((p) + 1)), mins[1]); \
        }                                                                                            \
    } while (0)
#endif

/* Row r's o * sx terms: its two chains added, from the lanes of mins (from GG_Q8_VEC_MINS rows) or
 * its scalars */
static inline __attribute__((always_inline)) float gg_q8_min_sum(const __m256 mins[2], const float mins1[][2],
                                                                 const int MR, int r) {
    if (MR < GG_Q8_VEC_MINS) return mins1[r][0] + mins1[r][1];
    float m0[8], m1[8];
    _mm256_storeu_ps(m0, mins[0]);
    _mm256_storeu_ps(m1, mins[1]);
    return m0[r] + m1[r];
}

/* Rows m0 .. m0 + MR - 1 of output column n, its blocks of QT at src; sxt: the rows' sx, piece by
 * piece (gg_q8_transpose_sx; the types with a min, from GG_Q8_VEC_MINS rows) */
static inline __attribute__((always_inline)) void gg_q8_tile(const gg_job *job, const uint8_t *src, const int QT,
                                                             int m0, const int MR, int n, const float *sxt) {
    const int depth = job->depth, pieces = depth / 32;
    const int64_t bytes = GG_BYTES(QT);
    const int8_t *xq = job->xq + (int64_t)m0 * depth;
    const float *dx = job->dx + (int64_t)m0 * 8 * pieces, *sx = job->sx + (int64_t)m0 * pieces;
    __m256 acc[GG_QMR][2], mins[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    float mins1[GG_Q8_VEC_MINS][2] = {{0.0f, 0.0f}};
    for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    gg_scales s;   /* the K-quants' (gg_k_scales_sse); Q6_K's decoder reads d values it then replaces: zeros */
    if (QT == GG_Q6_K) memset(&s, 0, sizeof s);
#ifdef GG_Q8_512
    __m512 wide[GG_QMR];             /* [chain 0 | chain 1] */
    for (int r = 0; r < MR; ++r) wide[r] = _mm512_setzero_ps();
#endif
    if (GG_QK(QT) == 256) {         /* 8 pieces a block: chains 0, 1, 0, 1, ... */
        for (int b = 0; b < pieces / 8; ++b) {
            const uint8_t *blk = src + b * bytes;
            const float q6_d = QT == GG_Q6_K ? gg_f16(blk + 208) : 0.0f;
            if (QT != GG_Q6_K) gg_k_scales_sse(blk, QT, &s);
#pragma GCC unroll 4
            for (int j = 0; j < 8; j += 2) {
#ifdef GG_Q8_512
                GG_Q8_PAIR(blk, j, blk, j + 1, 8 * b + j);
#else
                GG_Q8_PIECE(blk, j, 8 * b + j, 0);
                GG_Q8_PIECE(blk, j + 1, 8 * b + j + 1, 1);
#endif
            }
        }
    } else {                        /* a piece a block: blocks b (chain 0) and b + 1 (chain 1) */
        const float q6_d = 0.0f;
        for (int b = 0; b + 1 < pieces; b += 2) {
#ifdef GG_Q8_512
            GG_Q8_PAIR(src + b * bytes, 0, src + (b + 1) * bytes, 0, b);
#else
            GG_Q8_PIECE(src + b * bytes, 0, b, 0);
            GG_Q8_PIECE(src + (b + 1) * bytes, 0, b + 1, 1);
#endif
        }
    }
#ifdef GG_Q8_512
    for (int r = 0; r < MR; ++r) {
        acc[r][0] = _mm512_castps512_ps256(wide[r]);
        acc[r][1] = _mm512_extractf32x8_ps(wide[r], 1);
    }
#endif
    if (GG_QK(QT) == 32 && pieces % 2) {   /* an odd last piece: chain 0 */
        const float q6_d = 0.0f;
        GG_Q8_PIECE(src + (pieces - 1) * bytes, 0, pieces - 1, 0);
    }
    for (int r = 0; r < MR; ++r)
        job->out[(int64_t)(m0 + r) * job->ld + n] =
            gg_q8_hsum(_mm256_add_ps(acc[r][0], acc[r][1])) + gg_q8_min_sum(mins, mins1, MR, r);
}
#undef GG_Q8_PIECE
#ifdef GG_Q8_512
#undef GG_Q8_PAIR
#endif

#define GG_COLS(QT, MR) \
    for (int n = begin; n < end; ++n) gg_q8_tile(job, src + (n - begin) * stride, QT, m0, MR, n, sxt)
#define GG_Q8_ROWS(QT) GG_SWITCH_ROWS(mr, GG_Q8_MR(QT), QT);
/* BODY(QT) for the integer types q8 math takes (gguf_tiles.c's GG_SWITCH_TYPE less F16 and BF16) */
#define GG_Q8_SWITCH_TYPE(qtype, BODY)                                                              \
    switch (qtype) {                                                                                \
    GG_INTEGER_CASES(BODY)                                                                          \
    default: BODY(GG_Q6_K) break;                                                                   \
    }

/* sxt [pieces][8] = the sx of rows m0 .. m0 + mr - 1, piece by piece (lanes past mr: 0) */
static void gg_q8_transpose_sx(const gg_job *job, int m0, int mr, float *sxt) {
    const int pieces = job->depth / 32;
    for (int p = 0; p < pieces; ++p)
        for (int r = 0; r < 8; ++r) sxt[8 * p + r] = r < mr ? job->sx[(int64_t)(m0 + r) * pieces + p] : 0.0f;
}
/* GG_Q8_MR of a run-time type */
#define GG_Q8_RETURN_MR(QT) return GG_Q8_MR(QT);
static int gg_q8_rows(int qtype) { GG_Q8_SWITCH_TYPE(qtype, GG_Q8_RETURN_MR) }
#undef GG_Q8_RETURN_MR

/* Rows m0 .. m0 + mr - 1 (mr <= gg_q8_rows(qtype)) of columns [begin, end) in q8 math, column n's blocks at
 * src + (n - begin) * stride (F16/BF16 rows are not taken: gg_linear refuses them in q8 math) */
static void gg_q8_columns(const gg_job *job, const uint8_t *src, int64_t stride, int qtype, int m0, int mr, int begin,
                          int end) {
    const int transposed = !GG_Q8_SIGNED(qtype) && mr >= GG_Q8_VEC_MINS;   /* (the types with a min: o * sx) */
    float sxt[transposed ? 8 * (job->depth / 32) : 8];
    if (transposed) gg_q8_transpose_sx(job, m0, mr, sxt);
    GG_Q8_SWITCH_TYPE(qtype, GG_Q8_ROWS)
}
#undef GG_COLS

#include "gguf_q8_panel.c"
#undef GG_Q8_SWITCH_TYPE
#undef GG_Q8_ROWS
#undef GG_CAP
