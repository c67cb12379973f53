// kvc_common.cuh -- shared helpers of the kvcodec decode kernels (no torch, no CUDA headers).
//
// Everything here is plain C++ that also compiles for the host (g++), so the number conversions
// used by the kernels can be checked bit for bit on a CPU (tests/test_cuda_compile.py). On the
// device the float -> fp16/bf16 casts use the PTX round-to-nearest-even conversions; on the host
// a software version of the same IEEE rounding is used.
//
// Bit-exactness rules every kernel follows (they mirror the CPU reference in kvcodec/quant/):
//   * decode small formats (FP8, E2M1) to fp32 exactly, by bit manipulation;
//   * every multiply/add is a separately rounded fp32 operation (__fmul_rn/__fadd_rn on the
//     device; the programs are also compiled with --fmad=false), never a fused multiply-add,
//     because torch's CPU kernels round after each operation;
//   * the final cast to the output dtype rounds to nearest even, like torch's .to(dtype).
#pragma once

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define KVC_HD __host__ __device__ __forceinline__
#define KVC_DEVICE_CODE 1
#else
#define KVC_HD inline
#endif

#if defined(__CUDACC_RTC__)
// NVRTC has no standard headers; the fixed-width types are all we need.
typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef unsigned long long uint64_t;
typedef int int32_t;
typedef long long int64_t;
#else
#include <stdint.h>
#include <string.h>
#endif

namespace kvc {

// Output dtypes, as numbered in the kernel names' suffixes and in gpu.py.
enum OutDtype { OUT_F32 = 0, OUT_F16 = 1, OUT_BF16 = 2 };

KVC_HD uint32_t f32_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t u;
  memcpy(&u, &x, 4);
  return u;
#endif
}

KVC_HD float bits_f32(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float x;
  memcpy(&x, &u, 4);
  return x;
#endif
}

// fp32 multiply and add, each rounded once (never contracted into an FMA).
KVC_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  volatile float r = a * b;  // volatile: keep the host compiler from contracting or widening
  return r;
#endif
}

KVC_HD float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  volatile float r = a + b;
  return r;
#endif
}

KVC_HD float sub_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  volatile float r = a - b;
  return r;
#endif
}

// ---------------------------------------------------------------- small formats -> fp32 (exact)

// FP8 E4M3FN -> fp32: bias 7, no infinities, NaN = 0x7F/0xFF. This is the same integer formula
// torch's c10::Float8_e4m3fn uses, so even the NaN bit pattern (0x7FF00000 | sign) matches.
KVC_HD float e4m3_to_f32(uint32_t b) {
  const uint32_t w = b << 24;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t nonsign = w & 0x7FFFFFFFu;
  uint32_t renorm = 0;
  if (nonsign != 0) {
#if defined(__CUDA_ARCH__)
    renorm = (uint32_t)__clz(nonsign);
#else
    renorm = (uint32_t)__builtin_clz(nonsign);
#endif
  }
  renorm = renorm > 4 ? renorm - 4 : 0;
  const int32_t inf_nan_mask = ((int32_t)(nonsign + 0x01000000u) >> 8) & 0x7F800000;
  const int32_t zero_mask = (int32_t)(nonsign - 1) >> 31;
  const uint32_t r =
      sign | ((((nonsign << renorm >> 4) + ((0x78u - renorm) << 23)) | (uint32_t)inf_nan_mask) &
              ~(uint32_t)zero_mask);
  return bits_f32(r);
}

// FP8 E5M2 -> fp32: E5M2 is the top byte of an IEEE fp16, and fp16 -> fp32 is exact.
KVC_HD float f16_bits_to_f32(uint32_t h);
KVC_HD float e5m2_to_f32(uint32_t b) { return f16_bits_to_f32(b << 8); }

// IEEE fp16 bits -> fp32 (exact; NaN payload kept, as torch's c10::Half does).
KVC_HD float f16_bits_to_f32(uint32_t h) {
  const uint32_t sign = (h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  uint32_t mant = h & 0x3FFu;
  if (exp == 0x1F) return bits_f32(sign | 0x7F800000u | (mant << 13));
  if (exp != 0) return bits_f32(sign | ((exp + 112u) << 23) | (mant << 13));
  if (mant == 0) return bits_f32(sign);
  // subnormal: value = mant * 2^-24, exact in fp32
  int e = -1;
  do {
    mant <<= 1;
    ++e;
  } while ((mant & 0x400u) == 0);
  return bits_f32(sign | ((uint32_t)(112 - e) << 23) | ((mant & 0x3FFu) << 13));
}

// E2M1 (FP4) code -> fp32: 0..7 = {0, .5, 1, 1.5, 2, 3, 4, 6}, bit 3 is the sign.
// Magnitude m >= 2 is 2^((m >> 1) - 1) * (1 + (m & 1) / 2): exponent field (m >> 1) + 126,
// mantissa bit 22 = m & 1; m = 1 is 0.5 and m = 0 is zero.
KVC_HD float e2m1_to_f32(uint32_t c) {
  const uint32_t m = c & 7u;
  const uint32_t mag = m >= 2u ? ((((m >> 1) + 126u) << 23) | ((m & 1u) << 22)) : (m ? 0x3F000000u : 0u);
  return bits_f32(mag | ((c & 8u) << 28));
}

// ---------------------------------------------------------------- fp32 -> output dtype (RNE)

// Software fp32 -> fp16, round to nearest even, overflow to inf (the host twin of cvt.rn.f16.f32).
KVC_HD uint16_t f32_to_f16_soft(float x) {
  const uint32_t u = f32_bits(x);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return (uint16_t)(sign | 0x7E00u);  // NaN -> quiet NaN, as torch
  if (a >= 0x47800000u) {  // >= 65536 before rounding: inf (65520 and up rounds to inf below)
    return (uint16_t)(sign | 0x7C00u);
  }
  if (a < 0x38800000u) {  // below the smallest normal fp16 (2^-14): subnormal or zero
    if (a < 0x33000000u) return (uint16_t)sign;  // < 2^-25: rounds to zero (tie at 2^-25 -> 0)
    const uint32_t e = a >> 23;                    // 102..112
    const uint32_t m = (a & 0x7FFFFFu) | 0x800000u;
    const uint32_t shift = 126u - e;               // 14..24
    uint32_t r = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1u);
    const uint32_t half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (r & 1u))) ++r;
    return (uint16_t)(sign | r);
  }
  uint32_t r = a - 0x38000000u;  // rebias exponent 127 -> 15 (still 23-bit mantissa)
  const uint32_t rem = r & 0x1FFFu;
  r >>= 13;
  if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) ++r;  // may carry into the exponent / inf
  return (uint16_t)(sign | r);
}

// Software fp32 -> bf16, round to nearest even (NaN -> 0x7FC0, as torch does).
KVC_HD uint16_t f32_to_bf16_soft(float x) {
  const uint32_t u = f32_bits(x);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0u;  // torch's c10::BFloat16 NaN
  const uint32_t lsb = (u >> 16) & 1u;
  return (uint16_t)((u + 0x7FFFu + lsb) >> 16);
}

KVC_HD uint16_t f32_to_f16(float x) {
#if defined(__CUDA_ARCH__)
  uint16_t r;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(x));
  return r;
#else
  return f32_to_f16_soft(x);
#endif
}

KVC_HD uint16_t f32_to_bf16(float x) {
#if defined(__CUDA_ARCH__)
  uint16_t r;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(x));
  return r;
#else
  return f32_to_bf16_soft(x);
#endif
}

// Store one fp32 value as element i of an output of dtype OUT.
template <int OUT>
KVC_HD void store_out(void* out, uint64_t i, float v) {
  if (OUT == OUT_F32) {
    ((float*)out)[i] = v;
  } else if (OUT == OUT_F16) {
    ((uint16_t*)out)[i] = f32_to_f16(v);
  } else {
    ((uint16_t*)out)[i] = f32_to_bf16(v);
  }
}

// Output bit pattern of one value (fp32 as its bits; fp16/bf16 in the low 16 bits).
template <int OUT>
KVC_HD uint32_t out_bits(float v) {
  if (OUT == OUT_F32) return f32_bits(v);
  if (OUT == OUT_F16) return f32_to_f16(v);
  return f32_to_bf16(v);
}

}  // namespace kvc
