/* ans_decode.c -- the ANS stage decoder (kvn_ans_decode; formats/ANS.md, kvn_common.h).
 *
 * Speed: symbols are found with a slot table (one load when its resolution equals the table
 * precision; otherwise a few steps forward from the slot's first symbol), and LANES streams of the
 * same shape are decoded in lockstep so their dependency chains overlap.
 */
#include "kvn_common.h"

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
  const uint16_t* lut; /* 2^b entries, or NULL: lut8 or binary search */
  const uint8_t* lut8; /* the same as bytes when the alphabet fits (half the cache footprint) */
} Table;

typedef struct {
  uint32_t shift; /* 24 - b */
  int exact;      /* b == P: the slot's symbol is the symbol */
  int64_t A;
} Lookup;

static inline uint32_t find_symbol(const Table* tb, const Lookup* lk, uint32_t q) {
  uint32_t lo = 0, hi = (uint32_t)lk->A; /* invariant: cum[lo] <= q < cum[hi] */
  if (tb->lut8) {
    const uint32_t j = q >> lk->shift;
    lo = tb->lut8[j];
    if (lk->exact) return lo;
    hi = (uint32_t)tb->lut8[j + 1] + 1u;
  } else if (tb->lut) {
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

/* Decode `nl` (1..LANES) streams of chunk c, groups g0 .. g0+nl-1, all with the same rows.
 * (A tensor of kvc has few streams per chunk -- 195 rows in streams of 64 are three full groups
 * and a ragged one -- so runs of two or three full groups share lanes too: decoding them one by
 * one left each symbol's whole dependency chain exposed, about 2x slower.) */
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
    /* lanes unrolled for two to four streams (their dependency chains overlap) */
#define DEC_STEP(L) put(out, kind, g, row[L], t, pop(&st[L], &tb[L], lk))
    if (nl == 4) {
      for (int64_t t = t0; t < t1; ++t) {
        DEC_STEP(0); DEC_STEP(1); DEC_STEP(2); DEC_STEP(3);
      }
    } else if (nl == 3) {
      for (int64_t t = t0; t < t1; ++t) {
        DEC_STEP(0); DEC_STEP(1); DEC_STEP(2);
      }
    } else if (nl == 2) {
      for (int64_t t = t0; t < t1; ++t) {
        DEC_STEP(0); DEC_STEP(1);
      }
    } else {
      for (int64_t t = t0; t < t1; ++t)
        for (int l = 0; l < nl; ++l) DEC_STEP(l);
    }
#undef DEC_STEP
  }
  for (int l = 0; l < nl; ++l) {
    if (st[l].pos != 0 || st[l].x != 0) {
      *bad = c * g->n_groups + g0 + l;
      return KVN_NOT_CONSUMED;
    }
  }
  return KVN_OK;
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
  /* slots as bytes when the alphabet fits one (kvc's, mostly): 4096 slots of 8 tables then fit
   * a 48 KB L1 cache, which measured ~1.2x faster decoding than 16-bit slots */
  uint16_t* lut = NULL;
  uint8_t* lut8 = NULL;
  if (g.A <= 256) lut8 = (uint8_t*)malloc((size_t)(g.T * stride));
  else if (g.A <= 65536) lut = (uint16_t*)malloc(sizeof(uint16_t) * (size_t)(g.T * stride));
  int64_t* acc = NULL;
  uint8_t* cls = NULL;
  if (g.Q > 1) {
    acc = (int64_t*)malloc(sizeof(int64_t) * (size_t)(LANES * (g.C < g.N ? g.C : g.N)));
    cls = (uint8_t*)malloc((size_t)(LANES * (g.C < g.N ? g.C : g.N)));
  }
  if (!cum || !tabs || (g.A <= 256 ? !lut8 : (g.A <= 65536 && !lut)) || (g.Q > 1 && (!acc || !cls))) {
    free(cum); free(tabs); free(lut); free(lut8); free(acc); free(cls);
    return KVN_NOMEM;
  }
  Lookup lk;
  lk.shift = (uint32_t)(PREC - b);
  lk.exact = b == g.P;
  lk.A = g.A;
  for (int64_t t = 0; t < g.T; ++t) {
    tabs[t].cum = cum + t * (g.A + 1);
    tabs[t].lut = NULL;
    tabs[t].lut8 = NULL;
    /* slot j holds the symbol whose interval contains j << shift: symbol s fills the slots
     * from ceil(cum[s] / 2^shift) up to that of cum[s + 1] (bytes, or 16-bit symbols) */
#define FILL_SLOTS(TYPE, BUF, FIELD)                                                             \
  do {                                                                                           \
    TYPE* l = (BUF) + t * stride;                                                                \
    const uint32_t* c = tabs[t].cum;                                                             \
    const uint32_t round = (1u << lk.shift) - 1u;                                                \
    for (int64_t s = 0; s < g.A; ++s) {                                                          \
      const uint32_t j0 = (c[s] + round) >> lk.shift, j1 = (c[s + 1] + round) >> lk.shift;       \
      for (uint32_t j = j0; j < j1; ++j) l[j] = (TYPE)s;                                         \
    }                                                                                            \
    l[stride - 1] = (TYPE)(g.A - 1);                                                             \
    tabs[t].FIELD = l;                                                                           \
  } while (0)
    if (lut8) FILL_SLOTS(uint8_t, lut8, lut8);
    else if (lut) FILL_SLOTS(uint16_t, lut, lut);
#undef FILL_SLOTS
  }
  int rc = KVN_OK;
  for (int64_t c = 0; c < g.n_chunks && rc == KVN_OK; ++c) {
    /* runs of full groups share up to LANES lanes; the last (ragged) group alone */
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
    while (g0 < full && rc == KVN_OK) { /* any run of full groups shares lanes */
      const int nl = full - g0 < LANES ? (int)(full - g0) : LANES;
      rc = decode_lanes(&g, words, offsets, tabs, &lk, table_of, c, g0, nl, out, kind, bad);
      g0 += nl;
    }
    for (; g0 < g.n_groups && rc == KVN_OK; ++g0)
      rc = decode_lanes(&g, words, offsets, tabs, &lk, table_of, c, g0, 1, out, kind, bad);
  }
  free(cum);
  free(tabs);
  free(lut);
  free(lut8);
  free(acc);
  free(cls);
  return rc;
}
