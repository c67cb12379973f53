/* convert.c -- float16 / bfloat16 / float32 rows (store_row, load_row, shared by the
 * quantization and dequantization units), the F16C hardware path and its switch
 * (kvn_set_hw_f16), kvn_convert (the conversions' entry point) and all_finite.
 */
#include "kvn_common.h"

/* The (de)quantization units compute rows in float32 into a scratch row (simple loops that
 * vectorise), then store them as the output kind with store_row: float32 copy, bfloat16
 * rounding, or float16 -- with the F16C instruction (IEEE round to nearest even: the same bits as
 * f32_to_f16) where the CPU has it. The switch lives here only: store_row and load_row are its
 * sole readers. */
static int use_hw_f16 = -1; /* -1: not decided yet; tests can force the software path */

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#include <immintrin.h>
__attribute__((target("avx,f16c"))) static void row_f16_hw(uint16_t* dst, const float* src, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128((__m128i*)(dst + i), h);
  }
  for (; i < n; ++i) dst[i] = f32_to_f16(src[i]);
}
__attribute__((target("avx,f16c"))) static void row_f32_from_f16_hw(float* dst, const uint16_t* src, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(src + i))));
  for (; i < n; ++i) dst[i] = f16_to_f32(src[i]);
}
static int have_hw_f16(void) {
  __builtin_cpu_init();
  return __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx");
}
#else
static void row_f16_hw(uint16_t* dst, const float* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = f32_to_f16(src[i]);
}
static void row_f32_from_f16_hw(float* dst, const uint16_t* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = f16_to_f32(src[i]);
}
static int have_hw_f16(void) { return 0; }
#endif

/* 1: use F16C when present (default), 0: always the portable conversion. Returns whether the
 * hardware path is in use. */
int kvn_set_hw_f16(int on) {
  use_hw_f16 = on ? have_hw_f16() : 0;
  return use_hw_f16;
}

KVN_INTERNAL void store_row(void* out, int kind, int64_t o, const float* src, int64_t n) {
  if (kind == F_F16) {
    uint16_t* d = (uint16_t*)out + o;
    if (use_hw_f16 < 0) use_hw_f16 = have_hw_f16();
    if (use_hw_f16) {
      row_f16_hw(d, src, n);
    } else {
      for (int64_t i = 0; i < n; ++i) d[i] = f32_to_f16(src[i]);
    }
  } else if (kind == F_BF16) {
    uint16_t* d = (uint16_t*)out + o;
    for (int64_t i = 0; i < n; ++i) d[i] = f32_to_bf16(src[i]);
  } else {
    memcpy((float*)out + o, src, sizeof(float) * (size_t)n);
  }
}

/* n values of a float16 / bfloat16 / float32 array from element o, as float32 (exact). */
KVN_INTERNAL void load_row(float* dst, const void* src, int kind, int64_t o, int64_t n) {
  if (kind == F_F16) {
    const uint16_t* h = (const uint16_t*)src + o;
    if (use_hw_f16 < 0) use_hw_f16 = have_hw_f16();
    if (use_hw_f16) {
      row_f32_from_f16_hw(dst, h, n);
    } else {
      for (int64_t i = 0; i < n; ++i) dst[i] = f16_to_f32(h[i]);
    }
  } else if (kind == F_BF16) {
    const uint16_t* h = (const uint16_t*)src + o;
    for (int64_t i = 0; i < n; ++i) dst[i] = bits_f32((uint32_t)h[i] << 16);
  } else {
    memcpy(dst, (const float*)src + o, sizeof(float) * (size_t)n);
  }
}

/* Conversions: kind F_F16 / F_BF16, float32 -> bits (dir 0, through store_row: the path the
 * decoders use) or bits -> float32 (dir 1, through load_row: exact; kvcodec.native.convert.widen). */
void kvn_convert(int kind, int dir, const void* in, void* out, int64_t n) {
  if (dir == 0) {
    store_row(out, kind, 0, (const float*)in, n);
    return;
  }
  load_row((float*)out, in, kind, 0, n);
}

/* 1 if the n values of kind `kind` (F_F32 / F_F16 / F_BF16) at v are all finite, else 0: the
 * exponent bits tested on the values' bits (one loop that vectorises). */
KVN_INTERNAL int all_finite(const void* v, int kind, int64_t n) {
  int bad = 0;
  if (kind == F_F32) {
    const uint32_t* u = (const uint32_t*)v;
    for (int64_t i = 0; i < n; ++i) bad |= (u[i] & 0x7f800000u) == 0x7f800000u;
  } else {
    const uint16_t* u = (const uint16_t*)v;
    const uint16_t e = kind == F_F16 ? 0x7c00u : 0x7f80u;
    for (int64_t i = 0; i < n; ++i) bad |= (u[i] & e) == e;
  }
  return !bad;
}
