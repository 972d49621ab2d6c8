/* AdamW over float32 masters (trainer/cpu/optim.py), the update of torch's fused AdamW, and in
 * the same pass the bf16 compute copy of each updated weight (trainer/cpu/precision.py):
 *
 *   g = grad / grad_scale                    (the clip; grad_scale 1: none)
 *   p = p * (1 - lr wd)                      (decoupled weight decay)
 *   m = m + (1 - beta1) (g - m)              (m.lerp_(g, 1 - beta1))
 *   v = v beta2 + (1 - beta2) g g
 *   p = p - step_size m / (sqrt(v) / sqrt(bc2) + eps),  step_size = lr / bc1
 *   copy = bf16(p)                           (as torch casts), where copy != NULL
 *
 * The coefficients come from the caller in double, rounded to float once, as torch's kernel
 * does; the float32 steps may differ from torch's by an fp32 rounding (FMA contraction).
 * Compiled at first use by kernels/__init__.py; torch's thread pool is shared (libgomp).
 */
#include <stdint.h>
#include <math.h>
#include <omp.h>
#include "common.h"

/* 16 lanes: the divisions and square roots, not memory, bound the loop at gcc's usual 8. */
__attribute__((target("prefer-vector-width=512")))
void adamw_f32(float *p, const float *g, float *m, float *v, uint16_t *copy, int64_t n,
               float grad_scale, float decay, float one_minus_beta1, float beta2,
               float one_minus_beta2, float step_size, float bc2_sqrt, float eps,
               int nthreads) {
    enum { BLOCK = 4096 };  /* the copy of a block is rounded while p is in cache */
    const int unscaled = grad_scale == 1.0f;  /* g / 1 is g: no division */
#pragma omp parallel num_threads(nthreads)
    {
        int64_t a, b;
        share_elems(n, omp_get_thread_num(), omp_get_num_threads(), &a, &b);
        for (int64_t k = a; k < b; k += BLOCK) {
            const int64_t end = k + BLOCK < b ? k + BLOCK : b;
#pragma omp simd
            for (int64_t i = k; i < end; i++) {
                const float gi = unscaled ? g[i] : g[i] / grad_scale;
                const float mi = m[i] + one_minus_beta1 * (gi - m[i]);
                const float vi = v[i] * beta2 + one_minus_beta2 * gi * gi;
                p[i] = p[i] * decay - step_size * mi / (sqrtf(vi) / bc2_sqrt + eps);
                m[i] = mi;
                v[i] = vi;
            }
            if (!copy) continue;
#pragma omp simd
            for (int64_t i = k; i < end; i++) copy[i] = f32_to_bf16(p[i]);  /* torch's cast */
        }
    }
}
