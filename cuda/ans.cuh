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

// Largest s with cdf[s] <= q. Tables are stored padded to cs = 2^LOG + 1 entries (2^LOG >= A,
// entries past A hold 2^24, which no q reaches), so a branch-free binary search with a fixed
// number of steps (half = 2^(LOG-1), then half/2, ..., 1) finds it; since cdf[A] = 2^24 > q the
// result is at most A - 1.
KVC_HD uint32_t ans_find(const uint32_t* cdf, uint32_t half, uint32_t q) {
  uint32_t s = 0;
  for (uint32_t step = half; step > 0; step >>= 1)
    if (cdf[s + step] <= q) s += step;
  return s;
}

// One row's table: the padded cumulative frequencies, and optionally a bucket index (the
// _blk kernels): bkt[b] is the symbol containing q = b << shift, the start of bucket b, so the
// symbol of any q in that bucket is bkt[q >> shift] or a few past it -- one shared-memory read
// plus (usually) no step instead of the LOG steps of the search.
struct AnsTable {
  const uint32_t* cdf;
  const uint16_t* bkt;  // null: binary search
  uint32_t half, shift;
};

KVC_HD uint32_t ans_lookup(const AnsTable& tb, uint32_t q) {
  if (tb.bkt != nullptr) {
    uint32_t s = tb.bkt[q >> tb.shift];
    while (tb.cdf[s + 1] <= q) ++s;
    return s;
  }
  return ans_find(tb.cdf, tb.half, q);
}

KVC_HD uint32_t ans_pop(AnsStream& st, const AnsTable& tb) {
  const uint32_t q = (uint32_t)st.x & ANS_QMASK;
  const uint32_t s = ans_lookup(tb, q);
  const uint32_t c0 = tb.cdf[s];
  const uint32_t f = tb.cdf[s + 1] - c0;
  st.x = (st.x >> ANS_PREC) * f + (q - c0);
  if ((uint32_t)(st.x >> 32) == 0 && st.pos > 0) {
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
  int32_t out_is_t, base_group;        // output row: t (1) or j (0); anchor row = t / base_group
  uint8_t* aux;                        // kivi anchors: codes [n_anchors, R] (written or read)
  int32_t aux_mode;                    // 0: none; 1: write the code; 2: code = sym - code_off + anchor
  int32_t code_off, code_max;          // aux_mode 2: codes outside [0, code_max] are corrupt
  int32_t blk_words;                   // _blk kernels: words of table set 0 copied to shared memory
  int32_t cs, half;                    // padded table stride 2^LOG + 1 and 2^(LOG-1) (see ans_find)
  const uint16_t* bucket;              // _blk kernels, optional: [K, 2^bucket_bits] (see AnsTable)
  int32_t bucket_bits, bucket_words;   // 0: no bucket index; words of the index in shared memory
  // ans_tokens kernels (token-major symbols, any scope; kvc):
  int32_t* acc;                        // scope 2: int32 [n_groups, N] scratch (see ans_decode_stream_tokens)
  const int32_t* thr;                  // scope 2: the class thresholds T_1 .. T_{Q-1} (eighths)
  int32_t n_thr, center;               // scope 2: Q - 1 and the symbol of magnitude 0, (A - 1) / 2
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

// Where symbols of one row go, for successive columns j = t0, t0 + 1, ...: token, output and
// parameter indices advance incrementally, so the per-symbol work has no integer division.
struct SinkState {
  uint64_t o;        // output element index of column j
  uint32_t ao;       // aux (anchor code) index of column j: j * R + r
  uint32_t t;        // token of column j
  uint32_t cr;       // j % tdiv
  uint32_t bq, br;   // t / base_group, t % base_group (anchor row), when used
  uint32_t k;        // kivi: scale/zero index of token t
  uint32_t gr;       // kivi channel axis: t % group
  uint32_t kstep;    // kivi token axis: k step per token
  uint32_t kl;       // kivi: the k whose scale and zero are in sf, zf (~0u: none yet)
  float sf, zf;
};

KVC_HD bool sink_uses_anchor(const AnsParams& p) { return p.base != nullptr || p.aux_mode == 2; }

template <int SINK>
KVC_HD void sink_begin(const AnsParams& p, SinkState& ss, uint32_t r, uint32_t j) {
  const uint32_t R = (uint32_t)p.R;
  const uint32_t t = j * (uint32_t)p.tmul + (p.tdiv ? j / (uint32_t)p.tdiv : 0u) + (uint32_t)p.tadd;
  ss.t = t;
  ss.cr = p.tdiv ? j % (uint32_t)p.tdiv : 0u;
  ss.ao = j * R + r;
  ss.bq = 0;
  ss.br = 0;
  if (sink_uses_anchor(p)) {
    ss.bq = t / (uint32_t)p.base_group;
    ss.br = t - ss.bq * (uint32_t)p.base_group;
  }
  ss.k = 0;
  ss.gr = 0;
  ss.kstep = 0;
  ss.kl = ~0u;
  ss.sf = 0.0f;
  ss.zf = 0.0f;
  if (SINK == SINK_SYMBOLS) {
    ss.o = (uint64_t)r * (uint32_t)p.N + j;
    return;
  }
  ss.o = (uint64_t)(p.out_is_t ? t : j) * R + r;
  if (SINK == SINK_KIVI) {
    // kivi-ans: rows are the H*D channels, columns tokens
    const uint32_t group = (uint32_t)p.group;
    if (p.axis == 0) {  // "channel": params [ceil(T/g), H, D]; token t uses row t / g
      ss.k = (t / group) * R + r;
      ss.gr = t % group;
    } else {            // "token": params [T, H, ceil(D/g)]; channel d uses column d / g
      const uint32_t dim = (uint32_t)p.dim;
      const uint32_t h = r / dim, d = r - h * dim;
      const uint32_t ng = (dim + group - 1) / group;
      ss.kstep = (uint32_t)p.heads * ng;
      ss.k = t * ss.kstep + h * ng + d / group;
    }
  }
}

template <int SINK>
KVC_HD void sink_advance(const AnsParams& p, SinkState& ss) {
  const uint32_t R = (uint32_t)p.R;
  if (SINK == SINK_SYMBOLS) {
    ss.o += 1;
    return;
  }
  uint32_t inc = (uint32_t)p.tmul;
  if (p.tdiv && ++ss.cr == (uint32_t)p.tdiv) {
    ss.cr = 0;
    inc += 1;
  }
  ss.t += inc;
  ss.ao += R;
  ss.o += (uint64_t)(p.out_is_t ? inc : 1u) * R;
  if (sink_uses_anchor(p)) {
    ss.br += inc;
    while (ss.br >= (uint32_t)p.base_group) {
      ss.br -= (uint32_t)p.base_group;
      ss.bq += 1;
    }
  }
  if (SINK == SINK_KIVI) {
    if (p.axis == 0) {
      ss.gr += inc;
      while (ss.gr >= (uint32_t)p.group) {
        ss.gr -= (uint32_t)p.group;
        ss.k += R;
      }
    } else {
      ss.k += inc * ss.kstep;
    }
  }
}

// Consume one symbol; false if it decodes to an impossible code (corrupt stream).
template <int SINK, int OUT>
KVC_HD bool sink_put(const AnsParams& p, SinkState& ss, uint32_t r, uint32_t sym) {
  const uint32_t R = (uint32_t)p.R;
  bool ok = true;
  if (SINK == SINK_SYMBOLS) {
    ((int32_t*)p.out)[ss.o] = (int32_t)sym;
  } else if (SINK == SINK_KIVI) {
    int32_t code = (int32_t)sym;
    if (p.aux_mode == 2) {  // delta coded: code = difference - offset + the group's anchor code
      code = code - p.code_off + (int32_t)p.aux[(uint64_t)ss.bq * R + r];
      ok = code >= 0 && code <= p.code_max;
    } else if (p.aux_mode == 1) {
      p.aux[ss.ao] = (uint8_t)code;
    }
    if (ss.k != ss.kl) {  // K (channel axis) keeps one scale/zero for `group` tokens
      ss.sf = ans_half(load2(p.scale + ss.k));
      ss.zf = ans_half(load2(p.zero + ss.k));
      ss.kl = ss.k;
    }
    const float v = add_rn(mul_rn((float)code, ss.sf), ss.zf);
    store_out<OUT>(p.out, ss.o, clamp_out_ans<OUT>(v));
  } else {  // SINK_TOKSYM: value = (code - mid) * scale[t] (+ the anchor's value)
    float v = mul_rn((float)((int32_t)sym - p.mid), ans_half(load2(p.scale + ss.t)));
    if (p.base != nullptr) v = add_rn(loadf(p.base + (uint64_t)ss.bq * R + r), v);
    store_out<OUT>(p.out, ss.o, clamp_out_ans<OUT>(v));  // saturate, as the CPU decoders (SPEC.md §11.1)
  }
  sink_advance<SINK>(p, ss);
  return ok;
}

// ---------------------------------------------------------------------------- fast rows
// The common cases get their own loops (a row of one stream, columns j = t0 .. t1-1 are tokens):
// kivi-ans without delta and cachegen-lmcache. Output and parameter pointers just advance.
template <int OUT>
struct OutWord {
  typedef uint16_t type;
};
template <>
struct OutWord<OUT_F32> {
  typedef float type;
};

template <int OUT>
KVC_HD void put_out(typename OutWord<OUT>::type* o, float v) {
  if constexpr (OUT == OUT_F32) *o = v;
  else if constexpr (OUT == OUT_F16) *o = f32_to_f16(v);
  else *o = f32_to_bf16(v);
}

template <int OUT, bool CHANNEL>
KVC_HD void kivi_row_fast(const AnsParams& p, AnsStream& st, const AnsTable& tb, uint32_t r, uint32_t t0, uint32_t t1) {
  const uint32_t R = (uint32_t)p.R, group = (uint32_t)p.group;
  typename OutWord<OUT>::type* o = (typename OutWord<OUT>::type*)p.out + ((uint64_t)t0 * R + r);
  uint32_t k, gr = 0, kstep = 0;
  if (CHANNEL) {  // params [ceil(T/g), H, D]: token t uses row t / g
    k = (t0 / group) * R + r;
    gr = t0 % group;
  } else {        // params [T, H, ceil(D/g)]: channel d uses column d / g
    const uint32_t dim = (uint32_t)p.dim;
    const uint32_t h = r / dim, d = r - h * dim;
    const uint32_t ng = (dim + group - 1) / group;
    kstep = (uint32_t)p.heads * ng;
    k = t0 * kstep + h * ng + d / group;
  }
  float sf = 0.0f, zf = 0.0f;
  if (t0 < t1) {
    sf = ans_half(load2(p.scale + k));
    zf = ans_half(load2(p.zero + k));
  }
  for (uint32_t j = t0; j < t1; ++j) {
    const uint32_t sym = ans_pop(st, tb);
    put_out<OUT>(o, clamp_out_ans<OUT>(add_rn(mul_rn((float)sym, sf), zf)));
    o += R;
    bool reload;
    if (CHANNEL) {
      reload = ++gr == group;
      if (reload) {
        gr = 0;
        k += R;
      }
    } else {
      k += kstep;
      reload = true;
    }
    if (reload && j + 1 < t1) {
      sf = ans_half(load2(p.scale + k));
      zf = ans_half(load2(p.zero + k));
    }
  }
}

template <int OUT>
KVC_HD bool toksym_row_fast(const AnsParams& p, AnsStream& st, const AnsTable& tb, uint32_t r, uint32_t t0, uint32_t t1) {
  const uint32_t R = (uint32_t)p.R;
  const uint32_t max_code = (uint32_t)p.max_code;
  typename OutWord<OUT>::type* o = (typename OutWord<OUT>::type*)p.out + ((uint64_t)t0 * R + r);
  const uint16_t* sp = p.scale + t0;
  bool ok = true;
  for (uint32_t j = t0; j < t1; ++j) {
    const uint32_t sym = ans_pop(st, tb);
    ok = ok && sym <= max_code;
    put_out<OUT>(o, clamp_out_ans<OUT>(mul_rn((float)((int32_t)sym - p.mid), ans_half(load2(sp)))));
    o += R;
    ++sp;
  }
  return ok;
}

// Decode stream s completely. Tables are read from `cdf_base` (p.cdf in global memory, or the
// block's shared copy of table set 0); `tab`, if not null, is per-thread scratch (A + 1 words of
// shared memory) into which each row's table is copied first.
// GEN = 0 takes the fast row loops for SINK_KIVI / SINK_TOKSYM (token of column j is j, no
// anchors); GEN = 1 the general sink (anchors, deltas, any token mapping).
template <int SINK, int OUT, int GEN>
KVC_HD int32_t ans_decode_stream(const AnsParams& p, uint32_t s, uint32_t* tab, const uint32_t* cdf_base,
                                 const uint16_t* bucket_base) {
  const uint32_t ng = (uint32_t)p.n_groups;
  const uint32_t c = s / ng, g = s - c * ng;
  const uint32_t G = (uint32_t)p.G, C = (uint32_t)p.C;
  const uint32_t r0 = g * G, r1 = r0 + G < (uint32_t)p.R ? r0 + G : (uint32_t)p.R;
  const uint32_t t0 = c * C, t1 = t0 + C < (uint32_t)p.N ? t0 + C : (uint32_t)p.N;
  const uint32_t set = p.scope ? c : 0u;
  const uint32_t cs = (uint32_t)p.cs, half = (uint32_t)p.half;
  const uint32_t w0 = load4(p.offsets + s), w1 = load4(p.offsets + s + 1);
  AnsStream st;
  if (!ans_init(st, p.words + w0, w1 - w0)) return ANS_ZERO_WORD;
  int32_t bad = 0;
  for (uint32_t r = r0; r < r1; ++r) {
    const uint32_t ti = (uint32_t)p.table_of[set * (uint32_t)p.R + r];
    const uint32_t* src = cdf_base + (uint64_t)ti * cs;
    const uint32_t* cdf = src;
    if (tab != nullptr) {
      for (uint32_t k = 0; k < cs; ++k) tab[k] = load4(src + k);
      cdf = tab;
    }
    AnsTable tb;
    tb.cdf = cdf;
    tb.half = half;
    tb.shift = ANS_PREC - (uint32_t)p.bucket_bits;
    tb.bkt = bucket_base != nullptr ? bucket_base + ((uint64_t)ti << p.bucket_bits) : nullptr;
    if constexpr (SINK == SINK_KIVI && GEN == 0) {
      if (p.axis == 0) kivi_row_fast<OUT, true>(p, st, tb, r, t0, t1);
      else kivi_row_fast<OUT, false>(p, st, tb, r, t0, t1);
      continue;
    }
    if constexpr (SINK == SINK_TOKSYM && GEN == 0) {
      if (!toksym_row_fast<OUT>(p, st, tb, r, t0, t1)) bad = ANS_BAD_SYMBOL;
      continue;
    }
    SinkState ss;
    sink_begin<SINK>(p, ss, r, t0);
    for (uint32_t j = t0; j < t1; ++j) {
      const uint32_t sym = ans_pop(st, tb);
      if (sym > (uint32_t)p.max_code) bad = ANS_BAD_SYMBOL;
      if (!sink_put<SINK, OUT>(p, ss, r, sym)) bad = ANS_BAD_SYMBOL;
    }
  }
  if (bad) return bad;
  return ans_done(st) ? ANS_OK : ANS_NOT_CONSUMED;
}

// ---------------------------------------------------------------------------- token-major
// Decode stream s into token-major int32 symbols out[j * R + r] (the codecs' [N, R] order; kvc).
// Scopes 0 and 1 as above; scope 2 (magnitude contexts, formats/ANS.md §3.1): row k = r - r0 > 0
// of the stream takes table table_of[q * R + r] (table_of is [Q, R]) with class
//   q = #{ i : 8 * a >= T_i * k },  a = sum over the stream's rows above r of |X[., j] - center|
// kept per token in acc[g * N + j] (row 0 writes it, later rows add to it): exactly the
// integers of kvcodec.entropy.stage.magnitude_classes. The thresholds increase, so the count
// stops at the first one not reached.
KVC_HD int32_t ans_decode_stream_tokens(const AnsParams& p, uint32_t s, const uint32_t* cdf_base,
                                        const uint16_t* bucket_base) {
  const uint32_t ng = (uint32_t)p.n_groups;
  const uint32_t c = s / ng, g = s - c * ng;
  const uint32_t G = (uint32_t)p.G, C = (uint32_t)p.C, R = (uint32_t)p.R;
  const uint32_t r0 = g * G, r1 = r0 + G < R ? r0 + G : R;
  const uint32_t t0 = c * C, t1 = t0 + C < (uint32_t)p.N ? t0 + C : (uint32_t)p.N;
  const bool ctx = p.scope == 2;
  const uint32_t set = p.scope == 1 ? c : 0u;
  const uint32_t cs = (uint32_t)p.cs;
  const uint32_t w0 = load4(p.offsets + s), w1 = load4(p.offsets + s + 1);
  AnsStream st;
  if (!ans_init(st, p.words + w0, w1 - w0)) return ANS_ZERO_WORD;
  AnsTable tb;
  tb.half = (uint32_t)p.half;
  tb.shift = ANS_PREC - (uint32_t)p.bucket_bits;
  int32_t* out = (int32_t*)p.out;
  int32_t* acc = ctx ? p.acc + (uint64_t)g * (uint32_t)p.N : nullptr;
  const int32_t center = p.center;
  const uint32_t nthr = ctx ? (uint32_t)p.n_thr : 0u;
  for (uint32_t r = r0; r < r1; ++r) {
    const uint32_t k = r - r0;
    int32_t* o = out + ((uint64_t)t0 * R + r);
    if (!ctx || k == 0) {  // one table for the row's segment
      const uint32_t ti = (uint32_t)p.table_of[set * R + r];
      tb.cdf = cdf_base + (uint64_t)ti * cs;
      tb.bkt = bucket_base != nullptr ? bucket_base + ((uint64_t)ti << p.bucket_bits) : nullptr;
      for (uint32_t j = t0; j < t1; ++j) {
        const int32_t sym = (int32_t)ans_pop(st, tb);
        *o = sym;
        o += R;
        if (ctx) acc[j] = sym >= center ? sym - center : center - sym;
      }
      continue;
    }
    for (uint32_t j = t0; j < t1; ++j) {
      const uint64_t a8 = 8u * (uint64_t)(uint32_t)acc[j];
      uint32_t q = 0;
      while (q < nthr && a8 >= (uint64_t)(uint32_t)p.thr[q] * k) ++q;
      const uint32_t ti = (uint32_t)p.table_of[q * R + r];
      tb.cdf = cdf_base + (uint64_t)ti * cs;
      tb.bkt = bucket_base != nullptr ? bucket_base + ((uint64_t)ti << p.bucket_bits) : nullptr;
      const int32_t sym = (int32_t)ans_pop(st, tb);
      *o = sym;
      o += R;
      acc[j] += sym >= center ? sym - center : center - sym;
    }
  }
  return ans_done(st) ? ANS_OK : ANS_NOT_CONSUMED;
}

}  // namespace kvc
