/* 4-bit weight-only projections.
 *
 * Weights are in quant.py's nibble layout, the one the Triton kernels read:
 *   qweight uint8 [N, K/2]: element 2j in the low nibble of byte j, 2j+1 in the high one;
 *   scales, zeros bfloat16 [N, K/G]: w[n, k] = (q - 8) * s + z over groups of G (G % 32 == 0).
 * Dot products need no order, so x is de-interleaved once per call (per 32-element chunk: the 16
 * even elements, then the 16 odd ones) and each weight chunk dequantizes as 16 low nibbles then
 * 16 high ones: whole vectors, no shuffles. Activations and sums are float32.
 */
#include "native.h"

/* x [M, K] -> xp [M, K]: per 32-chunk, even elements then odd ones. */
static void deinterleave(const float *x, float *xp, int m, int k) {
    for (int r = 0; r < m; r++) {
        const float *src = x + (size_t)r * k;
        float *dst = xp + (size_t)r * k;
        for (int c = 0; c < k; c += 32)
            for (int i = 0; i < 16; i++) {
                dst[c + i] = src[c + 2 * i];
                dst[c + 16 + i] = src[c + 2 * i + 1];
            }
    }
}

#if !PREFILL_INT8 /* the float tiles' (q4_float_tiles) */
/* Rows [n0, n0+rows) of the weight, dequantized in the de-interleaved order: tile [rows, K]. */
static void dequant_rows(const uint8_t *q, const uint16_t *s, const uint16_t *z, int k, int g, int n0,
                         int rows, float *tile) {
    int groups = k / g;
    for (int r = 0; r < rows; r++) {
        const uint8_t *qr = q + (size_t)(n0 + r) * (k / 2);
        const uint16_t *sr = s + (size_t)(n0 + r) * groups, *zr = z + (size_t)(n0 + r) * groups;
        float *t = tile + (size_t)r * k;
        for (int gi = 0; gi < groups; gi++) {
            float sc = bf16(sr[gi]), zc = bf16(zr[gi]);
            for (int c = gi * g; c < (gi + 1) * g; c += 32) {
                v16b b;
                memcpy(&b, qr + c / 2, sizeof b);
                store16(t + c, nibbles(b & 15) * sc + zc);
                store16(t + c + 16, nibbles(b >> 4) * sc + zc);
            }
        }
    }
}
#endif

#if !PREFILL_INT8 /* else prefill.c serves more than INT_ROWS rows */
/* More than INT_ROWS rows without AVX2: the weight dequantized in float tiles. Small M: 16-row
 * tiles stay in L1 and spread over threads; large M: 64-row tiles amortize the dequantization over
 * more rows of x. */
static void q4_float_tiles(const float *x, float *xp, int m, int k, const uint8_t *q, const uint16_t *s,
                           const uint16_t *z, int n, int g, const float *bias, float *y) {
    deinterleave(x, xp, m, k);
    int nb = m <= 16 ? 16 : 64;
    int tiles = (n + nb - 1) / nb;
#pragma omp parallel for schedule(static) num_threads(threads())
    for (int t = 0; t < tiles; t++) {
        int n0 = t * nb, rows = n0 + nb <= n ? nb : n - n0;
        float *tile = scratch(0, (size_t)nb * k);
        dequant_rows(q, s, z, k, g, n0, rows, tile);
        tile_matmul(xp, m, k, tile, rows, n0, n, bias, y);
    }
}
#endif

/* Few rows of x (decode): each weight chunk is dequantized in registers and used at once for the
 * m (<= SMALL_M) rows. Always inlined with a constant m, so the accumulators live in registers. */
static inline __attribute__((always_inline)) void rows_small(const float *xp, const int m, int k,
                                                             const uint8_t *q, const uint16_t *s,
                                                             const uint16_t *z, int g, int n0, int n1, int n,
                                                             const float *bias, float *y) {
    int groups = k / g;
    for (int r = n0; r < n1; r++) {
        const uint8_t *qr = q + (size_t)r * (k / 2);
        const uint16_t *sr = s + (size_t)r * groups, *zr = z + (size_t)r * groups;
        v16 acc[SMALL_M] = {{0}};
        for (int gi = 0; gi < groups; gi++) {
            float sc = bf16(sr[gi]), zc = bf16(zr[gi]);
            for (int c = gi * g; c < (gi + 1) * g; c += 32) {
                v16b b;
                memcpy(&b, qr + c / 2, sizeof b);
                v16 lo = nibbles(b & 15) * sc + zc, hi = nibbles(b >> 4) * sc + zc;
                for (int i = 0; i < m; i++) {
                    const float *xi = xp + (size_t)i * k + c;
                    acc[i] += load16(xi) * lo + load16(xi + 16) * hi;
                }
            }
        }
        for (int i = 0; i < m; i++) y[(size_t)i * n + r] = hsum16(acc[i]) + (bias ? bias[r] : 0.f);
    }
}

#if defined(__AVX2__)
static inline __attribute__((always_inline)) void rows_int(const QX *x, const int m, int k, const uint8_t *q,
                                                           const uint16_t *s, const uint16_t *z, int g, int n0,
                                                           int n1, int n, const float *bias, float *y) {
    int groups = k / g, chunks = k / 32, per = g / 32;
    const __m128i low = _mm_set1_epi8(15);
    for (int r = n0; r < n1; r++) {
        const uint8_t *qr = q + (size_t)r * (k / 2);
        const uint16_t *sr = s + (size_t)r * groups, *zr = z + (size_t)r * groups;
        __m256 acc[SMALL_M];
        float off[SMALL_M];
        for (int i = 0; i < m; i++) acc[i] = _mm256_setzero_ps(), off[i] = 0.f;
        for (int gi = 0; gi < groups; gi++) {
            float sc = bf16(sr[gi]), zc = bf16(zr[gi]) - 8.f * sc;
            for (int c = gi * per; c < (gi + 1) * per; c++) {
                __m128i b = _mm_loadu_si128((const __m128i *)(qr + c * 16));
                __m256i wlo = _mm256_cvtepu8_epi16(_mm_and_si128(b, low));
                __m256i whi = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(b, 4), low));
                for (int i = 0; i < m; i++) {
                    const int16_t *xq = x->q + (size_t)i * k + c * 32;
                    __m256i dot = _mm256_add_epi32(_mm256_madd_epi16(wlo, _mm256_loadu_si256((const __m256i *)xq)),
                                                   _mm256_madd_epi16(whi, _mm256_loadu_si256((const __m256i *)(xq + 16))));
                    __m256 f = _mm256_set1_ps(sc * x->dx[(size_t)i * chunks + c]);
                    acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), f, acc[i]);
                    off[i] += zc * x->sum[(size_t)i * chunks + c];
                }
            }
        }
        for (int i = 0; i < m; i++) {
            __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc[i]), _mm256_extractf128_ps(acc[i], 1));
            h = _mm_add_ps(h, _mm_movehl_ps(h, h));
            h = _mm_add_ss(h, _mm_movehdup_ps(h));
            y[(size_t)i * n + r] = _mm_cvtss_f32(h) + off[i] + (bias ? bias[r] : 0.f);
        }
    }
}

static void rows_int_any(const QX *x, int m, int k, const uint8_t *q, const uint16_t *s, const uint16_t *z, int g,
                         int n0, int n1, int n, const float *bias, float *y) {
    for (int i0 = 0; i0 < m; i0 += SMALL_M) {
        QX xi = qx_rows(x, i0, k);
        float *yi = y + (size_t)i0 * n;
#define ROWS_INT(M) rows_int(&xi, M, k, q, s, z, g, n0, n1, n, bias, yi)
        WITH_CONSTANT_ROWS(m - i0, ROWS_INT)
#undef ROWS_INT
    }
}
#endif

#if !defined(__AVX2__) /* without AVX2 the fused path is float */
static void rows_small_any(const float *xp, int m, int k, const uint8_t *q, const uint16_t *s, const uint16_t *z,
                           int g, int n0, int n1, int n, const float *bias, float *y) {
    for (int i0 = 0; i0 < m; i0 += SMALL_M) {
        const float *xi = xp + (size_t)i0 * k;
        float *yi = y + (size_t)i0 * n;
#define ROWS_SMALL(M) rows_small(xi, M, k, q, s, z, g, n0, n1, n, bias, yi)
        WITH_CONSTANT_ROWS(m - i0, ROWS_SMALL)
#undef ROWS_SMALL
    }
}
#endif

/* y [M, N] = x [M, K] @ W^T (+ bias [N] or NULL); xp [M, K] is the caller's room for x reordered. */
void q4_matmul_into(const float *x, float *xp, int m, int k, const uint8_t *q, const uint16_t *s,
                           const uint16_t *z, int n, int g, const float *bias, float *y) {
    if (m > INT_ROWS) {
#if PREFILL_INT8 /* x in its natural order: prefill.c repacks the weight instead */
        q4_matmul_int8(x, m, k, q, s, z, n, g, bias, y);
#else
        q4_float_tiles(x, xp, m, k, q, s, z, n, g, bias, y);
#endif
        return;
    }
    deinterleave(x, xp, m, k);
    int per = 16; /* output rows per task: whole cache lines of y, many tasks to balance */
    int tasks = (n + per - 1) / per;
#if defined(__AVX2__)
    QX qx = quantize_x(xp, m, k);
#pragma omp parallel for schedule(static) num_threads(threads())
    for (int t = 0; t < tasks; t++) {
        int n0 = t * per, n1 = n0 + per < n ? n0 + per : n;
        rows_int_any(&qx, m, k, q, s, z, g, n0, n1, n, bias, y);
    }
#else
#pragma omp parallel for schedule(static) num_threads(threads())
    for (int t = 0; t < tasks; t++) {
        int n0 = t * per, n1 = n0 + per < n ? n0 + per : n;
        rows_small_any(xp, m, k, q, s, z, g, n0, n1, n, bias, y);
    }
#endif
}

void q4_matmul(const float *x, int m, int k, const uint8_t *q, const uint16_t *s, const uint16_t *z, int n,
               int g, const float *bias, float *y) {
    float *xp = scratch(1, (size_t)m * k);
    q4_matmul_into(x, xp, m, k, q, s, z, n, g, bias, y);
}

/* w [N, K] float32 in the natural order (large M: a float GEMM on it beats a 4-bit one). */
void q4_dequant(const uint8_t *q, const uint16_t *s, const uint16_t *z, int n, int k, int g, float *w) {
    int groups = k / g;
#pragma omp parallel for schedule(static) num_threads(threads())
    for (int r = 0; r < n; r++) {
        const uint8_t *qr = q + (size_t)r * (k / 2);
        float *wr = w + (size_t)r * k;
        for (int gi = 0; gi < groups; gi++) {
            float sc = bf16(s[(size_t)r * groups + gi]), zc = bf16(z[(size_t)r * groups + gi]);
            for (int c = gi * g; c < (gi + 1) * g; c += 32) {
                v16b b;
                memcpy(&b, qr + c / 2, sizeof b);
                v16 lo = nibbles(b & 15) * sc + zc, hi = nibbles(b >> 4) * sc + zc; /* elements 2j, 2j+1 */
                store16(wr + c, __builtin_shufflevector(lo, hi, 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23));
                store16(wr + c + 16,
                        __builtin_shufflevector(lo, hi, 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31));
            }
        }
    }
}
