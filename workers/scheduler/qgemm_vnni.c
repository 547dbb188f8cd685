/* 4- and 8-bit weights times int8 activations by AVX-512 VNNI (vpdpbusd), for
   CPUs with avx512_vnni but no AMX: y[m, n] = sum_k x[m, k] w[n, k], in groups
   of 32 along k, as llama.cpp runs a Q4_1 or Q8_0 GGUF (its Q8_1 activations).
   - x (bf16) is rounded per row and group to int8 levels: x ~ sx * qx, sx =
     max |x| / 127. Each group keeps sx and sx * sum qx.
   - w = scale * qw + low per output and group, qw unsigned (4-bit 0..15; 8-bit
     stored as level + 128, low = -128 scale), so
     y = sum_g sx (scale * sum qw qx + low * sum qx): the integer dot is exact.
     8-bit weights fold their low into it, y = sum_g sx scale (sum qw qx - 128
     sum qx): each group's dot starts at -128 sum qx (past MAGIC_BITS, below),
     and no FMA adds the low (1 of 11 instructions per row and group: the
     lm_head's matmul took 0.95x the time at 64 rows, 0.91x at 1, paired).
   - The weight is blocked by 16 outputs (one zmm lane each, 4 inputs a lane):
     for every 16 outputs and group, the levels (4-bit: 4 x 64 bytes, inputs
     4j..4j+3 in the low nibbles of part j and 16+4j.. in the high; 8-bit: 8 x
     64 bytes), then 16 fp16 scales and 16 fp16 lows (a GGUF's own fp16 d and
     m: exact; 0.85x the time of fp32 ones at 1 row, where weights stream).
   One weight block serves R rows from L1; y is fp32, or bf16 (nearest even), or
   for the lm_head of greedy sampling only each row's largest output is kept.
   The fine variant (*_vnni_fine) rounds x to 14 bits instead, sx = max |x| /
   16256, and splits each level into two int8 parts, q = 128 a + b (a in
   -127..127, b in -64..63): two vpdpbusd chains, one shift, one add. Its error
   is at most 1/32512 of the group's max |x|, far below bf16's rounding of the
   large elements (1/512 of each): for projections int8 is too coarse for. */

#include "kernels.h"

enum { GROUP = 32, LANES = 16, FINE_LEVELS = 127 * 128 };
/* Rows a weight block serves from registers, at most: ROWS for plain 8-bit
   weights (the lm_head's 49152 x 576 at 16-96 rows: 0.84-0.91x the time of
   12 on 2 threads, AMD Zen 5), 12 for the rest (4-bit: 0.99-1.01x with 16;
   the fine kernels keep a second chain of dots live). */
#define ROWS 16
#ifndef MAGIC
#define MAGIC 1
#endif
/* 1.5 * 2^23's fp32 bits: as an int32 start, the dot d ends as the float 1.5 * 2^23 + d
   exactly (|d| < 2^22: 4-bit 32 * 15 * 127, 8-bit 32 * 127 * 127; not the fine
   kernel's), so one FMA by the scale, less 1.5 * 2^23 scale (exact: a fp16 times 3 *
   2^22), converts and scales it, bit for bit as a conversion and a multiply did. A
   step's projections took 0.99x the time at 64 rows, 0.98x at 256 (AMD Zen 4, paired;
   MAGIC=0 builds the conversion) */
enum { MAGIC_BITS = 0x4B400000 };
#define MAGIC_FLOAT 12582912.0f
static inline int max_rows(int bits, int fine) { return bits == 8 && !fine ? ROWS : 12; }
#ifndef PREFETCH
#define PREFETCH 4096  /* bytes ahead of the block in use (1024-4096: within 5%) */
#endif

static inline int block_bytes(int bits) { return (bits == 4 ? 256 : 512) + 2 * 32; }

/* acc += levels . the 4 int8 of x at *at, broadcast to every lane, read by
   vpdpbusd itself ({1to16}): GCC loads it into a register first, and the
   engine's 64-row decode step took 0.86x the time without that load. */
#define DOT4(acc, levels, at) \
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(levels), "m"(*(at)))

/* Group g's sx and its second scale (4-bit: sx * sum q; 8-bit: the int32
   MAGIC_BITS - 128 sum q in its bits) into scales[2 g], [2 g + 1]. */
static inline void put_scales(float *scales, int g, float sx, int sum, const int BITS,
                              const int FINE) {
    scales[2 * g] = sx;
    if (BITS == 8) {
        int32_t start = (MAGIC && !FINE ? MAGIC_BITS : 0) - 128 * sum;
        memcpy(scales + 2 * g + 1, &start, 4);
    } else {
        scales[2 * g + 1] = sx * (float)sum;
    }
}

/* Groups g0..g0+15 of a row at x as quantize_row rounds them (the same bits):
   their max |x| and sums of levels reduced 16 groups at once, their scales
   divided as one vector. 16 rows of 1536 took 4.4 us to round against 6.5
   group by group (one thread), 64-row decode steps 0.989x the time (1.008-1.022
   paired the other way, 6 waves; AMD Zen 4). */
static inline __attribute__((always_inline)) void quantize16(
        const uint16_t *x, int g0, int8_t *q, float *scales, const int BITS) {
    __m512 top[16];
    #pragma GCC unroll 16
    for (int i = 0; i < 16; i++) {
        const uint16_t *at = x + (g0 + i) * GROUP;
        top[i] = _mm512_max_ps(_mm512_abs_ps(widen_bf16(_mm256_loadu_si256((const __m256i *)at))),
                               _mm512_abs_ps(widen_bf16(_mm256_loadu_si256((const __m256i *)(at + 16)))));
    }
    const __m512 amax = max16_ps(top), levels = _mm512_set1_ps(127.0f);
    float sx[16], inv[16];
    _mm512_storeu_ps(sx, _mm512_div_ps(amax, levels));
    _mm512_storeu_ps(inv, _mm512_maskz_div_ps(_mm512_cmp_ps_mask(amax, _mm512_setzero_ps(),
                                                                 _CMP_GT_OQ), levels, amax));
    __m512i sums[16];
    #pragma GCC unroll 16
    for (int i = 0; i < 16; i++) {
        const uint16_t *at = x + (g0 + i) * GROUP;  /* read again: 48 vectors held would spill */
        const __m512 by = _mm512_set1_ps(inv[i]);
        __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(
            widen_bf16(_mm256_loadu_si256((const __m256i *)at)), by));
        __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(
            widen_bf16(_mm256_loadu_si256((const __m256i *)(at + 16))), by));
        sums[i] = _mm512_add_epi32(qlo, qhi);
        _mm_storeu_si128((__m128i *)(q + (g0 + i) * GROUP), _mm512_cvtsepi32_epi8(qlo));
        _mm_storeu_si128((__m128i *)(q + (g0 + i) * GROUP + 16), _mm512_cvtsepi32_epi8(qhi));
    }
    int32_t sum[16];
    _mm512_storeu_si512(sum, sums16_epi32(sums));
    for (int i = 0; i < 16; i++) put_scales(scales, g0 + i, sx[i], sum[i], BITS, 0);
}

/* Row m's groups: int8 levels into q, sx and sx * sum q into scales[2 g], [2 g + 1]
   (8-bit weights: the int32 -128 sum q in the bits of [2 g + 1]).
   FINE: 14-bit levels as q[k] * 128 + q[K + k]. */
static inline __attribute__((always_inline)) void quantize_row(
        const uint16_t *x, int K, int8_t *q, float *scales, const int BITS, const int FINE) {
    const float levels = FINE ? (float)FINE_LEVELS : 127.0f;
    int g = 0;
    if (!FINE)
        for (; g + 16 <= K / GROUP; g += 16) quantize16(x, g, q, scales, BITS);
    for (; g < K / GROUP; g++) {
        __m512 lo = widen_bf16(_mm256_loadu_si256((const __m256i *)(x + g * GROUP)));
        __m512 hi = widen_bf16(_mm256_loadu_si256((const __m256i *)(x + g * GROUP + 16)));
        float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
        float sx = amax / levels, inv = amax > 0.0f ? levels / amax : 0.0f;
        __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, _mm512_set1_ps(inv)));
        __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, _mm512_set1_ps(inv)));
        int sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
        if (FINE) {  /* a = floor((q + 64) / 128), b = q - 128 a */
            const __m512i half = _mm512_set1_epi32(64);
            __m512i alo = _mm512_srai_epi32(_mm512_add_epi32(qlo, half), 7);
            __m512i ahi = _mm512_srai_epi32(_mm512_add_epi32(qhi, half), 7);
            __m512i blo = _mm512_sub_epi32(qlo, _mm512_slli_epi32(alo, 7));
            __m512i bhi = _mm512_sub_epi32(qhi, _mm512_slli_epi32(ahi, 7));
            _mm_storeu_si128((__m128i *)(q + K + g * GROUP), _mm512_cvtsepi32_epi8(blo));
            _mm_storeu_si128((__m128i *)(q + K + g * GROUP + 16), _mm512_cvtsepi32_epi8(bhi));
            qlo = alo;
            qhi = ahi;
        }
        _mm_storeu_si128((__m128i *)(q + g * GROUP), _mm512_cvtsepi32_epi8(qlo));
        _mm_storeu_si128((__m128i *)(q + g * GROUP + 16), _mm512_cvtsepi32_epi8(qhi));
        put_scales(scales, g, sx, sum, BITS, FINE);
    }
}

/* Outputs n..n+15 by R rows from m. */
static inline __attribute__((always_inline)) void tile(
        const int8_t *q, const float *xs, int K, const uint8_t *w, void *y, int bf16_out,
        int N, int n, int m, const int R, const int BITS, const int FINE) {
    const int G = K / GROUP, block = block_bytes(BITS), stride = FINE ? 2 * K : K;
    __m512 acc[ROWS];
    #pragma GCC unroll 16
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int g = 0; g < G; g++, w += block) {
        for (int at = 0; at < block; at += 64)  /* 5 or 9 lines */
            _mm_prefetch((const char *)w + PREFETCH + at, _MM_HINT_T0);
        __m512i levels[8];
        if (BITS == 4) {
            const __m512i mask = _mm512_set1_epi8(0x0F);
            #pragma GCC unroll 4
            for (int j = 0; j < 4; j++) {
                __m512i packed = _mm512_loadu_si512(w + 64 * j);
                levels[j] = _mm512_and_si512(packed, mask);
                levels[j + 4] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), mask);
            }
        } else {
            #pragma GCC unroll 8
            for (int j = 0; j < 8; j++) levels[j] = _mm512_loadu_si512(w + 64 * j);
        }
        const __m256i *per = (const __m256i *)(w + (BITS == 4 ? 256 : 512));
        __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(per));
        const __m512 unmagic = _mm512_mul_ps(scale, _mm512_set1_ps(-MAGIC_FLOAT));
        __m512 low = BITS == 4 ? _mm512_cvtph_ps(_mm256_loadu_si256(per + 1))
                               : _mm512_setzero_ps();  /* 8-bit: folded into the dot */
        #pragma GCC unroll 16
        for (int r = 0; r < R; r++) {
            const int32_t *qx = (const int32_t *)(q + (int64_t)(m + r) * stride + g * GROUP);
            const float *s = xs + ((int64_t)(m + r) * G + g) * 2;
            /* 8-bit: MAGIC_BITS - 128 sum q (the low's share) in the bits of s[1] */
            const __m512i start = BITS == 8 ? _mm512_castps_si512(_mm512_set1_ps(s[1]))
                                            : _mm512_set1_epi32(MAGIC && !FINE ? MAGIC_BITS : 0);
            /* two chains of 4 dots, added: a chain of 8 held each row's FMAs back
               (the 4-bit matmul's 64-row steps 0.983x the time, 0.965-0.991, 6
               waves paired; alone 12.1 cycles a row and group against 12.4, the
               dots' and FMAs' bound 11, AMD Zen 4) */
            __m512i dot = FINE ? _mm512_setzero_si512() : start, half = _mm512_setzero_si512();
            #pragma GCC unroll 4
            for (int j = 0; j < 4; j++) {
                DOT4(dot, levels[j], qx + j);
                DOT4(half, levels[j + 4], qx + j + 4);
            }
            dot = _mm512_add_epi32(dot, half);
            if (FINE) {
                __m512i fine = start;
                #pragma GCC unroll 8
                for (int j = 0; j < 8; j++)
                    DOT4(fine, levels[j], qx + K / 4 + j);
                dot = _mm512_add_epi32(_mm512_slli_epi32(dot, 7), fine);
            }
            __m512 scaled = MAGIC && !FINE
                ? _mm512_fmadd_ps(_mm512_castsi512_ps(dot), scale, unmagic)
                : _mm512_mul_ps(_mm512_cvtepi32_ps(dot), scale);
            acc[r] = _mm512_fmadd_ps(scaled, _mm512_set1_ps(s[0]), acc[r]);
            if (BITS == 4)
                acc[r] = _mm512_fmadd_ps(low, _mm512_set1_ps(s[1]), acc[r]);
        }
    }
    if (bf16_out == ARGMAX) {  /* y a Best (kernels.h): this thread's rows */
        const Best *b = y;
        const int64_t mine = (int64_t)omp_get_thread_num() * b->rows + m;
        #pragma GCC unroll 16
        for (int r = 0; r < R; r++)
            keep_best(acc[r], n, b->value + mine + r, b->at + mine + r);
        return;
    }
    #pragma GCC unroll 16
    for (int r = 0; r < R; r++) {
        int64_t at = (int64_t)(m + r) * N + n;
        if (bf16_out)
            _mm256_storeu_si256((__m256i *)((uint16_t *)y + at),
                                (__m256i)_mm512_cvtneps_pbh(acc[r]));
        else
            _mm512_storeu_ps((float *)y + at, acc[r]);
    }
}

#define T(R) tile(q, xs, K, w + (int64_t)(n / LANES) * G * block, y, bf16_out, N, n, m, R, \
                  BITS, FINE)

/* Outputs n..n+15 of every row. */
static inline __attribute__((always_inline)) void column(
        const int8_t *q, const float *xs, int M, int K, const uint8_t *w, void *y, int bf16_out,
        int N, int n, const int BITS, const int FINE) {
    const int G = K / GROUP, block = block_bytes(BITS), most = max_rows(BITS, FINE);
    /* rows in blocks of near-equal size (16 at 12 rows most: 8 + 8, not 12 + 4) */
    for (int m = 0, rows; m < M; m += rows) {
        int blocks = (M - m + most - 1) / most;
        rows = (M - m + blocks - 1) / blocks;
        switch (rows) {
        case 16: T(16); break;
        case 15: T(15); break;
        case 14: T(14); break;
        case 13: T(13); break;
        case 12: T(12); break;
        case 11: T(11); break;
        case 10: T(10); break;
        case 9: T(9); break;
        case 8: T(8); break;
        case 7: T(7); break;
        case 6: T(6); break;
        case 5: T(5); break;
        case 4: T(4); break;
        case 3: T(3); break;
        case 2: T(2); break;
        default: T(1); break;
        }
    }
}

/* Row m of x (bf16 whatever y is) into q and scales (INT8_GEMM in kernels.h). */
static inline __attribute__((always_inline)) void quantize(
        const uint16_t *x, int m, int K, int bf16_out, int8_t *q, float *scales, const int BITS,
        const int FINE) {
    (void)bf16_out;
    quantize_row(x + (int64_t)m * K, K, q, scales, BITS, FINE);
}

/* x bf16 [M, K], N a multiple of 16, K of 32. Threads: torch's OpenMP pool. */
INT8_GEMMS(vnni, uint16_t)

/* out[m]: the column of row m's largest output of q8_gemm_vnni (the first of
   equals, as torch's argmax), whose fp32 y is never written (greedy sampling's
   lm_head: ARGMAX in kernels.h). */
void q8_argmax_vnni(const uint16_t *x, int M, int K, const uint8_t *w, int64_t *out, int N) {
    Best best = best_alloc(M);
    q8_gemm_vnni(x, M, K, w, &best, ARGMAX, N);
    best_finish(&best, out);
}
