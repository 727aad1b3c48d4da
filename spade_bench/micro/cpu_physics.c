/* What one core can do, measured, so a forward's time can be read against it (spade_bench.cpu_physics).
 *
 * physics_fma: `iterations` rounds of CHAINS independent vector FMA chains, all in registers
 *   (CHAINS covers an FMA's latency times two FMA pipes on the cores we know: 4 cycles x 2 = 8).
 *   FLOPs = iterations x CHAINS x LANES x 2: the core's in-register FMA peak for this ISA.
 * physics_read: sums `count` floats with four vector accumulators: one pass that reads memory as
 *   fast as the core can stream it (bytes = 4 count), the bound a one-row forward meets.
 * Built and loaded like the kernel (verifier_service.backends.transformers.cpu.kernels.build_library).
 */

#include <immintrin.h>
#include <stddef.h>

#if defined(__AVX512F__)
#define LANES 16
typedef __m512 vec;
#define VSET1(v) _mm512_set1_ps(v)
#define VLOAD(p) _mm512_loadu_ps(p)
#define VADD(a, b) _mm512_add_ps(a, b)
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VSTORE(p, v) _mm512_storeu_ps(p, v)
#elif defined(__AVX2__) && defined(__FMA__)
#define LANES 8
typedef __m256 vec;
#define VSET1(v) _mm256_set1_ps(v)
#define VLOAD(p) _mm256_loadu_ps(p)
#define VADD(a, b) _mm256_add_ps(a, b)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VSTORE(p, v) _mm256_storeu_ps(p, v)
#else
#error "cpu_physics.c needs AVX-512F or AVX2 with FMA"
#endif

#define CHAINS 12

static float lane_sum(vec v) {
    float lanes[LANES], sum = 0.0f;
    VSTORE(lanes, v);
    for (int i = 0; i < LANES; i++) sum += lanes[i];
    return sum;
}

int physics_lanes(void) { return LANES; }
int physics_chains(void) { return CHAINS; }

float physics_fma(long iterations, float scale) {
    vec acc[CHAINS];
    vec a = VSET1(scale), b = VSET1(1.0f - scale);
    for (int j = 0; j < CHAINS; j++) acc[j] = VSET1((float)j);
    for (long i = 0; i < iterations; i++)
        for (int j = 0; j < CHAINS; j++) acc[j] = VFMA(acc[j], a, b);
    vec total = acc[0];
    for (int j = 1; j < CHAINS; j++) total = VADD(total, acc[j]);
    return lane_sum(total); /* returned, so the chains are not optimised away */
}

float physics_read(const float *data, size_t count) {
    vec s0 = VSET1(0.0f), s1 = s0, s2 = s0, s3 = s0;
    size_t i = 0;
    for (; i + 4 * LANES <= count; i += 4 * LANES) {
        s0 = VADD(s0, VLOAD(data + i));
        s1 = VADD(s1, VLOAD(data + i + LANES));
        s2 = VADD(s2, VLOAD(data + i + 2 * LANES));
        s3 = VADD(s3, VLOAD(data + i + 3 * LANES));
    }
    float sum = lane_sum(VADD(VADD(s0, s1), VADD(s2, s3)));
    for (; i < count; i++) sum += data[i];
    return sum;
}
