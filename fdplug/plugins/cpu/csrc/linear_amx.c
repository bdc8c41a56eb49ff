/* ---------------------------------------------------------------------------------------------
 * The packed linear in bf16 math on AMX tiles: fdplug_linear_packed's LP_BF16_MATH where the build
 * has AMX-BF16 (-march=native on such a CPU) and Linux lets the process use the tile registers.
 *
 * Why: vdpbf16ps tiles run ~190-220 GFLOP/s from 32 rows on two cores of an Intel(R) Xeon(R) Processor, avx512 with AMX,
 * 0.8x of paddle's float32 matmul (MKL) at 256 rows, so the startup timing put every bf16 layer on
 * the portable op, whose one-row call widens the layer (decode 12.5 tok/s against 29 before the
 * timing, SmolLM2's sizes; 2026-12-01). One TDPBF16PS multiplies a 16 x 32 tile of bf16 inputs into
 * a 32 x 16 tile of weights: 16 x 16 x 32 multiply-adds an instruction.
 *
 * The operands as they lie: a B tile is 16 pairs of k (rows) times 16 columns, each row 64 bytes:
 * exactly a 16-column slice of a packed panel's 16 k-pair rows (linear_packed.c: (k / 2) * 2 *
 * width + 2 * j + k % 2), read with the panel's row stride, 4 * width bytes. An A tile is 16 rows of
 * x's bf16 pairs (the rounding linear_bf16.c does, zero-padded to a multiple of 32 k and of 16 rows).
 *
 * Exactness: output (m, n) is lane n of row m of one C tile, accumulated from zero over the k blocks
 * of 32 in order (and within one, TDPBF16PS's pairs in order): no other row enters it, whatever the
 * batch, the tile or the thread count, so a row's bits do not depend on its batch. They are not
 * the vdpbf16ps tiles' bits (AMX adds a pair's even product first, vdpbf16ps its odd one): a process
 * whose library has AMX runs every LP_BF16_MATH call here (amx_ready decides once), and
 * FDPLUG_CPU_AMX=off builds the library without it. The bias is added to the finished sums as the
 * vdpbf16ps tiles add it. A k tail (depth not a multiple of 32) reads its B rows from a zeroed copy,
 * never past the panel.
 *
 * Included by linear_packed.c before fdplug_linear_packed (its job, the thread pool).
 * ------------------------------------------------------------------------------------------- */

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(HAVE_BF16_DOT) && defined(__linux__)
#define HAVE_AMX_BF16 1
#include <sys/syscall.h>

long syscall(long number, ...); /* unistd.h declares it only beyond -std=c99's POSIX */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((aligned(64))) amx_config;

/* Tile numbers are literals in GCC's intrinsics. Tiles 0-3 hold C: a row tile's four 16-column
 * tiles of a panel (amx_item), or two row tiles times two 16-column tiles (amx_pair) */
#define AMX_A 4  /* a row tile of x (amx_pair: the first) */
#define AMX_A1 5 /* amx_pair's second row tile */
#define AMX_B 6  /* a 16-column tile of weights */
#define AMX_B1 7 /* amx_pair's second */

/* Row tiles a block: an item's panels each pass over the block's x while it stays in L2 (256 rows
 * of K 576 in bf16: 288 KB). Each panel had passed over every row, x streamed from L3 once a panel:
 * from 1,024 rows the tiles fell to 0.54-0.81x of oneDNN's AMX GEMM (Intel(R) Xeon(R) Processor,
 * avx512, 2 threads, bench/gemm.py). */
#define AMX_ROW_BLOCK 16

static int amx_state; /* 0: not asked yet; 1: the process may use the tiles; -1: it may not */

/* Linux gives a process the tiles' 8 KB of state only when asked (arch_prctl ARCH_REQ_XCOMP_PERM
 * for XFEATURE_XTILEDATA, 18); without it the first tile instruction is SIGILL. Asked once. */
static int amx_ready(void) {
    int state = __atomic_load_n(&amx_state, __ATOMIC_ACQUIRE);
    if (state == 0) {
        state = syscall(SYS_arch_prctl, 0x1023, 18) == 0 ? 1 : -1;
        __atomic_store_n(&amx_state, state, __ATOMIC_RELEASE);
    }
    return state == 1;
}

typedef struct {
    const packed_job *job;
    int row_tile_rows; /* rows of the A and C tiles: 16, or the call's rows below that */
    int row_tiles, pieces, panels_per_piece;
    int64_t next_item;
} amx_job;

/* The C sums of row tile ``tile`` (16 rows of ``ld`` floats from ``sums``; rows past the call's
 * not written) into out's columns [col, col + width), plus the bias: 16 columns a vector (width is
 * a multiple of 16). Element by element this copy had been ~15% of a 2,048-row call. */
static void amx_out(const packed_job *job, int tile, int col, int width, const float *sums, int ld) {
    const int first = tile * 16, rows = job->rows - first < 16 ? job->rows - first : 16;
    for (int r = 0; r < rows; ++r) {
        float *out = job->out + (int64_t)(first + r) * job->cols + col;
        for (int c = 0; c < width; c += 16) {
            const __m512 v = _mm512_load_ps(sums + r * ld + c);
            _mm512_storeu_ps(out + c, job->bias == NULL ? v : _mm512_add_ps(v, _mm512_loadu_ps(job->bias + col + c)));
        }
    }
}

/* Panel ``panel``'s columns for rows [16 t, 16 t + rows) of x: C tiles over every k block in order. */
static void amx_item(const amx_job *amx, int tile, int panel, uint16_t *tail) {
    const packed_job *job = amx->job;
    const int depth = job->depth, width = job->cols - panel * LP_PANEL < LP_PANEL ? job->cols - panel * LP_PANEL
                                                                                  : LP_PANEL;
    const int nv = width / 16, pairs = depth / 2, stride = 4 * width;
    const uint16_t *w = (const uint16_t *)job->w + (int64_t)panel * LP_PANEL * depth;
    const uint32_t *x = job->x_pairs + (int64_t)tile * 16 * job->x_pairs_ld;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int p = 0; p < pairs; p += 16) {
        _tile_loadd(AMX_A, x + p, job->x_pairs_ld * 4);
        const uint16_t *b = w + (int64_t)p * 2 * width;
        if (pairs - p < 16) { /* the k tail: its rows, then zeros (x is zero there too) */
            memset(tail, 0, 16 * (size_t)stride);
            memcpy(tail, b, (size_t)(pairs - p) * (size_t)stride);
            b = tail;
        }
#define AMX_COLUMNS(V)                                                                               \
    if (nv > V) {                                                                                    \
        _tile_loadd(AMX_B, b + 32 * V, stride);                                                      \
        _tile_dpbf16ps(V, AMX_A, AMX_B);                                                             \
    }
        AMX_COLUMNS(0)
        AMX_COLUMNS(1)
        AMX_COLUMNS(2)
        AMX_COLUMNS(3)
#undef AMX_COLUMNS
    }
    float sums[16 * 64] __attribute__((aligned(64)));
    _tile_stored(0, sums, 256);
    if (nv > 1) _tile_stored(1, sums + 16, 256);
    if (nv > 2) _tile_stored(2, sums + 32, 256);
    if (nv > 3) _tile_stored(3, sums + 48, 256);
    amx_out(job, tile, panel * LP_PANEL, width, sums, 64);
}

/* Row tiles ``tile`` and ``tile + 1`` times panel ``panel``'s columns, 32 at a time: per k block
 * both row tiles' A and two column tiles' B loaded once each for four multiplies (amx_item loads a
 * B tile for one). The same C tiles over the same k blocks in the same order: amx_item's bits. */
static void amx_pair(const amx_job *amx, int tile, int panel, uint16_t *tail) {
    const packed_job *job = amx->job;
    const int depth = job->depth, width = job->cols - panel * LP_PANEL < LP_PANEL ? job->cols - panel * LP_PANEL
                                                                                  : LP_PANEL;
    const int nv = width / 16, pairs = depth / 2, stride = 4 * width, ld = job->x_pairs_ld * 4;
    const uint16_t *w = (const uint16_t *)job->w + (int64_t)panel * LP_PANEL * depth;
    const uint32_t *x = job->x_pairs + (int64_t)tile * 16 * job->x_pairs_ld;
    for (int v = 0; v < nv; v += 2) {   /* columns 16 v .. 16 v + 31 of the panel (16 where v + 1 == nv) */
        const int two = v + 1 < nv;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int p = 0; p < pairs; p += 16) {
            _tile_loadd(AMX_A, x + p, ld);
            _tile_loadd(AMX_A1, x + 16 * job->x_pairs_ld + p, ld);
            const uint16_t *b = w + (int64_t)p * 2 * width;
            if (pairs - p < 16) { /* the k tail: its rows, then zeros (x is zero there too) */
                memset(tail, 0, 16 * (size_t)stride);
                memcpy(tail, b, (size_t)(pairs - p) * (size_t)stride);
                b = tail;
            }
            _tile_loadd(AMX_B, b + 32 * v, stride);
            _tile_dpbf16ps(0, AMX_A, AMX_B);
            _tile_dpbf16ps(2, AMX_A1, AMX_B);
            if (two) {
                _tile_loadd(AMX_B1, b + 32 * (v + 1), stride);
                _tile_dpbf16ps(1, AMX_A, AMX_B1);
                _tile_dpbf16ps(3, AMX_A1, AMX_B1);
            }
        }
        float sums[32 * 32] __attribute__((aligned(64)));   /* [row of the pair][its 32 columns] */
        _tile_stored(0, sums, 128);
        _tile_stored(2, sums + 16 * 32, 128);
        if (two) {
            _tile_stored(1, sums + 16, 128);
            _tile_stored(3, sums + 16 * 32 + 16, 128);
        }
        for (int t = 0; t < 2; ++t) amx_out(job, tile + t, panel * LP_PANEL + 16 * v, two ? 32 : 16, sums + t * 16 * 32, 32);
    }
}

static void *amx_worker(void *arg) {
    amx_job *amx = arg;
    amx_config config = {0};
    config.palette = 1;
    for (int t = 0; t < 4; ++t) config.rows[t] = (uint8_t)amx->row_tile_rows, config.colsb[t] = 64;
    config.rows[AMX_A] = config.rows[AMX_A1] = (uint8_t)amx->row_tile_rows;
    config.colsb[AMX_A] = config.colsb[AMX_A1] = 64;
    config.rows[AMX_B] = config.rows[AMX_B1] = 16;
    config.colsb[AMX_B] = config.colsb[AMX_B1] = 64;
    _tile_loadconfig(&config);
    uint16_t tail[16 * 2 * LP_PANEL] __attribute__((aligned(64))); /* 16 k-pair rows of a panel */
    const int panels = (amx->job->cols + LP_PANEL - 1) / LP_PANEL;
    for (;;) { /* an item: a piece of panels, block of rows by block; in a block each panel over its row tiles */
        const int64_t item = __atomic_fetch_add(&amx->next_item, 1, __ATOMIC_RELAXED);
        if (item >= amx->pieces) break;
        const int first = (int)item * amx->panels_per_piece, end = first + amx->panels_per_piece;
        for (int block = 0; block < amx->row_tiles; block += AMX_ROW_BLOCK) {
            const int block_end = block + AMX_ROW_BLOCK < amx->row_tiles ? block + AMX_ROW_BLOCK : amx->row_tiles;
            for (int panel = first; panel < panels && panel < end; ++panel) {
                int tile = block;
                for (; tile + 2 <= block_end; tile += 2) amx_pair(amx, tile, panel, tail);
                if (tile < block_end) amx_item(amx, tile, panel, tail);
            }
        }
    }
    _tile_release();
    return NULL;
}

/* The job (x_pairs padded to a multiple of 16 rows with zeros) on AMX; 0, or -1 where the process
 * may not use the tiles (nothing written: the caller runs the vdpbf16ps tiles). */
static int amx_run(const packed_job *job, int num_threads) {
    if (!amx_ready()) return -1;
    const int panels = (job->cols + LP_PANEL - 1) / LP_PANEL;
    const int threads = num_threads > 1 ? num_threads : 1;
    const int pieces = panels < 4 * threads ? panels : 4 * threads; /* each thread a few sequential streams */
    const int panels_per_piece = (panels + pieces - 1) / pieces;
    amx_job amx = {job, job->rows < 16 ? job->rows : 16, (job->rows + 15) / 16,
                   (panels + panels_per_piece - 1) / panels_per_piece, panels_per_piece, 0};
    run_workers(amx_worker, &amx, threads < amx.pieces ? threads : amx.pieces);
    return 0;
}
#endif

/* Whether LP_BF16_MATH runs on AMX tiles in this process (the build has them and Linux allows them). */
int fdplug_linear_amx_bf16(void) {
#ifdef HAVE_AMX_BF16
    return amx_ready();
#else
    return 0;
#endif
}
