/* qgemm.c's 4- and 8-bit matmuls for bf16 activations on CPUs with AVX-512 and
   its bf16 dot product (avx512_bf16): y[m, n] = sum_k x[m, k] w[n, k], x bf16,
   y fp32, w in groups of 32 along k (4-bit w = q * scale + low, 8-bit w = q *
   scale). A group's levels are small integers, exact in bf16, so one vdpbf16ps
   gives sum x q exactly rounded in fp32; the group's scale multiplies that, and
   the 4-bit minimum multiplies the group's sum of x.
   The weight is blocked so that each thread reads one stream: for every 4
   outputs and every group, the levels (4-bit: 32 bytes holding outputs 0 and 1
   in their low and high nibbles, 32 holding 2 and 3; 8-bit: 32 bytes each),
   then 4 fp32 scales, then (4-bit) 4 fp32 minimums. A 4-bit level q becomes
   the bf16 of 128 + q by or-ing its exponent in (no shuffle): the minimums are
   stored less 128 scales to match. y is fp32, or bf16 rounded to nearest even. */

#include <stdlib.h>

#include "kernels.h"

enum { Q4_BLOCK = 2 * 32 + 32, Q8_BLOCK = 4 * 32 + 16 };
#ifndef PREFETCH
#define PREFETCH 2048  /* bytes ahead of the block in use: the weight streams from memory */
#endif

/* 32 4-bit levels (one byte each, 0-15) as the bf16 of 128 + level. */
static inline __m512i levels4(__m256i nibbles) {
    return _mm512_or_si512(_mm512_cvtepu8_epi16(nibbles), _mm512_set1_epi16(0x4300));
}

/* An 8-bit group's 32 levels (-127..127) as bf16. */
static inline __m512i levels8(const uint8_t *q) {
    __m256i bytes = _mm256_loadu_si256((const __m256i *)q);
    __m512 low = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(bytes)));
    __m512 high = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(bytes, 1)));
    return (__m512i)_mm512_cvtne2ps_pbh(high, low);
}

/* Outputs n..n+3 by R rows from m; `w` is their block; y bf16 if `bf16_out`. */
static inline __attribute__((always_inline)) void tile(
        const uint16_t *x, const float *sums, int K, const uint8_t *w, void *y, int bf16_out,
        int N, int n, int m, const int R, const int BITS) {
    const int G = K / 32, block = BITS == 4 ? Q4_BLOCK : Q8_BLOCK;
    __m512 acc[4][4];  /* [output][row]; fixed sizes keep them in registers */
    __m128 lows[4];  /* [row]: 4-bit minimums times the sums of x, per output */
    #pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
        lows[r] = _mm_setzero_ps();
        #pragma GCC unroll 4
        for (int b = 0; b < 4; b++) acc[b][r] = _mm512_setzero_ps();
    }
    for (int g = 0; g < G; g++, w += block) {
        _mm_prefetch((const char *)w + PREFETCH, _MM_HINT_T0);
        _mm_prefetch((const char *)w + PREFETCH + 64, _MM_HINT_T0);
        if (BITS == 8) _mm_prefetch((const char *)w + PREFETCH + 128, _MM_HINT_T0);
        __m512i xg[4];
        #pragma GCC unroll 4
        for (int r = 0; r < R; r++)
            xg[r] = _mm512_loadu_si512(x + (int64_t)(m + r) * K + g * 32);
        const float *scale = (const float *)(w + (BITS == 4 ? 64 : 128));
        __m256i pairs[2], mask = _mm256_set1_epi8(0x0F);
        if (BITS == 4)
            for (int i = 0; i < 2; i++) pairs[i] = _mm256_loadu_si256((const __m256i *)w + i);
        #pragma GCC unroll 4
        for (int b = 0; b < 4; b++) {
            __m512i levels = BITS == 8 ? levels8(w + b * 32) : levels4(_mm256_and_si256(
                b & 1 ? _mm256_srli_epi16(pairs[b / 2], 4) : pairs[b / 2], mask));
            __m512 s = _mm512_set1_ps(scale[b]);
            #pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                __m512 dot = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)xg[r],
                                              (__m512bh)levels);
                acc[b][r] = _mm512_fmadd_ps(dot, s, acc[b][r]);
            }
        }
        if (BITS == 4) {
            __m128 low = _mm_loadu_ps(scale + 4);
            #pragma GCC unroll 4
            for (int r = 0; r < R; r++)
                lows[r] = _mm_fmadd_ps(low, _mm_set1_ps(sums[(int64_t)(m + r) * G + g]),
                                       lows[r]);
        }
    }
    #pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
        float low[4];
        _mm_storeu_ps(low, lows[r]);
        #pragma GCC unroll 4
        for (int b = 0; b < 4; b++) {
            float total = _mm512_reduce_add_ps(acc[b][r]) + low[b];
            int64_t at = (int64_t)(m + r) * N + n + b;
            if (bf16_out)
                ((uint16_t *)y)[at] = float_to_bf16(total);
            else
                ((float *)y)[at] = total;
        }
    }
}

#define T(R, BITS) tile(x, sums, K, w + (int64_t)(n / 4) * G * block, y, bf16_out, N, n, m, \
                        R, BITS)
#define GEMM(NAME, BITS)                                                                \
void NAME(const uint16_t *x, int M, int K, const uint8_t *w, void *y, int bf16_out,     \
          int N) {                                                                      \
    const int G = K / 32, block = BITS == 4 ? Q4_BLOCK : Q8_BLOCK;                      \
    float *sums = malloc(sizeof(float) * (size_t)M * G);  /* x per row and group */     \
    for (int64_t i = 0; i < (int64_t)M * G; i++) {                                      \
        float s = 0.0f;                                                                 \
        for (int j = 0; j < 32; j++) s += bf16_to_float(x[i * 32 + j]);                 \
        sums[i] = s;                                                                    \
    }                                                                                   \
    _Pragma("omp parallel for schedule(static)")                                        \
    for (int n = 0; n < N; n += 4) {                                                    \
        int m = 0;                                                                      \
        for (; m + 4 <= M; m += 4) T(4, BITS);                                          \
        switch (M - m) {                                                                \
        case 3: T(3, BITS); break;                                                      \
        case 2: T(2, BITS); break;                                                      \
        case 1: T(1, BITS); break;                                                      \
        }                                                                               \
    }                                                                                   \
    free(sums);                                                                         \
}

/* N a multiple of 4, K of 32. Threads: torch's OpenMP pool. */
GEMM(q4_gemm_bf16, 4)
GEMM(q8_gemm_bf16, 8)
