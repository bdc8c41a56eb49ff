/* ---------------------------------------------------------------------------------------------
 * gguf_linear.c without AVX2 (x86 below x86-64-v3, ARM, others): each block widened to floats on
 * the stack, then multiplied into up to GG_MR rows. Each output keeps the vector tiles' 32 chains
 * (lane l of each 32 weights, fmaf) and their lane sum, so it gives their bits wherever fmaf is
 * an instruction (ARM); on x86 below v3 fmaf is a library call and this loop slow (selection then
 * refuses cpu_native_gguf_linear, as the linears' scalar loops).
 * ------------------------------------------------------------------------------------------- */

#define GG_MR 4

/* Block ``b`` of type qtype -> its GG_QK(qtype) floats, the portable op's values. */
static void gg_dequant_block(const uint8_t *b, int qtype, float *out) {
    if (qtype == GG_F16 || qtype == GG_BF16) {
        for (int i = 0; i < 32; ++i) {
            uint32_t bits = (uint32_t)(b[2 * i] | b[2 * i + 1] << 8) << 16;
            float f;
            memcpy(&f, &bits, sizeof f);
            out[i] = qtype == GG_F16 ? gg_f16(b + 2 * i) : f;
        }
    } else if (qtype == GG_Q8_0) {
        const float d = gg_f16(b);
        for (int i = 0; i < 32; ++i) out[i] = d * (float)(int8_t)b[2 + i];
    } else if (qtype == GG_Q4_0 || qtype == GG_Q4_1 || qtype == GG_Q5_0 || qtype == GG_Q5_1) {
        const int has_min = qtype == GG_Q4_1 || qtype == GG_Q5_1, five = qtype == GG_Q5_0 || qtype == GG_Q5_1;
        const float d = gg_f16(b), m = has_min ? gg_f16(b + 2) : 0.0f;
        uint32_t qh = 0;
        if (five) memcpy(&qh, b + 2 + 2 * has_min, sizeof qh);
        const uint8_t *qs = b + 2 + 2 * has_min + 4 * five;
        const int offset = has_min ? 0 : (five ? 16 : 8);
        for (int i = 0; i < 32; ++i) {
            const int q = (i < 16 ? qs[i] & 0xF : qs[i - 16] >> 4) | (int)((qh >> i) & 1) << 4;
            out[i] = has_min ? (float)q * d + m : (float)(q - offset) * d;
        }
    } else if (qtype == GG_Q4_K || qtype == GG_Q5_K) {
        gg_scales s;
        gg_k_scales(b, qtype, &s);
        const uint8_t *qs = b + (qtype == GG_Q4_K ? 16 : 48), *qh = b + 16;
        for (int j = 0; j < 8; ++j)
            for (int l = 0; l < 32; ++l) {
                int q = qs[32 * (j / 2) + l] >> 4 * (j % 2) & 0xF;
                if (qtype == GG_Q5_K) q |= (qh[l] >> j & 1) << 4;
                out[32 * j + l] = s.d[j] * (float)q - s.m[j];
            }
    } else { /* GG_Q6_K */
        gg_scales s;
        gg_k_scales(b, qtype, &s);
        for (int e = 0; e < 256; ++e) {
            const int h = e / 128, l = e % 128, g = l / 32;
            const int low = b[64 * h + l % 64] >> 4 * (l / 64) & 0xF, high = b[128 + 32 * h + l % 32] >> 2 * g & 3;
            out[e] = s.d[e / 16] * (float)((low | high << 4) - 32);
        }
    }
}

/* (chains: always 0 here, the panel layout of gguf_tiles.c's levels) */
static void gg_dequant_row(const uint8_t *row, int qtype, int depth, float *out, int chains) {
    (void)chains;
    const int block = GG_QK(qtype), bytes = GG_BYTES(qtype);
    for (int b = 0; b < depth / block; ++b) gg_dequant_block(row + (int64_t)b * bytes, qtype, out + b * block);
}

/* lanes_sum's pairing over 16 lanes (the sum of the two 16-lane chains of each 32) */
static float gg_lanes_sum(const float acc[32]) {
    float t[8];
    for (int j = 0; j < 8; ++j) t[j] = (acc[j] + acc[16 + j]) + (acc[8 + j] + acc[24 + j]);
    const float u0 = t[0] + t[4], u1 = t[1] + t[5], u2 = t[2] + t[6], u3 = t[3] + t[7];
    return (u0 + u2) + (u1 + u3);
}

static void gg_columns(const gg_job *job, const uint8_t *src, int64_t stride, int qtype, int m0, int mr, int begin,
                       int end) {
    const int depth = job->depth, block = GG_QK(qtype), bytes = GG_BYTES(qtype);
    float w[256], acc[GG_MR][32];
    for (int n = begin; n < end; ++n) {
        const uint8_t *row = src + (n - begin) * stride;
        memset(acc, 0, sizeof acc);
        for (int b = 0; b < depth / block; ++b) {
            gg_dequant_block(row + (int64_t)b * bytes, qtype, w);
            for (int r = 0; r < mr; ++r) {
                const float *x = job->x + (int64_t)(m0 + r) * depth + b * block;
                for (int i = 0; i < block; ++i) acc[r][i % 32] = fmaf(x[i], w[i], acc[r][i % 32]);
            }
        }
        for (int r = 0; r < mr; ++r) job->out[(int64_t)(m0 + r) * job->ld + n] = gg_lanes_sum(acc[r]);
    }
}
