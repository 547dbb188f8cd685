/* Decode attention on the CPU over the paged KV cache of attention.py ("HND":
   per layer [kv_heads, slots, dim], a block of block_size slots holding
   consecutive positions): one query token per sequence, its keys and values read
   in place through the block table, so nothing is gathered. The cache is fp32
   or (a bf16 model) bf16. Each (sequence, kv
   head) is one task; its group of query heads shares every key it reads. AVX2
   and FMA; dim a multiple of 8. It also writes the step's new keys and values,
   which saves torch four ops a layer. */

#include <math.h>
#include <stdlib.h>

#include "kernels.h"

/* The 8 horizontal sums of a[0..7], in order, as one vector. */
static inline __m256 sums8(const __m256 a[8]) {
    __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                         _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* 8 values of a cached row, bf16 or fp32, as fp32 */
static inline __m256 load8(const void *row, int d, const int BF16) {
    if (BF16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(
            _mm_loadu_si128((const __m128i *)((const uint16_t *)row + d))), 16));
    return _mm256_loadu_ps((const float *)row + d);
}

static inline float dot(const float *q, const void *k, int dim, const int BF16) {
    __m256 s = _mm256_setzero_ps();
    for (int d = 0; d < dim; d += 8)
        s = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), load8(k, d, BF16), s);
    __m256 z = _mm256_setzero_ps(), one[8] = {s, z, z, z, z, z, z, z};
    return _mm256_cvtss_f32(sums8(one));
}

/* score[p] = scale * q . keys[p] for p < len, 8 keys at a time. */
static inline __attribute__((always_inline)) void scores(
        const float *q, const void *const *keys, int len, int dim, float scale, float *score,
        const int BF16) {
    int p = 0;
    for (; p + 8 <= len; p += 8) {
        __m256 acc[8];
        for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
        for (int d = 0; d < dim; d += 8) {
            __m256 qd = _mm256_loadu_ps(q + d);
            for (int j = 0; j < 8; j++)
                acc[j] = _mm256_fmadd_ps(qd, load8(keys[p + j], d, BF16), acc[j]);
        }
        _mm256_storeu_ps(score + p, _mm256_mul_ps(sums8(acc), _mm256_set1_ps(scale)));
    }
    for (; p < len; p++) score[p] = scale * dot(q, keys[p], dim, BF16);
}

/* out = sum_p weight[p] values[p], 8 dims at a time, 4 positions in flight. */
static inline __attribute__((always_inline)) void weighted_sum(
        const float *weight, const void *const *values, int len, int dim, float *out,
        const int BF16) {
    for (int d = 0; d < dim; d += 8) {
        __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                         _mm256_setzero_ps()};
        int p = 0;
        for (; p + 4 <= len; p += 4)
            for (int j = 0; j < 4; j++)
                acc[j] = _mm256_fmadd_ps(_mm256_set1_ps(weight[p + j]),
                                         load8(values[p + j], d, BF16), acc[j]);
        for (; p < len; p++)
            acc[0] = _mm256_fmadd_ps(_mm256_set1_ps(weight[p]), load8(values[p], d, BF16),
                                     acc[0]);
        _mm256_storeu_ps(out + d, _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]),
                                                _mm256_add_ps(acc[2], acc[3])));
    }
}

static void softmax(float *x, int len) {
    float top = -INFINITY, total = 0.0f;
    for (int p = 0; p < len; p++) top = x[p] > top ? x[p] : top;
    __m256 max = _mm256_set1_ps(top), sum = _mm256_setzero_ps();
    int p = 0;
    for (; p + 8 <= len; p += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + p), max));
        _mm256_storeu_ps(x + p, e);
        sum = _mm256_add_ps(sum, e);
    }
    for (; p < len; p++) total += x[p] = expf(x[p] - top);
    float lanes[8];
    _mm256_storeu_ps(lanes, sum);
    for (int i = 0; i < 8; i++) total += lanes[i];
    const float inverse = 1.0f / total;
    for (p = 0; p < len; p++) x[p] *= inverse;
}

/* One layer's step: the new keys and values of all `rows` tokens written to
   their slots, then attention for the first `batch` rows (one-token decodes)
   into out [batch, heads * dim]. q [rows, heads, dim], k and v [rows, kv_heads,
   dim]: rows `*_stride` elements apart, heads `dim` apart. q, k, v, out and the
   caches are all bf16 if `bf16`, else all fp32. */
void paged_decode(const void *q, int64_t q_stride, const void *k, int64_t k_stride,
                  const void *v, int64_t v_stride, int bf16, int rows, const int64_t *slots,
                  int batch, int heads, int kv_heads, int dim, void *k_cache, void *v_cache,
                  int64_t cache_slots, const int32_t *tables, int table_width,
                  const int32_t *lengths, int block_size, float scale, void *out) {
    const int group = heads / kv_heads, width = bf16 ? 2 : 4;
    const size_t row_bytes = (size_t)width * dim;
    #pragma omp parallel
    {
        #pragma omp for collapse(2) schedule(static)
        for (int t = 0; t < rows; t++)
            for (int h = 0; h < kv_heads; h++) {
                int64_t at = ((int64_t)h * cache_slots + slots[t]) * row_bytes;
                int64_t from = (int64_t)h * row_bytes;
                memcpy((char *)k_cache + at, (const char *)k + width * t * k_stride + from,
                       row_bytes);
                memcpy((char *)v_cache + at, (const char *)v + width * t * v_stride + from,
                       row_bytes);
            }
        #pragma omp for collapse(2) schedule(dynamic)
        for (int b = 0; b < batch; b++) {
            for (int h = 0; h < kv_heads; h++) {
                const int len = lengths[b];
                const int32_t *table = tables + (int64_t)b * table_width;
                const void **keys = malloc(sizeof(void *) * 2 * (size_t)len);
                const void **values = keys + len;
                float *weight = malloc(sizeof(float) * ((size_t)len + 2 * dim));
                float *query = weight + len, *result = query + dim;
                for (int p = 0; p < len; p++) {
                    int64_t slot = (int64_t)table[p / block_size] * block_size + p % block_size;
                    int64_t at = ((int64_t)h * cache_slots + slot) * row_bytes;
                    keys[p] = (const char *)k_cache + at;
                    values[p] = (const char *)v_cache + at;
                }
                for (int g = 0; g < group; g++) {
                    int64_t head = (int64_t)h * group + g;
                    load_row((const char *)q + width * (b * q_stride + head * dim), bf16,
                             query, dim);
                    if (bf16) {
                        scores(query, keys, len, dim, scale, weight, 1);
                        softmax(weight, len);
                        weighted_sum(weight, values, len, dim, result, 1);
                    } else {
                        scores(query, keys, len, dim, scale, weight, 0);
                        softmax(weight, len);
                        weighted_sum(weight, values, len, dim, result, 0);
                    }
                    store_row(result, bf16, (char *)out + width * ((int64_t)b * heads + head) * dim,
                              dim);
                }
                free(keys);
                free(weight);
            }
        }
    }
}
