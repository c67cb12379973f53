// ans.cu -- ANS stage decode kernels: one thread per stream, fused with dequantization.
//
// ABI (cuda/README.md): one kvc::AnsParams by value; 1-D grid of 128-thread blocks, thread = stream.
//   ans_symbols[_smem]                  int32 symbols X[R, N] (no dequantization)
//   ans_kivi_{f32,f16,bf16}[_mode]      kivi-ans: dequantized [T, H, D] output (column j = token j)
//   ans_kivix_{f32,f16,bf16}[_mode]     the same with any token mapping and anchors (delta coding)
//   ans_toksym_{f32,f16,bf16}[_mode]    cachegen-lmcache: per-token symmetric dequantization
//   ans_toksymx_{f32,f16,bf16}[_mode]   cachegen: the same with any token mapping and anchors
//   ans_tokens[_blk]                    int32 symbols X[N, R] (token-major), any scope: kvc
// Where the cumulative tables (A + 1 words each) are read from:
//   NAME_blk   the block copies table set 0 (blk_words words; one table set, scope 0) into dynamic
//              shared memory once; streams index it directly (no per-stream copy)
//   NAME_smem  each thread copies its row's table into its own slot of dynamic shared memory
//              (blockDim * (A + 1) * 4 bytes) before decoding the row
//   NAME       tables are read from global memory (through L1) when neither fits
#include "ans.cuh"

enum AnsTableMode { TAB_GLOBAL = 0, TAB_THREAD = 1, TAB_BLOCK = 2 };

// TOKENS: the token-major decoder of any scope (ans_decode_stream_tokens) instead of a sink.
template <int SINK, int OUT, int GEN, int MODE, bool TOKENS = false>
__device__ __forceinline__ void ans_kernel_body(const kvc::AnsParams& p) {
  extern __shared__ uint32_t kvc_ans_smem[];
  const uint32_t* base = p.cdf;
  const uint16_t* bucket = nullptr;
  if (MODE == TAB_BLOCK) {  // one copy of table set 0 (and its bucket index) for the whole block
    const uint32_t nc = (uint32_t)p.blk_words, nb = (uint32_t)p.bucket_words;
    for (uint32_t i = threadIdx.x; i < nc; i += blockDim.x) kvc_ans_smem[i] = __ldg(p.cdf + i);
    const uint32_t* bsrc = (const uint32_t*)p.bucket;  // 4-byte aligned (a torch allocation)
    for (uint32_t i = threadIdx.x; i < nb; i += blockDim.x) kvc_ans_smem[nc + i] = __ldg(bsrc + i);
    __syncthreads();
    base = kvc_ans_smem;
    if (nb) bucket = (const uint16_t*)(kvc_ans_smem + nc);
  }
  const uint32_t s = blockIdx.x * blockDim.x + threadIdx.x;
  if (s >= (uint32_t)p.n_streams) return;
  if constexpr (TOKENS) {
    p.status[s] = kvc::ans_decode_stream_tokens(p, s, base, bucket);
  } else {
    uint32_t* tab = MODE == TAB_THREAD ? kvc_ans_smem + threadIdx.x * (uint32_t)p.cs : nullptr;
    p.status[s] = kvc::ans_decode_stream<SINK, OUT, GEN>(p, s, tab, base, bucket);
  }
}

#define KVC_ANS_KERNEL(NAME, SINK, OUT, GEN)                                                     \
  extern "C" __global__ void __launch_bounds__(128) NAME(const kvc::AnsParams p) {             \
    ans_kernel_body<SINK, OUT, GEN, TAB_GLOBAL>(p);                                             \
  }                                                                                             \
  extern "C" __global__ void __launch_bounds__(128) NAME##_smem(const kvc::AnsParams p) {      \
    ans_kernel_body<SINK, OUT, GEN, TAB_THREAD>(p);                                             \
  }                                                                                             \
  extern "C" __global__ void __launch_bounds__(128, 4) NAME##_blk(const kvc::AnsParams p) {       \
    ans_kernel_body<SINK, OUT, GEN, TAB_BLOCK>(p);                                              \
  }

// Token-major symbols of any scope, magnitude contexts included (kvc); _blk: one table set in
// shared memory (scopes 0 and 2). No _smem variant: with contexts the table changes per symbol.
extern "C" __global__ void __launch_bounds__(128, 4) ans_tokens(const kvc::AnsParams p) {
  ans_kernel_body<kvc::SINK_SYMBOLS, kvc::OUT_F32, 1, TAB_GLOBAL, true>(p);
}
extern "C" __global__ void __launch_bounds__(128, 4) ans_tokens_blk(const kvc::AnsParams p) {
  ans_kernel_body<kvc::SINK_SYMBOLS, kvc::OUT_F32, 1, TAB_BLOCK, true>(p);
}

KVC_ANS_KERNEL(ans_symbols, kvc::SINK_SYMBOLS, kvc::OUT_F32, 1)
KVC_ANS_KERNEL(ans_kivi_f32, kvc::SINK_KIVI, kvc::OUT_F32, 0)
KVC_ANS_KERNEL(ans_kivi_f16, kvc::SINK_KIVI, kvc::OUT_F16, 0)
KVC_ANS_KERNEL(ans_kivi_bf16, kvc::SINK_KIVI, kvc::OUT_BF16, 0)
KVC_ANS_KERNEL(ans_kivix_f32, kvc::SINK_KIVI, kvc::OUT_F32, 1)
KVC_ANS_KERNEL(ans_kivix_f16, kvc::SINK_KIVI, kvc::OUT_F16, 1)
KVC_ANS_KERNEL(ans_kivix_bf16, kvc::SINK_KIVI, kvc::OUT_BF16, 1)
KVC_ANS_KERNEL(ans_toksym_f32, kvc::SINK_TOKSYM, kvc::OUT_F32, 0)
KVC_ANS_KERNEL(ans_toksym_f16, kvc::SINK_TOKSYM, kvc::OUT_F16, 0)
KVC_ANS_KERNEL(ans_toksym_bf16, kvc::SINK_TOKSYM, kvc::OUT_BF16, 0)
KVC_ANS_KERNEL(ans_toksymx_f32, kvc::SINK_TOKSYM, kvc::OUT_F32, 1)
KVC_ANS_KERNEL(ans_toksymx_f16, kvc::SINK_TOKSYM, kvc::OUT_F16, 1)
KVC_ANS_KERNEL(ans_toksymx_bf16, kvc::SINK_TOKSYM, kvc::OUT_BF16, 1)
