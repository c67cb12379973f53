// intq.cuh -- per-item KIVI-style integer dequantization (bit unpacking fused with the affine
// decode), shared by the kernels (intq.cu) and the host harness.
//
// Layout (kvcodec/codecs/kivi.py, kvcodec/quant/intq.py, kvcodec/quant/packing.py):
//   packed: the uint8 codes [Tq, H, D] in C order as one LSB-first bit stream: bit j of code i
//           is stream bit i*bits + j; stream bit k is bit k%8 of byte k/8.
//   scale, zero: float16; axis "channel" (K): [ceil(Tq/g), H, D], token t uses row t/g;
//                axis "token" (V): [Tq, H, ceil(D/g)], channel d uses column d/g.
//   value = fp32(code) * fp32(scale) + fp32(zero): product rounded, then sum rounded (no FMA),
//   clamped to the output dtype's finite range, then one round-to-nearest-even cast.
#pragma once
#include "kvc_common.cuh"
#include "kvc_vec.cuh"

namespace kvc {

enum IntqAxis { AXIS_CHANNEL = 0, AXIS_TOKEN = 1 };

struct IntqParams {
  const uint8_t* packed;   // ceil(n * bits / 8) bytes
  const uint16_t* scale;   // fp16 bits
  const uint16_t* zero;    // fp16 bits
  void* out;               // [Tq, H, D] (the first Tq tokens of the output)
  int64_t n;               // Tq * H * D
  int32_t heads, dim, group, axis, bits, pad_;
};

KVC_HD float half_to_f32(uint16_t h) {
#if defined(__CUDA_ARCH__)
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
#else
  return f16_bits_to_f32(h);
#endif
}

// Index math is 32-bit unsigned: gpu.py only launches tensors of fewer than 2^31 elements
// (64-bit division would be a called subroutine, costly and spilling registers).
KVC_HD uint32_t intq_param_index(const IntqParams& p, uint32_t row /* t*H + h */, uint32_t d) {
  const uint32_t heads = (uint32_t)p.heads, dim = (uint32_t)p.dim, group = (uint32_t)p.group;
  if (p.axis == AXIS_CHANNEL) {
    const uint32_t t = row / heads, h = row - t * heads;
    return ((t / group) * heads + h) * dim + d;
  }
  const uint32_t ng = (dim + group - 1) / group;
  return row * ng + d / group;
}

// The reference clamps to the output dtype's finite range before the cast (an fp16 cache's top
// level can land just above 65504 after the fp16 rounding of scale and zero): saturate, not inf.
template <int OUT>
KVC_HD float clamp_out(float v) {
  if (OUT == OUT_F32) return v;
  const float fmax = OUT == OUT_F16 ? 65504.0f : bits_f32(0x7F7F0000u);  // bf16 max
  return v > fmax ? fmax : (v < -fmax ? -fmax : v);  // NaN passes through, as torch.clamp
}

template <int OUT>
KVC_HD float intq_value(uint32_t code, uint16_t s, uint16_t z) {
  return clamp_out<OUT>(add_rn(mul_rn((float)code, half_to_f32(s)), half_to_f32(z)));
}

// Code i of an LSB-first stream of `bits`-bit codes (never reads past the code's last byte).
KVC_HD uint32_t intq_code(const uint8_t* packed, uint32_t i, int bits) {
  const uint64_t bit = (uint64_t)i * (uint32_t)bits;
  const uint64_t byte = bit >> 3;
  const int shift = (int)(bit & 7);
  uint32_t v = load1(packed + byte) >> shift;
  if (shift + bits > 8) v |= (uint32_t)load1(packed + byte + 1) << (8 - shift);
  return v & ((1u << bits) - 1u);
}

// One element (any shape, any bit width).
template <int OUT>
KVC_HD void intq_item(const IntqParams& p, uint32_t i) {
  const uint32_t row = i / (uint32_t)p.dim, d = i - row * (uint32_t)p.dim;
  const uint32_t k = intq_param_index(p, row, d);
  store_out<OUT>(p.out, (uint64_t)i, intq_value<OUT>(intq_code(p.packed, i, p.bits), load2(p.scale + k), load2(p.zero + k)));
}

// The 2*BITS bytes holding codes 16v .. 16v+15, as a 128-bit little-endian value (lo, hi).
template <int BITS>
KVC_HD void intq_load16(const uint8_t* packed, uint32_t v, uint64_t& lo, uint64_t& hi) {
  const uint8_t* src = packed + (uint64_t)v * (2 * BITS);  // 2*BITS-byte aligned
  if (BITS == 8) {
    const U32x4 w = load16(src);
    lo = ((uint64_t)w.w[1] << 32) | w.w[0];
    hi = ((uint64_t)w.w[3] << 32) | w.w[2];
  } else if (BITS == 4) {
    lo = load8(src);
    hi = 0;
  } else if (BITS == 2) {
    lo = load4((const uint32_t*)src);
    hi = 0;
  } else {  // odd widths: 2-byte aligned, BITS halfwords
    lo = 0;
    hi = 0;
#pragma unroll
    for (int k = 0; k < BITS; ++k) {
      const uint64_t hw = load2((const uint16_t*)src + k);
      if (k < 4) lo |= hw << (16 * k); else hi |= hw << (16 * (k - 4));
    }
  }
}

template <int BITS>
KVC_HD uint32_t intq_extract(uint64_t lo, uint64_t hi, int j) {
  const int b = j * BITS;
  uint64_t v;
  if (b >= 64) v = hi >> (b - 64);
  else if (b + BITS > 64) v = (lo >> b) | (hi << (64 - b));
  else v = lo >> b;
  return (uint32_t)v & ((1u << BITS) - 1u);
}

// Sixteen elements of one row (D % 16 == 0): item v covers elements 16v .. 16v+15.
template <int BITS, int OUT>
KVC_HD void intq_item16(const IntqParams& p, uint32_t v) {
  const uint32_t i0 = v * 16;
  const uint32_t row = i0 / (uint32_t)p.dim, d0 = i0 - row * (uint32_t)p.dim;
  uint64_t lo, hi;
  intq_load16<BITS>(p.packed, v, lo, hi);
  uint32_t bits[16];
  if (p.axis == AXIS_CHANNEL) {
    // 16 consecutive channels: 16 scales and zeros, 32-byte aligned
    const uint32_t k = intq_param_index(p, row, d0);
    const U32x4 s0 = load16(p.scale + k), s1 = load16(p.scale + k + 8);
    const U32x4 z0 = load16(p.zero + k), z1 = load16(p.zero + k + 8);
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const uint32_t sw = j < 8 ? s0.w[j >> 1] : s1.w[(j - 8) >> 1];
      const uint32_t zw = j < 8 ? z0.w[j >> 1] : z1.w[(j - 8) >> 1];
      const uint16_t s = (uint16_t)(sw >> (16 * (j & 1))), z = (uint16_t)(zw >> (16 * (j & 1)));
      bits[j] = out_bits<OUT>(intq_value<OUT>(intq_extract<BITS>(lo, hi, j), s, z));
    }
  } else if (p.group % 16 == 0) {
    const uint32_t k = intq_param_index(p, row, d0);
    const uint16_t s = load2(p.scale + k), z = load2(p.zero + k);
#pragma unroll
    for (int j = 0; j < 16; ++j) bits[j] = out_bits<OUT>(intq_value<OUT>(intq_extract<BITS>(lo, hi, j), s, z));
  } else {
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const uint32_t k = intq_param_index(p, row, d0 + j);
      bits[j] = out_bits<OUT>(intq_value<OUT>(intq_extract<BITS>(lo, hi, j), load2(p.scale + k), load2(p.zero + k)));
    }
  }
  store16_out<OUT>(p.out, (uint64_t)i0, bits);
}

}  // namespace kvc
