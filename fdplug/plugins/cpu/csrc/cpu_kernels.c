/* fdplug cpu kernels: paged attention that reads the KV cache in place, the KV cache write, and
 * SwiGLU (paddle's CPU swiglu is one scalar thread: 8% of a prefill, 7% of a decode step).
 *
 * Why: on CPU, decode attention is memory-bound. The plain-Paddle reference gathers every
 * sequence's blocks into a dense tensor each layer (read the cache, write a copy, read the copy
 * again); this kernel reads each key and value once, straight from its block. Built by
 * fdplug/plugins/cpu/kernels.py with the system C compiler the first time it is needed.
 *
 * Layout (the cpu backends' `kv_cache_shape`): a cache is [kv_heads, num_blocks, block_size, head_dim]
 * float32. Queries are [tokens, heads, head_dim] float32; query head h reads kv head h / group.
 * The mask spec is per query token: keys [0, key_end) of its sequence are visible.
 *
 * No -ffast-math: it would change the floating-point mode of the whole process. With AVX2 and FMA
 * (built with -march=native) the two inner loops use intrinsics; elsewhere, portable C.
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_AVX2 1
#endif

int fdplug_kernels_abi(void) { return 2; }

/* Run worker(job) on the calling thread and up to num_threads - 1 helpers (at most 64), then join.
 * Workers take their pieces from a counter in the job, so a helper that cannot start, or that the
 * scheduler starts late (another process holding a core), leaves its pieces to the others. */
static void run_workers(void *(*worker)(void *), void *job, int num_threads) {
    pthread_t threads[64];
    int extra = num_threads - 1, started = 0;
    if (extra > 64) extra = 64;
    for (; started < extra; ++started)
        if (pthread_create(&threads[started], NULL, worker, job) != 0) break;
    worker(job); /* the calling thread works too; with no helper it does everything */
    for (int t = 0; t < started; ++t) pthread_join(threads[t], NULL);
}

/* scores[j] = q . keys[j] for n keys of `dim` floats each (rows `dim` apart). */
static void score_keys(const float *q, const float *keys, int n, int dim, float *scores) {
    int j = 0;
#ifdef HAVE_AVX2
    if (dim % 8 == 0) {
        /* Eight keys at a time: eight independent FMA chains (one chain would wait on FMA latency),
         * then one horizontal reduction tree for all eight. */
        for (; j + 8 <= n; j += 8) {
            const float *k = keys + (int64_t)j * dim;
            __m256 a[8];
            for (int i = 0; i < 8; ++i) a[i] = _mm256_setzero_ps();
            for (int d = 0; d < dim; d += 8) {
                const __m256 qv = _mm256_loadu_ps(q + d);
                for (int i = 0; i < 8; ++i) a[i] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + i * dim + d), a[i]);
            }
            const __m256 lo = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
            const __m256 hi = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
            _mm256_storeu_ps(scores + j, _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20),
                                                       _mm256_permute2f128_ps(lo, hi, 0x31)));
        }
    }
#endif
    for (; j < n; ++j) {
        const float *k = keys + (int64_t)j * dim;
        float acc[8] = {0}, total = 0.0f;
        int d = 0;
        for (; d + 8 <= dim; d += 8)
            for (int l = 0; l < 8; ++l) acc[l] += q[d + l] * k[d + l];
        for (; d < dim; ++d) total += q[d] * k[d];
        for (int l = 0; l < 8; ++l) total += acc[l];
        scores[j] = total;
    }
}

/* acc += sum_j probs[j] * values[j] over n value rows. Per slice of 32 dims, four register
 * accumulators (independent FMA chains) stream the block's rows, in L1 after the first slice. */
static void weigh_values(const float *probs, const float *values, int n, int dim, float *acc) {
    int d = 0;
#ifdef HAVE_AVX2
    for (; d + 32 <= dim; d += 32) {
        __m256 s0 = _mm256_loadu_ps(acc + d), s1 = _mm256_loadu_ps(acc + d + 8);
        __m256 s2 = _mm256_loadu_ps(acc + d + 16), s3 = _mm256_loadu_ps(acc + d + 24);
        for (int j = 0; j < n; ++j) {
            const __m256 p = _mm256_set1_ps(probs[j]);
            const float *v = values + (int64_t)j * dim + d;
            s0 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v), s0);
            s1 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 8), s1);
            s2 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 16), s2);
            s3 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 24), s3);
        }
        _mm256_storeu_ps(acc + d, s0);
        _mm256_storeu_ps(acc + d + 8, s1);
        _mm256_storeu_ps(acc + d + 16, s2);
        _mm256_storeu_ps(acc + d + 24, s3);
    }
#endif
    for (int j = 0; j < n; ++j)
        for (int e = d; e < dim; ++e) acc[e] += probs[j] * values[(int64_t)j * dim + e];
}

typedef struct {
    const float *q, *key_cache, *value_cache;
    const int32_t *q_rows, *block_tables, *seq_of_token, *key_end;
    float *out;
    int num_tokens, heads, kv_heads, head_dim, num_blocks, block_size, table_width, max_keys;
    float scale;
    int next_unit; /* work queue: unit = token * kv_heads + kv_head, taken with an atomic add */
    int failed;
} attention_job;

/* One (query token, kv head): the `group` query heads that share the kv head, so each key and
 * value vector is loaded once for all of them. Scores, then a softmax per head, then the sum. */
static void attend_unit(const attention_job *job, int unit, float *scores, float *queries, float *acc) {
    const int token = unit / job->kv_heads, kvh = unit % job->kv_heads;
    const int group = job->heads / job->kv_heads, dim = job->head_dim, bs = job->block_size;
    const int keys = job->key_end[token];
    const int32_t *table = job->block_tables + (int64_t)job->seq_of_token[token] * job->table_width;
    const int64_t head_stride = (int64_t)job->num_blocks * bs * dim;
    const float *qsrc = job->q + ((int64_t)job->q_rows[token] * job->heads + (int64_t)kvh * group) * dim;
    for (int i = 0; i < group * dim; ++i) queries[i] = qsrc[i] * job->scale;

    for (int j0 = 0; j0 < keys; j0 += bs) {
        const float *kblock = job->key_cache + kvh * head_stride + (int64_t)table[j0 / bs] * bs * dim;
        const int n = keys - j0 < bs ? keys - j0 : bs;
        for (int g = 0; g < group; ++g)
            score_keys(queries + g * dim, kblock, n, dim, scores + (int64_t)g * job->max_keys + j0);
    }
    for (int g = 0; g < group; ++g) {
        float *s = scores + (int64_t)g * job->max_keys, peak = -INFINITY, total = 0.0f;
        for (int j = 0; j < keys; ++j) peak = s[j] > peak ? s[j] : peak;
        for (int j = 0; j < keys; ++j) { s[j] = expf(s[j] - peak); total += s[j]; }
        const float inv = 1.0f / total;
        for (int j = 0; j < keys; ++j) s[j] *= inv;
    }
    memset(acc, 0, sizeof(float) * group * dim);
    for (int j0 = 0; j0 < keys; j0 += bs) {
        const float *vblock = job->value_cache + kvh * head_stride + (int64_t)table[j0 / bs] * bs * dim;
        const int n = keys - j0 < bs ? keys - j0 : bs;
        for (int g = 0; g < group; ++g)
            weigh_values(scores + (int64_t)g * job->max_keys + j0, vblock, n, dim, acc + g * dim);
    }
    float *dst = job->out + ((int64_t)token * job->heads + (int64_t)kvh * group) * dim;
    memcpy(dst, acc, sizeof(float) * group * dim);
}

static void *attention_worker(void *arg) {
    attention_job *job = arg;
    const int group = job->heads / job->kv_heads;
    float *scratch = malloc(sizeof(float) * ((size_t)group * job->max_keys + 2 * (size_t)group * job->head_dim));
    if (!scratch) { __atomic_store_n(&job->failed, 1, __ATOMIC_RELAXED); return NULL; }
    float *queries = scratch + (size_t)group * job->max_keys, *acc = queries + (size_t)group * job->head_dim;
    const int units = job->num_tokens * job->kv_heads;
    for (;;) {
        const int unit = __atomic_fetch_add(&job->next_unit, 1, __ATOMIC_RELAXED);
        if (unit >= units) break;
        attend_unit(job, unit, scratch, queries, acc);
    }
    free(scratch);
    return NULL;
}

/* out[i] = attention of query row q_rows[i] over keys [0, key_end[i]) of block table row
 * seq_of_token[i]. Returns 0, or -1 if memory or a thread could not be had (out is then undefined). */
int fdplug_paged_attention(const float *q, const float *key_cache, const float *value_cache,
                           const int32_t *q_rows, const int32_t *block_tables, const int32_t *seq_of_token,
                           const int32_t *key_end, float *out, int num_tokens, int heads, int kv_heads,
                           int head_dim, int num_blocks, int block_size, int table_width, int max_keys,
                           float scale, int num_threads) {
    attention_job job = {q, key_cache, value_cache, q_rows, block_tables, seq_of_token, key_end, out,
                         num_tokens, heads, kv_heads, head_dim, num_blocks, block_size, table_width,
                         max_keys, scale, 0, 0};
    const int units = num_tokens * kv_heads;
    run_workers(attention_worker, &job, num_threads < units ? num_threads : units);
    return job.failed ? -1 : 0;
}

/* key_cache[h, slot] = key[t, h] and value_cache[h, slot] = value[t, h] for slot = slots[t]. */
void fdplug_write_kv(const float *key, const float *value, float *key_cache, float *value_cache,
                     const int64_t *slots, int num_tokens, int kv_heads, int head_dim, int64_t slots_per_head) {
    const size_t row = sizeof(float) * head_dim;
    for (int t = 0; t < num_tokens; ++t)
        for (int h = 0; h < kv_heads; ++h) {
            const int64_t src = ((int64_t)t * kv_heads + h) * head_dim;
            const int64_t dst = ((int64_t)h * slots_per_head + slots[t]) * head_dim;
            memcpy(key_cache + dst, key + src, row);
            memcpy(value_cache + dst, value + src, row);
        }
}

/* ---------------------------------------------------------------------------------------------
 * SwiGLU: out[r, j] = silu(x[r, j]) * x[r, inter + j], silu(g) = g / (1 + e^-g).
 * ------------------------------------------------------------------------------------------- */

#ifdef HAVE_AVX2
/* e^x for eight floats (Cephes expf): x = n ln2 + r with ln2 split in two so r is exact, a degree-6
 * polynomial for e^r on |r| <= ln2/2, then 2^n through the exponent bits. Relative error about
 * 2e-7. x is clamped to [-87, 87] so 2^n stays a normal float; silu needs no more range: past
 * it, g / (1 + e^-g) is off by at most |g| * 2e-38 (g itself, or a number that small near 0). */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(87.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
    const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
}
#endif

typedef struct {
    const float *x;
    float *out;
    int64_t rows, rows_per_piece, next_piece; /* work queue: pieces taken with an atomic add */
    int inter;
} swiglu_job;

static void swiglu_rows(const swiglu_job *job, int64_t begin, int64_t end) {
    const int inter = job->inter;
    for (int64_t row = begin; row < end; ++row) {
        const float *gate = job->x + row * 2 * inter, *up = gate + inter;
        float *dst = job->out + row * inter;
        int j = 0;
#ifdef HAVE_AVX2
        const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
        for (; j + 8 <= inter; j += 8) {
            const __m256 g = _mm256_loadu_ps(gate + j);
            const __m256 denominator = _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, g)));
            _mm256_storeu_ps(dst + j, _mm256_div_ps(_mm256_mul_ps(g, _mm256_loadu_ps(up + j)), denominator));
        }
#endif
        for (; j < inter; ++j) dst[j] = gate[j] * up[j] / (1.0f + expf(-gate[j]));
    }
}

static void *swiglu_worker(void *arg) {
    swiglu_job *job = arg;
    for (;;) {
        const int64_t begin = __atomic_fetch_add(&job->next_piece, 1, __ATOMIC_RELAXED) * job->rows_per_piece;
        if (begin >= job->rows) return NULL;
        swiglu_rows(job, begin, begin + job->rows_per_piece < job->rows ? begin + job->rows_per_piece : job->rows);
    }
}

/* x [rows, 2 * inter] -> out [rows, inter] on up to num_threads threads (the caller's included). */
void fdplug_swiglu(const float *x, float *out, int64_t rows, int inter, int num_threads) {
    const int64_t rows_per_piece = inter >= 8192 ? 1 : 8192 / inter; /* ~32 KiB of output a piece */
    swiglu_job job = {x, out, rows, rows_per_piece, 0, inter};
    run_workers(swiglu_worker, &job, num_threads);
}
