// kvc_codec.cuh -- the kvc codec's decode after its entropy stage (kvcodec/codecs/kvc.py, the
// module docstring's "Decode arithmetic"), shared by the kernels (kvc_codec.cu) and the host
// harness.
//
// Input: the stage's token-major int32 symbols X[n, R] (ans_tokens kernels), R = H*D code rows
// plus, for k_tok and token-mode tensors, H step-code rows.
//   1. kvc_esc_count   (thread = row)    escapes per row: symbols equal to 2L - 1
//   2. kvc_join        (thread = row)    symbols -> codes in place: s - (L - 1), or the row's next
//                                        escaped code (the esc plane is in row-major order of the
//                                        [R, n] matrix, so row r starts at the exclusive prefix
//                                        sum esc_base[r]); rows marked in `pred` then become
//                                        running sums over tokens (64-bit, as the reference)
//   3. kvc_dequant_OUT (thread = element of [n, H, D])
//        step = step_ch[c] | step_tab[sc[c] + X[t, HD + h]] | step_tab[base[h] + X[t, HD + h]]
//        v    = recon[code] for 1 <= |code| <= n_recon, else float(code)  (exact values)
//        z    = v * step                       (fp32, one rounding)
//        raw: z as fp32 (Hadamard files: gpu.py applies the inverse transform and the rest)
//        else out[tok[t], h, c] = cast(clamp(z + mean[c], +-max of OUT))   (RNE cast)
// Failures set *status (any non-zero value; gpu.py turns it into the reference's error).
#pragma once
#include "kvc_common.cuh"
#include "kvc_vec.cuh"

namespace kvc {

enum KvcStatus {
  KVC_OK = 0,
  KVC_ESC_COUNT = 1,   // escape symbols and the esc plane disagree in number
  KVC_ESC_RANGE = 2,   // an escaped code lies inside the regular range (|c| < L)
  KVC_CODE_WIDE = 3,   // a code (after the token-delta sums) does not fit in int32
  KVC_STEP_RANGE = 4,  // a step code outside [STEP_CODE_MIN, STEP_CODE_MAX]
};

constexpr int32_t KVC_STEP_MIN = -320, KVC_STEP_MAX = 320;  // kvcodec.quant.deadzone

enum KvcStepMode { STEP_CHANNEL = 0, STEP_KTOK = 1, STEP_TOKEN = 2 };

struct KvcParams {
  int32_t* codes;            // [n, R] token-major: symbols in, codes out (kvc_join)
  const int32_t* esc;        // [n_esc] escaped codes
  int32_t* esc_count;        // [R] kvc_esc_count's output
  const int32_t* esc_base;   // [R] exclusive prefix sums of esc_count
  const uint8_t* pred;       // [R] 1: the row is coded as token deltas; null: none
  const float* step_ch;      // STEP_CHANNEL: [H*D] steps
  const int32_t* sc;         // STEP_KTOK: [H*D] channel step codes; STEP_TOKEN: [H] step_base
  const float* step_tab;     // [KVC_STEP_MAX - KVC_STEP_MIN + 1] steps of the log-step codes
  const float* mean;         // [H*D]
  const float* recon;        // [2 * n_recon + 1] values of the codes -n_recon .. n_recon, or null
  const int32_t* tok;        // [n] output token of coded token t
  void* out;                 // [T, H, D] of OUT, or fp32 [n, H, D] when raw
  int32_t* status;           // [1]
  int32_t n, R, H, D, L, n_esc, n_recon, step_mode, raw, pad_;
};

KVC_HD void kvc_fail(const KvcParams& p, int32_t code) { *p.status = code; }

KVC_HD void kvc_esc_count_row(const KvcParams& p, uint32_t r) {
  const uint32_t R = (uint32_t)p.R, n = (uint32_t)p.n;
  const int32_t esc_sym = 2 * p.L - 1;
  const int32_t* x = p.codes + r;
  int32_t cnt = 0;
  for (uint32_t t = 0; t < n; ++t, x += R) cnt += *x == esc_sym;
  p.esc_count[r] = cnt;
}

KVC_HD void kvc_join_row(const KvcParams& p, uint32_t r) {
  const uint32_t R = (uint32_t)p.R, n = (uint32_t)p.n;
  const int32_t L = p.L, esc_sym = 2 * L - 1;
  const bool delta = p.pred != nullptr && p.pred[r] != 0;
  uint32_t e = (uint32_t)p.esc_base[r];
  const uint32_t n_esc = (uint32_t)p.n_esc;
  int64_t run = 0;
  int32_t* x = p.codes + r;
  for (uint32_t t = 0; t < n; ++t, x += R) {
    const int32_t s = *x;
    int64_t c;
    if (s == esc_sym) {
      if (e < n_esc) {
        c = p.esc[e];
        if (c > -L && c < L) kvc_fail(p, KVC_ESC_RANGE);
      } else {
        c = 0;
        kvc_fail(p, KVC_ESC_COUNT);
      }
      ++e;
    } else {
      c = (int64_t)(s - (L - 1));
    }
    if (delta) {
      run += c;
      c = run;
    }
    if (c < -2147483647LL - 1 || c > 2147483647LL) {
      kvc_fail(p, KVC_CODE_WIDE);
      c = 0;
    }
    *x = (int32_t)c;
  }
  if (r + 1 == R && e != n_esc) kvc_fail(p, KVC_ESC_COUNT);  // the last row ends at the total
}

template <int OUT>
KVC_HD float kvc_clamp(float v) {
  const float fmax = OUT == OUT_F16 ? 65504.0f : bits_f32(OUT == OUT_F32 ? 0x7F7FFFFFu : 0x7F7F0000u);
  return v > fmax ? fmax : (v < -fmax ? -fmax : v);
}

template <int OUT>
KVC_HD void kvc_dequant_item(const KvcParams& p, uint32_t i) {
  const uint32_t H = (uint32_t)p.H, D = (uint32_t)p.D, HD = H * D, R = (uint32_t)p.R;
  const uint32_t t = i / HD, rem = i - t * HD;
  const int32_t* row = p.codes + (uint64_t)t * R;
  const int32_t code = row[rem];
  float step;
  if (p.step_mode == STEP_CHANNEL) {
    step = loadf(p.step_ch + rem);
  } else {
    const uint32_t h = rem / D;
    const int64_t sc = (int64_t)(p.step_mode == STEP_KTOK ? p.sc[rem] : p.sc[h]) + row[HD + h];
    if (sc < KVC_STEP_MIN || sc > KVC_STEP_MAX) {
      kvc_fail(p, KVC_STEP_RANGE);
      step = 0.0f;
    } else {
      step = loadf(p.step_tab + (sc - KVC_STEP_MIN));
    }
  }
  const int32_t m = p.n_recon;
  const float v = (m > 0 && code >= -m && code <= m) ? loadf(p.recon + (code + m)) : (float)code;
  const float z = mul_rn(v, step);
  if (p.raw) {
    ((float*)p.out)[i] = z;
    return;
  }
  const float x = kvc_clamp<OUT>(add_rn(z, loadf(p.mean + rem)));
  store_out<OUT>(p.out, (uint64_t)(uint32_t)p.tok[t] * HD + rem, x);
}

}  // namespace kvc
