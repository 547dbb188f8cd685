/* Attention on the CPU over the paged KV cache of attention.py ("HND": per
   layer [kv_heads, slots, dim], a block of block_size slots holding consecutive
   positions): one query row per token, with its own length and block table (a
   decode's token, or each token of a prefill chunk, which sees its sequence up
   to itself), keys and values read in place, so nothing is gathered. The cache is fp32
   or bf16, or (paged_decode_int8) 8-bit levels in paged_int8.c's format where the
   CPU lacks that file's VNNI: each level widened to fp32 as bf16 is, a key's scale
   applied to its score and a value's to its softmax weight. Each (sequence, kv
   head) is one task; its group of query heads, up to 3 at a time, shares every key
   and value it reads. AVX2 and FMA; dim a multiple of 8. It also writes the step's
   new keys and values, which saves torch four ops a layer. */

#include <math.h>
#include <omp.h>
#include <stdlib.h>

#include "kernels.h"

/* uint32 words a head's bf16 pairs of `len` softmax numerators take, a 64-byte
   store at a time (attention_avx512.h's bf16_pairs) */
static inline int pair_stride(int len) { return (len + 31) / 32 * 16; }

#ifdef __AVX512BF16__
#include "attention_avx512.h"
#endif

/* The 8 horizontal sums of a[0..7], in order, as one vector. */
static inline __m256 sums8(const __m256 a[8]) {
    __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                         _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* What a cached row holds: fp32, bf16, or 8-bit levels (a key's + 128 as u8, a
   value's as s8). */
enum { F32 = 0, BF16 = 1, U8 = 2, S8 = 3 };

/* 8 values of a cached row as fp32 (levels as they are: a key's still + 128) */
static inline __m256 load8(const void *row, int d, const int KIND) {
    if (KIND == BF16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(
            _mm_loadu_si128((const __m128i *)((const uint16_t *)row + d))), 16));
    if (KIND == U8 || KIND == S8) {
        __m128i bytes = _mm_loadl_epi64((const __m128i *)((const uint8_t *)row + d));
        return _mm256_cvtepi32_ps(KIND == U8 ? _mm256_cvtepu8_epi32(bytes)
                                             : _mm256_cvtepi8_epi32(bytes));
    }
    return _mm256_loadu_ps((const float *)row + d);
}

static inline float dot(const float *q, const void *k, int dim, const int KIND) {
    __m256 s = _mm256_setzero_ps();
    for (int d = 0; d < dim; d += 8)
        s = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), load8(k, d, KIND), s);
    __m256 z = _mm256_setzero_ps(), one[8] = {s, z, z, z, z, z, z, z};
    return _mm256_cvtss_f32(sums8(one));
}

/* The 4 horizontal sums of a[0..3], in order. */
static inline __m128 sums4(const __m256 a[4]) {
    __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    return _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
}

/* score[g * len + p] = scale * q[g] . keys[p] for GC query heads at once, so each
   key is read (and widened) once for all of them; 4 keys at a time. U8 keys:
   (q[g] . levels - offsets[g]) * key_scales[p], offsets[g] 128 * sum q[g]. */
static inline __attribute__((always_inline)) void scores(
        const float *q, const void *const *keys, int len, int dim, float scale, float *score,
        const int KIND, const int GC, const float *key_scales, const float *offsets) {
    int p = 0;
    for (; p + 4 <= len; p += 4) {
        __m256 acc[3][4];
        #pragma GCC unroll 3
        for (int g = 0; g < GC; g++)
            #pragma GCC unroll 4
            for (int j = 0; j < 4; j++) acc[g][j] = _mm256_setzero_ps();
        for (int d = 0; d < dim; d += 8) {
            __m256 k[4];
            #pragma GCC unroll 4
            for (int j = 0; j < 4; j++) k[j] = load8(keys[p + j], d, KIND);
            #pragma GCC unroll 3
            for (int g = 0; g < GC; g++) {
                __m256 qd = _mm256_loadu_ps(q + g * dim + d);
                #pragma GCC unroll 4
                for (int j = 0; j < 4; j++) acc[g][j] = _mm256_fmadd_ps(qd, k[j], acc[g][j]);
            }
        }
        #pragma GCC unroll 3
        for (int g = 0; g < GC; g++) {
            __m128 s = _mm_mul_ps(sums4(acc[g]), _mm_set1_ps(scale));
            if (KIND == U8)
                s = _mm_mul_ps(_mm_sub_ps(s, _mm_set1_ps(scale * offsets[g])),
                               _mm_loadu_ps(key_scales + p));
            _mm_storeu_ps(score + g * len + p, s);
        }
    }
    for (; p < len; p++)
        for (int g = 0; g < GC; g++) {
            const float s = dot(q + g * dim, keys[p], dim, KIND);
            score[g * len + p] = KIND == U8 ? scale * (s - offsets[g]) * key_scales[p] : scale * s;
        }
}

/* out[g] = sum_p weight[g * len + p] values[p] for GC heads at once, 8 dims at a
   time, 2 positions in flight. */
static inline __attribute__((always_inline)) void weighted_sum(
        const float *weight, const void *const *values, int len, int dim, float *out,
        const int KIND, const int GC) {
    for (int d = 0; d < dim; d += 8) {
        __m256 acc[3][2];
        #pragma GCC unroll 3
        for (int g = 0; g < GC; g++) acc[g][0] = acc[g][1] = _mm256_setzero_ps();
        int p = 0;
        for (; p + 2 <= len; p += 2) {
            __m256 v0 = load8(values[p], d, KIND), v1 = load8(values[p + 1], d, KIND);
            #pragma GCC unroll 3
            for (int g = 0; g < GC; g++) {
                const float *w = weight + g * len + p;
                acc[g][0] = _mm256_fmadd_ps(_mm256_set1_ps(w[0]), v0, acc[g][0]);
                acc[g][1] = _mm256_fmadd_ps(_mm256_set1_ps(w[1]), v1, acc[g][1]);
            }
        }
        for (; p < len; p++) {
            __m256 v0 = load8(values[p], d, KIND);
            for (int g = 0; g < GC; g++)
                acc[g][0] = _mm256_fmadd_ps(_mm256_set1_ps(weight[g * len + p]), v0, acc[g][0]);
        }
        #pragma GCC unroll 3
        for (int g = 0; g < GC; g++)
            _mm256_storeu_ps(out + g * dim + d, _mm256_add_ps(acc[g][0], acc[g][1]));
    }
}

static void softmax(float *x, int len, const float *value_scales);

/* The scales of an 8-bit task's keys and values (each [len]), and its heads'
   offsets (scores' U8), for attend; NULL for fp32 and bf16. */
typedef struct { const float *keys, *values; float offsets[3]; } Scales;

/* GC query heads (q [GC, dim] fp32) against one kv head: out [GC, dim].
   `pairs`: room for the AVX-512 build's bf16 weights (bf16_pairs). KIND: the
   cache's keys' (F32, BF16 or U8; a U8 cache's values are S8). */
static inline __attribute__((always_inline)) void attend(
        const float *q, const void *const *keys, const void *const *values, int len, int dim,
        float scale, float *weight, uint32_t *pairs, float *out, const int KIND,
        const int GC, const Scales *scales) {
#ifdef __AVX512BF16__
    if (KIND == BF16 && (dim == 64 || dim == 128)) {
        if (dim == 64) scores_bf16(q, keys, values, len, scale, weight, GC, 64);
        else scores_bf16(q, keys, values, len, scale, weight, GC, 128);
        float inverse[3];
        for (int g = 0; g < GC; g++) inverse[g] = 1.0f / exps(weight + g * len, len);
        bf16_pairs(weight, len, pairs, GC);
        if (dim == 64) weighted_sum_bf16(pairs, inverse, values, len, out, GC, 64);
        else weighted_sum_bf16(pairs, inverse, values, len, out, GC, 128);
        return;
    }
#else
    (void)pairs;
#endif
    const int U8_CACHE = KIND == U8;
    scores(q, keys, len, dim, scale, weight, KIND, GC, U8_CACHE ? scales->keys : NULL,
           U8_CACHE ? scales->offsets : NULL);
    for (int g = 0; g < GC; g++) softmax(weight + g * len, len, U8_CACHE ? scales->values : NULL);
    weighted_sum(weight, values, len, dim, out, U8_CACHE ? S8 : KIND, GC);
}

/* x made its softmax, times each position's value scale where there are any */
static void softmax(float *x, int len, const float *value_scales) {
    const float inverse = 1.0f / exps(x, len);
    if (value_scales)
        for (int p = 0; p < len; p++) x[p] *= inverse * value_scales[p];
    else
        for (int p = 0; p < len; p++) x[p] *= inverse;
}

/* The first PREFETCH_SLOTS keys and values of a task (k_head, v_head: its kv
   head's rows), and an 8-bit cache's scales (ks_head, vs_head; else NULL), to
   L2: the whole of the next task at the contexts of a chat (at 64 decodes of 57
   positions, a 30-layer step's attention took 0.8x the time of 32 slots). */
enum { PREFETCH_SLOTS = 128 };
static void prefetch_task(const char *k_head, const char *v_head, const float *ks_head,
                          const float *vs_head, size_t row_bytes, const int32_t *table, int len,
                          int block_size) {
    for (int p = 0; p < len && p < PREFETCH_SLOTS; p += block_size) {
        const size_t slot = (size_t)table[p / block_size] * block_size;
        if (ks_head) {
            _mm_prefetch((const char *)(ks_head + slot), _MM_HINT_T1);
            _mm_prefetch((const char *)(vs_head + slot), _MM_HINT_T1);
        }
        const size_t bytes = (size_t)(len - p < block_size ? len - p : block_size) * row_bytes;
        for (size_t line = 0; line < bytes; line += 64) {
            _mm_prefetch(k_head + slot * row_bytes + line, _MM_HINT_T1);
            _mm_prefetch(v_head + slot * row_bytes + line, _MM_HINT_T1);
        }
    }
}

/* x [dim] (bf16 or fp32) rounded to levels of its max |x| / 127, plus `offset`
   (128: a key's u8), into `to`; returns the scale (paged_int8.c's format). */
static float quantize_row(const void *x, int bf16, int dim, int offset, uint8_t *to) {
    float row[dim], amax = 0.0f;
    load_row(x, bf16, row, dim);
    for (int d = 0; d < dim; d++) amax = fmaxf(amax, fabsf(row[d]));
    const float inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
    for (int d = 0; d < dim; d++) to[d] = (uint8_t)((int)lrintf(row[d] * inverse) + offset);
    return amax / 127.0f;
}

/* The `bf16` argument's modes: q, k, v, out and the caches all fp32 (0) or
   all bf16 (1); or q, k, v and out fp32 and the caches bf16 (an fp32 model's
   bf16 cache: the new keys and values rounded to nearest even as written). */
enum { ALL_FP32 = 0, ALL_BF16 = 1, CACHE_BF16 = 2 };

/* paged_decode's work on either cache: KIND F32, BF16 or U8 (an 8-bit one,
   k_cache and v_cache Int8Caches); `bf16`: q, k, v and out's dtype. */
static inline __attribute__((always_inline)) void decode(
        const void *q, int64_t q_stride, const void *k, int64_t k_stride, const void *v,
        int64_t v_stride, int bf16, int rows, const int64_t *slots, int batch, int heads,
        int kv_heads, int dim, void *k_cache, void *v_cache, int64_t cache_slots,
        const int32_t *tables, int table_width, const int32_t *lengths, int block_size,
        float scale, void *out, const int KIND) {
    const int INT8 = KIND == U8;
    float *k_scales = INT8 ? ((Int8Cache *)k_cache)->scales : NULL;
    float *v_scales = INT8 ? ((Int8Cache *)v_cache)->scales : NULL;
    if (INT8) {
        k_cache = ((Int8Cache *)k_cache)->levels;
        v_cache = ((Int8Cache *)v_cache)->levels;
    }
    const int group = heads / kv_heads, width = bf16 ? 2 : 4;
    const size_t row_bytes = (size_t)(KIND == F32 ? 4 : KIND == BF16 ? 2 : 1) * dim;
    Span *spans = aligned_alloc(64, sizeof(Span) * omp_get_max_threads());
    /* one decode's few heads cost less than waking the second thread */
    #pragma omp parallel if (batch * kv_heads > 4 || rows > 64)
    {
        #pragma omp for collapse(2) schedule(static)
        for (int t = 0; t < rows; t++)
            for (int h = 0; h < kv_heads; h++) {
                const int64_t slot = (int64_t)h * cache_slots + slots[t], at = slot * row_bytes;
                const char *k_row = (const char *)k + width * (t * k_stride + (int64_t)h * dim);
                const char *v_row = (const char *)v + width * (t * v_stride + (int64_t)h * dim);
                if (INT8) {
                    k_scales[slot] = quantize_row(k_row, bf16, dim, 128, (uint8_t *)k_cache + at);
                    v_scales[slot] = quantize_row(v_row, bf16, dim, 0, (uint8_t *)v_cache + at);
                } else if (KIND == BF16 && !bf16) {
                    store_row((const float *)k_row, 1, (char *)k_cache + at, dim);
                    store_row((const float *)v_row, 1, (char *)v_cache + at, dim);
                } else {
                    memcpy((char *)k_cache + at, k_row, row_bytes);
                    memcpy((char *)v_cache + at, v_row, row_bytes);
                }
            }
        /* whole sequences, each thread a contiguous range taken in order, so that it
           knows its next task and starts its keys and values on their way from
           memory (a dynamic schedule without that prefetch: 1.4x the time at 64
           decodes); a thread done with its own takes the others' last ones
           (kernels.h's Span), so one the OS preempts holds up the other less */
        span_init(spans, batch);
        #pragma omp barrier
        for (int from = 0, b; (b = span_next(spans, &from)) >= 0;) {
            for (int h = 0; h < kv_heads; h++) {
                const int next_b = h + 1 < kv_heads ? b : b + 1, next_h = (h + 1) % kv_heads;
                if (next_b < batch)
                    prefetch_task((const char *)k_cache + (size_t)next_h * cache_slots * row_bytes,
                                  (const char *)v_cache + (size_t)next_h * cache_slots * row_bytes,
                                  INT8 ? k_scales + (size_t)next_h * cache_slots : NULL,
                                  INT8 ? v_scales + (size_t)next_h * cache_slots : NULL,
                                  row_bytes, tables + (int64_t)next_b * table_width,
                                  lengths[next_b], block_size);
                const int len = lengths[b];
                const int32_t *table = tables + (int64_t)b * table_width;
                /* on the stack up to 2048 positions (64 KB at a group of 3) */
                const int on_heap = len > 2048, room = on_heap ? len : 2048;
                const size_t pointers = 2 * (size_t)room;
                const size_t pair_words = 6 * (size_t)pair_stride(room);  /* hi, lo: 3 heads */
                const size_t floats = (size_t)group * (room + 2 * dim) + pair_words +
                                      (INT8 ? 2 * (size_t)room : 0);
                const void *stack_pointers[on_heap ? 1 : pointers];
                float stack_floats[on_heap ? 1 : floats];
                const void **keys = on_heap ? malloc(sizeof(void *) * pointers) : stack_pointers;
                const void **values = keys + len;
                float *weight = on_heap ? malloc(sizeof(float) * floats) : stack_floats;
                float *query = weight + (size_t)group * len, *result = query + group * dim;
                uint32_t *pairs = (uint32_t *)(result + group * dim);
                float *key_scales = (float *)pairs + pair_words, *value_scales = key_scales + len;
                Scales task = {key_scales, value_scales, {0}};
                const char *k_head = (const char *)k_cache + (size_t)h * cache_slots * row_bytes;
                const char *v_head = (const char *)v_cache + (size_t)h * cache_slots * row_bytes;
                for (int p = 0; p < len; p += block_size) {  /* a block's slots are in a row */
                    const size_t slot = (size_t)table[p / block_size] * block_size;
                    const int here = len - p < block_size ? len - p : block_size;
                    for (int i = 0; i < here; i++) {
                        keys[p + i] = k_head + (slot + i) * row_bytes;
                        values[p + i] = v_head + (slot + i) * row_bytes;
                        if (INT8) {
                            key_scales[p + i] = k_scales[h * cache_slots + slot + i];
                            value_scales[p + i] = v_scales[h * cache_slots + slot + i];
                        }
                    }
                }
                const int64_t head = (int64_t)h * group;
                for (int g = 0; g < group; g++)
                    load_row((const char *)q + width * (b * q_stride + (head + g) * dim), bf16,
                             query + g * dim, dim);
                for (int g = 0; g < group; g += 3) {  /* up to 3 heads per pass */
                    const int n = group - g < 3 ? group - g : 3;
                    const float *qg = query + g * dim;
                    float *rg = result + g * dim;
                    if (INT8)
                        for (int i = 0; i < n; i++) {
                            float total = 0.0f;
                            for (int d = 0; d < dim; d++) total += qg[i * dim + d];
                            task.offsets[i] = 128.0f * total;
                        }
                    #define ATTEND(GC) attend(qg, keys, values, len, dim, scale, weight, pairs, \
                                              rg, KIND, GC, &task)
                    if (n == 3) ATTEND(3); else if (n == 2) ATTEND(2); else ATTEND(1);
                    #undef ATTEND
                }
                store_row(result, bf16, (char *)out + width * ((int64_t)b * heads + head) * dim,
                          group * dim);
                if (on_heap) {
                    free(keys);
                    free(weight);
                }
            }
        }
    }
    free(spans);
}

/* One layer's step: the new keys and values of all `rows` tokens written to
   their slots, then attention for the first `batch` rows (one-token decodes)
   into out [batch, heads * dim]. q [rows, heads, dim], k and v [rows, kv_heads,
   dim]: rows `*_stride` elements apart, heads `dim` apart; dtypes as `bf16`
   says (its modes above). */
void paged_decode(const void *q, int64_t q_stride, const void *k, int64_t k_stride,
                  const void *v, int64_t v_stride, int bf16, int rows, const int64_t *slots,
                  int batch, int heads, int kv_heads, int dim, void *k_cache, void *v_cache,
                  int64_t cache_slots, const int32_t *tables, int table_width,
                  const int32_t *lengths, int block_size, float scale, void *out) {
    #define DECODE(KIND) decode(q, q_stride, k, k_stride, v, v_stride, bf16 == ALL_BF16, rows, \
                                slots, batch, heads, kv_heads, dim, k_cache, v_cache, \
                                cache_slots, tables, table_width, lengths, block_size, scale, \
                                out, KIND)
    if (bf16 == ALL_FP32) DECODE(F32); else DECODE(BF16);
}

/* paged_decode over an 8-bit cache (k_cache and v_cache Int8Caches), q, k, v
   and out all bf16 if `bf16`, else fp32: paged_int8.c's paged_decode_int8, for
   CPUs without its VNNI. */
void paged_decode_int8(const void *q, int64_t q_stride, const void *k, int64_t k_stride,
                       const void *v, int64_t v_stride, int bf16, int rows,
                       const int64_t *slots, int batch, int heads, int kv_heads, int dim,
                       void *k_cache, void *v_cache, int64_t cache_slots,
                       const int32_t *tables, int table_width, const int32_t *lengths,
                       int block_size, float scale, void *out) {
    DECODE(U8);
    #undef DECODE
}
