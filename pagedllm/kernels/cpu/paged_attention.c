/* Decode attention straight from the paged KV cache, for the CPU.
 *
 * The pure-torch path (kernels/reference.py) gathers every decoding sequence's blocks into a
 * padded [seqs, max_len] copy, then runs scaled_dot_product_attention over it: each layer
 * writes and reads the whole context twice more than it has to. Here each sequence reads its
 * own keys and values once, block by block, through its block table, and its query heads
 * share every key and value row they read (grouped-query attention). One OpenMP task per
 * sequence and KV head (so that one sequence's heads spread over the threads too); fp32
 * accumulation throughout. With AVX2 (AVX-512 CPUs included: its 512-bit dot products
 * with one horizontal sum per token were slower) a head_dim multiple of 64 takes
 * attend_group_avx2, which asks for all of a task's key and value rows before reading them
 * (docs/benchmarks.md has its figures).
 *
 * Layout (see kernels/metadata.py): key_cache and value_cache [num_blocks, block_size,
 * num_kv_heads, head_dim]; query and out [num_seqs, num_heads, head_dim], one query token
 * per sequence at position seq_lens[s] - 1; block_tables [num_seqs, table_stride].
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "vector_math.h"
#if defined(__AVX2__)
#include <immintrin.h>
#endif

static inline float dot(const float *a, const float *b, int64_t n) {
#if defined(__AVX512F__)
    if (n % 32 == 0) {
        __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
        for (int64_t i = 0; i < n; i += 32) {
            acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc0);
            acc1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16),
                                   acc1);
        }
        return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
    }
#elif defined(__AVX2__) && defined(__FMA__)
    if (n % 16 == 0) {
        __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
        for (int64_t i = 0; i < n; i += 16) {
            acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
            acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8),
                                   acc1);
        }
        return hsum256(_mm256_add_ps(acc0, acc1));
    }
#endif
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < n; i++) acc += a[i] * b[i];
    return acc;
}

static inline void axpy(float *y, float a, const float *x, int64_t n) {
#if defined(__AVX512F__)
    if (n % 16 == 0) {
        const __m512 va = _mm512_set1_ps(a);
        for (int64_t i = 0; i < n; i += 16)
            _mm512_storeu_ps(y + i,
                             _mm512_fmadd_ps(va, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
        return;
    }
#elif defined(__AVX2__) && defined(__FMA__)
    if (n % 8 == 0) {
        const __m256 va = _mm256_set1_ps(a);
        for (int64_t i = 0; i < n; i += 8)
            _mm256_storeu_ps(y + i,
                             _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
        return;
    }
#endif
#pragma omp simd
    for (int64_t i = 0; i < n; i++) y[i] += a * x[i];
}

/* The cache row of token t of a sequence, and (in *end) where its run of consecutive rows
 * stops: at the end of t's block, or of the sequence. Callers walk a block's tokens by
 * pointer instead of dividing by block_size for each token. */
static inline const float *block_run(const float *cache, const int32_t *table, int64_t t,
                                     int64_t len, int64_t block_size, int64_t token_stride,
                                     int64_t *end) {
    const int64_t offset = t % block_size;
    *end = t - offset + block_size < len ? t - offset + block_size : len;
    return cache + ((int64_t)table[t / block_size] * block_size + offset) * token_stride;
}

/* One sequence's query heads of KV head g (the `group` heads h0 = g * group ...): scores
 * [group, len] of scratch, then out[h] = softmax(scores[h]) . V. q and out point at head h0. */
static void attend_group(float *out, const float *q, const float *key_cache,
                         const float *value_cache, const int32_t *table, int64_t len,
                         int64_t start, int64_t g, int64_t group, int64_t num_kv_heads,
                         int64_t head_dim, int64_t block_size, float scale, const float *alibi,
                         float *scores) {
    const int64_t token_stride = num_kv_heads * head_dim;
    const int64_t span = len - start;
    for (int64_t t = start, end; t < len;) {
        const float *k = block_run(key_cache, table, t, len, block_size, token_stride, &end);
        for (; t < end; t++, k += token_stride) {
            float *s = scores + (t - start);
            for (int64_t j = 0; j < group; j++)
                s[j * span] = dot(q + j * head_dim, k + g * head_dim, head_dim) * scale;
        }
    }
    if (alibi)
        for (int64_t j = 0; j < group; j++)
            for (int64_t t = start; t < len; t++)
                scores[j * span + (t - start)] += alibi[g * group + j] * (float)(t - (len - 1));
    for (int64_t j = 0; j < group; j++) {
        float *p = scores + j * span;
        float max = -INFINITY, sum = 0.0f;
#pragma omp simd reduction(max : max)
        for (int64_t i = 0; i < span; i++) max = p[i] > max ? p[i] : max;
        int64_t i = 0;
#if defined(__AVX512F__)
        __m512 sums = _mm512_setzero_ps();
        for (; i + 16 <= span; i += 16) {
            const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(p + i), _mm512_set1_ps(max)));
            _mm512_storeu_ps(p + i, e);
            sums = _mm512_add_ps(sums, e);
        }
        sum = _mm512_reduce_add_ps(sums);
#endif
        for (; i < span; i++) {
            p[i] = expf(p[i] - max);
            sum += p[i];
        }
        const float inv = 1.0f / sum;
#pragma omp simd
        for (int64_t i = 0; i < span; i++) p[i] *= inv;
    }
    memset(out, 0, sizeof(float) * group * head_dim);
    for (int64_t t = start, end; t < len;) {
        const float *v = block_run(value_cache, table, t, len, block_size, token_stride, &end);
        for (; t < end; t++, v += token_stride) {
            const float *p = scores + (t - start);
            for (int64_t j = 0; j < group; j++)
                axpy(out + j * head_dim, p[j * span], v + g * head_dim, head_dim);
        }
    }
}

#if defined(__AVX2__) && defined(__FMA__)
#define ATTEND_AVX2 1
/* attend_group for AVX2 and head_dim a multiple of 64, without ALiBi: the keys' and values'
 * rows are looked up once (kp, vp: span pointers each); scores of 8 keys at a time, their 8
 * horizontal sums in one (hsum256x8); exp256 for the softmax; each 64 values of an output
 * head accumulate in registers over the tokens (in token order, as axpy adds them). */
static void attend_group_avx2(float *out, const float *q, const float *key_cache,
                              const float *value_cache, const int32_t *table, int64_t len,
                              int64_t start, int64_t g, int64_t group, int64_t num_kv_heads,
                              int64_t head_dim, int64_t block_size, float scale,
                              float *scores, const float **kp, const float **vp) {
    const int64_t token_stride = num_kv_heads * head_dim, span = len - start;
    for (int64_t t = start, end; t < len;) {
        const float *k = block_run(key_cache, table, t, len, block_size, token_stride, &end);
        const float *v = block_run(value_cache, table, t, len, block_size, token_stride, &end);
        for (; t < end; t++, k += token_stride, v += token_stride) {
            kp[t - start] = k + g * head_dim;
            vp[t - start] = v + g * head_dim;
            /* every row's cache lines requested now, into L2: the rows are strided and
             * scattered over blocks, so the hardware prefetcher alone leaves them to come
             * in one miss at a time */
            for (int64_t d = 0; d < head_dim; d += 16) {
                _mm_prefetch((const char *)(kp[t - start] + d), _MM_HINT_T1);
                _mm_prefetch((const char *)(vp[t - start] + d), _MM_HINT_T1);
            }
        }
    }
    const __m256 vscale = _mm256_set1_ps(scale);
    for (int64_t j = 0; j < group; j++) {
        const float *qj = q + j * head_dim;
        float *p = scores + j * span;
        for (int64_t t0 = 0; t0 < span; t0 += 8) {
            const int64_t nt = span - t0 < 8 ? span - t0 : 8;
            __m256 acc[8];
            for (int64_t i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
            for (int64_t d = 0; d < head_dim; d += 8) {
                const __m256 qv = _mm256_loadu_ps(qj + d);
                for (int64_t i = 0; i < nt; i++)
                    acc[i] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kp[t0 + i] + d), acc[i]);
            }
            const __m256 sc = _mm256_mul_ps(hsum256x8(acc), vscale);
            if (nt == 8) {
                _mm256_storeu_ps(p + t0, sc);
            } else {
                float tmp[8];
                _mm256_storeu_ps(tmp, sc);
                memcpy(p + t0, tmp, sizeof(float) * nt);
            }
        }
        float max = -INFINITY, sum = 0.0f;
#pragma omp simd reduction(max : max)
        for (int64_t i = 0; i < span; i++) max = p[i] > max ? p[i] : max;
        int64_t i = 0;
        __m256 sums = _mm256_setzero_ps();
        for (; i + 8 <= span; i += 8) {
            const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(p + i), _mm256_set1_ps(max)));
            _mm256_storeu_ps(p + i, e);
            sums = _mm256_add_ps(sums, e);
        }
        sum = hsum256(sums);
        for (; i < span; i++) {
            p[i] = expf(p[i] - max);
            sum += p[i];
        }
        const float inv = 1.0f / sum;
#pragma omp simd
        for (int64_t i = 0; i < span; i++) p[i] *= inv;
        for (int64_t d0 = 0; d0 < head_dim; d0 += 64) {
            __m256 o[8];
            for (int c = 0; c < 8; c++) o[c] = _mm256_setzero_ps();
            for (int64_t t = 0; t < span; t++) {
                const __m256 pt = _mm256_set1_ps(p[t]);
                const float *vt = vp[t] + d0;
                for (int c = 0; c < 8; c++) o[c] = _mm256_fmadd_ps(pt, _mm256_loadu_ps(vt + 8 * c), o[c]);
            }
            for (int c = 0; c < 8; c++) _mm256_storeu_ps(out + j * head_dim + d0 + 8 * c, o[c]);
        }
    }
}
#endif

#define ATTEND_PARALLEL_WORK (1 << 17) /* tokens x heads x head_dim */

/* One OpenMP task per (sequence, KV head): a single sequence's heads spread over the
 * threads too. Each query head's arithmetic is the same however the tasks fall. */
void paged_attention_decode_f32(float *out, const float *query, const float *key_cache,
                                const float *value_cache, const int32_t *block_tables,
                                int64_t table_stride, const int32_t *seq_lens,
                                int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                                int64_t head_dim, int64_t block_size, float scale,
                                int64_t sliding_window, const float *alibi,
                                int64_t max_seq_len, int64_t num_threads) {
    const int64_t group = num_heads / num_kv_heads, tasks = num_seqs * num_kv_heads;
    /* a step too small to share (one short sequence) runs on the calling thread: waking
     * the others and waiting for them costs more than the work */
    int64_t tokens = 0;
    for (int64_t s = 0; s < num_seqs; s++) tokens += seq_lens[s];
#pragma omp parallel num_threads(num_threads) if (tasks > 1 && tokens * num_heads * head_dim >= ATTEND_PARALLEL_WORK)
    {
        const int64_t cap = max_seq_len > 0 ? max_seq_len : 1;
        float *scores = malloc(sizeof(float) * group * cap);
#ifdef ATTEND_AVX2
        const float **rows = alibi == NULL && head_dim % 64 == 0 ? malloc(sizeof(float *) * 2 * cap)
                                                                 : NULL;
#endif
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; task++) {
            const int64_t s = task / num_kv_heads, g = task % num_kv_heads;
            const int64_t len = seq_lens[s];
            const int64_t start =
                sliding_window > 0 && len > sliding_window ? len - sliding_window : 0;
            const int64_t offset = (s * num_heads + g * group) * head_dim;
#ifdef ATTEND_AVX2
            if (rows != NULL) {
                attend_group_avx2(out + offset, query + offset, key_cache, value_cache,
                                  block_tables + s * table_stride, len, start, g, group,
                                  num_kv_heads, head_dim, block_size, scale, scores, rows,
                                  rows + cap);
                continue;
            }
#endif
            attend_group(out + offset, query + offset, key_cache, value_cache,
                         block_tables + s * table_stride, len, start, g, group, num_kv_heads,
                         head_dim, block_size, scale, alibi, scores);
        }
#ifdef ATTEND_AVX2
        free(rows);
#endif
        free(scores);
    }
}

/* Query head h alone of one sequence of len tokens (fused_decode.c's single stream shares
 * the heads among its threads): the same operations as that head gets in
 * paged_attention_decode_f32, so the same values. No sliding window, no ALiBi. */
void paged_attention_decode_head_f32(float *out, const float *query, const float *key_cache,
                                     const float *value_cache, const int32_t *table,
                                     int64_t len, int64_t h, int64_t num_heads,
                                     int64_t num_kv_heads, int64_t head_dim,
                                     int64_t block_size, float scale) {
    const int64_t g = h / (num_heads / num_kv_heads), offset = h * head_dim;
    float *scores = malloc(sizeof(float) * (size_t)len);
#ifdef ATTEND_AVX2
    if (head_dim % 64 == 0) {
        const float **rows = malloc(sizeof(float *) * 2 * (size_t)len);
        attend_group_avx2(out + offset, query + offset, key_cache, value_cache, table, len, 0,
                          g, 1, num_kv_heads, head_dim, block_size, scale, scores, rows,
                          rows + len);
        free(rows);
        free(scores);
        return;
    }
#endif
    attend_group(out + offset, query + offset, key_cache, value_cache, table, len, 0, g, 1,
                 num_kv_heads, head_dim, block_size, scale, NULL, scores);
    free(scores);
}

/* reshape_and_cache: copy each token's key and value rows (num_kv_heads * head_dim floats,
 * at the given row strides) into its cache slot; slot -1 means "do not write". */
void write_kv_cache_f32(float *key_cache, float *value_cache, const float *key,
                        int64_t key_stride, const float *value, int64_t value_stride,
                        const int64_t *slots, int64_t num_tokens, int64_t row) {
    for (int64_t t = 0; t < num_tokens; t++) {
        if (slots[t] < 0) continue;
        memcpy(key_cache + slots[t] * row, key + t * key_stride, sizeof(float) * row);
        memcpy(value_cache + slots[t] * row, value + t * value_stride, sizeof(float) * row);
    }
}
