/* kvc_cpu.c -- native CPU coder for kvcodec's ANS entropy stages (formats/ANS.md).
 *
 * Plain C99 with no Python headers: kvcodec/native/__init__.py compiles it once with the system C
 * compiler, caches the shared library and calls it through ctypes. It must agree bit for bit with
 * the executable spec, kvcodec/entropy/ans_ref.py (tests/test_native.py checks this on random and
 * real data, errors included):
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
 *
 * Speed: symbols are found with a slot table (one load when its resolution equals the table
 * precision; otherwise a few steps forward from the slot's first symbol), and LANES streams of the
 * same shape are decoded in lockstep so their dependency chains overlap. The encoder divides by
 * multiplying with a precomputed reciprocal (exact after one correction step).
 */
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

static void geom_read(const int64_t* g, Geom* o) {
  o->R = g[0]; o->N = g[1]; o->C = g[2]; o->G = g[3]; o->P = g[4]; o->A = g[5]; o->T = g[6]; o->scope = g[7];
  o->Q = g[8] >= 1 && g[8] <= MAXQ ? g[8] : 1; /* validated by the caller */
  o->center = g[9];
  for (int64_t i = 0; i < MAXQ; ++i) o->thr[i] = i < o->Q - 1 ? g[10 + i] : 0;
  o->n_groups = (o->R + o->G - 1) / o->G;
  o->n_chunks = o->N ? (o->N + o->C - 1) / o->C : 0;
  o->n_streams = o->n_groups * o->n_chunks;
}

/* Cumulative tables at precision 24: cum[t * (A + 1) + s]. */
static uint32_t* make_cum(const uint32_t* tables, const Geom* g) {
  const int64_t A = g->A, sh = PREC - g->P;
  uint32_t* cum = (uint32_t*)malloc(sizeof(uint32_t) * (size_t)(g->T * (A + 1)));
  if (!cum) return NULL;
  for (int64_t t = 0; t < g->T; ++t) {
    uint32_t acc = 0;
    uint32_t* c = cum + t * (A + 1);
    const uint32_t* f = tables + t * A;
    for (int64_t s = 0; s < A; ++s) {
      c[s] = acc;
      acc += f[s] << sh;
    }
    c[A] = acc; /* == 2^24 for a valid table (validated by the caller) */
  }
  return cum;
}

/* ------------------------------------------------------------------------------------ decode */
typedef struct {
  const uint32_t* w;
  int64_t pos;
  uint64_t x;
} Stream;

static int stream_init(Stream* st, const uint32_t* w, int64_t n) {
  st->w = w;
  st->pos = n;
  st->x = 0;
  if (n > 0) {
    st->x = w[n - 1];
    st->pos = n - 1;
    if (st->x == 0) return KVN_ZERO_WORD;
    if (st->pos > 0) { /* a single word is always < 2^32 */
      st->x = (st->x << 32) | w[st->pos - 1];
      st->pos -= 1;
    }
  }
  return KVN_OK;
}

typedef struct {
  const uint32_t* cum; /* A + 1 entries */
  const uint16_t* lut; /* 2^b entries, or NULL: binary search */
} Table;

typedef struct {
  uint32_t shift; /* 24 - b */
  int exact;      /* b == P: the slot's symbol is the symbol */
  int64_t A;
} Lookup;

static inline uint32_t find_symbol(const Table* tb, const Lookup* lk, uint32_t q) {
  uint32_t lo = 0, hi = (uint32_t)lk->A; /* invariant: cum[lo] <= q < cum[hi] */
  if (tb->lut) {
    const uint32_t j = q >> lk->shift;
    lo = tb->lut[j];
    if (lk->exact) return lo;
    hi = (uint32_t)tb->lut[j + 1] + 1u; /* the symbol at the next slot's start bounds q's symbol */
  }
  while (hi - lo > 1) {
    uint32_t mid = (lo + hi) >> 1;
    if (tb->cum[mid] <= q) lo = mid; else hi = mid;
  }
  return lo;
}

static inline uint32_t pop(Stream* st, const Table* tb, const Lookup* lk) {
  const uint32_t q = (uint32_t)st->x & QMASK;
  const uint32_t s = find_symbol(tb, lk, q);
  const uint32_t c0 = tb->cum[s];
  st->x = (st->x >> PREC) * (uint64_t)(tb->cum[s + 1] - c0) + (q - c0);
  if (st->x < (1ull << 32) && st->pos > 0) {
    st->pos -= 1;
    st->x = (st->x << 32) | st->w[st->pos];
  }
  return s;
}

static inline void put(void* out, int kind, const Geom* g, int64_t r, int64_t t, uint32_t s) {
  if (kind == OUT_U8_NR) ((uint8_t*)out)[t * g->R + r] = (uint8_t)s;
  else if (kind == OUT_U16_NR) ((uint16_t*)out)[t * g->R + r] = (uint16_t)s;
  else ((int32_t*)out)[r * g->N + t] = (int32_t)s;
}

/* Decode `nl` (1..LANES) streams of chunk c, groups g0 .. g0+nl-1, all with the same rows. */
static int decode_lanes(const Geom* g, const uint32_t* words, const uint32_t* offsets, const Table* tabs,
                        const Lookup* lk, const int32_t* table_of, int64_t c, int64_t g0, int nl, void* out,
                        int kind, int64_t* bad) {
  Stream st[LANES];
  const int64_t t0 = c * g->C, t1 = t0 + g->C < g->N ? t0 + g->C : g->N;
  const int64_t set = g->scope == 1 ? c : 0;
  const int64_t nrows = (g0 * g->G + g->G < g->R ? g->G : g->R - g0 * g->G);
  for (int l = 0; l < nl; ++l) {
    const int64_t s = c * g->n_groups + g0 + l;
    const int rc = stream_init(&st[l], words + offsets[s], (int64_t)offsets[s + 1] - (int64_t)offsets[s]);
    if (rc != KVN_OK) {
      *bad = s;
      return rc;
    }
  }
  for (int64_t k = 0; k < nrows; ++k) {
    Table tb[LANES];
    int64_t row[LANES];
    for (int l = 0; l < nl; ++l) {
      row[l] = (g0 + l) * g->G + k;
      tb[l] = tabs[table_of[set * g->R + row[l]]];
    }
    if (nl == LANES) {
      for (int64_t t = t0; t < t1; ++t) {
        const uint32_t s0 = pop(&st[0], &tb[0], lk);
        const uint32_t s1 = pop(&st[1], &tb[1], lk);
        const uint32_t s2 = pop(&st[2], &tb[2], lk);
        const uint32_t s3 = pop(&st[3], &tb[3], lk);
        put(out, kind, g, row[0], t, s0);
        put(out, kind, g, row[1], t, s1);
        put(out, kind, g, row[2], t, s2);
        put(out, kind, g, row[3], t, s3);
      }
    } else {
      for (int64_t t = t0; t < t1; ++t)
        for (int l = 0; l < nl; ++l) put(out, kind, g, row[l], t, pop(&st[l], &tb[l], lk));
    }
  }
  for (int l = 0; l < nl; ++l) {
    if (st[l].pos != 0 || st[l].x != 0) {
      *bad = c * g->n_groups + g0 + l;
      return KVN_NOT_CONSUMED;
    }
  }
  return KVN_OK;
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

/* decode_lanes for scope 2: per symbol, the table of the symbol's magnitude class; acc and cls
 * hold LANES * C running magnitude sums and classes (scratch). */
static int decode_lanes_ctx(const Geom* g, const uint32_t* words, const uint32_t* offsets, const Table* tabs,
                            const Lookup* lk, const int32_t* table_of, int64_t c, int64_t g0, int nl, void* out,
                            int kind, int64_t* bad, int64_t* acc, uint8_t* cls) {
  Stream st[LANES];
  const int64_t t0 = c * g->C, t1 = t0 + g->C < g->N ? t0 + g->C : g->N, nt = t1 - t0;
  const int64_t nrows = (g0 * g->G + g->G < g->R ? g->G : g->R - g0 * g->G);
  const int64_t nthr = g->Q - 1, h = g->center;
  for (int l = 0; l < nl; ++l) {
    const int64_t s = c * g->n_groups + g0 + l;
    const int rc = stream_init(&st[l], words + offsets[s], (int64_t)offsets[s + 1] - (int64_t)offsets[s]);
    if (rc != KVN_OK) {
      *bad = s;
      return rc;
    }
    memset(acc + l * nt, 0, sizeof(int64_t) * (size_t)nt);
  }
  for (int64_t k = 0; k < nrows; ++k) {
    const Table* tq[LANES][MAXQ];
    int64_t row[LANES], thr[MAXQ];
    ctx_bounds(g->thr, nthr, k, thr);
    for (int l = 0; l < nl; ++l) {
      row[l] = (g0 + l) * g->G + k;
      for (int64_t q = 0; q < g->Q; ++q) tq[l][q] = &tabs[table_of[q * g->R + row[l]]];
      /* the row's classes first, in a pass of their own (off the decoder's dependency chain) */
      const int64_t* al = acc + l * nt;
      uint8_t* cl = cls + l * nt;
      /* a constant threshold count lets the inlined ctx_class drop its switch from the loop */
#define CLS_LOOP(NTHR) for (int64_t i = 0; i < nt; ++i) cl[i] = (uint8_t)ctx_class(al[i], thr, NTHR)
      if (k == 0) memset(cl, 0, (size_t)nt); /* a stream's first row: class 0 */
      else if (nthr == 1) CLS_LOOP(1);
      else if (nthr == 2) CLS_LOOP(2);
      else if (nthr == 3) CLS_LOOP(3);
      else CLS_LOOP(nthr);
#undef CLS_LOOP
    }
    /* lanes unrolled for three and four streams (their dependency chains overlap) */
#define DEC_CTX_STEP(L)                                                      \
  do {                                                                       \
    int64_t* a_ = acc + (L) * nt + (t - t0);                                 \
    const uint32_t s_ = pop(&st[L], tq[L][cls[(L) * nt + (t - t0)]], lk);    \
    put(out, kind, g, row[L], t, s_);                                        \
    *a_ += (int64_t)s_ >= h ? (int64_t)s_ - h : h - (int64_t)s_;             \
  } while (0)
    if (nl == 4) {
      for (int64_t t = t0; t < t1; ++t) {
        DEC_CTX_STEP(0); DEC_CTX_STEP(1); DEC_CTX_STEP(2); DEC_CTX_STEP(3);
      }
    } else if (nl == 3) {
      for (int64_t t = t0; t < t1; ++t) {
        DEC_CTX_STEP(0); DEC_CTX_STEP(1); DEC_CTX_STEP(2);
      }
    } else if (nl == 2) {
      for (int64_t t = t0; t < t1; ++t) {
        DEC_CTX_STEP(0); DEC_CTX_STEP(1);
      }
    } else {
      for (int64_t t = t0; t < t1; ++t)
        for (int l = 0; l < nl; ++l) DEC_CTX_STEP(l);
    }
#undef DEC_CTX_STEP
  }
  for (int l = 0; l < nl; ++l) {
    if (st[l].pos != 0 || st[l].x != 0) {
      *bad = c * g->n_groups + g0 + l;
      return KVN_NOT_CONSUMED;
    }
  }
  return KVN_OK;
}

/* Decode a validated stage. geom: R, N, C, G, P, A, n_tables, scope. tables: [n_tables, A]
 * frequencies at precision P; table_of: [n_sets, R]; out: see OUT_*. On error, *bad is the
 * first failing stream (streams are checked in order). */
int kvn_ans_decode(const int64_t* geom, const uint32_t* words, const uint32_t* offsets, const uint32_t* tables,
                   const int32_t* table_of, void* out, int kind, int64_t* bad) {
  Geom g;
  geom_read(geom, &g);
  *bad = -1;
  if (g.n_streams == 0) return KVN_OK;
  uint32_t* cum = make_cum(tables, &g);
  Table* tabs = (Table*)malloc(sizeof(Table) * (size_t)(g.T ? g.T : 1));
  /* slot table resolution b: exact slots (b = P <= 12: one lookup) while all slot tables fit in
   * 256 KB (shared tables, few rows); otherwise halved until a table has no more than about twice
   * the symbols one stream decodes with it before moving on (a table per row per chunk is visited
   * briefly, and big slot tables would only miss the cache), never below 2^6. */
  const int64_t visit = g.C < g.N ? g.C : g.N;
  int64_t b = g.P < 12 ? g.P : 12;
  while (b > 6 && (g.T << b) * 2 > (256 << 10) && ((int64_t)1 << b) > 2 * visit) --b;
  /* and never more slots than a few per output symbol, whatever table count a file declares (a
   * coarse slot table only costs a short binary search between two slots' symbols) */
  while (b > 1 && (g.T << b) > 4 * g.R * g.N + 65536) --b;
  const int64_t stride = ((int64_t)1 << b) + 1; /* slots plus an end entry */
  uint16_t* lut = NULL;
  if (g.A <= 65536) lut = (uint16_t*)malloc(sizeof(uint16_t) * (size_t)(g.T * stride));
  int64_t* acc = NULL;
  uint8_t* cls = NULL;
  if (g.Q > 1) {
    acc = (int64_t*)malloc(sizeof(int64_t) * (size_t)(LANES * (g.C < g.N ? g.C : g.N)));
    cls = (uint8_t*)malloc((size_t)(LANES * (g.C < g.N ? g.C : g.N)));
  }
  if (!cum || !tabs || (g.A <= 65536 && !lut) || (g.Q > 1 && (!acc || !cls))) {
    free(cum); free(tabs); free(lut); free(acc); free(cls);
    return KVN_NOMEM;
  }
  Lookup lk;
  lk.shift = (uint32_t)(PREC - b);
  lk.exact = b == g.P;
  lk.A = g.A;
  for (int64_t t = 0; t < g.T; ++t) {
    tabs[t].cum = cum + t * (g.A + 1);
    tabs[t].lut = NULL;
    if (lut) {
      /* slot j holds the symbol whose interval contains j << shift: symbol s fills the slots
       * from ceil(cum[s] / 2^shift) up to that of cum[s + 1] */
      uint16_t* l = lut + t * stride;
      const uint32_t* c = tabs[t].cum;
      const uint32_t round = (1u << lk.shift) - 1u;
      for (int64_t s = 0; s < g.A; ++s) {
        const uint32_t j0 = (c[s] + round) >> lk.shift, j1 = (c[s + 1] + round) >> lk.shift;
        for (uint32_t j = j0; j < j1; ++j) l[j] = (uint16_t)s;
      }
      l[stride - 1] = (uint16_t)(g.A - 1);
      tabs[t].lut = l;
    }
  }
  int rc = KVN_OK;
  for (int64_t c = 0; c < g.n_chunks && rc == KVN_OK; ++c) {
    /* full groups in batches of LANES; the last (ragged) group alone */
    const int64_t full = (g.R % g.G == 0) ? g.n_groups : g.n_groups - 1;
    int64_t g0 = 0;
    if (g.Q > 1) { /* any run of full groups shares lanes */
      while (g0 < full && rc == KVN_OK) {
        const int nl = full - g0 < LANES ? (int)(full - g0) : LANES;
        rc = decode_lanes_ctx(&g, words, offsets, tabs, &lk, table_of, c, g0, nl, out, kind, bad, acc, cls);
        g0 += nl;
      }
      for (; g0 < g.n_groups && rc == KVN_OK; ++g0)
        rc = decode_lanes_ctx(&g, words, offsets, tabs, &lk, table_of, c, g0, 1, out, kind, bad, acc, cls);
      continue;
    }
    for (; g0 + LANES <= full && rc == KVN_OK; g0 += LANES)
      rc = decode_lanes(&g, words, offsets, tabs, &lk, table_of, c, g0, LANES, out, kind, bad);
    for (; g0 < g.n_groups && rc == KVN_OK; ++g0)
      rc = decode_lanes(&g, words, offsets, tabs, &lk, table_of, c, g0, 1, out, kind, bad);
  }
  free(cum);
  free(tabs);
  free(lut);
  free(acc);
  free(cls);
  return rc;
}

/* ------------------------------------------------------------------------------------ encode */
static inline uint64_t mulhi64(uint64_t a, uint64_t b) {
#ifdef __SIZEOF_INT128__
  return (uint64_t)(((unsigned __int128)a * b) >> 64);
#else
  const uint64_t a0 = (uint32_t)a, a1 = a >> 32, b0 = (uint32_t)b, b1 = b >> 32;
  const uint64_t p00 = a0 * b0, p01 = a0 * b1, p10 = a1 * b0, p11 = a1 * b1;
  const uint64_t mid = (p00 >> 32) + (uint32_t)p01 + (uint32_t)p10;
  return p11 + (p01 >> 32) + (p10 >> 32) + (mid >> 32);
#endif
}

/* Encode a stage. sym: int32 [R, N] row-major, values already checked to lie in [0, A).
 * words: capacity `cap` (R*N + 2*S always suffices: at most one word per symbol plus the
 * two-word flush); offsets: int64 [S + 1]. Returns KVN_OVERFLOW if cap is too small. */
static inline int32_t sym_at(const void* sym, int kind, int64_t i) {
  if (kind == OUT_U8_NR) return ((const uint8_t*)sym)[i];
  if (kind == OUT_U16_NR) return ((const uint16_t*)sym)[i];
  return ((const int32_t*)sym)[i];
}

/* One encoder step of lane L (symbols last to first; see the file header), its symbol from the
 * row-major scratch block (xs) or, _D, straight from token-major uint16 input (xd, stride st). */
#define ENC_STEP(L) ENC_STEP_T(L, fcr[L], invr[L], xs[L][t])
#define ENC_STEP_D(L) ENC_STEP_T(L, fcr[L], invr[L], xd[L][t * st])
/* scope 2: the tables of the symbol's class */
#define ENC_STEP_CTX(L) ENC_STEP_T(L, fcq[L][xq[L][t]], invq[L][xq[L][t]], xs[L][t])
#define ENC_STEP_CTX_D(L) ENC_STEP_T(L, fcq[L][xqd[L][t * st]], invq[L][xqd[L][t * st]], xd[L][t * st])
/* The nl (1..LANES) lanes' steps over the chunk's tokens, last to first. */
#define ENC_LANES(STEP)                                          \
  do {                                                           \
    if (nl == LANES) {                                           \
      for (int64_t t = nt - 1; t >= 0; --t) {                    \
        STEP(0); STEP(1); STEP(2); STEP(3);                      \
      }                                                          \
    } else if (nl == 3) {                                        \
      for (int64_t t = nt - 1; t >= 0; --t) {                    \
        STEP(0); STEP(1); STEP(2);                               \
      }                                                          \
    } else if (nl == 2) {                                        \
      for (int64_t t = nt - 1; t >= 0; --t) {                    \
        STEP(0); STEP(1);                                        \
      }                                                          \
    } else {                                                     \
      for (int64_t t = nt - 1; t >= 0; --t) STEP(0);             \
    }                                                            \
  } while (0)
#define ENC_STEP_T(L, FCR, INVR, SYM)                                \
  do {                                                               \
    const int32_t s_ = (SYM);                                        \
    const uint32_t* fr_ = (FCR);                                     \
    const uint64_t* ir_ = (INVR);                                    \
    const uint64_t f_ = fr_[2 * s_], c_ = fr_[2 * s_ + 1];           \
    const uint64_t e_ = (x[L] >> 40) >= f_; /* emit a word: branch-free */ \
    *o[L] = (uint32_t)x[L];                                          \
    o[L] += e_;                                                      \
    x[L] >>= (e_ << 5);                                              \
    uint64_t q_ = mulhi64(x[L], ir_[s_]);                            \
    uint64_t r_ = x[L] - q_ * f_;                                    \
    if (r_ >= f_) {                                                  \
      q_ += 1;                                                       \
      r_ -= f_;                                                      \
    }                                                                \
    x[L] = (q_ << PREC) | (c_ + r_);                                 \
  } while (0)

/* Histograms hist[r * A + s] (int64, accumulated) of rows [0, R) over tokens [t0, t1) of a
 * symbol matrix with element kind `kind` (OUT_*: int32 / uint16 / uint8) and strides sr (row),
 * st (token), in elements. KVN_BAD_SYMBOL if a symbol lies outside [0, A). */
int kvn_hist(const void* sym, int kind, int64_t R, int64_t sr, int64_t st, int64_t t0, int64_t t1, int64_t A,
             int64_t* hist) {
  for (int64_t t = t0; t < t1; ++t) {
    for (int64_t r = 0; r < R; ++r) {
      const int32_t s = sym_at(sym, kind, r * sr + t * st);
      if (s < 0 || s >= A) return KVN_BAD_SYMBOL;
      hist[r * A + s] += 1;
    }
  }
  return KVN_OK;
}

/* Scope 2 histograms: hist[(q * R + r) * A + s] (int64, accumulated) of the symbols of rows
 * [0, R) over all N tokens by row and magnitude class q (streams of G rows; thr: the nthr
 * thresholds, center: the zero symbol). KVN_BAD_SYMBOL if a symbol lies outside [0, A). */
int kvn_ctx_hist(const void* sym, int kind, int64_t R, int64_t sr, int64_t st, int64_t N, int64_t G, int64_t nthr,
                 const int64_t* thr, int64_t center, int64_t A, int64_t* hist, uint8_t* cls_out) {
  if (nthr < 0 || nthr >= MAXQ || G < 1) return KVN_BAD_SYMBOL;
  const int64_t gk = G < R ? G : R; /* rows of the longest stream */
  int64_t* bk = (int64_t*)malloc(sizeof(int64_t) * (size_t)(gk * MAXQ + 1)); /* class bounds per row */
  if (!bk) return KVN_NOMEM;
  for (int64_t k = 0; k < gk; ++k) ctx_bounds(thr, nthr, k, bk + k * MAXQ);
  /* counts in [R][Q][A] order while scanning (one row's classes stay together), then moved */
  const int64_t Q = nthr + 1;
  /* int32 counts while scanning (half the footprint of int64: 9 % faster on a [1535, 195]
   * matrix), moved into hist after every CTX_SPAN tokens so that no count can overflow */
  int32_t* h = (int32_t*)calloc((size_t)(R * Q * A + 1), sizeof(int32_t));
  if (!h) {
    free(bk);
    return KVN_NOMEM;
  }
  int rc = KVN_OK;
  const int64_t CTX_SPAN = (int64_t)1 << 30;
  for (int64_t t0 = 0; t0 < N && rc == KVN_OK; t0 += CTX_SPAN) {
    const int64_t t1 = N - t0 < CTX_SPAN ? N : t0 + CTX_SPAN;
  /* one loop per element type (the symbols are checked against A as they are read) */
#define CTX_HIST_LOOP(TYPE)                                                                  \
  for (int64_t t = t0; t < t1 && rc == KVN_OK; ++t) {                                       \
    const TYPE* x = (const TYPE*)sym + t * st;                                              \
    for (int64_t r0 = 0; r0 < R && rc == KVN_OK; r0 += G) {                                 \
      const int64_t r1 = r0 + G < R ? r0 + G : R;                                           \
      int64_t a = 0; /* the running magnitude sum of this stream at token t */              \
      for (int64_t r = r0; r < r1; ++r) {                                                   \
        const int64_t s = (int64_t)x[r * sr];                                               \
        if (s < 0 || s >= A) {                                                              \
          rc = KVN_BAD_SYMBOL;                                                              \
          break;                                                                            \
        }                                                                                   \
        const int q = ctx_class(a, bk + (r - r0) * MAXQ, nthr);                             \
        if (cls_out) cls_out[r * sr + t * st] = (uint8_t)q;                                 \
        h[(r * Q + q) * A + s] += 1;                                                        \
        a += s >= center ? s - center : center - s;                                         \
      }                                                                                     \
    }                                                                                       \
  }
  if (kind == OUT_U8_NR) {
    CTX_HIST_LOOP(uint8_t)
  } else if (kind == OUT_U16_NR) {
    CTX_HIST_LOOP(uint16_t)
  } else {
    CTX_HIST_LOOP(int32_t)
  }
#undef CTX_HIST_LOOP
    for (int64_t r = 0; r < R; ++r)
      for (int64_t q = 0; q < Q; ++q)
        for (int64_t s = 0; s < A; ++s) {
          hist[(q * R + r) * A + s] += h[(r * Q + q) * A + s];
          h[(r * Q + q) * A + s] = 0;
        }
  }
  free(h);
  free(bk);
  return rc;
}

/* Encode a stage. sym: symbols X[r, t] at sym[r * sr + t * st] of element kind `kind` (OUT_*),
 * values in [0, A) (else KVN_BAD_SYMBOL). words: capacity `cap` (R*N + 2*S always suffices: at
 * most one word per symbol plus the two-word flush); offsets: int64 [S + 1]. */
int kvn_ans_encode(const int64_t* geom, const uint32_t* tables, const int32_t* table_of, const void* sym, int kind,
                   int64_t sr, int64_t st, uint32_t* words, int64_t cap, int64_t* offsets, const uint8_t* cls_in) {
  Geom g;
  geom_read(geom, &g);
  offsets[0] = 0;
  if (g.n_streams == 0) return KVN_OK;
  const int64_t A = g.A, sh = PREC - g.P;
  /* per (table, symbol): frequency and start at precision 24, and floor((2^64 - 1) / F): then
   * q' = mulhi(x, inv) is q or q - 1 (q = x / F), fixed by one comparison. */
  uint32_t* fc = (uint32_t*)malloc(sizeof(uint32_t) * 2 * (size_t)(g.T * A));
  uint64_t* inv = (uint64_t*)malloc(sizeof(uint64_t) * (size_t)(g.T * A));
  if (!fc || !inv) {
    free(fc); free(inv);
    return KVN_NOMEM;
  }
  for (int64_t i = 0; i < g.T; ++i) {
    uint32_t acc = 0;
    for (int64_t s = 0; s < A; ++s) {
      const uint32_t f = tables[i * A + s] << sh;
      fc[2 * (i * A + s)] = f;
      fc[2 * (i * A + s) + 1] = acc;
      inv[i * A + s] = UINT64_MAX / f;
      acc += f;
    }
  }
  /* Streams are encoded in blocks of up to EBLOCK groups of one chunk: their symbols are first
   * gathered into a row-major scratch block (reading the input in its own order: token-major
   * input is read along rows of the cache, not down its columns), range-checked on the way. */
  enum { EBLOCK = 32 };
  const int64_t max_rows = EBLOCK * g.G < g.R ? EBLOCK * g.G : g.R;
  const int64_t max_tok = g.C < g.N ? g.C : g.N;
  int32_t* tmp = (int32_t*)malloc(sizeof(int32_t) * (size_t)(max_rows * max_tok + 1));
  const int64_t lane_cap = g.G * max_tok + 2; /* words one stream can produce */
  uint32_t* lw = (uint32_t*)malloc(sizeof(uint32_t) * (size_t)(LANES * lane_cap));
  uint8_t* cls = NULL; /* scope 2: the class of every symbol of the block */
  int64_t* acc = NULL;
  if (g.Q > 1) {
    cls = (uint8_t*)malloc((size_t)(max_rows * max_tok + 1));
    acc = (int64_t*)malloc(sizeof(int64_t) * (size_t)(max_tok + 1));
  }
  if (!tmp || !lw || (g.Q > 1 && (!cls || !acc))) {
    free(tmp); free(lw); free(fc); free(inv); free(cls); free(acc);
    return KVN_NOMEM;
  }
  int64_t w = 0;
  int rc = KVN_OK;
  for (int64_t c = 0; c < g.n_chunks && rc == KVN_OK; ++c) {
    const int64_t t0 = c * g.C, t1 = t0 + g.C < g.N ? t0 + g.C : g.N, nt = t1 - t0;
    const int64_t set = g.scope == 1 ? c : 0;
    for (int64_t gb = 0; gb < g.n_groups && rc == KVN_OK; gb += EBLOCK) {
      const int64_t ge = gb + EBLOCK < g.n_groups ? gb + EBLOCK : g.n_groups;
      const int64_t rb0 = gb * g.G, rb1 = ge * g.G < g.R ? ge * g.G : g.R;
      int32_t lo = 0, hi = 0;
      /* token-major uint16 symbols (kvc's), with the classes given when there are classes: read
         in place (the lanes' loads do not wait on the coder's state, so the stride costs little;
         the transposing copy and the class pass measured ~40 % of the encoder) */
      const int direct = kind == OUT_U16_NR && st != 1 && (g.Q == 1 || cls_in);
      if (direct) {
        uint32_t top = 0, qtop = 0;
        for (int64_t t = t0; t < t1; ++t) {
          const uint16_t* xr = (const uint16_t*)sym + t * st;
          for (int64_t r = rb0; r < rb1; ++r) top = xr[r * sr] > top ? xr[r * sr] : top;
          if (g.Q > 1) {
            const uint8_t* qr = cls_in + t * st;
            for (int64_t r = rb0; r < rb1; ++r) qtop = qr[r * sr] > qtop ? qr[r * sr] : qtop;
          }
        }
        if ((int64_t)top >= A || (g.Q > 1 && (int64_t)qtop >= g.Q)) {
          rc = KVN_BAD_SYMBOL;
          break;
        }
      } else if (st == 1) {
        for (int64_t r = rb0; r < rb1; ++r)
          for (int64_t t = t0; t < t1; ++t) tmp[(r - rb0) * nt + (t - t0)] = sym_at(sym, kind, r * sr + t);
      } else {
        for (int64_t t = t0; t < t1; ++t)
          for (int64_t r = rb0; r < rb1; ++r) tmp[(r - rb0) * nt + (t - t0)] = sym_at(sym, kind, r * sr + t * st);
      }
      if (!direct) {
        for (int64_t i = 0; i < (rb1 - rb0) * nt; ++i) {
          lo = tmp[i] < lo ? tmp[i] : lo;
          hi = tmp[i] > hi ? tmp[i] : hi;
        }
        if (lo < 0 || hi >= A) {
          rc = KVN_BAD_SYMBOL;
          break;
        }
      }
      /* the gathered block's classes (the direct path reads the caller's in place) */
      if (!direct && g.Q > 1 && cls_in) { /* classes as kvn_ctx_hist gave them (same layout as sym) */
        int bad = 0;
        for (int64_t r = rb0; r < rb1; ++r) {
          uint8_t* cr = cls + (r - rb0) * nt;
          for (int64_t t = t0; t < t1; ++t) {
            cr[t - t0] = cls_in[r * sr + t * st];
            bad |= cr[t - t0] >= g.Q;
          }
        }
        if (bad) {
          rc = KVN_BAD_SYMBOL;
          break;
        }
      } else if (!direct && g.Q > 1) { /* classes from the earlier rows of each stream (the decoder's rule) */
        int64_t thr[MAXQ];
        for (int64_t gi = gb; gi < ge; ++gi) {
          const int64_t r0 = gi * g.G, r1 = r0 + g.G < g.R ? r0 + g.G : g.R;
          memset(acc, 0, sizeof(int64_t) * (size_t)nt);
          for (int64_t r = r0; r < r1; ++r) {
            const int64_t k = r - r0;
            ctx_bounds(g.thr, g.Q - 1, k, thr);
            const int32_t* xr = tmp + (r - rb0) * nt;
            uint8_t* cr = cls + (r - rb0) * nt;
            for (int64_t t = 0; t < nt; ++t) {
              cr[t] = (uint8_t)ctx_class(acc[t], thr, g.Q - 1);
              acc[t] += xr[t] >= g.center ? xr[t] - g.center : g.center - xr[t];
            }
          }
        }
      }
      /* LANES full groups at a time (their dependency chains -- multiply, compare, shift --
       * overlap), else one (a ragged last group); each lane writes its words to its own scratch,
       * copied out in stream order */
      for (int64_t gi = gb; gi < ge && rc == KVN_OK;) {
        int nl = gi + LANES <= ge && (gi + LANES) * g.G <= g.R ? LANES : 1;
        if (g.Q > 1) /* any run of full groups shares lanes (wide streams leave few groups) */
          while (nl < LANES && gi + nl < ge && (gi + nl + 1) * g.G <= g.R) ++nl;
        const int64_t nrows = gi * g.G + g.G < g.R ? g.G : g.R - gi * g.G;
        uint64_t x[LANES] = {0};
        uint32_t* o[LANES];
        for (int l = 0; l < LANES; ++l) o[l] = lw + l * lane_cap;
        for (int64_t k = nrows - 1; k >= 0; --k) {
          const uint32_t* fcr[LANES];
          const uint64_t* invr[LANES];
          const int32_t* xs[LANES];
          const uint16_t* xd[LANES];
          const uint32_t* fcq[LANES][MAXQ];
          const uint64_t* invq[LANES][MAXQ];
          const uint8_t* xq[LANES];
          const uint8_t* xqd[LANES];
          for (int l = 0; l < nl; ++l) {
            const int64_t r = (gi + l) * g.G + k;
            const int64_t base = (int64_t)table_of[set * g.R + r] * A;
            fcr[l] = fc + 2 * base;
            invr[l] = inv + base;
            xs[l] = tmp + (r - rb0) * nt;
            xd[l] = direct ? (const uint16_t*)sym + r * sr + t0 * st : NULL;
            if (g.Q > 1) {
              for (int64_t q = 0; q < g.Q; ++q) {
                const int64_t bq = (int64_t)table_of[q * g.R + r] * A;
                fcq[l][q] = fc + 2 * bq;
                invq[l][q] = inv + bq;
              }
              xq[l] = cls + (r - rb0) * nt;
              xqd[l] = direct ? cls_in + r * sr + t0 * st : NULL;
            }
          }
          if (direct && g.Q > 1)
            ENC_LANES(ENC_STEP_CTX_D);
          else if (direct)
            ENC_LANES(ENC_STEP_D);
          else if (g.Q > 1)
            ENC_LANES(ENC_STEP_CTX);
          else
            ENC_LANES(ENC_STEP);
        }
        for (int l = 0; l < nl; ++l) {
          while (x[l]) {
            *o[l]++ = (uint32_t)x[l];
            x[l] >>= 32;
          }
          const int64_t nw = o[l] - (lw + l * lane_cap);
          if (w + nw > cap) {
            rc = KVN_OVERFLOW;
            break;
          }
          memcpy(words + w, lw + l * lane_cap, sizeof(uint32_t) * (size_t)nw);
          w += nw;
          offsets[c * g.n_groups + gi + l + 1] = w;
        }
        gi += nl;
      }
    }
  }
  free(lw);
  free(tmp);
  free(fc);
  free(inv);
  free(cls);
  free(acc);
  return rc;
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

/* ------------------------------------------------------------------ dequantization */
/* Rows are computed in float32 into a scratch row (simple loops that vectorise), then stored as
 * the output kind by store_row: float32 copy, bfloat16 rounding, or float16 -- with the F16C
 * instruction (IEEE round to nearest even: the same bits as f32_to_f16) where the CPU has it. */
static int use_hw_f16 = -1; /* -1: not decided yet; tests can force the software path */

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#include <immintrin.h>
__attribute__((target("avx,f16c"))) static void row_f16_hw(uint16_t* dst, const float* src, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128((__m128i*)(dst + i), h);
  }
  for (; i < n; ++i) dst[i] = f32_to_f16(src[i]);
}
__attribute__((target("avx,f16c"))) static void row_f32_from_f16_hw(float* dst, const uint16_t* src, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(src + i))));
  for (; i < n; ++i) dst[i] = f16_to_f32(src[i]);
}
static int have_hw_f16(void) {
  __builtin_cpu_init();
  return __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx");
}
#else
static void row_f16_hw(uint16_t* dst, const float* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = f32_to_f16(src[i]);
}
static void row_f32_from_f16_hw(float* dst, const uint16_t* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = f16_to_f32(src[i]);
}
static int have_hw_f16(void) { return 0; }
#endif

/* 1: use F16C when present (default), 0: always the portable conversion. Returns whether the
 * hardware path is in use. */
int kvn_set_hw_f16(int on) {
  use_hw_f16 = on ? have_hw_f16() : 0;
  return use_hw_f16;
}

static void store_row(void* out, int kind, int64_t o, const float* src, int64_t n) {
  if (kind == F_F16) {
    uint16_t* d = (uint16_t*)out + o;
    if (use_hw_f16 < 0) use_hw_f16 = have_hw_f16();
    if (use_hw_f16) {
      row_f16_hw(d, src, n);
    } else {
      for (int64_t i = 0; i < n; ++i) d[i] = f32_to_f16(src[i]);
    }
  } else if (kind == F_BF16) {
    uint16_t* d = (uint16_t*)out + o;
    for (int64_t i = 0; i < n; ++i) d[i] = f32_to_bf16(src[i]);
  } else {
    memcpy((float*)out + o, src, sizeof(float) * (size_t)n);
  }
}

/* n values of a float16 / bfloat16 / float32 array from element o, as float32 (exact). */
static void load_row(float* dst, const void* src, int kind, int64_t o, int64_t n) {
  if (kind == F_F16) {
    const uint16_t* h = (const uint16_t*)src + o;
    if (use_hw_f16 < 0) use_hw_f16 = have_hw_f16();
    if (use_hw_f16) {
      row_f32_from_f16_hw(dst, h, n);
    } else {
      for (int64_t i = 0; i < n; ++i) dst[i] = f16_to_f32(h[i]);
    }
  } else if (kind == F_BF16) {
    const uint16_t* h = (const uint16_t*)src + o;
    for (int64_t i = 0; i < n; ++i) dst[i] = bits_f32((uint32_t)h[i] << 16);
  } else {
    memcpy(dst, (const float*)src + o, sizeof(float) * (size_t)n);
  }
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

/* KIVI (kvcodec.quant.intq): out[t, h, d] = f32(code) * scale + zero, clamped to +-fmax when
 * fmax > 0 (fp16/bf16 outputs), then cast (out kind F_*). codes: uint8 [T, H, D]. scale/zero:
 * float32; axis 0 ("channel"): [ceil(T/g), H, D], row t / g; axis 1 ("token"): [T, H, ceil(D/g)].
 * Returns KVN_NOMEM if the scratch row cannot be allocated. */
int kvn_intq_dequant(const uint8_t* codes, int64_t T, int64_t H, int64_t D, int axis, int64_t group,
                     const float* scale, const float* zero, float fmax, int out_kind, void* out) {
  const int64_t Cn = H * D, ng = (D + group - 1) / group;
  const float m = fmax > 0.0f ? fmax : bits_f32(0x7f800000u); /* no clamp: +inf bound */
  float* row = (float*)malloc(sizeof(float) * (size_t)(Cn > 0 ? Cn : 1));
  if (!row) return KVN_NOMEM;
  for (int64_t t = 0; t < T; ++t) {
    const uint8_t* c = codes + t * Cn;
    if (axis == 0) {
      const float* s = scale + (t / group) * Cn;
      const float* z = zero + (t / group) * Cn;
      for (int64_t i = 0; i < Cn; ++i) row[i] = clampf((float)c[i] * s[i] + z[i], m);
    } else {
      for (int64_t h = 0; h < H; ++h) {
        const float* s = scale + (t * H + h) * ng;
        const float* z = zero + (t * H + h) * ng;
        for (int64_t j = 0; j < ng; ++j) { /* one scale and zero per group of channels */
          const int64_t d0 = j * group, d1 = d0 + group < D ? d0 + group : D;
          const float sj = s[j], zj = z[j];
          const uint8_t* cj = c + h * D;
          float* rj = row + h * D;
          for (int64_t d = d0; d < d1; ++d) rj[d] = clampf((float)cj[d] * sj + zj, m);
        }
      }
    }
    store_row(out, out_kind, t * Cn, row, Cn);
  }
  free(row);
  return KVN_OK;
}

/* Per-token symmetric codes (CacheGen): for code row j (codes [n, C], kind OUT_U8_NR / OUT_U16_NR),
 * v = f32(code - mid) * scale[j]; with base, v = base[brow[j], :] + v; written to output row
 * orow[j] (out kind F_*; fp16/bf16 outputs clamped to +-their largest finite value, formats/SPEC.md
 * §11.1, then cast RNE). Codes above max_code
 * make it return KVN_BAD_SYMBOL (after finishing). */
int kvn_rows_affine(const void* codes, int ckind, int64_t n, int64_t C, const int64_t* orow, const float* scale,
                    int32_t mid, int32_t max_code, const float* base, const int64_t* brow, int out_kind, void* out) {
  int32_t hi = 0;
  const float m = out_kind == F_F16 ? 65504.0f : bits_f32(0x7F7F0000u); /* fp16 / bf16 largest finite */
  float* row = (float*)malloc(sizeof(float) * (size_t)(C > 0 ? C : 1));
  if (!row) return KVN_NOMEM;
  for (int64_t j = 0; j < n; ++j) {
    const float s = scale[j];
    const float* b = base ? base + brow[j] * C : NULL;
    if (ckind == OUT_U8_NR) {
      const uint8_t* c = (const uint8_t*)codes + j * C;
      for (int64_t i = 0; i < C; ++i) hi = c[i] > hi ? c[i] : hi;
      for (int64_t i = 0; i < C; ++i) row[i] = (float)((int32_t)c[i] - mid) * s;
    } else {
      const uint16_t* c = (const uint16_t*)codes + j * C;
      for (int64_t i = 0; i < C; ++i) hi = c[i] > hi ? c[i] : hi;
      for (int64_t i = 0; i < C; ++i) row[i] = (float)((int32_t)c[i] - mid) * s;
    }
    if (b)
      for (int64_t i = 0; i < C; ++i) row[i] = b[i] + row[i];
    if (out_kind != F_F32) /* saturate, not inf: a coded extreme can pass 65504 by the fp16 scale's rounding */
      for (int64_t i = 0; i < C; ++i) row[i] = clampf(row[i], m);
    store_row(out, out_kind, orow[j] * C, row, C);
  }
  free(row);
  return hi > max_code ? KVN_BAD_SYMBOL : KVN_OK;
}

/* ------------------------------------------------------------------ quantization */
/* KIVI quantization, bit-identical to kvcodec.quant.fast.intq_quantize_fast: per group,
 * mn/mx = min/max (+0.0, so -0 becomes +0), scale16 = f16((mx - mn) / levels), zero16 = f16(mn),
 * s, z = their float32 values, code = s > 0 ? clamp(rint((x - z) / s), 0, levels) : 0.
 * x: [T, H, D] of kind F_*; axis 0 ("channel", K): groups of `group` tokens per channel, params
 * [ceil(T/g), H, D]; axis 1 ("token", V): groups of `group` channels per (token, head), params
 * [T, H, ceil(D/g)]. Returns 1 if x holds NaN/Inf, 2 if a scale or zero overflows float16,
 * KVN_NOMEM; else KVN_OK. */
int kvn_intq_quant(const void* x, int xkind, int64_t T, int64_t H, int64_t D, int axis, int64_t group, int bits,
                   uint16_t* scale16, uint16_t* zero16, uint8_t* codes) {
  const int64_t Cn = H * D, ng = (D + group - 1) / group;
  const float levels = (float)((1 << bits) - 1);
  const int64_t rows = axis == 0 ? (group < T ? group : T) : 1; /* token rows held at once */
  float* buf = (float*)malloc(sizeof(float) * (size_t)((rows > 0 ? rows : 1) * (Cn > 0 ? Cn : 1) + 4 * (Cn > 0 ? Cn : 1)));
  if (!buf) return KVN_NOMEM;
  float* mn = buf + (rows > 0 ? rows : 1) * (Cn > 0 ? Cn : 1);
  float* mx = mn + Cn;
  float* sf = mx + Cn;
  float* zf = sf + Cn;
  int rc = KVN_OK;
  if (axis == 0) {
    for (int64_t t0 = 0; t0 < T && rc == KVN_OK; t0 += group) {
      const int64_t nt = t0 + group < T ? group : T - t0, k = t0 / group;
      for (int64_t j = 0; j < nt; ++j) load_row(buf + j * Cn, x, xkind, (t0 + j) * Cn, Cn);
      for (int64_t i = 0; i < Cn; ++i) mn[i] = mx[i] = buf[i];
      uint32_t bad = 0;
      for (int64_t j = 0; j < nt; ++j) {
        const float* r = buf + j * Cn;
        for (int64_t i = 0; i < Cn; ++i) { /* branch-free: vectorises */
          bad |= (f32_bits(r[i]) & 0x7fffffffu) >= 0x7f800000u; /* NaN or Inf */
          mn[i] = r[i] < mn[i] ? r[i] : mn[i];
          mx[i] = r[i] > mx[i] ? r[i] : mx[i];
        }
      }
      if (bad) {
        rc = 1;
        break;
      }
      for (int64_t i = 0; i < Cn; ++i) {
        const float lo = mn[i] + 0.0f, hi = mx[i] + 0.0f;
        const uint16_t sh = f32_to_f16((hi - lo) / levels), zh = f32_to_f16(lo);
        if ((sh & 0x7c00u) == 0x7c00u || (zh & 0x7c00u) == 0x7c00u) rc = 2;
        scale16[k * Cn + i] = sh;
        zero16[k * Cn + i] = zh;
        sf[i] = f16_to_f32(sh);
        zf[i] = f16_to_f32(zh);
      }
      if (rc != KVN_OK) break;
      for (int64_t j = 0; j < nt; ++j) {
        const float* r = buf + j * Cn;
        uint8_t* c = codes + (t0 + j) * Cn;
        for (int64_t i = 0; i < Cn; ++i) {
          float q = sf[i] > 0.0f ? rne_f32((r[i] - zf[i]) / (sf[i] > 0.0f ? sf[i] : 1.0f)) : 0.0f;
          q = q < 0.0f ? 0.0f : (q > levels ? levels : q);
          c[i] = (uint8_t)q;
        }
      }
    }
  } else {
    for (int64_t t = 0; t < T && rc == KVN_OK; ++t) {
      load_row(buf, x, xkind, t * Cn, Cn);
      for (int64_t h = 0; h < H && rc == KVN_OK; ++h) {
        for (int64_t j = 0; j < ng; ++j) {
          const int64_t d0 = j * group, d1 = d0 + group < D ? d0 + group : D;
          const float* r = buf + h * D;
          /* min and max as integer reductions over order-preserving keys of the bit patterns
           * (they vectorise; float ones would not without -ffast-math). Only -0.0 < +0.0 differs
           * from float order, and the + 0.0f below makes both +0, as the reference does. */
          int32_t kmin = fkey(r[d0]), kmax = kmin;
          uint32_t bad = 0;
          for (int64_t d = d0; d < d1; ++d) {
            const int32_t k = fkey(r[d]);
            bad |= (f32_bits(r[d]) & 0x7fffffffu) >= 0x7f800000u;
            kmin = k < kmin ? k : kmin;
            kmax = k > kmax ? k : kmax;
          }
          if (bad) {
            rc = 1;
            break;
          }
          float lo = fkey_f32(kmin) + 0.0f, hi = fkey_f32(kmax) + 0.0f;
          const uint16_t sh = f32_to_f16((hi - lo) / levels), zh = f32_to_f16(lo);
          if ((sh & 0x7c00u) == 0x7c00u || (zh & 0x7c00u) == 0x7c00u) rc = 2;
          scale16[(t * H + h) * ng + j] = sh;
          zero16[(t * H + h) * ng + j] = zh;
          const float s = f16_to_f32(sh), z = f16_to_f32(zh);
          uint8_t* c = codes + t * Cn + h * D;
          for (int64_t d = d0; d < d1; ++d) {
            float q = s > 0.0f ? rne_f32((r[d] - z) / (s > 0.0f ? s : 1.0f)) : 0.0f;
            q = q < 0.0f ? 0.0f : (q > levels ? levels : q);
            c[d] = (uint8_t)q;
          }
        }
      }
    }
  }
  free(buf);
  return rc;
}

/* Per-token symmetric quantization (CacheGen), bit-identical to
 * kvcodec.codecs.cachegen.symmetric_token_quantize: for output row j, y = x[xrow[j], :] (minus
 * base[brow[j], :] when base is given, float32), scale16 = f16(max|y| / m), s = f32(scale16),
 * code = (s > 0 ? clamp(rint(y / s), -m, m) : 0) + m. x: [rows, C] of kind F_*. Returns 2 if a
 * row holds NaN or its scale overflows float16 (the reference's error), KVN_NOMEM, or KVN_OK. */
int kvn_tok_quant(const void* x, int xkind, int64_t n, int64_t C, const int64_t* xrow, const float* base,
                  const int64_t* brow, int32_t m, uint16_t* scale16, uint16_t* codes) {
  float* y = (float*)malloc(sizeof(float) * (size_t)(C > 0 ? C : 1));
  if (!y) return KVN_NOMEM;
  const float mf = (float)m;
  int rc = KVN_OK;
  for (int64_t j = 0; j < n && rc == KVN_OK; ++j) {
    load_row(y, x, xkind, xrow[j] * C, C);
    if (base) {
      const float* b = base + brow[j] * C;
      for (int64_t i = 0; i < C; ++i) y[i] = y[i] - b[i];
    }
    /* max |y| on the bit patterns: non-negative floats order as integers, and any NaN (above
     * inf's pattern) shows up as the maximum -- an integer reduction, which vectorises */
    uint32_t umax = 0;
    for (int64_t i = 0; i < C; ++i) {
      const uint32_t u = f32_bits(y[i]) & 0x7fffffffu;
      umax = u > umax ? u : umax;
    }
    const int nan = umax > 0x7f800000u;
    const float amax = bits_f32(umax);
    const uint16_t sh = f32_to_f16(amax / mf);
    if (nan || (sh & 0x7c00u) == 0x7c00u) {
      rc = 2;
      break;
    }
    scale16[j] = sh;
    const float s = f16_to_f32(sh);
    uint16_t* c = codes + j * C;
    if (s > 0.0f) {
      for (int64_t i = 0; i < C; ++i) {
        float q = rne_f32(y[i] / s);
        q = q < -mf ? -mf : (q > mf ? mf : q);
        c[i] = (uint16_t)(int32_t)(q + mf);
      }
    } else {
      for (int64_t i = 0; i < C; ++i) c[i] = (uint16_t)m;
    }
  }
  free(y);
  return rc;
}

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
                      const int32_t* etok, const int32_t* erow, int64_t* n_esc, int64_t* lv) {
  const int64_t L = esc_level(top, ml);
  *lv = L;
  *n_esc = ne;
  if (L < ml) {
    const uint16_t d = (uint16_t)(ml - L);
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
  return esc_finish(sym, n, R, ml, top, ne, esc, etok, erow, n_esc, lv);
}

/* kvn_escape_split1 that also takes a scope-2 entropy stage's statistics of the symbols it writes,
 * in the same pass (kvcodec.native.ctx_histograms' counts and classes: streams of G rows over the
 * token-major [n, R] symbols, nthr thresholds thr, center L - 1): hist int64 [Q * R, 2 L]
 * (row q * R + r; zeroed and filled here, Q = nthr + 1), cls uint8 [n, R]. The classes follow
 * the magnitudes |symbol - center| -- |c| for a regular code, L for an escape -- which do not
 * depend on the final L (when it ends below max_level nothing escaped), so only the histogram's
 * columns move with it. Returns as kvn_escape_split1, or KVN_BAD_SYMBOL for bad arguments (nthr
 * outside [0, 16), G < 1, n >= 2^31). scratch: int32 [R * Q * 2 max_level] counts. */
#define KVN_ESC_CTX_PASS(SUF, CT)                                                                        \
  static int64_t esc_ctx_pass##SUF(const CT* codes, int64_t n, int64_t R, int64_t ml, const uint8_t* delta, \
                                   uint16_t* sym, int32_t* etok, int32_t* erow, int64_t cap,             \
                                   uint64_t* top_out, int64_t G, int64_t nthr, const int64_t* bk,        \
                                   int32_t* h, uint8_t* cls) {                                           \
    const uint16_t e = (uint16_t)(2 * ml - 1);                                                          \
    const int64_t Q = nthr + 1, A = 2 * ml;                                                             \
    uint64_t top = 0;                                                                                   \
    int64_t ne = 0;                                                                                     \
    for (int64_t t = 0; t < n; ++t) {                                                                   \
      const CT* ct = codes + t * R;                                                                     \
      uint16_t* st = sym + t * R;                                                                       \
      uint8_t* qt = cls + t * R;                                                                        \
      for (int64_t r0 = 0; r0 < R; r0 += G) {                                                           \
        const int64_t r1 = r0 + G < R ? r0 + G : R;                                                     \
        int64_t acc = 0; /* the stream's running magnitude sum at token t */                            \
        for (int64_t r = r0; r < r1; ++r) {                                                             \
          const int64_t c = (delta && delta[r] && t) ? (int64_t)ct[r] - (int64_t)ct[r - R] : (int64_t)ct[r]; \
          int64_t sv;                                                                                   \
          ESC_SYMBOL(c, r, sv);                                                                         \
          const int64_t mag = sv == e ? ml : (c < 0 ? -c : c); /* |symbol - center| */                  \
          st[r] = (uint16_t)sv;                                                                         \
          const int q = ctx_class(acc, bk + (r - r0) * MAXQ, nthr);                                     \
          qt[r] = (uint8_t)q;                                                                           \
          h[(r * Q + q) * A + sv] += 1;                                                                 \
          acc += mag;                                                                                   \
        }                                                                                               \
      }                                                                                                 \
    }                                                                                                   \
    *top_out = top;                                                                                     \
    return ne;                                                                                          \
  }
KVN_ESC_CTX_PASS(_i64, int64_t)
KVN_ESC_CTX_PASS(_i32, int32_t)

int kvn_escape_split_ctx(const void* codes, int ckind, int64_t n, int64_t R, int64_t max_level, const uint8_t* delta,
                         uint16_t* sym, int32_t* esc, int32_t* etok, int32_t* erow, int64_t cap, int64_t* n_esc,
                         int64_t* lv, int64_t G, int64_t nthr, const int64_t* thr, int64_t* hist, uint8_t* cls) {
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
  const int64_t ne =
      ckind == C_I32 ? esc_ctx_pass_i32((const int32_t*)codes, n, R, ml, delta, sym, etok, erow, cap, &top, G, nthr, bk, h, cls)
                 : esc_ctx_pass_i64((const int64_t*)codes, n, R, ml, delta, sym, etok, erow, cap, &top, G, nthr, bk, h, cls);
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
  return esc_finish(sym, n, R, ml, top, ne, esc, etok, erow, n_esc, lv);
}

/* Inverse: out[t * R + r] = sym - (L - 1), escape symbols (2L - 1) replaced by esc values taken in
 * row-major order of [R, n]; with delta (uint8 [R] or NULL), the columns r with delta[r] != 0
 * become their running sums over t. out: int64 (okind 0) or int32 (okind 1) [n, R]. Returns 1 if the
 * escape count differs from n_esc, 2 if an escaped value lies inside (-L, L) (both corrupt files),
 * 3 if int32 output was asked for and a code does not fit (the caller redoes it in int64), KVN_NOMEM,
 * else KVN_OK. sym: uint16 [n, R]. */
int kvn_escape_join(const uint16_t* sym, int64_t n, int64_t R, int64_t L, const int64_t* esc, int64_t n_esc,
                    const uint8_t* delta, void* out, int okind) {
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
  int32_t* o32 = (int32_t*)out;
  int wide = 0; /* int32 output: a code outside the int32 range (the caller redoes it in int64) */
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
      if (okind == C_I32) {
        if (delta && delta[r] && t) v += o32[(t - 1) * R + r]; /* both within int32: no overflow in int64 */
        wide |= v < INT32_MIN || v > INT32_MAX;
        o32[t * R + r] = (int32_t)v;
      } else {
        if (delta && delta[r] && t) v = (int64_t)((uint64_t)v + (uint64_t)o64[(t - 1) * R + r]);
        o64[t * R + r] = v;
      }
    }
  free(pos);
  return rc ? rc : (wide ? 3 : KVN_OK);
}

/* kvc reconstruction (kvcodec/codecs/kvc.py, normative): out[t, h, d] = clamp(f32(code) * step
 * + mean[h, d], +-fmax), cast to the out kind. codes: int64 (ckind 0) or int32 (ckind 1) [n, H, D]
 * (token rows crow apart); step: float32 with element
 * strides s0, s1, s2 (0 broadcasts); mean: float32 [H, D]. fmax <= 0: no clamp. */
/* One row of D dequantized values from codes of type CT (kvn_kvc_dequant's arithmetic). */
#define KVN_DQ_ROW(SUF, CT)                                                                                \
  static void dq_row##SUF(const CT* c, const float* st, int64_t s2, const float* mu, int64_t D, float m,     \
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
KVN_DQ_ROW(_i32, int32_t)

int kvn_kvc_dequant(const void* codes, int ckind, int64_t crow, int64_t n, int64_t H, int64_t D, const float* step,
                    int64_t s0, int64_t s1, int64_t s2, const float* mean, float fmax, int out_kind, void* out,
                    const float* rtab, int64_t rm) {
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
        dq_row_i32((const int32_t*)codes + co, st, s2, mean + h * D, D, m, rtab, rm, row + h * D);
      else
        dq_row_i64((const int64_t*)codes + co, st, s2, mean + h * D, D, m, rtab, rm, row + h * D);
    }
    store_row(out, out_kind, t * Cn, row, Cn);
  }
  free(row);
  return KVN_OK;
}

/* Cluster sums for the entropy stage's table clustering: sums[assign[i], :] += h[i, :] (float64
 * counts, exact in any order); used[j] = 1 if cluster j has a member. */
void kvn_member_sums(const double* h, int64_t r, int64_t a, const int64_t* assign, int64_t k, double* sums,
                     uint8_t* used) {
  memset(sums, 0, sizeof(double) * (size_t)(k * a));
  memset(used, 0, (size_t)k);
  for (int64_t i = 0; i < r; ++i) {
    const int64_t j = assign[i];
    if (j < 0 || j >= k) continue;
    used[j] = 1;
    double* sj = sums + j * a;
    const double* hi = h + i * a;
    for (int64_t c = 0; c < a; ++c) sj[c] += hi[c];
  }
}

/* kvc's token-delta choice: per column r of token-major codes [n, R] (int64, ckind 0, or int32,
 * ckind 1), histograms over 128 bins
 * of the codes and of their token deltas (e[0] = c[0], e[t] = c[t] - c[t-1]) at the tokens
 * t = 0, ts, 2 ts, ... (ts >= 1), each value clipped to [-64, 63] and shifted by 64.
 * hc, he: int32 [R, 128] (n < 2^31), zeroed here. */
#define KVN_DELTA_HIST(SUF, CT)                                                                    \
  static void delta_hist##SUF(const CT* c, int64_t n, int64_t R, int64_t ts, int32_t* hc, int32_t* he) { \
    for (int64_t t = 0; t < n; t += ts) {                                                           \
      const CT* ct = c + t * R;                                                                     \
      for (int64_t r = 0; r < R; ++r) {                                                             \
        const int64_t v = (int64_t)ct[r];                                                           \
        /* the difference of two codes cannot overflow: the encoder's codes are far inside the     \
           int64 range (|c| < 2**62) */                                                             \
        const int64_t e = t ? v - (int64_t)ct[r - R] : v;                                           \
        const int64_t vc = v < -64 ? 0 : v > 63 ? 127 : v + 64;                                    \
        const int64_t ec = e < -64 ? 0 : e > 63 ? 127 : e + 64;                                    \
        hc[r * 128 + vc] += 1;                                                                      \
        he[r * 128 + ec] += 1;                                                                      \
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

/* Conversions for tests: kind F_F16 / F_BF16, float32 -> bits (dir 0, through store_row: the
 * path the decoders use) or bits -> float32 (dir 1). */
void kvn_convert(int kind, int dir, const void* in, void* out, int64_t n) {
  if (dir == 0) {
    store_row(out, kind, 0, (const float*)in, n);
    return;
  }
  for (int64_t i = 0; i < n; ++i) ((float*)out)[i] = load_f(in, kind, i);
}

/* ABI version: bump when a signature changes (the loader checks it). */
int kvn_abi_version(void) { return 22; }
