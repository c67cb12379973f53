/* tables.c -- the entropy stage's table clustering (kvcodec.entropy.stage). */
#include "kvn_common.h"

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

/* One step of the table clustering after its gains (kvcodec.entropy.clustering._cluster_tables):
 * each row's cheapest table, new[i] = the first j of the largest gain[i, j] (numpy's argmax;
 * gains are finite), into assign; then, where that changed assign or `first` is set, the
 * member sums and used flags of the new assignment (kvn_member_sums). Returns 1 if it did so,
 * 0 if the assignment stood (sums and used are then left as they were: those of this
 * assignment). */
int kvn_cluster_update(const double* gain, int64_t r, int64_t k, const double* h, int64_t a, int64_t* assign,
                       int first, double* sums, uint8_t* used) {
  int changed = first;
  for (int64_t i = 0; i < r; ++i) {
    const double* g = gain + i * k;
    int64_t best = 0;
    double top = g[0];
    for (int64_t j = 1; j < k; ++j)
      if (g[j] > top) {
        top = g[j];
        best = j;
      }
    changed |= assign[i] != best;
    assign[i] = best;
  }
  if (changed) kvn_member_sums(h, r, a, assign, k, sums, used);
  return changed;
}
