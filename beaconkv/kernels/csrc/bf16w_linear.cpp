// y = x @ W.T (+ b) with W stored in bfloat16 and x, y, the products and the sums in float32.
//
// For CPUs with AVX2 + FMA but no native bfloat16 matmul: a decode step multiplies a few rows by
// every weight matrix, so the step is bound by the bytes of weights read. Reading bf16 weights
// (half of fp32) and widening each 8-wide vector once in registers, reused by up to 8 rows, keeps
// the bf16 model's bytes at fp32's instruction count. Past 8 rows (a wide pool, a prefill) the
// work is compute-bound: the output columns are cut into tiles whose weights stay in cache while
// every block of rows passes over them, and each block holds 3 columns x 4 rows of accumulators.
// Built at first use by beaconkv/kernels/build.py (torch.utils.cpp_extension); registered as
// beaconkv_cpu::bf16w_linear.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "avx2_bf16.h"

namespace {

using beaconkv_cpu::bf16_to_float;
using beaconkv_cpu::horizontal_sum;
using beaconkv_cpu::load_bf16x8;

constexpr int kMaxRows = 8;    // rows sharing one widened weight vector (8 accumulators + 2 temporaries)
constexpr int kBlockRows = 4;  // rows of a block past kMaxRows rows (3 columns x 4 rows of accumulators)
constexpr int64_t kTile = 48;  // output columns whose weights stay in cache while every row block passes

// y[r, c] for r < R, c < C: x is (R, K) row-major, w points at weight row n (C rows of K), y at
// output column n (row stride N).
template <int C, int R>
inline void block(const float* x, const uint16_t* w, const float* bias, float* y, int64_t K, int64_t N) {
  __m256 acc[C][R];
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r) acc[c][r] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 wv[C];
    for (int c = 0; c < C; ++c) wv[c] = load_bf16x8(w + c * K + k);
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + r * K + k);
      for (int c = 0; c < C; ++c) acc[c][r] = _mm256_fmadd_ps(wv[c], xv, acc[c][r]);
    }
  }
  for (int c = 0; c < C; ++c) {
    for (int r = 0; r < R; ++r) {
      float s = horizontal_sum(acc[c][r]);
      for (int64_t j = k; j < K; ++j) s += bf16_to_float(w[c * K + j]) * x[r * K + j];
      y[r * N + c] = bias != nullptr ? s + bias[c] : s;
    }
  }
}

// Output columns [n0, n1) of R rows, C columns at a time (the last (n1 - n0) mod C one at a time).
template <int C, int R>
void columns(const float* x, const uint16_t* w, const float* bias, float* y, int64_t K, int64_t N, int64_t n0,
             int64_t n1) {
  int64_t n = n0;
  for (; n + C <= n1; n += C) block<C, R>(x, w + n * K, bias != nullptr ? bias + n : nullptr, y + n, K, N);
  for (; n < n1; ++n) block<1, R>(x, w + n * K, bias != nullptr ? bias + n : nullptr, y + n, K, N);
}

// Up to kMaxRows rows sharing each widened weight vector, one column at a time (memory-bound sizes).
void few_rows(int rows, const float* x, const uint16_t* w, const float* bias, float* y, int64_t K, int64_t N,
              int64_t n0, int64_t n1) {
  switch (rows) {
    case 1: return columns<1, 1>(x, w, bias, y, K, N, n0, n1);
    case 2: return columns<1, 2>(x, w, bias, y, K, N, n0, n1);
    case 3: return columns<1, 3>(x, w, bias, y, K, N, n0, n1);
    case 4: return columns<1, 4>(x, w, bias, y, K, N, n0, n1);
    case 5: return columns<1, 5>(x, w, bias, y, K, N, n0, n1);
    case 6: return columns<1, 6>(x, w, bias, y, K, N, n0, n1);
    case 7: return columns<1, 7>(x, w, bias, y, K, N, n0, n1);
    default: return columns<1, 8>(x, w, bias, y, K, N, n0, n1);
  }
}

// A block of up to kBlockRows rows of a compute-bound product: several columns per widened load.
void row_block(int rows, const float* x, const uint16_t* w, const float* bias, float* y, int64_t K, int64_t N,
               int64_t n0, int64_t n1) {
  switch (rows) {
    case 1: return columns<1, 1>(x, w, bias, y, K, N, n0, n1);
    case 2: return columns<2, 2>(x, w, bias, y, K, N, n0, n1);
    case 3: return columns<3, 3>(x, w, bias, y, K, N, n0, n1);
    default: return columns<3, 4>(x, w, bias, y, K, N, n0, n1);
  }
}

at::Tensor bf16w_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "bf16w_linear: x must be (rows, in_features) and weight (out_features, in_features); got ",
              x.sizes(), " and ", weight.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kBFloat16,
              "bf16w_linear: x must be float32 and weight bfloat16; got ", x.scalar_type(), " and ",
              weight.scalar_type());
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "bf16w_linear: CPU tensors only");
  const at::Tensor xc = x.contiguous();
  const at::Tensor wc = weight.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), N = wc.size(0);
  at::Tensor y = at::empty({M, N}, xc.options());
  at::Tensor bc;
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "bf16w_linear: bias must have ", N, " entries, got ", bias->numel());
    bc = bias->to(at::kFloat).contiguous();
    b = bc.data_ptr<float>();
  }
  if (M == 0 || N == 0) return y;
  const float* xp = xc.data_ptr<float>();
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(wc.data_ptr<at::BFloat16>());
  float* yp = y.data_ptr<float>();
  if (M <= kMaxRows) {  // one pass over the weights, each column's vector widened once for every row
    at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) { few_rows(static_cast<int>(M), xp, wp, b, yp, K, N, n0, n1); });
    return y;
  }
  // tiles of columns, every row block over each tile while its weights are in cache; rows in blocks
  // of at most kBlockRows, as even as possible (14 rows: 3 + 3 + 4 + 4)
  const int64_t blocks = (M + kBlockRows - 1) / kBlockRows;
  const int64_t tiles = (N + kTile - 1) / kTile;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * kTile, n1 = std::min(N, n0 + kTile);
      for (int64_t i = 0, m = 0; i < blocks; ++i) {
        const int rows = static_cast<int>((M - m) / (blocks - i));
        row_block(rows, xp + m * K, wp, b, yp + m * N, K, N, n0, n1);
        m += rows;
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(beaconkv_cpu, m) { m.def("bf16w_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor"); }

TORCH_LIBRARY_IMPL(beaconkv_cpu, CPU, m) { m.impl("bf16w_linear", &bf16w_linear); }
