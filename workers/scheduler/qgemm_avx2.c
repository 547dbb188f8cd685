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
   rounding. x and y are both fp32 or both bf16. A 16-output block's two halves
   of 8 (one ymm lane each) take each broadcast of a row's activations, R rows
   at a time; from UNPACK_ROWS rows on, the block's levels and scales are first
   unpacked for all rows to read (on an AMD Zen 1, 64 rows: 0.77x the time of
   the 4-bit projections of a half at a time, 0.85x the 8-bit lm_head's). */

#include <stdlib.h>

#include "kernels.h"

enum { GROUP = 32, LANES = 16, FINE_LEVELS = 127 * 128 };
#ifndef ROWS
#define ROWS 4  /* rows a tile serves from registers, at most (fine: 2) */
#endif
#ifndef PREFETCH
#define PREFETCH 2048  /* bytes ahead of the block in use (every line of it: one in
                          five gave 1.24x the time of a step's projections at 1 row) */
#endif
#ifndef UNPACK_ROWS  /* rows from which a column's blocks are unpacked first (AMD Zen 1,
                        against not: 1.0x at 16 and 32 rows, 0.93-0.95x at 64) */
#define UNPACK_ROWS 32
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

/* 8 outputs of a row into y at `at`: fp32, or bf16 rounded to nearest even. */
static inline void store8(void *y, int64_t at, __m256 v, int bf16) {
    if (!bf16) {
        _mm256_storeu_ps((float *)y + at, v);
        return;
    }
    __m256i bits = _mm256_castps_si256(v);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    bits = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(
        odd, _mm256_set1_epi32(0x7FFF))), 16);
    _mm_storeu_si128((__m128i *)((uint16_t *)y + at),
                     _mm_packus_epi32(_mm256_castsi256_si128(bits),
                                      _mm256_extracti128_si256(bits, 1)));
}

/* A group's block unpacked: levels [8 parts][2 halves][32 bytes] (8-bit: |w|,
   then w itself for its signs), then fp32 [scale h0, h1, low h0, h1][8]. */
static inline int unpacked_bytes(int bits) { return (bits == 4 ? 512 : 1024) + 128; }

/* Part j's levels for both halves (and 8-bit, their signs), from an unpacked
   group or a packed block. */
static inline __attribute__((always_inline)) void part(
        const uint8_t *at, int j, const int UNPACKED, const int BITS, __m256i l[2],
        __m256i signs[2]) {
    for (int h = 0; h < 2; h++) {
        if (UNPACKED) {
            l[h] = _mm256_load_si256((const __m256i *)(at + (2 * j + h) * 32));
            if (BITS == 8) signs[h] = _mm256_load_si256((const __m256i *)(at + 512 + (2 * j + h) * 32));
        } else if (BITS == 4) {  /* parts j and j + 4 share bytes */
            __m256i packed = _mm256_loadu_si256((const __m256i *)(at + 64 * (j & 3) + 32 * h));
            l[h] = _mm256_and_si256(j < 4 ? packed : _mm256_srli_epi16(packed, 4),
                                    _mm256_set1_epi8(0x0F));
        } else {
            signs[h] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(at + 64 * j + 32 * h)),
                                        _mm256_set1_epi8((char)0x80));
            l[h] = _mm256_abs_epi8(signs[h]);
        }
    }
}

/* The scale (i 0, 1: halves) or low (2, 3) of a group, unpacked or packed. */
static inline __m256 per_block(const uint8_t *at, int i, const int UNPACKED, const int BITS) {
    const int levels = BITS == 4 ? 256 : 512;
    if (UNPACKED) return _mm256_load_ps((const float *)(at + 2 * levels) + 8 * i);
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(at + levels) + i));
}

/* Blocks of a 16-output column, G groups, unpacked into lv. */
static void unpack(const uint8_t *w, int G, uint8_t *lv, const int BITS) {
    const int block = block_bytes(BITS), out = unpacked_bytes(BITS);
    for (int g = 0; g < G; g++, w += block, lv += out) {
        for (int at = 0; at < block; at += 64)
            _mm_prefetch((const char *)w + PREFETCH + at, _MM_HINT_T0);
        for (int j = 0; j < 8; j++) {
            __m256i l[2], signs[2];
            part(w, j, 0, BITS, l, signs);
            for (int h = 0; h < 2; h++) {
                _mm256_store_si256((__m256i *)(lv + (2 * j + h) * 32), l[h]);
                if (BITS == 8) _mm256_store_si256((__m256i *)(lv + 512 + (2 * j + h) * 32), signs[h]);
            }
        }
        for (int i = 0; i < 4; i++)
            _mm256_store_ps((float *)(lv + out - 128) + 8 * i, per_block(w, i, 0, BITS));
    }
}

/* A part's products of levels l with broadcast activations b into int16 (4-bit)
   or int32 (8-bit) sums, the first part starting them. */
static inline __attribute__((always_inline)) __m256i product(
        __m256i sum, __m256i l, __m256i signs, __m256i b, int first, const int BITS) {
    __m256i p = BITS == 4 ? _mm256_maddubs_epi16(l, b)
        : _mm256_madd_epi16(_mm256_maddubs_epi16(l, _mm256_sign_epi8(b, signs)),
                            _mm256_set1_epi16(1));
    if (first) return p;
    return BITS == 4 ? _mm256_add_epi16(sum, p) : _mm256_add_epi32(sum, p);
}

static inline __m256i widen(__m256i sum, const int BITS) {
    return BITS == 4 ? _mm256_madd_epi16(sum, _mm256_set1_epi16(1)) : sum;
}

/* Outputs n..n+15 by R rows from m: src is the column's unpacked groups or its
   packed blocks. FINE: each row's two parts, a * 128 + b. */
static inline __attribute__((always_inline)) void tile(
        const int8_t *q, const float *xs, int K, const uint8_t *src, void *y, int bf16,
        int N, int n, int m, const int R, const int BITS, const int FINE, const int UNPACKED) {
    const int G = K / GROUP, stride = FINE ? 2 * K : K;
    const int step = UNPACKED ? unpacked_bytes(BITS) : block_bytes(BITS);
    __m256 acc[2 * ROWS];
    #pragma GCC unroll 12
    for (int r = 0; r < 2 * R; r++) acc[r] = _mm256_setzero_ps();
    for (int g = 0; g < G; g++, src += step) {
        if (!UNPACKED && m == 0)  /* the block's 5 or 9 lines */
            for (int at = 0; at < block_bytes(BITS); at += 64)
                _mm_prefetch((const char *)src + PREFETCH + at, _MM_HINT_T0);
        const int32_t *qx[ROWS];
        #pragma GCC unroll 6
        for (int r = 0; r < R; r++)
            qx[r] = (const int32_t *)(q + (int64_t)(m + r) * stride + g * GROUP);
        __m256i sum[ROWS][2], fine[ROWS][2];
        #pragma GCC unroll 8
        for (int j = 0; j < 8; j++) {
            __m256i l[2], signs[2];
            part(src, j, UNPACKED, BITS, l, signs);
            #pragma GCC unroll 6
            for (int r = 0; r < R; r++) {
                __m256i b = _mm256_set1_epi32(qx[r][j]);
                sum[r][0] = product(sum[r][0], l[0], signs[0], b, j == 0, BITS);
                sum[r][1] = product(sum[r][1], l[1], signs[1], b, j == 0, BITS);
                /* else GCC hoists every product above the sums and spills them */
                __asm__("" : "+x"(sum[r][0]), "+x"(sum[r][1]));
                if (FINE) {
                    b = _mm256_set1_epi32(qx[r][j + K / 4]);
                    fine[r][0] = product(fine[r][0], l[0], signs[0], b, j == 0, BITS);
                    fine[r][1] = product(fine[r][1], l[1], signs[1], b, j == 0, BITS);
                    __asm__("" : "+x"(fine[r][0]), "+x"(fine[r][1]));
                }
            }
        }
        #pragma GCC unroll 6
        for (int r = 0; r < R; r++) {
            const float *s = xs + ((int64_t)(m + r) * G + g) * 2;
            for (int h = 0; h < 2; h++) {
                __m256i d = widen(sum[r][h], BITS);
                if (FINE) d = _mm256_add_epi32(_mm256_slli_epi32(d, 7), widen(fine[r][h], BITS));
                __m256 scaled = _mm256_mul_ps(_mm256_cvtepi32_ps(d), per_block(src, h, UNPACKED, BITS));
                acc[2 * r + h] = _mm256_fmadd_ps(scaled, _mm256_set1_ps(s[0]), acc[2 * r + h]);
                if (BITS == 4)
                    acc[2 * r + h] = _mm256_fmadd_ps(per_block(src, 2 + h, UNPACKED, BITS),
                                                     _mm256_set1_ps(s[1]), acc[2 * r + h]);
            }
        }
    }
    #pragma GCC unroll 6
    for (int r = 0; r < R; r++)
        for (int h = 0; h < 2; h++) store8(y, (int64_t)(m + r) * N + n + 8 * h, acc[2 * r + h], bf16);
}

#define T(R) tile(q, xs, K, src, y, bf16, N, n, m, R, BITS, FINE, UNPACKED)

/* Every row of outputs n..n+15, in tiles of near-equal rows (6: 3 + 3, not 4 + 2). */
static inline __attribute__((always_inline)) void rows_of(
        const int8_t *q, const float *xs, int M, int K, const uint8_t *src, void *y, int bf16,
        int N, int n, const int BITS, const int FINE, const int UNPACKED) {
    const int most = FINE ? 2 : ROWS;
    for (int m = 0, rows; m < M; m += rows) {
        int blocks = (M - m + most - 1) / most;
        rows = (M - m + blocks - 1) / blocks;
        switch (rows) {  /* at most `most` */
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

/* Outputs n..n+15 of every row. */
static inline __attribute__((always_inline)) void column(
        const int8_t *q, const float *xs, int M, int K, const uint8_t *w, void *y, int bf16,
        int N, int n, const int BITS, const int FINE) {
    const int G = K / GROUP;
    const uint8_t *packed = w + (int64_t)(n / LANES) * G * block_bytes(BITS);
    if (M < UNPACK_ROWS) {
        rows_of(q, xs, M, K, packed, y, bf16, N, n, BITS, FINE, 0);
        return;
    }
    uint8_t *lv = aligned_alloc(64, (size_t)G * unpacked_bytes(BITS));
    unpack(packed, G, lv, BITS);
    rows_of(q, xs, M, K, lv, y, bf16, N, n, BITS, FINE, 1);
    free(lv);
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
