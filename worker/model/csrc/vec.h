// One vector register of floats as one value, with GCC vector extensions, sized
// for the instruction set this library is compiled for (worker/kernels.py builds
// one library per ISA and loads the best one the CPU runs):
//
//   AVX-512: 16 floats a register, 32 registers
//   AVX2:     8 floats a register, 16 registers
//   baseline: 4 floats a register (SSE2 or NEON), 16 registers
//
// The register count sizes the kernels' tiles: a tile whose accumulators do not
// fit spills them to memory on every multiply-add (16-float vectors on AVX2 took
// two registers each, and an 8-row tile ran ten times slower than the bandwidth).
//
// `load` widens kLanes stored values to floats in registers, whatever their
// storage: float32, float16 (F16C's vcvtph2ps where the ISA has it), bfloat16
// (the top half of a float32, so a shift) or int8 (sign-extend, then convert).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
constexpr int64_t kLanes = 16;
constexpr int64_t kVectorRegisters = 32;
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
constexpr int64_t kLanes = 8;
constexpr int64_t kVectorRegisters = 16;
#else
constexpr int64_t kLanes = 4;
constexpr int64_t kVectorRegisters = 16;
#endif

// Naturally aligned, so that locals live in registers; memory is read through
// unaligned loads.
typedef float Vec __attribute__((vector_size(kLanes * sizeof(float))));
typedef uint16_t Shorts __attribute__((vector_size(kLanes * 2)));
typedef uint32_t Words __attribute__((vector_size(kLanes * 4)));
typedef int32_t Ints __attribute__((vector_size(kLanes * 4)));

template <typename To, typename From>
inline To bit_cast(From from) {
  static_assert(sizeof(To) == sizeof(From));
  To to;
  __builtin_memcpy(&to, &from, sizeof(to));
  return to;
}

inline Vec load(const float* p) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  return bit_cast<Vec>(_mm512_loadu_ps(p));
#elif defined(__AVX2__)
  return bit_cast<Vec>(_mm256_loadu_ps(p));
#else
  Vec v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
#endif
}

inline Vec load(const c10::Half* p) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  return bit_cast<Vec>(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
#elif defined(__F16C__) && defined(__AVX2__)
  return bit_cast<Vec>(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
  // Exponent and mantissa moved into float32's places, then scaled by 2^112 to
  // re-bias the exponent, which also turns float16's subnormals into float32
  // normals; infinities and NaNs get float32's all-ones exponent; the sign last.
  Shorts bits;
  __builtin_memcpy(&bits, p, sizeof(bits));
  const Words h = __builtin_convertvector(bits, Words);
  Words f = bit_cast<Words>(bit_cast<Vec>((h & 0x7fffu) << 13) * 0x1p112f);
  f |= ((h & 0x7c00u) == 0x7c00u) & 0x7f800000u;
  return bit_cast<Vec>(f | (h & 0x8000u) << 16);
#endif
}

inline Vec load(const c10::BFloat16* p) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  const __m512i words = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return bit_cast<Vec>(_mm512_slli_epi32(words, 16));
#elif defined(__AVX2__)
  const __m256i words = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return bit_cast<Vec>(_mm256_slli_epi32(words, 16));
#else
  Shorts bits;
  __builtin_memcpy(&bits, p, sizeof(bits));
  return bit_cast<Vec>(__builtin_convertvector(bits, Words) << 16);
#endif
}

inline Vec load(const int8_t* p) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  return bit_cast<Vec>(
      _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
#elif defined(__AVX2__)
  return bit_cast<Vec>(
      _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))));
#else
  Ints lanes;
  for (int64_t i = 0; i < kLanes; ++i) lanes[i] = p[i];
  return __builtin_convertvector(lanes, Vec);
#endif
}

// kLanes copies of *p, loaded straight into a register: one load, no arithmetic.
// (`Vec{} + *p` costs an add and a shuffle for each copy, since adding zero is
// not an identity for -0: in an 8-row tile those took the multiply-adds' ports.)
inline Vec broadcast(const float* p) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  return bit_cast<Vec>(_mm512_set1_ps(*p));
#elif defined(__AVX2__)
  return bit_cast<Vec>(_mm256_broadcast_ss(p));
#else
  return *p - Vec{};  // x - 0 is x for every x, so this folds to a copy
#endif
}

inline void store(float* p, Vec v) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  _mm512_storeu_ps(p, bit_cast<__m512>(v));
#elif defined(__AVX2__)
  _mm256_storeu_ps(p, bit_cast<__m256>(v));
#else
  __builtin_memcpy(p, &v, sizeof(v));
#endif
}

// a * b + c in each lane, rounded once, as std::fma rounds one float: the packed
// kernel finishes a partial panel's columns with std::fma and the others with this.
inline Vec fma(Vec a, Vec b, Vec c) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  return bit_cast<Vec>(_mm512_fmadd_ps(bit_cast<__m512>(a), bit_cast<__m512>(b), bit_cast<__m512>(c)));
#elif defined(__AVX2__) && defined(__FMA__)
  return bit_cast<Vec>(_mm256_fmadd_ps(bit_cast<__m256>(a), bit_cast<__m256>(b), bit_cast<__m256>(c)));
#else
  Vec r;
  for (int64_t i = 0; i < kLanes; ++i) r[i] = __builtin_fmaf(a[i], b[i], c[i]);
  return r;
#endif
}

inline float sum(Vec v) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  return _mm512_reduce_add_ps(bit_cast<__m512>(v));
#elif defined(__AVX2__)
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(bit_cast<__m256>(v)),
                        _mm256_extractf128_ps(bit_cast<__m256>(v), 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
#else
  float total = 0.f;
  for (int64_t i = 0; i < kLanes; ++i) total += v[i];
  return total;
#endif
}
