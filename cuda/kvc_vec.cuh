// kvc_vec.cuh -- 16-byte vector loads and stores that compile for the device and the host.
//
// On the device a 16-byte access is one LDG.128/STG.128 (the address must be 16-byte aligned:
// gpu.py only picks the vector kernels when every pointer and row length allows it). On the host
// the same functions use memcpy, so a host build runs the very same per-item code.
#pragma once
#include "kvc_common.cuh"

namespace kvc {

struct alignas(16) U32x4 {
  uint32_t w[4];
};

KVC_HD U32x4 load16(const void* p) {
  U32x4 r;
#if defined(__CUDA_ARCH__)
  const uint4 v = __ldg((const uint4*)p);
  r.w[0] = v.x; r.w[1] = v.y; r.w[2] = v.z; r.w[3] = v.w;
#else
  memcpy(&r, p, 16);
#endif
  return r;
}

KVC_HD void store16(void* p, const U32x4& r) {
#if defined(__CUDA_ARCH__)
  uint4 v;
  v.x = r.w[0]; v.y = r.w[1]; v.z = r.w[2]; v.w = r.w[3];
  *(uint4*)p = v;
#else
  memcpy(p, &r, 16);
#endif
}

KVC_HD uint64_t load8(const void* p) {
#if defined(__CUDA_ARCH__)
  const uint2 v = __ldg((const uint2*)p);
  return ((uint64_t)v.y << 32) | v.x;
#else
  uint64_t r;
  memcpy(&r, p, 8);
  return r;
#endif
}

KVC_HD uint8_t load1(const uint8_t* p) {
#if defined(__CUDA_ARCH__)
  return __ldg(p);
#else
  return *p;
#endif
}

KVC_HD float loadf(const float* p) {
#if defined(__CUDA_ARCH__)
  return __ldg(p);
#else
  return *p;
#endif
}

KVC_HD uint16_t load2(const uint16_t* p) {
#if defined(__CUDA_ARCH__)
  return __ldg(p);
#else
  return *p;
#endif
}

KVC_HD uint32_t load4(const uint32_t* p) {
#if defined(__CUDA_ARCH__)
  return __ldg(p);
#else
  return *p;
#endif
}

// Store 16 fp32 values (already converted to output bits) of dtype OUT at element offset i of
// out, which must be 16-element aligned: 2 (fp16/bf16) or 4 (fp32) 16-byte stores.
template <int OUT>
KVC_HD void store16_out(void* out, uint64_t i, const uint32_t (&bits)[16]) {
  if (OUT == OUT_F32) {
    uint32_t* o = (uint32_t*)out + i;
    for (int k = 0; k < 4; ++k) {
      U32x4 v;
      v.w[0] = bits[4 * k]; v.w[1] = bits[4 * k + 1]; v.w[2] = bits[4 * k + 2]; v.w[3] = bits[4 * k + 3];
      store16(o + 4 * k, v);
    }
  } else {
    uint16_t* o = (uint16_t*)out + i;
    for (int k = 0; k < 2; ++k) {
      U32x4 v;
      for (int j = 0; j < 4; ++j) v.w[j] = bits[8 * k + 2 * j] | (bits[8 * k + 2 * j + 1] << 16);
      store16(o + 8 * k, v);
    }
  }
}

}  // namespace kvc
