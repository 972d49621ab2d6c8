/* Passes of the trainer's backward over its gradients (trainer/cpu/linear.py,
 * trainer/cpu/precision.py):
 *
 *   transpose_bf16    out [C, R] = in [R, C]^T (in's rows ld elements apart), 8 x 32
 *                     blocks in AVX-512 registers (scalar elsewhere) within tiles of 128
 *                     rows: ~3x torch's transposing copy at the quickstart's sizes
 *   add_bf16_to_f32   total [n] += part [n] widened exactly (bf16 -> fp32 is a shift, and
 *                     one fp32 add each, as torch's add_ rounds it)
 *   sum_squares_f32   the squared 2-norm of a list of fp32 tensors (the gradient norm)
 *
 * Compiled at first use by kernels/__init__.py; torch's thread pool is shared (libgomp).
 */
#include <stdint.h>
#include <omp.h>
#include "common.h"

#ifdef __AVX512BW__
#include <immintrin.h>
/* 8 rows (ld apart) x the first `cols` <= 32 columns of in -> out, column c's 8 values at
 * out + c * R: the 8 x 8 transpose of 16-bit values by unpacks, within each 128-bit lane
 * (lane j holds columns 8 j .. 8 j + 7). */
static inline void transpose_8x32(const uint16_t *in, int64_t ld, int cols, uint16_t *out,
                                  int64_t R) {
    const __mmask32 t = cols >= 32 ? 0xFFFFFFFFu : (__mmask32)((1u << cols) - 1);
    __m512i r[8], a[8], b[8], c[8];
    for (int i = 0; i < 8; i++) r[i] = _mm512_maskz_loadu_epi16(t, in + i * ld);
    for (int i = 0; i < 4; i++) {
        a[2 * i] = _mm512_unpacklo_epi16(r[2 * i], r[2 * i + 1]);
        a[2 * i + 1] = _mm512_unpackhi_epi16(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++) {  /* rows 4 i .. 4 i + 3 */
        b[4 * i] = _mm512_unpacklo_epi32(a[4 * i], a[4 * i + 2]);      /* columns 0, 1 */
        b[4 * i + 1] = _mm512_unpackhi_epi32(a[4 * i], a[4 * i + 2]);  /* 2, 3 */
        b[4 * i + 2] = _mm512_unpacklo_epi32(a[4 * i + 1], a[4 * i + 3]);  /* 4, 5 */
        b[4 * i + 3] = _mm512_unpackhi_epi32(a[4 * i + 1], a[4 * i + 3]);  /* 6, 7 */
    }
    for (int i = 0; i < 4; i++) {
        c[2 * i] = _mm512_unpacklo_epi64(b[i], b[4 + i]);
        c[2 * i + 1] = _mm512_unpackhi_epi64(b[i], b[4 + i]);
    }
#define STORE_LANE(j)                                                                      \
    for (int k = 0; k < 8 && 8 * (j) + k < cols; k++)                                      \
        _mm_storeu_si128((__m128i *)(out + (int64_t)(8 * (j) + k) * R),                    \
                         _mm512_extracti32x4_epi32(c[k], j));
    STORE_LANE(0) STORE_LANE(1) STORE_LANE(2) STORE_LANE(3)
#undef STORE_LANE
}
#endif

void transpose_bf16(const uint16_t *in, int R, int C, int64_t ld, uint16_t *out,
                    int nthreads) {
    /* Tiles of RT rows x B columns; a thread's column blocks run inside each row tile, so
     * wide rows (the log-prob head's 49k vocabulary) are read a few pages at a time. */
    enum { B = 32, RT = 128 };
    const int blocks = (C + B - 1) / B;
#pragma omp parallel num_threads(nthreads)
    {
        int lo, hi;
        share(blocks, omp_get_thread_num(), omp_get_num_threads(), &lo, &hi);
        for (int t0 = 0; t0 < R; t0 += RT) {
            const int t1 = t0 + RT < R ? t0 + RT : R;
            for (int cb = lo; cb < hi; cb++) {
                const int c0 = cb * B, c1 = c0 + B < C ? c0 + B : C;
                int r0 = t0;
#ifdef __AVX512BW__
                for (; r0 + 8 <= t1; r0 += 8)
                    transpose_8x32(in + (int64_t)r0 * ld + c0, ld, c1 - c0,
                                   out + (int64_t)c0 * R + r0, R);
#endif
                for (int c = c0; c < c1; c++) {
                    uint16_t *o = out + (int64_t)c * R;
                    for (int r = r0; r < t1; r++)
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

/* sum of squares over n tensors (fp32, each ptrs[t] of sizes[t] elements), in double: the
 * global gradient norm's square in one parallel pass; each thread takes an equal share of
 * all the elements, whatever the tensors' sizes (torch's norm ran one tensor at a time). */
double sum_squares_f32(const float *const *ptrs, const int64_t *sizes, int n, int nthreads) {
    int64_t total = 0;
    for (int t = 0; t < n; t++) total += sizes[t];
    double sum = 0.0;
#pragma omp parallel num_threads(nthreads) reduction(+:sum)
    {
        int64_t a, b;
        share_elems(total, omp_get_thread_num(), omp_get_num_threads(), &a, &b);
        int64_t base = 0;
        for (int t = 0; t < n && base < b; base += sizes[t], t++) {
            const int64_t lo = a > base ? a - base : 0;
            const int64_t hi = b < base + sizes[t] ? b - base : sizes[t];
            const float *x = ptrs[t];
            for (int64_t k = lo; k < hi; k += 4096) {  /* float sums of 4096, then double */
                const int64_t end = k + 4096 < hi ? k + 4096 : hi;
                float s = 0.0f;
#pragma omp simd reduction(+:s)
                for (int64_t i = k; i < end; i++) s += x[i] * x[i];
                sum += s;
            }
        }
    }
    return sum;
}
