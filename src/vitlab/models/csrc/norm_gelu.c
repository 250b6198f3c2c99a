/* LayerNorm (for inference), GELU (the erf form; with its derivative for training) and the
 * residual join (h + x + bias) in float32 for x86 CPUs with AVX2 + FMA.
 * Built and loaded with attention.c by vitlab/models/cpu_kernels.py; its docstring says when
 * they run. Work is split by rows (LayerNorm) or by vectors of 8 (GELU, the join) over `threads`
 * threads (SPLIT in kernels.h); every element is computed by the same code whatever the split.
 * All return 0. */

#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "kernels.h"

/* R rows of width D (a multiple of 8): y = (x - mean) / sqrt(var + eps) * w + b, the mean and
 * then the variance of the centred values (two passes over a row in cache), a third to
 * normalise; the rows' chains interleave. */
ALWAYS_INLINE void norm_block(const int R, const float *x, const float *w, const float *b,
                              float *y, int64_t D, float eps) {
    __m256 acc[4], mean[4], scale[4];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t j = 0; j < D; j += 8)
        for (int r = 0; r < R; r++) acc[r] = _mm256_add_ps(acc[r], _mm256_loadu_ps(x + r * D + j));
    for (int r = 0; r < R; r++) {
        mean[r] = _mm256_set1_ps(hsum8(acc[r]) / (float)D);
        acc[r] = _mm256_setzero_ps();
    }
    for (int64_t j = 0; j < D; j += 8)
        for (int r = 0; r < R; r++) {
            __m256 c = _mm256_sub_ps(_mm256_loadu_ps(x + r * D + j), mean[r]);
            acc[r] = _mm256_fmadd_ps(c, c, acc[r]);
        }
    for (int r = 0; r < R; r++)
        scale[r] = _mm256_set1_ps(1.0f / sqrtf(hsum8(acc[r]) / (float)D + eps));
    for (int64_t j = 0; j < D; j += 8) {
        const __m256 wj = _mm256_loadu_ps(w + j), bj = _mm256_loadu_ps(b + j);
        for (int r = 0; r < R; r++) {
            __m256 c = _mm256_sub_ps(_mm256_loadu_ps(x + r * D + j), mean[r]);
            _mm256_storeu_ps(y + r * D + j, _mm256_fmadd_ps(_mm256_mul_ps(c, scale[r]), wj, bj));
        }
    }
}

/* Rows [start, end) of x (rows of D floats, D a multiple of 8) normalised into y, four at a
 * time. */
static int norm_rows(const float *x, const float *w, const float *b, float *y, int64_t D,
                     float eps, int64_t start, int64_t end) {
    int64_t i = start;
    for (; i + 4 <= end; i += 4) norm_block(4, x + i * D, w, b, y + i * D, D, eps);
    for (; i < end; i++) norm_block(1, x + i * D, w, b, y + i * D, D, eps);
    return 0;
}

/* erf(x / sqrt 2) of 8 floats by Abramowitz and Stegun 7.1.26 (absolute error below 1.5e-7;
 * +inf gives 1, -inf NaN as the formula does), and exp(-x^2 / 2), the exp it computes on the way
 * (GELU's derivative takes it too). */
ALWAYS_INLINE __m256 erf8(__m256 x, __m256 *gauss) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256 z = _mm256_mul_ps(x, _mm256_set1_ps(0.70710678118654752f));
    const __m256 a = _mm256_andnot_ps(sign, z); /* |z| */
    const __m256 t = _mm256_div_ps(_mm256_set1_ps(1.0f),
                                   _mm256_fmadd_ps(a, _mm256_set1_ps(0.3275911f), _mm256_set1_ps(1.0f)));
    __m256 p = _mm256_set1_ps(1.061405429f);
    p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(-1.453152027f));
    p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(1.421413741f));
    p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(-0.284496736f));
    p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(0.254829592f));
    p = _mm256_mul_ps(p, t);
    *gauss = exp8(_mm256_mul_ps(_mm256_sub_ps(sign, a), a)); /* exp(-z^2) */
    /* erf(|z|) = 1 - p exp(-z^2); erf keeps z's sign */
    const __m256 e = _mm256_fnmadd_ps(p, *gauss, _mm256_set1_ps(1.0f));
    return _mm256_or_ps(e, _mm256_and_ps(sign, z));
}

/* GELU of 8 floats: x / 2 (1 + erf(x / sqrt 2)); with `slope`, also its derivative there,
 * Phi(x) + x phi(x) = (1 + erf(x / sqrt 2)) / 2 + x exp(-x^2 / 2) / sqrt(2 pi). */
ALWAYS_INLINE __m256 gelu8(__m256 x, __m256 *slope) {
    __m256 gauss;
    const __m256 cdf = _mm256_mul_ps(_mm256_add_ps(erf8(x, &gauss), _mm256_set1_ps(1.0f)),
                                     _mm256_set1_ps(0.5f));
    if (slope)
        *slope = _mm256_fmadd_ps(_mm256_mul_ps(x, _mm256_set1_ps(0.39894228040143268f)), gauss, cdf);
    return _mm256_mul_ps(x, cdf);
}

/* Elements [8 start, min(8 end, n)) of x become their GELU, in place, and, where slope is not
 * NULL, slope their derivative (the last vector may be partial). With `bias` (width floats;
 * width a multiple of 8, n of width), x is taken as rows of width and each row's bias is added
 * first: GELU(x + bias), the pass that adds a linear layer's bias folded into its activation's. */
static int gelu_vectors(float *x, float *slope, const float *bias, int64_t width, int64_t n,
                        int64_t start, int64_t end) {
    int64_t col = bias ? 8 * start % width : 0; /* the bias's column at element 8 i */
    for (int64_t i = start; i < end; i++) {
        const int64_t at = 8 * i, left = n - at;
        __m256 d;
        if (left >= 8) {
            __m256 v = _mm256_loadu_ps(x + at);
            if (bias) {
                v = _mm256_add_ps(v, _mm256_loadu_ps(bias + col));
                col = col + 8 == width ? 0 : col + 8;
            }
            _mm256_storeu_ps(x + at, gelu8(v, slope ? &d : NULL));
            if (slope) _mm256_storeu_ps(slope + at, d);
        } else { /* no bias here: with one, n is whole vectors */
            const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)left),
                                                    _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
            _mm256_maskstore_ps(x + at, mask, gelu8(_mm256_maskload_ps(x + at, mask), slope ? &d : NULL));
            if (slope) _mm256_maskstore_ps(slope + at, mask, d);
        }
    }
    return 0;
}

/* Elements [8 start, 8 end) of h become h + x + bias (rows of width, a multiple of 8; bias
 * NULL: h + x): a branch's last linear layer's output, without its bias, joined to the residual
 * stream in one pass. */
static int join_vectors(float *h, const float *x, const float *bias, int64_t width,
                        int64_t start, int64_t end) {
    int64_t col = 8 * start % width; /* the bias's column at element 8 i */
    for (int64_t i = start; i < end; i++) {
        const int64_t at = 8 * i;
        __m256 v = _mm256_loadu_ps(h + at); /* (h + bias) + x: as PyTorch's linear, then + */
        if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + col));
        _mm256_storeu_ps(h + at, _mm256_add_ps(v, _mm256_loadu_ps(x + at)));
        col = col + 8 == width ? 0 : col + 8;
    }
    return 0;
}

/* y = LayerNorm(x) over `rows` rows of width D (a multiple of 8), on `threads` threads. */
int vitlab_layer_norm(const float *x, const float *w, const float *b, float *y, int64_t D,
                      float eps, int64_t rows, int64_t threads) {
    SPLIT(rows, threads, norm_rows(x, w, b, y, D, eps, start, end));
}

/* 1 where built with OpenMP, else 0 (cpu_kernels.py warns: one thread). */
int vitlab_openmp(void) { return openmp_built(); }

/* x = GELU(x + bias), in place, for the n floats of x (bias NULL: GELU(x); else rows of width,
 * a multiple of 8, each row adding the width floats of bias) and, where slope is not NULL,
 * slope = GELU'(x + bias) (what the backward multiplies the gradient by), on `threads` threads. */
int vitlab_gelu(float *x, float *slope, const float *bias, int64_t n, int64_t width,
                int64_t threads) {
    SPLIT((n + 7) / 8, threads, gelu_vectors(x, slope, bias, width, n, start, end));
}

/* h = h + x + bias, in place on h, for the n floats of h and x (rows of width, a multiple of 8,
 * as n; bias NULL: h + x), on `threads` threads. */
int vitlab_join(float *h, const float *x, const float *bias, int64_t n, int64_t width,
                int64_t threads) {
    SPLIT(n / 8, threads, join_vectors(h, x, bias, width, start, end));
}
