/* paged_attention.c's step over an 8-bit KV cache (--kv-cache-dtype int8),
   on AVX-512 VNNI: half the bytes of bf16 to read, and attention at a chat's
   contexts is bound by reading them. Per layer the cache is [kv_heads, slots,
   dim] of levels, with an fp32 scale per slot and head beside it:
   - key = scale * level, the level stored as level + 128 (u8; levels -127..127);
   - value = scale * level, stored as the level (s8).
   The step's new keys and values are rounded to 127 levels of their own max |x|.
   Scores: each query head rounded to 14 bits (q ~ sq * (128 a + b), a and b
   int8: qgemm_vnni.c's fine split), so q . key is two vpdpbusd chains a 64
   dims, exact in int32, less 128 sum q for the stored offset. Weighted sum:
   each head's softmax numerators times the values' scales, rounded to 16 bits
   of their max (two u8 parts), against the values of 4 positions interleaved
   (vpunpck*), 4 products a lane a vpdpbusd. Only the keys' and values' own
   rounding is an error of note: the queries' is under 1/32512 of their max,
   the weights' under 1/131070 of theirs. dim 64, 128 or 256 (kv_dtype checks). */

#include <math.h>

#include "kernels.h"

enum { FINE_LEVELS = 127 * 128, WEIGHT_LEVELS = 65535, PREFETCH_SLOTS = 128 };

/* 16 fp32 of x at d, from bf16 or fp32 */
static inline __m512 load16(const void *x, int d, int bf16) {
    if (bf16)
        return widen_bf16(_mm256_loadu_si256((const __m256i *)((const uint16_t *)x + d)));
    return _mm512_loadu_ps((const float *)x + d);
}

/* x [dim] (bf16 or fp32) rounded to levels of its max |x| / 127 into `to`,
   plus `offset` (128: the keys' u8); returns the scale. */
static float quantize_row(const void *x, int bf16, int dim, int offset, uint8_t *to) {
    __m512 top = _mm512_setzero_ps();
    for (int d = 0; d < dim; d += 16) top = _mm512_max_ps(top, _mm512_abs_ps(load16(x, d, bf16)));
    const float amax = _mm512_reduce_max_ps(top);
    const __m512 inverse = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    for (int d = 0; d < dim; d += 16) {
        __m512i level = _mm512_cvtps_epi32(_mm512_mul_ps(load16(x, d, bf16), inverse));
        level = _mm512_add_epi32(level, _mm512_set1_epi32(offset));
        _mm_storeu_si128((__m128i *)(to + d), _mm512_cvtepi32_epi8(level));
    }
    return amax / 127.0f;
}

/* A query head q [dim] fp32 as its fine split: parts[0..dim) a, [dim..2 dim) b;
   returns sq, and sum (128 a + b) in *sum. */
static float split_query(const float *q, int dim, int8_t *parts, int32_t *sum) {
    __m512 top = _mm512_setzero_ps();
    for (int d = 0; d < dim; d += 16) top = _mm512_max_ps(top, _mm512_abs_ps(_mm512_loadu_ps(q + d)));
    const float amax = _mm512_reduce_max_ps(top);
    const __m512 inverse = _mm512_set1_ps(amax > 0.0f ? FINE_LEVELS / amax : 0.0f);
    __m512i total = _mm512_setzero_si512();
    for (int d = 0; d < dim; d += 16) {
        __m512i level = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(q + d), inverse));
        __m512i a = _mm512_srai_epi32(_mm512_add_epi32(level, _mm512_set1_epi32(64)), 7);
        __m512i b = _mm512_sub_epi32(level, _mm512_slli_epi32(a, 7));
        _mm_storeu_si128((__m128i *)(parts + d), _mm512_cvtepi32_epi8(a));
        _mm_storeu_si128((__m128i *)(parts + dim + d), _mm512_cvtepi32_epi8(b));
        total = _mm512_add_epi32(total, level);
    }
    *sum = _mm512_reduce_add_epi32(total);
    return amax / FINE_LEVELS;
}

/* score[p] = scale * q . key p, 16 keys at a time (parts: split_query's);
   returns the largest. `fetch`: prefetch the next keys and these values, for
   the first of a kv head's query heads only (the others find them in L1: a
   third of the loop's instructions, repeated; 64-row decode steps 0.996x,
   16 waves paired, AMD Zen 4). */
static inline __attribute__((always_inline)) float scores_int8(
        const int8_t *parts, float sq, int32_t sum, const uint8_t *const *keys,
        const int8_t *const *values, const float *key_scales, int len, float scale,
        float *score, int fetch, const int DIM) {
    const __m512i offset = _mm512_set1_epi32(128 * sum);
    const __m512 unit = _mm512_set1_ps(sq * scale);
    __m512i a[DIM / 64], b[DIM / 64];
    #pragma GCC unroll 2
    for (int c = 0; c < DIM / 64; c++) {
        a[c] = _mm512_loadu_si512(parts + 64 * c);
        b[c] = _mm512_loadu_si512(parts + DIM + 64 * c);
    }
    __m512 tops = _mm512_set1_ps(-INFINITY);
    for (int p = 0; p < len; p += 16) {
        const int n = len - p < 16 ? len - p : 16;
        if (fetch) {
            for (int j = p + 16; j < p + 32 && j < len; j++)  /* the next 16, meanwhile */
                #pragma GCC unroll 2
                for (int line = 0; line < DIM; line += 64)
                    _mm_prefetch((const char *)keys[j] + line, _MM_HINT_T0);
            for (int j = p; j < p + 16 && j < len; j++)  /* this block's values, for later */
                #pragma GCC unroll 2
                for (int line = 0; line < DIM; line += 64)
                    _mm_prefetch((const char *)values[j] + line, _MM_HINT_T1);
        }
        __m512i acc[16];
        #pragma GCC unroll 16
        for (int j = 0; j < 16; j++) {
            acc[j] = _mm512_setzero_si512();
            if (j >= n) continue;
            const uint8_t *k = keys[p + j];
            #pragma GCC unroll 2
            for (int c = 0; c < DIM / 64; c++)
                acc[j] = _mm512_dpbusd_epi32(acc[j], _mm512_loadu_si512(k + 64 * c), a[c]);
            acc[j] = _mm512_slli_epi32(acc[j], 7);
            #pragma GCC unroll 2
            for (int c = 0; c < DIM / 64; c++)
                acc[j] = _mm512_dpbusd_epi32(acc[j], _mm512_loadu_si512(k + 64 * c), b[c]);
        }
        const __mmask16 here = first_lanes(n);
        __m512 dots = _mm512_cvtepi32_ps(_mm512_sub_epi32(sums16_epi32(acc), offset));
        __m512 scales = _mm512_maskz_loadu_ps(here, key_scales + p);
        const __m512 s = _mm512_mul_ps(_mm512_mul_ps(dots, unit), scales);
        _mm512_mask_storeu_ps(score + p, here, s);
        tops = _mm512_mask_max_ps(tops, here, tops, s);
    }
    return _mm512_reduce_max_ps(tops);
}

/* The scores of GC heads ([len] each, `stride` apart; head g's largest top[g])
   made e^(s - top[g]) in place, as kernels.h's exps makes them; inverse_sums[g]
   is 1 / their sum, amax[g] the largest times its value's scale (weight_words'
   range). One loop for the heads, so that their exps' long chains overlap: with
   scores_int8's max and this pass, 0.97x the attention's time at 64 rows of ~72
   keys hot in cache, exps apart per head (plus its own pass for the max, and
   weight_words' for amax). */
static inline __attribute__((always_inline)) void numerators(
        float *e, int stride, const float *value_scales, int len, const float *top,
        float *inverse_sums, float *amax, const int GC) {
    __m512 max16[3], sum16[3], tops[3];
    #pragma GCC unroll 3
    for (int g = 0; g < GC; g++) {
        max16[g] = _mm512_set1_ps(top[g]);
        sum16[g] = tops[g] = _mm512_setzero_ps();
    }
    for (int p = 0; p < len; p += 16) {
        const __mmask16 here = first_lanes(len - p);
        const __m512 vs = _mm512_maskz_loadu_ps(here, value_scales + p);
        #pragma GCC unroll 3
        for (int g = 0; g < GC; g++) {
            float *row = e + (size_t)g * stride;
            __m512 x = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(here, row + p), max16[g]));
            x = _mm512_maskz_mov_ps(here, x);
            _mm512_mask_storeu_ps(row + p, here, x);
            sum16[g] = _mm512_add_ps(sum16[g], x);
            tops[g] = _mm512_max_ps(tops[g], _mm512_mul_ps(x, vs));
        }
    }
    #pragma GCC unroll 3
    for (int g = 0; g < GC; g++) {
        amax[g] = _mm512_reduce_max_ps(tops[g]);
        inverse_sums[g] = 1.0f / _mm512_reduce_add_ps(sum16[g]);
    }
}

/* e [len] times the values' scales, rounded to 16 bits of their max (amax,
   from numerators): the high bytes of positions 4i..4i+3 in hi[i], the low
   ones in lo[i] (past len 0); returns the unit of a level. */
static float weight_words(const float *e, const float *value_scales, int len, float amax,
                          uint32_t *hi, uint32_t *lo) {
    const __m512 inverse = _mm512_set1_ps(amax > 0.0f ? WEIGHT_LEVELS / amax : 0.0f);
    for (int p = 0; p < len; p += 16) {  /* 16 positions: 4 words of each part */
        const __mmask16 here = first_lanes(len - p);
        __m512i level = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_mul_ps(
            _mm512_maskz_loadu_ps(here, e + p), _mm512_maskz_loadu_ps(here, value_scales + p)),
            inverse));
        __m128i high = _mm512_cvtepi32_epi8(_mm512_srli_epi32(level, 8));
        __m128i low = _mm512_cvtepi32_epi8(_mm512_and_si512(level, _mm512_set1_epi32(255)));
        _mm_storeu_si128((__m128i *)(hi + p / 4), high);
        _mm_storeu_si128((__m128i *)(lo + p / 4), low);
    }
    return amax / WEIGHT_LEVELS;
}

/* out[g] [dim] = sum_p weight[g, p] value[p] for GC heads, 64 dims at a time;
   words: each head's hi and lo weight words (weight_words), `stride` apart. */
static inline __attribute__((always_inline)) void weighted_sum_int8(
        const uint32_t *words, int stride, const float *units, const float *inverse_sums,
        const int8_t *const *values, int len, int dim, float *out, const int GC) {
    for (int c = 0; c < dim; c += 64) {
        __m512i acc[3][2][4];
        #pragma GCC unroll 3
        for (int g = 0; g < GC; g++)
            #pragma GCC unroll 2
            for (int part = 0; part < 2; part++)
                #pragma GCC unroll 4
                for (int i = 0; i < 4; i++) acc[g][part][i] = _mm512_setzero_si512();
        for (int p = 0; p < len; p += 4) {
            const int8_t *r[4];
            #pragma GCC unroll 4
            for (int j = 0; j < 4; j++) r[j] = values[p + j < len ? p + j : p] + c;  /* weight 0 */
            #pragma GCC unroll 4
            for (int j = p + 16; j < p + 20 && j < len; j++)  /* 16 positions ahead */
                _mm_prefetch((const char *)values[j] + c, _MM_HINT_T0);
            __m512i r0 = _mm512_loadu_si512(r[0]), r1 = _mm512_loadu_si512(r[1]);
            __m512i r2 = _mm512_loadu_si512(r[2]), r3 = _mm512_loadu_si512(r[3]);
            __m512i t0 = _mm512_unpacklo_epi8(r0, r1), t1 = _mm512_unpackhi_epi8(r0, r1);
            __m512i t2 = _mm512_unpacklo_epi8(r2, r3), t3 = _mm512_unpackhi_epi8(r2, r3);
            /* u[i], 32-bit element 4k + e: dim 16k + 4i + e of the 4 positions */
            __m512i u[4] = {_mm512_unpacklo_epi16(t0, t2), _mm512_unpackhi_epi16(t0, t2),
                            _mm512_unpacklo_epi16(t1, t3), _mm512_unpackhi_epi16(t1, t3)};
            #pragma GCC unroll 3
            for (int g = 0; g < GC; g++)
                #pragma GCC unroll 2
                for (int part = 0; part < 2; part++) {
                    const __m512i w = _mm512_set1_epi32((int)words[(2 * g + part) * stride + p / 4]);
                    #pragma GCC unroll 4
                    for (int i = 0; i < 4; i++)
                        acc[g][part][i] = _mm512_dpbusd_epi32(acc[g][part][i], w, u[i]);
                }
        }
        #pragma GCC unroll 3
        for (int g = 0; g < GC; g++) {
            const __m512 unit = _mm512_set1_ps(units[g] * inverse_sums[g]);
            __m512 a[4];
            #pragma GCC unroll 4
            for (int i = 0; i < 4; i++)
                a[i] = _mm512_mul_ps(unit, _mm512_fmadd_ps(
                    _mm512_cvtepi32_ps(acc[g][0][i]), _mm512_set1_ps(256.0f),
                    _mm512_cvtepi32_ps(acc[g][1][i])));
            /* dims in order: 128-bit quarter k of out = quarter k of a[0], a[1], a[2], a[3] */
            __m512 t0 = _mm512_shuffle_f32x4(a[0], a[1], 0x44), t1 = _mm512_shuffle_f32x4(a[2], a[3], 0x44);
            __m512 t2 = _mm512_shuffle_f32x4(a[0], a[1], 0xEE), t3 = _mm512_shuffle_f32x4(a[2], a[3], 0xEE);
            float *o = out + g * dim + c;
            _mm512_storeu_ps(o, _mm512_shuffle_f32x4(t0, t1, 0x88));
            _mm512_storeu_ps(o + 16, _mm512_shuffle_f32x4(t0, t1, 0xDD));
            _mm512_storeu_ps(o + 32, _mm512_shuffle_f32x4(t2, t3, 0x88));
            _mm512_storeu_ps(o + 48, _mm512_shuffle_f32x4(t2, t3, 0xDD));
        }
    }
}

/* The first keys and values of kv head h of sequence b, and their scales, to L2
   (as paged_attention.c). Unfetched, the scales' loads in paged_decode_int8
   waited for memory: 12% of perf's samples in the kernel, served at C=64. */
static void prefetch_task(const uint8_t *k_head, const int8_t *v_head, const float *ks_head,
                          const float *vs_head, int dim,
                          const int32_t *table, int len, int block_size) {
    for (int p = 0; p < len && p < PREFETCH_SLOTS; p += block_size) {
        const size_t slot = (size_t)table[p / block_size] * block_size;
        _mm_prefetch((const char *)(ks_head + slot), _MM_HINT_T1);
        _mm_prefetch((const char *)(vs_head + slot), _MM_HINT_T1);
        const size_t at = slot * dim;
        const size_t bytes = (size_t)(len - p < block_size ? len - p : block_size) * dim;
        for (size_t line = 0; line < bytes; line += 64) {
            _mm_prefetch((const char *)k_head + at + line, _MM_HINT_T1);
            _mm_prefetch((const char *)v_head + at + line, _MM_HINT_T1);
        }
    }
}

/* paged_decode's arguments and signature (so layers.c calls either), q, k, v
   and out all bf16 if `bf16`, else fp32; k_cache and v_cache are Int8Caches. */
void paged_decode_int8(const void *q, int64_t q_stride, const void *k, int64_t k_stride,
                       const void *v, int64_t v_stride, int bf16, int rows,
                       const int64_t *slots, int batch, int heads, int kv_heads, int dim,
                       void *k_int8, void *v_int8, int64_t cache_slots, const int32_t *tables,
                       int table_width, const int32_t *lengths, int block_size, float scale,
                       void *out) {
    uint8_t *k_cache = ((Int8Cache *)k_int8)->levels;
    int8_t *v_cache = ((Int8Cache *)v_int8)->levels;
    float *k_scales = ((Int8Cache *)k_int8)->scales, *v_scales = ((Int8Cache *)v_int8)->scales;
    const int group = heads / kv_heads, width = bf16 ? 2 : 4;
    int longest = 1;
    for (int b = 0; b < batch; b++) longest = lengths[b] > longest ? lengths[b] : longest;
    const int room = (longest + 15) / 16 * 16, words = room / 4;
    Span *spans = aligned_alloc(64, sizeof(Span) * omp_get_max_threads());
    #pragma omp parallel if (batch * kv_heads > 4 || rows > 64)
    {
        #pragma omp for collapse(2) schedule(static)
        for (int t = 0; t < rows; t++)
            for (int h = 0; h < kv_heads; h++) {
                const int64_t at = (int64_t)h * cache_slots + slots[t];
                k_scales[at] = quantize_row((const char *)k + width * (t * k_stride + h * dim),
                                            bf16, dim, 128, k_cache + at * dim);
                v_scales[at] = quantize_row((const char *)v + width * (t * v_stride + h * dim),
                                            bf16, dim, 0, (uint8_t *)v_cache + at * dim);
            }
        /* one scratch a thread, for the longest sequence */
        const size_t floats = (size_t)room * (2 + group) + (size_t)group * (2 * dim + 4);
        float *scratch = malloc(sizeof(float) * floats + sizeof(void *) * 2 * room +
                                sizeof(uint32_t) * 2 * group * words + 2 * group * dim);
        float *key_scales = scratch, *value_scales = key_scales + room;
        float *score = value_scales + room, *query = score + (size_t)group * room;
        float *result = query + group * dim, *units = result + group * dim;
        float *inverse_sums = units + group, *tops = inverse_sums + group, *amaxes = tops + group;
        const uint8_t **keys = (const uint8_t **)(amaxes + group);
        const int8_t **values = (const int8_t **)(keys + room);
        uint32_t *weights = (uint32_t *)(values + room);
        int8_t *parts = (int8_t *)(weights + 2 * group * words);
        span_init(spans, batch);
        #pragma omp barrier
        for (int from = 0, b; (b = span_next(spans, &from)) >= 0;) {
            const int len = lengths[b];
            const int32_t *table = tables + (int64_t)b * table_width;
            for (int h = 0; h < kv_heads; h++) {
                const uint8_t *k_head = k_cache + (size_t)h * cache_slots * dim;
                const int8_t *v_head = v_cache + (size_t)h * cache_slots * dim;
                const float *ks_head = k_scales + (size_t)h * cache_slots;
                const float *vs_head = v_scales + (size_t)h * cache_slots;
                const int next_b = h + 1 < kv_heads ? b : b + 1, next_h = (h + 1) % kv_heads;
                if (next_b < batch)
                    prefetch_task(k_cache + (size_t)next_h * cache_slots * dim,
                                  v_cache + (size_t)next_h * cache_slots * dim,
                                  k_scales + (size_t)next_h * cache_slots,
                                  v_scales + (size_t)next_h * cache_slots, dim,
                                  tables + (int64_t)next_b * table_width, lengths[next_b],
                                  block_size);
                for (int p = 0; p < len; p += block_size) {  /* a block's slots are in a row */
                    const size_t slot = (size_t)table[p / block_size] * block_size;
                    const int here = len - p < block_size ? len - p : block_size;
                    for (int i = 0; i < here; i++) {
                        keys[p + i] = k_head + (slot + i) * dim;
                        values[p + i] = v_head + (slot + i) * dim;
                        key_scales[p + i] = ks_head[slot + i];
                        value_scales[p + i] = vs_head[slot + i];
                    }
                }
                const int64_t head = (int64_t)h * group;
                for (int g = 0; g < group; g++) {
                    load_row((const char *)q + width * (b * q_stride + (head + g) * dim), bf16,
                             query + g * dim, dim);
                    int32_t sum;
                    const float sq = split_query(query + g * dim, dim, parts, &sum);
                    float *e = score + (size_t)g * room;
                    #define SCORES(DIM) scores_int8(parts, sq, sum, keys, values, key_scales, \
                                                    len, scale, e, g == 0, DIM)
                    tops[g] = dim == 64 ? SCORES(64) : dim == 128 ? SCORES(128) : SCORES(256);
                    #undef SCORES
                }
                for (int g = 0; g < group; g += 3) {  /* up to 3 heads a loop */
                    const int n = group - g < 3 ? group - g : 3;
                    #define NUM(GC) numerators(score + (size_t)g * room, room, value_scales, len, \
                                               tops + g, inverse_sums + g, amaxes + g, GC)
                    if (n == 3) NUM(3); else if (n == 2) NUM(2); else NUM(1);
                    #undef NUM
                }
                for (int g = 0; g < group; g++)
                    units[g] = weight_words(score + (size_t)g * room, value_scales, len, amaxes[g],
                                            weights + 2 * g * words, weights + (2 * g + 1) * words);
                for (int g = 0; g < group; g += 3) {  /* up to 3 heads a pass over the values */
                    const int n = group - g < 3 ? group - g : 3;
                    #define SUM(GC) weighted_sum_int8(weights + 2 * g * words, words, units + g, \
                                                    inverse_sums + g, values, len, dim, \
                                                    result + g * dim, GC)
                    if (n == 3) SUM(3); else if (n == 2) SUM(2); else SUM(1);
                    #undef SUM
                }
                store_row(result, bf16, (char *)out + width * ((int64_t)b * heads + head) * dim,
                          group * dim);
            }
        }
        free(scratch);
    }
    free(spans);
}
