/* RMSNorm of bf16 rows for the trainer (trainer/cpu/norm.py), forward and backward, with HF's
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

/* One row of the forward; returns r. The AVX512-BF16 path takes the same float32 steps on
 * 16 lanes (sum of squares in another order; its rounding is the hardware's RNE). */
static float norm_row(const uint16_t *xr, const uint16_t *w, int D, float eps, uint16_t *yr) {
#ifdef __AVX512BF16__
    __m512 vss = _mm512_setzero_ps();
    for (int i = 0; i < D; i += 16) {
        const __m512 v = load16(lanes(D - i), xr + i);
        vss = _mm512_fmadd_ps(v, v, vss);
    }
    const float r = 1.0f / sqrtf(_mm512_reduce_add_ps(vss) / (float)D + eps);
    const __m512 vr = _mm512_set1_ps(r);
    for (int i = 0; i < D; i += 16) {
        const __mmask16 t = lanes(D - i);
        const __m512 hb = round_bf16_x16(_mm512_mul_ps(load16(t, xr + i), vr));
        _mm256_mask_storeu_epi16(yr + i, t,
                                 (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(load16(t, w + i), hb)));
    }
    return r;
#else
    float ss = 0.0f;
#pragma omp simd reduction(+:ss)
    for (int i = 0; i < D; i++) {
        const float v = bf16_to_f32(xr[i]);
        ss += v * v;
    }
    const float r = 1.0f / sqrtf(ss / (float)D + eps);
#pragma omp simd
    for (int i = 0; i < D; i++) {
        const float hb = bf16_to_f32(f32_to_bf16(bf16_to_f32(xr[i]) * r));
        yr[i] = f32_to_bf16(bf16_to_f32(w[i]) * hb);
    }
    return r;
#endif
}

/* One row of the backward: gxr, and the row's bf16(g * bf16(x r)) added into gw. */
static void norm_grad_row(const uint16_t *xr, const uint16_t *w, const uint16_t *gr, float r,
                          int D, uint16_t *gxr, float *gw) {
    /* r = (v + eps)^-1/2: dr/dv = -r^3 / 2; v = sum x^2 / D: dv/dx_i = 2 x_i / D */
#ifdef __AVX512BF16__
    const __m512 vr = _mm512_set1_ps(r);
    __m512 vdot = _mm512_setzero_ps();  /* d loss / d r = sum_i gh_i x_i */
    for (int i = 0; i < D; i += 16) {
        const __mmask16 t = lanes(D - i);
        const __m512 xv = load16(t, xr + i), gv = load16(t, gr + i);
        const __m512 hb = round_bf16_x16(_mm512_mul_ps(xv, vr));
        const __m512 gh = round_bf16_x16(_mm512_mul_ps(gv, load16(t, w + i)));
        const __m512 gwv = _mm512_add_ps(_mm512_maskz_loadu_ps(t, gw + i),
                                         round_bf16_x16(_mm512_mul_ps(gv, hb)));
        _mm512_mask_storeu_ps(gw + i, t, gwv);
        vdot = _mm512_fmadd_ps(gh, xv, vdot);
    }
    const float coef = _mm512_reduce_add_ps(vdot) * (-0.5f * r * r * r) * 2.0f / (float)D;
    const __m512 vcoef = _mm512_set1_ps(coef);
    for (int i = 0; i < D; i += 16) {
        const __mmask16 t = lanes(D - i);
        const __m512 xv = load16(t, xr + i), gv = load16(t, gr + i);
        const __m512 gh = round_bf16_x16(_mm512_mul_ps(gv, load16(t, w + i)));
        _mm256_mask_storeu_epi16(gxr + i, t, (__m256i)_mm512_cvtneps_pbh(
            _mm512_fmadd_ps(gh, vr, _mm512_mul_ps(vcoef, xv))));
    }
#else
    float dot = 0.0f;  /* d loss / d r = sum_i gh_i x_i */
#pragma omp simd reduction(+:dot)
    for (int i = 0; i < D; i++) {
        const float xv = bf16_to_f32(xr[i]), gv = bf16_to_f32(gr[i]);
        const float hb = bf16_to_f32(f32_to_bf16(xv * r));
        const float gh = bf16_to_f32(f32_to_bf16(gv * bf16_to_f32(w[i])));
        gw[i] += bf16_to_f32(f32_to_bf16(gv * hb));
        dot += gh * xv;
    }
    const float coef = dot * (-0.5f * r * r * r) * 2.0f / (float)D;
#pragma omp simd
    for (int i = 0; i < D; i++) {
        const float xv = bf16_to_f32(xr[i]), gv = bf16_to_f32(gr[i]);
        const float gh = bf16_to_f32(f32_to_bf16(gv * bf16_to_f32(w[i])));
        gxr[i] = f32_to_bf16(gh * r + coef * xv);
    }
#endif
}

void rms_norm_fwd_bf16(const uint16_t *x, const uint16_t *w, int B, int D, float eps,
                       uint16_t *y, float *rstd, int nthreads) {
#pragma omp parallel num_threads(nthreads)
    {
        int lo, hi;
        share(B, omp_get_thread_num(), omp_get_num_threads(), &lo, &hi);
        for (int b = lo; b < hi; b++) {
            const uint16_t *xr = x + (int64_t)b * D;
            uint16_t *yr = y + (int64_t)b * D;
            rstd[b] = norm_row(xr, w, D, eps, yr);
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
            norm_grad_row(xr, w, gr, rstd[b], D, gxr, gw);
        }
    }
}
