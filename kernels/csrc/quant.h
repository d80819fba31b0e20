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
//
// The weight keeps that byte layout ([N, K / B * bytes], as the GGUF file stores it), so memory holds the
// file's bytes and a decode step reads them once. Two paths:
// - few rows (decode, M <= kQuantFewRows): each block is decoded once into an L1 buffer of B floats and
//   dotted with every row of x (fp32 FMAs): one pass over the packed weight;
// - many rows (prefill): a panel of 16 weight rows is decoded to fp32 once ([K, 16], the layout of
//   packed_linear's fp32 panels, linear.h) and all M rows run through linear.h's fp32 register tiles: the
//   decode cost is amortized over the rows, the GEMM is the fp32 one.
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

#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace agentrt {

// ggml's type ids (ggml.h enum ggml_type), as GGUF files and gguf.GGMLQuantizationType number them
enum QuantType : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14 };

constexpr int64_t kQuantFewRows = 4;  // rows of x up to which the block-at-a-time path beats the panel path

typedef uint8_t v8b __attribute__((vector_size(8), aligned(1)));
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

inline v8 u8_to_v8(v8b b) { return __builtin_convertvector(b, v8); }
inline v8b load_v8b(const uint8_t* p) { return *reinterpret_cast<const v8b*>(p); }

// ------------------------------------------------------------------------------------ block decoders

inline void dequant_q8_0(const uint8_t* blk, float* y) {
  const v8 d = splat(fp16_to_f32(blk));
  for (int i = 0; i < 32; i += 8) store8(y + i, d * __builtin_convertvector(*reinterpret_cast<const v8sb*>(blk + 2 + i), v8));
}

inline void dequant_q4_0(const uint8_t* blk, float* y) {
  const v8 d = splat(fp16_to_f32(blk));
  for (int i = 0; i < 16; i += 8) {
    const v8b b = load_v8b(blk + 2 + i);
    store8(y + i, d * (u8_to_v8(b & 15) - 8.f));
    store8(y + 16 + i, d * (u8_to_v8(b >> 4) - 8.f));
  }
}

inline void dequant_q4_1(const uint8_t* blk, float* y) {
  const v8 d = splat(fp16_to_f32(blk)), m = splat(fp16_to_f32(blk + 2));
  for (int i = 0; i < 16; i += 8) {
    const v8b b = load_v8b(blk + 4 + i);
    store8(y + i, d * u8_to_v8(b & 15) + m);  // d * q is exact in fp32: one rounding, FMA or not
    store8(y + 16 + i, d * u8_to_v8(b >> 4) + m);
  }
}

inline void dequant_q5_0(const uint8_t* blk, float* y) {
  const v8 d = splat(fp16_to_f32(blk));
  uint32_t qh;
  std::memcpy(&qh, blk + 2, 4);
  const v8w h = v8w{qh, qh, qh, qh, qh, qh, qh, qh};
  for (int i = 0; i < 16; i += 8) {
    const v8w j = v8w{0, 1, 2, 3, 4, 5, 6, 7} + uint32_t(i);
    const v8w b = __builtin_convertvector(load_v8b(blk + 6 + i), v8w);
    const v8w lo = (b & 15u) | (((h >> j) & 1u) << 4), hi = (b >> 4) | (((h >> (j + 16u)) & 1u) << 4);
    store8(y + i, d * (__builtin_convertvector(lo, v8) - 16.f));
    store8(y + 16 + i, d * (__builtin_convertvector(hi, v8) - 16.f));
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
      const v8b b = load_v8b(qs + 32 * p + l);
      v8b lo = b & 15, hi = b >> 4;
      if constexpr (kFifthBit) {
        const v8b h = load_v8b(qh + l);
        lo |= ((h >> (2 * p)) & 1) << 4;
        hi |= ((h >> (2 * p + 1)) & 1) << 4;
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
        const v8b lo = (load_v8b(ql + 64 * h + 32 * (t % 2) + l) >> (4 * (t / 2))) & 15;
        const v8b hi = (load_v8b(qh + 32 * h + l) >> (2 * t)) & 3;
        const v8 q = u8_to_v8(lo | (hi << 4)) - 32.f;
        store8(y + 128 * h + 32 * t + l, splat(d * float(sc[8 * h + 2 * t + l / 16])) * q);
      }
    }
  }
}

template <int64_t kType>
struct QuantFormat;
template <>
struct QuantFormat<kQ8_0> {
  static constexpr int64_t kBlock = 32, kBytes = 34;
  static void dequant(const uint8_t* b, float* y) { dequant_q8_0(b, y); }
};
template <>
struct QuantFormat<kQ4_0> {
  static constexpr int64_t kBlock = 32, kBytes = 18;
  static void dequant(const uint8_t* b, float* y) { dequant_q4_0(b, y); }
};
template <>
struct QuantFormat<kQ4_1> {
  static constexpr int64_t kBlock = 32, kBytes = 20;
  static void dequant(const uint8_t* b, float* y) { dequant_q4_1(b, y); }
};
template <>
struct QuantFormat<kQ5_0> {
  static constexpr int64_t kBlock = 32, kBytes = 22;
  static void dequant(const uint8_t* b, float* y) { dequant_q5_0(b, y); }
};
template <>
struct QuantFormat<kQ4_K> {
  static constexpr int64_t kBlock = 256, kBytes = 144;
  static void dequant(const uint8_t* b, float* y) { dequant_k4_k5<false>(b, y); }
};
template <>
struct QuantFormat<kQ5_K> {
  static constexpr int64_t kBlock = 256, kBytes = 176;
  static void dequant(const uint8_t* b, float* y) { dequant_k4_k5<true>(b, y); }
};
template <>
struct QuantFormat<kQ6_K> {
  static constexpr int64_t kBlock = 256, kBytes = 210;
  static void dequant(const uint8_t* b, float* y) { dequant_q6_k(b, y); }
};

// Calls fn(QuantFormat<type>{}) for a supported type; false for any other.
template <typename Fn>
inline bool by_quant_type(int64_t type, Fn fn) {
  switch (type) {
    case kQ8_0: fn(QuantFormat<kQ8_0>{}); return true;
    case kQ4_0: fn(QuantFormat<kQ4_0>{}); return true;
    case kQ4_1: fn(QuantFormat<kQ4_1>{}); return true;
    case kQ5_0: fn(QuantFormat<kQ5_0>{}); return true;
    case kQ4_K: fn(QuantFormat<kQ4_K>{}); return true;
    case kQ5_K: fn(QuantFormat<kQ5_K>{}); return true;
    case kQ6_K: fn(QuantFormat<kQ6_K>{}); return true;
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

// Few rows: each weight row's blocks decoded one at a time into `buf` and dotted with the M rows of x.
template <typename F, int MR>
inline void quant_rows_few(const float* x, int64_t K, const uint8_t* wrow, const float* bias, float* y, int64_t ldy) {
  alignas(64) float buf[F::kBlock];
  v8 acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = splat(0.f);
  const int64_t blocks = K / F::kBlock;
  for (int64_t b = 0; b < blocks; ++b) {
    F::dequant(wrow + b * F::kBytes, buf);
    const float* xb = x + b * F::kBlock;
    for (int m = 0; m < MR; ++m) {
      v8 a = acc[m];
#pragma GCC unroll 8
      for (int64_t i = 0; i < F::kBlock; i += 8) a += load8(buf + i) * load8(xb + m * K + i);
      acc[m] = a;
    }
  }
  for (int m = 0; m < MR; ++m) y[m * ldy] = hsum(acc[m]) + (bias ? *bias : 0.f);
}

template <typename F>
inline void quant_linear_few(const float* x, int64_t M, int64_t K, const uint8_t* w, const float* bias, float* y,
                             int64_t N) {
  constexpr int64_t kRowsPerTask = 8;
  const int64_t row_bytes = K / F::kBlock * F::kBytes;
  agentrt::stealing_for((N + kRowsPerTask - 1) / kRowsPerTask, [&](int64_t t0, int64_t t1) {
    for (int64_t n = t0 * kRowsPerTask; n < std::min(N, t1 * kRowsPerTask); ++n) {
      const uint8_t* wrow = w + n * row_bytes;
      const float* b = bias ? bias + n : nullptr;
      switch (M) {
        case 1: quant_rows_few<F, 1>(x, K, wrow, b, y + n, N); break;
        case 2: quant_rows_few<F, 2>(x, K, wrow, b, y + n, N); break;
        case 3: quant_rows_few<F, 3>(x, K, wrow, b, y + n, N); break;
        default: quant_rows_few<F, 4>(x, K, wrow, b, y + n, N); break;
      }
    }
  });
}

// Many rows: a panel of 16 weight rows decoded to fp32 [K, 16] once, then linear.h's fp32 tiles over all rows.
template <typename F>
inline void quant_linear_panels(const float* x, int64_t M, int64_t K, const uint8_t* w, const float* bias, float* y,
                                int64_t N) {
  const int64_t panels = (N + kPanel - 1) / kPanel, blocks = K / F::kBlock, row_bytes = blocks * F::kBytes;
  agentrt::stealing_for(panels, [&](int64_t p0, int64_t p1) {
    thread_local std::vector<float> panel;
    panel.resize(size_t(K * kPanel));
    alignas(64) float buf[F::kBlock];
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * kPanel, ncols = std::min(kPanel, N - n0);
      for (int64_t r = 0; r < kPanel; ++r) {
        if (r >= ncols) {
          for (int64_t k = 0; k < K; ++k) panel[k * kPanel + r] = 0.f;
          continue;
        }
        const uint8_t* wrow = w + (n0 + r) * row_bytes;
        for (int64_t b = 0; b < blocks; ++b) {
          F::dequant(wrow + b * F::kBytes, buf);
          float* dst = panel.data() + b * F::kBlock * kPanel + r;
          for (int64_t i = 0; i < F::kBlock; ++i) dst[i * kPanel] = buf[i];
        }
      }
      linear_rows_f32(x, K, M, K, panel.data(), bias ? bias + n0 : nullptr, y + n0, N, ncols);
    }
  });
}

template <typename F>
inline void quant_linear(const float* x, int64_t M, int64_t K, const uint8_t* w, const float* bias, float* y,
                         int64_t N) {
  if (M <= kQuantFewRows) {
    quant_linear_few<F>(x, M, K, w, bias, y, N);
  } else {
    quant_linear_panels<F>(x, M, K, w, bias, y, N);
  }
}

}  // namespace agentrt
