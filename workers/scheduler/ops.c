/* The elementwise parts of a decoder layer on the CPU, each one pass over its
   rows where torch takes three to six ops (fused.py). bf16 or fp32 throughout;
   each rounds where torch's ops would, so results match theirs. */

#include <math.h>

#include "kernels.h"

#define PARALLEL(rows) _Pragma("omp parallel for if ((rows) >= 8) schedule(static)")

#ifdef __AVX512F__
static inline __m512 bf16_lanes(const uint16_t *p) {  /* 16 bf16 as fp32 */
    return widen_bf16(_mm256_loadu_si256((const __m256i *)p));
}

/* add_rms_norm below on bf16 rows, 16 lanes at a time, rounding where it does
   (the sum of squares in another order): 64-row decode steps took 0.985x the
   time (10 rounds, the two builds alternating step by step in one engine; Intel
   Xeon with AMX), the compiler's loops over the row's fp32 copies being part
   scalar. */
static void add_rms_norm_bf16(uint16_t *h, const uint16_t *delta, const uint16_t *weight,
                              uint16_t *out, int rows, int n, float eps) {
    PARALLEL(rows)
    for (int r = 0; r < rows; r++) {
        float x[n];
        uint16_t *hr = h + (int64_t)r * n;
        __m512 squares[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
        for (int i = 0; i < n; i += 16) {
            __m512 v = bf16_lanes(hr + i);
            if (delta) {
                v = round_lanes(_mm512_add_ps(v, bf16_lanes(delta + (int64_t)r * n + i)));
                _mm256_storeu_si256((__m256i *)(hr + i), (__m256i)_mm512_cvtneps_pbh(v));
            }
            _mm512_storeu_ps(x + i, v);
            squares[(i / 16) & 1] = _mm512_fmadd_ps(v, v, squares[(i / 16) & 1]);
        }
        const float sum = _mm512_reduce_add_ps(_mm512_add_ps(squares[0], squares[1]));
        const __m512 inverse = _mm512_set1_ps(1.0f / sqrtf(sum / n + eps));
        for (int i = 0; i < n; i += 16) {
            __m512 v = _mm512_mul_ps(round_lanes(_mm512_mul_ps(_mm512_loadu_ps(x + i), inverse)),
                                     bf16_lanes(weight + i));
            _mm256_storeu_si256((__m256i *)(out + (int64_t)r * n + i),
                                (__m256i)_mm512_cvtneps_pbh(v));
        }
    }
}
#endif

/* h [rows, n] += delta (unless NULL), rounded; out = (h / rms(h)) rounded, times
   weight, rounded: the residual stream's update and the next norm in one pass. */
void add_rms_norm(void *h, const void *delta, const void *weight, void *out, int rows,
                  int n, float eps, int bf16) {
    const int width = bf16 ? 2 : 4;
#ifdef __AVX512F__
    if (bf16 && n % 16 == 0) {
        add_rms_norm_bf16(h, delta, weight, out, rows, n, eps);
        return;
    }
#endif
    PARALLEL(rows)
    for (int r = 0; r < rows; r++) {
        float x[n], w[n];
        char *hr = (char *)h + (int64_t)width * r * n;
        load_row(hr, bf16, x, n);
        if (delta) {
            load_row((const char *)delta + (int64_t)width * r * n, bf16, w, n);
            for (int i = 0; i < n; i++) x[i] = rounded(x[i] + w[i], bf16);
            store_row(x, bf16, hr, n);
        }
        float squares = 0.0f;
        #pragma omp simd reduction(+:squares)
        for (int i = 0; i < n; i++) squares += x[i] * x[i];
        const float inverse = 1.0f / sqrtf(squares / n + eps);
        load_row(weight, bf16, w, n);
        for (int i = 0; i < n; i++) x[i] = rounded(x[i] * inverse, bf16) * w[i];
        store_row(x, bf16, (char *)out + (int64_t)width * r * n, n);
    }
}

/* Rotary embedding in place on x [rows, heads, dim] (rows `stride` elements
   apart): each head's halves (a, b) -> (a cos - b sin, b cos + a sin), the
   angles of the row's position from cos and sin [positions, dim]. */
void rope(void *x, int64_t stride, int rows, int heads, int dim, const int64_t *positions,
          const void *cos, const void *sin, int bf16) {
    const int width = bf16 ? 2 : 4, half = dim / 2;
    PARALLEL(rows)
    for (int r = 0; r < rows; r++) {
        float c[dim], s[dim], v[dim];
        load_row((const char *)cos + (int64_t)width * positions[r] * dim, bf16, c, dim);
        load_row((const char *)sin + (int64_t)width * positions[r] * dim, bf16, s, dim);
        for (int h = 0; h < heads; h++) {
            char *head = (char *)x + (int64_t)width * (r * stride + (int64_t)h * dim);
            load_row(head, bf16, v, dim);
            float turned[dim];
            for (int i = 0; i < half; i++) {
                turned[i] = v[i] * c[i] - v[i + half] * s[i];
                turned[i + half] = v[i + half] * c[i + half] + v[i] * s[i + half];
            }
            store_row(turned, bf16, head, dim);
        }
    }
}

#ifdef __AVX512F__
/* silu_mul below on bf16 rows, 16 lanes from gate and up to out at a time (its
   loops over the rows' fp32 copies were part scalar); the same bits. */
static void silu_mul_bf16(const uint16_t *gate_up, uint16_t *out, int rows, int n) {
    PARALLEL(rows)
    for (int r = 0; r < rows; r++) {
        const uint16_t *gate = gate_up + (int64_t)r * 2 * n, *up = gate + n;
        for (int i = 0; i < n; i += 16) {
            __m512 v = _mm512_mul_ps(round_lanes(silu_lanes(bf16_lanes(gate + i))),
                                     bf16_lanes(up + i));
            _mm256_storeu_si256((__m256i *)(out + (int64_t)r * n + i),
                                (__m256i)_mm512_cvtneps_pbh(v));
        }
    }
}
#endif

/* out [rows, n] = silu(gate) * up, rounded after each, from gate_up [rows, 2n]. */
void silu_mul(const void *gate_up, void *out, int rows, int n, int bf16) {
    const int width = bf16 ? 2 : 4;
#ifdef __AVX512F__
    if (bf16 && n % 16 == 0) {
        silu_mul_bf16(gate_up, out, rows, n);
        return;
    }
#endif
    PARALLEL(rows)
    for (int r = 0; r < rows; r++) {
        float g[n], u[n];
        load_row((const char *)gate_up + (int64_t)width * r * 2 * n, bf16, g, n);
        load_row((const char *)gate_up + (int64_t)width * (r * 2 * n + n), bf16, u, n);
        int i = 0;
#ifdef __AVX512F__
        for (; i + 16 <= n; i += 16)  /* as below, 16 lanes */
            _mm512_storeu_ps(g + i, silu_lanes(_mm512_loadu_ps(g + i)));
#endif
        for (; i + 8 <= n; i += 8) {  /* g sigmoid(g), sigmoid from e^-|g| */
            __m256 x = _mm256_loadu_ps(g + i);
            __m256 minus_abs = _mm256_or_ps(x, _mm256_set1_ps(-0.0f));
            __m256 e = exp8(minus_abs);
            __m256 one = _mm256_set1_ps(1.0f), total = _mm256_add_ps(one, e);
            __m256 positive = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GE_OQ);
            __m256 sigmoid = _mm256_div_ps(_mm256_blendv_ps(e, one, positive), total);
            _mm256_storeu_ps(g + i, _mm256_mul_ps(x, sigmoid));
        }
        for (; i < n; i++) g[i] = g[i] / (1.0f + expf(-g[i]));
        for (i = 0; i < n; i++) g[i] = rounded(rounded(g[i], bf16) * u[i], bf16);
        store_row(g, bf16, (char *)out + (int64_t)width * r * n, n);
    }
}

/* out[r] = the index of row r's largest value in x [rows, n] fp32, the first of
   equal maxima (torch's argmax; NaNs are passed over: no model's logits hold one). */
void argmax_rows(const float *x, int rows, int n, int64_t *out) {
    #pragma omp parallel for if (rows >= 4) schedule(static)
    for (int r = 0; r < rows; r++) {
        const float *row = x + (int64_t)r * n;
        float best = -INFINITY;
        int at = 0, i = 0;
#ifdef __AVX512F__
        if (n >= 16) {  /* per lane the first of its maxima, then the lowest index of the best */
            __m512 top = _mm512_loadu_ps(row);
            __m512i where = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
            __m512i index = where;
            for (i = 16; i + 16 <= n; i += 16) {
                index = _mm512_add_epi32(index, _mm512_set1_epi32(16));
                __m512 v = _mm512_loadu_ps(row + i);
                __mmask16 higher = _mm512_cmp_ps_mask(v, top, _CMP_GT_OQ);
                top = _mm512_mask_blend_ps(higher, top, v);
                where = _mm512_mask_blend_epi32(higher, where, index);
            }
            best = _mm512_reduce_max_ps(top);
            __mmask16 ties = _mm512_cmp_ps_mask(top, _mm512_set1_ps(best), _CMP_EQ_OQ);
            at = _mm512_mask_reduce_min_epi32(ties, where);
            if (!ties) best = -INFINITY, at = 0;  /* a row of NaNs */
        }
#endif
        for (; i < n; i++)
            if (row[i] > best) best = row[i], at = i;
        out[r] = at;
    }
}
