/* GGUF quantized weights kept packed on the CPU: y = x . W^T with W in llama.cpp's blocks.
 *
 * Block layouts (as the gguf package's quants.py defines them; every row of W is a run of
 * blocks, k / block_size of them):
 *   Q8_0  34 bytes / 32:   fp16 d, int8 q[32]                         w = q * d
 *   Q4_0  18 bytes / 32:   fp16 d, q[16] (low nibbles 0-15, high 16-31) w = (q - 8) * d
 *   Q4_1  20 bytes / 32:   fp16 d, fp16 m, q[16] (as Q4_0)            w = q * d + m
 *   Q4_K 144 bytes / 256:  fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins for 8
 *                          sub-blocks of 32, q[128]: 32-byte chunk c holds sub-block 2c in its
 *                          low nibbles, 2c + 1 in its high nibbles    w = (d*sc) q - dmin*mn
 *   Q6_K 210 bytes / 256:  ql[128], qh[64], int8 scales[16] (one per 16 values), fp16 d;
 *                          6-bit q = low 4 bits from ql, high 2 from qh  w = (d*sc) (q - 32)
 *
 * dequantize and get_rows compute every weight with the oracle's own fp32 operations and
 * rounding order (gguf.quants.dequantize: a multiply, then an add for the offset), so they
 * are bit-exact. The matmul takes fp32 activations in two ways:
 *   1-8 rows (decode, a speculative step's k + 1 rows): the activations are quantized to
 *       16-bit integers per block of 32 and multiplied with the weights in integer
 *       arithmetic, straight from the packed bytes (int_matmul): each weight row is read
 *       once for all rows;
 *   more rows (tiled_matmul, 64 at a time): fp32 FMAs in register tiles of a few weight
 *       rows x 8-32 activation rows. 4-bit weights (Q4_0, Q4_1, Q4_K) are never written out
 *       in fp32: per unit of 32 weights a table of the 16 values its nibbles stand for is
 *       built, and each step broadcasts the entry its nibble picks (a byte load, in the
 *       integer units the FMAs leave idle); Q8_0 and Q6_K rows are dequantized a chunk at a
 *       time into a buffer in L1. On the 2-core Zen machine here (one 256-bit FMA per cycle
 *       per core) 16 rows run at ~30 GFLOP/s per core, ~77% of its FMA peak; integer
 *       multiply-adds (madd: half a 256-bit instruction per cycle) are no faster there
 *       per product, nor are 8-bit ones (maddubs), which need a widening madd as well.
 * Larger batches (prompts, more than 64 rows) dequantize a weight into fp32 and use BLAS:
 * gguf_blas_matmul_f32 below, each thread on its own share of the rows with MKL's sgemm
 * (layers/gguf_linear.py; torch's GEMM where torch links no MKL).
 * OpenMP over output rows; AVX2 + FMA where the compiler targets them, else scalar code.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "vector_math.h"

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define QUANT_AVX2 1
#endif

enum { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q6_K = 14 }; /* GGMLQuantizationType */

/* ------------------------------------------------------------------------- fp16 */

static inline float fp16_to_fp32(const uint8_t *p) {
    const uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else if (exp == 0) {
        if (mant == 0) {
            bits = sign;
        } else { /* subnormal: normalise */
            exp = 113;
            while (!(mant & 0x400)) {
                mant <<= 1;
                exp--;
            }
            bits = sign | (exp << 23) | ((mant & 0x3ff) << 13);
        }
    } else {
        bits = sign | ((exp + 112) << 23) | (mant << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

#ifdef QUANT_AVX2
/* two adjacent fp16 values (a block's scale and min) in one conversion */
static inline void fp16x2_to_fp32(const uint8_t *p, float *a, float *b) {
    int32_t bits;
    memcpy(&bits, p, sizeof bits);
    const __m128 v = _mm_cvtph_ps(_mm_cvtsi32_si128(bits));
    *a = _mm_cvtss_f32(v);
    *b = _mm_cvtss_f32(_mm_movehdup_ps(v));
}
#endif

/* ------------------------------------------------------------------------- block shapes */

static int64_t block_size(int64_t qtype) {
    return (qtype == Q4_K || qtype == Q6_K) ? 256 : 32;
}

static int64_t block_bytes(int64_t qtype) {
    switch (qtype) {
    case Q8_0: return 34;
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q4_K: return 144;
    case Q6_K: return 210;
    default: return 0;
    }
}

int64_t gguf_row_bytes(int64_t qtype, int64_t k) {
    const int64_t bs = block_size(qtype), bb = block_bytes(qtype);
    return (bb == 0 || k % bs) ? -1 : k / bs * bb;
}

/* ------------------------------------------------------------------------- dequantize */

#ifdef QUANT_AVX2
/* 8 bytes -> 8 floats */
static inline __m256 u8x8_to_ps(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)); }
static inline __m256 i8x8_to_ps(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)); }

/* 16 bytes of nibble pairs -> 32 floats: low nibbles first, then high nibbles */
static inline void nibbles_to_ps(const uint8_t *q, __m256 out[4]) {
    const __m128i bytes = _mm_loadu_si128((const __m128i *)q), mask = _mm_set1_epi8(0x0f);
    const __m128i lo = _mm_and_si128(bytes, mask);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
    out[0] = u8x8_to_ps(lo);
    out[1] = u8x8_to_ps(_mm_srli_si128(lo, 8));
    out[2] = u8x8_to_ps(hi);
    out[3] = u8x8_to_ps(_mm_srli_si128(hi, 8));
}
#endif

static void dequant_q8_0(const uint8_t *b, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, b += 34, y += 32) {
        const float d = fp16_to_fp32(b);
        const int8_t *q = (const int8_t *)(b + 2);
#ifdef QUANT_AVX2
        const __m256 vd = _mm256_set1_ps(d);
        for (int j = 0; j < 32; j += 8)
            _mm256_storeu_ps(y + j, _mm256_mul_ps(i8x8_to_ps(_mm_loadl_epi64((const __m128i *)(q + j))), vd));
#else
        for (int j = 0; j < 32; j++) y[j] = (float)q[j] * d;
#endif
    }
}

static void dequant_q4_0(const uint8_t *b, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, b += 18, y += 32) {
        const float d = fp16_to_fp32(b);
        const uint8_t *q = b + 2;
#ifdef QUANT_AVX2
        __m256 v[4];
        nibbles_to_ps(q, v);
        const __m256 vd = _mm256_set1_ps(d), eight = _mm256_set1_ps(8.0f);
        for (int j = 0; j < 4; j++)  /* q - 8 is exact in fp32, as the oracle's int8 is */
            _mm256_storeu_ps(y + 8 * j, _mm256_mul_ps(_mm256_sub_ps(v[j], eight), vd));
#else
        for (int j = 0; j < 16; j++) {
            y[j] = (float)((q[j] & 0x0f) - 8) * d;
            y[j + 16] = (float)((q[j] >> 4) - 8) * d;
        }
#endif
    }
}

static void dequant_q4_1(const uint8_t *b, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, b += 20, y += 32) {
        const float d = fp16_to_fp32(b), m = fp16_to_fp32(b + 2);
        const uint8_t *q = b + 4;
#ifdef QUANT_AVX2
        __m256 v[4];
        nibbles_to_ps(q, v);
        const __m256 vd = _mm256_set1_ps(d), vm = _mm256_set1_ps(m);
        for (int j = 0; j < 4; j++)
            _mm256_storeu_ps(y + 8 * j, _mm256_add_ps(_mm256_mul_ps(v[j], vd), vm));
#else
        for (int j = 0; j < 16; j++) {
            y[j] = (float)(q[j] & 0x0f) * d + m;
            y[j + 16] = (float)(q[j] >> 4) * d + m;
        }
#endif
    }
}

/* Q4_K's 12 bytes of scales: sub-block j's 6-bit scale and min. */
static inline void q4_k_scale_min(const uint8_t *s, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

#ifdef QUANT_AVX2
/* Unit j (32 weights, sub-block j & 7 of super-block j >> 3) of a Q4_K row: its weights are
 * w = scale * q - min for the 32 nibbles q returned as bytes, in the order of k. */
static inline __m256i q4_k_unit(const uint8_t *row, int64_t j, float *scale, float *min) {
    const uint8_t *b = row + (j >> 3) * 144;
    const int sub = (int)(j & 7);
    int sc, mn;
    q4_k_scale_min(b + 4, sub, &sc, &mn);
    float d, dmin;
    fp16x2_to_fp32(b, &d, &dmin);
    *scale = d * (float)sc;
    *min = dmin * (float)mn;
    return _mm256_and_si256(
        _mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)(b + 16 + 32 * (sub >> 1))),
                          4 * (sub & 1)),
        _mm256_set1_epi8(0x0f));
}
#endif

static void dequant_q4_k(const uint8_t *b, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, b += 144, y += 256) {
        const float d = fp16_to_fp32(b), dmin = fp16_to_fp32(b + 2);
        const uint8_t *scales = b + 4, *q = b + 16;
        for (int c = 0; c < 4; c++, q += 32) {
            for (int s = 0; s < 2; s++) {
                int sc, mn;
                q4_k_scale_min(scales, 2 * c + s, &sc, &mn);
                const float ds = d * (float)sc, dm = dmin * (float)mn;
                float *out = y + (2 * c + s) * 32;
                const int shift = 4 * s;
#ifdef QUANT_AVX2
                const __m256 vd = _mm256_set1_ps(ds), vm = _mm256_set1_ps(dm);
                const __m256i bytes = _mm256_loadu_si256((const __m256i *)q);
                const __m256i nib = _mm256_and_si256(_mm256_srli_epi16(bytes, shift),
                                                     _mm256_set1_epi8(0x0f));
                const __m128i n0 = _mm256_castsi256_si128(nib), n1 = _mm256_extracti128_si256(nib, 1);
                const __m256 v[4] = {u8x8_to_ps(n0), u8x8_to_ps(_mm_srli_si128(n0, 8)),
                                     u8x8_to_ps(n1), u8x8_to_ps(_mm_srli_si128(n1, 8))};
                for (int j = 0; j < 4; j++)
                    _mm256_storeu_ps(out + 8 * j, _mm256_sub_ps(_mm256_mul_ps(vd, v[j]), vm));
#else
                for (int j = 0; j < 32; j++) out[j] = ds * (float)((q[j] >> shift) & 0x0f) - dm;
#endif
            }
        }
    }
}

static void dequant_q6_k(const uint8_t *b, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, b += 210, y += 256) {
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t *scales = (const int8_t *)(b + 192);
        const float d = fp16_to_fp32(b + 208);
        for (int h = 0; h < 2; h++) {        /* halves of 128 values */
            for (int g = 0; g < 4; g++) {    /* groups of 32 within the half */
                const uint8_t *lo = ql + h * 64 + (g & 1) * 32, *hi = qh + h * 32;
                const int lshift = (g >> 1) * 4, hshift = 2 * g;
                float *out = y + h * 128 + g * 32;
                for (int half = 0; half < 2; half++) { /* 16 values share a scale */
                    const float ds = d * (float)scales[(h * 128 + g * 32 + half * 16) / 16];
                    const int o = half * 16;
#ifdef QUANT_AVX2
                    const __m128i l = _mm_and_si128(
                        _mm_srli_epi16(_mm_loadu_si128((const __m128i *)(lo + o)), lshift),
                        _mm_set1_epi8(0x0f));
                    const __m128i u = _mm_and_si128(
                        _mm_srli_epi16(_mm_loadu_si128((const __m128i *)(hi + o)), hshift),
                        _mm_set1_epi8(0x03));
                    const __m128i q6 = _mm_sub_epi8(_mm_or_si128(l, _mm_slli_epi16(u, 4)),
                                                    _mm_set1_epi8(32));
                    const __m256 vd = _mm256_set1_ps(ds);
                    _mm256_storeu_ps(out + o, _mm256_mul_ps(vd, i8x8_to_ps(q6)));
                    _mm256_storeu_ps(out + o + 8,
                                     _mm256_mul_ps(vd, i8x8_to_ps(_mm_srli_si128(q6, 8))));
#else
                    for (int j = o; j < o + 16; j++) {
                        const int q = ((lo[j] >> lshift) & 0x0f) | (((hi[j] >> hshift) & 3) << 4);
                        out[j] = ds * (float)(q - 32);
                    }
#endif
                }
            }
        }
    }
}

/* k values (a whole number of blocks) of one row, from its packed bytes. */
static void dequant_row(int64_t qtype, const uint8_t *src, float *dst, int64_t k) {
    const int64_t nb = k / block_size(qtype);
    switch (qtype) {
    case Q8_0: dequant_q8_0(src, dst, nb); break;
    case Q4_0: dequant_q4_0(src, dst, nb); break;
    case Q4_1: dequant_q4_1(src, dst, nb); break;
    case Q4_K: dequant_q4_k(src, dst, nb); break;
    case Q6_K: dequant_q6_k(src, dst, nb); break;
    default: break;
    }
}

/* out [n, k] = the n packed rows of w. */
void gguf_dequantize_f32(float *out, const uint8_t *w, int64_t qtype, int64_t n, int64_t k,
                         int64_t num_threads) {
    const int64_t row_bytes = gguf_row_bytes(qtype, k);
#pragma omp parallel for num_threads(num_threads) if (n * k >= 65536)
    for (int64_t r = 0; r < n; r++) dequant_row(qtype, w + r * row_bytes, out + r * k, k);
}

/* out [num_ids, k] = rows ids of w (the embedding lookup of a packed table). */
void gguf_get_rows_f32(float *out, const uint8_t *w, int64_t qtype, int64_t k,
                       const int64_t *ids, int64_t num_ids, int64_t num_threads) {
    const int64_t row_bytes = gguf_row_bytes(qtype, k);
#pragma omp parallel for num_threads(num_threads) if (num_ids * k >= 65536)
    for (int64_t r = 0; r < num_ids; r++)
        dequant_row(qtype, w + ids[r] * row_bytes, out + r * k, k);
}

/* ---- prompts: dequantize + the BLAS sgemm (MKL's, the one torch links: its Fortran
 * `sgemm_`, passed in by address). Each thread takes its own share of the weight's rows (the
 * output's columns), dequantizes them into a buffer of its own and multiplies them with a
 * single-threaded sgemm (MKL runs sequentially inside a parallel region): on the 2-core
 * EPYC here this runs a 512-token prompt's projections faster than one two-threaded GEMM
 * per weight, and a thread's dequantized rows are multiplied on the core that wrote them.
 * The values are gguf_dequantize_f32's. */
typedef void (*sgemm_fn)(const char *, const char *, const int *, const int *, const int *,
                         const float *, const float *, const int *, const float *,
                         const int *, const float *, float *, const int *);

/* each thread's dequantization buffer, grown as needed and kept for the thread's life
 * (OpenMP's pool threads persist), so that layers reuse memory that is already mapped */
static _Thread_local float *tls_buf;
static _Thread_local int64_t tls_cap;

static float *thread_buffer(int64_t floats) {
    if (floats > tls_cap) {
        free(tls_buf);
        const size_t bytes = ((size_t)floats * sizeof(float) + 63) / 64 * 64;
        tls_buf = aligned_alloc(64, bytes);
        tls_cap = tls_buf ? floats : 0;
    }
    return tls_buf;
}

/* out[r * ldo + j] = x[r] . W[j] for the m activation rows x [m, ldx] and the n packed
 * rows of W, through sgemm on at most chunk_rows dequantized rows at a time. Returns 0, or
 * -1 when a buffer could not be allocated (nothing computed then is to be trusted). */
int64_t gguf_blas_matmul_f32(float *out, int64_t ldo, const float *x, int64_t ldx, int64_t m,
                             const uint8_t *w, int64_t qtype, int64_t n, int64_t k,
                             const void *sgemm, int64_t chunk_rows, int64_t num_threads) {
    const int64_t row_bytes = gguf_row_bytes(qtype, k);
    const sgemm_fn gemm = (sgemm_fn)sgemm;
    int64_t failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        int64_t t, nt;
        thread_team(&t, &nt);
        /* shares of whole 16-column groups: a cache line of each output row per thread */
        const int64_t share = ((n + nt - 1) / nt + 15) & ~(int64_t)15;
        const int64_t c_begin = t * share < n ? t * share : n;
        const int64_t c_end = c_begin + share < n ? c_begin + share : n;
        const int64_t rows_max = chunk_rows < share ? chunk_rows : share;
        float *buf = c_begin < c_end ? thread_buffer(rows_max * k) : NULL;
        if (c_begin < c_end && buf == NULL) failed = 1;
        for (int64_t c0 = c_begin; buf != NULL && c0 < c_end; c0 += rows_max) {
            const int64_t nc = c_end - c0 < rows_max ? c_end - c0 : rows_max;
            for (int64_t r = 0; r < nc; r++) dequant_row(qtype, w + (c0 + r) * row_bytes, buf + r * k, k);
            /* column-major, as sgemm sees it: out^T [nc, m] (ld ldo) = W_c [nc, k] . x^T [k, m];
             * buf (W_c's rows) is W_c^T column-major ("T"), x is x^T column-major ("N") */
            const int M = (int)nc, N = (int)m, K = (int)k, lda = (int)k, ldb = (int)ldx;
            const int ldc = (int)ldo;
            const float one = 1.0f, zero = 0.0f;
            gemm("T", "N", &M, &N, &K, &one, buf, &lda, x, &ldb, &zero, out + c0, &ldc);
        }
    }
    return failed ? -1 : 0;
}

/* ------------------------------------------------------------------------- matmul */

#define KC 1024 /* k per chunk of dequantized weight rows: whole blocks of every type */

#ifdef QUANT_AVX2

/* ---- the tiled path for nine or more activation rows. The activations are transposed
 * once per call into xt [k, rp] (rows padded to rp, a multiple of 8, with zeros), so that
 * a tile of output is NW weight rows x RV vectors of 8 activation rows: each step of k
 * broadcasts NW dequantized weights and loads RV activation vectors for NW * RV FMAs, with
 * no horizontal sums (the shape of a BLAS micro-kernel, with x in the role of B). */

/* part [NW][rp] (+)= w [NW rows, KC apart] . xt [kl, rp] for activation-row vectors
 * v0 .. v0 + RV of the padded rows. */
static inline __attribute__((always_inline)) void tile(const float *w, int NW, const float *xt,
                                                       int64_t rp, int64_t v0, int RV,
                                                       int64_t kl, float *part, int first) {
    __m256 a[12][4];
    for (int t = 0; t < NW; t++)
        for (int v = 0; v < RV; v++)
            a[t][v] = first ? _mm256_setzero_ps() : _mm256_load_ps(part + t * rp + 8 * (v0 + v));
    const float *xk = xt + 8 * v0;
    for (int64_t i = 0; i < kl; i++, xk += rp) {
        __m256 x[4];
        for (int v = 0; v < RV; v++) x[v] = _mm256_load_ps(xk + 8 * v);
        for (int t = 0; t < NW; t++) {
            const __m256 wb = _mm256_broadcast_ss(w + t * KC + i);
            for (int v = 0; v < RV; v++) a[t][v] = _mm256_fmadd_ps(wb, x[v], a[t][v]);
        }
    }
    for (int t = 0; t < NW; t++)
        for (int v = 0; v < RV; v++) _mm256_store_ps(part + t * rp + 8 * (v0 + v), a[t][v]);
}

/* NW weight rows against every activation-row vector, RV (at most 4) vectors at a time;
 * NW * RV <= 12 accumulators. */
#define TILE_CASE(nw, rv) \
    case nw * 8 + rv: tile(w, nw, xt, rp, v, rv, kl, part, first); break;
static void tile_rows(const float *w, int nw, const float *xt, int64_t rp, int64_t kl,
                      float *part, int first) {
    const int64_t nv = rp / 8;
    for (int64_t v = 0; v < nv;) {
        const int rv = nw == 12 ? 1 : nw == 6 ? 2 : nw == 4 ? 3 : nv - v < 4 ? (int)(nv - v) : 4;
        switch (nw * 8 + rv) {
        TILE_CASE(12, 1) TILE_CASE(6, 2) TILE_CASE(4, 3) TILE_CASE(3, 4) TILE_CASE(3, 3)
        TILE_CASE(3, 2) TILE_CASE(3, 1) TILE_CASE(1, 4) TILE_CASE(1, 3) TILE_CASE(1, 2)
        TILE_CASE(1, 1)
        default: break;
        }
        v += rv;
    }
}
#undef TILE_CASE

/* xt [k, rp] = x [rows, ldx] transposed, rows rp - rows .. rp zero; k0 .. k1 of k (a
 * multiple of 8 each). 8 x 8 blocks through registers. */
static void transpose_rows(float *xt, int64_t rp, const float *x, int64_t ldx, int64_t rows,
                           int64_t k0, int64_t k1) {
    for (int64_t r0 = 0; r0 < rp; r0 += 8) {
        for (int64_t i0 = k0; i0 < k1; i0 += 8) {
            __m256 v[8];
            for (int r = 0; r < 8; r++)
                v[r] = r0 + r < rows ? _mm256_loadu_ps(x + (r0 + r) * ldx + i0) : _mm256_setzero_ps();
            const __m256 t0 = _mm256_unpacklo_ps(v[0], v[1]), t1 = _mm256_unpackhi_ps(v[0], v[1]);
            const __m256 t2 = _mm256_unpacklo_ps(v[2], v[3]), t3 = _mm256_unpackhi_ps(v[2], v[3]);
            const __m256 t4 = _mm256_unpacklo_ps(v[4], v[5]), t5 = _mm256_unpackhi_ps(v[4], v[5]);
            const __m256 t6 = _mm256_unpacklo_ps(v[6], v[7]), t7 = _mm256_unpackhi_ps(v[6], v[7]);
            const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
            const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
            const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
            const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
            float *o = xt + i0 * rp + r0;
            _mm256_store_ps(o + 0 * rp, _mm256_permute2f128_ps(u0, u4, 0x20));
            _mm256_store_ps(o + 1 * rp, _mm256_permute2f128_ps(u1, u5, 0x20));
            _mm256_store_ps(o + 2 * rp, _mm256_permute2f128_ps(u2, u6, 0x20));
            _mm256_store_ps(o + 3 * rp, _mm256_permute2f128_ps(u3, u7, 0x20));
            _mm256_store_ps(o + 4 * rp, _mm256_permute2f128_ps(u0, u4, 0x31));
            _mm256_store_ps(o + 5 * rp, _mm256_permute2f128_ps(u1, u5, 0x31));
            _mm256_store_ps(o + 6 * rp, _mm256_permute2f128_ps(u2, u6, 0x31));
            _mm256_store_ps(o + 7 * rp, _mm256_permute2f128_ps(u3, u7, 0x31));
        }
    }
}

/* ---- 4-bit weights (Q4_0, Q4_1, Q4_K) skip the dequantized buffer: a unit of 32 weights
 * has 16 possible values, so a table of them (computed with the oracle's operations) is
 * built per unit and row, and each step of k broadcasts the table entry its nibble picks.
 * The nibbles are extracted in the integer units, which the FMAs leave idle. */

#define LUT_UNITS 8 /* units of 32 whose tables are built ahead of use (256 values of k) */
#define STRIP 24    /* weight rows per task: whole groups of 6, 4 or 3 */

/* Unit j (32 weights) of a 4-bit row: its 16 possible values into tbl, and the nibble of
 * each of its weights (in the order of k) into idx. */
static inline __attribute__((always_inline)) void lut_unit(int64_t QT, const uint8_t *row,
                                                           int64_t j, float *tbl, uint8_t *idx) {
    const __m256 lo = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 hi = _mm256_setr_ps(8, 9, 10, 11, 12, 13, 14, 15);
    const __m128i mask = _mm_set1_epi8(0x0f);
    if (QT == Q4_0 || QT == Q4_1) { /* value i < 16: low nibble of byte i; 16 + i: high */
        const uint8_t *b = row + j * (QT == Q4_0 ? 18 : 20);
        if (QT == Q4_0) {
            const __m256 vd = _mm256_set1_ps(fp16_to_fp32(b)), eight = _mm256_set1_ps(8.0f);
            _mm256_store_ps(tbl, _mm256_mul_ps(_mm256_sub_ps(lo, eight), vd));
            _mm256_store_ps(tbl + 8, _mm256_mul_ps(_mm256_sub_ps(hi, eight), vd));
        } else {
            float d, m;
            fp16x2_to_fp32(b, &d, &m);
            const __m256 vd = _mm256_set1_ps(d), vm = _mm256_set1_ps(m);
            _mm256_store_ps(tbl, _mm256_add_ps(_mm256_mul_ps(lo, vd), vm));
            _mm256_store_ps(tbl + 8, _mm256_add_ps(_mm256_mul_ps(hi, vd), vm));
        }
        const __m128i q = _mm_loadu_si128((const __m128i *)(b + (QT == Q4_0 ? 2 : 4)));
        _mm_store_si128((__m128i *)idx, _mm_and_si128(q, mask));
        _mm_store_si128((__m128i *)(idx + 16), _mm_and_si128(_mm_srli_epi16(q, 4), mask));
    } else { /* Q4_K: value i is a nibble of byte i */
        float scale, min;
        const __m256i q = q4_k_unit(row, j, &scale, &min);
        const __m256 vd = _mm256_set1_ps(scale), vm = _mm256_set1_ps(min);
        _mm256_store_ps(tbl, _mm256_sub_ps(_mm256_mul_ps(vd, lo), vm));
        _mm256_store_ps(tbl + 8, _mm256_sub_ps(_mm256_mul_ps(vd, hi), vm));
        _mm256_store_si256((__m256i *)idx, q);
    }
}

/* part [NW][rp] = the NW 4-bit rows . xt [k, rp] for activation-row vectors v0 .. v0 + RV,
 * over nu units of 32. Each step of k: RV activation loads, then per weight row one byte
 * load (its nibble), one broadcast of the table entry and RV FMAs. */
static inline __attribute__((always_inline)) void lut_tile(int64_t QT, const uint8_t *const *wr,
                                                           int NW, const float *xt, int64_t rp,
                                                           int64_t v0, int RV, int64_t j_begin,
                                                           int64_t j_end, float *part, int first) {
    __m256 a[6][4];
    float tbl[LUT_UNITS][6][16] __attribute__((aligned(64)));
    uint8_t idx[LUT_UNITS][6][32] __attribute__((aligned(64)));
    for (int t = 0; t < NW; t++)
        for (int v = 0; v < RV; v++)
            a[t][v] = first ? _mm256_setzero_ps() : _mm256_load_ps(part + t * rp + 8 * (v0 + v));
    for (int64_t j0 = j_begin; j0 < j_end; j0 += LUT_UNITS) {
        const int units = j_end - j0 < LUT_UNITS ? (int)(j_end - j0) : LUT_UNITS;
        for (int u = 0; u < units; u++)
            for (int t = 0; t < NW; t++) lut_unit(QT, wr[t], j0 + u, tbl[u][t], idx[u][t]);
        for (int u = 0; u < units; u++) {
            const float *xk = xt + (j0 + u) * 32 * rp + 8 * v0;
            const float(*tb)[16] = tbl[u];
            const uint8_t(*id)[32] = idx[u];
            for (int i = 0; i < 32; i++, xk += rp) {
                __m256 x[4];
                for (int v = 0; v < RV; v++) x[v] = _mm256_load_ps(xk + 8 * v);
                for (int t = 0; t < NW; t++) {
                    const __m256 wb = _mm256_broadcast_ss(tb[t] + id[t][i]);
                    for (int v = 0; v < RV; v++) a[t][v] = _mm256_fmadd_ps(wb, x[v], a[t][v]);
                }
            }
        }
    }
    for (int t = 0; t < NW; t++)
        for (int v = 0; v < RV; v++) _mm256_store_ps(part + t * rp + 8 * (v0 + v), a[t][v]);
}

/* NW (at most 6) rows starting at n0 against every activation-row vector. */
static inline __attribute__((always_inline)) void lut_rows(int64_t QT, const uint8_t *w,
                                                           int64_t row_bytes, int64_t n0, int nw,
                                                           const float *xt, int64_t rp,
                                                           int64_t j_begin, int64_t j_end,
                                                           float *part, int first) {
    const uint8_t *wr[6];
    for (int t = 0; t < nw; t++) wr[t] = w + (n0 + t) * row_bytes;
    const int64_t nv = rp / 8;
#define LUT_CASE(NW, RV) \
    case NW * 8 + RV: lut_tile(QT, wr, NW, xt, rp, v, RV, j_begin, j_end, part, first); break;
    for (int64_t v = 0; v < nv;) {
        /* 6 rows x 2 vectors, 4 x 3, 3 x 4; fewer rows at the end of W */
        int rv = nv - v >= 4 && nw <= 3 ? 4 : nv - v >= 3 && nw <= 4 ? 3 : nv - v >= 2 ? 2 : 1;
        switch (nw * 8 + rv) {
        LUT_CASE(6, 2) LUT_CASE(6, 1) LUT_CASE(5, 2) LUT_CASE(5, 1) LUT_CASE(4, 3)
        LUT_CASE(4, 2) LUT_CASE(4, 1) LUT_CASE(3, 4) LUT_CASE(3, 3) LUT_CASE(3, 2)
        LUT_CASE(3, 1) LUT_CASE(2, 4) LUT_CASE(2, 3) LUT_CASE(2, 2) LUT_CASE(2, 1)
        LUT_CASE(1, 4) LUT_CASE(1, 3) LUT_CASE(1, 2) LUT_CASE(1, 1)
        default: break;
        }
        v += rv;
    }
#undef LUT_CASE
}

static void tiled_matmul(float *out, int64_t ldo, const float *x, int64_t ldx, int64_t rows,
                         const uint8_t *w, int64_t qtype, int64_t n, int64_t k,
                         int64_t num_threads) {
    const int64_t row_bytes = gguf_row_bytes(qtype, k), bs = block_size(qtype);
    const int64_t bb = block_bytes(qtype), rp = (rows + 7) / 8 * 8, nv = rp / 8;
    /* weight rows per tile: as many as 12 accumulators allow for the row vectors */
    const int lut = qtype == Q4_0 || qtype == Q4_1 || qtype == Q4_K;
    const int NW = nv <= 2 ? (lut || nv == 2 ? 6 : 12) : nv == 3 ? 4 : 3;
    const int64_t groups = (n + NW - 1) / NW;
    float *xt = aligned_alloc(64, (size_t)(k * rp) * sizeof(float));
#pragma omp parallel num_threads(num_threads) if (n * k * rows >= 131072)
    {
#pragma omp for schedule(static)
        for (int64_t i0 = 0; i0 < k; i0 += 32) transpose_rows(xt, rp, x, ldx, rows, i0, i0 + 32);
        if (lut) {
            /* strips of STRIP weight rows (whole groups of NW): each output row's values of a
             * strip are written together, a cache line rather than NW scattered floats */
            const int64_t strips = (n + STRIP - 1) / STRIP;
#pragma omp for schedule(static)
            for (int64_t sidx = 0; sidx < strips; sidx++) {
                float part[STRIP * 64] __attribute__((aligned(64)));
                const int64_t s0 = sidx * STRIP, sn = n - s0 < STRIP ? n - s0 : STRIP;
                /* the next strip's rows (this thread's next, under a static schedule) are
                 * read from memory while this one computes */
                const int64_t ahead = s0 + STRIP < n ? (n - s0 - STRIP < STRIP ? n - s0 - STRIP : STRIP) : 0;
                const char *next = (const char *)(w + (s0 + STRIP) * row_bytes);
                for (int64_t o = 0; o < ahead * row_bytes; o += 64) _mm_prefetch(next + o, _MM_HINT_T1);
                for (int64_t n0 = s0; n0 < s0 + sn; n0 += NW) {
                    const int nw = s0 + sn - n0 < NW ? (int)(s0 + sn - n0) : NW;
                    float *pg = part + (n0 - s0) * rp;
                    switch (qtype) {
                    case Q4_0: lut_rows(Q4_0, w, row_bytes, n0, nw, xt, rp, 0, k / 32, pg, 1); break;
                    case Q4_1: lut_rows(Q4_1, w, row_bytes, n0, nw, xt, rp, 0, k / 32, pg, 1); break;
                    default: lut_rows(Q4_K, w, row_bytes, n0, nw, xt, rp, 0, k / 32, pg, 1); break;
                    }
                }
                for (int64_t r = 0; r < rows; r++)
                    for (int64_t c = 0; c < sn; c++) out[r * ldo + s0 + c] = part[c * rp + r];
            }
        } else {
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++) {
            float wbuf[12 * KC] __attribute__((aligned(64)));
            float part[12 * 64] __attribute__((aligned(64)));
            const int64_t n0 = g * NW;
            const int nw = n - n0 < NW ? (int)(n - n0) : NW;
            for (int64_t k0 = 0; k0 < k; k0 += KC) {
                const int64_t kl = k - k0 < KC ? k - k0 : KC;
                for (int t = 0; t < nw; t++)
                    dequant_row(qtype, w + (n0 + t) * row_bytes + k0 / bs * bb, wbuf + t * KC, kl);
                const float *xk = xt + k0 * rp;
                if (nw == NW) {
                    tile_rows(wbuf, NW, xk, rp, kl, part, k0 == 0);
                } else {
                    for (int t = 0; t < nw; t++)
                        tile_rows(wbuf + t * KC, 1, xk, rp, kl, part + t * rp, k0 == 0);
                }
            }
            for (int t = 0; t < nw; t++)
                for (int64_t r = 0; r < rows; r++) out[r * ldo + n0 + t] = part[t * rp + r];
        }
        }
    }
    free(xt);
}
#endif

#ifdef QUANT_AVX2
/* ---- the integer path for one to four activation rows (decode), after llama.cpp's
 * method with 16-bit activations: each activation row is quantized in blocks of 32 (dx =
 * max|x| / 32767, qx = round(x / dx), and sx = dx * sum(qx) for the offsets); 32 weights
 * of a row are widened to 16-bit integers once and meet every activation row in integer
 * multiply-adds (madd: pairs of int16 products summed to int32), scaled by d * dx in fp32.
 * A weight row's bytes are read once for all the rows. The result is sum(w * x^) for the
 * quantized x^ (|x^ - x| <= dx / 2, a relative 1.5e-5 of the block's largest value) up to
 * fp32 rounding: close to fp32, where 8-bit activations (llama.cpp's) flip greedy tokens. */

#define INT_MAX_ROWS 8

typedef struct {
    int16_t *q;      /* [k] */
    float *d, *s;    /* [k / 32]: scale, and scale * sum of the block's q */
} QuantRow;

/* One block of 32 floats as integers of at most qmax in magnitude: q = round(x / d) with
 * d = max|x| / qmax (0 for an all-zero block); returns d and the sum of the q in *sum. */
static inline float quantize_block(const float *xb, float qmax, __m256i q[4], int32_t *sum) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v[4], amax = _mm256_setzero_ps();
    for (int t = 0; t < 4; t++) {
        v[t] = _mm256_loadu_ps(xb + 8 * t);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[t]));
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    const float d = _mm_cvtss_f32(m) / qmax, id = d > 0.0f ? 1.0f / d : 0.0f;
    for (int t = 0; t < 4; t++)
        q[t] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[t], _mm256_set1_ps(id)),
                                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    const __m256i sum32 = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]),
                                           _mm256_add_epi32(q[2], q[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum32), _mm256_extracti128_si256(sum32, 1));
    s4 = _mm_hadd_epi32(s4, s4);
    s4 = _mm_hadd_epi32(s4, s4);
    *sum = _mm_cvtsi128_si32(s4);
    return d;
}

static void quantize_row_q16(const float *x, int64_t k, QuantRow r) {
    for (int64_t b = 0; b < k / 32; b++) {
        __m256i q[4];
        int32_t sum;
        const float d = quantize_block(x + 32 * b, 32767.0f, q, &sum);
        /* packs works within 128-bit lanes: restore the order with a 64-bit permute */
        for (int t = 0; t < 2; t++)
            _mm256_storeu_si256((__m256i *)(r.q + 32 * b + 16 * t),
                                _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2 * t], q[2 * t + 1]),
                                                         0xD8));
        r.d[b] = d;
        r.s[b] = d * (float)sum;
    }
}

/* 32 int16 weights (two halves) . 32 int16 activations -> 8 int32 partial sums as fp32 */
static inline __m256 dot_i16(__m256i w0, __m256i w1, const int16_t *xq) {
    const __m256i p = _mm256_add_epi32(
        _mm256_madd_epi16(w0, _mm256_loadu_si256((const __m256i *)xq)),
        _mm256_madd_epi16(w1, _mm256_loadu_si256((const __m256i *)(xq + 16))));
    return _mm256_cvtepi32_ps(p);
}

/* Block j (32 values) of a weight row against NR quantized activation rows, into acc[r]
 * and the offset terms into corr[r]; QT and NR are constants after inlining. */
static inline __attribute__((always_inline)) void int_block(int64_t QT, const uint8_t *row,
                                                            int64_t j, const QuantRow *x,
                                                            int NR, __m256 *acc, float *corr) {
    if (QT == Q8_0) {
        const uint8_t *b = row + j * 34;
        const float d = fp16_to_fp32(b);
        const __m128i lo = _mm_loadu_si128((const __m128i *)(b + 2));
        const __m128i hi = _mm_loadu_si128((const __m128i *)(b + 18));
        const __m256i w0 = _mm256_cvtepi8_epi16(lo), w1 = _mm256_cvtepi8_epi16(hi);
        for (int r = 0; r < NR; r++)
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * x[r].d[j]), dot_i16(w0, w1, x[r].q + 32 * j),
                                     acc[r]);
    } else if (QT == Q4_0 || QT == Q4_1) {
        const uint8_t *b = row + j * (QT == Q4_0 ? 18 : 20);
        float d, off;
        if (QT == Q4_0) {
            d = fp16_to_fp32(b);
            off = -8.0f * d;
        } else {
            fp16x2_to_fp32(b, &d, &off);
        }
        const __m128i bytes = _mm_loadu_si128((const __m128i *)(b + (QT == Q4_0 ? 2 : 4)));
        const __m128i mask = _mm_set1_epi8(0x0f);
        const __m256i w0 = _mm256_cvtepu8_epi16(_mm_and_si128(bytes, mask));
        const __m256i w1 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask));
        for (int r = 0; r < NR; r++) {
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * x[r].d[j]), dot_i16(w0, w1, x[r].q + 32 * j),
                                     acc[r]);
            corr[r] = fmaf(off, x[r].s[j], corr[r]);
        }
    } else if (QT == Q4_K) {
        float d, min;
        const __m256i nib = q4_k_unit(row, j, &d, &min);
        const float off = -min;
        const __m256i w0 = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(nib));
        const __m256i w1 = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(nib, 1));
        for (int r = 0; r < NR; r++) {
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * x[r].d[j]), dot_i16(w0, w1, x[r].q + 32 * j),
                                     acc[r]);
            corr[r] = fmaf(off, x[r].s[j], corr[r]);
        }
    } else { /* Q6_K: 32 values with two scales, one per 16 = one per widened half */
        const uint8_t *b = row + (j >> 3) * 210;
        const int sub = (int)(j & 7), h = sub >> 2, g = sub & 3;
        const float d = fp16_to_fp32(b + 208);
        const int8_t *sc = (const int8_t *)(b + 192) + h * 8 + g * 2;
        const __m256i l = _mm256_and_si256(
            _mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)(b + h * 64 + (g & 1) * 32)),
                              (g >> 1) * 4),
            _mm256_set1_epi8(0x0f));
        const __m256i hi = _mm256_and_si256(
            _mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)(b + 128 + h * 32)), 2 * g),
            _mm256_set1_epi8(0x03));
        const __m256i w = _mm256_sub_epi8(_mm256_or_si256(l, _mm256_slli_epi16(hi, 4)),
                                          _mm256_set1_epi8(32));
        const __m256i w0 = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(w));
        const __m256i w1 = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(w, 1));
        const float d0 = d * (float)sc[0], d1 = d * (float)sc[1];
        for (int r = 0; r < NR; r++) {
            const int16_t *xq = x[r].q + 32 * j;
            const __m256 p0 = _mm256_cvtepi32_ps(
                _mm256_madd_epi16(w0, _mm256_loadu_si256((const __m256i *)xq)));
            const __m256 p1 = _mm256_cvtepi32_ps(
                _mm256_madd_epi16(w1, _mm256_loadu_si256((const __m256i *)(xq + 16))));
            const float dx = x[r].d[j];
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d0 * dx), p0, acc[r]);
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d1 * dx), p1, acc[r]);
        }
    }
}

/* One weight row against NR quantized activation rows: even and odd blocks go to separate
 * accumulators (vector and offset), so that consecutive blocks do not wait for each other. */
static inline __attribute__((always_inline)) void int_rows(int64_t QT, const uint8_t *row,
                                                           const QuantRow *x, int NR, int64_t k,
                                                           float *out, int64_t ldo) {
    __m256 even[INT_MAX_ROWS], odd[INT_MAX_ROWS];
    float corr_even[INT_MAX_ROWS], corr_odd[INT_MAX_ROWS];
    for (int r = 0; r < NR; r++) {
        even[r] = odd[r] = _mm256_setzero_ps();
        corr_even[r] = corr_odd[r] = 0.0f;
    }
    const int64_t nb = k / 32;
    int64_t j = 0;
    for (; j + 2 <= nb; j += 2) {
        int_block(QT, row, j, x, NR, even, corr_even);
        int_block(QT, row, j + 1, x, NR, odd, corr_odd);
    }
    if (j < nb) int_block(QT, row, j, x, NR, even, corr_even);
    for (int r = 0; r < NR; r++)
        out[r * ldo] = hsum256(_mm256_add_ps(even[r], odd[r])) + (corr_even[r] + corr_odd[r]);
}

static void int_matmul(float *out, int64_t ldo, const float *x, int64_t ldx, int64_t rows,
                       const uint8_t *w, int64_t qtype, int64_t n, int64_t k,
                       int64_t num_threads) {
    const int64_t row_bytes = gguf_row_bytes(qtype, k);
    int16_t *qbuf = malloc(sizeof(int16_t) * (size_t)(rows * k) + 64);
    float *fbuf = malloc(sizeof(float) * (size_t)(2 * rows * (k / 32)) + 64);
    QuantRow xq[INT_MAX_ROWS];
    for (int64_t r = 0; r < rows; r++) {
        xq[r] = (QuantRow){qbuf + r * k, fbuf + 2 * r * (k / 32), fbuf + (2 * r + 1) * (k / 32)};
        quantize_row_q16(x + r * ldx, k, xq[r]);
    }
    const int nr = (int)rows;
#define INT_LOOP(QT)                                                                         \
    _Pragma("omp parallel for num_threads(num_threads) schedule(static) if (n * k >= 65536)") \
    for (int64_t j = 0; j < n; j++) {                                                        \
        const uint8_t *row = w + j * row_bytes;                                              \
        switch (nr) {                                                                        \
        case 1: int_rows(QT, row, xq, 1, k, out + j, ldo); break;                            \
        case 2: int_rows(QT, row, xq, 2, k, out + j, ldo); break;                            \
        case 3: int_rows(QT, row, xq, 3, k, out + j, ldo); break;                            \
        case 4: int_rows(QT, row, xq, 4, k, out + j, ldo); break;                            \
        case 5: int_rows(QT, row, xq, 5, k, out + j, ldo); break;                            \
        case 6: int_rows(QT, row, xq, 6, k, out + j, ldo); break;                            \
        case 7: int_rows(QT, row, xq, 7, k, out + j, ldo); break;                            \
        default: int_rows(QT, row, xq, 8, k, out + j, ldo); break;                           \
        }                                                                                    \
    }
    /* one loop per type and row count, so that int_rows's branches are resolved at compile
     * time */
    switch (qtype) {
    case Q8_0: INT_LOOP(Q8_0) break;
    case Q4_0: INT_LOOP(Q4_0) break;
    case Q4_1: INT_LOOP(Q4_1) break;
    case Q4_K: INT_LOOP(Q4_K) break;
    default: INT_LOOP(Q6_K) break;
    }
#undef INT_LOOP
    free(qbuf);
    free(fbuf);
}
#endif

#ifdef QUANT_AVX2
/* ---- 8-bit activations (llama.cpp's method, --cpu-activations int8) for Q4_0, Q4_1 and
 * Q8_0 weights, 1 to 64 rows. Each activation row is quantized per block of 32 as Q8_0:
 * dx = max|x| / 127, qx = round-half-even(x * (1 / dx)) in int8, kept with dx in fp32 and
 * sx = dx * sum(qx) (Q8_1's sum, for Q4_0's -8 and Q4_1's min). A block's 32 products are
 * exact integer sums: Q4 nibbles are already unsigned bytes (maddubs: u8 x s8, pairs to
 * int16, at most 2 * 15 * 127), Q8_0 weights are made unsigned by moving their sign onto
 * the activations (at most 2 * 128 * 127); madd with ones then sums to int32, or one VNNI
 * dpbusd does both where the CPU has it (AVX-VNNI or AVX512-VNNI, which this library is
 * then built with: -march=native on the machine that runs it). Per block, in fp32:
 *   y += (d * dx) * sum(w_q * qx) + off * sx     (off: Q4_0 -8d, Q4_1 m, Q8_0 none)
 * The error against fp32 activations is that of rounding x to qx (at most dx / 2 each). */

#define Q8_MAX_ROWS 64

/* One row's blocks: block b's 32 values at q + b * qstep, its dx and sx at d[b * dstep],
 * s[b * dstep]. */
static void quantize_row_q8(const float *x, int64_t k, int8_t *q, int64_t qstep, float *d,
                            float *s, int64_t dstep) {
    for (int64_t b = 0; b < k / 32; b++) {
        __m256i i[4];
        int32_t sum;
        const float dx = quantize_block(x + 32 * b, 127.0f, i, &sum);
        /* the packs work within 128-bit lanes: a permute of 32-bit groups restores k order */
        const __m256i p16 = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]),
                                               _mm256_packs_epi32(i[2], i[3]));
        _mm256_storeu_si256((__m256i *)(q + b * qstep),
                            _mm256_permutevar8x32_epi32(p16, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
        d[b * dstep] = dx;
        s[b * dstep] = dx * (float)sum;
    }
}

/* out q [rows, k] int8, d and s [rows, k / 32]: the activations as the int8 path sees them
 * (tests compare them with an emulation). */
void gguf_quantize_q8_f32(int8_t *q, float *d, float *s, const float *x, int64_t ldx,
                          int64_t rows, int64_t k) {
    for (int64_t r = 0; r < rows; r++)
        quantize_row_q8(x + r * ldx, k, q + r * k, 32, d + r * (k / 32), s + r * (k / 32), 1);
}

/* 8 int32 partial sums of u[i] * v[i] over 32 unsigned bytes u and signed bytes v */
static inline __m256i dot_u8s8(__m256i u, __m256i v) {
#if defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, v);
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, v);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, v), _mm256_set1_epi16(1));
#endif
}

/* Block j of a weight row: its 32 values as unsigned bytes (Q8_0: |w|, the sign kept in
 * *sign for the activations), its scale and its offset factor. */
static inline __attribute__((always_inline)) __m256i q8_weight_block(
        int64_t QT, const uint8_t *row, int64_t j, __m256i *sign, float *d, float *off) {
    if (QT == Q8_0) {
        const uint8_t *b = row + j * 34;
        *d = fp16_to_fp32(b);
        *off = 0.0f;
        const __m256i w = _mm256_loadu_si256((const __m256i *)(b + 2));
        *sign = w;
        return _mm256_sign_epi8(w, w);
    }
    const uint8_t *b = row + j * (QT == Q4_0 ? 18 : 20);
    if (QT == Q4_0) {
        *d = fp16_to_fp32(b);
        *off = -8.0f * *d;
    } else {
        fp16x2_to_fp32(b, d, off);
    }
    const __m128i bytes = _mm_loadu_si128((const __m128i *)(b + (QT == Q4_0 ? 2 : 4)));
    const __m128i mask = _mm_set1_epi8(0x0f);
    /* values 0-15 are the low nibbles, 16-31 the high ones */
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask),
                            _mm_and_si128(bytes, mask));
}

/* Block j of one weight row against NR quantized activation rows, into acc[r], and the
 * offset terms of 8 rows at once into *corr. The activations are block-major (Q8Rows): the
 * rows' blocks j lie side by side at xq (32 bytes a row), their dx and sx at xd and xs (8
 * floats, rows past NR zero), so every address is a constant offset and the accumulators
 * stay in registers. */
static inline __attribute__((always_inline)) void q8_block(int64_t QT, const uint8_t *row,
                                                           int64_t j, const int8_t *xq,
                                                           const float *xd, const float *xs,
                                                           int NR, __m256 *acc, __m256 *corr) {
    __m256i sign = _mm256_setzero_si256();
    float d, off;
    const __m256i w = q8_weight_block(QT, row, j, &sign, &d, &off);
    float scale[8]; /* d * dx of each row, broadcast from memory below */
    _mm256_storeu_ps(scale, _mm256_mul_ps(_mm256_set1_ps(d), _mm256_loadu_ps(xd)));
    if (QT != Q8_0) *corr = _mm256_fmadd_ps(_mm256_set1_ps(off), _mm256_loadu_ps(xs), *corr);
    for (int r = 0; r < NR; r++) {
        __m256i x = _mm256_loadu_si256((const __m256i *)(xq + 32 * r));
        if (QT == Q8_0) x = _mm256_sign_epi8(x, sign);
        const __m256 p = _mm256_cvtepi32_ps(dot_u8s8(w, x));
        acc[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(scale + r), p, acc[r]);
    }
}

/* The quantized activations, block-major: block j of row r at q + (j * rp + r) * 32, its
 * dx and sx at d[j * rp + r], s[j * rp + r]; rp is rows rounded up to 8 (zero rows). */
typedef struct {
    int8_t *q;
    float *d, *s;
    int64_t rp;
} Q8Rows;

/* One weight row against NR quantized activation rows from row r0 (NR <= 8), into
 * out[r * ldo]. Up to 4 rows, even and odd blocks go to separate accumulators, so that
 * consecutive blocks do not wait on each other's FMA. */
static inline __attribute__((always_inline)) void q8_rows(int64_t QT, const uint8_t *row,
                                                          Q8Rows x, int64_t r0, int64_t k,
                                                          int NR, float *out, int64_t ldo) {
    __m256 acc[8], corr[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    const int pairs = NR <= 4, width = pairs ? 2 * NR : NR;
    for (int r = 0; r < width; r++) acc[r] = _mm256_setzero_ps();
    const int64_t nb = k / 32, rp = x.rp;
    const int8_t *xq = x.q + r0 * 32;
    const float *xd = x.d + r0, *xs = x.s + r0;
    int64_t j = 0;
    if (pairs) {
        for (; j + 2 <= nb; j += 2) {
            q8_block(QT, row, j, xq + j * rp * 32, xd + j * rp, xs + j * rp, NR, acc, corr);
            q8_block(QT, row, j + 1, xq + (j + 1) * rp * 32, xd + (j + 1) * rp,
                     xs + (j + 1) * rp, NR, acc + NR, corr + 1);
        }
    }
    for (; j < nb; j++)
        q8_block(QT, row, j, xq + j * rp * 32, xd + j * rp, xs + j * rp, NR, acc, corr);
    float c[8];
    _mm256_storeu_ps(c, _mm256_add_ps(corr[0], corr[1]));
    for (int r = 0; r < NR; r++) {
        const __m256 a = pairs ? _mm256_add_ps(acc[r], acc[NR + r]) : acc[r];
        out[r * ldo] = hsum256(a) + c[r];
    }
}

#define Q8_ROWS_CASES(QT)                                                                    \
    switch (nr) {                                                                            \
    case 1: q8_rows(QT, row, xr, r0, k, 1, o, ldo); break;                                   \
    case 2: q8_rows(QT, row, xr, r0, k, 2, o, ldo); break;                                   \
    case 3: q8_rows(QT, row, xr, r0, k, 3, o, ldo); break;                                   \
    case 4: q8_rows(QT, row, xr, r0, k, 4, o, ldo); break;                                   \
    case 5: q8_rows(QT, row, xr, r0, k, 5, o, ldo); break;                                   \
    case 6: q8_rows(QT, row, xr, r0, k, 6, o, ldo); break;                                   \
    case 7: q8_rows(QT, row, xr, r0, k, 7, o, ldo); break;                                   \
    default: q8_rows(QT, row, xr, r0, k, 8, o, ldo); break;                                  \
    }

/* ---- one activation row (a single stream's decode): the row's blocks lie contiguously,
 * each block's dx paired with its offset factor (xo: sx, Q4_0 -8 sx, Q8_0 0), so that the
 * weight block's [d, m] (Q4_1; Q4_0 and Q8_0: [d, d]) times one 64-bit load of [dx, xo]
 * gives [d * dx, m * xo] in one multiply: the first scales the integer sum, the second
 * adds to the offset term. Even and odd blocks use separate accumulators. */
typedef struct {
    const int8_t *q;  /* [k] */
    const float *dx;  /* [k / 32][2]: dx, xo */
} Q8Row;

static inline __attribute__((always_inline)) void q8_row_block(int64_t QT, const uint8_t *row,
                                                               int64_t j, Q8Row x, __m256 *acc,
                                                               __m128 *corr) {
    const __m128 xd = _mm_castpd_ps(_mm_load_sd((const double *)(x.dx + 2 * j)));
    const __m256i xq = _mm256_loadu_si256((const __m256i *)(x.q + 32 * j));
    __m128 f;
    __m256i w, xs;
    if (QT == Q8_0) {
        const uint8_t *b = row + j * 34;
        f = _mm_mul_ps(_mm_set1_ps(fp16_to_fp32(b)), xd);
        const __m256i v = _mm256_loadu_si256((const __m256i *)(b + 2));
        w = _mm256_sign_epi8(v, v);
        xs = _mm256_sign_epi8(xq, v);
    } else {
        const uint8_t *b = row + j * (QT == Q4_0 ? 18 : 20);
        int32_t bits;
        memcpy(&bits, b, sizeof bits);
        __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(bits));
        if (QT == Q4_0) dm = _mm_moveldup_ps(dm);
        f = _mm_mul_ps(dm, xd);
        *corr = _mm_add_ps(*corr, f);
        /* the 16 bytes in both lanes; the upper lane shifted to its high nibbles */
        const __m256i bytes = _mm256_broadcastsi128_si256(
            _mm_loadu_si128((const __m128i *)(b + (QT == Q4_0 ? 2 : 4))));
        w = _mm256_and_si256(_mm256_srlv_epi64(bytes, _mm256_setr_epi64x(0, 0, 4, 4)),
                             _mm256_set1_epi8(0x0f));
        xs = xq;
    }
    const __m256 p = _mm256_cvtepi32_ps(dot_u8s8(w, xs));
    *acc = _mm256_fmadd_ps(_mm256_broadcastss_ps(f), p, *acc);
}

static inline __attribute__((always_inline)) float q8_row_dot(int64_t QT, const uint8_t *row,
                                                              Q8Row x, int64_t nb) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    __m128 corr0 = _mm_setzero_ps(), corr1 = _mm_setzero_ps();
    int64_t j = 0;
    for (; j + 2 <= nb; j += 2) {
        q8_row_block(QT, row, j, x, &acc0, &corr0);
        q8_row_block(QT, row, j + 1, x, &acc1, &corr1);
    }
    if (j < nb) q8_row_block(QT, row, j, x, &acc0, &corr0);
    const __m128 corr = _mm_add_ps(corr0, corr1);
    return hsum256(_mm256_add_ps(acc0, acc1)) + _mm_cvtss_f32(_mm_movehdup_ps(corr));
}

/* Rows [j0, j1) of W against one quantized activation row. */
#define PREFETCH_AHEAD 2048

/* Rows [j0, j1) of W, one by one; the bytes PREFETCH_AHEAD past each row are asked for
 * as it starts, so that a small matrix's share streams from memory at full rate from
 * its first rows on (the hardware prefetcher needs a run of misses to start). */
static inline __attribute__((always_inline)) void q8_rows_of(int64_t QT, float *out, Q8Row x,
                                                             const uint8_t *w, int64_t j0,
                                                             int64_t j1, int64_t k) {
    const int64_t row_bytes = gguf_row_bytes(QT, k), nb = k / 32;
    const char *end = (const char *)(w + j1 * row_bytes);
    const char *ahead = (const char *)(w + j0 * row_bytes);
    for (int64_t j = j0; j < j1; j++) {
        const char *stop = (const char *)(w + (j + 1) * row_bytes) + PREFETCH_AHEAD;
        for (stop = stop < end ? stop : end; ahead < stop; ahead += 64)
            _mm_prefetch(ahead, _MM_HINT_T0);
        out[j] = q8_row_dot(QT, w + j * row_bytes, x, nb);
    }
}

static void q8_row_range(float *out, Q8Row x, const uint8_t *w, int64_t qtype, int64_t j0,
                         int64_t j1, int64_t k) {
    switch (qtype) {
    case Q8_0: q8_rows_of(Q8_0, out, x, w, j0, j1, k); break;
    case Q4_0: q8_rows_of(Q4_0, out, x, w, j0, j1, k); break;
    default: q8_rows_of(Q4_1, out, x, w, j0, j1, k); break;
    }
}

/* One activation row x [k] quantized for weights of type qtype: q [k], dx [k / 32][2]. */
static void quantize_q8_row(const float *x, int64_t k, int64_t qtype, int8_t *q, float *dx) {
    quantize_row_q8(x, k, q, 32, dx, dx + 1, 2);
    const float f = qtype == Q4_0 ? -8.0f : qtype == Q8_0 ? 0.0f : 1.0f;
    for (int64_t b = 0; b < k / 32; b++) dx[2 * b + 1] *= f;
}

static void q8_matmul_row(float *out, const float *x, const uint8_t *w, int64_t qtype,
                          int64_t n, int64_t k, int64_t num_threads) {
    int8_t q[k] __attribute__((aligned(32)));
    float dx[k / 16] __attribute__((aligned(32)));
    quantize_q8_row(x, k, qtype, q, dx);
    const Q8Row xr = {q, dx};
#pragma omp parallel num_threads(num_threads) if (n * k >= 65536)
    {
        int64_t t, nt;
        thread_team(&t, &nt);
        /* contiguous shares of whole 16-row groups (a cache line of output each) */
        const int64_t share = ((n + nt - 1) / nt + 15) & ~(int64_t)15;
        const int64_t j0 = t * share < n ? t * share : n, j1 = j0 + share < n ? j0 + share : n;
        q8_row_range(out, xr, w, qtype, j0, j1, k);
    }
}

/* The one-row int8 path in pieces, for a caller that shares the rows among its threads
 * itself (fused_decode.c): the activation row quantized once, then any range of W. */
void gguf_q8_quantize_row(int8_t *q, float *dx, const float *x, int64_t k, int64_t qtype) {
    quantize_q8_row(x, k, qtype, q, dx);
}

void gguf_q8_row_matmul(float *out, const int8_t *q, const float *dx, const uint8_t *w,
                        int64_t qtype, int64_t j0, int64_t j1, int64_t k) {
    q8_row_range(out, (Q8Row){q, dx}, w, qtype, j0, j1, k);
}

static void q8_matmul(float *out, int64_t ldo, const float *x, int64_t ldx, int64_t rows,
                      const uint8_t *w, int64_t qtype, int64_t n, int64_t k,
                      int64_t num_threads) {
    const int64_t row_bytes = gguf_row_bytes(qtype, k), nb = k / 32, rp = (rows + 7) & ~7;
    int8_t *qbuf = malloc((size_t)(rp * k) + 64);
    float *dbuf = calloc((size_t)(2 * rp * nb) + 16, sizeof(float)); /* padding rows: 0 */
    if (qbuf == NULL || dbuf == NULL) {
        free(qbuf);
        free(dbuf);
        for (int64_t r = 0; r < rows; r++)
            for (int64_t j = 0; j < n; j++) out[r * ldo + j] = NAN; /* never silently wrong */
        return;
    }
    const Q8Rows xr = {qbuf, dbuf, dbuf + rp * nb, rp};
    for (int64_t r = 0; r < rows; r++)
        quantize_row_q8(x + r * ldx, k, xr.q + r * 32, rp * 32, xr.d + r, xr.s + r, rp);
    /* each weight row meets the activation rows 8 at a time; its bytes stay in L1 */
#pragma omp parallel for num_threads(num_threads) schedule(static) if (n * k >= 65536)
    for (int64_t j = 0; j < n; j++) {
        const uint8_t *row = w + j * row_bytes;
        for (int64_t r0 = 0; r0 < rows; r0 += 8) {
            const int nr = rows - r0 < 8 ? (int)(rows - r0) : 8;
            float *o = out + r0 * ldo + j;
            switch (qtype) {
            case Q8_0: Q8_ROWS_CASES(Q8_0) break;
            case Q4_0: Q8_ROWS_CASES(Q4_0) break;
            default: Q8_ROWS_CASES(Q4_1) break;
            }
        }
    }
#undef Q8_ROWS_CASES
    free(qbuf);
    free(dbuf);
}
#endif

/* Whether qtype (its GGUF_INT8_ACTIVATIONS flag included) runs gguf_q8_row_matmul in
 * this build. */
int64_t gguf_q8_row_supported(int64_t qtype) {
#ifdef QUANT_AVX2
    const int64_t t = qtype & ~(int64_t)GGUF_INT8_ACTIVATIONS;
    return (qtype & GGUF_INT8_ACTIVATIONS) && (t == Q4_0 || t == Q4_1 || t == Q8_0);
#else
    (void)qtype;
    return 0;
#endif
}

/* out[r * ldo + j] = x[r] . W[j] for the activation rows x [rows, ldx] (k
 * used) and the n packed rows of W; out may be a column slice of a wider output. qtype
 * with GGUF_INT8_ACTIVATIONS set takes the 8-bit activation path where it applies (AVX2,
 * Q4_0 / Q4_1 / Q8_0, at most 64 rows), else the fp32-activation one. */
void gguf_matmul_f32(float *out, int64_t ldo, const float *x, int64_t ldx, int64_t rows,
                     const uint8_t *w, int64_t qtype, int64_t n, int64_t k,
                     int64_t num_threads) {
    const int int8_activations = (qtype & GGUF_INT8_ACTIVATIONS) != 0;
    qtype &= ~(int64_t)GGUF_INT8_ACTIVATIONS;
#ifdef QUANT_AVX2
    if (int8_activations && rows == 1 && (qtype == Q4_0 || qtype == Q4_1 || qtype == Q8_0)) {
        q8_matmul_row(out, x, w, qtype, n, k, num_threads);
        return;
    }
    if (int8_activations && rows <= Q8_MAX_ROWS &&
        (qtype == Q4_0 || qtype == Q4_1 || qtype == Q8_0)) {
        q8_matmul(out, ldo, x, ldx, rows, w, qtype, n, k, num_threads);
        return;
    }
    if (rows <= INT_MAX_ROWS) {
        int_matmul(out, ldo, x, ldx, rows, w, qtype, n, k, num_threads);
        return;
    }
    /* up to 64 rows at a time: their transposed activations stay in L2 */
    for (int64_t r0 = 0; r0 < rows; r0 += 64)
        tiled_matmul(out + r0 * ldo, ldo, x + r0 * ldx, ldx, rows - r0 < 64 ? rows - r0 : 64, w,
                     qtype, n, k, num_threads);
#else
    /* scalar: dequantize a chunk of each weight row, dot it with every activation row */
    const int64_t row_bytes = gguf_row_bytes(qtype, k), bs = block_size(qtype);
    const int64_t bb = block_bytes(qtype);
#pragma omp parallel for num_threads(num_threads) schedule(static) if (n * k * rows >= 131072)
    for (int64_t j = 0; j < n; j++) {
        float wbuf[KC];
        for (int64_t r = 0; r < rows; r++) out[r * ldo + j] = 0.0f;
        for (int64_t k0 = 0; k0 < k; k0 += KC) {
            const int64_t kl = k - k0 < KC ? k - k0 : KC;
            dequant_row(qtype, w + j * row_bytes + k0 / bs * bb, wbuf, kl);
            for (int64_t r = 0; r < rows; r++) {
                const float *xr = x + r * ldx + k0;
                float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
                for (int64_t i = 0; i < kl; i++) acc += wbuf[i] * xr[i];
                out[r * ldo + j] += acc;
            }
        }
    }
#endif
}
