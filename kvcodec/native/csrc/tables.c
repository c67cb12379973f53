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
int kvn_cluster_iterate(const double* h, int64_t r, int64_t a, int64_t k, int iters, double* centers,
                        int64_t* assign, double* sums, uint8_t* used, double* q) {
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
