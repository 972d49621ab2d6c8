/* Decode attention over a bf16 slot KV cache, one new query token per sequence.
 *
 * For every sequence b and KV head: write the new key and value at position pos[b],
 * then attend the group of query heads that share the KV head over positions 0..pos[b]
 * (softmax in float32), and write the output in bf16. Plain loops that gcc vectorises,
 * with AVX512-BF16 dot products where the CPU has them. Sequences and KV heads are split
 * over OpenMP threads; the library links libgomp.so.1 by soname, so inside a process that
 * imported torch it shares torch's OpenMP runtime and thread pool rather than adding one.
 * Compiled at first use by kernels/__init__.py.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <omp.h>
#ifdef __AVX512BF16__
#include <immintrin.h>
#endif

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {  /* round to nearest even, as torch does */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);  /* NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* exp(x) for x <= 0, vectorisable: 2^(x log2 e) split into 2^n * 2^f, f in [-0.5, 0.5],
 * 2^f by a degree-6 polynomial (relative error < 2e-7). */
static inline float exp_neg(float x) {
    float y = x * 1.44269504088896341f;
    y = y < -126.0f ? -126.0f : y;
    float n = __builtin_roundf(y);
    float f = y - n;
    float p = 1.535336188319500e-4f;
    p = p * f + 1.339887440266574e-3f;
    p = p * f + 9.618437357674640e-3f;
    p = p * f + 5.550332471162809e-2f;
    p = p * f + 2.402264791363012e-1f;
    p = p * f + 6.931472028550421e-1f;
    p = p * f + 1.0f;
    int32_t e = ((int32_t)n + 127) << 23;
    float s;
    memcpy(&s, &e, 4);
    return p * s;
}

/* s[g * T + l] = scale * <q_g, k_l> for the G query heads q (rows of D) and keys 0..len-1.
 * qf: G * D floats of scratch. With AVX512-BF16 the products run on bf16 pairs directly. */
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
            for (int l = 0; l < len; l++) {
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

/* q: [B, H, D] and knew, vnew: [B, KV, D], heads contiguous within a row, rows qs, ks, vs
 * elements apart; out: [B, H, D] contiguous; kc, vc: one layer's cache [S, KV, T, D];
 * work: nthreads * (2 * G * D + G * T) floats (G = H / KV). */
void decode_attention_bf16(const uint16_t *q, const uint16_t *knew, const uint16_t *vnew,
                           int64_t qs, int64_t ks, int64_t vs,
                           uint16_t *kc, uint16_t *vc, const int64_t *pos, uint16_t *out,
                           int B, int H, int KV, int D, int T, float scale, float *work,
                           int nthreads) {
    const int G = H / KV;
    const int64_t per_thread = 2 * (int64_t)G * D + (int64_t)G * T;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int item = 0; item < B * KV; item++) {
        const int b = item / KV, kh = item % KV;
        float *qf = work + per_thread * omp_get_thread_num();  /* [G, D] */
        float *acc = qf + G * D;                                /* [G, D] */
        float *s = acc + G * D;                                 /* [G, T] */
        const int64_t p = pos[b];
        const int len = (int)p + 1;
        uint16_t *kbase = kc + ((int64_t)b * KV + kh) * T * D;
        uint16_t *vbase = vc + ((int64_t)b * KV + kh) * T * D;
        memcpy(kbase + p * D, knew + b * ks + kh * D, D * sizeof(uint16_t));
        memcpy(vbase + p * D, vnew + b * vs + kh * D, D * sizeof(uint16_t));
        const uint16_t *qrow = q + b * qs + (int64_t)kh * G * D;
        scores(qrow, kbase, len, G, D, T, scale, qf, s);
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
            float inv = 1.0f / sum;
#pragma omp simd
            for (int l = 0; l < len; l++) sg[l] *= inv;
            memset(acc + g * D, 0, D * sizeof(float));
        }
        for (int l = 0; l < len; l++) {
            const uint16_t *vr = vbase + (int64_t)l * D;
#pragma omp simd
            for (int d = 0; d < D; d++) qf[d] = bf16_to_f32(vr[d]);  /* qf: a free row */
            for (int g = 0; g < G; g++) {
                const float w = s[g * T + l];
                float *a = acc + g * D;
#pragma omp simd
                for (int d = 0; d < D; d++) a[d] += w * qf[d];
            }
        }
        for (int g = 0; g < G; g++) {
            uint16_t *o = out + ((int64_t)b * H + kh * G + g) * D;
#pragma omp simd
            for (int d = 0; d < D; d++) o[d] = f32_to_bf16(acc[g * D + d]);
        }
    }
}
