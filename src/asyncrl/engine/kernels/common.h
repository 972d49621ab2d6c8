/* What the kernels of this folder share: bf16 <-> float32 as torch rounds, a vectorisable
 * exp for x <= 0, and a thread's share of the rows. Included by each kernel's .c file. */
#ifndef ASYNCRL_KERNELS_COMMON_H
#define ASYNCRL_KERNELS_COMMON_H
#include <stdint.h>
#include <string.h>
#include <math.h>

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {  /* round to nearest even, as torch does */
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const uint32_t quiet_nan = (u >> 16) | 0x40u;
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);  /* branch-free */
}

/* exp(x) for x <= 0, vectorisable: 2^(x log2 e) split into 2^n * 2^f, f in [-0.5, 0.5],
 * 2^f by a degree-6 polynomial (relative error < 2e-7). */
static inline float exp_neg(float x) {
    float y = x * 1.44269504088896341f;
    y = y < -126.0f ? -126.0f : y;
    float n = rintf(y);
    float f = y - n;
    float p = 1.535336188319500e-4f;
    p = p * f + 1.339887440266574e-3f;
    p = p * f + 9.618437357674640e-3f;
    p = p * f + 5.550332471162809e-2f;
    p = p * f + 2.402264791363012e-1f;
    p = p * f + 6.931472028550421e-1f;
    p = p * f + 1.0f;
    int32_t e = ((int32_t)n + 127) << 23;
    float s;
    memcpy(&s, &e, 4);
    return p * s;
}

/* The share [*lo, *hi) of n items of thread tid out of nt (contiguous, sizes differ by <= 1). */
static inline void share(int n, int tid, int nt, int *lo, int *hi) {
    *lo = (int)((int64_t)n * tid / nt);
    *hi = (int)((int64_t)n * (tid + 1) / nt);
}

#endif
