/* Q4_0 / Q4_1 weights repacked 8 rows at a time, for the int8 GEMVs of the fused decode
 * (fused_decode.c: a single stream's step, and steps of up to 64 rows). A copy made once,
 * beside the GGUF layout, which every other path keeps reading.
 *
 * Why: in GGUF's layout (quant.c's q8_row_block) each 32-weight block of one row is a dot
 * of 8 int32 lanes that must be converted, scaled by the block's own d and summed into
 * that row: ~11 vector instructions per block, which makes that kernel compute-bound below
 * what two cores read from memory (docs/benchmarks.md). Here 8 rows' block j lie together, laid
 * out so that 32-bit lane r of every vector is row r: the dot products need no horizontal
 * sum, and the conversion, the scale (8 rows' d in one fp16 load) and the offset are one
 * instruction each for 8 rows: ~6 instructions per row's block.
 *
 * Layout of group g (rows 8g .. 8g + 7), block j, at w + (g * nb + j) * group_bytes:
 *   fp16 d[8]                    row r's scale
 *   fp16 m[8]     (Q4_1 only)    row r's min
 *   q[4][32]      q[s][4r + i] = byte 4s + i of row r's 16 nibble bytes (i < 4)
 * so the low nibbles of q[s] hold weights 4s .. 4s + 3 of each row and the high nibbles
 * weights 16 + 4s .. 16 + 4s + 3 (GGUF's order: byte i holds weights i and i + 16).
 *
 * Arithmetic, per block: the 32 products of the unsigned nibbles with the int8
 * activations summed exactly in int16 (8 maddubs results of at most 2 * 15 * 127 each,
 * 30480 < 2^15) then to int32 by one madd; y += (d * dx) * sum + off * xo, the
 * activation row quantized as for quant.c's one-row path (xo: sx for Q4_1, -8 sx for
 * Q4_0, whose off is d). The sums equal quant.c's; only the fp32 order of the blocks'
 * accumulation differs.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define X8_AVX2 1
#endif

enum { Q4_0 = 2, Q4_1 = 3 }; /* GGMLQuantizationType */

static int64_t x8_block_bytes(int64_t qtype) { return qtype == Q4_1 ? 160 : 144; }

/* Whether qtype (its GGUF_INT8_ACTIVATIONS flag ignored) has the repacked layout here. */
int64_t gguf_x8_supported(int64_t qtype) {
#ifdef X8_AVX2
    const int64_t t = qtype & ~(int64_t)GGUF_INT8_ACTIVATIONS;
    return t == Q4_0 || t == Q4_1;
#else
    (void)qtype;
    return 0;
#endif
}

/* dst (as many bytes as src) = the rows [rows, k] of src (GGUF blocks) repacked; rows is
 * a multiple of 8 and k of 32. */
void gguf_x8_repack(uint8_t *dst, const uint8_t *src, int64_t qtype, int64_t rows,
                    int64_t k) {
    qtype &= ~(int64_t)GGUF_INT8_ACTIVATIONS;
    const int64_t nb = k / 32, q4_1 = qtype == Q4_1, sb = q4_1 ? 20 : 18;
    const int64_t gb = x8_block_bytes(qtype), scales = q4_1 ? 32 : 16, nibbles = q4_1 ? 4 : 2;
    for (int64_t g = 0; g < rows / 8; g++) {
        for (int64_t j = 0; j < nb; j++) {
            uint8_t *o = dst + (g * nb + j) * gb;
            for (int64_t r = 0; r < 8; r++) {
                const uint8_t *b = src + ((8 * g + r) * nb + j) * sb;
                memcpy(o + 2 * r, b, 2);
                if (q4_1) memcpy(o + 16 + 2 * r, b + 2, 2);
                for (int64_t s = 0; s < 4; s++)
                    memcpy(o + scales + 32 * s + 4 * r, b + nibbles + 4 * s, 4);
            }
        }
    }
}

#define X8_MAX_ROWS 64 /* activation rows of gguf_x8_matmul, as quant.c's int8 path */

#ifdef X8_AVX2
#define X8_PREFETCH 2048 /* bytes ahead of the block being read */

static inline __attribute__((always_inline)) void x8_groups(int64_t QT, float *out,
                                                            const int8_t *xq, const float *dx,
                                                            const uint8_t *w, int64_t g0,
                                                            int64_t g1, int64_t k) {
    const int64_t nb = k / 32, gb = x8_block_bytes(QT), scales = QT == Q4_1 ? 32 : 16;
    const __m256i mask = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    for (int64_t g = g0; g < g1; g++) {
        const uint8_t *b = w + g * nb * gb;
        __m256 acc = _mm256_setzero_ps(), corr = _mm256_setzero_ps();
        for (int64_t j = 0; j < nb; j++, b += gb) {
            _mm_prefetch((const char *)b + X8_PREFETCH, _MM_HINT_T0);
            _mm_prefetch((const char *)b + X8_PREFETCH + 64, _MM_HINT_T0);
            _mm_prefetch((const char *)b + X8_PREFETCH + 128, _MM_HINT_T0);
            const int8_t *x = xq + 32 * j;
            __m256i sum = _mm256_setzero_si256();
            for (int s = 0; s < 4; s++) {
                int32_t lo4, hi4;
                memcpy(&lo4, x + 4 * s, 4);
                memcpy(&hi4, x + 16 + 4 * s, 4);
                const __m256i v = _mm256_loadu_si256((const __m256i *)(b + scales + 32 * s));
                sum = _mm256_add_epi16(sum, _mm256_maddubs_epi16(_mm256_and_si256(v, mask),
                                                                 _mm256_set1_epi32(lo4)));
                sum = _mm256_add_epi16(
                    sum, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 4), mask),
                                              _mm256_set1_epi32(hi4)));
            }
            const __m256 p = _mm256_cvtepi32_ps(_mm256_madd_epi16(sum, ones));
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)b));
            acc = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(dx[2 * j])), p, acc);
            const __m256 off = QT == Q4_1
                                   ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b + 16)))
                                   : d;
            corr = _mm256_fmadd_ps(off, _mm256_set1_ps(dx[2 * j + 1]), corr);
        }
        _mm256_storeu_ps(out + 8 * g, _mm256_add_ps(acc, corr));
    }
}

/* Group g of the repacked w against `rows` quantized activation rows (q [rows][k], dx
 * [rows][k / 16]): out[r * ldo + 8g + i]. Each block's nibbles are unpacked once, into
 * registers, for all the rows; the rows' accumulators live in L1. */
static inline __attribute__((always_inline)) void x8_group_rows(int64_t QT, float *out,
                                                                int64_t ldo, const int8_t *q,
                                                                const float *dx, int64_t rows,
                                                                const uint8_t *w, int64_t g,
                                                                int64_t k) {
    const int64_t nb = k / 32, gb = x8_block_bytes(QT), scales = QT == Q4_1 ? 32 : 16;
    const __m256i mask = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    __m256 acc[X8_MAX_ROWS];
    for (int64_t r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
    const uint8_t *b = w + g * nb * gb;
    for (int64_t j = 0; j < nb; j++, b += gb) {
        __m256i lo[4], hi[4];
        for (int s = 0; s < 4; s++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(b + scales + 32 * s));
            lo[s] = _mm256_and_si256(v, mask);
            hi[s] = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)b));
        const __m256 off = QT == Q4_1
                               ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b + 16)))
                               : d;
        for (int64_t r = 0; r < rows; r++) {
            const int8_t *x = q + r * k + 32 * j;
            __m256i sum = _mm256_setzero_si256();
            for (int s = 0; s < 4; s++) {
                int32_t lo4, hi4;
                memcpy(&lo4, x + 4 * s, 4);
                memcpy(&hi4, x + 16 + 4 * s, 4);
                sum = _mm256_add_epi16(sum, _mm256_maddubs_epi16(lo[s], _mm256_set1_epi32(lo4)));
                sum = _mm256_add_epi16(sum, _mm256_maddubs_epi16(hi[s], _mm256_set1_epi32(hi4)));
            }
            const float *xd = dx + r * (k / 16) + 2 * j;
            const __m256 p = _mm256_cvtepi32_ps(_mm256_madd_epi16(sum, ones));
            acc[r] = _mm256_fmadd_ps(off, _mm256_set1_ps(xd[1]), acc[r]);
            acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(xd[0])), p, acc[r]);
        }
    }
    for (int64_t r = 0; r < rows; r++) _mm256_storeu_ps(out + r * ldo + 8 * g, acc[r]);
}
#endif

/* out[r * ldo + j] = x[r] . W[j] for the activation rows x [rows, ldx] (k used, rows at
 * most X8_MAX_ROWS, as quant.c's int8 path) and the n rows of the repacked w: a few
 * streams' decode step (fused_decode.c), the activations quantized as quant.c's are. */
void gguf_x8_matmul(float *out, int64_t ldo, const float *x, int64_t ldx, int64_t rows,
                    const uint8_t *w, int64_t qtype, int64_t n, int64_t k,
                    int64_t num_threads) {
    qtype &= ~(int64_t)GGUF_INT8_ACTIVATIONS;
    int8_t *q = malloc((size_t)(rows * k) + 64);
    float *dx = malloc(sizeof(float) * (size_t)(rows * (k / 16)) + 64);
    if (q == NULL || dx == NULL || rows > X8_MAX_ROWS) {
        for (int64_t r = 0; r < rows; r++)
            for (int64_t j = 0; j < n; j++) out[r * ldo + j] = NAN; /* never silently wrong */
        free(q), free(dx);
        return;
    }
    for (int64_t r = 0; r < rows; r++)
        gguf_q8_quantize_row(q + r * k, dx + r * (k / 16), x + r * ldx, k, qtype);
#ifdef X8_AVX2
#pragma omp parallel for num_threads(num_threads) schedule(static) if (n * k * rows >= 65536)
    for (int64_t g = 0; g < n / 8; g++) {
        if (qtype == Q4_1)
            x8_group_rows(Q4_1, out, ldo, q, dx, rows, w, g, k);
        else
            x8_group_rows(Q4_0, out, ldo, q, dx, rows, w, g, k);
    }
#else
    (void)w, (void)num_threads;
#endif
    free(q), free(dx);
}

/* out[j] = x . W[j] for the rows j in [8 * g0, 8 * g1) of the repacked w, against one
 * activation row quantized by gguf_q8_quantize_row for this qtype (q [k], dx [k / 16]). */
void gguf_x8_row_matmul(float *out, const int8_t *q, const float *dx, const uint8_t *w,
                        int64_t qtype, int64_t g0, int64_t g1, int64_t k) {
#ifdef X8_AVX2
    if ((qtype & ~(int64_t)GGUF_INT8_ACTIVATIONS) == Q4_1)
        x8_groups(Q4_1, out, q, dx, w, g0, g1, k);
    else
        x8_groups(Q4_0, out, q, dx, w, g0, g1, k);
#else
    (void)out, (void)q, (void)dx, (void)w, (void)qtype, (void)g0, (void)g1, (void)k;
#endif
}
