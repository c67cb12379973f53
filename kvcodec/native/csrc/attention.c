/* attention.c -- kvc's attention estimate (kvn_softmax_mean): per KV head, the mean over its query
 * rows of each row's softmax, in one pass per row while the row is in cache. Bit for bit what
 * kvcodec/codecs/kvc/calibration.py's softmax_mean computes (its reference, in numpy):
 *
 *   m     = the row's largest logit (and its sink logit, if any)
 *   e_j   = exp_neg(x_j - m): 0 below -86, else Cephes' expf: n = round(d log2 e) (by adding and
 *           subtracting 1.5 * 2^23), r = (d - n C1) - n C2, z = r^2, its degree-5 polynomial P by
 *           Estrin's scheme ((P0 r + P1) z^2 + (P2 r + P3) z) + (P4 r + P5), (P z + r) + 1, times 2^n
 *   Z     = eight partial sums (element j into lane j % 8, in order), added lane 0 to 7, plus
 *           the sink's e
 *   p_j   = e_j * (1 / Z), in float32
 *   est_j = the float64 sum of p_j over the rows in order, divided by the number of rows
 *
 * every operation a separately rounded float32 one (-ffp-contract=off). A row whose logits are
 * all -inf (and no sink) adds 0. Logits must be finite or -inf: a NaN or +inf returns 1 and the
 * caller takes its torch path. Kernels: one written with GCC vector extensions of eight lanes,
 * compiled twice (AVX2 where the CPU has it, chosen at run time; plain otherwise): the same
 * operations on every element either way. The encoder's estimate, not a decoder's: it sets
 * step sizes, never the meaning of a file. */
#include "kvn_common.h"

#define SM_LO (-86.0f)         /* below: e = 0 (2^-124 and more: never a subnormal) */
#define SM_LOG2E 1.44269504088896341f
#define SM_MAGIC 12582912.0f   /* 1.5 * 2^23: v + M - M rounds v to an integer, half to even */
#define SM_C1 0.693359375f
#define SM_C2 (-2.12194440e-4f)
#define SM_P0 1.9875691500e-4f
#define SM_P1 1.3981999507e-3f
#define SM_P2 8.3334519073e-3f
#define SM_P3 4.1665795894e-2f
#define SM_P4 1.6666665459e-1f
#define SM_P5 5.0000001201e-1f

typedef float sm_v8 __attribute__((vector_size(32)));
typedef int32_t sm_i8 __attribute__((vector_size(32)));

/* exp_neg of eight values (each <= 0, or -inf): the header's arithmetic, lane by lane */
#define SM_EXP8(D, OUT)                                                                              \
    do {                                                                                             \
        const sm_v8 lo_ = KVN_SPLAT8(SM_LO), l2e_ = KVN_SPLAT8(SM_LOG2E), mg_ = KVN_SPLAT8(SM_MAGIC); \
        const sm_v8 c1_ = KVN_SPLAT8(SM_C1), c2_ = KVN_SPLAT8(SM_C2), one_ = KVN_SPLAT8(1.0f);       \
        const sm_v8 dd_ = (D);                                                                       \
        const sm_i8 under_ = dd_ < lo_;                                                              \
        const sm_v8 d_ = (sm_v8)(((sm_i8)dd_ & ~under_) | ((sm_i8)lo_ & under_));                    \
        const sm_v8 n_ = (d_ * l2e_ + mg_) - mg_;                                                    \
        const sm_v8 r_ = (d_ - n_ * c1_) - n_ * c2_;                                                 \
        const sm_v8 z_ = r_ * r_;                                                                    \
        const sm_v8 z2_ = z_ * z_; /* the polynomial by Estrin's scheme: a shorter chain */         \
        const sm_v8 a_ = r_ * (sm_v8)KVN_SPLAT8(SM_P0) + (sm_v8)KVN_SPLAT8(SM_P1);                   \
        const sm_v8 b_ = r_ * (sm_v8)KVN_SPLAT8(SM_P2) + (sm_v8)KVN_SPLAT8(SM_P3);                   \
        const sm_v8 c_ = r_ * (sm_v8)KVN_SPLAT8(SM_P4) + (sm_v8)KVN_SPLAT8(SM_P5);                   \
        sm_v8 y_ = (a_ * z2_ + b_ * z_) + c_;                                                        \
        y_ = (y_ * z_ + r_) + one_;                                                                  \
        const sm_i8 e2_ = (__builtin_convertvector(n_, sm_i8) + 127) << 23;                           \
        (OUT) = (sm_v8)((sm_i8)(y_ * (sm_v8)e2_) & ~under_);                                          \
    } while (0)

/* M = the larger of M and V, lane by lane (the order of a maximum's operands changes nothing) */
#define SM_MAX(M, V)                                                                                 \
    do {                                                                                             \
        const sm_i8 gt_ = (V) > (M);                                                                 \
        (M) = (sm_v8)(((sm_i8)(V) & gt_) | ((sm_i8)(M) & ~gt_));                                     \
    } while (0)

typedef float sm_v4 __attribute__((vector_size(16)));
typedef double sm_d4 __attribute__((vector_size(32)));

/* One KV head: rows [R, T] of logits (each row's sink logit in sink, or NULL), the sums of the
 * rows' probabilities added into acc [T] (float64); e: scratch of T rounded up to 8 floats.
 * Returns 1 when a logit is NaN or +inf. Every pass in vectors of eight (four for the float64
 * sums); the scalar tails do the same operations. */
#define SM_KERNEL(NAME, ATTR)                                                                        \
    ATTR static int NAME(const float *x, int64_t R, int64_t T, const float *sink, float *e, double *acc) \
    {                                                                                                \
        const int64_t T8 = T - T % 8, T4 = T - T % 4;                                                \
        const sm_v8 inf8 = KVN_SPLAT8(INFINITY);                                                     \
        for (int64_t r = 0; r < R; r++) {                                                            \
            const float *row = x + r * T;                                                            \
            /* the largest logit: four running maxima */                                             \
            sm_v8 m0 = -inf8, m1 = -inf8, m2 = -inf8, m3 = -inf8;                                    \
            sm_i8 bad8 = {0};                                                                        \
            int64_t j1 = 0;                                                                          \
            for (; j1 + 32 <= T8; j1 += 32) {                                                        \
                sm_v8 v0, v1, v2, v3;                                                                \
                memcpy(&v0, row + j1, sizeof v0);                                                    \
                memcpy(&v1, row + j1 + 8, sizeof v1);                                                \
                memcpy(&v2, row + j1 + 16, sizeof v2);                                               \
                memcpy(&v3, row + j1 + 24, sizeof v3);                                               \
                bad8 |= (v0 != v0) | (v0 == inf8) | (v1 != v1) | (v1 == inf8);                       \
                bad8 |= (v2 != v2) | (v2 == inf8) | (v3 != v3) | (v3 == inf8);                       \
                SM_MAX(m0, v0);                                                                      \
                SM_MAX(m1, v1);                                                                      \
                SM_MAX(m2, v2);                                                                      \
                SM_MAX(m3, v3);                                                                      \
            }                                                                                        \
            for (; j1 < T8; j1 += 8) {                                                               \
                sm_v8 v;                                                                             \
                memcpy(&v, row + j1, sizeof v);                                                      \
                bad8 |= (v != v) | (v == inf8);                                                      \
                SM_MAX(m0, v);                                                                       \
            }                                                                                        \
            SM_MAX(m0, m1);                                                                          \
            SM_MAX(m2, m3);                                                                          \
            SM_MAX(m0, m2);                                                                          \
            const sm_v8 m8 = m0;                                                                     \
            float m = -INFINITY;                                                                     \
            int bad = 0;                                                                             \
            for (int l = 0; l < 8; l++) {                                                            \
                bad |= bad8[l] != 0;                                                                 \
                m = m8[l] > m ? m8[l] : m;                                                           \
            }                                                                                        \
            for (int64_t j = T8; j < T; j++) {                                                       \
                const float v = row[j];                                                              \
                bad |= (v != v) | (v == INFINITY);                                                   \
                m = v > m ? v : m;                                                                   \
            }                                                                                        \
            if (bad || (sink && (sink[r] != sink[r] || sink[r] == INFINITY)))                        \
                return 1;                                                                            \
            if (sink && sink[r] > m)                                                                 \
                m = sink[r];                                                                         \
            if (m == -INFINITY)                                                                      \
                continue; /* no key seen, no sink: the row adds 0 */                                 \
            const sm_v8 mv = KVN_SPLAT8(m);                                                          \
            sm_v8 s = KVN_SPLAT8(0.0f);                                                              \
            int64_t j0 = 0;                                                                          \
            for (; j0 + 16 <= T8; j0 += 16) { /* two vectors at a time: their chains overlap */     \
                sm_v8 v, w, ev, ew;                                                                  \
                memcpy(&v, row + j0, sizeof v);                                                      \
                memcpy(&w, row + j0 + 8, sizeof w);                                                  \
                SM_EXP8(v - mv, ev);                                                                 \
                SM_EXP8(w - mv, ew);                                                                 \
                memcpy(e + j0, &ev, sizeof ev);                                                      \
                memcpy(e + j0 + 8, &ew, sizeof ew);                                                  \
                s = s + ev;                                                                          \
                s = s + ew;                                                                          \
            }                                                                                        \
            for (; j0 < T8; j0 += 8) {                                                               \
                sm_v8 v, ev;                                                                         \
                memcpy(&v, row + j0, sizeof v);                                                      \
                SM_EXP8(v - mv, ev);                                                                 \
                memcpy(e + j0, &ev, sizeof ev);                                                      \
                s = s + ev;                                                                          \
            }                                                                                        \
            if (T8 < T) { /* the tail, padded with -inf: e = 0, and lane + 0 leaves the lane */      \
                sm_v8 v = -inf8, ev;                                                                 \
                for (int64_t j = T8; j < T; j++)                                                     \
                    v[j - T8] = row[j];                                                              \
                SM_EXP8(v - mv, ev);                                                                 \
                memcpy(e + T8, &ev, sizeof ev);                                                      \
                s = s + ev;                                                                          \
            }                                                                                        \
            float z = s[0];                                                                          \
            for (int l = 1; l < 8; l++)                                                              \
                z = z + s[l];                                                                        \
            if (sink) {                                                                              \
                sm_v8 v = KVN_SPLAT8(sink[r]), ev;                                                   \
                SM_EXP8(v - mv, ev);                                                                 \
                z = z + ev[0];                                                                       \
            }                                                                                        \
            const float inv = 1.0f / z;                                                              \
            const sm_v4 inv4 = {inv, inv, inv, inv};                                                 \
            for (int64_t j = 0; j < T4; j += 4) {                                                    \
                sm_v4 p;                                                                             \
                sm_d4 a;                                                                             \
                memcpy(&p, e + j, sizeof p);                                                         \
                memcpy(&a, acc + j, sizeof a);                                                       \
                a = a + __builtin_convertvector(p * inv4, sm_d4);                                    \
                memcpy(acc + j, &a, sizeof a);                                                       \
            }                                                                                        \
            for (int64_t j = T4; j < T; j++)                                                         \
                acc[j] += (double)(e[j] * inv);                                                      \
        }                                                                                            \
        return 0;                                                                                    \
    }

SM_KERNEL(sm_plain, )
#ifdef KVN_X86
SM_KERNEL(sm_avx2, __attribute__((target("avx2"))))
#endif

/* logits [B, R, T] float32 (B KV heads of R query rows each), sinks [B, R] or NULL; out [T, B]
 * float64: the mean over each head's rows of the rows' softmax. kernel 0: the fastest this CPU
 * runs, 1: the plain one, 2: AVX2 (tests: the same bits). Returns 0, 1 (a NaN or +inf logit: out
 * is not written), -1 (out of memory) or -2 (the CPU lacks the kernel asked for). */
int kvn_softmax_mean(const float *logits, int64_t B, int64_t R, int64_t T, const float *sinks, double *out,
                     int kernel)
{
    int (*fn)(const float *, int64_t, int64_t, const float *, float *, double *) = sm_plain;
#ifdef KVN_X86
    __builtin_cpu_init();
    const int has8 = __builtin_cpu_supports("avx2");
    if (kernel == 2 && !has8)
        return -2;
    if (kernel == 2 || (kernel == 0 && has8))
        fn = sm_avx2;
#else
    if (kernel == 2)
        return -2;
#endif
    float *e = (float *)malloc(sizeof(float) * (size_t)(T + 8));
    double *acc = (double *)malloc(sizeof(double) * (size_t)(T > 0 ? T : 1));
    if (!e || !acc) {
        free(e);
        free(acc);
        return -1;
    }
    int rc = 0;
    for (int64_t b = 0; b < B && rc == 0; b++) {
        for (int64_t j = 0; j < T; j++)
            acc[j] = 0.0;
        rc = fn(logits + b * R * T, R, T, sinks ? sinks + b * R : NULL, e, acc);
        for (int64_t j = 0; j < T && rc == 0; j++)
            out[j * B + b] = acc[j] / (double)R;
    }
    free(e);
    free(acc);
    return rc;
}
