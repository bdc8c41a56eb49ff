/* ---------------------------------------------------------------------------------------------
 * The packed linear's tiles on AVX2 + FMA + F16C (x86-64-v3: AMD Zen 2/3, Intel Haswell on, most
 * cloud x86): 16 ymm registers of 8 lanes instead of 32 zmm of 16.
 *
 * Why: without these the packed layout ran a scalar loop (~3-4 GFLOP/s, 0.01-0.10x paddle's
 * matmul), and selection had to refuse the kernel below x86-64-v4. An output is still one FMA
 * chain over k in index order from zero, in one lane, so these tiles give the AVX-512 tiles' bits
 * exactly (every kind: float32, bf16 widened, e4m3 widened and scaled), whatever the level the
 * library was built for.
 *
 * Panels of 16 columns here (LP_PANEL; the AVX-512 tiles' are 64), so that a 6 x 16 tile reads its
 * weights as one sequential stream and a one-row tile reads four (4 panels, 8 independent chains).
 * Against the 64-column panels (a tile read 64 of each 256-byte k row, prefetched) on AMD EPYC,
 * avx2-or-less (2026-11-29, 2 threads, interleaved, SmolLM2's four shapes, in a C driver): one row
 * 1.10-1.16x, 16-1,024 rows 0.93-1.11x (most 0.99-1.05x). Every tile reads x in place, its rows'
 * broadcasts six streams (packed_rows says why no copy).
 *
 * Tiles of rows x 8-column vectors, at most 12 accumulators of the 16 registers (packed_small says
 * which for how many rows).
 *
 * Included by linear_packed.c in place of the AVX-512 tiles.
 * ------------------------------------------------------------------------------------------- */

/* The k of a pass over a block of rows (above LP_MR rows): at most LP8_K_BLOCK, the depth cut in
 * equal even parts. Every row tile of the block passes over a 16-column panel's slice of it (16 x
 * 576 floats: 36 KB, from L2 with the prefetch below), each tile's x (6 rows of up to 576) read
 * in place. On AMD EPYC, avx2-or-less (2026-11-29, 2 threads, interleaved): 576 against 288 (the
 * slice in L1, BLIS's Haswell KC is 256) 1.01-1.07x at 256-1,024 rows. */
#ifndef LP8_K_BLOCK
#define LP8_K_BLOCK 576
#endif

/* Each k step prefetches its panels' line LP8_PREFETCH_K rows ahead: a hint (the same bits). The
 * lines are in sequence, but without it the tiles waited on L2 (AMD EPYC, avx2-or-less, 2 threads,
 * interleaved, 16-column panels: 3-15% slower at 16-1,024 rows than the 64-column panels with it). */
#ifndef LP8_PREFETCH_K
#define LP8_PREFETCH_K 48
#endif

static int packed_k_slice(int depth) {
    const int passes = (depth + LP8_K_BLOCK - 1) / LP8_K_BLOCK;
    return ((depth + passes - 1) / passes + 1) / 2 * 2;
}

/* Weight vector i (8 columns) of a tile at the k row ``w``: float32 loaded, or e4m3 bytes widened
 * through half precision (sign-extended, shifted by 7, bit 14 cleared: 2^-8 times the e4m3 value,
 * exactly) and times their columns' scales (256 x each: exact, then rounded once), as the AVX-512
 * tile. A tile's vectors 2p and 2p + 1 are panel p's (``panel_elements`` on from the first's). */
static inline __attribute__((always_inline)) __m256 packed_weights8(const char *w, int64_t panel_bytes, int i,
                                                                    const float *scale, __m128i keep, const int KIND) {
    const char *at = w + (i >> 1) * panel_bytes;
    if (KIND == LP_F32) return _mm256_loadu_ps((const float *)at + 8 * (i & 1));
    const __m128i h = _mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)(at + 8 * (i & 1)))), 7),
                                    keep);
    return _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_loadu_ps(scale + 8 * i));
}

/* Rows m0 .. m0 + MR - 1 times the NV 8-column vectors from column first_col (NV / 2 panels in a
 * row), k in [k0, k1) (k0, k1 even for bf16); ``w_at``: the first panel's weights at k0. Row r's x
 * at k: ``x[r * row_step + k]``. MR, NV and KIND are constants at each call site.
 * A k step loads every weight vector and every row's activation once; the smaller of the two sets
 * is held in registers across the other (ROWS_FIRST: the rows' broadcasts), so that the MR x NV
 * accumulators, that set and one of the other fit the 16 registers (a 1 x 8 tile holding its 8
 * weight vectors spilled: half the speed of paddle's GEMV on a 960 x 576 layer). */
static inline __attribute__((always_inline)) void packed_tile8(const packed_job *job, int m0, int64_t first_col,
                                                               const char *w_at, const float *x, int64_t row_step,
                                                               int k0, int k1, const int MR, const int NV,
                                                               const int KIND) {
    const int depth = job->depth, cols = job->cols, ROWS_FIRST = MR < NV;
    float *out = job->out + (int64_t)m0 * cols + first_col;
    __m256 acc[LP_MR][8];
    for (int r = 0; r < MR; ++r)
        for (int v = 0; v < NV; ++v)
            acc[r][v] = k0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(out + (int64_t)r * cols + 8 * v);
    x += k0;
    if (KIND == LP_BF16) { /* pairs of k: 8 columns x (k, k + 1) a 32-byte load, split by a shift and a mask */
        const int64_t panel_bytes = (int64_t)LP_PANEL * depth * 2;
        const char *w = w_at;
        const __m256i high = _mm256_set1_epi32((int)0xFFFF0000u);
        for (int k = k0; k < k1; k += 2, w += 4 * LP_PANEL, x += 2) {
            for (int p = 0; p < (NV + 1) / 2; ++p) _mm_prefetch(w + p * panel_bytes + LP8_PREFETCH_K * 2 * LP_PANEL, _MM_HINT_T0);
            __m256 even[8], odd[8], x0[LP_MR], x1[LP_MR];
            for (int i = 0; i < (ROWS_FIRST ? MR : NV); ++i) {
                if (ROWS_FIRST) {
                    x0[i] = _mm256_broadcast_ss(x + i * row_step);
                    x1[i] = _mm256_broadcast_ss(x + i * row_step + 1);
                } else {
                    const __m256i pairs = _mm256_loadu_si256((const __m256i *)(w + (i >> 1) * panel_bytes + 32 * (i & 1)));
                    even[i] = _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16));
                    odd[i] = _mm256_castsi256_ps(_mm256_and_si256(pairs, high));
                }
            }
            for (int j = 0; j < (ROWS_FIRST ? NV : MR); ++j) {
                if (ROWS_FIRST) {
                    const __m256i pairs = _mm256_loadu_si256((const __m256i *)(w + (j >> 1) * panel_bytes + 32 * (j & 1)));
                    const __m256 e = _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16));
                    const __m256 o = _mm256_castsi256_ps(_mm256_and_si256(pairs, high));
                    for (int r = 0; r < MR; ++r)
                        acc[r][j] = _mm256_fmadd_ps(x1[r], o, _mm256_fmadd_ps(x0[r], e, acc[r][j]));
                } else {
                    const __m256 b0 = _mm256_broadcast_ss(x + j * row_step);
                    const __m256 b1 = _mm256_broadcast_ss(x + j * row_step + 1);
                    for (int v = 0; v < NV; ++v)
                        acc[j][v] = _mm256_fmadd_ps(b1, odd[v], _mm256_fmadd_ps(b0, even[v], acc[j][v]));
                }
            }
        }
    } else { /* LP_F32, or LP_FP8: the AVX-512 tile's conversion, 8 bytes at a time (exact), times the scale */
        const int bytes = KIND == LP_F32 ? 4 : 1;
        const int64_t panel_bytes = (int64_t)LP_PANEL * depth * bytes;
        const char *w = w_at;
        const __m128i keep = _mm_set1_epi16((short)0xBF80);
        const float *scale = NULL;   /* LP_FP8: this k block's scales of the tile's columns */
        int block_end = k0;
        for (int k = k0; k < k1; ++k, w += LP_PANEL * bytes, ++x) {
            for (int p = 0; p < (NV + 1) / 2; ++p) _mm_prefetch(w + p * panel_bytes + LP8_PREFETCH_K * LP_PANEL * bytes, _MM_HINT_T0);
            if (KIND == LP_FP8 && k == block_end) {
                scale = job->scales_t + (int64_t)(k / job->block_k) * cols + first_col;
                block_end = (k / job->block_k + 1) * job->block_k;
            }
            __m256 held[8];   /* the rows' broadcasts, or the weight vectors */
            for (int i = 0; i < (ROWS_FIRST ? MR : NV); ++i)
                held[i] = ROWS_FIRST ? _mm256_broadcast_ss(x + i * row_step)
                                     : packed_weights8(w, panel_bytes, i, scale, keep, KIND);
            for (int j = 0; j < (ROWS_FIRST ? NV : MR); ++j) {
                if (ROWS_FIRST) {
                    const __m256 wv = packed_weights8(w, panel_bytes, j, scale, keep, KIND);
                    for (int r = 0; r < MR; ++r) acc[r][j] = _mm256_fmadd_ps(held[r], wv, acc[r][j]);
                } else {
                    const __m256 xb = _mm256_broadcast_ss(x + j * row_step);
                    for (int v = 0; v < NV; ++v) acc[j][v] = _mm256_fmadd_ps(xb, held[v], acc[j][v]);
                }
            }
        }
    }
    if (job->bias != NULL && k1 == depth) { /* the finished sums plus the bias: one rounding, as the AVX-512 tile */
        for (int v = 0; v < NV; ++v) {
            const __m256 b = _mm256_loadu_ps(job->bias + first_col + 8 * v);
            for (int r = 0; r < MR; ++r) acc[r][v] = _mm256_add_ps(acc[r][v], b);
        }
    }
    for (int r = 0; r < MR; ++r)
        for (int v = 0; v < NV; ++v) _mm256_storeu_ps(out + (int64_t)r * cols + 8 * v, acc[r][v]);
}

/* The weights of KIND at (k, panel): a bf16 pair row holds 2 x 16 halves, the others 16 elements. */
static inline __attribute__((always_inline)) const char *packed_at(const packed_job *job, int panel, int k,
                                                                   const int KIND) {
    const int bytes = KIND == LP_F32 ? 4 : KIND == LP_FP8 ? 1 : 2;
    return (const char *)job->w + ((int64_t)panel * LP_PANEL * job->depth + (int64_t)k * LP_PANEL) * bytes;
}

#define LP8_TILE(M, N) packed_tile8(job, m0 + row, first_col, w_at, x + row * row_step, row_step, 0, depth, M, N, KIND)

/* One row tile (mr rows, 1..LP_MR, x in place) over panels [panel, panel + n) for the whole depth:
 * one row takes up to 4 panels (8 independent chains, 4 sequential streams, as decode wants);
 * float32 and FP8: 2-3 rows take 2 panels at a time, 4-6 rows 1 (BLIS's 6 x 16 Haswell tile); bf16,
 * whose two halves of a pair need two registers more: 2 rows 2 panels, then 1 for 3 or 4 rows, 5-6
 * rows as 4 and the rest. Returns the panels done. */
static inline __attribute__((always_inline)) int packed_small(const packed_job *job, int m0, int mr, int panel,
                                                              int n, const int KIND) {
    const int depth = job->depth;
    const int64_t first_col = (int64_t)panel * LP_PANEL, row_step = depth;
    const char *w_at = packed_at(job, panel, 0, KIND);
    const float *x = job->x + (int64_t)m0 * depth;
    if (mr == 1) {
        const int row = 0;
        switch (n < 4 ? n : 4) {
        case 1: LP8_TILE(1, 2); return 1;
        case 2: LP8_TILE(1, 4); return 2;
        case 3: LP8_TILE(1, 6); return 3;
        default: LP8_TILE(1, 8); return 4;
        }
    }
    const int wide = (KIND == LP_BF16 ? mr == 2 : mr <= 3) && n >= 2;
    for (int row = 0; row < mr;) {
        const int left = mr - row, rows = KIND == LP_BF16 && left > 4 ? 4 : left;
        switch (rows) {
        case 2: if (wide) LP8_TILE(2, 4); else LP8_TILE(2, 2); break;
        case 3: if (wide) LP8_TILE(3, 4); else LP8_TILE(3, 2); break;
        case 4: LP8_TILE(4, 2); break;
        case 5: LP8_TILE(5, 2); break;
        case 6: LP8_TILE(6, 2); break;
        default: LP8_TILE(1, 2); break;
        }
        row += rows;
    }
    return wide ? 2 : 1;
}
#undef LP8_TILE

/* Rows [first_row, last_row) (more than LP_MR) times one panel whose weights at k0 are at w_at
 * (KIND's layout), k in [k0, k1): each row tile in turn over the panel's slice, x read in place.
 * The rows spread evenly over the tiles (lp_tile_rows; 64 rows had run no faster than 66): 0.91-0.94x
 * the time at 16 rows, 0.96-1.0x at 64 (AMD EPYC, avx512 capped to x86-64-v3, interleaved).
 * Until 2026-12-01 x was first copied into row tiles, k-major, so that a tile's six broadcasts read
 * one stream; without the copy (the same FMA chains, the same bits): float32 0.96-1.0x the time at
 * 16-1,024 rows on SmolLM2's four shapes, 0.90x on [576, 1,536] at 1,024, bf16 weights 0.89-1.0x
 * (AMD EPYC, avx512 capped to x86-64-v3, 2 threads, `bench/linear_ab.py`, interleaved). */
static inline __attribute__((always_inline)) void packed_rows(const packed_job *job, int first_row, int last_row,
                                                              int panel, const char *w_at, int k0, int k1,
                                                              const int KIND) {
    const int64_t first_col = (int64_t)panel * LP_PANEL, depth = job->depth;
    const int tiles = (last_row - first_row + LP_MR - 1) / LP_MR;
    for (int m0 = first_row, t = 0, mr; m0 < last_row; m0 += mr, ++t) {
        mr = lp_tile_rows(last_row - m0, tiles - t);
        const float *x = job->x + (int64_t)m0 * depth;
#define LP8_ROWS(M) packed_tile8(job, m0, first_col, w_at, x, depth, k0, k1, M, 2, KIND)
        switch (mr) {
        case 1: LP8_ROWS(1); break;
        case 2: LP8_ROWS(2); break;
        case 3: LP8_ROWS(3); break;
        case 4: LP8_ROWS(4); break;
        case 5: LP8_ROWS(5); break;
        default: LP8_ROWS(6); break;
        }
#undef LP8_ROWS
    }
}

/* bf16 weights under more than one row tile: the panel's k block widened once into a float32
 * copy (this thread's, 36 KB: 16 x LP8_K_BLOCK floats), which every row tile of the block then
 * reads with the float32 tiles. The same values and the same FMA chains, so the same bits; the widening (a shift
 * or a mask per 8 weights) is paid once per block instead of once per row tile: it had bf16
 * weights at ~0.67x float32's speed from 64 rows. ``call``: fdplug_linear_packed's call number,
 * so that a copy is never taken for another call's weights at the same address. The buffer lives
 * as long as its thread (the pool's helpers and the engine's thread: a few, for the process's life). */
static __thread float *lp_widened;
static __thread int64_t lp_widened_key[3] = {-1, -1, -1};

static const float *widened_block(const packed_job *job, int panel, int k0, int k1) {
    if (lp_widened_key[0] == job->call && lp_widened_key[1] == panel && lp_widened_key[2] == k0) return lp_widened;
    if (lp_widened == NULL && posix_memalign((void **)&lp_widened, 64, sizeof(float) * LP8_K_BLOCK * LP_PANEL) != 0) {
        lp_widened = NULL;
        return NULL;
    }
    const uint16_t *w = (const uint16_t *)packed_at(job, panel, k0, LP_BF16);
    const __m256i high = _mm256_set1_epi32((int)0xFFFF0000u);
    for (int k = k0; k < k1; k += 2, w += 2 * LP_PANEL) {
        float *even = lp_widened + (int64_t)(k - k0) * LP_PANEL, *odd = even + LP_PANEL;
        for (int j = 0; j < LP_PANEL; j += 8) {
            const __m256i pairs = _mm256_loadu_si256((const __m256i *)(w + 2 * j));
            _mm256_storeu_ps(even + j, _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16)));
            _mm256_storeu_ps(odd + j, _mm256_castsi256_ps(_mm256_and_si256(pairs, high)));
        }
    }
    lp_widened_key[0] = job->call, lp_widened_key[1] = panel, lp_widened_key[2] = k0;
    return lp_widened;
}

/* A work item's rows [first_row, last_row) times panels [first_panel, end_panel). One row tile
 * (decode, small batches): tiles over up to 4 panels, the whole depth. More rows: k pass by k pass,
 * panel by panel, every row tile over the panel's slice while it stays in L2 (LP8_K_BLOCK); bf16
 * weights widened once a slice for all of them.
 * The bf16 math kind is never asked for at this level: fdplug_linear_bf16dot_available() is 0. */
static void packed_item(const packed_job *job, int first_row, int last_row, int first_panel, int end_panel) {
    const int kind = job->kind;
    if (last_row - first_row <= LP_MR) {
        for (int m0 = first_row; m0 < last_row; m0 += LP_MR) {
            const int mr = last_row - m0 < LP_MR ? last_row - m0 : LP_MR;
            for (int p = first_panel; p < end_panel;)
                p += kind == LP_F32    ? packed_small(job, m0, mr, p, end_panel - p, LP_F32)
                     : kind == LP_BF16 ? packed_small(job, m0, mr, p, end_panel - p, LP_BF16)
                                       : packed_small(job, m0, mr, p, end_panel - p, LP_FP8);
        }
        return;
    }
    const int k_slice = packed_k_slice(job->depth);
    for (int k0 = 0; k0 < job->depth; k0 += k_slice) {
        const int k1 = k0 + k_slice < job->depth ? k0 + k_slice : job->depth;
        for (int panel = first_panel; panel < end_panel; ++panel) {
            if (kind == LP_F32) {
                packed_rows(job, first_row, last_row, panel, packed_at(job, panel, k0, LP_F32), k0, k1, LP_F32);
            } else if (kind == LP_BF16) {
                const float *widened = widened_block(job, panel, k0, k1);
                if (widened != NULL)
                    packed_rows(job, first_row, last_row, panel, (const char *)widened, k0, k1, LP_F32);
                else
                    packed_rows(job, first_row, last_row, panel, packed_at(job, panel, k0, LP_BF16), k0, k1, LP_BF16);
            } else {
                packed_rows(job, first_row, last_row, panel, packed_at(job, panel, k0, LP_FP8), k0, k1, LP_FP8);
            }
        }
    }
}
