/* One-pass statistics of CPU tensors: the recorder's hot loop.
 *
 * One read of a tensor gives min, max, sum, sum of squares, the count of |x| < eps and of NaNs; one
 * read of an Adam exp_avg/exp_avg_sq pair gives their statistics and those of ratio
 * m / max(sqrt(v), FLT_MIN) and update m / (max(sqrt(v), FLT_MIN) + shift), bitwise the torch path's
 * (IEEE single ops are correctly rounded). Each has an AVX2/FMA loop and a portable one.
 *
 * Accumulation: float lanes within blocks of BLOCK elements, block totals in double; a block whose
 * sums leave float's range (an exploding gradient) is summed again in double. min/max ignore NaNs;
 * the caller reports NaN where the NaN count is not zero.
 *
 * The GIL is released; with threads > 1 the threads claim CHUNK-element chunks from one atomic counter
 * and chunk results merge in a fixed order, so results do not depend on the thread count. Helpers are
 * PyTorch's GNU OpenMP workers where present (gomp_parallel), else POSIX threads.
 *
 * Optional extension trainrec.recorder._fused: without a C compiler the torch path runs instead.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <float.h>
#include <dlfcn.h>
#include <pthread.h>
#include <unistd.h>
#include <stdint.h>
#include <string.h>

#define BLOCK 4096
/* How far ahead of the element it reads the AVX2 loop asks for memory (_mm_prefetch), in elements:
 * 8 KiB. The hardware prefetchers alone leave fresh gradients (not in the caches) slow to read; the
 * distances tried are in benchmarks/RESULTS.md, "Statistics kernel". On cached data it costs one
 * instruction per 64-byte line. */
#define PREFETCH_AHEAD 2048
#define NF 6 /* min, max, sum, sumsq, zeros (|x| < eps), nans */
#define MAX_THREADS 64

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__)) && !defined(__INTEL_COMPILER)
#define CLONES __attribute__((target_clones("avx2", "default")))
#else
#define CLONES
#endif

/* at_mn, at_mx: where min and max were found, as the start of a stretch of at most BLOCK elements that
 * holds them (the first such stretch in element order; -1: none yet); find_at() gives the element. */
typedef struct {
    double mn, mx, s, ss, z, nan;
    int64_t at_mn, at_mx;
} acc_t;

static inline void acc_init(acc_t *a) {
    a->mn = INFINITY;
    a->mx = -INFINITY;
    a->s = a->ss = a->z = a->nan = 0.0;
    a->at_mn = a->at_mx = -1;
}

static inline void acc_merge(acc_t *a, const acc_t *b) {
    if (b->mn < a->mn) {
        a->mn = b->mn;
        a->at_mn = b->at_mn;
    }
    if (b->mx > a->mx) {
        a->mx = b->mx;
        a->at_mx = b->at_mx;
    }
    a->s += b->s;
    a->ss += b->ss;
    a->z += b->z;
    a->nan += b->nan;
}

static inline float bf16_to_f32(uint16_t u) {
    uint32_t w = (uint32_t)u << 16;
    float f;
    memcpy(&f, &w, sizeof f);
    return f;
}

/* ------------------------------------------------------------------ plain statistics */

#define STATS_BLOCK(LOAD)                                                                          \
    for (int64_t b = lo; b < hi; b += BLOCK) {                                                     \
        int64_t e = b + BLOCK < hi ? b + BLOCK : hi;                                               \
        float s = 0.f, ss = 0.f, z = 0.f, nn = 0.f, mn = INFINITY, mx = -INFINITY;                 \
        _Pragma("omp simd reduction(+ : s, ss, z, nn) reduction(min : mn) reduction(max : mx)")   \
        for (int64_t i = b; i < e; i++) {                                                          \
            float v = LOAD;                                                                        \
            s += v;                                                                                \
            ss += v * v;                                                                           \
            z += fabsf(v) < eps ? 1.f : 0.f;                                                       \
            nn += v != v ? 1.f : 0.f;                                                              \
            mn = v < mn ? v : mn;                                                                  \
            mx = v > mx ? v : mx;                                                                  \
        }                                                                                          \
        double bs = s, bss = ss;                                                                   \
        if ((!isfinite(bs) || !isfinite(bss)) && nn == 0.f && isfinite(mn) && isfinite(mx)) {      \
            bs = bss = 0.0; /* finite values past float's range when squared: again in double */  \
            for (int64_t i = b; i < e; i++) {                                                      \
                double v = (double)(LOAD);                                                         \
                bs += v;                                                                           \
                bss += v * v;                                                                      \
            }                                                                                      \
        }                                                                                          \
        a->s += bs;                                                                                \
        a->ss += bss;                                                                              \
        a->z += z;                                                                                 \
        a->nan += nn;                                                                              \
        if (mn < a->mn) {                                                                          \
            a->mn = mn;                                                                            \
            a->at_mn = b;                                                                          \
        }                                                                                          \
        if (mx > a->mx) {                                                                          \
            a->mx = mx;                                                                            \
            a->at_mx = b;                                                                          \
        }                                                                                          \
    }

CLONES static void stats_f32_generic(const float *x, int64_t lo, int64_t hi, float eps, acc_t *a) {
    STATS_BLOCK(x[i])
}

#if defined(__GNUC__) && defined(__x86_64__) && !defined(__INTEL_COMPILER)
#include <immintrin.h>
#define HAVE_AVX2_KERNEL 1

/* Sum of the 8 float lanes (in double) and of the 8 int32 lanes. */
__attribute__((target("avx2,fma"))) static inline double hsum_ps(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    __m256d d = _mm256_add_pd(_mm256_cvtps_pd(lo), _mm256_cvtps_pd(hi));
    __m128d e = _mm_add_pd(_mm256_castpd256_pd128(d), _mm256_extractf128_pd(d, 1));
    return _mm_cvtsd_f64(_mm_add_sd(e, _mm_unpackhi_pd(e, e)));
}

__attribute__((target("avx2,fma"))) static inline double hsum_epi32(__m256i v) {
    int32_t t[8];
    _mm256_storeu_si256((__m256i *)t, v);
    return (double)t[0] + t[1] + t[2] + t[3] + t[4] + t[5] + t[6] + t[7];
}

/* stats_f32 with AVX2 and FMA: the same quantities and block structure as STATS_BLOCK, with two
 * independent vector accumulators per statistic (the auto-vectorised loop has one, so each iteration
 * waits for the previous one's adds), and NaNs counted only where the sum is not finite (a NaN makes
 * it NaN), so the loop does six vector operations per 8 elements instead of eight. On data in the
 * caches (a hook's fresh activation) it reads faster; from memory both are bound by the memory.
 * Zero counts are int32 lanes (at most BLOCK / 16 per lane). min/max ignore NaNs as the
 * generic loop does: vminps/vmaxps return the second operand when either is NaN, and the running
 * value is passed second. A block's last elements (fewer than 16) go through the generic loop. */
__attribute__((target("avx2,fma"))) static void stats_f32_avx2(const float *x, int64_t lo, int64_t hi, float eps,
                                                                acc_t *a) {
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256 veps = _mm256_set1_ps(eps);
    for (int64_t b = lo; b < hi; b += BLOCK) {
        int64_t e = b + BLOCK < hi ? b + BLOCK : hi;
        __m256 s0 = _mm256_setzero_ps(), s1 = s0, q0 = s0, q1 = s0;
        __m256 mn0 = _mm256_set1_ps(INFINITY), mn1 = mn0, mx0 = _mm256_set1_ps(-INFINITY), mx1 = mx0;
        __m256i z0 = _mm256_setzero_si256(), z1 = z0;
        int64_t i = b;
        for (; i + 16 <= e; i += 16) {
            if (i + PREFETCH_AHEAD < hi) /* not past the chunk: another thread may be reading the next */
                _mm_prefetch((const char *)(x + i + PREFETCH_AHEAD), _MM_HINT_T0);
            __m256 v0 = _mm256_loadu_ps(x + i), v1 = _mm256_loadu_ps(x + i + 8);
            s0 = _mm256_add_ps(s0, v0);
            s1 = _mm256_add_ps(s1, v1);
            q0 = _mm256_fmadd_ps(v0, v0, q0);
            q1 = _mm256_fmadd_ps(v1, v1, q1);
            mn0 = _mm256_min_ps(v0, mn0);
            mn1 = _mm256_min_ps(v1, mn1);
            mx0 = _mm256_max_ps(v0, mx0);
            mx1 = _mm256_max_ps(v1, mx1);
            /* a true compare is all ones, -1 as int32: subtracting it counts one */
            z0 = _mm256_sub_epi32(z0, _mm256_castps_si256(_mm256_cmp_ps(_mm256_and_ps(v0, absmask), veps, _CMP_LT_OQ)));
            z1 = _mm256_sub_epi32(z1, _mm256_castps_si256(_mm256_cmp_ps(_mm256_and_ps(v1, absmask), veps, _CMP_LT_OQ)));
        }
        double vs = hsum_ps(_mm256_add_ps(s0, s1)), vss = hsum_ps(_mm256_add_ps(q0, q1)), nn = 0.0;
        if (!isfinite(vs)) /* a NaN makes the sum NaN: only then are NaNs counted */
            for (int64_t k = b; k < i; k++) nn += x[k] != x[k];
        float m[8], bmn = INFINITY, bmx = -INFINITY;
        _mm256_storeu_ps(m, _mm256_min_ps(mn0, mn1));
        for (int k = 0; k < 8; k++) bmn = m[k] < bmn ? m[k] : bmn;
        _mm256_storeu_ps(m, _mm256_max_ps(mx0, mx1));
        for (int k = 0; k < 8; k++) bmx = m[k] > bmx ? m[k] : bmx;
        if ((!isfinite(vs) || !isfinite(vss)) && nn == 0.0 && isfinite(bmn) && isfinite(bmx)) {
            vs = vss = 0.0; /* finite values past float's range when squared (or summed): again in double */
            for (int64_t k = b; k < i; k++) {
                double d = x[k];
                vs += d;
                vss += d * d;
            }
        }
        a->s += vs;
        a->ss += vss;
        a->z += hsum_epi32(_mm256_add_epi32(z0, z1));
        a->nan += nn;
        if (bmn < a->mn) {
            a->mn = bmn;
            a->at_mn = b;
        }
        if (bmx > a->mx) {
            a->mx = bmx;
            a->at_mx = b;
        }
        if (i < e) { /* the block's last few elements */
            acc_t t;
            acc_init(&t);
            stats_f32_generic(x, i, e, eps, &t);
            acc_merge(a, &t);
        }
    }
}
#endif

typedef void (*stats_f32_fn)(const float *, int64_t, int64_t, float, acc_t *);
static stats_f32_fn stats_f32 = stats_f32_generic; /* the AVX2 kernel where the CPU has it (module init) */
static const char *kernel_name = "generic";

CLONES static void stats_bf16(const uint16_t *x, int64_t lo, int64_t hi, float eps, acc_t *a) {
    STATS_BLOCK(bf16_to_f32(x[i]))
}

/* ------------------------------------------------------------------ Adam state, update and ratio */

/* want: bit 0 = stats of m and v, bit 1 = stats of update and ratio.
 * a[0..3] = m, v, update, ratio. eps[0..3] likewise (the zero thresholds, already divided by the scales). */
#define ADAM_BODY(WANT_MV, WANT_UR)                                                                 \
    for (int64_t b = lo; b < hi; b += BLOCK) {                                                      \
        int64_t e = b + BLOCK < hi ? b + BLOCK : hi;                                                \
        float s0 = 0.f, q0 = 0.f, z0 = 0.f, n0 = 0.f, lo0 = INFINITY, hi0 = -INFINITY;              \
        float s1 = 0.f, q1 = 0.f, z1 = 0.f, n1 = 0.f, lo1 = INFINITY, hi1 = -INFINITY;              \
        float s2 = 0.f, q2 = 0.f, z2 = 0.f, n2 = 0.f, lo2 = INFINITY, hi2 = -INFINITY;              \
        float s3 = 0.f, q3 = 0.f, z3 = 0.f, n3 = 0.f, lo3 = INFINITY, hi3 = -INFINITY;              \
        _Pragma("omp simd reduction(+ : s0, q0, z0, n0, s1, q1, z1, n1, s2, q2, z2, n2, s3, q3, z3, n3) \
                 reduction(min : lo0, lo1, lo2, lo3) reduction(max : hi0, hi1, hi2, hi3)")          \
        for (int64_t i = b; i < e; i++) {                                                           \
            float mm = m[i], vv = v[i];                                                             \
            if (WANT_MV) {                                                                          \
                s0 += mm; q0 += mm * mm; z0 += fabsf(mm) < e0 ? 1.f : 0.f;                          \
                n0 += mm != mm ? 1.f : 0.f; lo0 = mm < lo0 ? mm : lo0; hi0 = mm > hi0 ? mm : hi0;   \
                s1 += vv; q1 += vv * vv; z1 += fabsf(vv) < e1 ? 1.f : 0.f;                          \
                n1 += vv != vv ? 1.f : 0.f; lo1 = vv < lo1 ? vv : lo1; hi1 = vv > hi1 ? vv : hi1;   \
            }                                                                                       \
            if (WANT_UR) {                                                                          \
                float d = sqrtf(vv);                                                                \
                d = d < FLT_MIN ? FLT_MIN : d; /* NaN stays NaN: the comparison is false */         \
                float u = mm / (d + shift), r = mm / d;                                             \
                s2 += u; q2 += u * u; z2 += fabsf(u) < e2 ? 1.f : 0.f;                              \
                n2 += u != u ? 1.f : 0.f; lo2 = u < lo2 ? u : lo2; hi2 = u > hi2 ? u : hi2;         \
                s3 += r; q3 += r * r; z3 += fabsf(r) < e3 ? 1.f : 0.f;                              \
                n3 += r != r ? 1.f : 0.f; lo3 = r < lo3 ? r : lo3; hi3 = r > hi3 ? r : hi3;         \
            }                                                                                       \
        }                                                                                           \
        float S[4] = {s0, s1, s2, s3}, Q[4] = {q0, q1, q2, q3}, Z[4] = {z0, z1, z2, z3};            \
        float N[4] = {n0, n1, n2, n3}, L[4] = {lo0, lo1, lo2, lo3}, H[4] = {hi0, hi1, hi2, hi3};    \
        for (int k = 0; k < 4; k++) {                                                               \
            a[k].s += S[k]; a[k].ss += Q[k]; a[k].z += Z[k]; a[k].nan += N[k];                      \
            if (L[k] < a[k].mn) a[k].mn = L[k];                                                     \
            if (H[k] > a[k].mx) a[k].mx = H[k];                                                     \
        }                                                                                           \
    }

CLONES static void adam_mv(const float *m, const float *v, int64_t lo, int64_t hi, float shift,
                           const float *eps, acc_t *a) {
    float e0 = eps[0], e1 = eps[1], e2 = eps[2], e3 = eps[3];
    (void)shift; (void)e2; (void)e3;
    ADAM_BODY(1, 0)
}

CLONES static void adam_ur(const float *m, const float *v, int64_t lo, int64_t hi, float shift,
                           const float *eps, acc_t *a) {
    float e0 = eps[0], e1 = eps[1], e2 = eps[2], e3 = eps[3];
    (void)e0; (void)e1;
    ADAM_BODY(0, 1)
}

CLONES static void adam_all(const float *m, const float *v, int64_t lo, int64_t hi, float shift,
                            const float *eps, acc_t *a) {
    float e0 = eps[0], e1 = eps[1], e2 = eps[2], e3 = eps[3];
    ADAM_BODY(1, 1)
}

/* want: as in ADAM_BODY (1: m and v, 2: update and ratio, 3: both). */
typedef void (*adam_fn)(const float *, const float *, int64_t, int64_t, float, const float *, acc_t *, int);

static void adam_generic(const float *m, const float *v, int64_t lo, int64_t hi, float shift, const float *eps,
                         acc_t *a, int want) {
    if (want == 1) adam_mv(m, v, lo, hi, shift, eps, a);
    else if (want == 2) adam_ur(m, v, lo, hi, shift, eps, a);
    else adam_all(m, v, lo, hi, shift, eps, a);
}

static adam_fn adam_stats = adam_generic; /* the AVX2 loop where the CPU has it (module init) */

#ifdef HAVE_AVX2_KERNEL
/* One statistic's vector accumulators in the AVX2 Adam loop (NaNs are counted only where a sum is not
 * finite, as in stats_f32_avx2). */
typedef struct {
    __m256 s, q, mn, mx;
    __m256i z;
} vacc_t;

#define AVX2_INLINE __attribute__((target("avx2,fma"), always_inline)) static inline

AVX2_INLINE void vacc_init(vacc_t *c) {
    c->s = c->q = _mm256_setzero_ps();
    c->mn = _mm256_set1_ps(INFINITY);
    c->mx = _mm256_set1_ps(-INFINITY);
    c->z = _mm256_setzero_si256();
}

AVX2_INLINE void vacc_add(vacc_t *c, __m256 x, __m256 absmask, __m256 veps) {
    c->s = _mm256_add_ps(c->s, x);
    c->q = _mm256_fmadd_ps(x, x, c->q);
    c->mn = _mm256_min_ps(x, c->mn); /* the running value second: a NaN leaves it as it was */
    c->mx = _mm256_max_ps(x, c->mx);
    c->z = _mm256_sub_epi32(c->z, _mm256_castps_si256(_mm256_cmp_ps(_mm256_and_ps(x, absmask), veps, _CMP_LT_OQ)));
}

/* The block's totals of c into a; 0 where its sums are not finite (the caller then redoes the block). */
AVX2_INLINE int vacc_finish(const vacc_t *c, acc_t *a) {
    double s = hsum_ps(c->s), ss = hsum_ps(c->q);
    if (!isfinite(s) || !isfinite(ss)) return 0;
    float m[8], mn = INFINITY, mx = -INFINITY;
    _mm256_storeu_ps(m, c->mn);
    for (int k = 0; k < 8; k++) mn = m[k] < mn ? m[k] : mn;
    _mm256_storeu_ps(m, c->mx);
    for (int k = 0; k < 8; k++) mx = m[k] > mx ? m[k] : mx;
    a->s += s;
    a->ss += ss;
    a->z += hsum_epi32(c->z);
    if (mn < a->mn) a->mn = mn;
    if (mx > a->mx) a->mx = mx;
    return 1;
}

/* Both states' memory PREFETCH_AHEAD elements ahead of i, not past the chunk (see stats_f32_avx2). */
AVX2_INLINE void prefetch_pair(const float *m, const float *v, int64_t i, int64_t hi) {
    if (i + PREFETCH_AHEAD < hi) {
        _mm_prefetch((const char *)(m + i + PREFETCH_AHEAD), _MM_HINT_T0);
        _mm_prefetch((const char *)(v + i + PREFETCH_AHEAD), _MM_HINT_T0);
    }
}

/* Elements per pass: a block is read in runs of ADAM_RUN elements (2 KiB of each state, in L1), each run
 * once for m and v and once more for update and ratio, so that each pass keeps its 10 accumulators in
 * registers (all 20 at once would not fit in AVX2's 16). */
#define ADAM_RUN 512

/* adam_generic with AVX2 and FMA: the same quantities, from the same IEEE operations (sqrt, max with
 * FLT_MIN, add, divide: the quotients are bitwise those of the generic loop and the torch path), in the
 * same blocks. A block whose sums are not finite, and each block's last elements (fewer than 16), go
 * through the generic loop. */
__attribute__((target("avx2,fma"))) static void adam_avx2(const float *m, const float *v, int64_t lo, int64_t hi,
                                                           float shift, const float *eps, acc_t *a, int want) {
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256 e0 = _mm256_set1_ps(eps[0]), e1 = _mm256_set1_ps(eps[1]);
    const __m256 e2 = _mm256_set1_ps(eps[2]), e3 = _mm256_set1_ps(eps[3]);
    const __m256 vshift = _mm256_set1_ps(shift), tiny = _mm256_set1_ps(FLT_MIN);
    for (int64_t b = lo; b < hi; b += BLOCK) {
        int64_t e = b + BLOCK < hi ? b + BLOCK : hi, ve = b + (e - b) / 16 * 16;
        vacc_t cm, cv, cu, cr;
        vacc_init(&cm);
        vacc_init(&cv);
        vacc_init(&cu);
        vacc_init(&cr);
        for (int64_t r = b; r < ve; r += ADAM_RUN) {
            int64_t re = r + ADAM_RUN < ve ? r + ADAM_RUN : ve;
            if (want & 1)
                for (int64_t i = r; i < re; i += 16) {
                    prefetch_pair(m, v, i, hi);
                    for (int k = 0; k < 16; k += 8) {
                        vacc_add(&cm, _mm256_loadu_ps(m + i + k), absmask, e0);
                        vacc_add(&cv, _mm256_loadu_ps(v + i + k), absmask, e1);
                    }
                }
            if (want & 2)
                for (int64_t i = r; i < re; i += 16) {
                    if (!(want & 1)) /* the first pass over this run asks for memory */
                        prefetch_pair(m, v, i, hi);
                    for (int k = 0; k < 16; k += 8) {
                        __m256 mm = _mm256_loadu_ps(m + i + k);
                        /* max(FLT_MIN, d) gives d where d is NaN (the second operand), as the generic
                         * loop's d < FLT_MIN ? FLT_MIN : d does */
                        __m256 d = _mm256_max_ps(tiny, _mm256_sqrt_ps(_mm256_loadu_ps(v + i + k)));
                        vacc_add(&cu, _mm256_div_ps(mm, _mm256_add_ps(d, vshift)), absmask, e2);
                        vacc_add(&cr, _mm256_div_ps(mm, d), absmask, e3);
                    }
                }
        }
        acc_t t[4];
        for (int k = 0; k < 4; k++) acc_init(&t[k]);
        int ok = 1;
        if (want & 1) ok = vacc_finish(&cm, &t[0]) && vacc_finish(&cv, &t[1]);
        if (ok && (want & 2)) ok = vacc_finish(&cu, &t[2]) && vacc_finish(&cr, &t[3]);
        if (!ok) { /* an inf or NaN in the block: all of it through the generic loop, which counts NaNs */
            for (int k = 0; k < 4; k++) acc_init(&t[k]);
            ve = b;
        }
        if (ve < e) { /* the block's last few elements, or all of it */
            acc_t u[4];
            for (int k = 0; k < 4; k++) acc_init(&u[k]);
            adam_generic(m, v, ve, e, shift, eps, u, want);
            for (int k = 0; k < 4; k++) acc_merge(&t[k], &u[k]);
        }
        for (int k = 0; k < 4; k++) acc_merge(&a[k], &t[k]);
    }
}
#endif

/* ------------------------------------------------------------------ work split between threads */

/* Each tensor is cut into chunks of CHUNK elements; a chunk's statistics are accumulated in element
 * order and the chunks of a tensor are merged in chunk order, whichever thread computed them, so the
 * result does not depend on the number of threads (a norm recomputed later is bitwise the same). */
#define CHUNK (64 * BLOCK)

enum { KIND_F32 = 0, KIND_BF16 = 1, KIND_ADAM = 2 };

typedef struct {
    int kind, want;
    int64_t *next;             /* the next chunk to claim (shared, atomic) */
    Py_ssize_t n;              /* tensors */
    const uint64_t *a, *b;     /* data addresses (b: exp_avg_sq for Adam) */
    const int64_t *numel;
    const double *eps;         /* per tensor (Adam: 4 per tensor) */
    const double *shift;       /* Adam: per tensor */
    const int64_t *first;      /* first chunk of each tensor; first[n] = total chunks */
    const int64_t *owner;      /* tensor of each chunk */
    acc_t *parts;              /* per chunk (Adam: 4 per chunk) */
    uint64_t *samples;         /* float32 with fingerprints: per chunk, its sample_sum (else NULL) */
} job_t;

/* A fingerprint's sample of a float32 tensor: the runs of SAMPLE_RUN elements (one 64-byte cache line
 * of 16) that start at every SAMPLE_STRIDE-th element (one run per KiB); sample_sum() adds their bit
 * patterns as integers. Any write that changes the values of SAMPLE_STRIDE consecutive elements or more
 * (a row of an embedding of width 256 or more, a slice, anything dense) changes an element of the
 * sample, and so the sum, but for changes that cancel exactly in 64-bit integers. Checking it reads one
 * line in 16, far less than measuring the tensor again. */
#define SAMPLE_STRIDE 256
#define SAMPLE_RUN 16
#define SAMPLE_MASK ((UINT64_C(1) << 52) - 1) /* the sum, kept in a double: exact */

/* The sum over the sample's runs that start in [lo, hi), each cut at hi (lo: a multiple of
 * SAMPLE_STRIDE). */
static uint64_t sample_sum(const float *x, int64_t lo, int64_t hi) {
    const uint32_t *u = (const uint32_t *)x;
    uint64_t s = 0;
    for (int64_t r = lo; r < hi; r += SAMPLE_STRIDE) {
        if (r + 8 * SAMPLE_STRIDE < hi) __builtin_prefetch(u + r + 8 * SAMPLE_STRIDE);
        int64_t e = r + SAMPLE_RUN < hi ? r + SAMPLE_RUN : hi;
        for (int64_t i = r; i < e; i++) s += u[i];
    }
    return s;
}

static void run_chunk(const job_t *j, int64_t c) {
    int per = j->kind == KIND_ADAM ? 4 : 1;
    int64_t t = j->owner[c];
    int64_t lo = (c - j->first[t]) * CHUNK, hi = lo + CHUNK < j->numel[t] ? lo + CHUNK : j->numel[t];
    acc_t *acc = j->parts + c * per;
    for (int k = 0; k < per; k++) acc_init(&acc[k]);
    if (j->kind == KIND_F32) {
        stats_f32((const float *)(uintptr_t)j->a[t], lo, hi, (float)j->eps[t], acc);
        /* the chunk was just read: its sample lines are in this core's caches (CHUNK is a multiple of
         * SAMPLE_STRIDE, so every run starts in the chunk that holds it) */
        if (j->samples != NULL) j->samples[c] = sample_sum((const float *)(uintptr_t)j->a[t], lo, hi);
    } else if (j->kind == KIND_BF16) {
        stats_bf16((const uint16_t *)(uintptr_t)j->a[t], lo, hi, (float)j->eps[t], acc);
    } else {
        float e[4];
        for (int k = 0; k < 4; k++) e[k] = (float)j->eps[4 * t + k];
        const float *m = (const float *)(uintptr_t)j->a[t], *v = (const float *)(uintptr_t)j->b[t];
        float shift = (float)j->shift[t];
        adam_stats(m, v, lo, hi, shift, e, acc, j->want);
    }
}

static void *thread_main(void *arg) {
    const job_t *j = (const job_t *)arg;
    int64_t total = j->first[j->n];
    for (int64_t c; (c = __atomic_fetch_add(j->next, 1, __ATOMIC_RELAXED)) < total;) run_chunk(j, c);
    return NULL;
}

/* The helpers' threads. Where the process has GNU OpenMP loaded globally (PyTorch's CPU builds load
 * their libgomp with RTLD_GLOBAL), the job runs as a parallel region of that runtime, on the same
 * worker threads torch's own CPU ops use: right after a torch op those workers are spinning, waiting
 * for the next region, and take the job at once. Threads of our own would share the cores with those
 * spinning workers instead: in training, Adam's statistics ran 1.7x as long that way as on an idle
 * machine. Elsewhere (no libgomp in the process, or set_threads("pthreads")), POSIX threads. Either
 * way the chunks are claimed from one counter and merged in a fixed order: the same results. */
typedef void (*gomp_parallel_fn)(void (*)(void *), void *, unsigned, unsigned);
static gomp_parallel_fn gomp_parallel = NULL;
static int use_gomp = 1;
static pid_t gomp_pid = 0; /* a forked child (GNU OpenMP's pool is not fork-safe) uses POSIX threads */

static void gomp_body(void *arg) { thread_main(arg); }

static void find_gomp(void) {
    if (gomp_parallel == NULL) gomp_parallel = (gomp_parallel_fn)dlsym(RTLD_DEFAULT, "GOMP_parallel");
}

static int gomp_usable(void) { return use_gomp && gomp_parallel != NULL && getpid() == gomp_pid; }

/* Tensors smaller than this get no fingerprint: finding its two elements reads up to two blocks, as
 * much as measuring a small tensor again. */
#define FINGERPRINT_MIN_NUMEL (16 * BLOCK)
#define FP_COLS 5 /* a fingerprint's doubles: where the min and max are, their values, the sample's sum */

/* The first element from `at` (a stretch of at most BLOCK elements, within numel) equal to v; -1: none.
 * Compared in float (v is a float's value) in runs of 64 without an early exit, which vectorise; only
 * the run that holds a match is looked at element by element. */
static int64_t find_at(int kind, uint64_t addr, int64_t numel, int64_t at, double v) {
    if (at < 0) return -1;
    int64_t end = at + BLOCK < numel ? at + BLOCK : numel;
    float fv = (float)v;
    for (int64_t r = at; r < end; r += 64) {
        int64_t e = r + 64 < end ? r + 64 : end;
        int hit = 0;
        if (kind == KIND_F32) {
            const float *x = (const float *)(uintptr_t)addr;
            for (int64_t i = r; i < e; i++) hit |= x[i] == fv;
            if (hit)
                for (int64_t i = r; i < e; i++)
                    if (x[i] == fv) return i;
        } else {
            const uint16_t *x = (const uint16_t *)(uintptr_t)addr;
            for (int64_t i = r; i < e; i++) hit |= bf16_to_f32(x[i]) == fv;
            if (hit)
                for (int64_t i = r; i < e; i++)
                    if (bf16_to_f32(x[i]) == fv) return i;
        }
    }
    return -1;
}

/* Runs the job on nthreads threads (the caller's one included); res: [n * per][NF]. ext (float32
 * statistics only, or NULL): per tensor its fingerprint as [n][FP_COLS] doubles: the element index of
 * its min and of its max, their values, and its sample_sum (masked to 52 bits); -1, -1, NaN, NaN, NaN
 * where the tensor has a NaN, is empty or smaller than FINGERPRINT_MIN_NUMEL, or an extreme is
 * infinite. */
static int run_parallel(job_t *base, int nthreads, double *res, double *ext) {
    int per = base->kind == KIND_ADAM ? 4 : 1;
    Py_ssize_t n = base->n;
    int64_t *first = (int64_t *)PyMem_RawMalloc(sizeof(int64_t) * (size_t)(n + 1));
    if (first == NULL) return -1;
    int64_t total = 0;
    for (Py_ssize_t t = 0; t < n; t++) {
        first[t] = total;
        total += base->numel[t] > 0 ? (base->numel[t] + CHUNK - 1) / CHUNK : 0;
    }
    first[n] = total;
    int64_t *owner = (int64_t *)PyMem_RawMalloc(sizeof(int64_t) * (size_t)(total > 0 ? total : 1));
    acc_t *parts = (acc_t *)PyMem_RawMalloc(sizeof(acc_t) * (size_t)(total > 0 ? total : 1) * (size_t)per);
    int sampled = ext != NULL && base->kind == KIND_F32;
    uint64_t *samples = sampled ? (uint64_t *)PyMem_RawMalloc(sizeof(uint64_t) * (size_t)(total > 0 ? total : 1))
                                : NULL;
    if (owner == NULL || parts == NULL || (sampled && samples == NULL)) {
        PyMem_RawFree(first); PyMem_RawFree(owner); PyMem_RawFree(parts); PyMem_RawFree(samples);
        return -1;
    }
    for (Py_ssize_t t = 0; t < n; t++)
        for (int64_t c = first[t]; c < first[t + 1]; c++) owner[c] = t;
    if (nthreads > total) nthreads = total > 0 ? (int)total : 1;
    int64_t next = 0;
    job_t job = *base;
    job.next = &next;
    job.first = first;
    job.owner = owner;
    job.parts = parts;
    job.samples = samples;
    if (nthreads > 1 && gomp_usable()) {
        gomp_parallel(gomp_body, &job, (unsigned)nthreads, 0);
    } else {
        pthread_t th[MAX_THREADS];
        int started[MAX_THREADS] = {0};
        for (int t = 1; t < nthreads; t++) /* a thread that does not start leaves its chunks to the others */
            started[t] = pthread_create(&th[t], NULL, thread_main, &job) == 0;
        thread_main(&job);
        for (int t = 1; t < nthreads; t++)
            if (started[t]) pthread_join(th[t], NULL);
    }
    for (Py_ssize_t t = 0; t < n; t++) {
        for (int k = 0; k < per; k++) {
            acc_t a;
            acc_init(&a);
            for (int64_t c = first[t]; c < first[t + 1]; c++) acc_merge(&a, &parts[c * per + k]);
            double *o = res + (t * per + k) * NF;
            o[0] = a.mn; o[1] = a.mx; o[2] = a.s; o[3] = a.ss; o[4] = a.z; o[5] = a.nan;
            if (ext != NULL && per == 1) {
                double *w = ext + t * FP_COLS;
                int64_t i = -1, j = -1;
                if (sampled && base->numel[t] >= FINGERPRINT_MIN_NUMEL && a.nan == 0 && isfinite(a.mn) &&
                    isfinite(a.mx)) {
                    i = find_at(base->kind, base->a[t], base->numel[t], a.at_mn, a.mn);
                    j = find_at(base->kind, base->a[t], base->numel[t], a.at_mx, a.mx);
                }
                if (i < 0 || j < 0) {
                    w[0] = w[1] = -1.0;
                    w[2] = w[3] = w[4] = NAN;
                } else {
                    uint64_t sum = 0;
                    for (int64_t c = first[t]; c < first[t + 1]; c++) sum += samples[c];
                    w[0] = (double)i; w[1] = (double)j; w[2] = a.mn; w[3] = a.mx; w[4] = (double)(sum & SAMPLE_MASK);
                }
            }
        }
    }
    PyMem_RawFree(first); PyMem_RawFree(owner); PyMem_RawFree(parts); PyMem_RawFree(samples);
    return 0;
}

/* ------------------------------------------------------------------ rows of the requested ops */

enum { OP_MIN = 0, OP_MAX = 1, OP_MEAN = 2, OP_NORM = 3, OP_ZEROS = 4, OP_NANS = 5 };

/* One float32 row of the requested ops from a raw row (min, max, sum, sumsq, zeros, nans). min/max are
 * NaN where the tensor has a NaN (as torch's aminmax); min, max, norm and mean are multiplied by scale. */
static void finish_row(const double *r, int64_t numel, double scale, const unsigned char *ops, Py_ssize_t nops,
                       float *out) {
    int nan = r[5] > 0;
    double n = (double)numel;
    for (Py_ssize_t k = 0; k < nops; k++) {
        double v;
        switch (ops[k]) {
        case OP_MIN: v = nan ? NAN : r[0] * scale; break;
        case OP_MAX: v = nan ? NAN : r[1] * scale; break;
        case OP_MEAN: v = r[2] / n * scale; break;
        case OP_NORM: v = sqrt(r[3]) * scale; break;
        case OP_ZEROS: v = r[4] / n; break;
        default: v = r[5]; break;
        }
        out[k] = (float)v;
    }
}

/* ------------------------------------------------------------------ Python interface */

static int get_buf(PyObject *obj, Py_buffer *view, Py_ssize_t itemsize, Py_ssize_t count, const char *what,
                   int writable) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) < 0) return -1;
    if (view->len != itemsize * count) {
        PyErr_Format(PyExc_ValueError, "%s: expected %zd bytes, got %zd", what, itemsize * count, view->len);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* A NULL data address with elements to read (a wrapper tensor subclass without storage of its own,
 * e.g. a DTensor) would crash the process: refuse it. */
static int check_addrs(const Py_buffer *addrs, const Py_buffer *numels, const char *what) {
    const uint64_t *a = (const uint64_t *)addrs->buf;
    const int64_t *n = (const int64_t *)numels->buf;
    for (Py_ssize_t t = 0; t < addrs->len / 8; t++)
        if ((a[t] == 0 && n[t] > 0) || n[t] < 0) {
            PyErr_Format(PyExc_ValueError, "%s: tensor %zd has no data (address 0) or a negative size", what, t);
            return -1;
        }
    return 0;
}

static int check_ops(const Py_buffer *ops) {
    for (Py_ssize_t k = 0; k < ops->len; k++)
        if (((const unsigned char *)ops->buf)[k] > OP_NANS) {
            PyErr_Format(PyExc_ValueError, "unknown op code %d", ((const unsigned char *)ops->buf)[k]);
            return -1;
        }
    return 0;
}

/* The argument buffers both entry points take: k arrays (the first one n uint64 data addresses, then
 * numels and the others, per[q] * n items of 8 bytes each), the op codes, and the writable float32
 * output of rows x len(ops). On failure the buffers taken so far are released and -1 is returned. */
typedef struct {
    Py_buffer bufs[10];
    int got;
    Py_ssize_t n, nops;
} args_t;

static void release_args(args_t *a) {
    for (int q = 0; q < a->got; q++) PyBuffer_Release(&a->bufs[q]);
    a->got = 0;
}

static int take_args(args_t *a, PyObject **o, int k, const char **names, const Py_ssize_t *per, int n_addr_arrays,
                     PyObject *ops, PyObject *out, Py_ssize_t rows_per_tensor) {
    a->got = 0;
    if (PyObject_GetBuffer(o[0], &a->bufs[0], PyBUF_C_CONTIGUOUS) < 0) return -1;
    a->got = 1;
    a->n = a->bufs[0].len / 8;
    if (a->bufs[0].len % 8) {
        PyErr_Format(PyExc_ValueError, "%s: not uint64", names[0]);
        goto fail;
    }
    for (int q = 1; q < k; q++) {
        if (get_buf(o[q], &a->bufs[q], 8, a->n * per[q], names[q], 0) < 0) goto fail;
        a->got = q + 1;
    }
    /* the numels follow the address arrays */
    for (int q = 0; q < n_addr_arrays; q++)
        if (check_addrs(&a->bufs[q], &a->bufs[n_addr_arrays], names[q]) < 0) goto fail;
    if (PyObject_GetBuffer(ops, &a->bufs[k], PyBUF_C_CONTIGUOUS) < 0) goto fail;
    a->got = k + 1;
    a->nops = a->bufs[k].len;
    if (check_ops(&a->bufs[k]) < 0) goto fail;
    if (get_buf(out, &a->bufs[k + 1], 4, a->n * rows_per_tensor * a->nops, "out", 1) < 0) goto fail;
    a->got = k + 2;
    return 0;
fail:
    release_args(a);
    return -1;
}

/* Runs the job and writes the rows of the requested ops: ``per`` rows per tensor, the rows k >= first_scaled
 * of a tensor multiplied by its scale (Adam: update and ratio, not m and v). */
static int run_and_finish(job_t *job, int threads, const double *scale, int per, int first_scaled,
                          const unsigned char *ops, Py_ssize_t nops, float *out, double *ext) {
    Py_ssize_t n = job->n;
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    double *res = (double *)PyMem_RawMalloc(sizeof(double) * NF * (size_t)per * (size_t)(n > 0 ? n : 1));
    int rc = res == NULL ? -1 : 0;
    Py_BEGIN_ALLOW_THREADS
    if (rc == 0) rc = run_parallel(job, threads, res, ext);
    if (rc == 0)
        for (Py_ssize_t t = 0; t < n; t++)
            for (int k = 0; k < per; k++)
                finish_row(res + (t * per + k) * NF, job->numel[t], k < first_scaled ? 1.0 : scale[t], ops, nops,
                           out + (t * per + k) * nops);
    Py_END_ALLOW_THREADS
    PyMem_RawFree(res);
    return rc;
}

PyDoc_STRVAR(stats_doc,
"stats(kind, addrs, numels, eps, scales, ops, out, threads)\n\n"
"kind 0 = float32, 1 = bfloat16. addrs: n uint64 data addresses of contiguous CPU tensors; numels: n int64;\n"
"eps: n float64 zero thresholds; scales: n float64 factors of min, max, norm, mean; ops: op codes (bytes,\n"
"0 min, 1 max, 2 mean, 3 norm, 4 zeros, 5 nans); out: writable n x len(ops) float32.\n"
"The caller keeps the tensors alive and unchanged during the call.");

static PyObject *py_stats(PyObject *self, PyObject *args) {
    int kind, threads;
    PyObject *o[4], *ops, *out;
    (void)self;
    if (!PyArg_ParseTuple(args, "iOOOOOOi", &kind, &o[0], &o[1], &o[2], &o[3], &ops, &out, &threads)) return NULL;
    if (kind != KIND_F32 && kind != KIND_BF16) return PyErr_Format(PyExc_ValueError, "unknown kind %d", kind);
    static const char *names[] = {"addrs", "numels", "eps", "scales"};
    static const Py_ssize_t per[] = {1, 1, 1, 1};
    args_t a;
    if (take_args(&a, o, 4, names, per, 1, ops, out, 1) < 0) return NULL;
    job_t job = {.kind = kind, .n = a.n, .a = (const uint64_t *)a.bufs[0].buf,
                 .numel = (const int64_t *)a.bufs[1].buf, .eps = (const double *)a.bufs[2].buf};
    int rc = run_and_finish(&job, threads, (const double *)a.bufs[3].buf, 1, 0, (const unsigned char *)a.bufs[4].buf,
                            a.nops, (float *)a.bufs[5].buf, NULL);
    release_args(&a);
    if (rc < 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

PyDoc_STRVAR(adam_doc,
"adam(want, m_addrs, v_addrs, numels, eps, shifts, scales, ops, out, threads)\n\n"
"float32 exp_avg / exp_avg_sq pairs. want: 1 = rows of m and v, 2 = of update and ratio, 3 = all four.\n"
"eps: n x 4 float64 zero thresholds (m, v, update, ratio); shifts: n float64; scales: n float64 factors of\n"
"update and ratio; ops as stats(); out: writable n x 4 x len(ops) float32 (m, v, update, ratio).\n"
"update = scale * m / (max(sqrt(v), FLT_MIN) + shift), ratio = scale * m / max(sqrt(v), FLT_MIN).");

static PyObject *py_adam(PyObject *self, PyObject *args) {
    int want, threads;
    PyObject *o[6], *ops, *out;
    (void)self;
    if (!PyArg_ParseTuple(args, "iOOOOOOOOi", &want, &o[0], &o[1], &o[2], &o[3], &o[4], &o[5], &ops, &out,
                          &threads))
        return NULL;
    if (want < 1 || want > 3) return PyErr_Format(PyExc_ValueError, "want must be 1, 2 or 3, not %d", want);
    static const char *names[] = {"m_addrs", "v_addrs", "numels", "eps", "shifts", "scales"};
    static const Py_ssize_t per[] = {1, 1, 1, 4, 1, 1};
    args_t a;
    if (take_args(&a, o, 6, names, per, 2, ops, out, 4) < 0) return NULL;
    job_t job = {.kind = KIND_ADAM, .want = want, .n = a.n, .a = (const uint64_t *)a.bufs[0].buf,
                 .b = (const uint64_t *)a.bufs[1].buf, .numel = (const int64_t *)a.bufs[2].buf,
                 .eps = (const double *)a.bufs[3].buf, .shift = (const double *)a.bufs[4].buf};
    int rc = run_and_finish(&job, threads, (const double *)a.bufs[5].buf, 4, 2, (const unsigned char *)a.bufs[6].buf,
                            a.nops, (float *)a.bufs[7].buf, NULL);
    release_args(&a);
    if (rc < 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* The hooks' entry: the tensors themselves, so a hook pays no Python loop over them. Each must be of
 * one of `types` (exact types: torch.Tensor, nn.Parameter), of `dtype` (float32), on the CPU, no
 * negative view (is_neg(): its memory holds the values negated, which torch's ops resolve and a raw read
 * does not) and contiguous or dense (see dense()), or None or empty (a NaN row); otherwise nothing is
 * computed, False is returned, and the caller takes its general path (copies, conversions, refusals
 * with their errors). */
static PyObject *s_dtype, *s_is_cpu, *s_is_neg, *s_is_contiguous, *s_numel, *s_data_ptr, *s_shape, *s_stride;

/* ``xs`` as a tuple of its own, which holds every tensor (so its memory) while the GIL is released;
 * NULL with a TypeError where it is no sequence. */
static PyObject *tensor_tuple(PyObject *xs) {
    PyObject *seq = PySequence_Check(xs) ? PySequence_Tuple(xs) : NULL;
    if (seq == NULL && (!PyErr_Occurred() || PyErr_ExceptionMatches(PyExc_TypeError))) {
        PyErr_Clear();
        PyErr_SetString(PyExc_TypeError, "xs: expected a sequence of tensors");
    }
    return seq;
}

/* Whether x's elements fill one block of memory without gaps or overlaps, in some order of its dims
 * (a transpose or permute of a contiguous tensor: batch_first attention outputs, a tied weight's .t()):
 * then the statistics of that block are the tensor's, as all six ops ignore the order of elements,
 * and no contiguous copy is needed. 1: dense, 0: not, -1: a Python error. */
static int dense(PyObject *x) {
    PyObject *shape = PyObject_GetAttr(x, s_shape), *stride = NULL;
    int rc = -1;
    if (shape == NULL || (stride = PyObject_CallMethodNoArgs(x, s_stride)) == NULL) goto done;
    if (!PyTuple_Check(shape) || !PyTuple_Check(stride) || PyTuple_GET_SIZE(shape) != PyTuple_GET_SIZE(stride) ||
        PyTuple_GET_SIZE(shape) > 64) {
        rc = 0;
        goto done;
    }
    int64_t sz[64], st[64];
    Py_ssize_t nd = 0;
    for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(shape); k++) {
        int64_t a = PyLong_AsLongLong(PyTuple_GET_ITEM(shape, k)), b = PyLong_AsLongLong(PyTuple_GET_ITEM(stride, k));
        if ((a == -1 || b == -1) && PyErr_Occurred()) goto done;
        if (a == 1) continue; /* any stride */
        Py_ssize_t j = nd++;  /* insertion by stride */
        for (; j > 0 && st[j - 1] > b; j--) {
            sz[j] = sz[j - 1];
            st[j] = st[j - 1];
        }
        sz[j] = a;
        st[j] = b;
    }
    int64_t expect = 1;
    rc = 1;
    for (Py_ssize_t k = 0; k < nd; k++) {
        if (st[k] != expect) rc = 0;
        expect *= sz[k];
    }
done:
    Py_XDECREF(shape);
    Py_XDECREF(stride);
    return rc;
}

static int tensor_entry(PyObject *x, PyObject *types, PyObject *dtype, uint64_t *addr, int64_t *numel) {
    /* 1: take it (numel 0: a NaN row), 0: not for this path, -1: a Python error */
    int known = 0;
    for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(types); k++)
        if ((PyObject *)Py_TYPE(x) == PyTuple_GET_ITEM(types, k)) known = 1;
    if (!known) return 0;
    PyObject *v = PyObject_GetAttr(x, s_dtype);
    if (v == NULL) return -1;
    int ok = v == dtype;
    Py_DECREF(v);
    if (!ok) return 0;
    if ((v = PyObject_GetAttr(x, s_is_cpu)) == NULL) return -1;
    ok = v == Py_True;
    Py_DECREF(v);
    if (!ok) return 0;
    if ((v = PyObject_CallMethodNoArgs(x, s_numel)) == NULL) return -1;
    *numel = PyLong_AsLongLong(v);
    Py_DECREF(v);
    if (*numel == -1 && PyErr_Occurred()) return -1;
    if (*numel == 0) return 1;
    /* a negative view (x.conj().imag, torch._neg_view, a gradient some backward gave as one): the values
     * are minus what memory holds; float32 has no conjugate views (conj() of a real tensor is itself) */
    if ((v = PyObject_CallMethodNoArgs(x, s_is_neg)) == NULL) return -1;
    ok = v == Py_False;
    Py_DECREF(v);
    if (!ok) return 0;
    if ((v = PyObject_CallMethodNoArgs(x, s_is_contiguous)) == NULL) {
        PyErr_Clear(); /* sparse layouts have no contiguity: the general path measures their values */
        return 0;
    }
    ok = v == Py_True;
    Py_DECREF(v);
    if (!ok && (ok = dense(x)) <= 0) return ok;
    if ((v = PyObject_CallMethodNoArgs(x, s_data_ptr)) == NULL) return -1;
    *addr = PyLong_AsUnsignedLongLong(v);
    Py_DECREF(v);
    if (*addr == (uint64_t)-1 && PyErr_Occurred()) return -1;
    return *addr != 0 && *numel > 0;
}

static PyObject *py_stats_tensors(PyObject *self, PyObject *args) {
    PyObject *xs, *ops, *types, *dtype, *out, *extremes = Py_None;
    double eps;
    long long parallel_numel;
    int threads;
    (void)self;
    if (!PyArg_ParseTuple(args, "OdOO!OOLi|O", &xs, &eps, &ops, &PyTuple_Type, &types, &dtype, &out, &parallel_numel,
                          &threads, &extremes))
        return NULL;
    PyObject *seq = tensor_tuple(xs);
    if (seq == NULL) return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(seq);
    PyObject **items = &PyTuple_GET_ITEM(seq, 0);
    Py_buffer opb, outb, extb;
    int got = 0, rc = -1;
    uint64_t *addr = NULL;
    int64_t *numel = NULL;
    double *epsv = NULL, *ext = NULL;
    Py_ssize_t *slot = NULL;
    float *rows = NULL;
    if (PyObject_GetBuffer(ops, &opb, PyBUF_C_CONTIGUOUS) < 0) goto done;
    got = 1;
    if (check_ops(&opb) < 0) goto done;
    Py_ssize_t nops = opb.len;
    if (get_buf(out, &outb, 4, n * nops, "out", 1) < 0) goto done;
    got = 2;
    if (extremes != Py_None) {
        if (get_buf(extremes, &extb, 8, n * FP_COLS, "extremes", 1) < 0) goto done;
        got = 3;
    }
    size_t cap = (size_t)(n > 0 ? n : 1);
    addr = (uint64_t *)PyMem_Malloc(8 * cap);
    numel = (int64_t *)PyMem_Malloc(8 * cap);
    epsv = (double *)PyMem_Malloc(8 * cap);
    slot = (Py_ssize_t *)PyMem_Malloc(sizeof(Py_ssize_t) * cap);
    if (addr == NULL || numel == NULL || epsv == NULL || slot == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t m = 0;
    int64_t total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (items[i] == Py_None) continue;
        int r = tensor_entry(items[i], types, dtype, &addr[m], &numel[m]);
        if (r < 0) goto done;
        if (r == 0) {
            rc = 0; /* not for this path */
            goto done;
        }
        if (numel[m] == 0) continue;
        epsv[m] = eps;
        slot[m] = i;
        total += numel[m];
        m++;
    }
    float *o = (float *)outb.buf;
    double *e = got > 2 ? (double *)extb.buf : NULL;
    if (m < n && (rows = (float *)PyMem_Malloc(sizeof(float) * (size_t)(m > 0 ? m : 1) * (size_t)nops)) == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (m < n && e != NULL && (ext = (double *)PyMem_Malloc(sizeof(double) * FP_COLS * (size_t)(m > 0 ? m : 1))) == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    job_t job = {.kind = KIND_F32, .n = m, .a = addr, .numel = numel, .eps = epsv};
    if (run_and_finish(&job, total >= parallel_numel ? threads : 1, NULL, 1, 1, (const unsigned char *)opb.buf, nops,
                       rows != NULL ? rows : o, ext != NULL ? ext : e) < 0) {
        PyErr_NoMemory();
        goto done;
    }
    if (rows != NULL) { /* NaN rows for None and empty tensors, the others' rows in their places */
        for (Py_ssize_t i = 0; i < n * nops; i++) o[i] = NAN;
        for (Py_ssize_t t = 0; t < m; t++) memcpy(o + slot[t] * nops, rows + t * nops, sizeof(float) * (size_t)nops);
    }
    if (ext != NULL) { /* likewise: no extremes for None and empty tensors */
        for (Py_ssize_t i = 0; i < n; i++) {
            e[FP_COLS * i] = e[FP_COLS * i + 1] = -1.0;
            e[FP_COLS * i + 2] = e[FP_COLS * i + 3] = e[FP_COLS * i + 4] = NAN;
        }
        for (Py_ssize_t t = 0; t < m; t++)
            memcpy(e + slot[t] * FP_COLS, ext + t * FP_COLS, sizeof(double) * FP_COLS);
    }
    rc = 1;
done:
    if (got > 2) PyBuffer_Release(&extb);
    if (got > 1) PyBuffer_Release(&outb);
    if (got > 0) PyBuffer_Release(&opb);
    PyMem_Free(ext);
    PyMem_Free(addr);
    PyMem_Free(numel);
    PyMem_Free(epsv);
    PyMem_Free(slot);
    PyMem_Free(rows);
    Py_DECREF(seq);
    if (rc < 0) return NULL;
    return PyBool_FromLong(rc);
}

/* unchanged(xs, types, dtype, extremes) -> bytes: per tensor 1 where it still holds, at the element
 * indices extremes gave it (stats_tensors), the min and max values it had then, and its sample (see
 * sample_sum) adds up as it did; 0 where not, or where it had no fingerprint, or is no longer for that
 * path. Two element reads and one line in 16 per tensor, without the GIL. */
static PyObject *py_unchanged(PyObject *self, PyObject *args) {
    PyObject *xs, *types, *dtype, *extremes;
    (void)self;
    if (!PyArg_ParseTuple(args, "OO!OO", &xs, &PyTuple_Type, &types, &dtype, &extremes)) return NULL;
    PyObject *seq = tensor_tuple(xs);
    if (seq == NULL) return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(seq);
    PyObject **items = &PyTuple_GET_ITEM(seq, 0);
    Py_buffer eb;
    if (get_buf(extremes, &eb, 8, n * FP_COLS, "extremes", 0) < 0) {
        Py_DECREF(seq);
        return NULL;
    }
    PyObject *res = PyBytes_FromStringAndSize(NULL, n);
    uint64_t *addr = (uint64_t *)PyMem_Malloc(8 * (size_t)(n > 0 ? n : 1));
    int64_t *numel = (int64_t *)PyMem_Malloc(8 * (size_t)(n > 0 ? n : 1));
    if (res != NULL && (addr == NULL || numel == NULL)) {
        Py_CLEAR(res);
        PyErr_NoMemory();
    }
    if (res != NULL) {
        for (Py_ssize_t t = 0; t < n; t++) {
            addr[t] = 0;
            numel[t] = 0;
            int ok = items[t] == Py_None ? 0 : tensor_entry(items[t], types, dtype, &addr[t], &numel[t]);
            if (ok < 0) {
                Py_CLEAR(res);
                break;
            }
            if (!ok) addr[t] = 0;
        }
    }
    if (res != NULL) {
        char *r = PyBytes_AS_STRING(res);
        const double *e = (const double *)eb.buf;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t t = 0; t < n; t++) {
            const double *w = e + FP_COLS * t;
            int64_t i = (int64_t)w[0], j = (int64_t)w[1];
            r[t] = 0;
            if (addr[t] != 0 && i >= 0 && j >= 0 && i < numel[t] && j < numel[t] && numel[t] >= FINGERPRINT_MIN_NUMEL) {
                const float *x = (const float *)(uintptr_t)addr[t];
                r[t] = (double)x[i] == w[2] && (double)x[j] == w[3] &&
                       (double)(sample_sum(x, 0, numel[t]) & SAMPLE_MASK) == w[4];
            }
        }
        Py_END_ALLOW_THREADS
    }
    PyMem_Free(addr);
    PyMem_Free(numel);
    PyBuffer_Release(&eb);
    Py_DECREF(seq);
    return res;
}

static PyObject *py_set_kernel(PyObject *self, PyObject *args) {
    const char *name;
    if (!PyArg_ParseTuple(args, "s", &name)) return NULL;
    PyObject *prev = PyUnicode_FromString(kernel_name);
    if (prev == NULL) return NULL;
    if (strcmp(name, "generic") == 0) {
        stats_f32 = stats_f32_generic;
        adam_stats = adam_generic;
        kernel_name = "generic";
#ifdef HAVE_AVX2_KERNEL
    } else if (strcmp(name, "avx2") == 0 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
        stats_f32 = stats_f32_avx2;
        adam_stats = adam_avx2;
        kernel_name = "avx2";
#endif
    } else {
        Py_DECREF(prev);
        PyErr_Format(PyExc_ValueError, "kernel %R: expected 'generic', or 'avx2' on a CPU with AVX2 and FMA", PyTuple_GET_ITEM(args, 0));
        return NULL;
    }
    return prev;
}

static PyObject *py_kernel(PyObject *self, PyObject *unused) { return PyUnicode_FromString(kernel_name); }

static const char *threads_name(void) { return gomp_usable() ? "openmp" : "pthreads"; }

static PyObject *py_threads(PyObject *self, PyObject *unused) { return PyUnicode_FromString(threads_name()); }

static PyObject *py_set_threads(PyObject *self, PyObject *args) {
    const char *name;
    if (!PyArg_ParseTuple(args, "s", &name)) return NULL;
    PyObject *prev = PyUnicode_FromString(threads_name());
    if (prev == NULL) return NULL;
    if (strcmp(name, "pthreads") == 0) {
        use_gomp = 0;
    } else if (strcmp(name, "openmp") == 0) {
        find_gomp();
        if (gomp_parallel == NULL) {
            Py_DECREF(prev);
            PyErr_SetString(PyExc_ValueError, "threads 'openmp': no GNU OpenMP runtime is loaded in this process");
            return NULL;
        }
        use_gomp = 1;
    } else {
        Py_DECREF(prev);
        PyErr_Format(PyExc_ValueError, "threads %R: expected 'openmp' or 'pthreads'", PyTuple_GET_ITEM(args, 0));
        return NULL;
    }
    return prev;
}

PyDoc_STRVAR(threads_doc, "threads() -> str\n\nWhere the helpers of a parallel call run: 'openmp' (the process's GNU\n"
             "OpenMP workers, torch's) or 'pthreads' (threads of the call's own).");

PyDoc_STRVAR(set_threads_doc,
             "set_threads(name) -> str\n\n"
             "Run the helpers of parallel calls on 'openmp' (the default where GNU OpenMP is loaded) or\n"
             "'pthreads'; returns the previous choice. For tests and benchmarks: not thread-safe.");

PyDoc_STRVAR(kernel_doc, "kernel() -> str\n\nThe float32 statistics loop in use: 'avx2' or 'generic'.");

PyDoc_STRVAR(set_kernel_doc,
             "set_kernel(name) -> str\n\n"
             "Use the float32 loops (plain statistics and Adam state) 'generic' (auto-vectorised C) or 'avx2'\n"
             "(the default where the CPU has AVX2 and FMA); returns the previous one. For tests and benchmarks:\n"
             "not thread-safe.");

PyDoc_STRVAR(stats_tensors_doc,
             "stats_tensors(xs, eps, ops, types, dtype, out, parallel_numel, threads[, extremes]) -> bool\n\n"
             "stats() of the tensors xs themselves (None and empty: NaN rows), each of one of the exact types,\n"
             "of dtype, on the CPU and contiguous or a permutation of a contiguous block; False (out untouched)\n"
             "where one is not. extremes: None, or a writable n x 4 float64 buffer given per tensor the element\n"
             "index of its min and of its max (in memory order from its data address) and their values; -1, -1,\n"
             "NaN, NaN where it has none (None, empty, under 65536 elements, a NaN, an infinite extreme).");

PyDoc_STRVAR(unchanged_doc,
             "unchanged(xs, types, dtype, extremes) -> bytes\n\n"
             "Per tensor 1 where it still holds, at the indices stats_tensors() gave in extremes, the min and max\n"
             "values it had; else 0.");

static PyMethodDef methods[] = {
    {"stats", py_stats, METH_VARARGS, stats_doc},
    {"adam", py_adam, METH_VARARGS, adam_doc},
    {"stats_tensors", py_stats_tensors, METH_VARARGS, stats_tensors_doc},
    {"unchanged", py_unchanged, METH_VARARGS, unchanged_doc},
    {"set_kernel", py_set_kernel, METH_VARARGS, set_kernel_doc},
    {"kernel", py_kernel, METH_NOARGS, kernel_doc},
    {"threads", py_threads, METH_NOARGS, threads_doc},
    {"set_threads", py_set_threads, METH_VARARGS, set_threads_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fused",
                                    "One-pass tensor statistics for the recorder (see _fused.c).", -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__fused(void) {
#ifdef HAVE_AVX2_KERNEL
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
        stats_f32 = stats_f32_avx2;
        adam_stats = adam_avx2;
        kernel_name = "avx2";
    }
#endif
    /* PyTorch, imported before this module, has put its libgomp in the global namespace */
    find_gomp();
    gomp_pid = getpid();
    if ((s_dtype = PyUnicode_InternFromString("dtype")) == NULL ||
        (s_is_cpu = PyUnicode_InternFromString("is_cpu")) == NULL ||
        (s_is_neg = PyUnicode_InternFromString("is_neg")) == NULL ||
        (s_is_contiguous = PyUnicode_InternFromString("is_contiguous")) == NULL ||
        (s_numel = PyUnicode_InternFromString("numel")) == NULL ||
        (s_data_ptr = PyUnicode_InternFromString("data_ptr")) == NULL ||
        (s_shape = PyUnicode_InternFromString("shape")) == NULL ||
        (s_stride = PyUnicode_InternFromString("stride")) == NULL)
        return NULL;
    PyObject *mod = PyModule_Create(&module);
    /* the layout of a fingerprint row (the Python side checks it: an extension built from older sources
     * has another) */
    if (mod != NULL && PyModule_AddIntConstant(mod, "FINGERPRINT_COLUMNS", FP_COLS) < 0) Py_CLEAR(mod);
    return mod;
}
