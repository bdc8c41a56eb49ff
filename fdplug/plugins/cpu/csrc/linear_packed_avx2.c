/* ---------------------------------------------------------------------------------------------
 * The packed linear's tiles on AVX2 + FMA + F16C (x86-64-v3: AMD Zen 2/3, Intel Haswell on, most
 * cloud x86): 16 ymm registers of 8 lanes instead of 32 zmm of 16.
 *
 * Why: without these the packed layout ran a scalar loop (~3-4 GFLOP/s, 0.01-0.10x paddle's
 * matmul), and selection had to refuse the kernel below x86-64-v4. Same layout, same work split
 * (linear_packed.c): only the tile changes. An output is still one FMA chain over k in index order
 * from zero, in one lane, so these tiles give the AVX-512 tiles' bits exactly (every kind: float32,
 * bf16 widened, e4m3 widened and scaled), whatever the level the library was built for.
 *
 * Tiles of rows x 8-column vectors, at most 12 accumulators of the 16 registers (packed_tiles says
 * which for how many rows). The x rows of a tile are read again for each column slice of the
 * panel, from L1.
 *
 * Included by linear_packed.c in place of the AVX-512 tiles.
 * ------------------------------------------------------------------------------------------- */

/* A tile narrower than 8 vectors (NV < 8: every tile of more than one row; one row's only on a
 * narrow last panel) reads 64 or 128 bytes of each 256-byte k row of a 64-column panel, so its
 * loads are strided and cross a 4 KB page every 16 k, where the L2 streamer stops: the first row
 * tile over a panel waited on memory for each line. Each k step prefetches its first line
 * LP8_PREFETCH_K rows ahead (a 32-column tile's second line is not prefetched: not measured). On
 * AMD EPYC, avx2-or-less (Zen 3, 2026-11-29, 2 threads, against no prefetch, interleaved):
 * [3072, 576] at 64 rows 1.24-1.51x, the other SmolLM2 shapes 1.0-1.2x at 16-256 rows; 96 ahead no
 * better than 48. A hint: the same bits. (The AVX-512 tiles take the panel's whole width, one
 * sequential stream, and need none.) */
#ifndef LP8_PREFETCH_K
#define LP8_PREFETCH_K 48
#endif

/* Weight vector i (8 columns) of the k row at ``w``: float32 loaded, or e4m3 bytes widened through
 * half precision (sign-extended, shifted by 7, bit 14 cleared: 2^-8 times the e4m3 value, exactly)
 * and times their columns' scales (256 x each: exact, then rounded once), as the AVX-512 tile. */
static inline __attribute__((always_inline)) __m256 packed_weights8(const char *w, int i, const float *scale,
                                                                    __m128i keep, const int KIND) {
    if (KIND == LP_F32) return _mm256_loadu_ps((const float *)w + 8 * i);
    const __m128i h = _mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)(w + 8 * i))), 7),
                                    keep);
    return _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_loadu_ps(scale + 8 * i));
}

/* Rows m0 .. m0 + MR - 1 times the NV 8-column vectors from column first_col, whose weight at k0 is
 * at ``w_at`` in a panel of ``width`` columns (the layout of KIND), k in [k0, k1) (k0, k1 even for
 * bf16); MR, NV and KIND are constants at each call site.
 * A k step loads every weight vector and every row's activation once; the smaller of the two sets
 * is held in registers across the other (ROWS_FIRST: the rows' broadcasts), so that the MR x NV
 * accumulators, that set and one of the other fit the 16 registers (a 1 x 8 tile holding its 8
 * weight vectors spilled: half the speed of paddle's GEMV on a 960 x 576 layer). */
static inline __attribute__((always_inline)) void packed_tile8(const packed_job *job, int m0, int64_t first_col,
                                                               const char *w_at, int width, int k0, int k1, const int MR,
                                                               const int NV, const int KIND) {
    const int depth = job->depth, cols = job->cols, ROWS_FIRST = MR < NV;
    float *out = job->out + (int64_t)m0 * cols + first_col;
    const float *x = job->x + (int64_t)m0 * depth;
    __m256 acc[LP_MR][8];
    for (int r = 0; r < MR; ++r)
        for (int v = 0; v < NV; ++v)
            acc[r][v] = k0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(out + (int64_t)r * cols + 8 * v);
    if (KIND == LP_BF16) { /* pairs of k: 8 columns x (k, k + 1) a 32-byte load, split by a shift and a mask */
        const uint16_t *w = (const uint16_t *)w_at;
        const __m256i high = _mm256_set1_epi32((int)0xFFFF0000u);
        for (int k = k0; k < k1; k += 2, w += 2 * width) {
            if (LP8_PREFETCH_K > 0 && NV < 8) _mm_prefetch((const char *)(w + (int64_t)LP8_PREFETCH_K * width), _MM_HINT_T0);
            __m256 even[8], odd[8], x0[LP_MR], x1[LP_MR];
            for (int i = 0; i < (ROWS_FIRST ? MR : NV); ++i) {
                if (ROWS_FIRST) {
                    x0[i] = _mm256_broadcast_ss(x + (int64_t)i * depth + k);
                    x1[i] = _mm256_broadcast_ss(x + (int64_t)i * depth + k + 1);
                } else {
                    const __m256i pairs = _mm256_loadu_si256((const __m256i *)(w + 16 * i));
                    even[i] = _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16));
                    odd[i] = _mm256_castsi256_ps(_mm256_and_si256(pairs, high));
                }
            }
            for (int j = 0; j < (ROWS_FIRST ? NV : MR); ++j) {
                if (ROWS_FIRST) {
                    const __m256i pairs = _mm256_loadu_si256((const __m256i *)(w + 16 * j));
                    const __m256 e = _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16));
                    const __m256 o = _mm256_castsi256_ps(_mm256_and_si256(pairs, high));
                    for (int r = 0; r < MR; ++r)
                        acc[r][j] = _mm256_fmadd_ps(x1[r], o, _mm256_fmadd_ps(x0[r], e, acc[r][j]));
                } else {
                    const __m256 b0 = _mm256_broadcast_ss(x + (int64_t)j * depth + k);
                    const __m256 b1 = _mm256_broadcast_ss(x + (int64_t)j * depth + k + 1);
                    for (int v = 0; v < NV; ++v)
                        acc[j][v] = _mm256_fmadd_ps(b1, odd[v], _mm256_fmadd_ps(b0, even[v], acc[j][v]));
                }
            }
        }
    } else { /* LP_F32, or LP_FP8: the AVX-512 tile's conversion, 8 bytes at a time (exact), times the scale */
        const int bytes = KIND == LP_F32 ? 4 : 1;
        const char *w = w_at;
        const __m128i keep = _mm_set1_epi16((short)0xBF80);
        const float *scale = NULL;   /* LP_FP8: this k block's scales of the tile's columns */
        int block_end = k0;
        for (int k = k0; k < k1; ++k, w += (int64_t)width * bytes) {
            if (LP8_PREFETCH_K > 0 && NV < 8) _mm_prefetch(w + (int64_t)LP8_PREFETCH_K * width * bytes, _MM_HINT_T0);
            if (KIND == LP_FP8 && k == block_end) {
                scale = job->scales_t + (int64_t)(k / job->block_k) * cols + first_col;
                block_end = (k / job->block_k + 1) * job->block_k;
            }
            __m256 held[8];   /* the rows' broadcasts, or the weight vectors */
            for (int i = 0; i < (ROWS_FIRST ? MR : NV); ++i)
                held[i] = ROWS_FIRST ? _mm256_broadcast_ss(x + (int64_t)i * depth + k) : packed_weights8(w, i, scale, keep, KIND);
            for (int j = 0; j < (ROWS_FIRST ? NV : MR); ++j) {
                if (ROWS_FIRST) {
                    const __m256 wv = packed_weights8(w, j, scale, keep, KIND);
                    for (int r = 0; r < MR; ++r) acc[r][j] = _mm256_fmadd_ps(held[r], wv, acc[r][j]);
                } else {
                    const __m256 xb = _mm256_broadcast_ss(x + (int64_t)j * depth + k);
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

#define LP8_TILE(M, N) packed_tile8(job, m0 + row, first_col + c0, w_at + c0 * col_bytes, width, k0, k1, M, N, KIND)

/* A block of mr rows (1..LP_MR) times the panel of ``width`` columns from first_col, whose weight
 * at k0 is at w_at (the layout of KIND), in the tiles above: one row takes the panel's whole width
 * (independent chains, one sequential stream, as decode wants); float32 and FP8: 2-3 rows take 32
 * columns at a time, 4-6 rows 16 (BLIS's 6 x 16 Haswell tile); bf16, whose two halves of a pair
 * need two registers more: 2 rows 32 columns, then 16 columns for 3 or 4 rows, 5-6 rows as 4 and
 * the rest. */
static inline __attribute__((always_inline)) void packed_tiles(const packed_job *job, int m0, int mr,
                                                               int64_t first_col, const char *w_at, int width, int k0,
                                                               int k1, const int KIND) {
    const int units = width / 8, col_bytes = KIND == LP_FP8 ? 1 : 4; /* a column of k: 4 bytes, or a bf16 pair */
    if (mr == 1) {
        const int c0 = 0, row = 0;
        switch (units) {
        case 2: LP8_TILE(1, 2); break;
        case 4: LP8_TILE(1, 4); break;
        case 6: LP8_TILE(1, 6); break;
        default: LP8_TILE(1, 8); break;
        }
        return;
    }
    for (int u = 0; u < units;) {
        const int c0 = 8 * u, wide = (KIND == LP_BF16 ? mr == 2 : mr <= 3) && units - u >= 4;
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
        u += wide ? 4 : 2;
    }
}
#undef LP8_TILE

/* bf16 weights under more than one row tile: the panel's k block widened once into a float32
 * copy (this thread's, 256 KB at most), which every row tile of the block then reads with the
 * float32 tiles. The same values and the same FMA chains, so the same bits; the widening (a shift
 * or a mask per 8 weights) is paid once per block instead of once per row tile: it had bf16
 * weights at ~0.67x float32's speed from 64 rows. ``call``: fdplug_linear_packed's call number,
 * so that a copy is never taken for another call's weights at the same address. The buffer lives
 * as long as its thread (the pool's helpers and the engine's thread: a few, for the process's life). */
static __thread float *lp_widened;
static __thread int64_t lp_widened_key[3] = {-1, -1, -1};

static const float *widened_block(const packed_job *job, int panel, int width, int k0, int k1) {
    if (lp_widened_key[0] == job->call && lp_widened_key[1] == panel && lp_widened_key[2] == k0) return lp_widened;
    if (lp_widened == NULL && posix_memalign((void **)&lp_widened, 64, sizeof(float) * LP_K_BLOCK * LP_PANEL) != 0) {
        lp_widened = NULL;
        return NULL;
    }
    const uint16_t *w = (const uint16_t *)job->w + (int64_t)panel * LP_PANEL * job->depth + (int64_t)k0 * width;
    const __m256i high = _mm256_set1_epi32((int)0xFFFF0000u);
    for (int k = k0; k < k1; k += 2, w += 2 * width) {
        float *even = lp_widened + (int64_t)(k - k0) * width, *odd = even + width;
        for (int j = 0; j < width; j += 8) {
            const __m256i pairs = _mm256_loadu_si256((const __m256i *)(w + 2 * j));
            _mm256_storeu_ps(even + j, _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16)));
            _mm256_storeu_ps(odd + j, _mm256_castsi256_ps(_mm256_and_si256(pairs, high)));
        }
    }
    lp_widened_key[0] = job->call, lp_widened_key[1] = panel, lp_widened_key[2] = k0;
    return lp_widened;
}

/* The bf16 math kind is never asked for at this level: fdplug_linear_bf16dot_available() is 0. */
static void packed_block(const packed_job *job, int m0, int mr, int panel, int nv, int k0, int k1) {
    const int width = 16 * nv;
    const int64_t first_col = (int64_t)panel * LP_PANEL, at = first_col * job->depth + (int64_t)k0 * width;
    switch (job->kind) {
    case LP_F32:
        packed_tiles(job, m0, mr, first_col, (const char *)((const float *)job->w + at), width, k0, k1, LP_F32);
        break;
    case LP_BF16: {
        const float *widened = job->rows > LP_MR ? widened_block(job, panel, width, k0, k1) : NULL;
        if (widened != NULL)
            packed_tiles(job, m0, mr, first_col, (const char *)widened, width, k0, k1, LP_F32);
        else
            packed_tiles(job, m0, mr, first_col, (const char *)((const uint16_t *)job->w + at), width, k0, k1, LP_BF16);
        break;
    }
    default: packed_tiles(job, m0, mr, first_col, (const char *)job->w + at, width, k0, k1, LP_FP8); break;
    }
}
