/* ---------------------------------------------------------------------------------------------
 * The KV cache's element types (--kv-cache-dtype): float32, float16 or bfloat16 values, read widened
 * to float32 (exactly) and written rounded to nearest even, as paddle's astype rounds.
 *
 * Why: decode attention at 64 streams is memory-bound (every key and value of every sequence read
 * once a layer, ~33-45 GB/s here): a 2-byte cache halves those bytes and the cache's memory, as
 * llama.cpp's default float16 cache does. The attention math stays float32.
 *
 * Included by cpu_kernels.c before the attention kernels.
 * ------------------------------------------------------------------------------------------- */

enum { KV_F32 = 0, KV_F16 = 1, KV_BF16 = 2 }; /* kernels.KV_TYPES, in order */

/* BODY(KT) with KT the element type kt as a compile-time constant (the inner loops specialised) */
#define KV_SWITCH(kt, BODY)                                                                          \
    switch (kt) {                                                                                    \
    case KV_F16: BODY(KV_F16); break;                                                                \
    case KV_BF16: BODY(KV_BF16); break;                                                              \
    default: BODY(KV_F32); break;                                                                    \
    }

static inline int64_t kv_size(int kt) { return kt == KV_F32 ? 4 : 2; }

/* base + i elements of type kt */
static inline const void *kv_at(const void *base, int64_t i, int kt) { return (const char *)base + i * kv_size(kt); }

/* The 2-byte float types' scalar conversions (also the GGUF decoders' float16 scales, gg_f16, and
 * the bf16 linear's tail, linear.c): exact widening; rounding to nearest even. */
static inline float half_to_float(uint16_t h) {
#if defined(HAVE_AVX2) && defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF;
    uint32_t bits;
    if (exponent == 0x1F) {
        bits = sign | 0x7F800000u | mantissa << 13;
    } else if (exponent != 0) {
        bits = sign | (exponent + 112) << 23 | mantissa << 13;
    } else { /* zero and subnormals: mantissa * 2^-24, exact */
        const float f = (float)mantissa * 0x1p-24f;
        memcpy(&bits, &f, sizeof bits);
        bits |= sign;
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

static inline uint16_t float_to_half(float f) {
#if defined(HAVE_AVX2) && defined(__F16C__)
    return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    const uint32_t sign = (x >> 16) & 0x8000;
    const uint32_t abs = x & 0x7FFFFFFFu;
    if (abs > 0x7F800000u) return (uint16_t)(sign | 0x7E00); /* NaN */
    if (abs >= 0x477FF000u) return (uint16_t)(sign | 0x7C00); /* rounds to infinity (or is one) */
    if (abs < 0x38800000u) {                                  /* a float16 subnormal or zero */
        float a;
        memcpy(&a, &abs, sizeof a);
        return (uint16_t)(sign | (uint32_t)lrintf(a * 0x1p24f)); /* the default rounding: to nearest even */
    }
    const uint32_t rounded = abs + 0xFFF + ((abs >> 13) & 1);
    return (uint16_t)(sign | ((rounded - 0x38000000u) >> 13));
#endif
}

static inline float bf16_to_float(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t float_to_bf16(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    if ((x & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((x >> 16) | 0x40); /* NaN stays a (quiet) NaN */
    return (uint16_t)((x + 0x7FFF + ((x >> 16) & 1)) >> 16);
}

/* Element i of a row of type kt, widened */
static inline float kv_get(const void *row, int64_t i, int kt) {
    if (kt == KV_F32) return ((const float *)row)[i];
    const uint16_t h = ((const uint16_t *)row)[i];
    return kt == KV_F16 ? half_to_float(h) : bf16_to_float(h);
}

/* dim floats of src into a row of type kt at dst */
static void kv_put_row(const float *src, void *dst, int dim, int kt) {
    if (kt == KV_F32) {
        memcpy(dst, src, sizeof(float) * dim);
        return;
    }
    uint16_t *out = dst;
    int d = 0;
#if defined(HAVE_AVX2) && defined(__F16C__)
    if (kt == KV_F16)
        for (; d + 8 <= dim; d += 8)
            _mm_storeu_si128((__m128i *)(out + d), _mm256_cvtps_ph(_mm256_loadu_ps(src + d), _MM_FROUND_TO_NEAREST_INT));
#endif
    for (; d < dim; ++d) out[d] = kt == KV_F16 ? float_to_half(src[d]) : float_to_bf16(src[d]);
}

/* A row of type kt widened into dim floats */
static void kv_get_row(const void *row, float *dst, int dim, int kt) {
    if (kt == KV_F32) {
        memcpy(dst, row, sizeof(float) * dim);
        return;
    }
    for (int d = 0; d < dim; ++d) dst[d] = kv_get(row, d, kt);
}

#ifdef HAVE_AVX2
/* 8 elements of type kt at base + i, widened (exactly) */
static inline __attribute__((always_inline)) __m256 kv_load8(const void *base, int64_t i, const int kt) {
    if (kt == KV_F32) return _mm256_loadu_ps((const float *)base + i);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + i));
#if defined(__F16C__)
    if (kt == KV_F16) return _mm256_cvtph_ps(h);
#else
    if (kt == KV_F16) {
        float f[8];
        for (int l = 0; l < 8; ++l) f[l] = half_to_float(((const uint16_t *)base)[i + l]);
        return _mm256_loadu_ps(f);
    }
#endif
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
#endif
