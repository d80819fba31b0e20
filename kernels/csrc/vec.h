// Vector helpers shared by the CPU kernels: 8 fp32 lanes (one AVX2 register) through GCC/Clang
// vector extensions, and bf16 storage (uint16_t, the top half of an fp32) converted on load and
// rounded to nearest even on store. Kernels are templates over the stored element type `T`
// (float or bf16); arithmetic is always fp32.

#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace agentrt {

using bf16 = uint16_t;  // storage of at::BFloat16

typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));  // unaligned access
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint32_t v8w __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16), aligned(2)));  // 8 bf16, unaligned
typedef uint32_t v8wu __attribute__((vector_size(32), aligned(2)));  // 8 bf16 pairs, unaligned

inline v8 splat(float x) { return v8{x, x, x, x, x, x, x, x}; }

// One cache line into L1 (prefetch_l1) or L2 (prefetch_l2). asm statements: GCC (-O3) dropped __builtin_prefetch
// from the kernels' inlined loops.
inline void prefetch_l1(const char* p) {
#if defined(__x86_64__)
  asm volatile("prefetcht0 %0" : : "m"(*p));
#else
  __builtin_prefetch(p, 0, 3);
#endif
}
inline void prefetch_l2(const char* p) {
#if defined(__x86_64__)
  asm volatile("prefetcht1 %0" : : "m"(*p));
#else
  __builtin_prefetch(p, 0, 2);
#endif
}

inline float to_f32(float x) { return x; }
inline float to_f32(bf16 x) {
  const uint32_t u = uint32_t(x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Round-to-nearest-even fp32 -> bf16 bits (NaN stays a quiet NaN), as torch rounds.
inline bf16 f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16((u >> 16) | 0x40);
  return bf16((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

template <typename T>
inline T from_f32(float x);
template <>
inline float from_f32<float>(float x) { return x; }
template <>
inline bf16 from_f32<bf16>(float x) { return f32_to_bf16(x); }

// x rounded to T's precision, kept in fp32: what a torch op in dtype T stores between two steps.
template <typename T>
inline float round_as(float x) { return to_f32(from_f32<T>(x)); }

inline v8 load8(const float* p) { return *reinterpret_cast<const v8u*>(p); }
inline v8 load8(const bf16* p) {
#if defined(__AVX2__)
  return (v8)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16);
#else
  const v8h h = *reinterpret_cast<const v8h*>(p);
  return (v8)(__builtin_convertvector(h, v8w) << 16);
#endif
}

inline v8w round_bits(v8 x) {  // bf16 bits in the high half of each lane
  const v8w u = (v8w)x;
  const v8w rounded = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  const v8w nan = (v8w)((u & 0x7fffffffu) > 0x7f800000u);
  return (nan & ((u | 0x400000u) & 0xffff0000u)) | (~nan & rounded);
}

inline void store8(float* p, v8 x) { *reinterpret_cast<v8u*>(p) = x; }
inline void store8(bf16* p, v8 x) {
#if defined(__AVX512BF16__)
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), (__m128i)_mm256_cvtneps_pbh((__m256)x));
#else
  *reinterpret_cast<v8h*>(p) = __builtin_convertvector(round_bits(x) >> 16, v8h);
#endif
}

template <typename T>
inline v8 round_as(v8 x);
template <>
inline v8 round_as<float>(v8 x) { return x; }
template <>
inline v8 round_as<bf16>(v8 x) { return (v8)round_bits(x); }

inline float hsum(v8 x) {
  typedef float v4 __attribute__((vector_size(16)));
  v4 h = __builtin_shufflevector(x, x, 0, 1, 2, 3) + __builtin_shufflevector(x, x, 4, 5, 6, 7);
  h += __builtin_shufflevector(h, h, 2, 3, 0, 1);
  return h[0] + h[1];
}

// s[0..3] = the lane sums of a0..a3 (two pairwise-add levels, then the two 128-bit halves).
inline void hsum4(v8 a0, v8 a1, v8 a2, v8 a3, float* s) {
  typedef float v4u __attribute__((vector_size(16), aligned(4)));
  const v8 h01 = __builtin_shufflevector(a0, a1, 0, 2, 8, 10, 4, 6, 12, 14) +
                 __builtin_shufflevector(a0, a1, 1, 3, 9, 11, 5, 7, 13, 15);
  const v8 h23 = __builtin_shufflevector(a2, a3, 0, 2, 8, 10, 4, 6, 12, 14) +
                 __builtin_shufflevector(a2, a3, 1, 3, 9, 11, 5, 7, 13, 15);
  const v8 h = __builtin_shufflevector(h01, h23, 0, 2, 8, 10, 4, 6, 12, 14) +
               __builtin_shufflevector(h01, h23, 1, 3, 9, 11, 5, 7, 13, 15);
  *reinterpret_cast<v4u*>(s) = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
}

// exp: Cephes' expf (range reduction by ln 2, degree-5 polynomial), about 1 ulp; inputs are
// clamped to [-87, 88] (below: ~1e-38 instead of 0 or a denormal; above: ~1.6e38 instead of inf).
inline v8 exp8(v8 x) {
  x = x < splat(-87.0f) ? splat(-87.0f) : x;
  x = x > splat(88.0f) ? splat(88.0f) : x;
  v8 fx = x * splat(1.44269504088896341f) + splat(0.5f);
  v8 t = __builtin_convertvector(__builtin_convertvector(fx, v8i), v8);  // truncate
  fx = t - (t > fx ? splat(1.f) : splat(0.f));                              // floor
  x = x - fx * splat(0.693359375f) - fx * splat(-2.12194440e-4f);
  v8 z = x * x;
  v8 y = splat(1.9875691500e-4f);
  y = y * x + splat(1.3981999507e-3f);
  y = y * x + splat(8.3334519073e-3f);
  y = y * x + splat(4.1665795894e-2f);
  y = y * x + splat(1.6666665459e-1f);
  y = y * x + splat(5.0000001201e-1f);
  y = y * z + x + splat(1.f);
  v8i n = (__builtin_convertvector(fx, v8i) + 127) << 23;
  return y * (v8)n;
}

// The largest of row[0, V) (-inf for none) and whether any is NaN (NaNs take no part in the maximum).
template <typename T>
inline float row_max(const T* row, int64_t V, bool* any_nan) {
  const float neg_inf = -__builtin_inff();
  v8 m = splat(neg_inf);
  v8i nan = {};
  int64_t i = 0;
  for (; i + 8 <= V; i += 8) {
    const v8 v = load8(row + i);
    nan |= v != v;
    m = v > m ? v : m;
  }
  float best = neg_inf;
  bool found = false;
  for (int l = 0; l < 8; ++l) {
    found |= nan[l] != 0;
    best = m[l] > best ? m[l] : best;
  }
  for (; i < V; ++i) {
    const float v = to_f32(row[i]);
    found |= v != v;
    best = v > best ? v : best;
  }
  *any_nan = found;
  return best;
}

// The instruction set this library was compiled for (kernels/cpu.py builds one per CPU kind).
inline const char* compiled_isa() {
#if defined(__AVX512BF16__)
  return "avx512_bf16";
#elif defined(__AVX512F__)
  return "avx512";
#elif defined(__AVX2__)
  return "avx2";
#else
  return "generic";
#endif
}

}  // namespace agentrt
