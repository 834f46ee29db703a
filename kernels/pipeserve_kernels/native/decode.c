/* A stage's decode step in one call (model/native_decode.py) and its paged attention. */
#include "native.h"

/* ---- the decode step: every layer of a stage for B rows of one new token each ---- */

typedef struct {
    const uint8_t *q;      /* W_Q4: nibbles [N, K/2]; W_F32: the float32 weight [N, K]; W_Q8: int8 [N, K]
                            * (g 16: Q6_K's 6-bit packing, dense.c) */
    const uint16_t *s, *z; /* W_Q4's scales and zeros; W_Q8: scales in s (float32 [N, K/32], or g 16:
                            * Q6_K's, dense.c), float32 mins
                            * [N, K/32] or NULL in z (dense.c's q8_matmul); else NULL */
    const float *bias;     /* or NULL */
    int n, k, g; /* g: W_Q4's group; W_Q8's scale block, 16 or 32 (0 read as 32) */
    int kind; /* W_Q4, W_F32, W_Q8 or W_CAT */
} Q4;

/* W_CAT: a fused projection whose parts differ in kind (a Q4_K_M file's q/k in Q4_K, v in Q6_K): q points
 * at g parts (Q4 structs, none W_CAT), whose rows are stacked in order; bias is each part's own. */
enum { W_Q4 = 0, W_F32 = 1, W_Q8 = 2, W_CAT = 3 };

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

typedef _Float16 vh __attribute__((vector_size(VL * 2)));
typedef uint16_t vu16 __attribute__((vector_size(VL * 2)));
typedef uint32_t vu __attribute__((vector_size(VL * 4)));

/* VL pool elements at element offset i of `base` as floats; always inlined with a constant kvt. */
static inline __attribute__((always_inline)) vf kv_load(const void *base, size_t i, const int kvt) {
    if (kvt == KV_F32) return loadv((const float *)base + i);
#if defined(__AVX512F__)
    if (kvt == KV_F16) { /* the conversion instruction itself: GCC's generic _Float16 path is slower */
        __m512 f = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)base + i)));
        vf out;
        memcpy(&out, &f, sizeof out);
        return out;
    }
#elif defined(__F16C__)
    if (kvt == KV_F16) {
        __m256 f = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)base + i)));
        vf out;
        memcpy(&out, &f, sizeof out);
        return out;
    }
#endif
    vu16 h;
    memcpy(&h, (const uint16_t *)base + i, sizeof h);
    if (kvt == KV_F16) return __builtin_convertvector((vh)h, vf);
    return (vf)(__builtin_convertvector(h, vu) << 16); /* bfloat16: the high half of a float */
}

/* n (% 16 == 0) floats into the pool at element offset i, rounded to nearest-even as torch's .to(). */
static void kv_store(void *base, size_t i, const float *src, int n, int kvt) {
    if (kvt == KV_F32) {
        memcpy((float *)base + i, src, (size_t)n * sizeof(float));
        return;
    }
    for (int j = 0; j < n; j += VL) {
        vf f = loadv(src + j);
        vu16 h;
        if (kvt == KV_F16) {
            h = (vu16)__builtin_convertvector(f, vh);
        } else {
            vu u = (vu)f;
            h = __builtin_convertvector((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16, vu16);
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
    if (w->kind == W_CAT) { /* each part into scratch slot 7, then into its columns of y [b, n] */
        const Q4 *parts = (const Q4 *)w->q;
        for (int p = 0, col = 0; p < w->g; col += parts[p].n, p++) {
            float *part = scratch(7, (size_t)b * parts[p].n);
            matmul(x, xp, b, &parts[p], part);
            for (int r = 0; r < b; r++)
                memcpy(y + (size_t)r * w->n + col, part + (size_t)r * parts[p].n, parts[p].n * sizeof(float));
        }
        return;
    }
    if (w->kind == W_F32)
        f32_matmul(x, b, w->k, (const float *)w->q, w->n, w->bias, y);
    else if (w->kind == W_Q8)
        q8_matmul(x, b, w->k, (const int8_t *)w->q, (const float *)w->s, (const float *)w->z, w->g ? w->g : 32,
                  w->n, w->bias, y);
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
    vf qv[HD / VL], acc[HD / VL];
    for (int i = 0; i < HD / VL; i++) qv[i] = loadv(q + VL * i), acc[i] = (vf){0};
    int len = p1 - p0, padded = (len + 15) & ~15;
    for (int p = p0; p < p1;) {
        int o = p % bs;
        size_t at = ((size_t)table[p / bs] * bs + o) * stride;
        for (; o < bs && p < p1; o++, p++, at += stride) {
            vf dot = qv[0] * kv_load(kc, at, kvt);
            for (int i = 1; i < HD / VL; i++) dot += qv[i] * kv_load(kc, at + VL * i, kvt);
            sc[p - p0] = hsumv(dot) * scale;
        }
    }
    for (int p = len; p < padded; p++) sc[p] = -INFINITY;
    vf mv = loadv(sc);
    for (int p = VL; p < padded; p += VL) mv = vmax(mv, loadv(sc + p));
    float mx = mv[0];
    for (int i = 1; i < VL; i++) mx = mv[i] > mx ? mv[i] : mx;
    vf tv = {0};
    for (int p = 0; p < padded; p += VL) {
        vf e = vexp(loadv(sc + p) - mx);
        storev(sc + p, e);
        tv += e;
    }
    for (int p = p0; p < p1;) {
        int o = p % bs;
        size_t at = ((size_t)table[p / bs] * bs + o) * stride;
        for (; o < bs && p < p1; o++, p++, at += stride) {
            float w = sc[p - p0];
            for (int i = 0; i < HD / VL; i++) acc[i] += w * kv_load(vc, at + VL * i, kvt);
        }
    }
    part[0] = mx, part[1] = hsumv(tv);
    for (int i = 0; i < HD / VL; i++) storev(part + 2 + VL * i, acc[i]);
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
            for (int i = 0; i < d->inter; i += VL) {
                vf gv = loadv(g + i);
                storev(a + i, gv / (1.f + vexp(-gv)) * loadv(u + i));
            }
        }
        matmul(act, xp, b, &ly->down, proj);
        for (size_t i = 0; i < (size_t)b * h; i++) x[i] += proj[i];
    }
}
