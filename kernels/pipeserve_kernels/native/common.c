/* What the kernels share: the thread count, per-thread scratch, the float-tile product and x's
 * int16 quantization (native.h). */
#include "native.h"

/* The threads of a parallel region: what the caller set for its thread (set_threads: torch's
 * intra-op count, which libgomp does not carry into threads created after torch.set_num_threads),
 * else libgomp's default. Thread-local, as torch's setting applies to whichever thread calls. */
static __thread int n_threads;

void set_threads(int n) { n_threads = n; }

int threads(void) { return n_threads > 0 ? n_threads : omp_get_max_threads(); }

/* Whether the integer products for many rows (prefill.c) are built here: 1 where AVX2 is. */
int int8_prefill(void) { return PREFILL_INT8; }

/* native.h's INT_ROWS, which native/__init__.py mirrors (its test checks they agree). */
int int16_rows(void) { return INT_ROWS; }

/* Grow-only per-thread buffer `slot` (a few per thread) of at least n floats, 64-byte aligned. */
float *scratch(int slot, size_t n) {
    static __thread float *buf[SCRATCH_SLOTS];
    static __thread size_t cap[SCRATCH_SLOTS];
    if (cap[slot] < n) {
        free(buf[slot]);
        size_t bytes = ((n * sizeof(float) + 63) / 64) * 64;
        buf[slot] = aligned_alloc(64, bytes);
        cap[slot] = buf[slot] ? n : 0;
    }
    return buf[slot];
}

/* y[m, n0 + r] = dot(xp[m], tile[r]) (+ bias), rows four at a time so each x load feeds 4 FMAs. */
void tile_matmul(const float *xp, int m, int k, const float *tile, int rows, int n0, int n,
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

#if defined(__AVX2__)
QX quantize_x(const float *xp, int m, int k) {
    int chunks = k / 32;
    float *room = scratch(4, (size_t)m * (k / 2 + 2 * chunks)); /* int16 values, then dx, then sums */
    QX out = {(int16_t *)room, room + (size_t)m * k / 2, room + (size_t)m * (k / 2 + chunks)};
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
            int16_t *q = out.q + (size_t)i * k + c * 32;
            for (int j = 0; j < 32; j++) q[j] = (int16_t)lrintf(v[j] * inv);
            out.dx[(size_t)i * chunks + c] = d;
            out.sum[(size_t)i * chunks + c] = sum;
        }
    return out;
}
#endif
