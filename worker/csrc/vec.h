// 16 floats as one value, with GCC vector extensions: the compiler maps it onto
// AVX-512, AVX2 or SSE registers, whichever the target has.
//
// `load` widens 16 stored values to 16 floats in registers, whatever their storage:
// float32, float16 (vcvtph2ps where the target has F16C), bfloat16 (the top half
// of a float32, so a shift) or int8 (sign-extend, then convert). Weights and the
// KV cache may be stored in fewer bytes; arithmetic is float32 throughout.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>

constexpr int64_t kLanes = 16;

typedef float Vec __attribute__((vector_size(kLanes * sizeof(float)), aligned(sizeof(float))));
typedef _Float16 Halves __attribute__((vector_size(kLanes * 2), aligned(2)));
typedef uint16_t Shorts __attribute__((vector_size(kLanes * 2), aligned(2)));
typedef uint32_t Words __attribute__((vector_size(kLanes * 4), aligned(4)));
typedef int8_t Bytes __attribute__((vector_size(kLanes), aligned(1)));

inline Vec load(const float* p) {
  Vec v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}

inline Vec load(const c10::Half* p) {
  Halves h;
  __builtin_memcpy(&h, p, sizeof(h));
  return __builtin_convertvector(h, Vec);
}

inline Vec load(const c10::BFloat16* p) {
  Shorts bits;
  __builtin_memcpy(&bits, p, sizeof(bits));
  const Words wide = __builtin_convertvector(bits, Words) << 16;
  Vec v;
  __builtin_memcpy(&v, &wide, sizeof(v));
  return v;
}

inline Vec load(const int8_t* p) {
  Bytes b;
  __builtin_memcpy(&b, p, sizeof(b));
  return __builtin_convertvector(b, Vec);
}

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
