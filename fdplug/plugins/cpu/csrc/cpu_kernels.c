/* fdplug cpu kernels: paged attention that reads the KV cache in place (decode_attention.c), the KV cache write,
 * SwiGLU (paddle's CPU swiglu is one scalar thread: 8% of a prefill, 7% of a decode step), the
 * routed experts of a MoE layer and an FP8 block linear for decode (both at the end of the file), and,
 * in linear.c (included at the end), the linear layer with float32 or bf16 weights.
 *
 * Why: on CPU, decode attention is memory-bound. The plain-Paddle reference gathers every
 * sequence's blocks into a dense tensor each layer (read the cache, write a copy, read the copy
 * again); this kernel reads each key and value once, straight from its block. Built by
 * fdplug/plugins/cpu/kernels.py with the system C compiler the first time it is needed.
 *
 * Layout (the cpu backends' `kv_cache_shape`): a cache is [kv_heads, num_blocks, block_size, head_dim]
 * float32. Queries are [tokens, heads, head_dim] float32; query head h reads kv head h / group.
 * The mask spec is per query token: keys [0, key_end) of its sequence are visible.
 *
 * No -ffast-math: it would change the floating-point mode of the whole process. With AVX2 and FMA
 * (built with -march=native) the two inner loops use intrinsics; elsewhere, portable C.
 */
#define _POSIX_C_SOURCE 200809L /* clock_gettime, pthreads under -std=c99 */
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_AVX2 1
#elif defined(__SSE4_1__)
#include <immintrin.h>
#define HAVE_SSE41 1 /* x86-64-v2 (FDPLUG_CPU_ISA=sse4, or a CPU without AVX2): 4-lane SwiGLU and argmax */
#endif
#include "kv_elements.c" /* the KV cache's element types: float32, float16, bfloat16 */

int fdplug_kernels_abi(void) { return 12; }

/* ---------------------------------------------------------------------------------------------
 * Threads. A kernel call runs worker(job) on the calling thread and up to num_threads - 1 helpers
 * (at most 64). Workers take their pieces from a counter in the job, so a helper that starts late
 * (another process holding its core) leaves its pieces to the others.
 *
 * The helpers are a persistent pool: creating and joining threads on every call cost ~45 us a
 * call, 12+ calls a decode step. Posting and claiming a job take no lock: the caller publishes the
 * job and bumps `generation`; a helper claims one of the job's `slots` with a compare-and-swap; the
 * caller, after working on the job itself, closes it by taking the slots that are left (an atomic
 * exchange), so it knows exactly how many helpers run it and waits only for those (a helper the
 * scheduler keeps off a core costs nothing: it finds the job closed). Between jobs a helper spins
 * on `generation` for POOL_SPIN_NS, then sleeps on a condition variable (`sleepers` tells the
 * caller to wake it). A decode step calls the kernels every few tens of microseconds with Python
 * in between; with the old 50 us spin and a mutex on every claim, a 1,536 x 512 bf16 decode step
 * spent ~80 us in a 786 KB projection (measured: single-stream decode 84 -> 99 tok/s at a 1 ms
 * spin, before the lock-free claim). One job at a time: a second thread calling a kernel meanwhile
 * gets fresh threads, the old way. After fork() the child starts with no pool.
 * ------------------------------------------------------------------------------------------- */
#define POOL_MAX 64
#define POOL_SPIN_NS 1000000

typedef struct {
    pthread_mutex_t busy; /* held by the one caller whose job the pool runs */
    pthread_mutex_t lock; /* with the conditions: only for sleeping and waking */
    pthread_cond_t wake, done;
    int size;             /* helpers started (only the caller holding busy changes it) */
    unsigned generation;  /* bumped for each job, after the job's fields are written */
    void *(*worker)(void *);
    void *job;
    int slots;            /* helpers that may still claim the job; 0 once closed */
    int finished;         /* helpers that claimed the job and are done with it */
    int sleepers;         /* helpers waiting on `wake` (or about to) */
    int waiting;          /* the caller waits on `done` */
} worker_pool;

#define POOL_FRESH {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, \
                    PTHREAD_COND_INITIALIZER, 0, 0, NULL, NULL, 0, 0, 0, 0}
static worker_pool pool = POOL_FRESH;

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* Spin until *value != seen or POOL_SPIN_NS pass; whether it changed. Every 1,024 turns (~20 us)
 * it yields the core, so a thread of another process waiting for it (the API server, a client) runs
 * instead of waiting for the spin to end; with none waiting, sched_yield returns at once. */
static int spin_while_equal(const unsigned *value, unsigned seen) {
    const int64_t until = now_ns() + POOL_SPIN_NS;
    for (int i = 1;; ++i) {
        if (__atomic_load_n(value, __ATOMIC_ACQUIRE) != seen) return 1;
        cpu_relax();
        if (i % 64 == 0 && now_ns() > until) return 0;
        if (i % 1024 == 0) sched_yield();
    }
}

/* Spin until *value >= target or POOL_SPIN_NS pass. */
static void spin_until_at_least(const int *value, int target) {
    const int64_t until = now_ns() + POOL_SPIN_NS;
    for (int i = 1; __atomic_load_n(value, __ATOMIC_ACQUIRE) < target; ++i) {
        cpu_relax();
        if (i % 64 == 0 && now_ns() > until) return;
    }
}

/* Wait for a generation other than `seen`: spin, then sleep. Sleeping is announced in `sleepers`
 * before the generation is checked again, and the caller bumps the generation before it reads
 * `sleepers` (both sequentially consistent): either the caller sees the sleeper and wakes it, or the
 * sleeper sees the new generation and does not sleep. */
static unsigned pool_next_generation(unsigned seen) {
    if (!spin_while_equal(&pool.generation, seen)) {
        pthread_mutex_lock(&pool.lock);
        __atomic_add_fetch(&pool.sleepers, 1, __ATOMIC_SEQ_CST);
        while (__atomic_load_n(&pool.generation, __ATOMIC_SEQ_CST) == seen)
            pthread_cond_wait(&pool.wake, &pool.lock);
        __atomic_sub_fetch(&pool.sleepers, 1, __ATOMIC_SEQ_CST);
        pthread_mutex_unlock(&pool.lock);
    }
    return __atomic_load_n(&pool.generation, __ATOMIC_ACQUIRE);
}

/* Take one of the job's slots; 0 when none is left (the job is closed or fully claimed). */
static int pool_claim(void) {
    int slots = __atomic_load_n(&pool.slots, __ATOMIC_ACQUIRE);
    while (slots > 0)
        if (__atomic_compare_exchange_n(&pool.slots, &slots, slots - 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
            return 1;
    return 0;
}

static void *pool_helper(void *arg) {
    unsigned seen = (unsigned)(uintptr_t)arg;
    for (;;) {
        seen = pool_next_generation(seen);
        if (!pool_claim()) continue;
        /* The fields were written before the generation this helper saw; the caller cannot post
         * another job before this one's finished count includes this helper. */
        pool.worker(pool.job);
        __atomic_add_fetch(&pool.finished, 1, __ATOMIC_SEQ_CST);
        if (__atomic_load_n(&pool.waiting, __ATOMIC_SEQ_CST)) {
            pthread_mutex_lock(&pool.lock);
            pthread_cond_signal(&pool.done);
            pthread_mutex_unlock(&pool.lock);
        }
    }
    return NULL;
}

static void pool_after_fork_in_child(void) {
    worker_pool fresh = POOL_FRESH;
    pool = fresh; /* the helpers were not forked */
}

static pthread_once_t pool_once = PTHREAD_ONCE_INIT;
static void pool_init(void) { pthread_atfork(NULL, NULL, pool_after_fork_in_child); }

/* Grow the pool to `helpers` threads (fewer if the system refuses more); called holding pool.busy. */
static int pool_grow(int helpers) {
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    while (pool.size < helpers) {
        pthread_t thread;
        const unsigned seen = __atomic_load_n(&pool.generation, __ATOMIC_ACQUIRE);
        if (pthread_create(&thread, &attr, pool_helper, (void *)(uintptr_t)seen) != 0) break;
        ++pool.size;
    }
    pthread_attr_destroy(&attr);
    return pool.size;
}

static void run_fresh_threads(void *(*worker)(void *), void *job, int extra) {
    pthread_t threads[POOL_MAX];
    int started = 0;
    for (; started < extra; ++started)
        if (pthread_create(&threads[started], NULL, worker, job) != 0) break;
    worker(job); /* the calling thread works too; with no helper it does everything */
    for (int t = 0; t < started; ++t) pthread_join(threads[t], NULL);
}

static void run_workers(void *(*worker)(void *), void *job, int num_threads) {
    int extra = num_threads - 1;
    if (extra > POOL_MAX) extra = POOL_MAX;
    if (extra <= 0) {
        worker(job);
        return;
    }
    pthread_once(&pool_once, pool_init);
    if (pthread_mutex_trylock(&pool.busy) != 0) {
        run_fresh_threads(worker, job, extra);
        return;
    }
    const int helpers = pool_grow(extra) < extra ? pool.size : extra;
    pool.worker = worker;
    pool.job = job;
    __atomic_store_n(&pool.finished, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&pool.slots, helpers, __ATOMIC_RELEASE);
    __atomic_add_fetch(&pool.generation, 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&pool.sleepers, __ATOMIC_SEQ_CST)) {
        pthread_mutex_lock(&pool.lock);
        pthread_cond_broadcast(&pool.wake);
        pthread_mutex_unlock(&pool.lock);
    }
    worker(job);
    const int claimed = helpers - __atomic_exchange_n(&pool.slots, 0, __ATOMIC_ACQ_REL);
    spin_until_at_least(&pool.finished, claimed); /* helpers usually end together */
    if (__atomic_load_n(&pool.finished, __ATOMIC_SEQ_CST) < claimed) {
        pthread_mutex_lock(&pool.lock);
        __atomic_store_n(&pool.waiting, 1, __ATOMIC_SEQ_CST);
        while (__atomic_load_n(&pool.finished, __ATOMIC_SEQ_CST) < claimed) pthread_cond_wait(&pool.done, &pool.lock);
        __atomic_store_n(&pool.waiting, 0, __ATOMIC_SEQ_CST);
        pthread_mutex_unlock(&pool.lock);
    }
    pthread_mutex_unlock(&pool.busy);
}

#ifdef HAVE_AVX2
/* e^x for eight floats (Cephes expf): x = n ln2 + r with ln2 split in two so r is exact, a degree-6
 * polynomial for e^r on |r| <= ln2/2, then 2^n through the exponent bits. Relative error about
 * 2e-7. x is clamped to [-87, 87] so 2^n stays a normal float; silu needs no more range: past
 * it, g / (1 + e^-g) is off by at most |g| * 2e-38 (g itself, or a number that small near 0); nor
 * does the decode softmax, whose x = score - max <= 0: a weight of 1.6e-38 instead of less is nothing
 * next to the sum's 1. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(87.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
    const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
}
#endif

#ifdef HAVE_SSE41
/* exp8's steps on four floats without FMA (x86-64-v2 has none): n * 0.693359375 is exact (9
 * significant bits times |n| <= 126), each other step rounds once more than with FMA; relative
 * error at most 8.2e-8 against double exp over every float in [-87, 87] (checked one by one).
 * Without it SwiGLU called libm's expf per element: 0.59x paddle's swiglu at one token (1,536
 * outputs) and 1.8-2.1x above; now a tie at one token (a call's cost, not its arithmetic) and
 * 2.9-4.9x above (AMD EPYC, avx2-or-less capped to x86-64-v2, bench/ops.py). */
static inline __m128 exp4(__m128 x) {
    x = _mm_min_ps(_mm_max_ps(x, _mm_set1_ps(-87.0f)), _mm_set1_ps(87.0f));
    const __m128 n = _mm_round_ps(_mm_mul_ps(x, _mm_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m128 r = _mm_sub_ps(x, _mm_mul_ps(n, _mm_set1_ps(0.693359375f)));
    r = _mm_sub_ps(r, _mm_mul_ps(n, _mm_set1_ps(-2.12194440e-4f)));
    __m128 p = _mm_set1_ps(1.9875691500e-4f);
    p = _mm_add_ps(_mm_mul_ps(p, r), _mm_set1_ps(1.3981999507e-3f));
    p = _mm_add_ps(_mm_mul_ps(p, r), _mm_set1_ps(8.3334519073e-3f));
    p = _mm_add_ps(_mm_mul_ps(p, r), _mm_set1_ps(4.1665795894e-2f));
    p = _mm_add_ps(_mm_mul_ps(p, r), _mm_set1_ps(1.6666665459e-1f));
    p = _mm_add_ps(_mm_mul_ps(p, r), _mm_set1_ps(5.0000001201e-1f));
    p = _mm_add_ps(_mm_add_ps(_mm_mul_ps(p, _mm_mul_ps(r, r)), r), _mm_set1_ps(1.0f));
    const __m128i scale = _mm_slli_epi32(_mm_add_epi32(_mm_cvtps_epi32(n), _mm_set1_epi32(127)), 23);
    return _mm_mul_ps(p, _mm_castsi128_ps(scale));
}
#endif

#include "decode_attention.c" /* paged attention for decode: each key and value read once, in place */

/* key_cache[h, slot] = key[t, h] and value_cache[h, slot] = value[t, h] for slot = slots[t], rounded
 * to the caches' element type kv_type. */
void fdplug_write_kv(const float *key, const float *value, void *key_cache, void *value_cache,
                     const int64_t *slots, int num_tokens, int kv_heads, int head_dim, int64_t slots_per_head,
                     int kv_type) {
    for (int t = 0; t < num_tokens; ++t)
        for (int h = 0; h < kv_heads; ++h) {
            const int64_t src = ((int64_t)t * kv_heads + h) * head_dim;
            const int64_t dst = ((int64_t)h * slots_per_head + slots[t]) * head_dim;
            kv_put_row(key + src, (void *)kv_at(key_cache, dst, kv_type), head_dim, kv_type);
            kv_put_row(value + src, (void *)kv_at(value_cache, dst, kv_type), head_dim, kv_type);
        }
}

/* ---------------------------------------------------------------------------------------------
 * SwiGLU: out[r, j] = silu(x[r, j]) * x[r, inter + j], silu(g) = g / (1 + e^-g).
 * ------------------------------------------------------------------------------------------- */


typedef struct {
    const float *x;
    float *out;
    int64_t rows, rows_per_piece, next_piece; /* work queue: pieces taken with an atomic add */
    int inter;
} swiglu_job;

static void swiglu_rows(const swiglu_job *job, int64_t begin, int64_t end) {
    const int inter = job->inter;
    for (int64_t row = begin; row < end; ++row) {
        const float *gate = job->x + row * 2 * inter, *up = gate + inter;
        float *dst = job->out + row * inter;
        int j = 0;
#ifdef HAVE_AVX2
        const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
        for (; j + 8 <= inter; j += 8) {
            const __m256 g = _mm256_loadu_ps(gate + j);
            const __m256 denominator = _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, g)));
            _mm256_storeu_ps(dst + j, _mm256_div_ps(_mm256_mul_ps(g, _mm256_loadu_ps(up + j)), denominator));
        }
#elif defined(HAVE_SSE41)
        const __m128 one = _mm_set1_ps(1.0f), zero = _mm_setzero_ps();
        for (; j + 4 <= inter; j += 4) {
            const __m128 g = _mm_loadu_ps(gate + j);
            const __m128 denominator = _mm_add_ps(one, exp4(_mm_sub_ps(zero, g)));
            _mm_storeu_ps(dst + j, _mm_div_ps(_mm_mul_ps(g, _mm_loadu_ps(up + j)), denominator));
        }
#endif
        for (; j < inter; ++j) dst[j] = gate[j] * up[j] / (1.0f + expf(-gate[j]));
    }
}

static void *swiglu_worker(void *arg) {
    swiglu_job *job = arg;
    for (;;) {
        const int64_t begin = __atomic_fetch_add(&job->next_piece, 1, __ATOMIC_RELAXED) * job->rows_per_piece;
        if (begin >= job->rows) return NULL;
        swiglu_rows(job, begin, begin + job->rows_per_piece < job->rows ? begin + job->rows_per_piece : job->rows);
    }
}

/* x [rows, 2 * inter] -> out [rows, inter] on up to num_threads threads (the caller's included). */
void fdplug_swiglu(const float *x, float *out, int64_t rows, int inter, int num_threads) {
    const int64_t rows_per_piece = inter >= 8192 ? 1 : 8192 / inter; /* ~32 KiB of output a piece */
    swiglu_job job = {x, out, rows, rows_per_piece, 0, inter};
    run_workers(swiglu_worker, &job, num_threads);
}

/* ---------------------------------------------------------------------------------------------
 * Routed experts of a MoE layer:
 *   out[t] = sum_{k<K} w[t,k] * down_e(silu(gate_e x_t) * up_e x_t),  e = ids[t,k].
 *
 * Packed weights (fdplug_moe_pack, once per layer; exactly as many floats as the inputs):
 *   gate_up [E][2*I*H]: per expert, ceil(I/8) panels of 8 intermediate columns; panel p holds, for
 *     each h in 0..H-1, its w gate weights then its w up weights (w = 8, or what is left of I in
 *     the last panel): [H][2w]. One h row (64 bytes) feeds an MR x (8 gate + 8 up) register tile.
 *   down    [E][H*I]: per expert, ceil(H/16) panels of 16 output columns, [I][w] (w = 16 or the rest).
 *   Panels of one expert are contiguous, so a work item's panels stream as one sequential read.
 *
 * One call: a counting sort groups the (token, k) assignments by expert; each expert's rows are cut
 * into groups of at most MOE_ROW_BLOCK; work items are a group times MOE_ITEM_PANELS panels, for
 * gate/up (SwiGLU fused, into hbuf [A, I]) and for down (times the routing weight, into ybuf
 * [A, H]); a last pass sums each token's K rows of ybuf in k order. Items are taken from one
 * counter; a down item waits until its group's gate/up items are done, a sum item until every down
 * item is (the items waited on were all taken before, by running threads, so the wait always ends).
 * Decode (a few rows an expert) is memory-bound: each touched expert's weights are read once, all
 * its rows in one register tile. Prefill is compute-bound: 6-row tiles over a panel that stays in
 * L1/L2 while the group's x rows stay in L2.
 *
 * Determinism: every output element is one FMA chain over H (gate/up) or I (down) in index order,
 * whatever the rows around it, the tile it falls in or the thread; then w * acc; then the sum over k
 * in k order. A token's output does not depend on the batch nor on the thread count, bit for bit.
 * ------------------------------------------------------------------------------------------- */

/* Rows (assignments) of a register tile: 12 x 16 floats of accumulators where AVX-512VL gives 32
 * vector registers (the AVX2 code is the same, the compiler just has more registers), else 6 x 16. */
#ifndef MOE_MR
#if defined(__AVX512VL__)
#define MOE_MR 12
#else
#define MOE_MR 6
#endif
#endif
#define MOE_GU_COLS 8     /* intermediate columns of a gate/up panel (8 gate + 8 up floats a row) */
#define MOE_DOWN_COLS 16  /* output columns of a down panel */
#define MOE_ROW_BLOCK 192 /* most rows of a group (work items are a group times some panels) */
#define MOE_ITEM_PANELS 8 /* panels of a work item: 256 KiB of gate/up weights at H = 512 */
#define MOE_SUM_TOKENS 64 /* tokens of a final-sum item */
#define MOE_KC 512        /* depth of one pass of the row tiles over a panel: bounds what they share */
/* Tiles of 4 rows or more prefetch the panel MOE_PF bytes ahead (into L2): their FMAs fill the
 * out-of-order window, which then no longer reaches far enough ahead to hide memory latency. Lighter
 * tiles stream better without (all measured, H = 512, I = 384, 32 experts, 2 Zen 4 cores). */
#define MOE_PF 8192
#define MOE_PF_ROWS 4
/* A call's hbuf + ybuf stay under this (tokens go in chunks), one token's whatever its size. */
#define MOE_SCRATCH_BYTES ((int64_t)256 << 20)
/* The scratch cap in use: MOE_SCRATCH_BYTES, or what fdplug_moe_scratch_bytes set (a test makes
 * chunks of a few tokens so, without a build of its own) */
static int64_t moe_scratch_bytes = MOE_SCRATCH_BYTES;

static int64_t gu_panel_offset(int p, int hidden) { return (int64_t)p * MOE_GU_COLS * 2 * hidden; }
static int64_t down_panel_offset(int q, int inter) { return (int64_t)q * MOE_DOWN_COLS * inter; }

typedef struct {
    const float *gate, *up, *down;
    float *gate_up, *down_packed;
    int experts, hidden, inter, next; /* next: the next expert to pack, taken with an atomic add */
} pack_job;

static void *pack_worker(void *arg) {
    pack_job *job = arg;
    const int64_t H = job->hidden, I = job->inter;
    for (;;) {
        const int e = __atomic_fetch_add(&job->next, 1, __ATOMIC_RELAXED);
        if (e >= job->experts) return NULL;
        const float *gate = job->gate + e * I * H, *up = job->up + e * I * H, *down = job->down + e * H * I;
        float *gu = job->gate_up + e * 2 * I * H, *dn = job->down_packed + e * H * I;
        for (int p = 0; (int64_t)p * MOE_GU_COLS < I; ++p) {
            const int c0 = p * MOE_GU_COLS, w = I - c0 < MOE_GU_COLS ? (int)(I - c0) : MOE_GU_COLS;
            float *panel = gu + gu_panel_offset(p, (int)H);
            for (int64_t h = 0; h < H; ++h)
                for (int c = 0; c < w; ++c) {
                    panel[h * 2 * w + c] = gate[(c0 + c) * H + h];
                    panel[h * 2 * w + w + c] = up[(c0 + c) * H + h];
                }
        }
        for (int q = 0; (int64_t)q * MOE_DOWN_COLS < H; ++q) {
            const int c0 = q * MOE_DOWN_COLS, w = H - c0 < MOE_DOWN_COLS ? (int)(H - c0) : MOE_DOWN_COLS;
            float *panel = dn + down_panel_offset(q, (int)I);
            for (int64_t i = 0; i < I; ++i)
                for (int c = 0; c < w; ++c) panel[i * w + c] = down[(c0 + c) * I + i];
        }
    }
}

/* gate, up [E, I, H] and down [E, H, I] (row-major, nn.Linear's [out, in] per expert) into the
 * packed layout above. */
void fdplug_moe_pack(const float *gate, const float *up, const float *down, float *gate_up, float *down_packed,
                     int experts, int hidden, int inter, int num_threads) {
    pack_job job = {gate, up, down, gate_up, down_packed, experts, hidden, inter, 0};
    run_workers(pack_worker, &job, num_threads < experts ? num_threads : experts);
}

enum { MOE_GATE_UP = 0, MOE_DOWN = 1, MOE_SUM = 2 };

typedef struct {
    int kind, group, first, last; /* gate/up, down: panels [first, last) of group; sum: tokens [first, last) */
} moe_item;

typedef struct {
    int expert, row0, rows; /* rows [row0, row0 + rows) of the sorted assignments */
} moe_group;

/* A counter alone on its cache line: the threads write them all the time. */
typedef struct {
    int value;
    char pad[64 - sizeof(int)];
} moe_counter;

typedef struct {
    const float *x, *gate_up, *down;
    float *out;
    int tokens, top_k, hidden, inter;
    const int32_t *row_token; /* [A] token of sorted assignment a */
    const float *row_weight;  /* [A] its routing weight */
    const int32_t *slot;      /* [T * K] sorted position of assignment t * K + k */
    float *hbuf, *ybuf;       /* [A, I], [A, H] */
    const moe_group *groups;
    const moe_item *items;
    int num_items, total_down, gate_up_items;
    moe_counter *next_item, *down_done, *gate_up_done; /* gate_up_done: per group, its items finished */
} moe_job;

static void moe_wait(const int *counter, int target) {
    for (int spins = 0; __atomic_load_n(counter, __ATOMIC_ACQUIRE) < target; ++spins) {
#ifdef HAVE_AVX2
        _mm_pause();
#endif
        if (spins > 2000) sched_yield(); /* the thread we wait for may have lost its core */
    }
}

#ifdef HAVE_AVX2
/* Rows of the next register tile for `left` rows still to do with tiles of at most `most`: never a
 * last tile under 4 rows when that can be helped (8 = 4 + 4, not 6 + 2: a 2-row tile has too few
 * FMA chains to hide their latency). */
static int moe_tile_rows(int left, int most) { return left <= most ? left : left >= most + 4 ? most : 4; }

/* The register tile: for r < m, res[16 r .. 16 r + 16) += sum over d < depth, in order, of
 * ar[r][d0 + d] * b[d][0..16), one FMA chain per element continuing from res. b rows are ldb floats
 * apart, the second vector at b + hi; masked loads for a narrow last panel (they read nothing outside
 * the mask). m and masked are constants after inlining. */
static inline __attribute__((always_inline)) void moe_tile(const int m, const int masked, const float *const *ar,
                                                           const int d0, const float *b, const int ldb, const int hi,
                                                           const __m256i mlo, const __m256i mhi, const int depth,
                                                           float *res) {
    /* Named accumulators, not an array: gcc keeps an array's rows on the stack inside the loop. */
    const __m256 zero = _mm256_setzero_ps();
#define MOE_LOAD(r)                                                          \
    __m256 acc##r##_0 = m > r ? _mm256_loadu_ps(res + r * 16) : zero;        \
    __m256 acc##r##_1 = m > r ? _mm256_loadu_ps(res + r * 16 + 8) : zero;    \
    const float *x##r = ar[m > r ? r : 0] + d0;
#define MOE_ROW(r)                                           \
        if (m > r) {                                         \
            a = _mm256_broadcast_ss(x##r + d);               \
            acc##r##_0 = _mm256_fmadd_ps(a, b0, acc##r##_0); \
            acc##r##_1 = _mm256_fmadd_ps(a, b1, acc##r##_1); \
        }
#define MOE_STORE(r)                                     \
    if (m > r) {                                         \
        _mm256_storeu_ps(res + r * 16, acc##r##_0);      \
        _mm256_storeu_ps(res + r * 16 + 8, acc##r##_1);  \
    }
#if MOE_MR == 12
#define MOE_ROWS(F) F(0) F(1) F(2) F(3) F(4) F(5) F(6) F(7) F(8) F(9) F(10) F(11)
#else
#define MOE_ROWS(F) F(0) F(1) F(2) F(3) F(4) F(5)
#endif
    MOE_ROWS(MOE_LOAD)
    for (int d = 0; d < depth; ++d, b += ldb) {
        __m256 b0 = masked ? _mm256_maskload_ps(b, mlo) : _mm256_loadu_ps(b);
        __m256 b1 = masked ? _mm256_maskload_ps(b + hi, mhi) : _mm256_loadu_ps(b + 8);
        /* Keep b in registers: gcc would otherwise fold the loads into every FMA (m loads each). */
        __asm__("" : "+x"(b0), "+x"(b1));
        if (MOE_PF && m >= MOE_PF_ROWS) _mm_prefetch((const char *)b + MOE_PF, _MM_HINT_T2);
        __m256 a;
        MOE_ROWS(MOE_ROW)
    }
    MOE_ROWS(MOE_STORE)
#undef MOE_LOAD
#undef MOE_ROW
#undef MOE_STORE
}

static void moe_tile_any(int m, int masked, const float *const *ar, int d0, const float *b, int ldb, int hi,
                         __m256i mlo, __m256i mhi, int depth, float *res) {
    switch (m * 2 + masked) {
#define MOE_CASE(mm)                                                                    \
    case 2 * (mm): moe_tile((mm), 0, ar, d0, b, ldb, hi, mlo, mhi, depth, res); break;     \
    case 2 * (mm) + 1: moe_tile((mm), 1, ar, d0, b, ldb, hi, mlo, mhi, depth, res); break;
#define MOE_CASE1(r) MOE_CASE(r + 1)
        MOE_ROWS(MOE_CASE1)
#undef MOE_CASE1
#undef MOE_CASE
    }
}
#undef MOE_ROWS

static __m256i moe_mask(int w) { /* lanes [0, w) on, w may be <= 0 or >= 8 */
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(w), lanes);
}
#endif

/* res[16 r + c] = sum over d < depth, in order, of ar[r][d] * panel[d][c] for r < rows: panel rows
 * are ldb floats, columns [0, lo) of the first vector at offset 0, [0, hi_cols) of the second at hi.
 * Passes of MOE_KC along d bound what the row tiles share for a large H or I; each element stays
 * one chain in d order. */
static void moe_panel(const float *const *ar, int rows, const float *panel, int ldb, int lo, int hi_cols, int hi,
                      int depth, float *res) {
    memset(res, 0, sizeof(float) * 16 * (size_t)rows);
#ifdef HAVE_AVX2
    const __m256i mlo = moe_mask(lo), mhi = moe_mask(hi_cols);
    const int masked = lo < 8 || hi_cols < 8;
    /* A few rows (decode): all in one tile if they fit, so the panel streams from memory once, at
     * an even pace. Many (prefill): 6-row tiles, faster than 12-row ones there (measured). */
    const int most = rows <= MOE_MR ? MOE_MR : 6;
    for (int d0 = 0; d0 < depth; d0 += MOE_KC) {
        const int dn = depth - d0 < MOE_KC ? depth - d0 : MOE_KC;
        for (int r0 = 0, m; r0 < rows; r0 += m) {
            m = moe_tile_rows(rows - r0, most);
            moe_tile_any(m, masked, ar + r0, d0, panel + (int64_t)d0 * ldb, ldb, hi, mlo, mhi, dn, res + 16 * r0);
        }
    }
#else
    for (int r = 0; r < rows; ++r) {
        float *acc = res + 16 * r;
        for (int d = 0; d < depth; ++d) {
            const float av = ar[r][d], *b = panel + (int64_t)d * ldb;
            for (int c = 0; c < lo; ++c) acc[c] += av * b[c];
            for (int c = 0; c < hi_cols; ++c) acc[8 + c] += av * b[hi + c];
        }
    }
#endif
}

/* Gate/up for the item's rows (their x rows in ar) and intermediate panel p: SwiGLU into hbuf. */
static void moe_gate_up_panel(const moe_job *job, const float *weights, const float *const *ar, int row0, int rows,
                              int p, float *res) {
    const int H = job->hidden, I = job->inter, c0 = p * MOE_GU_COLS;
    const int w = I - c0 < MOE_GU_COLS ? I - c0 : MOE_GU_COLS;
    moe_panel(ar, rows, weights + gu_panel_offset(p, H), 2 * w, w, w, w, H, res);
    for (int r = 0; r < rows; ++r) {
        const float *g = res + 16 * r, *u = g + 8;
        float *dst = job->hbuf + (int64_t)(row0 + r) * I + c0;
#ifdef HAVE_AVX2
        const __m256 gv = _mm256_loadu_ps(g);
        const __m256 denominator = _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv)));
        const __m256 h = _mm256_div_ps(_mm256_mul_ps(gv, _mm256_loadu_ps(u)), denominator);
        if (w == MOE_GU_COLS) _mm256_storeu_ps(dst, h);
        else _mm256_maskstore_ps(dst, moe_mask(w), h);
#else
        for (int c = 0; c < w; ++c) dst[c] = g[c] * u[c] / (1.0f + expf(-g[c]));
#endif
    }
}

/* Down for the item's rows (their hbuf rows in ar) and output panel q, times each row's routing weight. */
static void moe_down_panel(const moe_job *job, const float *weights, const float *const *ar, int row0, int rows,
                           int q, float *res) {
    const int H = job->hidden, I = job->inter, c0 = q * MOE_DOWN_COLS;
    const int w = H - c0 < MOE_DOWN_COLS ? H - c0 : MOE_DOWN_COLS;
    moe_panel(ar, rows, weights + down_panel_offset(q, I), w, w < 8 ? w : 8, w > 8 ? w - 8 : 0, 8, I, res);
    for (int r = 0; r < rows; ++r) {
        const float scale = job->row_weight[row0 + r];
        float *dst = job->ybuf + (int64_t)(row0 + r) * H + c0;
        for (int c = 0; c < w; ++c) dst[c] = scale * res[16 * r + c];
    }
}

/* out[t] = ybuf[slot[t, 0]] + ybuf[slot[t, 1]] + ... in k order. */
static void moe_sum_tokens(const moe_job *job, int first, int last) {
    const int H = job->hidden, K = job->top_k;
    for (int t = first; t < last; ++t) {
        float *dst = job->out + (int64_t)t * H;
        memcpy(dst, job->ybuf + (int64_t)job->slot[(int64_t)t * K] * H, sizeof(float) * H);
        for (int k = 1; k < K; ++k) {
            const float *src = job->ybuf + (int64_t)job->slot[(int64_t)t * K + k] * H;
            for (int h = 0; h < H; ++h) dst[h] += src[h];
        }
    }
}

static void *moe_worker(void *arg) {
    moe_job *job = arg;
    const float *ar[MOE_ROW_BLOCK];
    float res[16 * MOE_ROW_BLOCK];
    for (;;) {
        const int index = __atomic_fetch_add(&job->next_item->value, 1, __ATOMIC_RELAXED);
        if (index >= job->num_items) return NULL;
        const moe_item item = job->items[index];
        if (item.kind == MOE_SUM) {
            moe_wait(&job->down_done->value, job->total_down);
            moe_sum_tokens(job, item.first, item.last);
            continue;
        }
        const moe_group *g = job->groups + item.group;
        if (item.kind == MOE_GATE_UP) {
            const float *weights = job->gate_up + (int64_t)g->expert * 2 * job->inter * job->hidden;
            for (int r = 0; r < g->rows; ++r) ar[r] = job->x + (int64_t)job->row_token[g->row0 + r] * job->hidden;
            for (int p = item.first; p < item.last; ++p) moe_gate_up_panel(job, weights, ar, g->row0, g->rows, p, res);
            __atomic_fetch_add(&job->gate_up_done[item.group].value, 1, __ATOMIC_RELEASE);
        } else {
            moe_wait(&job->gate_up_done[item.group].value, job->gate_up_items);
            const float *weights = job->down + (int64_t)g->expert * job->hidden * job->inter;
            for (int r = 0; r < g->rows; ++r) ar[r] = job->hbuf + (int64_t)(g->row0 + r) * job->inter;
            for (int q = item.first; q < item.last; ++q) moe_down_panel(job, weights, ar, g->row0, g->rows, q, res);
            __atomic_fetch_add(&job->down_done->value, 1, __ATOMIC_RELEASE);
        }
    }
}

/* Scratch for one chunk of at most max_tokens tokens, reused chunk after chunk. */
typedef struct {
    int32_t *start, *row_token, *slot;
    float *row_weight, *hbuf, *ybuf;
    moe_group *groups;
    moe_item *items;
    char *counters_raw;
    int max_groups;
} moe_scratch;

static void moe_scratch_free(moe_scratch *s) {
    free(s->start); free(s->row_token); free(s->slot); free(s->row_weight); free(s->hbuf); free(s->ybuf);
    free(s->groups); free(s->items); free(s->counters_raw);
}

static int moe_scratch_alloc(moe_scratch *s, int max_tokens, int top_k, int experts, int hidden, int inter) {
    const size_t A = (size_t)max_tokens * top_k;
    const int gu_panels = (inter + MOE_GU_COLS - 1) / MOE_GU_COLS;
    const int down_panels = (hidden + MOE_DOWN_COLS - 1) / MOE_DOWN_COLS;
    s->max_groups = experts + (int)(A / MOE_ROW_BLOCK) + 1;
    const size_t max_items = (size_t)s->max_groups * (gu_panels + down_panels) + max_tokens / MOE_SUM_TOKENS + 1;
    s->start = malloc(sizeof(int32_t) * ((size_t)experts + 1));
    s->row_token = malloc(sizeof(int32_t) * A);
    s->slot = malloc(sizeof(int32_t) * A);
    s->row_weight = malloc(sizeof(float) * A);
    s->hbuf = malloc(sizeof(float) * A * (size_t)inter);
    s->ybuf = malloc(sizeof(float) * A * (size_t)hidden);
    s->groups = malloc(sizeof(moe_group) * (size_t)s->max_groups);
    s->items = malloc(sizeof(moe_item) * max_items);
    s->counters_raw = malloc(sizeof(moe_counter) * ((size_t)s->max_groups + 3) + 64);
    return s->start && s->row_token && s->slot && s->row_weight && s->hbuf && s->ybuf && s->groups && s->items &&
           s->counters_raw;
}

/* One chunk of tokens, ids already checked. */
static void moe_chunk(moe_scratch *s, const float *x, const float *gate_up, const float *down, const int32_t *ids,
                      const float *weights, float *out, int tokens, int top_k, int experts, int hidden, int inter,
                      int num_threads) {
    const int64_t A = (int64_t)tokens * top_k;
    const int gu_panels = (inter + MOE_GU_COLS - 1) / MOE_GU_COLS;
    const int down_panels = (hidden + MOE_DOWN_COLS - 1) / MOE_DOWN_COLS;
    int32_t *start = s->start;

    /* Counting sort by expert, stable in (token, k) order. */
    memset(start, 0, sizeof(int32_t) * ((size_t)experts + 1));
    for (int64_t a = 0; a < A; ++a) ++start[ids[a] + 1];
    for (int e = 0; e < experts; ++e) start[e + 1] += start[e];
    for (int64_t a = 0; a < A; ++a) {
        const int32_t pos = start[ids[a]]++;
        s->row_token[pos] = (int32_t)(a / top_k);
        s->row_weight[pos] = weights[a];
        s->slot[a] = pos;
    }
    /* start[e] is now the end of expert e's rows (the start of e + 1's). Each expert's rows are cut
     * into groups of at most MOE_ROW_BLOCK, of even sizes. */
    int num_groups = 0;
    for (int e = 0, row0 = 0; e < experts; row0 = start[e++]) {
        const int count = start[e] - row0;
        if (count == 0) continue;
        const int blocks = (count + MOE_ROW_BLOCK - 1) / MOE_ROW_BLOCK;
        int per = (count + blocks - 1) / blocks;
        per = (per + MOE_MR - 1) / MOE_MR * MOE_MR;
        for (int r = 0; r < count; r += per)
            s->groups[num_groups++] = (moe_group){e, row0 + r, count - r < per ? count - r : per};
    }
    /* Items: gate/up of group g, then down of group g - 1 (whose gate/up items are then long taken),
     * then the per-token sums. */
    int n = 0;
    for (int g = 0; g <= num_groups; ++g) {
        if (g < num_groups)
            for (int p = 0; p < gu_panels; p += MOE_ITEM_PANELS)
                s->items[n++] = (moe_item){MOE_GATE_UP, g, p, p + MOE_ITEM_PANELS < gu_panels ? p + MOE_ITEM_PANELS
                                                                                                : gu_panels};
        if (g > 0)
            for (int q = 0; q < down_panels; q += MOE_ITEM_PANELS)
                s->items[n++] = (moe_item){MOE_DOWN, g - 1, q, q + MOE_ITEM_PANELS < down_panels ? q + MOE_ITEM_PANELS
                                                                                                  : down_panels};
    }
    for (int t = 0; t < tokens; t += MOE_SUM_TOKENS)
        s->items[n++] = (moe_item){MOE_SUM, 0, t, t + MOE_SUM_TOKENS < tokens ? t + MOE_SUM_TOKENS : tokens};

    moe_counter *counters = (moe_counter *)(((uintptr_t)s->counters_raw + 63) & ~(uintptr_t)63);
    memset(counters, 0, sizeof(moe_counter) * ((size_t)num_groups + 2));
    const int gu_items = (gu_panels + MOE_ITEM_PANELS - 1) / MOE_ITEM_PANELS;
    const int down_items = (down_panels + MOE_ITEM_PANELS - 1) / MOE_ITEM_PANELS;
    moe_job job = {x, gate_up, down, out, tokens, top_k, hidden, inter, s->row_token, s->row_weight, s->slot,
                   s->hbuf, s->ybuf, s->groups, s->items, n, num_groups * down_items, gu_items,
                   counters, counters + 1, counters + 2};
    run_workers(moe_worker, &job, num_threads < n ? num_threads : n);
}

/* fdplug_moe_experts' scratch cap from now on: bytes (> 0), or MOE_SCRATCH_BYTES (0); returns the
 * cap it replaces. For tests: a call in flight keeps the cap it started with. */
int64_t fdplug_moe_scratch_bytes(int64_t bytes) {
    return __atomic_exchange_n(&moe_scratch_bytes, bytes > 0 ? bytes : MOE_SCRATCH_BYTES, __ATOMIC_RELAXED);
}

/* The routed experts for tokens x [T, H] with ids, weights [T, K] (row-major) into out [T, H], on up
 * to num_threads threads (the caller's included). Tokens go in chunks whose scratch (hbuf and ybuf:
 * K * (I + H) floats a token) stays under the scratch cap (MOE_SCRATCH_BYTES, or
 * fdplug_moe_scratch_bytes'); a token's result does not depend on its chunk. Returns 0; -1 if
 * scratch memory could not be had (out undefined); -2 if an id is outside [0, experts) (then nothing
 * is computed). */
int fdplug_moe_experts(const float *x, const float *gate_up, const float *down, const int32_t *ids,
                       const float *weights, float *out, int tokens, int top_k, int experts, int hidden, int inter,
                       int num_threads) {
    if (tokens <= 0 || top_k <= 0) return 0;
    const int64_t A = (int64_t)tokens * top_k;
    for (int64_t a = 0; a < A; ++a)
        if (ids[a] < 0 || ids[a] >= experts) return -2;
    const int64_t per_token = (int64_t)top_k * (hidden + inter) * (int64_t)sizeof(float);
    int64_t chunk = __atomic_load_n(&moe_scratch_bytes, __ATOMIC_RELAXED) / per_token;
    chunk = chunk < 1 ? 1 : chunk > tokens ? tokens : chunk;
    if (chunk * top_k > INT32_MAX / 4) chunk = INT32_MAX / 4 / top_k;
    moe_scratch s;
    const int ok = moe_scratch_alloc(&s, (int)chunk, top_k, experts, hidden, inter);
    if (ok)
        for (int64_t t0 = 0; t0 < tokens; t0 += chunk) {
            const int n = (int)(tokens - t0 < chunk ? tokens - t0 : chunk);
            moe_chunk(&s, x + t0 * hidden, gate_up, down, ids + t0 * top_k, weights + t0 * top_k, out + t0 * hidden,
                      n, top_k, experts, hidden, inter, num_threads);
        }
    moe_scratch_free(&s);
    return ok ? 0 : -1;
}

/* ---------------------------------------------------------------------------------------------
 * FP8 block linear for a few rows (decode): out[m, n] = sum_k x[m, k] * W[n, k], where W is an e4m3
 * weight [N, K] (one byte a weight) times its per-row block scales [N, ceil(K / bk)] (the layout of
 * fdplug/core/quant/fp8_rows.py). The weights are never dequantized in memory: each 8 are widened
 * in registers (the 7 magnitude bits placed at float bit 20 and the sign at bit 31 read as a float
 * 2^-120 times the e4m3 value, normals and subnormals alike; times 2^120, then the block's scale;
 * the NaN code 0x7F, which the quantizer never writes, reads as 480) and feed FMAs for up to FP8_MR
 * rows at once. Work items are ranges of output columns taken from one counter; a weight row is read
 * from memory once per call. Each output is two FMA chains per lane (the first and second 8 of each
 * 16 weights: one chain waited on the FMA latency, 2 FMAs a 16 weights, ~5 GB/s of weights a thread),
 * over K in index order, then summed in a fixed order: the same bits whatever the batch or threads.
 * ------------------------------------------------------------------------------------------- */

#define FP8_MR 8

typedef struct {
    const float *x;
    const uint8_t *w;
    const float *scales;
    float *out;
    int rows, cols, depth, blocks, block_k;
    int64_t cols_per_piece, next_piece;
} fp8_job;

static inline float e4m3_to_float(uint8_t b) {
    const uint32_t bits = ((uint32_t)(b & 0x7F) << 20) | ((uint32_t)(b & 0x80) << 24);
    float f;
    memcpy(&f, &bits, sizeof f);
    return f * 0x1p120f;
}

#ifdef HAVE_AVX2
static inline float hsum8(__m256 v) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}
#endif

/* Rows m0 .. m0 + mr - 1 (mr <= FP8_MR) of output column n; mr is a constant at each call site
 * (fp8_columns), so the accumulators live in registers: with mr a variable gcc kept them on the
 * stack, a store and a load around every FMA (single-row decode ran at ~5 GB/s of weights). */
static inline __attribute__((always_inline)) void fp8_column(const fp8_job *job, int m0, const int mr, int n) {
    const int depth = job->depth, bk = job->block_k;
    const uint8_t *w = job->w + (int64_t)n * depth;
    const float *scales = job->scales + (int64_t)n * job->blocks;
    const float *x = job->x + (int64_t)m0 * depth;
    float tail[FP8_MR] = {0};
    int k = 0;
#ifdef HAVE_AVX2
    __m256 acc[FP8_MR], acc2[FP8_MR];
    for (int r = 0; r < FP8_MR; ++r) acc[r] = acc2[r] = _mm256_setzero_ps();
    const __m256i low7 = _mm256_set1_epi32(0x7F), high1 = _mm256_set1_epi32(0x80);
    const __m256 two120 = _mm256_set1_ps(0x1p120f);
#endif
    for (int b = 0; b < job->blocks; ++b) {
        const int end = (b + 1) * bk < depth ? (b + 1) * bk : depth;
        const float scale = scales[b];
#if defined(HAVE_AVX2) && defined(__F16C__)
        /* 16 at a time through half precision: the magnitude bits at half bit 7 and the sign at bit
         * 15 make a half equal to 2^-8 times the e4m3 value (subnormals included). Sign-extended and
         * shifted by 7, a byte has its magnitude at bits 7-13 and its sign in bits 14-15: one AND
         * keeps bit 15 and clears bit 14. */
        const __m256 s = _mm256_set1_ps(scale * 256.0f);
        const __m256i keep = _mm256_set1_epi16((short)0xBF80);
        for (; k + 16 <= end; k += 16) {
            const __m256i v = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + k)));
            const __m256i h = _mm256_and_si256(_mm256_slli_epi16(v, 7), keep);
            const __m256 w0 = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), s);
            const __m256 w1 = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)), s);
            for (int r = 0; r < mr; ++r) {
                const float *xr = x + (int64_t)r * depth + k;
                acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(xr), w0, acc[r]);
                acc2[r] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 8), w1, acc2[r]);
            }
        }
#endif
#ifdef HAVE_AVX2
        const __m256 s8 = _mm256_set1_ps(scale);
        for (; k + 8 <= end; k += 8) {
            const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(w + k)));
            const __m256i bits = _mm256_or_si256(_mm256_slli_epi32(_mm256_and_si256(v, low7), 20),
                                                 _mm256_slli_epi32(_mm256_and_si256(v, high1), 24));
            const __m256 wf = _mm256_mul_ps(_mm256_mul_ps(_mm256_castsi256_ps(bits), two120), s8);
            for (int r = 0; r < mr; ++r)
                acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + (int64_t)r * depth + k), wf, acc[r]);
        }
#endif
        for (; k < end; ++k) {
            const float wf = e4m3_to_float(w[k]) * scale;
            for (int r = 0; r < mr; ++r) tail[r] += x[(int64_t)r * depth + k] * wf;
        }
    }
    for (int r = 0; r < mr; ++r) {
#ifdef HAVE_AVX2
        tail[r] += hsum8(_mm256_add_ps(acc[r], acc2[r]));
#endif
        job->out[(int64_t)(m0 + r) * job->cols + n] = tail[r];
    }
}

/* Columns [begin, end) of rows m0 .. m0 + mr - 1, one fp8_column each, its mr made a constant. */
static void fp8_columns(const fp8_job *job, int m0, int mr, int begin, int end) {
#define FP8_COLUMNS(MR) for (int n = begin; n < end; ++n) fp8_column(job, m0, MR, n)
    switch (mr) {
    case 1: FP8_COLUMNS(1); break;
    case 2: FP8_COLUMNS(2); break;
    case 3: FP8_COLUMNS(3); break;
    case 4: FP8_COLUMNS(4); break;
    case 5: FP8_COLUMNS(5); break;
    case 6: FP8_COLUMNS(6); break;
    case 7: FP8_COLUMNS(7); break;
    default: FP8_COLUMNS(FP8_MR); break;
    }
#undef FP8_COLUMNS
}

static void *fp8_worker(void *arg) {
    fp8_job *job = arg;
    for (;;) {
        const int64_t begin = __atomic_fetch_add(&job->next_piece, 1, __ATOMIC_RELAXED) * job->cols_per_piece;
        if (begin >= job->cols) return NULL;
        const int end = (int)(begin + job->cols_per_piece < job->cols ? begin + job->cols_per_piece : job->cols);
        for (int m0 = 0; m0 < job->rows; m0 += FP8_MR) /* a piece's weight rows stay in L1/L2 across row tiles */
            fp8_columns(job, m0, job->rows - m0 < FP8_MR ? job->rows - m0 : FP8_MR, (int)begin, end);
    }
}

/* x [rows, depth] float32, w [cols, depth] e4m3 bytes, scales [cols, ceil(depth / block_k)] float32
 * -> out [rows, cols] float32, on up to num_threads threads (the caller's included). */
void fdplug_fp8_linear(const float *x, const uint8_t *w, const float *scales, float *out, int rows, int cols,
                       int depth, int block_k, int num_threads) {
    if (rows <= 0 || cols <= 0) return;
    const int blocks = (depth + block_k - 1) / block_k;
    const int64_t cols_per_piece = (1 << 16) / depth > 8 ? (1 << 16) / depth : 8; /* ~64 KiB of weights a piece */
    fp8_job job = {x, w, scales, out, rows, cols, depth, blocks, block_k, cols_per_piece, 0};
    const int64_t pieces = (cols + cols_per_piece - 1) / cols_per_piece;
    run_workers(fp8_worker, &job, num_threads < pieces ? num_threads : (int)pieces);
}

/* out [cols, depth] float32 = w [cols, depth] e4m3 times its per-row block scales: the layer widened
 * once for a long prefill, where fdplug_linear's tiles beat re-widening the weights every 8 rows. */
typedef struct {
    const uint8_t *w;
    const float *scales;
    float *out;
    int cols, depth, blocks, block_k;
    int next_col;
} fp8_dequant_job;

static void *fp8_dequant_worker(void *arg) {
    fp8_dequant_job *job = arg;
    for (;;) {
        const int n = __atomic_fetch_add(&job->next_col, 1, __ATOMIC_RELAXED);
        if (n >= job->cols) return NULL;
        const uint8_t *w = job->w + (int64_t)n * job->depth;
        float *o = job->out + (int64_t)n * job->depth;
        for (int k = 0; k < job->depth; ++k) o[k] = e4m3_to_float(w[k]) * job->scales[(int64_t)n * job->blocks + k / job->block_k];
    }
}

void fdplug_fp8_dequant(const uint8_t *w, const float *scales, float *out, int cols, int depth, int block_k,
                        int num_threads) {
    if (cols <= 0 || depth <= 0) return;
    fp8_dequant_job job = {w, scales, out, cols, depth, (depth + block_k - 1) / block_k, block_k, 0};
    run_workers(fp8_dequant_worker, &job, num_threads < cols ? num_threads : cols);
}

/* Grouped FP8 linear (FP8 experts): rows [offsets[g], offsets[g + 1]) of x [A, depth] times group g's
 * weight w[g] [cols, depth] with its scales [cols, blocks], into the same rows of out [A, cols]. Work
 * items are (group, column piece) pairs of the groups that have rows, all taken from one counter, so
 * a decode step's few experts share the threads; each output is computed exactly as by
 * fdplug_fp8_linear. */
typedef struct {
    fp8_job base;          /* shapes and pointers of group 0; per item the group's are derived */
    const int64_t *offsets;
    const int32_t *item_group;  /* group of each item */
    const int32_t *item_piece;  /* column piece of each item */
    int64_t items, next_item;
} fp8_grouped_job;

static void *fp8_grouped_worker(void *arg) {
    fp8_grouped_job *job = arg;
    const fp8_job *b = &job->base;
    for (;;) {
        const int64_t item = __atomic_fetch_add(&job->next_item, 1, __ATOMIC_RELAXED);
        if (item >= job->items) return NULL;
        const int g = job->item_group[item];
        const int64_t first = job->offsets[g], rows = job->offsets[g + 1] - first;
        fp8_job one = {b->x + first * b->depth, b->w + (int64_t)g * b->cols * b->depth,
                       b->scales + (int64_t)g * b->cols * b->blocks, b->out + first * b->cols, (int)rows, b->cols,
                       b->depth, b->blocks, b->block_k, b->cols_per_piece, 0};
        const int64_t begin = (int64_t)job->item_piece[item] * b->cols_per_piece;
        const int end = (int)(begin + b->cols_per_piece < b->cols ? begin + b->cols_per_piece : b->cols);
        for (int m0 = 0; m0 < one.rows; m0 += FP8_MR)
            fp8_columns(&one, m0, one.rows - m0 < FP8_MR ? one.rows - m0 : FP8_MR, (int)begin, end);
    }
}

/* Returns 0, or -1 if the item lists could not be allocated (out undefined). */
int fdplug_fp8_grouped(const float *x, const uint8_t *w, const float *scales, float *out, const int64_t *offsets,
                       int groups, int cols, int depth, int block_k, int num_threads) {
    const int blocks = (depth + block_k - 1) / block_k;
    const int64_t cols_per_piece = (1 << 16) / depth > 8 ? (1 << 16) / depth : 8;
    const int64_t pieces = (cols + cols_per_piece - 1) / cols_per_piece;
    int64_t items = 0;
    for (int g = 0; g < groups; ++g) items += offsets[g + 1] > offsets[g] ? pieces : 0;
    if (items == 0) return 0;
    int32_t *item_group = malloc(sizeof(int32_t) * items), *item_piece = malloc(sizeof(int32_t) * items);
    if (!item_group || !item_piece) {
        free(item_group);
        free(item_piece);
        return -1;
    }
    int64_t i = 0;
    for (int g = 0; g < groups; ++g)
        if (offsets[g + 1] > offsets[g])
            for (int64_t p = 0; p < pieces; ++p, ++i) {
                item_group[i] = g;
                item_piece[i] = (int32_t)p;
            }
    fp8_grouped_job job = {{x, w, scales, out, 0, cols, depth, blocks, block_k, cols_per_piece, 0},
                           offsets, item_group, item_piece, items, 0};
    run_workers(fp8_grouped_worker, &job, num_threads < items ? num_threads : (int)items);
    free(item_group);
    free(item_piece);
    return 0;
}

/* The routed experts of a MoE layer with FP8 weights, in one call:
 *   out[t] = sum_{k<K} w[t,k] * down_e(silu(gate_e x_t) * up_e x_t),  e = ids[t,k],
 * with w13 [E, 2I, H] e4m3 (each expert's gate rows, then its up rows), s13 [E, 2I, ceil(H/bk)],
 * w2 [E, H, I] and s2 [E, H, ceil(I/bk)] (per-row block scales). The (token, k) assignments are
 * counting-sorted by expert, gathered, run through both grouped GEMMs (fdplug_fp8_grouped) with
 * SwiGLU between, and each token's K rows summed in k order: a token's result does not depend on the
 * rest of the batch nor on the thread count. Returns 0; -1 if scratch memory could not be had (out
 * undefined); -2 if an id is outside [0, experts) (nothing computed). */
int fdplug_fp8_moe(const float *x, const uint8_t *w13, const float *s13, const uint8_t *w2, const float *s2,
                   const int32_t *ids, const float *weights, float *out, int tokens, int top_k, int experts,
                   int hidden, int inter, int block_k, int num_threads) {
    if (tokens <= 0 || top_k <= 0) return 0;
    const int64_t A = (int64_t)tokens * top_k;
    for (int64_t a = 0; a < A; ++a)
        if (ids[a] < 0 || ids[a] >= experts) return -2;
    int64_t *offsets = calloc((size_t)experts + 1, sizeof(int64_t)), *cursor = malloc(sizeof(int64_t) * experts);
    int64_t *pos = malloc(sizeof(int64_t) * A);
    float *xbuf = malloc(sizeof(float) * A * hidden), *gbuf = malloc(sizeof(float) * A * 2 * inter);
    float *hbuf = malloc(sizeof(float) * A * inter), *ybuf = malloc(sizeof(float) * A * hidden);
    int status = offsets && cursor && pos && xbuf && gbuf && hbuf && ybuf ? 0 : -1;
    if (status == 0) {
        for (int64_t a = 0; a < A; ++a) offsets[ids[a] + 1] += 1;
        for (int e = 0; e < experts; ++e) offsets[e + 1] += offsets[e];
        memcpy(cursor, offsets, sizeof(int64_t) * experts);
        for (int64_t a = 0; a < A; ++a) { /* stable: an expert's rows in assignment order */
            pos[a] = cursor[ids[a]]++;
            memcpy(xbuf + pos[a] * hidden, x + (a / top_k) * hidden, sizeof(float) * hidden);
        }
        status = fdplug_fp8_grouped(xbuf, w13, s13, gbuf, offsets, experts, 2 * inter, hidden, block_k, num_threads);
    }
    if (status == 0) {
        fdplug_swiglu(gbuf, hbuf, A, inter, num_threads);
        status = fdplug_fp8_grouped(hbuf, w2, s2, ybuf, offsets, experts, hidden, inter, block_k, num_threads);
    }
    if (status == 0)
        for (int64_t t = 0; t < tokens; ++t) {
            float *o = out + t * hidden;
            const float *y = ybuf + pos[t * top_k] * hidden, w = weights[t * top_k];
            for (int j = 0; j < hidden; ++j) o[j] = w * y[j];
            for (int k = 1; k < top_k; ++k) {
                const float *yk = ybuf + pos[t * top_k + k] * hidden, wk = weights[t * top_k + k];
                for (int j = 0; j < hidden; ++j) o[j] += wk * yk[j];
            }
        }
    free(offsets);
    free(cursor);
    free(pos);
    free(xbuf);
    free(gbuf);
    free(hbuf);
    free(ybuf);
    return status;
}

#include "linear.c" /* the linear layer, float32 or bf16 weights (its own file: one concept a file) */
#include "linear_bf16.c" /* the linear layer in bf16 math (AVX512-BF16) */
#include "linear_packed.c" /* the linear layer on weights packed at load: outer-product tiles */
#include "gguf_linear.c" /* the linear layer on a GGUF file's GGML blocks, read in place */
#include "prefill_attention.c" /* prefill attention, blocked with an online softmax */
#include "rms_norm.c"
#include "argmax.c" /* greedy sampling's argmax */
#include "decoder_stack.c" /* a decode step's layers in one call, from the kernels above */
#include "fma_peak.c" /* the FMA peak every GFLOP/s figure sits under (bench/gemm.py) */
