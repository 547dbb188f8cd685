/* Appended by bench/avx2_bound.py to a copy of workers/scheduler/qgemm_avx2.c
   (built beside kernels.h, with the kernel's flags): the kernel's own tile of 4
   rows by 16 outputs, over one column's unpacked groups, its activations and
   its outputs all in L1, so that nothing streams and no thread waits. Against
   the whole kernel's time a unit, it shows what the weights' streaming, the
   unpacking, the rounding of the activations and the threads cost on top of
   the tile's own instructions. */

#include <time.h>

/* Seconds for `reps` passes of the 4-row tile over K inputs (K / 32 groups) of
   the 16 outputs of packed column `w` (bits 4 or 8), rows x [4, K] fp32. */
double tile_seconds(long reps, int K, const float *x, const uint8_t *w, int bits) {
    const int G = K / GROUP;
    int8_t *q = malloc((size_t)4 * K);
    float *xs = malloc(sizeof(float) * 2 * 4 * G), y[4 * LANES];
    for (int m = 0; m < 4; m++) quantize_row(x + (int64_t)m * K, 0, K, q + m * K, xs + m * 2 * G, 0);
    uint8_t *lv = aligned_alloc(64, (size_t)G * unpacked_bytes(bits));
    if (bits == 4) unpack(w, G, lv, 4); else unpack(w, G, lv, 8);
    struct timespec start, end;
    clock_gettime(CLOCK_MONOTONIC, &start);
    for (long i = 0; i < reps; i++) {
        if (bits == 4) tile(q, xs, K, lv, y, 0, LANES, 0, 0, 4, 4, 0, 1);
        else tile(q, xs, K, lv, y, 0, LANES, 0, 0, 4, 8, 0, 1);
        __asm__ volatile("" : : "r"(y) : "memory");
    }
    clock_gettime(CLOCK_MONOTONIC, &end);
    free(q);
    free(xs);
    free(lv);
    return (double)(end.tv_sec - start.tv_sec) + (end.tv_nsec - start.tv_nsec) * 1e-9;
}
