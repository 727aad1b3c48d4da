/* CPU kernel of the verifier's fast path: y = x W^T (+ b) for a few rows of x.
 *
 * Built at run time by verifier_service/backends/cpu_kernels.py (gcc -O3, AVX-512 or AVX2+FMA)
 * and called through ctypes on the model's own weights: W is the [N, K] row-major matrix
 * nn.Linear holds; nothing is repacked or copied.
 *
 * Why not torch's F.linear: an fp32 GEMM of a few rows costs several one-row GEMVs (MKL moves
 * from GEMV to GEMM kernels at M = 2; docs/benchmarks.md), while reading the weights from memory is
 * what one row costs. Here y[m, n] is a dot product of x[m] with W[n], computed in register
 * tiles of MT rows x NT weight rows: each load of W serves MT rows, so a block of 9 rows reads
 * W from memory once, as one row does, and the extra rows' FMAs run while the next weights
 * stream in (software prefetch one chunk ahead).
 *
 * Batch invariance, by construction: y[m, n] is computed the same way whatever M is, whichever
 * tile shape or thread handles it. One accumulator vector per (m, n) collects x[m, k] * W[n, k]
 * for k = 0, LANES, 2 LANES, ... in that order (lane l holds the k = l mod LANES terms), a fixed
 * tree sums the lanes, the K % LANES tail is added in order, then the bias. K is never split,
 * nothing is reassociated (compiled without -ffast-math).
 */

#include <immintrin.h>
#include <stddef.h>

#if defined(__AVX512F__)
#define LANES 16
#define MAX_SINGLE_GROUP 9 /* rows done in one pass over W; more rows are split in groups */
#define MAX_GROUP 8
typedef __m512 vec;
#define VZERO() _mm512_setzero_ps()
#define VLOAD(p) _mm512_loadu_ps(p)
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
static inline float vsum(vec v) {
    __m256 half = _mm256_add_ps(_mm512_castps512_ps256(v),
                                _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    __m128 quarter = _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
    quarter = _mm_add_ps(quarter, _mm_movehl_ps(quarter, quarter));
    return _mm_cvtss_f32(_mm_add_ss(quarter, _mm_movehdup_ps(quarter)));
}
#elif defined(__AVX2__) && defined(__FMA__)
#define LANES 8
#define MAX_SINGLE_GROUP 6
#define MAX_GROUP 6
typedef __m256 vec;
#define VZERO() _mm256_setzero_ps()
#define VLOAD(p) _mm256_loadu_ps(p)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
static inline float vsum(vec v) {
    __m128 quarter = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    quarter = _mm_add_ps(quarter, _mm_movehl_ps(quarter, quarter));
    return _mm_cvtss_f32(_mm_add_ss(quarter, _mm_movehdup_ps(quarter)));
}
#else
#error "cpu_kernels.c needs AVX-512F or AVX2 with FMA"
#endif

#define INLINE static inline __attribute__((always_inline))
#define MAX_TILE_ROWS 9
#define MAX_TILE_COLS 8
/* Tiles of 4 rows or more compute long enough per weight line that the hardware prefetcher
 * falls behind: they also fetch 1 KiB ahead in their own weight rows into L1. Measured on
 * Zen 4, it speeds up blocks of 4+ rows and does nothing for fewer, which do without (the
 * forward-bench section of docs/benchmarks.md). */
#define L1_PREFETCH_MIN_ROWS 4
#define L1_PREFETCH_FLOATS 256

/* y[i, j] = x[i] . w[j] (+ b[j]) for i < mt, j < nt. With `next` set, also prefetch the same
 * weight rows of the next chunk into L2, one cache line per weight row and k step. */
INLINE void dot_tile(int mt, int nt, const float *x, const float *w, const float *bias, float *y,
                     ptrdiff_t ldy, int K, const float *next) {
    vec acc[MAX_TILE_ROWS][MAX_TILE_COLS];
    for (int i = 0; i < mt; i++)
        for (int j = 0; j < nt; j++) acc[i][j] = VZERO();
    int k = 0;
    for (; k + LANES <= K; k += LANES) {
        vec wv[MAX_TILE_COLS];
        for (int j = 0; j < nt; j++) wv[j] = VLOAD(w + (ptrdiff_t)j * K + k);
        if (next)
            for (int j = 0; j < nt; j++) _mm_prefetch((const char *)(next + (ptrdiff_t)j * K + k), _MM_HINT_T2);
        if (mt >= L1_PREFETCH_MIN_ROWS) /* and 1 KiB ahead in these rows into L1 */
            for (int j = 0; j < nt; j++) _mm_prefetch((const char *)(w + (ptrdiff_t)j * K + k + L1_PREFETCH_FLOATS), _MM_HINT_T0);
        for (int i = 0; i < mt; i++) {
            vec xv = VLOAD(x + (ptrdiff_t)i * K + k);
            __asm__("" : "+v"(xv)); /* keep x in a register: one load, nt FMAs */
            for (int j = 0; j < nt; j++) acc[i][j] = VFMA(xv, wv[j], acc[i][j]);
        }
    }
    for (int i = 0; i < mt; i++)
        for (int j = 0; j < nt; j++) {
            float sum = vsum(acc[i][j]);
            for (int t = k; t < K; t++) /* explicit FMA: the same rounding in every tile */
                sum = __builtin_fmaf(x[(ptrdiff_t)i * K + t], w[(ptrdiff_t)j * K + t], sum);
            y[(ptrdiff_t)i * ldy + j] = bias ? sum + bias[j] : sum;
        }
}

typedef void (*tile_fn)(const float *, const float *, const float *, float *, ptrdiff_t, int,
                        const float *);
struct tile_shape {
    tile_fn tile; /* MT x NT */
    tile_fn edge; /* MT x 1, for the last N % NT weight rows */
    int nt;
};

/* One function per shape, so each is unrolled with its sizes known (accumulators in registers). */
#define TILE(MT, NT)                                                                              \
    static void tile_##MT##x##NT(const float *x, const float *w, const float *b, float *y,       \
                                 ptrdiff_t ldy, int K, const float *next) {                       \
        if (next) dot_tile(MT, NT, x, w, b, y, ldy, K, next);                                     \
        else dot_tile(MT, NT, x, w, b, y, ldy, K, 0);                                             \
    }                                                                                             \
    static void edge_##MT(const float *x, const float *w, const float *b, float *y, ptrdiff_t ldy, \
                          int K, const float *next) { (void)next; dot_tile(MT, 1, x, w, b, y, ldy, K, 0); }
#define SHAPE(MT, NT) { tile_##MT##x##NT, edge_##MT, NT }

#if LANES == 16
/* 32 vector registers: MT * NT accumulators + NT weights + 1 input. Measured on Zen 4: one pass
 * of a tall tile beats two passes of a square one (the second pass re-reads W from L2). */
TILE(1, 8) TILE(2, 8) TILE(3, 7) TILE(4, 6) TILE(5, 5) TILE(6, 4) TILE(7, 3) TILE(8, 3) TILE(9, 3)
static const struct tile_shape SHAPES[] = {{0, 0, 0}, SHAPE(1, 8), SHAPE(2, 8), SHAPE(3, 7),
    SHAPE(4, 6), SHAPE(5, 5), SHAPE(6, 4), SHAPE(7, 3), SHAPE(8, 3), SHAPE(9, 3)};
#else
/* 16 vector registers. */
TILE(1, 4) TILE(2, 4) TILE(3, 3) TILE(4, 2) TILE(5, 2) TILE(6, 2)
static const struct tile_shape SHAPES[] = {{0, 0, 0}, SHAPE(1, 4), SHAPE(2, 4), SHAPE(3, 3),
    SHAPE(4, 2), SHAPE(5, 2), SHAPE(6, 2)};
#endif

static int num_groups_for(int M) { return M <= MAX_SINGLE_GROUP ? 1 : (M + MAX_GROUP - 1) / MAX_GROUP; }

/* Weight rows [n0, n1) against all M rows, in groups of rows; `chunk` = n1 - n0 for all but the
 * last chunk. The chunk (~256 KiB) stays in L2 across the groups; the first group prefetches
 * the next chunk, so memory keeps streaming while the other groups compute. */
static void linear_chunk(const float *x, const float *w, const float *bias, float *y, int M, int N,
                         int K, int n0, int n1, int chunk) {
    int num_groups = num_groups_for(M);
    for (int g = 0; g < num_groups; g++) {
        int m0 = g * M / num_groups, height = (g + 1) * M / num_groups - m0; /* balanced */
        const struct tile_shape shape = SHAPES[height];
        const float *xg = x + (ptrdiff_t)m0 * K;
        float *yg = y + (ptrdiff_t)m0 * N;
        int n = n0;
        for (; n + shape.nt <= n1; n += shape.nt) {
            const float *next = g == 0 && n + chunk + shape.nt <= N ? w + (ptrdiff_t)(n + chunk) * K : 0;
            shape.tile(xg, w + (ptrdiff_t)n * K, bias ? bias + n : 0, yg + n, N, K, next);
        }
        for (; n < n1; n++) shape.edge(xg, w + (ptrdiff_t)n * K, bias ? bias + n : 0, yg + n, N, K, 0);
    }
}

static int gcd(int a, int b) { return b ? gcd(b, a % b) : a; }

/* Weight rows per chunk: about 256 KiB of W, a multiple of every tile width the groups use
 * (balanced groups have two heights at most), so only the matrix's last rows need edge tiles. */
static int chunk_rows(int M, int K) {
    int num_groups = num_groups_for(M);
    int low = SHAPES[M / num_groups].nt, high = SHAPES[(M + num_groups - 1) / num_groups].nt;
    int step = low / gcd(low, high) * high;
    int chunk = (int)(256L * 1024 / ((long)K * 4)) / step * step;
    return chunk < step ? step : chunk;
}

int spade_lanes(void) { return LANES; }

/* y[M, N] = x[M, K] W[N, K]^T (+ bias[N]); all row-major and contiguous. Threads split the
 * weight rows (chunks), never K, so the result does not depend on num_threads either. */
void spade_linear(const float *x, const float *w, const float *bias, float *y, int M, int N, int K,
                  int num_threads) {
    (void)num_threads; /* used by OpenMP only */
    if (M <= 0 || N <= 0) return;
    int chunk = chunk_rows(M, K);
    int num_chunks = (N + chunk - 1) / chunk;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1)
    for (int c = 0; c < num_chunks; c++) {
        int n0 = c * chunk, n1 = n0 + chunk < N ? n0 + chunk : N;
        linear_chunk(x, w, bias, y, M, N, K, n0, n1, chunk);
    }
}
