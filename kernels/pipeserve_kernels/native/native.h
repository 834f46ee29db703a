/* Shared by the native CPU kernels (native/__init__.py compiles common.c, q4.c, dense.c and
 * decode.c into one library; ctypes calls it, so every exported argument is a plain pointer or
 * number): 16-float vectors (GCC vector extensions: AVX-512, or two AVX2 halves), their helpers, the
 * per-thread scratch and thread count, and the row-blocked products the weight kinds share.
 *
 * Threads: OpenMP, whose runtime is the one torch loaded (same soname); each region takes
 * threads(). Scratch is grow-only and per thread; nothing allocates per call once warm.
 */
#ifndef PIPESERVE_NATIVE_H
#define PIPESERVE_NATIVE_H

#include <math.h>
#include <omp.h>
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif
#include <stddef.h>
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

/* The CPU's own float vector, VL lanes: 16 with AVX-512, else 8. Without AVX-512 GCC has no machine
 * mode for a 64-byte vector, so v16 code there is lowered through memory (the float32 product ran
 * 4-8x slower on an AVX2-only CPU: benchmarks/RESULTS.md, issue 27); every loop that runs on such a
 * CPU (the decode step, the float32 product, prefill.c's quantization of x) steps by VL on vf. v16 is kept
 * for 16-element units (a 32-element block's nibble halves) on paths AVX2 CPUs do not take. */
#if defined(__AVX512F__)
#define VL 16
#else
#define VL 8
#endif
typedef float vf __attribute__((vector_size(VL * 4)));
typedef int32_t vfi __attribute__((vector_size(VL * 4)));

static inline vf loadv(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void storev(float *p, vf v) { memcpy(p, &v, sizeof v); }

static inline float hsumv(vf v) { /* a tree, not VL dependent adds */
#if VL == 16
    v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#else
    v8 a = v;
#endif
    v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
}

/* Lane-wise select (C has no vector ?:): mask lanes are -1 (take a) or 0 (take b). */
static inline vf vsel(vfi mask, vf a, vf b) { return (vf)(((vfi)a & mask) | ((vfi)b & ~mask)); }
static inline vf vmax(vf a, vf b) { return vsel(a > b, a, b); }
static inline vf vmin(vf a, vf b) { return vsel(a < b, a, b); }

/* exp over VL lanes (Cephes' expf polynomial, ~1 ulp on [-87, 88]); inputs below -87 give ~0. */
static inline vf vexp(vf x) {
    const vf zero = {0};
    x = vmin(vmax(x, zero - 87.f), zero + 88.f);
    vf t = x * 1.44269504088896341f;
    vf n = __builtin_convertvector(__builtin_convertvector(t, vfi), vf);
    n += __builtin_convertvector(n > t, vf);         /* floor(t): true lanes are -1 */
    n -= __builtin_convertvector(t - n >= 0.5f, vf); /* nearest */
    vf r = x - n * 0.693359375f + n * 2.12194440e-4f;
    vf p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    vf e = p * r * r + r + 1.f;
    vfi bits = (__builtin_convertvector(n, vfi) + 127) << 23;
    return e * (vf)bits;
}

static inline float bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* 16 nibble values q -> the floats q - 8 (exact), the factor the scale multiplies. */
static inline v16 nibbles(v16b q) { return __builtin_convertvector(__builtin_convertvector(q, v16i) - 8, v16); }

/* The threads of a parallel region (common.c): the caller's set_threads, else libgomp's default. */
int threads(void);

/* Grow-only per-thread buffer `slot` of at least n floats, 64-byte aligned (common.c). Slots: 0
 * weight tiles, 1 reordered x, 2 attention scores, 3 decode-step activations, 4 int16 x,
 * 5 attention partials, 6 x's int8 planes (prefill.c), 7 a mixed fused projection's part (decode.c),
 * 8 x's int8 planes for vnni.c. */
#define SCRATCH_SLOTS 9
float *scratch(int slot, size_t n);

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
/* Up to this many rows of x, the fused path (x in int16 on AVX2, each weight chunk unpacked in
 * registers); above, on AVX2, prefill.c (x's int16 rounding as two int8 planes, weight tiles repacked
 * per call), whose repack costs about 4 rows of products. Where it wins, per 4 projections of the
 * default model (benchmarks/RESULTS.md, issue 27): with VNNI from 5 rows (1.2x; 1.8x at 16); with
 * AVX2's maddubs, two ops per dot step, only from ~12 rows (measured by an AVX2 build). */
#if defined(__AVX512VNNI__) || defined(__AVXVNNI__)
#define INT_ROWS 4
#else
#define INT_ROWS 12
#endif

void tile_matmul(const float *xp, int m, int k, const float *tile, int rows, int n0, int n,
                        const float *bias, float *y);

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

/* xp [m, K] -> per 32-element chunk, int16 values, their scale and their float sum, held in the
 * calling thread's scratch slot 4 (valid until its next call). */
QX quantize_x(const float *xp, int m, int k);

/* The rows of x from row i0 on. */
static inline QX qx_rows(const QX *x, int i0, int k) {
    return (QX){x->q + (size_t)i0 * k, x->dx + (size_t)i0 * (k / 32), x->sum + (size_t)i0 * (k / 32)};
}
#endif

/* Integer products for more than INT_ROWS rows (prefill.c): x rounded to int16 per 32 elements and
 * held as two int8 planes, the CPU's u8 x s8 dot product (VNNI, else AVX2's maddubs). Needs AVX2. */
#if defined(__AVX2__)
#define PREFILL_INT8 1
void q4_matmul_int8(const float *x, int m, int k, const uint8_t *q, const uint16_t *s, const uint16_t *z, int n,
                    int g, const float *bias, float *y);
void q8_matmul_int8(const float *x, int m, int k, const int8_t *q, const float *d, const float *mn, int n,
                    const float *bias, float *y);
#else
#define PREFILL_INT8 0
#endif

/* The weight kinds' products (q4.c, dense.c), y [M, N] = x [M, K] @ W^T (+ bias). */
void q4_matmul_into(const float *x, float *xp, int m, int k, const uint8_t *q, const uint16_t *s,
                           const uint16_t *z, int n, int g, const float *bias, float *y);
/* 8-bit blocks: w[n, k] = q[n, k] * d[n, k / sub] (+ mn[n, k / 32] where mn is not NULL), sub 16 or 32:
 * Q8_0 (sub 32, no mins) and the int8 form of GGUF's Q5_0, Q5_1, Q5_K (sub 32, mins); sub 16 is Q6_K
 * (no mins), q its own 6-bit packing and d its scales per 256 (a float32, 16 int8 sub-scales; dense.c). */
void q8_matmul(const float *x, int m, int k, const int8_t *q, const float *d, const float *mn, int sub, int n,
               const float *bias, float *y);
void f32_matmul(const float *x, int m, int k, const float *w, int n, const float *bias, float *y);

/* AVX-512 VNNI (vnni.c): q8_matmul's blocks on vpdpbusd, x as prefill.c's two int8 planes per 32; dense.c
 * sends it Q6_K at every row count and the blocks of 32 up to INT_ROWS rows. */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define VNNI512 1
void q8_matmul_vnni(const float *x, int m, int k, const int8_t *q, const float *d, const float *mn, int sub, int n,
                    const float *bias, float *y);
#else
#define VNNI512 0
#endif

#endif
