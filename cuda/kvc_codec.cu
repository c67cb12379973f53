// kvc_codec.cu -- the kvc codec's decode after its entropy stage (kvc_codec.cuh).
//
// ABI (cuda/README.md): one kvc::KvcParams by value plus the item count; 256-thread blocks.
//   kvc_esc_count               item = a row of the [n, R] symbol matrix
//   kvc_join                    item = a row (escape join and token-delta sums, in place)
//   kvc_dequant_{f32,f16,bf16}  item = an element of the coded tokens [n, H, D]
#include "kvc_codec.cuh"

extern "C" __global__ void __launch_bounds__(256) kvc_esc_count(const kvc::KvcParams p, int64_t n) {
  const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) kvc::kvc_esc_count_row(p, (uint32_t)i);
}

extern "C" __global__ void __launch_bounds__(256) kvc_join(const kvc::KvcParams p, int64_t n) {
  const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) kvc::kvc_join_row(p, (uint32_t)i);
}

#define KVC_DEQUANT(OUTNAME, OUT)                                                          \
  extern "C" __global__ void __launch_bounds__(256)                                       \
      kvc_dequant_##OUTNAME(const kvc::KvcParams p, int64_t n) {                          \
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;                    \
    if (i < n) kvc::kvc_dequant_item<OUT>(p, (uint32_t)i);                               \
  }

KVC_DEQUANT(f32, kvc::OUT_F32)
KVC_DEQUANT(f16, kvc::OUT_F16)
KVC_DEQUANT(bf16, kvc::OUT_BF16)
