/* CPU kernel of the verifier's fast path: y = x W^T (+ b) for a few rows of x.
 *
 * Built at run time by verifier_service/backends/transformers/cpu/kernels.py (gcc -O3 -Wall -Wextra, AVX-512
 * or AVX2+FMA, with OpenMP where the compiler has it) and called through ctypes on the model's own weights, in one of two forms:
 *
 *   dot     W is the [N, K] row-major matrix nn.Linear holds. For weights that cannot be packed
 *           (shared with the input embeddings, N not a multiple of the panel width).
 *   packed  W permuted in place into panels of output columns (the second half of this file).
 *           Every other weight; faster for blocks of rows, the same for one row.
 *
 * Why not torch's F.linear: an fp32 GEMM of a few rows costs several one-row GEMVs (MKL moves
 * from GEMV to GEMM kernels at M = 2; docs/benchmarks.md), while reading the weights from memory is
 * what one row costs. Here both forms read each weight once for all rows of the block (a block of
 * 9 rows reads W from memory once, as one row does) and the extra rows' FMAs run while the next
 * weights stream in.
 *
 * The dot form: y[m, n] is a dot product of x[m] with W[n], computed in register tiles of MT rows
 * x NT weight rows, each load of W serving MT rows, with software prefetch one chunk ahead.
 * Batch invariance, by construction: y[m, n] is computed the same way whatever M is, whichever
 * tile shape or thread handles it. One accumulator vector per (m, n) collects x[m, k] * W[n, k]
 * for k = 0, LANES, 2 LANES, ... in that order (lane l holds the k = l mod LANES terms), a fixed
 * tree sums the lanes, the K % LANES tail is added in order, then the bias. K is never split,
 * nothing is reassociated (compiled without -ffast-math).
 */

#include <immintrin.h>
#include <stddef.h>

/* Threads split the weight rows (never K) through OpenMP; a compiler without it builds a
 * one-thread kernel, with no pragma left for it to warn about. */
#ifdef _OPENMP
#define PARALLEL_FOR _Pragma("omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1)")
#else
#define PARALLEL_FOR
#endif

#if defined(__AVX512F__)
#define LANES 16
#define MAX_SINGLE_GROUP 9 /* rows done in one pass over W; more rows are split in groups */
#define MAX_GROUP 8
#define PANEL_VECS 2 /* vectors per panel of the packed form */
#define MAX_PANELS 3 /* panels one packed tile holds at most */
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
/* 16 vector registers: a tile of MT rows x NV weight vectors keeps MT NV accumulators, NV weights
 * and one input in registers. One-vector panels let a tile of up to 12 rows keep all its
 * accumulators (12 + 1 + 1 registers), so a verify block of 9 rows reads W once, in one pass;
 * with two-vector panels it took two groups, the second re-reading W while memory sat idle. */
#define LANES 8
#define MAX_SINGLE_GROUP 12
#define MAX_GROUP 6 /* 6 rows x 2 panels: 12 FMAs per 8 loads, the compute-bound (prefill) tile */
#define PANEL_VECS 1
#define MAX_PANELS 6
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
#error "kernels.c needs AVX-512F or AVX2 with FMA"
#endif

#define INLINE static inline __attribute__((always_inline))
#define MAX_TILE_ROWS MAX_SINGLE_GROUP
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
/* 16 vector registers: MT * NT accumulators + NT weights + 1 input. From 7 rows on, one weight
 * row per tile: every row of a verify block in one pass over W. */
TILE(1, 4) TILE(2, 4) TILE(3, 3) TILE(4, 2) TILE(5, 2) TILE(6, 2) TILE(7, 1) TILE(8, 1) TILE(9, 1) TILE(10, 1)
TILE(11, 1) TILE(12, 1)
static const struct tile_shape SHAPES[] = {{0, 0, 0}, SHAPE(1, 4), SHAPE(2, 4), SHAPE(3, 3), SHAPE(4, 2),
    SHAPE(5, 2), SHAPE(6, 2), SHAPE(7, 1), SHAPE(8, 1), SHAPE(9, 1), SHAPE(10, 1), SHAPE(11, 1), SHAPE(12, 1)};
#endif

/* Groups of at most MAX_GROUP rows, balanced; with AVX2, 13-14 rows are two groups of 6-7 (one-
 * vector panels, two passes over W) rather than three of 4-5 (two-panel tiles whose 4-row group
 * computes little per load): 14 % faster for 13 and 14 rows, the same for 15-17, measured with the
 * AVX2 build on Zen 4 (docs/runs/run-z.md). */
static int num_groups_for(int M) {
    if (M <= MAX_SINGLE_GROUP) return 1;
#if LANES == 8
    if (M <= 2 * MAX_GROUP + 2) return 2;
#endif
    return (M + MAX_GROUP - 1) / MAX_GROUP;
}

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

/* y[M, N] = x[M, K] W[N, K]^T (+ bias[N]); all row-major and contiguous. Threads split the
 * weight rows (chunks), never K, so the result does not depend on num_threads either. */
void spade_linear(const float *x, const float *w, const float *bias, float *y, int M, int N, int K,
                  int num_threads) {
    (void)num_threads; /* used by OpenMP only */
    if (M <= 0 || N <= 0) return;
    int chunk = chunk_rows(M, K);
    int num_chunks = (N + chunk - 1) / chunk;
    PARALLEL_FOR
    for (int c = 0; c < num_chunks; c++) {
        int n0 = c * chunk, n1 = n0 + chunk < N ? n0 + chunk : N;
        linear_chunk(x, w, bias, y, M, N, K, n0, n1, chunk);
    }
}


/* --- packed weights --------------------------------------------------------------------------
 *
 * The same product on weights repacked into panels of PANEL output columns (PANEL_VECS vectors:
 * two with AVX-512, one with AVX2): panel p holds W[p PANEL + c, k] at packed[(p K + k) PANEL + c],
 * so a panel is one contiguous stream in k. Here each vector lane IS one output y[m, n]: a tile
 * of MT rows x NP panels keeps MT x NP PANEL_VECS accumulators, and per k loads NP PANEL_VECS
 * weight vectors, broadcasts x[m, k] and does the FMAs. Against the dot-product form above, the
 * rows' inputs are read as scalars (once per LANES k instead of once per k and weight row), the
 * weights as one sequential stream per panel, and nothing is summed across lanes: a block of 9
 * rows costs little more than one (docs/benchmarks.md, "The target's forward per draft length").
 *
 * Batch invariance, by construction: y[m, n] = bias[n] + (... ((x[m,0] W[n,0]) + x[m,1] W[n,1])
 * ... + x[m,K-1] W[n,K-1]), one fused multiply-add per k in order, whatever M, the tile shape,
 * the thread or the K block computes it (a K block stores the running sums in y and resumes them
 * exactly).
 */

#define PANEL (PANEL_VECS * LANES)
/* Tiles of many rows compute long enough per panel line that the hardware prefetcher falls
 * behind: they also prefetch PACKED_PREFETCH_FLOATS ahead in each panel's stream, into L2. Fewer
 * rows do without. Measured per ISA (docs/benchmarks.md): AVX-512 on Zen 4 (Run F), faster for
 * 8-9 rows and slower for 1-7; AVX2's one-vector panels on a Xeon (Run R), 5-6 rows 9-12 % faster,
 * 4 rows the same, 8-12 rows 25-32 % faster. The #ifndef guards let a bench build variants (-D)
 * side by side; the service builds these values. */
#ifndef PACKED_PREFETCH_MIN_ROWS
#if LANES == 16
#define PACKED_PREFETCH_MIN_ROWS 8
#else
#define PACKED_PREFETCH_MIN_ROWS 5
#endif
#endif
#ifndef PACKED_PREFETCH_FLOATS
#define PACKED_PREFETCH_FLOATS 2048
#endif
#ifndef K_BLOCK
#define K_BLOCK 1024 /* rows in several groups: the panels' slice of K_BLOCK stays in cache across groups */
#endif

#if LANES == 16
#define VBROADCAST(p) _mm512_set1_ps(*(p))
#define VSTORE(p, v) _mm512_storeu_ps(p, v)
#define VADD(a, b) _mm512_add_ps(a, b)
#else
/* Not _mm256_broadcast_ss(p): gcc 12 treats that builtin's pointer as if it might write memory and
 * stores every accumulator to the stack on each k (blocks of 6-64 rows ran 1.5-1.7x slower). */
#define VBROADCAST(p) _mm256_set1_ps(*(p))
#define VSTORE(p, v) _mm256_storeu_ps(p, v)
#define VADD(a, b) _mm256_add_ps(a, b)
#endif
#define TILE_VECS (PANEL_VECS * MAX_PANELS)

/* y[i, p PANEL + c] (+)= sum over k in [k0, k1) of x[i, k] W[p PANEL + c, k], for i < mt, p < np.
 * `first`: start from zero (else resume the sums in y); `last`: add the bias; `prefetch`: also
 * fetch each panel's stream PACKED_PREFETCH_FLOATS ahead into L2, once per cache line. */
INLINE void panel_tile(int mt, int np, const float *x, int K, const float *wp, const float *bias, float *y,
                       ptrdiff_t ldy, int k0, int k1, int first, int last, int prefetch) {
    vec acc[MAX_TILE_ROWS][TILE_VECS];
    int nv = np * PANEL_VECS;
    for (int i = 0; i < mt; i++)
        for (int j = 0; j < nv; j++)
            acc[i][j] = first ? VZERO() : VLOAD(y + (ptrdiff_t)i * ldy + j * LANES);
    for (int k = k0; k < k1; k++) {
        vec wv[TILE_VECS];
        for (int p = 0; p < np; p++) {
            const float *base = wp + ((ptrdiff_t)p * K + k) * PANEL;
            for (int v = 0; v < PANEL_VECS; v++) wv[p * PANEL_VECS + v] = VLOAD(base + v * LANES);
            if (prefetch && (k * PANEL) % 16 == 0) /* with AVX2, two k steps share a 64-byte line */
                for (int c = 0; c < PANEL; c += 16) _mm_prefetch((const char *)(base + PACKED_PREFETCH_FLOATS + c), _MM_HINT_T1);
        }
        for (int i = 0; i < mt; i++) {
            vec xv = VBROADCAST(x + (ptrdiff_t)i * K + k);
            for (int j = 0; j < nv; j++) acc[i][j] = VFMA(xv, wv[j], acc[i][j]);
        }
    }
    for (int i = 0; i < mt; i++)
        for (int j = 0; j < nv; j++)
            VSTORE(y + (ptrdiff_t)i * ldy + j * LANES, last && bias ? VADD(acc[i][j], VLOAD(bias + j * LANES)) : acc[i][j]);
}

typedef void (*panel_fn)(const float *, int, const float *, const float *, float *, ptrdiff_t, int, int, int, int, int);

#define PANEL_TILE(MT, NP)                                                                                       \
    static void panels_##MT##x##NP(const float *x, int K, const float *wp, const float *b, float *y, ptrdiff_t ldy, \
                                   int k0, int k1, int first, int last, int prefetch) {                          \
        if (prefetch) panel_tile(MT, NP, x, K, wp, b, y, ldy, k0, k1, first, last, 1);                            \
        else panel_tile(MT, NP, x, K, wp, b, y, ldy, k0, k1, first, last, 0);                                     \
    }

/* PANEL_TILES[MT][NP]: every shape whose MT x NP PANEL_VECS accumulators + NP PANEL_VECS weights + 1
 * input fit the vector registers; PANELS_FOR[MT]: the widest (a group's own shape). */
#if LANES == 16 /* 32 registers, two-vector panels */
PANEL_TILE(1, 1) PANEL_TILE(1, 2) PANEL_TILE(1, 3) PANEL_TILE(2, 1) PANEL_TILE(2, 2) PANEL_TILE(2, 3)
PANEL_TILE(3, 1) PANEL_TILE(3, 2) PANEL_TILE(3, 3) PANEL_TILE(4, 1) PANEL_TILE(4, 2) PANEL_TILE(4, 3)
PANEL_TILE(5, 1) PANEL_TILE(5, 2) PANEL_TILE(6, 1) PANEL_TILE(6, 2) PANEL_TILE(7, 1) PANEL_TILE(8, 1) PANEL_TILE(9, 1)
static const panel_fn PANEL_TILES[MAX_TILE_ROWS + 1][MAX_PANELS + 1] = {
    {0}, {0, panels_1x1, panels_1x2, panels_1x3}, {0, panels_2x1, panels_2x2, panels_2x3},
    {0, panels_3x1, panels_3x2, panels_3x3}, {0, panels_4x1, panels_4x2, panels_4x3}, {0, panels_5x1, panels_5x2},
    {0, panels_6x1, panels_6x2}, {0, panels_7x1}, {0, panels_8x1}, {0, panels_9x1}};
static const int PANELS_FOR[] = {0, 3, 3, 3, 3, 2, 2, 1, 1, 1};
#else /* 16 registers, one-vector panels */
PANEL_TILE(1, 1) PANEL_TILE(1, 2) PANEL_TILE(1, 3) PANEL_TILE(1, 4) PANEL_TILE(1, 5) PANEL_TILE(1, 6)
PANEL_TILE(2, 1) PANEL_TILE(2, 2) PANEL_TILE(2, 3) PANEL_TILE(2, 4) PANEL_TILE(3, 1) PANEL_TILE(3, 2) PANEL_TILE(3, 3)
PANEL_TILE(4, 1) PANEL_TILE(4, 2) PANEL_TILE(4, 3) PANEL_TILE(5, 1) PANEL_TILE(5, 2) PANEL_TILE(6, 1) PANEL_TILE(6, 2)
PANEL_TILE(7, 1) PANEL_TILE(8, 1) PANEL_TILE(9, 1) PANEL_TILE(10, 1) PANEL_TILE(11, 1) PANEL_TILE(12, 1)
static const panel_fn PANEL_TILES[MAX_TILE_ROWS + 1][MAX_PANELS + 1] = {
    {0}, {0, panels_1x1, panels_1x2, panels_1x3, panels_1x4, panels_1x5, panels_1x6},
    {0, panels_2x1, panels_2x2, panels_2x3, panels_2x4}, {0, panels_3x1, panels_3x2, panels_3x3},
    {0, panels_4x1, panels_4x2, panels_4x3}, {0, panels_5x1, panels_5x2}, {0, panels_6x1, panels_6x2},
    {0, panels_7x1}, {0, panels_8x1}, {0, panels_9x1}, {0, panels_10x1}, {0, panels_11x1}, {0, panels_12x1}};
static const int PANELS_FOR[] = {0, 6, 4, 3, 3, 2, 2, 1, 1, 1, 1, 1, 1};
#endif

int spade_panel_width(void) { return PANEL; }

/* One group of rows (a verify block): each tile runs over all of K, prefetching its streams
 * when it has rows enough to fall behind them. */
static void packed_one_group(const float *x, const float *wp, const float *bias, float *y, int M, int N, int K,
                             int p0, int p1) {
    int unit = PANELS_FOR[M], prefetch = M >= PACKED_PREFETCH_MIN_ROWS;
    for (int p = p0; p < p1; p += unit) {
        int np = p1 - p < unit ? p1 - p : unit;
        PANEL_TILES[M][np](x, K, wp + (ptrdiff_t)p * K * PANEL, bias ? bias + p * PANEL : 0, y + p * PANEL, N, 0, K, 1,
                           1, prefetch);
    }
}

/* Several groups (rows of a prefill): K in blocks, every group over the block's slice of a few
 * panels (then in cache), the first group prefetching. Measured against blocking the rows and K
 * as a GEMM does (the inputs kept in L2, the slice in L1): no faster with either ISA, slower for
 * AVX-512 at 512 rows (docs/benchmarks.md, "Run R"). */
static void packed_groups(const float *x, const float *wp, const float *bias, float *y, int M, int N, int K, int p0,
                          int p1, int num_groups) {
    int unit = PANELS_FOR[M / num_groups]; /* the shorter group's width fits the taller group too */
    if (PANELS_FOR[(M + num_groups - 1) / num_groups] < unit) unit = PANELS_FOR[(M + num_groups - 1) / num_groups];
    for (int p = p0; p < p1; p += unit) {
        int np = p1 - p < unit ? p1 - p : unit;
        const float *panels = wp + (ptrdiff_t)p * K * PANEL;
        for (int k0 = 0; k0 < K; k0 += K_BLOCK) {
            int k1 = k0 + K_BLOCK < K ? k0 + K_BLOCK : K;
            for (int g = 0; g < num_groups; g++) {
                int m0 = g * M / num_groups, height = (g + 1) * M / num_groups - m0; /* balanced */
                PANEL_TILES[height][np](x + (ptrdiff_t)m0 * K, K, panels, bias ? bias + p * PANEL : 0,
                                        y + (ptrdiff_t)m0 * N + p * PANEL, N, k0, k1, k0 == 0, k1 == K,
                                        g == 0 && height >= PACKED_PREFETCH_MIN_ROWS);
            }
        }
    }
}

/* y[M, N] = x[M, K] W[N, K]^T (+ bias[N]) with W packed (N a multiple of PANEL). Threads split
 * the panels, never K, so the result does not depend on num_threads either. */
void spade_packed_linear(const float *x, const float *wp, const float *bias, float *y, int M, int N, int K,
                         int num_threads) {
    (void)num_threads; /* used by OpenMP only */
    if (M <= 0 || N <= 0) return;
    int num_panels = N / PANEL, num_groups = num_groups_for(M);
    int per_thread = num_threads > 1 ? (num_panels + num_threads - 1) / num_threads : num_panels;
    int num_parts = (num_panels + per_thread - 1) / per_thread;
    PARALLEL_FOR
    for (int part = 0; part < num_parts; part++) {
        int p0 = part * per_thread, p1 = p0 + per_thread < num_panels ? p0 + per_thread : num_panels;
        if (num_groups == 1) packed_one_group(x, wp, bias, y, M, N, K, p0, p1);
        else packed_groups(x, wp, bias, y, M, N, K, p0, p1, num_groups);
    }
}


/* --- batch-invariant attention -----------------------------------------------------------------
 *
 * The batch-invariant mode's attention: each new query row on its own against exactly the keys it
 * sees (row r of R new rows, at position num_keys - R + r, sees keys 0 ... that position), as
 * cpu_attention.rowwise_attention does with a few torch operations per row, at the cost of their
 * dispatch (28 layers x 9 rows of them were over a quarter of a 9-row verify's extra time on AVX2).
 *
 * Batch invariance, by construction: a row's output is computed by the same operations whatever
 * R, the thread or the order of the tasks. For each (row, head): score j = (the lanes of one
 * accumulator collecting q[d] k_j[d] for d = 0, LANES, ... in order, summed by vsum's fixed tree)
 * times `scaling`; e_j = exp(score j - max) by one polynomial (vexp) on whole vectors of keys
 * (lane l of vector b holds key b LANES + l, keys past the visible ones are zeroed after it);
 * their sum: the vectors added in order, then vsum; out[d] = (sum over j in order of e_j v_j[d])
 * / that sum. Nothing depends on which other rows share the call.
 */

#if LANES == 16
typedef __m512i ivec;
#define VSET1(a) _mm512_set1_ps(a)
#define VMUL(a, b) _mm512_mul_ps(a, b)
#define VSUB(a, b) _mm512_sub_ps(a, b)
#define VMAX(a, b) _mm512_max_ps(a, b)
#define VDIV(a, b) _mm512_div_ps(a, b)
#define VFLOOR(a) _mm512_roundscale_ps(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC)
#define VEXPONENT(n) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23))
static inline float vmax_lanes(vec v) { return _mm512_reduce_max_ps(v); }
#else
#define VSET1(a) _mm256_set1_ps(a)
#define VMUL(a, b) _mm256_mul_ps(a, b)
#define VSUB(a, b) _mm256_sub_ps(a, b)
#define VMAX(a, b) _mm256_max_ps(a, b)
#define VDIV(a, b) _mm256_div_ps(a, b)
#define VFLOOR(a) _mm256_floor_ps(a)
#define VEXPONENT(n) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23))
static inline float vmax_lanes(vec v) {
    __m128 quarter = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    quarter = _mm_max_ps(quarter, _mm_movehl_ps(quarter, quarter));
    return _mm_cvtss_f32(_mm_max_ss(quarter, _mm_movehdup_ps(quarter)));
}
#endif

/* e^x for x <= 0 (softmax's shifted scores), Cephes' expf: x = n ln 2 + r, a degree-5 polynomial
 * in r, times 2^n. Below -87 it gives e^-87 (~2e-38, a normal float), never a denormal. */
INLINE vec vexp(vec x) {
    x = VMAX(x, VSET1(-87.0f));
    vec n = VFLOOR(VFMA(x, VSET1(1.44269504088896341f), VSET1(0.5f)));
    vec r = VFMA(n, VSET1(-0.693359375f), x);
    r = VFMA(n, VSET1(2.12194440e-4f), r);
    vec p = VSET1(1.9875691500e-4f);
    p = VFMA(p, r, VSET1(1.3981999507e-3f));
    p = VFMA(p, r, VSET1(8.3334519073e-3f));
    p = VFMA(p, r, VSET1(4.1665795894e-2f));
    p = VFMA(p, r, VSET1(1.6666665459e-1f));
    p = VFMA(p, r, VSET1(5.0000001201e-1f));
    vec y = VFMA(p, VMUL(r, r), VADD(r, VSET1(1.0f)));
    return VMUL(y, VEXPONENT(n));
}

#define ATTENTION_KEYS 8    /* keys whose scores are computed together (independent FMA chains) */
#define ATTENTION_VECS 8    /* output vectors of a head accumulated together */
#define ATTENTION_BLOCK 32  /* keys per pass of the value sums (their values stay in L1 across the heads) */

/* scores[h padded + j] = scaling * q_h . k_j for the group's heads h and keys j < n: a block of
 * ATTENTION_KEYS keys (one FMA chain each) at a time, every head of the group over the block while
 * its keys are in L1. */
INLINE void group_scores(const float *q, ptrdiff_t q_head, int group, const float *k, ptrdiff_t k_key, int head_dim, int n,
                         float scaling, float *scores, ptrdiff_t padded) {
    int j = 0;
    for (; j + ATTENTION_KEYS <= n; j += ATTENTION_KEYS)
        for (int h = 0; h < group; h++) {
            vec acc[ATTENTION_KEYS];
            for (int t = 0; t < ATTENTION_KEYS; t++) acc[t] = VZERO();
            for (int d = 0; d < head_dim; d += LANES) {
                vec qv = VLOAD(q + h * q_head + d);
                for (int t = 0; t < ATTENTION_KEYS; t++) acc[t] = VFMA(qv, VLOAD(k + (j + t) * k_key + d), acc[t]);
            }
            for (int t = 0; t < ATTENTION_KEYS; t++) scores[h * padded + j + t] = vsum(acc[t]) * scaling;
        }
    for (; j < n; j++)
        for (int h = 0; h < group; h++) {
            vec acc = VZERO();
            for (int d = 0; d < head_dim; d += LANES) acc = VFMA(VLOAD(q + h * q_head + d), VLOAD(k + j * k_key + d), acc);
            scores[h * padded + j] = vsum(acc) * scaling;
        }
}

/* scores[0, n) -> e_j = exp(score j - max), zero from n to the next multiple of LANES; their sum. */
INLINE float head_softmax_numerators(float *scores, int n) {
    int padded = (n + LANES - 1) / LANES * LANES;
    for (int j = n; j < padded; j++) scores[j] = scores[n - 1]; /* a visible score: the max is unchanged */
    vec maxv = VLOAD(scores);
    for (int j = LANES; j < padded; j += LANES) maxv = VMAX(maxv, VLOAD(scores + j));
    vec shift = VSET1(vmax_lanes(maxv)), total = VZERO();
    for (int j = 0; j < padded; j += LANES) VSTORE(scores + j, vexp(VSUB(VLOAD(scores + j), shift)));
    for (int j = n; j < padded; j++) scores[j] = 0.0f;
    for (int j = 0; j < padded; j += LANES) total = VADD(total, VLOAD(scores + j));
    return vsum(total);
}

/* sum[t LANES ...] (+)= e_j v_j[d0 + t LANES ...] over keys j in [j0, j1), for t < NV: NV
 * accumulators in registers (NV a constant at every call site). */
INLINE void value_sums(int nv, const float *e, const float *v, ptrdiff_t v_key, int j0, int j1, float *sum) {
    vec acc[ATTENTION_VECS];
    for (int t = 0; t < nv; t++) acc[t] = j0 == 0 ? VZERO() : VLOAD(sum + t * LANES);
    for (int j = j0; j < j1; j++) {
        vec ev = VBROADCAST(e + j);
        for (int t = 0; t < nv; t++) acc[t] = VFMA(ev, VLOAD(v + j * v_key + t * LANES), acc[t]);
    }
    for (int t = 0; t < nv; t++) VSTORE(sum + t * LANES, acc[t]);
}

/* One (row, KV head) task: the `group` query heads that share the KV head. */
static void attention_task(const float *q, const float *k, const float *v, float *out, int group, int head_dim,
                           int n, const long long *strides, float scaling, float *scores, float *sums) {
    ptrdiff_t q_head = strides[0], k_key = strides[3], v_key = strides[5], out_head = strides[7];
    ptrdiff_t padded = (n + LANES - 1) / LANES * LANES;
    float totals[64];
    group_scores(q, q_head, group, k, k_key, head_dim, n, scaling, scores, padded);
    for (int h = 0; h < group; h++) totals[h] = head_softmax_numerators(scores + h * padded, n);
    for (int j0 = 0; j0 < n; j0 += ATTENTION_BLOCK) {
        int j1 = j0 + ATTENTION_BLOCK < n ? j0 + ATTENTION_BLOCK : n;
        for (int h = 0; h < group; h++) {
            const float *e = scores + h * padded;
            int d0 = 0;
            for (; d0 + ATTENTION_VECS * LANES <= head_dim; d0 += ATTENTION_VECS * LANES)
                value_sums(ATTENTION_VECS, e, v + d0, v_key, j0, j1, sums + h * head_dim + d0);
            for (; d0 < head_dim; d0 += LANES) value_sums(1, e, v + d0, v_key, j0, j1, sums + h * head_dim + d0);
        }
    }
    for (int h = 0; h < group; h++) {
        vec total = VSET1(totals[h]);
        for (int d = 0; d < head_dim; d += LANES) VSTORE(out + h * out_head + d, VDIV(VLOAD(sums + h * head_dim + d), total));
    }
}

int spade_attention_lanes(void) { return LANES; }

/* out[r, h] = softmax(scaling q[h, r] . k[h / group, j] over the keys j row r sees) . v, for every
 * new row r < num_rows and query head h. strides (in floats): q per head, q per row, k per KV head,
 * k per key, v per KV head, v per key, out per row, out per head; within a head the head_dim
 * floats are contiguous (head_dim a multiple of LANES, group <= 64: the caller checks). Threads
 * split the (row, KV head) tasks; 0 on success, -1 when scratch memory could not be had. */
int spade_rowwise_attention(const float *q, const float *k, const float *v, float *out, int num_rows, int num_heads,
                            int num_kv_heads, int head_dim, int num_keys, const long long *strides, float scaling,
                            int num_threads) {
    (void)num_threads; /* used by OpenMP only */
    int group = num_heads / num_kv_heads, num_tasks = num_rows * num_kv_heads, failed = 0;
    size_t padded = (size_t)(num_keys + LANES - 1) / LANES * LANES;
    PARALLEL_FOR
    for (int task = 0; task < num_tasks; task++) {
        int row = task / num_kv_heads, kv = task % num_kv_heads;
        float *scratch = (float *)_mm_malloc(((size_t)group * padded + (size_t)group * head_dim) * sizeof(float), 64);
        if (!scratch) {
            failed = 1; /* a benign race: every writer writes 1 */
            continue;
        }
        attention_task(q + (ptrdiff_t)kv * group * strides[0] + (ptrdiff_t)row * strides[1], k + (ptrdiff_t)kv * strides[2],
                       v + (ptrdiff_t)kv * strides[4], out + (ptrdiff_t)row * strides[6] + (ptrdiff_t)kv * group * strides[7],
                       group, head_dim, num_keys - num_rows + row + 1, strides, scaling, scratch, scratch + group * padded);
        _mm_free(scratch);
    }
    return failed ? -1 : 0;
}
