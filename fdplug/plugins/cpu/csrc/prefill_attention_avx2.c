/* ---------------------------------------------------------------------------------------------
 * prefill_attention.c's micro-tile on AVX2 + FMA (included there when the build has no AVX-512): the
 * same transposed keys, the same 32 keys a step, the same online softmax, in 8-lane ymm registers.
 *
 * Why its own shape: AVX2 has 16 registers, not 32, so what the AVX-512 tile keeps in registers
 * through a step (the scores of 32 keys and acc[v][D]) no longer fits. A step here has three
 * phases: scores, one 16-key tile at a time as two ymm halves (2 * PF_MR independent FMA chains,
 * the keys' two loads and one broadcast: 2 * PF_MR + 3 registers), stored to L1; the softmax over
 * the step's 32 scores of each vector; then probabilities times values over slices of 16 dims,
 * each slice's accumulators (2 * PF_MR registers) loaded from L1, rescaled by the step's alpha
 * (1 where the running max held: the same bits) and stored back once per 32 keys.
 * ------------------------------------------------------------------------------------------- */

/* Six vectors a micro-tile (15 registers in each loop: more FMAs per broadcast and per loaded key)
 * in units of 48 rows, which fill their micro-tiles whatever the group (48 * group vectors; only a
 * call's last unit may pad): ~5% faster than four vectors in units of 32 rows on 9/3, 14/2 and
 * 16/16 heads (one thread, best of 16, 1,024 tokens). With 32 rows, 16/16 heads left a micro-tile
 * of 2 vectors padded to 6 in every unit. */
#define PF_MR 6     /* query vectors a micro-tile */
#define PF_CHUNK 48 /* query rows a work unit */

/* The largest of eight floats (hsum8, in cpu_kernels.c, is their sum). */
static inline float hmax8(__m256 x) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

/* PF_MR query vectors (rows rows[v], heads heads[v]) over the keys their rows see, 32 keys a step.
 * D is a constant at the call sites that matter (64, 128). value_rows: this kv head's value row of
 * each key. */
static inline __attribute__((always_inline)) void prefill_tile(const prefill_job *job, const float *const *value_rows,
                                                               const int *rows, const int *heads, int nv,
                                                               const float *kt, const int D) {
    float qv[PF_MR][PF_MAX_DIM] __attribute__((aligned(32)));
    float acc[PF_MR][PF_MAX_DIM] __attribute__((aligned(32)));
    float probs[PF_MR][32] __attribute__((aligned(32)));   /* a step's scores, then its probabilities */
    float peak[PF_MR], total[PF_MR], alpha[PF_MR];
    int ends[PF_MR], keys = 0;
    for (int v = 0; v < PF_MR; ++v) {
        const int use = v < nv ? v : 0;    /* padding vectors repeat the first; never stored */
        const float *src = job->q + ((int64_t)job->q_rows[rows[use]] * job->heads + heads[use]) * D;
        for (int d = 0; d < D; ++d) {
            qv[v][d] = src[d] * job->scale;
            acc[v][d] = 0.0f;
        }
        ends[v] = job->key_end[rows[use]];
        keys = ends[v] > keys ? ends[v] : keys;
        peak[v] = -INFINITY;
        total[v] = 0.0f;
    }
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 none = _mm256_set1_ps(-INFINITY);
    for (int j0 = 0; j0 < keys; j0 += 32) {
        /* Fetch the step's value rows while the scores are computed: the value loads were where the
         * probabilities-times-values loop stalled (perf). With the next slice's prefetch there: 9%
         * faster on 16/16 heads of 128, no change on heads of 64 (one thread, A/B medians). */
        for (int t = 0; t < 32 && j0 + t < keys; ++t) _mm_prefetch((const char *)value_rows[j0 + t], _MM_HINT_T0);
        /* Scores of the step's two 16-key tiles (the second is zeros, unread, past the last key). */
        for (int half = 0; half < 2; ++half) {
            __m256 s0[PF_MR], s1[PF_MR];
            for (int v = 0; v < PF_MR; ++v) s0[v] = s1[v] = _mm256_setzero_ps();
            if (j0 + 16 * half < keys) {
                const float *tile = kt + (int64_t)(j0 / 16 + half) * D * 16;
                for (int d = 0; d < D; ++d) {
                    __m256 k0 = _mm256_load_ps(tile + d * 16), k1 = _mm256_load_ps(tile + d * 16 + 8);
                    PF_IN_REGISTER(k0);
                    PF_IN_REGISTER(k1);
                    for (int v = 0; v < PF_MR; ++v) {
                        const __m256 qd = _mm256_broadcast_ss(&qv[v][d]);
                        s0[v] = _mm256_fmadd_ps(qd, k0, s0[v]);
                        s1[v] = _mm256_fmadd_ps(qd, k1, s1[v]);
                    }
                }
            }
            for (int v = 0; v < PF_MR; ++v) {
                _mm256_store_ps(probs[v] + 16 * half, s0[v]);
                _mm256_store_ps(probs[v] + 16 * half + 8, s1[v]);
            }
        }
        /* The online softmax: per vector, the step's masked max, its probabilities and their sum,
         * and alpha, the factor that takes the accumulators to the new max. */
        for (int v = 0; v < PF_MR; ++v) {
            alpha[v] = 1.0f;
            if (j0 >= ends[v]) {   /* every key of these 32 is past the row's end */
                for (int q = 0; q < 4; ++q) _mm256_store_ps(probs[v] + 8 * q, _mm256_setzero_ps());
                continue;
            }
            const __m256i end = _mm256_set1_epi32(ends[v] - j0);
            __m256 seen[4], s[4], top = none;
            for (int q = 0; q < 4; ++q) {
                seen[q] = _mm256_castsi256_ps(_mm256_cmpgt_epi32(end, _mm256_add_epi32(lane, _mm256_set1_epi32(8 * q))));
                s[q] = _mm256_load_ps(probs[v] + 8 * q);
                top = _mm256_max_ps(top, _mm256_blendv_ps(none, s[q], seen[q]));
            }
            const float step_top = hmax8(top), next = step_top > peak[v] ? step_top : peak[v];
            const __m256 high = _mm256_set1_ps(next);
            __m256 sum = _mm256_setzero_ps();
            for (int q = 0; q < 4; ++q) {
                const __m256 p = _mm256_and_ps(seen[q], exp8(_mm256_sub_ps(s[q], high)));
                _mm256_store_ps(probs[v] + 8 * q, p);
                sum = _mm256_add_ps(sum, p);
            }
            const float added = hsum8(sum);
            if (next == peak[v]) { /* the max held: alpha is expf(0) = 1 */
                total[v] += added;
                continue;
            }
            alpha[v] = peak[v] == -INFINITY ? 0.0f : expf(peak[v] - next);
            total[v] = total[v] * alpha[v] + added;
            peak[v] = next;
        }
        /* acc = acc * alpha + probs . values, a slice of 16 dims at a time over the step's keys. */
        const int n = keys - j0 < 32 ? keys - j0 : 32;
        const float *const *values = value_rows + j0;
        for (int c = 0; c < D; c += 16) {
            __m256 a0[PF_MR], a1[PF_MR];
            for (int v = 0; v < PF_MR; ++v) {
                const __m256 rescale = _mm256_set1_ps(alpha[v]);
                a0[v] = _mm256_mul_ps(_mm256_load_ps(acc[v] + c), rescale);
                a1[v] = _mm256_mul_ps(_mm256_load_ps(acc[v] + c + 8), rescale);
            }
            for (int t = 0; t < n; ++t) {
                __m256 val0 = _mm256_loadu_ps(values[t] + c), val1 = _mm256_loadu_ps(values[t] + c + 8);
                PF_IN_REGISTER(val0);
                PF_IN_REGISTER(val1);
                if (c + 16 < D) _mm_prefetch((const char *)(values[t] + c + 16), _MM_HINT_T0); /* the next slice's line */
                for (int v = 0; v < PF_MR; ++v) {
                    const __m256 p = _mm256_broadcast_ss(&probs[v][t]);
                    a0[v] = _mm256_fmadd_ps(p, val0, a0[v]);
                    a1[v] = _mm256_fmadd_ps(p, val1, a1[v]);
                }
            }
            for (int v = 0; v < PF_MR; ++v) {
                _mm256_store_ps(acc[v] + c, a0[v]);
                _mm256_store_ps(acc[v] + c + 8, a1[v]);
            }
        }
    }
    for (int v = 0; v < nv; ++v) {
        float *dst = job->out + ((int64_t)rows[v] * job->heads + heads[v]) * D;
        const __m256 inv = _mm256_set1_ps(1.0f / total[v]);
        for (int c = 0; c < D; c += 8) _mm256_storeu_ps(dst + c, _mm256_mul_ps(_mm256_load_ps(acc[v] + c), inv));
    }
}
