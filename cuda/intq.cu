// intq.cu -- KIVI-style integer dequantization kernels (bit unpacking fused with the decode).
//
// ABI (cuda/README.md): one kvc::IntqParams by value plus the item count; 256-thread blocks.
//   intq_{f32,f16,bf16}              item = one element (any D, any bit width)
//   intq_b{1..8}_{f32,f16,bf16}_v16  item = 16 elements of a row (D % 16 == 0)
#include "intq.cuh"

#define KVC_INTQ_SCALAR(OUTNAME, OUT)                                                        \
  extern "C" __global__ void __launch_bounds__(256)                                         \
      intq_##OUTNAME(const kvc::IntqParams p, int64_t n) {                                  \
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;                      \
    if (i < n) kvc::intq_item<OUT>(p, i);                                                  \
  }

#define KVC_INTQ_VEC(B, OUTNAME, OUT)                                                        \
  extern "C" __global__ void __launch_bounds__(256)                                         \
      intq_b##B##_##OUTNAME##_v16(const kvc::IntqParams p, int64_t n) {                     \
    const int64_t v = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;                      \
    if (v < n) kvc::intq_item16<B, OUT>(p, v);                                             \
  }

#define KVC_INTQ_ALL_OUT(B)                  \
  KVC_INTQ_VEC(B, f32, kvc::OUT_F32)         \
  KVC_INTQ_VEC(B, f16, kvc::OUT_F16)         \
  KVC_INTQ_VEC(B, bf16, kvc::OUT_BF16)

KVC_INTQ_SCALAR(f32, kvc::OUT_F32)
KVC_INTQ_SCALAR(f16, kvc::OUT_F16)
KVC_INTQ_SCALAR(bf16, kvc::OUT_BF16)
KVC_INTQ_ALL_OUT(1)
KVC_INTQ_ALL_OUT(2)
KVC_INTQ_ALL_OUT(3)
KVC_INTQ_ALL_OUT(4)
KVC_INTQ_ALL_OUT(5)
KVC_INTQ_ALL_OUT(6)
KVC_INTQ_ALL_OUT(7)
KVC_INTQ_ALL_OUT(8)
