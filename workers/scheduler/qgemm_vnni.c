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
     64 bytes), then 16 fp16 scales (a GGUF's own fp16 d: exact; 0.85x the
     time of fp32 ones at 1 row, where weights stream) and 16 lows: 8-bit
     fp16 (unused), 4-bit int16 levels of a step per output, 16 fp32 steps in
     a head of 64 bytes before the block's groups.
   - 4-bit lows: sum_g low sx sum qx is a small matmul of its own, [rows, G] by
     [G, 16] a block, in integers: the lows as int16 levels (step max |low| /
     LOW_LEVELS), each row's group sums sx sum qx as levels of another (max /
     SUM_LEVELS), two groups a vpdpwssd, once the block's groups are in L1.
     Its FMA a row and group was 1 of 11 instructions on the pipes the dots
     use (64-row decode steps took 0.936x the time without it, AMD Zen 4).
     The lows move by at most 1/32766 of an output's largest, the sums by
     1/8190 of their row's largest: on the model's own activations the
     answer's distance from the exact one moved from 6.00e-3 to 6.01e-3 at
     most. The fine kernels keep an FMA a group, of the exact sum and the low
     from its level.
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

/* 4-bit lows' and row sums' int16 levels; at most SUM_CHUNK pairs of groups'
   products add up in int32 (32 x 16383 x 4095 < 2^31), then in fp32. */
enum { LOW_LEVELS = 16383, SUM_LEVELS = 4095, SUM_CHUNK = 16 };

static inline int pairs_of(int G) { return (G + 1) / 2; }
/* A group's bytes: levels, then 16 fp16 scales and 16 lows (8-bit fp16, 4-bit
   int16 levels); before them a 4-bit block has a head of 16 fp32 low steps. */
static inline int group_bytes(int bits) { return (bits == 4 ? 256 : 512) + 2 * 32; }
static inline int head_bytes(int bits) { return bits == 4 ? 64 : 0; }
static inline int64_t block_bytes(int bits, int G) {
    return head_bytes(bits) + (int64_t)G * group_bytes(bits);
}

/* acc += levels . the 4 int8 of x at *at, broadcast to every lane, read by
   vpdpbusd itself ({1to16}): GCC loads it into a register first, and the
   engine's 64-row decode step took 0.86x the time without that load. */
#define DOT4(acc, levels, at) \
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(levels), "m"(*(at)))

/* A row's group sums a[0..G) (sx sum q) as int16 levels of one step, in place:
   level g at the int16 a + g bytes 2g.. (so group 2p in the low half of the int32
   at a[p], 0 past an odd G's last), the step at a[(G + 1) / 2]. */
static inline void sum_levels(float *a, int G) {
    __m512 top = _mm512_setzero_ps();
    for (int g = 0; g < G; g += 16)
        top = _mm512_max_ps(top, _mm512_abs_ps(_mm512_maskz_loadu_ps(first_lanes(G - g), a + g)));
    const float amax = _mm512_reduce_max_ps(top);
    const __m512 inv = _mm512_set1_ps(amax > 0.0f ? (float)SUM_LEVELS / amax : 0.0f);
    int16_t *levels = (int16_t *)a;  /* each 16 written below the next 16 read */
    for (int g = 0; g < G; g += 16) {
        const __mmask16 lanes = first_lanes(G - g);
        __m512i level = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_maskz_loadu_ps(lanes, a + g), inv));
        _mm256_mask_storeu_epi16(levels + g, lanes, _mm512_cvtepi32_epi16(level));
    }
    if (G % 2)
        levels[G] = 0;
    a[pairs_of(G)] = amax / (float)SUM_LEVELS;
}

/* Row m's groups: int8 levels into q, and into scales (xs_row(G) floats):
   8-bit weights sx and their dot's int32 start (MAGIC_BITS but in FINE, less
   128 sum q: the low's share) in a float's bits at [2 g], [2 g + 1]; 4-bit sx
   at [g], then from [G] the sums sx sum q (FINE) or their levels (sum_levels).
   FINE: 14-bit levels as q[k] * 128 + q[K + k]. */
static inline __attribute__((always_inline)) void quantize_row(
        const uint16_t *x, int K, int8_t *q, float *scales, const int BITS, const int FINE) {
    const float levels = FINE ? (float)FINE_LEVELS : 127.0f;
    for (int g = 0; g < K / GROUP; g++) {
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
        if (BITS == 8) {
            int32_t start = (MAGIC && !FINE ? MAGIC_BITS : 0) - 128 * sum;
            scales[2 * g] = sx;
            memcpy(scales + 2 * g + 1, &start, 4);
        } else {
            scales[g] = sx;
            scales[K / GROUP + g] = sx * (float)sum;
        }
    }
    if (BITS == 4 && !FINE)
        sum_levels(scales + K / GROUP, K / GROUP);
}

/* acc[r] += sum_g low sx sum qx for R rows from m (4-bit), the block's lows
   (int16 levels, after each group's scales) a pair of groups at a time. */
static inline __attribute__((always_inline)) void add_low_terms(
        __m512 *acc, const uint8_t *head, const float *xs, int G, int m, const int R) {
    const uint8_t *lows = head + head_bytes(4) + 256 + 32;  /* group 0's */
    const int64_t row = xs_row(G), block = group_bytes(4);
    /* words 0-15 of group 2p's lows and 16-31 of 2p + 1's: lane i their i-th */
    const __m512i interleave = _mm512_set_epi16(
        31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
        23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512 step = _mm512_loadu_ps((const float *)head);
    for (int p0 = 0; p0 < pairs_of(G); p0 += SUM_CHUNK) {
        const int end = p0 + SUM_CHUNK < pairs_of(G) ? p0 + SUM_CHUNK : pairs_of(G);
        __m512i t[ROWS];
        #pragma GCC unroll 16
        for (int r = 0; r < R; r++) t[r] = _mm512_setzero_si512();
        for (int p = p0; p < end; p++) {
            const __m256i even = _mm256_loadu_si256((const __m256i *)(lows + 2 * p * block));
            const __m256i odd = 2 * p + 1 < G
                ? _mm256_loadu_si256((const __m256i *)(lows + (2 * p + 1) * block))
                : _mm256_setzero_si256();
            const __m512i low = _mm512_permutexvar_epi16(
                interleave, _mm512_inserti64x4(_mm512_castsi256_si512(even), odd, 1));
            #pragma GCC unroll 16
            for (int r = 0; r < R; r++) {
                const int32_t *sums = (const int32_t *)(xs + (m + r) * row + G);
                t[r] = _mm512_dpwssd_epi32(t[r], low, _mm512_set1_epi32(sums[p]));
            }
        }
        #pragma GCC unroll 16
        for (int r = 0; r < R; r++)
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t[r]), _mm512_mul_ps(step, _mm512_set1_ps(
                xs[(m + r) * row + G + pairs_of(G)])), acc[r]);
    }
}

/* Outputs n..n+15 by R rows from m. */
static inline __attribute__((always_inline)) void tile(
        const int8_t *q, const float *xs, int K, const uint8_t *w, void *y, int bf16_out,
        int N, int n, int m, const int R, const int BITS, const int FINE) {
    const int G = K / GROUP, block = group_bytes(BITS), stride = FINE ? 2 * K : K;
    const uint8_t *head = w;
    w += head_bytes(BITS);
    __m512 acc[ROWS];
    #pragma GCC unroll 16
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int g = 0; g < G; g++, w += block) {
        /* 5 or 9 lines; the group first also the line a 4-bit head takes */
        for (int at = g ? 0 : -head_bytes(BITS); at < block; at += 64)
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
        __m512 low = _mm512_setzero_ps();
        if (BITS == 4 && FINE)  /* its own group's low, in fp32, times the exact sum */
            low = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(
                                    _mm256_loadu_si256(per + 1))),
                                _mm512_loadu_ps((const float *)head));
        #pragma GCC unroll 16
        for (int r = 0; r < R; r++) {
            const int32_t *qx = (const int32_t *)(q + (int64_t)(m + r) * stride + g * GROUP);
            /* 8-bit: sx, start at s[0], s[1]; 4-bit: sx at s[0] */
            const float *s = xs + (m + r) * xs_row(G) + (BITS == 8 ? 2 * g : g);
            /* 8-bit: MAGIC_BITS - 128 sum q (the low's share) in the bits of s[1] */
            const __m512i start = BITS == 8 ? _mm512_castps_si512(_mm512_set1_ps(s[1]))
                                            : _mm512_set1_epi32(MAGIC && !FINE ? MAGIC_BITS : 0);
            __m512i dot = FINE ? _mm512_setzero_si512() : start;
            #pragma GCC unroll 8
            for (int j = 0; j < 8; j++)
                DOT4(dot, levels[j], qx + j);
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
            if (BITS == 4 && FINE)
                acc[r] = _mm512_fmadd_ps(low, _mm512_set1_ps(s[G]), acc[r]);
        }
    }
    if (BITS == 4 && !FINE)
        add_low_terms(acc, head, xs, G, m, R);
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

#define T(R) tile(q, xs, K, w + (int64_t)(n / LANES) * block_bytes(BITS, G), y, bf16_out, N, \
                  n, m, R, BITS, FINE)

/* Outputs n..n+15 of every row. */
static inline __attribute__((always_inline)) void column(
        const int8_t *q, const float *xs, int M, int K, const uint8_t *w, void *y, int bf16_out,
        int N, int n, const int BITS, const int FINE) {
    const int G = K / GROUP, most = max_rows(BITS, FINE);
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
