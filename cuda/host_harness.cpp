// host_harness.cpp -- runs the kernels' per-item device code on the CPU.
//
// The kernels in this folder are thin loops around __host__ __device__ functions (dequant.cuh,
// intq.cuh, ans.cuh, kvc_codec.cuh). This file compiles those same functions with the host compiler, so
// tests/test_cuda_compile.py can check them bit for bit against kvcodec's CPU reference
// decoders on a machine without a GPU:
//   g++ -std=c++17 -O2 -ffp-contract=off -shared -fPIC host_harness.cpp -o harness.so
// What it cannot check: the PTX conversions (cvt.rn.f16/bf16.f32, replaced here by software
// twins that the test also checks against torch) and the grid mapping of the kernels.
#include "dequant.cuh"
#include "intq.cuh"
#include "ans.cuh"
#include "kvc_codec.cuh"
#include <vector>

template <int B>
static void intq_vec_host(const kvc::IntqParams* p, int out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    if (out == 0) kvc::intq_item16<B, kvc::OUT_F32>(*p, (uint32_t)i);
    else if (out == 1) kvc::intq_item16<B, kvc::OUT_F16>(*p, (uint32_t)i);
    else kvc::intq_item16<B, kvc::OUT_BF16>(*p, (uint32_t)i);
  }
}

extern "C" {

// Sizes of the parameter structs, to check gpu.py's ctypes mirrors.
int64_t kvc_sizeof(int which) {
  switch (which) {
    case 0: return (int64_t)sizeof(kvc::Fp8Params);
    case 1: return (int64_t)sizeof(kvc::Nvfp4Params);
    case 2: return (int64_t)sizeof(kvc::IntqParams);
    case 3: return (int64_t)sizeof(kvc::AnsParams);
    case 4: return (int64_t)sizeof(kvc::KvcParams);
    default: return -1;
  }
}

void kvc_fp8_host(const kvc::Fp8Params* p, int fmt, int out, int vec16, int64_t n) {
#define KVC_RUN(F, O)                                                        \
  for (int64_t i = 0; i < n; ++i) {                                          \
    if (vec16) kvc::fp8_item16<F, O>(*p, i); else kvc::fp8_item<F, O>(*p, i); \
  }
  if (fmt == 0) {
    if (out == 0) { KVC_RUN(kvc::FP8_E4M3, kvc::OUT_F32) }
    else if (out == 1) { KVC_RUN(kvc::FP8_E4M3, kvc::OUT_F16) }
    else { KVC_RUN(kvc::FP8_E4M3, kvc::OUT_BF16) }
  } else {
    if (out == 0) { KVC_RUN(kvc::FP8_E5M2, kvc::OUT_F32) }
    else if (out == 1) { KVC_RUN(kvc::FP8_E5M2, kvc::OUT_F16) }
    else { KVC_RUN(kvc::FP8_E5M2, kvc::OUT_BF16) }
  }
#undef KVC_RUN
}

void kvc_nvfp4_host(const kvc::Nvfp4Params* p, int out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    if (out == 0) kvc::nvfp4_item<kvc::OUT_F32>(*p, i);
    else if (out == 1) kvc::nvfp4_item<kvc::OUT_F16>(*p, i);
    else kvc::nvfp4_item<kvc::OUT_BF16>(*p, i);
  }
}

void kvc_intq_host(const kvc::IntqParams* p, int out, int vec16, int64_t n) {
  if (!vec16) {
    for (int64_t i = 0; i < n; ++i) {
      if (out == 0) kvc::intq_item<kvc::OUT_F32>(*p, (uint32_t)i);
      else if (out == 1) kvc::intq_item<kvc::OUT_F16>(*p, (uint32_t)i);
      else kvc::intq_item<kvc::OUT_BF16>(*p, (uint32_t)i);
    }
    return;
  }
  switch (p->bits) {
    case 1: intq_vec_host<1>(p, out, n); break;
    case 2: intq_vec_host<2>(p, out, n); break;
    case 3: intq_vec_host<3>(p, out, n); break;
    case 4: intq_vec_host<4>(p, out, n); break;
    case 5: intq_vec_host<5>(p, out, n); break;
    case 6: intq_vec_host<6>(p, out, n); break;
    case 7: intq_vec_host<7>(p, out, n); break;
    default: intq_vec_host<8>(p, out, n); break;
  }
}

// Decode every stream of an ANS stage. mode 0: tables from global memory; 1: per-stream copy
// (like the _smem kernels); 2: one copy of table set 0 (like the _blk kernels).
void kvc_ans_host(const kvc::AnsParams* p, int sink, int out, int mode, int gen) {
  std::vector<uint32_t> tab((size_t)p->cs);
  std::vector<uint32_t> blk(mode == 2 ? (size_t)p->blk_words : 0);
  for (size_t i = 0; i < blk.size(); ++i) blk[i] = p->cdf[i];
  std::vector<uint16_t> bkt(mode == 2 ? (size_t)p->bucket_words * 2 : 0);
  for (size_t i = 0; i < bkt.size(); ++i) bkt[i] = p->bucket[i];
  uint32_t* t = mode == 1 ? tab.data() : nullptr;
  const uint32_t* base = mode == 2 ? blk.data() : p->cdf;
  const uint16_t* bucket = bkt.empty() ? nullptr : bkt.data();
#define KVC_ANS_RUN(SINK, GEN)                                                                     \
  (out == 0 ? kvc::ans_decode_stream<SINK, kvc::OUT_F32, GEN>(*p, s, t, base, bucket)                     \
            : out == 1 ? kvc::ans_decode_stream<SINK, kvc::OUT_F16, GEN>(*p, s, t, base, bucket)          \
                       : kvc::ans_decode_stream<SINK, kvc::OUT_BF16, GEN>(*p, s, t, base, bucket))
  for (uint32_t s = 0; s < (uint32_t)p->n_streams; ++s) {
    int32_t r;
    if (sink == kvc::SINK_SYMBOLS) r = kvc::ans_decode_stream<kvc::SINK_SYMBOLS, kvc::OUT_F32, 1>(*p, s, t, base, bucket);
    else if (sink == kvc::SINK_KIVI) r = gen ? KVC_ANS_RUN(kvc::SINK_KIVI, 1) : KVC_ANS_RUN(kvc::SINK_KIVI, 0);
    else r = gen ? KVC_ANS_RUN(kvc::SINK_TOKSYM, 1) : KVC_ANS_RUN(kvc::SINK_TOKSYM, 0);
    p->status[s] = r;
  }
#undef KVC_ANS_RUN
}

// Token-major stage decode (the ans_tokens kernels); blk: one copy of table set 0 as in _blk.
void kvc_ans_tokens_host(const kvc::AnsParams* p, int blk) {
  std::vector<uint32_t> tab(blk ? (size_t)p->blk_words : 0);
  for (size_t i = 0; i < tab.size(); ++i) tab[i] = p->cdf[i];
  std::vector<uint16_t> bkt(blk ? (size_t)p->bucket_words * 2 : 0);
  for (size_t i = 0; i < bkt.size(); ++i) bkt[i] = p->bucket[i];
  const uint32_t* base = blk ? tab.data() : p->cdf;
  const uint16_t* bucket = bkt.empty() ? nullptr : bkt.data();
  for (uint32_t s = 0; s < (uint32_t)p->n_streams; ++s)
    p->status[s] = kvc::ans_decode_stream_tokens(*p, s, base, bucket);
}

// The kvc codec's kernels: which 0 = kvc_esc_count, 1 = kvc_join, 2 = kvc_dequant (out dtype).
void kvc_kvc_host(const kvc::KvcParams* p, int which, int out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    if (which == 0) kvc::kvc_esc_count_row(*p, (uint32_t)i);
    else if (which == 1) kvc::kvc_join_row(*p, (uint32_t)i);
    else if (out == 0) kvc::kvc_dequant_item<kvc::OUT_F32>(*p, (uint32_t)i);
    else if (out == 1) kvc::kvc_dequant_item<kvc::OUT_F16>(*p, (uint32_t)i);
    else kvc::kvc_dequant_item<kvc::OUT_BF16>(*p, (uint32_t)i);
  }
}

// Element-wise conversions, for exhaustive checks against torch.
void kvc_convert_host(int which, const uint32_t* in, uint32_t* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    switch (which) {
      case 0: out[i] = kvc::f32_bits(kvc::e4m3_to_f32(in[i])); break;
      case 1: out[i] = kvc::f32_bits(kvc::e5m2_to_f32(in[i])); break;
      case 2: out[i] = kvc::f32_bits(kvc::e2m1_to_f32(in[i])); break;
      case 3: out[i] = kvc::f32_to_f16_soft(kvc::bits_f32(in[i])); break;
      case 4: out[i] = kvc::f32_to_bf16_soft(kvc::bits_f32(in[i])); break;
      case 5: out[i] = kvc::f32_bits(kvc::f16_bits_to_f32(in[i])); break;
      default: out[i] = 0; break;
    }
  }
}

}  // extern "C"
