/* paged_attention.c's two loops over a bf16 cache on AVX-512 with its bf16
   dot product (built so where the CPU has avx512_bf16; head dims 64 and 128):
   q . k as 32 exact bf16 products a vdpbf16ps, summed in fp32; the weighted sum
   of values in fp32, 16 dims a vector. Scores prefetch the values to L2. */

#ifndef PIPELINE_ATTENTION_AVX512_H
#define PIPELINE_ATTENTION_AVX512_H

#include <immintrin.h>
#include <stdint.h>

/* lane j: the sum of a[j]'s 16 lanes */
static inline __m512 sums16(const __m512 a[16]) {
    __m512 b[8], c[4];
    for (int i = 0; i < 8; i++)  /* pairs: 2 keys' partial sums per 128-bit quarter */
        b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                             _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++) {  /* 4 keys per quarter */
        __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
        c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    __m512 d0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88),
                              _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
    __m512 d1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x88),
                              _mm512_shuffle_f32x4(c[2], c[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(d0, d1, 0x88),
                         _mm512_shuffle_f32x4(d0, d1, 0xDD));
}

/* score[g * len + p] = scale * q[g] . keys[p], q fp32 [GC, DIM] holding bf16
   values (so rounding them back is exact), 16 keys at a time. */
static inline __attribute__((always_inline)) void scores_bf16(
        const float *q, const void *const *keys, const void *const *values, int len,
        float scale, float *score, const int GC, const int DIM) {
    __m512bh qh[3][DIM / 32];
    #pragma GCC unroll 3
    for (int g = 0; g < GC; g++)
        #pragma GCC unroll 4
        for (int c = 0; c < DIM / 32; c++)
            qh[g][c] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(q + g * DIM + 32 * c + 16),
                                           _mm512_loadu_ps(q + g * DIM + 32 * c));
    for (int p = 0; p < len; p += 16) {
        const int n = len - p < 16 ? len - p : 16;
        for (int j = p + 16; j < p + 32 && j < len; j++)  /* the next block, meanwhile */
            for (int line = 0; line < 2 * DIM; line += 64)
                _mm_prefetch((const char *)keys[j] + line, _MM_HINT_T0);
        for (int j = p; j < p + 16 && j < len; j++)  /* this block's values, for later */
            for (int line = 0; line < 2 * DIM; line += 64)
                _mm_prefetch((const char *)values[j] + line, _MM_HINT_T1);
        #pragma GCC unroll 3
        for (int g = 0; g < GC; g++) {
            __m512 acc[16];
            #pragma GCC unroll 16
            for (int j = 0; j < 16; j++) {
                acc[j] = _mm512_setzero_ps();
                if (j >= n) continue;
                const uint16_t *k = (const uint16_t *)keys[p + j];
                #pragma GCC unroll 4
                for (int c = 0; c < DIM / 32; c++)
                    acc[j] = _mm512_dpbf16_ps(acc[j], qh[g][c],
                                              (__m512bh)_mm512_loadu_si512(k + 32 * c));
            }
            __m512 s = _mm512_mul_ps(sums16(acc), _mm512_set1_ps(scale));
            _mm512_mask_storeu_ps(score + g * len + p, (__mmask16)((1u << n) - 1), s);
        }
    }
}

/* out[g] = sum_p weight[g * len + p] values[p], bf16 values, all DIM dims of a
   value at once (GC * DIM / 16 sums in flight). */
static inline __attribute__((always_inline)) void weighted_sum_bf16(
        const float *weight, const void *const *values, int len, float *out, const int GC,
        const int DIM) {
    __m512 acc[3][DIM / 16];
    #pragma GCC unroll 3
    for (int g = 0; g < GC; g++)
        #pragma GCC unroll 8
        for (int c = 0; c < DIM / 16; c++) acc[g][c] = _mm512_setzero_ps();
    for (int p = 0; p < len; p++) {
        const uint16_t *v = (const uint16_t *)values[p];
        if (p + 16 < len)
            for (int line = 0; line < 2 * DIM; line += 64)
                _mm_prefetch((const char *)values[p + 16] + line, _MM_HINT_T0);
        #pragma GCC unroll 8
        for (int c = 0; c < DIM / 16; c++) {
            __m256i raw = _mm256_loadu_si256((const __m256i *)(v + 16 * c));
            __m512 x = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
            #pragma GCC unroll 3
            for (int g = 0; g < GC; g++)
                acc[g][c] = _mm512_fmadd_ps(_mm512_set1_ps(weight[g * len + p]), x, acc[g][c]);
        }
    }
    #pragma GCC unroll 3
    for (int g = 0; g < GC; g++)
        #pragma GCC unroll 8
        for (int c = 0; c < DIM / 16; c++) _mm512_storeu_ps(out + g * DIM + 16 * c, acc[g][c]);
}

#endif
