/* xpred.c -- kvc's prediction across layers (formats/codecs/kvc.md §13, normative): the affine
 * map y = b + x W in float32, every product and every sum a separately rounded float32
 * operation, the inputs summed in ascending order (the library is built with
 * -ffp-contract=off, so no multiply-add is fused). Bit for bit what
 * kvcodec/codecs/kvc/xpred.py's affine_reference computes.
 *
 * Tiled for speed: groups of XP_GROUP_TILES tiles of rows (their inputs stay in cache), each tile
 * four rows (six with AVX2's 8 lanes) by two or four vectors of outputs, the accumulators in
 * registers while the inputs run; the operations on each output element keep their order. Vectors
 * are GCC / Clang vector extensions (elementwise IEEE operations on any target): 4 lanes
 * everywhere, 8 lanes where the CPU has AVX2 (x86, chosen at run time), 16 where it has
 * AVX-512. An input is broadcast as it is: -0 stays -0, as in the reference (before 2026-12-07
 * the kernels added +0, which made it +0; an output could then differ from the reference in the
 * sign of a zero when the bias was -0 and every product zero).
 *
 * Exact products, fused: where a product x[i] * W[i] is exact in float32, rounding it changes
 * nothing, so y + x[i] * W[i] rounded once (a fused multiply-add) is bit for bit the separately
 * rounded product and sum the format asks for. A product is exact when both operands are zero or
 * lie in [2^-62, 2^63) with at most 11 significant bits (float16 values, and bfloat16 values in
 * that range: the product then has at most 22 significant bits and lies in [2^-124, 2^126), a
 * normal float32). Every block of rows checks this on the values themselves (fusable), per
 * input part, against the check of W made once per call; the AVX-512 kernels, and the AVX2 ones
 * where the CPU has FMA, then fuse those inputs' multiply-adds (one instruction instead of two:
 * the untuned V half of a predictor's inputs, the K half too where K does not rotate), and the
 * 4-lane kernel computes them as before. */
#include "kvn_common.h"

/* rows per group of the tiled kernels: their inputs stay in cache (a multiple of each kernel's
 * rows per tile) */
#define XP_GROUP_TILES 8

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

/* 1 when every one of the n values v can take part in an exact product (the header): zero, or
 * 2^-62 <= |v| < 2^63 with the low 13 of its 23 mantissa bits zero. */
static int fusable(const float *v, int64_t n)
{
    uint32_t bad = 0;
    for (int64_t j = 0; j < n; j++) {
        uint32_t u;
        memcpy(&u, v + j, sizeof u);
        const uint32_t a = u & 0x7fffffffu, e = a >> 23;
        bad |= (uint32_t)(a != 0) & ((uint32_t)((u & 0x1fffu) != 0) | (uint32_t)(e < 65u) | (uint32_t)(e > 189u));
    }
    return bad == 0;
}

/* Runs of inputs [seg[3s], seg[3s + 1]) whose multiply-adds may be fused (seg[3s + 2] != 0: every
 * product exact) or not; nseg runs cover 0 .. n_in in order. */
#define XP_MAXSEG 16

/* The inputs [I_LO, I_HI) of RB rows into the accumulators a (in XP_KERNEL's scope), each
 * a[r][v] = OP(x, w, a[r][v]) in input order */
#define XP_INPUTS(VT, LANES, NV, RB, I_LO, I_HI, OP)                                              \
    for (int64_t i = (I_LO); i < (I_HI); i++) {                                                   \
        const float *wi = w + i * n_out + o0;                                                     \
        VT ww[NV];                                                                                \
        for (int v = 0; v < (NV); v++)                                                            \
            memcpy(&ww[v], wi + v * (LANES), sizeof ww[v]);                                       \
        for (int r = 0; r < (RB); r++) {                                                          \
            const float xs = x[(r0 + r) * n_in + i];                                              \
            const VT xv = KVN_SPLAT##LANES(xs);                                                  \
            for (int v = 0; v < (NV); v++)                                                        \
                a[r][v] = OP(xv, ww[v], a[r][v]);                                                 \
        }                                                                                         \
    }

/* The tiled kernel for vectors of LANES floats (VT): outputs in blocks of NV * LANES from o_lo on,
 * RB rows at a time with RB * NV accumulators in registers, on the rows [0, t - t % RB) (the
 * caller does the rest). FMA(x, w, a) computes a + x * w for the runs marked exact (fused where
 * the vector unit has it; the same bits either way). Returns the end of the outputs it covered. */
#define XP_KERNEL(NAME, VT, LANES, NV, RB, ATTR, FMA)                                             \
    ATTR static int64_t NAME(const float *x, int64_t t, int64_t n_in, const float *w, const float *b, \
                             int64_t n_out, int64_t o_lo, float *out, const int64_t *seg, int nseg) \
    {                                                                                             \
        const int64_t ob = (NV) * (LANES), group = (RB) * XP_GROUP_TILES;                         \
        const int64_t t_full = t - t % (RB), o_full = o_lo + (n_out - o_lo) / ob * ob;            \
        for (int64_t g0 = 0; g0 < t_full; g0 += group) {                                          \
            const int64_t g1 = g0 + group < t_full ? g0 + group : t_full;                         \
            for (int64_t o0 = o_lo; o0 < o_full; o0 += ob) {                                      \
                VT bb[NV];                                                                        \
                for (int v = 0; v < (NV); v++)                                                    \
                    memcpy(&bb[v], b + o0 + v * (LANES), sizeof bb[v]);                           \
                for (int64_t r0 = g0; r0 < g1; r0 += (RB)) {                                      \
                    VT a[RB][NV];                                                                 \
                    for (int r = 0; r < (RB); r++)                                                \
                        for (int v = 0; v < (NV); v++)                                            \
                            a[r][v] = bb[v];                                                      \
                    for (int sg = 0; sg < nseg; sg++) {                                           \
                        if (seg[3 * sg + 2]) {                                                    \
                            XP_INPUTS(VT, LANES, NV, RB, seg[3 * sg], seg[3 * sg + 1], FMA)       \
                        } else {                                                                  \
                            XP_INPUTS(VT, LANES, NV, RB, seg[3 * sg], seg[3 * sg + 1], XP_MULADD) \
                        }                                                                         \
                    }                                                                             \
                    for (int r = 0; r < (RB); r++)                                                \
                        for (int v = 0; v < (NV); v++)                                            \
                            memcpy(out + (r0 + r) * n_out + o0 + v * (LANES), &a[r][v], sizeof a[r][v]); \
                }                                                                                 \
            }                                                                                     \
        }                                                                                         \
        return o_full;                                                                            \
    }

/* a + x * w, the product and the sum each rounded (the library is built with -ffp-contract=off;
 * the same bits as fused, for exact products) */
#define XP_MULADD(X, W, A) ((A) + (X) * (W))

typedef float xp_v4 __attribute__((vector_size(16)));
XP_KERNEL(affine_v4, xp_v4, 4, 2, 4, , XP_MULADD)

#ifdef KVN_X86
typedef float xp_v8 __attribute__((vector_size(32)));
/* six rows of two vectors: 12 accumulators, two weight vectors and a broadcast in AVX2's 16
 * registers (1.3x the four rows' speed on an AMD EPYC, scratch benchmark: 65 against 50 GFLOP/s
 * on one core); the last rows of a block take four */
XP_KERNEL(affine_v8x6, xp_v8, 8, 2, 6, __attribute__((target("avx2"))), XP_MULADD)
XP_KERNEL(affine_v8, xp_v8, 8, 2, 4, __attribute__((target("avx2"))), XP_MULADD)
/* with FMA (every AVX2 CPU but a few): the exact products' multiply-adds fused, one instruction
 * instead of two (the same bits; 1.2-1.3x on those inputs, scratch benchmark) */
#define XP_FMA8(X, W, A) ((xp_v8)_mm256_fmadd_ps((__m256)(X), (__m256)(W), (__m256)(A)))
XP_KERNEL(affine_v8x6f, xp_v8, 8, 2, 6, __attribute__((target("avx2,fma"))), XP_FMA8)
XP_KERNEL(affine_v8f, xp_v8, 8, 2, 4, __attribute__((target("avx2,fma"))), XP_FMA8)
typedef float xp_v16 __attribute__((vector_size(64)));
/* one vfmadd instruction (AVX-512F has it), for the exact products only */
#define XP_FMA16(X, W, A) ((xp_v16)_mm512_fmadd_ps((__m512)(X), (__m512)(W), (__m512)(A)))
/* 16 accumulators of 16 lanes (AVX-512 has 32 registers): 21 % faster than 8 on this machine's
 * 384 x 384 maps (scratch benchmark, 69 against 57 GFLOP/s on one core); outputs past the last
 * block of 64 take the 32-wide kernel */
XP_KERNEL(affine_v16x4, xp_v16, 16, 4, 4, __attribute__((target("avx512f"))), XP_FMA16)
XP_KERNEL(affine_v16, xp_v16, 16, 2, 4, __attribute__((target("avx512f"))), XP_FMA16)
#endif

/* The widest kernel this CPU runs, or the one asked for (lanes 4, 8, 16), over the input runs
 * seg (nseg of them, XP_MAXSEG at most; see XP_KERNEL); returns the lanes used, or 0 when the
 * CPU cannot run the kernel asked for. The rows past a kernel's last whole tile of rows, and the
 * outputs past its last whole block, take the next smaller kernel, then affine_tail: every output
 * element gets the same operations in the same order whichever code computes it. */
static int affine_any(const float *x, int64_t t, int64_t n_in, const float *w, const float *b, int64_t n_out,
                      float *out, int lanes, const int64_t *seg, int nseg)
{
    int64_t done, t4 = t - t % 4; /* rows [0, t4) of outputs [0, done) by four-row tiles */
    int used = 4;
#ifdef KVN_X86
    __builtin_cpu_init();
    const int has16 = __builtin_cpu_supports("avx512f"), has8 = __builtin_cpu_supports("avx2"),
              fma = __builtin_cpu_supports("fma");
    if (lanes == 0)
        lanes = has16 ? 16 : has8 ? 8 : 4;
    if ((lanes == 16 && !has16) || (lanes == 8 && !has8))
        return 0;
    if (lanes == 16) {
        done = affine_v16(x, t, n_in, w, b, n_out, affine_v16x4(x, t, n_in, w, b, n_out, 0, out, seg, nseg), out,
                          seg, nseg);
        used = 16;
    } else if (lanes == 8) {
        done = (fma ? affine_v8x6f : affine_v8x6)(x, t, n_in, w, b, n_out, 0, out, seg, nseg);
        const int64_t t6 = t - t % 6; /* the rest of the rows: four-row tiles from t6 on */
        (fma ? affine_v8f : affine_v8)(x + t6 * n_in, t - t6, n_in, w, b, n_out, 0, out + t6 * n_out, seg, nseg);
        t4 = t6 + (t - t6) - (t - t6) % 4;
        used = 8;
    } else
#else
    if (lanes == 8 || lanes == 16)
        return 0;
#endif
        done = affine_v4(x, t, n_in, w, b, n_out, 0, out, seg, nseg);
    if (t4 < t && done > 0)
        affine_tail(x, t4, t - t4, n_in, w, b, n_out, 0, done, out);
    if (done < n_out)
        affine_tail(x, 0, t, n_in, w, b, n_out, done, n_out - done, out);
    return used;
}

/* x float32 [t, n_in], w float32 [n_in, n_out], b float32 [n_out] -> out float32 [t, n_out].
 * lanes: 0 for the widest kernel this CPU runs, or 4, 8, 16 for that one (tests); returns the
 * lanes used, or 0 when the CPU cannot run the kernel asked for. The multiply-adds are fused
 * where every product is exact (fusable x and w: the same bits). */
int kvn_xpred_affine(const float *x, int64_t t, int64_t n_in, const float *w, const float *b,
                     int64_t n_out, float *out, int lanes)
{
    const int64_t seg[3] = {0, n_in, fusable(w, n_in * n_out) && fusable(x, t * n_in)};
    return affine_any(x, t, n_in, w, b, n_out, out, lanes, seg, 1);
}

/* Turn the np pairs (ia[p], ib[p]) of each of h heads of d channels in row v by the cosines c and
 * sines s of that row: forward (dir 1) (a c - b s, b c + a s), back (dir -1) (a c + b s, b c - a s),
 * each product and sum rounded on its own, in that order. */
static void turn_row(float *v, int64_t h, int64_t d, const float *c, const float *s, const int32_t *ia,
                     const int32_t *ib, int64_t np, int dir)
{
    for (int64_t hh = 0; hh < h; hh++) {
        float *x = v + hh * d;
        for (int64_t p = 0; p < np; p++) {
            const float a = x[ia[p]], b = x[ib[p]];
            const float ac = a * c[p], bs = b * s[p], bc = b * c[p], as = a * s[p];
            if (dir > 0) {
                x[ia[p]] = ac - bs;
                x[ib[p]] = bc + as;
            } else {
                x[ia[p]] = ac + bs;
                x[ib[p]] = bc - as;
            }
        }
    }
}

/* turn_row for pairs (roff + p, roff + np + p) ("half" layout): the same operations on runs the
 * compiler vectorises */
static void turn_row_half(float *v, int64_t h, int64_t d, const float *c, const float *s, int64_t roff,
                          int64_t np, int dir)
{
    for (int64_t hh = 0; hh < h; hh++) {
        float *xa = v + hh * d + roff, *xb = xa + np;
        if (dir > 0)
            for (int64_t p = 0; p < np; p++) {
                const float a = xa[p], b = xb[p];
                const float ac = a * c[p], bs = b * s[p], bc = b * c[p], as = a * s[p];
                xa[p] = ac - bs;
                xb[p] = bc + as;
            }
        else
            for (int64_t p = 0; p < np; p++) {
                const float a = xa[p], b = xb[p];
                const float ac = a * c[p], bs = b * s[p], bc = b * c[p], as = a * s[p];
                xa[p] = ac + bs;
                xb[p] = bc - as;
            }
    }
}

/* the channel offset of pairs in the "half" layout (ia[p] = roff + p, ib[p] = roff + np + p), or -1 */
static int64_t half_offset(const int32_t *ia, const int32_t *ib, int64_t np)
{
    if (np < 1)
        return -1;
    for (int64_t p = 0; p < np; p++)
        if ((int64_t)ia[p] != ia[0] + p || (int64_t)ib[p] != ia[0] + np + p)
            return -1;
    return ia[0];
}

static void turn_any(float *v, int64_t h, int64_t d, const float *c, const float *s, const int32_t *ia,
                     const int32_t *ib, int64_t np, int64_t half, int dir)
{
    if (half >= 0)
        turn_row_half(v, h, d, c, s, half, np, dir);
    else
        turn_row(v, h, d, c, s, ia, ib, np, dir);
}

/* rows per block of the pass (a multiple of the kernels' six- and four-row tiles) */
#define XP_BLOCK 60

/* One layer's prediction pass (formats/codecs/kvc.md §13) on rows [r0, r1) of t-row tensors.
 * Inputs: n_in parts (layer l - 1 as decoded, role order), part k at address in_ptr[k], geometry
 * in_geo[4k..4k+3] = (element kind F_*, heads, channels, turned back 0/1); a turned part's rows
 * turn back by cin / sin_ (float32 [t, np_in]) on pairs ia_in / ib_in (channel indices in a head).
 * w float32 [n_i, n_o], b float32 [n_o]: y = b + x w (the affine kernels). Outputs: n_out parts
 * (layer l, role order) alike (out_geo, cout / sout, ia_out / ib_out; turned forward). mode 0: each
 * output part holds its decoded residual, and rows whose mask byte (mask_ptr[k], uint8 [t]) is
 * non-zero become convert(residual + y) in place; mode 1: the output parts are float32 and get y.
 * Returns the kernel lanes used, 0 when the CPU lacks the kernel asked for, -1 when out of memory,
 * -2 when the parts' widths do not add up to n_i and n_o. */
int kvn_xpred_pass(int64_t r0, int64_t r1, int64_t n_in, const int64_t *in_ptr, const int64_t *in_geo,
                   const float *cin, const float *sin_, const int32_t *ia_in, const int32_t *ib_in, int64_t np_in,
                   const float *w, const float *b, int64_t n_i, int64_t n_o, int64_t n_out, const int64_t *out_ptr,
                   const int64_t *out_geo, const int64_t *mask_ptr, const float *cout, const float *sout,
                   const int32_t *ia_out, const int32_t *ib_out, int64_t np_out, int mode, int lanes)
{
    int64_t wi = 0, wo = 0;
    for (int64_t k = 0; k < n_in; k++)
        wi += in_geo[4 * k + 1] * in_geo[4 * k + 2];
    for (int64_t k = 0; k < n_out; k++)
        wo += out_geo[4 * k + 1] * out_geo[4 * k + 2];
    if (wi != n_i || wo != n_o)
        return -2;
    float *xb = (float *)malloc(sizeof(float) * (size_t)(XP_BLOCK * n_i + XP_BLOCK * n_o + n_o + 1));
    if (!xb)
        return -1;
    float *yb = xb + XP_BLOCK * n_i, *tmp = yb + XP_BLOCK * n_o;
    const int64_t half_in = half_offset(ia_in, ib_in, np_in), half_out = half_offset(ia_out, ib_out, np_out);
    /* per input part: whether its rows of W allow exact products (checked once; its values are
     * checked per block below) */
    int wfus[XP_MAXSEG];
    const int parts = n_in <= XP_MAXSEG ? (int)n_in : 0; /* more parts than runs: nothing fused */
    for (int64_t k = 0, at = 0; k < parts; k++) {
        const int64_t n = in_geo[4 * k + 1] * in_geo[4 * k + 2];
        wfus[k] = fusable(w + at * n_o, n * n_o);
        at += n;
    }
    int used = 0;
    for (int64_t g0 = r0; g0 < r1; g0 += XP_BLOCK) {
        const int64_t g1 = g0 + XP_BLOCK < r1 ? g0 + XP_BLOCK : r1, gn = g1 - g0;
        for (int64_t r = g0; r < g1; r++) { /* the inputs, turned back */
            float *x = xb + (r - g0) * n_i;
            for (int64_t k = 0; k < n_in; k++) {
                const int64_t h = in_geo[4 * k + 1], d = in_geo[4 * k + 2], n = h * d;
                load_row(x, (const void *)(intptr_t)in_ptr[k], (int)in_geo[4 * k], r * n, n);
                if (in_geo[4 * k + 3])
                    turn_any(x, h, d, cin + r * np_in, sin_ + r * np_in, ia_in, ib_in, np_in, half_in, -1);
                x += n;
            }
        }
        int64_t seg[3 * XP_MAXSEG] = {0, n_i, 0}; /* without parts to tell apart: one plain run */
        int nseg = 1;
        if (parts) { /* runs of parts with and without exact products (neighbours merged) */
            nseg = 0;
            for (int64_t k = 0, at = 0; k < parts; k++) {
                const int64_t n = in_geo[4 * k + 1] * in_geo[4 * k + 2];
                int fus = wfus[k];
                for (int64_t r = 0; fus && r < gn; r++)
                    fus = fusable(xb + r * n_i + at, n);
                if (nseg && seg[3 * nseg - 1] == fus) {
                    seg[3 * nseg - 2] = at + n;
                } else {
                    seg[3 * nseg] = at;
                    seg[3 * nseg + 1] = at + n;
                    seg[3 * nseg + 2] = fus;
                    nseg++;
                }
                at += n;
            }
        }
        used = affine_any(xb, gn, n_i, w, b, n_o, yb, lanes, seg, nseg);
        if (!used)
            break;
        for (int64_t r = g0; r < g1; r++) { /* the outputs, turned forward, added */
            float *y = yb + (r - g0) * n_o;
            for (int64_t k = 0; k < n_out; k++) {
                const int64_t h = out_geo[4 * k + 1], d = out_geo[4 * k + 2], n = h * d;
                const int kind = (int)out_geo[4 * k];
                void *o = (void *)(intptr_t)out_ptr[k];
                if (out_geo[4 * k + 3])
                    turn_any(y, h, d, cout + r * np_out, sout + r * np_out, ia_out, ib_out, np_out, half_out, 1);
                if (mode == 1) {
                    memcpy((float *)o + r * n, y, sizeof(float) * (size_t)n);
                } else if (((const uint8_t *)(intptr_t)mask_ptr[k])[r]) {
                    load_row(tmp, o, kind, r * n, n);
                    for (int64_t e = 0; e < n; e++)
                        tmp[e] = tmp[e] + y[e];
                    store_row(o, kind, r * n, tmp, n);
                }
                y += n;
            }
        }
    }
    free(xb);
    return used;
}

/* The encoder's closed loop around a prediction, one pass each (kvcodec.codecs.kvc.xpred
 * residual and XPredEncoder.store_sum; their references are the numpy / torch lines beside
 * them): values in blocks of XP_CHUNK through float32 scratch, converted with load_row /
 * store_row (exact widening; rounding to nearest, ties to even). */
#define XP_CHUNK 1024

/* r = kind(float32(x) - pred) for n values (x and r of element kind `kind`), and float32(x) into
 * x32 where it is not NULL. Returns 1 if every r is finite, else 0. */
int kvn_xpred_residual(const void *x, int kind, const float *pred, int64_t n, void *r, float *x32)
{
    float buf[XP_CHUNK];
    int ok = 1;
    for (int64_t o = 0; o < n; o += XP_CHUNK) {
        const int64_t m = n - o < XP_CHUNK ? n - o : XP_CHUNK;
        float *v = x32 ? x32 + o : buf;
        load_row(v, x, kind, o, m);
        if (x32) {
            for (int64_t i = 0; i < m; ++i) buf[i] = v[i] - pred[o + i];
        } else {
            for (int64_t i = 0; i < m; ++i) buf[i] -= pred[o + i];
        }
        store_row(r, kind, o, buf, m);
        ok &= all_finite(kind == F_F32 ? (const void *)((const float *)r + o) : (const void *)((const uint16_t *)r + o),
                         kind, m);
    }
    return ok;
}

/* out = float32(kind(float32(d) + pred)) for n values of kind `kind` at d: a decoded residual
 * plus its prediction, as the decoder rounds it, widened for the next layer's prediction. */
void kvn_xpred_sum(const void *d, int kind, const float *pred, int64_t n, float *out)
{
    uint16_t h[XP_CHUNK];
    for (int64_t o = 0; o < n; o += XP_CHUNK) {
        const int64_t m = n - o < XP_CHUNK ? n - o : XP_CHUNK;
        float *v = out + o;
        load_row(v, d, kind, o, m);
        for (int64_t i = 0; i < m; ++i) v[i] += pred[o + i];
        if (kind != F_F32) {
            store_row(h, kind, 0, v, m);
            load_row(v, h, kind, 0, m);
        }
    }
}
