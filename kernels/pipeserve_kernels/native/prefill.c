/* Integer products for more than INT_ROWS rows of x (prefill chunks, decode batches): 4-bit and
 * Q8_0 weights times x rounded to int16 per block and held as two int8 planes, with the CPU's int8
 * dot product (AVX-512 VNNI's vpdpbusd where the CPU has it, AVX-VNNI on 256 bits, else AVX2's
 * maddubs + madd).
 *
 * x: per 32-element block, xq = round(x / dx) in [-32639, 32639], dx = max|x| / 32639, and
 * sx = dx * sum xq (quantize_x8). A block's product with a weight row w = q s + m (q unsigned 8-bit,
 * s and m per block) is then
 *     sum_k w x  ~=  s dx sum_k q xq  +  m sx
 * 4-bit (quant.py's nibbles): q = the nibble, s the group's scale, m = z - 8 s.
 * Q8_0: with VNNI q = w + 128 (vpdpbusd multiplies unsigned by signed) and m = -128 d; on AVX2
 * q = w itself, multiplied as |x| times w with x's sign (maddubs would saturate on w + 128), m = 0.
 *
 * Weights are repacked per tile of W output rows (W = the vector's int32 lanes) so that one lane
 * is one output row: a vector holds 4 consecutive k's of each of the W rows, and one dot step adds
 * x's 4 bytes at those k's (broadcast to every lane) times them into each row's int32 sum. A block
 * of 32 k's is 8 such steps per plane of x, then one scale and one offset FMA per row of x: no
 * horizontal sums until the end. The repack costs about 4 rows of products: it is done per call,
 * into per-thread scratch, so the weights keep their one layout (the decode kernels' and Triton's).
 *
 * Rounding: x's int16 rounding bounds the error per output by sum_k |w| * max|x block| / 65278
 * (tests/kernels/test_native.py); the sums are exact integers up to the float scaling.
 */
#include "native.h"

#if PREFILL_INT8

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define W 16
typedef __m512i rowi; /* one int32 lane per output row of a tile */
typedef __m512 rowf;
#define LOADI(p) _mm512_loadu_si512((const void *)(p))
#define SET1I(v) _mm512_set1_epi32(v)
#define ZEROI() _mm512_setzero_si512()
#define ANDI(a, b) _mm512_and_si512(a, b)
#define ADDI(a, b) _mm512_add_epi32(a, b)
#define SLLI32(a, n) _mm512_slli_epi32(a, n)
#define SRLI16(a, n) _mm512_srli_epi16(a, n)
#define SET1B(v) _mm512_set1_epi8(v)
#define DOT(acc, u, s) _mm512_dpbusd_epi32(acc, u, s)
#define LOADF(p) _mm512_loadu_ps(p)
#define SET1F(v) _mm512_set1_ps(v)
#define ZEROF() _mm512_setzero_ps()
#define FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define CVT(a) _mm512_cvtepi32_ps(a)
#define STOREF(p, v) _mm512_storeu_ps(p, v)
#define Q8_VNNI 1
#else
#define W 8
typedef __m256i rowi;
typedef __m256 rowf;
#define LOADI(p) _mm256_loadu_si256((const __m256i *)(p))
#define SET1I(v) _mm256_set1_epi32(v)
#define ZEROI() _mm256_setzero_si256()
#define ANDI(a, b) _mm256_and_si256(a, b)
#define ADDI(a, b) _mm256_add_epi32(a, b)
#define SLLI32(a, n) _mm256_slli_epi32(a, n)
#define SRLI16(a, n) _mm256_srli_epi16(a, n)
#define SET1B(v) _mm256_set1_epi8(v)
#if defined(__AVXVNNI__)
#define DOT(acc, u, s) _mm256_dpbusd_avx_epi32(acc, u, s)
#define Q8_VNNI 1
#else /* u8 x s8 pairs to s16 (no saturation: q <= 127 and |x| <= 128 here, 2 * 127 * 128 < 32767), then s32 */
#define DOT(acc, u, s) _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)))
#define Q8_VNNI 0
#endif
#define LOADF(p) _mm256_loadu_ps(p)
#define SET1F(v) _mm256_set1_ps(v)
#define ZEROF() _mm256_setzero_ps()
#define FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define CVT(a) _mm256_cvtepi32_ps(a)
#define STOREF(p, v) _mm256_storeu_ps(p, v)
#endif

#define MR SMALL_M /* rows of x per pass over a tile: each weight vector loaded feeds MR dot steps */

/* x [M, K] -> per block of 32, x's int16 rounding as two int8 planes (XQ8, in the calling thread's
 * scratch slot 6): xq = round(x / dx) with dx = max|x| / 32639, split xq = 256 hi + lo with
 * hi = round(xq / 256) in [-127, 127] and lo in [-128, 127]. The dot product takes a plane at a time
 * (sum q xq = 256 sum q hi + sum q lo, exact in int32), so x keeps the int16 path's precision
 * (1/65278 of its block's largest value) at two int8 dot steps per k-quad: one plane alone, as
 * llama.cpp's Q8_1 activations, lost the default model 1.5 % of its teacher-forced agreement with
 * the float32 model (99.4 -> 97.9 %; benchmarks/RESULTS.md, issue 27). */
#define XQ_MAX 32639 /* 127 * 256 + 127 */
typedef struct {
    int8_t *hi, *lo; /* [M, K] each */
    float *dx;       /* [M, K/32] */
    float *sx;       /* [M, K/32]: dx * sum of the block's xq */
} XQ8;

static XQ8 quantize_x8(const float *x, int m, int k) {
    int blocks = k / 32;
    float *room = scratch(6, (size_t)m * (k / 2 + 2 * blocks));
    XQ8 out = {(int8_t *)room, (int8_t *)room + (size_t)m * k, room + (size_t)m * k / 2,
               room + (size_t)m * (k / 2 + blocks)};
#pragma omp parallel for schedule(static) num_threads(threads())
    for (int i = 0; i < m; i++)
        for (int b = 0; b < blocks; b++) {
            const float *v = x + (size_t)i * k + b * 32;
            vf amax = {0};
            for (int j = 0; j < 32; j += VL) amax = vmax(amax, vmax(loadv(v + j), -loadv(v + j)));
            float mx = 0.f;
            for (int j = 0; j < VL; j++) mx = amax[j] > mx ? amax[j] : mx;
            float d = mx / (float)XQ_MAX, inv = d > 0.f ? (float)XQ_MAX / mx : 0.f;
            size_t at = (size_t)i * k + b * 32;
            typedef int8_t vq __attribute__((vector_size(VL)));
            const vf zero = {0};
            vfi sums = {0};
            for (int j = 0; j < 32; j += VL) {
                vf r = loadv(v + j) * inv; /* in [-XQ_MAX, XQ_MAX]; round half away from zero */
                vfi xq = __builtin_convertvector(r + vsel(r < zero, zero - 0.5f, zero + 0.5f), vfi);
                vfi hi = (xq + 128) >> 8; /* arithmetic: round(xq / 256), halves up */
                vq h = __builtin_convertvector(hi, vq), l = __builtin_convertvector(xq - (hi << 8), vq);
                memcpy(out.hi + at + j, &h, sizeof h);
                memcpy(out.lo + at + j, &l, sizeof l);
                sums += xq;
            }
            int sum = 0;
            for (int e = 0; e < VL; e++) sum += sums[e];
            out.dx[(size_t)i * blocks + b] = d;
            out.sx[(size_t)i * blocks + b] = d * (float)sum;
        }
    return out;
}

/* A tile of W weight rows, repacked: per block, `steps` vectors of W lanes x 4 bytes, then the
 * rows' scales s [W] and offsets m [W] (float32). Rows past n are zeros (their outputs dropped). */
typedef struct {
    const uint8_t *q;
    const float *s, *m;
    int steps; /* vectors per block: 4 (4-bit: two k-quads per byte) or 8 (Q8_0) */
} Tile;

/* Row r's block b into the tile: its `steps` k-quads (out, 4 bytes each) to lane r of the block's
 * vectors, its scale and offset to lane r of the block's s and m. */
static inline void place(uint8_t *dst, float *sv, float *mv, int steps, int b, int r, const uint8_t *out, float sc,
                         float mc) {
    for (int p = 0; p < steps; p++) memcpy(dst + ((size_t)(b * steps + p) * W + r) * 4, out + 4 * p, 4);
    sv[(size_t)b * W + r] = sc;
    mv[(size_t)b * W + r] = mc;
}

/* 4-bit rows [n0, n0 + W) of quant.py's nibble layout: block b's vector p holds, in lane r, the
 * nibbles of k = 32b + 4p + t (low) and 32b + 16 + 4p + t (high), t = 0..3. In the source, element
 * e of a block is nibble e % 2 of byte e / 2, so byte pair j of the lane (bytes 2j, 2j+1 of the 16
 * per row and block) is (A_j lo | B_j lo << 4, A_j hi | B_j hi << 4), A = bytes 0..7, B = 8..15. */
static Tile repack_q4(const uint8_t *q, const uint16_t *s, const uint16_t *z, int n, int k, int g, int n0,
                      uint8_t *room) {
    int blocks = k / 32;
    uint8_t *dst = room;
    float *sv = (float *)(room + (size_t)blocks * 4 * W * 4), *mv = sv + (size_t)blocks * W;
    for (int r = 0; r < W; r++) {
        int row = n0 + r;
        for (int b = 0; b < blocks; b++) {
            uint8_t out[16] = {0};
            float sc = 0.f, mc = 0.f;
            if (row < n) {
                const uint8_t *src = q + (size_t)row * (k / 2) + b * 16;
                /* bytes 2j, 2j+1 = (A_j lo | B_j lo << 4, A_j hi | B_j hi << 4): A the low 8 bytes, B the high */
                __m128i v = _mm_loadu_si128((const __m128i *)src), nib = _mm_set1_epi8(15);
                __m128i bsh = _mm_srli_si128(v, 8);
                __m128i lo = _mm_or_si128(_mm_and_si128(v, nib), _mm_slli_epi16(_mm_and_si128(bsh, nib), 4));
                __m128i hi = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(v, 4), nib), _mm_andnot_si128(nib, bsh));
                _mm_storeu_si128((__m128i *)out, _mm_unpacklo_epi8(lo, hi));
                int gi = (b * 32) / g;
                sc = bf16(s[(size_t)row * (k / g) + gi]);
                mc = bf16(z[(size_t)row * (k / g) + gi]) - 8.f * sc;
            }
            place(dst, sv, mv, 4, b, r, out, sc, mc);
        }
    }
    return (Tile){dst, sv, mv, 4};
}

/* Q8_0 rows [n0, n0 + W): block b's vector p holds, in lane r, k = 32b + 4p + t (t = 0..3), as
 * w + 128 (VNNI) or w itself (AVX2: x's sign is moved onto it at each step). */
static Tile repack_q8(const int8_t *q, const float *d, const float *mn, int n, int k, int n0, uint8_t *room) {
    int blocks = k / 32;
    uint8_t *dst = room;
    float *sv = (float *)(room + (size_t)blocks * 8 * W * 4), *mv = sv + (size_t)blocks * W;
    for (int r = 0; r < W; r++) {
        int row = n0 + r;
        for (int b = 0; b < blocks; b++) {
            uint8_t out[32] = {0};
            float sc = 0.f, lo = 0.f; /* lo: the block's min (Q5_1, Q5_K), 0 for Q8_0 */
            if (row < n) {
                const int8_t *src = q + (size_t)row * k + b * 32;
                for (int j = 0; j < 32; j++) out[j] = (uint8_t)(Q8_VNNI ? (uint8_t)src[j] ^ 0x80 : (uint8_t)src[j]);
                sc = d[(size_t)row * blocks + b];
                lo = mn ? mn[(size_t)row * blocks + b] : 0.f;
            } else if (Q8_VNNI) {
                memset(out, 0x80, sizeof out); /* w = 0 */
            }
            place(dst, sv, mv, 8, b, r, out, sc, lo + (Q8_VNNI ? -128.f * sc : 0.f));
        }
    }
    return (Tile){dst, sv, mv, 8};
}

static inline int quad(const int8_t *p) {
    int v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* y[i0 + i, n0 .. n0 + W) for mr (<= MR, a constant when inlined) rows of x over one tile. */
static inline __attribute__((always_inline)) void tile_rows(const XQ8 *x, int i0, const int mr, int k,
                                                            const Tile *t, int n0, int n, const float *bias,
                                                            float *y) {
    int blocks = k / 32;
    rowf acc[MR];
    for (int i = 0; i < mr; i++) acc[i] = ZEROF();
    const rowi low = SET1B(15);
    for (int b = 0; b < blocks; b++) {
        rowi dh[MR], dl[MR]; /* the block's sums over x's high and low planes */
        for (int i = 0; i < mr; i++) dh[i] = ZEROI(), dl[i] = ZEROI();
        const uint8_t *wb = t->q + (size_t)b * t->steps * W * 4;
        if (t->steps == 4) { /* 4-bit: each vector is two k-quads, p and p + 4 */
            for (int p = 0; p < 4; p++) {
                rowi v = LOADI(wb + (size_t)p * W * 4);
                rowi lo = ANDI(v, low), hi = ANDI(SRLI16(v, 4), low);
                for (int i = 0; i < mr; i++) {
                    size_t at = (size_t)(i0 + i) * k + b * 32 + 4 * p;
                    dh[i] = DOT(dh[i], lo, SET1I(quad(x->hi + at)));
                    dl[i] = DOT(dl[i], lo, SET1I(quad(x->lo + at)));
                    dh[i] = DOT(dh[i], hi, SET1I(quad(x->hi + at + 16)));
                    dl[i] = DOT(dl[i], hi, SET1I(quad(x->lo + at + 16)));
                }
            }
        } else {
            for (int p = 0; p < 8; p++) {
                rowi v = LOADI(wb + (size_t)p * W * 4);
                for (int i = 0; i < mr; i++) {
                    size_t at = (size_t)(i0 + i) * k + b * 32 + 4 * p;
                    rowi xh = SET1I(quad(x->hi + at)), xl = SET1I(quad(x->lo + at));
#if Q8_VNNI
                    dh[i] = DOT(dh[i], v, xh);
                    dl[i] = DOT(dl[i], v, xl);
#else /* |x| (128 fits unsigned) times w with x's sign (|w| <= 127): a low plane of -128 stays exact */
                    dh[i] = DOT(dh[i], _mm256_abs_epi8(xh), _mm256_sign_epi8(v, xh));
                    dl[i] = DOT(dl[i], _mm256_abs_epi8(xl), _mm256_sign_epi8(v, xl));
#endif
                }
            }
        }
        rowi dot[MR];
        for (int i = 0; i < mr; i++) dot[i] = ADDI(SLLI32(dh[i], 8), dl[i]);
        rowf s = LOADF(t->s + (size_t)b * W), m = LOADF(t->m + (size_t)b * W);
        for (int i = 0; i < mr; i++) {
            size_t at = (size_t)(i0 + i) * blocks + b;
            acc[i] = FMA(CVT(dot[i]), s * SET1F(x->dx[at]), acc[i]);
            acc[i] = FMA(m, SET1F(x->sx[at]), acc[i]);
        }
    }
    for (int i = 0; i < mr; i++) {
        float out[W];
        STOREF(out, acc[i]);
        float *yi = y + (size_t)(i0 + i) * n;
        for (int r = 0; r < W && n0 + r < n; r++) yi[n0 + r] = out[r] + (bias ? bias[n0 + r] : 0.f);
    }
}

/* A weight in either form: 4-bit (q nibbles, s / z bfloat16 scales and zeros per group g) or 8-bit
 * blocks of 32 (q int8, s float32 per block; z float32 mins per block or NULL). */
typedef struct {
    const void *q, *s, *z;
    int n, k, g, steps; /* steps: 4 for 4-bit, 8 for Q8_0 (Tile.steps) */
} Weight;

static Tile repack(const Weight *w, int n0, uint8_t *room) {
    if (w->steps == 4) return repack_q4(w->q, w->s, w->z, w->n, w->k, w->g, n0, room);
    return repack_q8(w->q, w->s, w->z, w->n, w->k, n0, room);
}

static void rows_any(const XQ8 *x, int i0, int m, int k, const Tile *t, int n0, int n, const float *bias,
                     float *y) {
#define TILE_ROWS(R) tile_rows(x, i0, R, k, t, n0, n, bias, y)
    WITH_CONSTANT_ROWS(m - i0, TILE_ROWS)
#undef TILE_ROWS
}

/* y [M, N] = x [M, K] @ W^T (+ bias): tiles of W weight rows spread over the threads, each tile
 * repacked once into the thread's scratch and run against every row of x. */
static void int8_matmul(const float *x, int m, const Weight *w, const float *bias, float *y) {
    int k = w->k, n = w->n, tiles = (n + W - 1) / W, blocks = k / 32;
    XQ8 qx = quantize_x8(x, m, k);
    size_t room_floats = (size_t)blocks * (w->steps * W + 2 * W); /* the vectors' bytes / 4, s, m */
#pragma omp parallel for schedule(static) num_threads(threads())
    for (int ti = 0; ti < tiles; ti++) {
        Tile t = repack(w, ti * W, (uint8_t *)scratch(0, room_floats));
        for (int i0 = 0; i0 < m; i0 += MR) rows_any(&qx, i0, m, k, &t, ti * W, n, bias, y);
    }
}

void q4_matmul_int8(const float *x, int m, int k, const uint8_t *q, const uint16_t *s, const uint16_t *z, int n,
                    int g, const float *bias, float *y) {
    Weight w = {q, s, z, n, k, g, 4};
    int8_matmul(x, m, &w, bias, y);
}

void q8_matmul_int8(const float *x, int m, int k, const int8_t *q, const float *d, const float *mn, int n,
                    const float *bias, float *y) {
    Weight w = {q, d, mn, n, k, 32, 8};
    int8_matmul(x, m, &w, bias, y);
}

#endif
