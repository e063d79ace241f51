// AVX2 helpers shared by the CPU kernels: bf16 -> fp32 widening and an 8-lane horizontal sum.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace beaconkv_cpu {

// 8 consecutive bf16 values widened to 8 fp32 lanes (a bf16 is the high half of an fp32).
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

}  // namespace beaconkv_cpu
