/* kvc.c -- kvc's symbol passes (kvcodec.codecs.kvc): escape split and join of token-major code
 * matrices (with token-delta columns and magnitude-context statistics), the normative
 * dequantization, and the token-delta statistics.
 */
#include "kvn_common.h"

/* kvc escapes on a token-major code matrix codes[t * R + r] (int64 [n, R]): L = clamp(max|c| + 1,
 * 1, max_level); sym = |c| < L ? c + L - 1 : 2L - 1 (uint16 [n, R]); the escaped codes go to esc
 * (int32, wrapped as numpy's astype) in ROW-major order of the [R, n] symbol matrix (row r, then
 * token t), as kvcodec.codecs.kvc.escape_split writes them. esc needs room for every escape:
 * call with sym = NULL first: it returns L (in *lv), the escape count (in *n_esc) and each row's
 * count (rowcnt, int64 [R]); then call again with sym, esc, rowcnt and *lv as returned.
 * delta (uint8 [R] or NULL): columns with delta[r] != 0 are split as their token deltas
 * c[t] - c[t-1] (t > 0; the encoder's codes are far inside the int64 range), as kvc codes them. */
static inline int64_t esc_val(const int64_t* codes, int64_t t, int64_t r, int64_t R, const uint8_t* delta) {
  const int64_t c = codes[t * R + r];
  return (delta && delta[r] && t) ? c - codes[(t - 1) * R + r] : c;
}

int kvn_escape_split(const int64_t* codes, int64_t n, int64_t R, int64_t max_level, const uint8_t* delta,
                     uint16_t* sym, int32_t* esc, int64_t* rowcnt, int64_t* n_esc, int64_t* lv) {
  if (!sym) {
    /* pass 1: the largest magnitude and, per row, how many reach max_level (the escapes if
       L = max_level; with L = top + 1 < max_level nothing escapes) */
    uint64_t top = 0;
    const uint64_t ml = max_level > 0 ? (uint64_t)max_level : 1;
    for (int64_t r = 0; r < R; ++r) rowcnt[r] = 0;
    for (int64_t t = 0; t < n; ++t)
      for (int64_t r = 0; r < R; ++r) {
        const int64_t c = esc_val(codes, t, r, R, delta);
        const uint64_t a = c < 0 ? (uint64_t)0 - (uint64_t)c : (uint64_t)c;
        top = a > top ? a : top;
        rowcnt[r] += a >= ml;
      }
    int64_t L = top + 1 < (uint64_t)max_level ? (int64_t)top + 1 : max_level;
    if (L < 1) L = 1;
    *lv = L;
    int64_t total = 0;
    for (int64_t r = 0; r < R; ++r) {
      if (L < max_level) rowcnt[r] = 0;
      total += rowcnt[r];
    }
    *n_esc = total;
    return KVN_OK;
  }
  /* pass 2, with rowcnt and *lv from pass 1 */
  const int64_t L = *lv;
  int64_t* pos = (int64_t*)malloc((size_t)(R > 0 ? R : 1) * sizeof(int64_t));
  if (!pos) return KVN_NOMEM;
  int64_t total = 0;
  for (int64_t r = 0; r < R; ++r) { /* counts -> first slot of each row */
    pos[r] = total;
    total += rowcnt[r];
  }
  const uint16_t e = (uint16_t)(2 * L - 1);
  for (int64_t t = 0; t < n; ++t)
    for (int64_t r = 0; r < R; ++r) {
      const int64_t c = esc_val(codes, t, r, R, delta);
      if (c >= L || c <= -L) {
        sym[t * R + r] = e;
        if (esc) esc[pos[r]++] = (int32_t)(uint32_t)(uint64_t)c;
      } else {
        sym[t * R + r] = (uint16_t)(c + L - 1);
      }
    }
  free(pos);
  return KVN_OK;
}

/* The symbol SV of code C in row R_ of a one-pass split at L = max_level (ml, e = 2 ml - 1, top,
 * ne, cap, etok, erow in scope): an escape is recorded in token order while the scratch lasts. */
#define ESC_SYMBOL(C, R_, SV)                                                  \
  do {                                                                         \
    const uint64_t a_ = (C) < 0 ? (uint64_t)0 - (uint64_t)(C) : (uint64_t)(C); \
    top = a_ > top ? a_ : top;                                                 \
    if (a_ >= (uint64_t)ml) {                                                  \
      SV = e;                                                                  \
      if (ne < cap) {                                                          \
        etok[ne] = (int32_t)(uint32_t)(uint64_t)(C);                           \
        erow[ne] = (int32_t)(R_);                                              \
      }                                                                        \
      ++ne;                                                                    \
    } else {                                                                   \
      SV = (C) + ml - 1;                                                       \
    }                                                                          \
  } while (0)

/* The one pass of kvn_escape_split1 over int64 or int32 codes (CT); returns the escape count. */
#define KVN_ESC_PASS(SUF, CT)                                                                             \
  static int64_t esc_pass##SUF(const CT* codes, int64_t n, int64_t R, int64_t ml, const uint8_t* delta,   \
                               uint16_t* sym, int32_t* etok, int32_t* erow, int64_t cap, uint64_t* top_out) { \
    const uint16_t e = (uint16_t)(2 * ml - 1);                                                           \
    uint64_t top = 0;                                                                                    \
    int64_t ne = 0;                                                                                      \
    for (int64_t t = 0; t < n; ++t) {                                                                    \
      const CT* ct = codes + t * R;                                                                      \
      uint16_t* st = sym + t * R;                                                                        \
      for (int64_t r = 0; r < R; ++r) {                                                                  \
        const int64_t c = (delta && delta[r] && t) ? (int64_t)ct[r] - (int64_t)ct[r - R] : (int64_t)ct[r]; \
        int64_t sv;                                                                                      \
        ESC_SYMBOL(c, r, sv);                                                                            \
        st[r] = (uint16_t)sv;                                                                            \
      }                                                                                                  \
    }                                                                                                    \
    *top_out = top;                                                                                      \
    return ne;                                                                                           \
  }
KVN_ESC_PASS(_i64, int64_t)
KVN_ESC_PASS(_i32, int32_t)

/* The escape split's L: clamp(max|c| + 1, 1, max_level). */
static inline int64_t esc_level(uint64_t top, int64_t ml) {
  const int64_t L = top + 1 < (uint64_t)ml ? (int64_t)top + 1 : ml;
  return L < 1 ? 1 : L;
}

/* The end of a one-pass split: L and the escape count out; with L < max_level (nothing escaped)
 * the symbols shifted down to the smaller alphabet, else the escapes put in row order (a stable
 * counting sort of the token-order scratch). */
static int esc_finish(uint16_t* sym, int64_t n, int64_t R, int64_t ml, uint64_t top, int64_t ne, int32_t* esc,
                      const int32_t* etok, const int32_t* erow, int64_t* n_esc, int64_t* lv, int64_t orow) {
  const int64_t L = esc_level(top, ml);
  *lv = L;
  *n_esc = ne;
  if (L < ml) {
    const uint16_t d = (uint16_t)(ml - L);
    if (orow) /* row-major rows orow apart: their first n */
      for (int64_t r = 0; r < R; ++r)
        for (int64_t t = 0; t < n; ++t) sym[r * orow + t] = (uint16_t)(sym[r * orow + t] - d);
    else
      for (int64_t i = 0; i < n * R; ++i) sym[i] = (uint16_t)(sym[i] - d);
    return KVN_OK;
  }
  if (!ne) return KVN_OK;
  int64_t* pos = (int64_t*)calloc((size_t)(R > 0 ? R : 1), sizeof(int64_t));
  if (!pos) return KVN_NOMEM;
  for (int64_t i = 0; i < ne; ++i) pos[erow[i]] += 1;
  int64_t total = 0;
  for (int64_t r = 0; r < R; ++r) { /* counts -> first slot of each row */
    const int64_t k = pos[r];
    pos[r] = total;
    total += k;
  }
  for (int64_t i = 0; i < ne; ++i) esc[pos[erow[i]]++] = etok[i];
  free(pos);
  return KVN_OK;
}

/* kvn_escape_split in one pass over the codes (int64, ckind 0, or int32, ckind 1; same sym, esc
 * and L): the symbols are written as if L = max_level, the escapes collected in token order with
 * their rows (at most cap of them: KVN_OVERFLOW beyond, sym then undone -- the caller uses the
 * two passes), then put in row order by a stable counting sort; when every |c| < max_level - 1,
 * L = max|c| + 1 and the symbols are shifted down by max_level - L instead. etok, erow: int32
 * [cap] scratch; esc: int32 [cap]. */
int kvn_escape_split1(const void* codes, int ckind, int64_t n, int64_t R, int64_t max_level, const uint8_t* delta,
                      uint16_t* sym, int32_t* esc, int32_t* etok, int32_t* erow, int64_t cap, int64_t* n_esc,
                      int64_t* lv) {
  const int64_t ml = max_level > 0 ? max_level : 1;
  uint64_t top = 0;
  const int64_t ne = ckind == C_I32 ? esc_pass_i32((const int32_t*)codes, n, R, ml, delta, sym, etok, erow, cap, &top)
                                : esc_pass_i64((const int64_t*)codes, n, R, ml, delta, sym, etok, erow, cap, &top);
  if (ne > cap) return KVN_OVERFLOW;
  return esc_finish(sym, n, R, ml, top, ne, esc, etok, erow, n_esc, lv, 0);
}

/* kvn_escape_split1 that also takes a scope-2 entropy stage's statistics of the symbols it writes,
 * in the same pass (kvcodec.native.ctx_histograms' counts and classes: streams of G rows over the
 * token-major [n, R] symbols, nthr thresholds thr, center L - 1): hist int64 [Q * R, 2 L]
 * (row q * R + r; zeroed and filled here, Q = nthr + 1), cls uint8 [n, R]. The classes follow
 * the magnitudes |symbol - center| -- |c| for a regular code, L for an escape -- which do not
 * depend on the final L (when it ends below max_level nothing escaped), so only the histogram's
 * columns move with it. Returns as kvn_escape_split1, or KVN_BAD_SYMBOL for bad arguments (nthr
 * outside [0, 16), G < 1, n >= 2^31, 0 < orow < n). scratch: int32 [R * Q * 2 max_level] counts.
 * orow > 0: sym and cls are written row-major, rows orow >= n elements apart ([R, orow] arrays,
 * what the entropy stage reads fastest) instead. The pass
 * below covers tokens [tb, n) and goes on from ne escapes and the largest magnitude *top_out; the
 * symbol and class of (t, r) go to t * ot + r * orr. */
#define KVN_ESC_CTX_PASS(SUF, CT, NTHR)                                                                  \
  static int64_t esc_ctx_pass##SUF(const CT* codes, int64_t tb, int64_t n, int64_t R, int64_t ml,      \
                                   const uint8_t* delta, uint16_t* sym, int32_t* etok, int32_t* erow,    \
                                   int64_t cap, int64_t ne, uint64_t* top_out, int64_t G, int64_t nthr_, \
                                   const int64_t* bk, int32_t* h, uint8_t* cls, int64_t ot,             \
                                   int64_t orr) {                                                        \
    /* a constant threshold count (NTHR >= 0) lets the inlined ctx_class drop its switch */              \
    const int64_t nthr = (NTHR) >= 0 ? (NTHR) : nthr_;                                                  \
    const uint16_t e = (uint16_t)(2 * ml - 1);                                                          \
    const int64_t Q = nthr + 1, A = 2 * ml;                                                             \
    uint64_t top = *top_out;                                                                            \
    for (int64_t t = tb; t < n; ++t) {                                                                  \
      const CT* ct = codes + t * R;                                                                     \
      uint16_t* st = sym + t * ot;                                                                      \
      uint8_t* qt = cls + t * ot;                                                                       \
      for (int64_t r0 = 0; r0 < R; r0 += G) {                                                           \
        const int64_t r1 = r0 + G < R ? r0 + G : R;                                                     \
        int64_t acc = 0; /* the stream's running magnitude sum at token t */                            \
        for (int64_t r = r0; r < r1; ++r) {                                                             \
          const int64_t c = (delta && delta[r] && t) ? (int64_t)ct[r] - (int64_t)ct[r - R] : (int64_t)ct[r]; \
          int64_t sv;                                                                                   \
          ESC_SYMBOL(c, r, sv);                                                                         \
          const int64_t mag = sv == e ? ml : (c < 0 ? -c : c); /* |symbol - center| */                  \
          st[r * orr] = (uint16_t)sv;                                                                   \
          const int q = ctx_class(acc, bk + (r - r0) * MAXQ, nthr);                                     \
          qt[r * orr] = (uint8_t)q;                                                                     \
          h[(r * Q + q) * A + sv] += 1;                                                                 \
          acc += mag;                                                                                   \
        }                                                                                               \
      }                                                                                                 \
    }                                                                                                   \
    *top_out = top;                                                                                     \
    return ne;                                                                                          \
  }
KVN_ESC_CTX_PASS(_i64, int64_t, -1)
KVN_ESC_CTX_PASS(_i32, int32_t, -1)
/* kvc's stages have one to four thresholds: the pass specialised for each (25 % faster with
 * three, scratch benchmark on SmolLM2's tensors; the same operations) */
KVN_ESC_CTX_PASS(_i32_1, int32_t, 1)
KVN_ESC_CTX_PASS(_i32_2, int32_t, 2)
KVN_ESC_CTX_PASS(_i32_3, int32_t, 3)
KVN_ESC_CTX_PASS(_i32_4, int32_t, 4)

/* 0: this unit's AVX2 paths (the escape split with contexts, dq_row_i32) stay scalar: tests
 * compare the two through kvn_kvc_vector, which sets it (on >= 0) and returns what it was */
static int kvc_vector = 1;

int kvn_kvc_vector(int on) {
  const int was = kvc_vector;
  if (on >= 0) kvc_vector = on != 0;
  return was;
}

#ifdef KVN_X86
/* Tokens [t0, t0 + 8) of esc_ctx_pass_i32 in AVX2 lanes, one token a lane: the codes of a row
 * gathered down the tokens, the split, magnitude, class and running sum as vectors; the symbols
 * and classes stored (lane by lane, or eight side by side for row-major outputs), the counts and
 * escapes lane by lane. For int32 codes of magnitude below 2^30 at
 * these tokens and the one before (their token deltas fit int32), 1 to 4 thresholds, 8 R < 2^31
 * and a stream's magnitude sum below 2^31 (the caller checks): then the same outputs as the scalar
 * pass. orr: 1 for token-major outputs, else the row stride of row-major ones. Escapes are
 * recorded row by row within the block, each row's in token order: the counting sort by row that
 * orders them (esc_finish) gives the same list. bm1: per row of a stream
 * (k < G), the class bounds minus one clamped to int32 (int32 [G][4]). */
__attribute__((target("avx2"))) static int64_t esc_ctx_block8(const int32_t* codes, int64_t t0, int64_t R, int64_t ml,
                                                           const uint8_t* delta, uint16_t* sym, int32_t* etok,
                                                           int32_t* erow, int64_t cap, int64_t ne, uint64_t* top_out,
                                                           int64_t G, int64_t nthr, const int32_t* bm1, int32_t* h,
                                                           uint8_t* cls, int64_t orr) {
  const int64_t Q = nthr + 1, A = 2 * ml;
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i idx = _mm256_mullo_epi32(lane, _mm256_set1_epi32((int32_t)R));
  const __m256i idxp = _mm256_sub_epi32(idx, _mm256_set1_epi32((int32_t)R)); /* the token before */
  /* lane 0 at token 0 has no token before: its delta is the code itself */
  const __m256i pmask = t0 ? _mm256_set1_epi32(-1) : _mm256_cmpgt_epi32(lane, _mm256_setzero_si256());
  const __m256i vml = _mm256_set1_epi32((int32_t)ml), vml1 = _mm256_set1_epi32((int32_t)(ml - 1));
  const __m256i ve = _mm256_set1_epi32((int32_t)(2 * ml - 1));
  __m256i top = _mm256_setzero_si256();
  int32_t svb[8] __attribute__((aligned(32))), qb[8] __attribute__((aligned(32))), cb[8] __attribute__((aligned(32)));
  for (int64_t r0 = 0; r0 < R; r0 += G) {
    const int64_t r1 = r0 + G < R ? r0 + G : R;
    __m256i acc = _mm256_setzero_si256();
    for (int64_t r = r0; r < r1; ++r) {
      const int32_t* base = codes + t0 * R + r;
      __m256i c = _mm256_i32gather_epi32((const int*)base, idx, 4);
      if (delta && delta[r])
        c = _mm256_sub_epi32(c, _mm256_mask_i32gather_epi32(_mm256_setzero_si256(), (const int*)base, idxp, pmask, 4));
      const __m256i a = _mm256_abs_epi32(c);
      top = _mm256_max_epu32(top, a);
      const __m256i esc = _mm256_cmpgt_epi32(a, vml1); /* |c| >= ml */
      const __m256i sv = _mm256_blendv_epi8(_mm256_add_epi32(c, vml1), ve, esc);
      const int32_t* b = bm1 + (r - r0) * 4;
      __m256i q = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_cmpgt_epi32(acc, _mm256_set1_epi32(b[0])));
      if (nthr > 1) q = _mm256_sub_epi32(q, _mm256_cmpgt_epi32(acc, _mm256_set1_epi32(b[1])));
      if (nthr > 2) q = _mm256_sub_epi32(q, _mm256_cmpgt_epi32(acc, _mm256_set1_epi32(b[2])));
      if (nthr > 3) q = _mm256_sub_epi32(q, _mm256_cmpgt_epi32(acc, _mm256_set1_epi32(b[3])));
      acc = _mm256_add_epi32(acc, _mm256_min_epi32(a, vml)); /* an escape counts ml */
      _mm256_store_si256((__m256i*)svb, sv);
      _mm256_store_si256((__m256i*)qb, q);
      const int m = _mm256_movemask_ps(_mm256_castsi256_ps(esc));
      int32_t* hr = h + r * Q * A;
      if (orr == 1) { /* token-major: a lane a token row */
        for (int j = 0; j < 8; ++j) {
          const int64_t at = (t0 + j) * R + r;
          sym[at] = (uint16_t)svb[j];
          cls[at] = (uint8_t)qb[j];
          hr[qb[j] * A + svb[j]] += 1;
        }
      } else { /* row-major: the eight tokens side by side */
        const __m128i s16 = _mm_packus_epi32(_mm256_castsi256_si128(sv), _mm256_extracti128_si256(sv, 1));
        const __m128i q16 = _mm_packus_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
        _mm_storeu_si128((__m128i*)(sym + r * orr + t0), s16);
        _mm_storel_epi64((__m128i*)(cls + r * orr + t0), _mm_packus_epi16(q16, q16));
        for (int j = 0; j < 8; ++j) hr[qb[j] * A + svb[j]] += 1;
      }
      if (m) {
        _mm256_store_si256((__m256i*)cb, c);
        for (int j = 0; j < 8; ++j)
          if ((m >> j) & 1) {
            if (ne < cap) {
              etok[ne] = cb[j];
              erow[ne] = (int32_t)r;
            }
            ++ne;
          }
      }
    }
  }
  uint32_t tb[8];
  memcpy(tb, &top, sizeof tb);
  for (int j = 0; j < 8; ++j) *top_out = tb[j] > *top_out ? tb[j] : *top_out;
  return ne;
}

/* 1 when every code of rows [t0, t1) of the token-major int32 matrix has magnitude below 2^30 */
__attribute__((target("avx2"))) static int esc_small_rows(const int32_t* codes, int64_t t0, int64_t t1, int64_t R) {
  const int32_t* p = codes + t0 * R;
  const int64_t m = (t1 - t0) * R, m8 = m - m % 8;
  const __m256i off = _mm256_set1_epi32(1 << 30);
  __m256i big = _mm256_setzero_si256();
  for (int64_t i = 0; i < m8; i += 8) { /* c + 2^30 outside [0, 2^31): |c| >= 2^30 */
    const __m256i v = _mm256_loadu_si256((const __m256i*)(p + i));
    big = _mm256_or_si256(big, _mm256_add_epi32(v, off));
  }
  uint32_t any = (uint32_t)_mm256_movemask_ps(_mm256_castsi256_ps(big));
  for (int64_t i = m8; i < m; ++i) any |= (uint32_t)(p[i] + (int64_t)(1 << 30)) >> 31 | (p[i] < -(1 << 30));
  return any == 0;
}
#endif

int kvn_escape_split_ctx(const void* codes, int ckind, int64_t n, int64_t R, int64_t max_level, const uint8_t* delta,
                         uint16_t* sym, int32_t* esc, int32_t* etok, int32_t* erow, int64_t cap, int64_t* n_esc,
                         int64_t* lv, int64_t G, int64_t nthr, const int64_t* thr, int64_t* hist, uint8_t* cls,
                         int64_t orow) {
  if (orow != 0 && orow < n) return KVN_BAD_SYMBOL;
  const int64_t ot = orow ? 1 : R, orr = orow ? orow : 1; /* where (t, r) goes */
  if (nthr < 0 || nthr >= MAXQ || G < 1 || n >= ((int64_t)1 << 31)) return KVN_BAD_SYMBOL;
  const int64_t ml = max_level > 0 ? max_level : 1;
  const int64_t Q = nthr + 1, A = 2 * ml;
  const int64_t gk = G < R ? G : R;
  int64_t* bk = (int64_t*)malloc(sizeof(int64_t) * (size_t)(gk * MAXQ + 1)); /* class bounds per row */
  int32_t* h = (int32_t*)calloc((size_t)(R * Q * A + 1), sizeof(int32_t));  /* [R][Q][A] while scanning */
  if (!bk || !h) {
    free(bk);
    free(h);
    return KVN_NOMEM;
  }
  for (int64_t k = 0; k < gk; ++k) ctx_bounds(thr, nthr, k, bk + k * MAXQ);
  uint64_t top = 0;
  int64_t ne;
  if (ckind == C_I32) {
    int64_t (*pass)(const int32_t*, int64_t, int64_t, int64_t, int64_t, const uint8_t*, uint16_t*, int32_t*, int32_t*,
                    int64_t, int64_t, uint64_t*, int64_t, int64_t, const int64_t*, int32_t*, uint8_t*, int64_t,
                    int64_t) =
        nthr == 1 ? esc_ctx_pass_i32_1 : nthr == 2 ? esc_ctx_pass_i32_2 : nthr == 3 ? esc_ctx_pass_i32_3
        : nthr == 4 ? esc_ctx_pass_i32_4 : esc_ctx_pass_i32;
    const int32_t* c32 = (const int32_t*)codes;
    int64_t done = 0;
    ne = 0;
#ifdef KVN_X86
    /* eight tokens at a time in AVX2 lanes where the block's codes allow it (esc_ctx_block8),
       else the scalar pass on those tokens; the last n % 8 tokens scalar */
    __builtin_cpu_init();
    if (kvc_vector && __builtin_cpu_supports("avx2") && nthr >= 1 && nthr <= 4 && R < ((int64_t)1 << 28) &&
        gk * ml < ((int64_t)1 << 30) && n >= 8) {
      int32_t* bm1 = (int32_t*)malloc(sizeof(int32_t) * (size_t)(gk * 4));
      if (bm1) {
        for (int64_t k = 0; k < gk; ++k)
          for (int64_t i = 0; i < 4; ++i) {
            const int64_t b = i < nthr ? bk[k * MAXQ + i] : INT64_MAX;
            bm1[k * 4 + i] = b > INT32_MAX ? INT32_MAX : b <= INT32_MIN ? INT32_MIN : (int32_t)(b - 1);
          }
        for (; done + 8 <= n; done += 8) {
          if (esc_small_rows(c32, done ? done - 1 : 0, done + 8, R))
            ne = esc_ctx_block8(c32, done, R, ml, delta, sym, etok, erow, cap, ne, &top, gk, nthr, bm1, h, cls, orr);
          else
            ne = pass(c32, done, done + 8, R, ml, delta, sym, etok, erow, cap, ne, &top, G, nthr, bk, h, cls, ot, orr);
        }
        free(bm1);
      }
    }
#endif
    ne = pass(c32, done, n, R, ml, delta, sym, etok, erow, cap, ne, &top, G, nthr, bk, h, cls, ot, orr);
  } else {
    ne = esc_ctx_pass_i64((const int64_t*)codes, 0, n, R, ml, delta, sym, etok, erow, cap, 0, &top, G, nthr, bk, h,
                          cls, ot, orr);
  }
  free(bk);
  if (ne > cap) {
    free(h);
    return KVN_OVERFLOW;
  }
  /* the histogram over the final alphabet 2L: symbol s' = s - (max_level - L) */
  const int64_t L = esc_level(top, ml), d = ml - L, A2 = 2 * L;
  for (int64_t r = 0; r < R; ++r)
    for (int64_t q = 0; q < Q; ++q)
      for (int64_t s2 = 0; s2 < A2; ++s2) hist[(q * R + r) * A2 + s2] = h[(r * Q + q) * A + s2 + d];
  free(h);
  return esc_finish(sym, n, R, ml, top, ne, esc, etok, erow, n_esc, lv, orow);
}

/* kvn_escape_join's int32 output (its status codes: 1 escape count, 2 an escape inside the
 * regular range, 3 a code past int32), shaped for speed: the plain codes of a token
 * row in one loop the compiler vectorises (with an "any escape here" flag), escapes fixed
 * after, token-delta rows summed from a list, and no counting pass when the file has no
 * escapes (a stray escape symbol is then caught in the row loop). */
KVN_INTERNAL int escape_join_i32(const uint16_t* sym, int64_t n, int64_t R, int64_t L, const int64_t* esc,
                                 int64_t n_esc, const uint8_t* delta, int32_t* out) {
  const uint16_t e = (uint16_t)(2 * L - 1);
  const int32_t off = (int32_t)(L - 1);
  int64_t* pos = (int64_t*)calloc((size_t)(R > 0 ? R : 1), sizeof(int64_t));
  int64_t* drow = (int64_t*)malloc(sizeof(int64_t) * (size_t)(R > 0 ? R : 1));
  int32_t* cnt = (int32_t*)calloc((size_t)(R > 0 ? R : 1), sizeof(int32_t));
  if (!pos || !drow || !cnt) {
    free(pos); free(drow); free(cnt);
    return KVN_NOMEM;
  }
  int64_t nd = 0;
  for (int64_t r = 0; r < R; ++r)
    if (delta && delta[r]) drow[nd++] = r;
  if (n_esc > 0) { /* where each row's escapes start in the row-major esc plane */
    for (int64_t t = 0; t < n; ++t) {
      const uint16_t* st = sym + t * R;
      for (int64_t r = 0; r < R; ++r) cnt[r] += st[r] == e;
    }
    int64_t total = 0;
    for (int64_t r = 0; r < R; ++r) {
      pos[r] = total;
      total += cnt[r];
    }
    if (total != n_esc) {
      free(pos); free(drow); free(cnt);
      return 1;
    }
  }
  int rc = KVN_OK, wide = 0;
  for (int64_t t = 0; t < n; ++t) {
    const uint16_t* st = sym + t * R;
    int32_t* o = out + t * R;
    int any = 0;
    for (int64_t r = 0; r < R; ++r) {
      o[r] = (int32_t)st[r] - off;
      any |= st[r] == e;
    }
    if (any) {
      if (n_esc <= 0) { rc = 1; break; } /* escape symbols, but the esc plane is empty */
      for (int64_t r = 0; r < R; ++r)
        if (st[r] == e) {
          const int64_t v = esc[pos[r]++];
          if (v < L && v > -L) rc = 2;
          wide |= v < INT32_MIN || v > INT32_MAX;
          o[r] = (int32_t)v;
        }
    }
    if (t)
      for (int64_t j = 0; j < nd; ++j) { /* token-delta rows: running sums down the tokens */
        const int64_t r = drow[j];
        const int64_t v = (int64_t)o[r] + (int64_t)o[r - R];
        wide |= v < INT32_MIN || v > INT32_MAX;
        o[r] = (int32_t)v;
      }
  }
  free(pos); free(drow); free(cnt);
  return rc ? rc : (wide ? 3 : KVN_OK);
}

/* Inverse: out[t * R + r] = sym - (L - 1), escape symbols (2L - 1) replaced by esc values taken in
 * row-major order of [R, n]; with delta (uint8 [R] or NULL), the columns r with delta[r] != 0
 * become their running sums over t. out: int64 (okind 0) or int32 (okind 1) [n, R]. Returns 1 if the
 * escape count differs from n_esc, 2 if an escaped value lies inside (-L, L) (both corrupt files),
 * 3 if int32 output was asked for and a code does not fit (the caller redoes it in int64), KVN_NOMEM,
 * else KVN_OK. sym: uint16 [n, R]. */
int kvn_escape_join(const uint16_t* sym, int64_t n, int64_t R, int64_t L, const int64_t* esc, int64_t n_esc,
                    const uint8_t* delta, void* out, int okind) {
  if (okind == C_I32) return escape_join_i32(sym, n, R, L, esc, n_esc, delta, (int32_t*)out);
  const uint16_t e = (uint16_t)(2 * L - 1);
  int64_t* pos = (int64_t*)calloc((size_t)(R > 0 ? R : 1), sizeof(int64_t));
  if (!pos) return KVN_NOMEM;
  for (int64_t t = 0; t < n; ++t)
    for (int64_t r = 0; r < R; ++r) pos[r] += sym[t * R + r] == e;
  int64_t total = 0;
  for (int64_t r = 0; r < R; ++r) {
    const int64_t k = pos[r];
    pos[r] = total;
    total += k;
  }
  if (total != n_esc) {
    free(pos);
    return 1;
  }
  int rc = KVN_OK;
  int64_t* o64 = (int64_t*)out;
  for (int64_t t = 0; t < n; ++t)
    for (int64_t r = 0; r < R; ++r) {
      const uint16_t s = sym[t * R + r];
      int64_t v;
      if (s == e) {
        v = esc[pos[r]++];
        if (v < L && v > -L) rc = 2;
      } else {
        v = (int64_t)s - (L - 1);
      }
      /* kvc's token-delta rows: running sums down the tokens (wrapping like numpy's cumsum) */
      if (delta && delta[r] && t) v = (int64_t)((uint64_t)v + (uint64_t)o64[(t - 1) * R + r]);
      o64[t * R + r] = v;
    }
  free(pos);
  return rc;
}

/* kvc reconstruction (kvcodec/codecs/kvc.py, normative): out[t, h, d] = clamp(f32(code) * step
 * + mean[h, d], +-fmax), cast to the out kind. codes: int64 (ckind 0) or int32 (ckind 1) [n, H, D]
 * (token rows crow apart); step: float32 with element
 * strides s0, s1, s2 (0 broadcasts); mean: float32 [H, D]. fmax <= 0: no clamp. */
/* One row of D dequantized values from codes of type CT (kvn_kvc_dequant's arithmetic). */
#define KVN_DQ_ROW(SUF, CT)                                                                                \
  KVN_INTERNAL void dq_row##SUF(const CT* c, const float* st, int64_t s2, const float* mu, int64_t D, float m,     \
                          const float* rtab, int64_t rm, float* r) {                                        \
    if (rtab) {                                                                                             \
      for (int64_t d = 0; d < D; ++d) {                                                                     \
        const int64_t v = (int64_t)c[d];                                                                    \
        const int64_t i = v < -rm - 1 ? -rm - 1 : (v > rm + 1 ? rm + 1 : v);                                \
        const float cv = (float)v - rtab[i + rm + 1];                                                       \
        r[d] = clampf(cv * st[d * s2] + mu[d], m);                                                          \
      }                                                                                                     \
    } else {                                                                                                \
      for (int64_t d = 0; d < D; ++d) r[d] = clampf((float)c[d] * st[d * s2] + mu[d], m);                   \
    }                                                                                                       \
  }
KVN_DQ_ROW(_i64, int64_t)
KVN_DQ_ROW(_i32_plain, int32_t)

#ifdef KVN_X86
/* dq_row_i32 in AVX2 vectors of eight (steps contiguous or one for the row; the offsets looked up
 * with a gather): the same operations on each value -- (float)c, the offset subtracted, times the
 * step, plus the mean, clamped as clampf does (NaN kept) -- so the same bits. */
__attribute__((target("avx2"))) static void dq_row_i32_avx2(const int32_t* c, const float* st, int64_t s2,
                                                            const float* mu, int64_t D, float m, const float* rtab,
                                                            int64_t rm, float* r) {
  const __m256 vm = _mm256_set1_ps(m), vnm = _mm256_set1_ps(-m), s0 = _mm256_set1_ps(st[0]);
  const __m256i lo = _mm256_set1_epi32((int32_t)(-rm - 1)), hi = _mm256_set1_epi32((int32_t)(rm + 1));
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) {
    const __m256i v = _mm256_loadu_si256((const __m256i*)(c + d));
    __m256 cv = _mm256_cvtepi32_ps(v);
    if (rtab) {
      const __m256i i = _mm256_sub_epi32(_mm256_min_epi32(_mm256_max_epi32(v, lo), hi), lo);
      cv = _mm256_sub_ps(cv, _mm256_i32gather_ps(rtab, i, 4));
    }
    __m256 y = _mm256_add_ps(_mm256_mul_ps(cv, s2 ? _mm256_loadu_ps(st + d) : s0), _mm256_loadu_ps(mu + d));
    y = _mm256_blendv_ps(y, vm, _mm256_cmp_ps(y, vm, _CMP_GT_OQ));
    y = _mm256_blendv_ps(y, vnm, _mm256_cmp_ps(y, vnm, _CMP_LT_OQ));
    _mm256_storeu_ps(r + d, y);
  }
  if (d < D) dq_row_i32_plain(c + d, st + d * s2, s2, mu + d, D - d, m, rtab, rm, r + d);
}
#endif

/* One row of D dequantized int32 codes: AVX2 where the CPU has it and the steps are contiguous or
 * one for the row, else the plain loop (the same bits). */
KVN_INTERNAL void dq_row_i32(const int32_t* c, const float* st, int64_t s2, const float* mu, int64_t D, float m,
                             const float* rtab, int64_t rm, float* r) {
#ifdef KVN_X86
  if (kvc_vector && (s2 == 0 || s2 == 1) && D >= 8 && __builtin_cpu_supports("avx2")) {
    dq_row_i32_avx2(c, st, s2, mu, D, m, rtab, rm, r);
    return;
  }
#endif
  dq_row_i32_plain(c, st, s2, mu, D, m, rtab, rm, r);
}

int kvn_kvc_dequant(const void* codes, int ckind, int64_t crow, int64_t n, int64_t H, int64_t D, const float* step,
                    int64_t s0, int64_t s1, int64_t s2, const float* mean, int64_t ms0, float fmax, int out_kind,
                    void* out, const float* rtab, int64_t rm) {
  /* mean: float32 rows of H * D, token t's at mean + t * ms0 (ms0 0: one row for every token;
     H * D: a row per token, kvc's rotating K means) */
  /* rtab (NULL, or 2 * rm + 3 floats): what to subtract from each code in [-rm - 1, rm + 1] (kvc's
     reconstruction offsets: sign(c) * offset / 256, zero at 0 and at both ends), so a code c
     stands for (float)c - rtab[clamp(c, -rm - 1, rm + 1) + rm + 1] -- exact in float32, and
     without a branch */
  const int64_t Cn = H * D;
  const float m = fmax > 0.0f ? fmax : bits_f32(0x7f800000u);
  float* row = (float*)malloc(sizeof(float) * (size_t)(Cn > 0 ? Cn : 1));
  if (!row) return KVN_NOMEM;
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t h = 0; h < H; ++h) {
      const int64_t co = t * crow + h * D;
      const float* st = step + t * s0 + h * s1;
      if (ckind == C_I32)
        dq_row_i32((const int32_t*)codes + co, st, s2, mean + t * ms0 + h * D, D, m, rtab, rm, row + h * D);
      else
        dq_row_i64((const int64_t*)codes + co, st, s2, mean + t * ms0 + h * D, D, m, rtab, rm, row + h * D);
    }
    store_row(out, out_kind, t * Cn, row, Cn);
  }
  free(row);
  return KVN_OK;
}

/* kvc's token-delta choice: per column r of token-major codes [n, R] (int64, ckind 0, or int32,
 * ckind 1), histograms over 128 bins
 * of the codes and of their token deltas (e[0] = c[0], e[t] = c[t] - c[t-1]) at the tokens
 * t = 0, ts, 2 ts, ... (ts >= 1), each value clipped to [-64, 63] and shifted by 64.
 * hc, he: int32 [R, 128] (n < 2^31), zeroed here. */
/* Rows in blocks of DH_BLOCK: a block's counts (2 x 128 int32 per row: 8 KB) stay in the L1
 * cache while the sampled tokens stream past (the counts of all rows at once missed it: 0.7x
 * the time on the tensors of a SmolLM2 encode, scratch benchmark). */
#define DH_BLOCK 8
#define KVN_DELTA_HIST(SUF, CT)                                                                    \
  static void delta_hist##SUF(const CT* c, int64_t n, int64_t R, int64_t ts, int32_t* hc, int32_t* he) { \
    for (int64_t b0 = 0; b0 < R; b0 += DH_BLOCK) {                                                  \
      const int64_t b1 = b0 + DH_BLOCK < R ? b0 + DH_BLOCK : R;                                     \
      for (int64_t t = 0; t < n; t += ts) {                                                         \
        const CT* ct = c + t * R;                                                                   \
        for (int64_t r = b0; r < b1; ++r) {                                                         \
          const int64_t v = (int64_t)ct[r];                                                         \
          /* the difference of two codes cannot overflow: the encoder's codes are far inside the   \
             int64 range (|c| < 2**62) */                                                           \
          const int64_t e = t ? v - (int64_t)ct[r - R] : v;                                         \
          const int64_t vc = v < -64 ? 0 : v > 63 ? 127 : v + 64;                                  \
          const int64_t ec = e < -64 ? 0 : e > 63 ? 127 : e + 64;                                  \
          hc[r * 128 + vc] += 1;                                                                    \
          he[r * 128 + ec] += 1;                                                                    \
        }                                                                                           \
      }                                                                                             \
    }                                                                                               \
  }
KVN_DELTA_HIST(_i64, int64_t)
KVN_DELTA_HIST(_i32, int32_t)

void kvn_delta_hist(const void* c, int ckind, int64_t n, int64_t R, int64_t ts, int32_t* hc, int32_t* he) {
  memset(hc, 0, sizeof(int32_t) * (size_t)(R * 128));
  memset(he, 0, sizeof(int32_t) * (size_t)(R * 128));
  if (ts < 1) ts = 1;
  if (ckind == C_I32)
    delta_hist_i32((const int32_t*)c, n, R, ts, hc, he);
  else
    delta_hist_i64((const int64_t*)c, n, R, ts, hc, he);
}
