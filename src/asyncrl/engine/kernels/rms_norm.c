/* RMSNorm of bf16 rows for the trainer (training/norm.py), forward and backward, with HF's
 * roundings: y = bf16(w * bf16(x * r)), r = 1 / sqrt(mean(x^2) + eps) in float32; the
 * backward in float32 with autograd's bf16 roundings of the products by w and by bf16(x r),
 * the input gradient rounded once. Each row is read from cache; torch's version runs ~10
 * elementwise ops forward and ~15 backward over the whole tensor.
 *
 * Compiled at first use by kernels/__init__.py; torch's thread pool is shared (libgomp).
 */
#include <stdint.h>
#include <string.h>
#include <math.h>
#include <omp.h>
#include "common.h"

void rms_norm_fwd_bf16(const uint16_t *x, const uint16_t *w, int B, int D, float eps,
                       uint16_t *y, float *rstd, int nthreads) {
#pragma omp parallel num_threads(nthreads)
    {
        int lo, hi;
        share(B, omp_get_thread_num(), omp_get_num_threads(), &lo, &hi);
        for (int b = lo; b < hi; b++) {
            const uint16_t *xr = x + (int64_t)b * D;
            uint16_t *yr = y + (int64_t)b * D;
            float ss = 0.0f;
#pragma omp simd reduction(+:ss)
            for (int i = 0; i < D; i++) {
                const float v = bf16_to_f32(xr[i]);
                ss += v * v;
            }
            const float r = 1.0f / sqrtf(ss / (float)D + eps);
            rstd[b] = r;
#pragma omp simd
            for (int i = 0; i < D; i++) {
                const float hb = bf16_to_f32(f32_to_bf16(bf16_to_f32(xr[i]) * r));
                yr[i] = f32_to_bf16(bf16_to_f32(w[i]) * hb);
            }
        }
    }
}

/* gx [B, D] bf16; gw_part [nthreads, D] float32, zeroed by the caller: each thread adds
 * its rows' bf16(g * bf16(x r)) into its own row (the caller sums them). */
void rms_norm_bwd_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *g,
                       const float *rstd, int B, int D, uint16_t *gx, float *gw_part,
                       int nthreads) {
#pragma omp parallel num_threads(nthreads)
    {
        int lo, hi;
        const int tid = omp_get_thread_num();
        share(B, tid, omp_get_num_threads(), &lo, &hi);
        float *gw = gw_part + (int64_t)tid * D;
        for (int b = lo; b < hi; b++) {
            const uint16_t *xr = x + (int64_t)b * D, *gr = g + (int64_t)b * D;
            uint16_t *gxr = gx + (int64_t)b * D;
            const float r = rstd[b];
            float dot = 0.0f;  /* d loss / d r = sum_i gh_i x_i */
#pragma omp simd reduction(+:dot)
            for (int i = 0; i < D; i++) {
                const float xv = bf16_to_f32(xr[i]), gv = bf16_to_f32(gr[i]);
                const float hb = bf16_to_f32(f32_to_bf16(xv * r));
                const float gh = bf16_to_f32(f32_to_bf16(gv * bf16_to_f32(w[i])));
                gw[i] += bf16_to_f32(f32_to_bf16(gv * hb));
                dot += gh * xv;
            }
            /* r = (v + eps)^-1/2: dr/dv = -r^3 / 2; v = sum x^2 / D: dv/dx_i = 2 x_i / D */
            const float coef = dot * (-0.5f * r * r * r) * 2.0f / (float)D;
#pragma omp simd
            for (int i = 0; i < D; i++) {
                const float xv = bf16_to_f32(xr[i]), gv = bf16_to_f32(gr[i]);
                const float gh = bf16_to_f32(f32_to_bf16(gv * bf16_to_f32(w[i])));
                gxr[i] = f32_to_bf16(gh * r + coef * xv);
            }
        }
    }
}
