/* deadzone.c -- dead-zone quantization and kvc's reconstruction-offset sums
 * (kvcodec.quant.deadzone).
 */
#include "kvn_common.h"

/* Dead-zone quantization (kvcodec.quant.deadzone.deadzone_quantize), the same float64 arithmetic:
 * code = sign(x) * floor(|x| / step + rho), and kvc's reconstruction-offset statistics
 * (kvcodec.quant.deadzone.recon_sums) of those codes, taken from the same quotients. Rows are
 * done in blocks of DZ_BLOCK values: the quotients |x| / step first (one vectorisable division
 * loop into stack scratch), then the codes, then (with levels) the sums — every loop
 * branch-free, which measured 2-3x faster than the data-dependent branches compilers emit for
 * the sign and level tests. */
#define DZ_BLOCK 256
/* The row loops below stay out of line: inlined into the dispatch over steps, codes and levels
 * they ran out of registers (spills in the inner loop: 2x slower on 64-value rows). */
#if defined(__GNUC__) || defined(__clang__)
#define KVN_NOINLINE __attribute__((noinline))
#else
#define KVN_NOINLINE
#endif

/* The quotients |x| / step of n values (float64, the quantizer's division; steps read as float64
 * or float32, converted exactly, with stride ss) into q. */
#define KVN_QUOT_ROW(STYPE)                                                                         \
  static KVN_NOINLINE void quot_row_##STYPE(const float* xr, const STYPE* st, int64_t ss, int64_t n, double* q) { \
    for (int64_t k = 0; k < n; ++k) q[k] = fabs((double)xr[k]) / (double)st[k * ss];                \
  }
KVN_QUOT_ROW(double)
KVN_QUOT_ROW(float)

/* The row walk and the sums exist for int64 codes (suffix _i64: any code below 2^53) and int32
 * codes (_i32: codes below 2^31, half the memory traffic and a vectorisable conversion -- what the
 * kvc encoder asks for first); CT is the code type. Each family's codes come from DZ_CODES_* (codes
 * only) and DZ_FROM_QUOT_* (codes from quotients), defined after it below. */
#define KVN_DZ_FAMILY(SUF, CT)                                                                     \
  /* Reconstruction sums of n codes and their quotients: per level l = 1..levels, acc[4 * l +      \
   * lane] += llrint((l - q) * 2^24) (rounded half to even by the 1.5 * 2^52 trick: |residual| <=  \
   * 2^24 for a quotient that matches its code, in the default rounding mode) and cnt[4 * l +      \
   * lane] += 1; slot l = 0 takes every code outside 1..levels and is never read. Four lanes of    \
   * accumulators so consecutive values do not wait on one another; acc, cnt: int64 [4 * 17]. */   \
  static KVN_NOINLINE void recon_row##SUF(const double* q, const CT* cr, int64_t n, int64_t levels, int64_t* acc,  \
                             int64_t* cnt) {                                                        \
    const double magic = 6755399441055744.0; /* 1.5 * 2^52 */                                       \
    for (int64_t k = 0; k < n; ++k) {                                                               \
      const int64_t c = (int64_t)cr[k];                                                             \
      const int64_t m = c < 0 ? -c : c;                                                             \
      /* a quotient that does not match its code (NaN, huge) only lands in slot 0: clamped so the  \
         cast stays defined (a no-op for the counted levels, whose quotients are below 17) */       \
      const double qq = q[k] < 1073741824.0 ? q[k] : 1073741824.0;                                  \
      const double r = (((double)m - qq) * 16777216.0 + magic) - magic;                             \
      const int64_t in = (uint64_t)(m - 1) < (uint64_t)levels; /* 1 <= m <= levels */               \
      const int64_t slot = 4 * (m * in) + (k & 3);                                                  \
      acc[slot] = (int64_t)((uint64_t)acc[slot] + (uint64_t)(int64_t)r); /* slot 0 may wrap */      \
      cnt[slot] += 1;                                                                               \
    }                                                                                               \
  }                                                                                                 \
  /* One (i, j) row of n values: codes (quantize != 0: written to cr; else cr holds them) and,     \
   * with levels > 0, the sums. Returns the codes' flag. */                                         \
  static int dz_row##SUF(const float* xr, const void* step, int skind, int64_t ss, int64_t n,        \
                         double rho, CT* cr, int quantize, int64_t levels, int64_t* acc,            \
                         int64_t* cnt) {                                                            \
    if (quantize && !levels)                                                                        \
      return DZ_CODES##SUF(xr, step, skind, ss, n, rho, cr);                                        \
    double q[DZ_BLOCK];                                                                             \
    int bad = 0;                                                                                    \
    for (int64_t k0 = 0; k0 < n; k0 += DZ_BLOCK) {                                                  \
      const int64_t nb = n - k0 < DZ_BLOCK ? n - k0 : DZ_BLOCK;                                     \
      if (skind == 1)                                                                               \
        quot_row_float(xr + k0, (const float*)step + k0 * ss, ss, nb, q);                           \
      else                                                                                          \
        quot_row_double(xr + k0, (const double*)step + k0 * ss, ss, nb, q);                         \
      if (quantize) bad |= DZ_FROM_QUOT##SUF(xr + k0, q, nb, rho, cr + k0);                         \
      if (levels) recon_row##SUF(q, cr + k0, nb, levels, acc, cnt);                                 \
    }                                                                                               \
    return bad;                                                                                     \
  }                                                                                                 \
  /* The rows of x float32 [n0, n1, n2] (steps with element strides s0, s1, s2, 0 = broadcast;     \
   * codes element (i, j, k) at i * orow + j * n2 + k), folded into sums, counts [levels]. */       \
  static int dz_rows##SUF(const float* x, int64_t n0, int64_t n1, int64_t n2, const void* step,      \
                          int skind, int64_t s0, int64_t s1, int64_t s2, double rho, CT* codes,     \
                          int64_t orow, int quantize, int64_t levels, int64_t* sums,                \
                          int64_t* counts) {                                                        \
    int64_t acc[4 * 17] = {0}, cnt[4 * 17] = {0};                                                   \
    const size_t es = skind == 1 ? sizeof(float) : sizeof(double);                                  \
    int bad = 0;                                                                                    \
    for (int64_t i = 0; i < n0 && !bad; ++i)                                                        \
      for (int64_t j = 0; j < n1 && !bad; ++j)                                                      \
        bad |= dz_row##SUF(x + (i * n1 + j) * n2, (const char*)step + (size_t)(i * s0 + j * s1) * es,  \
                           skind, s2, n2, rho, codes + i * orow + j * n2, quantize, levels, acc,    \
                           cnt);                                                                    \
    for (int64_t l = 1; l <= levels; ++l) {                                                         \
      sums[l - 1] = acc[4 * l] + acc[4 * l + 1] + acc[4 * l + 2] + acc[4 * l + 3];                  \
      counts[l - 1] = cnt[4 * l] + cnt[4 * l + 1] + cnt[4 * l + 2] + cnt[4 * l + 3];                \
    }                                                                                               \
    return bad;                                                                                     \
  }

/* int64 codes, one loop each (the int64 conversion has no SSE2 vector form, so there is nothing
 * to gain from splitting them as the int32 ones below are). Dead-zone codes from quotients:
 * sign(x) * floor(q + rho); nonzero if a q + rho is not below 2^53 (or is NaN: a non-finite x).
 * q >= 0 (steps > 0), so truncation is floor. */
static KVN_NOINLINE int dz_from_quot_i64(const float* xr, const double* q, int64_t n, double rho, int64_t* cr) {
  const double lim = 9007199254740992.0; /* 2^53 */
  int bad = 0;
  for (int64_t k = 0; k < n; ++k) {
    const double v = q[k] + rho;
    const int ok = v < lim; /* false for NaN */
    bad |= !ok;
    const int64_t m = (int64_t)(ok ? v : 0.0);
    const int64_t neg = -(int64_t)(xr[k] < 0); /* all ones for a negative value */
    cr[k] = (m ^ neg) - neg;                   /* -m or m */
  }
  return bad;
}

/* Codes only, without scratch (measured ~15 % faster than the blocks when no sums are taken). */
#define KVN_DZ_DIRECT(SNAME, STYPE)                                                                    \
  static KVN_NOINLINE int dz_direct_##SNAME##_i64(const float* xr, const STYPE* st, int64_t ss, int64_t n, \
                                                  double rho, int64_t* cr) {                          \
    const double lim = 9007199254740992.0; /* 2^53 */                                                 \
    int bad = 0;                                                                                      \
    for (int64_t k = 0; k < n; ++k) {                                                                 \
      const double v = fabs((double)xr[k]) / (double)st[k * ss] + rho;                                \
      const int ok = v < lim;                                                                         \
      bad |= !ok;                                                                                     \
      const int64_t m = (int64_t)(ok ? v : 0.0);                                                      \
      const int64_t neg = -(int64_t)(xr[k] < 0);                                                      \
      cr[k] = (m ^ neg) - neg;                                                                        \
    }                                                                                                 \
    return bad;                                                                                       \
  }
KVN_DZ_DIRECT(f, float)
KVN_DZ_DIRECT(d, double)

/* int32 codes without sums, vectorisable: per block, the magnitudes floor(|x| / step + rho) (or -1
 * where that is not below 2^31 or NaN: rho > 0, so a valid magnitude is never negative), then the
 * flags OR-ed, then the signs -- three loops without a cross-iteration dependency the compiler
 * cannot vectorise (one loop with the flag reduction ran scalar: 0.5 against 0.2 ms on a
 * [1535, 3, 64] tensor). Same codes and flag as dz_direct_*_i64, in int32. */
#define KVN_DZ_MAG(SNAME, STYPE)                                                                     \
  static KVN_NOINLINE void dz_mag_##SNAME(const float* xr, const STYPE* st, int64_t ss, int64_t n,  \
                                          double rho, int32_t* m) {                                 \
    if (ss == 0) {                                                                                  \
      const double s0 = (double)st[0];                                                              \
      for (int64_t k = 0; k < n; ++k) {                                                             \
        const double v = fabs((double)xr[k]) / s0 + rho;                                            \
        m[k] = (int32_t)(v < 2147483648.0 ? v : -1.0);                                              \
      }                                                                                             \
    } else if (ss == 1) {                                                                           \
      for (int64_t k = 0; k < n; ++k) {                                                             \
        const double v = fabs((double)xr[k]) / (double)st[k] + rho;                                 \
        m[k] = (int32_t)(v < 2147483648.0 ? v : -1.0);                                              \
      }                                                                                             \
    } else {                                                                                        \
      for (int64_t k = 0; k < n; ++k) {                                                             \
        const double v = fabs((double)xr[k]) / (double)st[k * ss] + rho;                            \
        m[k] = (int32_t)(v < 2147483648.0 ? v : -1.0);                                              \
      }                                                                                             \
    }                                                                                               \
  }
KVN_DZ_MAG(f, float)
KVN_DZ_MAG(d, double)

static int dz_blocks_i32(const float* xr, const void* step, int skind, int64_t ss, int64_t n, double rho,
                         int32_t* cr) {
  int32_t m[DZ_BLOCK];
  int32_t flag = 0;
  for (int64_t k0 = 0; k0 < n; k0 += DZ_BLOCK) {
    const int64_t nb = n - k0 < DZ_BLOCK ? n - k0 : DZ_BLOCK;
    if (skind == 1)
      dz_mag_f(xr + k0, (const float*)step + k0 * ss, ss, nb, rho, m);
    else
      dz_mag_d(xr + k0, (const double*)step + k0 * ss, ss, nb, rho, m);
    for (int64_t k = 0; k < nb; ++k) flag |= m[k];
    const float* x = xr + k0;
    int32_t* o = cr + k0;
    for (int64_t k = 0; k < nb; ++k) {
      const int32_t neg = -(int32_t)(x[k] < 0);
      o[k] = (m[k] ^ neg) - neg;
    }
  }
  return flag < 0;
}

/* dz_from_quot for int32 codes, vectorisable (the magnitudes with -1 for out of range, their
 * flags OR-ed, then the signs: see dz_blocks_i32). */
static KVN_NOINLINE int dz_from_quot_blocks_i32(const float* xr, const double* q, int64_t n, double rho, int32_t* cr) {
  int32_t flag = 0;
  for (int64_t k = 0; k < n; ++k) {
    const double v = q[k] + rho;
    cr[k] = (int32_t)(v < 2147483648.0 ? v : -1.0);
  }
  for (int64_t k = 0; k < n; ++k) flag |= cr[k];
  for (int64_t k = 0; k < n; ++k) {
    const int32_t neg = -(int32_t)(xr[k] < 0);
    cr[k] = (cr[k] ^ neg) - neg;
  }
  return flag < 0;
}
#define DZ_FROM_QUOT_i64 dz_from_quot_i64
#define DZ_FROM_QUOT_i32 dz_from_quot_blocks_i32

/* The codes-only paths of the two families. */
#define DZ_CODES_i64(XR, STEP, SKIND, SS, N, RHO, CR)                                      \
  ((SKIND) == 1 ? dz_direct_f_i64(XR, (const float*)(STEP), SS, N, RHO, CR)                \
                : dz_direct_d_i64(XR, (const double*)(STEP), SS, N, RHO, CR))
#define DZ_CODES_i32(XR, STEP, SKIND, SS, N, RHO, CR) dz_blocks_i32(XR, STEP, SKIND, SS, N, RHO, CR)
KVN_DZ_FAMILY(_i64, int64_t)
KVN_DZ_FAMILY(_i32, int32_t)

static int dz_dispatch(const float* x, int64_t n0, int64_t n1, int64_t n2, const void* step, int skind, int64_t s0,
                       int64_t s1, int64_t s2, double rho, void* codes, int ckind, int64_t orow, int quantize,
                       int64_t levels, int64_t* sums, int64_t* counts) {
  return ckind == C_I32 ? dz_rows_i32(x, n0, n1, n2, step, skind, s0, s1, s2, rho, (int32_t*)codes, orow, quantize,
                                      levels, sums, counts)
                        : dz_rows_i64(x, n0, n1, n2, step, skind, s0, s1, s2, rho, (int64_t*)codes, orow, quantize,
                                      levels, sums, counts);
}

/* Dead-zone codes sign(x) * floor(|x| / step + rho) of float32 x [n0, n1, n2] (float64 arithmetic,
 * as kvcodec.quant.deadzone.deadzone_quantize), steps float64 (skind 0) or float32 (skind 1,
 * converted exactly) with element strides s0, s1, s2 (0 = broadcast). codes: int64 (ckind 0) or
 * int32 (ckind 1), element (i, j, k) at i * orow + j * n2 + k (orow >= n1 * n2: a wider matrix can
 * take the codes in its first columns). Returns 1 if a value is not finite or a code would reach
 * 2^53 (int32: 2^31; the caller then uses the numpy path / int64 codes), else 0. */
int kvn_deadzone(const float* x, int64_t n0, int64_t n1, int64_t n2, const void* step, int skind, int64_t s0,
                 int64_t s1, int64_t s2, double rho, void* codes, int ckind, int64_t orow) {
  return dz_dispatch(x, n0, n1, n2, step, skind, s0, s1, s2, rho, codes, ckind, orow, 1, 0, NULL, NULL);
}

/* kvc's reconstruction-offset statistics (kvcodec.native.recon_sums) of existing int64 codes
 * (layout as kvn_deadzone's): per level l = 1..levels (1..16), counts[l - 1] = #{|c| = l},
 * sums[l - 1] = sum of llrint((l - |x| / step) * 2^24) (float64 residuals, half to even, summed
 * exactly). Returns KVN_BAD_SYMBOL for levels outside 1..16, else KVN_OK. */
int kvn_recon_sums(const float* x, int64_t n0, int64_t n1, int64_t n2, const void* step, int skind, int64_t s0,
                   int64_t s1, int64_t s2, const int64_t* codes, int64_t orow, int64_t levels, int64_t* sums,
                   int64_t* counts) {
  if (levels < 1 || levels > 16) return KVN_BAD_SYMBOL;
  dz_rows_i64(x, n0, n1, n2, step, skind, s0, s1, s2, 0.0, (int64_t*)codes, orow, 0, levels, sums, counts);
  return KVN_OK;
}

/* kvn_deadzone and kvn_recon_sums in one pass (each quotient computed once): the codes as
 * kvn_deadzone writes them and the sums and counts of those codes. Returns 1 as kvn_deadzone does
 * (the sums are then meaningless), KVN_BAD_SYMBOL for levels outside 1..16, else 0. */
int kvn_deadzone_recon(const float* x, int64_t n0, int64_t n1, int64_t n2, const void* step, int skind, int64_t s0,
                       int64_t s1, int64_t s2, double rho, void* codes, int ckind, int64_t orow, int64_t levels,
                       int64_t* sums, int64_t* counts) {
  if (levels < 1 || levels > 16) return KVN_BAD_SYMBOL;
  return dz_dispatch(x, n0, n1, n2, step, skind, s0, s1, s2, rho, codes, ckind, orow, 1, levels, sums, counts);
}
