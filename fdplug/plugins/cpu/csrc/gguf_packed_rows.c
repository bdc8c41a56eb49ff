/* ---------------------------------------------------------------------------------------------
 * Rows of a packed weight (fdplug_gguf_pack's group layout) as floats: a tied GGUF embedding's token
 * rows read from the lm_head's packed copy, so that the model keeps one copy of the table.
 *
 * Values: gg_dequant_row's on the file's row (and so gguf_blocks.dequantize's): each weight is
 * fma(q, d, o) with gg_pair_of's integer q and factors d, o. Each piece is unpacked as the tiles
 * unpack it (gp_piece_at, with gp_k_factors' K-quant factors: one reading of the layout), and the
 * row's column taken from the 16. A step asks for its tokens' rows only (a 2,048-token prefill step
 * of SmolLM2 ~1.2 M weights, milliseconds against the step's seconds).
 *
 * Included by gguf_packed.c after gguf_packed_tiles.c (gp_piece_at, gp_k_factors).
 * ------------------------------------------------------------------------------------------- */

/* Row `row` (column row % 16 of group row / 16) of a packed weight of depth weights -> out[depth] */
static void gp_row(const uint8_t *packed, int qtype, int depth, int64_t row, float *out) {
    const int c = (int)(row % GP_COLS), h = c / GP_LANES, lane = c % GP_LANES;
    const int64_t unit = (int64_t)GP_COLS * GG_BYTES(qtype);
    const uint8_t *g = packed + row / GP_COLS * (depth / GG_QK(qtype)) * unit;
    float dws[16][GP_COLS], ows[8][GP_COLS];
    for (int p = 0; p < depth / 32; ++p) {
        if (GG_QK(qtype) == 256 && p % 8 == 0) gp_k_factors(g + (p / 8) * unit, qtype, dws, ows);
        gp_piece e;
        gp_piece_at(g, qtype, p, dws, ows, &e);
        uint8_t q[8][GP_VBYTES];   /* half h's quads (Q8_0 without VNNI: the signed bytes) */
        float f[3][GP_LANES];      /* its dw0 (weights 0-15), dw1 (16-31) and ow */
        for (int k = 0; k < 8; ++k) memcpy(q[k], GP_SIGNED(qtype) ? &e.s[h][k] : &e.v[h][k], GP_VBYTES);
        memcpy(f[0], &e.dw0[h], sizeof f[0]);
        memcpy(f[1], &e.dw1[h], sizeof f[1]);
        memcpy(f[2], &e.ow[h], sizeof f[2]);
        for (int w = 0; w < 32; ++w) {
            const uint8_t byte = q[w / 4][4 * lane + w % 4];
            const int integer = qtype != GG_Q8_0 ? byte : (int8_t)(GP_SIGNED(qtype) ? byte : byte ^ 0x80);
            const float d = f[w / 16][lane];   /* gg_pair_of's o: the min, or the offset's -offset * d */
            const float o = gp_has_min(qtype) ? f[2][lane] : qtype == GG_Q8_0 ? 0.0f : -(float)gp_offset(qtype) * d;
            out[32 * p + w] = fmaf((float)integer, d, o);
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
