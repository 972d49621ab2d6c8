/* The elementwise and attention parts of one decode step over a bf16 slot KV cache.
 *
 * The matrix products stay with oneDNN; everything between them is here, one call each:
 * add_rms_norm (residual add + RMSNorm), rope_attention (optional per-head q/k RMSNorm,
 * rotary embedding, KV-cache write, attention over each sequence's exact length) and
 * silu_mul. Every bf16 rounding of the torch/HF forward is reproduced (each op rounds its
 * result to bf16; norms and softmax run in float32), so results match the torch path up to
 * summation order. Plain loops that gcc vectorises, AVX512-BF16 dot products where the CPU
 * has them. Attention splits sequences and KV heads over OpenMP threads; the library links
 * libgomp.so.1 by soname, so in a process that imported torch it shares torch's runtime
 * and thread pool. Compiled at first use by kernels/__init__.py.
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
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const uint32_t quiet_nan = (u >> 16) | 0x40u;
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);  /* branch-free */
}

static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

/* exp(x) for x <= 0, vectorisable: 2^(x log2 e) split into 2^n * 2^f, f in [-0.5, 0.5],
 * 2^f by a degree-6 polynomial (relative error < 2e-7). */
static inline float exp_neg(float x) {
    float y = x * 1.44269504088896341f;
    y = y < -126.0f ? -126.0f : y;
    float n = rintf(y);
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
    const int G = H / KV;
    const int64_t per_thread = 2 * (int64_t)G * D + (int64_t)G * T + D;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int item = 0; item < B * KV; item++) {
        const int b = item / KV, kh = item % KV;
        float *qf = work + per_thread * omp_get_thread_num();  /* [G, D] */
        float *acc = qf + G * D;                                /* [G, D] */
        float *s = acc + G * D;                                 /* [G, T] */
        float *tmp = s + G * T;                                 /* [D] */
        const int64_t p = pos[b];
        const int len = (int)p + 1;
        const uint16_t *c = cos + p * D, *sn = sin + p * D;
        uint16_t *row = qkv + b * qkv_stride;
        uint16_t *q = row + (int64_t)kh * G * D;
        uint16_t *k = row + (int64_t)(H + kh) * D;
        const uint16_t *v = row + (int64_t)(H + KV + kh) * D;
        for (int g = 0; g < G; g++) norm_rope(q + g * D, qn, c, sn, D, eps, tmp);
        norm_rope(k, kn, c, sn, D, eps, tmp);
        uint16_t *kbase = kc + ((int64_t)b * KV + kh) * T * D;
        uint16_t *vbase = vc + ((int64_t)b * KV + kh) * T * D;
        memcpy(kbase + p * D, k, D * sizeof(uint16_t));
        memcpy(vbase + p * D, v, D * sizeof(uint16_t));
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
            memset(acc + g * D, 0, D * sizeof(float));
        }
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
            uint16_t *o = out + ((int64_t)b * H + kh * G + g) * D;
#pragma omp simd
            for (int d = 0; d < D; d++) o[d] = f32_to_bf16(acc[g * D + d]);
        }
    }
}
