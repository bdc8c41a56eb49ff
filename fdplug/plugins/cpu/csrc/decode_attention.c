/* ---------------------------------------------------------------------------------------------
 * Paged attention for decode (and any query row over its sequence's keys, cpu_kernels.c's mask
 * spec): each key and value read once, straight from its block of the cache, for the query heads
 * that share its kv head.
 *
 * Tried and not kept (2026-11-27, AMD EPYC, avx512, capped to AVX2, bench/kv_cache.py --seqs 1
 * --keys 3000 --layers 30): scoring and weighing up to 3 query heads a pass, each float16 key and
 * value converted once instead of once a head (the same chains, so the same bits: checked on 960
 * shapes at both levels): 1.1x with the cache in L2, 1.2-1.4x with a sequence's blocks in order,
 * but ~0.75x with them scattered (--scatter, a busy block pool), where the head-by-head passes
 * leave the prefetches (KV_AHEAD) time to land; a longer KV_AHEAD, or the values fetched ahead in
 * the weighing pass instead of during the scores, did not win that back.
 *
 * Included by cpu_kernels.c (its thread pool, exp8, kv_elements.c's element types).
 * ------------------------------------------------------------------------------------------- */

/* scores[j] = q . keys[j] for n keys of `dim` elements of type kt each (rows `dim` apart). */
static inline __attribute__((always_inline)) void score_keys(const float *q, const void *keys, int n, int dim,
                                                             float *scores, const int kt) {
    int j = 0;
#ifdef HAVE_AVX2
    if (dim % 8 == 0) {
        /* Eight keys at a time: eight independent FMA chains (one chain would wait on FMA latency),
         * then one horizontal reduction tree for all eight. */
        for (; j + 8 <= n; j += 8) {
            const int64_t k = (int64_t)j * dim;
            __m256 a[8];
            for (int i = 0; i < 8; ++i) a[i] = _mm256_setzero_ps();
            for (int d = 0; d < dim; d += 8) {
                const __m256 qv = _mm256_loadu_ps(q + d);
                for (int i = 0; i < 8; ++i) a[i] = _mm256_fmadd_ps(qv, kv_load8(keys, k + i * dim + d, kt), a[i]);
            }
            const __m256 lo = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
            const __m256 hi = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
            _mm256_storeu_ps(scores + j, _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20),
                                                       _mm256_permute2f128_ps(lo, hi, 0x31)));
        }
    }
#endif
    for (; j < n; ++j) {
        const void *k = kv_at(keys, (int64_t)j * dim, kt);
        float acc[8] = {0}, total = 0.0f;
        int d = 0;
        for (; d + 8 <= dim; d += 8)
            for (int l = 0; l < 8; ++l) acc[l] += q[d + l] * kv_get(k, d + l, kt);
        for (; d < dim; ++d) total += q[d] * kv_get(k, d, kt);
        for (int l = 0; l < 8; ++l) total += acc[l];
        scores[j] = total;
    }
}

/* acc += sum_j probs[j] * values[j] over n value rows. Per slice of 64 dims, eight register
 * accumulators (independent FMA chains: four waited on the FMA latency, measured), then slices of
 * 32 with four, stream the block's rows, in L1 after the first slice. Each output sums over j in
 * order whatever the slice: the same bits. */
static inline __attribute__((always_inline)) void weigh_values(const float *probs, const void *values, int n, int dim,
                                                               float *acc, const int kt) {
    int d = 0;
#ifdef HAVE_AVX2
    for (; d + 64 <= dim; d += 64) {
        __m256 s[8];
        for (int i = 0; i < 8; ++i) s[i] = _mm256_loadu_ps(acc + d + 8 * i);
        for (int j = 0; j < n; ++j) {
            const __m256 p = _mm256_set1_ps(probs[j]);
            const int64_t v = (int64_t)j * dim + d;
            for (int i = 0; i < 8; ++i) s[i] = _mm256_fmadd_ps(p, kv_load8(values, v + 8 * i, kt), s[i]);
        }
        for (int i = 0; i < 8; ++i) _mm256_storeu_ps(acc + d + 8 * i, s[i]);
    }
    for (; d + 32 <= dim; d += 32) {
        __m256 s0 = _mm256_loadu_ps(acc + d), s1 = _mm256_loadu_ps(acc + d + 8);
        __m256 s2 = _mm256_loadu_ps(acc + d + 16), s3 = _mm256_loadu_ps(acc + d + 24);
        for (int j = 0; j < n; ++j) {
            const __m256 p = _mm256_set1_ps(probs[j]);
            const int64_t v = (int64_t)j * dim + d;
            s0 = _mm256_fmadd_ps(p, kv_load8(values, v, kt), s0);
            s1 = _mm256_fmadd_ps(p, kv_load8(values, v + 8, kt), s1);
            s2 = _mm256_fmadd_ps(p, kv_load8(values, v + 16, kt), s2);
            s3 = _mm256_fmadd_ps(p, kv_load8(values, v + 24, kt), s3);
        }
        _mm256_storeu_ps(acc + d, s0);
        _mm256_storeu_ps(acc + d + 8, s1);
        _mm256_storeu_ps(acc + d + 16, s2);
        _mm256_storeu_ps(acc + d + 24, s3);
    }
#endif
    for (int j = 0; j < n; ++j)
        for (int e = d; e < dim; ++e) acc[e] += probs[j] * kv_get(values, (int64_t)j * dim + e, kt);
}

typedef struct {
    const float *q;
    const void *key_cache, *value_cache; /* elements of type kv_type (kv_elements.c) */
    const int32_t *q_rows, *block_tables, *seq_of_token, *key_end;
    float *out;
    int num_tokens, heads, kv_heads, head_dim, num_blocks, block_size, table_width, max_keys, kv_type;
    float scale;
    int units;            /* work units: (token, kv head, its keys [first, last)) in unit_of */
    const int32_t *unit_of; /* [units][4] */
    float *partials;      /* [units][group][2 + head_dim]: a chunk's max, sum and unnormalized output */
    int next_unit;        /* work queue: an index into unit_of, taken with an atomic add */
    int failed;
} attention_job;

/* A query row over more keys than this is split into equal chunks of at most this many (in whole
 * blocks), each a work unit, merged after (attention_merge): one decode row had kv_heads units
 * (SmolLM2: 3 on 2 threads, one idle a third of the time; on more cores, all but kv_heads idle),
 * and at thousands of keys attention is a large part of a decode step. The split depends only on
 * the row's key count, never on the batch or the threads: a row gets the same bits alone or in a
 * batch. Up to this many keys, one unit and the one-pass softmax, as before the split. */
#ifndef ATT_CHUNK_KEYS
#define ATT_CHUNK_KEYS 1024
#endif

/* The chunks a row of `keys` keys is split into (1: not split), each of *chunk_keys keys but the
 * last (what is left). */
static int attention_chunks(int keys, int block_size, int *chunk_keys) {
    *chunk_keys = keys;
    if (keys <= ATT_CHUNK_KEYS) return 1;
    const int pieces = (keys + ATT_CHUNK_KEYS - 1) / ATT_CHUNK_KEYS, even = (keys + pieces - 1) / pieces;
    *chunk_keys = (even + block_size - 1) / block_size * block_size;
    return (keys + *chunk_keys - 1) / *chunk_keys;
}

/* Key blocks fetched ahead of the scores: a running engine's blocks lie scattered (a sequence's
 * taken from the pool as it grows), so the hardware prefetchers stop at each block's end and decode
 * attention at many streams waited on memory latency (9.7 GB/s of a 2-byte cache, where one
 * thread streams 21: bench/kv_cache.py --layers 30 --scatter; AMD EPYC, avx512). The prefetches go
 * to L2 (prefetcht1), not L1: a block's 32-64 lines each, two blocks ahead, into L1 kept its
 * miss buffers full and the loads of the block being scored waited behind them (17% of the
 * kernel's samples on the prefetches; the values, fetched during the scores, were partly evicted
 * from L1's 32 KiB again by the later keys before the weighing). Into L2, float16 cache (AMD EPYC,
 * avx512, 2 threads, --layers 30 --scatter, 2-3 interleaved rounds): 64 sequences of 200 and 1,000
 * keys 0.88-0.91 -> 0.56-0.58 and 4.4-4.8 -> 3.0-3.2 ms a layer (10-11 -> 16-17.5 GB/s), one of
 * 3,000 keys 0.21 -> 0.15-0.18 ms; capped to AVX2 0.98-1.04 -> 0.62-0.67 and 4.8-5.7 -> 3.3-3.6;
 * float32 1.1-1.5x at both levels. Four blocks ahead instead of two: the same within noise.
 * A block's prefetches are spread over its heads' score passes (each head issues its share of the
 * key block ahead and of the value block): all 64 lines of a block pair at once stalled the pass
 * that issued them (the prefetch loops held 13% of the kernel's samples at 64 streams). Spread, 64
 * sequences of <= 256-1,024 keys took 0.85-0.91x the time (float16 and float32 caches; 8 layers'
 * caches read in turn, blocks scattered: bench/attention_ab.py against the build before; AMD EPYC,
 * avx2-or-less, 2 threads), one sequence of 1,024 and 3,000 keys 0.98x and 0.87x. Six blocks
 * ahead, or the next work unit's first block fetched during the weighing: within noise. */
#ifndef KV_AHEAD
#define KV_AHEAD 2
#endif
static inline void prefetch_bytes(const void *p, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch((const char *)p + i, 0, 2);
}
/* Head g's share (part bytes from g * part, within the block) of the key block ahead (NULL: none)
 * and of the value block now. Inlined: as a call (GCC's choice, at three element types) the
 * kernel took 1.24-1.42x the time (bench/attention_ab.py; AMD EPYC, avx2-or-less). */
static inline __attribute__((always_inline)) void prefetch_share(const char *kahead, const char *vnow, int g,
                                                                 int64_t part, int64_t block_bytes) {
    const int64_t from = g * part, bytes = from + part < block_bytes ? part : block_bytes - from;
    if (bytes <= 0) return;
    if (kahead != NULL) prefetch_bytes(kahead + from, bytes);
    prefetch_bytes(vnow + from, bytes);
}

/* One (query token, kv head) over keys [first, last): the `group` query heads that share the kv
 * head. Scores, then a softmax per head, then the sum. A whole row (partial NULL) is normalized
 * and written to out; a chunk of one (first a multiple of the block size) leaves each head's
 * max, sum of exponentials and unnormalized output in partial, for attention_merge. */
static void attend_range(const attention_job *job, int token, int kvh, int first, int last, float *scores,
                         float *queries, float *acc, float *partial) {
    const int group = job->heads / job->kv_heads, dim = job->head_dim, bs = job->block_size;
    const int keys = last - first, kt = job->kv_type;
    const int32_t *table = job->block_tables + (int64_t)job->seq_of_token[token] * job->table_width + first / bs;
    const int64_t head_stride = (int64_t)job->num_blocks * bs * dim;
    const float *qsrc = job->q + ((int64_t)job->q_rows[token] * job->heads + (int64_t)kvh * group) * dim;
    for (int i = 0; i < group * dim; ++i) queries[i] = qsrc[i] * job->scale;
    const int64_t block_bytes = (int64_t)bs * dim * kv_size(kt);
    const void *kbase = kv_at(job->key_cache, kvh * head_stride, kt), *vbase = kv_at(job->value_cache, kvh * head_stride, kt);
#define KV_BLOCK(base, b) ((const char *)(base) + (int64_t)table[b] * block_bytes)
    const int blocks = (keys + bs - 1) / bs;
    for (int b = 0; b < blocks && b < KV_AHEAD; ++b) prefetch_bytes(KV_BLOCK(kbase, b), block_bytes);
    const int64_t part = (block_bytes / group + 63) / 64 * 64;   /* a head's share of a block's prefetches */
    for (int j0 = 0; j0 < keys; j0 += bs) {
        const int b = j0 / bs;
        const char *kahead = b + KV_AHEAD < blocks ? KV_BLOCK(kbase, b + KV_AHEAD) : NULL;
        const char *vnow = KV_BLOCK(vbase, b);   /* (read after the softmax: in L2 by then) */
        const void *kblock = KV_BLOCK(kbase, b);
        const int n = keys - j0 < bs ? keys - j0 : bs;
        float *at = scores + j0;
#define SCORE(KT)                                                                                    \
    for (int g = 0; g < group; ++g) {                                                                \
        prefetch_share(kahead, vnow, g, part, block_bytes);                                          \
        score_keys(queries + g * dim, kblock, n, dim, at + (int64_t)g * job->max_keys, KT);         \
    }
        KV_SWITCH(kt, SCORE)
#undef SCORE
    }
    for (int g = 0; g < group; ++g) {
        float *s = scores + (int64_t)g * job->max_keys, peak = -INFINITY, total = 0.0f;
        int j = 0;
#ifdef HAVE_AVX2
        /* the max eight at a time (a scalar loop here kept peak on the stack: ~15% of the kernel) */
        __m256 peaks = _mm256_set1_ps(-INFINITY);
        for (; j + 8 <= keys; j += 8) peaks = _mm256_max_ps(_mm256_loadu_ps(s + j), peaks);
        float lanes_max[8];
        _mm256_storeu_ps(lanes_max, peaks);
        for (int l = 0; l < 8; ++l) peak = lanes_max[l] > peak ? lanes_max[l] : peak;
#endif
        for (; j < keys; ++j) peak = s[j] > peak ? s[j] : peak;
        j = 0;
#ifdef HAVE_AVX2
        /* eight at a time through exp8 (2e-7 relative): scalar expf was most of this kernel at long contexts */
        __m256 sums = _mm256_setzero_ps();
        const __m256 top = _mm256_set1_ps(peak);
        for (; j + 8 <= keys; j += 8) {
            const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), top));
            _mm256_storeu_ps(s + j, e);
            sums = _mm256_add_ps(sums, e);
        }
        float lanes[8];
        _mm256_storeu_ps(lanes, sums);
        for (int l = 0; l < 8; ++l) total += lanes[l];
#endif
        for (; j < keys; ++j) { s[j] = expf(s[j] - peak); total += s[j]; }
        if (partial != NULL) {
            partial[(int64_t)g * (2 + dim)] = peak;
            partial[(int64_t)g * (2 + dim) + 1] = total;
            continue;
        }
        const float inv = 1.0f / total;
        for (j = 0; j < keys; ++j) s[j] *= inv;
    }
    memset(acc, 0, sizeof(float) * group * dim);
    for (int j0 = 0; j0 < keys; j0 += bs) {
        const void *vblock = KV_BLOCK(vbase, j0 / bs);
        const int n = keys - j0 < bs ? keys - j0 : bs;
        const float *probs = scores + j0;
#define WEIGH(KT) for (int g = 0; g < group; ++g) weigh_values(probs + (int64_t)g * job->max_keys, vblock, n, dim, acc + g * dim, KT)
        KV_SWITCH(kt, WEIGH)
#undef WEIGH
    }
#undef KV_BLOCK
    if (partial != NULL) {
        for (int g = 0; g < group; ++g) memcpy(partial + (int64_t)g * (2 + dim) + 2, acc + g * dim, sizeof(float) * dim);
        return;
    }
    float *dst = job->out + ((int64_t)token * job->heads + (int64_t)kvh * group) * dim;
    memcpy(dst, acc, sizeof(float) * group * dim);
}

/* The chunks of (token, kv head) from unit `first` on, in order, into its output: each head's
 * sum over the chunks of their outputs times e^(max_c - max), over the same sum of their sums. */
static void attention_merge(const attention_job *job, int first, int chunks) {
    const int group = job->heads / job->kv_heads, dim = job->head_dim;
    const int token = job->unit_of[4 * first], kvh = job->unit_of[4 * first + 1];
    for (int g = 0; g < group; ++g) {
        const float *part = job->partials + ((int64_t)first * group + g) * (2 + dim);
        const int64_t step = (int64_t)group * (2 + dim);   /* the next chunk's, same head */
        float peak = -INFINITY, total = 0.0f;
        for (int c = 0; c < chunks; ++c) peak = part[c * step] > peak ? part[c * step] : peak;
        float *dst = job->out + ((int64_t)token * job->heads + (int64_t)kvh * group + g) * dim;
        memset(dst, 0, sizeof(float) * dim);
        for (int c = 0; c < chunks; ++c) {
            const float *chunk = part + c * step, weight = expf(chunk[0] - peak);
            total += chunk[1] * weight;
            for (int e = 0; e < dim; ++e) dst[e] += chunk[2 + e] * weight;
        }
        const float inv = 1.0f / total;
        for (int e = 0; e < dim; ++e) dst[e] *= inv;
    }
}

static void *attention_worker(void *arg) {
    attention_job *job = arg;
    const int group = job->heads / job->kv_heads;
    float *scratch = malloc(sizeof(float) * ((size_t)group * job->max_keys + 2 * (size_t)group * job->head_dim));
    if (!scratch) { __atomic_store_n(&job->failed, 1, __ATOMIC_RELAXED); return NULL; }
    float *queries = scratch + (size_t)group * job->max_keys, *acc = queries + (size_t)group * job->head_dim;
    for (;;) {
        const int unit = __atomic_fetch_add(&job->next_unit, 1, __ATOMIC_RELAXED);
        if (unit >= job->units) break;
        const int32_t *u = job->unit_of + 4 * unit;
        const int whole = u[2] == 0 && u[3] == job->key_end[u[0]];
        attend_range(job, u[0], u[1], u[2], u[3], scratch, queries, acc,
                     whole ? NULL : job->partials + (int64_t)unit * group * (2 + job->head_dim));
    }
    free(scratch);
    return NULL;
}

/* out[i] = attention of query row q_rows[i] over keys [0, key_end[i]) of block table row
 * seq_of_token[i]. Returns 0, or -1 if memory or a thread could not be had (out is then undefined). */
int fdplug_paged_attention(const float *q, const void *key_cache, const void *value_cache,
                           const int32_t *q_rows, const int32_t *block_tables, const int32_t *seq_of_token,
                           const int32_t *key_end, float *out, int num_tokens, int heads, int kv_heads,
                           int head_dim, int num_blocks, int block_size, int table_width, int max_keys,
                           float scale, int num_threads, int kv_type) {
    int64_t units = 0;
    int chunk;
    for (int t = 0; t < num_tokens; ++t) units += (int64_t)kv_heads * attention_chunks(key_end[t], block_size, &chunk);
    const int split = units > (int64_t)num_tokens * kv_heads;
    int32_t *unit_of = malloc(sizeof(int32_t) * 4 * (size_t)units);
    float *partials = split ? malloc(sizeof(float) * (size_t)units * (size_t)(heads / kv_heads) * (size_t)(2 + head_dim)) : NULL;
    if (unit_of == NULL || (split && partials == NULL)) {
        free(unit_of), free(partials);
        return -1;
    }
    int64_t at = 0;
    for (int t = 0; t < num_tokens; ++t) {
        const int keys = key_end[t], chunks = attention_chunks(keys, block_size, &chunk);
        for (int h = 0; h < kv_heads; ++h)
            for (int c = 0; c < chunks; ++c, ++at) {
                int32_t *u = unit_of + 4 * at;
                u[0] = t, u[1] = h, u[2] = c * chunk, u[3] = c == chunks - 1 ? keys : (c + 1) * chunk;
            }
    }
    attention_job job = {q, key_cache, value_cache, q_rows, block_tables, seq_of_token, key_end, out,
                         num_tokens, heads, kv_heads, head_dim, num_blocks, block_size, table_width,
                         max_keys, kv_type, scale, (int)units, unit_of, partials, 0, 0};
    run_workers(attention_worker, &job, num_threads < units ? num_threads : (int)units);
    for (int64_t u = 0; u < units && !job.failed;) {   /* the split rows' chunks merged, in order */
        const int chunks = attention_chunks(key_end[unit_of[4 * u]], block_size, &chunk);
        if (chunks > 1) attention_merge(&job, (int)u, chunks);
        u += chunks;
    }
    free(unit_of), free(partials);
    return job.failed ? -1 : 0;
}
