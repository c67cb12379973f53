/* rope.c -- kvc's rotating means (kvcodec/transforms/rope.py, formats/codecs/kvc.md §3.1):
 * R(p) mu for every token (float32, each product and sum rounded on its own; the library is
 * built with -ffp-contract=off) and the encoder's mean over tokens of R(p)^-1 k (float64, tokens
 * summed in order then divided by their count: numpy's mean over axis 0), bit for bit what the
 * numpy functions there compute. The phase of pair j at position p is (p mod 2^32) * steps[j]
 * mod 2^32; its top sin_bits bits index the sine table, a quarter turn on for the cosine. */
#include "kvn_common.h"

static inline void pair_of(int64_t j, int64_t r2, int64_t roff, int style, int64_t *a, int64_t *b)
{
    *a = style == 0 ? roff + j : roff + 2 * j;
    *b = style == 0 ? roff + r2 + j : roff + 2 * j + 1;
}

/* mu float32 [H, D] -> out float32 [n, H, D]: R(pos[t]) mu (kvn_common.h's rotate_mean_row, which
 * the one-call kvc decoder uses too). */
void kvn_rotated_means(const float *mu, int64_t n, int64_t H, int64_t D, const int64_t *pos, const uint32_t *steps,
                       int64_t r2, int64_t roff, int style, const float *sintab, int64_t sin_bits, float *out)
{
    for (int64_t t = 0; t < n; t++) {
        float *o = out + t * H * D;
        memcpy(o, mu, sizeof(float) * (size_t)(H * D));
        rotate_mean_row(mu, H, D, pos[t], steps, r2, roff, style, sintab, sin_bits, o);
    }
}

/* k [n, H, D] (kind F_F32 / F_F16) -> out float64 [H, D]: the mean over tokens of R(pos[t])^-1 k[t]
 * ((a c + b s, b c - a s) on each pair in float64; other channels as they are). acc is scratch
 * float64 [H, D]. */
void kvn_unrotated_mean(const void *k, int kind, int64_t n, int64_t H, int64_t D, const int64_t *pos,
                        const uint32_t *steps, int64_t r2, int64_t roff, int style, const float *sintab,
                        int64_t sin_bits, double *out)
{
    const int64_t nsin = (int64_t)1 << sin_bits, quarter = nsin >> 2, sh = 32 - sin_bits, hd = H * D;
    float *row = (float *)malloc(sizeof(float) * (size_t)(hd > 0 ? hd : 1));
    double *cs = (double *)malloc(sizeof(double) * (size_t)(2 * r2 + 1));
    if (!row || !cs) {
        free(row);
        free(cs);
        for (int64_t e = 0; e < hd; e++)
            out[e] = NAN;
        return;
    }
    for (int64_t t = 0; t < n; t++) {
        load_row(row, k, kind, t * hd, hd);
        const uint64_t p = (uint64_t)(uint32_t)pos[t];
        for (int64_t j = 0; j < r2; j++) {
            const uint32_t i = (uint32_t)(p * (uint64_t)steps[j]) >> sh;
            cs[j] = (double)sintab[(i + quarter) & (nsin - 1)];
            cs[r2 + j] = (double)sintab[i];
        }
        double *acc = out;
        if (t == 0) { /* numpy's reduction starts from the first token's values */
            for (int64_t e = 0; e < hd; e++)
                acc[e] = (double)row[e];
            for (int64_t h = 0; h < H; h++)
                for (int64_t j = 0; j < r2; j++) {
                    int64_t a, b;
                    pair_of(j, r2, roff, style, &a, &b);
                    const double xa = row[h * D + a], xb = row[h * D + b], c = cs[j], s = cs[r2 + j];
                    const double u = xa * c, v = xb * s, w = xb * c, z = xa * s;
                    acc[h * D + a] = u + v;
                    acc[h * D + b] = w - z;
                }
            continue;
        }
        for (int64_t h = 0; h < H; h++) {
            const float *x = row + h * D;
            double *o = acc + h * D;
            /* channels outside the pairs: summed as they are */
            const int64_t p0 = r2 ? roff : D, p1 = r2 ? roff + 2 * r2 : D;
            for (int64_t e = 0; e < p0; e++)
                o[e] = o[e] + (double)x[e];
            for (int64_t e = p1; e < D; e++)
                o[e] = o[e] + (double)x[e];
            if (style == 0) { /* pairs (roff + j, roff + r2 + j): one loop over j that vectorises */
                const float *xa = x + roff, *xb = xa + r2;
                double *oa = o + roff, *ob = oa + r2;
                for (int64_t j = 0; j < r2; j++) {
                    const double a = xa[j], b = xb[j], c = cs[j], s = cs[r2 + j];
                    const double u = a * c, v = b * s, w = b * c, z = a * s;
                    oa[j] = oa[j] + (u + v);
                    ob[j] = ob[j] + (w - z);
                }
                continue;
            }
            for (int64_t j = 0; j < r2; j++) {
                int64_t a, b;
                pair_of(j, r2, roff, style, &a, &b);
                const double xa = x[a], xb = x[b], c = cs[j], s = cs[r2 + j];
                const double u = xa * c, v = xb * s, w = xb * c, z = xa * s;
                o[a] = o[a] + (u + v);
                o[b] = o[b] + (w - z);
            }
        }
    }
    if (n > 0)
        for (int64_t e = 0; e < hd; e++)
            out[e] = out[e] / (double)n;
    free(row);
    free(cs);
}

/* y float32 [n, H, D] -> z = y - R(pos[t]) mu (float32, one rounding per element), and the
 * rotated means themselves into rot where it is not NULL: kvn_rotated_means and the encoder's
 * subtraction in one pass (kvcodec.transforms.rope.rope_centred). */
void kvn_rope_centre(const float *y, const float *mu, int64_t n, int64_t H, int64_t D, const int64_t *pos,
                     const uint32_t *steps, int64_t r2, int64_t roff, int style, const float *sintab, int64_t sin_bits,
                     float *z, float *rot)
{
    const int64_t hd = H * D;
    float *scratch = rot ? NULL : (float *)malloc(sizeof(float) * (size_t)(hd > 0 ? hd : 1));
    if (!rot && !scratch) { /* no memory: NaN, which no caller's values can hold */
        for (int64_t e = 0; e < n * hd; e++)
            z[e] = NAN;
        return;
    }
    for (int64_t t = 0; t < n; t++) {
        float *r = rot ? rot + t * hd : scratch;
        memcpy(r, mu, sizeof(float) * (size_t)hd);
        rotate_mean_row(mu, H, D, pos[t], steps, r2, roff, style, sintab, sin_bits, r);
        const float *yt = y + t * hd;
        float *zt = z + t * hd;
        for (int64_t e = 0; e < hd; e++)
            zt[e] = yt[e] - r[e];
    }
    free(scratch);
}
