/* paged_attention.c's two loops over a bf16 cache on AVX-512 with its bf16
   dot product (built so where the CPU has avx512_bf16; head dims 64 and 128):
   q . k as 32 exact bf16 products a vdpbf16ps, summed in fp32; the weighted sum
   of values likewise, the softmax's numerators split into two bf16 parts and
   their sum divided out in fp32 at the end. Scores prefetch the values to L2. */

#ifndef PIPELINE_ATTENTION_AVX512_H
#define PIPELINE_ATTENTION_AVX512_H

#include <immintrin.h>
#include <stdint.h>

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
            _mm512_mask_storeu_ps(score + g * len + p, first_lanes(n), s);
        }
    }
}

/* e [GC, len] (softmax numerators, fp32) as bf16 pairs, each split in two: hi =
   bf16(e), lo = bf16(e - hi), so hi + lo holds e to ~2^-17. Head g's hi pairs
   at pairs[2 g * stride + j], its lo pairs a stride on: positions 2j and
   2j + 1, past len zero; stride = pair_stride(len) (paged_attention.c). */

static inline __m512 bf16_half(__m512bh both, int upper) {
    return widen_bf16(_mm512_extracti64x4_epi64((__m512i)both, upper));
}

static inline void bf16_pairs(const float *e, int len, uint32_t *pairs, int GC) {
    const int stride = pair_stride(len);
    for (int g = 0; g < GC; g++)
        for (int p = 0; p < len; p += 32) {
            __m512 first = _mm512_maskz_loadu_ps(first_lanes(len - p), e + g * len + p);
            __m512 second = _mm512_maskz_loadu_ps(first_lanes(len - p - 16),
                                                  e + g * len + p + 16);
            __m512bh hi = _mm512_cvtne2ps_pbh(second, first);
            __m512bh lo = _mm512_cvtne2ps_pbh(_mm512_sub_ps(second, bf16_half(hi, 1)),
                                              _mm512_sub_ps(first, bf16_half(hi, 0)));
            _mm512_storeu_si512(pairs + 2 * g * stride + p / 2, (__m512i)hi);
            _mm512_storeu_si512(pairs + (2 * g + 1) * stride + p / 2, (__m512i)lo);
        }
}

/* out[g] = inverse[g] * sum_p e[g, p] values[p] from e's bf16 pairs: the
   values of two positions interleaved (vpunpcklwd / vpunpckhwd) against one
   pair, 32 exact products a vdpbf16ps, summed in fp32, once for hi and once
   for lo (0.6x the ops of widening each value to fp32 for 16 FMAs; as exact
   as them: e to ~2^-17). A lane of the low half holds dims 8k..8k+3 of a
   128-bit quarter k, of the high half 8k+4..8k+7: put back in order at the end. */
static inline __attribute__((always_inline)) void weighted_sum_bf16(
        const uint32_t *pairs, const float *inverse, const void *const *values, int len,
        float *out, const int GC, const int DIM) {
    const int stride = pair_stride(len);
    __m512 acc[3][DIM / 16];
    #pragma GCC unroll 3
    for (int g = 0; g < GC; g++)
        #pragma GCC unroll 8
        for (int c = 0; c < DIM / 16; c++) acc[g][c] = _mm512_setzero_ps();
    for (int p = 0; p < len; p += 2) {
        const uint16_t *v0 = (const uint16_t *)values[p];
        const uint16_t *v1 = (const uint16_t *)values[p + 1 < len ? p + 1 : p];  /* weight 0 */
        if (p + 16 < len)  /* 16 positions ahead (8-48: within noise) */
            for (int j = p + 16; j < p + 18 && j < len; j++)
                for (int line = 0; line < 2 * DIM; line += 64)
                    _mm_prefetch((const char *)values[j] + line, _MM_HINT_T0);
        #pragma GCC unroll 4
        for (int c = 0; c < DIM / 32; c++) {
            __m512i a = _mm512_loadu_si512(v0 + 32 * c), b = _mm512_loadu_si512(v1 + 32 * c);
            __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(a, b);
            __m512bh hi = (__m512bh)_mm512_unpackhi_epi16(a, b);
            #pragma GCC unroll 3
            for (int g = 0; g < GC; g++) {
                const uint32_t *at = pairs + 2 * g * stride + p / 2;
                __m512bh w = (__m512bh)_mm512_set1_epi32((int)at[0]);
                __m512bh rest = (__m512bh)_mm512_set1_epi32((int)at[stride]);
                acc[g][2 * c] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(acc[g][2 * c], lo, w), lo, rest);
                acc[g][2 * c + 1] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(acc[g][2 * c + 1], hi, w),
                                                     hi, rest);
            }
        }
    }
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19,
                                            4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
    #pragma GCC unroll 3
    for (int g = 0; g < GC; g++)
        #pragma GCC unroll 4
        for (int c = 0; c < DIM / 32; c++) {
            __m512 lo = _mm512_mul_ps(acc[g][2 * c], _mm512_set1_ps(inverse[g]));
            __m512 hi = _mm512_mul_ps(acc[g][2 * c + 1], _mm512_set1_ps(inverse[g]));
            _mm512_storeu_ps(out + g * DIM + 32 * c, _mm512_permutex2var_ps(lo, first, hi));
            _mm512_storeu_ps(out + g * DIM + 32 * c + 16,
                             _mm512_permutex2var_ps(lo, second, hi));
        }
}

#endif
