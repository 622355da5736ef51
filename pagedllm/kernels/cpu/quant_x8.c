/* Q4_0 / Q4_1 / Q8_0 weights repacked 8 rows at a time, for the int8 GEMVs of the fused
 * decode (fused_decode.c: a single stream's step, and steps of up to 64 rows) and of the
 * LM head. A copy made once, beside the GGUF layout, which every other path keeps reading.
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
 * Q8_0: fp16 d[8], then q[8][32] with q[s][4r + i] = row r's int8 weight 4s + i.
 *
 * Arithmetic, per block: the 32 products of the unsigned nibbles with the int8
 * activations summed exactly in int16 (8 maddubs results of at most 2 * 15 * 127 each,
 * 30480 < 2^15) then to int32 by one madd; y += (d * dx) * sum + off * xo, the
 * activation row quantized as for quant.c's one-row path (xo: sx for Q4_1, -8 sx for
 * Q4_0, whose off is d). Q8_0's signed weights are made unsigned by moving their sign
 * onto the activations (|w| . sign(x, w), as quant.c), each maddubs pair (at most
 * 2 * 127 * 127) widened to int32 at once; it has no offset term. The sums equal
 * quant.c's; only the fp32 order of the blocks' accumulation differs.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define X8_AVX2 1
#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
#define X8_VNNI 1
#endif
#endif

#ifdef X8_VNNI
/* acc + lane i's 4 products of unsigned bytes u with signed bytes v (bytes 4i .. 4i + 3):
 * VNNI's dpbusd, one instruction for maddubs + madd, and no int16 sums to bound. */
static inline __m256i dpbusd(__m256i acc, __m256i u, __m256i v) {
#if defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, u, v);
#else
    return _mm256_dpbusd_epi32(acc, u, v);
#endif
}
#endif

enum { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8 }; /* GGMLQuantizationType */

static int64_t x8_block_bytes(int64_t qtype) {
    return qtype == Q4_1 ? 160 : qtype == Q8_0 ? 272 : 144;
}

/* Whether qtype (its GGUF_INT8_ACTIVATIONS flag ignored) has the repacked layout here. */
int64_t gguf_x8_supported(int64_t qtype) {
#ifdef X8_AVX2
    const int64_t t = qtype & ~(int64_t)GGUF_INT8_ACTIVATIONS;
    return t == Q4_0 || t == Q4_1 || t == Q8_0;
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
    const int64_t nb = k / 32;
    if (qtype == Q8_0) {
        for (int64_t g = 0; g < rows / 8; g++)
            for (int64_t j = 0; j < nb; j++) {
                uint8_t *o = dst + (g * nb + j) * 272;
                for (int64_t r = 0; r < 8; r++) {
                    const uint8_t *b = src + ((8 * g + r) * nb + j) * 34;
                    memcpy(o + 2 * r, b, 2);
                    for (int64_t s = 0; s < 8; s++)
                        memcpy(o + 16 + 32 * s + 4 * r, b + 2 + 4 * s, 4);
                }
            }
        return;
    }
    const int64_t q4_1 = qtype == Q4_1, sb = q4_1 ? 20 : 18;
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
    const __m256i mask = _mm256_set1_epi8(0x0f);
#ifndef X8_VNNI
    const __m256i ones = _mm256_set1_epi16(1); /* the int16 sums' widening */
#endif
    for (int64_t g = g0; g < g1; g++) {
        const uint8_t *b = w + g * nb * gb;
        __m256 acc = _mm256_setzero_ps(), corr = _mm256_setzero_ps();
        for (int64_t j = 0; j < nb; j++, b += gb) {
            _mm_prefetch((const char *)b + X8_PREFETCH, _MM_HINT_T0);
            _mm_prefetch((const char *)b + X8_PREFETCH + 64, _MM_HINT_T0);
            _mm_prefetch((const char *)b + X8_PREFETCH + 128, _MM_HINT_T0);
            const int8_t *x = xq + 32 * j;
#ifdef X8_VNNI
            __m256i sum_lo = _mm256_setzero_si256(), sum_hi = _mm256_setzero_si256();
#else
            __m256i sum = _mm256_setzero_si256();
#endif
            for (int s = 0; s < 4; s++) {
                int32_t lo4, hi4;
                memcpy(&lo4, x + 4 * s, 4);
                memcpy(&hi4, x + 16 + 4 * s, 4);
                const __m256i v = _mm256_loadu_si256((const __m256i *)(b + scales + 32 * s));
                const __m256i lo = _mm256_and_si256(v, mask);
                const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
#ifdef X8_VNNI
                sum_lo = dpbusd(sum_lo, lo, _mm256_set1_epi32(lo4));
                sum_hi = dpbusd(sum_hi, hi, _mm256_set1_epi32(hi4));
#else
                sum = _mm256_add_epi16(sum, _mm256_maddubs_epi16(lo, _mm256_set1_epi32(lo4)));
                sum = _mm256_add_epi16(sum, _mm256_maddubs_epi16(hi, _mm256_set1_epi32(hi4)));
#endif
            }
#ifdef X8_VNNI
            const __m256 p = _mm256_cvtepi32_ps(_mm256_add_epi32(sum_lo, sum_hi));
#else
            const __m256 p = _mm256_cvtepi32_ps(_mm256_madd_epi16(sum, ones));
#endif
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

/* The integer sums of one Q8_0 group block (8 rows' 32 weights at b) against 32 int8
 * activations x: lane r is row r's exact sum. */
static inline __attribute__((always_inline)) __m256i x8_q8_0_sum(const uint8_t *b,
                                                                 const int8_t *x) {
#ifdef X8_VNNI
    __m256i sums[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
    for (int s = 0; s < 8; s++) {
        int32_t x4;
        memcpy(&x4, x + 4 * s, 4);
        const __m256i v = _mm256_loadu_si256((const __m256i *)(b + 16 + 32 * s));
        sums[s & 1] = dpbusd(sums[s & 1], _mm256_sign_epi8(v, v),
                             _mm256_sign_epi8(_mm256_set1_epi32(x4), v));
    }
    return _mm256_add_epi32(sums[0], sums[1]);
#else
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i sum = _mm256_setzero_si256();
    for (int s = 0; s < 8; s++) {
        int32_t x4;
        memcpy(&x4, x + 4 * s, 4);
        const __m256i v = _mm256_loadu_si256((const __m256i *)(b + 16 + 32 * s));
        const __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(v, v),
                                               _mm256_sign_epi8(_mm256_set1_epi32(x4), v));
        sum = _mm256_add_epi32(sum, _mm256_madd_epi16(p, ones));
    }
    return sum;
#endif
}

/* Groups [g0, g1) of a repacked Q8_0 w against one activation row: out[8g + r]. */
static void x8_groups_q8_0(float *out, const int8_t *xq, const float *dx, const uint8_t *w,
                           int64_t g0, int64_t g1, int64_t k) {
    const int64_t nb = k / 32;
    for (int64_t g = g0; g < g1; g++) {
        const uint8_t *b = w + g * nb * 272;
        __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
        int64_t j = 0;
        for (; j < nb; j++, b += 272) {
            for (int l = 0; l < 5; l++)
                _mm_prefetch((const char *)b + X8_PREFETCH + 64 * l, _MM_HINT_T0);
            const __m256 p = _mm256_cvtepi32_ps(x8_q8_0_sum(b, xq + 32 * j));
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)b));
            const __m256 f = _mm256_mul_ps(d, _mm256_set1_ps(dx[2 * j]));
            if (j & 1)
                acc1 = _mm256_fmadd_ps(f, p, acc1);
            else
                acc0 = _mm256_fmadd_ps(f, p, acc0);
        }
        _mm256_storeu_ps(out + 8 * g, _mm256_add_ps(acc0, acc1));
    }
}

/* Group g of a repacked Q8_0 w against `rows` activation rows, as x8_group_rows. */
static void x8_group_rows_q8_0(float *out, int64_t ldo, const int8_t *q, const float *dx,
                               int64_t rows, const uint8_t *w, int64_t g, int64_t k) {
    const int64_t nb = k / 32;
    __m256 acc[X8_MAX_ROWS];
    for (int64_t r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
    const uint8_t *b = w + g * nb * 272;
    for (int64_t j = 0; j < nb; j++, b += 272) {
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)b));
        for (int64_t r = 0; r < rows; r++) {
            const __m256 p = _mm256_cvtepi32_ps(x8_q8_0_sum(b, q + r * k + 32 * j));
            const float xd = dx[r * (k / 16) + 2 * j];
            acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(xd)), p, acc[r]);
        }
    }
    for (int64_t r = 0; r < rows; r++) _mm256_storeu_ps(out + r * ldo + 8 * g, acc[r]);
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
    const __m256i mask = _mm256_set1_epi8(0x0f);
#ifndef X8_VNNI
    const __m256i ones = _mm256_set1_epi16(1); /* the int16 sums' widening */
#endif
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
#ifdef X8_VNNI
            __m256i sum_lo = _mm256_setzero_si256(), sum_hi = _mm256_setzero_si256();
            for (int s = 0; s < 4; s++) {
                int32_t lo4, hi4;
                memcpy(&lo4, x + 4 * s, 4);
                memcpy(&hi4, x + 16 + 4 * s, 4);
                sum_lo = dpbusd(sum_lo, lo[s], _mm256_set1_epi32(lo4));
                sum_hi = dpbusd(sum_hi, hi[s], _mm256_set1_epi32(hi4));
            }
            const __m256 p = _mm256_cvtepi32_ps(_mm256_add_epi32(sum_lo, sum_hi));
#else
            __m256i sum = _mm256_setzero_si256();
            for (int s = 0; s < 4; s++) {
                int32_t lo4, hi4;
                memcpy(&lo4, x + 4 * s, 4);
                memcpy(&hi4, x + 16 + 4 * s, 4);
                sum = _mm256_add_epi16(sum, _mm256_maddubs_epi16(lo[s], _mm256_set1_epi32(lo4)));
                sum = _mm256_add_epi16(sum, _mm256_maddubs_epi16(hi[s], _mm256_set1_epi32(hi4)));
            }
            const __m256 p = _mm256_cvtepi32_ps(_mm256_madd_epi16(sum, ones));
#endif
            const float *xd = dx + r * (k / 16) + 2 * j;
            acc[r] = _mm256_fmadd_ps(off, _mm256_set1_ps(xd[1]), acc[r]);
            acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(xd[0])), p, acc[r]);
        }
    }
    for (int64_t r = 0; r < rows; r++) _mm256_storeu_ps(out + r * ldo + 8 * g, acc[r]);
}
#endif

#if defined(X8_VNNI) && defined(__AVX512VL__)
#define X8_PAIRS 1
/* Two groups' accumulators into out: rows x 16 columns from column 8g. */
static inline void store_pair(float *out, int64_t ldo, __m256 acc[2][X8_MAX_ROWS],
                              int64_t rows, int64_t g) {
    for (int64_t r = 0; r < rows; r++) {
        _mm256_storeu_ps(out + r * ldo + 8 * g, acc[0][r]);
        _mm256_storeu_ps(out + r * ldo + 8 * g + 8, acc[1][r]);
    }
}

/* Groups g and g + 1 against `rows` activation rows, as x8_group_rows twice, but each
 * broadcast of 4 activations feeds both groups' dpbusd: half the activation reads per
 * product (AVX-512VL's 32 vector registers hold both groups' unpacked nibbles). */
static inline __attribute__((always_inline)) void x8_group_pair_rows(
        int64_t QT, float *out, int64_t ldo, const int8_t *q, const float *dx, int64_t rows,
        const uint8_t *w, int64_t g, int64_t k) {
    const int64_t nb = k / 32, gb = x8_block_bytes(QT), scales = QT == Q4_1 ? 32 : 16;
    const __m256i mask = _mm256_set1_epi8(0x0f);
    __m256 acc[2][X8_MAX_ROWS];
    for (int64_t r = 0; r < rows; r++) acc[0][r] = acc[1][r] = _mm256_setzero_ps();
    const uint8_t *b0 = w + g * nb * gb, *b1 = b0 + nb * gb;
    for (int64_t j = 0; j < nb; j++, b0 += gb, b1 += gb) {
        __m256i lo[2][4], hi[2][4];
        __m256 d[2], off[2];
        for (int h = 0; h < 2; h++) {
            const uint8_t *b = h ? b1 : b0;
            for (int s = 0; s < 4; s++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(b + scales + 32 * s));
                lo[h][s] = _mm256_and_si256(v, mask);
                hi[h][s] = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
            }
            d[h] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)b));
            off[h] = QT == Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b + 16)))
                                : d[h];
        }
        for (int64_t r = 0; r < rows; r++) {
            const int8_t *x = q + r * k + 32 * j;
            __m256i sum0 = _mm256_setzero_si256(), sum1 = _mm256_setzero_si256();
            for (int s = 0; s < 4; s++) {
                int32_t lo4, hi4;
                memcpy(&lo4, x + 4 * s, 4);
                memcpy(&hi4, x + 16 + 4 * s, 4);
                const __m256i xl = _mm256_set1_epi32(lo4), xh = _mm256_set1_epi32(hi4);
                sum0 = dpbusd(dpbusd(sum0, lo[0][s], xl), hi[0][s], xh);
                sum1 = dpbusd(dpbusd(sum1, lo[1][s], xl), hi[1][s], xh);
            }
            const float *xd = dx + r * (k / 16) + 2 * j;
            const __m256 xs = _mm256_set1_ps(xd[0]), xo = _mm256_set1_ps(xd[1]);
            acc[0][r] = _mm256_fmadd_ps(off[0], xo, acc[0][r]);
            acc[0][r] = _mm256_fmadd_ps(_mm256_mul_ps(d[0], xs), _mm256_cvtepi32_ps(sum0),
                                        acc[0][r]);
            acc[1][r] = _mm256_fmadd_ps(off[1], xo, acc[1][r]);
            acc[1][r] = _mm256_fmadd_ps(_mm256_mul_ps(d[1], xs), _mm256_cvtepi32_ps(sum1),
                                        acc[1][r]);
        }
    }
    store_pair(out, ldo, acc, rows, g);
}
#endif

#ifdef X8_PAIRS
/* Q8_0's groups g and g + 1 against `rows` activation rows, as x8_group_rows_q8_0 twice.
 * dpbusd wants one unsigned operand: the activations are, as x + 128 (x ^ 0x80, weight-
 * independent, so one broadcast feeds both groups), and 128 * sum(w) of each row's block,
 * computed once for all the rows, is taken off the exact int32 sum. */
static void x8_group_pair_rows_q8_0(float *out, int64_t ldo, const int8_t *q, const float *dx,
                                    int64_t rows, const uint8_t *w, int64_t g, int64_t k) {
    const int64_t nb = k / 32;
    const __m256i bias = _mm256_set1_epi8((char)0x80);
    __m256 acc[2][X8_MAX_ROWS];
    for (int64_t r = 0; r < rows; r++) acc[0][r] = acc[1][r] = _mm256_setzero_ps();
    const uint8_t *b0 = w + g * nb * 272, *b1 = b0 + nb * 272;
    for (int64_t j = 0; j < nb; j++, b0 += 272, b1 += 272) {
        __m256i v[2][8], corr[2];
        __m256 d[2];
        for (int h = 0; h < 2; h++) {
            const uint8_t *b = h ? b1 : b0;
            corr[h] = _mm256_setzero_si256();
            for (int s = 0; s < 8; s++) {
                v[h][s] = _mm256_loadu_si256((const __m256i *)(b + 16 + 32 * s));
                corr[h] = dpbusd(corr[h], bias, v[h][s]);
            }
            d[h] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)b));
        }
        for (int64_t r = 0; r < rows; r++) {
            const int8_t *x = q + r * k + 32 * j;
            __m256i sum0 = _mm256_sub_epi32(_mm256_setzero_si256(), corr[0]);
            __m256i sum1 = _mm256_sub_epi32(_mm256_setzero_si256(), corr[1]);
            for (int s = 0; s < 8; s++) {
                uint32_t x4;
                memcpy(&x4, x + 4 * s, 4);
                const __m256i xb = _mm256_set1_epi32((int32_t)(x4 ^ 0x80808080u));
                sum0 = dpbusd(sum0, xb, v[0][s]);
                sum1 = dpbusd(sum1, xb, v[1][s]);
            }
            const __m256 xs = _mm256_set1_ps(dx[r * (k / 16) + 2 * j]);
            acc[0][r] = _mm256_fmadd_ps(_mm256_mul_ps(d[0], xs), _mm256_cvtepi32_ps(sum0),
                                        acc[0][r]);
            acc[1][r] = _mm256_fmadd_ps(_mm256_mul_ps(d[1], xs), _mm256_cvtepi32_ps(sum1),
                                        acc[1][r]);
        }
    }
    store_pair(out, ldo, acc, rows, g);
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
    if (rows == 1) { /* a GEMV: each thread one contiguous run of groups, prefetched */
#pragma omp parallel num_threads(num_threads) if (n * k >= 65536)
        {
            int64_t t, nt;
            thread_team(&t, &nt);
            const int64_t groups = n / 8, share = (groups + nt - 1) / nt;
            const int64_t g0 = t * share < groups ? t * share : groups;
            const int64_t g1 = g0 + share < groups ? g0 + share : groups;
            gguf_x8_row_matmul(out, q, dx, w, qtype, g0, g1, k);
        }
        free(q), free(dx);
        return;
    }
#ifdef X8_PAIRS
    {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (n * k * rows >= 65536)
        for (int64_t pair = 0; pair < (n / 8 + 1) / 2; pair++) {
            const int64_t g = 2 * pair;
            if (g + 1 == n / 8 && qtype == Q8_0)
                x8_group_rows_q8_0(out, ldo, q, dx, rows, w, g, k);
            else if (g + 1 == n / 8)
                x8_group_rows(qtype, out, ldo, q, dx, rows, w, g, k);
            else if (qtype == Q8_0)
                x8_group_pair_rows_q8_0(out, ldo, q, dx, rows, w, g, k);
            else if (qtype == Q4_1)
                x8_group_pair_rows(Q4_1, out, ldo, q, dx, rows, w, g, k);
            else
                x8_group_pair_rows(Q4_0, out, ldo, q, dx, rows, w, g, k);
        }
        free(q), free(dx);
        return;
    }
#endif
#pragma omp parallel for num_threads(num_threads) schedule(static) if (n * k * rows >= 65536)
    for (int64_t g = 0; g < n / 8; g++) {
        if (qtype == Q8_0)
            x8_group_rows_q8_0(out, ldo, q, dx, rows, w, g, k);
        else if (qtype == Q4_1)
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
    qtype &= ~(int64_t)GGUF_INT8_ACTIVATIONS;
    if (qtype == Q8_0)
        x8_groups_q8_0(out, q, dx, w, g0, g1, k);
    else if (qtype == Q4_1)
        x8_groups(Q4_1, out, q, dx, w, g0, g1, k);
    else
        x8_groups(Q4_0, out, q, dx, w, g0, g1, k);
#else
    (void)out, (void)q, (void)dx, (void)w, (void)qtype, (void)g0, (void)g1, (void)k;
#endif
}
