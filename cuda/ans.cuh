// ans.cuh -- decoding of ANS entropy stages (formats/ANS.md), one thread per stream, fused with
// the dequantization of the codec that produced the symbols. Shared by the kernels (ans.cu) and
// the host harness, so the exact per-stream loop that runs on the GPU is checked bit for bit
// against kvcodec/entropy/ans_ref.py and the codecs' CPU decoders on a machine without a GPU.
//
// Stream (ANS.md §2): 64-bit state x, 32-bit words popped from the END of the stream's word
// array; precision 24 (tables of precision P are stored scaled: C[s] = sum f << (24 - P)).
//   init:   x = w[W-1] (must not be 0), then x = x << 32 | w[W-2] while words remain and x < 2^32
//   symbol: q = x & (2^24-1); s with C[s] <= q < C[s+1]; x = (x >> 24) * F[s] + q - C[s];
//           if x < 2^32 and words remain: x = x << 32 | next word
//   end:    every word read and x == 0, else the stream is corrupt.
// Stage (ANS.md §3): symbol matrix X[R, N]; stream s = c * n_groups + g holds rows
// [g*G, min(R, g*G+G)) over tokens [c*C, min(N, c*C+C)), row after row; row r of table set
// `set` (0, or c when scope == 1) uses cumulative table cdf[table_of[set * R + r]].
#pragma once
#include "kvc_common.cuh"
#include "kvc_vec.cuh"

namespace kvc {

constexpr uint32_t ANS_PREC = 24;
constexpr uint32_t ANS_QMASK = (1u << ANS_PREC) - 1u;

// Per-stream status codes (written to AnsParams::status; gpu.py turns them into errors).
enum AnsStatus { ANS_OK = 0, ANS_ZERO_WORD = 1, ANS_NOT_CONSUMED = 2, ANS_BAD_SYMBOL = 3 };

struct AnsStream {
  const uint32_t* w;
  uint32_t pos;    // words not yet read: w[0 .. pos)
  uint32_t next;   // w[pos - 1], loaded one refill ahead (hides the load latency); 0 if pos == 0
  uint64_t x;
};

KVC_HD bool ans_init(AnsStream& st, const uint32_t* w, uint32_t n) {
  st.w = w;
  st.pos = n;
  st.x = 0;
  if (st.pos > 0) {
    st.x = load4(w + st.pos - 1);
    st.pos -= 1;
    if (st.x == 0) return false;
    if (st.pos > 0) {  // x < 2^32 always holds for a single word
      st.x = (st.x << 32) | load4(w + st.pos - 1);
      st.pos -= 1;
    }
  }
  st.next = st.pos > 0 ? load4(w + st.pos - 1) : 0u;
  return true;
}

// Largest s with cdf[s] <= q, for cdf[0] = 0 <= q < cdf[A] = 2^24 (binary search).
KVC_HD uint32_t ans_find(const uint32_t* cdf, uint32_t a, uint32_t q) {
  uint32_t lo = 0, hi = a;
  while (hi - lo > 1) {
    const uint32_t mid = (lo + hi) >> 1;
    if (cdf[mid] <= q) lo = mid; else hi = mid;
  }
  return lo;
}

// Pop one symbol with cumulative table cdf[0..a] (a = alphabet size).
KVC_HD uint32_t ans_pop(AnsStream& st, const uint32_t* cdf, uint32_t a) {
  const uint32_t q = (uint32_t)st.x & ANS_QMASK;
  const uint32_t s = ans_find(cdf, a, q);
  const uint32_t c0 = cdf[s];
  const uint32_t f = cdf[s + 1] - c0;
  st.x = (st.x >> ANS_PREC) * f + (q - c0);
  if ((st.x >> 32) == 0 && st.pos > 0) {
    st.x = (st.x << 32) | st.next;
    st.pos -= 1;
    st.next = st.pos > 0 ? load4(st.w + st.pos - 1) : 0u;
  }
  return s;
}

KVC_HD bool ans_done(const AnsStream& st) { return st.pos == 0 && st.x == 0; }

// ---------------------------------------------------------------------------- sinks
// What happens to symbol X[r, j] (row r, column j of the stage):
enum AnsSink {
  SINK_SYMBOLS = 0,  // int32 out[r * N + j] = symbol (no dequantization)
  SINK_KIVI = 1,     // kivi / kivi-ans: out[t, r] = fp32(code) * scale + zero (fp16 params)
  SINK_TOKSYM = 2,   // cachegen: out[row, r] = fp32(code - mid) * scale[t] (+ base[t / base_group, r])
};

struct AnsParams {
  const uint32_t* words;     // [W]
  const uint32_t* offsets;   // [S + 1]
  const uint32_t* cdf;       // [tables, A + 1] cumulative frequencies at precision 24
  const int32_t* table_of;   // [n_sets, R] -> table index into cdf
  int32_t* status;           // [S]
  void* out;
  const uint16_t* scale;     // fp16 bits (kivi: per group; cachegen: per token)
  const uint16_t* zero;      // fp16 bits (kivi)
  const float* base;         // cachegen deltas: decoded anchors [n_anchors, R] (fp32), or null
  int32_t R, N, C, G, A, n_groups, n_streams, scope;
  int32_t heads, dim, group, axis;     // kivi: tensor geometry and quantization groups
  int32_t mid, max_code;               // symbols > max_code are corrupt (status 3)
  int32_t tmul, tdiv, tadd;            // token of column j: t = j * tmul + (tdiv ? j / tdiv : 0) + tadd
  int32_t out_is_t, base_group;        // output row: t (1) or j (0); base row = t / base_group
};

template <int OUT>
KVC_HD float clamp_out_ans(float v) {
  if (OUT == OUT_F32) return v;
  const float fmax = OUT == OUT_F16 ? 65504.0f : bits_f32(0x7F7F0000u);
  return v > fmax ? fmax : (v < -fmax ? -fmax : v);
}

KVC_HD float ans_half(uint16_t h) {
#if defined(__CUDA_ARCH__)
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
#else
  return f16_bits_to_f32(h);
#endif
}

template <int SINK, int OUT>
KVC_HD void ans_sink(const AnsParams& p, uint32_t r, uint32_t j, uint32_t sym) {
  if (SINK == SINK_SYMBOLS) {
    ((int32_t*)p.out)[(uint64_t)r * (uint32_t)p.N + j] = (int32_t)sym;
  } else if (SINK == SINK_KIVI) {
    // kivi-ans: rows are the H*D channels, columns the tokens (j == t)
    const uint32_t R = (uint32_t)p.R, dim = (uint32_t)p.dim, group = (uint32_t)p.group;
    uint32_t k;
    if (p.axis == 0) {  // "channel": params [ceil(T/g), H, D], row t / g
      k = (j / group) * R + r;
    } else {            // "token": params [T, H, ceil(D/g)]
      const uint32_t h = r / dim, d = r - h * dim;
      const uint32_t ng = (dim + group - 1) / group;
      k = (j * (uint32_t)p.heads + h) * ng + d / group;
    }
    const float v = add_rn(mul_rn((float)sym, ans_half(load2(p.scale + k))), ans_half(load2(p.zero + k)));
    store_out<OUT>(p.out, (uint64_t)j * R + r, clamp_out_ans<OUT>(v));
  } else {  // SINK_TOKSYM
    const uint32_t t = j * (uint32_t)p.tmul + (p.tdiv ? j / (uint32_t)p.tdiv : 0u) + (uint32_t)p.tadd;
    float v = mul_rn((float)((int32_t)sym - p.mid), ans_half(load2(p.scale + t)));
    if (p.base != nullptr) v = add_rn(loadf(p.base + (uint64_t)(t / (uint32_t)p.base_group) * (uint32_t)p.R + r), v);
    const uint32_t row = p.out_is_t ? t : j;
    store_out<OUT>(p.out, (uint64_t)row * (uint32_t)p.R + r, v);
  }
}

// Decode stream s completely. `tab` is scratch for one table (A + 1 words; shared memory on the
// device when it fits, else null and the table is read from global memory through L1).
template <int SINK, int OUT>
KVC_HD int32_t ans_decode_stream(const AnsParams& p, uint32_t s, uint32_t* tab) {
  const uint32_t ng = (uint32_t)p.n_groups;
  const uint32_t c = s / ng, g = s - c * ng;
  const uint32_t G = (uint32_t)p.G, C = (uint32_t)p.C;
  const uint32_t r0 = g * G, r1 = r0 + G < (uint32_t)p.R ? r0 + G : (uint32_t)p.R;
  const uint32_t t0 = c * C, t1 = t0 + C < (uint32_t)p.N ? t0 + C : (uint32_t)p.N;
  const uint32_t set = p.scope ? c : 0u;
  const uint32_t a = (uint32_t)p.A;
  const uint32_t w0 = load4(p.offsets + s), w1 = load4(p.offsets + s + 1);
  AnsStream st;
  if (!ans_init(st, p.words + w0, w1 - w0)) return ANS_ZERO_WORD;
  int32_t bad = 0;
  for (uint32_t r = r0; r < r1; ++r) {
    const uint32_t ti = (uint32_t)p.table_of[set * (uint32_t)p.R + r];
    const uint32_t* src = p.cdf + (uint64_t)ti * (a + 1);
    const uint32_t* cdf = src;
    if (tab != nullptr) {
      for (uint32_t k = 0; k <= a; ++k) tab[k] = load4(src + k);
      cdf = tab;
    }
    for (uint32_t j = t0; j < t1; ++j) {
      const uint32_t sym = ans_pop(st, cdf, a);
      if (sym > (uint32_t)p.max_code) bad = ANS_BAD_SYMBOL;
      ans_sink<SINK, OUT>(p, r, j, sym);
    }
  }
  if (bad) return bad;
  return ans_done(st) ? ANS_OK : ANS_NOT_CONSUMED;
}

}  // namespace kvc
