/* Two passes of the trainer's backward over bf16 gradients (training/linear.py,
 * training/precision.py):
 *
 *   transpose_bf16    out [C, R] = in [R, C]^T (in's rows ld elements apart), 32 x 32
 *                     blocks from cache: ~2x torch's transposing copy at the quickstart's sizes
 *   add_bf16_to_f32   total [n] += part [n] widened exactly (bf16 -> fp32 is a shift, and
 *                     one fp32 add each, as torch's add_ rounds it)
 *
 * Compiled at first use by kernels/__init__.py; torch's thread pool is shared (libgomp).
 */
#include <stdint.h>
#include <omp.h>
#include "common.h"

void transpose_bf16(const uint16_t *in, int R, int C, int64_t ld, uint16_t *out,
                    int nthreads) {
    enum { B = 32 };
    const int blocks = (C + B - 1) / B;
#pragma omp parallel num_threads(nthreads)
    {
        int lo, hi;
        share(blocks, omp_get_thread_num(), omp_get_num_threads(), &lo, &hi);
        for (int cb = lo; cb < hi; cb++) {
            const int c0 = cb * B, c1 = c0 + B < C ? c0 + B : C;
            for (int r0 = 0; r0 < R; r0 += B) {
                const int r1 = r0 + B < R ? r0 + B : R;
                for (int c = c0; c < c1; c++) {
                    uint16_t *o = out + (int64_t)c * R;
#pragma omp simd
                    for (int r = r0; r < r1; r++)
                        o[r] = in[(int64_t)r * ld + c];
                }
            }
        }
    }
}

void add_bf16_to_f32(float *total, const uint16_t *part, int64_t n, int nthreads) {
#pragma omp parallel num_threads(nthreads)
    {
        int64_t a, b;
        share_elems(n, omp_get_thread_num(), omp_get_num_threads(), &a, &b);
#pragma omp simd
        for (int64_t i = a; i < b; i++)
            total[i] += bf16_to_f32(part[i]);
    }
}
