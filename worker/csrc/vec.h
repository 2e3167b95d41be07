// 16 floats as one value, with GCC vector extensions: the compiler maps it onto
// AVX-512, AVX2 or SSE registers, whichever the target has.
#pragma once

#include <cstdint>

constexpr int64_t kLanes = 16;

typedef float Vec __attribute__((vector_size(kLanes * sizeof(float)), aligned(sizeof(float))));

inline Vec load(const float* p) {
  Vec v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
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
