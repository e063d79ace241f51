// Decode attention of float32 queries over a bfloat16 KV cache, in float32, without widening the cache.
//
// A session whose matmuls compute in float32 on a bf16 model (the bf16w kernels) keeps its cache in
// bf16, so that it costs what the caller sized. PyTorch's attention needs one dtype, so each step
// would first widen every layer's whole cache to float32 (write twice its bytes, read them again) —
// most of a step's non-matmul time. Here each (sequence, KV head) reads its bf16 keys and values once,
// widening 8 lanes at a time in registers: logits, a masked softmax and the weighted sum of values,
// all in float32. Built with the bf16w kernel by beaconkv/kernels/build.py; registered as
// beaconkv_cpu::mixed_attention.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "avx2_bf16.h"

namespace {

using beaconkv_cpu::horizontal_sum;
using beaconkv_cpu::load_bf16x8;

// exp(x) for 8 lanes (range reduction to 2^n * exp(r), |r| <= ln2/2, degree-6 polynomial; relative
// error about 1e-7); lanes below -87.3 (masked slots carry -inf) give exactly 0.
inline __m256 exp8(__m256 x) {
  const __m256 below = _mm256_cmp_ps(x, _mm256_set1_ps(-87.3f), _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(below, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

// One (sequence, KV head): q (G, D) float32, k and v (S, D) bf16, valid (S), out (G, D); logits is
// scratch of G x S8 floats (S8: S rounded up to 8), top scratch of G floats.
void one_head(const float* q, const uint16_t* k, const uint16_t* v, const bool* valid, float* out, float* logits,
              float* top, int64_t G, int64_t S, int64_t S8, int64_t D, float scale) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  std::fill(top, top + G, neg_inf);
  for (int64_t s = 0; s < S8; ++s) {
    if (s >= S || !valid[s]) {
      for (int64_t g = 0; g < G; ++g) logits[g * S8 + s] = neg_inf;
      continue;
    }
    const uint16_t* ks = k + s * D;
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = q + g * D;
      __m256 acc = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(qg + d), load_bf16x8(ks + d), acc);
      const float l = horizontal_sum(acc) * scale;
      logits[g * S8 + s] = l;
      top[g] = std::max(top[g], l);
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    float* og = out + g * D;
    for (int64_t d = 0; d < D; ++d) og[d] = 0.0f;
    if (top[g] == neg_inf) continue;  // no valid slot: zeros (a slot that is not decoding)
    float* lg = logits + g * S8;
    const __m256 m = _mm256_set1_ps(top[g]);
    __m256 total = _mm256_setzero_ps();
    for (int64_t s = 0; s < S8; s += 8) {
      const __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(lg + s), m));
      _mm256_storeu_ps(lg + s, p);
      total = _mm256_add_ps(total, p);
    }
    const float inv = 1.0f / horizontal_sum(total);
    for (int64_t s = 0; s < S; ++s) {
      const float p = lg[s];
      if (p == 0.0f) continue;
      const __m256 pv = _mm256_set1_ps(p * inv);
      const uint16_t* vs = v + s * D;
      for (int64_t d = 0; d < D; d += 8)
        _mm256_storeu_ps(og + d, _mm256_fmadd_ps(pv, load_bf16x8(vs + d), _mm256_loadu_ps(og + d)));
    }
  }
}

at::Tensor mixed_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                           double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.sizes() == k.sizes() && q.size(0) == k.size(0) &&
                  q.size(1) == k.size(1) && q.size(3) == k.size(3),
              "mixed_attention: q must be (batch, kv_heads, group, head_dim) and k, v (batch, kv_heads, slots, "
              "head_dim); got ", q.sizes(), ", ", k.sizes(), " and ", v.sizes());
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16,
              "mixed_attention: q must be float32 and k, v bfloat16; got ", q.scalar_type(), ", ", k.scalar_type(),
              " and ", v.scalar_type());
  TORCH_CHECK(q.size(3) % 8 == 0, "mixed_attention: head_dim must be a multiple of 8, got ", q.size(3));
  TORCH_CHECK(mask.scalar_type() == at::kBool, "mixed_attention: mask must be bool, got ", mask.scalar_type());
  const int64_t B = k.size(0), H = k.size(1), S = k.size(2), D = k.size(3), G = q.size(2);
  const at::Tensor valid = mask.expand({B, H, 1, S}).contiguous();
  const at::Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  at::Tensor out = at::empty({B, H, G, D}, qc.options());
  const int64_t S8 = (S + 7) / 8 * 8;
  const float* qp = qc.data_ptr<float>();
  const uint16_t* kp = reinterpret_cast<const uint16_t*>(kc.data_ptr<at::BFloat16>());
  const uint16_t* vp = reinterpret_cast<const uint16_t*>(vc.data_ptr<at::BFloat16>());
  const bool* mp = valid.data_ptr<bool>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, B * H, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> scratch(G * S8 + G);  // logits, then each query's top logit: once per chunk of heads
    for (int64_t i = i0; i < i1; ++i)
      one_head(qp + i * G * D, kp + i * S * D, vp + i * S * D, mp + i * S, op + i * G * D, scratch.data(),
               scratch.data() + G * S8, G, S, S8, D, static_cast<float>(scale));
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(beaconkv_cpu, m) {
  m.def("mixed_attention(Tensor q, Tensor k, Tensor v, Tensor mask, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(beaconkv_cpu, CPU, m) { m.impl("mixed_attention", &mixed_attention); }
