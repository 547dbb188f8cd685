/* qgemm_vnni.c's matmul for CPUs with AVX2 and no VNNI: 4- and 8-bit weights
   times int8 activations, in groups of 32 along k, on the same weight blocks
   (qgemm_vnni.py packs them). Where VNNI has vpdpbusd, AVX2 has vpmaddubsw
   (unsigned bytes times signed bytes, pairs summed into int16, saturating)
   and vpmaddwd (int16 pairs into int32): 4 products a lane in two steps.
   - 4-bit levels (0..15) times int8 (|q| <= 127): a pair is at most 3810, so a
     group's 8 parts sum in int16 (30480) before one vpmaddwd.
   - 8-bit levels, stored as level + 128, are made signed again (xor 128), and
     |w| multiplies q * sign(w) (vpsignb): a pair is at most 2 * 127 * 127, so
     each part goes to int32 on its own. The stored lows are not used.
   - The fine variant's two parts (a in -127..127, b in -64..63) each take the
     same steps as plain int8.
   Every integer sum is exact, so the result is qgemm_vnni.c's up to fp32
   rounding. x and y are both fp32 or both bf16. A 16-output block is run as
   two halves of 8 (one ymm lane each), each by up to ROWS rows at a time. */

#include <stdlib.h>

#include "kernels.h"

enum { GROUP = 32, LANES = 16, FINE_LEVELS = 127 * 128 };
#ifndef ROWS
#define ROWS 4  /* rows a half block serves from registers, at most */
#endif
#ifndef PREFETCH
#define PREFETCH 2048  /* bytes ahead of the block in use (every line of it: one in
                          five gave 1.24x the time of a step's projections at 1 row) */
#endif

static inline int block_bytes(int bits) { return (bits == 4 ? 256 : 512) + 2 * 32; }

static inline __m256 load8(const void *x, int at, int bf16) {
    if (!bf16) return _mm256_loadu_ps((const float *)x + at);
    __m128i half = _mm_loadu_si128((const __m128i *)((const uint16_t *)x + at));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}

static inline float hmax(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

static inline int hsum(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}

/* 4 x 8 int32 -> 32 int8, in order (saturating) */
static inline void store_bytes(int8_t *q, const __m256i v[4]) {
    __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]),
                                       _mm256_packs_epi32(v[2], v[3]));
    bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)q, bytes);
}

/* Row m's groups: int8 levels into q, sx and sx * sum q into scales[2 g], [2 g + 1].
   FINE: 14-bit levels as q[k] * 128 + q[K + k]. */
static inline __attribute__((always_inline)) void quantize_row(
        const void *x, int bf16, int K, int8_t *q, float *scales, const int FINE) {
    const float levels = FINE ? (float)FINE_LEVELS : 127.0f;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int g = 0; g < K / GROUP; g++) {
        __m256 v[4];
        __m256 amax = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            v[i] = load8(x, g * GROUP + 8 * i, bf16);
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
        }
        float top = hmax(amax), sx = top / levels, inv = top > 0.0f ? levels / top : 0.0f;
        __m256i qi[4], sum = _mm256_setzero_si256();
        for (int i = 0; i < 4; i++) {
            qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(inv)));
            sum = _mm256_add_epi32(sum, qi[i]);
        }
        if (FINE) {  /* a = floor((q + 64) / 128), b = q - 128 a */
            __m256i b[4];
            for (int i = 0; i < 4; i++) {
                __m256i a = _mm256_srai_epi32(_mm256_add_epi32(qi[i], _mm256_set1_epi32(64)), 7);
                b[i] = _mm256_sub_epi32(qi[i], _mm256_slli_epi32(a, 7));
                qi[i] = a;
            }
            store_bytes(q + K + g * GROUP, b);
        }
        store_bytes(q + g * GROUP, qi);
        scales[2 * g] = sx;
        scales[2 * g + 1] = sx * (float)hsum(sum);
    }
}

/* A group's dot products of one half block's 8 outputs with one row's levels qx
   (8 parts of 4 bytes). 4-bit: int16 sums, then int32; 8-bit: int32 each part. */
static inline __attribute__((always_inline)) __m256i dot(
        const __m256i levels[8], const __m256i signs[8], const int32_t *qx, const int BITS) {
    const __m256i ones = _mm256_set1_epi16(1);
    if (BITS == 4) {
        __m256i sum = _mm256_maddubs_epi16(levels[0], _mm256_set1_epi32(qx[0]));
        #pragma GCC unroll 8
        for (int j = 1; j < 8; j++)
            sum = _mm256_add_epi16(sum, _mm256_maddubs_epi16(levels[j],
                                                             _mm256_set1_epi32(qx[j])));
        return _mm256_madd_epi16(sum, ones);
    }
    __m256i sum = _mm256_setzero_si256();
    #pragma GCC unroll 8
    for (int j = 0; j < 8; j++) {
        __m256i signed_x = _mm256_sign_epi8(_mm256_set1_epi32(qx[j]), signs[j]);
        sum = _mm256_add_epi32(sum, _mm256_madd_epi16(
            _mm256_maddubs_epi16(levels[j], signed_x), ones));
    }
    return sum;
}

/* Outputs n..n+7 (half `h` of block w) by R rows from m. */
static inline __attribute__((always_inline)) void tile(
        const int8_t *q, const float *xs, int K, const uint8_t *w, int h, void *y, int bf16,
        int N, int n, int m, const int R, const int BITS, const int FINE) {
    const int G = K / GROUP, block = block_bytes(BITS), stride = FINE ? 2 * K : K;
    __m256 acc[ROWS];
    #pragma GCC unroll 4
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int g = 0; g < G; g++, w += block) {
        if (h == 0 && m == 0)  /* the block's 5 or 9 lines, which both halves read */
            for (int at = 0; at < block; at += 64)
                _mm_prefetch((const char *)w + PREFETCH + at, _MM_HINT_T0);
        __m256i levels[8], signs[8];
        if (BITS == 4) {
            const __m256i mask = _mm256_set1_epi8(0x0F);
            #pragma GCC unroll 4
            for (int j = 0; j < 4; j++) {
                __m256i packed = _mm256_loadu_si256((const __m256i *)(w + 64 * j + 32 * h));
                levels[j] = _mm256_and_si256(packed, mask);
                levels[j + 4] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), mask);
            }
        } else {
            const __m256i flip = _mm256_set1_epi8((char)0x80);
            #pragma GCC unroll 8
            for (int j = 0; j < 8; j++) {
                signs[j] = _mm256_xor_si256(
                    _mm256_loadu_si256((const __m256i *)(w + 64 * j + 32 * h)), flip);
                levels[j] = _mm256_abs_epi8(signs[j]);
            }
        }
        const __m128i *per = (const __m128i *)(w + (BITS == 4 ? 256 : 512));
        __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128(per + h));
        #pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const int32_t *qx = (const int32_t *)(q + (int64_t)(m + r) * stride + g * GROUP);
            __m256i d = dot(levels, signs, qx, BITS);
            if (FINE)
                d = _mm256_add_epi32(_mm256_slli_epi32(d, 7),
                                     dot(levels, signs, qx + K / 4, BITS));
            const float *s = xs + ((int64_t)(m + r) * G + g) * 2;
            __m256 scaled = _mm256_mul_ps(_mm256_cvtepi32_ps(d), scale);
            acc[r] = _mm256_fmadd_ps(scaled, _mm256_set1_ps(s[0]), acc[r]);
            if (BITS == 4)
                acc[r] = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128(per + 2 + h)),
                                         _mm256_set1_ps(s[1]), acc[r]);
        }
    }
    #pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
        int64_t at = (int64_t)(m + r) * N + n;
        if (!bf16) {
            _mm256_storeu_ps((float *)y + at, acc[r]);
            continue;
        }
        __m256i bits = _mm256_castps_si256(acc[r]);  /* round to nearest even */
        __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
        bits = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(
            odd, _mm256_set1_epi32(0x7FFF))), 16);
        _mm_storeu_si128((__m128i *)((uint16_t *)y + at),
                         _mm_packus_epi32(_mm256_castsi256_si128(bits),
                                          _mm256_extracti128_si256(bits, 1)));
    }
}

#define T(R) tile(q, xs, K, block_w, h, y, bf16, N, n + 8 * h, m, R, BITS, FINE)

/* Outputs n..n+15 of every row, in two halves of 8. */
static inline __attribute__((always_inline)) void column(
        const int8_t *q, const float *xs, int M, int K, const uint8_t *w, void *y, int bf16,
        int N, int n, const int BITS, const int FINE) {
    const int G = K / GROUP, block = block_bytes(BITS);
    const uint8_t *block_w = w + (int64_t)(n / LANES) * G * block;
    for (int h = 0; h < 2; h++)
        /* rows in blocks of near-equal size (6: 3 + 3, not 4 + 2) */
        for (int m = 0, rows; m < M; m += rows) {
            int blocks = (M - m + ROWS - 1) / ROWS;
            rows = (M - m + blocks - 1) / blocks;
            switch (rows) {
#if ROWS >= 6
            case 6: T(6); break;
            case 5: T(5); break;
#endif
            case 4: T(4); break;
            case 3: T(3); break;
            case 2: T(2); break;
            default: T(1); break;
            }
        }
}

/* Row m of x (fp32, or bf16 as y is) into q and scales (INT8_GEMM in kernels.h). */
static inline __attribute__((always_inline)) void quantize(
        const void *x, int m, int K, int bf16, int8_t *q, float *scales, const int BITS,
        const int FINE) {
    (void)BITS;
    quantize_row((const char *)x + (int64_t)m * K * (bf16 ? 2 : 4), bf16, K, q, scales, FINE);
}

/* x [M, K] and y [M, N] fp32, or both bf16; N a multiple of 16, K of 32.
   Threads: torch's OpenMP pool. */
INT8_GEMMS(avx2, void)
