/* What our C kernels share (AVX2 and FMA; AVX-512 where built for it): a vector
   e^x and the softmax numerators of a row, and rows of bf16 or fp32 read into
   and written from fp32. */

#ifndef PIPELINE_KERNELS_H
#define PIPELINE_KERNELS_H

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* e^x for x <= 0, to ~2 ulp: x = n ln2 + r, |r| <= ln2 / 2, e^r by its Taylor
   polynomial to r^7, 2^n through the exponent bits; under -87 it flushes to 0.
   exp8 and exp16 take the same steps on these constants: both give the same bits. */
#define EXP_FLOOR (-87.0f)
#define EXP_LOG2E 1.44269504089f
#define EXP_LN2_HI 0.693145751953125f
#define EXP_LN2_LO 1.428606765330187e-06f
static const float EXP_TAYLOR[8] = {1.0f / 5040, 1.0f / 720, 1.0f / 120, 1.0f / 24,
                                    1.0f / 6, 0.5f, 1.0f, 1.0f};

static inline __m256 exp8(__m256 x) {
    __m256 under = _mm256_cmp_ps(x, _mm256_set1_ps(EXP_FLOOR), _CMP_LT_OQ);
    x = _mm256_max_ps(x, _mm256_set1_ps(EXP_FLOOR));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(EXP_LOG2E)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_HI), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_LO), r);
    __m256 e = _mm256_set1_ps(EXP_TAYLOR[0]);
    for (int i = 1; i < 8; i++) e = _mm256_fmadd_ps(e, r, _mm256_set1_ps(EXP_TAYLOR[i]));
    __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                      _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(e, _mm256_castsi256_ps(bits)));
}

#ifdef __AVX512F__
/* 16 bf16 (the low half of each 32-bit lane to be) as fp32: exact. */
static inline __m512 widen_bf16(__m256i half) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

/* The first n of 16 lanes (none for n <= 0, all for n >= 16): a row's tail. */
static inline __mmask16 first_lanes(int n) {
    return n >= 16 ? (__mmask16)0xFFFF : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1);
}

static inline __m512 exp16(__m512 x) {
    __mmask16 under = _mm512_cmp_ps_mask(x, _mm512_set1_ps(EXP_FLOOR), _CMP_LT_OQ);
    x = _mm512_max_ps(x, _mm512_set1_ps(EXP_FLOOR));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(EXP_LOG2E)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_HI), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_LO), r);
    __m512 e = _mm512_set1_ps(EXP_TAYLOR[0]);
    for (int i = 1; i < 8; i++) e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(EXP_TAYLOR[i]));
    __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n),
                                                      _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mul_ps((__mmask16)~under, e, _mm512_castsi512_ps(bits));
}

/* lane j: the sum of a[j]'s 16 int32 lanes (pairs, then quarters, then halves
   of the 16 vectors at once): lanes16_ps below on int32, exact
   (paged_int8.c's dots: in fp32 its offset, often the larger term, would round
   the dot away; qgemm_vnni.c's groups' sums of levels) */
static inline __m512i sums16_epi32(const __m512i a[16]) {
    __m512i b[8], c[4];
    for (int i = 0; i < 8; i++)
        b[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(a[2 * i], a[2 * i + 1]),
                                _mm512_unpackhi_epi32(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++)
        c[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(b[2 * i], b[2 * i + 1]),
                                _mm512_unpackhi_epi64(b[2 * i], b[2 * i + 1]));
    __m512i d0 = _mm512_add_epi32(_mm512_shuffle_i32x4(c[0], c[1], 0x88),
                                  _mm512_shuffle_i32x4(c[0], c[1], 0xDD));
    __m512i d1 = _mm512_add_epi32(_mm512_shuffle_i32x4(c[2], c[3], 0x88),
                                  _mm512_shuffle_i32x4(c[2], c[3], 0xDD));
    return _mm512_add_epi32(_mm512_shuffle_i32x4(d0, d1, 0x88),
                            _mm512_shuffle_i32x4(d0, d1, 0xDD));
}

/* lane j: the sum (or, MAX, the largest) of a[j]'s 16 fp32 lanes, as sums16_epi32 */
static inline __attribute__((always_inline)) __m512 lanes16_ps(const __m512 a[16],
                                                                 const int MAX) {
    #define LANES_OP(x, y) (MAX ? _mm512_max_ps(x, y) : _mm512_add_ps(x, y))
    __m512 b[8], c[4];
    for (int i = 0; i < 8; i++)  /* pairs: 2 vectors' partial results per 128-bit quarter */
        b[i] = LANES_OP(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                        _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++) {  /* 4 vectors per quarter */
        __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
        c[i] = LANES_OP(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                        _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    __m512 d0 = LANES_OP(_mm512_shuffle_f32x4(c[0], c[1], 0x88),
                         _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
    __m512 d1 = LANES_OP(_mm512_shuffle_f32x4(c[2], c[3], 0x88),
                         _mm512_shuffle_f32x4(c[2], c[3], 0xDD));
    return LANES_OP(_mm512_shuffle_f32x4(d0, d1, 0x88), _mm512_shuffle_f32x4(d0, d1, 0xDD));
    #undef LANES_OP
}

static inline __m512 sums16(const __m512 a[16]) { return lanes16_ps(a, 0); }
static inline __m512 max16_ps(const __m512 a[16]) { return lanes16_ps(a, 1); }

static inline __m512 round_lanes(__m512 x) {  /* to bf16 (nearest even) and back */
    return widen_bf16((__m256i)_mm512_cvtneps_pbh(x));
}

/* x sigmoid(x), sigmoid from e^-|x|: ops.c's silu_mul and qgemm_amx.c's
   tiled_gemm_silu, the same bits. */
static inline __m512 silu_lanes(__m512 x) {
    __m512 minus_abs = _mm512_castsi512_ps(_mm512_or_si512(
        _mm512_castps_si512(x), _mm512_set1_epi32((int)0x80000000)));
    __m512 e = exp16(minus_abs), one = _mm512_set1_ps(1.0f);
    __mmask16 positive = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GE_OQ);
    return _mm512_mul_ps(x, _mm512_div_ps(_mm512_mask_blend_ps(positive, e, one),
                                          _mm512_add_ps(one, e)));
}
#endif

/* x[p] = e^(x[p] - max x) in place; returns their sum (the attention kernels'
   softmax numerators). */
static inline float exps(float *x, int len) {
    float top = -INFINITY, total = 0.0f;
    int p = 0;
#ifdef __AVX512F__
    __m512 tops = _mm512_set1_ps(-INFINITY);
    for (; p < len; p += 16) {
        const __mmask16 here = first_lanes(len - p);
        tops = _mm512_mask_max_ps(tops, here, tops, _mm512_maskz_loadu_ps(here, x + p));
    }
    top = _mm512_reduce_max_ps(tops);
    p = 0;
    __m512 max16 = _mm512_set1_ps(top), sum16 = _mm512_setzero_ps();
    for (; p < len; p += 16) {  /* the tail in masked lanes */
        const __mmask16 here = first_lanes(len - p);
        __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(here, x + p), max16));
        e = _mm512_maskz_mov_ps(here, e);
        _mm512_mask_storeu_ps(x + p, here, e);
        sum16 = _mm512_add_ps(sum16, e);
    }
    total = _mm512_reduce_add_ps(sum16);
#else
    for (; p < len; p++) top = x[p] > top ? x[p] : top;
    p = 0;
    __m256 max = _mm256_set1_ps(top), sum = _mm256_setzero_ps();
    for (; p + 8 <= len; p += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + p), max));
        _mm256_storeu_ps(x + p, e);
        sum = _mm256_add_ps(sum, e);
    }
    for (; p < len; p++) total += x[p] = expf(x[p] - top);
    float lanes[8];
    _mm256_storeu_ps(lanes, sum);
    for (int i = 0; i < 8; i++) total += lanes[i];
#endif
    return total;
}

static inline float bf16_to_float(uint16_t half) {
    uint32_t bits = (uint32_t)half << 16;
    float x;
    memcpy(&x, &bits, 4);
    return x;
}

static inline uint16_t float_to_bf16(float x) {  /* round to nearest even */
    uint32_t bits;
    memcpy(&bits, &x, 4);
    return (uint16_t)((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

/* x as bf16 would hold it, or x itself for fp32 */
static inline float rounded(float x, int bf16) {
    return bf16 ? bf16_to_float(float_to_bf16(x)) : x;
}

static inline void load_row(const void *src, int bf16, float *dst, int n) {
    if (!bf16) {
        for (int i = 0; i < n; i++) dst[i] = ((const float *)src)[i];
        return;
    }
    for (int i = 0; i < n; i++) dst[i] = bf16_to_float(((const uint16_t *)src)[i]);
}

static inline void store_row(const float *src, int bf16, void *dst, int n) {
    if (!bf16) {
        for (int i = 0; i < n; i++) ((float *)dst)[i] = src[i];
        return;
    }
    for (int i = 0; i < n; i++) ((uint16_t *)dst)[i] = float_to_bf16(src[i]);
}

#ifdef __AVX512F__
/* Greedy sampling's lm_head (mode ARGMAX of a kernel's bf16/fp32 output flag, y a
   Best): each thread keeps every row's largest output so far and its column (the
   first of equals: torch's argmax); best_finish picks across threads. The logits
   are never written (64 rows x 49152 fp32: 12.6 MB to write, then read again by
   the argmax). qgemm_amx.c and qgemm_vnni.c. */
enum { ARGMAX = 2 };
typedef struct { float *value; int32_t *at; int rows, threads; } Best;

static inline Best best_alloc(int rows) {
    Best b = {0, 0, rows, omp_get_max_threads()};
    b.value = malloc(sizeof(float) * b.threads * rows);
    b.at = malloc(sizeof(int32_t) * b.threads * rows);
    for (int i = 0; i < b.threads * rows; i++)
        b.value[i] = -INFINITY, b.at[i] = INT32_MAX;
    return b;
}

/* *best, *at: the largest of v (columns n0..n0 + 15), where it beats *best or
   ties it at a lower column. */
static inline void keep_best(__m512 v, int n0, float *best, int32_t *at) {
    const float top = _mm512_reduce_max_ps(v);
    if (top < *best)
        return;
    const __mmask16 ties = _mm512_cmp_ps_mask(v, _mm512_set1_ps(top), _CMP_EQ_OQ);
    const int column = n0 + (ties ? __builtin_ctz(ties) : 0);
    if (top > *best || column < *at)
        *best = top, *at = column;
}

/* out[r]: the column of row r's largest output over every thread's; frees b. */
static inline void best_finish(Best *b, int64_t *out) {
    for (int r = 0; r < b->rows; r++) {
        float top = -INFINITY;
        int32_t at = INT32_MAX;
        for (int t = 0; t < b->threads; t++) {
            const float v = b->value[t * b->rows + r];
            const int32_t c = b->at[t * b->rows + r];
            if (v > top || (v == top && c < at))
                top = v, at = c;
        }
        out[r] = at == INT32_MAX ? 0 : at;
    }
    free(b->value);
    free(b->at);
}
#endif

/* A layer's 8-bit keys or values (paged_int8.c, and paged_attention.c's AVX2
   loop): levels [kv_heads, cache_slots, dim], scales [kv_heads, cache_slots]
   (paged.InPlace builds one for each). */
typedef struct { void *levels; float *scales; } Int8Cache;

/* A parallel region's blocks of work, shared out by stealing: each thread
   takes its own contiguous range from the front and, when done, the other
   threads' last blocks from the back. The OS preempts one of the engine's
   threads whenever the tier's other processes run (2 cores here); with fixed
   shares the region then waits for the whole of that thread's share, here
   for the block it holds at most. Each thread keeps streaming its own range
   in order. One Span per thread (a cache line each): next | end << 32. */
typedef struct { _Atomic uint64_t span; char pad[56]; } Span;

/* This thread's range of `blocks`; a barrier must follow before any thread takes. */
static inline void span_init(Span *spans, int blocks) {
    const int t = omp_get_thread_num(), threads = omp_get_num_threads();
    const uint64_t first = (uint64_t)blocks * t / threads;
    const uint64_t end = (uint64_t)blocks * (t + 1) / threads;
    atomic_store_explicit(&spans[t].span, first | end << 32, memory_order_relaxed);
}

static inline int span_take(Span *s, int from_back) {
    uint64_t v = atomic_load_explicit(&s->span, memory_order_relaxed);
    while ((uint32_t)v < (uint32_t)(v >> 32)) {
        uint64_t taken = from_back ? v - ((uint64_t)1 << 32) : v + 1;
        if (atomic_compare_exchange_weak_explicit(&s->span, &v, taken, memory_order_relaxed,
                                                  memory_order_relaxed))
            return from_back ? (int)(v >> 32) - 1 : (int)(uint32_t)v;
    }
    return -1;
}

/* The next block this thread runs, or -1 when none is left; `from` (0 at the
   start) is the thread it takes from, counted from itself. */
static inline int span_next(Span *spans, int *from) {
    const int t = omp_get_thread_num(), threads = omp_get_num_threads();
    for (; *from < threads; ++*from) {
        int block = span_take(spans + (t + *from) % threads, *from > 0);
        if (block >= 0)
            return block;
    }
    return -1;
}

/* The four exported int8-activation matmuls of a file (qgemm_vnni.c with SUFFIX
   vnni and x uint16_t, qgemm_avx2.c with avx2 and void): q4 and q8, plain and
   fine. Each quantizes x into its own buffers (the file's `quantize`, a row a
   call: GROUP its group size), then runs the file's `column` on blocks of
   LANES outputs taken by stealing (Span above: paired engine steps at 64 rows
   took 0.95x the time of fixed shares with the host quiet, 0.89x beside a
   process busy 20% of a core, 0.96x at 1 row, AMD Zen 4), in a parallel
   region of its own, so that the region is compiled with its BITS and FINE
   (one region for all four made them run-time values: 1.75x the time at 16
   rows on an AMD Zen 3). */
#define INT8_GEMM(NAME, X, BITS, FINE)                                                     \
void NAME(const X *x, int M, int K, const uint8_t *w, void *y, int bf16, int N) {          \
    const int stride = (FINE ? 2 : 1) * K, G = K / GROUP;                                  \
    int8_t *q = malloc((size_t)M * stride);                                                \
    float *xs = malloc(sizeof(float) * 2 * (size_t)M * G);                                 \
    Span *spans = aligned_alloc(64, sizeof(Span) * omp_get_max_threads());                 \
    _Pragma("omp parallel")                                                                \
    {                                                                                      \
        span_init(spans, N / LANES);                                                       \
        /* its barrier: every span is set, every row quantized */                          \
        _Pragma("omp for schedule(static)")                                                \
        for (int m = 0; m < M; m++)                                                        \
            quantize(x, m, K, bf16, q + (int64_t)m * stride, xs + (int64_t)m * 2 * G, BITS, FINE); \
        for (int from = 0, b; (b = span_next(spans, &from)) >= 0;)                         \
            column(q, xs, M, K, w, y, bf16, N, b * LANES, BITS, FINE);                     \
    }                                                                                      \
    free(q);                                                                               \
    free(xs);                                                                              \
    free(spans);                                                                           \
}
#define INT8_GEMMS(SUFFIX, X)                                                              \
    INT8_GEMM(q4_gemm_##SUFFIX, X, 4, 0)                                                   \
    INT8_GEMM(q8_gemm_##SUFFIX, X, 8, 0)                                                   \
    INT8_GEMM(q4_gemm_##SUFFIX##_fine, X, 4, 1)                                            \
    INT8_GEMM(q8_gemm_##SUFFIX##_fine, X, 8, 1)

#endif
