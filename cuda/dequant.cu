// dequant.cu -- FP8 (E4M3FN, E5M2) and NVFP4 dequantization kernels.
//
// ABI (cuda/README.md): every kernel takes one parameter struct by value (dequant.cuh) and is
// launched on a 1-D grid of 256-thread blocks, one item per thread:
//   fp8_{e4m3,e5m2}_{f32,f16,bf16}        item = one element            (any shape)
//   fp8_{e4m3,e5m2}_{f32,f16,bf16}_v16    item = 16 elements of a row   (D % 16 == 0)
//   nvfp4_{f32,f16,bf16}                  item = one 16-element block
// The item count is the grid size times 256, rounded up; the kernels bound-check it.
#include "dequant.cuh"

#define KVC_FP8_KERNELS(FMTNAME, FMT, OUTNAME, OUT)                                          \
  extern "C" __global__ void __launch_bounds__(256)                                         \
      fp8_##FMTNAME##_##OUTNAME(const kvc::Fp8Params p, int64_t n) {                        \
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;                      \
    if (i < n) kvc::fp8_item<FMT, OUT>(p, i);                                              \
  }                                                                                         \
  extern "C" __global__ void __launch_bounds__(256)                                         \
      fp8_##FMTNAME##_##OUTNAME##_v16(const kvc::Fp8Params p, int64_t n) {                  \
    const int64_t v = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;                      \
    if (v < n) kvc::fp8_item16<FMT, OUT>(p, v);                                            \
  }

KVC_FP8_KERNELS(e4m3, kvc::FP8_E4M3, f32, kvc::OUT_F32)
KVC_FP8_KERNELS(e4m3, kvc::FP8_E4M3, f16, kvc::OUT_F16)
KVC_FP8_KERNELS(e4m3, kvc::FP8_E4M3, bf16, kvc::OUT_BF16)
KVC_FP8_KERNELS(e5m2, kvc::FP8_E5M2, f32, kvc::OUT_F32)
KVC_FP8_KERNELS(e5m2, kvc::FP8_E5M2, f16, kvc::OUT_F16)
KVC_FP8_KERNELS(e5m2, kvc::FP8_E5M2, bf16, kvc::OUT_BF16)

#define KVC_NVFP4_KERNEL(OUTNAME, OUT)                                                       \
  extern "C" __global__ void __launch_bounds__(256)                                         \
      nvfp4_##OUTNAME(const kvc::Nvfp4Params p, int64_t n) {                                \
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;                      \
    if (i < n) kvc::nvfp4_item<OUT>(p, i);                                                 \
  }

KVC_NVFP4_KERNEL(f32, kvc::OUT_F32)
KVC_NVFP4_KERNEL(f16, kvc::OUT_F16)
KVC_NVFP4_KERNEL(bf16, kvc::OUT_BF16)
