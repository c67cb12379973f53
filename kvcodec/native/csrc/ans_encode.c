/* ans_encode.c -- the ANS stage encoder (kvn_ans_encode) and the symbol histograms that choose
 * its tables (kvn_hist, kvn_ctx_hist); formats/ANS.md, kvn_common.h. The encoder divides by
 * multiplying with a precomputed reciprocal (exact after one correction step).
 */
#include "kvn_common.h"

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
    const uint64_t xs_ = x[L] >> 32;                                 \
    *o[L] = (uint32_t)x[L];                                          \
    o[L] += e_;                                                      \
    x[L] = e_ ? xs_ : x[L]; /* a select: shorter than a shift by e*32 */ \
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
      const int direct = kind == OUT_U16_NR && (g.Q == 1 || cls_in);
      if (direct) {
        uint32_t top = 0, qtop = 0;
        if (st == 1) { /* row-major: along the rows */
          for (int64_t r = rb0; r < rb1; ++r) {
            const uint16_t* xr = (const uint16_t*)sym + r * sr;
            for (int64_t t = t0; t < t1; ++t) top = xr[t] > top ? xr[t] : top;
            if (g.Q > 1) {
              const uint8_t* qr = cls_in + r * sr;
              for (int64_t t = t0; t < t1; ++t) qtop = qr[t] > qtop ? qr[t] : qtop;
            }
          }
        } else {
          for (int64_t t = t0; t < t1; ++t) {
            const uint16_t* xr = (const uint16_t*)sym + t * st;
            for (int64_t r = rb0; r < rb1; ++r) top = xr[r * sr] > top ? xr[r * sr] : top;
            if (g.Q > 1) {
              const uint8_t* qr = cls_in + t * st;
              for (int64_t r = rb0; r < rb1; ++r) qtop = qr[r * sr] > qtop ? qr[r * sr] : qtop;
            }
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
