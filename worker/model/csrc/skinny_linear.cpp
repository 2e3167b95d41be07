// y = (x @ w.T) * scale + bias for the few rows of a decode step (1 to 8 of them),
// with w stored as float32, float16, bfloat16 or int8 and x, y, scale, bias float32;
// and for the many rows of a prefill, each row as it would be in a decode step.
//
// At that size a product is bound by streaming w from memory, and, at 8 rows, by
// the instructions spent on each weight loaded. So w is packed once, when the
// engine builds its weights (pack_weight), into panels of kPanel output columns
// (two vectors on AVX-512, one on AVX2 and the baseline):
//
//   float32, float16, bfloat16: [N / kPanel][K][kPanel]
//   int8:                       [N / kPanel][K / 2][kPanel][2]
//
// the last panel padded with zero columns. For each k the kernel loads one row of
// a panel, kPanel columns of w[:, k] (widened to float32 in registers, vec.h), and
// multiplies it with x[m, k] broadcast, for each input row m, into M accumulators
// per vector: no horizontal sums, each weight converted once for all rows, and one
// contiguous stream per panel, prefetched ahead. Threads take whole panels. The
// panels taken side by side are as many as the registers hold for the rows'
// accumulators (more panels: more multiply-adds per broadcast); more than
// kRowGroup rows go in two groups over the same panels, the second group reading
// them from cache, so that 8 rows do not leave room for one panel only. More than
// kMaxRows rows (a prefill) go the same way in as many groups as they fill: each
// set of panels is read from memory once for all of them, not once per 8 rows.
//
// int8 weights, on AVX2 and AVX-512, are multiplied in integers: each input row is
// quantized on the fly to int16 with one scale of its own, and a 32-bit broadcast
// of a pair of them, (x[m, k], x[m, k + 1]), is multiplied with the panel's
// column pairs (w[n, k], w[n, k + 1]) and summed into int32 lanes (vpmaddwd, or
// AVX512-VNNI's vpdpwssd). 14-bit activations keep the rounding of x far below the
// int8 weights' own, and the int32 sums cannot overflow for K up to 16384.
//
// Each output is one lane: one dependency chain over k (in blocks of kBlock k's
// for floats), in the same order whatever the number of rows, their group, or
// how many panels are taken together, finished by one explicit fused
// multiply-add with its scale and bias: a row's result does not depend on its
// batchmates, which exact resumes rely on.

#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "vec.h"

namespace {

// The tiles' loops are unrolled whole, so that their accumulators are registers.
#define UNROLLED _Pragma("GCC unroll 64")

constexpr int64_t kMaxRows = 8;
constexpr int64_t kMinColumnsPerThread = 256;

// Vectors of output columns per panel: two where there are registers for 2 * 8
// accumulators, weights and a broadcast (AVX-512's 32), else one.
constexpr int64_t kPanelVectors = kVectorRegisters >= 32 ? 2 : 1;
constexpr int64_t kPanel = kPanelVectors * kLanes;

// Floating-point sums run over blocks of kBlock k's, each block's chain added to
// the output's total in turn: a fixed split (the same for every number of rows)
// that keeps float32's rounding over K = 3072 near that of a short chain's.
constexpr int64_t kBlock = 256;

// More rows than this go in two groups over the same panels, the second reading
// them from cache: each group's tile then holds several panels' weight vectors
// and its broadcasts serve all of them, where an 8-row tile has registers for
// one panel only and spends a broadcast on every multiply-add (on AVX2 that made
// 8 rows twice as slow as 4, on AVX-512 half as fast again).
constexpr int64_t kRowGroup = 4;

constexpr int64_t kPrefetchAhead = 2048;  // bytes ahead in a panel's stream

// Panels multiplied side by side for M input rows: enough vectors of weights in
// flight to keep several multiply-add chains going, with M accumulators each, the
// weight vectors themselves, a broadcast and ``spare_registers`` more in
// registers, up to 8 vectors.
constexpr int64_t PanelsFor(int64_t M, int64_t spare_registers = 1) {
  int64_t vectors = (kVectorRegisters - 1 - spare_registers) / (M + 1);
  vectors = vectors > 8 ? 8 : vectors;
  const int64_t panels = vectors / kPanelVectors;
  return panels < 1 ? 1 : panels;
}

// The integer tile's panels: as PanelsFor, with three registers spare rather
// than one, for the products vpmaddwd makes before they are added. With 4 rows
// on AVX-512 the float tile's 3 panels took 31 of the 32 registers, and GCC
// then kept most of the integer sums on the stack, loading, adding and storing
// each one every k (on a Zen 5 EPYC the VNNI build's 8-row int8 LM head took
// 1.8 ms that way, 1.1 with 2 panels).
constexpr int64_t IntegerPanelsFor(int64_t M) { return PanelsFor(M, 3); }

// The columns of the last panel below N, each fma(sum, scale, bias): out of line,
// since it runs once a product, and inlined into every tile it made the build
// several times larger and slower.
__attribute__((noinline)) void finish_partial(const Vec& sums, const float* scale,
                                              const float* bias, float* y_row, int64_t N,
                                              int64_t n) {
  for (int64_t i = 0; n + i < N; ++i)
    y_row[n + i] = std::fma(sums[i], scale ? scale[n + i] : 1.f, bias ? bias[n + i] : 0.f);
}

// y[m, n .. n + kLanes) from one vector of accumulators: fma(acc, scale, bias),
// columns past N dropped (the last panel's padding).
__attribute__((always_inline)) inline void finish(Vec acc, const float* scale, const float* bias,
                                                  float* y_row, int64_t N, int64_t n) {
  if (n + kLanes > N) return finish_partial(acc, scale, bias, y_row, N, n);
  const Vec s = scale ? load(scale + n) : 1.f - Vec{};
  const Vec b = bias ? load(bias + n) : Vec{};
  store(y_row + n, fma(acc, s, b));
}

// G panels from panel p on, for M input rows.
template <typename W, int64_t M, int64_t G>
__attribute__((always_inline)) inline void float_panels(const float* x, const W* packed,
                                                        const float* scale, const float* bias,
                                                        float* y, int64_t K, int64_t N,
                                                        int64_t p) {
  constexpr int64_t V = G * kPanelVectors;
  Vec total[M][V] = {};
  asm volatile("" : : "r"(&total[0][0]) : "memory");
  const W* w[G];
  UNROLLED
  for (int64_t g = 0; g < G; ++g) w[g] = packed + (p + g) * K * kPanel;
  for (int64_t k0 = 0; k0 < K; k0 += kBlock) {
    const int64_t k1 = k0 + kBlock < K ? k0 + kBlock : K;
    Vec acc[M][V] = {};
    for (int64_t k = k0; k < k1; ++k) {
      Vec a[V];
      UNROLLED
      for (int64_t g = 0; g < G; ++g)
        __builtin_prefetch(reinterpret_cast<const char*>(w[g] + k * kPanel) + kPrefetchAhead);
      UNROLLED
      for (int64_t g = 0; g < G; ++g)
        UNROLLED
        for (int64_t v = 0; v < kPanelVectors; ++v)
          a[g * kPanelVectors + v] = load(w[g] + k * kPanel + v * kLanes);
      UNROLLED
      for (int64_t m = 0; m < M; ++m) {
        const Vec xm = broadcast(x + m * K + k);
        UNROLLED
        for (int64_t v = 0; v < V; ++v) acc[m][v] += a[v] * xm;
      }
    }
    UNROLLED
    for (int64_t m = 0; m < M; ++m)
      UNROLLED
      for (int64_t v = 0; v < V; ++v) total[m][v] += acc[m][v];
    // The totals live in memory, not registers: at 8 rows the block's
    // accumulators need every register (kept there, they spilled the loop's).
    asm volatile("" : : "r"(&total[0][0]) : "memory");
  }
  UNROLLED
  for (int64_t m = 0; m < M; ++m)
    UNROLLED
    for (int64_t v = 0; v < V; ++v)
      finish(total[m][v], scale, bias, y + m * N, N, p * kPanel + v * kLanes);
}

template <typename W, int64_t M>
void float_columns(const float* x, const W* packed, const float* scale, const float* bias,
                   float* y, int64_t K, int64_t N, int64_t p0, int64_t p1) {
  if constexpr (M > kRowGroup) {
    // The first kRowGroup rows, then the rest on the same panels, which the
    // first group's pass left in cache.
    constexpr int64_t G = PanelsFor(kRowGroup), R = M - kRowGroup;
    const float* x_rest = x + kRowGroup * K;
    float* y_rest = y + kRowGroup * N;
    int64_t p = p0;
    for (; p + G <= p1; p += G) {
      float_panels<W, kRowGroup, G>(x, packed, scale, bias, y, K, N, p);
      float_panels<W, R, G>(x_rest, packed, scale, bias, y_rest, K, N, p);
    }
    for (; p < p1; ++p) {
      float_panels<W, kRowGroup, 1>(x, packed, scale, bias, y, K, N, p);
      float_panels<W, R, 1>(x_rest, packed, scale, bias, y_rest, K, N, p);
    }
  } else {
    constexpr int64_t G = PanelsFor(M);
    int64_t p = p0;
    for (; p + G <= p1; p += G) float_panels<W, M, G>(x, packed, scale, bias, y, K, N, p);
    for (; p < p1; ++p) float_panels<W, M, 1>(x, packed, scale, bias, y, K, N, p);
  }
}

// tile(rows, m) for M rows in groups of kRowGroup from m = 0, the last group
// smaller (rows: the group's size, as a type). Over the same panels, which stay in
// cache from one group to the next; a call of up to kMaxRows rows runs these very
// tiles, so a row's result is the same either way.
template <typename Tile>
__attribute__((always_inline)) inline void row_groups(int64_t M, Tile tile) {
  int64_t m = 0;
  for (; m + kRowGroup <= M; m += kRowGroup) tile(std::integral_constant<int64_t, kRowGroup>{}, m);
  switch (M - m) {
    case 1: tile(std::integral_constant<int64_t, 1>{}, m); break;
    case 2: tile(std::integral_constant<int64_t, 2>{}, m); break;
    case 3: tile(std::integral_constant<int64_t, 3>{}, m); break;
    default: break;
  }
}

template <typename W>
void float_many_rows(int64_t M, const float* x, const W* packed, const float* scale,
                     const float* bias, float* y, int64_t K, int64_t N, int64_t p0, int64_t p1) {
  constexpr int64_t G = PanelsFor(kRowGroup);
  int64_t p = p0;
  for (; p + G <= p1; p += G)
    row_groups(M, [&](auto rows, int64_t m) {
      float_panels<W, decltype(rows)::value, G>(x + m * K, packed, scale, bias, y + m * N, K, N, p);
    });
  for (; p < p1; ++p)
    row_groups(M, [&](auto rows, int64_t m) {
      float_panels<W, decltype(rows)::value, 1>(x + m * K, packed, scale, bias, y + m * N, K, N, p);
    });
}

#if defined(__AVX2__) || (defined(__AVX512F__) && defined(__AVX512BW__))
#define HAS_INTEGER_PRODUCTS 1

constexpr float kActivationMax = 8191.f;
constexpr int64_t kMaxIntegerK = 16384;

#if defined(__AVX512F__) && defined(__AVX512BW__)
typedef __m512i IVec;
// kLanes columns' pairs of int8 weights, as int16.
inline IVec load_weights(const int8_t* p) {
  return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline IVec broadcast_pair(int32_t pair) { return _mm512_set1_epi32(pair); }
inline IVec dot_add(IVec acc, IVec w, IVec x) {
#if defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(acc, w, x);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(w, x));
#endif
}
inline Vec to_floats(IVec v) { return bit_cast<Vec>(_mm512_cvtepi32_ps(v)); }
#else
typedef __m256i IVec;
inline IVec load_weights(const int8_t* p) {
  return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline IVec broadcast_pair(int32_t pair) { return _mm256_set1_epi32(pair); }
inline IVec dot_add(IVec acc, IVec w, IVec x) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(w, x));
}
inline Vec to_floats(IVec v) { return bit_cast<Vec>(_mm256_cvtepi32_ps(v)); }
#endif

// finish_partial for integer sums, whose scale is the row's times the column's.
__attribute__((noinline)) void integer_finish_partial(const Vec& sums, float x_scale,
                                                      const float* scale, const float* bias,
                                                      float* y_row, int64_t N, int64_t n) {
  for (int64_t i = 0; n + i < N; ++i)
    y_row[n + i] = std::fma(sums[i], x_scale * scale[n + i], bias ? bias[n + i] : 0.f);
}

template <int64_t M, int64_t G>
__attribute__((always_inline)) inline void integer_panels(const int16_t* xq, const float* x_scale,
                                                          const int8_t* packed, const float* scale,
                                                          const float* bias, float* y, int64_t K,
                                                          int64_t N, int64_t p) {
  constexpr int64_t V = G * kPanelVectors;
  IVec acc[M][V];
  UNROLLED
  for (int64_t m = 0; m < M; ++m)
    UNROLLED
    for (int64_t v = 0; v < V; ++v) acc[m][v] = IVec{};
  const int8_t* w[G];
  UNROLLED
  for (int64_t g = 0; g < G; ++g) w[g] = packed + (p + g) * K * kPanel;
  for (int64_t k = 0; k < K; k += 2) {
    IVec a[V];
    UNROLLED
    for (int64_t g = 0; g < G; ++g) __builtin_prefetch(w[g] + k * kPanel + kPrefetchAhead);
    UNROLLED
    for (int64_t g = 0; g < G; ++g)
      UNROLLED
      for (int64_t v = 0; v < kPanelVectors; ++v)
        a[g * kPanelVectors + v] = load_weights(w[g] + k * kPanel + v * 2 * kLanes);
    UNROLLED
    for (int64_t m = 0; m < M; ++m) {
      int32_t pair;
      std::memcpy(&pair, xq + m * K + k, sizeof(pair));
      const IVec xm = broadcast_pair(pair);
      UNROLLED
      for (int64_t v = 0; v < V; ++v) acc[m][v] = dot_add(acc[m][v], a[v], xm);
    }
  }
  UNROLLED
  for (int64_t m = 0; m < M; ++m)
    UNROLLED
    for (int64_t v = 0; v < V; ++v) {
      // fma(sum, x_scale[m] * scale[n], bias[n]), as finish does for float sums.
      const int64_t n = p * kPanel + v * kLanes;
      const Vec sums = to_floats(acc[m][v]);
      float* y_row = y + m * N;
      if (n + kLanes <= N) {
        const Vec s = load(scale + n) * x_scale[m];
        store(y_row + n, fma(sums, s, bias ? load(bias + n) : Vec{}));
      } else {
        integer_finish_partial(sums, x_scale[m], scale, bias, y_row, N, n);
      }
    }
}

template <int64_t M>
void integer_columns(const int16_t* xq, const float* x_scale, const int8_t* packed,
                     const float* scale, const float* bias, float* y, int64_t K, int64_t N,
                     int64_t p0, int64_t p1) {
  if constexpr (M > kRowGroup) {  // in two groups of rows, as float_columns
    constexpr int64_t G = IntegerPanelsFor(kRowGroup), R = M - kRowGroup;
    const int16_t* xq_rest = xq + kRowGroup * K;
    const float* x_scale_rest = x_scale + kRowGroup;
    float* y_rest = y + kRowGroup * N;
    int64_t p = p0;
    for (; p + G <= p1; p += G) {
      integer_panels<kRowGroup, G>(xq, x_scale, packed, scale, bias, y, K, N, p);
      integer_panels<R, G>(xq_rest, x_scale_rest, packed, scale, bias, y_rest, K, N, p);
    }
    for (; p < p1; ++p) {
      integer_panels<kRowGroup, 1>(xq, x_scale, packed, scale, bias, y, K, N, p);
      integer_panels<R, 1>(xq_rest, x_scale_rest, packed, scale, bias, y_rest, K, N, p);
    }
  } else {
    constexpr int64_t G = IntegerPanelsFor(M);
    int64_t p = p0;
    for (; p + G <= p1; p += G) integer_panels<M, G>(xq, x_scale, packed, scale, bias, y, K, N, p);
    for (; p < p1; ++p) integer_panels<M, 1>(xq, x_scale, packed, scale, bias, y, K, N, p);
  }
}

// More than kMaxRows rows, as float_many_rows.
void integer_many_rows(int64_t M, const int16_t* xq, const float* x_scale, const int8_t* packed,
                       const float* scale, const float* bias, float* y, int64_t K, int64_t N,
                       int64_t p0, int64_t p1) {
  constexpr int64_t G = IntegerPanelsFor(kRowGroup);
  int64_t p = p0;
  for (; p + G <= p1; p += G)
    row_groups(M, [&](auto rows, int64_t m) {
      integer_panels<decltype(rows)::value, G>(xq + m * K, x_scale + m, packed, scale, bias,
                                                 y + m * N, K, N, p);
    });
  for (; p < p1; ++p)
    row_groups(M, [&](auto rows, int64_t m) {
      integer_panels<decltype(rows)::value, 1>(xq + m * K, x_scale + m, packed, scale, bias,
                                                 y + m * N, K, N, p);
    });
}

// Each row of x as int16 with one scale, so that x[m] ~= xq[m] * x_scale[m].
void quantize_rows(const float* x, int64_t M, int64_t K, int16_t* xq, float* x_scale) {
  for (int64_t m = 0; m < M; ++m) {
    float largest = 0.f;
    for (int64_t k = 0; k < K; ++k) largest = std::max(largest, std::fabs(x[m * K + k]));
    const float step = largest > 0.f ? largest / kActivationMax : 1.f;
    const float inverse = 1.f / step;
    for (int64_t k = 0; k < K; ++k)
      xq[m * K + k] = static_cast<int16_t>(std::nearbyint(x[m * K + k] * inverse));
    x_scale[m] = step;
  }
}
#else
#define HAS_INTEGER_PRODUCTS 0

// int8 weights widened to float32, one column at a time over the packed pairs (a
// build without SIMD integer products: the scalar loop is its speed anyway).
void widened_int8_columns(int64_t M, const float* x, const int8_t* packed, const float* scale,
                          const float* bias, float* y, int64_t K, int64_t N, int64_t p0,
                          int64_t p1) {
  for (int64_t p = p0; p < p1; ++p) {
    const int8_t* w = packed + p * K * kPanel;
    for (int64_t c = 0; c < kPanel && p * kPanel + c < N; ++c) {
      const int64_t n = p * kPanel + c;
      for (int64_t m = 0; m < M; ++m) {
        float acc = 0.f;
        for (int64_t k = 0; k < K; k += 2) {
          acc += static_cast<float>(w[k * kPanel + 2 * c]) * x[m * K + k];
          acc += static_cast<float>(w[k * kPanel + 2 * c + 1]) * x[m * K + k + 1];
        }
        y[m * N + n] = std::fma(acc, scale[n], bias ? bias[n] : 0.f);
      }
    }
  }
}
#endif

// Dispatch on the number of rows, a template parameter so that tiles are fixed.
#define FOR_ROWS(M, CALL)                  \
  switch (M) {                             \
    case 1: { constexpr int64_t kM = 1; CALL; break; } \
    case 2: { constexpr int64_t kM = 2; CALL; break; } \
    case 3: { constexpr int64_t kM = 3; CALL; break; } \
    case 4: { constexpr int64_t kM = 4; CALL; break; } \
    case 5: { constexpr int64_t kM = 5; CALL; break; } \
    case 6: { constexpr int64_t kM = 6; CALL; break; } \
    case 7: { constexpr int64_t kM = 7; CALL; break; } \
    default: { constexpr int64_t kM = 8; CALL; break; } \
  }

int64_t panels_of(int64_t N) { return (N + kPanel - 1) / kPanel; }
int64_t panels_per_thread() {
  return (kMinColumnsPerThread + kPanel - 1) / kPanel;
}

template <typename W>
void float_product(int64_t M, const float* x, const W* packed, const float* scale,
                   const float* bias, float* y, int64_t K, int64_t N) {
  at::parallel_for(0, panels_of(N), panels_per_thread(), [&](int64_t p0, int64_t p1) {
    if (M > kMaxRows) return float_many_rows(M, x, packed, scale, bias, y, K, N, p0, p1);
    FOR_ROWS(M, (float_columns<W, kM>(x, packed, scale, bias, y, K, N, p0, p1)));
  });
}

const float* optional_floats(const std::optional<at::Tensor>& t, int64_t n, const char* name) {
  if (!t.has_value()) return nullptr;
  TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == n, name,
              " must be contiguous float32, one per out_feature");
  return t->data_ptr<float>();
}

bool is_weight_type(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16 || t == at::kChar;
}

// w (N, K) in its natural layout, as the panels packed_linear reads (see the top).
at::Tensor pack_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2, "weight must be 2-D");
  TORCH_CHECK(is_weight_type(weight.scalar_type()),
              "skinny_linear takes a float32, float16, bfloat16 or int8 weight");
  TORCH_CHECK(weight.is_contiguous(), "weight must be contiguous");
  const int64_t N = weight.size(0), K = weight.size(1);
  const bool pairs = weight.scalar_type() == at::kChar;
  TORCH_CHECK(!pairs || K % 2 == 0, "an int8 weight needs an even in_features");
  const int64_t P = panels_of(N);
  at::Tensor packed = pairs ? at::zeros({P, K / 2, kPanel, 2}, weight.options())
                            : at::zeros({P, K, kPanel}, weight.options());
  const int64_t size = weight.element_size();
  const char* from = static_cast<const char*>(weight.data_ptr());
  char* to = static_cast<char*>(packed.data_ptr());
  at::parallel_for(0, P, 16, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t c = 0; c < kPanel && p * kPanel + c < N; ++c) {
        const char* row = from + (p * kPanel + c) * K * size;
        char* panel = to + p * K * kPanel * size;
        for (int64_t k = 0; k < K; ++k) {
          // float: [k][c]; int8: [k / 2][c][k % 2]
          const int64_t at = pairs ? (k / 2) * 2 * kPanel + 2 * c + k % 2 : k * kPanel + c;
          std::memcpy(panel + at * size, row + k * size, size);
        }
      }
  });
  return packed;
}

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                         const std::optional<at::Tensor>& scale,
                         const std::optional<at::Tensor>& bias) {
  const auto stored = packed.scalar_type();
  const bool pairs = stored == at::kChar;
  TORCH_CHECK(x.dim() == 2, "x must be 2-D");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "skinny_linear takes float32 x");
  TORCH_CHECK(is_weight_type(stored),
              "skinny_linear takes a float32, float16, bfloat16 or int8 weight");
  TORCH_CHECK(!pairs || scale.has_value(), "an int8 weight needs its scale");
  TORCH_CHECK(x.is_contiguous() && packed.is_contiguous(), "x and weight must be contiguous");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(M >= 1, "skinny_linear takes 1 row or more, got ", M);
  TORCH_CHECK(packed.dim() == (pairs ? 4 : 3) && packed.size(0) == panels_of(N) &&
                  packed.size(2) == kPanel && (!pairs || packed.size(3) == 2),
              "weight must be packed by this build's pack_weight for ", N, " out_features");
  TORCH_CHECK(packed.size(1) * (pairs ? 2 : 1) == K && K % 32 == 0,
              "in_features must match and be a multiple of 32");
  const float* s = optional_floats(scale, N, "scale");
  const float* b = optional_floats(bias, N, "bias");
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  switch (stored) {
    case at::kHalf: float_product(M, xp, packed.data_ptr<c10::Half>(), s, b, yp, K, N); break;
    case at::kBFloat16:
      float_product(M, xp, packed.data_ptr<c10::BFloat16>(), s, b, yp, K, N);
      break;
    case at::kChar: {
      const int8_t* w = packed.data_ptr<int8_t>();
#if HAS_INTEGER_PRODUCTS
      TORCH_CHECK(K <= kMaxIntegerK, "int8 products take in_features up to ", kMaxIntegerK);
      std::vector<int16_t> xq(M * K);
      std::vector<float> x_scale(M);
      quantize_rows(xp, M, K, xq.data(), x_scale.data());
      const int16_t* q = xq.data();
      const float* qs = x_scale.data();
      at::parallel_for(0, panels_of(N), panels_per_thread(), [&](int64_t p0, int64_t p1) {
        if (M > kMaxRows) return integer_many_rows(M, q, qs, w, s, b, yp, K, N, p0, p1);
        FOR_ROWS(M, (integer_columns<kM>(q, qs, w, s, b, yp, K, N, p0, p1)));
      });
#else
      at::parallel_for(0, panels_of(N), panels_per_thread(), [&](int64_t p0, int64_t p1) {
        widened_int8_columns(M, xp, w, s, b, yp, K, N, p0, p1);
      });
#endif
      break;
    }
    default: float_product(M, xp, packed.data_ptr<float>(), s, b, yp, K, N);
  }
  return y;
}

// What this library was compiled for (worker/kernels.py names the build), and how
// it multiplies int8 weights: "vnni" (vpdpwssd), "integer" (vpmaddwd) or "float"
// (widened to float32).
std::string int8_products() {
#if HAS_INTEGER_PRODUCTS && defined(__AVX512VNNI__)
  return "vnni";
#elif HAS_INTEGER_PRODUCTS
  return "integer";
#else
  return "float";
#endif
}

int64_t vector_lanes() { return kLanes; }
int64_t panel_columns() { return kPanel; }

}  // namespace

// Registered ops, so that torch's profiler sees them by name and shapes. Each
// build has its own namespace (MINIBATCH_OPS, e.g. minibatch_avx2), so that a test
// can load every build this CPU runs side by side; a weight packed by one build is
// for that build's packed_linear only (the panels' width is the build's).
TORCH_LIBRARY_FRAGMENT(MINIBATCH_OPS, m) {
  m.def("pack_weight(Tensor weight) -> Tensor");
  m.def(
      "packed_linear(Tensor x, Tensor packed, int out_features, Tensor? scale, Tensor? bias) "
      "-> Tensor");
  m.def("int8_products() -> str", &int8_products);
  m.def("vector_lanes() -> int", &vector_lanes);
  m.def("panel_columns() -> int", &panel_columns);
}

TORCH_LIBRARY_IMPL(MINIBATCH_OPS, CPU, m) {
  m.impl("pack_weight", &pack_weight);
  m.impl("packed_linear", &packed_linear);
}
