/* 8-bit blocks (Q8_0, the int8 form of GGUF's Q5_0/Q5_1/Q5_K, Q6_K's own packing) and dense float32 projections. */
#include "native.h"

/* ---- 8-bit weights in blocks: w[n, k] = q[n, k] * d[n, k / sub] (+ mn[n, k / 32]), q int8, d and mn
 * float32, sub 16 or 32. Exact for those GGUF types: each block's scale (and min) is a float32 product of
 * an fp16 super-block scale and a small integer, and q fits int8.
 * sub 16 is Q6_K, read at its own size (6.6 bits a weight, not 10 as int8 values and a float32 per 16):
 * q is the file's 6-bit packing and d its scales, per row and super-block of 256:
 *   q: 192 bytes, ggml's ql[128] then qh[64]; element 128 h + 32 j + l (h, j < 2 or 4, l < 32) is
 *      ((ql[64 h + 32 (j & 1) + l] >> 4 (j >= 2)) & 15) | ((qh[32 h + l] >> 2 j) & 3) << 4, minus 32;
 *   d: 20 bytes, float32 D then 16 int8 sub-scales sc; the scale of 16-element block i is D * sc[i],
 *      formed here (exact: D is an fp16 value, sc 8 bits). ---- */
#define Q6K_QBYTES 192
#define Q6K_SBYTES 20

/* The scale of 16-element block i of a row's Q6_K scales `sr`. */
static inline float q6k_scale(const uint8_t *sr, int i) {
    float dd;
    memcpy(&dd, sr + (i / 16) * Q6K_SBYTES, sizeof dd);
    return dd * (float)(int8_t)sr[(i / 16) * Q6K_SBYTES + 4 + i % 16];
}

/* Row r's scale of block i (of `sub` elements). */
static inline float q8_scale(const float *d, int sub, int k, int r, int i) {
    if (sub == 16) return q6k_scale((const uint8_t *)d + (size_t)r * (k / 256) * Q6K_SBYTES, i);
    return d[(size_t)r * (k / 32) + i];
}

#if !PREFILL_INT8 /* else prefill.c serves more than INT_ROWS rows */
/* Element e of a row of Q6_K's packing (the layout above), -32..31. */
static inline int q6k_value(const uint8_t *row, int e) {
    const uint8_t *b = row + (size_t)(e / 256) * Q6K_QBYTES;
    int i = e % 256, h = i / 128, j = (i % 128) / 32, l = i % 32;
    int lo = b[64 * h + 32 * (j & 1) + l] >> (j >= 2 ? 4 : 0);
    return ((lo & 15) | ((b[128 + 32 * h + l] >> (2 * j)) & 3) << 4) - 32;
}

static void q8_dequant_rows(const int8_t *q, const float *d, const float *mn, int sub, int k, int n0, int rows,
                            float *tile) {
    for (int r = 0; r < rows; r++) {
        const float *mr = mn ? mn + (size_t)(n0 + r) * (k / 32) : NULL;
        float *t = tile + (size_t)r * k;
        if (sub == 16) {
            const uint8_t *qr = (const uint8_t *)q + (size_t)(n0 + r) * (k / 256) * Q6K_QBYTES;
            for (int c = 0; c < k; c++) t[c] = (float)q6k_value(qr, c) * q8_scale(d, sub, k, n0 + r, c / 16);
            continue;
        }
        const int8_t *qr = q + (size_t)(n0 + r) * k;
        for (int c = 0; c < k; c += 16) {
            v16b b;
            memcpy(&b, qr + c, sizeof b);
            typedef int8_t v16s8 __attribute__((vector_size(16)));
            v16 w = __builtin_convertvector(__builtin_convertvector((v16s8)b, v16i), v16) *
                    q8_scale(d, sub, k, n0 + r, c / sub);
            store16(t + c, mr ? w + mr[c / 32] : w);
        }
    }
}
#endif

#if defined(__AVX2__)
/* 32-element chunk c of a row of Q6_K's packing as int8 values q - 32 (the layout above). */
static inline __m256i q6k_chunk(const uint8_t *row, int c) {
    const uint8_t *b = row + (size_t)(c / 8) * Q6K_QBYTES;
    int h = (c / 4) % 2, j = c % 4;
    __m256i lo = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32 * (j & 1)));
    __m256i hi = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
    lo = _mm256_and_si256(_mm256_srl_epi16(lo, _mm_cvtsi32_si128(j >= 2 ? 4 : 0)), _mm256_set1_epi8(15));
    hi = _mm256_and_si256(_mm256_srl_epi16(hi, _mm_cvtsi32_si128(2 * j)), _mm256_set1_epi8(3));
    return _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)), _mm256_set1_epi8(32));
}

/* A 32-element chunk's dot is two 16-element halves (madd pairs within each half), so a scale per 16
 * (sub 16: Q6_K) weighs each half; a min per 32 multiplies x's exact float sum over the chunk. */
static inline __attribute__((always_inline)) void q8_rows_int(const QX *x, const int m, int k, const int8_t *q,
                                                              const float *d, const float *mn, const int sub,
                                                              int n0, int n1, int n, const float *bias,
                                                              float *y) {
    int chunks = k / 32;
    for (int r = n0; r < n1; r++) {
        const int8_t *qr = q + (size_t)r * k;
        const uint8_t *q6 = (const uint8_t *)q + (size_t)r * (k / 256) * Q6K_QBYTES; /* sub 16 */
        const float *mr = mn ? mn + (size_t)r * chunks : NULL;
        __m256 acc[SMALL_M];
        float off[SMALL_M];
        for (int i = 0; i < m; i++) acc[i] = _mm256_setzero_ps(), off[i] = 0.f;
        for (int c = 0; c < chunks; c++) {
            /* the chunk's scales: one per 32, or its two per 16 (Q6_K) */
            float d0 = q8_scale(d, sub, k, r, sub == 32 ? c : 2 * c);
            float d1 = sub == 32 ? d0 : q8_scale(d, sub, k, r, 2 * c + 1);
            __m256i w0, w1;
            if (sub == 32) {
                w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(qr + c * 32)));
                w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(qr + c * 32 + 16)));
            } else {
                __m256i v = q6k_chunk(q6, c);
                w0 = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(v));
                w1 = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(v, 1));
            }
            for (int i = 0; i < m; i++) {
                const int16_t *xq = x->q + (size_t)i * k + c * 32;
                __m256i p0 = _mm256_madd_epi16(w0, _mm256_loadu_si256((const __m256i *)xq));
                __m256i p1 = _mm256_madd_epi16(w1, _mm256_loadu_si256((const __m256i *)(xq + 16)));
                float dx = x->dx[(size_t)i * chunks + c];
                if (sub == 32) {
                    acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(p0, p1)), _mm256_set1_ps(d0 * dx),
                                             acc[i]);
                } else {
                    acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_set1_ps(d0 * dx), acc[i]);
                    acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), _mm256_set1_ps(d1 * dx), acc[i]);
                }
                if (mr) off[i] += mr[c] * x->sum[(size_t)i * chunks + c];
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

static void q8_rows_int_any(const QX *x, int m, int k, const int8_t *q, const float *d, const float *mn, int sub,
                            int n0, int n1, int n, const float *bias, float *y) {
    for (int i0 = 0; i0 < m; i0 += SMALL_M) {
        QX xi = qx_rows(x, i0, k);
        float *yi = y + (size_t)i0 * n;
#define Q8_ROWS_INT(M) q8_rows_int(&xi, M, k, q, d, mn, sub, n0, n1, n, bias, yi)
        WITH_CONSTANT_ROWS(m - i0, Q8_ROWS_INT)
#undef Q8_ROWS_INT
    }
}
#endif

/* y [M, N] = x [M, K] @ W^T (+ bias) for 8-bit blocks (K % 32 == 0); x in its natural order. prefill.c's
 * tiles hold one scale per 32: scales per 16 take the int16 path at every row count. */
void q8_matmul(const float *x, int m, int k, const int8_t *q, const float *d, const float *mn, int sub, int n,
               const float *bias, float *y) {
#if VNNI512
    if (m <= INT_ROWS || sub != 32) {
        q8_matmul_vnni(x, m, k, q, d, mn, sub, n, bias, y);
        return;
    }
#endif
#if defined(__AVX2__)
    if (m <= INT_ROWS || sub != 32) {
        int per = 16, tasks = (n + per - 1) / per;
        QX qx = quantize_x(x, m, k);
#pragma omp parallel for schedule(static) num_threads(threads())
        for (int t = 0; t < tasks; t++) {
            int n0 = t * per, n1 = n0 + per < n ? n0 + per : n;
            q8_rows_int_any(&qx, m, k, q, d, mn, sub, n0, n1, n, bias, y);
        }
        return;
    }
    q8_matmul_int8(x, m, k, q, d, mn, n, bias, y);
#else
    int nb = 64, tiles = (n + nb - 1) / nb;
#pragma omp parallel for schedule(static) num_threads(threads())
    for (int t = 0; t < tiles; t++) {
        int n0 = t * nb, rows = n0 + nb <= n ? nb : n - n0;
        float *tile = scratch(0, (size_t)nb * k);
        q8_dequant_rows(q, d, mn, sub, k, n0, rows, tile);
        tile_matmul(x, m, k, tile, rows, n0, n, bias, y);
    }
#endif
}

/* ---- float32 weights (--quantization none): few rows, read at the memory's rate ---- */

/* y rows [n0, n1) for m (<= SMALL_M, constant when inlined) rows of x; one row of x keeps four
 * accumulators so the FMA chain does not bound the weight stream. K % 16 == 0 (so % VL). */
static inline __attribute__((always_inline)) void f32_rows(const float *x, const int m, int k, const float *w,
                                                           int n0, int n1, int n, const float *bias, float *y) {
    for (int r = n0; r < n1; r++) {
        const float *wr = w + (size_t)r * k;
        float out[SMALL_M];
        if (m == 1) {
            vf a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
            int c = 0;
            for (; c + 4 * VL <= k; c += 4 * VL) {
                a0 += loadv(x + c) * loadv(wr + c);
                a1 += loadv(x + c + VL) * loadv(wr + c + VL);
                a2 += loadv(x + c + 2 * VL) * loadv(wr + c + 2 * VL);
                a3 += loadv(x + c + 3 * VL) * loadv(wr + c + 3 * VL);
            }
            for (; c < k; c += VL) a0 += loadv(x + c) * loadv(wr + c);
            out[0] = hsumv((a0 + a1) + (a2 + a3));
        } else {
            vf acc[SMALL_M] = {{0}};
            for (int c = 0; c < k; c += VL) {
                vf wv = loadv(wr + c);
                for (int i = 0; i < m; i++) acc[i] += loadv(x + (size_t)i * k + c) * wv;
            }
            for (int i = 0; i < m; i++) out[i] = hsumv(acc[i]);
        }
        for (int i = 0; i < m; i++) y[(size_t)i * n + r] = out[i] + (bias ? bias[r] : 0.f);
    }
}

/* y [M, N] = x [M, K] @ W^T (+ bias) for a float32 W [N, K]; any M, fastest where M is small. */
void f32_matmul(const float *x, int m, int k, const float *w, int n, const float *bias, float *y) {
    int per = 16, tasks = (n + per - 1) / per;
#pragma omp parallel for schedule(static) num_threads(threads())
    for (int t = 0; t < tasks; t++) {
        int n0 = t * per, n1 = n0 + per < n ? n0 + per : n;
        for (int i0 = 0; i0 < m; i0 += SMALL_M) {
            const float *xi = x + (size_t)i0 * k;
            float *yi = y + (size_t)i0 * n;
#define F32_ROWS(M) f32_rows(xi, M, k, w, n0, n1, n, bias, yi)
            WITH_CONSTANT_ROWS(m - i0, F32_ROWS)
#undef F32_ROWS
        }
    }
}
