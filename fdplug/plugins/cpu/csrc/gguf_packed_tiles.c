/* ---------------------------------------------------------------------------------------------
 * gguf_packed.c's tiles, at two widths: a group's 16 columns in one 512-bit vector of int32 lanes
 * (AVX-512 BW; vpdpbusd with VNNI), or in two 256-bit halves of 8 (AVX2; vpdpbusd with AVX-VNNI,
 * else vpmaddubsw + vpmaddwd + vpaddd). Every lane does the same operations at both widths: each run's
 * integer sum is exact whichever instructions add it, and the float steps are the same per lane, so
 * every level gives the same bits (tests/test_cpu_gguf_packed_kernel.py compares the builds).
 *
 * Without VNNI, vpmaddubsw's int16 pair sums saturate for Q8_0's bytes offset by 128 (255 * 127 * 2):
 * its weights go signed there (q, |q| against x with q's sign: at most 128 * 127 * 2), and the sum
 * starts at 0 instead of -128 * sum(x's integers): the same integer. At AVX2 without VNNI a decoded
 * group of every other type takes the operands' roles swapped (gp_tile_swapped: the inputs unsigned
 * as q + 128, the weights signed from memory), again the same integers.
 * Included by gguf_packed.c (gp_job, gp_inputs, the layout's helpers), after gguf_q8.c (its integer
 * dot products, gg_dot4_add and gg_dot4_add_512).
 * ------------------------------------------------------------------------------------------- */

#ifdef GG_Q8_512   /* (gguf_q8.c: AVX-512 BW, VL and DQ) */
#define GP_HALVES 1          /* vectors a group's 16 columns take */
typedef __m512i gp_vi;
typedef __m512 gp_vf;
static inline gp_vi gp_load(const uint8_t *p) { return _mm512_loadu_si512((const void *)p); }
static inline gp_vi gp_set1(int32_t v) { return _mm512_set1_epi32(v); }
static inline gp_vi gp_and(gp_vi a, gp_vi b) { return _mm512_and_si512(a, b); }
static inline gp_vi gp_srli4(gp_vi a) { return _mm512_srli_epi16(a, 4); }
static inline gp_vi gp_set8(int v) { return _mm512_set1_epi8((char)v); }
static inline gp_vi gp_abs8(gp_vi a) { return _mm512_abs_epi8(a); }
static inline gp_vi gp_xor80(gp_vi a) { return _mm512_xor_si512(a, _mm512_set1_epi8((char)0x80)); }
static inline gp_vi gp_sign8(gp_vi x, gp_vi s) {   /* x where s > 0, -x where s < 0, 0 where s == 0 */
    const gp_vi neg = _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(s), _mm512_setzero_si512(), x);
    return _mm512_maskz_mov_epi8(_mm512_test_epi8_mask(s, s), neg);
}
/* bit plane's 64 bits m (quad q of 16 columns) added into half h's bytes as bit (0x10 << plane) */
static inline gp_vi gp_plane(gp_vi v, uint64_t m, int h, int plane) {
    (void)h;
    return _mm512_mask_add_epi8(v, (__mmask64)m, v, _mm512_set1_epi8((char)(0x10 << plane)));
}
static inline gp_vi gp_dot(gp_vi acc, gp_vi u, gp_vi s) { return gg_dot4_add_512(acc, u, s); }
static inline gp_vi gp_pairs16(gp_vi u, gp_vi s) { return _mm512_maddubs_epi16(u, s); }
static inline gp_vi gp_add16(gp_vi a, gp_vi b) { return _mm512_add_epi16(a, b); }
static inline gp_vi gp_widen_add(gp_vi acc, gp_vi t) { return _mm512_add_epi32(acc, _mm512_madd_epi16(t, _mm512_set1_epi16(1))); }
static inline gp_vf gp_f(gp_vi a) { return _mm512_cvtepi32_ps(a); }
static inline gp_vf gp_fset1(float v) { return _mm512_set1_ps(v); }
static inline gp_vf gp_fzero(void) { return _mm512_setzero_ps(); }
static inline gp_vf gp_mul(gp_vf a, gp_vf b) { return _mm512_mul_ps(a, b); }
static inline gp_vf gp_fma(gp_vf a, gp_vf b, gp_vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline gp_vf gp_fload(const float *p) { return _mm512_loadu_ps(p); }
static inline gp_vf gp_f16(const uint8_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
/* lanes [0, valid) of a + b at out */
static inline void gp_store(float *out, gp_vf a, gp_vf b, int valid) {
    if (valid > 0) _mm512_mask_storeu_ps(out, valid >= 16 ? 0xFFFF : (__mmask16)((1u << valid) - 1), _mm512_add_ps(a, b));
}
#else
#define GP_HALVES 2
typedef __m256i gp_vi;
typedef __m256 gp_vf;
static inline gp_vi gp_load(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline gp_vi gp_set1(int32_t v) { return _mm256_set1_epi32(v); }
static inline gp_vi gp_and(gp_vi a, gp_vi b) { return _mm256_and_si256(a, b); }
static inline gp_vi gp_srli4(gp_vi a) { return _mm256_srli_epi16(a, 4); }
static inline gp_vi gp_set8(int v) { return _mm256_set1_epi8((char)v); }
static inline gp_vi gp_abs8(gp_vi a) { return _mm256_abs_epi8(a); }
static inline gp_vi gp_xor80(gp_vi a) { return _mm256_xor_si256(a, _mm256_set1_epi8((char)0x80)); }
static inline gp_vi gp_sign8(gp_vi x, gp_vi s) { return _mm256_sign_epi8(x, s); }
static inline gp_vi gp_dot(gp_vi acc, gp_vi u, gp_vi s) { return gg_dot4_add(acc, u, s); }
static inline gp_vi gp_pairs16(gp_vi u, gp_vi s) { return _mm256_maddubs_epi16(u, s); }
static inline gp_vi gp_add16(gp_vi a, gp_vi b) { return _mm256_add_epi16(a, b); }
static inline gp_vi gp_widen_add(gp_vi acc, gp_vi t) { return _mm256_add_epi32(acc, _mm256_madd_epi16(t, _mm256_set1_epi16(1))); }
static inline gp_vf gp_f(gp_vi a) { return _mm256_cvtepi32_ps(a); }
static inline gp_vf gp_fset1(float v) { return _mm256_set1_ps(v); }
static inline gp_vf gp_fzero(void) { return _mm256_setzero_ps(); }
static inline gp_vf gp_mul(gp_vf a, gp_vf b) { return _mm256_mul_ps(a, b); }
static inline gp_vf gp_fma(gp_vf a, gp_vf b, gp_vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline gp_vf gp_fload(const float *p) { return _mm256_loadu_ps(p); }
static inline gp_vf gp_f16(const uint8_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
static inline void gp_store(float *out, gp_vf a, gp_vf b, int valid) {
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    _mm256_maskstore_ps(out, _mm256_cmpgt_epi32(_mm256_set1_epi32(valid), lanes), _mm256_add_ps(a, b));
}
#endif
#define GP_LANES (GP_COLS / GP_HALVES)   /* columns a vector */
#define GP_VBYTES (64 / GP_HALVES)       /* bytes of a 64-byte layout vector a half takes */
#ifdef GP_VNNI
#define GP_SIGNED(QT) 0                  /* Q8_0's bytes offset by 128, as stored */
#define GP_DECODED (8 * 64 + 3 * 64)     /* bytes a decoded piece takes (gp_decode_group) */
#else
#define GP_SIGNED(QT) ((QT) == GG_Q8_0)  /* Q8_0 as signed bytes (vpmaddubsw) */
#define GP_DECODED (16 * 64 + 3 * 64)    /* (and Q8_0's signs; or gp_swap_piece's two runs' starts) */
#endif

/* A piece's integers (v: per half, the 8 quads' vectors; Q8_0 without VNNI: |q|, s its signs) and
 * factors (dw0, and Q6_K's second run's dw1; ow the min), as the tiles multiply them */
typedef struct {
    gp_vi v[GP_HALVES][8], s[GP_HALVES][8];
    gp_vf dw0[GP_HALVES], dw1[GP_HALVES], ow[GP_HALVES];
} gp_piece;

/* Half h of the piece's integers at p (the group layout) */
static inline __attribute__((always_inline)) void gp_unpack(const uint8_t *p, const int QT, int h, gp_piece *e) {
    if (QT == GG_Q8_0) {
        for (int q = 0; q < 8; ++q) {
            const gp_vi u = gp_load(p + 64 * q + GP_VBYTES * h);
            if (GP_SIGNED(QT)) {   /* q = u ^ 0x80 */
                e->s[h][q] = gp_xor80(u);
                e->v[h][q] = gp_abs8(e->s[h][q]);
            } else {
                e->v[h][q] = u;
            }
        }
        return;
    }
    const gp_vi low = gp_set8(0x0F);
    for (int i = 0; i < 4; ++i) {
        const gp_vi b = gp_load(p + 64 * i + GP_VBYTES * h);
        e->v[h][2 * i] = gp_and(b, low);
        e->v[h][2 * i + 1] = gp_and(gp_srli4(b), low);
    }
    for (int plane = 0; plane < gp_planes(QT); ++plane) {
#ifdef GP_PLANE_MASKS
        for (int q = 0; q < 8; ++q) {
            uint64_t m;
            memcpy(&m, p + 256 + 64 * plane + 8 * q, 8);
            e->v[h][q] = gp_plane(e->v[h][q], m, h, plane);   /* (the bit is clear: add = or) */
        }
#else   /* (gp_put_planes: bit q of a lane's byte is quad q's, moved to bit 4 + plane) */
        const gp_vi bits = gp_load(p + 256 + 64 * plane + GP_VBYTES * h), one = gp_set8(0x10 << plane);
        for (int q = 0; q < 8; ++q) {
            const int to = 4 + plane;   /* (16-bit shifts: what crosses a byte lands below bit `to` or above it) */
            const gp_vi moved = q <= to ? _mm256_slli_epi16(bits, to - q) : _mm256_srli_epi16(bits, q - to);
            e->v[h][q] = _mm256_or_si256(e->v[h][q], gp_and(moved, one));
        }
#endif
    }
}

/* The K-quants' factors of a super-block's 16 columns (headers at h, gp_pack_group's: a field of all
 * 16 columns a load): dw[s][c] and ow[s][c] for Q4_K/Q5_K's 8 pieces (ow = -dmin * mn), dw[r][c] for
 * Q6_K's 16 runs. A column at a time, then the stores into columns, had been a third of a one-row
 * Q4_K call. */
static void gp_k_factors(const uint8_t *h, int QT, float dw[16][GP_COLS], float ow[8][GP_COLS]) {
    if (QT == GG_Q6_K) {   /* the header: scale i of the 16 columns at 16 i (int8), then their d */
        const __m256 d0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + 256)));
        const __m256 d1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + 272)));
        for (int i = 0; i < 16; ++i) {   /* d * (float)scale, as a scalar product: the same bits */
            const __m128i sc = _mm_loadu_si128((const __m128i *)(h + 16 * i));
            _mm256_storeu_ps(dw[i], _mm256_mul_ps(d0, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc))));
            _mm256_storeu_ps(dw[i] + 8, _mm256_mul_ps(d1, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8)))));
        }
        return;
    }
    /* Q4_K, Q5_K: the 6-bit fields of ggml's get_scale_min_k4 from byte k of all columns at 16 k (scale
     * and min j < 4: bytes j and j + 4, low 6 bits; j >= 4: the low or high nibble of byte j + 4 and the
     * top 2 bits of byte j - 4 or j), then d * sc and -(dmin * m): gg_k_scales_sse's products */
    const __m256 d0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + 192)));
    const __m256 d1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + 208)));
    const __m256 m0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + 224)));
    const __m256 m1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + 240)));
    const __m128i six = _mm_set1_epi8(0x3F), four = _mm_set1_epi8(0x0F), top = _mm_set1_epi8(0x30);
    const __m256 negate = _mm256_set1_ps(-0.0f);
    __m128i q[12];
    for (int k = 0; k < 12; ++k) q[k] = _mm_loadu_si128((const __m128i *)(h + 16 * k));
    for (int j = 0; j < 8; ++j) {
        const __m128i sc = j < 4 ? _mm_and_si128(q[j], six)
                                 : _mm_or_si128(_mm_and_si128(q[j + 4], four), _mm_and_si128(_mm_srli_epi16(q[j - 4], 2), top));
        const __m128i mn = j < 4 ? _mm_and_si128(q[j + 4], six)
                                 : _mm_or_si128(_mm_and_si128(_mm_srli_epi16(q[j + 4], 4), four),
                                                _mm_and_si128(_mm_srli_epi16(q[j], 2), top));
        _mm256_storeu_ps(dw[j], _mm256_mul_ps(d0, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sc))));
        _mm256_storeu_ps(dw[j] + 8, _mm256_mul_ps(d1, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(sc, 8)))));
        _mm256_storeu_ps(ow[j], _mm256_xor_ps(negate, _mm256_mul_ps(m0, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(mn)))));
        _mm256_storeu_ps(ow[j] + 8, _mm256_xor_ps(negate, _mm256_mul_ps(m1, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(mn, 8))))));
    }
}

/* Half h's factors of a 32-weight type's piece whose 16 float16 d (then m) are at scales */
static inline __attribute__((always_inline)) void gp_block_factors(const uint8_t *scales, const int QT, int h,
                                                                   gp_piece *e) {
    e->dw0[h] = e->dw1[h] = gp_f16(scales + 2 * GP_LANES * h);
    e->ow[h] = gp_has_min(QT) ? gp_f16(scales + 32 + 2 * GP_LANES * h) : gp_fzero();
}

/* Piece p of the group at g (K-quants: dws, ows hold its super-block's factors, gp_k_factors) */
static inline __attribute__((always_inline)) void gp_piece_at(const uint8_t *g, const int QT, int p,
                                                              const float dws[16][GP_COLS],
                                                              const float ows[8][GP_COLS], gp_piece *e) {
    const int64_t unit = (int64_t)GP_COLS * GG_BYTES(QT);
    for (int h = 0; h < GP_HALVES; ++h) {
        if (GG_QK(QT) == 32) {
            const uint8_t *u = g + p * unit, *scales = u + gp_piece_bytes(QT);
            gp_unpack(u, QT, h, e);
            gp_block_factors(scales, QT, h, e);
            continue;
        }
        const int j = p % 8;
        gp_unpack(g + (p / 8) * unit + GP_COLS * gp_header(QT) + j * gp_piece_bytes(QT), QT, h, e);
        e->dw0[h] = gp_fload(dws[QT == GG_Q6_K ? 2 * j : j] + GP_LANES * h);
        e->dw1[h] = QT == GG_Q6_K ? gp_fload(dws[2 * j + 1] + GP_LANES * h) : e->dw0[h];
        e->ow[h] = QT == GG_Q6_K ? gp_fzero() : gp_fload(ows[j] + GP_LANES * h);
    }
}

#ifdef GP_SWAP
/* A piece's integers decoded for gp_run_swapped at d: less the type's offset, as signed bytes w (8
 * vectors of 64 bytes), and each run's start -128 * sum(w) of each column (int32, 16 lanes a run, at
 * 704 and 768) */
static inline void gp_swap_piece(const gp_piece *e, const int QT, uint8_t *d) {
    const __m256i off = _mm256_set1_epi8((char)gp_offset(QT)), ones8 = _mm256_set1_epi8(1);
    for (int h = 0; h < GP_HALVES; ++h) {
        for (int j = 0; j < 2; ++j) {
            __m256i sum = _mm256_setzero_si256();
            for (int q = 4 * j; q < 4 * j + 4; ++q) {
                const __m256i w = _mm256_sub_epi8(e->v[h][q], off);
                _mm256_storeu_si256((__m256i *)(d + 64 * q + GP_VBYTES * h), w);
                sum = _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, w), _mm256_set1_epi16(1)));
            }
            _mm256_storeu_si256((__m256i *)(d + 704 + 64 * j + GP_VBYTES * h),
                                _mm256_slli_epi32(_mm256_sub_epi32(_mm256_setzero_si256(), sum), 7));
        }
    }
}
#else
static inline void gp_swap_piece(const gp_piece *e, const int QT, uint8_t *d) { (void)e, (void)QT, (void)d; }
#endif

/* Every piece of the group at g, decoded into buf (GP_DECODED bytes a piece: its integers as 8
 * vectors of 64 bytes, dw0, dw1 and ow as 16 floats each, then without VNNI Q8_0's signs; swap, a
 * call gp_swapped: gp_swap_piece's): where more than one row tile passes over a group, each then
 * loads what gp_piece_at would compute again */
static void gp_decode_group(const uint8_t *g, int QT, int depth, int swap, uint8_t *buf) {
    float dws[16][GP_COLS], ows[8][GP_COLS];
    const int64_t unit = (int64_t)GP_COLS * GG_BYTES(QT);
#define GP_DECODE(T)                                                                                 \
    for (int p = 0; p < depth / 32; ++p) {                                                           \
        if (GG_QK(T) == 256 && p % 8 == 0) gp_k_factors(g + (p / 8) * unit, T, dws, ows);           \
        gp_piece e;                                                                                  \
        gp_piece_at(g, T, p, dws, ows, &e);                                                          \
        uint8_t *d = buf + (int64_t)p * GP_DECODED;                                                  \
        const int swapped = GP_SWAPS(T) && swap;                                                     \
        if (swapped) gp_swap_piece(&e, T, d);                                                        \
        for (int h = 0; h < GP_HALVES; ++h) {                                                        \
            for (int q = 0; q < 8 && !swapped; ++q) {   /* (swapped: gp_swap_piece's integers) */    \
                memcpy(d + 64 * q + GP_VBYTES * h, &e.v[h][q], GP_VBYTES);                          \
                if (GP_SIGNED(T)) memcpy(d + 704 + 64 * q + GP_VBYTES * h, &e.s[h][q], GP_VBYTES);  \
            }                                                                                        \
            memcpy(d + 512 + 4 * GP_LANES * h, &e.dw0[h], GP_VBYTES);                               \
            memcpy(d + 576 + 4 * GP_LANES * h, &e.dw1[h], GP_VBYTES);                               \
            memcpy(d + 640 + 4 * GP_LANES * h, &e.ow[h], GP_VBYTES);                                \
        }                                                                                            \
    }
    switch (QT) {
    GG_INTEGER_CASES(GP_DECODE)
    default: GP_DECODE(GG_Q6_K) break;
    }
#undef GP_DECODE
}

/* A 4-byte value at p, broadcast to every lane */
static inline gp_vi gp_bcast(const uint8_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return gp_set1(v);
}
static inline float gp_float_at(const uint8_t *p) {
    float v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* Run j's integer sums of both halves (quads 4j .. 4j + 3 of each half's weight vectors; Q8_0
 * without VNNI: e->s their signs) against the inputs of a row's record rec (gp_inputs), from the
 * record's start (-offset * qs), into acc[h]. Each input quad is broadcast once for both halves (a
 * broadcast per half was a third of the AVX2 tile's loads). With VNNI one vpdpbusd a quad. Without,
 * vpmaddubsw's int16 pair sums of quads are added as int16 where they cannot overflow (inputs |q| <=
 * 127: 4 quads of weights below 32 at most 31,496, 2 of Q6_K's below 64), then widened by one
 * vpmaddwd; Q8_0 (|w| against q with w's sign: |w| <= 128) a quad at a time. The same integers
 * either way. */
static inline __attribute__((always_inline)) void gp_run(const gp_piece *e, int j, const uint8_t *rec, const int QT,
                                                         gp_vi acc[GP_HALVES]) {
    const uint8_t *x = rec + 16 * j;
    const gp_vi start = gp_bcast(rec + 40 + 4 * j);
    for (int h = 0; h < GP_HALVES; ++h) acc[h] = start;
#ifdef GP_VNNI
    (void)QT;   /* (every type alike) */
    for (int q = 0; q < 4; ++q) {
        const gp_vi b = gp_bcast(x + 4 * q);
        for (int h = 0; h < GP_HALVES; ++h) acc[h] = gp_dot(acc[h], e->v[h][4 * j + q], b);
    }
#else
    const int per = QT == GG_Q8_0 ? 1 : QT == GG_Q6_K ? 2 : 4;
    for (int q = 0; q < 4; q += per) {
        const gp_vi b = gp_bcast(x + 4 * q);
        gp_vi t[GP_HALVES];
        for (int h = 0; h < GP_HALVES; ++h)
            t[h] = gp_pairs16(e->v[h][4 * j + q], GP_SIGNED(QT) ? gp_sign8(b, e->s[h][4 * j + q]) : b);
        for (int i = q + 1; i < q + per; ++i) {
            const gp_vi bi = gp_bcast(x + 4 * i);
            for (int h = 0; h < GP_HALVES; ++h) t[h] = gp_add16(t[h], gp_pairs16(e->v[h][4 * j + i], bi));
        }
        for (int h = 0; h < GP_HALVES; ++h) acc[h] = gp_widen_add(acc[h], t[h]);
    }
#endif
}

/* A row's runs' integer sums a0, a1 (both halves) times the inputs' scales (record x) and the
 * piece's factors, added into the row's accumulators acc of the piece's chain: the float steps */
static inline __attribute__((always_inline)) void gp_scale_add(gp_vf acc[GP_HALVES], const gp_vi a0[GP_HALVES],
                                                               const gp_vi a1[GP_HALVES], const uint8_t *x,
                                                               const gp_piece *e, const int QT) {
    const gp_vf d0 = gp_fset1(gp_float_at(x + 32)), d1 = gp_fset1(gp_float_at(x + 36));
    const gp_vf sx = gp_has_min(QT) ? gp_fset1(gp_float_at(x + 48)) : gp_fzero();
    for (int h = 0; h < GP_HALVES; ++h) {   /* (both halves take the row's broadcast inputs) */
        const gp_vf s0 = gp_mul(gp_f(a0[h]), d0);
        gp_vf *a = &acc[h];
        if (QT == GG_Q6_K) {
            *a = gp_fma(s0, e->dw0[h], *a);
            *a = gp_fma(gp_mul(gp_f(a1[h]), d1), e->dw1[h], *a);
        } else {
            *a = gp_fma(gp_fma(gp_f(a1[h]), d1, s0), e->dw0[h], *a);
            if (gp_has_min(QT)) *a = gp_fma(e->ow[h], sx, *a);
        }
    }
}

/* Rows m0 .. m0 + MR - 1's accumulators, both chains added, into out's columns n0 .. n0 + 15 (those below job->cols) */
static inline __attribute__((always_inline)) void gp_store_rows(const gp_job *job, gp_vf acc[GP_MR][2][GP_HALVES],
                                                                int m0, const int MR, int n0) {
    for (int r = 0; r < MR; ++r)
        for (int h = 0; h < GP_HALVES; ++h)
            gp_store(job->out + (int64_t)(m0 + r) * job->ld + n0 + GP_LANES * h, acc[r][0][h], acc[r][1][h],
                     job->cols - n0 - GP_LANES * h);
}

/* A decoded piece's factors at d (dw0, dw1, ow: gp_decode_group's) into e */
static inline __attribute__((always_inline)) void gp_factors_at(const uint8_t *d, const int QT, gp_piece *e) {
    for (int h = 0; h < GP_HALVES; ++h) {
        e->dw0[h] = gp_fload((const float *)(d + 512) + GP_LANES * h);
        e->dw1[h] = QT == GG_Q6_K ? gp_fload((const float *)(d + 576) + GP_LANES * h) : e->dw0[h];
        e->ow[h] = gp_has_min(QT) ? gp_fload((const float *)(d + 640) + GP_LANES * h) : gp_fzero();
    }
}

#ifdef GP_SWAP
/* Run j's integer sums of both halves, the roles swapped: the record's inputs as unsigned bytes
 * (q + 128, broadcast) against the decoded piece's signed weights w at d (vpmaddubsw's memory operand,
 * so no weight takes a register or a load of its own), from the run's start -128 * sum(w). Each
 * column's sum is then sum((q + 128) * w) - 128 * sum(w) = sum(q * w): gp_run's integer. int16 pair
 * sums cannot saturate: |w| <= 16 (Q4_0, Q4_1, Q4_K, Q5_0) gives 4 quads at most 4 * 2 * 255 * 16 =
 * 32,640; Q5_1, Q5_K (w <= 31) and Q6_K (|w| <= 32) 2 quads. Q8_0's |w| <= 128 saturates a pair:
 * its groups keep gp_run's signed route. */
static inline __attribute__((always_inline)) void gp_run_swapped(const uint8_t *d, int j, const uint8_t *rec,
                                                                 const int QT, gp_vi acc[GP_HALVES]) {
    const uint8_t *u = rec + 16 * j;
    const int per = QT == GG_Q6_K || QT == GG_Q5_1 || QT == GG_Q5_K ? 2 : 4;
    for (int h = 0; h < GP_HALVES; ++h) acc[h] = gp_load(d + 704 + 64 * j + GP_VBYTES * h);
    for (int q = 0; q < 4; q += per) {
        gp_vi t[GP_HALVES];
        for (int i = q; i < q + per; ++i) {
            const gp_vi b = gp_bcast(u + 4 * i);
            for (int h = 0; h < GP_HALVES; ++h) {
                const gp_vi m = gp_pairs16(b, gp_load(d + 64 * (4 * j + i) + GP_VBYTES * h));
                t[h] = i == q ? m : gp_add16(t[h], m);
            }
        }
        for (int h = 0; h < GP_HALVES; ++h) acc[h] = gp_widen_add(acc[h], t[h]);
    }
}

/* gp_tile over a decoded group, the roles swapped (gp_run_swapped): the same integers, the same float
 * steps, so the same bits. At AVX2 the 16 weight vectors of gp_tile do not stay in 16 registers beside
 * a row's work and were loaded again each row (14 of a row and piece's 89 instructions, Q4_1); here
 * each weight load is part of its multiply */
static inline __attribute__((always_inline)) void gp_tile_swapped(const gp_job *job, const uint8_t *decoded,
                                                                  const int QT, int m0, const int MR, int n0) {
    const gp_inputs *in = job->in;
    gp_vf acc[GP_MR][2][GP_HALVES];
    for (int r = 0; r < MR; ++r)
        for (int h = 0; h < GP_HALVES; ++h) acc[r][0][h] = acc[r][1][h] = gp_fzero();
    const uint8_t *records = gp_tile_records(in, m0);
    for (int p = 0; p < job->depth / 32; ++p) {
        const uint8_t *d = decoded + (int64_t)p * GP_DECODED;
        gp_piece e;
        gp_factors_at(d, QT, &e);
        const int C = p & 1;
        const uint8_t *rec = records + (int64_t)p * in->height * GP_REC;
        GG_UNROLL
        for (int r = 0; r < MR; ++r) {
            const uint8_t *x = rec + r * GP_REC;
            gp_vi a0[GP_HALVES], a1[GP_HALVES];
            gp_run_swapped(d, 0, x, QT, a0);
            gp_run_swapped(d, 1, x, QT, a1);
            gp_scale_add(acc[r][C], a0, a1, x, &e, QT);
        }
    }
    gp_store_rows(job, acc, m0, MR, n0);
}
#endif

#ifdef GP_SWAP
/* gp_tile for Q8_0 at AVX2 without VNNI (its bytes signed: vpmaddubsw on |w| against the inputs
 * with w's sign), from the packed group (gp_decode_rows: it never decodes), a run and a half at a
 * time: the run's 4 quads of w and |w| in that half stay in 8 registers while every row of the tile
 * takes them. gp_tile's loop holds a piece's 32 such vectors (8 quads, 2 halves), past AVX2's 16
 * registers, so each row loaded them again from the stack. The same integer sums (each quad's pair
 * sums widened as gp_run's), the same float steps: the same bits. Against gp_tile (decoding above
 * 32 rows): 0.80-0.90x the time on SmolLM2's Q8_0 shapes at 1-64 rows, 0.84-1.02x at 1,024,
 * 0.93-0.97x on its 49152 x 576 lm_head at 64 rows (2 threads, interleaved; AMD EPYC,
 * avx2-or-less). */
static inline __attribute__((always_inline)) void gp_tile_q8_signed(const gp_job *job, const uint8_t *g, int m0,
                                                                    const int MR, int n0) {
    const gp_inputs *in = job->in;
    const int64_t unit = (int64_t)GP_COLS * GG_BYTES(GG_Q8_0);
    const uint8_t *records = gp_tile_records(in, m0);
    gp_vf acc[GP_MR][2][GP_HALVES];
    for (int r = 0; r < MR; ++r)
        for (int h = 0; h < GP_HALVES; ++h) acc[r][0][h] = acc[r][1][h] = gp_fzero();
    for (int p = 0; p < job->depth / 32; ++p) {
        const uint8_t *u = g + p * unit;
        gp_piece e;   /* (its factors only) */
        for (int h = 0; h < GP_HALVES; ++h) gp_block_factors(u + gp_piece_bytes(GG_Q8_0), GG_Q8_0, h, &e);
        const uint8_t *rec = records + (int64_t)p * in->height * GP_REC;
        gp_vi sums[GP_MR][2][GP_HALVES];   /* each row's runs' integer sums (from 0: no offset) */
        for (int j = 0; j < 2; ++j) {
            for (int h = 0; h < GP_HALVES; ++h) {
                gp_vi w[4], mag[4];   /* the run's quads of this half: w, |w| */
                for (int q = 0; q < 4; ++q) {
                    w[q] = gp_xor80(gp_load(u + 64 * (4 * j + q) + GP_VBYTES * h));
                    mag[q] = gp_abs8(w[q]);
                }
                GG_UNROLL
                for (int r = 0; r < MR; ++r) {
                    const uint8_t *x = rec + r * GP_REC + 16 * j;
                    gp_vi a = gp_set1(0);
                    for (int q = 0; q < 4; ++q) a = gp_widen_add(a, gp_pairs16(mag[q], gp_sign8(gp_bcast(x + 4 * q), w[q])));
                    sums[r][j][h] = a;
                }
            }
        }
        const int C = p & 1;
        for (int r = 0; r < MR; ++r) gp_scale_add(acc[r][C], sums[r][0], sums[r][1], rec + r * GP_REC, &e, GG_Q8_0);
    }
    gp_store_rows(job, acc, m0, MR, n0);
}
#endif

/* Rows m0 .. m0 + MR - 1 of the 16 columns of the group at g (or, decoded != NULL, its pieces as
 * gp_decode_group left them), out's columns n0 .. n0 + 15 (those below job->cols) */
static inline __attribute__((always_inline)) void gp_tile(const gp_job *job, const uint8_t *g, const uint8_t *decoded,
                                                          const int QT, int m0, const int MR, int n0) {
#ifdef GP_SWAP
    if (GP_SWAPS(QT) && job->in->swap) {   /* (then decoded != NULL: gp_swapped) */
        gp_tile_swapped(job, decoded, QT, m0, MR, n0);
        return;
    }
    if (QT == GG_Q8_0) {   /* (never decoded here: gp_decode_rows) */
        gp_tile_q8_signed(job, g, m0, MR, n0);
        return;
    }
#endif
    const gp_inputs *in = job->in;
    const int pieces = job->depth / 32;
    const int64_t unit = (int64_t)GP_COLS * GG_BYTES(QT);
    const uint8_t *records = gp_tile_records(in, m0);
    float dws[16][GP_COLS], ows[8][GP_COLS];
    gp_vf acc[GP_MR][2][GP_HALVES];
    for (int r = 0; r < MR; ++r)
        for (int h = 0; h < GP_HALVES; ++h) acc[r][0][h] = acc[r][1][h] = gp_fzero();
    for (int p = 0; p < pieces; ++p) {
        gp_piece e;
        if (decoded != NULL) {
            const uint8_t *d = decoded + (int64_t)p * GP_DECODED;
            for (int h = 0; h < GP_HALVES; ++h) {
                for (int q = 0; q < 8; ++q) {
                    e.v[h][q] = gp_load(d + 64 * q + GP_VBYTES * h);
                    if (GP_SIGNED(QT)) e.s[h][q] = gp_load(d + 704 + 64 * q + GP_VBYTES * h);
                }
            }
            gp_factors_at(d, QT, &e);
        } else {
            if (GG_QK(QT) == 256 && p % 8 == 0) gp_k_factors(g + (p / 8) * unit, QT, dws, ows);
            gp_piece_at(g, QT, p, dws, ows, &e);
        }
        const int C = p & 1;   /* the chain */
        const uint8_t *rec = records + (int64_t)p * in->height * GP_REC;   /* row r's at r * GP_REC */
        gp_vi a0[GP_MR][GP_HALVES];   /* run 0 of every row, then run 1: a run's weights stay in registers */
        GG_UNROLL
        for (int r = 0; r < MR; ++r) gp_run(&e, 0, rec + r * GP_REC, QT, a0[r]);
        GG_UNROLL
        for (int r = 0; r < MR; ++r) {
            const uint8_t *x = rec + r * GP_REC;
            gp_vi a1[GP_HALVES];
            gp_run(&e, 1, x, QT, a1);
            gp_scale_add(acc[r][C], a0[r], a1, x, &e, QT);
        }
    }
    gp_store_rows(job, acc, m0, MR, n0);
}

