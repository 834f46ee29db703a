/* 8-bit-class blocks on AVX-512 VNNI (dense.c's q8_matmul where the CPU has it): Q6_K at every row
 * count, and the int8 blocks of 32 (Q8_0, Q5_0, Q5_1, Q5_K) up to INT_ROWS rows of x. The weight
 * stays in its one layout (Q6_K's 6-bit packing is unpacked 64 values a vector, in registers).
 *
 * x is rounded as prefill.c rounds it: per 32-element block xq = round(x / dx), dx = max|x| / 32639,
 * held as two int8 planes (xq = 256 hi + lo, hi in [-127, 127], lo in [-128, 127]), so it keeps the
 * int16 path's precision (1/65278 of the block's largest value) at two vpdpbusd per 64 weights.
 * vpdpbusd multiplies unsigned bytes by signed ones: the weight is the unsigned side, u = q + c
 * (Q6_K: its stored 6-bit value, c = 32; int8 blocks: q xor 0x80 = q + 128, c = 128), and
 *     sum_k w x = sum_blocks s dx (sum u xq - c sum xq)  (+ mn dx sum xq for a min per 32)
 * with s the block's scale (Q6_K: d sc per 16, an exact float32 product; else d per 32).
 *
 * One int32 lane of a vector holds the dot of 4 consecutive k's (64 k's a vector), so a lane lies in
 * one block of 16 (Q6_K: lane j of vector v in block 4v + j/4) or 32 (2v + j/8); its float is
 * weighed by s dx of its block, permuted to the lanes from 16 blocks' worth computed at once. The
 * integer sums are exact: |hi dot| <= 4 * 255 * 127 per lane, so 256 hi + lo < 2^26 (Q6_K: < 2^23,
 * exact in float too; the int8 blocks' lane float rounds at 2^-24 of the lane, far below x's
 * rounding). Per output: |err| <= sum_k |w| * max|x block| / 65278 (tests/kernels/test_native.py).
 *
 * Why: Q6_K's packing unpacked to int16 for AVX2's madd (dense.c) ran a Q4_K_M file at 0.70x and a
 * Q6_K one at 0.47x the Q4_1 path's decode (benchmarks/RESULTS.md, issue 28, point 3).
 */
#include "native.h"

#if VNNI512

#define XQ_MAX 32639 /* 127 * 256 + 127, as prefill.c */
#define Q6K_QBYTES 192
#define Q6K_SBYTES 20

/* x's rounding, per row: int8 planes [K], and per block its dx and the sum of its xq (an integer,
 * exact in float32: |sum| <= 32 * XQ_MAX < 2^24), per 16 (Q6_K's blocks) and per 32. */
typedef struct {
    int8_t *hi, *lo;
    float *dx16, *s16; /* [m, K/16]: dx of the 32-block holding it, the 16's sum of xq */
    float *dx32, *s32; /* [m, K/32] */
} XV;

/* x [M, K] (K % 32 == 0) -> XV in the calling thread's scratch slot 8 (valid until its next call). */
static XV quantize_xv(const float *x, int m, int k) {
    int b16 = k / 16, b32 = k / 32;
    float *room = scratch(8, (size_t)m * (k / 2 + 2 * b16 + 2 * b32));
    XV out = {(int8_t *)room, (int8_t *)room + (size_t)m * k, room + (size_t)m * k / 2, NULL, NULL, NULL};
    out.s16 = out.dx16 + (size_t)m * b16;
    out.dx32 = out.s16 + (size_t)m * b16;
    out.s32 = out.dx32 + (size_t)m * b32;
    const __m512 sign = _mm512_set1_ps(-0.f);
#pragma omp parallel for schedule(static) num_threads(threads()) if (m > SMALL_M)
    for (int i = 0; i < m; i++)
        for (int b = 0; b < b32; b++) {
            const float *v = x + (size_t)i * k + b * 32;
            __m512 a0 = _mm512_loadu_ps(v), a1 = _mm512_loadu_ps(v + 16);
            float mx = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, a0), _mm512_andnot_ps(sign, a1)));
            float d = mx / (float)XQ_MAX, inv = mx > 0.f ? (float)XQ_MAX / mx : 0.f;
            size_t at = (size_t)i * k + b * 32;
            int sums[2];
            for (int h = 0; h < 2; h++) {
                __m512i xq = _mm512_cvtps_epi32(_mm512_mul_ps(h ? a1 : a0, _mm512_set1_ps(inv))); /* nearest */
                __m512i hi = _mm512_srai_epi32(_mm512_add_epi32(xq, _mm512_set1_epi32(128)), 8);
                __m512i lo = _mm512_sub_epi32(xq, _mm512_slli_epi32(hi, 8));
                _mm_storeu_si128((__m128i *)(out.hi + at + 16 * h), _mm512_cvtepi32_epi8(hi));
                _mm_storeu_si128((__m128i *)(out.lo + at + 16 * h), _mm512_cvtepi32_epi8(lo));
                sums[h] = _mm512_reduce_add_epi32(xq);
                out.dx16[(size_t)i * b16 + 2 * b + h] = d;
                out.s16[(size_t)i * b16 + 2 * b + h] = (float)sums[h];
            }
            out.dx32[(size_t)i * b32 + b] = d;
            out.s32[(size_t)i * b32 + b] = (float)(sums[0] + sums[1]);
        }
    return out;
}

/* acc + (the 64 k's dot of u with x's planes at xh, xl) * the lanes' block scales: lane j takes
 * t[idx[j]] (t: s dx of 16 blocks). */
static inline __m512 dot64(__m512 acc, __m512i u, __m512i xh, __m512i xl, __m512 t, __m512i idx) {
    __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, xh);
    d = _mm512_dpbusd_epi32(_mm512_slli_epi32(d, 8), u, xl); /* 256 hi + lo, exact */
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_permutexvar_ps(idx, t), acc);
}

/* A Q6_K super-block's 128 values 128 h .. 128 h + 127 as their stored 6-bit values (q + 32): u0 the
 * first 64 (quarters j = 0, 1: ql's low nibbles, qh's bits 0-1 and 2-3), u1 the next 64 (j = 2, 3:
 * the high nibbles, qh's bits 4-5 and 6-7). Layout: dense.c. The 2-bit fields go to bits 4-5 by a
 * shift per 256-bit half (16-bit shifts: bits crossing into the next byte are masked off). */
static inline void q6k_unpack(const uint8_t *b, int h, __m512i *u0, __m512i *u1) {
    const __m512i m0f = _mm512_set1_epi8(15), m30 = _mm512_set1_epi8(48);
    __m512i ql = _mm512_loadu_si512(b + 64 * h);
    __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h)));
    /* per 256-bit half (16-bit lanes): j = 0 takes bits 0-1 << 4, j = 1 bits 2-3 << 2; j = 2 bits 4-5
     * as they are, j = 3 bits 6-7 >> 2 */
    const __m512i up = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
    const __m512i down = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
    *u0 = _mm512_or_si512(_mm512_and_si512(ql, m0f), _mm512_and_si512(_mm512_sllv_epi16(qh, up), m30));
    *u1 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), m0f),
                          _mm512_and_si512(_mm512_srlv_epi16(qh, down), m30));
}

/* The lanes' block within a vector (+ 4v for Q6_K's vector v, + 2v for the int8 blocks' v). */
static inline __m512i lanes16(int v) { /* lane j -> block of 16: 4v + j / 4 */
    return _mm512_add_epi32(_mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0), _mm512_set1_epi32(4 * v));
}
static inline __m512i lanes32(int v) { /* lane j -> block of 32: 2v + j / 8 */
    return _mm512_add_epi32(_mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0), _mm512_set1_epi32(2 * v));
}

/* y[i, r] for output rows [n0, n1) and m (<= SMALL_M, a constant when inlined) rows of x. Per row of x
 * three float vectors: acc (the blocks' dots times s dx), off (s dx times the blocks' sums of xq,
 * times -c at the end), mins (mn dx sum xq). */
static inline __attribute__((always_inline)) void vnni_rows(const XV *x, const int m, int k, const uint8_t *q,
                                                            const float *d, const float *mn, const int sub,
                                                            int n0, int n1, int n, const float *bias, float *y) {
    const int b16 = k / 16, b32 = k / 32;
    for (int r = n0; r < n1; r++) {
        __m512 acc[SMALL_M], off[SMALL_M], mins[SMALL_M];
        for (int i = 0; i < m; i++) acc[i] = off[i] = mins[i] = _mm512_setzero_ps();
        if (sub == 16) { /* Q6_K: super-blocks of 256, 16 blocks of 16, 4 vectors */
            const uint8_t *qr = q + (size_t)r * (k / 256) * Q6K_QBYTES;
            const uint8_t *sr = (const uint8_t *)d + (size_t)r * (k / 256) * Q6K_SBYTES;
            for (int sb = 0; sb < k / 256; sb++) {
                const uint8_t *ss = sr + (size_t)sb * Q6K_SBYTES;
                float dd;
                memcpy(&dd, ss, sizeof dd);
                /* the 16 blocks' scales d sc (exact) */
                __m512 s = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(ss + 4)))),
                                         _mm512_set1_ps(dd));
                __m512 t[SMALL_M];
                for (int i = 0; i < m; i++) {
                    size_t at = (size_t)i * b16 + sb * 16;
                    t[i] = _mm512_mul_ps(s, _mm512_loadu_ps(x->dx16 + at));
                    off[i] = _mm512_fmadd_ps(t[i], _mm512_loadu_ps(x->s16 + at), off[i]);
                }
                for (int h = 0; h < 2; h++) {
                    __m512i u0, u1;
                    q6k_unpack(qr + (size_t)sb * Q6K_QBYTES, h, &u0, &u1);
                    for (int i = 0; i < m; i++) {
                        size_t at = (size_t)i * k + sb * 256 + 128 * h;
                        acc[i] = dot64(acc[i], u0, _mm512_loadu_si512(x->hi + at), _mm512_loadu_si512(x->lo + at),
                                       t[i], lanes16(2 * h));
                        acc[i] = dot64(acc[i], u1, _mm512_loadu_si512(x->hi + at + 64),
                                       _mm512_loadu_si512(x->lo + at + 64), t[i], lanes16(2 * h + 1));
                    }
                }
            }
        } else { /* int8 blocks of 32: 16 blocks (8 vectors) at a time, the last group masked */
            const int8_t *qr = (const int8_t *)q + (size_t)r * k;
            const float *dr = d + (size_t)r * b32, *mr = mn ? mn + (size_t)r * b32 : NULL;
            const __m512i flip = _mm512_set1_epi8((char)0x80);
            for (int b0 = 0; b0 < b32; b0 += 16) {
                int nb = b32 - b0 < 16 ? b32 - b0 : 16;
                __mmask16 bm = (__mmask16)((1u << nb) - 1);
                __m512 s = _mm512_maskz_loadu_ps(bm, dr + b0);
                __m512 mv = mr ? _mm512_maskz_loadu_ps(bm, mr + b0) : _mm512_setzero_ps();
                __m512 t[SMALL_M];
                for (int i = 0; i < m; i++) {
                    size_t at = (size_t)i * b32 + b0;
                    __m512 dx = _mm512_maskz_loadu_ps(bm, x->dx32 + at), sum = _mm512_maskz_loadu_ps(bm, x->s32 + at);
                    t[i] = _mm512_mul_ps(s, dx);
                    off[i] = _mm512_fmadd_ps(t[i], sum, off[i]);
                    if (mr) mins[i] = _mm512_fmadd_ps(mv, _mm512_mul_ps(dx, sum), mins[i]);
                }
                for (int v = 0; 2 * v < nb; v++) {
                    /* a last vector of one block: its upper 32 bytes zero in x and in u's place */
                    __mmask64 km = 2 * v + 1 < nb ? ~0ULL : 0xffffffffULL;
                    const int8_t *qv = qr + (size_t)(b0 + 2 * v) * 32;
                    __m512i u = _mm512_xor_si512(_mm512_maskz_loadu_epi8(km, qv), flip);
                    for (int i = 0; i < m; i++) {
                        size_t at = (size_t)i * k + (size_t)(b0 + 2 * v) * 32;
                        acc[i] = dot64(acc[i], u, _mm512_maskz_loadu_epi8(km, x->hi + at),
                                       _mm512_maskz_loadu_epi8(km, x->lo + at), t[i], lanes32(v));
                    }
                }
            }
        }
        const float c = sub == 16 ? 32.f : 128.f;
        for (int i = 0; i < m; i++)
            y[(size_t)i * n + r] = _mm512_reduce_add_ps(acc[i]) - c * _mm512_reduce_add_ps(off[i]) +
                                   _mm512_reduce_add_ps(mins[i]) + (bias ? bias[r] : 0.f);
    }
}

static void vnni_rows_any(const XV *x, int m, int k, const uint8_t *q, const float *d, const float *mn, int sub,
                          int n0, int n1, int n, const float *bias, float *y) {
    for (int i0 = 0; i0 < m; i0 += SMALL_M) {
        int b16 = k / 16, b32 = k / 32;
        size_t e = (size_t)i0 * k;
        XV xi = {x->hi + e, x->lo + e, x->dx16 + (size_t)i0 * b16, x->s16 + (size_t)i0 * b16,
                 x->dx32 + (size_t)i0 * b32, x->s32 + (size_t)i0 * b32};
        float *yi = y + (size_t)i0 * n;
#define VNNI_ROWS(M)                                                                                                  \
    do {                                                                                                              \
        if (sub == 16)                                                                                                \
            vnni_rows(&xi, M, k, q, d, mn, 16, n0, n1, n, bias, yi);                                                  \
        else                                                                                                          \
            vnni_rows(&xi, M, k, q, d, mn, 32, n0, n1, n, bias, yi);                                                  \
    } while (0)
        WITH_CONSTANT_ROWS(m - i0, VNNI_ROWS)
#undef VNNI_ROWS
    }
}

/* y [M, N] = x [M, K] @ W^T (+ bias), W as dense.c's q8_matmul takes it (sub 16: Q6_K's packing and
 * scales; sub 32: int8 [N, K], float32 d and optional mins per 32). */
void q8_matmul_vnni(const float *x, int m, int k, const int8_t *q, const float *d, const float *mn, int sub, int n,
                    const float *bias, float *y) {
    XV xv = quantize_xv(x, m, k);
    int per = 16, tasks = (n + per - 1) / per;
#pragma omp parallel for schedule(static) num_threads(threads())
    for (int t = 0; t < tasks; t++) {
        int n0 = t * per, n1 = n0 + per < n ? n0 + per : n;
        vnni_rows_any(&xv, m, k, (const uint8_t *)q, d, mn, sub, n0, n1, n, bias, y);
    }
}

#endif
