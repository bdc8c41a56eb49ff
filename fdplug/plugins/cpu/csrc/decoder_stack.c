/* ---------------------------------------------------------------------------------------------
 * A decode step's decoder layers in one call: the decoder_stack op (plugins/cpu/native_stack.py).
 *
 * Why: a one-token decode step of a small model is mostly the time between kernels. Per layer the
 * model calls ~12 ops from Python (two norms, three or more linears, the q/k split, RoPE, the cache
 * write, attention, SwiGLU, the reshapes), each 10-20 us of interpreter and tensor bookkeeping: 5.3
 * ms of SmolLM2-135M's 10.2 ms a token (30 layers, Q4_1, this 2-core Zen 5), where llama.cpp, one
 * compiled graph, spends 6.8 ms on everything. Here the same kernels run back to back in C.
 *
 * Values: every stage is a call of the kernel the layer-by-layer path runs with the cpu plugin's
 * ops (gg_linear, the RMSNorm rows, RoPE, the cache write, paged attention, SwiGLU), on the same
 * inputs in the same order, and none of them depends on the thread count or on the other rows:
 * the result is that path's, bit for bit. The only differences are where outputs live: a fused
 * projection's groups write their columns side by side (gg_linear's row stride) instead of being
 * joined after, and q and k come out of RoPE in their own buffers instead of as split views.
 *
 * A float model's linears (weights packed at load, linear_packed.c) run as the cpu_native_linear op
 * runs them: fdplug_linear_packed with the layer's bias, the same call as layer by layer.
 *
 * Layout as the model's: x, residual [T, hidden]; qkv [T, (H + 2 KV) * D], q heads then k then v;
 * gate_up [T, 2 I], gate then up; the caches as cpu_kernels.c's attention reads them. Included by
 * cpu_kernels.c after every kernel it calls.
 * ------------------------------------------------------------------------------------------- */

#define DS_MAX_GROUPS 4

typedef struct {                          /* one linear layer: row groups of one block type each */
    const uint8_t *weight[DS_MAX_GROUPS];  /* [rows[g], depth / block * block bytes] GGML blocks */
    const float *bias;                     /* [cols] or NULL */
    int qtype[DS_MAX_GROUPS], rows[DS_MAX_GROUPS];
    int groups, depth, cols;
    int packed_kind;                       /* -1: GGML blocks; else weight[0] is packed (fdplug_linear_packed's
                                            * kind: LP_F32, LP_BF16, LP_BF16_MATH) and bias its bias */
} ds_linear;

typedef struct {
    const float *input_norm, *post_norm, *qk_norm; /* [hidden], [hidden], [H + KV, D] or NULL */
    ds_linear qkv, o, gate_up, down;
} ds_layer;

typedef struct {
    const ds_layer *layers;
    const uint8_t *embed_table;            /* [vocab, embed_row_bytes] GGML blocks of embed_qtype, or NULL */
    int64_t embed_row_bytes;
    int embed_qtype, num_layers, hidden, inter, heads, kv_heads, head_dim;
    float eps, scale;
    int math;                              /* the linears' math: gg_linear's GG_MATH_F32, _BF16 or _Q8 */
    int embed_packed;                      /* embed_table in fdplug_gguf_pack's groups (a tied lm_head's copy) */
} ds_model;

typedef struct {                          /* one step's inputs, outputs and attention metadata */
    const float *embed;                    /* [T, hidden]: the first layer's input; NULL: ids' table rows */
    const int64_t *ids;                    /* [T] token ids (checked against the vocabulary by the caller) */
    const float *cos, *sin;                /* [T, H + KV, D]: RotaryEmbedding.lookup's tables */
    void *const *key_caches, *const *value_caches; /* [num_layers], elements of type kv_type */
    const int64_t *slots;                  /* [T] cache slot of each token */
    const int32_t *q_rows, *block_tables, *seq_of_token, *key_end; /* paged attention's */
    float *x, *residual;                   /* out [T, hidden]: the last layer's MLP output and stream */
    float *scratch;                        /* fdplug_decoder_stack_scratch floats */
    int tokens, num_blocks, block_size, table_width, max_key_end, threads;
    int kv_type;                           /* the caches' element type (kv_elements.c) */
} ds_step;

static int64_t ds_qkv_width(const ds_model *m) { return (int64_t)(m->heads + 2 * m->kv_heads) * m->head_dim; }

/* The floats of scratch a step of `tokens` rows needs. */
int64_t fdplug_decoder_stack_scratch(const ds_model *m, int tokens) {
    const int64_t qk = (int64_t)(m->heads + m->kv_heads) * m->head_dim;
    return (int64_t)tokens * (3 * (int64_t)m->hidden + ds_qkv_width(m) + 2 * qk + (int64_t)m->heads * m->head_dim +
                              3 * (int64_t)m->inter);
}

/* out [T, cols] = x [T, depth] @ W^T (+ bias), each group's columns at its offset. */
static int ds_linear_run(const ds_linear *l, const float *x, float *out, int tokens, int math, int threads) {
    if (l->packed_kind >= 0) { /* -1: no memory for bf16 math's copy of x (-3 below); -2: checked at prepare */
        const int status = fdplug_linear_packed(x, l->weight[0], l->packed_kind, l->bias, out, tokens, l->cols,
                                                l->depth, threads);
        return status == -1 ? -3 : status;
    }
    int offset = 0;
    for (int g = 0; g < l->groups; ++g) {
        const int status = gg_linear(x, l->weight[g], out + offset, l->cols, tokens, l->rows[g], l->depth,
                                     l->qtype[g], math, threads);
        if (status != 0) return status;
        offset += l->rows[g];
    }
    if (l->bias != NULL)
        for (int64_t t = 0; t < tokens; ++t)
            for (int j = 0; j < l->cols; ++j) out[t * l->cols + j] += l->bias[j];
    return 0;
}

/* The rows threshold of the Python wrappers (native_norms.py): below it one thread. */
static int ds_norm_threads(int64_t rows, int threads) { return rows >= 64 ? threads : 1; }

/* qkv -> (optional q/k norm) -> RoPE into q [T, H, D] and k [T, KV, D]; k and v into the caches. */
static void ds_rotate_and_cache(const ds_model *m, const ds_layer *layer, const ds_step *s, int index,
                                const float *qkv, float *qk_normed, float *q, float *k) {
    const int D = m->head_dim, H = m->heads, KV = m->kv_heads, T = s->tokens;
    const int64_t width = ds_qkv_width(m), qk = (int64_t)(H + KV) * D;
    const float *src = qkv;
    int64_t stride = width;
    if (layer->qk_norm != NULL) {
        for (int t = 0; t < T; ++t)
            fdplug_rms_norm(qkv + t * width, layer->qk_norm, qk_normed + t * qk, H + KV, D, H + KV, m->eps, 1);
        src = qk_normed;
        stride = qk;
    }
    for (int t = 0; t < T; ++t) {
        const float *cos = s->cos + t * qk, *sin = s->sin + t * qk;
        fdplug_rope(src + t * stride, cos, sin, q + (int64_t)t * H * D, H, D, 1);
        fdplug_rope(src + t * stride + (int64_t)H * D, cos + (int64_t)H * D, sin + (int64_t)H * D,
                    k + (int64_t)t * KV * D, KV, D, 1);
    }
    const int64_t per_head = (int64_t)s->num_blocks * s->block_size;
    void *key_cache = s->key_caches[index], *value_cache = s->value_caches[index];
    for (int t = 0; t < T; ++t)
        for (int h = 0; h < KV; ++h) {
            const int64_t dst = ((int64_t)h * per_head + s->slots[t]) * D;
            kv_put_row(k + ((int64_t)t * KV + h) * D, (void *)kv_at(key_cache, dst, s->kv_type), D, s->kv_type);
            kv_put_row(qkv + t * width + (int64_t)(H + KV + h) * D, (void *)kv_at(value_cache, dst, s->kv_type), D,
                       s->kv_type);
        }
}

/* Every layer of one step. Returns 0; -1 if attention had no scratch memory or threads; -2 if a
 * linear's block type or packed shape is not run here (the caller checked them all at prepare); -3 if
 * bf16 or q8 math had no memory for its copy of a linear's input. */
int fdplug_decoder_stack(const ds_model *m, const ds_step *s) {
    const int T = s->tokens, hidden = m->hidden, inter = m->inter, threads = s->threads;
    const int64_t qk = (int64_t)(m->heads + m->kv_heads) * m->head_dim, attn = (int64_t)m->heads * m->head_dim;
    float *h = s->scratch, *o = h + (int64_t)T * hidden, *qkv = o + (int64_t)T * hidden;
    float *qk_normed = qkv + T * ds_qkv_width(m), *q = qk_normed + T * qk, *k = q + T * attn;
    float *att = k + (int64_t)T * m->kv_heads * m->head_dim, *gate_up = att + T * attn;
    float *act = gate_up + (int64_t)T * 2 * inter, *rows = act + (int64_t)T * inter;
    const int norm_threads = ds_norm_threads(T, threads);
    const float *embed = s->embed;
    int status;
    if (embed == NULL) { /* the rows the portable op dequantizes (gguf_blocks.dequantize's bits) */
        for (int t = 0; t < T; ++t) {
            if (m->embed_packed) {
#ifdef GG_HAVE_PACKED
                gp_row(m->embed_table, m->embed_qtype, hidden, s->ids[t], rows + (int64_t)t * hidden);
                continue;
#else
                return -2;   /* (a packed table only comes from a build that packs: unreachable) */
#endif
            }
            gg_dequant_row(m->embed_table + s->ids[t] * m->embed_row_bytes, m->embed_qtype, hidden,
                           rows + (int64_t)t * hidden, 0);
        }
        embed = rows;
    }
    for (int i = 0; i < m->num_layers; ++i) {
        const ds_layer *layer = &m->layers[i];
        if (i == 0) {
            fdplug_rms_norm(embed, layer->input_norm, h, T, hidden, 1, m->eps, norm_threads);
            memcpy(s->residual, embed, sizeof(float) * T * hidden);
        } else {   /* (residual in place: each element is read before it is written) */
            fdplug_add_rms_norm(s->x, s->residual, layer->input_norm, s->residual, h, T, hidden, m->eps, norm_threads);
        }
        if ((status = ds_linear_run(&layer->qkv, h, qkv, T, m->math, threads)) != 0) return status;
        ds_rotate_and_cache(m, layer, s, i, qkv, qk_normed, q, k);
        if (fdplug_paged_attention(q, s->key_caches[i], s->value_caches[i], s->q_rows, s->block_tables,
                                   s->seq_of_token, s->key_end, att, T, m->heads, m->kv_heads, m->head_dim,
                                   s->num_blocks, s->block_size, s->table_width, s->max_key_end, m->scale,
                                   threads, s->kv_type) != 0)
            return -1;
        if ((status = ds_linear_run(&layer->o, att, o, T, m->math, threads)) != 0) return status;
        fdplug_add_rms_norm(o, s->residual, layer->post_norm, s->residual, h, T, hidden, m->eps, norm_threads);
        if ((status = ds_linear_run(&layer->gate_up, h, gate_up, T, m->math, threads)) != 0) return status;
        fdplug_swiglu(gate_up, act, T, inter, (int64_t)T * inter >= (1 << 15) ? threads : 1);
        if ((status = ds_linear_run(&layer->down, act, s->x, T, m->math, threads)) != 0) return status;
    }
    return 0;
}
