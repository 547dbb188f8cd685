/* Decode attention on the CPU over the paged KV cache of attention.py ("HND":
   per layer [kv_heads, slots, dim] fp32, a block of block_size slots holding
   consecutive positions): one query token per sequence, its keys and values read
   in place through the block table, so nothing is gathered. Each (sequence, kv
   head) is one task; its group of query heads shares every key it reads. AVX2
   and FMA; dim a multiple of 8. */

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

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

/* e^x for x <= 0, to ~2 ulp: x = n ln2 + r, |r| <= ln2 / 2, e^r by its Taylor
   polynomial to r^7, 2^n through the exponent bits; under -87 it flushes to 0. */
static inline __m256 exp8(__m256 x) {
    const __m256 floor = _mm256_set1_ps(-87.0f);
    __m256 under = _mm256_cmp_ps(x, floor, _CMP_LT_OQ);
    x = _mm256_max_ps(x, floor);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504089f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
    __m256 e = _mm256_set1_ps(1.0f / 5040);
    const float c[] = {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f};
    for (int i = 0; i < 7; i++) e = _mm256_fmadd_ps(e, r, _mm256_set1_ps(c[i]));
    __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                      _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(e, _mm256_castsi256_ps(bits)));
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

void paged_decode(const float *q, int batch, int heads, int kv_heads, int dim,
                  const float *k_cache, const float *v_cache, int64_t slots,
                  const int32_t *tables, int table_width, const int32_t *lengths,
                  int block_size, float scale, float *out) {
    const int group = heads / kv_heads;
    #pragma omp parallel for collapse(2) schedule(dynamic)
    for (int b = 0; b < batch; b++) {
        for (int h = 0; h < kv_heads; h++) {
            const int len = lengths[b];
            const int32_t *table = tables + (int64_t)b * table_width;
            const float **keys = malloc(sizeof(float *) * 2 * (size_t)len);
            const float **values = keys + len;
            float *weight = malloc(sizeof(float) * (size_t)len);
            for (int p = 0; p < len; p++) {
                int64_t slot = (int64_t)table[p / block_size] * block_size + p % block_size;
                keys[p] = k_cache + ((int64_t)h * slots + slot) * dim;
                values[p] = v_cache + ((int64_t)h * slots + slot) * dim;
            }
            for (int g = 0; g < group; g++) {
                int64_t row = (int64_t)b * heads + (int64_t)h * group + g;
                scores(q + row * dim, keys, len, dim, scale, weight);
                softmax(weight, len);
                weighted_sum(weight, values, len, dim, out + row * dim);
            }
            free(keys);
            free(weight);
        }
    }
}
