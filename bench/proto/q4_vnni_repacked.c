/* ---------------------------------------------------------------------------------------------
 * A prototype, not a kernel of fdplug's: Q4_1 weights repacked at load into groups of 16 columns
 * (the same bytes a weight: nibbles and float16 scales), multiplied by 8-bit inputs with one scale
 * per run of 16 (vpdpbusd, AVX-512 VNNI), columns in the lanes; 2 threads, each half the groups.
 *
 *     gcc -O3 -march=native -pthread -o /tmp/q4_vnni bench/proto/q4_vnni_repacked.c && /tmp/q4_vnni
 *     python bench/gguf_linear.py --types Q4_1 --rows 1,8,64,256 --no-lm-head     # the kernels, same shapes
 *
 * Why: at AVX-512 on a Zen 4 the GGUF linears' bf16 tiles run 290-350 GFLOP/s from 64 rows, near
 * vdpbf16ps's peak there (457 GFLOP/s, 2 threads), and a decode row pays ~9 vector operations to
 * widen and round every 32 weights. vpdpbusd does 64 multiply-adds where vdpbf16ps does 32, at twice
 * its rate on this core (929 against 457 GOP/s). Columns in the lanes keep a piece's integer sums in
 * one register per run, so the float work is one conversion and one FMA a run of 16 inputs; the
 * repacked layout (a group's pieces one after the other) lets one row stream the weights in order,
 * the blocker of wip/q8-block-float's transposed tile (its groups read piece by piece across 8
 * columns' rows). One summation order for every row count: rows share nothing but the weights.
 *
 * Layout of a group, piece p (32 weights of each of 16 columns): 4 x 64 bytes, byte 4c + i of vector
 * v holds column c's weight 32p + 8v + i (low nibble) and 32p + 8v + 4 + i (high nibble), so vector
 * v's low nibbles are the lanes of quad 2v (inputs 8v .. 8v + 3) and its high nibbles quad 2v + 1;
 * then 16 float16 d and 16 float16 m. 256 + 64 = 320 bytes, as 16 Q4_1 blocks (16 x 20).
 * ------------------------------------------------------------------------------------------- */
#include <immintrin.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <math.h>

#define RUN 16
typedef struct {
    const uint8_t *w;      /* repacked [N / 16 groups][P pieces][320 bytes] */
    const int8_t *xq;      /* [rows, K] */
    const float *dx;       /* [rows, K / RUN] */
    const float *sx;       /* [rows, P]: sum over the piece of the dequantized inputs */
    float *out;            /* [rows, N] */
    int n, k, rows, g0, g1;
} job;

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }

/* MR rows of a group's 16 outputs */
static inline __attribute__((always_inline)) void tile(const job *j, const uint8_t *g, int m0, const int MR) {
    const int P = j->k / 32;
    __m512 out[4];
    for (int r = 0; r < MR; ++r) out[r] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int p = 0; p < P; ++p, g += 320) {
        __m512i v[8];
        for (int i = 0; i < 4; ++i) {
            const __m512i b = _mm512_loadu_si512((const void *)(g + 64 * i));
            v[2 * i] = _mm512_and_si512(b, low);
            v[2 * i + 1] = _mm512_and_si512(_mm512_srli_epi16(b, 4), low);
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(g + 256)));
        const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(g + 288)));
        for (int r = 0; r < MR; ++r) {
            const int32_t *xr = (const int32_t *)(j->xq + (int64_t)(m0 + r) * j->k + 32 * p);
            const float *dr = j->dx + (int64_t)(m0 + r) * (j->k / RUN) + 2 * p;
            __m512i a0 = _mm512_setzero_si512(), a1 = _mm512_setzero_si512();
            for (int q = 0; q < 4; ++q) a0 = _mm512_dpbusd_epi32(a0, v[q], _mm512_set1_epi32(xr[q]));
            for (int q = 4; q < 8; ++q) a1 = _mm512_dpbusd_epi32(a1, v[q], _mm512_set1_epi32(xr[q]));
            const __m512 s = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a1), _mm512_set1_ps(dr[1]),
                                             _mm512_mul_ps(_mm512_cvtepi32_ps(a0), _mm512_set1_ps(dr[0])));
            out[r] = _mm512_fmadd_ps(s, d, out[r]);
            out[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(j->sx[(int64_t)(m0 + r) * P + p]), out[r]);
        }
    }
    for (int r = 0; r < MR; ++r) _mm512_storeu_ps(j->out + (int64_t)(m0 + r) * j->n + 0, out[r]);
}

static void *work(void *arg) {
    const job *j = arg;
    const int64_t gbytes = (int64_t)(j->k / 32) * 320;
    for (int gi = j->g0; gi < j->g1; ++gi) {
        const uint8_t *g = j->w + gi * gbytes;
        job jj = *j;
        jj.out = j->out + 16 * gi;
        int m = 0;
        for (; m + 4 <= j->rows; m += 4) tile(&jj, g, m, 4);
        for (; m < j->rows; ++m) tile(&jj, g, m, 1);
    }
    return NULL;
}

/* x [rows, k] -> xq, dx per run of 16 (amax / 127), sx per piece */
static void quantize(const float *x, int rows, int k, int8_t *xq, float *dx, float *sx) {
    for (int r = 0; r < rows; ++r)
        for (int b = 0; b < k / RUN; ++b) {
            float amax = 0;
            for (int i = 0; i < RUN; ++i) amax = fmaxf(amax, fabsf(x[r * k + b * RUN + i]));
            const float d = amax / 127, id = d ? 1 / d : 0;
            int sum = 0;
            for (int i = 0; i < RUN; ++i) sum += xq[r * k + b * RUN + i] = (int8_t)nearbyintf(x[r * k + b * RUN + i] * id);
            dx[r * (k / RUN) + b] = d;
            if (b % 2 == 0) sx[r * (k / 32) + b / 2] = 0;
            sx[r * (k / 32) + b / 2] += d * sum;
        }
}

/* A second thread that spins for work (thread creation would dominate a one-row call) */
static job helper_job;
static volatile int helper_seq, helper_done;
static void *helper(void *arg) {
    (void)arg;
    for (int seen = 0;;) {
        while (__atomic_load_n(&helper_seq, __ATOMIC_ACQUIRE) == seen) _mm_pause();
        seen = helper_seq;
        work(&helper_job);
        __atomic_store_n(&helper_done, seen, __ATOMIC_RELEASE);
    }
    return NULL;
}

static double run(const uint8_t *w, int n, int k, int rows, const int8_t *xq, const float *dx, const float *sx, float *out) {
    job a = {w, xq, dx, sx, out, n, k, rows, 0, n / 32};
    helper_job = a;
    helper_job.g0 = n / 32;
    helper_job.g1 = n / 16;
    const double t0 = now();
    const int seq = helper_seq + 1;
    __atomic_store_n(&helper_seq, seq, __ATOMIC_RELEASE);
    work(&a);
    while (__atomic_load_n(&helper_done, __ATOMIC_ACQUIRE) != seq) _mm_pause();
    return now() - t0;
}

int main(void) {
    const int shapes[3][2] = {{576, 576}, {1536, 576}, {576, 1536}}, counts[4] = {1, 8, 64, 256};
    srand(1);
    pthread_t t;
    pthread_create(&t, NULL, helper, NULL);
    for (int s = 0; s < 3; ++s) {
        const int n = shapes[s][0], k = shapes[s][1], P = k / 32;
        const int64_t bytes = (int64_t)n / 16 * P * 320, copies = 1 + (256 << 20) / bytes; /* ~256 MB: from memory */
        uint8_t *w = aligned_alloc(64, bytes * copies);
        for (int64_t i = 0; i < bytes * copies; ++i) w[i] = rand();
        for (int64_t c = 0; c < copies; ++c)   /* finite float16 scales */
            for (int gi = 0; gi < n / 16; ++gi)
                for (int p = 0; p < P; ++p) {
                    uint16_t *h = (uint16_t *)(w + c * bytes + ((int64_t)gi * P + p) * 320 + 256);
                    for (int i = 0; i < 32; ++i) h[i] = 0x1000 + (rand() & 0x3FF);
                }
        for (int ci = 0; ci < 4; ++ci) {
            const int rows = counts[ci];
            float *x = malloc(sizeof(float) * rows * k), *dx = malloc(sizeof(float) * rows * k / RUN);
            float *sx = malloc(sizeof(float) * rows * P), *out = malloc(sizeof(float) * rows * n);
            int8_t *xq = malloc(rows * k);
            for (int i = 0; i < rows * k; ++i) x[i] = (float)rand() / RAND_MAX - 0.5f;
            quantize(x, rows, k, xq, dx, sx);
            double hot = 1e9, cold = 1e9;
            for (int rep = 0; rep < 200; ++rep) {
                const double t = run(w, n, k, rows, xq, dx, sx, out);
                if (t < hot) hot = t;
            }
            for (int64_t c = 0; c < copies; ++c) {
                const double t = run(w + c * bytes, n, k, rows, xq, dx, sx, out);
                if (c > 0 && t < cold) cold = t;
            }
            const double flop = 2.0 * n * k * rows;
            printf("[%5d, %5d] %4d rows | in cache %8.1f us %6.1f GFLOP/s | from memory %8.1f us %6.1f GFLOP/s %5.1f GB/s\n",
                   n, k, rows, hot * 1e6, flop / hot / 1e9, cold * 1e6, flop / cold / 1e9, bytes / cold / 1e9);
            free(x); free(dx); free(sx); free(out); free(xq);
        }
        free(w);
    }
    return 0;
}
