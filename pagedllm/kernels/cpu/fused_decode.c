/* A Llama-family decode step's decoder layers in one call, for GGUF-packed weights on the CPU.
 *
 * The per-op path (models/llama.py through layers/) runs ~12 kernels per layer, each behind
 * a Python module call and a ctypes call; on a 135M model that overhead is as large as the
 * matmuls. Here the same kernels (quant.c's packed matmul, elementwise.c's RMSNorm, rotary
 * and SiLU, paged_attention.c's cache write and decode attention) run back to back in C, in
 * the per-op path's order, over every layer. The layers' pointers (packed weight segments,
 * norm weights, KV caches) are set up once by the caller (models/cpu_decode.py); a step
 * passes only the hidden states and its metadata.
 *
 * Decode only: every sequence has exactly one query token (rows == sequences).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#define MAX_SEGMENTS 4

/* Rows [start, start + rows) of a projection's output, packed in one block type. */
typedef struct {
    const uint8_t *weight;
    int64_t qtype, start, rows;
} Segment;

typedef struct {
    Segment segments[MAX_SEGMENTS];
    int64_t num_segments, in_features, out_features;
} Projection;

typedef struct {
    const float *input_norm, *post_norm;
    float input_eps, post_eps;
    Projection qkv, o, gate_up, down;
    float *key_cache, *value_cache; /* [num_blocks, block_size, num_kv_heads, head_dim] */
} DecodeLayer;

typedef struct {
    const DecodeLayer *layers;
    int64_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate, block_size;
    float scale;
    const float *cos, *sin; /* [max_position, head_dim] */
} DecodeModel;

/* The step's metadata (kernels/metadata.py), on the host. */
typedef struct {
    int64_t rows;
    const int64_t *positions, *slots;
    const int32_t *block_tables, *seq_lens;
    int64_t table_stride, max_seq_len, num_threads;
} DecodeStep;

static void project(const Projection *p, float *out, const float *x, int64_t rows,
                    int64_t num_threads) {
    for (int64_t i = 0; i < p->num_segments; i++) {
        const Segment *s = &p->segments[i];
        gguf_matmul_f32(out + s->start, p->out_features, x, p->in_features, rows, s->weight,
                        s->qtype, s->rows, p->in_features, num_threads);
    }
}

/* hidden_out, residual_out [rows, hidden] = the state after every layer, from the state
 * before them (residual_in NULL: before the first layer, as LlamaForCausalLM.embed gives). */
void llama_decode_layers_f32(const DecodeModel *m, const DecodeStep *st, const float *hidden_in,
                             const float *residual_in, float *hidden_out, float *residual_out) {
    const int64_t rows = st->rows, threads = st->num_threads, H = m->hidden;
    const int64_t q_size = m->num_heads * m->head_dim, kv_size = m->num_kv_heads * m->head_dim;
    const int64_t qkv_size = q_size + 2 * kv_size, I = m->intermediate;
    float *buf = malloc(sizeof(float) * (size_t)rows * (H + qkv_size + 2 * q_size + 3 * I));
    float *normed = buf, *qkv = normed + rows * H, *query = qkv + rows * qkv_size;
    float *attn = query + rows * q_size, *gate_up = attn + rows * q_size;
    float *act = gate_up + rows * 2 * I;

    const float *x = hidden_in, *res = residual_in;
    for (int64_t l = 0; l < m->num_layers; l++) {
        const DecodeLayer *L = &m->layers[l];
        /* hidden, residual = input_layernorm(hidden, residual) */
        if (res == NULL) {
            memcpy(residual_out, x, sizeof(float) * rows * H);
            rms_norm_f32(normed, NULL, x, NULL, L->input_norm, rows, H, L->input_eps, threads);
        } else {
            rms_norm_f32(normed, residual_out, x, res, L->input_norm, rows, H, L->input_eps,
                         threads);
        }
        res = residual_out;
        /* attention: q|k|v, rotary on q and k, k and v into the cache, attend, o_proj */
        project(&L->qkv, qkv, normed, rows, threads);
        float *k = qkv + q_size, *v = k + kv_size;
        rotary_embedding_f32(qkv, qkv_size, k, qkv_size, st->positions, m->cos, m->sin, rows,
                             m->num_heads, m->num_kv_heads, m->head_dim, threads);
        write_kv_cache_f32(L->key_cache, L->value_cache, k, qkv_size, v, qkv_size, st->slots,
                           rows, kv_size);
        for (int64_t r = 0; r < rows; r++)
            memcpy(query + r * q_size, qkv + r * qkv_size, sizeof(float) * q_size);
        paged_attention_decode_f32(attn, query, L->key_cache, L->value_cache, st->block_tables,
                                   st->table_stride, st->seq_lens, rows, m->num_heads,
                                   m->num_kv_heads, m->head_dim, m->block_size, m->scale, 0,
                                   NULL, st->max_seq_len, threads);
        project(&L->o, hidden_out, attn, rows, threads);
        /* hidden, residual = post_attention_layernorm(hidden, residual); the gated MLP */
        rms_norm_f32(normed, residual_out, hidden_out, res, L->post_norm, rows, H, L->post_eps,
                     threads);
        project(&L->gate_up, gate_up, normed, rows, threads);
        silu_and_mul_f32(act, gate_up, rows, I, threads);
        project(&L->down, hidden_out, act, rows, threads);
        x = hidden_out;
    }
    free(buf);
}
