// y = (x @ w.T) * scale + bias for the few rows of a decode step (1 to 8 of them),
// with w stored as float32, float16, bfloat16 or int8 and x, y, scale, bias float32.
//
// At that size a product is bound by streaming w from memory. This kernel reads w
// once, in its natural (out, in) row-major layout: it takes a few weight rows at a
// time and uses each loaded vector of them against every input row while it sits
// in a register, so the input rows stay in cache and only w streams from memory.
// The hardware prefetcher keeps those few streams ahead on its own: on a 2-vCPU
// Xeon (AVX-512), a software prefetch 4 to 16 rows ahead made the LM head at one
// row up to 2.6x slower, and 2 rows ahead gained nothing.
//
// Floating-point weights are widened to float32 in registers (vec.h), so a step
// reads half (16-bit) or a quarter (int8) of float32's bytes. int8 weights, on
// AVX2 and AVX-512, are multiplied in integers instead: each input row is
// quantized on the fly to int16 with one scale of its own, and pairs of int16
// products are summed into int32 lanes (vpmaddwd, or AVX512-VNNI's vpdpwssd, one
// instruction for 32 weights). 14-bit activations keep the rounding of x far below
// the int8 weights' own, and the int32 sums cannot overflow for K up to 16384.
//
// Each output is one dependency chain per (weight row, input row), summed over k
// in the same order whatever the number of rows, and finished by one explicit
// fused multiply-add (a tile of another size could otherwise contract it
// differently): a row's result does not depend on its batchmates, which exact
// resumes rely on.

#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <string>
#include <vector>

#include "vec.h"

namespace {

// The tiles' loops are unrolled whole, so that their accumulators are registers.
#define UNROLLED _Pragma("GCC unroll 64")

constexpr int64_t kMaxRows = 8;
constexpr int64_t kMinColumnsPerThread = 256;

// Weight rows per pass for M input rows: as many as fit the registers, with
// R * M accumulators, R weight vectors and one input vector live at once (and one
// register spare), up to 8. On AVX2 that is 1 row at M = 8, on AVX-512 3.
constexpr int64_t RowsFor(int64_t M) {
  const int64_t fit = (kVectorRegisters - 2) / (M + 1);
  return fit > 8 ? 8 : (fit < 1 ? 1 : fit);
}

// Output columns [n, n + R) for M input rows.
template <typename W, int64_t M, int64_t R>
__attribute__((always_inline)) inline void dot_rows(const float* x, const W* rows,
                                                    const float* scale, const float* bias,
                                                    float* y, int64_t K, int64_t N, int64_t n) {
  Vec acc[R][M] = {};
  for (int64_t k = 0; k < K; k += kLanes) {
    Vec a[R];
    UNROLLED
    for (int64_t r = 0; r < R; ++r) {
      a[r] = load(rows + r * K + k);
    }
    UNROLLED
    for (int64_t m = 0; m < M; ++m) {
      const Vec xm = load(x + m * K + k);
      UNROLLED
      for (int64_t r = 0; r < R; ++r) acc[r][m] += a[r] * xm;
    }
  }
  UNROLLED
  for (int64_t m = 0; m < M; ++m)
    for (int64_t r = 0; r < R; ++r)
      y[m * N + n + r] = std::fma(sum(acc[r][m]), scale ? scale[n + r] : 1.f, bias ? bias[n + r] : 0.f);
}

template <typename W, int64_t M>
void float_columns(const float* x, const W* w, const float* scale, const float* bias, float* y,
                   int64_t K, int64_t N, int64_t n0, int64_t n1) {
  constexpr int64_t R = RowsFor(M);
  int64_t n = n0;
  for (; n + R <= n1; n += R) dot_rows<W, M, R>(x, w + n * K, scale, bias, y, K, N, n);
  for (; n < n1; ++n) dot_rows<W, M, 1>(x, w + n * K, scale, bias, y, K, N, n);
}

#if defined(__AVX2__) || (defined(__AVX512F__) && defined(__AVX512BW__))
#define HAS_INTEGER_PRODUCTS 1

constexpr float kActivationMax = 8191.f;
constexpr int64_t kMaxIntegerK = 16384;

#if defined(__AVX512F__) && defined(__AVX512BW__)
typedef __m512i IVec;
constexpr int64_t kIntLanes = 32;  // int16 values a register
inline IVec load_weights(const int8_t* p) {
  return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline IVec load_activations(const int16_t* p) { return _mm512_loadu_si512(p); }
inline IVec dot_add(IVec acc, IVec w, IVec x) {
#if defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(acc, w, x);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(w, x));
#endif
}
inline int32_t integer_sum(IVec v) { return _mm512_reduce_add_epi32(v); }
#else
typedef __m256i IVec;
constexpr int64_t kIntLanes = 16;
inline IVec load_weights(const int8_t* p) {
  return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline IVec load_activations(const int16_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}
inline IVec dot_add(IVec acc, IVec w, IVec x) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(w, x));
}
inline int32_t integer_sum(IVec v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(s);
}
#endif

template <int64_t M, int64_t R>
__attribute__((always_inline)) inline void integer_dot_rows(const int16_t* xq, const float* x_scale,
                                                            const int8_t* rows, const float* scale,
                                                            const float* bias, float* y, int64_t K,
                                                            int64_t N, int64_t n) {
  IVec acc[R][M];
  for (int64_t r = 0; r < R; ++r)
    UNROLLED
    for (int64_t m = 0; m < M; ++m) acc[r][m] = IVec{};
  for (int64_t k = 0; k < K; k += kIntLanes) {
    IVec a[R];
    UNROLLED
    for (int64_t r = 0; r < R; ++r) {
      a[r] = load_weights(rows + r * K + k);
    }
    UNROLLED
    for (int64_t m = 0; m < M; ++m) {
      const IVec xm = load_activations(xq + m * K + k);
      UNROLLED
      for (int64_t r = 0; r < R; ++r) acc[r][m] = dot_add(acc[r][m], a[r], xm);
    }
  }
  UNROLLED
  for (int64_t m = 0; m < M; ++m)
    for (int64_t r = 0; r < R; ++r)
      y[m * N + n + r] = std::fma(static_cast<float>(integer_sum(acc[r][m])),
                                  x_scale[m] * scale[n + r], bias ? bias[n + r] : 0.f);
}

template <int64_t M>
void integer_columns(const int16_t* xq, const float* x_scale, const int8_t* w, const float* scale,
                     const float* bias, float* y, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  constexpr int64_t R = RowsFor(M);
  int64_t n = n0;
  for (; n + R <= n1; n += R)
    integer_dot_rows<M, R>(xq, x_scale, w + n * K, scale, bias, y, K, N, n);
  for (; n < n1; ++n) integer_dot_rows<M, 1>(xq, x_scale, w + n * K, scale, bias, y, K, N, n);
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

template <typename W>
void float_product(int64_t M, const float* x, const W* w, const float* scale, const float* bias,
                   float* y, int64_t K, int64_t N) {
  at::parallel_for(0, N, kMinColumnsPerThread, [&](int64_t n0, int64_t n1) {
    FOR_ROWS(M, (float_columns<W, kM>(x, w, scale, bias, y, K, N, n0, n1)));
  });
}

const float* optional_floats(const std::optional<at::Tensor>& t, int64_t n, const char* name) {
  if (!t.has_value()) return nullptr;
  TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == n, name,
              " must be contiguous float32, one per out_feature");
  return t->data_ptr<float>();
}

at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& weight,
                         const std::optional<at::Tensor>& scale,
                         const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2, "x and weight must be 2-D");
  const auto stored = weight.scalar_type();
  TORCH_CHECK(x.scalar_type() == at::kFloat, "skinny_linear takes float32 x");
  TORCH_CHECK(stored == at::kFloat || stored == at::kHalf || stored == at::kBFloat16 ||
                  stored == at::kChar,
              "skinny_linear takes a float32, float16, bfloat16 or int8 weight");
  TORCH_CHECK(stored != at::kChar || scale.has_value(), "an int8 weight needs its scale");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "x and weight must be contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(M >= 1 && M <= kMaxRows, "skinny_linear takes 1 to ", kMaxRows, " rows, got ", M);
  TORCH_CHECK(weight.size(1) == K && K % 32 == 0, "in_features must match and be a multiple of 32");
  const float* s = optional_floats(scale, N, "scale");
  const float* b = optional_floats(bias, N, "bias");
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  switch (stored) {
    case at::kHalf: float_product(M, xp, weight.data_ptr<c10::Half>(), s, b, yp, K, N); break;
    case at::kBFloat16:
      float_product(M, xp, weight.data_ptr<c10::BFloat16>(), s, b, yp, K, N);
      break;
    case at::kChar: {
      const int8_t* w = weight.data_ptr<int8_t>();
#if HAS_INTEGER_PRODUCTS
      TORCH_CHECK(K <= kMaxIntegerK, "int8 products take in_features up to ", kMaxIntegerK);
      std::vector<int16_t> xq(M * K);
      float x_scale[kMaxRows];
      quantize_rows(xp, M, K, xq.data(), x_scale);
      at::parallel_for(0, N, kMinColumnsPerThread, [&](int64_t n0, int64_t n1) {
        FOR_ROWS(M, (integer_columns<kM>(xq.data(), x_scale, w, s, b, yp, K, N, n0, n1)));
      });
#else
      float_product(M, xp, w, s, b, yp, K, N);
#endif
      break;
    }
    default: float_product(M, xp, weight.data_ptr<float>(), s, b, yp, K, N);
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

}  // namespace

// Registered ops, so that torch's profiler sees them by name and shapes. Each
// build has its own namespace (MINIBATCH_OPS, e.g. minibatch_avx2), so that a test
// can load every build this CPU runs side by side.
TORCH_LIBRARY_FRAGMENT(MINIBATCH_OPS, m) {
  m.def("skinny_linear(Tensor x, Tensor weight, Tensor? scale, Tensor? bias) -> Tensor");
  m.def("int8_products() -> str", &int8_products);
  m.def("vector_lanes() -> int", &vector_lanes);
}

TORCH_LIBRARY_IMPL(MINIBATCH_OPS, CPU, m) { m.impl("skinny_linear", &skinny_linear); }
