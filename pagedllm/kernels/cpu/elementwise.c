/* Fused elementwise kernels for the CPU: each is one pass over its rows instead of the five
 * to eight torch ops (and temporaries) of the pure-torch path. fp32 only. */
#include <math.h>
#include <stdint.h>

#include "kernels.h"
#include "vector_math.h"

/* RMSNorm, optionally after adding the residual: with residual_in, sum = x + residual_in is
 * written to residual_out and normalised; without, x is. out = weight * sum / rms(sum). */
void rms_norm_f32(float *out, float *residual_out, const float *x, const float *residual_in,
                  const float *weight, int64_t rows, int64_t dim, float eps,
                  int64_t num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * dim >= 65536)
    for (int64_t r = 0; r < rows; r++) {
        const float *src = x + r * dim;
        float *dst = out + r * dim;
        if (residual_in) {
            float *sum = residual_out + r * dim;
            const float *res = residual_in + r * dim;
#pragma omp simd
            for (int64_t i = 0; i < dim; i++) sum[i] = src[i] + res[i];
            src = sum;
        }
        float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
        for (int64_t i = 0; i < dim; i++) squares += src[i] * src[i];
        const float inv = 1.0f / sqrtf(squares / (float)dim + eps);
#pragma omp simd
        for (int64_t i = 0; i < dim; i++) dst[i] = weight[i] * (src[i] * inv);
    }
}

/* Rotary embedding, rotate-half layout, in place on the heads of each token of q and k.
 * cos and sin: [max_position, head_dim] (each half repeated); row strides in floats. */
static void rotate_heads(float *x, int64_t num_heads, int64_t head_dim, const float *cos,
                         const float *sin) {
    const int64_t half = head_dim / 2;
    for (int64_t h = 0; h < num_heads; h++, x += head_dim) {
#pragma omp simd
        for (int64_t i = 0; i < half; i++) {
            const float x1 = x[i], x2 = x[i + half];
            x[i] = x1 * cos[i] - x2 * sin[i];
            x[i + half] = x2 * cos[i + half] + x1 * sin[i + half];
        }
    }
}

void rotary_embedding_f32(float *q, int64_t q_stride, float *k, int64_t k_stride,
                          const int64_t *positions, const float *cos, const float *sin,
                          int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads,
                          int64_t head_dim, int64_t num_threads) {
#pragma omp parallel for num_threads(num_threads) if (num_tokens * num_heads * head_dim >= 65536)
    for (int64_t t = 0; t < num_tokens; t++) {
        const float *c = cos + positions[t] * head_dim, *s = sin + positions[t] * head_dim;
        rotate_heads(q + t * q_stride, num_heads, head_dim, c, s);
        rotate_heads(k + t * k_stride, num_kv_heads, head_dim, c, s);
    }
}

/* The gated MLP activation on a fused [gate | up] projection: out = silu(gate) * up, with
 * silu(g) = g / (1 + exp(-g)) as torch computes it. x: [rows, 2 * dim], out: [rows, dim]. */
void silu_and_mul_f32(float *out, const float *x, int64_t rows, int64_t dim,
                      int64_t num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * dim >= 65536)
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = x + r * 2 * dim, *up = gate + dim;
        float *dst = out + r * dim;
        int64_t i = 0;
#if defined(__AVX512F__)
        const __m512 one = _mm512_set1_ps(1.0f);
        for (; i + 16 <= dim; i += 16) {
            const __m512 g = _mm512_loadu_ps(gate + i);
            const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), g));
            const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(one, e));
            _mm512_storeu_ps(dst + i, _mm512_mul_ps(silu, _mm512_loadu_ps(up + i)));
        }
#elif defined(__AVX2__) && defined(__FMA__)
        const __m256 one = _mm256_set1_ps(1.0f);
        for (; i + 8 <= dim; i += 8) {
            const __m256 g = _mm256_loadu_ps(gate + i);
            const __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), g));
            const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(one, e));
            _mm256_storeu_ps(dst + i, _mm256_mul_ps(silu, _mm256_loadu_ps(up + i)));
        }
#endif
        for (; i < dim; i++) dst[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
    }
}
