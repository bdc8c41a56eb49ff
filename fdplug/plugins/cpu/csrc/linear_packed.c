/* ---------------------------------------------------------------------------------------------
 * The linear layer on weights packed once at load (native_linear.prepare): outer-product tiles.
 *
 * Why: linear.c reads W [N, K] in place, so each output is a dot product over 16 lanes that ends
 * in a horizontal sum; at 64+ rows MKL's outer-product tiles ran 155-207 GFLOP/s on this machine's
 * two cores against those tiles' 120-140. Packed in panels of 64 columns, k-major, a tile
 * broadcasts one activation and multiplies it into 64 consecutive weights: no horizontal sums,
 * each weight vector loaded feeds MR FMAs, and a one-row GEMV still reads each panel as one
 * sequential stream (what the hardware prefetcher follows best: linear.c's LIN_STREAM_ROWS).
 *
 * Exactness: output (m, n) is one FMA chain over k in index order, from zero, in lane n % 16 of
 * one accumulator (bf16 math: one vdpbf16ps per pair of k). Nothing else enters it: not the tile,
 * the other rows, the thread count, nor the k blocking (a partial sum goes through memory as a
 * float32, exactly). A token gets the same bits decoded alone, in a batch, or in a prompt chunk;
 * bf16 weights in float32 math give the float32 kernel's bits on the same (widened) values.
 *
 * FP8 (e4m3 bytes with per-row block scales, fdplug_linear_packed_fp8): each 16 bytes widened in
 * registers (as the FP8 GEMV does: half precision, exact) times their columns' scales, so a weight is
 * e4m3 x scale rounded once, as dequantizing would give, and the layer is never widened in memory.
 *
 * Layout (LP_PANEL columns: 64 for the AVX-512 tiles and below x86-64-v3, 16 for the AVX2 tiles,
 * fdplug_linear_packed_panel() says which; N a multiple of 16, so a last 64-column panel is 16, 32, 48
 * or 64 wide): panel p holds columns [LP_PANEL p, LP_PANEL p + width) from element LP_PANEL p * K.
 * float32 and e4m3: (k, j) at k * width + j;
 * bf16: pairs of k interleaved, (k, j) at (k / 2) * 2 * width + 2 * j + k % 2 (K even), so one
 * 64-byte load is 16 columns times a pair of k: vdpbf16ps's operand as it is, or two float32
 * vectors by a shift and a mask.
 *
 * Included by cpu_kernels.c after linear_bf16.c (its thread pool, the bf16 rounding of x).
 * ------------------------------------------------------------------------------------------- */

#if !(defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)) && defined(HAVE_AVX2) && \
    defined(__F16C__)
#define LP_AVX2_TILES 1
#define LP_PANEL 16 /* an AVX2 tile's 16 columns: each k row one 64-byte line, read in sequence */
#else
#define LP_PANEL 64 /* an AVX-512 tile's 64 columns: 4 zmm a k row */
#endif
#define LP_MR 6         /* rows of a tile: 6 x 4 accumulators + 4 weight vectors of the 32 registers */
#define LP_K_BLOCK 1024 /* k a pass: a 64-column panel's slice is 256 KB (float32), in L2 for every row tile */
enum { LP_F32 = 0, LP_BF16 = 1, LP_BF16_MATH = 2, LP_FP8 = 3 };

typedef struct {
    const float *x;           /* [rows, depth] float32 (LP_F32, LP_BF16) */
    const uint32_t *x_pairs;  /* [rows, x_pairs_ld] bf16 pairs of x (LP_BF16_MATH) */
    const void *w;            /* packed */
    float *out;               /* [rows, cols] */
    int rows, cols, depth, kind, x_pairs_ld;
    int rows_per_block, panels_per_piece, pieces;
    int split_blocks;         /* > 0: the row tiles cut into split_blocks items a piece (lp_split) */
    int64_t next_item;
    const float *scales_t;    /* LP_FP8: [blocks][cols], 256 x each column's block scale */
    int block_k;
    const float *bias;        /* [cols] added to the finished sums, or NULL */
    int64_t call;             /* this call's number (lp_calls): what a thread's widened copy belongs to */
} packed_job;

static int64_t lp_calls;

/* The rows of the next row tile where `left` rows remain for `tiles` tiles (the fewest: rows over
 * LP_MR, rounded up): spread evenly, 16 rows as 6 + 5 + 5, not 6 + 6 + 4, since a tile of 4 rows
 * takes about as long as one of 6. Each output's chain is the same in any tile: the same bits. */
static inline int lp_tile_rows(int left, int tiles) { return (left + tiles - 1) / tiles; }

/* The first row of tile t of `tiles` over `rows` spread as lp_tile_rows spreads them. */
static inline int lp_tile_start(int rows, int tiles, int t) {
    return t * (rows / tiles) + (t < rows % tiles ? t : rows % tiles);
}

/* How many items each piece's row tiles are cut into, where the pieces alone would leave a thread
 * idle at the end (9 panels of 64 columns on 2 threads: 5 and 4): the fewest blocks that keep every
 * thread busy to within 5% (equal items assumed), fewer than the tiles (two tiles of 7 rows apart
 * read the panel twice for little: 1.02-1.03x the time), 0 where one block does. A block is whole
 * tiles of the call's own spread, so no tile gets smaller. AMD EPYC, avx512, 2 threads
 * (`bench/linear_ab.py`, interleaved, the same bits): 0.89-0.98x the time at 16-96 rows on
 * SmolLM2's 576- and 960-column layers (float32, bf16 widened, bf16 math); the AVX2 tiles' 16-column
 * panels already share evenly there (36, 60). */
#ifndef LP_SPLIT_EFFICIENCY
#define LP_SPLIT_EFFICIENCY 0.95
#endif
static int lp_split(int pieces, int tiles, int threads) {
    for (int blocks = 1; blocks < tiles && blocks <= 64; ++blocks) {
        const int64_t items = (int64_t)pieces * blocks, rounds = (items + threads - 1) / threads;
        if ((double)items >= LP_SPLIT_EFFICIENCY * (double)(rounds * threads)) return blocks > 1 ? blocks : 0;
    }
    return 0;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
/* Rows m0 .. m0 + MR - 1 times the NV vectors of panel ``panel``, k in [k0, k1) (k0, k1 even for
 * the bf16 kinds); MR, NV and KIND are constants at each call site. */
static inline __attribute__((always_inline)) void packed_tile(const packed_job *job, int m0, int panel, int k0,
                                                              int k1, const int MR, const int NV, const int KIND) {
    const int depth = job->depth, cols = job->cols, width = NV * 16;
    float *out = job->out + (int64_t)m0 * cols + (int64_t)panel * LP_PANEL;
    const int64_t panel_start = (int64_t)panel * LP_PANEL * depth;
    __m512 acc[LP_MR][4];
    for (int r = 0; r < MR; ++r)
        for (int v = 0; v < NV; ++v)
            acc[r][v] = k0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(out + (int64_t)r * cols + 16 * v);
    if (KIND == LP_F32) {
        const float *w = (const float *)job->w + panel_start + (int64_t)k0 * width;
        const float *x = job->x + (int64_t)m0 * depth;
        for (int k = k0; k < k1; ++k, w += width) {
            __m512 wv[4];
            for (int v = 0; v < NV; ++v) wv[v] = _mm512_loadu_ps(w + 16 * v);
            for (int r = 0; r < MR; ++r) {
                const __m512 xb = _mm512_set1_ps(x[(int64_t)r * depth + k]);
                for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_fmadd_ps(xb, wv[v], acc[r][v]);
            }
        }
    } else if (KIND == LP_BF16) {
        const uint16_t *w = (const uint16_t *)job->w + panel_start + (int64_t)k0 * width;
        const float *x = job->x + (int64_t)m0 * depth;
        const __m512i high = _mm512_set1_epi32((int)0xFFFF0000u);
        for (int k = k0; k < k1; k += 2, w += 2 * width) {
            for (int v = 0; v < NV; ++v) {
                const __m512i pairs = _mm512_loadu_si512((const void *)(w + 32 * v));
                const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
                const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(pairs, high));
                for (int r = 0; r < MR; ++r) {
                    const float *xr = x + (int64_t)r * depth + k;
                    acc[r][v] = _mm512_fmadd_ps(_mm512_set1_ps(xr[0]), even, acc[r][v]);
                    acc[r][v] = _mm512_fmadd_ps(_mm512_set1_ps(xr[1]), odd, acc[r][v]);
                }
            }
        }
    } else if (KIND == LP_FP8) {
        /* sign-extended and shifted by 7, a byte is a half of 2^-8 times its e4m3 value once bit 14
         * is cleared (the FP8 GEMV's conversion); times 256 x the scale: exact, then rounded once */
        const uint8_t *w = (const uint8_t *)job->w + panel_start + (int64_t)k0 * width;
        const float *x = job->x + (int64_t)m0 * depth;
        const __m256i keep = _mm256_set1_epi16((short)0xBF80);
        __m512 scale[4];
        int block_end = k0;
        for (int k = k0; k < k1; ++k, w += width) {
            if (k == block_end) {
                const float *row = job->scales_t + (int64_t)(k / job->block_k) * cols + (int64_t)panel * LP_PANEL;
                for (int v = 0; v < NV; ++v) scale[v] = _mm512_loadu_ps(row + 16 * v);
                block_end = (k / job->block_k + 1) * job->block_k;
            }
            __m512 wv[4];
            for (int v = 0; v < NV; ++v) {
                const __m256i h = _mm256_and_si256(
                    _mm256_slli_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + 16 * v))), 7), keep);
                wv[v] = _mm512_mul_ps(_mm512_cvtph_ps(h), scale[v]);
            }
            for (int r = 0; r < MR; ++r) {
                const __m512 xb = _mm512_set1_ps(x[(int64_t)r * depth + k]);
                for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_fmadd_ps(xb, wv[v], acc[r][v]);
            }
        }
    } else {
#ifdef HAVE_BF16_DOT
        const uint16_t *w = (const uint16_t *)job->w + panel_start + (int64_t)k0 * width;
        const uint32_t *x = job->x_pairs + (int64_t)m0 * job->x_pairs_ld;
        for (int k = k0; k < k1; k += 2, w += 2 * width) {
            __m512i wv[4];
            for (int v = 0; v < NV; ++v) wv[v] = _mm512_loadu_si512((const void *)(w + 32 * v));
            for (int r = 0; r < MR; ++r) {
                const __m512bh xb = (__m512bh)_mm512_set1_epi32((int)x[(int64_t)r * job->x_pairs_ld + k / 2]);
                for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], xb, (__m512bh)wv[v]);
            }
        }
#endif
    }
    if (job->bias != NULL && k1 == depth) { /* the finished sums: plus the bias, one rounding, as an add after */
        for (int v = 0; v < NV; ++v) {
            const __m512 b = _mm512_loadu_ps(job->bias + (int64_t)panel * LP_PANEL + 16 * v);
            for (int r = 0; r < MR; ++r) acc[r][v] = _mm512_add_ps(acc[r][v], b);
        }
    }
    for (int r = 0; r < MR; ++r)
        for (int v = 0; v < NV; ++v) _mm512_storeu_ps(out + (int64_t)r * cols + 16 * v, acc[r][v]);
}

#define LP_VCASE(KIND, M)                                                                            \
    switch (nv) {                                                                                    \
    case 1: packed_tile(job, m0, panel, k0, k1, M, 1, KIND); break;                                  \
    case 2: packed_tile(job, m0, panel, k0, k1, M, 2, KIND); break;                                  \
    case 3: packed_tile(job, m0, panel, k0, k1, M, 3, KIND); break;                                  \
    default: packed_tile(job, m0, panel, k0, k1, M, 4, KIND); break;                                 \
    }
#define LP_MCASE(KIND)                                                                               \
    switch (mr) {                                                                                    \
    case 1: LP_VCASE(KIND, 1) break;                                                                 \
    case 2: LP_VCASE(KIND, 2) break;                                                                 \
    case 3: LP_VCASE(KIND, 3) break;                                                                 \
    case 4: LP_VCASE(KIND, 4) break;                                                                 \
    case 5: LP_VCASE(KIND, 5) break;                                                                 \
    default: LP_VCASE(KIND, 6) break;                                                                \
    }

static void packed_block(const packed_job *job, int m0, int mr, int panel, int nv, int k0, int k1) {
    switch (job->kind) {
    case LP_F32: LP_MCASE(LP_F32) break;
    case LP_BF16: LP_MCASE(LP_BF16) break;
    case LP_FP8: LP_MCASE(LP_FP8) break;
    default: LP_MCASE(LP_BF16_MATH) break;
    }
}
#elif defined(LP_AVX2_TILES)
#include "linear_packed_avx2.c" /* the same chains in 8-lane tiles: the same bits */
#else
/* Below x86-64-v3: the same chains, one output at a time (the bf16 math kind is never asked for:
 * fdplug_linear_bf16dot_available() is 0). */
static void packed_block(const packed_job *job, int m0, int mr, int panel, int nv, int k0, int k1) {
    const int depth = job->depth, width = nv * 16;
    const int64_t panel_start = (int64_t)panel * LP_PANEL * depth;
    for (int r = 0; r < mr; ++r)
        for (int j = 0; j < width; ++j) {
            float *out = job->out + (int64_t)(m0 + r) * job->cols + (int64_t)panel * LP_PANEL + j;
            const float *x = job->x + (int64_t)(m0 + r) * depth;
            float sum = k0 == 0 ? 0.0f : *out;
            for (int k = k0; k < k1; ++k) {
                const int64_t at = panel_start + (int64_t)k * width + j;
                const float w = job->kind == LP_F32 ? ((const float *)job->w)[at]
                              : job->kind == LP_FP8
                                  ? e4m3_to_float(((const uint8_t *)job->w)[at]) * 0x1p-8f *
                                        job->scales_t[(int64_t)(k / job->block_k) * job->cols + panel * LP_PANEL + j]
                                  : bf16_to_float(((const uint16_t *)job->w)[panel_start + (int64_t)(k / 2) * 2 * width +
                                                                             2 * j + k % 2]);
                sum = fmaf(x[k], w, sum);
            }
            *out = job->bias != NULL && k1 == depth ? sum + job->bias[(int64_t)panel * LP_PANEL + j] : sum;
        }
}
#endif

#ifndef LP_AVX2_TILES
/* A work item's rows [first_row, last_row) times panels [first_panel, end_panel): panel by panel and
 * k block by k block, every row tile of the block (lp_tile_rows: 0.94-0.96x the time at 16 rows,
 * 0.975-1.0x at 64 against tiles of 6 and the rest; AMD EPYC, avx512, 2 threads, `bench/linear_ab.py`,
 * interleaved). */
static void packed_item(const packed_job *job, int first_row, int last_row, int first_panel, int end_panel) {
    const int k_step = job->rows <= LP_MR ? job->depth : LP_K_BLOCK; /* one row tile: nothing comes back to a k block */
    for (int panel = first_panel; panel < end_panel; ++panel) {
        const int left = (job->cols - panel * LP_PANEL) / 16;
        const int nv = left < 4 ? left : 4;
        for (int k0 = 0; k0 < job->depth; k0 += k_step) {
            const int k1 = k0 + k_step < job->depth ? k0 + k_step : job->depth;
            const int tiles = (last_row - first_row + LP_MR - 1) / LP_MR;
            for (int m0 = first_row, t = 0, mr; m0 < last_row; m0 += mr, ++t) {
                mr = lp_tile_rows(last_row - m0, tiles - t);
                packed_block(job, m0, mr, panel, nv, k0, k1);
            }
        }
    }
}

/* The k a block of rows is read for at a time (how many rows keep their inputs in L2). */
static int packed_k_slice(int depth) { return depth < LP_K_BLOCK ? depth : LP_K_BLOCK; }

#endif

/* Work items (a block of rows times a piece of panels) from the job's counter until none is left. */
static void *packed_worker(void *arg) {
    packed_job *job = arg;
    const int panels = (job->cols + LP_PANEL - 1) / LP_PANEL;
    for (;;) {
        const int64_t item = __atomic_fetch_add(&job->next_item, 1, __ATOMIC_RELAXED);
        int64_t first_row, last_row, piece;
        if (job->split_blocks > 0) { /* a piece's blocks one after another: both threads on its weights */
            piece = item / job->split_blocks;
            if (piece >= job->pieces) return NULL;
            const int block = (int)(item % job->split_blocks), tiles = (job->rows + LP_MR - 1) / LP_MR;
            first_row = lp_tile_start(job->rows, tiles, block * tiles / job->split_blocks);
            last_row = lp_tile_start(job->rows, tiles, (block + 1) * tiles / job->split_blocks);
        } else {
            first_row = item / job->pieces * job->rows_per_block;
            if (first_row >= job->rows) return NULL;
            piece = item % job->pieces;
            last_row = first_row + job->rows_per_block < job->rows ? first_row + job->rows_per_block : job->rows;
        }
        const int first_panel = (int)piece * job->panels_per_piece;
        const int end_panel = first_panel + job->panels_per_piece < panels ? first_panel + job->panels_per_piece : panels;
        packed_item(job, (int)first_row, (int)last_row, first_panel, end_panel);
    }
}

/* Rows in blocks that keep their inputs in L2, panels in pieces over the threads; runs the job. */
static void packed_run(packed_job *job, int x_bytes, int num_threads) {
    const int64_t k_slice = packed_k_slice(job->depth);
    const int64_t block_rows = LIN_X_BLOCK_BYTES / (k_slice * x_bytes) / LP_MR * LP_MR;
    job->rows_per_block = block_rows < LP_MR ? LP_MR : (int)block_rows;
    const int panels = (job->cols + LP_PANEL - 1) / LP_PANEL;
    const int threads = num_threads > 1 ? num_threads : 1;
    /* One row tile (decode): a thread's share in about four pieces, each read in sequence (one
     * stream a 64-column panel, four for the AVX2 tiles' 16-column ones). More rows: one panel a
     * piece, so both threads stay busy on small layers, and its row tiles in blocks where the
     * panels do not share evenly (lp_split). */
    job->panels_per_piece = job->rows <= LP_MR ? (panels + 4 * threads - 1) / (4 * threads) : 1;
    job->pieces = (panels + job->panels_per_piece - 1) / job->panels_per_piece;
    if (job->rows > LP_MR && job->rows <= job->rows_per_block)
        job->split_blocks = lp_split(job->pieces, (job->rows + LP_MR - 1) / LP_MR, threads);
    const int64_t items = job->split_blocks > 0 ? (int64_t)job->pieces * job->split_blocks
                                                : (int64_t)job->pieces * ((job->rows + job->rows_per_block - 1) /
                                                                          job->rows_per_block);
    run_workers(packed_worker, job, num_threads < items ? num_threads : (int)items);
}

#include "linear_amx.c" /* LP_BF16_MATH on AMX tiles, where the build and the OS have them */

/* x [rows, depth] float32 times weights packed as above (kind: LP_F32, LP_BF16 in float32 math,
 * LP_BF16_MATH: x rounded to bf16, vdpbf16ps), plus bias [cols] unless NULL -> out [rows, cols], on up
 * to num_threads threads.
 * cols must be a multiple of 16 and depth even for the bf16 kinds (the packing's conditions).
 * Returns 0; -1 when LP_BF16_MATH is not built or its bf16 copy of x cannot be allocated (nothing
 * written), -2 for arguments outside those conditions. */
int fdplug_linear_packed(const float *x, const void *w, int kind, const float *bias, float *out, int rows, int cols,
                         int depth, int num_threads) {
    if (rows <= 0 || cols <= 0) return 0;
    if (cols % 16 != 0 || kind < LP_F32 || kind > LP_BF16_MATH || (kind != LP_F32 && depth % 2 != 0)) return -2;
    if (depth <= 0) return -2;   /* the prepared layouts need a depth */
    packed_job job = {.x = x, .w = w, .out = out, .rows = rows, .cols = cols, .depth = depth, .kind = kind, .bias = bias};
    void *buffer = NULL;
    if (kind == LP_BF16_MATH) {
#ifdef HAVE_BF16_DOT
        const int padded = (depth + 31) / 32 * 32;
        const size_t tile_rows = (size_t)(rows + 15) / 16 * 16; /* AMX reads whole 16-row tiles: zeros past rows */
        if (posix_memalign(&buffer, 64, sizeof(uint16_t) * tile_rows * (size_t)padded) != 0) return -1;
        memset((uint16_t *)buffer + (size_t)rows * padded, 0, sizeof(uint16_t) * (tile_rows - rows) * padded);
        bf16dot_job convert = {{x, NULL, NULL, rows, cols, depth, 0, 0, 0, 0, 0}, buffer, padded, 0};
        run_workers(bf16dot_convert_worker, &convert, num_threads < rows ? num_threads : rows);
        job.x_pairs = buffer;
        job.x_pairs_ld = padded / 2;
#ifdef HAVE_AMX_BF16
        if (amx_run(&job, num_threads) == 0) {
            free(buffer);
            return 0;
        }
#endif
#else
        return -1;
#endif
    }
    job.call = __atomic_add_fetch(&lp_calls, 1, __ATOMIC_RELAXED);
    packed_run(&job, kind == LP_BF16_MATH ? 2 : 4, num_threads);
    free(buffer);
    return 0;
}

/* x [rows, depth] float32 times e4m3 weights packed as above with their block scales [cols,
 * ceil(depth / block_k)] (fp8_rows' layout, unpacked) -> out [rows, cols]. Returns 0, -1 if the
 * scales' transposed copy cannot be allocated, -2 for cols not a multiple of 16 or block_k < 1. */
int fdplug_linear_packed_fp8(const float *x, const uint8_t *w, const float *scales, const float *bias, float *out,
                             int rows, int cols, int depth, int block_k, int num_threads) {
    if (rows <= 0 || cols <= 0) return 0;
    if (cols % 16 != 0 || block_k < 1 || depth <= 0) return -2;
    const int blocks = (depth + block_k - 1) / block_k;
    float *scales_t = malloc(sizeof(float) * (size_t)blocks * (size_t)cols);
    if (scales_t == NULL) return -1;
    for (int n = 0; n < cols; ++n)
        for (int b = 0; b < blocks; ++b) scales_t[(int64_t)b * cols + n] = scales[(int64_t)n * blocks + b] * 256.0f;
    packed_job job = {.x = x, .w = w, .out = out, .rows = rows, .cols = cols, .depth = depth, .kind = LP_FP8,
                      .scales_t = scales_t, .block_k = block_k, .bias = bias};
    packed_run(&job, 4, num_threads);
    free(scales_t);
    return 0;
}

/* The columns of a panel in the packed layout of this build (the layout native_linear.prepare writes). */
int fdplug_linear_packed_panel(void) { return LP_PANEL; }
