/* Multi-head self-attention for short sequences on x86 CPUs in float32 (AVX2 + FMA), forward and
 * backward, straight from the fused qkv projection's output. Built and loaded by
 * vitlab/models/cpu_attention.py; its docstring says when it runs and why.
 *
 * Layouts (all contiguous, float32):
 *   qkv   (B, T, 3, H, d)  the qkv Linear's output, (B, T, 3D) viewed per part and head
 *   out   (B, T, H, d)     softmax(scale q k^T) v, already in the (B, T, D) layout proj reads
 *   probs (B, H, T, Tp)    the softmax, kept for the backward (NULL: not kept); Tp is T rounded
 *                          up to a multiple of 8, the padding columns zero
 *   dout  (B, T, H, d)     the gradient of out
 *   dqkv  (B, T, 3, H, d)  the gradient of qkv: every element written once
 * Work is split by (batch, head) pair: a call computes pairs [start, end), so callers can run
 * disjoint ranges on several threads. Every pair is computed by the same code whatever the split,
 * so results do not depend on the thread count. Returns 0, or -1 if scratch memory was refused. */

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

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

/* One register tile of the product below: MR rows, NV vectors of 8 columns. */
ALWAYS_INLINE void tile(const int MR, const int NV, int64_t m, const float *a, int64_t sai,
                        int64_t saj, const float *b, int64_t ldb, float *c, int64_t ldc,
                        __m256 alpha) {
    __m256 acc[6][4];
    for (int r = 0; r < MR; r++)
        for (int v = 0; v < NV; v++) acc[r][v] = _mm256_setzero_ps();
    for (int64_t j = 0; j < m; j++) {
        __m256 bv[4];
        for (int v = 0; v < NV; v++) bv[v] = _mm256_loadu_ps(b + j * ldb + 8 * v);
        for (int r = 0; r < MR; r++) {
            __m256 av = _mm256_broadcast_ss(a + r * sai + j * saj);
            for (int v = 0; v < NV; v++) acc[r][v] = _mm256_fmadd_ps(av, bv[v], acc[r][v]);
        }
    }
    for (int r = 0; r < MR; r++)
        for (int v = 0; v < NV; v++)
            _mm256_storeu_ps(c + r * ldc + 8 * v, _mm256_mul_ps(acc[r][v], alpha));
}

/* Rows [0, n) of one column block of NV vectors: tiles of MR rows, then single rows. */
ALWAYS_INLINE void rows(const int MR, const int NV, int64_t n, int64_t m, const float *a,
                        int64_t sai, int64_t saj, const float *b, int64_t ldb, float *c,
                        int64_t ldc, __m256 alpha) {
    int64_t i = 0;
    for (; i + MR <= n; i += MR)
        tile(MR, NV, m, a + i * sai, sai, saj, b, ldb, c + i * ldc, ldc, alpha);
    for (; i < n; i++) tile(1, NV, m, a + i * sai, sai, saj, b, ldb, c + i * ldc, ldc, alpha);
}

/* c[i, 0:w] = alpha * sum_{j < m} a[i * sai + j * saj] * b[j * ldb + 0:w] for i < n; w a multiple
 * of 8. The strides let a be read as a matrix or as its transpose. */
static void product(int64_t n, int64_t m, int64_t w, const float *a, int64_t sai, int64_t saj,
                    const float *b, int64_t ldb, float *c, int64_t ldc, float scale) {
    const __m256 alpha = _mm256_set1_ps(scale);
    int64_t col = 0;
    for (; col + 32 <= w; col += 32) rows(2, 4, n, m, a, sai, saj, b + col, ldb, c + col, ldc, alpha);
    switch ((w - col) / 8) {
        case 3: rows(3, 3, n, m, a, sai, saj, b + col, ldb, c + col, ldc, alpha); break;
        case 2: rows(4, 2, n, m, a, sai, saj, b + col, ldb, c + col, ldc, alpha); break;
        case 1: rows(6, 1, n, m, a, sai, saj, b + col, ldb, c + col, ldc, alpha); break;
        default: break;
    }
}

/* dst (d, tp) = the transpose of t rows of d floats (row stride ld), columns t..tp zero. */
static void transpose(const float *src, int64_t ld, int64_t t, int64_t d, int64_t tp, float *dst) {
    for (int64_t c = 0; c < d; c++) {
        for (int64_t i = 0; i < t; i++) dst[c * tp + i] = src[i * ld + c];
        for (int64_t i = t; i < tp; i++) dst[c * tp + i] = 0.0f;
    }
}

/* dst (t, d) = t rows of d floats (row stride ld): the rows a product broadcasts from, copied
 * first with independent loads (read in place, each row is a dependent wait on memory: the
 * forward ran twice as long). */
static void gather(const float *src, int64_t ld, int64_t t, int64_t d, float *dst) {
    for (int64_t i = 0; i < t; i++)
        for (int64_t c = 0; c < d; c++) dst[i * d + c] = src[i * ld + c];
}

/* Row i of s (length tp, the last tp - t padding) becomes softmax over its first t entries. */
static void softmax_row(float *s, int64_t t, int64_t tp) {
    for (int64_t j = t; j < tp; j++) s[j] = -INFINITY; /* exp8 makes them 0 */
    __m256 mx = _mm256_loadu_ps(s);
    for (int64_t j = 8; j < tp; j += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(s + j));
    const __m256 top = _mm256_set1_ps(hmax8(mx));
    __m256 sum = _mm256_setzero_ps();
    for (int64_t j = 0; j < tp; j += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), top));
        _mm256_storeu_ps(s + j, e);
        sum = _mm256_add_ps(sum, e);
    }
    const __m256 inv = _mm256_set1_ps(1.0f / hsum8(sum));
    for (int64_t j = 0; j < tp; j += 8) _mm256_storeu_ps(s + j, _mm256_mul_ps(_mm256_loadu_ps(s + j), inv));
}

int vitlab_attention_forward(const float *qkv, float *out, float *probs, int64_t B, int64_t T,
                             int64_t H, int64_t d, float scale, int64_t start, int64_t end) {
    (void)B;
    const int64_t tp = (T + 7) / 8 * 8, row = 3 * H * d, orow = H * d;
    float *kt = malloc(sizeof(float) * (d * tp + T * tp + T * d));
    if (!kt) return -1;
    float *ql = kt + d * tp + T * tp; /* (T, d) */
    for (int64_t bh = start; bh < end; bh++) {
        const int64_t b = bh / H, h = bh % H;
        const float *q = qkv + b * T * row + h * d, *k = q + H * d, *v = q + 2 * H * d;
        float *s = probs ? probs + bh * T * tp : kt + d * tp; /* (T, tp) */
        transpose(k, row, T, d, tp, kt);
        gather(q, row, T, d, ql);
        product(T, d, tp, ql, d, 1, kt, tp, s, tp, scale); /* scale q k^T */
        for (int64_t i = 0; i < T; i++) softmax_row(s + i * tp, T, tp);
        product(T, T, d, s, tp, 1, v, row, out + b * T * orow + h * d, orow, 1.0f); /* p v */
    }
    free(kt);
    return 0;
}

int vitlab_attention_backward(const float *qkv, const float *probs, const float *dout,
                              float *dqkv, int64_t B, int64_t T, int64_t H, int64_t d,
                              float scale, int64_t start, int64_t end) {
    (void)B;
    const int64_t tp = (T + 7) / 8 * 8, row = 3 * H * d, orow = H * d;
    float *vt = malloc(sizeof(float) * (d * tp + T * tp + T * d));
    if (!vt) return -1;
    float *ds = vt + d * tp;      /* (T, tp): dP, then dS */
    float *gl = ds + T * tp;      /* (T, d): this pair's rows of dout */
    for (int64_t bh = start; bh < end; bh++) {
        const int64_t b = bh / H, h = bh % H, off = b * T * row + h * d;
        const float *q = qkv + off, *k = q + H * d, *v = q + 2 * H * d;
        const float *p = probs + bh * T * tp, *g = dout + b * T * orow + h * d;
        float *dq = dqkv + off, *dk = dq + H * d, *dv = dq + 2 * H * d;
        transpose(v, row, T, d, tp, vt);
        gather(g, orow, T, d, gl);
        product(T, d, tp, gl, d, 1, vt, tp, ds, tp, 1.0f); /* dP = dout v^T */
        for (int64_t i = 0; i < T; i++) { /* dS = P * (dP - rowsum(P * dP)), zero padding */
            const float *pi = p + i * tp;
            float *si = ds + i * tp;
            __m256 acc = _mm256_setzero_ps();
            for (int64_t j = 0; j < tp; j += 8)
                acc = _mm256_fmadd_ps(_mm256_loadu_ps(pi + j), _mm256_loadu_ps(si + j), acc);
            const __m256 dot = _mm256_set1_ps(hsum8(acc));
            for (int64_t j = 0; j < tp; j += 8) {
                __m256 x = _mm256_sub_ps(_mm256_loadu_ps(si + j), dot);
                _mm256_storeu_ps(si + j, _mm256_mul_ps(_mm256_loadu_ps(pi + j), x));
            }
        }
        product(T, T, d, p, 1, tp, gl, d, dv, row, 1.0f);     /* dv = P^T dout */
        product(T, T, d, ds, tp, 1, k, row, dq, row, scale);  /* dq = scale dS k */
        product(T, T, d, ds, 1, tp, q, row, dk, row, scale);  /* dk = scale dS^T q */
    }
    free(vt);
    return 0;
}
