/* Multi-head self-attention for short sequences on x86 CPUs in float32 (AVX2 + FMA), forward and
 * backward, straight from the fused qkv projection's output. Built and loaded by
 * vitlab/models/cpu_kernels.py; cpu_attention.py's docstring says when it runs and why.
 *
 * Layouts (all contiguous, float32):
 *   qkv   (B, T, 3, H, d)  the qkv Linear's output, (B, T, 3D) viewed per part and head
 *   out   (B, T, H, d)     softmax(scale q k^T) v, already in the (B, T, D) layout proj reads
 *   probs (B, H, T, Tp)    the softmax, kept for the backward (NULL: not kept); Tp is T rounded
 *                          up to a multiple of 8, the padding columns zero
 *   dout  (B, T, H, d)     the gradient of out
 *   dqkv  (B, T, 3, H, d)  the gradient of qkv: every element written once
 *   bias  (3, H, d)        added to every token's q, k and v as they are read (the qkv Linear's
 *                          bias, folded in here instead of a pass over its output), or NULL
 * Work is split by (batch, head) pair over `threads` threads (SPLIT in kernels.h). Every pair is
 * computed by the same code whatever the split, so results do not depend on the thread count.
 * Returns 0, or -1 if scratch memory was refused. */

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "kernels.h"

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

/* dst[c * ldd + r] = src[r * ld + c] + add[c] for r, c < 8: an 8 x 8 block transposed in
 * registers. */
ALWAYS_INLINE void transpose8(const float *src, int64_t ld, __m256 add, float *dst, int64_t ldd) {
    __m256 r[8], t[8], u[8];
    for (int i = 0; i < 8; i++) r[i] = _mm256_add_ps(_mm256_loadu_ps(src + i * ld), add);
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int i = 0; i < 4; i++) {
        _mm256_storeu_ps(dst + i * ldd, _mm256_permute2f128_ps(u[i], u[i + 4], 0x20));
        _mm256_storeu_ps(dst + (i + 4) * ldd, _mm256_permute2f128_ps(u[i], u[i + 4], 0x31));
    }
}

/* dst (d, tp) = the transpose of t rows of d floats (row stride ld; d a multiple of 8), each
 * row plus bias (d floats, or NULL: none), columns t..tp zero: 8 x 8 blocks in registers, the
 * last t % 8 rows one by one. */
static void transpose(const float *src, int64_t ld, int64_t t, int64_t d, int64_t tp,
                      const float *bias, float *dst) {
    const int64_t t8 = t / 8 * 8;
    for (int64_t c = 0; c < d; c += 8) {
        const __m256 add = bias ? _mm256_loadu_ps(bias + c) : _mm256_setzero_ps();
        for (int64_t i = 0; i < t8; i += 8)
            transpose8(src + i * ld + c, ld, add, dst + c * tp + i, tp);
    }
    for (int64_t c = 0; c < d; c++)
        for (int64_t i = t8; i < tp; i++)
            dst[c * tp + i] = i < t ? src[i * ld + c] + (bias ? bias[c] : 0.0f) : 0.0f;
}

/* dst (t, d) = t rows of d floats (row stride ld), each plus bias (d floats, or NULL: none): the
 * rows a product broadcasts from, copied first with independent loads (read in place, each row
 * is a dependent wait on memory: the forward ran twice as long). */
static void gather(const float *src, int64_t ld, int64_t t, int64_t d, const float *bias,
                   float *dst) {
    for (int64_t i = 0; i < t; i++)
        for (int64_t c = 0; c < d; c++) dst[i * d + c] = src[i * ld + c] + (bias ? bias[c] : 0.0f);
}

/* R rows of s (row stride tp, the last tp - t entries of each padding) become softmax over
 * their first t entries; the rows' dependency chains interleave. Each row is computed the same
 * way whatever R. */
ALWAYS_INLINE void softmax_block(const int R, float *s, int64_t t, int64_t tp) {
    __m256 mx[4], top[4], sum[4], inv[4];
    for (int r = 0; r < R; r++) {
        for (int64_t j = t; j < tp; j++) s[r * tp + j] = -INFINITY; /* exp8 makes them 0 */
        mx[r] = _mm256_loadu_ps(s + r * tp);
    }
    for (int64_t j = 8; j < tp; j += 8)
        for (int r = 0; r < R; r++) mx[r] = _mm256_max_ps(mx[r], _mm256_loadu_ps(s + r * tp + j));
    for (int r = 0; r < R; r++) {
        top[r] = _mm256_set1_ps(hmax8(mx[r]));
        sum[r] = _mm256_setzero_ps();
    }
    for (int64_t j = 0; j < tp; j += 8)
        for (int r = 0; r < R; r++) {
            __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + r * tp + j), top[r]));
            _mm256_storeu_ps(s + r * tp + j, e);
            sum[r] = _mm256_add_ps(sum[r], e);
        }
    for (int r = 0; r < R; r++) inv[r] = _mm256_set1_ps(1.0f / hsum8(sum[r]));
    for (int64_t j = 0; j < tp; j += 8)
        for (int r = 0; r < R; r++)
            _mm256_storeu_ps(s + r * tp + j, _mm256_mul_ps(_mm256_loadu_ps(s + r * tp + j), inv[r]));
}

/* The first t rows of s (t, tp) become their softmax, four rows at a time. */
static void softmax(float *s, int64_t t, int64_t tp) {
    int64_t i = 0;
    for (; i + 4 <= t; i += 4) softmax_block(4, s + i * tp, t, tp);
    for (; i < t; i++) softmax_block(1, s + i * tp, t, tp);
}

/* Ask for the cache lines of t rows of d floats (row stride ld) ahead of their use, into L2:
 * the forward measured 1.08-1.18x faster than with them asked into L1 (a pair's 3 T rows would
 * crowd it). */
static void prefetch(const float *src, int64_t ld, int64_t t, int64_t d) {
    for (int64_t i = 0; i < t; i++)
        for (int64_t c = 0; c < d; c += 16)
            _mm_prefetch((const char *)(src + i * ld + c), _MM_HINT_T1);
}

static int forward(const float *qkv, const float *bias, float *out, float *probs, int64_t T,
                   int64_t H, int64_t d, float scale, int64_t start, int64_t end) {
    const int64_t tp = (T + 7) / 8 * 8, row = 3 * H * d, orow = H * d;
    float *kt = malloc(sizeof(float) * (d * tp + T * tp + 2 * T * d));
    if (!kt) return -1;
    float *ql = kt + d * tp + T * tp, *vl = ql + T * d; /* (T, d) each */
    for (int64_t bh = start; bh < end; bh++) {
        const int64_t b = bh / H, h = bh % H;
        const float *q = qkv + b * T * row + h * d, *k = q + H * d, *v = q + 2 * H * d;
        float *s = probs ? probs + bh * T * tp : kt + d * tp; /* (T, tp) */
        if (bh + 1 < end) {
            const float *next = qkv + (bh + 1) / H * T * row + (bh + 1) % H * d;
            for (int part = 0; part < 3; part++) prefetch(next + part * H * d, row, T, d);
        }
        const float *bq = bias ? bias + h * d : NULL, *bk = bias ? bq + H * d : NULL;
        transpose(k, row, T, d, tp, bk, kt);
        gather(q, row, T, d, bq, ql);
        gather(v, row, T, d, bias ? bk + H * d : NULL, vl);
        product(T, d, tp, ql, d, 1, kt, tp, s, tp, scale); /* scale q k^T */
        softmax(s, T, tp);
        product(T, T, d, s, tp, 1, vl, d, out + b * T * orow + h * d, orow, 1.0f); /* p v */
    }
    free(kt);
    return 0;
}

static int backward(const float *qkv, const float *bias, const float *probs, const float *dout,
                    float *dqkv, int64_t T, int64_t H, int64_t d, float scale, int64_t start,
                    int64_t end) {
    const int64_t tp = (T + 7) / 8 * 8, row = 3 * H * d, orow = H * d;
    float *vt = malloc(sizeof(float) * (d * tp + T * tp + 3 * T * d));
    if (!vt) return -1;
    float *ds = vt + d * tp;      /* (T, tp): dP, then dS */
    float *gl = ds + T * tp;      /* (T, d): this pair's rows of dout */
    float *ql = gl + T * d, *kl = ql + T * d; /* (T, d) each: q and k plus their bias */
    for (int64_t bh = start; bh < end; bh++) {
        const int64_t b = bh / H, h = bh % H, off = b * T * row + h * d;
        const float *q = qkv + off, *k = q + H * d, *v = q + 2 * H * d;
        const float *p = probs + bh * T * tp, *g = dout + b * T * orow + h * d;
        float *dq = dqkv + off, *dk = dq + H * d, *dv = dq + 2 * H * d;
        if (bh + 1 < end) { /* the next pair's inputs, and the lines its output goes to */
            const int64_t next = (bh + 1) / H * T * row + (bh + 1) % H * d;
            for (int part = 0; part < 3; part++) {
                prefetch(qkv + next + part * H * d, row, T, d);
                prefetch(dqkv + next + part * H * d, row, T, d);
            }
            prefetch(dout + (bh + 1) / H * T * orow + (bh + 1) % H * d, orow, T, d);
        }
        const float *bq = bias ? bias + h * d : NULL, *bk = bias ? bq + H * d : NULL;
        const float *qr = q, *kr = k; /* the q and k the products read, and their row stride */
        int64_t ld = row;
        if (bias) {
            gather(q, row, T, d, bq, ql);
            gather(k, row, T, d, bk, kl);
            qr = ql, kr = kl, ld = d;
        }
        transpose(v, row, T, d, tp, bias ? bk + H * d : NULL, vt);
        gather(g, orow, T, d, NULL, gl);
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
        product(T, T, d, ds, tp, 1, kr, ld, dq, row, scale);  /* dq = scale dS k */
        product(T, T, d, ds, 1, tp, qr, ld, dk, row, scale);  /* dk = scale dS^T q */
    }
    free(vt);
    return 0;
}

int vitlab_attention_forward(const float *qkv, const float *bias, float *out, float *probs,
                             int64_t B, int64_t T, int64_t H, int64_t d, float scale,
                             int64_t threads) {
    SPLIT(B * H, threads, forward(qkv, bias, out, probs, T, H, d, scale, start, end));
}

int vitlab_attention_backward(const float *qkv, const float *bias, const float *probs,
                              const float *dout, float *dqkv, int64_t B, int64_t T, int64_t H,
                              int64_t d, float scale, int64_t threads) {
    SPLIT(B * H, threads, backward(qkv, bias, probs, dout, dqkv, T, H, d, scale, start, end));
}

