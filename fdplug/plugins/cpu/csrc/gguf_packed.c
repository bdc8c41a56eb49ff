/* ---------------------------------------------------------------------------------------------
 * gguf_linear.c in packed q8 math: the file's blocks repacked once at load into groups of 16
 * columns (the same bytes, another order: fdplug_gguf_pack), x quantized to 8 bits with a scale per
 * run of 16 values, and each run's 16 products of a column summed as integers with the 16 columns
 * in the lanes (vpdpbusd where the build has VNNI; the tiles at each level: gguf_packed_tiles.c).
 *
 * Why: at AVX-512 on a Zen 4 the bf16 tiles run near vdpbf16ps's peak from 64 rows (290-350 of
 * ~457 GFLOP/s, 2 threads), and one row pays ~9 vector operations to widen and round every 32
 * weights. vpdpbusd does 64 multiply-adds where vdpbf16ps does 32, at twice its rate there (929
 * against 457 GOP/s). With columns in the lanes a run's integer sums stay in one register, so the
 * float work is a conversion and an FMA a run of 16 inputs; and a group's pieces lie one after the
 * other, so one row streams the weights in order (q8 math's runs of 4 keep a float scale per 4
 * products; wip/q8-block-float's transposed tiles read 8 columns' rows piece by piece). The same
 * tile for every row count: a token's result does not depend on its batch.
 *
 * Values (`fdplug.plugin_api.gguf_formats.q8_inputs(x, run=16)` is the reference): each run of 16
 * inputs of a row becomes d = amax / 127 and q = rint(x * (1 / d)) (float32, nearest even; zeros
 * where amax is 0), with qs its integer sum. A piece of 32 weights of a column is u * dw + ow with u
 * the stored unsigned integers less the type's offset (Q4_0 8, Q5_0 16, Q8_0 128 as q ^ 0x80, Q6_K
 * 32; subtracted exactly as -offset * qs, the accumulator's start), dw the block's scale (Q4_K,
 * Q5_K: d * sc; Q6_K: d * sc per run of 16) and ow its min (Q4_1, Q5_1: m; Q4_K, Q5_K: -dmin * mn).
 * With S0, S1 the piece's two runs' exact integer sums (float32), per column and piece p in order,
 * pieces alternating between two chains (p & 1), added at the end:
 *     t = fma(S1, d1, S0 * d0);  acc = fma(t, dw, acc);  acc = fma(ow, sx, acc)   (sx = fma(d1, qs1, d0 * qs0))
 * and Q6_K: acc = fma(S0 * d0, dw0, acc); acc = fma(S1 * d1, dw1, acc).
 *
 * Group layout (16 * the row's bytes: each unit is 16 blocks' bytes, one piece of the 32-weight
 * types or one super-block of the K-quants): integers of piece p as 4 vectors of 64 bytes, byte 4c + i
 * of vector v holding column c's weight 8v + i in its low nibble and 8v + 4 + i in its high one (so
 * vector v gives the lanes of the input quads 2v and 2v + 1); Q5_0/Q5_1/Q5_K: then a plane of 64
 * bytes, the fifth bits of quads 0-7 (gp_put_planes: as 8 masks at AVX-512, as a byte a lane below);
 * Q6_K: two such planes (bits 4, 5); Q8_0: 8 vectors of bytes q ^ 0x80 instead. 32-weight types: then
 * 16 float16 d (and Q4_1, Q5_1: 16 m). K-quants: a super-block starts with its 16 columns' headers,
 * a field for all 16 columns in one load (gp_k_factors) in the file's bytes: Q4_K, Q5_K: scale byte k
 * (the file's 12 bytes of 6-bit fields) of the 16 columns at 16 k, then their d, then their dmin (256
 * bytes); Q6_K: int8 scale i of the 16 columns at 16 i, then their d (288 bytes). Then its 8 pieces.
 *
 * Included by gguf_linear.c where the build has AVX2 (where it is chosen first:
 * native_gguf_packed.py).
 * ------------------------------------------------------------------------------------------- */

#define GG_HAVE_PACKED 1
#define GP_COLS 16 /* columns a group: the lanes */
#define GP_RUN 16  /* inputs a scale */
#ifndef GP_MR
#define GP_MR 8    /* rows a tile: at 8 rows 1.05-1.5x 4 (one tile instead of two), from 64 rows even
                      within this machine's noise (AMD EPYC, avx512; 6 between) */
#endif
/* Above this many rows each group is decoded once into a buffer (gp_decode_group) that every row
 * tile then loads; at or below it each tile unpacks the group's pieces itself. The 32-weight types
 * unpack cheaply (nibbles, Q5's one plane, Q8_0's signs) from a group 3.5-4x smaller than its
 * decoded copy (Q4_1 at K = 1,536: 15 KB against 58 KB, past a 32 KB L1), so up to 32 rows they
 * unpack: at 12-32 rows 0.98-1.29x decoding's speed (most 1.05-1.2x), at 48 0.96-1.16x (Q4_0,
 * Q4_1, Q5_0, Q8_0 on SmolLM2's three shapes, 2 threads, interleaved; AMD EPYC, avx2-or-less).
 * The K-quants decode from GP_MR rows on (each tile would compute their scale factors again, and
 * Q6_K's planes: undecoded 0.89-0.93x at 16 rows, 0.62-0.94x at 64). Q8_0 without VNNI never
 * decodes (gp_tile_q8_signed unpacks a run at a time, an xor and an abs a vector): with that tile,
 * 0.95-0.96x the decoded route's time on the 49152 x 576 lm_head at 64-1,024 rows (2 threads,
 * interleaved; AMD EPYC, avx2-or-less). At AVX-512 (one 512-bit half, twice the registers) not
 * measured: there every type decodes from GP_MR rows on, as before. */
static inline int gp_decode_rows(int qtype) {
#ifdef GG_Q8_512
    (void)qtype;
    return GP_MR;
#elif !defined(GG_DOT4_VNNI)   /* (GP_SWAP's condition, defined below: AVX2 without VNNI) */
    return qtype == GG_Q8_0 ? 1 << 30 : GG_QK(qtype) == 32 ? 32 : GP_MR;
#else
    return GG_QK(qtype) == 32 ? 32 : GP_MR;
#endif
}

static inline int gp_offset(int QT) {
    return QT == GG_Q4_0 ? 8 : QT == GG_Q5_0 ? 16 : QT == GG_Q8_0 ? 128 : QT == GG_Q6_K ? 32 : 0;
}
static inline int gp_has_min(int QT) { return QT == GG_Q4_1 || QT == GG_Q5_1 || QT == GG_Q4_K || QT == GG_Q5_K; }
static inline int gp_planes(int QT) {   /* bit planes above the nibbles */
    return QT == GG_Q5_0 || QT == GG_Q5_1 || QT == GG_Q5_K ? 1 : QT == GG_Q6_K ? 2 : 0;
}
static inline int gp_packable(int qtype) { return gg_known(qtype) && qtype != GG_F16 && qtype != GG_BF16; }
/* A K-quant super-block's header bytes a column in the group (the file's, copied) */
static inline int gp_header(int QT) { return QT == GG_Q6_K ? 18 : 16; }
/* Bytes of a piece's integers: nibbles and planes, or Q8_0's bytes */
static inline int gp_piece_bytes(int QT) { return QT == GG_Q8_0 ? 512 : 256 + 64 * gp_planes(QT); }

/* ---- packing (once at load) ---- */

/* The 32 stored integers of piece j of the block at blk: unsigned, offset included (Q8_0: q ^ 0x80) */
static void gp_piece_integers(const uint8_t *blk, int j, int qtype, uint8_t u[32]) {
    gg_scales none;
    memset(&none, 0, sizeof none);
#define GP_PAIR(QT)                                                                                  \
    {                                                                                                \
        const gg_pair p = gg_pair_of(blk, j, QT, &none);                                             \
        _mm_storeu_si128((__m128i *)u, p.q[0]);                                                      \
        _mm_storeu_si128((__m128i *)(u + 16), p.q[1]);                                               \
    }
    GG_SWITCH_TYPE(qtype, GP_PAIR)
#undef GP_PAIR
    if (qtype == GG_Q8_0)
        for (int i = 0; i < 32; ++i) u[i] ^= 0x80;
}

/* A piece's bit planes (gp_planes: the integers' bit 4, and Q6_K's bit 5) at dst + 256, 64 bytes a
 * plane. AVX-512 (GP_PLANE_MASKS) takes a 64-bit mask per input quad q (bit 4c + i: column c's weight
 * 4q + i), which a masked add spreads over the quad's bytes in one instruction. AVX2 has no such mask
 * (spreading one took a broadcast, a shuffle, an and, a compare and an and per quad): there byte 4c + i
 * holds in bit q the bit of column c's weight 4q + i, so that one load spreads all 8 quads of a half,
 * a shift, an and and an or each (gp_unpack). The layout is the build's own: the library that packs
 * a weight at load is the one that reads it. */
#ifdef GG_Q8_512
#define GP_PLANE_MASKS 1
#endif
static void gp_put_planes(const uint8_t u[GP_COLS][32], int qtype, uint8_t *dst) {
    for (int plane = 0; plane < gp_planes(qtype); ++plane)
        for (int q = 0; q < 8; ++q) {
            uint64_t bits = 0;
            for (int c = 0; c < GP_COLS; ++c)
                for (int i = 0; i < 4; ++i) bits |= (uint64_t)((u[c][4 * q + i] >> (4 + plane)) & 1) << (4 * c + i);
#ifdef GP_PLANE_MASKS
            memcpy(dst + 256 + 64 * plane + 8 * q, &bits, 8);
#else
            for (int lane = 0; lane < 64; ++lane) {
                uint8_t *byte = dst + 256 + 64 * plane + lane;
                *byte = (uint8_t)((q == 0 ? 0 : *byte) | ((bits >> lane) & 1) << q);
            }
#endif
        }
}

/* A piece's integers of 16 columns (u[c]: 32 bytes each) in the group layout at dst: each input quad
 * of the 16 columns gathered into one vector (vector q, lane c: u[c][4q .. 4q + 3]) */
static void gp_put_piece(const uint8_t u[GP_COLS][32], int qtype, uint8_t *dst) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    const __m512i lanes = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                             _mm512_set1_epi32(32));
    __m512i q[8];
    for (int i = 0; i < 8; ++i) q[i] = _mm512_i32gather_epi32(lanes, (const void *)(&u[0][4 * i]), 1);
    if (qtype == GG_Q8_0) {
        for (int i = 0; i < 8; ++i) _mm512_storeu_si512((void *)(dst + 64 * i), q[i]);
        return;
    }
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int v = 0; v < 4; ++v)
        _mm512_storeu_si512((void *)(dst + 64 * v),
                            _mm512_or_si512(_mm512_and_si512(q[2 * v], low),
                                            _mm512_slli_epi16(_mm512_and_si512(q[2 * v + 1], low), 4)));
#ifdef GP_PLANE_MASKS
    for (int plane = 0; plane < gp_planes(qtype); ++plane)
        for (int i = 0; i < 8; ++i) {
            const uint64_t bits = _mm512_test_epi8_mask(q[i], _mm512_set1_epi8((char)(0x10 << plane)));
            memcpy(dst + 256 + 64 * plane + 8 * i, &bits, 8);
        }
#else
    gp_put_planes(u, qtype, dst);
#endif
#else   /* (at load, or a layer the loader could not pack: plain loops) */
    if (qtype == GG_Q8_0) {
        for (int q = 0; q < 8; ++q)
            for (int c = 0; c < GP_COLS; ++c) memcpy(dst + 64 * q + 4 * c, &u[c][4 * q], 4);
        return;
    }
    for (int v = 0; v < 4; ++v)
        for (int c = 0; c < GP_COLS; ++c)
            for (int i = 0; i < 4; ++i)
                dst[64 * v + 4 * c + i] = (uint8_t)((u[c][8 * v + i] & 0x0F) | (u[c][8 * v + 4 + i] & 0x0F) << 4);
    gp_put_planes(u, qtype, dst);
#endif
}

/* Columns [0, valid) of the 16 whose rows (row_bytes each, blocks of qtype) start at w, in the group
 * layout at dst (16 * row_bytes bytes); columns from valid on as zero blocks (their weights 0). */
static void gp_pack_group(const uint8_t *w, int64_t row_bytes, int valid, int depth, int qtype, uint8_t *dst) {
    static const uint8_t zero[256];
    const int blocks = depth / GG_QK(qtype), bytes = GG_BYTES(qtype);
    uint8_t u[GP_COLS][32];
    for (int b = 0; b < blocks; ++b) {
        uint8_t *unit = dst + (int64_t)b * GP_COLS * bytes;
        const uint8_t *blk[GP_COLS];
        for (int c = 0; c < GP_COLS; ++c) blk[c] = c < valid ? w + c * row_bytes + (int64_t)b * bytes : zero;
        if (GG_QK(qtype) == 32) {
            for (int c = 0; c < GP_COLS; ++c) gp_piece_integers(blk[c], 0, qtype, u[c]);
            gp_put_piece((const uint8_t (*)[32])u, qtype, unit);
            uint8_t *scales = unit + gp_piece_bytes(qtype);
            for (int c = 0; c < GP_COLS; ++c) {
                memcpy(scales + 2 * c, blk[c], 2);                                   /* d */
                if (gp_has_min(qtype)) memcpy(scales + 32 + 2 * c, blk[c] + 2, 2);  /* m */
            }
            continue;
        }
        const int header = gp_header(qtype);
        for (int c = 0; c < GP_COLS; ++c) {
            if (qtype == GG_Q6_K) {   /* the block's 16 scales (at 192) a scale for all columns, then d */
                for (int i = 0; i < 16; ++i) unit[GP_COLS * i + c] = blk[c][192 + i];
                memcpy(unit + GP_COLS * 16 + 2 * c, blk[c] + 208, 2);
            } else {                  /* Q4_K, Q5_K: scale byte k for all columns at 16 k, then d, dmin */
                for (int k = 0; k < 12; ++k) unit[GP_COLS * k + c] = blk[c][4 + k];
                memcpy(unit + GP_COLS * 12 + 2 * c, blk[c], 2);
                memcpy(unit + GP_COLS * 14 + 2 * c, blk[c] + 2, 2);
            }
        }
        for (int j = 0; j < 8; ++j) {
            for (int c = 0; c < GP_COLS; ++c) gp_piece_integers(blk[c], j, qtype, u[c]);
            gp_put_piece((const uint8_t (*)[32])u, qtype, unit + GP_COLS * header + j * gp_piece_bytes(qtype));
        }
    }
}

/* W [cols, row bytes] (the file's blocks of qtype) -> out, the same bytes in the group layout.
 * Returns 0, or -2 for a type it does not take, cols not a multiple of 16 or a depth not of whole blocks. */
int fdplug_gguf_pack(const uint8_t *w, uint8_t *out, int cols, int depth, int qtype) {
    if (!gp_packable(qtype) || cols <= 0 || cols % GP_COLS || depth <= 0 || depth % GG_QK(qtype)) return -2;
    const int64_t row_bytes = (int64_t)depth / GG_QK(qtype) * GG_BYTES(qtype);
    for (int g = 0; g < cols / GP_COLS; ++g)
        gp_pack_group(w + (int64_t)g * GP_COLS * row_bytes, row_bytes, GP_COLS, depth, qtype,
                      out + (int64_t)g * GP_COLS * row_bytes);
    return 0;
}

/* ---- inputs (every call) ---- */

#if (defined(GG_Q8_512) && defined(__AVX512VNNI__)) || (!defined(GG_Q8_512) && defined(GG_DOT4_VNNI))
#define GP_VNNI 1   /* the tiles' integer products are vpdpbusd (gguf_packed_tiles.c) */
#endif
#define GP_REC 64   /* bytes of a row's record for a piece (gp_inputs) */
#if !defined(GG_Q8_512) && !defined(GP_VNNI)
#define GP_SWAP 1   /* AVX2 without VNNI: decoded groups multiply with the operands' roles swapped (gguf_packed_tiles.c) */
#define GP_SWAPS(QT) ((QT) != GG_Q8_0)   /* the types that route takes (Q8_0's |w| = 128 would saturate it) */
#else
#define GP_SWAPS(QT) 0
#endif
/* Whether a call's decoded groups take the swapped route (gp_tile_swapped) */
static inline int gp_swapped(int qtype, int rows) { return GP_SWAPS(qtype) && rows > gp_decode_rows(qtype); }

/* x quantized, a record of GP_REC bytes for each piece p and row (gp_record): its 32 inputs q (int8),
 * the runs' scales d[2] (float), the runs' integer sums times -off (start[2], int32: each sum's start,
 * the type's offset subtracted exactly), the piece's sum sx = fma(d1, qs1, d0 * qs0) (float) at byte 48. */
typedef struct {
    uint8_t *rec;
    int pieces, off;
    int swap;   /* the inputs stored as q ^ 0x80 (unsigned: q + 128) and the starts 0, for gp_tile_swapped */
    int height; /* rows a tile of records: GP_MR, or all of them below it (gp_record) */
} gp_inputs;

/* Row row's record for piece p. A row tile's (GP_MR rows from a multiple of GP_MR; all rows where
 * fewer) lie GP_REC bytes apart for each piece (one pointer and constant offsets), and its pieces one
 * after the other: a tile reads its records in one run of memory. Each piece over every row instead
 * put a tile's next piece rows * 64 bytes on, past what the hardware prefetchers follow: at 1,024
 * rows 1.05-1.13x slower on SmolLM2's shapes (Q4_1, Q5_0, Q6_K, Q8_0, interleaved; AMD EPYC,
 * avx2-or-less). */
/* The records of the tile of rows from m0 (a multiple of the height) for piece 0; piece p's are
 * p * height * GP_REC bytes on (what the tiles' loops step by, without gp_record's division) */
static inline const uint8_t *gp_tile_records(const gp_inputs *in, int64_t m0) {
    return in->rec + m0 * in->pieces * GP_REC;
}
static inline const uint8_t *gp_record(const gp_inputs *in, int64_t p, int64_t row) {
    const int64_t within = row % in->height;
    return gp_tile_records(in, row - within) + (p * in->height + within) * GP_REC;
}
/* Bytes of the records of rows (whole tiles) of pieces */
static inline int64_t gp_record_bytes(int64_t rows, int pieces) {
    return (rows < GP_MR ? rows : (rows + GP_MR - 1) / GP_MR * GP_MR) * pieces * GP_REC;
}

/* x's runs [first, last) of 16 (first even; run = row * pieces * 2 + 2 * piece + j) -> their records:
 * the same values at both levels */
static void gp_quantize(const float *x, int64_t first, int64_t last, gp_inputs *in) {
    int32_t first_sum = 0;   /* the piece's first run's qs (its second run comes next: first is even) */
    int64_t row = first / (2 * in->pieces), p = first / 2 % in->pieces;
    uint8_t *piece0 = (uint8_t *)gp_record(in, 0, row);   /* the row's record for piece 0: a division a row */
    for (int64_t run = first; run < last; ++run) {
        const float *v = x + GP_RUN * run;
        const int j = (int)(run % 2);
        uint8_t *r = piece0 + p * in->height * GP_REC;
        int32_t qs;
#if defined(__AVX512F__) && defined(__AVX512BW__)
        const __m512 a = _mm512_loadu_ps(v);
        const float d = _mm512_reduce_max_ps(_mm512_abs_ps(a)) / 127.0f, inverse = d != 0.0f ? 1.0f / d : 0.0f;
        const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(inverse))); /* nearest even */
        const __m128i bytes = _mm512_cvtsepi32_epi8(q);
        qs = _mm512_reduce_add_epi32(q);
#else
        const __m256 a0 = _mm256_loadu_ps(v), a1 = _mm256_loadu_ps(v + 8), sign = _mm256_set1_ps(-0.0f);
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(_mm256_max_ps(_mm256_andnot_ps(sign, a0), _mm256_andnot_ps(sign, a1))),
                               _mm256_extractf128_ps(_mm256_max_ps(_mm256_andnot_ps(sign, a0), _mm256_andnot_ps(sign, a1)), 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        const float d = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4))) / 127.0f, inverse = d != 0.0f ? 1.0f / d : 0.0f;
        const __m256i q0 = _mm256_cvtps_epi32(_mm256_mul_ps(a0, _mm256_set1_ps(inverse)));   /* nearest even */
        const __m256i q1 = _mm256_cvtps_epi32(_mm256_mul_ps(a1, _mm256_set1_ps(inverse)));
        const __m256i words = _mm256_permute4x64_epi64(_mm256_packs_epi32(q0, q1), 0xD8);    /* 16 in order */
        const __m128i bytes = _mm_packs_epi16(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1));
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(_mm256_add_epi32(q0, q1)),
                                   _mm256_extracti128_si256(_mm256_add_epi32(q0, q1), 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(1, 0, 3, 2)));
        qs = _mm_cvtsi128_si32(_mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(2, 3, 0, 1))));
#endif
        _mm_storeu_si128((__m128i *)(r + 16 * j), in->swap ? _mm_xor_si128(bytes, _mm_set1_epi8((char)0x80)) : bytes);
        const int32_t start = -in->off * qs;
        memcpy(r + 32 + 4 * j, &d, 4);
        memcpy(r + 40 + 4 * j, &start, 4);
        if (j == 1) {
            float d0;
            memcpy(&d0, r + 32, 4);
            const float sx = fmaf(d, (float)qs, d0 * (float)first_sum);
            memcpy(r + 48, &sx, 4);
            if (++p == in->pieces) p = 0, piece0 = (uint8_t *)gp_record(in, 0, ++row);
        }
        first_sum = qs;
    }
}

/* ---- the tiles ---- */

typedef struct {
    gp_inputs *in;   /* (the workers fill it first: gp_worker) */
    const uint8_t *w;
    float *out;
    int64_t ld, next;
    int rows, cols, groups, depth, qtype, per_item;
    int block_rows, items_per_block;   /* a work item's rows (gp_block_rows) and a block's items */
    int packed;      /* w in the group layout; 0: the file's rows, each group packed here a call */
    int failed;      /* a thread had no memory for its group buffer */
    const float *x;  /* quantized into in by the workers first, GP_QUANTIZE_RUNS runs an item */
    int64_t runs, next_runs, runs_done;
} gp_job;

#include "gguf_packed_tiles.c"
#include "gguf_packed_rows.c"

#define GP_CAP(MR) ((MR) < GP_MR ? (MR) : GP_MR)   /* (mr <= GP_MR: the cases above it never run) */
#define GP_ROWS(QT)                                                                                  \
    switch (mr) {                                                                                    \
    case 1: gp_tile(job, g, decoded, QT, m0, 1, n0); break;                                          \
    case 2: gp_tile(job, g, decoded, QT, m0, GP_CAP(2), n0); break;                                  \
    case 3: gp_tile(job, g, decoded, QT, m0, GP_CAP(3), n0); break;                                  \
    case 4: gp_tile(job, g, decoded, QT, m0, GP_CAP(4), n0); break;                                  \
    case 5: gp_tile(job, g, decoded, QT, m0, GP_CAP(5), n0); break;                                  \
    case 6: gp_tile(job, g, decoded, QT, m0, GP_CAP(6), n0); break;                                  \
    case 7: gp_tile(job, g, decoded, QT, m0, GP_CAP(7), n0); break;                                  \
    default: gp_tile(job, g, decoded, QT, m0, GP_CAP(8), n0); break;                                 \
    }
#define GP_SWITCH_TYPE(qtype, BODY)                                                                  \
    switch (qtype) {                                                                                 \
    GG_INTEGER_CASES(BODY)                                                                           \
    default: BODY(GG_Q6_K) break;                                                                    \
    }

static float *gg_panel_buffer(int64_t floats);   /* (gguf_linear.c: a thread's buffer) */

/* A work item's rows: where a call's records (its quantized x, rows x pieces x GP_REC bytes) pass
 * this, its rows are split evenly, in whole tiles, into the fewest blocks whose records stay within
 * it, and each work item is a run of groups over one block (the blocks in turn, every group of one
 * before the next; gp_linear says how long a run). A group over all rows streamed all the records through the cache once a group: at
 * 2,048 rows and K = 1,536 (6 MiB of records) SmolLM2's down projection ran at 96-110 GFLOP/s in
 * about half the timings, against 147-200 blocked, and never below 147 blocked; at 1,024 rows
 * (3 MiB, now 2 blocks) and below either way within this machine's noise (Q5_0, Q6_K, 2 threads,
 * interleaved; AMD EPYC, avx2-or-less). Each block decodes its group again (gp_decode_group: about a
 * row tile's work, against a block's dozens). The tiles and their row tiles are the same, so are the
 * bits. */
#ifndef GP_BLOCK_BYTES
#define GP_BLOCK_BYTES (2 << 20)
#endif
static int gp_block_rows(int rows, int pieces) {
    const int64_t fit = GP_BLOCK_BYTES / ((int64_t)pieces * GP_REC) / GP_MR * GP_MR;
    if (rows <= fit) return rows;
    const int64_t most = fit < GP_MR ? GP_MR : fit, blocks = (rows + most - 1) / most;
    return (int)((rows + blocks - 1) / blocks + GP_MR - 1) / GP_MR * GP_MR;
}

/* Runs of x a quantizing item (even: a piece's two runs in one item) */
#define GP_QUANTIZE_RUNS 128

static void *gp_worker(void *arg) {
    gp_job *job = arg;
    for (;;) {   /* first x's quantization, shared as the groups are; then every worker waits for all of it */
        const int64_t first = __atomic_fetch_add(&job->next_runs, GP_QUANTIZE_RUNS, __ATOMIC_RELAXED);
        if (first >= job->runs) break;
        const int64_t last = first + GP_QUANTIZE_RUNS < job->runs ? first + GP_QUANTIZE_RUNS : job->runs;
        gp_quantize(job->x, first, last, job->in);
        __atomic_add_fetch(&job->runs_done, last - first, __ATOMIC_RELEASE);
    }
    for (int i = 1; __atomic_load_n(&job->runs_done, __ATOMIC_ACQUIRE) < job->runs; ++i) {
        cpu_relax();   /* (another worker is quantizing its last item) */
        if (i % 4096 == 0) sched_yield();
    }
    const int64_t row_bytes = (int64_t)(job->depth / GG_QK(job->qtype)) * GG_BYTES(job->qtype);
    const int64_t own_bytes = job->packed ? 0 : (GP_COLS * row_bytes + 63) / 64 * 64;
    const int decode = job->rows > gp_decode_rows(job->qtype);   /* many row tiles a group: decoded once a block */
    const int64_t bytes = own_bytes + (decode ? (int64_t)(job->depth / 32) * GP_DECODED : 0);
    uint8_t *buffer = bytes ? (uint8_t *)gg_panel_buffer((bytes + 3) / 4) : NULL;
    if (bytes && buffer == NULL) {
        __atomic_store_n(&job->failed, 1, __ATOMIC_RELAXED);
        return NULL;
    }
    uint8_t *own = buffer, *decoded = decode ? buffer + own_bytes : NULL;
    for (;;) {
        const int64_t item = __atomic_fetch_add(&job->next, 1, __ATOMIC_RELAXED);
        const int64_t block = item / job->items_per_block, first = item % job->items_per_block * job->per_item;
        const int row0 = (int)(block * job->block_rows);
        if (row0 >= job->rows) return NULL;
        const int row_end = job->rows - row0 < job->block_rows ? job->rows : row0 + job->block_rows;
        const int64_t last = first + job->per_item < job->groups ? first + job->per_item : job->groups;
        for (int64_t gi = first; gi < last; ++gi) {
            const int n0 = (int)gi * GP_COLS;
            const uint8_t *g = job->w + gi * GP_COLS * row_bytes;
            if (!job->packed) {   /* the file's rows: this group packed into the thread's buffer */
                gp_pack_group(g, row_bytes, job->cols - n0 < GP_COLS ? job->cols - n0 : GP_COLS, job->depth,
                              job->qtype, own);
                g = own;
            }
            if (decoded != NULL) gp_decode_group(g, job->qtype, job->depth, job->in->swap, decoded);
            for (int m0 = row0; m0 < row_end; m0 += GP_MR) {
                const int mr = row_end - m0 < GP_MR ? row_end - m0 : GP_MR;
                GP_SWITCH_TYPE(job->qtype, GP_ROWS)
            }
        }
    }
}
#undef GP_ROWS
#undef GP_CAP
#undef GP_SWITCH_TYPE

/* x [rows, depth] float32 times W [cols, depth] packed by fdplug_gguf_pack from blocks of qtype ->
 * out [rows, cols] at row stride ld, on up to num_threads threads; packed = 0: W the file's rows
 * [cols, row bytes] instead, each group of 16 packed as the call reaches it (the same tiles, the same
 * bits: a layer the loader could not pack, or the tied embedding table as the lm_head). Returns 0,
 * -2 for a type it does not take, packed cols not a multiple of 16 or a depth not of whole blocks,
 * -3 without memory for the quantized x or a group buffer (then some outputs may be unwritten). */
static int gp_linear(const float *x, const uint8_t *w, float *out, int64_t ld, int rows, int cols, int depth,
                     int qtype, int packed, int num_threads) {
    if (!gp_packable(qtype) || (packed && cols % GP_COLS) || depth <= 0 || depth % GG_QK(qtype)) return -2;
    if (rows <= 0 || cols <= 0) return 0;
    const int64_t values = (int64_t)rows * depth, bytes = gp_record_bytes(rows, depth / 32);
    uint8_t small[GG_SMALL_X / 32 * GP_REC] __attribute__((aligned(64)));
    uint8_t *rec = bytes > (int64_t)sizeof small ? malloc((size_t)bytes) : small;
    if (rec == NULL) return -3;
    const int swap = gp_swapped(qtype, rows);
    gp_inputs in = {rec, depth / 32, GP_SIGNED(qtype) || swap ? 0 : gp_offset(qtype), swap,
                    rows < GP_MR ? rows : GP_MR};
    const int groups = (cols + GP_COLS - 1) / GP_COLS, block_rows = gp_block_rows(rows, depth / 32);
    const int64_t items = (int64_t)groups * ((rows + block_rows - 1) / block_rows);
    const int threads = num_threads < items ? (num_threads > 0 ? num_threads : 1) : (int)items;
    /* Work items: about 4 a thread at every row count, each a run of groups over a block of rows
     * (gp_block_rows), as many for each thread (SmolLM2's 36 groups: 12 items of 3), so that a thread
     * reads its weights in order and the threads still end together. Until 2026-12-01 above GP_MR
     * rows each item was one group (measured on AMD EPYC, avx2-or-less: 16-256 rows 0.97-1.13x of 4
     * items a thread); on AMD EPYC, avx512 (Zen 5), capped to AVX2, runs of groups took 0.57-0.88x
     * the time on the Q8_0 lm_head (49152 x 576) at 16-64 rows, 0.67-0.97x on SmolLM2's layers at
     * 9-32 rows, 0.83-1.0x at 48-512 (Q8_0, Q6_K most), the rest within noise; at AVX-512 0.82-1.0x
     * (2 threads, `bench/kernel_ab.py`, interleaved; the same bits). Items of 4 groups were 1.05-1.24x
     * slower than these there, 2 items a thread within noise. A group's work at one row was 10-16%
     * slower when the items were single groups (the weights not read in order). */
    int per_item = groups / (4 * threads);
    while (per_item > 1 && (groups + per_item - 1) / per_item % threads != 0) --per_item;
    per_item = per_item > 0 ? per_item : 1;
    gp_job job = {&in, w, out, ld, 0, rows, cols, groups, depth, qtype, per_item, block_rows,
                  (groups + per_item - 1) / per_item, packed, 0, x, values / GP_RUN, 0, 0};
    run_workers(gp_worker, &job, threads);
    if (rec != small) free(rec);
    return job.failed ? -3 : 0;
}
