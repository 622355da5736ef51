/* The kernels one file of this library calls in another (fused_decode.c composes them).
 * Each defining file includes this header too, so the compiler checks every prototype
 * against its definition. */
#ifndef PAGEDLLM_KERNELS_H
#define PAGEDLLM_KERNELS_H

#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* This thread's index and the team's size inside a parallel region (0 of 1 without
 * OpenMP): the kernels that split their work into contiguous shares by hand. */
static inline void thread_team(int64_t *t, int64_t *nt) {
#ifdef _OPENMP
    *t = omp_get_thread_num(), *nt = omp_get_num_threads();
#else
    *t = 0, *nt = 1;
#endif
}

/* Or'ed into gguf_matmul_f32's qtype: 8-bit activations where quant.c has them. */
#define GGUF_INT8_ACTIVATIONS 0x100

void gguf_matmul_f32(float *out, int64_t ldo, const float *x, int64_t ldx, int64_t rows,
                     const uint8_t *w, int64_t qtype, int64_t n, int64_t k,
                     int64_t num_threads);
/* One activation row, 8-bit, for rows [j0, j1) of W at a time (quant.c): q [k], dx
 * [k / 16]; only where gguf_q8_row_supported(qtype). */
int64_t gguf_q8_row_supported(int64_t qtype);
void gguf_q8_quantize_row(int8_t *q, float *dx, const float *x, int64_t k, int64_t qtype);
void gguf_q8_row_matmul(float *out, const int8_t *q, const float *dx, const uint8_t *w,
                        int64_t qtype, int64_t j0, int64_t j1, int64_t k);
/* Q4_0 / Q4_1 / Q8_0 rows repacked 8 at a time for the int8 GEMVs (quant_x8.c): rows a
 * multiple of 8; the matmul takes groups [g0, g1) of 8 rows. */
int64_t gguf_x8_supported(int64_t qtype);
void gguf_x8_repack(uint8_t *dst, const uint8_t *src, int64_t qtype, int64_t rows,
                    int64_t k);
void gguf_x8_row_matmul(float *out, const int8_t *q, const float *dx, const uint8_t *w,
                        int64_t qtype, int64_t g0, int64_t g1, int64_t k);
/* up to 64 activation rows (fp32, quantized inside) against the repacked w */
void gguf_x8_matmul(float *out, int64_t ldo, const float *x, int64_t ldx, int64_t rows,
                    const uint8_t *w, int64_t qtype, int64_t n, int64_t k,
                    int64_t num_threads);
void rms_norm_f32(float *out, float *residual_out, const float *x, const float *residual_in,
                  const float *weight, int64_t rows, int64_t dim, float eps,
                  int64_t num_threads);
void rotary_embedding_f32(float *q, int64_t q_stride, float *k, int64_t k_stride,
                          const int64_t *positions, const float *cos, const float *sin,
                          int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads,
                          int64_t head_dim, int64_t num_threads);
void silu_and_mul_f32(float *out, const float *x, int64_t rows, int64_t dim,
                      int64_t num_threads);
void write_kv_cache_f32(float *key_cache, float *value_cache, const float *key,
                        int64_t key_stride, const float *value, int64_t value_stride,
                        const int64_t *slots, int64_t num_tokens, int64_t row);
void paged_attention_decode_f32(float *out, const float *query, const float *key_cache,
                                const float *value_cache, const int32_t *block_tables,
                                int64_t table_stride, const int32_t *seq_lens,
                                int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                                int64_t head_dim, int64_t block_size, float scale,
                                int64_t sliding_window, const float *alibi,
                                int64_t max_seq_len, int64_t num_threads);

void paged_attention_decode_head_f32(float *out, const float *query, const float *key_cache,
                                     const float *value_cache, const int32_t *table,
                                     int64_t len, int64_t h, int64_t num_heads,
                                     int64_t num_kv_heads, int64_t head_dim,
                                     int64_t block_size, float scale);

#endif
