// 16 floats as one value, with GCC vector extensions: the compiler maps it onto
// AVX-512, AVX2 or SSE registers, whichever the target has.
//
// `load` widens 16 stored values to 16 floats in registers, whatever their storage:
// float32, float16, bfloat16 (the top half of a float32, so a shift) or int8
// (sign-extend, then convert). Weights and the KV cache may be stored in fewer
// bytes; arithmetic is float32 throughout. Each widening is written so that GCC 12
// keeps it in vector registers: converting a vector of _Float16 or of int8 straight
// to floats compiled to one scalar conversion per element, slower than the
// float32 kernel it was meant to beat.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>

constexpr int64_t kLanes = 16;

typedef float Vec __attribute__((vector_size(kLanes * sizeof(float)), aligned(sizeof(float))));
typedef uint16_t Shorts __attribute__((vector_size(kLanes * 2), aligned(2)));
typedef uint32_t Words __attribute__((vector_size(kLanes * 4), aligned(4)));
typedef int8_t Bytes __attribute__((vector_size(kLanes), aligned(1)));
typedef int8_t Quads __attribute__((vector_size(kLanes * 4), aligned(1)));
typedef int32_t Ints __attribute__((vector_size(kLanes * 4), aligned(4)));

inline Vec as_floats(Words bits) {
  Vec v;
  __builtin_memcpy(&v, &bits, sizeof(v));
  return v;
}

inline Words as_words(Vec v) {
  Words bits;
  __builtin_memcpy(&bits, &v, sizeof(bits));
  return bits;
}

inline Vec load(const float* p) {
  Vec v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}

// Exponent and mantissa moved into float32's places, then scaled by 2^112 to
// re-bias the exponent, which also turns float16's subnormals into float32 normals;
// infinities and NaNs get float32's all-ones exponent; the sign goes back on last.
inline Vec load(const c10::Half* p) {
  Shorts bits;
  __builtin_memcpy(&bits, p, sizeof(bits));
  const Words h = __builtin_convertvector(bits, Words);
  Words f = as_words(as_floats((h & 0x7fffu) << 13) * 0x1p112f);
  f |= ((h & 0x7c00u) == 0x7c00u) & 0x7f800000u;
  return as_floats(f | (h & 0x8000u) << 16);
}

inline Vec load(const c10::BFloat16* p) {
  Shorts bits;
  __builtin_memcpy(&bits, p, sizeof(bits));
  return as_floats(__builtin_convertvector(bits, Words) << 16);
}

// Each byte copied into the top of its own 32-bit lane (one shuffle), then an
// arithmetic shift right sign-extends it.
#define FOUR(i) i, i, i, i
inline Vec load(const int8_t* p) {
  Bytes b;
  __builtin_memcpy(&b, p, sizeof(b));
  const Quads spread = __builtin_shufflevector(
      b, b, FOUR(0), FOUR(1), FOUR(2), FOUR(3), FOUR(4), FOUR(5), FOUR(6), FOUR(7), FOUR(8),
      FOUR(9), FOUR(10), FOUR(11), FOUR(12), FOUR(13), FOUR(14), FOUR(15));
  Ints lanes;
  __builtin_memcpy(&lanes, &spread, sizeof(lanes));
  return __builtin_convertvector(lanes >> 24, Vec);
}
#undef FOUR

inline void store(float* p, Vec v) { __builtin_memcpy(p, &v, sizeof(v)); }

inline float sum(Vec v) {
  float total = 0.f;
  for (int64_t i = 0; i < kLanes; ++i) total += v[i];
  return total;
}

// On x86-64, compile a function once per instruction set (AVX-512, AVX2, baseline)
// and pick one when the library loads, so one build runs on any x86-64 machine.
#if defined(__x86_64__)
#define PER_ISA __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define PER_ISA
#endif
