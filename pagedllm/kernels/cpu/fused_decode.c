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
#include <stdatomic.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define SPIN_PAUSE() _mm_pause()
#else
#define SPIN_PAUSE() ((void)0)
#endif

#include "kernels.h"

#define MAX_SEGMENTS 4

/* Rows [start, start + rows) of a projection's output, packed in one block type; x8: the
 * same rows in quant_x8.c's 8-row layout, or NULL (the one-row int8 step reads it). */
typedef struct {
    const uint8_t *weight;
    int64_t qtype, start, rows;
    const uint8_t *x8;
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

#define X8_MAX_ROWS 64 /* as quant_x8.c (and quant.c's int8 path) */

static void project(const Projection *p, float *out, const float *x, int64_t rows,
                    int64_t num_threads) {
    for (int64_t i = 0; i < p->num_segments; i++) {
        const Segment *s = &p->segments[i];
        if (s->x8 != NULL && rows <= X8_MAX_ROWS)
            gguf_x8_matmul(out + s->start, p->out_features, x, p->in_features, rows, s->x8,
                           s->qtype, s->rows, p->in_features, num_threads);
        else
            gguf_matmul_f32(out + s->start, p->out_features, x, p->in_features, rows,
                            s->weight, s->qtype, s->rows, p->in_features, num_threads);
    }
}

/* ---- one sequence with 8-bit activations: the projections are GEMVs of a few hundred
 * microseconds at most, too short for a fork and a join barrier each (a barrier waits for
 * every thread, and on a busy machine a descheduled one holds the others up for a whole
 * time slice). One parallel region runs the step: thread 0 walks the layers and does the
 * small serial work (norms, rotary, the cache write, SiLU); each projection is published as
 * a phase of CHUNK_ROWS-row chunks that every thread claims from atomic tickets, and
 * the attention as a phase of one chunk per query head. Thread 0 then waits only for the
 * chunks that were claimed, never for a thread that is not running. */
#define CHUNK_ROWS 32 /* a multiple of 8: quant_x8.c's groups */
/* a ticket: phase << 40 | end << 20 | next chunk; a phase's chunks are split in two halves,
 * each its own ticket, so that each of two threads reads a contiguous run of the weight
 * (one stream for its prefetchers) and takes from the other half once its own is done */
#define PHASE_END (((int64_t)1 << 23) - 1)
#define TICKET(phase, end, next) \
    ((int64_t)(phase) << 40 | (int64_t)(end) << 20 | (int64_t)(next))
#define TICKET_PHASE(t) ((t) >> 40)
#define TICKET_CHUNKS(t) (((t) >> 20) & 0xfffff)
#define TICKET_NEXT(t) ((t) & 0xfffff)

typedef struct {
    /* claimed by compare-and-swap: a claim is of the phase (and its half's end) it read,
     * and the phase's description stays as it is until each claimed chunk is done */
    struct {
        _Alignas(64) _Atomic int64_t t;
    } ticket[2];
    _Alignas(64) _Atomic int64_t done; /* chunks finished, over all phases */
    /* the current phase's projection: read only between a successful claim and its done */
    const Projection *p;
    float *out;
    const int8_t *q; /* the input row quantized for each segment's type: [MAX_SEGMENTS][k] */
    const float *dx; /* [MAX_SEGMENTS][k / 16] */
    int64_t first_chunk[MAX_SEGMENTS + 1];
    /* an attention phase instead (layer non-NULL): chunk h is query head h */
    const DecodeModel *m;
    const DecodeStep *st;
    const DecodeLayer *layer;
    const float *query;
} WorkQueue;

static int one_row_int8(const Projection *p) {
    if (p->out_features / CHUNK_ROWS + MAX_SEGMENTS >= ((int64_t)1 << 20)) return 0;
    for (int64_t i = 0; i < p->num_segments; i++)
        if (!gguf_q8_row_supported(p->segments[i].qtype)) return 0;
    return 1;
}

static void run_chunk(const WorkQueue *wq, int64_t c) {
    if (wq->layer != NULL) {
        const DecodeModel *m = wq->m;
        paged_attention_decode_head_f32(wq->out, wq->query, wq->layer->key_cache,
                                        wq->layer->value_cache, wq->st->block_tables,
                                        wq->st->seq_lens[0], c, m->num_heads, m->num_kv_heads,
                                        m->head_dim, m->block_size, m->scale);
        return;
    }
    const Projection *p = wq->p;
    int64_t i = 0;
    while (c >= wq->first_chunk[i + 1]) i++;
    const Segment *s = &p->segments[i];
    const int64_t j0 = (c - wq->first_chunk[i]) * CHUNK_ROWS;
    const int64_t j1 = j0 + CHUNK_ROWS < s->rows ? j0 + CHUNK_ROWS : s->rows;
    const int64_t k = p->in_features, qtype = s->qtype & ~(int64_t)GGUF_INT8_ACTIVATIONS;
    if (s->x8 != NULL) /* rows a multiple of 8, chunks of CHUNK_ROWS (one too) */
        gguf_x8_row_matmul(wq->out + s->start, wq->q + i * k, wq->dx + i * (k / 16), s->x8,
                           qtype, j0 / 8, j1 / 8, k);
    else
        gguf_q8_row_matmul(wq->out + s->start, wq->q + i * k, wq->dx + i * (k / 16),
                           s->weight, qtype, j0, j1, k);
}

/* Claim and run chunks of phase `phase` until none is left: from half `own` first. */
static void work_phase(WorkQueue *wq, int64_t phase, int own) {
    for (int i = 0; i < 2; i++) {
        _Atomic int64_t *ticket = &wq->ticket[(own + i) & 1].t;
        int64_t t = atomic_load_explicit(ticket, memory_order_acquire);
        while (TICKET_PHASE(t) == phase && TICKET_NEXT(t) < TICKET_CHUNKS(t)) {
            if (atomic_compare_exchange_weak_explicit(ticket, &t, t + 1, memory_order_acquire,
                                                      memory_order_acquire)) {
                run_chunk(wq, TICKET_NEXT(t));
                atomic_fetch_add_explicit(&wq->done, 1, memory_order_release);
                t = atomic_load_explicit(ticket, memory_order_acquire);
            }
        }
    }
}

static void worker_loop(WorkQueue *wq, int own) {
    int64_t finished = -1; /* the last phase this thread found empty */
    for (;;) {
        const int64_t phase = TICKET_PHASE(atomic_load_explicit(&wq->ticket[0].t,
                                                                memory_order_acquire));
        if (phase == PHASE_END) return;
        if (phase == finished) {
            SPIN_PAUSE();
            continue;
        }
        work_phase(wq, phase, own);
        finished = phase;
    }
}

/* Publish the phase's description (already in wq) as phase *phase + 1 of `chunks` chunks,
 * work on it, and wait until every chunk is done. */
static void run_shared(WorkQueue *wq, int64_t *phase, int64_t *expected, int64_t chunks) {
    *phase += 1;
    *expected += chunks;
    const int64_t half = (chunks + 1) / 2;
    /* the second half first: a worker that sees the phase in ticket[0] sees both */
    atomic_store_explicit(&wq->ticket[1].t, TICKET(*phase, chunks, half), memory_order_release);
    atomic_store_explicit(&wq->ticket[0].t, TICKET(*phase, half, 0), memory_order_release);
    work_phase(wq, *phase, 0);
    while (atomic_load_explicit(&wq->done, memory_order_acquire) < *expected) SPIN_PAUSE();
}

/* out = x . W^T for one row x [p->in_features], shared with the workers. `q` and `dx`
 * hold MAX_SEGMENTS quantized copies of the row. */
static void project_shared(WorkQueue *wq, int64_t *phase, int64_t *expected,
                           const Projection *p, float *out, const float *x, int8_t *q,
                           float *dx) {
    const int64_t k = p->in_features;
    wq->first_chunk[0] = 0;
    for (int64_t i = 0; i < p->num_segments; i++) {
        const Segment *s = &p->segments[i];
        gguf_q8_quantize_row(q + i * k, dx + i * (k / 16), x, k,
                             s->qtype & ~(int64_t)GGUF_INT8_ACTIVATIONS);
        wq->first_chunk[i + 1] = wq->first_chunk[i] + (s->rows + CHUNK_ROWS - 1) / CHUNK_ROWS;
    }
    wq->p = p, wq->out = out, wq->q = q, wq->dx = dx, wq->layer = NULL;
    run_shared(wq, phase, expected, wq->first_chunk[p->num_segments]);
}

/* out [num_heads, head_dim] = the sequence's attention for query [num_heads, head_dim]
 * over layer L's cache, one head per chunk: shared with the workers as a projection is. */
static void attend_shared(WorkQueue *wq, int64_t *phase, int64_t *expected,
                          const DecodeLayer *L, float *out, const float *query) {
    wq->layer = L, wq->out = out, wq->query = query;
    run_shared(wq, phase, expected, wq->m->num_heads);
}

/* Thread 0's walk over the layers, for one row (llama_decode_layers_f32's order). */
static void one_row_layers(const DecodeModel *m, const DecodeStep *st, WorkQueue *wq,
                           const float *hidden_in, const float *residual_in, float *hidden_out,
                           float *residual_out, float *buf, int8_t *q, float *dx) {
    const int64_t H = m->hidden, q_size = m->num_heads * m->head_dim;
    const int64_t kv_size = m->num_kv_heads * m->head_dim, qkv_size = q_size + 2 * kv_size;
    float *normed = buf, *qkv = normed + H, *attn = qkv + qkv_size, *gate_up = attn + q_size;
    float *act = gate_up + 2 * m->intermediate;
    int64_t phase = 0, expected = 0;
    const float *x = hidden_in, *res = residual_in;
    for (int64_t l = 0; l < m->num_layers; l++) {
        const DecodeLayer *L = &m->layers[l];
        if (res == NULL) memcpy(residual_out, x, sizeof(float) * H);
        rms_norm_f32(normed, res == NULL ? NULL : residual_out, x, res, L->input_norm, 1, H,
                     L->input_eps, 1);
        res = residual_out;
        project_shared(wq, &phase, &expected, &L->qkv, qkv, normed, q, dx);
        float *k = qkv + q_size, *v = k + kv_size;
        rotary_embedding_f32(qkv, qkv_size, k, qkv_size, st->positions, m->cos, m->sin, 1,
                             m->num_heads, m->num_kv_heads, m->head_dim, 1);
        write_kv_cache_f32(L->key_cache, L->value_cache, k, qkv_size, v, qkv_size, st->slots,
                           1, kv_size);
        attend_shared(wq, &phase, &expected, L, attn, qkv);
        project_shared(wq, &phase, &expected, &L->o, hidden_out, attn, q, dx);
        rms_norm_f32(normed, residual_out, hidden_out, res, L->post_norm, 1, H, L->post_eps, 1);
        project_shared(wq, &phase, &expected, &L->gate_up, gate_up, normed, q, dx);
        silu_and_mul_f32(act, gate_up, 1, m->intermediate, 1);
        project_shared(wq, &phase, &expected, &L->down, hidden_out, act, q, dx);
        x = hidden_out;
    }
}

static int one_row_model(const DecodeModel *m) {
    for (int64_t l = 0; l < m->num_layers; l++) {
        const DecodeLayer *L = &m->layers[l];
        if (!(one_row_int8(&L->qkv) && one_row_int8(&L->o) && one_row_int8(&L->gate_up) &&
              one_row_int8(&L->down)))
            return 0;
    }
    return 1;
}

/* The one-row step; returns 0 where it does not apply (the general loop runs then). */
static int decode_one_row(const DecodeModel *m, const DecodeStep *st, const float *hidden_in,
                          const float *residual_in, float *hidden_out, float *residual_out) {
    if (st->rows != 1 || !one_row_model(m)) return 0;
    const int64_t H = m->hidden, I = m->intermediate;
    const int64_t q_size = m->num_heads * m->head_dim, kv_size = m->num_kv_heads * m->head_dim;
    const int64_t k_max = H > I ? H : (I > q_size ? I : q_size);
    float *buf = malloc(sizeof(float) * (size_t)(H + q_size + 2 * kv_size + q_size + 3 * I));
    int8_t *q = aligned_alloc(64, (size_t)(MAX_SEGMENTS * k_max + 64) / 64 * 64);
    float *dx = malloc(sizeof(float) * (size_t)(MAX_SEGMENTS * (k_max / 16 + 1)));
    if (buf == NULL || q == NULL || dx == NULL) {
        free(buf), free(q), free(dx);
        return 0;
    }
    WorkQueue wq = {.p = &m->layers[0].qkv, .m = m, .st = st};
    atomic_init(&wq.ticket[0].t, 0);
    atomic_init(&wq.ticket[1].t, 0);
    atomic_init(&wq.done, 0);
#pragma omp parallel num_threads(st->num_threads)
    {
#ifdef _OPENMP
        const int thread = omp_get_thread_num();
#else
        const int thread = 0;
#endif
        const int main_thread = thread == 0;
        if (main_thread) {
            one_row_layers(m, st, &wq, hidden_in, residual_in, hidden_out, residual_out, buf, q,
                           dx);
            atomic_store_explicit(&wq.ticket[0].t, TICKET(PHASE_END, 0, 0),
                                  memory_order_release);
        } else {
            worker_loop(&wq, thread & 1);
        }
    }
    free(buf), free(q), free(dx);
    return 1;
}

/* hidden_out, residual_out [rows, hidden] = the state after every layer, from the state
 * before them (residual_in NULL: before the first layer, as LlamaForCausalLM.embed gives). */
void llama_decode_layers_f32(const DecodeModel *m, const DecodeStep *st, const float *hidden_in,
                             const float *residual_in, float *hidden_out, float *residual_out) {
    if (decode_one_row(m, st, hidden_in, residual_in, hidden_out, residual_out)) return;
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
