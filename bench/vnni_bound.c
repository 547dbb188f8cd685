/* The VNNI matmuls' own instructions with nothing else in the way (no memory
   but L1, no loads of weights or activations but the broadcasts): one weight
   block's unpacking, then R = 11 rows of qgemm_vnni.c's tile, each 8 vpdpbusd
   in two chains with their activations broadcast from L1, the chains added,
   and the scale's, the activation scale's and (4-bit) the low's FMAs into the
   row's sum. bench/vnni_bound.py times it against the kernel itself. */

#include <stdint.h>
#include <time.h>

static int32_t scratch[1024] __attribute__((aligned(64)));

#define ROW(A, o, LOW)                                                                  \
    "vmovdqa64 %%zmm20, %%zmm0\n\t"                                                     \
    "vpxord %%zmm1, %%zmm1, %%zmm1\n\t"                                                 \
    "vpdpbusd " #o "+0(%0)%{1to16%}, %%zmm22, %%zmm0\n\t"                               \
    "vpdpbusd " #o "+16(%0)%{1to16%}, %%zmm26, %%zmm1\n\t"                              \
    "vpdpbusd " #o "+4(%0)%{1to16%}, %%zmm23, %%zmm0\n\t"                               \
    "vpdpbusd " #o "+20(%0)%{1to16%}, %%zmm27, %%zmm1\n\t"                              \
    "vpdpbusd " #o "+8(%0)%{1to16%}, %%zmm24, %%zmm0\n\t"                               \
    "vpdpbusd " #o "+24(%0)%{1to16%}, %%zmm28, %%zmm1\n\t"                              \
    "vpdpbusd " #o "+12(%0)%{1to16%}, %%zmm25, %%zmm0\n\t"                              \
    "vpdpbusd " #o "+28(%0)%{1to16%}, %%zmm29, %%zmm1\n\t"                              \
    "vpaddd %%zmm1, %%zmm0, %%zmm0\n\t"                                                 \
    "vfmadd132ps %%zmm30, %%zmm31, %%zmm0\n\t"                                          \
    "vfmadd231ps " #o "+2048(%0)%{1to16%}, %%zmm0, %%zmm" #A "\n\t"                     \
    LOW(A, o)
#define LOW4(A, o) "vfmadd231ps " #o "+2052(%0)%{1to16%}, %%zmm19, %%zmm" #A "\n\t"
#define LOW8(A, o)
#define UNPACK                                                                          \
    "vpsrlw $4, 3072(%0), %%zmm16\n\t" "vpandd 3072(%0), %%zmm18, %%zmm22\n\t"          \
    "vpandd %%zmm18, %%zmm16, %%zmm26\n\t"                                              \
    "vpsrlw $4, 3136(%0), %%zmm16\n\t" "vpandd 3136(%0), %%zmm18, %%zmm23\n\t"          \
    "vpandd %%zmm18, %%zmm16, %%zmm27\n\t"                                              \
    "vpsrlw $4, 3200(%0), %%zmm16\n\t" "vpandd 3200(%0), %%zmm18, %%zmm24\n\t"          \
    "vpandd %%zmm18, %%zmm16, %%zmm28\n\t"                                              \
    "vpsrlw $4, 3264(%0), %%zmm16\n\t" "vpandd 3264(%0), %%zmm18, %%zmm25\n\t"          \
    "vpandd %%zmm18, %%zmm16, %%zmm29\n\t"                                              \
    "vcvtph2ps 3328(%0), %%zmm30\n\t" "vmulps %%zmm17, %%zmm30, %%zmm31\n\t"            \
    "vcvtph2ps 3360(%0), %%zmm19\n\t"
#define ROWS(LOW) ROW(2, 0, LOW) ROW(3, 32, LOW) ROW(4, 64, LOW) ROW(5, 96, LOW)        \
    ROW(6, 128, LOW) ROW(7, 160, LOW) ROW(8, 192, LOW) ROW(9, 224, LOW) ROW(10, 256, LOW) \
    ROW(11, 288, LOW) ROW(12, 320, LOW)
#define CLOBBERS "memory", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", \
    "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", "xmm16", "xmm19", "xmm22", "xmm23", "xmm24", \
    "xmm25", "xmm26", "xmm27", "xmm28", "xmm29", "xmm30", "xmm31"

static double seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* Seconds for `blocks` weight blocks of 11 rows: bits 4 (unpacking, the low's
   FMA) or 8 (the levels as they are, the low folded into the dot). */
double mix_seconds(long blocks, int bits) {
    const double start = seconds();
    if (bits == 4)
        for (long b = 0; b < blocks; b++)
            __asm__ volatile(UNPACK ROWS(LOW4) : : "r"(scratch) : CLOBBERS);
    else
        for (long b = 0; b < blocks; b++)
            __asm__ volatile(ROWS(LOW8) : : "r"(scratch) : CLOBBERS);
    return seconds() - start;
}
