/* ---------------------------------------------------------------------------------------------
 * Prefill attention from the paged cache, blocked (flash-attention's online softmax) on AVX-512 or
 * on AVX2 + FMA:
 *   out[i, h] = softmax_j(scale * q[i, h] . K[j, h / group]) V[j, h / group] over keys [0, key_end[i])
 * for query rows q_rows[i] of ONE sequence (block table `table`); key_end is the mask spec, per row.
 *
 * Why: a prefill chunk's rows each see hundreds of keys. The plain-Paddle reference materialises
 * the scores, adds a mask and runs paddle's softmax (a third of a 1,024-token prefill on this
 * machine); the decode kernel reads every key once per query row. First the keys are transposed
 * once a call into [kv head][tile][dim][16] (in parallel: units of PF_KEYS_A_UNIT keys of a head;
 * each row chunk used to transpose all the keys it saw, 32 times over for a 1,024-token prompt);
 * then a work unit is (kv head, chunk of PF_CHUNK rows) running micro-tiles of PF_MR query vectors
 * (row, head of the group) over 16-key tiles: scores by broadcast FMAs against the transposed
 * keys, masked, the running max and sum rescaled, then the probabilities times the value rows.
 * Nothing of size keys x rows in memory.
 *
 * Two micro-tiles (`prefill_tile`), one algorithm and one layout: AVX-512 keeps a 32-key step's
 * scores and the accumulators in its 32 zmm registers; AVX2 (prefill_attention_avx2.c: an AVX2-only
 * EPYC, most cloud x86, or FDPLUG_CPU_ISA=avx2) has 16 ymm registers of 8 lanes, so it takes a
 * 16-key tile as two halves and keeps its accumulators in L1. The rest is shared.
 * ------------------------------------------------------------------------------------------- */

#define PF_MAX_DIM 256
#define PF_KEYS_A_UNIT 256 /* keys a transposition unit (16 tiles) */
/* Keep a loaded vector in a register: gcc otherwise folded the load into each of the PF_MR FMAs
 * that use it (a memory operand each), and the loads, not the FMAs, bounded the loops (perf). */
#define PF_IN_REGISTER(v) __asm__("" : "+v"(v))

typedef struct {
    const float *q;
    const void *key_cache, *value_cache; /* elements of type kv_type (kv_elements.c) */
    const int32_t *q_rows, *key_end, *table;
    float *out;
    int rows, heads, kv_heads, dim, num_blocks, block_size, max_keys;
    float scale;
    int next_unit;
    float *kt;           /* [kv_heads][key_tiles][dim][16]: the transposed keys */
    const float **value_rows; /* [kv_heads][key_tiles * 16]: where each key's value row is (NULL past max_keys) */
    int key_tiles;       /* an even count: a score tile is two of them */
    int kv_type;
    float *values;       /* a 2-byte cache: [kv_heads][key_tiles * 16][dim], the value rows widened once */
} prefill_job;

#ifdef HAVE_AVX2
int fdplug_prefill_attention_available(void) { return 1; }

static inline const void *key_row(const prefill_job *job, const void *cache, int kvh, int j) {
    const int64_t head_stride = (int64_t)job->num_blocks * job->block_size * job->dim;
    const int64_t block = job->table[j / job->block_size];
    return kv_at(cache, kvh * head_stride + (block * job->block_size + j % job->block_size) * job->dim, job->kv_type);
}

/* Key tiles [tile0, tile1) of kv head kvh into job->kt (zeros past max_keys). */
static void transpose_keys(const prefill_job *job, int kvh, int tile0, int tile1) {
    const int dim = job->dim, keys = job->max_keys;
    for (int tile_index = tile0; tile_index < tile1; ++tile_index) {
        float *tile = job->kt + ((int64_t)kvh * job->key_tiles + tile_index) * dim * 16;
        const int j0 = tile_index * 16;
        for (int t = 0; t < 16; ++t) {
            const void *k = j0 + t < keys ? key_row(job, job->key_cache, kvh, j0 + t) : NULL;
            for (int d = 0; d < dim; ++d) tile[d * 16 + t] = k ? kv_get(k, d, job->kv_type) : 0.0f;
            const int64_t at = (int64_t)kvh * job->key_tiles * 16 + j0 + t;
            const void *value = k ? key_row(job, job->value_cache, kvh, j0 + t) : NULL;
            if (value != NULL && job->values != NULL) { /* a 2-byte cache: the row widened once */
                kv_get_row(value, job->values + at * dim, dim, job->kv_type);
                value = job->values + at * dim;
            }
            job->value_rows[at] = value;
        }
    }
}

static void *transpose_worker(void *arg) {
    prefill_job *job = arg;
    const int per_unit = PF_KEYS_A_UNIT / 16, chunks = (job->key_tiles + per_unit - 1) / per_unit;
    for (;;) {
        const int unit = __atomic_fetch_add(&job->next_unit, 1, __ATOMIC_RELAXED);
        if (unit >= chunks * job->kv_heads) return NULL;
        const int first = unit % chunks * per_unit;
        transpose_keys(job, unit / chunks, first, first + per_unit < job->key_tiles ? first + per_unit : job->key_tiles);
    }
}

#ifdef __AVX512F__
#define PF_MR 4     /* query vectors a micro-tile */
#define PF_CHUNK 32 /* query rows a work unit */

static inline __m512 exp16(__m512 x) { /* exp8 on each half: a 512-bit copy of it measured no faster */
    const __m256 lo = exp8(_mm512_castps512_ps256(x));
    const __m256 hi = exp8(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(lo)), _mm256_castps_pd(hi), 1));
}

/* PF_MR query vectors (rows rows[v], heads heads[v]) over the keys their rows see, 32 keys a step
 * (two transposed tiles: eight independent FMA chains for the scores, one max and one sum a row per
 * 32 keys). D is a constant at the call sites that matter (64, 128); acc[v][D] stays in registers
 * there. value_rows: this kv head's value row of each key. */
static inline __attribute__((always_inline)) void prefill_tile(const prefill_job *job, const float *const *value_rows,
                                                               const int *rows, const int *heads, int nv,
                                                               const float *kt, const int D) {
    float qv[PF_MR][PF_MAX_DIM] __attribute__((aligned(64)));
    float probs[PF_MR][32] __attribute__((aligned(64)));
    __m512 acc[PF_MR][PF_MAX_DIM / 16];
    float peak[PF_MR], total[PF_MR];
    int ends[PF_MR], keys = 0;
    for (int v = 0; v < PF_MR; ++v) {
        const int use = v < nv ? v : 0;    /* padding vectors repeat the first; never stored */
        const float *src = job->q + ((int64_t)job->q_rows[rows[use]] * job->heads + heads[use]) * D;
        for (int d = 0; d < D; ++d) qv[v][d] = src[d] * job->scale;
        ends[v] = job->key_end[rows[use]];
        keys = ends[v] > keys ? ends[v] : keys;
        peak[v] = -INFINITY;
        total[v] = 0.0f;
        for (int c = 0; c < D / 16; ++c) acc[v][c] = _mm512_setzero_ps();
    }
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512 none = _mm512_set1_ps(-INFINITY);
    for (int j0 = 0; j0 < keys; j0 += 32) {
        const float *tile = kt + (int64_t)(j0 / 16) * D * 16;  /* tiles j0 / 16 and the next: key_tiles is even */
        __m512 s0[PF_MR], s1[PF_MR];
        for (int v = 0; v < PF_MR; ++v) s0[v] = s1[v] = _mm512_setzero_ps();
        for (int d = 0; d < D; ++d) {
            __m512 k0 = _mm512_load_ps(tile + d * 16), k1 = _mm512_load_ps(tile + (D + d) * 16);
            PF_IN_REGISTER(k0);
            PF_IN_REGISTER(k1);
            for (int v = 0; v < PF_MR; ++v) {
                const __m512 qd = _mm512_set1_ps(qv[v][d]);
                s0[v] = _mm512_fmadd_ps(qd, k0, s0[v]);
                s1[v] = _mm512_fmadd_ps(qd, k1, s1[v]);
            }
        }
        const __m512i index0 = _mm512_add_epi32(lane, _mm512_set1_epi32(j0));
        const __m512i index1 = _mm512_add_epi32(index0, _mm512_set1_epi32(16));
        for (int v = 0; v < PF_MR; ++v) {
            const __m512i end = _mm512_set1_epi32(ends[v]);
            const __mmask16 seen0 = _mm512_cmplt_epi32_mask(index0, end), seen1 = _mm512_cmplt_epi32_mask(index1, end);
            if (!seen0) {   /* every key of these 32 is past the row's end (seen1 is then empty too) */
                _mm512_store_ps(probs[v], _mm512_setzero_ps());
                _mm512_store_ps(probs[v] + 16, _mm512_setzero_ps());
                continue;
            }
            const float top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_mask_mov_ps(none, seen0, s0[v]),
                                                                 _mm512_mask_mov_ps(none, seen1, s1[v])));
            const float next = top > peak[v] ? top : peak[v];
            const __m512 high = _mm512_set1_ps(next);
            const __m512 p0 = _mm512_maskz_mov_ps(seen0, exp16(_mm512_sub_ps(s0[v], high)));
            const __m512 p1 = _mm512_maskz_mov_ps(seen1, exp16(_mm512_sub_ps(s1[v], high)));
            _mm512_store_ps(probs[v], p0);
            _mm512_store_ps(probs[v] + 16, p1);
            const float added = _mm512_reduce_add_ps(_mm512_add_ps(p0, p1));
            if (next == peak[v]) { /* the max held: alpha would be expf(0) = 1, and x * 1 is x */
                total[v] += added;
                continue;
            }
            const float alpha = peak[v] == -INFINITY ? 0.0f : expf(peak[v] - next);
            total[v] = total[v] * alpha + added;
            peak[v] = next;
            const __m512 a = _mm512_set1_ps(alpha);
            for (int c = 0; c < D / 16; ++c) acc[v][c] = _mm512_mul_ps(acc[v][c], a);
        }
        const int n = keys - j0 < 32 ? keys - j0 : 32;
        for (int t = 0; t < n; ++t) {
            const float *value = value_rows[j0 + t];
            for (int c = 0; c < D / 16; ++c) {
                __m512 val = _mm512_loadu_ps(value + c * 16);
                PF_IN_REGISTER(val);
                for (int v = 0; v < PF_MR; ++v) acc[v][c] = _mm512_fmadd_ps(_mm512_set1_ps(probs[v][t]), val, acc[v][c]);
            }
        }
    }
    for (int v = 0; v < nv; ++v) {
        float *dst = job->out + ((int64_t)rows[v] * job->heads + heads[v]) * D;
        const __m512 inv = _mm512_set1_ps(1.0f / total[v]);
        for (int c = 0; c < D / 16; ++c) _mm512_storeu_ps(dst + c * 16, _mm512_mul_ps(acc[v][c], inv));
    }
}

#else
#include "prefill_attention_avx2.c" /* prefill_tile, PF_MR and PF_CHUNK for 16 ymm registers */
#endif

static void prefill_unit(const prefill_job *job, int unit) {
    const int group = job->heads / job->kv_heads, kvh = unit % job->kv_heads;
    const int first = (unit / job->kv_heads) * PF_CHUNK;
    const int last = first + PF_CHUNK < job->rows ? first + PF_CHUNK : job->rows;
    const float *kt = job->kt + (int64_t)kvh * job->key_tiles * job->dim * 16;
    const float *const *value_rows = job->value_rows + (int64_t)kvh * job->key_tiles * 16;
    const int vectors = (last - first) * group;
    for (int v0 = 0; v0 < vectors; v0 += PF_MR) {
        int rows[PF_MR], heads[PF_MR];
        const int nv = vectors - v0 < PF_MR ? vectors - v0 : PF_MR;
        for (int v = 0; v < nv; ++v) {
            rows[v] = first + (v0 + v) / group;
            heads[v] = kvh * group + (v0 + v) % group;
        }
        if (job->dim == 64) prefill_tile(job, value_rows, rows, heads, nv, kt, 64);
        else if (job->dim == 128) prefill_tile(job, value_rows, rows, heads, nv, kt, 128);
        else prefill_tile(job, value_rows, rows, heads, nv, kt, job->dim);
    }
}

static void *prefill_worker(void *arg) {
    prefill_job *job = arg;
    const int units = ((job->rows + PF_CHUNK - 1) / PF_CHUNK) * job->kv_heads;
    for (;;) {
        const int unit = __atomic_fetch_add(&job->next_unit, 1, __ATOMIC_RELAXED);
        if (unit >= units) return NULL;
        prefill_unit(job, unit);
    }
}

/* Rows i of out [rows, heads, dim] from q rows q_rows[i], keys [0, key_end[i]) of the sequence whose
 * block table is `table`. dim: a multiple of 16 up to PF_MAX_DIM (the caller checks). Returns 0, or -1
 * if scratch memory could not be had (out undefined). */
int fdplug_prefill_attention(const float *q, const void *key_cache, const void *value_cache,
                             const int32_t *q_rows, const int32_t *key_end, const int32_t *table, float *out,
                             int rows, int heads, int kv_heads, int dim, int num_blocks, int block_size,
                             int max_keys, float scale, int num_threads, int kv_type) {
    const int units = ((rows + PF_CHUNK - 1) / PF_CHUNK) * kv_heads;
    if (units <= 0) return 0;
    prefill_job job = {q, key_cache, value_cache, q_rows, key_end, table, out, rows, heads, kv_heads, dim,
                       num_blocks, block_size, max_keys, scale, 0, NULL, NULL, (max_keys + 31) / 32 * 2,
                       kv_type, NULL};
    const size_t keys = (size_t)kv_heads * job.key_tiles * 16, widened = kv_type == KV_F32 ? 0 : keys * dim;
    void *memory = NULL;
    if (posix_memalign(&memory, 64, sizeof(float) * (keys * dim + widened) + sizeof(float *) * keys) != 0) return -1;
    job.kt = memory;
    job.values = widened ? job.kt + keys * dim : NULL;
    job.value_rows = (const float **)(job.kt + keys * dim + widened);
    const int transpose_units = kv_heads * ((job.key_tiles + PF_KEYS_A_UNIT / 16 - 1) / (PF_KEYS_A_UNIT / 16));
    run_workers(transpose_worker, &job, num_threads < transpose_units ? num_threads : transpose_units);
    job.next_unit = 0;
    run_workers(prefill_worker, &job, num_threads < units ? num_threads : units);
    free(memory);
    return 0;
}
#else
int fdplug_prefill_attention_available(void) { return 0; }

int fdplug_prefill_attention(const float *q, const void *key_cache, const void *value_cache,
                             const int32_t *q_rows, const int32_t *key_end, const int32_t *table, float *out,
                             int rows, int heads, int kv_heads, int dim, int num_blocks, int block_size,
                             int max_keys, float scale, int num_threads, int kv_type) {
    (void)kv_type;
    return -2; /* built without AVX2 and FMA: the caller keeps the reference path */
}
#endif
