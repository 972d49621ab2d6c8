/* The trainer's vocabulary head on bf16 logits (training/logprob_head.py), one pass per
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

void head_rows_bf16(uint16_t *logits, int B, int V, const int64_t *tok, float temperature,
                    float *logprob, float *entropy, int write_template, int nthreads) {
    const float t = temperature;
#pragma omp parallel num_threads(nthreads)
    {
        int lo, hi;
        share(B, omp_get_thread_num(), omp_get_num_threads(), &lo, &hi);
        for (int b = lo; b < hi; b++) {
            uint16_t *row = logits + (int64_t)b * V;
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
            const float log_total = logf(total);  /* logsumexp(z) = m + log_total */
            const int64_t y = tok[b];
            const float lp = (bf16_to_f32(row[y]) / t - m) - log_total;
            logprob[b] = lp;
            if (entropy) entropy[b] = log_total - weighted / total;
            if (!write_template) continue;
            const float shift = m + log_total;
#pragma omp simd
            for (int i = 0; i < V; i++) {
                const float p = exp_neg(bf16_to_f32(row[i]) / t - shift);
                row[i] = f32_to_bf16(-p / t);
            }
            row[y] = f32_to_bf16((1.0f - exp_neg(lp)) / t);
        }
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
#pragma omp simd
            for (int i = 0; i < V; i++) row[i] = f32_to_bf16(bf16_to_f32(row[i]) * gb);
        }
    }
}
