/* xpred.c -- kvc's prediction across layers (formats/codecs/kvc.md §13, normative): the affine
 * map y = b + x W in float32, every product and every sum a separately rounded float32
 * operation, the inputs summed in ascending order (the library is built with
 * -ffp-contract=off, so no multiply-add is fused). Bit for bit what
 * kvcodec/codecs/kvc/xpred.py's affine_reference computes.
 *
 * Tiled for speed: groups of XP_GROUP rows (their inputs stay in cache), in each XP_RB rows by
 * two vectors of outputs, the accumulators in registers while the inputs run; the operations
 * on each output element keep their order. Vectors are GCC / Clang vector extensions
 * (elementwise IEEE operations on any target): 4 lanes everywhere, 8 lanes where the CPU has
 * AVX2 (x86, chosen at run time; AVX2 has no fused multiply-add, and none is generated). */
#include "kvn_common.h"

#define XP_RB 4
#define XP_GROUP 32

/* rows [r0, r0 + nr) and outputs [o0, o0 + no), one element at a time */
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

/* The tiled kernel for vectors of LANES floats (VT): outputs in blocks of 2 * LANES. Returns how
 * many leading outputs it covered (every row); the caller does the rest. */
#define XP_KERNEL(NAME, VT, LANES, ATTR)                                                          \
    ATTR static int64_t NAME(const float *x, int64_t t, int64_t n_in, const float *w, const float *b, \
                             int64_t n_out, float *out)                                           \
    {                                                                                             \
        const int64_t ob = 2 * (LANES);                                                           \
        const int64_t t_full = t - t % XP_RB, o_full = n_out - n_out % ob;                        \
        for (int64_t g0 = 0; g0 < t_full; g0 += XP_GROUP) {                                       \
            const int64_t g1 = g0 + XP_GROUP < t_full ? g0 + XP_GROUP : t_full;                   \
            for (int64_t o0 = 0; o0 < o_full; o0 += ob) {                                         \
                VT b0, b1;                                                                        \
                memcpy(&b0, b + o0, sizeof b0);                                                   \
                memcpy(&b1, b + o0 + (LANES), sizeof b1);                                         \
                for (int64_t r0 = g0; r0 < g1; r0 += XP_RB) {                                     \
                    VT a00 = b0, a01 = b1, a10 = b0, a11 = b1, a20 = b0, a21 = b1, a30 = b0, a31 = b1; \
                    const float *x0 = x + r0 * n_in, *x1 = x0 + n_in, *x2 = x1 + n_in, *x3 = x2 + n_in; \
                    for (int64_t i = 0; i < n_in; i++) {                                          \
                        const float *wi = w + i * n_out + o0;                                     \
                        VT w0, w1, p, v0, v1, v2, v3;                                             \
                        memcpy(&w0, wi, sizeof w0);                                               \
                        memcpy(&w1, wi + (LANES), sizeof w1);                                     \
                        v0 = x0[i] + (VT){0}; v1 = x1[i] + (VT){0};                               \
                        v2 = x2[i] + (VT){0}; v3 = x3[i] + (VT){0};                               \
                        p = v0 * w0; a00 = a00 + p; p = v0 * w1; a01 = a01 + p;                   \
                        p = v1 * w0; a10 = a10 + p; p = v1 * w1; a11 = a11 + p;                   \
                        p = v2 * w0; a20 = a20 + p; p = v2 * w1; a21 = a21 + p;                   \
                        p = v3 * w0; a30 = a30 + p; p = v3 * w1; a31 = a31 + p;                   \
                    }                                                                             \
                    float *y = out + r0 * n_out + o0;                                             \
                    memcpy(y, &a00, sizeof a00); memcpy(y + (LANES), &a01, sizeof a01); y += n_out; \
                    memcpy(y, &a10, sizeof a10); memcpy(y + (LANES), &a11, sizeof a11); y += n_out; \
                    memcpy(y, &a20, sizeof a20); memcpy(y + (LANES), &a21, sizeof a21); y += n_out; \
                    memcpy(y, &a30, sizeof a30); memcpy(y + (LANES), &a31, sizeof a31);           \
                }                                                                                 \
            }                                                                                     \
        }                                                                                         \
        for (int64_t o0 = 0; o0 < o_full && t_full < t; o0 += ob)                                 \
            affine_tail(x, t_full, t - t_full, n_in, w, b, n_out, o0, ob, out);                   \
        return o_full;                                                                            \
    }

typedef float xp_v4 __attribute__((vector_size(16)));
XP_KERNEL(affine_v4, xp_v4, 4, )

#if defined(__GNUC__) && defined(__x86_64__)
#define XP_AVX2 1
typedef float xp_v8 __attribute__((vector_size(32)));
XP_KERNEL(affine_v8, xp_v8, 8, __attribute__((target("avx2"))))
typedef float xp_v16 __attribute__((vector_size(64)));
XP_KERNEL(affine_v16, xp_v16, 16, __attribute__((target("avx512f"))))
#endif

/* x float32 [t, n_in], w float32 [n_in, n_out], b float32 [n_out] -> out float32 [t, n_out].
 * lanes: 0 for the widest kernel this CPU runs, or 4, 8, 16 for that one (tests); returns the
 * lanes used, or 0 when the CPU cannot run the kernel asked for. */
int kvn_xpred_affine(const float *x, int64_t t, int64_t n_in, const float *w, const float *b,
                     int64_t n_out, float *out, int lanes)
{
    int64_t done;
    int used = 4;
#ifdef XP_AVX2
    __builtin_cpu_init();
    const int has16 = __builtin_cpu_supports("avx512f"), has8 = __builtin_cpu_supports("avx2");
    if (lanes == 0)
        lanes = has16 ? 16 : has8 ? 8 : 4;
    if ((lanes == 16 && !has16) || (lanes == 8 && !has8))
        return 0;
    if (lanes == 16) {
        done = affine_v16(x, t, n_in, w, b, n_out, out);
        used = 16;
    } else if (lanes == 8) {
        done = affine_v8(x, t, n_in, w, b, n_out, out);
        used = 8;
    } else
#else
    if (lanes == 8 || lanes == 16)
        return 0;
#endif
        done = affine_v4(x, t, n_in, w, b, n_out, out);
    if (done < n_out)
        affine_tail(x, 0, t, n_in, w, b, n_out, done, n_out - done, out);
    return used;
}
