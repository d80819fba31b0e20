// y[M, N] = x[M, K] @ W[N, K]^T (+ bias) where W stays in a GGUF (ggml) block format: each weight row is
// K / B blocks of B weights (B = 32, or 256 for the K-quants), every block a few scales and packed
// integers. The block layouts (ggml-common.h; weight j of a block is w_j):
//
//   Q8_0  34 B: fp16 d, int8 q[32]                     w_j = d * q_j
//   Q4_0  18 B: fp16 d, u8 qs[16]                      w_j = d * (nibble_j - 8); nibbles: qs[j] & 15 for
//                                                       j < 16, qs[j - 16] >> 4 after
//   Q4_1  20 B: fp16 d, fp16 m, u8 qs[16]              w_j = d * nibble_j + m
//   Q5_0  22 B: fp16 d, u32 qh, u8 qs[16]              w_j = d * ((nibble_j | bit_j(qh) << 4) - 16)
//   Q4_K 144 B: fp16 d, fp16 dmin, u8 scales[12],      8 sub-blocks of 32 with 6-bit scale s_i and min m_i
//               u8 qs[128]                             (packed in `scales`); w = d*s_i * nibble - dmin*m_i;
//                                                       sub-blocks 2p and 2p+1 are the low / high nibbles of
//                                                       qs[32p .. 32p+32]
//   Q5_K 176 B: as Q4_K plus u8 qh[32] (after scales)  the fifth bit of sub-block i's weight l is bit i of qh[l]
//   Q6_K 210 B: u8 ql[128], u8 qh[64], int8 sc[16],    16 sub-blocks of 16, w = d * sc_i * (q - 32), q six bits:
//               fp16 d                                 four from ql, two from qh (layout in dequant_q6_k)
//   MXFP4 17 B: u8 e (E8M0), u8 qs[16]                 w_j = 2^(e - 128) * v(nibble_j), v the E2M1 code's value
//                                                       doubled: {0, 1, 2, 3, 4, 6, 8, 12}, sign bit 3 (gpt-oss's
//                                                       experts; ggml's type 39); nibbles as Q4_0's
//
// The weight keeps that byte layout ([N, K / B * bytes], as the GGUF file stores it), so memory holds the
// file's bytes and a decode step reads them once. Many rows (prefill): threads take panels of 16 weight rows;
// a panel is decoded to fp32 once ([16, K], 16 K floats: L2) and every row of x runs over it in register
// tiles of 3-4 rows of x by 4 weight rows (`quant_dot_tile`). 1-4 rows (decode): 4 weight rows at a time,
// block by block through an L1 buffer (`quant_rows_blockwise`). Both sum each output in the same lanes and
// k order, so a row's output does not depend on the other rows of the call, nor on the path (the engine's
// deterministic mode costs nothing here).
// Decoding rounds exactly once where the product does not fit fp32 (Q6_K's d * sc * q), so a block decodes
// to the fp32 rounding of its exact value, whatever the ISA. Accumulation is fp32.

#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "linear.h"
#include "team.h"
#include "vec.h"

#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace agentrt {

// ggml's type ids (ggml.h enum ggml_type), as GGUF files and gguf.GGMLQuantizationType number them
enum QuantType : int64_t {
  kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14, kMXFP4 = 39
};


// Eight bytes are handled as one uint64 (GCC's byte vectors shift and convert lane by lane through scalar
// registers): a shift right by s moves the next byte's low bits into each byte's top s bits, so every
// shift is followed by a mask of at most 8 - s low bits per byte.
using u8x8 = uint64_t;
constexpr u8x8 kBytes1 = 0x0101010101010101ull;
typedef int8_t v8sb __attribute__((vector_size(8), aligned(1)));

inline float fp16_to_f32(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = uint32_t(h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ffu;
  uint32_t u;
  if (exp == 0x1f) {
    u = sign | 0x7f800000u | (man << 13);
  } else if (exp != 0) {
    u = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    u = sign;
  } else {  // subnormal: normalize
    int e = -1;
    uint32_t m = man;
    do {
      ++e;
      m <<= 1;
    } while (!(m & 0x400u));
    u = sign | ((112 - e) << 23) | ((m & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

// 8 bytes -> 8 fp32 lanes
inline v8 u8_to_v8(u8x8 b) {
#if defined(__AVX2__)
  return (v8)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(int64_t(b))));
#else
  v8 out;
  for (int i = 0; i < 8; ++i) out[i] = float((b >> (8 * i)) & 0xff);
  return out;
#endif
}
inline v8 s8_to_v8(const int8_t* p) {
#if defined(__AVX2__)
  return (v8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  return __builtin_convertvector(*reinterpret_cast<const v8sb*>(p), v8);
#endif
}
inline u8x8 load_u8x8(const uint8_t* p) {
  u8x8 b;
  std::memcpy(&b, p, 8);
  return b;
}

// ------------------------------------------------------------------------------------ block decoders

#if defined(__AVX512F__)
typedef float f32x16 __attribute__((vector_size(64)));
typedef float f32x16u __attribute__((vector_size(64), aligned(4)));
inline void store_f32x16(float* p, f32x16 x) { *reinterpret_cast<f32x16u*>(p) = x; }
inline f32x16 splat_f32x16(float x) { return (f32x16)_mm512_set1_ps(x); }
inline f32x16 u8_to_v16(__m128i b) { return (f32x16)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b)); }
inline __m128i load16b(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
inline __m128i low_nibbles(__m128i b) { return _mm_and_si128(b, _mm_set1_epi8(15)); }
inline __m128i high_nibbles(__m128i b) { return _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(15)); }
#endif

inline void dequant_q8_0(const uint8_t* blk, float* y) {
#if defined(__AVX512F__)
  const f32x16 d = splat_f32x16(fp16_to_f32(blk));
  for (int i = 0; i < 32; i += 16)
    store_f32x16(y + i, d * (f32x16)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(load16b(blk + 2 + i))));
#else
  const v8 d = splat(fp16_to_f32(blk));
  for (int i = 0; i < 32; i += 8) store8(y + i, d * s8_to_v8(reinterpret_cast<const int8_t*>(blk + 2 + i)));
#endif
}

inline void dequant_q4_0(const uint8_t* blk, float* y) {
#if defined(__AVX512F__)
  const f32x16 d16 = splat_f32x16(fp16_to_f32(blk));
  const __m128i q = load16b(blk + 2);
  store_f32x16(y, d16 * (u8_to_v16(low_nibbles(q)) - 8.f));
  store_f32x16(y + 16, d16 * (u8_to_v16(high_nibbles(q)) - 8.f));
#else
  const v8 d = splat(fp16_to_f32(blk));
  for (int i = 0; i < 16; i += 8) {
    const u8x8 b = load_u8x8(blk + 2 + i);
    store8(y + i, d * (u8_to_v8(b & 15 * kBytes1) - 8.f));
    store8(y + 16 + i, d * (u8_to_v8((b >> 4) & 15 * kBytes1) - 8.f));
  }
#endif
}

inline void dequant_q4_1(const uint8_t* blk, float* y) {
#if defined(__AVX512F__)
  const f32x16 d16 = splat_f32x16(fp16_to_f32(blk)), m16 = splat_f32x16(fp16_to_f32(blk + 2));
  const __m128i q = load16b(blk + 4);
  store_f32x16(y, d16 * u8_to_v16(low_nibbles(q)) + m16);
  store_f32x16(y + 16, d16 * u8_to_v16(high_nibbles(q)) + m16);
#else
  const v8 d = splat(fp16_to_f32(blk)), m = splat(fp16_to_f32(blk + 2));
  for (int i = 0; i < 16; i += 8) {
    const u8x8 b = load_u8x8(blk + 4 + i);
    store8(y + i, d * u8_to_v8(b & 15 * kBytes1) + m);  // d * q is exact in fp32: one rounding, FMA or not
    store8(y + 16 + i, d * u8_to_v8((b >> 4) & 15 * kBytes1) + m);
  }
#endif
}

inline void dequant_q5_0(const uint8_t* blk, float* y) {
  const v8 d = splat(fp16_to_f32(blk));
  uint32_t qh;
  std::memcpy(&qh, blk + 2, 4);
  const v8w h = v8w{qh, qh, qh, qh, qh, qh, qh, qh};
  for (int i = 0; i < 16; i += 8) {
    const v8w j = v8w{0, 1, 2, 3, 4, 5, 6, 7} + uint32_t(i);
    const u8x8 b = load_u8x8(blk + 6 + i);
    const v8w hl = ((h >> j) & 1u) << 4, hh = ((h >> (j + 16u)) & 1u) << 4;
    store8(y + i, d * (u8_to_v8(b & 15 * kBytes1) + __builtin_convertvector(hl, v8) - 16.f));
    store8(y + 16 + i, d * (u8_to_v8((b >> 4) & 15 * kBytes1) + __builtin_convertvector(hh, v8) - 16.f));
  }
}

// The 6-bit scale and min of sub-block j (0-7) of a Q4_K / Q5_K block (ggml's get_scale_min_k4).
inline void k_scale_min(const uint8_t* q, int j, float& sc, float& m) {
  if (j < 4) {
    sc = float(q[j] & 63);
    m = float(q[j + 4] & 63);
  } else {
    sc = float((q[j + 4] & 0xf) | ((q[j - 4] >> 6) << 4));
    m = float((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
  }
}

// Q4_K and Q5_K (with `qh`): per pair p of sub-blocks, 32 bytes of qs give sub-block 2p's nibbles (low) and 2p+1's (high).
template <bool kFifthBit>
inline void dequant_k4_k5(const uint8_t* blk, float* y) {
  const float d = fp16_to_f32(blk), dmin = fp16_to_f32(blk + 2);
  const uint8_t* scales = blk + 4;
  const uint8_t* qh = blk + 16;
  const uint8_t* qs = blk + (kFifthBit ? 48 : 16);
  for (int p = 0; p < 4; ++p) {
    float s0, m0, s1, m1;
    k_scale_min(scales, 2 * p, s0, m0);
    k_scale_min(scales, 2 * p + 1, s1, m1);
    const v8 d0 = splat(d * s0), d1 = splat(d * s1), n0 = splat(dmin * m0), n1 = splat(dmin * m1);
    for (int l = 0; l < 32; l += 8) {
      const u8x8 b = load_u8x8(qs + 32 * p + l);
      u8x8 lo = b & 15 * kBytes1, hi = (b >> 4) & 15 * kBytes1;
      if constexpr (kFifthBit) {
        const u8x8 h = load_u8x8(qh + l);
        lo |= ((h >> (2 * p)) & kBytes1) << 4;
        hi |= ((h >> (2 * p + 1)) & kBytes1) << 4;
      }
      store8(y + 64 * p + l, d0 * u8_to_v8(lo) - n0);
      store8(y + 64 * p + 32 + l, d1 * u8_to_v8(hi) - n1);
    }
  }
}

// Q6_K: weight 128h + 32t + l (h < 2, t < 4, l < 32) has low four bits (ql[64h + 32(t % 2) + l] >> 4(t / 2)) & 15,
// high two bits (qh[32h + l] >> 2t) & 3, and scale sc[8h + 2t + l / 16].
inline void dequant_q6_k(const uint8_t* blk, float* y) {
  const uint8_t* ql = blk;
  const uint8_t* qh = blk + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
  const float d = fp16_to_f32(blk + 208);
  for (int h = 0; h < 2; ++h) {
    for (int t = 0; t < 4; ++t) {
      for (int l = 0; l < 32; l += 8) {
        const u8x8 lo = (load_u8x8(ql + 64 * h + 32 * (t % 2) + l) >> (4 * (t / 2))) & 15 * kBytes1;
        const u8x8 hi = (load_u8x8(qh + 32 * h + l) >> (2 * t)) & 3 * kBytes1;
        const v8 q = u8_to_v8(lo | (hi << 4)) - 32.f;
        store8(y + 128 * h + 32 * t + l, splat(d * float(sc[8 * h + 2 * t + l / 16])) * q);
      }
    }
  }
}

// MXFP4: the integers of the 16 E2M1 codes (their values doubled, so the block scale is 2^(e - 128)), and that scale
// from its E8M0 byte as ggml's ggml_e8m0_to_fp32_half computes it (e < 2: the fp32 subnormals 2^-128, 2^-127).
inline constexpr int8_t kMxfp4Ints[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
inline float e8m0_half(uint8_t e) {
  const uint32_t bits = e < 2 ? (0x00200000u << e) : (uint32_t(e - 1) << 23);
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Every product is exact in fp32 (a power of two times at most 4 significant bits).
inline void dequant_mxfp4(const uint8_t* blk, float* y) {
  const float d = e8m0_half(blk[0]);
#if defined(__AVX512F__)
  alignas(64) static constexpr float kValues[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
  const __m512 table = _mm512_load_ps(kValues);
  const f32x16 d16 = splat_f32x16(d);
  const __m128i q = load16b(blk + 1);
  store_f32x16(y, d16 * (f32x16)_mm512_permutexvar_ps(_mm512_cvtepu8_epi32(low_nibbles(q)), table));
  store_f32x16(y + 16, d16 * (f32x16)_mm512_permutexvar_ps(_mm512_cvtepu8_epi32(high_nibbles(q)), table));
#else
  for (int i = 0; i < 16; ++i) {
    y[i] = d * float(kMxfp4Ints[blk[1 + i] & 15]);
    y[i + 16] = d * float(kMxfp4Ints[blk[1 + i] >> 4]);
  }
#endif
}

// A format as the kernels take it: weights and bytes per block, and the block decoder.
template <int64_t kBlockWeights, int64_t kBlockBytes, void (*kDecode)(const uint8_t*, float*)>
struct QuantFormat {
  static constexpr int64_t kBlock = kBlockWeights, kBytes = kBlockBytes;
  static void dequant(const uint8_t* b, float* y) { kDecode(b, y); }
};
using FormatQ8_0 = QuantFormat<32, 34, dequant_q8_0>;
using FormatQ4_0 = QuantFormat<32, 18, dequant_q4_0>;
using FormatQ4_1 = QuantFormat<32, 20, dequant_q4_1>;
using FormatQ5_0 = QuantFormat<32, 22, dequant_q5_0>;
using FormatQ4_K = QuantFormat<256, 144, dequant_k4_k5<false>>;
using FormatQ5_K = QuantFormat<256, 176, dequant_k4_k5<true>>;
using FormatQ6_K = QuantFormat<256, 210, dequant_q6_k>;
using FormatMXFP4 = QuantFormat<32, 17, dequant_mxfp4>;

// Calls fn(Format{}) for a supported type; false for any other.
template <typename Fn>
inline bool by_quant_type(int64_t type, Fn fn) {
  switch (type) {
    case kQ8_0: fn(FormatQ8_0{}); return true;
    case kQ4_0: fn(FormatQ4_0{}); return true;
    case kQ4_1: fn(FormatQ4_1{}); return true;
    case kQ5_0: fn(FormatQ5_0{}); return true;
    case kQ4_K: fn(FormatQ4_K{}); return true;
    case kQ5_K: fn(FormatQ5_K{}); return true;
    case kQ6_K: fn(FormatQ6_K{}); return true;
    case kMXFP4: fn(FormatMXFP4{}); return true;
    default: return false;
  }
}

// ------------------------------------------------------------------------------------ kernels

// w [N, K / B * bytes] -> y [N, K] fp32.
template <typename F>
inline void quant_dequantize(const uint8_t* w, int64_t N, int64_t K, float* y) {
  const int64_t blocks = K / F::kBlock, row_bytes = blocks * F::kBytes;
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t b = 0; b < blocks; ++b) F::dequant(w + n * row_bytes + b * F::kBytes, y + n * K + b * F::kBlock);
  });
}

// The accumulators of both paths: 16 lanes on AVX-512 (one zmm), else 8; an output is summed in the same lanes
// and order by either path.
#if defined(__AVX512F__)
using vacc = f32x16;
constexpr int64_t kAccLanes = 16;
inline vacc load_acc(const float* p) { return *reinterpret_cast<const f32x16u*>(p); }
inline vacc zero_acc() { return splat_f32x16(0.f); }
inline float hsum_acc(vacc a) {
  v8 lo, hi;
  std::memcpy(&lo, &a, 32);
  std::memcpy(&hi, reinterpret_cast<const char*>(&a) + 32, 32);
  return hsum(lo + hi);
}
#else
using vacc = v8;
constexpr int64_t kAccLanes = 8;
inline vacc load_acc(const float* p) { return load8(p); }
inline vacc zero_acc() { return splat(0.f); }
inline float hsum_acc(vacc a) { return hsum(a); }
#endif

// out[m][n] = x_m . w_n for MR rows of x and NR decoded weight rows (both fp32, rows K apart). Lane j of an
// accumulator sums the products of k = j mod kAccLanes in increasing k, then `hsum_acc` adds the lanes in a fixed order:
// an output's summation order depends on nothing but K, whatever the tile or the row count.
template <int MR, int NR>
inline void quant_dot_tile(const float* x, const float* w, int64_t K, const float* bias, float* y, int64_t ldy,
                           int64_t ncols) {
  vacc acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) acc[m][n] = zero_acc();
  for (int64_t k = 0; k < K; k += kAccLanes) {
    for (int n = 0; n < NR; ++n) {
      const vacc b = load_acc(w + n * K + k);
      for (int m = 0; m < MR; ++m) acc[m][n] += load_acc(x + m * K + k) * b;
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR && n < ncols; ++n) y[m * ldy + n] = hsum_acc(acc[m][n]) + (bias ? bias[n] : 0.f);
}

#if defined(__AVX512F__)
constexpr int kQuantTileRows = 4;  // 4 x 4 accumulators of 32 zmm-era registers
#else
constexpr int kQuantTileRows = 3;  // 3 x 4 of AVX2's 16 (FMAs take x from memory)
#endif
constexpr int64_t kQuantTileCols = 4;    // weight rows per tile
constexpr int64_t kQuantPanelRows = 16;  // weight rows decoded per panel
constexpr int64_t kQuantFewRows = 4;     // rows of x up to which the blockwise path runs (at 1-2 rows ~20% faster, at 3-4 even)
constexpr int64_t kQuantTileColsFew = 4;  // weight rows decoded together by the blockwise path

// The decode paths below walk 4 weight rows at a time, and 4 rows are short (an expert's row of 2880 MXFP4 weights is
// 1530 bytes, a SmolLM2 row of 576 Q4_1 weights 360): the hardware's stream prefetch, which starts over in every
// 4 KB page after a few misses, barely gets going before a group ends. So while it walks a group, a walk prefetches
// the next group of rows (the bytes right after it: the 4 rows of the next group, or of the next panel or expert,
// where prefetching is harmless if another thread or nobody reads them), slice `i` of `n` per step. `agentrt bench
// kernels`-style timings on a 2-core Xeon with AMX (gpt-oss-20b's MXFP4 experts, 5760 x 2880, 1 row each, 19 experts
// read from memory): 16.4 -> 10.8 ms; the same 4 experts again and again (from cache): unchanged.
// kL2: into L2 only (prefetcht1), which kept the fill buffers free where a walk's own loads miss too: the K-quants'
// 1-row register path (quant_bf16.h's qdot_rows_kregs) over Qwen3-4B's LM head shape (151936 x 2560, from memory,
// 2 threads) in Q6_K 20.9 -> 17.0 ms, in Q4_K 14.9 -> 12.0; its other shapes and 4 rows even.
template <bool kL2 = false>
inline void prefetch_slice(const uint8_t* next, int64_t bytes, int64_t i, int64_t n) {
  const char* base = reinterpret_cast<const char*>(next);
  for (int64_t o = (i * bytes / n) & ~int64_t(63), hi = (i + 1) * bytes / n; o < hi; o += 64) {
    if constexpr (kL2) {
      prefetch_l2(base + o);
    } else {
      prefetch_l1(base + o);
    }
  }
}

// Few rows (decode): 4 weight rows at a time, block by block: the 4 rows' blocks are decoded into an L1 buffer
// and dotted with each row of x at once, in the same lanes and k order as quant_dot_tile (the same bits).
template <typename F, int MR>
inline void quant_rows_blockwise(const float* x, int64_t K, const uint8_t* w, int64_t row_bytes, int64_t nrows,
                                 const float* bias, float* y, int64_t ldy) {
  constexpr int NR = int(kQuantTileColsFew);
  alignas(64) float buf[NR][F::kBlock];
  vacc acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) acc[m][n] = zero_acc();
  for (int n = int(nrows); n < NR; ++n)
    for (int64_t i = 0; i < F::kBlock; ++i) buf[n][i] = 0.f;
  const int64_t blocks = K / F::kBlock;
  for (int64_t b = 0; b < blocks; ++b) {
    prefetch_slice(w + kQuantTileColsFew * row_bytes, kQuantTileColsFew * row_bytes, b, blocks);
    for (int n = 0; n < nrows; ++n) F::dequant(w + n * row_bytes + b * F::kBytes, buf[n]);
    const float* xb = x + b * F::kBlock;
    for (int64_t i = 0; i < F::kBlock; i += kAccLanes) {
      for (int n = 0; n < NR; ++n) {
        const vacc wv = load_acc(buf[n] + i);
        for (int m = 0; m < MR; ++m) acc[m][n] += load_acc(xb + m * K + i) * wv;
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < nrows; ++n) y[m * ldy + n] = hsum_acc(acc[m][n]) + (bias ? bias[n] : 0.f);
}

// Weight rows n0 .. n0 + rows (rows <= kQuantPanelRows; w, bias and y start at row n0, weight rows row_bytes apart)
// against the M rows of x: y[m * ldy + j] for j < rows. quant_linear's work item, shared with the grouped expert
// projection (moe.h): 1-4 rows of x take the blockwise path (groups of 4 weight rows through L1), more decode
// the panel to fp32 once (`panel`, the caller's thread buffer) and run the register tiles over it.
template <typename F>
inline void quant_panel(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t row_bytes, int64_t rows,
                        const float* bias, float* y, int64_t ldy, std::vector<float>& panel) {
  if (M <= kQuantFewRows) {
    for (int64_t c = 0; c < rows; c += kQuantTileColsFew) {
      const int64_t nrows = std::min(kQuantTileColsFew, rows - c);
      const uint8_t* wg = w + c * row_bytes;
      const float* bg = bias ? bias + c : nullptr;
      switch (M) {
        case 1: quant_rows_blockwise<F, 1>(x, K, wg, row_bytes, nrows, bg, y + c, ldy); break;
        case 2: quant_rows_blockwise<F, 2>(x, K, wg, row_bytes, nrows, bg, y + c, ldy); break;
        case 3: quant_rows_blockwise<F, 3>(x, K, wg, row_bytes, nrows, bg, y + c, ldy); break;
        default: quant_rows_blockwise<F, 4>(x, K, wg, row_bytes, nrows, bg, y + c, ldy); break;
      }
    }
    return;
  }
  const int64_t blocks = K / F::kBlock;
  panel.resize(size_t(K * kQuantPanelRows));
  for (int64_t r = 0; r < kQuantPanelRows; ++r) {
    float* dst = panel.data() + r * K;
    if (r >= rows) {
      std::fill(dst, dst + K, 0.f);
      continue;
    }
    for (int64_t b = 0; b < blocks; ++b) F::dequant(w + r * row_bytes + b * F::kBytes, dst + b * F::kBlock);
  }
  for (int64_t m0 = 0; m0 < M; m0 += kQuantTileRows) {
    const float* xm = x + m0 * K;
    for (int64_t c = 0; c < rows; c += kQuantTileCols) {
      const float* wc = panel.data() + c * K;
      const float* bc = bias ? bias + c : nullptr;
      float* yc = y + m0 * ldy + c;
      const int64_t nc = std::min(kQuantTileCols, rows - c);
      switch (std::min<int64_t>(kQuantTileRows, M - m0)) {
        case 1: quant_dot_tile<1, kQuantTileCols>(xm, wc, K, bc, yc, ldy, nc); break;
        case 2: quant_dot_tile<2, kQuantTileCols>(xm, wc, K, bc, yc, ldy, nc); break;
#if defined(__AVX512F__)
        case 3: quant_dot_tile<3, kQuantTileCols>(xm, wc, K, bc, yc, ldy, nc); break;
#endif
        default: quant_dot_tile<kQuantTileRows, kQuantTileCols>(xm, wc, K, bc, yc, ldy, nc); break;
      }
    }
  }
}

// Threads take panels of 16 weight rows (quant_panel).
template <typename F>
inline void quant_linear(const float* x, int64_t M, int64_t K, const uint8_t* w, const float* bias, float* y,
                         int64_t N) {
  const int64_t panels = (N + kQuantPanelRows - 1) / kQuantPanelRows, row_bytes = K / F::kBlock * F::kBytes;
  agentrt::stealing_for(panels, [&](int64_t p0, int64_t p1) {
    thread_local std::vector<float> panel;
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * kQuantPanelRows;
      quant_panel<F>(x, M, K, w + n0 * row_bytes, row_bytes, std::min(kQuantPanelRows, N - n0),
                     bias ? bias + n0 : nullptr, y + n0, N, panel);
    }
  });
}

}  // namespace agentrt
