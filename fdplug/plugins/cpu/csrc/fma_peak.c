/* ---------------------------------------------------------------------------------------------
 * The CPU's float32 FMA peak at this build's level: the ceiling every GFLOP/s figure sits under.
 *
 * Why: issue 33's bars are ratios against paddle's matmul. Where that matmul already runs near the
 * peak (MKL at 85-87% of it at 64 rows on [3072, 576], AMD EPYC, avx512 capped to AVX2; 84-89% on
 * three of SmolLM2's four shapes on a Zen 3), no kernel can be 1.2x it; bench/gemm.py times this
 * loop among its calls, in the same run and on the same threads, and prints each figure as a share
 * of it, so that a reader sees where the ceiling is rather than taking a note's word for it.
 *
 * Each thread runs 12 independent FMA chains of the build's widest float vectors (two FMA pipes
 * times a latency of 4-6 cycles keeps 8-12 in flight), with nothing but the FMAs in the loop body
 * once unrolled. acc = acc * a + b with a just under 1: the chains neither overflow nor go subnormal.
 * ------------------------------------------------------------------------------------------- */

#if defined(__AVX512F__)
typedef __m512 peak_vec;
#define PEAK_LANES 16
#define PEAK_SET1 _mm512_set1_ps
#define PEAK_FMA _mm512_fmadd_ps
#define PEAK_SUM _mm512_reduce_add_ps
#elif defined(HAVE_AVX2)
typedef __m256 peak_vec;
#define PEAK_LANES 8
#define PEAK_SET1 _mm256_set1_ps
#define PEAK_FMA _mm256_fmadd_ps
static inline float peak_sum8(__m256 v) {
    float lanes[8], sum = 0.0f;
    _mm256_storeu_ps(lanes, v);
    for (int i = 0; i < 8; ++i) sum += lanes[i];
    return sum;
}
#define PEAK_SUM peak_sum8
#else
typedef float peak_vec; /* x86-64-v2 and other CPUs: scalar fmaf (a library call where there is no FMA) */
#define PEAK_LANES 1
#define PEAK_SET1(v) (v)
#define PEAK_FMA(acc, a, b) fmaf((acc), (a), (b))
#define PEAK_SUM(v) (v)
#endif

#define PEAK_CHAINS 12
#define PEAK_CHUNKS_A_THREAD 16 /* the work in pieces from a counter, as the kernels': a late helper does less */

typedef struct {
    int64_t chunks, next_chunk, chunk_iterations; /* iterations of the 12 chains a chunk */
    float sink;                                   /* the chains' sums: keeps the loop from being dropped */
    pthread_mutex_t lock;
} peak_job;

static void *fma_peak_worker(void *arg) {
    peak_job *job = arg;
    const peak_vec a = PEAK_SET1(0.99999994f), b = PEAK_SET1(1e-3f);
    float sum = 0.0f;
    while (__atomic_fetch_add(&job->next_chunk, 1, __ATOMIC_RELAXED) < job->chunks) {
        peak_vec acc[PEAK_CHAINS];
        for (int c = 0; c < PEAK_CHAINS; ++c) acc[c] = PEAK_SET1((float)c);
        for (int64_t i = 0; i < job->chunk_iterations; ++i)
            for (int c = 0; c < PEAK_CHAINS; ++c) acc[c] = PEAK_FMA(acc[c], a, b);
        for (int c = 0; c < PEAK_CHAINS; ++c) sum += PEAK_SUM(acc[c]);
    }
    pthread_mutex_lock(&job->lock);
    job->sink += sum;
    pthread_mutex_unlock(&job->lock);
    return NULL;
}

/* About ``flops`` floating-point operations of independent FMAs (two each) on up to num_threads
 * threads (the kernels' pool); returns the number done (rounded up to whole chunks), 0 for
 * flops <= 0 or past 1e15. Time the call to get the peak: flops / seconds. */
double fdplug_fma_peak(double flops, int num_threads) {
    const int threads = num_threads > 1 ? num_threads : 1;
    if (!(flops > 0.0) || flops > 1e15) return 0.0;
    const int64_t chunks = (int64_t)PEAK_CHUNKS_A_THREAD * threads;
    const double per_iteration = 2.0 * PEAK_CHAINS * PEAK_LANES;
    peak_job job = {chunks, 0, (int64_t)(flops / per_iteration / (double)chunks) + 1, 0.0f, PTHREAD_MUTEX_INITIALIZER};
    run_workers(fma_peak_worker, &job, threads);
    volatile float kept = job.sink;
    (void)kept;
    return per_iteration * (double)job.chunk_iterations * (double)chunks;
}
