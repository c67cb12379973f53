// dequant.cuh -- per-item FP8 and NVFP4 dequantization, shared by the kernels (dequant.cu) and
// the host harness (host/harness.cpp) that checks them bit for bit against the CPU reference.
//
// Layouts (formats/SPEC.md, kvcodec/quant/):
//   FP8:   codes uint8 [rows = T*H, D]; scale fp32 broadcast onto [T, H, D]; value = f32(code) * s
//   NVFP4: codes uint8 [rows, Dp/2] (low nibble = even index), block_scale uint8 E4M3
//          [rows, Dp/16], tensor_scale fp32 [1]; value = (e2m1 * f32(block_scale)) * tensor_scale,
//          each product rounded in fp32; the first D of the Dp (padded) columns are kept.
// Every value is rounded to the output dtype once, at the end (round to nearest even).
#pragma once
#include "kvc_common.cuh"
#include "kvc_vec.cuh"

namespace kvc {

enum Fp8Format { FP8_E4M3 = 0, FP8_E5M2 = 1 };

// Kernel parameters, passed by value; gpu.py mirrors this layout with ctypes.Structure.
struct Fp8Params {
  const uint8_t* codes;  // [rows, D]
  const float* scale;    // broadcast scale, indexed as below
  void* out;             // [rows, D] in the output dtype
  int64_t rows;          // T * H
  int64_t s_t, s_h, s_d; // scale strides (elements); 0 on broadcast axes
  int32_t heads, dim;    // H, D
  int32_t t_blk, h_blk, d_blk;  // scale coordinate along an axis = coordinate / blk
  int32_t scale_const16;        // 1 if the scale is constant over each aligned run of 16 along D
};

template <int FMT>
KVC_HD float fp8_to_f32(uint32_t b) {
  return FMT == FP8_E4M3 ? e4m3_to_f32(b) : e5m2_to_f32(b);
}

#if defined(__CUDA_ARCH__)
KVC_HD float f16_to_f32_ptx(uint32_t h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"((uint16_t)h));
  return f;
}
#endif

// The 16 FP8 codes of a 16-byte vector as exact fp32 values. On the device the conversion goes
// through fp16, which holds every E4M3 and E5M2 value exactly: E5M2 is the top byte of an fp16,
// and sm_89+ converts two E4M3 codes with one instruction (cvt.rn.f16x2.e4m3x2, low byte -> low
// half); both are exact, so the result equals the integer decode used elsewhere.
template <int FMT>
KVC_HD void fp8x16_to_f32(const U32x4& c, float (&v)[16]) {
#if defined(__CUDA_ARCH__)
  if constexpr (FMT == FP8_E5M2) {
#pragma unroll
    for (int j = 0; j < 16; ++j) v[j] = f16_to_f32_ptx(((c.w[j >> 2] >> (8 * (j & 3))) & 0xFFu) << 8);
    return;
  }
#if __CUDA_ARCH__ >= 890
  if constexpr (FMT == FP8_E4M3) {
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const uint16_t two = (uint16_t)(c.w[k >> 1] >> (16 * (k & 1)));
      uint32_t h2;
      asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(two));
      v[2 * k] = f16_to_f32_ptx(h2 & 0xFFFFu);
      v[2 * k + 1] = f16_to_f32_ptx(h2 >> 16);
    }
    return;
  }
#endif
#endif
  if constexpr (FMT == FP8_E4M3 || FMT == FP8_E5M2) {
#pragma unroll
    for (int j = 0; j < 16; ++j) v[j] = fp8_to_f32<FMT>((c.w[j >> 2] >> (8 * (j & 3))) & 0xFFu);
  }
}

// Index math is 32-bit unsigned: gpu.py only launches tensors of fewer than 2^31 elements
// (64-bit division would be a called subroutine, costly and spilling registers).
KVC_HD uint32_t fp8_scale_index(const Fp8Params& p, uint32_t row, uint32_t d) {
  const uint32_t t = row / (uint32_t)p.heads, h = row - t * (uint32_t)p.heads;
  return (t / (uint32_t)p.t_blk) * (uint32_t)p.s_t + (h / (uint32_t)p.h_blk) * (uint32_t)p.s_h +
         (d / (uint32_t)p.d_blk) * (uint32_t)p.s_d;
}

// One element (the general path: any D, any scale layout).
template <int FMT, int OUT>
KVC_HD void fp8_item(const Fp8Params& p, uint32_t i) {
  const uint32_t row = i / (uint32_t)p.dim, d = i - row * (uint32_t)p.dim;
  const float s = loadf(p.scale + fp8_scale_index(p, row, d));
  store_out<OUT>(p.out, (uint64_t)i, mul_rn(fp8_to_f32<FMT>(p.codes[i]), s));
}

// Sixteen elements d0..d0+15 of one row (the fast path: D % 16 == 0, 16-byte aligned planes).
template <int FMT, int OUT>
KVC_HD void fp8_item16(const Fp8Params& p, uint32_t v) {
  const uint32_t i0 = v * 16;
  const uint32_t row = i0 / (uint32_t)p.dim, d0 = i0 - row * (uint32_t)p.dim;
  const U32x4 c = load16(p.codes + i0);
  float x[16];
  fp8x16_to_f32<FMT>(c, x);
  uint32_t bits[16];
  if (p.scale_const16) {
    const float s = loadf(p.scale + fp8_scale_index(p, row, d0));
#pragma unroll
    for (int j = 0; j < 16; ++j) bits[j] = out_bits<OUT>(mul_rn(x[j], s));
  } else {
    const uint32_t base = fp8_scale_index(p, row, 0);
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const float s = loadf(p.scale + base + ((d0 + j) / (uint32_t)p.d_blk) * (uint32_t)p.s_d);
      bits[j] = out_bits<OUT>(mul_rn(x[j], s));
    }
  }
  store16_out<OUT>(p.out, (uint64_t)i0, bits);
}

struct Nvfp4Params {
  const uint8_t* codes;         // [rows, dim_padded / 2]
  const uint8_t* block_scale;   // [rows, dim_padded / 16], E4M3
  const float* tensor_scale;    // [1]
  void* out;                    // [rows, dim]
  int64_t rows;
  int32_t dim, dim_padded;
};

KVC_HD float nvfp4_value(uint32_t code, float block_scale, float tensor_scale) {
  return mul_rn(mul_rn(e2m1_to_f32(code), block_scale), tensor_scale);
}

// One 16-element block: item = row * (dim_padded / 16) + block.
template <int OUT>
KVC_HD void nvfp4_item(const Nvfp4Params& p, uint32_t item) {
  const uint32_t nb = (uint32_t)p.dim_padded >> 4;
  const uint32_t row = item / nb;
  const uint32_t b = item - row * nb;
  const uint64_t packed = load8(p.codes + (uint64_t)row * (p.dim_padded >> 1) + b * 8);
  const float bs = e4m3_to_f32(load1(p.block_scale + item));
  const float ts = loadf(p.tensor_scale);
  const uint32_t d0 = b * 16;
  if (p.dim == p.dim_padded) {
    uint32_t bits[16];
#pragma unroll
    for (int j = 0; j < 16; ++j)
      bits[j] = out_bits<OUT>(nvfp4_value((uint32_t)(packed >> (4 * j)) & 0xFu, bs, ts));
    store16_out<OUT>(p.out, (uint64_t)(row * p.dim + d0), bits);
  } else {
    for (uint32_t j = 0; j < 16 && d0 + j < (uint32_t)p.dim; ++j)
      store_out<OUT>(p.out, (uint64_t)(row * p.dim + d0 + j),
                     nvfp4_value((uint32_t)(packed >> (4 * j)) & 0xFu, bs, ts));
  }
}

}  // namespace kvc
