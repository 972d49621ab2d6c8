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

/* The share [*a, *b) of n elements of thread tid out of nt, in whole blocks of 16k elements
 * (for flat elementwise passes: no two threads write the same cache line). */
static inline void share_elems(int64_t n, int tid, int nt, int64_t *a, int64_t *b) {
    const int64_t block = 1 << 14;
    int lo, hi;
    share((int)((n + block - 1) / block), tid, nt, &lo, &hi);
    *a = (int64_t)lo * block;
    *b = (int64_t)hi * block < n ? (int64_t)hi * block : n;
}

#ifdef __AVX512BF16__
#include <immintrin.h>
/* The same on 16 lanes (AVX512-BF16 machines): bf16 -> fp32, a bf16 rounding, exp_neg and
 * x * sigmoid(x) from exp(-|x|) (no overflow). */
static inline __m512 bf16x16_to_f32(__m256i v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

/* The first min(n, 16) of 16 lanes (a row's tail); 16 bf16 at p under them, 0 elsewhere,
 * as float32. */
static inline __mmask16 lanes(int n) {
    return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1);
}

static inline __m512 load16(__mmask16 t, const uint16_t *p) {
    return bf16x16_to_f32(_mm256_maskz_loadu_epi16(t, p));
}

static inline __m512 round_bf16_x16(__m512 v) {
    return bf16x16_to_f32((__m256i)_mm512_cvtneps_pbh(v));
}

/* exp_neg (above) on 16 lanes: the same steps, as intrinsics. */
static inline __m512 exp_neg_x16(__m512 x) {
    __m512 y = _mm512_max_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                             _mm512_set1_ps(-126.0f));
    const __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(y, n);
    __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n),
                                                         _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

/* sigmoid(x) on 16 lanes from e = exp(-|x|) (no overflow): 1 / (1 + e) for x >= 0, else
 * e / (1 + e), as decode.c's silu_mul_bf16 computes it. */
static inline __m512 sigmoid_x16(__m512 x) {
    const __m512 e = exp_neg_x16(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x)));
    const __mmask16 pos = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GE_OQ);
    const __m512 num = _mm512_mask_blend_ps(pos, e, _mm512_set1_ps(1.0f));
    return _mm512_div_ps(num, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
}

static inline __m512 silu_x16(__m512 x) { return _mm512_mul_ps(x, sigmoid_x16(x)); }
#endif

#endif
