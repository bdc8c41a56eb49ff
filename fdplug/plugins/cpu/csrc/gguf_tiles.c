/* ---------------------------------------------------------------------------------------------
 * gguf_linear.c's tiles, written once for the AVX-512 and the AVX2 vectors: the including file
 * (gguf_linear_avx512.c, gguf_linear_avx2.c) defines the vector type GG_V of GG_VL floats, GG_NV =
 * 32 / GG_VL vectors a pair of 16 weights, gg_vload, gg_vfma, gg_widen (a gg_pair's 32 integers as
 * GG_NV float vectors, q * d + o) and gg_finish (an output's GG_NV accumulators summed in
 * lanes_sum's pairing), and the rows of a tile: GG_MR for the register route, GG_PMR for the
 * panel route's floats. A tile is one output column: measured on this Zen 5 (AVX-512, one thread),
 * 2 columns at once (4 rows x 2 on floats, or 2 columns for a single row, to hide the FMA latency)
 * ran no faster than one, and 4 x 2 ran 0.6-0.75x 8 x 1 on floats.
 *
 * Every tile shape gives the same bits: output (m, n) is GG_NV accumulators, each one chain over k
 * in order, whatever the rows and columns beside it. The row count and the block type are
 * compile-time constants at each call (gg_columns' switches): with either a variable gcc keeps the
 * accumulators on the stack, a store and a load around every FMA (as the FP8 GEMV found).
 * ------------------------------------------------------------------------------------------- */

#define GG_MAX_MR 8
#define GG_UNROLL _Pragma("GCC unroll 16") /* (else gcc may keep a tile's accumulators on the stack) */

/* Weights [32j, 32j + 32) of the block at ``blk``: QT's bytes, or (GG_F32) floats. */
static inline __attribute__((always_inline)) void gg_weights(const uint8_t *blk, const int j, const int QT,
                                                             const gg_scales *s, GG_V w[GG_NV]) {
    if (QT == GG_F32) {
        for (int v = 0; v < GG_NV; ++v) w[v] = gg_vload((const float *)blk + 32 * j + GG_VL * v);
        return;
    }
    if (QT == GG_F16 || QT == GG_BF16) { /* (j == 0: a 32-value "block") widened exactly */
        for (int v = 0; v < GG_NV; ++v) w[v] = gg_vload_half(blk + 2 * GG_VL * v, QT == GG_BF16);
        return;
    }
    if (QT == GG_Q4_0 || QT == GG_Q4_1) {
        gg_widen_q4(blk, QT, w);
        return;
    }
    const gg_pair q = gg_pair_of(blk, j, QT, s);
    gg_widen(&q, gg_signed(QT), w);
}

/* Rows m0 .. m0 + MR - 1 of output column n, whose weights are at src (a row of blocks of QT, or
 * of floats). */
static inline __attribute__((always_inline)) void gg_tile(const gg_job *job, const uint8_t *src, const int QT,
                                                          int m0, const int MR, int n) {
    const int depth = job->depth, qk = QT == GG_F32 ? 32 : GG_QK(QT);
    const int64_t block_bytes = QT == GG_F32 ? 32 * 4 : GG_BYTES(QT);
    const float *x = job->x + (int64_t)m0 * depth;
    GG_V acc[GG_MAX_MR][GG_NV];
    for (int r = 0; r < MR; ++r)
        for (int v = 0; v < GG_NV; ++v) acc[r][v] = gg_vzero();
    gg_scales s;
    for (int b = 0; b < depth / qk; ++b) {
        const uint8_t *blk = src + b * block_bytes;
        if (qk == 256) gg_k_scales_sse(blk, QT, &s);
#pragma GCC unroll 8
        for (int j = 0; j < qk / 32; ++j) {
            const float *xk = x + b * qk + 32 * j;
            GG_V w[GG_NV];
            gg_weights(blk, j, QT, &s, w);
            for (int r = 0; r < MR; ++r)
                for (int v = 0; v < GG_NV; ++v)
                    acc[r][v] = gg_vfma(gg_vload(xk + (int64_t)r * depth + GG_VL * v), w[v], acc[r][v]);
        }
    }
    for (int r = 0; r < MR; ++r) job->out[(int64_t)(m0 + r) * job->ld + n] = gg_finish(acc[r]);
}

/* The cases of the integer block types but Q6_K (every switch's default: gg_known has checked the type) */
#define GG_INTEGER_CASES(BODY)                                                                       \
    case GG_Q4_0: BODY(GG_Q4_0) break;                                                               \
    case GG_Q4_1: BODY(GG_Q4_1) break;                                                               \
    case GG_Q5_0: BODY(GG_Q5_0) break;                                                               \
    case GG_Q5_1: BODY(GG_Q5_1) break;                                                               \
    case GG_Q8_0: BODY(GG_Q8_0) break;                                                               \
    case GG_Q4_K: BODY(GG_Q4_K) break;                                                               \
    case GG_Q5_K: BODY(GG_Q5_K) break;

/* BODY(QT) with QT the block type ``qtype`` as a compile-time constant, so that each decoder and
 * tile is specialised per type (Q6_K the default). */
#define GG_SWITCH_TYPE(qtype, BODY)                                                                  \
    switch (qtype) {                                                                                 \
    GG_INTEGER_CASES(BODY)                                                                           \
    case GG_F16: BODY(GG_F16) break;                                                                 \
    case GG_BF16: BODY(GG_BF16) break;                                                               \
    default: BODY(GG_Q6_K) break;                                                                    \
    }

/* A row of blocks widened to floats: in k order (fdplug_gguf_dequant's, and the panel route's), or
 * (chains: GG_CHAIN_PANEL's panel route) vector v of 32-weight piece p at v * depth / GG_NV +
 * p * GG_VL, each chain's values one after the other. */
static void gg_dequant_row(const uint8_t *row, int qtype, int depth, float *out, int chains) {
#define GG_ROW(QT)                                                                                   \
    for (int b = 0; b < depth / GG_QK(QT); ++b) {                                                   \
        const uint8_t *blk = row + (int64_t)b * GG_BYTES(QT);                                        \
        if (GG_QK(QT) == 256) gg_k_scales_sse(blk, QT, &s);                                          \
        for (int j = 0; j < GG_QK(QT) / 32; ++j) {                                                   \
            GG_V w[GG_NV];                                                                           \
            gg_weights(blk, j, QT, &s, w);                                                           \
            const int piece = b * (GG_QK(QT) / 32) + j;                                              \
            for (int v = 0; v < GG_NV; ++v)                                                          \
                gg_vstore(out + (chains ? v * (depth / GG_NV) + piece * GG_VL : 32 * piece + GG_VL * v), w[v]); \
        }                                                                                            \
    }
    gg_scales s;
    GG_SWITCH_TYPE(qtype, GG_ROW)
#undef GG_ROW
}

/* Columns [begin, end), column n's weights at src + (n - begin) * stride, each MR rows from m0 */
#define GG_COLS(QT, MR) \
    for (int n = begin; n < end; ++n) gg_tile(job, src + (n - begin) * stride, QT, m0, MR, n)

/* GG_COLS for mr rows (1 .. MAX, MAX at most 8), mr a compile-time constant in each case */
#define GG_CAP(MR, MAX) ((MR) < (MAX) ? (MR) : (MAX))
#define GG_SWITCH_ROWS(mr, MAX, QT)                                                                  \
    switch (mr) {                                                                                    \
    case 1: GG_COLS(QT, 1); break;                                                                   \
    case 2: GG_COLS(QT, GG_CAP(2, MAX)); break;                                                      \
    case 3: GG_COLS(QT, GG_CAP(3, MAX)); break;                                                      \
    case 4: GG_COLS(QT, GG_CAP(4, MAX)); break;                                                      \
    case 5: GG_COLS(QT, GG_CAP(5, MAX)); break;                                                      \
    case 6: GG_COLS(QT, GG_CAP(6, MAX)); break;                                                      \
    case 7: GG_COLS(QT, GG_CAP(7, MAX)); break;                                                      \
    default: GG_COLS(QT, GG_CAP(8, MAX)); break;                                                     \
    }

/* The register route: rows m0 .. m0 + mr - 1 (mr <= GG_MR) of columns [begin, end), column n's
 * blocks at src + (n - begin) * stride. */
static void gg_columns(const gg_job *job, const uint8_t *src, int64_t stride, int qtype, int m0, int mr, int begin,
                       int end) {
#define GG_ROWS(QT) GG_SWITCH_ROWS(mr, GG_MR, QT)
    GG_SWITCH_TYPE(qtype, GG_ROWS)
#undef GG_ROWS
}

#ifdef GG_CHAIN_PANEL
/* The panel route, one chain at a time (GG_CHAIN_PANEL: the level's tiles hold GG_NV accumulators
 * an output, too many for enough outputs a tile): rows m0 .. m0 + MR - 1 of columns n .. n + NC - 1
 * over the panel in gg_dequant_row's chain layout (column n's at panel + (n - first) * depth).
 * Chain v of every output of the tile runs over k in order, MR x NC accumulators, each x vector
 * loaded once for the NC columns and each weight vector once for the MR rows; the chains are then
 * summed as gg_finish sums them. The same FMAs in the same order as gg_tile's: the same bits. */
static inline __attribute__((always_inline)) void gg_chain_tile(const gg_job *job, const float *panel, int first,
                                                                int m0, const int MR, int n, const int NC) {
    const int depth = job->depth, pieces = depth / 32, chain = depth / GG_NV;
    const float *x = job->x + (int64_t)m0 * depth, *w = panel + (int64_t)(n - first) * depth;
    GG_V done[GG_MAX_MR][GG_CHAIN_NC][GG_NV];
    for (int v = 0; v < GG_NV; ++v) {
        GG_V acc[GG_MAX_MR][GG_CHAIN_NC];
        GG_UNROLL
        for (int r = 0; r < MR; ++r)
            GG_UNROLL
            for (int c = 0; c < NC; ++c) acc[r][c] = gg_vzero();
        for (int p = 0; p < pieces; ++p) {
            GG_V xv[GG_MAX_MR];
            GG_UNROLL
            for (int r = 0; r < MR; ++r) xv[r] = gg_vload(x + (int64_t)r * depth + 32 * p + GG_VL * v);
            GG_UNROLL
            for (int c = 0; c < NC; ++c) {
                const GG_V wv = gg_vload(w + (int64_t)c * depth + v * chain + GG_VL * p);
                GG_UNROLL
                for (int r = 0; r < MR; ++r) acc[r][c] = gg_vfma(xv[r], wv, acc[r][c]);
            }
        }
        GG_UNROLL
        for (int r = 0; r < MR; ++r)
            GG_UNROLL
            for (int c = 0; c < NC; ++c) done[r][c][v] = acc[r][c];
    }
    for (int r = 0; r < MR; ++r)
        for (int c = 0; c < NC; ++c) job->out[(int64_t)(m0 + r) * job->ld + n + c] = gg_finish(done[r][c]);
}

#define GG_CHAIN_COLS(MR)                                                                            \
    for (int n = begin; n < end;) {                                                                  \
        if (end - n >= GG_CHAIN_NC) {                                                                \
            gg_chain_tile(job, panel, begin, m0, MR, n, GG_CHAIN_NC);                                \
            n += GG_CHAIN_NC;                                                                        \
        } else {                                                                                     \
            gg_chain_tile(job, panel, begin, m0, MR, n, 1);                                          \
            ++n;                                                                                     \
        }                                                                                            \
    }

static void gg_panel_columns(const gg_job *job, const float *panel, int m0, int mr, int begin, int end) {
    switch (mr) {
    case 1: GG_CHAIN_COLS(1); break;
    case 2: GG_CHAIN_COLS(2); break;
    default: GG_CHAIN_COLS(3); break;
    }
}
#undef GG_CHAIN_COLS
#else
/* The panel route: rows m0 .. m0 + mr - 1 (mr <= GG_PMR) of columns [begin, end) over their
 * widened floats, column n's at panel + (n - begin) * depth. */
static void gg_panel_columns(const gg_job *job, const float *panel, int m0, int mr, int begin, int end) {
    const uint8_t *src = (const uint8_t *)panel;
    const int64_t stride = (int64_t)job->depth * 4;
    GG_SWITCH_ROWS(mr, GG_PMR, GG_F32)
}
#endif
#undef GG_CAP
#undef GG_COLS
