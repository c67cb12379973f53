/* quant.c -- KIVI quantization and dequantization (kvcodec.quant.intq), CacheGen's per-token
 * quantization and its row-affine dequantization (kvcodec.codecs.cachegen).
 */
#include "kvn_common.h"

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
