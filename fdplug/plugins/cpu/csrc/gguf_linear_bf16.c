/* ---------------------------------------------------------------------------------------------
 * gguf_linear.c in bf16 math (AVX512-BF16): out[m, n] = sum_k bf16(x[m, k]) * bf16(W[n, k]), W the
 * file's GGML blocks decoded as gguf_tiles.c decodes them (the exact float32 weight) and rounded to
 * bf16, x rounded to bf16 once a call, the products (exact in float32) summed in float32.
 *
 * Why: from a few rows up the GGUF linears are compute-bound (64 rows: 330-390 GFLOP/s of the
 * machine's ~530 in float32 FMAs, 2 cores of Zen 5), and vdpbf16ps does 32 multiply-adds where an
 * FMA does 16: prefill and batched decode (64 streams) run their linears up to ~2x faster. The
 * rounding costs far less than the file's own: a Q4 weight is 4 bits plus a float16 scale, and
 * bf16 keeps 8 significant bits of the decoded value; the activations keep 8 significant bits each,
 * where llama.cpp quantizes them to 8 bits per block of 32 (q8_0/q8_1/q8_K). The float32 kernel
 * (cpu_native_gguf_linear) stays one --op-kernel away.
 *
 * Exactness of the order: output (m, n) is two vdpbf16ps chains, pieces of 32 weights alternating
 * (piece p of the row into chain p & 1; each lane adds its two products in the instruction's
 * order), then the chains added lane by lane and summed across lanes (lanes_sum): the same for every
 * row count, tile, route (registers or panel) and thread count, so a token's result does not depend
 * on its batch. Two chains: a row alone (decode) would otherwise wait on the instruction's latency.
 * Denormal inputs and results flush to zero (the instruction's rule), far below the rounding.
 *
 * Included by gguf_linear.c after the AVX-512 tiles (gg_weights, gg_scales, lanes_sum).
 * ------------------------------------------------------------------------------------------- */

#define GG_HAVE_BF16 1
#define GG_BMR 8 /* rows a tile: 16 accumulators, 2 weight vectors */

/* bf16(q * d + o) of 32 integers q < 32 that share d and o: the 32 possible values widened and
 * rounded once into a table, each weight looked up in it (vpermw). The same FMA on the same q as
 * gg_widen, so the same bits, in fewer operations: 2 FMAs, a rounding, a widening of the bytes and
 * the lookup, where gg_widen converts each 16 integers twice before its FMA, then rounds. */
static inline __m512bh gg_lookup_bf16(__m256i q, float d, float o) {
    const __m512 low = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 high = _mm512_add_ps(low, _mm512_set1_ps(16.0f)), dv = _mm512_set1_ps(d), ov = _mm512_set1_ps(o);
    const __m512bh table = _mm512_cvtne2ps_pbh(_mm512_fmadd_ps(high, dv, ov), _mm512_fmadd_ps(low, dv, ov));
    return (__m512bh)_mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(q), (__m512i)table);
}

/* Weights [32j, 32j + 32) of the block at blk as bf16, rounded to nearest even (BF16 rows as they
 * are): Q5_0 and Q5_1 by gg_lookup_bf16 (one row: 1.14-1.16x widening; AMD EPYC, avx512, 2
 * threads), the others widened (the lookup ran 0.92-0.97x there for Q4_1 and Q4_K, whose widening
 * has no fifth bits to spread) */
static inline __attribute__((always_inline)) __m512bh gg_weights_bf16(const uint8_t *blk, const int j, const int QT,
                                                                      const gg_scales *s) {
    if (QT == GG_BF16) return (__m512bh)_mm512_loadu_si512((const void *)blk);
    if (QT == GG_Q5_0 || QT == GG_Q5_1) {
        float d, o;
        const __m256i q = gg_piece_bytes(blk, j, QT, s, &d, &o);
        if (QT == GG_Q5_0) o = -16.0f * d; /* gg_pair_of's o */
        return gg_lookup_bf16(q, d, o);
    }
    __m512 w[2];
    gg_weights(blk, j, QT, s, w);
    return _mm512_cvtne2ps_pbh(w[1], w[0]);
}

/* acc[r][c] += x[r, piece] . w for the rows of a tile, the pieces at xk (c: the piece's chain) */
#define GG_BF16_DOT(c, xk, w)                                                                         \
    for (int r = 0; r < MR; ++r)                                                                     \
        acc[r][c] = _mm512_dpbf16_ps(acc[r][c], (__m512bh)_mm512_loadu_si512((const void *)((xk) + (int64_t)r * depth)), w)

/* Rows m0 .. m0 + MR - 1 of output column n, its weights at src (a row of blocks of QT; the panel
 * route's rows are already bf16: QT == GG_BF16) */
static inline __attribute__((always_inline)) void gg_tile_bf16(const gg_job *job, const uint8_t *src, const int QT,
                                                               int m0, const int MR, int n) {
    const int depth = job->depth, qk = GG_QK(QT), blocks = depth / qk;
    const int64_t block_bytes = GG_BYTES(QT);
    const uint16_t *x = job->xb + (int64_t)m0 * depth;
    __m512 acc[GG_BMR][2];
    for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    gg_scales s;
    for (int b = 0; b < blocks; ++b) {
        const uint8_t *blk = src + b * block_bytes;
        if (qk == 256) {             /* 8 pieces a block: chains 0, 1, 0, 1, ... */
            gg_k_scales_sse(blk, QT, &s);
#pragma GCC unroll 4
            for (int j = 0; j < 8; j += 2) {
                const __m512bh w0 = gg_weights_bf16(blk, j, QT, &s), w1 = gg_weights_bf16(blk, j + 1, QT, &s);
                GG_BF16_DOT(0, x + b * 256 + 32 * j, w0);
                GG_BF16_DOT(1, x + b * 256 + 32 * j + 32, w1);
            }
        } else if (b + 1 < blocks) { /* a piece a block: blocks b (chain 0) and b + 1 (chain 1) */
            const __m512bh w0 = gg_weights_bf16(blk, 0, QT, &s), w1 = gg_weights_bf16(blk + block_bytes, 0, QT, &s);
            GG_BF16_DOT(0, x + b * 32, w0);
            GG_BF16_DOT(1, x + b * 32 + 32, w1);
            ++b;
        } else {                     /* an odd last piece: chain 0 */
            const __m512bh w0 = gg_weights_bf16(blk, 0, QT, &s);
            GG_BF16_DOT(0, x + b * 32, w0);
        }
    }
    for (int r = 0; r < MR; ++r)
        job->out[(int64_t)(m0 + r) * job->ld + n] = lanes_sum(_mm512_add_ps(acc[r][0], acc[r][1]));
}
#undef GG_BF16_DOT

/* A row of blocks as bf16: the panel route's widened weights (half the bytes of gg_dequant_row's) */
static void gg_dequant_row_bf16(const uint8_t *row, int qtype, int depth, uint16_t *out) {
#define GG_ROW(QT)                                                                                   \
    for (int b = 0; b < depth / GG_QK(QT); ++b) {                                                   \
        const uint8_t *blk = row + (int64_t)b * GG_BYTES(QT);                                        \
        if (GG_QK(QT) == 256) gg_k_scales_sse(blk, QT, &s);                                          \
        for (int j = 0; j < GG_QK(QT) / 32; ++j)                                                     \
            _mm512_storeu_si512((void *)(out + b * GG_QK(QT) + 32 * j), (__m512i)gg_weights_bf16(blk, j, QT, &s)); \
    }
    gg_scales s;
    GG_SWITCH_TYPE(qtype, GG_ROW)
#undef GG_ROW
}

#define GG_COLS(QT, MR) \
    for (int n = begin; n < end; ++n) gg_tile_bf16(job, src + (n - begin) * stride, QT, m0, MR, n)
#define GG_CAP(MR, MAX) ((MR) < (MAX) ? (MR) : (MAX))
#define GG_ROWS(QT) GG_SWITCH_ROWS(mr, GG_BMR, QT)

/* gg_columns in bf16 math: rows m0 .. m0 + mr - 1 (mr <= GG_BMR) of columns [begin, end) */
static void gg_columns_bf16(const gg_job *job, const uint8_t *src, int64_t stride, int qtype, int m0, int mr,
                            int begin, int end) {
    GG_SWITCH_TYPE(qtype, GG_ROWS)
}

/* Rows m0 .. m0 + MR - 1 of panel columns n .. n + GG_BNC - 1 (column c's bf16 weights at w0 + c *
 * depth): each output the same two chains as gg_tile_bf16 (pieces alternating, an odd last piece
 * into chain 0), so the same bits; a piece of x is loaded once for GG_BNC columns, a piece of
 * weights once for GG_B2MR rows. Measured against gg_tile_bf16's 8 rows x 1 column (AMD EPYC,
 * avx512, 2 threads, Q5_0 and Q6_K layers of 1,536 x 576 and 576 x 1,536, the panel's decoding
 * included, interleaved builds): 4 x 2 1.13-1.22x at 64 and 256 rows, 6 x 2 the same within noise,
 * 3 x 3 1.01-1.12x, 2 x 4 0.75-0.95x, 1 x 8 0.41-0.52x. */
#ifndef GG_B2MR
#define GG_B2MR 4 /* rows: 16 accumulators */
#endif
#ifndef GG_BNC
#define GG_BNC 2 /* columns */
#endif
static inline __attribute__((always_inline)) void gg_panel_tile_bf16(const gg_job *job, const uint16_t *w0, int m0,
                                                                const int MR, int n) {
    const int depth = job->depth, pieces = depth / 32;
    const uint16_t *x = job->xb + (int64_t)m0 * depth;
    __m512 acc[GG_B2MR][GG_BNC][2]; /* [row][column][chain] */
    GG_UNROLL
    for (int r = 0; r < MR; ++r)
        for (int c = 0; c < GG_BNC; ++c) acc[r][c][0] = acc[r][c][1] = _mm512_setzero_ps();
#define GG_LOAD_BH(p) ((__m512bh)_mm512_loadu_si512((const void *)(p)))
#define GG_PANEL_PIECE(p, chain)                                                                  \
    do {                                                                                          \
        __m512bh w[GG_BNC];                                                                       \
        for (int c = 0; c < GG_BNC; ++c) w[c] = GG_LOAD_BH(w0 + (int64_t)c * depth + 32 * (p));   \
        GG_UNROLL                                                                                 \
        for (int r = 0; r < MR; ++r) {                                                            \
            const __m512bh xv = GG_LOAD_BH(x + (int64_t)r * depth + 32 * (p));                    \
            for (int c = 0; c < GG_BNC; ++c) acc[r][c][chain] = _mm512_dpbf16_ps(acc[r][c][chain], xv, w[c]); \
        }                                                                                         \
    } while (0)
    int p = 0;
    for (; p + 1 < pieces; p += 2) {
        GG_PANEL_PIECE(p, 0);
        GG_PANEL_PIECE(p + 1, 1);
    }
    if (p < pieces) GG_PANEL_PIECE(p, 0); /* an odd last piece: chain 0 */
#undef GG_PANEL_PIECE
#undef GG_LOAD_BH
    for (int r = 0; r < MR; ++r)
        for (int c = 0; c < GG_BNC; ++c)
            job->out[(int64_t)(m0 + r) * job->ld + n + c] = lanes_sum(_mm512_add_ps(acc[r][c][0], acc[r][c][1]));
}

/* gg_panel_columns in bf16 math: column n's bf16 weights at panel + (n - begin) * depth; rows
 * m0 .. m0 + mr - 1 in tiles of up to GG_B2MR, each over every column (any mr: the tile size is this
 * file's to know) */
static void gg_panel_columns_bf16(const gg_job *job, const uint16_t *panel, int m0, int mr, int begin, int end) {
    const uint8_t *src = (const uint8_t *)panel;
    const int64_t stride = (int64_t)job->depth * 2;
#undef GG_COLS
#define GG_COLS(QT, MR)                                                                           \
    do {                                                                                          \
        int n = begin;                                                                            \
        for (; n + GG_BNC <= end; n += GG_BNC) gg_panel_tile_bf16(job, panel + (int64_t)(n - begin) * job->depth, top, MR, n); \
        for (; n < end; ++n) gg_tile_bf16(job, src + (n - begin) * stride, GG_BF16, top, MR, n);  \
    } while (0)
    for (int top = m0; top < m0 + mr; top += GG_B2MR) {
        const int rows = m0 + mr - top < GG_B2MR ? m0 + mr - top : GG_B2MR;
        GG_SWITCH_ROWS(rows, GG_B2MR, GG_BF16)
    }
}
#undef GG_ROWS
#undef GG_CAP
#undef GG_COLS

/* x [rows, depth] float32 -> xb, rounded to bf16 (to nearest even); depth a multiple of 32 */
static void gg_round_rows_bf16(const float *x, uint16_t *xb, int64_t values) {
    for (int64_t i = 0; i < values; i += 32)
        _mm512_storeu_si512((void *)(xb + i),
                            (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + i + 16), _mm512_loadu_ps(x + i)));
}
