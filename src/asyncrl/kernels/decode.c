/* The bf16 CPU forward pass of the local engine, over a slot KV cache.
 *
 * forward_rows_bf16 runs a whole forward pass of any set of token rows (a decode step,
 * prompts, or both) in one OpenMP parallel region: products on prepacked weights with
 * AVX512-BF16 dot products or AMX tiles where present (gemm_part), and between them residual add + RMSNorm, optional
 * per-head q/k RMSNorm, rotary embedding, KV-cache write and attention over each row's
 * exact length, SiLU. sample_rows_bf16 draws the next tokens. The per-op entry points
 * (add_rms_norm_bf16, rope_attention_bf16, silu_mul_bf16) serve CPUs without AVX512-BF16,
 * between oneDNN's products. Every bf16 rounding of the torch/HF forward is reproduced
 * (each op rounds its result to bf16; products, norms and softmax accumulate in float32),
 * so results match the torch path up to summation order. A row's result never depends on
 * the other rows (batch invariance). The library links libgomp.so.1 by soname, so in a
 * process that imported torch it shares torch's runtime and thread pool. Compiled at first
 * use by kernels/__init__.py.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <omp.h>
#include "common.h"
#ifdef __AVX512BF16__
#include <immintrin.h>
#endif

static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

#ifdef __AVX512BF16__
/* out[g, :] = bf16(sum_l p[g * T + l] * v[l, :]) for G heads, with D % 32 == 0: each pair
 * of 16-wide chunks of the G outputs is held in registers over all keys. */
#define PV(G)                                                                                 \
static void pv_##G(const float *p, int T, const uint16_t *v, int len, int D, uint16_t *out) { \
    for (int j = 0; j < D; j += 32) {                                                         \
        __m512 a[G][2];                                                                       \
        for (int g = 0; g < G; g++) a[g][0] = a[g][1] = _mm512_setzero_ps();                  \
        for (int l = 0; l < len; l++) {                                                       \
            const uint16_t *vr = v + (int64_t)l * D + j;                                      \
            const __m512 v0 = bf16x16_to_f32(_mm256_loadu_si256((const void *)vr));           \
            const __m512 v1 = bf16x16_to_f32(_mm256_loadu_si256((const void *)(vr + 16)));    \
            for (int g = 0; g < G; g++) {                                                     \
                const __m512 w = _mm512_set1_ps(p[g * T + l]);                                \
                a[g][0] = _mm512_fmadd_ps(w, v0, a[g][0]);                                    \
                a[g][1] = _mm512_fmadd_ps(w, v1, a[g][1]);                                    \
            }                                                                                 \
        }                                                                                     \
        for (int g = 0; g < G; g++) {                                                         \
            _mm256_storeu_si256((void *)(out + g * D + j), (__m256i)_mm512_cvtneps_pbh(a[g][0])); \
            _mm256_storeu_si256((void *)(out + g * D + j + 16),                               \
                                (__m256i)_mm512_cvtneps_pbh(a[g][1]));                        \
        }                                                                                     \
    }                                                                                         \
}
PV(1) PV(2) PV(3) PV(4) PV(5) PV(6) PV(7) PV(8)
typedef void (*pv_fn)(const float *, int, const uint16_t *, int, int, uint16_t *);
static const pv_fn PVS[9] = {0, pv_1, pv_2, pv_3, pv_4, pv_5, pv_6, pv_7, pv_8};

/* r[j] = the sum of v[j]'s 16 lanes, j = 0..15: a transpose-and-add tree (15 adds and 30
 * shuffles for 16 sums, against ~8 dependent steps for each sum alone). */
static inline __m512 hsum16(const __m512 v[16]) {
    __m512 t[8], u[4], w[2];
    for (int i = 0; i < 8; i++)  /* per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] */
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) {  /* per 128-bit lane: partial sums of 4 vectors */
        const __m512d a = _mm512_castps_pd(t[2 * i]), b = _mm512_castps_pd(t[2 * i + 1]);
        u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    for (int i = 0; i < 2; i++)  /* add 128-bit lanes pairwise */
        w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88),
                         _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
}
#endif

/* s[g * T + l] = scale * <q_g, k_l> for the G query heads q (rows of D) and keys 0..len-1.
 * qf: G * D floats of scratch. With AVX512-BF16 the products run on bf16 pairs directly,
 * 16 keys at a time. */
static void scores(const uint16_t *q, const uint16_t *k, int len, int G, int D, int T,
                   float scale, float *qf, float *s) {
#ifdef __AVX512BF16__
    if (D % 32 == 0 && D <= 256) {
        __m512bh qv[8 * 8];
        const int nv = D / 32;
        if (G <= 8) {
            for (int g = 0; g < G; g++)
                for (int j = 0; j < nv; j++)
                    qv[g * nv + j] = (__m512bh)_mm512_loadu_si512(q + g * D + j * 32);
            int l = 0;
            for (; l + 16 <= len; l += 16)
                for (int g = 0; g < G; g++) {
                    __m512 acc[16];
                    for (int i = 0; i < 16; i++) {
                        const uint16_t *kr = k + (int64_t)(l + i) * D;
                        __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[g * nv],
                                                    (__m512bh)_mm512_loadu_si512(kr));
                        for (int j = 1; j < nv; j++)
                            a = _mm512_dpbf16_ps(a, qv[g * nv + j],
                                                 (__m512bh)_mm512_loadu_si512(kr + j * 32));
                        acc[i] = a;
                    }
                    _mm512_storeu_ps(s + g * T + l,
                                     _mm512_mul_ps(hsum16(acc), _mm512_set1_ps(scale)));
                }
            for (; l < len; l++) {
                const uint16_t *kr = k + (int64_t)l * D;
                __m512bh kv[8];
                for (int j = 0; j < nv; j++) kv[j] = (__m512bh)_mm512_loadu_si512(kr + j * 32);
                for (int g = 0; g < G; g++) {
                    __m512 a = _mm512_setzero_ps();
                    for (int j = 0; j < nv; j++) a = _mm512_dpbf16_ps(a, qv[g * nv + j], kv[j]);
                    s[g * T + l] = _mm512_reduce_add_ps(a) * scale;
                }
            }
            return;
        }
    }
#endif
    for (int g = 0; g < G; g++) {
#pragma omp simd
        for (int d = 0; d < D; d++) qf[g * D + d] = bf16_to_f32(q[g * D + d]) * scale;
    }
    for (int l = 0; l < len; l++) {
        const uint16_t *kr = k + (int64_t)l * D;
        for (int g = 0; g < G; g++) {
            float dot = 0.0f;
#pragma omp simd reduction(+:dot)
            for (int d = 0; d < D; d++) dot += qf[g * D + d] * bf16_to_f32(kr[d]);
            s[g * T + l] = dot;
        }
    }
}

/* HF's RMSNorm of n values into bf16: w * round(x * rsqrt(mean(x^2) + eps)). */
static void rms_norm_row(const float *x, const uint16_t *w, uint16_t *out, int n, float eps) {
    float ss = 0.0f;
#pragma omp simd reduction(+:ss)
    for (int i = 0; i < n; i++) ss += x[i] * x[i];
    const float inv = 1.0f / sqrtf(ss / (float)n + eps);
#pragma omp simd
    for (int i = 0; i < n; i++) out[i] = f32_to_bf16(bf16_to_f32(w[i]) * round_bf16(x[i] * inv));
}

/* x [B, N] += d (if d), rounded to bf16 in place; out [B, N] = RMSNorm(x) * w.
 * work: N floats. */
void add_rms_norm_bf16(uint16_t *x, const uint16_t *d, const uint16_t *w, uint16_t *out,
                       int B, int N, float eps, float *work) {
    for (int b = 0; b < B; b++) {
        uint16_t *xr = x + (int64_t)b * N;
        if (d) {
            const uint16_t *dr = d + (int64_t)b * N;
#pragma omp simd
            for (int i = 0; i < N; i++) xr[i] = f32_to_bf16(bf16_to_f32(xr[i]) + bf16_to_f32(dr[i]));
        }
#pragma omp simd
        for (int i = 0; i < N; i++) work[i] = bf16_to_f32(xr[i]);
        rms_norm_row(work, w, out + (int64_t)b * N, N, eps);
    }
}

/* out [B, I] = round(silu(gate)) * up, rounded, for gu [B, 2I] = gate | up. */
void silu_mul_bf16(const uint16_t *gu, uint16_t *out, int B, int I) {
    for (int b = 0; b < B; b++) {
        const uint16_t *__restrict g = gu + (int64_t)b * 2 * I, *__restrict u = g + I;
        uint16_t *__restrict o = out + (int64_t)b * I;
#pragma omp simd
        for (int i = 0; i < I; i++) {
            const float x = bf16_to_f32(g[i]);
            const float e = exp_neg(x >= 0.0f ? -x : x);  /* exp(-|x|), no overflow */
            const float sig = x >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
            o[i] = f32_to_bf16(round_bf16(x * sig) * bf16_to_f32(u[i]));
        }
    }
}

/* In place on one head row of D: optional RMSNorm (weights qkn), then the rotary embedding
 * round(round(x * cos) + round(roll(x, D/2) * sin)), with sin's first half negated. */
static void norm_rope(uint16_t *h, const uint16_t *qkn, const uint16_t *cos,
                      const uint16_t *sin, int D, float eps, float *tmp) {
#pragma omp simd
    for (int d = 0; d < D; d++) tmp[d] = bf16_to_f32(h[d]);
    if (qkn) {
        rms_norm_row(tmp, qkn, h, D, eps);
#pragma omp simd
        for (int d = 0; d < D; d++) tmp[d] = bf16_to_f32(h[d]);
    }
    const int half = D / 2;
#pragma omp simd
    for (int d = 0; d < D; d++) {
        const float rolled = tmp[d < half ? d + half : d - half];
        h[d] = f32_to_bf16(round_bf16(tmp[d] * bf16_to_f32(cos[d])) +
                           round_bf16(rolled * bf16_to_f32(sin[d])));
    }
}

/* One row's q/k heads normed (if qn/kn) and rotated in place at position p, and its key and
 * value heads written into the cache at (slot, p). row: [(H + 2 KV) D] = q | k | v heads;
 * kc, vc: [S, KV, T, D]; tmp: D floats. */
static void rope_write_row(uint16_t *row, const uint16_t *qn, const uint16_t *kn,
                           const uint16_t *cos, const uint16_t *sin, uint16_t *kc, uint16_t *vc,
                           int64_t slot, int64_t p, int H, int KV, int D, int T, float eps,
                           float *tmp) {
    const uint16_t *c = cos + p * D, *sn = sin + p * D;
    for (int h = 0; h < H; h++) norm_rope(row + (int64_t)h * D, qn, c, sn, D, eps, tmp);
    for (int kh = 0; kh < KV; kh++) {
        uint16_t *k = row + (int64_t)(H + kh) * D;
        norm_rope(k, kn, c, sn, D, eps, tmp);
        const int64_t at = ((slot * KV + kh) * T + p) * D;
        memcpy(kc + at, k, D * sizeof(uint16_t));
        memcpy(vc + at, row + (int64_t)(H + KV + kh) * D, D * sizeof(uint16_t));
    }
}

/* Attention of the G = H / KV query heads of KV head kh in one (rotated) row over positions
 * 0..p of cache slot `slot`, in float32: out[g * D ..] for g < G, rounded to bf16 once.
 * work: 2 G D + G T + D floats. */
static void attend(const uint16_t *row, const uint16_t *kc, const uint16_t *vc, int64_t slot,
                   int64_t p, int kh, int H, int KV, int D, int T, float scale, uint16_t *o,
                   float *work) {
    const int G = H / KV, len = (int)p + 1;
    float *qf = work;           /* [G, D] */
    float *acc = qf + G * D;    /* [G, D] */
    float *s = acc + G * D;     /* [G, T] */
    float *tmp = s + G * T;     /* [D] */
    const uint16_t *q = row + (int64_t)kh * G * D;
    const uint16_t *kbase = kc + (slot * KV + kh) * T * D;
    const uint16_t *vbase = vc + (slot * KV + kh) * T * D;
    scores(q, kbase, len, G, D, T, scale, qf, s);
    for (int g = 0; g < G; g++) {
        float *sg = s + g * T;
        float m = sg[0];
        for (int l = 1; l < len; l++) m = sg[l] > m ? sg[l] : m;
        float sum = 0.0f;
#pragma omp simd reduction(+:sum)
        for (int l = 0; l < len; l++) {
            float e = exp_neg(sg[l] - m);
            sg[l] = e;
            sum += e;
        }
        const float inv = 1.0f / sum;
#pragma omp simd
        for (int l = 0; l < len; l++) sg[l] *= inv;
    }
#ifdef __AVX512BF16__
    if (D % 32 == 0 && G <= 8) {
        PVS[G](s, T, vbase, len, D, o);
        return;
    }
#endif
    memset(acc, 0, (size_t)G * D * sizeof(float));
    for (int l = 0; l < len; l++) {
        const uint16_t *vr = vbase + (int64_t)l * D;
#pragma omp simd
        for (int d = 0; d < D; d++) tmp[d] = bf16_to_f32(vr[d]);
        for (int g = 0; g < G; g++) {
            const float w = s[g * T + l];
            float *a = acc + g * D;
#pragma omp simd
            for (int d = 0; d < D; d++) a[d] += w * tmp[d];
        }
    }
    for (int g = 0; g < G; g++) {
#pragma omp simd
        for (int d = 0; d < D; d++) o[g * D + d] = f32_to_bf16(acc[g * D + d]);
    }
}

/* Attention for R rows inside a parallel region: every row's rotation and cache write, a
 * barrier, then the (row, KV head) items, dynamically scheduled (a prefill's rows differ in
 * length), ending with the loop's barrier. Row r sits in cache slot slot[r] (r if slot is
 * NULL) at position pos[r]; rows of one slot see each other's keys, so a prompt's rows
 * attend causally. qkv rows at stride ld; out [R, H D]. */
static void attention_rows(uint16_t *qkv, int64_t ld, const uint16_t *qn, const uint16_t *kn,
                           const uint16_t *cos, const uint16_t *sin, uint16_t *kc, uint16_t *vc,
                           const int64_t *slot, const int64_t *pos, uint16_t *out, int R, int H,
                           int KV, int D, int T, float scale, float eps, float *work, int tid,
                           int nt) {
    int lo, hi;
    share(R, tid, nt, &lo, &hi);
    for (int r = lo; r < hi; r++)
        rope_write_row(qkv + r * ld, qn, kn, cos, sin, kc, vc, slot ? slot[r] : r, pos[r], H, KV,
                       D, T, eps, work);
#pragma omp barrier
    const int G = H / KV;
#pragma omp for schedule(dynamic, 4)
    for (int item = 0; item < R * KV; item++) {
        const int r = item / KV, kh = item % KV;
        attend(qkv + r * ld, kc, vc, slot ? slot[r] : r, pos[r], kh, H, KV, D, T, scale,
               out + ((int64_t)r * H + kh * G) * D, work);
    }
}

/* One decode step of attention for B sequences in cache slots 0..B-1.
 * qkv [B, (H + 2 KV) * D] (row stride qkv_stride): the projections, rotated here in place;
 * qn, kn: per-head RMSNorm weights [D] or NULL; cos, sin: rotary tables [T, D];
 * kc, vc: one layer's cache [S, KV, T, D]; pos [B]: position of each new token; the new
 * key and value go there and the query attends positions 0..pos. out: [B, H * D].
 * work: nthreads * (2 G D + G T + D) floats, G = H / KV. */
void rope_attention_bf16(uint16_t *qkv, int64_t qkv_stride, const uint16_t *qn,
                         const uint16_t *kn, const uint16_t *cos, const uint16_t *sin,
                         uint16_t *kc, uint16_t *vc, const int64_t *pos, uint16_t *out,
                         int B, int H, int KV, int D, int T, float scale, float eps,
                         float *work, int nthreads) {
    const int64_t per_thread = 2 * (int64_t)(H / KV) * D + (int64_t)(H / KV) * T + D;
#pragma omp parallel num_threads(nthreads)
    attention_rows(qkv, qkv_stride, qn, kn, cos, sin, kc, vc, NULL, pos, out, B, H, KV, D, T,
                   scale, eps, work + per_thread * omp_get_thread_num(), omp_get_thread_num(),
                   omp_get_num_threads());
}

/* ---- Sampling --------------------------------------------------------------------------- */

/* One token per row of logits [B, V] (bf16) and its log-prob log_softmax(logits / t)[token],
 * t = temperature[b]; t <= 0 means greedy: the first argmax, with its log-prob at t = 1.
 * Sampled rows invert the CDF of exp(x - max) at u[b] * sum (u[b] in [0, 1), drawn by the
 * caller), in blocks of 256: one pass for the max, one for the block sums, then one block.
 * Rows are split over the threads.
 * work: nthreads * (V + V / 256 + 1) floats. */
void sample_rows_bf16(const uint16_t *logits, int B, int V, const float *temperature,
                      const float *u, int64_t *token, float *logprob, float *work, int nthreads) {
    const int nb = (V + 255) / 256;
#pragma omp parallel num_threads(nthreads)
    {
        int lo, hi;
        share(B, omp_get_thread_num(), omp_get_num_threads(), &lo, &hi);
        float *x = work + (int64_t)(V + nb) * omp_get_thread_num(), *bsum = x + V;
        for (int b = lo; b < hi; b++) {
            const uint16_t *lr = logits + (int64_t)b * V;
            const int greedy = !(temperature[b] > 0.0f);
            const float t = greedy ? 1.0f : temperature[b];
            float m = -INFINITY;
#pragma omp simd reduction(max:m)
            for (int i = 0; i < V; i++) {
                x[i] = bf16_to_f32(lr[i]) / t;  /* divided, as the trainer does */
                m = x[i] > m ? x[i] : m;
            }
            float total = 0.0f;
            for (int k = 0; k < nb; k++) {
                const int end = (k + 1) * 256 < V ? (k + 1) * 256 : V;
                float sk = 0.0f;
#pragma omp simd reduction(+:sk)
                for (int i = k * 256; i < end; i++) sk += exp_neg(x[i] - m);
                bsum[k] = sk;
                total += sk;
            }
            int tok = -1;
            if (greedy) {
                for (int i = 0; i < V && tok < 0; i++) tok = x[i] == m ? i : -1;
            } else {
                const float target = u[b] * total;
                float c = 0.0f;
                int k = 0;
                while (k < nb - 1 && c + bsum[k] <= target) c += bsum[k++];
                const int end = (k + 1) * 256 < V ? (k + 1) * 256 : V;
                for (int i = k * 256; i < end && tok < 0; i++) {
                    c += exp_neg(x[i] - m);  /* > 0: exp_neg never underflows to 0 */
                    if (c > target) tok = i;
                }
                if (tok < 0) tok = end - 1;  /* rounding left c <= target at the block's end */
            }
            token[b] = tok;
            logprob[b] = (x[tok] - m) - logf(total);
        }
    }
}

/* ---- Matrix products on prepacked bf16 weights --------------------------------------------
 *
 * A weight W [N, K] (out x in, N % 16 == 0, K even) is packed as P [N / 16][K / 2][16][2]:
 * for each block of 16 output columns, K/2 rows of 16 bf16 pairs, which is exactly the
 * operand of one AVX512-BF16 dot product (16 columns x 2 k). y = x W^T runs as tiles of MR
 * rows x NZ blocks: per pair of k, NZ weight loads feed MR x NZ dot products against the
 * broadcast pair x[r, 2kp:2kp+2]; accumulation in float32, one bf16 rounding at the end, as
 * oneDNN does (only the order of the float32 sums differs). Each thread takes a contiguous
 * range of column blocks, so at batch 1 the two threads each stream half of every weight
 * once, and at larger batches a weight tile (K x 64 bf16, <= 200 KB) is read from memory
 * once and reused from L2 for every group of rows.
 */
#ifdef __AVX512BF16__
#define HAVE_GEMM 1
#define MR_MAX 6

enum { EPI_STORE = 0, EPI_SILU = 1 };

/* acc -> bf16 y rows: plain (+ bias), or silu(gate) * up with gate/up in blocks z, z + 1. */
#define TILE(MR, NZ)                                                                          \
static void tile_##MR##_##NZ(const uint16_t *x, int64_t ldx, const uint16_t *p, int K,        \
                             uint16_t *y, int64_t ldy, const uint16_t *bias, int epi,         \
                             const char *pf) {                                                \
    __m512 acc[MR][NZ];                                                                       \
    for (int r = 0; r < MR; r++)                                                              \
        for (int z = 0; z < NZ; z++) acc[r][z] = _mm512_setzero_ps();                         \
    const int64_t bs = (int64_t)K * 16;                                                       \
    for (int kp = 0; kp < K / 2; kp++) {                                                      \
        __m512bh w[NZ];                                                                       \
        for (int z = 0; z < NZ; z++)                                                          \
            w[z] = (__m512bh)_mm512_loadu_si512(p + z * bs + (int64_t)kp * 32);               \
        if (pf) _mm_prefetch(pf + (int64_t)kp * 64, _MM_HINT_T1);                             \
        for (int r = 0; r < MR; r++) {                                                        \
            const __m512bh a = (__m512bh)_mm512_set1_epi32(                                   \
                *(const int32_t *)(x + r * ldx + 2 * kp));                                    \
            for (int z = 0; z < NZ; z++) acc[r][z] = _mm512_dpbf16_ps(acc[r][z], a, w[z]);    \
        }                                                                                     \
    }                                                                                         \
    store_tile(&acc[0][0], MR, NZ, NZ, y, ldy, bias, epi);                                    \
}

static inline void store_tile(const __m512 *acc, int mr, int nz, int stride, uint16_t *y,
                              int64_t ldy, const uint16_t *bias, int epi) {
    for (int z = 0; z < nz; z++) {
        const __m512 b = bias ? bf16x16_to_f32(_mm256_loadu_si256((const void *)(bias + z * 16)))
                              : _mm512_setzero_ps();
        if (epi == EPI_STORE) {
            for (int r = 0; r < mr; r++)
                _mm256_storeu_si256(
                    (void *)(y + r * ldy + z * 16),
                    (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[r * stride + z], b)));
        } else if (z + 1 < nz) {  /* z even: gate, z + 1: up; output block z / 2 */
            const __m512 bu =
                bias ? bf16x16_to_f32(_mm256_loadu_si256((const void *)(bias + z * 16 + 16)))
                     : _mm512_setzero_ps();
            for (int r = 0; r < mr; r++) {
                const __m512 g = round_bf16_x16(_mm512_add_ps(acc[r * stride + z], b));
                const __m512 u = round_bf16_x16(_mm512_add_ps(acc[r * stride + z + 1], bu));
                _mm256_storeu_si256((void *)(y + r * ldy + (z / 2) * 16),
                                    (__m256i)_mm512_cvtneps_pbh(
                                        _mm512_mul_ps(round_bf16_x16(silu_x16(g)), u)));
            }
            z++;
        }
    }
}

TILE(1, 4) TILE(2, 4) TILE(3, 4) TILE(4, 4) TILE(5, 4) TILE(6, 4)
TILE(1, 2) TILE(2, 2) TILE(3, 2) TILE(4, 2) TILE(5, 2) TILE(6, 2)
TILE(1, 1) TILE(2, 1) TILE(3, 1) TILE(4, 1) TILE(5, 1) TILE(6, 1)

typedef void (*tile_fn)(const uint16_t *, int64_t, const uint16_t *, int, uint16_t *, int64_t,
                        const uint16_t *, int, const char *);
static const tile_fn TILES4[MR_MAX + 1] = {0, tile_1_4, tile_2_4, tile_3_4, tile_4_4, tile_5_4,
                                           tile_6_4};
static const tile_fn TILES2[MR_MAX + 1] = {0, tile_1_2, tile_2_2, tile_3_2, tile_4_2, tile_5_2,
                                           tile_6_2};
static const tile_fn TILES1[MR_MAX + 1] = {0, tile_1_1, tile_2_1, tile_3_1, tile_4_1, tile_5_1,
                                           tile_6_1};

/* ---- The same products on AMX tiles, where the CPU has them ------------------------------
 *
 * The packed layout is also AMX's: a block's 16 consecutive k pairs (16 x 64 bytes) are one
 * B tile. Per pair of column blocks and 32 rows: two A tiles (16 rows x 32 k), two B tiles,
 * four float32 accumulator tiles; the epilogue (bias, one bf16 rounding, SiLU) is the AVX
 * path's. Rows past the last multiple of 16 go through a zero-padded copy, so every row
 * takes the same instructions whatever the batch (batch invariance holds). Used for every
 * M where K % 32 == 0 (the models' K: 576, 1536, ...), once the kernel holds Linux's
 * permission for the tile state (arch_prctl); elsewhere the AVX512-BF16 tiles above run.
 * At 64 rows ~4x the AVX512-BF16 tiles' throughput on the quickstart's matrices.
 */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define HAVE_AMX 1

static int amx_state = 0;   /* 0: not asked yet, 1: granted, -1: refused */
static int amx_wanted = 1;  /* gemm_use_amx(0) turns it off (tests, benchmarks) */

/* Whether AMX runs: asks Linux for the tile state once (call outside parallel regions). */
static int amx_on(void) {
    if (amx_state == 0)
        amx_state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                            18 /* XFEATURE_XTILEDATA */) == 0 ? 1 : -1;
    return amx_wanted && amx_state > 0;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed, aligned(64))) tile_config;

/* y rows [0, rows) (rows <= 32) for column blocks c0 (and c0 + 1 if nblk == 2); the A tiles
 * read 16 or 32 rows of a at stride lda (zero rows past `rows`). */
static void amx_tile(const uint16_t *a, int64_t lda, int rows, int K, const uint16_t *p,
                     int nblk, uint16_t *y, int64_t ldy, const uint16_t *bias, int epi,
                     const char *pf) {
    const int na = rows > 16 ? 2 : 1;
    const int64_t bs = (int64_t)K * 16;
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int k = 0; k < K; k += 32) {
        if (pf)  /* the next pair's weights for this k (2 x 1 KB) into L2 */
            for (int line = 0; line < 2048; line += 64)
                _mm_prefetch(pf + (line < 1024 ? 0 : bs * 2 - 1024) + (int64_t)k * 32 + line,
                             _MM_HINT_T1);
        _tile_loadd(4, a + k, lda * 2);
        _tile_loadd(6, p + (int64_t)k * 16, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (nblk == 2) {
            _tile_loadd(7, p + bs + (int64_t)k * 16, 64);
            _tile_dpbf16ps(1, 4, 7);
        }
        if (na == 2) {
            _tile_loadd(5, a + 16 * lda + k, lda * 2);
            _tile_dpbf16ps(2, 5, 6);
            if (nblk == 2) _tile_dpbf16ps(3, 5, 7);
        }
    }
    float c[4][16][16] __attribute__((aligned(64)));
    _tile_stored(0, c[0], 64); _tile_stored(1, c[1], 64);
    _tile_stored(2, c[2], 64); _tile_stored(3, c[3], 64);
    __m512 acc[32][2];
    for (int r = 0; r < rows; r++)
        for (int z = 0; z < nblk; z++) acc[r][z] = _mm512_load_ps(c[(r / 16) * 2 + z][r % 16]);
    store_tile(&acc[0][0], rows, nblk, 2, y, ldy, bias, epi);
}

static void amx_gemm_part(const uint16_t *x, int64_t ldx, int M, int K, const uint16_t *p,
                          int N, const uint16_t *bias, uint16_t *y, int64_t ldy, int epi,
                          int tid, int nt) {
    const int pairs = (N / 16 + 1) / 2, out_block = epi == EPI_SILU ? 1 : 2;
    int lo, hi;
    share(pairs, tid, nt, &lo, &hi);
    if (lo >= hi) return;
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) { cfg.colsb[t] = 64; cfg.rows[t] = 16; }
    _tile_loadconfig(&cfg);
    /* the last group of rows, if not whole tiles: once into a zero-padded copy */
    const int tail = M % 32, m_tail = M - tail, padded = tail % 16 ? (tail > 16 ? 32 : 16) : 0;
    uint16_t *pad = padded ? malloc((size_t)padded * K * sizeof(uint16_t)) : NULL;
    for (int r = 0; r < padded; r++) {
        if (r < tail) memcpy(pad + (int64_t)r * K, x + (m_tail + r) * ldx, K * sizeof(uint16_t));
        else memset(pad + (int64_t)r * K, 0, K * sizeof(uint16_t));
    }
    for (int c = lo; c < hi; c++) {
        const int nblk = N / 16 - 2 * c >= 2 ? 2 : 1;
        for (int m = 0; m < M; m += 32) {
            const int rows = M - m < 32 ? M - m : 32, copy = pad && m == m_tail;
            /* few rows: the weights' bandwidth bounds it; fetch the next pair's ahead */
            const char *pf = M <= 32 && c + 1 < hi && N / 16 - 2 * (c + 1) >= 2
                                 ? (const char *)(p + (int64_t)(c + 1) * 32 * K) : NULL;
            amx_tile(copy ? pad : x + m * ldx, copy ? K : ldx, rows, K, p + (int64_t)c * 32 * K,
                     nblk, y + m * ldy + (int64_t)c * 16 * out_block, ldy,
                     bias ? bias + c * 32 : NULL, epi, pf);
        }
    }
    free(pad);
    _tile_release();
}

void gemm_use_amx(int on) { amx_wanted = on; }
int gemm_has_amx(void) { return amx_on(); }
#else
static int amx_on(void) { return 0; }
void gemm_use_amx(int on) { (void)on; }
int gemm_has_amx(void) { return 0; }
#endif

/* This thread's share of y [M, N or N/2] = epi(x [M, K] W^T + bias), W packed, in pairs of
 * column blocks (N % 32 == 0 for EPI_SILU; a lone last block runs as a pair's first half).
 * Rows go in groups of at most MR_MAX, as equal as possible. While a tile's row groups run,
 * each prefetches one block (K/2 lines, a line per k pair) of the next tile's weights into
 * L2, so that the first group of the next tile does not wait on memory; from 4 groups on
 * (19 rows) that covers the whole next tile (a step 9% faster at 32 rows, 7% at 4). */
static void gemm_part(const uint16_t *x, int64_t ldx, int M, int K, const uint16_t *p, int N,
                      const uint16_t *bias, uint16_t *y, int64_t ldy, int epi, int tid, int nt,
                      int amx) {
#ifdef HAVE_AMX
    if (amx && K % 32 == 0) {
        amx_gemm_part(x, ldx, M, K, p, N, bias, y, ldy, epi, tid, nt);
        return;
    }
#endif
    (void)amx;
    const int pairs = (N / 16 + 1) / 2, groups = (M + MR_MAX - 1) / MR_MAX;
    int lo, hi;
    share(pairs, tid, nt, &lo, &hi);
    const int out_block = epi == EPI_SILU ? 1 : 2;  /* output blocks per pair */
    for (int c = lo; c < hi;) {
        /* two pairs at once where both are this thread's; a lone last block (odd N / 16,
         * never for EPI_SILU) as a tile of one */
        const int left = N / 16 - 2 * c, nblk = c + 1 < hi && left >= 4 ? 4 : left >= 2 ? 2 : 1;
        const tile_fn *tiles = nblk == 4 ? TILES4 : nblk == 2 ? TILES2 : TILES1;
        const int64_t col = (int64_t)c * 32;
        const int next = c + (nblk + 1) / 2 < hi ? (left - nblk >= 4 ? 4 : 2) : 0;
        const char *pf = (const char *)(p + (col + nblk * 16) * K);
        for (int g = 0, m = 0; g < groups; g++) {
            const int mr = (M - m) / (groups - g);
            tiles[mr](x + m * ldx, ldx, p + col * K, K, y + m * ldy + (int64_t)c * 16 * out_block,
                      ldy, bias ? bias + col : NULL, epi, g < next ? pf + (int64_t)g * 32 * K : NULL);
            m += mr;
        }
        c += (nblk + 1) / 2;
    }
}

/* y [M, N] = x [M, K] W^T (+ bias) for a packed W; rows of x and y at strides ldx, ldy. */
void gemm_bf16(const uint16_t *x, int64_t ldx, int M, int K, const uint16_t *p, int N,
               const uint16_t *bias, uint16_t *y, int64_t ldy, int nthreads) {
    const int amx = amx_on();
#pragma omp parallel num_threads(nthreads)
    gemm_part(x, ldx, M, K, p, N, bias, y, ldy, EPI_STORE, omp_get_thread_num(),
              omp_get_num_threads(), amx);
}

/* out [M, I] = round(silu(gate)) * up for gate | up = x W^T (+ bias), W [2 I, K] packed with
 * gate and up blocks of 16 interleaved (g0 u0 g1 u1 ...), I % 16 == 0. */
void gemm_silu_bf16(const uint16_t *x, int64_t ldx, int M, int K, const uint16_t *p, int I,
                    const uint16_t *bias, uint16_t *out, int64_t ldo, int nthreads) {
    const int amx = amx_on();
#pragma omp parallel num_threads(nthreads)
    gemm_part(x, ldx, M, K, p, 2 * I, bias, out, ldo, EPI_SILU, omp_get_thread_num(),
              omp_get_num_threads(), amx);
}

/* ---- A whole forward pass in one parallel region ----------------------------------------- */

typedef struct {  /* one layer's weights; the Python side passes 12 pointers per layer */
    const uint16_t *attn_norm, *wqkv, *bqkv, *qn, *kn, *wo, *bo, *mlp_norm, *wgu, *bgu,
        *wdown, *bdown;
} layer_t;

/* Rows [lo, hi) of x [., E] += d (if d), then normed = RMSNorm(x) * w. */
static void add_norm_rows(uint16_t *x, const uint16_t *d, const uint16_t *w, uint16_t *normed,
                          int lo, int hi, int E, float eps, float *work) {
    if (hi > lo)
        add_rms_norm_bf16(x + (int64_t)lo * E, d ? d + (int64_t)lo * E : NULL, w,
                          normed + (int64_t)lo * E, hi - lo, E, eps, work);
}

/* The forward pass of R token rows, all in one parallel region: row r has its embedding in
 * x[r] (updated in place as the residual stream) and sits in cache slot slot[r] at position
 * pos[r]; a decode step is one row per sequence, a prefill one row per prompt token, and
 * both can share a call. Logits [n_out, V] of the rows out_rows[0..n_out) (all R rows if
 * out_rows is NULL). kc, vc: layer 0's cache [S, KV, T, D], layer n at + n * layer_stride.
 * The same maths and roundings as the per-op path; every phase splits its work over the
 * team, with a barrier between phases.
 * buf: R (2 E + (2 H + 2 KV) D + I) + n_out E bf16; work: nthreads * work_per_thread
 * floats, work_per_thread >= max(E, 2 G D + G T + D). */
void forward_rows_bf16(const layer_t *layers, int L, const uint16_t *final_norm,
                       const uint16_t *lm_head, int V, uint16_t *x, uint16_t *kc, uint16_t *vc,
                       int64_t layer_stride, const int64_t *slot, const int64_t *pos, int R,
                       const int64_t *out_rows, int n_out, const uint16_t *cos,
                       const uint16_t *sin, int E, int H, int KV, int D, int I, int T,
                       float scale, float eps, uint16_t *buf, float *work,
                       int64_t work_per_thread, uint16_t *logits, int nthreads) {
    const int Q = (H + 2 * KV) * D;
    uint16_t *normed = buf, *qkv = normed + (int64_t)R * E, *o = qkv + (int64_t)R * Q;
    uint16_t *proj = o + (int64_t)R * H * D, *act = proj + (int64_t)R * E;
    uint16_t *picked = out_rows ? act + (int64_t)R * I : normed;
    const int amx = amx_on();
#pragma omp parallel num_threads(nthreads)
    {
        const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
        float *w = work + work_per_thread * tid;
        int rlo, rhi;
        share(R, tid, nt, &rlo, &rhi);
        add_norm_rows(x, NULL, layers[0].attn_norm, normed, rlo, rhi, E, eps, w);
#pragma omp barrier
        for (int n = 0; n < L; n++) {
            const layer_t *l = layers + n;
            gemm_part(normed, E, R, E, l->wqkv, Q, l->bqkv, qkv, Q, EPI_STORE, tid, nt, amx);
#pragma omp barrier
            attention_rows(qkv, Q, l->qn, l->kn, cos, sin, kc + n * layer_stride,
                           vc + n * layer_stride, slot, pos, o, R, H, KV, D, T, scale, eps, w,
                           tid, nt);  /* ends with a barrier */
            gemm_part(o, H * D, R, H * D, l->wo, E, l->bo, proj, E, EPI_STORE, tid, nt, amx);
#pragma omp barrier
            add_norm_rows(x, proj, l->mlp_norm, normed, rlo, rhi, E, eps, w);
#pragma omp barrier
            gemm_part(normed, E, R, E, l->wgu, 2 * I, l->bgu, act, I, EPI_SILU, tid, nt, amx);
#pragma omp barrier
            gemm_part(act, I, R, I, l->wdown, E, l->bdown, proj, E, EPI_STORE, tid, nt, amx);
#pragma omp barrier
            add_norm_rows(x, proj, n + 1 < L ? layers[n + 1].attn_norm : final_norm, normed,
                          rlo, rhi, E, eps, w);
#pragma omp barrier
        }
        if (out_rows) {
            int lo, hi;
            share(n_out, tid, nt, &lo, &hi);
            for (int i = lo; i < hi; i++)
                memcpy(picked + (int64_t)i * E, normed + out_rows[i] * E, E * sizeof(uint16_t));
#pragma omp barrier
        }
        gemm_part(picked, E, n_out, E, lm_head, V, NULL, logits, V, EPI_STORE, tid, nt, amx);
    }
}
#endif
