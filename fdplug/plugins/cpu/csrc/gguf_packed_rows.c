/* ---------------------------------------------------------------------------------------------
 * Rows of a packed weight (fdplug_gguf_pack's group layout) as floats: a tied GGUF embedding's token
 * rows read from the lm_head's packed copy, so that the model keeps one copy of the table.
 *
 * Values: gg_dequant_row's on the file's row (and so gguf_blocks.dequantize's): each weight is
 * fma(q, d, o) with gg_pair_of's integer q and factors d, o. The integers are read back from the
 * group (nibbles, bit planes, Q8_0's bytes as q ^ 0x80), a K-quant's header fields are put back in
 * the file's order and decoded by the same gg_k_scales_sse. A scalar loop: a step asks for its
 * tokens' rows only (a 2,048-token prefill step of SmolLM2 ~1.2 M weights, milliseconds against
 * the step's seconds).
 *
 * Included by gguf_packed.c (the layout's helpers), after gguf_bytes.c (gg_k_scales_sse).
 * ------------------------------------------------------------------------------------------- */

/* The stored integer (offset included; Q8_0: signed) of weight w of column c of the piece at p */
static inline int gp_integer_at(const uint8_t *p, int qtype, int c, int w) {
    const int q = w / 4, i = w % 4;
    if (qtype == GG_Q8_0) return (int8_t)(p[64 * q + 4 * c + i] ^ 0x80);
    const uint8_t byte = p[64 * (q / 2) + 4 * c + i];
    int u = q % 2 ? byte >> 4 : byte & 0x0F;
    for (int plane = 0; plane < gp_planes(qtype); ++plane) {
#ifdef GP_PLANE_MASKS   /* (gp_put_planes: a 64-bit mask a quad, bit 4c + i) */
        uint64_t m;
        memcpy(&m, p + 256 + 64 * plane + 8 * q, 8);
        u |= (int)((m >> (4 * c + i)) & 1) << (4 + plane);
#else                   /* (bit q of the lane's byte) */
        u |= ((p[256 + 64 * plane + 4 * c + i] >> q) & 1) << (4 + plane);
#endif
    }
    return u;
}

/* The K-quant super-block header of column c (at h, gp_pack_group's fields) in the file's bytes at
 * blk (Q4_K, Q5_K: d, dmin, the 12 scale bytes; Q6_K: the 16 scales at 192, d at 208), decoded */
static void gp_k_scales_of(const uint8_t *h, int qtype, int c, gg_scales *s) {
    uint8_t blk[256];   /* (a Q6_K block is 210 bytes) */
    if (qtype == GG_Q6_K) {
        for (int i = 0; i < 16; ++i) blk[192 + i] = h[GP_COLS * i + c];
        memcpy(blk + 208, h + GP_COLS * 16 + 2 * c, 2);
    } else {
        memcpy(blk, h + GP_COLS * 12 + 2 * c, 2);
        memcpy(blk + 2, h + GP_COLS * 14 + 2 * c, 2);
        for (int k = 0; k < 12; ++k) blk[4 + k] = h[GP_COLS * k + c];
    }
    gg_k_scales_sse(blk, qtype, s);
}

/* Row `row` (column row % 16 of group row / 16) of a packed weight of depth weights -> out[depth] */
static void gp_row(const uint8_t *packed, int qtype, int depth, int64_t row, float *out) {
    const int qk = GG_QK(qtype), bytes = GG_BYTES(qtype), c = (int)(row % GP_COLS);
    const int64_t unit = (int64_t)GP_COLS * bytes;
    const uint8_t *g = packed + row / GP_COLS * (depth / qk) * unit;
    gg_scales s;
    for (int b = 0; b < depth / qk; ++b) {
        const uint8_t *u = g + b * unit;
        if (qk == 256) gp_k_scales_of(u, qtype, c, &s);
        for (int j = 0; j < qk / 32; ++j) {
            const uint8_t *piece = qk == 32 ? u : u + GP_COLS * gp_header(qtype) + j * gp_piece_bytes(qtype);
            float d[2], o[2];   /* gg_pair_of's factors of the piece's two halves */
            if (qk == 32) {
                const uint8_t *scales = u + gp_piece_bytes(qtype);
                d[0] = gg_f16(scales + 2 * c);
                o[0] = gp_has_min(qtype) ? gg_f16(scales + 32 + 2 * c)
                       : qtype == GG_Q4_0 ? -8.0f * d[0] : qtype == GG_Q5_0 ? -16.0f * d[0] : 0.0f;
                d[1] = d[0], o[1] = o[0];
            } else if (qtype == GG_Q6_K) {
                for (int h = 0; h < 2; ++h) d[h] = s.d[2 * j + h], o[h] = -32.0f * d[h];
            } else {
                d[0] = d[1] = s.d[j];
                o[0] = o[1] = -s.m[j];
            }
            for (int w = 0; w < 32; ++w)
                out[b * qk + 32 * j + w] = fmaf((float)gp_integer_at(piece, qtype, c, w), d[w / 16], o[w / 16]);
        }
    }
}

/* Rows ids[0 .. n) of a packed [cols, depth] weight of qtype -> out [n, depth]. Returns 0, -1 for an id
 * outside [0, cols) (nothing written past the rows before it), -2 for a type or shape it does not take. */
int fdplug_gguf_packed_rows(const uint8_t *packed, const int64_t *ids, int n, float *out, int cols, int depth,
                            int qtype) {
    if (!gp_packable(qtype) || cols <= 0 || cols % GP_COLS || depth <= 0 || depth % GG_QK(qtype)) return -2;
    for (int t = 0; t < n; ++t) {
        if (ids[t] < 0 || ids[t] >= cols) return -1;
        gp_row(packed, qtype, depth, ids[t], out + (int64_t)t * depth);
    }
    return 0;
}
