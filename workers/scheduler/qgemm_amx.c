// 4- and 8-bit weight-only matmul on Intel AMX: y[rows, out] = x[rows, in] @ w.T,
// x in bf16. Each 16 outputs x 32 inputs of the weight (one group: one scale,
// and for 4 bits one minimum, per output) are dequantized to bf16 in L1, as
// bf16(level * scale + minimum) in fp32 and rounded to nearest even: the very
// weights the dense bf16 path holds. One tile product then takes up to 16 rows
// of x against them; up to 4 row blocks (64 rows) share one dequantization.
// The next group's dequantization runs between this group's tile products, a
// quarter after each, so the vector units and the tiles work at once: all 30
// layers' projections and the lm_head at 64 rows (streamed) took 0.82-0.85x the
// time of dequantizing before the products, 0.82x at 48, 0.95x at 32, 0.98x at 16.
//
// Weight layout, per block of 16 outputs and group g (see qgemm_amx.py): 16
// tile rows, one per pair of inputs (2r, 2r + 1); lane L of a row is output
// L / 2, input 2r + L % 2 (AMX's pairs-of-k layout). 8 bits: the 32 lanes as
// int8. 4 bits: 16 bytes, byte j holding lane j (low nibble) and lane 16 + j
// (high nibble). Scales and minimums: fp32 [out / 16, groups, 16].
//
// dense_gemm_amx: the same products on a bf16 weight in the same lanes, for
// steps past the 4-bit kernel's reach (prefill chunks of hundreds of rows).

#include <immintrin.h>
#include <stdint.h>

#include "kernels.h"
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

// *ok = 1 where Linux lets this process use the tile registers.
void amx_init(int *ok) {
    *ok = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

// Tiles 0-3: the fp32 sums of row blocks; 4: a full block of x; 5: the last
// block of x (`last` rows); 6: the dequantized weights.
static void configure(int blocks, int last) {
    tile_config c = {0};
    c.palette = 1;
    for (int i = 0; i < 4; i++) {  // the unused ones too: all four are zeroed
        c.rows[i] = i == blocks - 1 ? last : 16;
        c.colsb[i] = 64;
    }
    c.rows[4] = 16, c.colsb[4] = 64;
    c.rows[5] = last, c.colsb[5] = 64;
    c.rows[6] = 16, c.colsb[6] = 64;
    _tile_loadconfig(&c);
}

// A group's scales and minimums, each output's spread over its two lanes.
typedef struct { __m512 s_lo, s_hi, m_lo, m_hi; } Consts;
static inline Consts consts(const float *scale, const float *low) {
    const __m512i lo_lanes = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i hi_lanes = _mm512_add_epi32(lo_lanes, _mm512_set1_epi32(8));
    Consts c;
    __m512 s = _mm512_loadu_ps(scale);
    c.s_lo = _mm512_permutexvar_ps(lo_lanes, s), c.s_hi = _mm512_permutexvar_ps(hi_lanes, s);
    if (low) {
        __m512 m = _mm512_loadu_ps(low);
        c.m_lo = _mm512_permutexvar_ps(lo_lanes, m), c.m_hi = _mm512_permutexvar_ps(hi_lanes, m);
    } else {
        c.m_lo = c.m_hi = _mm512_setzero_ps();
    }
    return c;
}

// Tile rows [r0, r0 + 4) of one group's 16 x 32 weights, as bf16, into `dst`.
static inline void dequantize4(const uint8_t *q, Consts c, int bits, uint16_t *dst, int r0) {
    if (bits == 4) {  // a level's fp32 looked up by its nibble (vpermps reads 4 bits), where
        // masking and converting took a uop more a row on the vector ports, which set
        // the pace at 64 rows: the projections' calls 0.92x the time at 16 rows, 0.97x
        // at 64 (the same bits)
        const __m512 levels = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        for (int r = r0; r < r0 + 4; r++) {
            __m512i t = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q + 16 * r)));
            __m512 lo = _mm512_permutexvar_ps(t, levels);
            __m512 hi = _mm512_permutexvar_ps(_mm512_srli_epi32(t, 4), levels);
            lo = _mm512_fmadd_ps(lo, c.s_lo, c.m_lo);
            hi = _mm512_fmadd_ps(hi, c.s_hi, c.m_hi);
            _mm512_store_si512(dst + 32 * r, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        }
    } else {
        for (int r = r0; r < r0 + 4; r++) {
            const __m128i *row = (const __m128i *)(q + 32 * r);
            __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(row)));
            __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(row + 1)));
            lo = _mm512_mul_ps(lo, c.s_lo);
            hi = _mm512_mul_ps(hi, c.s_hi);
            _mm512_store_si512(dst + 32 * r, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        }
    }
}

// Groups ahead that a block's levels are fetched: all 30 layers' projections
// (streamed) took 0.98x the time at 32-128 rows with 8 as with 16 (4: the same
// as 8, 32: 1.0-1.02x; alternating builds, 15 runs each, Intel Xeon with AMX)
#ifndef PREFETCH
#define PREFETCH 8
#endif

#define PRODUCT(block, a)                                                        \
    _tile_loadd(a, x + (size_t)16 * (block) * in_dim + 32 * g, 2 * in_dim); \
    _tile_dpbf16ps(block, a, 6);
// Tile rows [r, r + 4) of the next group's weights, where there is one.
#define NEXT(r) if (more) dequantize4(qn, c, bits, next, r);

// Block nb's 16 outputs over every group, summed into tiles 0 to blocks - 1; at
// the halfway group the thread claims its next unit of work into *following,
// unless following is NULL.
static inline __attribute__((always_inline)) void block_sums(
        const uint16_t *x, int in_dim, int blocks, const uint8_t *q, const float *scale,
        const float *low, int bits, int nb, uint16_t tiles[2][512], Span *spans, int *from,
        int *following) {
    const int groups = in_dim / 32;
    const size_t q_bytes = bits == 4 ? 256 : 512;
    const uint8_t *qb = q + (size_t)nb * groups * q_bytes;
    const float *sb = scale + (size_t)nb * groups * 16;
    const float *lb = low ? low + (size_t)nb * groups * 16 : 0;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const Consts first = consts(sb, lb);
    for (int r = 0; r < 16; r += 4)
        dequantize4(qb, first, bits, tiles[0], r);
    for (int g = 0; g < groups; g++) {
        if (following && g == groups / 2)
            *following = span_next(spans, from);
        const int more = g + 1 < groups;
        uint16_t *next = tiles[(g + 1) & 1];
        const uint8_t *qn = qb + (g + 1) * q_bytes;
        const uint8_t *ahead = qb + (g + PREFETCH) * q_bytes;  // may pass the end
        for (size_t line = 0; line < q_bytes; line += 64)
            _mm_prefetch((const char *)ahead + line, _MM_HINT_T0);
        _mm_prefetch((const char *)(sb + 16 * (g + PREFETCH)), _MM_HINT_T0);
        if (lb)
            _mm_prefetch((const char *)(lb + 16 * (g + PREFETCH)), _MM_HINT_T0);
        _tile_loadd(6, tiles[g & 1], 64);
        const Consts c = more ? consts(sb + 16 * (g + 1), lb ? lb + 16 * (g + 1) : 0) : first;
        switch (blocks) {  // the next group's quarters between the products
        case 4: PRODUCT(0, 4) NEXT(0) PRODUCT(1, 4) NEXT(4) PRODUCT(2, 4) NEXT(8)
                PRODUCT(3, 5) NEXT(12) break;
        case 3: PRODUCT(0, 4) NEXT(0) NEXT(4) PRODUCT(1, 4) NEXT(8)
                PRODUCT(2, 5) NEXT(12) break;
        case 2: PRODUCT(0, 4) NEXT(0) NEXT(4) PRODUCT(1, 5) NEXT(8) NEXT(12) break;
        default: PRODUCT(0, 5) NEXT(0) NEXT(4) NEXT(8) NEXT(12)
        }
    }
}

// SILU (a mode beside STORE's and kernels.h's ARGMAX): the output's first half
// is an MLP's gate, its second its up, and y [rows, out / 2] = silu(gate) * up.
enum { SILU = 3 };

// Writes row block `block` (tile `block`) of 16 outputs starting at column n0
// (mode 1: bf16, 0: fp32), or (ARGMAX, y a Best) keeps each row's largest so far,
// or (SILU) writes silu(gate) * up, the gate's sums in gate[block], rounded as
// ops.c's silu_mul rounds the two after a bf16 store.
#define STORE(block)                                                                 \
    if (mode == 1) {                                                                 \
        _tile_stored(block, sums, 64);                                               \
        int rows_here = (block) == blocks - 1 ? last : 16;                           \
        for (int r = 0; r < rows_here; r++) {                                        \
            __m256bh v = _mm512_cvtneps_pbh(_mm512_load_ps(sums + 16 * r));          \
            _mm256_storeu_si256((__m256i *)(y16 + (size_t)(16 * (block) + r) * width + n0), \
                                (__m256i)v);                                         \
        }                                                                            \
    } else if (mode == ARGMAX) {                                                     \
        _tile_stored(block, sums, 64);                                               \
        int rows_here = (block) == blocks - 1 ? last : 16;                           \
        for (int r = 0; r < rows_here; r++)                                          \
            keep_best(_mm512_load_ps(sums + 16 * r), n0,                             \
                      my_best + m0 + 16 * (block) + r, my_at + m0 + 16 * (block) + r); \
    } else if (mode == SILU) {                                                       \
        _tile_stored(block, sums, 64);                                               \
        int rows_here = (block) == blocks - 1 ? last : 16;                           \
        for (int r = 0; r < rows_here; r++) {                                        \
            __m512 g = round_lanes(_mm512_load_ps(gate[block] + 16 * r));            \
            __m512 u = round_lanes(_mm512_load_ps(sums + 16 * r));                   \
            __m256bh v = _mm512_cvtneps_pbh(_mm512_mul_ps(round_lanes(silu_lanes(g)), u)); \
            _mm256_storeu_si256((__m256i *)(y16 + (size_t)(16 * (block) + r) * width + n0), \
                                (__m256i)v);                                         \
        }                                                                            \
    } else {                                                                         \
        _tile_stored(block, y32 + (size_t)16 * (block) * width + n0, 4 * width);    \
    }
#define KEEP_GATE(block) _tile_stored(block, gate[block], 64);

// Rows [0, rows) in passes of up to 64; `bits` 4 or 8; STORE's mode.
static void tiles_gemm(const uint16_t *x_all, int rows, int in_dim, const uint8_t *q,
                       const float *scale, const float *low, void *y, int mode, int out_dim,
                       int bits) {
    const int num_blocks = out_dim / 16;
    const int units = mode == SILU ? num_blocks / 2 : num_blocks;  // SILU: gate's and up's
    const int width = mode == SILU ? out_dim / 2 : out_dim;  // of y
    Span *spans = aligned_alloc(64, sizeof(Span) * omp_get_max_threads());  // units by stealing
    for (int m0 = 0; m0 < rows; m0 += 64) {
        const int here = rows - m0 < 64 ? rows - m0 : 64;
        const int blocks = (here + 15) / 16, last = here - 16 * (blocks - 1);
        const uint16_t *x = x_all + (size_t)m0 * in_dim;
        float *y32 = mode == ARGMAX ? 0 : (float *)y + (size_t)m0 * width;  // y a Best
        uint16_t *y16 = mode == ARGMAX ? 0 : (uint16_t *)y + (size_t)m0 * width;
#pragma omp parallel
        {
            const Best *best = mode == ARGMAX ? y : 0;
            const size_t mine = (size_t)omp_get_thread_num() * rows;
            float *my_best = best ? best->value + mine : 0;
            int32_t *my_at = best ? best->at + mine : 0;
            configure(blocks, last);
            uint16_t tiles[2][512] __attribute__((aligned(64)));
            float sums[256] __attribute__((aligned(64)));
            float gate[4][256] __attribute__((aligned(64)));
            span_init(spans, units);
#pragma omp barrier
            // the next unit is claimed halfway through this one: span_next's locked
            // compare-exchange waits for every earlier store, and right after a
            // block's STOREs that is its last tile products too (engine steps
            // 0.97-0.98x the time at 64 rows and 0.97x at 32, paired in one process)
            int from = 0, unit = span_next(spans, &from), following = -1;
            for (; unit >= 0; unit = following) {
                const int n0 = 16 * unit;
                if (mode == SILU) {  // the gate's block, kept; then the up's
                    block_sums(x, in_dim, blocks, q, scale, low, bits, unit, tiles, spans,
                               &from, 0);
                    switch (blocks) {
                    case 4: KEEP_GATE(0) KEEP_GATE(1) KEEP_GATE(2) KEEP_GATE(3) break;
                    case 3: KEEP_GATE(0) KEEP_GATE(1) KEEP_GATE(2) break;
                    case 2: KEEP_GATE(0) KEEP_GATE(1) break;
                    default: KEEP_GATE(0)
                    }
                }
                block_sums(x, in_dim, blocks, q, scale, low, bits,
                           mode == SILU ? unit + units : unit, tiles, spans, &from, &following);
                switch (blocks) {
                case 4: STORE(0) STORE(1) STORE(2) STORE(3) break;
                case 3: STORE(0) STORE(1) STORE(2) break;
                case 2: STORE(0) STORE(1) break;
                default: STORE(0)
                }
            }
            _tile_release();
        }
    }
    free(spans);
}

void q_gemm_amx(const uint16_t *x, int rows, int in_dim, const uint8_t *q, const float *scale,
                const float *low, void *y, int y_bf16, int out_dim, int bits) {
    tiles_gemm(x, rows, in_dim, q, scale, low, y, y_bf16 != 0, out_dim, bits);
}

// out[r] = the index of the largest of x[r] @ w.T (the first of equals), as
// argmax over q_gemm_amx's fp32 y, which is never written (ARGMAX in kernels.h).
void q_argmax_amx(const uint16_t *x, int rows, int in_dim, const uint8_t *q, const float *scale,
                  const float *low, int64_t *out, int out_dim, int bits) {
    Best best = best_alloc(rows);
    tiles_gemm(x, rows, in_dim, q, scale, low, &best, ARGMAX, out_dim, bits);
    best_finish(&best, out);
}

// A weight as layers.c passes it: its parts, for tiled_gemm.
typedef struct {
    const uint8_t *q;
    const float *scale, *low;
    int bits;
} tiled;

// q_gemm_amx with layers.c's matmul signature (w a tiled).
void tiled_gemm(const void *x, int rows, int in_dim, const void *w, void *y, int y_bf16,
                int out_dim) {
    const tiled *t = w;
    q_gemm_amx(x, rows, in_dim, t->q, t->scale, t->low, y, y_bf16, out_dim, t->bits);
}

// tiled_gemm on an MLP's gate_up weight (gate's outputs, then up's: out of them
// in all, a multiple of 32) into its activation, y [rows, out / 2] bf16 =
// silu(gate) * up: the bits of ops.c's silu_mul after a bf16 tiled_gemm, without
// writing gate_up and reading it back in a pass of its own (y_bf16 must be set).
void tiled_gemm_silu(const void *x, int rows, int in_dim, const void *w, void *y, int y_bf16,
                     int out_dim) {
    const tiled *t = w;
    (void)y_bf16;
    tiles_gemm(x, rows, in_dim, t->q, t->scale, t->low, y, SILU, out_dim, t->bits);
}

// Dense: tiles 0-3 the sums of 2 row blocks x 2 blocks of 16 outputs, 4 and 5 the
// row blocks of x (`a` and `b` rows; b 0: none), 6 and 7 the two weight blocks.
static void configure_dense(int a, int b) {
    tile_config c = {0};
    c.palette = 1;
    for (int i = 0; i < 8; i++) c.colsb[i] = 64;
    c.rows[0] = c.rows[1] = c.rows[4] = a;
    c.rows[2] = c.rows[3] = c.rows[5] = b ? b : 1;
    c.rows[6] = c.rows[7] = 16;
    _tile_loadconfig(&c);
}

// Rows of two tiles' fp32 sums (16 outputs each, side by side) into y at (row0, n0).
static void store_pair(const float *left, const float *right, int rows, void *y, int y_bf16,
                       int out_dim, int row0, int n0) {
    for (int r = 0; r < rows; r++) {
        const __m512 a = _mm512_load_ps(left + 16 * r), b = _mm512_load_ps(right + 16 * r);
        const size_t at = (size_t)(row0 + r) * out_dim + n0;
        if (y_bf16) {
            _mm512_storeu_si512((uint16_t *)y + at, (__m512i)_mm512_cvtne2ps_pbh(b, a));
        } else {
            _mm512_storeu_ps((float *)y + at, a);
            _mm512_storeu_ps((float *)y + at + 16, b);
        }
    }
}

#define DENSE_PRODUCTS(second)                                              \
    for (int g = 0; g < groups; g++) {                                      \
        _tile_loadd(4, x0 + 32 * g, 2 * in_dim);                            \
        _tile_loadd(6, w0 + 512 * g, 64);                                   \
        _tile_dpbf16ps(0, 4, 6);                                            \
        _tile_loadd(7, w1 + 512 * g, 64);                                   \
        _tile_dpbf16ps(1, 4, 7);                                            \
        if (second) {                                                       \
            _tile_loadd(5, x0 + (size_t)16 * in_dim + 32 * g, 2 * in_dim);  \
            _tile_dpbf16ps(2, 5, 6);                                        \
            _tile_dpbf16ps(3, 5, 7);                                        \
        }                                                                   \
    }

// y[rows, out] = x[rows, in] @ w.T, x and w bf16 (w in the lanes above, 1 KB a
// block and group), out a multiple of 32: threads take pairs of output blocks
// (the pair's weights stay in L1 while every 32 rows of x pass by from L2),
// with layers.c's matmul signature. Against oneDNN's bf16 matmul on a packed
// weight, the 4 projections of 30 layers (distinct weights) at 512 rows took
// 0.79-0.81x the time (2 threads, Intel Xeon with AMX).
void dense_gemm_amx(const void *x_all, int rows, int in_dim, const void *w, void *y,
                    int y_bf16, int out_dim) {
    const int groups = in_dim / 32, pairs = out_dim / 32;
    const size_t pair_bytes = (size_t)groups * 2048;
    Span *spans = aligned_alloc(64, sizeof(Span) * omp_get_max_threads());
#pragma omp parallel
    {
        float sums[4][256] __attribute__((aligned(64)));
        int config_a = -1, config_b = -1;
        span_init(spans, pairs);
#pragma omp barrier
        int from = 0;
        for (int p; (p = span_next(spans, &from)) >= 0;) {
            const uint16_t *w0 = (const uint16_t *)w + (size_t)p * groups * 1024;
            const uint16_t *w1 = w0 + (size_t)groups * 512;
            const char *following = (const char *)(w0 + (size_t)groups * 1024);
            const size_t share = (pair_bytes * 32 + rows - 1) / rows;  // of it, per 32 rows
            for (int m0 = 0; m0 < rows; m0 += 32) {
                const int left = rows - m0, a = left < 16 ? left : 16;
                const int b = left <= 16 ? 0 : left < 32 ? left - 16 : 16;
                if (a != config_a || b != config_b) {
                    configure_dense(a, b);
                    config_a = a, config_b = b;
                }
                if (p + 1 < pairs)  // the next pair's weights, spread over this one's rows
                    for (size_t at = share * (m0 / 32); at < share * (m0 / 32 + 1) &&
                         at < pair_bytes; at += 64)
                        _mm_prefetch(following + at, _MM_HINT_T1);
                const uint16_t *x0 = (const uint16_t *)x_all + (size_t)m0 * in_dim;
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                if (b) {
                    DENSE_PRODUCTS(1)
                } else {
                    DENSE_PRODUCTS(0)
                }
                _tile_stored(0, sums[0], 64);
                _tile_stored(1, sums[1], 64);
                store_pair(sums[0], sums[1], a, y, y_bf16, out_dim, m0, 32 * p);
                if (b) {
                    _tile_stored(2, sums[2], 64);
                    _tile_stored(3, sums[3], 64);
                    store_pair(sums[2], sums[3], b, y, y_bf16, out_dim, m0 + 16, 32 * p);
                }
            }
        }
        _tile_release();
    }
    free(spans);
}
