/* kvc_decode.c -- one kvc tensor decoded in one call (kvn_kvc_decode): the entropy stage, the
 * escape join with token-delta sums, the log steps, the rotating K means and the
 * dequantization, each the arithmetic of its own unit or of the Python reference it names
 * (kvcodec/codecs/kvc/codec.py KVCCodec.decode_tensor), bit for bit (tests/test_native_kvc_decode.py).
 *
 * Why one call: a 256-token chunk of a small model is ~50 k values, and the Python glue between
 * the five passes (arrays made, checked and converted between them) cost twice the passes
 * themselves; one call also holds no Python lock, so threads decode tensors on every core.
 */
#include "kvn_common.h"

int kvn_ans_decode(const int64_t* geom, const uint32_t* words, const uint32_t* offsets, const uint32_t* tables,
                   const int32_t* table_of, void* out, int kind, int64_t* bad);

/* Status codes of kvn_kvc_decode beyond the stage's (KVN_ZERO_WORD, KVN_NOT_CONSUMED with
 * *bad = the stream): */
enum {
  KVD_ESC_COUNT = 10,  /* escape symbols and the esc plane disagree (*bad = escape symbols counted) */
  KVD_ESC_INSIDE = 11, /* an escaped code lies inside the regular range */
  KVD_WIDE = 12,       /* a code does not fit int32: the caller takes the general path */
  KVD_STEP = 13        /* a step code (channel code + token offset, or base + token code) out of range */
};

/* The normative float32 step of a log-step code c (kvcodec.quant.deadzone.step_from_code):
 * mant[c mod 8] * 2^(c div 8), exact in float32 for the codes' range. */
static inline float step_of(const float* mant, int64_t c) {
  return ldexpf(mant[c & 7], (int)(c >> 3)); /* arithmetic shift: floor division by 8 */
}

/* mode: 0 per-channel steps sc[H * D]; 1 per-channel steps plus a token offset per head (the H
 * columns after the H * D codes: k_tok); 2 a step per (token, head): base[H] (in sc) plus the H
 * token columns (token-mode V). rope: r2 > 0 pairs of rotating means (steps rsteps[r2], channel
 * offset roff, style 0 half / 1 interleaved, positions pos[n], sintab of 2^sin_bits floats),
 * r2 == 0 one mean row for every token. out: [n, H, D] of out_kind, contiguous. */
int kvn_kvc_decode(const int64_t* geom, const uint32_t* words, const uint32_t* offsets, const uint32_t* tables,
                   const int32_t* table_of, const int64_t* esc, int64_t n_esc, int64_t L, const uint8_t* delta,
                   int64_t n, int64_t H, int64_t D, int mode, const int64_t* sc, const float* mant, int64_t cmin,
                   int64_t cmax, const float* rtab, int64_t rm, const float* mean, const uint32_t* rsteps,
                   int64_t r2, int64_t roff, int rstyle, const int64_t* pos, const float* sintab, int64_t sin_bits,
                   float fmax, int out_kind, void* out, int64_t* bad) {
  const int64_t hd = H * D, R = hd + (mode ? H : 0);
  *bad = -1;
  if (n <= 0) return KVN_OK;
  if (cmax < cmin || (r2 > 0 && (sin_bits < 2 || sin_bits > 30))) return KVD_STEP;
  uint16_t* sym = (uint16_t*)malloc(sizeof(uint16_t) * (size_t)(n * R));
  int32_t* codes = (int32_t*)malloc(sizeof(int32_t) * (size_t)(n * R));
  /* per token: its steps, its means and its values (float32 rows of H * D) */
  float* srow = (float*)malloc(sizeof(float) * (size_t)(3 * hd));
  /* every step of the code range, looked up instead of an ldexpf per value */
  float* stab = (float*)malloc(sizeof(float) * (size_t)(cmax - cmin + 1));
  int rc = KVN_OK;
  if (!sym || !codes || !srow || !stab) {
    rc = KVN_NOMEM;
    goto done;
  }
  rc = kvn_ans_decode(geom, words, offsets, tables, table_of, sym, OUT_U16_NR, bad);
  if (rc != KVN_OK) goto done;
  rc = escape_join_i32(sym, n, R, L, esc, n_esc, delta, codes);
  if (rc == 1) {
    const uint16_t e = (uint16_t)(2 * L - 1);
    int64_t cnt = 0;
    for (int64_t i = 0; i < n * R; ++i) cnt += sym[i] == e;
    *bad = cnt;
    rc = KVD_ESC_COUNT;
    goto done;
  }
  if (rc == 2) { rc = KVD_ESC_INSIDE; goto done; }
  if (rc == 3) { rc = KVD_WIDE; goto done; }
  if (rc != KVN_OK) goto done;
  for (int64_t c = cmin; c <= cmax; ++c) stab[c - cmin] = step_of(mant, c);
  float* st = srow;
  float* mu = srow + hd;
  float* row = srow + 2 * hd;
  if (mode == 0)
    for (int64_t i = 0; i < hd; ++i) {
      if (sc[i] < cmin || sc[i] > cmax) { rc = KVD_STEP; goto done; }
      st[i] = stab[sc[i] - cmin];
    }
  memcpy(mu, mean, sizeof(float) * (size_t)hd);
  const float m = fmax > 0.0f ? fmax : bits_f32(0x7f800000u);
  for (int64_t t = 0; t < n; ++t) {
    const int32_t* ct = codes + t * R;
    /* the token's steps (kvcodec.quant.deadzone.step_from_code of its codes) */
    if (mode == 1) {
      for (int64_t h = 0; h < H; ++h) {
        const int64_t off = ct[hd + h];
        const int64_t* sch = sc + h * D;
        float* sth = st + h * D;
        for (int64_t d = 0; d < D; ++d) {
          const int64_t c = sch[d] + off;
          if (c < cmin || c > cmax) { rc = KVD_STEP; goto done; }
          sth[d] = stab[c - cmin];
        }
      }
    } else if (mode == 2) {
      for (int64_t h = 0; h < H; ++h) {
        const int64_t c = (int64_t)ct[hd + h] + sc[h];
        if (c < cmin || c > cmax) { rc = KVD_STEP; goto done; }
        const float v = stab[c - cmin];
        for (int64_t d = 0; d < D; ++d) st[h * D + d] = v;
      }
    }
    /* rotating means (kvcodec.transforms.rope.rotated_means): R(p) mu */
    if (r2 > 0) rotate_mean_row(mean, H, D, pos[t], rsteps, r2, roff, rstyle, sintab, sin_bits, mu);
    /* kvn_kvc_dequant's row arithmetic (kvc.c), over the token's H * D values at once */
    dq_row_i32(ct, st, 1, mu, hd, m, rtab, rm, row);
    store_row(out, out_kind, t * hd, row, hd);
  }
done:
  free(sym);
  free(codes);
  free(srow);
  free(stab);
  return rc;
}

/* kvn_kvc_decode_batch: jobs j0 .. n-1 of kvn_kvc_decode in one call, so that a caller decoding
 * a whole file lets go of the Python lock once, not once per tensor (a 256-token chunk of a
 * small model is 60 tensors of ~0.4 ms each: threads decoding chunks side by side spent their
 * time waiting for the lock, not decoding). Job i's KVD_ARGS arguments are a[i * KVD_ARGS ..],
 * in the order of kvn_kvc_decode's parameters up to `out` (pointers and integers as int64; fmax
 * as its float32 bits in the low 32 bits). Stops at the first job that does not return KVN_OK:
 * returns its index with its status in st[0] and its *bad in st[1]; returns n when all decoded. */
#define KVD_ARGS 30
int64_t kvn_kvc_decode_batch(int64_t j0, int64_t n, const int64_t* a, int64_t* st) {
  for (int64_t j = j0; j < n; ++j) {
    const int64_t* p = a + j * KVD_ARGS;
    int64_t bad = -1;
    const int rc = kvn_kvc_decode(
        (const int64_t*)p[0], (const uint32_t*)p[1], (const uint32_t*)p[2], (const uint32_t*)p[3],
        (const int32_t*)p[4], (const int64_t*)p[5], p[6], p[7], (const uint8_t*)p[8], p[9], p[10], p[11], (int)p[12],
        (const int64_t*)p[13], (const float*)p[14], p[15], p[16], (const float*)p[17], p[18], (const float*)p[19],
        (const uint32_t*)p[20], p[21], p[22], (int)p[23], (const int64_t*)p[24], (const float*)p[25], p[26],
        bits_f32((uint32_t)p[27]),
        (int)p[28], (void*)p[29], &bad);
    if (rc != KVN_OK) {
      st[0] = rc;
      st[1] = bad;
      return j;
    }
  }
  return n;
}
