/* ---------------------------------------------------------------------------------------------
 * q8 math's panel route (gguf_q8.c): a piece of columns decoded once a call into bytes that every
 * row tile reads. Included by gguf_q8.c (GG_Q8_MULS, gg_q8_piece, GG_Q8_ROWS, GG_Q8_SWITCH_TYPE).
 * ------------------------------------------------------------------------------------------- */

#ifndef GG_Q8_512
/* The panel route (AVX2 builds): where more than one row tile reads a piece of columns (prefill,
 * batched decode), each thread decodes its columns' blocks once a call into a thread-local panel,
 * each piece as gg_q8_piece gives it (bytes, d_w, o; Q6_K's pair scales), and every row tile reads
 * them from there, where the register route decodes a column again for every tile of GG_Q8_MR rows.
 * The tiles multiply the same bytes by the same scales in the same order (GG_Q8_MULS, chain p & 1):
 * the same bits. Measured against the register route (AMD EPYC, avx512, capped to AVX2, 2 threads,
 * SmolLM2's layer shapes, 2 interleaved rounds) at 64-256 rows: Q5_0 1.14-1.29x, Q6_K 1.17-1.43x,
 * Q4_0 1.06-1.21x, and with their o * sx terms vectorized Q4_K 1.10-1.28x, Q5_1 1.05-1.24x, Q5_K
 * 1.09-1.29x, Q4_1 1.02-1.16x (0.95-1.0x at 16 rows); Q8_0, which has no decoding to save,
 * 0.99-1.05x: it keeps the register route. */
#define GG_Q8_PANEL 1
#define GG_Q8_PANEL_TYPE(qtype) ((qtype) != GG_Q8_0)

/* A panel column: its pieces' 32 bytes each, then their d_w, their o (floats), Q6_K's two scales */
static int64_t gg_q8_panel_stride(int pieces) { return (int64_t)pieces * (32 + 2 * sizeof(float) + 2 * sizeof(int16_t)); }

static inline __attribute__((always_inline)) void gg_q8_panel_column(const uint8_t *src, const int QT, int pieces,
                                                                     uint8_t *col) {
    int8_t *q = (int8_t *)col;
    float *d = (float *)(col + 32 * (int64_t)pieces), *o = d + pieces;
    int16_t *sc = (int16_t *)(o + pieces);
    gg_scales s = {{0}, {0}};
    float q6_d = 0.0f;
    for (int p = 0; p < pieces; ++p) {
        const int j = GG_QK(QT) == 256 ? p % 8 : 0;
        const uint8_t *blk = src + (int64_t)(GG_QK(QT) == 256 ? p / 8 : p) * GG_BYTES(QT);
        if (GG_QK(QT) == 256 && j == 0) {
            if (QT == GG_Q6_K) q6_d = gg_f16(blk + 208);
            else gg_k_scales_sse(blk, QT, &s);
        }
        _mm256_storeu_si256((__m256i *)(q + 32 * p), gg_q8_piece(blk, j, QT, &s, q6_d, d + p, o + p));
        if (QT == GG_Q6_K) {
            sc[2 * p] = (int8_t)blk[192 + 2 * j];
            sc[2 * p + 1] = (int8_t)blk[192 + 2 * j + 1];
        }
    }
}

/* Rows m0 .. m0 + MR - 1 of output column n, its decoded pieces at col */
static inline __attribute__((always_inline)) void gg_q8_panel_tile(const gg_job *job, const uint8_t *col, const int QT,
                                                                   int m0, const int MR, int n, const float *sxt) {
    const int depth = job->depth, pieces = depth / 32;
    const int8_t *xq = job->xq + (int64_t)m0 * depth, *pq = (const int8_t *)col;
    const float *dx = job->dx + (int64_t)m0 * 8 * pieces, *sx = job->sx + (int64_t)m0 * pieces;
    const float *pd = (const float *)(col + 32 * (int64_t)pieces), *po = pd + pieces;
    const int16_t *psc = (const int16_t *)(po + pieces);
    __m256 acc[GG_QMR][2], mins[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    float mins1[GG_Q8_VEC_MINS][2] = {{0.0f, 0.0f}};
    for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
#define GG_Q8_PANEL_PIECE(p, C)                                                                     \
    do {                                                                                            \
        const __m256i w_ = _mm256_loadu_si256((const __m256i *)(pq + 32 * (p)));                    \
        const __m256i pw_ = QT == GG_Q6_K ? _mm256_set_m128i(_mm_set1_epi16(psc[2 * (p) + 1]),       \
                                                             _mm_set1_epi16(psc[2 * (p)]))          \
                                          : _mm256_set1_epi16(1);                                   \
        GG_Q8_MULS(w_, pw_, pd[p], po[p], p, C);                                                    \
    } while (0)
    int p = 0;
    for (; p + 1 < pieces; p += 2) {
        GG_Q8_PANEL_PIECE(p, 0);
        GG_Q8_PANEL_PIECE(p + 1, 1);
    }
    if (p < pieces) GG_Q8_PANEL_PIECE(p, 0); /* an odd last piece: chain 0 */
#undef GG_Q8_PANEL_PIECE
    for (int r = 0; r < MR; ++r)
        job->out[(int64_t)(m0 + r) * job->ld + n] =
            gg_q8_hsum(_mm256_add_ps(acc[r][0], acc[r][1])) + gg_q8_min_sum(mins, mins1, MR, r);
}

/* Columns [begin, end) of the job's weights decoded into panel (gg_q8_panel_stride a column) */
static void gg_q8_panel_fill(const gg_job *job, int begin, int end, uint8_t *panel) {
    const int pieces = job->depth / 32;
    const int64_t stride = gg_q8_panel_stride(pieces);
#define GG_FILL(QT)                                                                                 \
    for (int n = begin; n < end; ++n)                                                               \
        gg_q8_panel_column(job->w + (int64_t)n * job->row_bytes, QT, pieces, panel + (n - begin) * stride);
    GG_Q8_SWITCH_TYPE(job->qtype, GG_FILL)   /* (Q8_0 never comes here: GG_Q8_PANEL_TYPE) */
#undef GG_FILL
}

#define GG_COLS(QT, MR) \
    for (int n = begin; n < end; ++n) gg_q8_panel_tile(job, panel + (n - begin) * stride, QT, m0, MR, n, sxt)
/* Rows m0 .. m0 + mr - 1 (mr <= gg_q8_rows(qtype)) of the panel's columns [begin, end) */
static void gg_q8_panel_columns(const gg_job *job, const uint8_t *panel, int m0, int mr, int begin, int end) {
    const int64_t stride = gg_q8_panel_stride(job->depth / 32);
    const int transposed = !GG_Q8_SIGNED(job->qtype) && mr >= GG_Q8_VEC_MINS;
    float sxt[transposed ? 8 * (job->depth / 32) : 8];
    if (transposed) gg_q8_transpose_sx(job, m0, mr, sxt);
    GG_Q8_SWITCH_TYPE(job->qtype, GG_Q8_ROWS)
}
#undef GG_COLS
#endif
