/* ---------------------------------------------------------------------------------------------
 * A prototype, not a kernel of fdplug's: a q8-math tile with columns in the lanes and block-float
 * inputs, on Q4_1-like blocks ([576, 1,536]: SmolLM2's down projection), one thread, weights in
 * cache; to hold against the real kernel on the same shape and thread count:
 *
 *     gcc -O3 -mavx2 -mfma -mf16c -o /tmp/q8_columns_tile bench/proto/q8_columns_tile.c && /tmp/q8_columns_tile
 *     FDPLUG_CPU_ISA=avx2 python bench/gguf_linear.py --types Q4_1 --rows 1,2,4,8,64 --threads 1 --no-lm-head
 *
 * Why: q8 math (csrc/gguf_q8.c) gives each run of 4 inputs its own float scale, so every 32
 * products of a row are converted and scaled in floats (vpmaddubsw, vpmaddwd, vmulps, vcvtdq2ps,
 * vfmadd: 5 operations a row per 32 multiply-adds) and its tiles run at about the float32 FMA peak
 * at AVX2. The proposal (docs/cpu-kernels.md, "Where q8 math stops at AVX2"): a scale D per 32
 * inputs and a power-of-two multiplier 2^u per run of 4, given to vpmaddwd as its second operand
 * (today a vector of ones), so a piece's 8 runs add as integers; with 8 columns x 4 inputs a
 * register (a group's pieces decoded and transposed once into an L1 panel), a row costs vpmaddubsw,
 * vpmaddwd and vpaddd per 32 multiply-adds, and one conversion and two FMAs per piece of 8 columns.
 * The same tile serves every row count (1 row included), so one summation order is kept for free.
 * tools/q8_input_schemes.py measures the rounding (SmolLM2: +0.33% perplexity, runs of 4 +0.27%).
 *
 * Measured 2026-11-27 on AMD EPYC family 25 (Zen 4), avx512, both built for AVX2, one thread, in one
 * session (the machine drifted +-20%): this tile 37 / 50 / 67 / 92 / 123 GFLOP/s at 1 / 2 / 4 / 8 /
 * 64 rows, q8 math's (its `q8 math` column, [576, 1536]) 32 / 51 / 55 / 55 / 67: 1.15x, 1.0x, 1.2x,
 * 1.7x, 1.85x. Left out here, and a kernel would pay: quantizing x, the threads, the other types'
 * decoding (Q4_1's is the cheapest), a vpsignb a row where the weights are signed (Q8_0, Q6_K).
 * ------------------------------------------------------------------------------------------- */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define K 1536
#define N 576
#define P (K / 32)
#define ROWS 64

static uint8_t W[N * P * 20];                  /* Q4_1-like: f16 d, f16 m, 16 bytes of nibbles */
static int8_t xq[ROWS * K];
static int16_t mult[ROWS * P * 16];            /* 2^u per run (as vpmaddwd pairs) */
static float D[ROWS * P], sxb[ROWS * P];       /* a scale per piece of 32, its o * sx term's sx */
static float out[ROWS * N];

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static inline __m256i decode(const uint8_t *b, float *d, float *m) {
    const __m128i v = _mm_loadu_si128((const __m128i *)(b + 4));
    uint32_t both;
    memcpy(&both, b, 4);
    const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128((int)both));
    *d = _mm_cvtss_f32(dm);
    *m = _mm_cvtss_f32(_mm_movehdup_ps(dm));
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), _mm256_set1_epi8(15));
}

static __attribute__((aligned(32))) uint8_t panel[P * 8 * 32]; /* a group: [piece][run][column][4 bytes] */
static float pd[P * 8], pm[P * 8];

/* 8 registers of 8 dwords transposed: register c's dword l goes to register l's dword c */
static inline void transpose8(__m256i r[8]) {
    __m256i t[8], u[8];
    for (int i = 0; i < 4; ++i) {
        t[2 * i] = _mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; ++i)
        for (int j = 0; j < 2; ++j) {
            u[4 * i + 2 * j] = _mm256_unpacklo_epi64(t[4 * i + j], t[4 * i + j + 2]);
            u[4 * i + 2 * j + 1] = _mm256_unpackhi_epi64(t[4 * i + j], t[4 * i + j + 2]);
        }
    for (int i = 0; i < 4; ++i) {
        r[i] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x20);
        r[i + 4] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x31);
    }
}

static inline __attribute__((always_inline)) void tile(int m0, const int MR, int g) {
    __m256 acc[4];
    for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps();
    for (int p = 0; p < P; ++p) {
        __m256i sums[4];
        for (int r = 0; r < MR; ++r) sums[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int l = 0; l < 8; ++l) {
            const __m256i w = _mm256_load_si256((const __m256i *)(panel + (p * 8 + l) * 32));
            for (int r = 0; r < MR; ++r) {
                int32_t four;
                memcpy(&four, xq + (m0 + r) * K + 32 * p + 4 * l, 4);
                const __m256i times = _mm256_set1_epi16(mult[((m0 + r) * P + p) * 16 + 2 * l]);
                sums[r] = _mm256_add_epi32(sums[r], _mm256_madd_epi16(_mm256_maddubs_epi16(w, _mm256_set1_epi32(four)), times));
            }
        }
        const __m256 d = _mm256_loadu_ps(pd + p * 8), m = _mm256_loadu_ps(pm + p * 8);
        for (int r = 0; r < MR; ++r) {
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r]), _mm256_mul_ps(d, _mm256_set1_ps(D[(m0 + r) * P + p])), acc[r]);
            acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(sxb[(m0 + r) * P + p]), acc[r]);
        }
    }
    for (int r = 0; r < MR; ++r) _mm256_storeu_ps(out + (m0 + r) * N + 8 * g, acc[r]);
}

/* per group of 8 columns, its pieces decoded and transposed into the panel, then tiles of
 * 4 rows (1-3 for the rest) */
static void proposed(int rows) {
    for (int g = 0; g < N / 8; ++g) {
        for (int p = 0; p < P; ++p) {
            __m256i cols[8];
            for (int c = 0; c < 8; ++c) cols[c] = decode(W + ((size_t)(8 * g + c) * P + p) * 20, &pd[p * 8 + c], &pm[p * 8 + c]);
            transpose8(cols);
            for (int l = 0; l < 8; ++l) _mm256_store_si256((__m256i *)(panel + (p * 8 + l) * 32), cols[l]);
        }
        int m0 = 0;
        for (; m0 + 4 <= rows; m0 += 4) tile(m0, 4, g);
        switch (rows - m0) {
        case 1: tile(m0, 1, g); break;
        case 2: tile(m0, 2, g); break;
        case 3: tile(m0, 3, g); break;
        default: break;
        }
    }
}

int main(void) {
    srand(1);
    for (size_t i = 0; i < sizeof W; ++i) W[i] = (uint8_t)rand();
    for (int i = 0; i < N * P; ++i) W[i * 20 + 1] = W[i * 20 + 3] = 0x1c, W[i * 20] = W[i * 20 + 2] = 0; /* d, m 2^-8 */
    for (int i = 0; i < ROWS * K; ++i) xq[i] = (int8_t)(rand() % 255 - 127);
    for (int i = 0; i < ROWS * P * 16; ++i) mult[i] = (int16_t)(1 << (rand() % 9));
    for (int i = 0; i < ROWS * P; ++i) sxb[i] = 1.0f, D[i] = 0.001f;
    const int counts[] = {1, 2, 4, 8, 64};
    for (int i = 0; i < 5; ++i) {
        const int rows = counts[i], calls = rows >= 64 ? 20 : 200;
        double best = 1e9;
        for (int rep = 0; rep < 7; ++rep) {
            const double t0 = now();
            for (int c = 0; c < calls; ++c) proposed(rows);
            const double t = now() - t0;
            best = t < best ? t : best;
        }
        printf("[%d, %d] %3d rows: %6.1f GFLOP/s (one thread)\n", N, K, rows, 2.0 * rows * N * K * calls / best / 1e9);
    }
    return 0;
}
