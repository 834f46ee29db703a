/* Native CPU kernels for 4-bit weight-only projections and the decode step (native.py builds and
 * loads this file; ctypes calls it, so every argument is a plain pointer or number).
 *
 * Weights are in quant.py's nibble layout, the one the Triton kernels read:
 *   qweight uint8 [N, K/2]: element 2j in the low nibble of byte j, 2j+1 in the high one;
 *   scales, zeros bfloat16 [N, K/G]: w[n, k] = (q - 8) * s + z over groups of G (G % 32 == 0).
 * Dot products need no order, so x is de-interleaved once per call (per 32-element chunk: the 16
 * even elements, then the 16 odd ones) and each weight chunk dequantizes as 16 low nibbles then
 * 16 high ones: whole vectors, no shuffles. Activations and sums are float32.
 *
 * Threads: OpenMP, whose runtime is the one torch loaded (same soname), so torch.set_num_threads
 * sets ours too. Scratch is grow-only and per thread; nothing here allocates per call once warm.
 */
#include <math.h>
#include <omp.h>
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint8_t v16b __attribute__((vector_size(16)));

static inline v16 load16(const float *p) {
    v16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store16(float *p, v16 v) { memcpy(p, &v, sizeof v); }

typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

static inline float hsum16(v16 v) { /* a tree, not 16 dependent adds */
    v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
}

/* Lane-wise select (C has no vector ?:): mask lanes are -1 (take a) or 0 (take b). */
static inline v16 vsel(v16i mask, v16 a, v16 b) { return (v16)(((v16i)a & mask) | ((v16i)b & ~mask)); }
static inline v16 vmax(v16 a, v16 b) { return vsel(a > b, a, b); }
static inline v16 vmin(v16 a, v16 b) { return vsel(a < b, a, b); }

/* exp over 16 lanes (Cephes' expf polynomial, ~1 ulp on [-87, 88]); inputs below -87 give ~0. */
static inline v16 vexp(v16 x) {
    const v16 zero = {0};
    x = vmin(vmax(x, zero - 87.f), zero + 88.f);
    v16 t = x * 1.44269504088896341f;
    v16 n = __builtin_convertvector(__builtin_convertvector(t, v16i), v16);
    n += __builtin_convertvector(n > t, v16);         /* floor(t): true lanes are -1 */
    n -= __builtin_convertvector(t - n >= 0.5f, v16); /* nearest */
    v16 r = x - n * 0.693359375f + n * 2.12194440e-4f;
    v16 p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    v16 e = p * r * r + r + 1.f;
    v16i bits = (__builtin_convertvector(n, v16i) + 127) << 23;
    return e * (v16)bits;
}

static inline float bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* 16 nibble values q -> the floats q - 8 (exact), the factor the scale multiplies. */
static inline v16 nibbles(v16b q) { return __builtin_convertvector(__builtin_convertvector(q, v16i) - 8, v16); }

/* The threads of a parallel region: what the caller set for its thread (set_threads: torch's
 * intra-op count, which libgomp does not carry into threads created after torch.set_num_threads),
 * else libgomp's default. Thread-local, as torch's setting applies to whichever thread calls. */
static __thread int n_threads;

void set_threads(int n) { n_threads = n; }

static inline int threads(void) { return n_threads > 0 ? n_threads : omp_get_max_threads(); }

/* Grow-only per-thread buffer `slot` (a few per thread) of at least n floats, 64-byte aligned. */
static float *scratch(int slot, size_t n) {
    static __thread float *buf[6];
    static __thread size_t cap[6];
    if (cap[slot] < n) {
        free(buf[slot]);
        size_t bytes = ((n * sizeof(float) + 63) / 64) * 64;
        buf[slot] = aligned_alloc(64, bytes);
        cap[slot] = buf[slot] ? n : 0;
    }
    return buf[slot];
}

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

/* y[m, n0 + r] = dot(xp[m], tile[r]) (+ bias), rows four at a time so each x load feeds 4 FMAs. */
static void tile_matmul(const float *xp, int m, int k, const float *tile, int rows, int n0, int n,
                        const float *bias, float *y) {
    const int mstep = 32; /* x rows per pass: 32 x K floats stay in L2 beside the tile */
    for (int m0 = 0; m0 < m; m0 += mstep) {
        int m1 = m0 + mstep < m ? m0 + mstep : m;
        int r = 0;
        for (; r + 4 <= rows; r += 4) {
            const float *w0 = tile + (size_t)r * k, *w1 = w0 + k, *w2 = w1 + k, *w3 = w2 + k;
            for (int i = m0; i < m1; i++) {
                const float *xi = xp + (size_t)i * k;
                v16 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
                for (int c = 0; c < k; c += 16) {
                    v16 xv = load16(xi + c);
                    a0 += xv * load16(w0 + c);
                    a1 += xv * load16(w1 + c);
                    a2 += xv * load16(w2 + c);
                    a3 += xv * load16(w3 + c);
                }
                float *yi = y + (size_t)i * n + n0 + r;
                yi[0] = hsum16(a0) + (bias ? bias[n0 + r] : 0.f);
                yi[1] = hsum16(a1) + (bias ? bias[n0 + r + 1] : 0.f);
                yi[2] = hsum16(a2) + (bias ? bias[n0 + r + 2] : 0.f);
                yi[3] = hsum16(a3) + (bias ? bias[n0 + r + 3] : 0.f);
            }
        }
        for (; r < rows; r++) {
            const float *w0 = tile + (size_t)r * k;
            for (int i = m0; i < m1; i++) {
                v16 a0 = {0};
                for (int c = 0; c < k; c += 16) a0 += load16(xp + (size_t)i * k + c) * load16(w0 + c);
                y[(size_t)i * n + n0 + r] = hsum16(a0) + (bias ? bias[n0 + r] : 0.f);
            }
        }
    }
}

/* Few rows of x (decode): each weight chunk is dequantized in registers and used at once for the
 * m (<= SMALL_M) rows. Always inlined with a constant m, so the accumulators live in registers. */
#define SMALL_M 4
/* CALL(M) with M the constant 1..SMALL_M equal to min(rows, SMALL_M): the row kernels are always
 * inlined, so each constant gets its own copy with its accumulators in registers. */
#define WITH_CONSTANT_ROWS(rows, CALL)                                                                      \
    switch ((rows) < SMALL_M ? (rows) : SMALL_M) {                                                           \
    case 1: CALL(1); break;                                                                                  \
    case 2: CALL(2); break;                                                                                  \
    case 3: CALL(3); break;                                                                                  \
    default: CALL(SMALL_M); break;                                                                           \
    }
#define INT_ROWS 16 /* up to this many rows of x, the fused (int8 x on AVX2) path */
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
/* The integer path: x quantized to int16 per 32-element chunk (xq = round(x / dx), dx = max|x| /
 * 32767: a relative rounding of 2^-16 of the chunk's largest value, finer than the bfloat16 that
 * torch's int4 kernel takes), so a chunk's dot is two s16 x s16 pair-products (AVX2 madd):
 *   sum x w = s dx sum xq q  +  (z - 8 s) sum x      (w = q s + (z - 8 s), q the raw nibble)
 * ~2.5x the float path's rate at one row. */
typedef struct {
    int16_t *q; /* [m, K] de-interleaved order */
    float *dx;  /* [m, K/32] */
    float *sum; /* [m, K/32] sums of x over each chunk */
} QX;

static void quantize_x(const float *xp, int m, int k, QX *out) {
    int chunks = k / 32;
    for (int i = 0; i < m; i++)
        for (int c = 0; c < chunks; c++) {
            const float *v = xp + (size_t)i * k + c * 32;
            float amax = 0.f, sum = 0.f;
            for (int j = 0; j < 32; j++) {
                float a = fabsf(v[j]);
                amax = a > amax ? a : amax;
                sum += v[j];
            }
            float d = amax / 32767.f, inv = d > 0.f ? 1.f / d : 0.f;
            int16_t *q = out->q + (size_t)i * k + c * 32;
            for (int j = 0; j < 32; j++) q[j] = (int16_t)lrintf(v[j] * inv);
            out->dx[(size_t)i * chunks + c] = d;
            out->sum[(size_t)i * chunks + c] = sum;
        }
}

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
        int chunks = k / 32;
        QX xi = {x->q + (size_t)i0 * k, x->dx + (size_t)i0 * chunks, x->sum + (size_t)i0 * chunks};
        float *yi = y + (size_t)i0 * n;
#define ROWS_INT(M) rows_int(&xi, M, k, q, s, z, g, n0, n1, n, bias, yi)
        WITH_CONSTANT_ROWS(m - i0, ROWS_INT)
#undef ROWS_INT
    }
}
#endif

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

/* y [M, N] = x [M, K] @ W^T (+ bias [N] or NULL); xp [M, K] is the caller's room for x reordered. */
static void q4_matmul_into(const float *x, float *xp, int m, int k, const uint8_t *q, const uint16_t *s,
                           const uint16_t *z, int n, int g, const float *bias, float *y) {
    deinterleave(x, xp, m, k);
    if (m <= INT_ROWS) {
        int per = 16; /* output rows per task: whole cache lines of y, many tasks to balance */
        int tasks = (n + per - 1) / per;
#if defined(__AVX2__)
        int chunks = k / 32;
        float *qxf = scratch(4, (size_t)m * (k / 2 + 2 * chunks));
        QX qx = {(int16_t *)qxf, qxf + (size_t)m * k / 2, qxf + (size_t)m * (k / 2 + chunks)};
        quantize_x(xp, m, k, &qx);
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
        return;
    }
    /* Small M: 4-row tiles stay in L1 and spread over threads; large M: 64-row tiles amortize
     * the dequantization over more rows of x. */
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

void q4_matmul(const float *x, int m, int k, const uint8_t *q, const uint16_t *s, const uint16_t *z, int n,
               int g, const float *bias, float *y) {
    float *xp = scratch(1, (size_t)m * k);
    q4_matmul_into(x, xp, m, k, q, s, z, n, g, bias, y);
}

/* ---- 8-bit weights in Q8_0 blocks: w[n, k] = q[n, k] * d[n, k / 32], q int8, d float32 ---- */

static void q8_dequant_rows(const int8_t *q, const float *d, int k, int n0, int rows, float *tile) {
    for (int r = 0; r < rows; r++) {
        const int8_t *qr = q + (size_t)(n0 + r) * k;
        const float *dr = d + (size_t)(n0 + r) * (k / 32);
        float *t = tile + (size_t)r * k;
        for (int c = 0; c < k; c += 16) {
            v16b b;
            memcpy(&b, qr + c, sizeof b);
            typedef int8_t v16s8 __attribute__((vector_size(16)));
            store16(t + c, __builtin_convertvector(__builtin_convertvector((v16s8)b, v16i), v16) * dr[c / 32]);
        }
    }
}

#if defined(__AVX2__)
static inline __attribute__((always_inline)) void q8_rows_int(const QX *x, const int m, int k, const int8_t *q,
                                                              const float *d, int n0, int n1, int n,
                                                              const float *bias, float *y) {
    int chunks = k / 32;
    for (int r = n0; r < n1; r++) {
        const int8_t *qr = q + (size_t)r * k;
        const float *dr = d + (size_t)r * chunks;
        __m256 acc[SMALL_M];
        for (int i = 0; i < m; i++) acc[i] = _mm256_setzero_ps();
        for (int c = 0; c < chunks; c++) {
            __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(qr + c * 32)));
            __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(qr + c * 32 + 16)));
            for (int i = 0; i < m; i++) {
                const int16_t *xq = x->q + (size_t)i * k + c * 32;
                __m256i dot = _mm256_add_epi32(_mm256_madd_epi16(w0, _mm256_loadu_si256((const __m256i *)xq)),
                                               _mm256_madd_epi16(w1, _mm256_loadu_si256((const __m256i *)(xq + 16))));
                acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(dr[c] * x->dx[(size_t)i * chunks + c]),
                                         acc[i]);
            }
        }
        for (int i = 0; i < m; i++) {
            __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc[i]), _mm256_extractf128_ps(acc[i], 1));
            h = _mm_add_ps(h, _mm_movehl_ps(h, h));
            h = _mm_add_ss(h, _mm_movehdup_ps(h));
            y[(size_t)i * n + r] = _mm_cvtss_f32(h) + (bias ? bias[r] : 0.f);
        }
    }
}

static void q8_rows_int_any(const QX *x, int m, int k, const int8_t *q, const float *d, int n0, int n1, int n,
                            const float *bias, float *y) {
    int chunks = k / 32;
    for (int i0 = 0; i0 < m; i0 += SMALL_M) {
        QX xi = {x->q + (size_t)i0 * k, x->dx + (size_t)i0 * chunks, x->sum + (size_t)i0 * chunks};
        float *yi = y + (size_t)i0 * n;
#define Q8_ROWS_INT(M) q8_rows_int(&xi, M, k, q, d, n0, n1, n, bias, yi)
        WITH_CONSTANT_ROWS(m - i0, Q8_ROWS_INT)
#undef Q8_ROWS_INT
    }
}
#endif

/* y [M, N] = x [M, K] @ W^T (+ bias) for Q8_0 blocks (K % 32 == 0); x in its natural order. */
void q8_matmul(const float *x, int m, int k, const int8_t *q, const float *d, int n, const float *bias, float *y) {
#if defined(__AVX2__)
    if (m <= INT_ROWS) {
        int chunks = k / 32, per = 16, tasks = (n + per - 1) / per;
        float *qxf = scratch(4, (size_t)m * (k / 2 + 2 * chunks));
        QX qx = {(int16_t *)qxf, qxf + (size_t)m * k / 2, qxf + (size_t)m * (k / 2 + chunks)};
        quantize_x(x, m, k, &qx);
#pragma omp parallel for schedule(static) num_threads(threads())
        for (int t = 0; t < tasks; t++) {
            int n0 = t * per, n1 = n0 + per < n ? n0 + per : n;
            q8_rows_int_any(&qx, m, k, q, d, n0, n1, n, bias, y);
        }
        return;
    }
#endif
    int nb = 64, tiles = (n + nb - 1) / nb;
#pragma omp parallel for schedule(static) num_threads(threads())
    for (int t = 0; t < tiles; t++) {
        int n0 = t * nb, rows = n0 + nb <= n ? nb : n - n0;
        float *tile = scratch(0, (size_t)nb * k);
        q8_dequant_rows(q, d, k, n0, rows, tile);
        tile_matmul(x, m, k, tile, rows, n0, n, bias, y);
    }
}

/* ---- float32 weights (--quantization none): few rows, read at the memory's rate ---- */

/* y rows [n0, n1) for m (<= SMALL_M, constant when inlined) rows of x; one row of x keeps four
 * accumulators so the FMA chain does not bound the weight stream. K % 16 == 0. */
static inline __attribute__((always_inline)) void f32_rows(const float *x, const int m, int k, const float *w,
                                                           int n0, int n1, int n, const float *bias, float *y) {
    for (int r = n0; r < n1; r++) {
        const float *wr = w + (size_t)r * k;
        float out[SMALL_M];
        if (m == 1) {
            v16 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
            int c = 0;
            for (; c + 64 <= k; c += 64) {
                a0 += load16(x + c) * load16(wr + c);
                a1 += load16(x + c + 16) * load16(wr + c + 16);
                a2 += load16(x + c + 32) * load16(wr + c + 32);
                a3 += load16(x + c + 48) * load16(wr + c + 48);
            }
            for (; c < k; c += 16) a0 += load16(x + c) * load16(wr + c);
            out[0] = hsum16((a0 + a1) + (a2 + a3));
        } else {
            v16 acc[SMALL_M] = {{0}};
            for (int c = 0; c < k; c += 16) {
                v16 wv = load16(wr + c);
                for (int i = 0; i < m; i++) acc[i] += load16(x + (size_t)i * k + c) * wv;
            }
            for (int i = 0; i < m; i++) out[i] = hsum16(acc[i]);
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

/* ---- the decode step: every layer of a stage for B rows of one new token each ---- */

typedef struct {
    const uint8_t *q;      /* W_Q4: nibbles [N, K/2]; W_F32: the float32 weight [N, K]; W_Q8: int8 [N, K] */
    const uint16_t *s, *z; /* W_Q4's scales and zeros; W_Q8: its float32 scales [N, K/32] in s; else NULL */
    const float *bias;     /* or NULL */
    int n, k, g;
    int kind; /* W_Q4, W_F32 or W_Q8 */
} Q4;

enum { W_Q4 = 0, W_F32 = 1, W_Q8 = 2 };

typedef struct {
    const float *input_norm, *post_norm; /* [hidden] */
    Q4 qkv, o, gate_up, down;
} Layer;

typedef struct {
    int hidden, heads, kv_heads, head_dim, inter;
    int blocks, block_size; /* the KV pool: [layers, 2, blocks, block_size, kv_heads, head_dim] */
    float eps, scale;
    int kv_dtype; /* the pool's element: KV_F32, KV_F16 or KV_BF16 */
} Dims;

enum { KV_F32 = 0, KV_F16 = 1, KV_BF16 = 2 };
static const size_t KV_BYTES[] = {4, 2, 2};

typedef _Float16 v16h __attribute__((vector_size(32)));
typedef uint16_t v16u16 __attribute__((vector_size(32)));
typedef uint32_t v16u __attribute__((vector_size(64)));

/* 16 pool elements at element offset i of `base` as floats; always inlined with a constant kvt. */
static inline __attribute__((always_inline)) v16 kv_load(const void *base, size_t i, const int kvt) {
    if (kvt == KV_F32) return load16((const float *)base + i);
#if defined(__AVX512F__)
    if (kvt == KV_F16) { /* the conversion instruction itself: GCC's generic _Float16 path is slower */
        __m512 f = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)base + i)));
        v16 out;
        memcpy(&out, &f, sizeof out);
        return out;
    }
#elif defined(__F16C__)
    if (kvt == KV_F16) {
        const __m128i *p = (const __m128i *)((const uint16_t *)base + i);
        __m256 a = _mm256_cvtph_ps(_mm_loadu_si128(p)), b = _mm256_cvtph_ps(_mm_loadu_si128(p + 1));
        v16 out;
        memcpy(&out, &a, sizeof a);
        memcpy((char *)&out + sizeof a, &b, sizeof b);
        return out;
    }
#endif
    v16u16 h;
    memcpy(&h, (const uint16_t *)base + i, sizeof h);
    if (kvt == KV_F16) return __builtin_convertvector((v16h)h, v16);
    return (v16)(__builtin_convertvector(h, v16u) << 16); /* bfloat16: the high half of a float */
}

/* n (% 16 == 0) floats into the pool at element offset i, rounded to nearest-even as torch's .to(). */
static void kv_store(void *base, size_t i, const float *src, int n, int kvt) {
    if (kvt == KV_F32) {
        memcpy((float *)base + i, src, (size_t)n * sizeof(float));
        return;
    }
    for (int j = 0; j < n; j += 16) {
        v16 f = load16(src + j);
        v16u16 h;
        if (kvt == KV_F16) {
            h = (v16u16)__builtin_convertvector(f, v16h);
        } else {
            v16u u = (v16u)f;
            h = __builtin_convertvector((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16, v16u16);
        }
        memcpy((uint16_t *)base + i + j, &h, sizeof h);
    }
}

static void rms_norm(const float *x, const float *w, float *out, int b, int h, float eps) {
    for (int r = 0; r < b; r++) {
        const float *xr = x + (size_t)r * h;
        float ss = 0.f;
        for (int i = 0; i < h; i++) ss += xr[i] * xr[i];
        float inv = 1.f / sqrtf(ss / h + eps);
        for (int i = 0; i < h; i++) out[(size_t)r * h + i] = w[i] * (xr[i] * inv);
    }
}

/* HF's rotate_half rotary on one head's D values in place; cos/sin [D] of the row's position. */
static void rotate(float *v, const float *cos, const float *sin, int d) {
    int half = d / 2;
    for (int i = 0; i < half; i++) {
        float a = v[i], b = v[i + half];
        v[i] = a * cos[i] - b * sin[i];
        v[i + half] = b * cos[i + half] + a * sin[i + half];
    }
}

static void matmul(const float *x, float *xp, int b, const Q4 *w, float *y) {
    if (w->kind == W_F32)
        f32_matmul(x, b, w->k, (const float *)w->q, w->n, w->bias, y);
    else if (w->kind == W_Q8)
        q8_matmul(x, b, w->k, (const int8_t *)w->q, (const float *)w->s, w->n, w->bias, y);
    else
        q4_matmul_into(x, xp, b, w->k, w->q, w->s, w->z, w->n, w->g, w->bias, y);
}

/* Decode attention, split like flash-decoding: a task is one (row, kv head, SPLIT positions); it
 * takes the G query heads of that kv head together, so K and V are read once for all of them, and
 * leaves per head a partial (max score, sum of exp, unnormalized output) that merge() combines. */
#define SPLIT 128
#define MAX_G 16

/* One query head over positions [p0, p1) of its kv head: part = (max score, sum of exp, unnormalized
 * output [HD]). Always inlined with constant HD and kvt, so q and the output stay in registers; the
 * K/V span (SPLIT slots) stays in L1/L2 for the group's next head. kc/vc point at the pool slice
 * of this kv head; offsets are in elements (slot * stride). */
static inline __attribute__((always_inline)) void head_part(const float *q, const void *kc, const void *vc,
                                                            const int64_t *table, int p0, int p1, int bs,
                                                            size_t stride, float scale, const int HD,
                                                            const int kvt, float *sc, float *part) {
    v16 qv[HD / 16], acc[HD / 16];
    for (int i = 0; i < HD / 16; i++) qv[i] = load16(q + 16 * i), acc[i] = (v16){0};
    int len = p1 - p0, padded = (len + 15) & ~15;
    for (int p = p0; p < p1;) {
        int o = p % bs;
        size_t at = ((size_t)table[p / bs] * bs + o) * stride;
        for (; o < bs && p < p1; o++, p++, at += stride) {
            v16 dot = qv[0] * kv_load(kc, at, kvt);
            for (int i = 1; i < HD / 16; i++) dot += qv[i] * kv_load(kc, at + 16 * i, kvt);
            sc[p - p0] = hsum16(dot) * scale;
        }
    }
    for (int p = len; p < padded; p++) sc[p] = -INFINITY;
    v16 mv = load16(sc);
    for (int p = 16; p < padded; p += 16) mv = vmax(mv, load16(sc + p));
    float mx = mv[0];
    for (int i = 1; i < 16; i++) mx = mv[i] > mx ? mv[i] : mx;
    v16 tv = {0};
    for (int p = 0; p < padded; p += 16) {
        v16 e = vexp(load16(sc + p) - mx);
        store16(sc + p, e);
        tv += e;
    }
    for (int p = p0; p < p1;) {
        int o = p % bs;
        size_t at = ((size_t)table[p / bs] * bs + o) * stride;
        for (; o < bs && p < p1; o++, p++, at += stride) {
            float w = sc[p - p0];
            for (int i = 0; i < HD / 16; i++) acc[i] += w * kv_load(vc, at + 16 * i, kvt);
        }
    }
    part[0] = mx, part[1] = hsum16(tv);
    for (int i = 0; i < HD / 16; i++) store16(part + 2 + 16 * i, acc[i]);
}

#define HEAD_PART(HD, KVT) head_part(q, kb, vb, table, p0, p1, d->block_size, stride, d->scale, HD, KVT, sc, pj)
#define HEAD_PART_KV(HD)                                                                                       \
    switch (d->kv_dtype) {                                                                                     \
    case KV_F16: HEAD_PART(HD, KV_F16); break;                                                                 \
    case KV_BF16: HEAD_PART(HD, KV_BF16); break;                                                               \
    default: HEAD_PART(HD, KV_F32);                                                                            \
    }

static void attend_part(const float *qrow, const void *kc, const void *vc, const int64_t *table, int p0, int p1,
                        const Dims *d, int kv, float *part /* [G][2 + hd] */) {
    int hd = d->head_dim, g = d->heads / d->kv_heads;
    size_t stride = (size_t)d->kv_heads * hd; /* elements from one slot to the next */
    float *sc = scratch(2, (size_t)((p1 - p0 + 15) & ~15));
    size_t elem = KV_BYTES[d->kv_dtype];
    const void *kb = (const char *)kc + (size_t)kv * hd * elem, *vb = (const char *)vc + (size_t)kv * hd * elem;
    for (int j = 0; j < g; j++) {
        const float *q = qrow + ((size_t)kv * g + j) * hd; /* the group's G query heads, consecutive */
        float *pj = part + (size_t)j * (2 + hd);
        switch (hd) {
        case 64: HEAD_PART_KV(64); break;
        case 128: HEAD_PART_KV(128); break;
        default: HEAD_PART_KV(16 * (hd / 16));
        }
    }
}

/* out [hd] = the softmax-weighted sum from `splits` partials of one head (stride between them). */
static void merge(const float *part, int splits, size_t stride, int hd, float *out) {
    float mx = -INFINITY, den = 0.f;
    for (int s = 0; s < splits; s++) mx = part[s * stride] > mx ? part[s * stride] : mx;
    for (int i = 0; i < hd; i++) out[i] = 0.f;
    for (int s = 0; s < splits; s++) {
        const float *ps = part + s * stride;
        if (ps[1] == 0.f) continue; /* an empty range */
        float w = expf(ps[0] - mx);
        den += ps[1] * w;
        for (int i = 0; i < hd; i++) out[i] += ps[2 + i] * w;
    }
    for (int i = 0; i < hd; i++) out[i] /= den;
}

/* att [b, heads * hd] = attention of the queries (row r at proj + r * row_width, heads * hd floats)
 * over the pool's K/V slices kc/vc [blocks, BS, kv_heads, hd]; row r reads ctx[r] slots through
 * tables + r * width. Exported for the tests (the decode step calls it on its qkv rows). */
void decode_attention(const float *proj, size_t row_width, const void *kc, const void *vc, const int64_t *tables,
                      int width, const int64_t *ctx, int b, const Dims *d, float *att) {
    int hd = d->head_dim, kvh = d->kv_heads, g = d->heads / kvh, qs = d->heads * hd;
    int longest = 0;
    for (int r = 0; r < b; r++) longest = ctx[r] > longest ? (int)ctx[r] : longest;
    int splits = (longest + SPLIT - 1) / SPLIT;
    size_t head_part = 2 + (size_t)hd;
    /* parts [b][kvh][splits][g][2 + hd] */
    float *parts = scratch(5, (size_t)b * kvh * splits * g * head_part);
#pragma omp parallel for schedule(static) collapse(3) num_threads(threads())
    for (int r = 0; r < b; r++)
        for (int kv = 0; kv < kvh; kv++)
            for (int sp = 0; sp < splits; sp++) {
                float *part = parts + (((size_t)r * kvh + kv) * splits + sp) * g * head_part;
                int p0 = sp * SPLIT, p1 = p0 + SPLIT < ctx[r] ? p0 + SPLIT : (int)ctx[r];
                if (p0 >= p1) {
                    for (int j = 0; j < g; j++) part[j * head_part] = -INFINITY, part[j * head_part + 1] = 0.f;
                    continue;
                }
                attend_part(proj + r * row_width, kc, vc, tables + (size_t)r * width, p0, p1, d, kv, part);
            }
    for (int r = 0; r < b; r++)
        for (int kv = 0; kv < kvh; kv++)
            for (int j = 0; j < g; j++)
                merge(parts + (((size_t)r * kvh + kv) * splits) * g * head_part + j * head_part, splits,
                      g * head_part, hd, att + (size_t)r * qs + ((size_t)kv * g + j) * hd);
}

/* x [B, hidden] in/out (the stage's hidden states); cos/sin [B, D]; slots [B]; tables [B, width];
 * ctx [B] (context lengths, new token included); kv: the stage's float32 pool. */
void decode_step(const Dims *d, const Layer *layers, int n_layers, int b, float *x, const float *cos,
                 const float *sin, const int64_t *slots, const int64_t *tables, int width, const int64_t *ctx,
                 void *kv) {
    int h = d->hidden, hd = d->head_dim, qs = d->heads * hd, ks = d->kv_heads * hd;
    int wide = qs + 2 * ks > 2 * d->inter ? qs + 2 * ks : 2 * d->inter;
    int widest_in = h > d->inter ? h : d->inter;
    widest_in = widest_in > qs ? widest_in : qs;
    float *norm = scratch(3, (size_t)b * (wide + qs + widest_in + h + d->inter));
    float *proj = norm + (size_t)b * h;      /* [B, wide] qkv or gate_up */
    float *att = proj + (size_t)b * wide;    /* [B, qs] */
    float *xp = att + (size_t)b * qs;        /* [B, widest_in] matmul reorder room */
    float *act = xp + (size_t)b * widest_in; /* [B, inter] */
    size_t layer_elems = (size_t)d->blocks * d->block_size * ks;
    for (int l = 0; l < n_layers; l++) {
        const Layer *ly = &layers[l];
        char *kc = (char *)kv + (size_t)l * 2 * layer_elems * KV_BYTES[d->kv_dtype];
        char *vc = kc + layer_elems * KV_BYTES[d->kv_dtype];
        rms_norm(x, ly->input_norm, norm, b, h, d->eps);
        matmul(norm, xp, b, &ly->qkv, proj);
        for (int r = 0; r < b; r++) {
            float *row = proj + (size_t)r * (qs + 2 * ks);
            for (int hh = 0; hh < d->heads + d->kv_heads; hh++) rotate(row + hh * hd, cos + r * hd, sin + r * hd, hd);
            kv_store(kc, (size_t)slots[r] * ks, row + qs, ks, d->kv_dtype);
            kv_store(vc, (size_t)slots[r] * ks, row + qs + ks, ks, d->kv_dtype);
        }
        decode_attention(proj, (size_t)qs + 2 * ks, kc, vc, tables, width, ctx, b, d, att);
        matmul(att, xp, b, &ly->o, proj);
        for (size_t i = 0; i < (size_t)b * h; i++) x[i] += proj[i];
        rms_norm(x, ly->post_norm, norm, b, h, d->eps);
        matmul(norm, xp, b, &ly->gate_up, proj);
        for (int r = 0; r < b; r++) {
            const float *g = proj + (size_t)r * 2 * d->inter, *u = g + d->inter;
            float *a = act + (size_t)r * d->inter;
            for (int i = 0; i < d->inter; i += 16) {
                v16 gv = load16(g + i);
                store16(a + i, gv / (1.f + vexp(-gv)) * load16(u + i));
            }
        }
        matmul(act, xp, b, &ly->down, proj);
        for (size_t i = 0; i < (size_t)b * h; i++) x[i] += proj[i];
    }
}
