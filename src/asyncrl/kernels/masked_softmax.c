/* The softmax of the trainer's trie attention (trainer/cpu/attention.py), forward and backward,
 * over bf16 score rows under a boolean mask shared by the heads:
 *
 *   forward   p = softmax(scale * s) over the keys the mask allows (others 0)
 *   backward  ds = scale * p * (dp - sum_j p_j dp_j)
 *
 * s, p, dp, ds: [R, H, L, L] bf16 (row (r, h, i) holds query i's scores over the L keys);
 * mask: [R, L, L] bytes, 1 where query i may attend to key j (every row allows its query's
 * own key, so no row is empty). Each row is computed in float32 from cache and rounded once,
 * as torch's masked_fill + softmax and its softmax backward do; these replace 3 passes over
 * the [R, H, L, L] tensors forward and 2 backward. At the end of the file: the moves of
 * q, k, v and the output between the trie's nodes and the packed rows.
 *
 * Compiled at first use by kernels/__init__.py; torch's thread pool is shared (libgomp).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <omp.h>
#include "common.h"

/* One row of the forward: p[0, L) from s and the mask row m, keys past `end` all hidden;
 * buf holds L + 16 floats. */
static void softmax_row(const uint16_t *sr, const uint8_t *m, int end, int L, float scale,
                        float *buf, uint16_t *pr) {
#ifdef __AVX512BF16__
    /* 16 keys at a time (the tail under a lane mask), the same float32 steps as below: the
     * row's max and the values are the same; the sum adds in another order. */
    const __m512 vscale = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-INFINITY);
    __m512 vtop = ninf;
    for (int j = 0; j < end; j += 16) {
        const __mmask16 t = lanes(end - j);
        const __m128i mb = _mm_maskz_loadu_epi8(t, m + j);
        const __mmask16 allowed = _mm_test_epi8_mask(mb, mb);
        const __m512 x = _mm512_mask_mul_ps(ninf, allowed, vscale,
                                            load16(t, sr + j));
        _mm512_storeu_ps(buf + j, x);
        vtop = _mm512_max_ps(vtop, x);
    }
    const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(vtop));
    __m512 vsum = _mm512_setzero_ps();
    for (int j = 0; j < end; j += 16) {
        const __mmask16 t = lanes(end - j);
        const __m128i mb = _mm_maskz_loadu_epi8(t, m + j);
        const __mmask16 allowed = _mm_test_epi8_mask(mb, mb);
        const __m512 e = _mm512_maskz_mov_ps(
            allowed, exp_neg_x16(_mm512_sub_ps(_mm512_loadu_ps(buf + j), top)));
        _mm512_storeu_ps(buf + j, e);
        vsum = _mm512_add_ps(vsum, e);
    }
    const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(vsum));
    for (int j = 0; j < end; j += 16) {
        const __mmask16 t = lanes(end - j);
        _mm256_mask_storeu_epi16(pr + j, t, (__m256i)_mm512_cvtneps_pbh(
            _mm512_mul_ps(_mm512_loadu_ps(buf + j), inv)));
    }
#else
    float top = -INFINITY;
#pragma omp simd reduction(max:top)
    for (int j = 0; j < end; j++) {
        const float x = m[j] ? scale * bf16_to_f32(sr[j]) : -INFINITY;
        buf[j] = x;
        top = x > top ? x : top;
    }
    float sum = 0.0f;
#pragma omp simd reduction(+:sum)
    for (int j = 0; j < end; j++) {
        const float e = m[j] ? exp_neg(buf[j] - top) : 0.0f;  /* -inf - top: clamped */
        buf[j] = e;
        sum += e;
    }
    const float inv = 1.0f / sum;
#pragma omp simd
    for (int j = 0; j < end; j++)
        pr[j] = f32_to_bf16(buf[j] * inv);
#endif
    memset(pr + end, 0, sizeof(uint16_t) * (size_t)(L - end));
}

/* One row of the backward: ds = scale * p * (dp - sum_j p_j dp_j). */
static void softmax_grad_row(const uint16_t *pr, const uint16_t *gr, int L, float scale,
                             uint16_t *out) {
#ifdef __AVX512BF16__
    __m512 vdot = _mm512_setzero_ps();
    for (int j = 0; j < L; j += 16) {
        const __mmask16 t = lanes(L - j);
        vdot = _mm512_fmadd_ps(load16(t, pr + j), load16(t, gr + j), vdot);
    }
    const __m512 dot = _mm512_set1_ps(_mm512_reduce_add_ps(vdot));
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int j = 0; j < L; j += 16) {
        const __mmask16 t = lanes(L - j);
        const __m512 pv = load16(t, pr + j), gv = load16(t, gr + j);
        _mm256_mask_storeu_epi16(out + j, t, (__m256i)_mm512_cvtneps_pbh(
            _mm512_mul_ps(_mm512_mul_ps(vscale, pv), _mm512_sub_ps(gv, dot))));
    }
#else
    float dot = 0.0f;
#pragma omp simd reduction(+:dot)
    for (int j = 0; j < L; j++)
        dot += bf16_to_f32(pr[j]) * bf16_to_f32(gr[j]);
#pragma omp simd
    for (int j = 0; j < L; j++)
        out[j] = f32_to_bf16(scale * bf16_to_f32(pr[j]) * (bf16_to_f32(gr[j]) - dot));
#endif
}

void masked_softmax_fwd_bf16(const uint16_t *s, const uint8_t *mask, int R, int H, int L,
                             float scale, uint16_t *p, int nthreads) {
    const int rows = R * H * L;
    /* Each mask row's end: one past its last allowed key. A trie row allows only a node's
     * ancestors, which come before it, so on average about half the row is computed; the
     * rest of p is 0 as before. */
    int *ends = (int *)malloc(sizeof(int) * (size_t)R * L);
#pragma omp parallel num_threads(nthreads)
    {
        int lo, hi;
        share(R * L, omp_get_thread_num(), omp_get_num_threads(), &lo, &hi);
        for (int q = lo; q < hi; q++) {
            const uint8_t *m = mask + (int64_t)q * L;
            int end = L;
            while (end > 0 && !m[end - 1]) end--;
            ends[q] = end;
        }
#pragma omp barrier
        share(rows, omp_get_thread_num(), omp_get_num_threads(), &lo, &hi);
        float buf[L + 16];
        for (int row = lo; row < hi; row++) {
            const int r = row / (H * L), i = row % L;
            softmax_row(s + (int64_t)row * L, mask + ((int64_t)r * L + i) * L,
                        ends[r * L + i], L, scale, buf, p + (int64_t)row * L);
        }
    }
    free(ends);
}

/* ds may be dp (written in place). */
void masked_softmax_bwd_bf16(const uint16_t *p, const uint16_t *dp, int rows, int L,
                             float scale, uint16_t *ds, int nthreads) {
#pragma omp parallel num_threads(nthreads)
    {
        int lo, hi;
        share(rows, omp_get_thread_num(), omp_get_num_threads(), &lo, &hi);
        for (int row = lo; row < hi; row++)
            softmax_grad_row(p + (int64_t)row * L, dp + (int64_t)row * L, L, scale,
                             ds + (int64_t)row * L);
    }
}

/* The moves of q, k, v and the output between the trie's nodes and the packed rows, each one
 * pass of 2-byte vectors (torch's were a zero fill, an index_copy, a transposing copy
 * forward and the same again backward, per tensor and layer).
 *
 * nodes -> rows: out [R, H, L, D] contiguous; slot l of row r holds node node_of[r L + l]'s
 * vector of head h, read at x + n sn + h sh (D contiguous), or zeros where node_of is -1. */
void nodes_to_rows_16(const uint16_t *x, int64_t sn, int64_t sh, const int64_t *node_of,
                      int R, int H, int L, int D, uint16_t *out, int nthreads) {
#pragma omp parallel num_threads(nthreads)
    {
        int lo, hi;
        share(R * H, omp_get_thread_num(), omp_get_num_threads(), &lo, &hi);
        for (int rh = lo; rh < hi; rh++) {
            const int r = rh / H, h = rh % H;
            uint16_t *o = out + (int64_t)rh * L * D;
            for (int l = 0; l < L; l++, o += D) {
                const int64_t n = node_of[(int64_t)r * L + l];
                if (n < 0)
                    memset(o, 0, sizeof(uint16_t) * (size_t)D);
                else
                    memcpy(o, x + n * sn + h * sh, sizeof(uint16_t) * (size_t)D);
            }
        }
    }
}

/* rows -> nodes: out [N, H, D] contiguous; node n's vector of head h from rows [R, H, L, D]
 * (contiguous) at its flat slot r L + l = slots[n]. */
void rows_to_nodes_16(const uint16_t *rows, const int64_t *slots, int N, int H, int L, int D,
                      uint16_t *out, int nthreads) {
#pragma omp parallel num_threads(nthreads)
    {
        int lo, hi;
        share(N, omp_get_thread_num(), omp_get_num_threads(), &lo, &hi);
        for (int n = lo; n < hi; n++) {
            const int64_t r = slots[n] / L, l = slots[n] % L;
            for (int h = 0; h < H; h++)
                memcpy(out + ((int64_t)n * H + h) * D, rows + ((r * H + h) * L + l) * D,
                       sizeof(uint16_t) * (size_t)D);
        }
    }
}
