// Decode's 1-4 rows of x against Q4_K, Q6_K, Q8_0, Q4_0, Q4_1 and Q5_0 weights by integer dot products
// (`vpdpbusd`: 64 byte products an instruction, against `vdpbf16ps`'s 32 on weights first made bf16). quant_bf16.h's
// register paths spend ~9 instructions per 32 weights making and scaling u; for 1 row that bound them at ~20 GB/s of
// Q4_K in cache, below what DRAM gives, so a 4B model's decode step (2.5 GB) waited on instructions.
//
// x's rows become 15-bit integers per 32 weights (VnniX): s = max|x| / 16256, x_q = round(x / s), split as
// x_q = 128 h + l with h in [-127, 127] and l in [-64, 63], both signed bytes. The weights' integers are the unsigned
// bytes: Q4_K's and Q4_1's nibbles, Q6_K's six bits q (u = q - 32), Q8_0's q + 128, Q4_0's nibbles (u = nibble - 8),
// Q5_0's five bits (u = q - 16). So per 64 weights and row of x
//
//   r = 128 (u . h) + (u . l) - offset * (sum of x_q over each 4 weights)     (int32, exact; offset 0 to 128)
//
// and the output sums r * (the weights' scale) * s in fp32 by lanes, as quant_bf16.h sums its chunks, plus Q4_K's
// and Q4_1's offsets times x's per-32 sums (the exact bf16 x, qdot_output) once at the end. Products and their sums
// are exact in int32; the one new rounding is x's: |x - s x_q| <= max|x_chunk| / 32512, about 2^-15 of the chunk's
// largest element, where x itself, a bf16, is rounded to 2^-9 of each element (llama.cpp takes x in 8 bits a 256).
// Weight bytes are read once, the same 32 KB ahead as the bf16 register paths.
//
// Measured (2-core Xeon VM with AMX, 2 threads, 1 row, weights in cache): Q4_K 20 -> 27 GB/s, Q6_K 22 -> 32, Q8_0
// 25 -> 38; Gemma 3's 262144 x 640 Q8_0 head (178 MB, from DRAM) 8.0 -> 7.5 ms. Two rows of x cost ~2.3x one: each
// row's dot products are the work, the weight's unpacking is shared.
//
// Not in the deterministic mode: a row's output here differs in its last bits from the batch-invariant path's (its
// fp32 sums of exact bf16 products), so `invariant` keeps every M on that path; and 5 rows or more take the tiles.

#pragma once

// Included by quant_bf16.h before quant_linear_bf16, which dispatches here (it uses that file's kQdotCols, qdot_ahead,
// prefetch_slice and qdot_output).

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512BF16__)

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace agentrt {

constexpr int kVnniXMax = 16256;  // 127 * 128: |h| <= 127 after rounding x_q / 128

// M rows of x as VnniX, a scale s per 32 weights (a wider group, e.g. a K-quant's 256, would save a multiply a step,
// measured no faster, and let one large activation coarsen 255 others): h and l [M][K] signed bytes, s [M][K / 4]
// (per 64 weights, 16 lane scales: the s of the first 32 weights in lanes 0-7, of the second in 8-15), o [M][K / 4]
// the sums of x_q over each 4 weights times the format's offset (quant_vnni_offset). K % 64 == 0.
struct VnniX {
  std::vector<int8_t> h, l;
  std::vector<float> s;
  std::vector<int32_t> o;
  void make(const bf16* x, int64_t M, int64_t K, int offset) {
    h.resize(size_t(M * K));
    l.resize(size_t(M * K));
    s.resize(size_t(M * K / 4));
    o.resize(size_t(M * K / 4));
    const __m512i top = _mm512_set1_epi32(kVnniXMax), bottom = _mm512_set1_epi32(-kVnniXMax);
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t c = 0; c < K / 32; ++c) {
        const int64_t at = m * K + 32 * c;
        __m512 v[2];
        for (int i = 0; i < 2; ++i)  // bf16 -> fp32: the bits moved up
          v[i] = _mm512_castsi512_ps(_mm512_slli_epi32(
              _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + at + 16 * i))), 16));
        const float mx = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])));
        const float inv = mx > 0.f ? float(kVnniXMax) / mx : 0.f;
        float* lanes = s.data() + m * K / 4 + 16 * (c / 2) + 8 * (c % 2);
        _mm256_storeu_ps(lanes, _mm256_set1_ps(mx / float(kVnniXMax)));
        for (int i = 0; i < 2; ++i) {
          // round to nearest (even), as nearbyint; the clamp only guards inv's rounding at the largest element
          const __m512i r = _mm512_cvtps_epi32(_mm512_mul_ps(v[i], _mm512_set1_ps(inv)));
          const __m512i q = _mm512_max_epi32(bottom, _mm512_min_epi32(top, r));
          const __m512i hi = _mm512_srai_epi32(_mm512_add_epi32(q, _mm512_set1_epi32(64)), 7);
          _mm_storeu_si128(reinterpret_cast<__m128i*>(h.data() + at + 16 * i), _mm512_cvtepi32_epi8(hi));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(l.data() + at + 16 * i),
                           _mm512_cvtepi32_epi8(_mm512_sub_epi32(q, _mm512_slli_epi32(hi, 7))));
          if (offset != 0) {  // sums of 4 lanes in lanes 0, 4, 8, 12, packed to 4 ints
            __m512i t = _mm512_add_epi32(q, _mm512_shuffle_epi32(q, _MM_PERM_CDAB));
            t = _mm512_add_epi32(t, _mm512_shuffle_epi32(t, _MM_PERM_BADC));
            t = _mm512_mullo_epi32(_mm512_maskz_compress_epi32(0x1111, t), _mm512_set1_epi32(offset));
            _mm_storeu_si128(reinterpret_cast<__m128i*>(o.data() + at / 4 + 4 * i), _mm512_castsi512_si128(t));
          }
        }
      }
    }
  }
};

// The offset a format's unsigned bytes carry (u = byte - offset).
template <typename F>
constexpr int quant_vnni_offset() {
  if constexpr (std::is_same_v<F, FormatQ6_K>) return 32;
  if constexpr (std::is_same_v<F, FormatQ8_0>) return 128;
  if constexpr (std::is_same_v<F, FormatQ4_0>) return 8;
  if constexpr (std::is_same_v<F, FormatQ5_0>) return 16;
  return 0;
}

// One 64-weight step for MR rows of x: acc[m] += (r as fp32) * ws * x's lane scales. u: the 64 weight bytes; xi: the
// step's index in x's bytes (a multiple of 64).
template <int MR, bool kOffset>
__attribute__((always_inline)) inline void vnni_step(__m512 (&acc)[MR], __m512i u, __m512 ws, const VnniX& X,
                                                     int64_t K, int64_t xi) {
  for (int m = 0; m < MR; ++m) {
    const size_t at = size_t(m * K + xi);
    const __m512i hv = _mm512_loadu_si512(X.h.data() + at), lv = _mm512_loadu_si512(X.l.data() + at);
    __m512i r = _mm512_slli_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), u, hv), 7);
    if constexpr (kOffset) r = _mm512_sub_epi32(r, _mm512_loadu_si512(X.o.data() + at / 4));
    r = _mm512_dpbusd_epi32(r, u, lv);
    acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(r), _mm512_mul_ps(ws, _mm512_loadu_ps(X.s.data() + at / 4)), acc[m]);
  }
}

// The upper 32 bytes of q shifted down 4 bits (their high nibbles into the low ones; the lower 32 bytes as they are):
// `vpmultishiftqb` where the CPU has it, which runs beside the dot products (they and `vpsrlvw` share a port).
inline __m512i high_half_nibbles_down(__m512i q) {
#if defined(__AVX512VBMI__)
  const __m512i lo = _mm512_set1_epi64(0x3830282018100800LL), hi = _mm512_set1_epi64(0x3c342c241c140c04LL);
  return _mm512_multishift_epi64_epi8(_mm512_inserti64x4(lo, _mm512_castsi512_si256(hi), 1), q);
#else
  return _mm512_srlv_epi16(q, _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1));
#endif
}

// Weight row `blk` (its blocks from k = 0) against MR rows of x, one block: acc[m] += the block's sums by lanes; c:
// Q4_K's 8 offsets of the block (-dmin * m_j), written.
template <typename F, int MR>
struct VnniBlock {
  static constexpr bool kHas = false;
};

template <int MR>
struct VnniBlock<FormatQ4_K, MR> {
  static constexpr bool kHas = true;
  __attribute__((always_inline)) static void run(__m512 (&acc)[MR], const uint8_t* blk, const VnniX& X, int64_t K,
                                                 int64_t k0, float* c) {
    const __m512 sm = k_scales_mins(blk);  // d * sc_j (lanes 0-7), dmin * m_j (8-15)
    _mm256_storeu_ps(c, _mm256_xor_ps(_mm512_extractf32x8_ps(sm, 1), _mm256_set1_ps(-0.f)));
    const __m512i m15 = _mm512_set1_epi8(15);
    for (int p = 0; p < 4; ++p) {  // sub-blocks 2p (low nibbles of qs[32p ..]) and 2p + 1 (high): 64 weights in order
      const __m512i q = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16 + 32 * p)));
      const __m512i u = _mm512_and_si512(high_half_nibbles_down(q), m15);
      const __m512 ws = _mm512_permutexvar_ps(
          _mm512_inserti64x4(_mm512_set1_epi32(2 * p), _mm256_set1_epi32(2 * p + 1), 1), sm);
      vnni_step<MR, false>(acc, u, ws, X, K, k0 + 64 * p);
    }
  }
};

// Q6_K: half h of the block (128 weights): ql[64h ..] low nibbles are weights 128h + 0..63, high nibbles 64..127;
// qh[32h + l]'s bit pairs 0-1, 2-3, 4-5, 6-7 are the top bits of weights 128h + l, + 32, + 64, + 96 (quant.h).
template <int MR>
struct VnniBlock<FormatQ6_K, MR> {
  static constexpr bool kHas = true;
  __attribute__((always_inline)) static void run(__m512 (&acc)[MR], const uint8_t* blk, const VnniX& X, int64_t K,
                                                 int64_t k0, float*) {
    const __m512 dsc = _mm512_mul_ps(
        _mm512_set1_ps(fp16_to_f32(blk + 208)),
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192)))));
    const __m512i shift = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
    const __m512i m15 = _mm512_set1_epi8(15), top = _mm512_set1_epi8(0x30);
    const __m512i quarter = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    for (int h = 0; h < 2; ++h) {
      const __m512i ql = _mm512_loadu_si512(blk + 64 * h);
      const __m512i qh = _mm512_srlv_epi16(
          _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * h))), shift);
      // bits 4-5 from the second operand where `top` has them (0xd8: c ? b : a), bits 6-7 zero from the first
      const __m512i lo = _mm512_ternarylogic_epi32(_mm512_and_si512(ql, m15), _mm512_slli_epi16(qh, 4), top, 0xd8);
      const __m512i hi = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi16(ql, 4), m15), qh, top, 0xd8);
      const __m512i lanes_lo = _mm512_add_epi32(_mm512_set1_epi32(8 * h), quarter);  // sub-blocks 8h .. 8h + 3
      const __m512i lanes_hi = _mm512_add_epi32(_mm512_set1_epi32(8 * h + 4), quarter);
      vnni_step<MR, true>(acc, lo, _mm512_permutexvar_ps(lanes_lo, dsc), X, K, k0 + 128 * h);
      vnni_step<MR, true>(acc, hi, _mm512_permutexvar_ps(lanes_hi, dsc), X, K, k0 + 128 * h + 64);
    }
  }
};

// Q8_0: two blocks a step (the row's block pairs; K % 64 == 0), q + 128 as the unsigned bytes.
template <int MR>
struct VnniBlock<FormatQ8_0, MR> {
  static constexpr bool kHas = true;
  __attribute__((always_inline)) static void run(__m512 (&acc)[MR], const uint8_t* blk, const VnniX& X, int64_t K,
                                                 int64_t k0, float*) {
    const __m512i q = _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2))),
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 34 + 2)), 1);
    const __m512i u = _mm512_xor_si512(q, _mm512_set1_epi8(int8_t(0x80)));
    const __m512 ws =
        _mm512_mask_mov_ps(_mm512_set1_ps(fp16_to_f32(blk)), 0xff00, _mm512_set1_ps(fp16_to_f32(blk + 34)));
    vnni_step<MR, true>(acc, u, ws, X, K, k0);
  }
};

// The 32-weight nibble formats, two blocks a step: block i's 16 bytes of nibbles (at kQs) are its weights 0-15 (low)
// and 16-31 (high); Q5_0's fifth bits are the u32 after d, bit j weight j's; Q4_1's m (after d) is the blocks' offset.
template <typename F, int MR, int kQs, bool kFifth, bool kMin>
struct VnniNibbles {
  static constexpr bool kHas = true;
  __attribute__((always_inline)) static void run(__m512 (&acc)[MR], const uint8_t* blk, const VnniX& X, int64_t K,
                                                 int64_t k0, float* c) {
    const uint8_t* b1 = blk + F::kBytes;
    const __m128i q0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + kQs));
    const __m128i q1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b1 + kQs));
    const __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set_m128i(q0, q0)), _mm256_set_m128i(q1, q1), 1);
    const __m512i shift = _mm512_setr_epi64(0, 0, 0x0004000400040004LL, 0x0004000400040004LL, 0, 0,
                                            0x0004000400040004LL, 0x0004000400040004LL);
    __m512i u = _mm512_and_si512(_mm512_srlv_epi16(q, shift), _mm512_set1_epi8(15));
    if constexpr (kFifth) {
      uint32_t h0, h1;
      std::memcpy(&h0, blk + 2, 4);
      std::memcpy(&h1, b1 + 2, 4);
      u = _mm512_or_si512(u, _mm512_maskz_set1_epi8(_cvtu64_mask64(uint64_t(h1) << 32 | h0), 16));
    }
    if constexpr (kMin) {
      c[0] = fp16_to_f32(blk + 2);
      c[1] = fp16_to_f32(b1 + 2);
    }
    const __m512 ws = _mm512_mask_mov_ps(_mm512_set1_ps(fp16_to_f32(blk)), 0xff00, _mm512_set1_ps(fp16_to_f32(b1)));
    vnni_step<MR, quant_vnni_offset<F>() != 0>(acc, u, ws, X, K, k0);
  }
};
template <int MR>
struct VnniBlock<FormatQ4_0, MR> : VnniNibbles<FormatQ4_0, MR, 2, false, false> {};
template <int MR>
struct VnniBlock<FormatQ4_1, MR> : VnniNibbles<FormatQ4_1, MR, 4, false, true> {};
template <int MR>
struct VnniBlock<FormatQ5_0, MR> : VnniNibbles<FormatQ5_0, MR, 6, true, false> {};

// The weights a VnniBlock step covers (F's block, or Q8_0's pair of blocks).
template <typename F>
constexpr int64_t vnni_span() {
  return F::kBlock == 32 ? 64 : F::kBlock;
}

template <typename F>
constexpr bool vnni_applies() {
  return VnniBlock<F, 1>::kHas;
}

// A group of up to kQdotCols weight rows against MR rows of x (qdot_rows_kregs' loop, its prefetches and output).
template <typename F, int MR>
inline void vnni_rows(const VnniX& X, int64_t K, const uint8_t* w, int64_t row_bytes, int64_t ncols, float* c,
                      const float* sx, const float* bias, bf16* y, int64_t ldy) {
  constexpr int64_t span = vnni_span<F>(), step_bytes = span / F::kBlock * F::kBytes;
  constexpr bool kOffsets = Bf16Unpack<F>::kOffsets;  // Q4_K's -dmin * m_j, Q4_1's m: summed by qdot_output
  const int64_t chunks = K / 32, steps = K / span;
  __m512 acc[kQdotCols][MR];
  for (int n = 0; n < kQdotCols; ++n)
    for (int m = 0; m < MR; ++m) acc[n][m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < steps; ++b) {
    prefetch_slice<true>(w + kQdotCols * row_bytes, kQdotCols * row_bytes, b, steps);  // the next group (quant.h)
    prefetch_slice<true>(w + qdot_ahead(row_bytes), kQdotCols * row_bytes, b, steps);
    for (int n = 0; n < kQdotCols; ++n) {
      if (n >= ncols) break;
      VnniBlock<F, MR>::run(acc[n], w + n * row_bytes + b * step_bytes, X, K, b * span,
                            c + n * chunks + b * (span / 32));
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < ncols; ++n)
      y[m * ldy + n] = qdot_output<kOffsets>(acc[n][m], c + n * chunks, sx + m * chunks, chunks, bias, n);
}

// quant_linear_bf16's 1-4 rows outside the deterministic mode, for the formats above: x made VnniX once, then groups
// of 4 weight rows over the threads as the bf16 register paths take them.
template <typename F>
inline void quant_linear_vnni(const bf16* x, int64_t M, int64_t K, const uint8_t* w, const float* bias, bf16* y,
                              int64_t N, int64_t ldy, const float* sx) {
  thread_local VnniX mine;
  VnniX& X = mine;  // the caller's: the threads below read it (a thread_local named there would be their own)
  X.make(x, M, K, quant_vnni_offset<F>());
  const int64_t row_bytes = K / F::kBlock * F::kBytes, groups = (N + kQdotCols - 1) / kQdotCols;
  agentrt::stealing_for((groups + 3) / 4, [&](int64_t t0, int64_t t1) {
    thread_local std::vector<float> c;
    c.resize(size_t(kQdotCols * (K / 32)));
    for (int64_t g = t0 * 4; g < std::min(groups, t1 * 4); ++g) {
      const int64_t n0 = g * kQdotCols, ncols = std::min(kQdotCols, N - n0);
      const uint8_t* wg = w + n0 * row_bytes;
      const float* bg = bias ? bias + n0 : nullptr;
      switch (M) {
        case 1: vnni_rows<F, 1>(X, K, wg, row_bytes, ncols, c.data(), sx, bg, y + n0, ldy); break;
        case 2: vnni_rows<F, 2>(X, K, wg, row_bytes, ncols, c.data(), sx, bg, y + n0, ldy); break;
        case 3: vnni_rows<F, 3>(X, K, wg, row_bytes, ncols, c.data(), sx, bg, y + n0, ldy); break;
        default: vnni_rows<F, 4>(X, K, wg, row_bytes, ncols, c.data(), sx, bg, y + n0, ldy); break;
      }
    }
  });
}

}  // namespace agentrt

#endif
