/* kvn_common.h -- what the C units of kvcodec's native library share: includes, status codes,
 * element kinds, the ANS stage geometry, and small inline helpers (float conversions, keys).
 *
 * Plain C99 with no Python headers: kvcodec/native/build.py compiles every unit of this folder
 * into one shared library (flags in build.py; -ffp-contract=off keeps float code bit-exact),
 * caches it and calls it through ctypes with the signatures of kvcodec/native/abi.py. Each unit
 * must agree bit for bit with the reference it names (tests/test_native.py).
 *
 * ANS entropy stages (formats/ANS.md), bit-exact with kvcodec/entropy/ans_ref.py:
 *
 *   stream: 64-bit state x, 32-bit words; the decoder pops words from the END of the stream.
 *   decode: q = x & (2^24-1); s with C[s] <= q < C[s+1]; x = (x >> 24) * F[s] + q - C[s];
 *           if x < 2^32 and words remain: x = x << 32 | next word.  End: no words left, x == 0.
 *   encode: symbols last to first: if (x >> 40) >= F[s]: emit low word, x >>= 32;
 *           x = (x / F[s]) << 24 | (C[s] + x % F[s]).  Flush: low word, then high word (if != 0).
 *
 * Stage geometry (ANS.md §3): symbols X[R, N]; stream s = c * n_groups + g holds rows
 * [g*G, min(R, g*G+G)) over tokens [c*C, min(N, c*C+C)), row after row; the table of row r in
 * chunk c is table_of[set * R + r] with set = scope ? c : 0, an index into the flat table list.
 * Scope 2 (magnitude contexts, ANS.md §3.1): one table set, but the table of X[r, t] is
 * table_of[q * R + r], where the class q of the k-th row of a stream at token t is 0 for k = 0,
 * else the number of thresholds T_i with 8 * a >= T_i * k, a = sum over the stream's earlier rows
 * of |X - center| at that token. Encoder and decoder compute q from the symbols themselves.
 */
#ifndef KVN_COMMON_H
#define KVN_COMMON_H

#include <stdint.h>
#include <stdlib.h>
#include <math.h>
#include <string.h>

enum { KVN_OK = 0, KVN_ZERO_WORD = 1, KVN_NOT_CONSUMED = 2, KVN_NOMEM = 3, KVN_BAD_SYMBOL = 4, KVN_OVERFLOW = 5 };
/* Code element kinds (ckind / okind) of the dead-zone, escape, delta and dequantization entry points. */
enum { C_I64 = 0, C_I32 = 1 };
enum { OUT_I32_RN = 0, OUT_U16_NR = 1, OUT_U8_NR = 2 }; /* int32 [R, N]; uint16 / uint8 [N, R] (transposed) */

#define PREC 24
#define QMASK ((1u << PREC) - 1u)
#define LANES 4
#define MAXQ 16

/* geometry vector passed from Python: R, N, C, G, P, A, n_tables, scope, Q, center, T_1 .. T_15
 * (Q = 1 and no thresholds unless scope == 2) */
typedef struct {
  int64_t R, N, C, G, P, A, T, scope, n_groups, n_chunks, n_streams, Q, center, thr[MAXQ];
} Geom;

/* Version of the functions' signatures; kvcodec/native/abi.py's ABI_VERSION must equal it (the
 * loader checks kvn_abi_version()). Bump both when a signature changes. */
#define KVN_ABI_VERSION 39

/* Functions shared between units but not part of the ABI: hidden from the library's exports. */
#if defined(__GNUC__) || defined(__clang__)
#define KVN_INTERNAL __attribute__((visibility("hidden")))
#define KVN_ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define KVN_INTERNAL
#define KVN_ALWAYS_INLINE inline
#endif

/* an initializer of 4, 8 or 16 copies of s, for GCC vector types (not s + 0: that would turn
 * -0 into +0, and the compiler would spend an add on every copy) */
#define KVN_SPLAT4(s) {(s), (s), (s), (s)}
#define KVN_SPLAT8(s) {(s), (s), (s), (s), (s), (s), (s), (s)}
#define KVN_SPLAT16(s) {(s), (s), (s), (s), (s), (s), (s), (s), (s), (s), (s), (s), (s), (s), (s), (s)}

/* x86-64 with GCC's target attributes and __builtin_cpu_supports: the units build their AVX2 (and
 * AVX-512) kernels beside the plain ones and choose at run time */
#if defined(__GNUC__) && defined(__x86_64__)
#define KVN_X86 1
#include <immintrin.h>
#endif

static inline void geom_read(const int64_t* g, Geom* o) {
  o->R = g[0]; o->N = g[1]; o->C = g[2]; o->G = g[3]; o->P = g[4]; o->A = g[5]; o->T = g[6]; o->scope = g[7];
  o->Q = g[8] >= 1 && g[8] <= MAXQ ? g[8] : 1; /* validated by the caller */
  o->center = g[9];
  for (int64_t i = 0; i < MAXQ; ++i) o->thr[i] = i < o->Q - 1 ? g[10 + i] : 0;
  o->n_groups = (o->R + o->G - 1) / o->G;
  o->n_chunks = o->N ? (o->N + o->C - 1) / o->C : 0;
  o->n_streams = o->n_groups * o->n_chunks;
}

/* The class of one symbol (scope 2): 0 for the first row of a stream (k = 0), else the number of
 * thresholds with 8 * a >= T_i * k, i.e. with a >= b_i = ceil(T_i * k / 8). ctx_bounds fills b
 * for row k (k = 0: bounds no sum reaches, so class 0); ctx_class counts them without branches
 * for the usual one to four thresholds. */
static inline void ctx_bounds(const int64_t* thr, int64_t nthr, int64_t k, int64_t* b) {
  for (int64_t i = 0; i < nthr; ++i) b[i] = k ? (thr[i] * k + 7) / 8 : INT64_MAX;
}

static inline int ctx_class(int64_t a, const int64_t* b, int64_t nthr) {
  switch (nthr) {
    case 0: return 0;
    case 1: return (a >= b[0]);
    case 2: return (a >= b[0]) + (a >= b[1]);
    case 3: return (a >= b[0]) + (a >= b[1]) + (a >= b[2]);
    case 4: return (a >= b[0]) + (a >= b[1]) + (a >= b[2]) + (a >= b[3]);
    default: {
      int q = 0;
      for (int64_t i = 0; i < nthr; ++i) q += a >= b[i];
      return q;
    }
  }
}

/* ------------------------------------------------------------------ float conversions */
/* Element kinds of float arrays: float32, float16 bits, bfloat16 bits. */
enum { F_F32 = 0, F_F16 = 1, F_BF16 = 2 };

static inline uint32_t f32_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}
static inline float bits_f32(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

/* float32 -> float16 bits, round to nearest even, overflow to inf (as torch's cast and numpy's
 * astype); NaN becomes the quiet NaN 0x7e00 (never produced from valid files). F. Giesen's method
 * written without branches (every path computed, then selected) so loops of it vectorise. */
static inline uint16_t f32_to_f16(float f) {
  uint32_t x = f32_bits(f);
  const uint32_t sign = x & 0x80000000u;
  x ^= sign;
  /* normal: rebias the exponent by -112 (0xC8000000 mod 2^32), round the 13 dropped bits to even */
  const uint32_t nrm = (x + 0xC8000FFFu + ((x >> 13) & 1u)) >> 13;
  /* subnormal (< 2^-14): adding 0.5 puts the f16 quantum 2^-24 at float32's last bit, so the float
   * add does the rounding */
  const uint32_t sub = f32_bits(bits_f32(x) + 0.5f) - 0x3F000000u;
  const uint32_t big = x > 0x7F800000u ? 0x7E00u : 0x7C00u; /* >= 2^16: inf (or NaN) */
  uint32_t o = x < 0x38800000u ? sub : nrm;
  o = x >= 0x47800000u ? big : o;
  return (uint16_t)(o | (sign >> 16));
}

static inline uint16_t f32_to_bf16(float f) { /* RNE on the dropped 16 bits (finite inputs) */
  const uint32_t u = f32_bits(f);
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* float16 bits -> float32, exact. */
static inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0x1f) return bits_f32(sign | 0x7f800000u | (m << 13));
  if (e == 0) return bits_f32(sign) + (sign ? -1.0f : 1.0f) * (float)m * bits_f32(103u << 23); /* m * 2^-24 */
  return bits_f32(sign | ((e + 112u) << 23) | (m << 13));
}

static inline float load_f(const void* p, int kind, int64_t i) {
  if (kind == F_F16) return f16_to_f32(((const uint16_t*)p)[i]);
  if (kind == F_BF16) return bits_f32((uint32_t)((const uint16_t*)p)[i] << 16);
  return ((const float*)p)[i];
}

/* Order-preserving integer key of a float's bits (negative floats have their magnitude bits
 * flipped), and back: the map is its own inverse. */
static inline int32_t fkey(float f) {
  const int32_t i = (int32_t)f32_bits(f);
  return i ^ ((i >> 31) & 0x7fffffff);
}
static inline float fkey_f32(int32_t k) { return bits_f32((uint32_t)(k ^ ((k >> 31) & 0x7fffffff))); }

/* Round to nearest, ties to even, as rintf in the default rounding mode but without a libm call
 * (x86-64's baseline has no rounding instruction): adding and removing 2^23 leaves a float whose
 * last bit is the unit, so the float add rounds; values of magnitude >= 2^23 (and inf, NaN) are
 * already integral and returned as they are; the sign is v's, zeros included. */
static inline float rne_f32(float v) {
  const float big = 8388608.0f; /* 2^23 */
  const float a = fabsf(v);
  const float r = (a + big) - big; /* RNE(|v|) for |v| < 2^23; rint(v) = sign(v) * RNE(|v|) */
  return copysignf(a < big ? r : a, v); /* branch-free, so loops of it vectorise */
}

static inline float clampf(float v, float m) { return v > m ? m : (v < -m ? -m : v); }

/* Rotating means (kvcodec.transforms.rope.rotated_means): the r2 pairs of R(p) mean, each head of
 * D channels, written into out (channels outside the pairs are left as they are). The phase of
 * pair j is (p mod 2^32) * steps[j] mod 2^32, its top sin_bits bits index sintab (a quarter turn
 * on for the cosine); style 0 pairs (roff + j, roff + r2 + j), 1 pairs (roff + 2j, roff + 2j + 1);
 * float32 products rounded one by one (-ffp-contract=off). Shared by kvc_decode.c and rope.c. */
#define KVN_ROPE_MAX_PAIRS 512
static inline void rotate_mean_row(const float* mean, int64_t H, int64_t D, int64_t pos, const uint32_t* steps,
                                   int64_t r2, int64_t roff, int style, const float* sintab, int64_t sin_bits,
                                   float* out) {
  const uint32_t nsin = 1u << sin_bits, quarter = 1u << (sin_bits - 2), sh = (uint32_t)(32 - sin_bits);
  const uint64_t p = (uint64_t)(uint32_t)pos;
  if (style == 0 && r2 <= KVN_ROPE_MAX_PAIRS) {
    /* the phases first, then each head's pairs in one loop over j that vectorises (the same
       products and sums, element by element, as the general loop below) */
    float cs[KVN_ROPE_MAX_PAIRS], sn[KVN_ROPE_MAX_PAIRS];
    for (int64_t j = 0; j < r2; ++j) {
      const uint32_t i = (uint32_t)(p * (uint64_t)steps[j]) >> sh;
      cs[j] = sintab[(i + quarter) & (nsin - 1)];
      sn[j] = sintab[i];
    }
    for (int64_t h = 0; h < H; ++h) {
      const float* ma = mean + h * D + roff;
      const float* mb = ma + r2;
      float* oa = out + h * D + roff;
      float* ob = oa + r2;
      for (int64_t j = 0; j < r2; ++j) {
        const float x = ma[j] * cs[j], y = mb[j] * sn[j], z = mb[j] * cs[j], w = ma[j] * sn[j];
        oa[j] = x - y;
        ob[j] = z + w;
      }
    }
    return;
  }
  for (int64_t j = 0; j < r2; ++j) {
    const uint32_t i = (uint32_t)(p * (uint64_t)steps[j]) >> sh;
    const float c = sintab[(i + quarter) & (nsin - 1)], s = sintab[i];
    const int64_t a = style == 0 ? roff + j : roff + 2 * j, b = style == 0 ? roff + r2 + j : roff + 2 * j + 1;
    for (int64_t h = 0; h < H; ++h) {
      const float ma = mean[h * D + a], mb = mean[h * D + b];
      const float x = ma * c, y = mb * s, z = mb * c, w = ma * s;
      out[h * D + a] = x - y;
      out[h * D + b] = z + w;
    }
  }
}

/* convert.c: rows of float16 / bfloat16 / float32 from and to float32, with the F16C instructions
 * where the CPU has them (the same bits as the portable code; kvn_set_hw_f16 switches). */
KVN_INTERNAL void store_row(void* out, int kind, int64_t o, const float* src, int64_t n);
KVN_INTERNAL void load_row(float* dst, const void* src, int kind, int64_t o, int64_t n);
KVN_INTERNAL int all_finite(const void* v, int kind, int64_t n);
/* kvc.c, shared with kvc_decode.c: kvn_escape_join's int32 output, and one row of
 * kvn_kvc_dequant's arithmetic from int32 codes */
KVN_INTERNAL int escape_join_i32(const uint16_t* sym, int64_t n, int64_t R, int64_t L, const int64_t* esc,
                                 int64_t n_esc, const uint8_t* delta, int32_t* out);
KVN_INTERNAL void dq_row_i32(const int32_t* c, const float* st, int64_t s2, const float* mu, int64_t D, float m,
                             const float* rtab, int64_t rm, float* r);

#endif /* KVN_COMMON_H */
