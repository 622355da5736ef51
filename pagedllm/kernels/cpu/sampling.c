/* Greedy sampling's reductions over the logits, for the CPU: each row's argmax and
 * logsumexp (the logprob of the chosen token needs it) in two passes over the row.
 *
 * torch computes them as max(dim) and logsumexp: six passes over [rows, vocab] (max, then
 * logsumexp's amax, sub, exp, sum, log), each an op dispatch and a fork of the thread pool,
 * a visible part of a small model's decode step (docs/benchmarks.md). This is one call,
 * one thread per row.
 *
 * The values are torch's: the argmax is the first index of the row's maximum, NaN counting
 * as the maximum (as torch.max does); the logsumexp is max + log(sum(exp(x - max))), which
 * is the maximum itself where that is infinite or NaN.
 */
#include <math.h>
#include <stdint.h>

#include "vector_math.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SAMPLING_AVX2 1
#endif

/* The first index of x's maximum, NaN the largest value. */
static int64_t first_argmax(const float *x, int64_t n) {
    int64_t i = 0, best = 0;
    float m = x[0];
    if (m != m) return 0;
#ifdef SAMPLING_AVX2
    if (n >= 16) {
        /* per lane: the lane's maximum and its first index (a later equal value never
         * replaces it); NaN lanes are found apart */
        __m256 vm = _mm256_loadu_ps(x), nan = _mm256_setzero_ps();
        __m256i vi = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), idx = vi;
        const __m256i eight = _mm256_set1_epi32(8);
        for (i = 8; i + 8 <= n; i += 8) {
            idx = _mm256_add_epi32(idx, eight);
            const __m256 v = _mm256_loadu_ps(x + i);
            const __m256 gt = _mm256_cmp_ps(v, vm, _CMP_GT_OQ);
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
            vm = _mm256_blendv_ps(vm, v, gt);
            vi = _mm256_blendv_epi8(vi, idx, _mm256_castps_si256(gt));
        }
        if (!_mm256_testz_ps(nan, nan)) {
            for (int64_t j = 0; j < n; j++)
                if (x[j] != x[j]) return j;
        }
        float lm[8];
        int32_t li[8];
        _mm256_storeu_ps(lm, vm);
        _mm256_storeu_si256((__m256i *)li, vi);
        m = lm[0], best = li[0];
        for (int l = 1; l < 8; l++)
            if (lm[l] > m || (lm[l] == m && li[l] < best)) m = lm[l], best = li[l];
    }
#endif
    for (; i < n; i++) {
        if (x[i] != x[i]) return i;
        if (x[i] > m) m = x[i], best = i;
    }
    return best;
}

static float sum_exp(const float *x, int64_t n, float max) {
    int64_t i = 0;
    float sum = 0.0f;
#ifdef SAMPLING_AVX2
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    const __m256 vmax = _mm256_set1_ps(max);
    for (; i + 16 <= n; i += 16) {
        s0 = _mm256_add_ps(s0, exp256(_mm256_sub_ps(_mm256_loadu_ps(x + i), vmax)));
        s1 = _mm256_add_ps(s1, exp256(_mm256_sub_ps(_mm256_loadu_ps(x + i + 8), vmax)));
    }
    sum = hsum256(_mm256_add_ps(s0, s1));
#endif
    for (; i < n; i++) sum += expf(x[i] - max);
    return sum;
}

/* argmax[r], lse[r] of rows r of x [rows, vocab] (row stride `stride` floats). */
void row_argmax_logsumexp_f32(const float *x, int64_t rows, int64_t vocab, int64_t stride,
                              int64_t *argmax, float *lse, int64_t num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * stride;
        const int64_t best = first_argmax(row, vocab);
        const float max = row[best];
        argmax[r] = best;
        lse[r] = isfinite(max) ? max + logf(sum_exp(row, vocab, max)) : max;
    }
}
