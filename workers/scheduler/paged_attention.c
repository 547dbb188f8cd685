/* Decode attention on the CPU over the paged KV cache of attention.py ("HND":
   per layer [kv_heads, slots, dim] fp32, a block of block_size slots holding
   consecutive positions): one query token per sequence, its keys and values read
   in place through the block table, so nothing is gathered. Each (sequence, kv
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

static inline float dot(const float *a, const float *b, int dim) {
    __m256 s = _mm256_setzero_ps();
    for (int d = 0; d < dim; d += 8)
        s = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), s);
    __m256 z = _mm256_setzero_ps(), one[8] = {s, z, z, z, z, z, z, z};
    return _mm256_cvtss_f32(sums8(one));
}

/* score[p] = scale * q . keys[p] for p < len, 8 keys at a time. */
static void scores(const float *q, const float *const *keys, int len, int dim, float scale,
                   float *score) {
    int p = 0;
    for (; p + 8 <= len; p += 8) {
        __m256 acc[8];
        for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
        for (int d = 0; d < dim; d += 8) {
            __m256 qd = _mm256_loadu_ps(q + d);
            for (int j = 0; j < 8; j++)
                acc[j] = _mm256_fmadd_ps(qd, _mm256_loadu_ps(keys[p + j] + d), acc[j]);
        }
        _mm256_storeu_ps(score + p, _mm256_mul_ps(sums8(acc), _mm256_set1_ps(scale)));
    }
    for (; p < len; p++) score[p] = scale * dot(q, keys[p], dim);
}

/* out = sum_p weight[p] values[p], 8 dims at a time, 4 positions in flight. */
static void weighted_sum(const float *weight, const float *const *values, int len, int dim,
                         float *out) {
    for (int d = 0; d < dim; d += 8) {
        __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                         _mm256_setzero_ps()};
        int p = 0;
        for (; p + 4 <= len; p += 4)
            for (int j = 0; j < 4; j++)
                acc[j] = _mm256_fmadd_ps(_mm256_set1_ps(weight[p + j]),
                                         _mm256_loadu_ps(values[p + j] + d), acc[j]);
        for (; p < len; p++)
            acc[0] = _mm256_fmadd_ps(_mm256_set1_ps(weight[p]), _mm256_loadu_ps(values[p] + d),
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
   dim]: rows `*_stride` elements apart, heads `dim` apart; q, k, v and out are
   bf16 if `bf16`, else fp32. */
void paged_decode(const void *q, int64_t q_stride, const void *k, int64_t k_stride,
                  const void *v, int64_t v_stride, int bf16, int rows, const int64_t *slots,
                  int batch, int heads, int kv_heads, int dim, float *k_cache, float *v_cache,
                  int64_t cache_slots, const int32_t *tables, int table_width,
                  const int32_t *lengths, int block_size, float scale, void *out) {
    const int group = heads / kv_heads, width = bf16 ? 2 : 4;
    #pragma omp parallel
    {
        #pragma omp for collapse(2) schedule(static)
        for (int t = 0; t < rows; t++)
            for (int h = 0; h < kv_heads; h++) {
                int64_t at = ((int64_t)h * cache_slots + slots[t]) * dim;
                int64_t from = (int64_t)width * ((int64_t)h * dim);
                load_row((const char *)k + width * t * k_stride + from, bf16, k_cache + at, dim);
                load_row((const char *)v + width * t * v_stride + from, bf16, v_cache + at, dim);
            }
        #pragma omp for collapse(2) schedule(dynamic)
        for (int b = 0; b < batch; b++) {
            for (int h = 0; h < kv_heads; h++) {
                const int len = lengths[b];
                const int32_t *table = tables + (int64_t)b * table_width;
                const float **keys = malloc(sizeof(float *) * 2 * (size_t)len);
                const float **values = keys + len;
                float *weight = malloc(sizeof(float) * ((size_t)len + 2 * dim));
                float *query = weight + len, *result = query + dim;
                for (int p = 0; p < len; p++) {
                    int64_t slot = (int64_t)table[p / block_size] * block_size + p % block_size;
                    keys[p] = k_cache + ((int64_t)h * cache_slots + slot) * dim;
                    values[p] = v_cache + ((int64_t)h * cache_slots + slot) * dim;
                }
                for (int g = 0; g < group; g++) {
                    int64_t head = (int64_t)h * group + g;
                    load_row((const char *)q + width * (b * q_stride + head * dim), bf16,
                             query, dim);
                    scores(query, keys, len, dim, scale, weight);
                    softmax(weight, len);
                    weighted_sum(weight, values, len, dim, result);
                    store_row(result, bf16, (char *)out + width * ((int64_t)b * heads + head) * dim,
                              dim);
                }
                free(keys);
                free(weight);
            }
        }
    }
}
