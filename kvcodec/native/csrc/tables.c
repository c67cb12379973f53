/* tables.c -- the entropy stage's table clustering (kvcodec.entropy.stage). */
#include "kvn_common.h"

/* q[j] = centers[j] / sum(centers[j]) for k tables of a symbols (every value a multiple of 1/2
 * below 2^52: the sums are exact in any order, as numpy's are) */
static void next_q(const double* centers, int64_t k, int64_t a, double* q) {
  for (int64_t j = 0; j < k; ++j) {
    const double* cj = centers + j * a;
    double tot = 0.0;
    for (int64_t c = 0; c < a; ++c) tot += cj[c];
    for (int64_t c = 0; c < a; ++c) q[j * a + c] = cj[c] / tot;
  }
}

/* The table clustering's passes after its first centres (kvcodec.entropy.clustering
 * _cluster_tables, whose numpy loop is the reference): up to `iters` times,
 *   - each table's log distribution, log q[j][c] (libm's log, as Python's math.log);
 *   - each row's gain per table, gain[i][j] = the sum over the symbols c of h[i][c] * log q[j][c]
 *     in ascending c, each product and sum rounded on its own (a zero count adds nothing: a sum
 *     that starts at +0 is unchanged by a -0 product);
 *   - each row's cheapest table, the first j of the largest gain (numpy's argmax; gains are
 *     finite); on a pass after the first, an assignment that stands ends the passes;
 *   - the member sums of the new assignment and which tables have members, the centres
 *     (sums + 0.5 where a table has members, else as they were) and the next distributions
 *     (next_q).
 * Rows are read once into a list of their non-zero counts (most counts are zero), so a pass
 * costs the non-zero counts times k, not R * A * k. centers [k, a]: in, the first centres;
 * out, the last. assign [r], sums [k, a], used [k] out: those of the final assignment; q [k, a]
 * scratch. Returns the passes made, or -1 when out of memory. */
static KVN_ALWAYS_INLINE int cluster_iterate(const double* h, int64_t r, int64_t a, int64_t k, int iters,
                                             double* centers, int64_t* assign, double* sums, uint8_t* used,
                                             double* q) {
  int64_t nnz = 0;
  for (int64_t e = 0; e < r * a; ++e) nnz += h[e] != 0.0;
  double* gain = (double*)malloc(sizeof(double) * (size_t)(r * k + a * k + k + nnz + 1));
  int64_t* start = (int64_t*)malloc(sizeof(int64_t) * (size_t)(r + 1 + nnz + 1));
  if (!gain || !start) {
    free(gain);
    free(start);
    return -1;
  }
  double *lq = gain + r * k, *g = lq + a * k, *val = g + k; /* lq [a, k]: symbol-major */
  int64_t* col = start + r + 1;
  start[0] = 0;
  for (int64_t i = 0, at = 0; i < r; ++i) {
    for (int64_t c = 0; c < a; ++c)
      if (h[i * a + c] != 0.0) {
        col[at] = c;
        val[at++] = h[i * a + c];
      }
    start[i + 1] = at;
  }
  next_q(centers, k, a, q);
  int done = 0;
  for (int it = 0; it < iters; ++it) {
    for (int64_t j = 0; j < k; ++j)
      for (int64_t c = 0; c < a; ++c) lq[c * k + j] = log(q[j * a + c]);
    int changed = it == 0;
    for (int64_t i = 0; i < r; ++i) {
      for (int64_t j = 0; j < k; ++j) g[j] = 0.0;
      for (int64_t e = start[i]; e < start[i + 1]; ++e) {
        const double hv = val[e], *l = lq + col[e] * k;
        for (int64_t j = 0; j < k; ++j) g[j] = g[j] + hv * l[j];
      }
      int64_t best = 0;
      for (int64_t j = 1; j < k; ++j)
        if (g[j] > g[best]) best = j;
      changed |= assign[i] != best;
      assign[i] = best;
    }
    if (!changed) break;
    done++;
    memset(sums, 0, sizeof(double) * (size_t)(k * a));
    memset(used, 0, (size_t)k);
    for (int64_t i = 0; i < r; ++i) {
      double* sj = sums + assign[i] * a;
      used[assign[i]] = 1;
      for (int64_t e = start[i]; e < start[i + 1]; ++e) sj[col[e]] += val[e];
    }
    for (int64_t j = 0; j < k; ++j)
      if (used[j])
        for (int64_t c = 0; c < a; ++c) centers[j * a + c] = sums[j * a + c] + 0.5;
    next_q(centers, k, a, q);
  }
  free(gain);
  free(start);
  return done;
}

/* The passes built twice, for AVX2 (chosen at run time where the CPU has it) and plain: the gains'
 * loop over the tables vectorises four doubles wide instead of two; the same operations (no
 * multiply-add is fused: -ffp-contract=off). */
#ifdef KVN_X86
__attribute__((target("avx2"))) static int cluster_iterate_avx2(const double* h, int64_t r, int64_t a, int64_t k,
                                                                int iters, double* centers, int64_t* assign,
                                                                double* sums, uint8_t* used, double* q) {
  return cluster_iterate(h, r, a, k, iters, centers, assign, sums, used, q);
}
#endif

int kvn_cluster_iterate(const double* h, int64_t r, int64_t a, int64_t k, int iters, double* centers,
                        int64_t* assign, double* sums, uint8_t* used, double* q) {
#ifdef KVN_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2")) return cluster_iterate_avx2(h, r, a, k, iters, centers, assign, sums, used, q);
#endif
  return cluster_iterate(h, r, a, k, iters, centers, assign, sums, used, q);
}

/* The rows of the first centres (kvcodec.entropy.clustering._cluster_tables' init): rows in the
 * order of their mean symbol, ties by row index (numpy's lexsort), then k rows spread evenly over
 * that order at round(i * (r - 1) / (k - 1)) (numpy's linspace -- the last exactly r - 1 -- and
 * round half to even). Means are integer sums (exact in any order) over max(count, 1). */
typedef struct {
  double mean;
  int64_t row;
} RowMean;

static int by_mean(const void* x, const void* y) {
  const RowMean *a = (const RowMean*)x, *b = (const RowMean*)y;
  if (a->mean != b->mean) return a->mean < b->mean ? -1 : 1;
  return (a->row > b->row) - (a->row < b->row);
}

/* A table of precision p from counts h[a] (entropy/tables.py build_tables, the reference): every
 * symbol 1, then floor(h * free / total) of the free 2^p - a, the rest one each to the largest
 * remainders (ties: the lower symbol); all-zero counts count as all ones. Products below 2^62 (the
 * caller checks). rem, ord: scratch [a]. */
typedef struct {
  int64_t rem, sym;
} RemSym;

static int by_rem(const void* x, const void* y) {
  const RemSym *u = (const RemSym*)x, *v = (const RemSym*)y;
  if (u->rem != v->rem) return u->rem > v->rem ? -1 : 1;
  return (u->sym > v->sym) - (u->sym < v->sym);
}

static void table_of_counts(const int64_t* h, int64_t a, int p, uint32_t* out, int64_t* rem, RemSym* ord) {
  int64_t total = 0;
  for (int64_t c = 0; c < a; ++c) total += h[c];
  const int64_t free_ = ((int64_t)1 << p) - a;
  int64_t left = free_;
  for (int64_t c = 0; c < a; ++c) {
    const int64_t v = total ? h[c] : 1, prod = v * free_, t = total ? total : a;
    out[c] = (uint32_t)(prod / t + 1);
    rem[c] = prod % t;
    left -= prod / t;
  }
  if (left <= 0) return;
  /* the largest remainders, ties to the lower symbol: the symbols in that order, one each to the
     first `left` (a sort: picking the largest `left` times cost a * left steps) */
  for (int64_t c = 0; c < a; ++c) ord[c] = (RemSym){rem[c], c};
  qsort(ord, (size_t)a, sizeof(RemSym), by_rem);
  for (int64_t n = 0; n < left; ++n) out[ord[n].sym] += 1;
}

/* The whole table clustering of kvcodec.entropy.clustering._cluster_tables (its numpy code is the
 * reference, the same bits): the first centres, the passes (kvn_cluster_iterate, at most `iters`),
 * and a table of precision p per cluster from its member counts (a cluster without members: from
 * every row's). hist int64 [r, a] counts; tables uint32 [k, a] and assign int64 [r] out. Returns
 * the passes made; -1 out of memory; -2 operands the reference handles on its own (negative
 * counts, counts whose products could pass 2^62, a bad precision or alphabet). */
int kvn_cluster_tables(const int64_t* hist, int64_t r, int64_t a, int64_t k, int iters, int p, uint32_t* tables,
                       int64_t* assign) {
  if (r < 1 || k < 1 || iters < 1 || p < 1 || p > 24 || a < 2 || a > ((int64_t)1 << p)) return -2;
  int64_t big = 0;
  for (int64_t e = 0; e < r * a; ++e) {
    if (hist[e] < 0) return -2;
    big = hist[e] > big ? hist[e] : big;
  }
  /* every row sum and member sum is at most r * a * big: keep its products with 2^p below 2^62 */
  if (big > 0 && (double)big * (double)r * (double)a * (double)((int64_t)1 << p) >= 4.0e18) return -2;
  const size_t nd = (size_t)(r * a + 3 * k * a + a + 1);
  double* h = (double*)malloc(sizeof(double) * nd);
  RowMean* rm = (RowMean*)malloc(sizeof(RowMean) * (size_t)r);
  int64_t* th = (int64_t*)malloc(sizeof(int64_t) * (size_t)(k * a + a + 1));
  uint8_t* used = (uint8_t*)malloc((size_t)k + 1);
  if (!h || !rm || !th || !used) {
    free(h); free(rm); free(th); free(used);
    return -1;
  }
  double *centers = h + r * a, *sums = centers + k * a, *q = sums + k * a;
  for (int64_t i = 0; i < r; ++i) {
    double s = 0.0, w = 0.0;
    for (int64_t c = 0; c < a; ++c) {
      const double v = (double)hist[i * a + c];
      h[i * a + c] = v;
      s += v * (double)c;
      w += v;
    }
    rm[i].mean = s / (w > 1.0 ? w : 1.0);
    rm[i].row = i;
  }
  qsort(rm, (size_t)r, sizeof(RowMean), by_mean);
  const double step = k > 1 ? (double)(r - 1) / (double)(k - 1) : 0.0;
  for (int64_t j = 0; j < k; ++j) {
    double y = step != 0.0 ? (double)j * step : 0.0;
    if (k > 1 && j == k - 1) y = (double)(r - 1);
    const int64_t row = rm[(int64_t)nearbyint(y)].row;
    for (int64_t c = 0; c < a; ++c) centers[j * a + c] = h[row * a + c] + 0.5;
  }
  const int done = kvn_cluster_iterate(h, r, a, k, iters, centers, assign, sums, used, q);
  if (done >= 0) {
    int64_t* all = th + k * a; /* every row's counts: a cluster without members takes them */
    int64_t unused = 0;
    for (int64_t j = 0; j < k; ++j) unused += !used[j];
    for (int64_t c = 0; c < a; ++c) all[c] = 0;
    if (unused) /* (row by row: a remainder per count cost more than the passes) */
      for (int64_t i = 0; i < r; ++i)
        for (int64_t c = 0; c < a; ++c) all[c] += hist[i * a + c];
    for (int64_t j = 0; j < k; ++j)
      for (int64_t c = 0; c < a; ++c) th[j * a + c] = used[j] ? (int64_t)sums[j * a + c] : all[c];
    int64_t* rem = (int64_t*)malloc(sizeof(int64_t) * (size_t)a);
    RemSym* ord = (RemSym*)malloc(sizeof(RemSym) * (size_t)a);
    if (!rem || !ord) {
      free(h); free(rm); free(th); free(used); free(rem); free(ord);
      return -1;
    }
    for (int64_t j = 0; j < k; ++j) table_of_counts(th + j * a, a, p, tables + j * a, rem, ord);
    free(rem);
    free(ord);
  }
  free(h);
  free(rm);
  free(th);
  free(used);
  return done;
}
