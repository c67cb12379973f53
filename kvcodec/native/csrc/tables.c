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
 * member sums and used flags of the new assignment (kvn_member_sums), the new centres
 * (centers[j] = sums[j] + 0.5 where table j has members, else as they were) and the next
 * distributions q[j] = centers[j] / sum(centers[j]) (every value a multiple of 1/2 below 2^52,
 * so the sums are exact in any order, as numpy's are). Returns 1 if it did so, 0 if the
 * assignment stood (everything else is then left as it was: that of this assignment). */
int kvn_cluster_update(const double* gain, int64_t r, int64_t k, const double* h, int64_t a, int64_t* assign,
                       int first, double* sums, uint8_t* used, double* centers, double* q) {
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
  if (!changed) return 0;
  kvn_member_sums(h, r, a, assign, k, sums, used);
  for (int64_t j = 0; j < k; ++j) {
    double* cj = centers + j * a;
    if (used[j])
      for (int64_t c = 0; c < a; ++c) cj[c] = sums[j * a + c] + 0.5;
    double tot = 0.0;
    for (int64_t c = 0; c < a; ++c) tot += cj[c];
    for (int64_t c = 0; c < a; ++c) q[j * a + c] = cj[c] / tot;
  }
  return 1;
}
