/* The softmax of the trainer's trie attention (training/attention.py), forward and backward,
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
        float buf[L];
        for (int row = lo; row < hi; row++) {
            const int r = row / (H * L), i = row % L;
            const uint8_t *m = mask + ((int64_t)r * L + i) * L;
            const int end = ends[r * L + i];
            const uint16_t *sr = s + (int64_t)row * L;
            uint16_t *pr = p + (int64_t)row * L;
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
            memset(pr + end, 0, sizeof(uint16_t) * (size_t)(L - end));
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
        for (int row = lo; row < hi; row++) {
            const uint16_t *pr = p + (int64_t)row * L, *gr = dp + (int64_t)row * L;
            uint16_t *out = ds + (int64_t)row * L;
            float dot = 0.0f;
#pragma omp simd reduction(+:dot)
            for (int j = 0; j < L; j++)
                dot += bf16_to_f32(pr[j]) * bf16_to_f32(gr[j]);
#pragma omp simd
            for (int j = 0; j < L; j++)
                out[j] = f32_to_bf16(scale * bf16_to_f32(pr[j]) * (bf16_to_f32(gr[j]) - dot));
        }
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
