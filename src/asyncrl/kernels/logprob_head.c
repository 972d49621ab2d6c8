/* The trainer's vocabulary head on bf16 logits (trainer/cpu/logprob_head.py), one pass per
 * row group instead of torch's chain of fp32 temporaries.
 *
 * head_rows_bf16: for each row of bf16 logits [B, V], with z = float(logits) / temperature
 * as the torch path computes it, the log-probability of the row's token, z[tok] -
 * logsumexp(z); optionally its entropy -sum p log p; optionally the gradient template
 * (onehot(tok) - softmax(z)) / temperature, written over the row in bf16 (each value
 * computed in float32 and rounded once, as the torch path rounds it). A row's three passes
 * (max; sum of exponentials; template) read it from cache, so the fp32 logits never exist.
 *
 * scale_rows_bf16: x[b, :] = bf16(float(x[b, :]) * g[b]), in place: the template times the
 * incoming gradient, rounded as autograd rounds dL/dz.
 *
 * Compiled at first use by kernels/__init__.py; torch's thread pool is shared (libgomp).
 */
#include <stdint.h>
#include <string.h>
#include <math.h>
#include <omp.h>
#include "common.h"

#define BLOCK 256  /* the sums run per block of 256 values, then over blocks (accuracy) */

#ifdef __AVX512BF16__
/* z = x / t; at t = 1 the division is the identity, and skipped. */
static inline __m512 over_t(__m512 x, __m512 vt, int unit) {
    return unit ? x : _mm512_div_ps(x, vt);
}
#endif

/* One row's passes: its max, its sums per block, and optionally the template over it. The
 * AVX512-BF16 path takes the same float32 steps on 16 lanes (the lanes' partial sums add in
 * another order; its rounding is the hardware's RNE). */
static void head_row(uint16_t *row, int V, int64_t y, float t, float *logprob, float *entropy,
                     int write_template) {
#ifdef __AVX512BF16__
    const __m512 vt = _mm512_set1_ps(t), ninf = _mm512_set1_ps(-INFINITY);
    const int unit = t == 1.0f;
    __m512 vm = ninf;
    for (int i = 0; i < V; i += 16) {
        const __mmask16 k = lanes(V - i);
        vm = _mm512_mask_max_ps(vm, k, vm, over_t(load16(k, row + i), vt, unit));
    }
    const float m = _mm512_reduce_max_ps(vm);
    const __m512 vmax = _mm512_set1_ps(m);
    float total = 0.0f, weighted = 0.0f;  /* sum e^(z-m), sum e^(z-m) (z-m) */
    for (int k0 = 0; k0 < V; k0 += BLOCK) {
        const int end = k0 + BLOCK < V ? k0 + BLOCK : V;
        __m512 vs = _mm512_setzero_ps(), vw = _mm512_setzero_ps();
        for (int i = k0; i < end; i += 16) {
            const __mmask16 k = lanes(end - i);
            const __m512 d = _mm512_sub_ps(over_t(load16(k, row + i), vt, unit), vmax);
            const __m512 e = _mm512_maskz_mov_ps(k, exp_neg_x16(d));
            vs = _mm512_add_ps(vs, e);
            vw = _mm512_fmadd_ps(e, d, vw);
        }
        total += _mm512_reduce_add_ps(vs);
        weighted += _mm512_reduce_add_ps(vw);
    }
#else
    float m = -INFINITY;
#pragma omp simd reduction(max:m)
    for (int i = 0; i < V; i++) {
        const float z = bf16_to_f32(row[i]) / t;
        m = z > m ? z : m;
    }
    float total = 0.0f, weighted = 0.0f;  /* sum e^(z-m), sum e^(z-m) (z-m) */
    for (int k = 0; k < V; k += BLOCK) {
        const int end = k + BLOCK < V ? k + BLOCK : V;
        float s = 0.0f, w = 0.0f;
#pragma omp simd reduction(+:s, w)
        for (int i = k; i < end; i++) {
            const float d = bf16_to_f32(row[i]) / t - m;
            const float e = exp_neg(d);
            s += e;
            w += e * d;
        }
        total += s;
        weighted += w;
    }
#endif
    const float log_total = logf(total);  /* logsumexp(z) = m + log_total */
    const float lp = (bf16_to_f32(row[y]) / t - m) - log_total;
    *logprob = lp;
    if (entropy) *entropy = log_total - weighted / total;
    if (!write_template) return;
    const float shift = m + log_total;
#ifdef __AVX512BF16__
    const __m512 vshift = _mm512_set1_ps(shift), vneg_t = _mm512_set1_ps(-t);
    for (int i = 0; i < V; i += 16) {
        const __mmask16 k = lanes(V - i);
        const __m512 p = exp_neg_x16(_mm512_sub_ps(over_t(load16(k, row + i), vt, unit), vshift));
        /* -p / t; at t = 1 the negation alone */
        const __m512 g = unit ? _mm512_sub_ps(_mm512_setzero_ps(), p) : _mm512_div_ps(p, vneg_t);
        _mm256_mask_storeu_epi16(row + i, k, (__m256i)_mm512_cvtneps_pbh(g));
    }
#else
#pragma omp simd
    for (int i = 0; i < V; i++) {
        const float p = exp_neg(bf16_to_f32(row[i]) / t - shift);
        row[i] = f32_to_bf16(-p / t);
    }
#endif
    row[y] = f32_to_bf16((1.0f - exp_neg(lp)) / t);
}

void head_rows_bf16(uint16_t *logits, int B, int V, const int64_t *tok, float temperature,
                    float *logprob, float *entropy, int write_template, int nthreads) {
#pragma omp parallel num_threads(nthreads)
    {
        int lo, hi;
        share(B, omp_get_thread_num(), omp_get_num_threads(), &lo, &hi);
        for (int b = lo; b < hi; b++)
            head_row(logits + (int64_t)b * V, V, tok[b], temperature, logprob + b,
                     entropy ? entropy + b : NULL, write_template);
    }
}

void scale_rows_bf16(uint16_t *x, int B, int V, const float *g, int nthreads) {
#pragma omp parallel num_threads(nthreads)
    {
        int lo, hi;
        share(B, omp_get_thread_num(), omp_get_num_threads(), &lo, &hi);
        for (int b = lo; b < hi; b++) {
            uint16_t *row = x + (int64_t)b * V;
            const float gb = g[b];
#ifdef __AVX512BF16__
            const __m512 vg = _mm512_set1_ps(gb);
            for (int i = 0; i < V; i += 16) {
                const __mmask16 k = lanes(V - i);
                _mm256_mask_storeu_epi16(row + i, k, (__m256i)_mm512_cvtneps_pbh(
                    _mm512_mul_ps(load16(k, row + i), vg)));
            }
#else
#pragma omp simd
            for (int i = 0; i < V; i++) row[i] = f32_to_bf16(bf16_to_f32(row[i]) * gb);
#endif
        }
    }
}
