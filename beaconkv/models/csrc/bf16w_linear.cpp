// y = x @ W.T (+ b) with W stored in bfloat16 and x, y, the products and the sums in float32.
//
// For CPUs with AVX2 + FMA but no native bfloat16 matmul: a decode step multiplies a few rows by
// every weight matrix, so the step is bound by the bytes of weights read. Reading bf16 weights
// (half of fp32) and widening each 8-wide vector once in registers, reused by up to 8 rows, keeps
// the bf16 model's bytes at fp32's instruction count. Built at first use by
// beaconkv/models/bf16w.py (torch.utils.cpp_extension); registered as beaconkv_cpu::bf16w_linear.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

constexpr int kMaxRows = 8;  // rows sharing one widened weight vector (8 accumulators + 2 temporaries)

inline __m256 load_bf16x8(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline float bf16_to_float(uint16_t v) {
  const uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline float horizontal_sum(__m256 v) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  __m128 shuf = _mm_movehdup_ps(lo);
  __m128 sums = _mm_add_ps(lo, shuf);
  shuf = _mm_movehl_ps(shuf, sums);
  return _mm_cvtss_f32(_mm_add_ss(sums, shuf));
}

// Output columns [n0, n1) of R rows: x is (R, K) row-major, w (N, K), y (R, N).
template <int R>
void columns(const float* x, const uint16_t* w, const float* bias, float* y, int64_t K, int64_t N, int64_t n0,
             int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const uint16_t* row = w + n * K;
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
      const __m256 wv = load_bf16x8(row + k);
      for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + r * K + k), acc[r]);
    }
    for (int r = 0; r < R; ++r) {
      float s = horizontal_sum(acc[r]);
      for (int64_t j = k; j < K; ++j) s += bf16_to_float(row[j]) * x[r * K + j];
      y[r * N + n] = bias != nullptr ? s + bias[n] : s;
    }
  }
}

void rows_block(int rows, const float* x, const uint16_t* w, const float* bias, float* y, int64_t K, int64_t N,
                int64_t n0, int64_t n1) {
  switch (rows) {
    case 1: return columns<1>(x, w, bias, y, K, N, n0, n1);
    case 2: return columns<2>(x, w, bias, y, K, N, n0, n1);
    case 3: return columns<3>(x, w, bias, y, K, N, n0, n1);
    case 4: return columns<4>(x, w, bias, y, K, N, n0, n1);
    case 5: return columns<5>(x, w, bias, y, K, N, n0, n1);
    case 6: return columns<6>(x, w, bias, y, K, N, n0, n1);
    case 7: return columns<7>(x, w, bias, y, K, N, n0, n1);
    default: return columns<8>(x, w, bias, y, K, N, n0, n1);
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
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t m = 0; m < M; m += kMaxRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kMaxRows, M - m));
      rows_block(rows, xp + m * K, wp, b, yp + m * N, K, N, n0, n1);
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(beaconkv_cpu, m) { m.def("bf16w_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor"); }

TORCH_LIBRARY_IMPL(beaconkv_cpu, CPU, m) { m.impl("bf16w_linear", &bf16w_linear); }
