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
