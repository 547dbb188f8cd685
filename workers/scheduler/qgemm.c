/* Weight-only 4- and 8-bit matmuls for x86-64 with AVX2 and FMA, in fp32: the
   kernels of workers/scheduler/qgemm.py. y[m, n] = sum_k x[m, k] w[n, k] with w[n]
   in groups of 32 along k. 4-bit: w = q * scale + low, q in [0, 15], 16 bytes a
   group, byte j holding q[j] (low nibble) and q[j + 16] (high nibble). 8-bit:
   w = q * scale, q int8, 32 bytes a group. Each group is widened to fp32 once and
   used for up to 8 rows of x, so a batch of rows costs about one dequantization. */

#include <immintrin.h>
#include <stdint.h>

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* NB outputs from n by R rows from m, with A accumulators per (output, row): enough
   independent FMA chains to hide their latency, few enough to stay in registers. */
static inline __attribute__((always_inline)) void tile(
        const float *x, int K, const uint8_t *q, const float *scale, const float *low,
        float *y, int N, int n, int m, const int NB, const int R, const int A, const int BITS) {
    const int G = K / 32;
    __m256 acc[NB][R][A];
    #pragma GCC unroll 8
    for (int b = 0; b < NB; b++)
        #pragma GCC unroll 8
        for (int r = 0; r < R; r++)
            #pragma GCC unroll 2
            for (int a = 0; a < A; a++) acc[b][r][a] = _mm256_setzero_ps();
    const __m128i mask = _mm_set1_epi8(0x0F);
    for (int g = 0; g < G; g++) {
        #pragma GCC unroll 8
        for (int b = 0; b < NB; b++) {
            int64_t at = (int64_t)(n + b) * G + g;
            __m128i half[2];
            if (BITS == 4) {
                __m128i v = _mm_loadu_si128((const __m128i *)(q + at * 16));
                half[0] = _mm_and_si128(v, mask);
                half[1] = _mm_and_si128(_mm_srli_epi16(v, 4), mask);
            } else {
                half[0] = _mm_loadu_si128((const __m128i *)(q + at * 32));
                half[1] = _mm_loadu_si128((const __m128i *)(q + at * 32 + 16));
            }
            __m256 s = _mm256_set1_ps(scale[at]);
            __m256 z = BITS == 4 ? _mm256_set1_ps(low[at]) : _mm256_setzero_ps();
            #pragma GCC unroll 4
            for (int j = 0; j < 4; j++) {
                __m128i bytes = (j & 1) ? _mm_srli_si128(half[j >> 1], 8) : half[j >> 1];
                __m256i ints = BITS == 4 ? _mm256_cvtepu8_epi32(bytes)
                                         : _mm256_cvtepi8_epi32(bytes);
                __m256 w = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ints), s, z);
                #pragma GCC unroll 8
                for (int r = 0; r < R; r++) {
                    const float *xr = x + (int64_t)(m + r) * K + g * 32 + j * 8;
                    acc[b][r][j % A] = _mm256_fmadd_ps(w, _mm256_loadu_ps(xr), acc[b][r][j % A]);
                }
            }
        }
    }
    #pragma GCC unroll 8
    for (int b = 0; b < NB; b++)
        #pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            __m256 total = acc[b][r][0];
            #pragma GCC unroll 2
            for (int a = 1; a < A; a++) total = _mm256_add_ps(total, acc[b][r][a]);
            y[(int64_t)(m + r) * N + n + b] = hsum(total);
        }
}

/* the tile of NB outputs from n and R rows from m */
#define T(n, NB, R, A, BITS) tile(x, K, q, scale, low, y, N, n, m, NB, R, A, BITS)
#define GEMM(NAME, BITS)                                                                \
void NAME(const float *x, int M, int K, const uint8_t *q, const float *scale,           \
          const float *low, float *y, int N) {                                          \
    _Pragma("omp parallel for schedule(static)")                                        \
    for (int n = 0; n < N; n += 4) {                                                    \
        int m = 0;                                                                      \
        for (; m + 8 <= M; m += 8)                                                      \
            for (int b = 0; b < 4; b++) T(n + b, 1, 8, 1, BITS);                        \
        for (; m + 4 <= M; m += 4)                                                      \
            for (int b = 0; b < 4; b += 2) T(n + b, 2, 4, 1, BITS);                     \
        switch (M - m) {                                                                \
        case 3: for (int b = 0; b < 4; b += 2) T(n + b, 2, 3, 1, BITS); break;          \
        case 2: for (int b = 0; b < 4; b += 2) T(n + b, 2, 2, 2, BITS); break;          \
        case 1: T(n, 4, 1, 2, BITS); break;                                             \
        }                                                                               \
    }                                                                                   \
}

/* N a multiple of 4, K of 32; low is unused by q8_gemm. Threads: torch's OpenMP pool. */
GEMM(q4_gemm, 4)
GEMM(q8_gemm, 8)
