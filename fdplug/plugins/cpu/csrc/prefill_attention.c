/* ---------------------------------------------------------------------------------------------
 * Prefill attention from the paged cache, blocked (flash-attention's online softmax) on AVX-512:
 *   out[i, h] = softmax_j(scale * q[i, h] . K[j, h / group]) V[j, h / group] over keys [0, key_end[i])
 * for query rows q_rows[i] of ONE sequence (block table `table`); key_end is the mask spec, per row.
 *
 * Why: a prefill chunk's rows each see hundreds of keys. The plain-Paddle reference materialises
 * the scores, adds a mask and runs paddle's softmax (a third of a 1,024-token prefill on this
 * machine); the decode kernel reads every key once per query row. Here a work unit is (kv head,
 * chunk of PF_CHUNK rows): it transposes the keys it needs once into [tile][dim][16] and runs
 * micro-tiles of PF_MR query vectors (row, head of the group) over 16-key tiles: scores by
 * broadcast FMAs against the transposed keys, masked, the running max and sum rescaled, then the
 * probabilities times the value rows. One pass, nothing of size keys x rows in memory.
 * ------------------------------------------------------------------------------------------- */

#define PF_MR 4      /* query vectors a micro-tile */
#define PF_CHUNK 32  /* query rows a work unit */
#define PF_MAX_DIM 256

typedef struct {
    const float *q, *key_cache, *value_cache;
    const int32_t *q_rows, *key_end, *table;
    float *out;
    int rows, heads, kv_heads, dim, num_blocks, block_size, max_keys;
    float scale;
    int next_unit, failed;
} prefill_job;

#if defined(__AVX512F__) && defined(HAVE_AVX2)
int fdplug_prefill_attention_available(void) { return 1; }

static inline __m512 exp16(__m512 x) {
    const __m256 lo = exp8(_mm512_castps512_ps256(x));
    const __m256 hi = exp8(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(lo)), _mm256_castps_pd(hi), 1));
}

static inline const float *key_row(const prefill_job *job, const float *cache, int kvh, int j) {
    const int64_t head_stride = (int64_t)job->num_blocks * job->block_size * job->dim;
    const int64_t block = job->table[j / job->block_size];
    return cache + kvh * head_stride + (block * job->block_size + j % job->block_size) * job->dim;
}

/* keys [0, keys) of kv head kvh as kt[tile][d][16] (zeros past the last key). */
static void transpose_keys(const prefill_job *job, int kvh, int keys, float *kt) {
    const int dim = job->dim;
    for (int j0 = 0; j0 < keys; j0 += 16) {
        float *tile = kt + (int64_t)(j0 / 16) * dim * 16;
        for (int t = 0; t < 16; ++t) {
            const float *k = j0 + t < keys ? key_row(job, job->key_cache, kvh, j0 + t) : NULL;
            for (int d = 0; d < dim; ++d) tile[d * 16 + t] = k ? k[d] : 0.0f;
        }
    }
}

/* PF_MR query vectors (rows rows[v], heads heads[v]) over the keys their rows see. D is a constant
 * at the call sites that matter (64, 128); acc[v][D] stays in registers there. */
static inline __attribute__((always_inline)) void prefill_tile(const prefill_job *job, int kvh, const int *rows,
                                                               const int *heads, int nv, const float *kt,
                                                               const int D) {
    float qv[PF_MR][PF_MAX_DIM] __attribute__((aligned(64)));
    float probs[PF_MR][16] __attribute__((aligned(64)));
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
    for (int j0 = 0; j0 < keys; j0 += 16) {
        const float *tile = kt + (int64_t)(j0 / 16) * D * 16;
        __m512 s[PF_MR];
        for (int v = 0; v < PF_MR; ++v) s[v] = _mm512_setzero_ps();
        for (int d = 0; d < D; ++d) {
            const __m512 k = _mm512_load_ps(tile + d * 16);
            for (int v = 0; v < PF_MR; ++v) s[v] = _mm512_fmadd_ps(_mm512_set1_ps(qv[v][d]), k, s[v]);
        }
        const __m512i index = _mm512_add_epi32(lane, _mm512_set1_epi32(j0));
        for (int v = 0; v < PF_MR; ++v) {
            const __mmask16 seen = _mm512_cmplt_epi32_mask(index, _mm512_set1_epi32(ends[v]));
            if (!seen) {   /* every key of this tile is past the row's end */
                _mm512_store_ps(probs[v], _mm512_setzero_ps());
                continue;
            }
            const float top = _mm512_mask_reduce_max_ps(seen, s[v]);
            const float next = top > peak[v] ? top : peak[v];
            const __m512 p = _mm512_maskz_mov_ps(seen, exp16(_mm512_sub_ps(s[v], _mm512_set1_ps(next))));
            _mm512_store_ps(probs[v], p);
            if (next == peak[v]) { /* the max held: alpha would be expf(0) = 1, and x * 1 is x */
                total[v] += _mm512_reduce_add_ps(p);
                continue;
            }
            const float alpha = peak[v] == -INFINITY ? 0.0f : expf(peak[v] - next);
            total[v] = total[v] * alpha + _mm512_reduce_add_ps(p);
            peak[v] = next;
            const __m512 a = _mm512_set1_ps(alpha);
            for (int c = 0; c < D / 16; ++c) acc[v][c] = _mm512_mul_ps(acc[v][c], a);
        }
        const int n = keys - j0 < 16 ? keys - j0 : 16;
        for (int t = 0; t < n; ++t) {
            const float *value = key_row(job, job->value_cache, kvh, j0 + t);
            for (int c = 0; c < D / 16; ++c) {
                const __m512 val = _mm512_loadu_ps(value + c * 16);
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

static void prefill_unit(const prefill_job *job, int unit, float *kt) {
    const int group = job->heads / job->kv_heads, kvh = unit % job->kv_heads;
    const int first = (unit / job->kv_heads) * PF_CHUNK;
    const int last = first + PF_CHUNK < job->rows ? first + PF_CHUNK : job->rows;
    int keys = 0;
    for (int i = first; i < last; ++i) keys = job->key_end[i] > keys ? job->key_end[i] : keys;
    transpose_keys(job, kvh, keys, kt);
    const int vectors = (last - first) * group;
    for (int v0 = 0; v0 < vectors; v0 += PF_MR) {
        int rows[PF_MR], heads[PF_MR];
        const int nv = vectors - v0 < PF_MR ? vectors - v0 : PF_MR;
        for (int v = 0; v < nv; ++v) {
            rows[v] = first + (v0 + v) / group;
            heads[v] = kvh * group + (v0 + v) % group;
        }
        if (job->dim == 64) prefill_tile(job, kvh, rows, heads, nv, kt, 64);
        else if (job->dim == 128) prefill_tile(job, kvh, rows, heads, nv, kt, 128);
        else prefill_tile(job, kvh, rows, heads, nv, kt, job->dim);
    }
}

static void *prefill_worker(void *arg) {
    prefill_job *job = arg;
    void *memory = NULL;
    if (posix_memalign(&memory, 64, sizeof(float) * (size_t)((job->max_keys + 15) / 16) * 16 * job->dim) != 0) {
        __atomic_store_n(&job->failed, 1, __ATOMIC_RELAXED);
        return NULL;
    }
    float *kt = memory;
    const int units = ((job->rows + PF_CHUNK - 1) / PF_CHUNK) * job->kv_heads;
    for (;;) {
        const int unit = __atomic_fetch_add(&job->next_unit, 1, __ATOMIC_RELAXED);
        if (unit >= units) break;
        prefill_unit(job, unit, kt);
    }
    free(kt);
    return NULL;
}

/* Rows i of out [rows, heads, dim] from q rows q_rows[i], keys [0, key_end[i]) of the sequence whose
 * block table is `table`. dim: a multiple of 16 up to PF_MAX_DIM (the caller checks). Returns 0, or -1
 * if scratch memory could not be had (out undefined). */
int fdplug_prefill_attention(const float *q, const float *key_cache, const float *value_cache,
                             const int32_t *q_rows, const int32_t *key_end, const int32_t *table, float *out,
                             int rows, int heads, int kv_heads, int dim, int num_blocks, int block_size,
                             int max_keys, float scale, int num_threads) {
    prefill_job job = {q, key_cache, value_cache, q_rows, key_end, table, out, rows, heads, kv_heads, dim,
                       num_blocks, block_size, max_keys, scale, 0, 0};
    const int units = ((rows + PF_CHUNK - 1) / PF_CHUNK) * kv_heads;
    if (units > 0) run_workers(prefill_worker, &job, num_threads < units ? num_threads : units);
    return job.failed ? -1 : 0;
}
#else
int fdplug_prefill_attention_available(void) { return 0; }

int fdplug_prefill_attention(const float *q, const float *key_cache, const float *value_cache,
                             const int32_t *q_rows, const int32_t *key_end, const int32_t *table, float *out,
                             int rows, int heads, int kv_heads, int dim, int num_blocks, int block_size,
                             int max_keys, float scale, int num_threads) {
    return -2; /* built without AVX-512: the caller keeps the reference path */
}
#endif
