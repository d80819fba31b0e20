// A GGUF block (quant.h) decoded in registers to the weights the widened engine holds: each weight's fp32 decoding
// (F::dequant) rounded to bf16 by `vcvtne2ps2bf16` (nearest even), 32 bf16 words a chunk of 32 weights, the same
// bits as F::dequant into memory and that rounding after. quant_bf16.h's widened_panel_amx writes them into AMX
// A tiles.
//
// Why the bits agree: every product in a decoding is exact in fp32, so computing it with an FMA, in another order
// or once for a whole table gives the same fp32 number. d is an fp16 (11 significant bits), scales and integers are
// small:
//   Q8_0, Q4_0   d * q              <= 11 + 8 bits: exact, the only operation
//   Q4_1         d * q + m          d * q <= 11 + 4 bits exact, the addition the one rounding
//   Q4_K         d*sc * q - dmin*m  d*sc (11 x 6 bits) and dmin*m exact in quant.h's scalar d * s0, dmin * m0;
//                                   d*sc * q <= 21 bits exact; the subtraction the one rounding
//   Q5_K         as Q4_K            d*sc * q <= 22 bits
//   Q6_K         (d*sc) * (q - 32)  d*sc: 11 bits x |sc| <= 128 (7 bits, 128 one): <= 18 bits; |q - 32| <= 32
//                                   (5 bits, 32 one): <= 23 bits, exact, so no rounding at all before bf16
// (fp16 subnormals are 2^-24 times an integer: exact too.) The K-quants take that further: a 32-weight sub-block
// of Q4_K has 16 distinct weights (32 for Q5_K), so each sub-block's weights are decoded once into a 32-word bf16
// table (the same expression d*sc * j - dmin*m, j = 0..15 or 0..31) and a chunk is one `vpermw` lookup of its
// integers: per 32 weights ~4 vector instructions plus the table's share, against ~10 for decoding each weight.
// Q6_K's 64 values per 16 weights make a table dearer than the products, so it multiplies.

#pragma once

#if defined(__AVX512BF16__)

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "quant.h"

namespace agentrt {

// A 32-weight block's 32 bf16 words in registers. kHas: F has one.
template <typename F>
struct Bf16Block {
  static constexpr bool kHas = false;
  static __m512i decode(const uint8_t*) { return _mm512_setzero_si512(); }
};
template <>
struct Bf16Block<FormatQ8_0> {
  static constexpr bool kHas = true;
  static __m512i decode(const uint8_t* blk) {
    const __m512 d = _mm512_set1_ps(fp16_to_f32(blk));
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(load16b(blk + 2)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(load16b(blk + 18)));
    return (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(d, hi), _mm512_mul_ps(d, lo));
  }
};
template <>
struct Bf16Block<FormatQ4_0> {
  static constexpr bool kHas = true;
  static __m512i decode(const uint8_t* blk) {
    const __m512 d = _mm512_set1_ps(fp16_to_f32(blk)), eight = _mm512_set1_ps(8.f);
    const __m128i q = load16b(blk + 2);
    const __m512 lo = _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(low_nibbles(q))), eight);
    const __m512 hi = _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(high_nibbles(q))), eight);
    return (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(d, hi), _mm512_mul_ps(d, lo));
  }
};
template <>
struct Bf16Block<FormatQ4_1> {
  static constexpr bool kHas = true;
  static __m512i decode(const uint8_t* blk) {
    const __m512 d = _mm512_set1_ps(fp16_to_f32(blk)), m = _mm512_set1_ps(fp16_to_f32(blk + 2));
    const __m128i q = load16b(blk + 4);
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(low_nibbles(q)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(high_nibbles(q)));
    return (__m512i)_mm512_cvtne2ps_pbh(_mm512_fmadd_ps(d, hi, m), _mm512_fmadd_ps(d, lo, m));
  }
};

// Q4_K / Q5_K: the 8 sub-blocks' d * sc_j (lanes 0-7) and dmin * m_j (lanes 8-15), the 6-bit scales unpacked as
// quant.h's k_scale_min does, four bytes a lane (sc 0-3 and m 0-3 are the low 6 bits of bytes 0-7; sc 4-7 and m 4-7
// the nibbles of bytes 8-11 under the top 2 bits of bytes 0-3 and 4-7), all in vector registers: against the same
// done in scalar registers and moved over, 1 row of Q4_K (qdot_rows_kregs, one thread, 4096 x 2560) 0.550 -> 0.514 ms.
inline __m512 k_scales_mins(const uint8_t* blk) {
  // the scale bytes as dwords q0, q1, q2 (and 4 bytes of qs, unused); lanes: sc 0-3, sc 4-7, m 0-3, m 4-7
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 4));
  const __m128i lo = _mm_and_si128(_mm_srlv_epi32(_mm_shuffle_epi32(q, _MM_SHUFFLE(2, 1, 2, 0)), _mm_setr_epi32(0, 0, 0, 4)),
                                   _mm_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f));
  const __m128i hi = _mm_and_si128(_mm_srli_epi32(_mm_shuffle_epi32(q, _MM_SHUFFLE(1, 1, 0, 0)), 2),
                                   _mm_setr_epi32(0, 0x30303030, 0, 0x30303030));  // top 2 bits of q0 / q1 to 4-5
  // d and dmin (fp16 words 0 and 1) to lanes 0-7 and 8-15
  int dd;
  std::memcpy(&dd, blk, 4);
  const __m256i h = _mm256_permutexvar_epi16(_mm256_setr_epi16(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
                                             _mm256_castsi128_si256(_mm_cvtsi32_si128(dd)));
  return _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_or_si128(lo, hi))));
}

// Lane j of v broadcast, read back from memory: a broadcast load costs no shuffle (the compiler would otherwise pick
// `vpermd`, and the decoders below are bound by the shuffle port). v is stored to s first.
struct Lanes {
  alignas(64) float s[16];
  explicit Lanes(__m512 v) {
    _mm512_store_ps(s, v);
    asm volatile("" : : "r"(s) : "memory");
  }
  __m512 operator[](int j) const { return _mm512_set1_ps(s[j]); }
};

inline __m512 iota16(float base) {
  return _mm512_add_ps(_mm512_set1_ps(base),
                       _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
}

// A 256-weight block whole: decode(blk, out, stride) writes chunk c's 32 bf16 words (weights 32c .. 32c + 31) to
// out + c * stride, its scales unpacked once. kHas: F has one.
template <typename F>
struct Bf16KBlock {
  static constexpr bool kHas = false;
  static void decode(const uint8_t*, uint16_t*, int64_t) {}
};

// Q4_K: sub-blocks 2p and 2p + 1 are the low and high nibbles of qs[32p .. 32p + 32]; pair p's table holds sub-block
// 2p's 16 weights in words 0-15 and 2p + 1's in 16-31, so the high nibbles index it with bit 4 set.
template <>
struct Bf16KBlock<FormatQ4_K> {
  static constexpr bool kHas = true;
  static void decode(const uint8_t* blk, uint16_t* out, int64_t stride) {
    const Lanes sm(k_scales_mins(blk));
    const __m512 i = iota16(0.f);
    const __m512i m15 = _mm512_set1_epi16(15), b4 = _mm512_set1_epi16(16);
    for (int p = 0; p < 4; ++p) {
      const __m512i t = (__m512i)_mm512_cvtne2ps_pbh(_mm512_fmsub_ps(i, sm[2 * p + 1], sm[8 + 2 * p + 1]),
                                                     _mm512_fmsub_ps(i, sm[2 * p], sm[8 + 2 * p]));
      const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16 + 32 * p)));
      _mm512_storeu_si512(out + 2 * p * stride, _mm512_permutexvar_epi16(_mm512_and_si512(w, m15), t));
      _mm512_storeu_si512(out + (2 * p + 1) * stride,
                          _mm512_permutexvar_epi16(_mm512_or_si512(_mm512_srli_epi16(w, 4), b4), t));
    }
  }
};

// Q5_K: as Q4_K with a fifth bit, bit j of qh[l] for weight l of sub-block j; sub-block j's table its 32 weights.
template <>
struct Bf16KBlock<FormatQ5_K> {
  static constexpr bool kHas = true;
  static void decode(const uint8_t* blk, uint16_t* out, int64_t stride) {
    const Lanes sm(k_scales_mins(blk));
    const __m512 lo = iota16(0.f), hi = iota16(16.f);
    const __m512i m15 = _mm512_set1_epi16(15);
    const __m512i h = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16)));
    for (int p = 0; p < 4; ++p) {
      const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 48 + 32 * p)));
      for (int s = 0; s < 2; ++s) {
        const int j = 2 * p + s;
        const __m512i t = (__m512i)_mm512_cvtne2ps_pbh(_mm512_fmsub_ps(hi, sm[j], sm[8 + j]),
                                                       _mm512_fmsub_ps(lo, sm[j], sm[8 + j]));
        const __m512i nib = s ? _mm512_srli_epi16(w, 4) : w;
        const __m512i bit = j < 4 ? _mm512_slli_epi16(h, unsigned(4 - j)) : _mm512_srli_epi16(h, unsigned(j - 4));
        // bits 0-3 from the nibble, 4 and up from the shifted qh (vpermw reads bits 0-4)
        _mm512_storeu_si512(out + j * stride, _mm512_permutexvar_epi16(_mm512_ternarylogic_epi32(m15, nib, bit, 0xca), t));
      }
    }
  }
};

// Q6_K: chunk 4h + t holds weights 128h + 32t + l (quant.h's dequant_q6_k), lanes l < 16 scaled by sc[8h + 2t], the
// rest by sc[8h + 2t + 1]. a * (q - 32) as a * q - 32 a: both products exact, so the FMA's one rounding leaves the
// exact (representable) value.
template <>
struct Bf16KBlock<FormatQ6_K> {
  static constexpr bool kHas = true;
  static void decode(const uint8_t* blk, uint16_t* out, int64_t stride) {
    const __m512 a = _mm512_mul_ps(_mm512_set1_ps(fp16_to_f32(blk + 208)),
                                   _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(load16b(blk + 192))));
    const Lanes av(a), a32(_mm512_mul_ps(a, _mm512_set1_ps(32.f)));
    const __m256i m15 = _mm256_set1_epi8(15), m48 = _mm256_set1_epi8(0x30);
    for (int h = 0; h < 2; ++h) {
      const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * h));
      const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * h + 32));
      const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * h));
      for (int t = 0; t < 4; ++t) {
        const __m256i lb = t % 2 ? l1 : l0;
        const __m256i lo = t / 2 ? _mm256_srli_epi16(lb, 4) : lb;
        const __m256i hi = _mm256_and_si256(
            t < 2 ? _mm256_slli_epi16(hb, unsigned(4 - 2 * t)) : _mm256_srli_epi16(hb, unsigned(2 * t - 4)), m48);
        const __m256i q = _mm256_ternarylogic_epi32(m15, lo, hi, 0xca);  // low 4 bits from lo, 2 from hi
        const int c = 4 * h + t;
        const __m512 v0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(q)));
        const __m512 v1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(q, 1)));
        _mm512_storeu_si512(out + c * stride,
                            (__m512i)_mm512_cvtne2ps_pbh(_mm512_fmsub_ps(v1, av[2 * c + 1], a32[2 * c + 1]),
                                                         _mm512_fmsub_ps(v0, av[2 * c], a32[2 * c])));
      }
    }
  }
};

}  // namespace agentrt

#endif  // __AVX512BF16__
