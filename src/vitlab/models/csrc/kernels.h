/* What vitlab's CPU kernels share: vector helpers (AVX2 + FMA, float32) and the split of a
 * kernel's work over threads. */

#ifndef VITLAB_KERNELS_H
#define VITLAB_KERNELS_H

#include <immintrin.h>
#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* exp of 8 floats: x = n ln2 + r, exp(r) by a degree-6 polynomial (Cephes' expf), 2^n from the
 * exponent bits; about 1 ulp on the range softmax uses (x <= 0). Below about -87.7 it returns 0. */
ALWAYS_INLINE __m256 exp8(__m256 x) {
    x = _mm256_max_ps(_mm256_set1_ps(-88.3762626647949f), x); /* x second: a NaN stays NaN */
    x = _mm256_min_ps(_mm256_set1_ps(88.3762626647949f), x);
    __m256 n = _mm256_floor_ps(
        _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

ALWAYS_INLINE float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

ALWAYS_INLINE float hmax8(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* The body of an exported kernel: RANGE_CALL (an expression using `start` and `end`, returning 0
 * or -1) over the items [0, items), one even range per thread of a team of `threads`. With
 * OpenMP the team is PyTorch's own (its OpenMP runtime, libgomp.so.1, is the one this library
 * links to), so no second pool competes with PyTorch's spinning threads for the cores; without
 * OpenMP, one call on this thread. Each item is computed by the same code whatever the split. */
#ifdef _OPENMP
#define SPLIT(items, threads, RANGE_CALL)                                          \
    int rc = 0;                                                                \
    const int team_size = (int)(threads);                                      \
    _Pragma("omp parallel num_threads(team_size) reduction(| : rc)") {         \
        const int64_t team = omp_get_num_threads(), me = omp_get_thread_num(); \
        const int64_t start = (items) * me / team, end = (items) * (me + 1) / team; \
        rc |= (RANGE_CALL);                                                    \
    }                                                                          \
    return rc
#else
#define SPLIT(items, threads, RANGE_CALL)     \
    (void)(threads);                          \
    const int64_t start = 0, end = (items);   \
    return (RANGE_CALL)
#endif

/* 1 where this library was built with OpenMP (its kernels run on PyTorch's thread team). */
static inline int openmp_built(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

#endif

