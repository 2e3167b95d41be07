// y = (x @ w.T) * scale + bias for the few rows of a decode step (1 to 8 of them),
// with w stored as float32, float16, bfloat16 or int8 and x, y, scale, bias float32.
//
// At that size a product is bound by streaming w from memory, and oneDNN and MKL
// reach about half of the machine's read bandwidth. This kernel reads w once, in
// its natural (out, in) row-major layout: it takes a few weight rows at a time and
// uses each loaded vector of them against every input row while it sits in a
// register, so the input rows stay in cache and only w streams from memory. A
// software prefetch eight weight rows ahead keeps that stream ahead of the FMAs,
// which the hardware prefetcher alone did not (on a 2-core AMD EPYC, the LM head
// at 8 rows: 22 GB/s with it, 16 without; oneDNN 17).
//
// Stored in fewer bytes, w is widened to float32 in registers (vec.h), so a step
// reads half (16-bit) or a quarter (int8) of the bytes. int8 rows carry one scale
// per output channel, applied once to each finished dot product.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "vec.h"

namespace {

constexpr int64_t kMaxRows = 8;
// Prefetching past the end of w is harmless: prefetches never fault.
constexpr int64_t kPrefetchRows = 8;
constexpr int64_t kMinColumnsPerThread = 256;

// Weight rows per pass: enough accumulator chains (R * M) to hide FMA latency.
// Measured at 8 input rows, 4 weight rows beat 2 by 15% (the input rows are
// loaded once per 4 weight vectors, not per 2) and 6 added little more.
constexpr int64_t RowsFor(int64_t M) { return M == 1 ? 8 : 4; }

// Output columns [n, n + R) for M input rows: each accumulator is its own
// dependency chain, and R * M chains keep the FMA units busy where a single
// weight row (R = 1) would wait on each FMA's latency.
template <typename W, int64_t M, int64_t R>
__attribute__((always_inline)) inline void dot_rows(const float* x, const W* rows,
                                                    const float* scale, const float* bias,
                                                    float* y, int64_t K, int64_t N, int64_t n) {
  Vec acc[R][M] = {};
  for (int64_t k = 0; k < K; k += kLanes) {
    Vec a[R];
    for (int64_t r = 0; r < R; ++r) {
      __builtin_prefetch(rows + r * K + k + kPrefetchRows * K, 0, 0);
      a[r] = load(rows + r * K + k);
    }
    for (int64_t m = 0; m < M; ++m) {
      const Vec xm = load(x + m * K + k);
      for (int64_t r = 0; r < R; ++r) acc[r][m] += a[r] * xm;
    }
  }
  for (int64_t m = 0; m < M; ++m)
    for (int64_t r = 0; r < R; ++r)
      y[m * N + n + r] = sum(acc[r][m]) * (scale ? scale[n + r] : 1.f) + (bias ? bias[n + r] : 0.f);
}

// All M input rows against weight rows [n, n + R).
template <typename W, int64_t R>
__attribute__((always_inline)) inline void dot_any_rows(int64_t M, const float* x, const W* w,
                                                        const float* scale, const float* bias,
                                                        float* y, int64_t K, int64_t N, int64_t n) {
  const W* rows = w + n * K;
  switch (M) {
    case 1: return dot_rows<W, 1, R>(x, rows, scale, bias, y, K, N, n);
    case 2: return dot_rows<W, 2, R>(x, rows, scale, bias, y, K, N, n);
    case 3: return dot_rows<W, 3, R>(x, rows, scale, bias, y, K, N, n);
    case 4: return dot_rows<W, 4, R>(x, rows, scale, bias, y, K, N, n);
    case 5: return dot_rows<W, 5, R>(x, rows, scale, bias, y, K, N, n);
    case 6: return dot_rows<W, 6, R>(x, rows, scale, bias, y, K, N, n);
    case 7: return dot_rows<W, 7, R>(x, rows, scale, bias, y, K, N, n);
    case 8: return dot_rows<W, 8, R>(x, rows, scale, bias, y, K, N, n);
  }
}

template <typename W>
__attribute__((always_inline)) inline void columns(int64_t M, const float* x, const W* w, const float* scale, const float* bias,
                     float* y, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  int64_t n = n0;
  if (M == 1) {
    for (; n + RowsFor(1) <= n1; n += RowsFor(1))
      dot_any_rows<W, RowsFor(1)>(M, x, w, scale, bias, y, K, N, n);
  } else {
    for (; n + RowsFor(2) <= n1; n += RowsFor(2))
      dot_any_rows<W, RowsFor(2)>(M, x, w, scale, bias, y, K, N, n);
  }
  for (; n < n1; ++n) dot_any_rows<W, 1>(M, x, w, scale, bias, y, K, N, n);  // the last < R
}

// target_clones does not take templates: one overload, and clone set, per storage
// type.
PER_ISA void columns_stored(int64_t M, const float* x, const float* w, const float* scale,
                         const float* bias, float* y, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  columns(M, x, w, scale, bias, y, K, N, n0, n1);
}
PER_ISA void columns_stored(int64_t M, const float* x, const c10::Half* w, const float* scale,
                         const float* bias, float* y, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  columns(M, x, w, scale, bias, y, K, N, n0, n1);
}
PER_ISA void columns_stored(int64_t M, const float* x, const c10::BFloat16* w, const float* scale,
                          const float* bias, float* y, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  columns(M, x, w, scale, bias, y, K, N, n0, n1);
}
PER_ISA void columns_stored(int64_t M, const float* x, const int8_t* w, const float* scale,
                        const float* bias, float* y, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  columns(M, x, w, scale, bias, y, K, N, n0, n1);
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
  TORCH_CHECK(weight.size(1) == K && K % kLanes == 0, "in_features must match and be a multiple of ",
              kLanes);
  const float* s = optional_floats(scale, N, "scale");
  const float* b = optional_floats(bias, N, "bias");
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // Each of torch's intra-op threads takes a contiguous share of the output columns.
  at::parallel_for(0, N, kMinColumnsPerThread, [&](int64_t n0, int64_t n1) {
    switch (stored) {
      case at::kHalf:
        return columns_stored(M, xp, weight.data_ptr<c10::Half>(), s, b, yp, K, N, n0, n1);
      case at::kBFloat16:
        return columns_stored(M, xp, weight.data_ptr<c10::BFloat16>(), s, b, yp, K, N, n0, n1);
      case at::kChar: return columns_stored(M, xp, weight.data_ptr<int8_t>(), s, b, yp, K, N, n0, n1);
      default: return columns_stored(M, xp, weight.data_ptr<float>(), s, b, yp, K, N, n0, n1);
    }
  });
  return y;
}

}  // namespace

// A registered op, so that torch's profiler sees it by name and shapes.
TORCH_LIBRARY_FRAGMENT(minibatch, m) {
  m.def("skinny_linear(Tensor x, Tensor weight, Tensor? scale, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(minibatch, CPU, m) { m.impl("skinny_linear", &skinny_linear); }
