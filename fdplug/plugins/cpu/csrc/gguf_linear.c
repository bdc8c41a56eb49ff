/* ---------------------------------------------------------------------------------------------
 * The GGUF linear layer: out[m, n] = sum_k x[m, k] * W[n, k], x float32 [M, K], W [N, row_bytes]
 * the file's GGML blocks (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1: 32 weights a block; Q4_K, Q5_K, Q6_K: 256),
 * read in place.
 *
 * Why: the portable op dequantizes the whole layer on every call (paddle's bitwise ops over
 * [N, blocks, bytes]) before its matmul: 1.3-2.3 ms a 576 x 1,536 layer (Q8_0, Q4_1), ~10 ms a
 * 512 x 1,536 one in Q6_K, even for a one-token decode step (bench/gguf_linear.py; there this
 * kernel runs 15-210x faster at 1-8 rows, 2-20x at 64-256, on this 2-core Zen 5). Here each block
 * is widened in registers and fed straight to FMAs, the weights staying the file's 4.5-8.5 bits a
 * weight in memory.
 *
 * Values: every weight is decoded to exactly the float32 that fdplug/core/quant/gguf_blocks.py (and
 * ggml's dequantize_row_*) gives: d * q, q * d + m, d1 * q - m1 are one FMA each on exact products
 * (a float16 scale has 11 significant bits, q at most 8), Q6_K's (d * sc) * q in ggml's order. So
 * only the summation order differs from the portable matmul (float32 rounding, ~1e-6 relative).
 *
 * Two routes, the same bits (each output is the same two FMA chains over k in order, then the same
 * lane sum, whatever the route, the row tile it falls in, the other rows or the thread count: a
 * token gets the same logits alone or in a batch; and the AVX2 tiles and the scalar loop keep the
 * same chains and lane sum, so every level gives the AVX-512 bits):
 *  - few rows (decode): a weight row's blocks are widened in registers and multiplied into up to
 *    GG_MR rows of x at once (8 with AVX-512, 3 with AVX2), so a block is decoded once per GG_MR rows;
 *  - more than GG_PANEL_ROWS rows (prefill): each thread widens a panel of weight rows once into a
 *    thread-local float buffer (in L2) and runs the same tiles over every row from there: the
 *    decoding, ~10 vector ops per 16 weights, is then paid once a call instead of once per GG_MR
 *    rows. Measured on this Zen 5 (one thread): the register route 1.2-2.6x the panel's at 2-6 rows,
 *    about even at 8, the panel's 1.2-1.8x ahead from 16 rows.
 *    At AVX2 the panel is laid out chain by chain and its tiles run one chain at a time (the same
 *    FMAs in the same order: gguf_tiles.c's gg_chain_tile).
 * Work items are pieces of output columns taken from one counter (as the FP8 GEMV's).
 *
 * Two other maths, each with one summation order of its own: bf16 (gguf_linear_bf16.c, AVX512-BF16)
 * and q8 (gguf_q8.c: x quantized to 8 bits per 4 values, integer sums; its blocks decoded to bytes,
 * in registers or, with AVX2 and more than one row tile, once a call into a panel of bytes).
 *
 * The block decoders (gguf_bytes.c) are 128-bit SSE4.1/SSSE3 code shared by the AVX-512 tiles
 * (gguf_linear_avx512.c) and the AVX2 + FMA ones (gguf_linear_avx2.c); elsewhere (other x86 levels,
 * ARM) a plain C loop over blocks widened to floats one at a time. Included by cpu_kernels.c after
 * linear.c (its thread pool, lanes_sum).
 * ------------------------------------------------------------------------------------------- */

enum { GG_F32 = 0, GG_F16 = 1, GG_Q4_0 = 2, GG_Q4_1 = 3, GG_Q5_0 = 6, GG_Q5_1 = 7, GG_Q8_0 = 8, GG_Q4_K = 12,
       GG_Q5_K = 13, GG_Q6_K = 14, GG_BF16 = 30 }; /* ggml's type ids; GG_F32: the panel buffer's widened rows */
#ifndef GG_PANEL_ROWS
#define GG_PANEL_ROWS 8             /* above this many rows the panel route */
#endif
#define GG_PANEL_BYTES (128 << 10)  /* a thread's widened panel: stays in L2 while every row passes */
#define GG_SMALL_X 8192             /* bf16 math: up to this many values of x rounded on the stack */

typedef struct {
    const float *x;
    const uint8_t *w;
    float *out;
    int rows, cols, depth, qtype, row_bytes, panel;
    int64_t cols_per_piece, next_piece;
    int64_t ld; /* out's row stride: cols, or more where this layer's columns are part of a wider output */
    const uint16_t *xb; /* bf16 math (gguf_linear_bf16.c): x rounded to bf16; NULL: float32 math */
    const int8_t *xq;   /* q8 math (gguf_q8.c): x quantized, with its scale lanes dx and sums sx; NULL: not */
    const float *dx, *sx;
} gg_job;

/* gg_linear's math; packed: gguf_packed.c's (the weights in its groups; _ROWS: the file's rows) */
enum { GG_MATH_F32 = 0, GG_MATH_BF16 = 1, GG_MATH_Q8 = 2, GG_MATH_PACKED = 3, GG_MATH_PACKED_ROWS = 4 };

/* Weights and bytes of a block of QT (one of the types below: gg_known) */
#define GG_QK(QT) ((QT) == GG_Q4_K || (QT) == GG_Q5_K || (QT) == GG_Q6_K ? 256 : 32)
#define GG_BYTES(QT)                                                                                 \
    ((QT) == GG_Q8_0 ? 34 : (QT) == GG_Q4_0 ? 18 : (QT) == GG_Q4_1 ? 20 : (QT) == GG_Q5_0 ? 22 :       \
     (QT) == GG_Q5_1 ? 24 : (QT) == GG_Q4_K ? 144 : (QT) == GG_Q5_K ? 176 :                            \
     (QT) == GG_F16 || (QT) == GG_BF16 ? 64 : 210)

static int gg_known(int qtype) {
    switch (qtype) {
    case GG_Q4_0: case GG_Q4_1: case GG_Q5_0: case GG_Q5_1: case GG_Q8_0: case GG_Q4_K: case GG_Q5_K: case GG_Q6_K:
    case GG_F16: case GG_BF16: /* float16 and bfloat16 rows: 32 values a "block" of 64 bytes here */
        return 1;
    default:
        return 0;
    }
}

/* The little-endian float16 at p, as float32 (exact). */
static inline float gg_f16(const uint8_t *p) { return half_to_float((uint16_t)(p[0] | p[1] << 8)); }

/* A K-quant super-block's per-sub-block factors: Q4_K/Q5_K d * sc and dmin * m for its 8 sub-blocks
 * of 32 (ggml's get_scale_min_k4: 6-bit fields, the top 2 bits of scales/mins 4-7 in bytes 0-7);
 * Q6_K d * sc for its 16 sub-blocks of 16. All exact products. */
typedef struct {
    float d[16], m[8];
} gg_scales;

static inline void gg_k_scales(const uint8_t *b, int qtype, gg_scales *s) {
    uint8_t q[16]; /* a copy: stores to s (floats) cannot then alias it, and the loops vectorize */
    if (qtype == GG_Q6_K) {
        const float d = gg_f16(b + 208);
        memcpy(q, b + 192, 16);
        for (int i = 0; i < 16; ++i) s->d[i] = d * (float)(int8_t)q[i];
        return;
    }
    const float d = gg_f16(b), dmin = gg_f16(b + 2);
    uint32_t w[3], sc[2], m[2];
    memcpy(w, b + 4, 12);   /* four 6-bit fields a word: bytes j, j + 4, j + 8 hold field j's and j + 4's bits */
    sc[0] = w[0] & 0x3F3F3F3F;
    m[0] = w[1] & 0x3F3F3F3F;
    sc[1] = (w[2] & 0x0F0F0F0F) | ((w[0] >> 2) & 0x30303030);
    m[1] = ((w[2] >> 4) & 0x0F0F0F0F) | ((w[1] >> 2) & 0x30303030);
    memcpy(q, sc, 8);
    memcpy(q + 8, m, 8);
    for (int j = 0; j < 8; ++j) {
        s->d[j] = d * (float)q[j];
        s->m[j] = dmin * (float)q[8 + j];
    }
}

#if defined(HAVE_AVX2) && defined(__F16C__) && defined(__SSE4_1__) && defined(__SSSE3__)
#include "gguf_bytes.c"
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include "gguf_linear_avx512.c"
#ifdef __AVX512BF16__
#include "gguf_linear_bf16.c"
#endif
#else
#include "gguf_linear_avx2.c"
#endif
#include "gguf_q8.c"
#include "gguf_packed.c"
#define GG_HAVE_PANELS 1
#ifdef GG_CHAIN_PANEL
#define GG_CHAINS 1 /* the panel in gg_dequant_row's chain layout */
#else
#define GG_CHAINS 0
#endif
#else
#include "gguf_linear_scalar.c"
#endif
#undef GG_SWITCH_ROWS

#ifdef GG_HAVE_PANELS
/* A thread's panel buffer, grown as needed and kept while the thread lives (the pool's threads
 * live on): allocated every call, blocks this large are mapped afresh and their pages faulted in
 * again. Freed when its thread exits (the fresh threads of a call made while the pool is busy). */
typedef struct {
    float *data;
    int64_t capacity;
} gg_buffer;

static pthread_key_t gg_buffer_key;
static pthread_once_t gg_buffer_once = PTHREAD_ONCE_INIT;
static int gg_buffer_key_made;

static void gg_buffer_free(void *p) {
    gg_buffer *buffer = p;
    free(buffer->data);
    free(buffer);
}

static void gg_buffer_init(void) { gg_buffer_key_made = pthread_key_create(&gg_buffer_key, gg_buffer_free) == 0; }

/* NULL if there is no memory for it */
static float *gg_panel_buffer(int64_t floats) {
    pthread_once(&gg_buffer_once, gg_buffer_init);
    if (!gg_buffer_key_made) return NULL;
    gg_buffer *buffer = pthread_getspecific(gg_buffer_key);
    if (buffer == NULL) {
        buffer = calloc(1, sizeof *buffer);
        if (buffer == NULL || pthread_setspecific(gg_buffer_key, buffer) != 0) {
            free(buffer);
            return NULL;
        }
    }
    if (floats > buffer->capacity) {
        free(buffer->data);
        buffer->data = NULL;
        buffer->capacity = 0;
        void *data;
        if (posix_memalign(&data, 64, sizeof(float) * (size_t)floats) != 0) return NULL;
        buffer->data = data;
        buffer->capacity = floats;
    }
    return buffer->data;
}

/* The panel route's rows a tile: GG_PMR, fewer where their inputs would not stay in L1 (32 KiB of
 * its 48) while the tile passes over every column: at K = 1,536, 5 rows ran ~1.2x 8 (AVX-512, one
 * thread; the 8 rows' 48 KiB came from L2 for every column). */
#ifndef GG_X_L1_BYTES
#define GG_X_L1_BYTES (32 << 10)
#endif
static int gg_panel_tile_rows(int depth, int x_bytes) {
    const int fit = GG_X_L1_BYTES / (x_bytes * depth);
    return fit < 1 ? 1 : fit < GG_PMR ? fit : GG_PMR;
}
#endif

#ifdef GG_HAVE_BF16
/* Columns [begin, end) in bf16 math: the panel route (the piece's weights decoded and rounded once,
 * half a float panel's bytes) or the register route, as in float32 math */
static void gg_bf16_piece(const gg_job *job, int begin, int end) {
    const int64_t values = (int64_t)(end - begin) * job->depth;
    uint16_t *panel = job->panel ? (uint16_t *)gg_panel_buffer((values + 1) / 2) : NULL;
    if (panel != NULL) {
        for (int n = begin; n < end; ++n)
            gg_dequant_row_bf16(job->w + (int64_t)n * job->row_bytes, job->qtype, job->depth,
                                panel + (int64_t)(n - begin) * job->depth);
        const int step = gg_panel_tile_rows(job->depth, 2);
        for (int m0 = 0; m0 < job->rows; m0 += step)
            gg_panel_columns_bf16(job, panel, m0, job->rows - m0 < step ? job->rows - m0 : step, begin, end);
        return;
    }
    for (int m0 = 0; m0 < job->rows; m0 += GG_BMR)
        gg_columns_bf16(job, job->w + (int64_t)begin * job->row_bytes, job->row_bytes, job->qtype, m0,
                        job->rows - m0 < GG_BMR ? job->rows - m0 : GG_BMR, begin, end);
}
#endif

#ifdef GG_Q8_PANEL
/* q8 math's panel route for columns [begin, end); 0 where there is no memory for the panel (the
 * register route then runs them: the same bits) */
static int gg_q8_panel_piece(const gg_job *job, int begin, int end) {
    uint8_t *panel = (uint8_t *)gg_panel_buffer(((end - begin) * gg_q8_panel_stride(job->depth / 32) + 3) / 4);
    if (panel == NULL) return 0;
    gg_q8_panel_fill(job, begin, end, panel);
    const int step = gg_q8_rows(job->qtype);
    for (int m0 = 0; m0 < job->rows; m0 += step)
        gg_q8_panel_columns(job, panel, m0, job->rows - m0 < step ? job->rows - m0 : step, begin, end);
    return 1;
}
#endif

static void *gg_worker(void *arg) {
    gg_job *job = arg;
    for (;;) {
        const int64_t begin = __atomic_fetch_add(&job->next_piece, 1, __ATOMIC_RELAXED) * job->cols_per_piece;
        if (begin >= job->cols) return NULL;
        const int end = (int)(begin + job->cols_per_piece < job->cols ? begin + job->cols_per_piece : job->cols);
#ifdef GG_HAVE_Q8
        if (job->xq != NULL) { /* q8 math: blocks stay bytes; decoded once a call where several row tiles read them */
            const int step = gg_q8_rows(job->qtype);
#ifdef GG_Q8_PANEL
            if (job->rows > step && GG_Q8_PANEL_TYPE(job->qtype) && gg_q8_panel_piece(job, (int)begin, end)) continue;
#endif
            for (int m0 = 0; m0 < job->rows; m0 += step)
                gg_q8_columns(job, job->w + begin * job->row_bytes, job->row_bytes, job->qtype, m0,
                              job->rows - m0 < step ? job->rows - m0 : step, (int)begin, end);
            continue;
        }
#endif
#ifdef GG_HAVE_PANELS
#ifdef GG_HAVE_BF16
        if (job->xb != NULL) {
            gg_bf16_piece(job, (int)begin, end);
            continue;
        }
#endif
        float *panel = job->panel ? gg_panel_buffer((int64_t)(end - begin) * job->depth) : NULL;
        if (panel != NULL) { /* (no memory for it: the register route, the same bits) */
            for (int n = (int)begin; n < end; ++n)
                gg_dequant_row(job->w + (int64_t)n * job->row_bytes, job->qtype, job->depth,
                               panel + (int64_t)(n - begin) * job->depth, GG_CHAINS);
            const int step = gg_panel_tile_rows(job->depth, 4);
            for (int m0 = 0; m0 < job->rows; m0 += step) /* the panel stays in L2 across row tiles */
                gg_panel_columns(job, panel, m0, job->rows - m0 < step ? job->rows - m0 : step, (int)begin, end);
            continue;
        }
#endif
        for (int m0 = 0; m0 < job->rows; m0 += GG_MR) /* a piece's blocks stay in L1/L2 across row tiles */
            gg_columns(job, job->w + begin * job->row_bytes, job->row_bytes, job->qtype, m0,
                       job->rows - m0 < GG_MR ? job->rows - m0 : GG_MR, (int)begin, end);
    }
}

/* Columns a piece: at most ``most`` (4 at least), in a number of pieces that is a multiple of the
 * threads, ``per_thread`` a thread at least (the last round of pieces keeps every thread busy). */
static int64_t gg_piece_cols(int cols, int64_t most, int num_threads, int per_thread) {
    const int64_t threads = num_threads > 1 ? num_threads : 1;
    int64_t pieces = (cols + (most > 4 ? most : 4) - 1) / (most > 4 ? most : 4);
    if (pieces < per_thread * threads) pieces = per_thread * threads;
    pieces = (pieces + threads - 1) / threads * threads;
    const int64_t per_piece = (cols + pieces - 1) / pieces;
    return per_piece > 4 ? per_piece : 4;
}

/* q8 math's quantized x (gguf_q8.c): on the stack for a few rows, else on the heap */
typedef struct {
    int8_t small_q[GG_SMALL_X];
    float small_f[GG_SMALL_X / 32 * 9];
    int8_t *q;
    float *f; /* 8 scale lanes, then (after every piece's) one sx, a piece */
} gg_q8_input;

/* -3 where there is no memory for it */
static int gg_q8_input_make(gg_q8_input *in, const float *x, int64_t values, gg_job *job) {
    in->q = in->small_q;
    in->f = in->small_f;
    if (values > GG_SMALL_X) {
        in->q = malloc((size_t)values);
        in->f = malloc(sizeof(float) * (size_t)(values / 32 * 9));
        if (in->q == NULL || in->f == NULL) return -3;
    }
#ifdef GG_HAVE_Q8
    gg_quantize_rows_q8(x, in->q, in->f, in->f + values / 32 * 8, values);
#else
    (void)x;
#endif
    job->xq = in->q;
    job->dx = in->f;
    job->sx = in->f + values / 32 * 8;
    return 0;
}

static void gg_q8_input_free(gg_q8_input *in) {
    if (in->q != in->small_q) free(in->q);
    if (in->f != in->small_f) free(in->f);
}

/* x [rows, depth] float32 times W [cols, depth] in GGML blocks of type qtype (ggml's id), the file's
 * bytes, rows of depth / block blocks -> out [rows, cols] float32 at row stride ld (>= cols: a
 * fused projection's groups write their columns side by side), on up to num_threads threads, in
 * ``math``: GG_MATH_F32, GG_MATH_BF16 (gguf_linear_bf16.c) or GG_MATH_Q8 (gguf_q8.c; F16 and BF16
 * rows, which have no integers to keep, in float32 math). Returns 0, or -2 for a type not decoded
 * here or a depth that is not a multiple of its block, -3 where the bf16 or q8 copy of x cannot be
 * allocated, -4 for a math this build lacks (bf16: AVX512-BF16; q8: AVX2); nothing written then. */
static int gg_linear(const float *x, const uint8_t *w, float *out, int64_t ld, int rows, int cols, int depth,
                     int qtype, int math, int num_threads) {
    if (!gg_known(qtype) || depth <= 0 || depth % GG_QK(qtype) != 0) return -2;
    if ((math == GG_MATH_PACKED || math == GG_MATH_PACKED_ROWS) && (qtype == GG_F16 || qtype == GG_BF16))
        math = GG_MATH_F32;   /* (no integers to keep: as the op computes them, native_gguf_packed.py) */
    if (math == GG_MATH_PACKED || math == GG_MATH_PACKED_ROWS) {
#ifdef GG_HAVE_PACKED
        return gp_linear(x, w, out, ld, rows, cols, depth, qtype, math == GG_MATH_PACKED, num_threads);
#else
        return -4;
#endif
    }
#ifndef GG_HAVE_BF16
    if (math == GG_MATH_BF16) return -4;
#endif
#ifndef GG_HAVE_Q8
    if (math == GG_MATH_Q8) return -4;
#endif
    if (math == GG_MATH_Q8 && (qtype == GG_F16 || qtype == GG_BF16)) math = GG_MATH_F32;
    if (rows <= 0 || cols <= 0) return 0;
    const int row_bytes = depth / GG_QK(qtype) * GG_BYTES(qtype);
#ifdef GG_HAVE_PANELS
    const int panel = rows > GG_PANEL_ROWS && math != GG_MATH_Q8;
#else
    const int panel = 0;
#endif
    /* the panel route: a piece is a panel, 4 a thread at least (both cores busy on the smallest
     * layers); the register route: up to ~64 KiB of blocks */
    const int panel_value_bytes = math == GG_MATH_BF16 ? 2 : 4;
    const int64_t per_piece =
        panel ? gg_piece_cols(cols, GG_PANEL_BYTES / ((int64_t)depth * panel_value_bytes), num_threads, 4)
              : gg_piece_cols(cols, (1 << 16) / row_bytes, num_threads, 1);
    gg_job job = {x, w, out, rows, cols, depth, qtype, row_bytes, panel, per_piece, 0, ld, NULL, NULL, NULL, NULL};
    const int64_t values = (int64_t)rows * depth;
    uint16_t small[GG_SMALL_X], *xb = NULL;
#ifdef GG_HAVE_BF16
    if (math == GG_MATH_BF16) { /* x rounded once a call: on the stack for a few rows, else on the heap */
        xb = values <= GG_SMALL_X ? small : NULL;
        if (xb == NULL && posix_memalign((void **)&xb, 64, sizeof(uint16_t) * (size_t)values) != 0) return -3;
        gg_round_rows_bf16(x, xb, values);
        job.xb = xb;
    }
#endif
    gg_q8_input q8;
    if (math == GG_MATH_Q8 && gg_q8_input_make(&q8, x, values, &job) != 0) {
        gg_q8_input_free(&q8);
        return -3;
    }
    const int64_t pieces = (cols + per_piece - 1) / per_piece;
    run_workers(gg_worker, &job, num_threads < pieces ? num_threads : (int)pieces);
    if (xb != small) free(xb);
    if (math == GG_MATH_Q8) gg_q8_input_free(&q8);
    return 0;
}

int fdplug_gguf_linear(const float *x, const uint8_t *w, float *out, int rows, int cols, int depth, int qtype,
                       int num_threads) {
    return gg_linear(x, w, out, cols, rows, cols, depth, qtype, GG_MATH_F32, num_threads);
}

/* fdplug_gguf_linear in bf16 math (gguf_linear_bf16.c): -4 where the build has no AVX512-BF16, -3
 * where x's bf16 copy cannot be allocated (nothing written either way) */
int fdplug_gguf_linear_bf16(const float *x, const uint8_t *w, float *out, int rows, int cols, int depth, int qtype,
                            int num_threads) {
    return gg_linear(x, w, out, cols, rows, cols, depth, qtype, GG_MATH_BF16, num_threads);
}

/* fdplug_gguf_linear in q8 math (gguf_q8.c): -4 where the build has no AVX2, -3 where x's
 * quantized copy cannot be allocated (nothing written either way) */
int fdplug_gguf_linear_q8(const float *x, const uint8_t *w, float *out, int rows, int cols, int depth, int qtype,
                          int num_threads) {
    return gg_linear(x, w, out, cols, rows, cols, depth, qtype, GG_MATH_Q8, num_threads);
}

/* fdplug_gguf_linear in packed q8 math (gguf_packed.c), on weights packed by fdplug_gguf_pack
 * (packed = 1) or the file's rows (0): -4 where the build has no AVX512-VNNI, -2 for packed cols not a
 * multiple of 16, -3 without memory for x's quantized copy or a thread's group buffer */
int fdplug_gguf_linear_packed(const float *x, const uint8_t *w, float *out, int rows, int cols, int depth, int qtype,
                              int packed, int num_threads) {
    return gg_linear(x, w, out, cols, rows, cols, depth, qtype, packed ? GG_MATH_PACKED : GG_MATH_PACKED_ROWS,
                     num_threads);
}

int fdplug_gguf_packed_available(void) {
#ifdef GG_HAVE_PACKED
    return 1;
#else
    return 0;
#endif
}

/* whether the packed tiles multiply with vpdpbusd (AVX512-VNNI or AVX-VNNI in the build) */
int fdplug_gguf_packed_vnni(void) {
#ifdef GP_VNNI
    return 1;
#else
    return 0;
#endif
}

#ifndef GG_HAVE_PACKED
int fdplug_gguf_pack(const uint8_t *w, uint8_t *out, int cols, int depth, int qtype) {
    (void)w, (void)out, (void)cols, (void)depth, (void)qtype;
    return -4;
}
int fdplug_gguf_packed_rows(const uint8_t *packed, const int64_t *ids, int n, float *out, int cols, int depth,
                            int qtype) {
    (void)packed, (void)ids, (void)n, (void)out, (void)cols, (void)depth, (void)qtype;
    return -4;
}
#endif

int fdplug_gguf_bf16_available(void) {
#ifdef GG_HAVE_BF16
    return 1;
#else
    return 0;
#endif
}

int fdplug_gguf_q8_available(void) {
#ifdef GG_HAVE_Q8
    return 1;
#else
    return 0;
#endif
}

/* W [cols, row bytes] in blocks of qtype -> out [cols, depth] float32 (the values gg_columns
 * multiplies: gguf_blocks.dequantize's bits). Returns as fdplug_gguf_linear. */
typedef struct {
    const uint8_t *w;
    float *out;
    int cols, depth, qtype, row_bytes, next_col;
} gg_dequant_job;

static void *gg_dequant_worker(void *arg) {
    gg_dequant_job *job = arg;
    for (;;) {
        const int n = __atomic_fetch_add(&job->next_col, 1, __ATOMIC_RELAXED);
        if (n >= job->cols) return NULL;
        gg_dequant_row(job->w + (int64_t)n * job->row_bytes, job->qtype, job->depth, job->out + (int64_t)n * job->depth, 0);
    }
}

int fdplug_gguf_dequant(const uint8_t *w, float *out, int cols, int depth, int qtype, int num_threads) {
    if (!gg_known(qtype) || depth <= 0 || depth % GG_QK(qtype) != 0) return -2;
    if (cols <= 0) return 0;
    gg_dequant_job job = {w, out, cols, depth, qtype, depth / GG_QK(qtype) * GG_BYTES(qtype), 0};
    run_workers(gg_dequant_worker, &job, num_threads < cols ? num_threads : cols);
    return 0;
}
