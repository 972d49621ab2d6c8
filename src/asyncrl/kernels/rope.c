/* Rotary position embedding of the trainer's attention (trainer/cpu/rope.py), forward and
 * backward, bf16, with HF's roundings: for each row x of head_dim D (halves x1, x2) and
 * its position's cos c and sin s,
 *
 *   forward   out = round(round(x * c) + round(rot(x) * s)),   rot(x) = (-x2, x1)
 *   backward  dx  = round(round(g * c) + rot'(round(g * s))),  rot'(y) = (y2, -y1)
 *
 * which is what torch computes in bf16 for HF's `q * cos + rotate_half(q) * sin` and its
 * autograd, op by op, bit for bit: one pass instead of ~6 forward and ~8 backward.
 *
 * Rows are [B, H, N] with element strides (sb, sh, sn) and contiguous along D, as HF's
 * transposed q and k are; the output takes the same strides. cos and sin are [B, N, D],
 * contiguous. 16 lanes on AVX512-BF16 machines (D / 2 a multiple of 16), else plain C.
 */
#include <stdint.h>
#include <omp.h>
#include "common.h"

static inline float r(float x) { return bf16_to_f32(f32_to_bf16(x)); }

/* Forward (rot) or backward (rot', which takes the sines of the other half), row by row. */
static void rope_rows(const uint16_t *x, const uint16_t *cos, const uint16_t *sin,
                      uint16_t *out, int64_t B, int64_t H, int64_t N, int64_t D,
                      int64_t sb, int64_t sh, int64_t sn, int backward, int nthreads) {
    const int64_t half = D / 2, rows = B * H * N;
#pragma omp parallel num_threads(nthreads)
    {
        int lo, hi;
        share((int)rows, omp_get_thread_num(), omp_get_num_threads(), &lo, &hi);
        for (int64_t row = lo; row < hi; row++) {
            const int64_t b = row / (H * N), h = (row / N) % H, n = row % N;
            const int64_t off = b * sb + h * sh + n * sn;
            const uint16_t *xr = x + off, *c = cos + (b * N + n) * D, *s = sin + (b * N + n) * D;
            uint16_t *o = out + off;
            int64_t i = 0;
#ifdef __AVX512BF16__
            for (; i + 16 <= half; i += 16) {
                const __m512 a = bf16x16_to_f32(_mm256_loadu_si256((const void *)(xr + i)));
                const __m512 z = bf16x16_to_f32(_mm256_loadu_si256((const void *)(xr + half + i)));
                const __m512 c1 = bf16x16_to_f32(_mm256_loadu_si256((const void *)(c + i)));
                const __m512 c2 = bf16x16_to_f32(_mm256_loadu_si256((const void *)(c + half + i)));
                const __m512 s1 = bf16x16_to_f32(_mm256_loadu_si256((const void *)(s + i)));
                const __m512 s2 = bf16x16_to_f32(_mm256_loadu_si256((const void *)(s + half + i)));
                __m512 lo_v, hi_v;
                if (!backward) {  /* (a c1 - z s1, z c2 + a s2) */
                    lo_v = _mm512_sub_ps(round_bf16_x16(_mm512_mul_ps(a, c1)),
                                         round_bf16_x16(_mm512_mul_ps(z, s1)));
                    hi_v = _mm512_add_ps(round_bf16_x16(_mm512_mul_ps(z, c2)),
                                         round_bf16_x16(_mm512_mul_ps(a, s2)));
                } else {          /* (a c1 + z s2, z c2 - a s1) */
                    lo_v = _mm512_add_ps(round_bf16_x16(_mm512_mul_ps(a, c1)),
                                         round_bf16_x16(_mm512_mul_ps(z, s2)));
                    hi_v = _mm512_sub_ps(round_bf16_x16(_mm512_mul_ps(z, c2)),
                                         round_bf16_x16(_mm512_mul_ps(a, s1)));
                }
                _mm256_storeu_si256((void *)(o + i), (__m256i)_mm512_cvtneps_pbh(lo_v));
                _mm256_storeu_si256((void *)(o + half + i), (__m256i)_mm512_cvtneps_pbh(hi_v));
            }
#endif
            for (; i < half; i++) {
                const float a = bf16_to_f32(xr[i]), z = bf16_to_f32(xr[half + i]);
                const float c1 = bf16_to_f32(c[i]), c2 = bf16_to_f32(c[half + i]);
                const float s1 = bf16_to_f32(s[i]), s2 = bf16_to_f32(s[half + i]);
                if (!backward) {
                    o[i] = f32_to_bf16(r(a * c1) - r(z * s1));
                    o[half + i] = f32_to_bf16(r(z * c2) + r(a * s2));
                } else {
                    o[i] = f32_to_bf16(r(a * c1) + r(z * s2));
                    o[half + i] = f32_to_bf16(r(z * c2) - r(a * s1));
                }
            }
        }
    }
}

void rope_fwd_bf16(const uint16_t *x, const uint16_t *cos, const uint16_t *sin, uint16_t *out,
                   int64_t B, int64_t H, int64_t N, int64_t D, int64_t sb, int64_t sh,
                   int64_t sn, int nthreads) {
    rope_rows(x, cos, sin, out, B, H, N, D, sb, sh, sn, 0, nthreads);
}

void rope_bwd_bf16(const uint16_t *grad, const uint16_t *cos, const uint16_t *sin,
                   uint16_t *grad_x, int64_t B, int64_t H, int64_t N, int64_t D, int64_t sb,
                   int64_t sh, int64_t sn, int nthreads) {
    rope_rows(grad, cos, sin, grad_x, B, H, N, D, sb, sh, sn, 1, nthreads);
}
