/* xpred.c -- kvc's prediction across layers (formats/codecs/kvc.md §13, normative): the affine
 * map y = b + x W in float32, every product and every sum a separately rounded float32
 * operation, the inputs summed in ascending order (the library is built with
 * -ffp-contract=off, so no multiply-add is fused). Bit for bit what
 * kvcodec/codecs/kvc/xpred.py's affine_reference computes.
 *
 * Tiled for speed: XP_RB rows by XP_OB outputs at a time, their accumulators in registers while
 * the inputs run; the operations on each output element keep their order. */
#include "kvn_common.h"

#define XP_RB 4
#define XP_OB 8
#define XP_GROUP 32

static void affine_tail(const float *x, int64_t r0, int64_t nr, int64_t n_in, const float *w, const float *b,
                        int64_t n_out, int64_t o0, int64_t no, float *out)
{
    for (int64_t r = r0; r < r0 + nr; r++) {
        float *acc = out + r * n_out;
        for (int64_t o = o0; o < o0 + no; o++)
            acc[o] = b[o];
        for (int64_t i = 0; i < n_in; i++) {
            const float xi = x[r * n_in + i];
            const float *wi = w + i * n_out;
            for (int64_t o = o0; o < o0 + no; o++) {
                const float p = xi * wi[o];
                acc[o] = acc[o] + p;
            }
        }
    }
}

/* four float32 lanes (GCC / Clang vector extension: elementwise IEEE operations on any target) */
typedef float xp_v4 __attribute__((vector_size(16)));

static inline xp_v4 xp_load(const float *p)
{
    xp_v4 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void xp_store(float *p, xp_v4 v) { memcpy(p, &v, sizeof v); }

/* x float32 [t, n_in], w float32 [n_in, n_out], b float32 [n_out] -> out float32 [t, n_out]. */
int kvn_xpred_affine(const float *x, int64_t t, int64_t n_in, const float *w, const float *b,
                     int64_t n_out, float *out)
{
    const int64_t t_full = t - t % XP_RB, o_full = n_out - n_out % XP_OB;
    /* groups of XP_GROUP rows (their inputs stay in cache while every output block runs) */
    for (int64_t g0 = 0; g0 < t_full; g0 += XP_GROUP) {
    const int64_t g1 = g0 + XP_GROUP < t_full ? g0 + XP_GROUP : t_full;
    for (int64_t o0 = 0; o0 < o_full; o0 += XP_OB) {
        const xp_v4 b0 = xp_load(b + o0), b1 = xp_load(b + o0 + 4);
        for (int64_t r0 = g0; r0 < g1; r0 += XP_RB) {
            xp_v4 a00 = b0, a01 = b1, a10 = b0, a11 = b1, a20 = b0, a21 = b1, a30 = b0, a31 = b1;
            const float *x0 = x + r0 * n_in, *x1 = x0 + n_in, *x2 = x1 + n_in, *x3 = x2 + n_in;
            for (int64_t i = 0; i < n_in; i++) {
                const float *wi = w + i * n_out + o0;
                const xp_v4 w0 = xp_load(wi), w1 = xp_load(wi + 4);
                xp_v4 p;
                const xp_v4 v0 = {x0[i], x0[i], x0[i], x0[i]}, v1 = {x1[i], x1[i], x1[i], x1[i]};
                const xp_v4 v2 = {x2[i], x2[i], x2[i], x2[i]}, v3 = {x3[i], x3[i], x3[i], x3[i]};
                p = v0 * w0; a00 = a00 + p; p = v0 * w1; a01 = a01 + p;
                p = v1 * w0; a10 = a10 + p; p = v1 * w1; a11 = a11 + p;
                p = v2 * w0; a20 = a20 + p; p = v2 * w1; a21 = a21 + p;
                p = v3 * w0; a30 = a30 + p; p = v3 * w1; a31 = a31 + p;
            }
            float *y = out + r0 * n_out + o0;
            xp_store(y, a00); xp_store(y + 4, a01); y += n_out;
            xp_store(y, a10); xp_store(y + 4, a11); y += n_out;
            xp_store(y, a20); xp_store(y + 4, a21); y += n_out;
            xp_store(y, a30); xp_store(y + 4, a31);
        }
    }
    }
    for (int64_t o0 = 0; o0 < o_full && t_full < t; o0 += XP_OB)
        affine_tail(x, t_full, t - t_full, n_in, w, b, n_out, o0, XP_OB, out);
    if (o_full < n_out)
        affine_tail(x, 0, t, n_in, w, b, n_out, o_full, n_out - o_full, out);
    return KVN_OK;
}
