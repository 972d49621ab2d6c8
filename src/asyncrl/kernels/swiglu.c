/* The SwiGLU product of the trainer's MLPs (trainer/cpu/mlp.py), forward and backward, over
 * bf16 gate and up activations [n], with torch's roundings:
 *
 *   forward   s = round(silu(g)), h = round(s * u)
 *   backward  du = round(dh * s), ds = round(dh * u),
 *             dg = round(ds * sig(g) * (1 + g * (1 - sig(g))))   (silu_backward, in fp32)
 *
 * One pass instead of torch's two forward (silu, mul) and three backward (two muls,
 * silu_backward); only g and u are kept for backward. sig(x) from exp(-|x|) (common.h's
 * exp_neg, relative error < 2e-7 against torch's exp), so a value may differ from torch's
 * by one bf16 rounding step where the fp32 result sits on a rounding boundary.
 *
 * On AVX512-BF16 machines 16 values at a time (common.h's intrinsics), else plain C.
 * Compiled at first use by kernels/__init__.py; torch's thread pool is shared (libgomp).
 */
#include <stdint.h>
#include <omp.h>
#include "common.h"

static inline float sigmoid(float x) {
    const float e = exp_neg(x >= 0.0f ? -x : x);  /* exp(-|x|), no overflow */
    return x >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
}

static inline float rounded(float x) { return bf16_to_f32(f32_to_bf16(x)); }

void swiglu_fwd_bf16(const uint16_t *g, const uint16_t *u, uint16_t *h, int64_t n,
                     int nthreads) {
#pragma omp parallel num_threads(nthreads)
    {
        int64_t a, b;
        share_elems(n, omp_get_thread_num(), omp_get_num_threads(), &a, &b);
        int64_t i = a;
#ifdef __AVX512BF16__
        for (; i + 16 <= b; i += 16) {
            const __m512 x = bf16x16_to_f32(_mm256_loadu_si256((const void *)(g + i)));
            const __m512 y = bf16x16_to_f32(_mm256_loadu_si256((const void *)(u + i)));
            _mm256_storeu_si256((void *)(h + i), (__m256i)_mm512_cvtneps_pbh(
                _mm512_mul_ps(round_bf16_x16(silu_x16(x)), y)));
        }
#endif
        for (; i < b; i++) {
            const float x = bf16_to_f32(g[i]);
            h[i] = f32_to_bf16(rounded(x * sigmoid(x)) * bf16_to_f32(u[i]));
        }
    }
}

void swiglu_bwd_bf16(const uint16_t *g, const uint16_t *u, const uint16_t *dh,
                     uint16_t *dg, uint16_t *du, int64_t n, int nthreads) {
#pragma omp parallel num_threads(nthreads)
    {
        int64_t a, b;
        share_elems(n, omp_get_thread_num(), omp_get_num_threads(), &a, &b);
        int64_t i = a;
#ifdef __AVX512BF16__
        const __m512 one = _mm512_set1_ps(1.0f);
        for (; i + 16 <= b; i += 16) {
            const __m512 x = bf16x16_to_f32(_mm256_loadu_si256((const void *)(g + i)));
            const __m512 y = bf16x16_to_f32(_mm256_loadu_si256((const void *)(u + i)));
            const __m512 d = bf16x16_to_f32(_mm256_loadu_si256((const void *)(dh + i)));
            const __m512 sig = sigmoid_x16(x);
            _mm256_storeu_si256((void *)(du + i), (__m256i)_mm512_cvtneps_pbh(
                _mm512_mul_ps(d, round_bf16_x16(_mm512_mul_ps(x, sig)))));
            const __m512 ds = round_bf16_x16(_mm512_mul_ps(d, y));
            const __m512 slope = _mm512_fmadd_ps(x, _mm512_sub_ps(one, sig), one);
            _mm256_storeu_si256((void *)(dg + i), (__m256i)_mm512_cvtneps_pbh(
                _mm512_mul_ps(_mm512_mul_ps(ds, sig), slope)));
        }
#endif
        for (; i < b; i++) {
            const float x = bf16_to_f32(g[i]), d = bf16_to_f32(dh[i]);
            const float sig = sigmoid(x);
            du[i] = f32_to_bf16(d * rounded(x * sig));
            const float ds = rounded(d * bf16_to_f32(u[i]));
            dg[i] = f32_to_bf16(ds * sig * (1.0f + x * (1.0f - sig)));
        }
    }
}
