// y[M, N] = x[M, K] @ W[N, K]^T (+ bias) for bf16 rows x and a weight kept in a GGUF block format (quant.h), on
// AVX512-BF16: the blocks' integers times x by `vdpbf16ps`, the blocks' scales applied once per 32 weights.
//
// Every format's weight is w_j = a_s * u_j + c_s over sub-blocks s of 32 (16 for Q6_K) weights, u_j a small
// integer and a_s, c_s fp32 numbers that are exact products of the block's scales (quant.h's layouts):
//
//   Q8_0  u = q (-128..127)     a = d          c = 0       Q4_K  u = nibble       a = d * sc_i   c = -dmin * m_i
//   Q4_0  u = nibble - 8        a = d          c = 0       Q5_K  u = 5 bits       a = d * sc_i   c = -dmin * m_i
//   Q4_1  u = nibble            a = d          c = m       Q6_K  u = q - 32       a = d * sc_i   c = 0 (16-weight s)
//   Q5_0  u = 5 bits - 16       a = d          c = 0       MXFP4 u = 2 x E2M1 value a = 2^(e - 128)  c = 0
//
// Any integer of at most 8 bits is exact in bf16, so x . w_s = a_s * (u . x)_s + c_s * sum(x_s) is computed from
// exact products: `vdpbf16ps` (32 bf16 products into 16 fp32 lanes, pairs summed) of u and x, then one FMA by a_s
// per 32 weights; the c_s terms are one dot product of the c's with x's per-32 sums after the loop. u is made by a
// table lookup (`vpermw`: a byte per weight widened to 16 bits indexes the bf16 of its integer). Per 32 weights
// of a weight row: ~5 instructions to unpack (shared by every row of x), 2 per row of x — against ~14 and 2
// FMAs per row for widening each weight to fp32 (quant.h's tiles). The output is rounded to bf16 once, after
// the bias.
//
// Threads take groups of 4 weight rows; a group is unpacked once (u in bf16, a and c: [4, K] bf16 plus K / 16
// floats, L1 / L2) and every row of x runs over it, 4 rows by 4 weight rows in registers; for 1-4 rows of x the
// blocks are unpacked straight into registers and used there (qdot_rows_chunks, qdot_rows_kregs). An output sums its
// 32-weight products in one lane order and k order whatever M and the tile, so a row's output does not depend on
// the other rows of the call (the engine's deterministic mode, `invariant`). Outside that mode, from
// kQuantWidenMinRows rows, panels widened to bf16 run linear.h's tiles instead (below), and 1-4 rows of most formats
// take integer dot products on x rounded to 15 bits (quant_vnni.h).
//
// Accuracy: products exact, sums in fp32, so |err| <= ~K * eps * (sum |a u x| + sum |c| |x|): with c = m
// (Q4_1) or -dmin * m (K-quants) of the order of the largest weight, a few times the rounding of fp32 sums
// over the decoded weights.

#pragma once

#if defined(__AVX512BF16__)

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "quant.h"
#include "quant_widen.h"
#include "team.h"
#include "vec.h"

namespace agentrt {

// bf16 bits of an integer |v| <= 255 (exact: 8 significant bits).
constexpr uint16_t bf16_of_int(int v) {
  if (v == 0) return 0;
  const uint16_t sign = v < 0 ? 0x8000 : 0;
  const int a = v < 0 ? -v : v;
  int e = 0;
  while ((a >> (e + 1)) != 0) ++e;
  return uint16_t(sign | ((127 + e) << 7) | ((a << (7 - e)) & 0x7f));
}

// The lookup tables: entry i is the bf16 of i - offset, 64 entries (vpermw reads the first 32, vpermt2w all).
template <int kOffset>
struct IntTable {
  alignas(64) uint16_t v[64];
  constexpr IntTable() : v() {
    for (int i = 0; i < 64; ++i) v[i] = bf16_of_int(i - kOffset);
  }
};
inline constexpr IntTable<0> kTablePlain{};
inline constexpr IntTable<8> kTableOff8{};
inline constexpr IntTable<16> kTableOff16{};
inline constexpr IntTable<32> kTableOff32{};
// MXFP4: entry i < 16 the bf16 of E2M1 code i's value doubled (quant.h's kMxfp4Ints), the rest unused.
struct Mxfp4Table {
  alignas(64) uint16_t v[64];
  constexpr Mxfp4Table() : v() {
    for (int i = 0; i < 16; ++i) v[i] = bf16_of_int(kMxfp4Ints[i]);
  }
};
inline constexpr Mxfp4Table kTableMxfp4{};

// 32 weight bytes (each 0..31) -> the bf16 of table[byte], 32 words.
inline __m512i lookup32(__m256i idx, const uint16_t* table) {
  return _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(idx), _mm512_load_si512(table));
}
// 32 bytes (each 0..63) -> bf16 of (byte - 32).
inline __m512i lookup64_off32(__m256i idx) {
  return _mm512_permutex2var_epi16(_mm512_load_si512(kTableOff32.v), _mm512_cvtepu8_epi16(idx),
                                   _mm512_load_si512(kTableOff32.v + 32));
}

inline __m256i nibbles32(const uint8_t* p) {  // 16 bytes -> 32 bytes: low nibbles, then high nibbles
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i m = _mm_set1_epi8(15);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m), _mm_and_si128(q, m));
}
inline void store_u(uint16_t* u, __m512i v) { _mm512_storeu_si512(u, v); }

// The 32-weight formats, one block in registers: u (32 bf16), its scale a and offset c.
inline __m512i chunk_q8_0(const uint8_t* blk, float& a, float& c) {
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2))));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 18))));
  a = fp16_to_f32(blk);
  c = 0.f;
  return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);  // exact: |q| <= 128
}
inline __m512i chunk_q4_0(const uint8_t* blk, float& a, float& c) {
  a = fp16_to_f32(blk);
  c = 0.f;
  return lookup32(nibbles32(blk + 2), kTableOff8.v);
}
inline __m512i chunk_q4_1(const uint8_t* blk, float& a, float& c) {
  a = fp16_to_f32(blk);
  c = fp16_to_f32(blk + 2);
  return lookup32(nibbles32(blk + 4), kTablePlain.v);
}
inline __m512i chunk_q5_0(const uint8_t* blk, float& a, float& c) {
  uint32_t qh;
  std::memcpy(&qh, blk + 2, 4);
  a = fp16_to_f32(blk);
  c = 0.f;
  return lookup32(_mm256_or_si256(nibbles32(blk + 6), _mm256_maskz_set1_epi8(qh, 16)), kTableOff16.v);
}
// MXFP4's scale is a power of two, so it goes into the table instead of an FMA per row: the exponent field of every
// nonzero entry moved by e - 128 (entries 0 and 8 are the zeros), and the block's products added to the accumulators
// by `vdpbf16ps` itself, a = 0 saying so (a real scale is never 0). Exact where the moved exponents stay normal
// (the table's 1..12 times 2^(e - 128): e in [2, 252]); other blocks keep the table as it is and a = their scale.
inline constexpr __mmask32 kMxfp4Nonzero = 0xfffffefe;
inline bool mxfp4_folds(int e) { return unsigned(e - 2) <= 250u; }
// The block's 32 weights in bf16 with its scale folded in (mxfp4_folds(blk[0])).
inline __m512i mxfp4_folded(const uint8_t* blk, __m512i table) {
  table = _mm512_mask_add_epi16(table, kMxfp4Nonzero, table, _mm512_set1_epi16(int16_t((blk[0] - 128) * 128)));
  return _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(nibbles32(blk + 1)), table);
}
inline __m512i chunk_mxfp4(const uint8_t* blk, float& a, float& c) {
  c = 0.f;
  if (mxfp4_folds(blk[0])) {
    a = 0.f;
    return mxfp4_folded(blk, _mm512_load_si512(kTableMxfp4.v));
  }
  a = e8m0_half(blk[0]);
  return lookup32(nibbles32(blk + 1), kTableMxfp4.v);
}

// Unpack one block: u (kBlock bf16), a (2 floats per 32 weights: the scales of its lanes 0-7 and 8-15), c (one
// float per 32 weights).
template <__m512i (*kChunk)(const uint8_t*, float&, float&)>
inline void unpack_chunk(const uint8_t* blk, uint16_t* u, float* a, float* c) {
  store_u(u, kChunk(blk, a[0], c[0]));
  a[1] = a[0];
}
template <bool kFifthBit>
inline void unpack_k4_k5(const uint8_t* blk, uint16_t* u, float* a, float* c) {
  const float d = fp16_to_f32(blk), dmin = fp16_to_f32(blk + 2);
  const uint8_t* qs = blk + (kFifthBit ? 48 : 16);
  const __m256i m15 = _mm256_set1_epi8(15), ones = _mm256_set1_epi8(1);
  __m256i qh = _mm256_setzero_si256();
  if constexpr (kFifthBit) qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16));
  for (int p = 0; p < 4; ++p) {
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * p));
    __m256i lo = _mm256_and_si256(q, m15), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m15);
    if constexpr (kFifthBit) {  // bit i of qh[l]: the fifth bit of sub-block i's weight l
      lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * p), ones), 4));
      hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * p + 1), ones), 4));
    }
    store_u(u + 64 * p, lookup32(lo, kTablePlain.v));
    store_u(u + 64 * p + 32, lookup32(hi, kTablePlain.v));
    for (int s = 0; s < 2; ++s) {
      float sc, m;
      k_scale_min(blk + 4, 2 * p + s, sc, m);
      a[2 * (2 * p + s)] = a[2 * (2 * p + s) + 1] = d * sc;  // exact: 11 x 6 bits
      c[2 * p + s] = -(dmin * m);
    }
  }
}
inline void unpack_q6_k(const uint8_t* blk, uint16_t* u, float* a, float* c) {
  const uint8_t* ql = blk;
  const uint8_t* qh = blk + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
  const float d = fp16_to_f32(blk + 208);
  const __m256i m15 = _mm256_set1_epi8(15), m3 = _mm256_set1_epi8(3);
  for (int h = 0; h < 2; ++h) {
    const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh + 32 * h));
    for (int t = 0; t < 4; ++t) {  // weights 128h + 32t + l, l < 32 (quant.h's dequant_q6_k)
      const __m256i lb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 64 * h + 32 * (t % 2)));
      const __m256i lo = _mm256_and_si256(t / 2 ? _mm256_srli_epi16(lb, 4) : lb, m15);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(hb, 2 * t), m3);
      const int chunk = 4 * h + t;
      store_u(u + 32 * chunk, lookup64_off32(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 4))));
      a[2 * chunk] = d * float(sc[8 * h + 2 * t]);  // exact: 11 x 8 bits
      a[2 * chunk + 1] = d * float(sc[8 * h + 2 * t + 1]);
      c[chunk] = 0.f;
    }
  }
}

inline __m512i no_chunk(const uint8_t*, float&, float&) { return _mm512_setzero_si512(); }  // not a 32-weight format

template <typename F>
struct Bf16Unpack;
// kChunk32: a 32-weight format whose block `chunk` gives in registers (the decode path skips the u buffer).
#define AGENTRT_BF16_UNPACK(Format, fn, offsets, half, chunk32, chunk_fn, fold) \
  template <>                                    \
  struct Bf16Unpack<Format> {                    \
    static constexpr bool kOffsets = offsets;    \
    static constexpr bool kFold = fold;          \
    static constexpr bool kHalf = half;          \
    static constexpr bool kChunk32 = chunk32;    \
    static void unpack(const uint8_t* b, uint16_t* u, float* a, float* c) { fn(b, u, a, c); } \
    static __m512i chunk(const uint8_t* b, float& a, float& c) { return chunk_fn(b, a, c); } \
  };
AGENTRT_BF16_UNPACK(FormatQ8_0, unpack_chunk<chunk_q8_0>, false, false, true, chunk_q8_0, false)
AGENTRT_BF16_UNPACK(FormatQ4_0, unpack_chunk<chunk_q4_0>, false, false, true, chunk_q4_0, false)
AGENTRT_BF16_UNPACK(FormatQ4_1, unpack_chunk<chunk_q4_1>, true, false, true, chunk_q4_1, false)
AGENTRT_BF16_UNPACK(FormatQ5_0, unpack_chunk<chunk_q5_0>, false, false, true, chunk_q5_0, false)
AGENTRT_BF16_UNPACK(FormatQ4_K, unpack_k4_k5<false>, true, false, false, no_chunk, false)
AGENTRT_BF16_UNPACK(FormatQ5_K, unpack_k4_k5<true>, true, false, false, no_chunk, false)
AGENTRT_BF16_UNPACK(FormatQ6_K, unpack_q6_k, false, true, false, no_chunk, false)
AGENTRT_BF16_UNPACK(FormatMXFP4, unpack_chunk<chunk_mxfp4>, false, false, true, chunk_mxfp4, true)
#undef AGENTRT_BF16_UNPACK

constexpr int64_t kQdotCols = 4;  // weight rows of a group
constexpr int kQdotRows = 4;      // rows of x of a register tile

// The partial sums of c . sx over chunks [0, n) in 16 lanes (lane i: chunks i, i + 16, ...).
inline __m512 dot_lanes(const float* c, const float* sx, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n - i)) - 1);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, c + i), _mm512_maskz_loadu_ps(m, sx + i), acc);
  }
  return acc;
}

// One output: the lanes of its 32-weight products, plus (kOffsets) the lanes of c . sx, summed; + bias, to bf16.
template <bool kOffsets>
inline bf16 qdot_output(__m512 acc, const float* c, const float* sx, int64_t chunks, const float* bias, int64_t n) {
  if constexpr (kOffsets) acc = _mm512_add_ps(acc, dot_lanes(c, sx, chunks));
  return f32_to_bf16(_mm512_reduce_add_ps(acc) + (bias ? bias[n] : 0.f));
}

// The scales of a chunk's 16 lanes: one (a 32-weight sub-block) or lanes 0-7 and 8-15 (Q6_K's 16-weight ones).
template <bool kHalf>
inline __m512 chunk_scales(const float* a) {
  if constexpr (kHalf) return _mm512_insertf32x8(_mm512_set1_ps(a[0]), _mm256_set1_ps(a[1]), 1);
  return _mm512_set1_ps(a[0]);
}

// acc[m][n] += a . (u_n . x_m) over chunks [ch0, ch1): x rows K apart, u rows ldu apart from chunk ch0, a rows lda
// apart (2 floats a chunk) from ch0.
// `kFold` (MXFP4): a chunk whose scale is 0 has it in u already (chunk_mxfp4); its products go straight into acc.
template <int MR, bool kHalf, bool kFold>
inline void qdot_chunks(__m512 (&acc)[MR][kQdotCols], const bf16* x, int64_t K, int64_t ch0, int64_t ch1,
                        const uint16_t* u, int64_t ldu, const float* a, int64_t lda) {
  for (int64_t ch = ch0; ch < ch1; ++ch) {
    __m512bh xv[MR];
    for (int m = 0; m < MR; ++m) xv[m] = (__m512bh)_mm512_loadu_si512(x + m * K + 32 * ch);
    for (int n = 0; n < kQdotCols; ++n) {
      const __m512bh uv = (__m512bh)_mm512_loadu_si512(u + n * ldu + 32 * (ch - ch0));
      if constexpr (kFold) {
        if (a[n * lda + 2 * (ch - ch0)] == 0.f) {
          for (int m = 0; m < MR; ++m) acc[m][n] = _mm512_dpbf16_ps(acc[m][n], uv, xv[m]);
          continue;
        }
      }
      const __m512 av = chunk_scales<kHalf>(a + n * lda + 2 * (ch - ch0));
      for (int m = 0; m < MR; ++m)
        acc[m][n] = _mm512_fmadd_ps(av, _mm512_dpbf16_ps(_mm512_setzero_ps(), uv, xv[m]), acc[m][n]);
    }
  }
}

// MR rows of x (bf16, rows K apart) through an unpacked group (u [4][K] bf16, a [4][K / 16], c [4][K / 32]);
// sx [MR][K / 32]: x's per-32 sums (kOffsets). y[m * ldy + n] for n < ncols, rounded to bf16.
template <int MR, bool kOffsets, bool kHalf, bool kFold>
inline void qdot_tile(const bf16* x, int64_t K, const uint16_t* u, const float* a, const float* c, const float* sx,
                      const float* bias, bf16* y, int64_t ldy, int64_t ncols) {
  const int64_t chunks = K / 32;
  __m512 acc[MR][kQdotCols];
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < kQdotCols; ++n) acc[m][n] = _mm512_setzero_ps();
  qdot_chunks<MR, kHalf, kFold>(acc, x, K, 0, chunks, u, K, a, 2 * chunks);
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < ncols; ++n)
      y[m * ldy + n] = qdot_output<kOffsets>(acc[m][n], c + n * chunks, sx + m * chunks, chunks, bias, n);
}

// How far ahead of its group a 1-4-row walk asks for weight bytes into L2: whole groups, ~32 KB. The next group alone
// (prefetch_slice's own distance) leaves a DRAM-bound stream short of requests in flight: Gemma 3's 262144 x 640 Q8_0
// head, 1 row, 2 threads, 178 MB: 10.9 -> 8.0 ms (16 -> 22 GB/s; an int64 sum of the same bytes 25-30 GB/s); 4, 8 and
// 16 groups (11-44 KB) measured alike against that sum. In cache (2048-65536 rows) the rate is unchanged. Over a
// Qwen3-4B-shape decode's 163 weights (quant_vnni.h's path, 2.5 GB), 32, 64 and 128 KB alike, 256 KB 7% slower.
constexpr int64_t kQdotAheadBytes = 32768;
inline int64_t qdot_ahead(int64_t row_bytes) {
  const int64_t group = kQdotCols * row_bytes;
  return std::max<int64_t>(1, kQdotAheadBytes / group) * group;
}

// Few rows of a 32-weight format: each block's u straight from the bytes into registers and dotted with every row,
// the same products in the same order as qdot_tile (the same bits); c [4][K / 32] written for the offsets.
template <typename F, int MR>
inline void qdot_rows_chunks(const bf16* x, int64_t K, const uint8_t* w, int64_t row_bytes, int64_t ncols, float* c,
                             const float* sx, const float* bias, bf16* y, int64_t ldy) {
  using U = Bf16Unpack<F>;
  static_assert(F::kBlock == 32 && U::kChunk32);
  const int64_t chunks = K / 32;
  __m512 acc[MR][kQdotCols];
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < kQdotCols; ++n) acc[m][n] = _mm512_setzero_ps();
  for (int64_t ch = 0; ch < chunks; ++ch) {
    __m512bh xv[MR];
    for (int m = 0; m < MR; ++m) xv[m] = (__m512bh)_mm512_loadu_si512(x + m * K + 32 * ch);
    prefetch_slice(w + kQdotCols * row_bytes, kQdotCols * row_bytes, ch, chunks);  // the next group (quant.h)
    prefetch_slice<true>(w + qdot_ahead(row_bytes), kQdotCols * row_bytes, ch, chunks);
    for (int n = 0; n < kQdotCols; ++n) {
      if (n >= ncols) break;
      const uint8_t* blk = w + n * row_bytes + ch * F::kBytes;
      float a, cv;
      const __m512bh uv = (__m512bh)U::chunk(blk, a, cv);
      if constexpr (U::kOffsets) c[n * chunks + ch] = cv;
      if constexpr (U::kFold) {
        if (a == 0.f) {
          for (int m = 0; m < MR; ++m) acc[m][n] = _mm512_dpbf16_ps(acc[m][n], uv, xv[m]);
          continue;
        }
      }
      const __m512 av = _mm512_set1_ps(a);
      for (int m = 0; m < MR; ++m)
        acc[m][n] = _mm512_fmadd_ps(av, _mm512_dpbf16_ps(_mm512_setzero_ps(), uv, xv[m]), acc[m][n]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < ncols; ++n)
      y[m * ldy + n] = qdot_output<U::kOffsets>(acc[m][n], c + n * chunks, sx + m * chunks, chunks, bias, n);
}

// Few rows of the K-quants straight from the bytes: a block's 8 chunks of u made in registers (each(blk, c, fn) calls
// fn(chunk, u, a) in chunk order, a the chunk's 16 lane scales, and writes the block's 8 offsets to c), the scales
// unpacked once a block by vector (quant_widen.h's k_scales_mins). The same u, a and c as unpack_k4_k5 / unpack_q6_k,
// so qdot_rows_kregs computes qdot_tile's products in its order: the same bits, without a u buffer and without the
// scalar unpacking of 16 six-bit scales a block. kHas: F has one.
template <typename F>
struct QdotKBlock {
  static constexpr bool kHas = false;
  template <typename Fn>
  static void each(const uint8_t*, float*, Fn&&) {}
};
template <bool kFifthBit>
struct QdotK45 {
  static constexpr bool kHas = true;
  template <typename Fn>
  __attribute__((always_inline)) static void each(const uint8_t* blk, float* c, Fn&& fn) {
    const __m512 sm = k_scales_mins(blk);  // d * sc_j, dmin * m_j
    _mm256_storeu_ps(c, _mm256_xor_ps(_mm512_extractf32x8_ps(sm, 1), _mm256_set1_ps(-0.f)));
    const Lanes a(sm);
    const __m512i table = _mm512_load_si512(kTablePlain.v), m15 = _mm512_set1_epi16(15);
    __m512i h = _mm512_setzero_si512();
    if constexpr (kFifthBit) h = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16)));
    for (int p = 0; p < 4; ++p) {
      const __m512i w =
          _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + (kFifthBit ? 48 : 16) + 32 * p)));
      __m512i lo = _mm512_and_si512(w, m15), hi = _mm512_srli_epi16(w, 4);
      if constexpr (kFifthBit) {  // bit j of qh[l] into bit 4 (vpermw reads bits 0-4)
        const int j = 2 * p;
        lo = _mm512_ternarylogic_epi32(m15, lo, j < 4 ? _mm512_slli_epi16(h, unsigned(4 - j)) : _mm512_srli_epi16(h, unsigned(j - 4)), 0xca);
        hi = _mm512_ternarylogic_epi32(m15, hi, j + 1 < 4 ? _mm512_slli_epi16(h, unsigned(3 - j)) : _mm512_srli_epi16(h, unsigned(j - 3)), 0xca);
      }
      fn(2 * p, _mm512_permutexvar_epi16(lo, table), a[2 * p]);
      fn(2 * p + 1, _mm512_permutexvar_epi16(hi, table), a[2 * p + 1]);
    }
  }
};
template <>
struct QdotKBlock<FormatQ4_K> : QdotK45<false> {};
template <>
struct QdotKBlock<FormatQ5_K> : QdotK45<true> {};
template <>
struct QdotKBlock<FormatQ6_K> {  // no offsets (c untouched); lanes 0-7 and 8-15 of a chunk have their own scale
  static constexpr bool kHas = true;
  template <typename Fn>
  __attribute__((always_inline)) static void each(const uint8_t* blk, float*, Fn&& fn) {
    const Lanes a(_mm512_mul_ps(_mm512_set1_ps(fp16_to_f32(blk + 208)),
                                _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(load16b(blk + 192)))));
    const __m256i m15 = _mm256_set1_epi8(15), m48 = _mm256_set1_epi8(0x30);
    for (int h = 0; h < 2; ++h) {
      const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * h));
      const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * h + 32));
      const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * h));
      for (int t = 0; t < 4; ++t) {  // weights 128h + 32t + l (quant.h's dequant_q6_k)
        const __m256i lb = t % 2 ? l1 : l0;
        const __m256i lo = t / 2 ? _mm256_srli_epi16(lb, 4) : lb;
        const __m256i hi = _mm256_and_si256(
            t < 2 ? _mm256_slli_epi16(hb, unsigned(4 - 2 * t)) : _mm256_srli_epi16(hb, unsigned(2 * t - 4)), m48);
        const int ch = 4 * h + t;
        fn(ch, lookup64_off32(_mm256_ternarylogic_epi32(m15, lo, hi, 0xca)),
           _mm512_mask_mov_ps(a[2 * ch], 0xff00, a[2 * ch + 1]));
      }
    }
  }
};

// Few rows of a K-quant (QdotKBlock): qdot_tile's products and order, u made in registers, a weight row's block at a
// time. (Going round the 4 rows a pair of chunks at a time, so that no accumulator's FMA chain waits on itself, was
// no faster: one thread, 4096 x 2560, 1 row Q4_K even, Q5_K 0.66 -> 0.82 ms, Q6_K 0.80 -> 0.84.)
template <typename F, int MR>
inline void qdot_rows_kregs(const bf16* x, int64_t K, const uint8_t* w, int64_t row_bytes, int64_t ncols, float* c,
                            const float* sx, const float* bias, bf16* y, int64_t ldy) {
  using U = Bf16Unpack<F>;
  constexpr int64_t sub = F::kBlock / 32;
  const int64_t chunks = K / 32, blocks = K / F::kBlock;
  float cb[sub];
  __m512 acc[MR][kQdotCols];
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < kQdotCols; ++n) acc[m][n] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    prefetch_slice<true>(w + kQdotCols * row_bytes, kQdotCols * row_bytes, b, blocks);  // the next group (quant.h)
    prefetch_slice<true>(w + qdot_ahead(row_bytes), kQdotCols * row_bytes, b, blocks);
    const bf16* xb = x + b * F::kBlock;
    for (int n = 0; n < kQdotCols; ++n) {
      if (n >= ncols) break;
      QdotKBlock<F>::each(w + n * row_bytes + b * F::kBytes, U::kOffsets ? c + n * chunks + b * sub : cb,
                          [&](int ch, __m512i u, __m512 a) __attribute__((always_inline)) {
                            for (int m = 0; m < MR; ++m)
                              acc[m][n] = _mm512_fmadd_ps(
                                  a,
                                  _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)u,
                                                   (__m512bh)_mm512_loadu_si512(xb + m * K + 32 * ch)),
                                  acc[m][n]);
                          });
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < ncols; ++n)
      y[m * ldy + n] = qdot_output<U::kOffsets>(acc[m][n], c + n * chunks, sx + m * chunks, chunks, bias, n);
}

// 1-4 rows of x, u made in registers: the 32-weight formats' blocks (qdot_rows_chunks: ~1.3-2x the rate of unpacking
// blocks into an L1 buffer first, Q4_1 and MXFP4, 2 cores) or the K-quants' (qdot_rows_kregs: one thread, 4096 x
// 2560, 1 row 1.5x and 4 rows 1.15x that rate).
template <typename F, int MR>
inline void qdot_rows(const bf16* x, int64_t K, const uint8_t* w, int64_t row_bytes, int64_t ncols, float* c,
                      const float* sx, const float* bias, bf16* y, int64_t ldy) {
  if constexpr (Bf16Unpack<F>::kChunk32) {
    qdot_rows_chunks<F, MR>(x, K, w, row_bytes, ncols, c, sx, bias, y, ldy);
  } else {
    static_assert(QdotKBlock<F>::kHas);
    qdot_rows_kregs<F, MR>(x, K, w, row_bytes, ncols, c, sx, bias, y, ldy);
  }
}

// Per-32 sums of x's rows [M, K] bf16 -> sx [M, K / 32] fp32 (`vdpbf16ps` by ones: one order).
inline void chunk_sums_bf16(const bf16* x, int64_t M, int64_t K, float* sx) {
  const __m512bh ones = (__m512bh)_mm512_set1_epi16(int16_t(0x3f80));
  for (int64_t m = 0; m < M; ++m)
    for (int64_t ch = 0; ch < K / 32; ++ch)
      sx[m * (K / 32) + ch] = _mm512_reduce_add_ps(
          _mm512_dpbf16_ps(_mm512_setzero_ps(), ones, (__m512bh)_mm512_loadu_si512(x + m * K + 32 * ch)));
}

// A group's buffers (one per thread): u [4][K] bf16, a [4][K / 16], c [4][K / 32].
struct QdotBuffers {
  std::vector<uint16_t> u;
  std::vector<float> a, c;
  void size_for(int64_t K) {
    u.resize(size_t(kQdotCols * K));
    a.resize(size_t(kQdotCols * 2 * (K / 32)));
    c.resize(size_t(kQdotCols * (K / 32)));
  }
};
inline QdotBuffers& qdot_buffers(int64_t K) {
  thread_local QdotBuffers b;
  b.size_for(K);
  return b;
}

// Weight rows n0 .. n0 + ncols (ncols <= 4; w, bias and y start at row n0, weight rows row_bytes apart) against the
// M rows of x (sx: their per-32 sums where the format has offsets): y[m * ldy + j] for j < ncols. quant_linear_bf16's
// work item, shared with the grouped expert projection (moe.h).
template <typename F>
inline void qdot_group(const bf16* x, int64_t M, int64_t K, const uint8_t* w, int64_t row_bytes, int64_t ncols,
                       const float* sx, const float* bias, bf16* y, int64_t ldy, QdotBuffers& buf) {
  using U = Bf16Unpack<F>;
  const int64_t chunks = K / 32, blocks = K / F::kBlock, sub = F::kBlock / 32;
  uint16_t* u = buf.u.data();
  float *a = buf.a.data(), *c = buf.c.data();
  if (M <= kQdotRows) {
    switch (M) {
      case 1: qdot_rows<F, 1>(x, K, w, row_bytes, ncols, c, sx, bias, y, ldy); break;
      case 2: qdot_rows<F, 2>(x, K, w, row_bytes, ncols, c, sx, bias, y, ldy); break;
      case 3: qdot_rows<F, 3>(x, K, w, row_bytes, ncols, c, sx, bias, y, ldy); break;
      default: qdot_rows<F, 4>(x, K, w, row_bytes, ncols, c, sx, bias, y, ldy); break;
    }
    return;
  }
  for (int64_t n = 0; n < kQdotCols; ++n) {
    if (n >= ncols) {  // past N: zero weights (their outputs are not stored)
      std::fill(u + n * K, u + (n + 1) * K, uint16_t(0));
      std::fill(a + n * 2 * chunks, a + (n + 1) * 2 * chunks, 0.f);
      std::fill(c + n * chunks, c + (n + 1) * chunks, 0.f);
      continue;
    }
    const uint8_t* wr = w + n * row_bytes;
    for (int64_t b = 0; b < blocks; ++b)
      U::unpack(wr + b * F::kBytes, u + n * K + b * F::kBlock, a + n * 2 * chunks + b * sub * 2,
                c + n * chunks + b * sub);
  }
  for (int64_t m0 = 0; m0 < M; m0 += kQdotRows) {
    const bf16* xm = x + m0 * K;
    const float* sm = U::kOffsets ? sx + m0 * chunks : nullptr;
    bf16* ym = y + m0 * ldy;
    switch (std::min<int64_t>(kQdotRows, M - m0)) {
      case 1: qdot_tile<1, U::kOffsets, U::kHalf, U::kFold>(xm, K, u, a, c, sm, bias, ym, ldy, ncols); break;
      case 2: qdot_tile<2, U::kOffsets, U::kHalf, U::kFold>(xm, K, u, a, c, sm, bias, ym, ldy, ncols); break;
      case 3: qdot_tile<3, U::kOffsets, U::kHalf, U::kFold>(xm, K, u, a, c, sm, bias, ym, ldy, ncols); break;
      default: qdot_tile<4, U::kOffsets, U::kHalf, U::kFold>(xm, K, u, a, c, sm, bias, ym, ldy, ncols); break;
    }
  }
}

#if defined(AGENTRT_AMX)
// ---------------------------------------------------------------- MXFP4 on AMX
//
// With its scale folded in (chunk_mxfp4), an MXFP4 block is 32 exact bf16 weights, so the k sums of a whole panel can
// run on AMX: A = 16 weight rows x 32 k of one chunk (unpacked to L1, 64 bytes a row), B = the same 32 k of up to 16
// rows of x as k pairs ([16 pairs][16 rows][2], `fold_amx_rows`), C[n][row] += A . B by `tdpbf16ps`, four C tiles
// (64 rows of x) per unpacking of the panel. The register paths above pay a `vdpbf16ps` per row of x and block; here a
// block costs its unpacking and a store whatever the rows, which is what a mixture of experts' decode step (1-3 rows
// an expert) and its prefill (hundreds) need. Each output sums its chunks in k order, each chunk's pairs as the
// hardware does for every row alike, so a row's output does not depend on the others (the deterministic mode): the
// path is taken for every M, and a panel holding a block that does not fold (exponent byte outside 2..252: weights
// past fp32's range or subnormal) takes the register path instead, whatever M.

// x's rows [M, K] bf16 as B operands: xt[(rb * K / 2 + p) * 16 + j] = the k pair p of row 16 rb + j (rows past M: 0).
inline int64_t fold_amx_rows_size(int64_t M, int64_t K) { return ((M + 15) / 16) * (K / 2) * 16; }
inline void transpose16x16_epi32(__m512i (&r)[16]);  // below

// Row blocks [rb0, rb1) of fold_amx_rows: 16 rows x 16 pairs at a time, transposed in registers (rows past M zero).
inline void fold_amx_row_blocks(const bf16* x, int64_t M, int64_t K, uint32_t* xt, int64_t rb0, int64_t rb1) {
  const int64_t pairs = K / 2;  // a multiple of 16 (K % 32 == 0)
  const uint32_t* x32 = reinterpret_cast<const uint32_t*>(x);
  for (int64_t rb = rb0; rb < rb1; ++rb) {
    const int64_t rows = std::min<int64_t>(16, M - rb * 16);
    uint32_t* dst = xt + rb * pairs * 16;
    for (int64_t p = 0; p < pairs; p += 16) {
      __m512i t[16];
      for (int64_t j = 0; j < 16; ++j)
        t[j] = j < rows ? _mm512_loadu_si512(x32 + (rb * 16 + j) * pairs + p) : _mm512_setzero_si512();
      transpose16x16_epi32(t);  // t[i]: pair p + i of the 16 rows
      for (int64_t i = 0; i < 16; ++i) _mm512_storeu_si512(dst + (p + i) * 16, t[i]);
    }
  }
}
inline void fold_amx_rows(const bf16* x, int64_t M, int64_t K, uint32_t* xt) {
  fold_amx_row_blocks(x, M, K, xt, 0, (M + 15) / 16);
}

// A thread's tiles for fold_panel_amx: C 0-3, A 4, B 5, all 16 rows x 64 bytes; released when it goes.
struct FoldAmxTiles {
  FoldAmxTiles() {
    TileConfig c;
    for (int t = 0; t < 6; ++t) c.colsb[t] = 64, c.rows[t] = 16;
    _tile_loadconfig(&c);
  }
  FoldAmxTiles(const FoldAmxTiles&) = delete;
  FoldAmxTiles& operator=(const FoldAmxTiles&) = delete;
  ~FoldAmxTiles() { _tile_release(); }
};

// A panel of 16 weight rows against the M rows of x in xt on AMX: four C tiles (64 rows of x) at a time, over the
// chunks of 32 k in order, A of chunk ch from `a_of(ch, first)` (16 rows x 64 bytes; `first`: the first group of 64
// rows asks, where the A of later groups may be kept), or nullptr to give up: false, nothing written (a_of gives up
// in the first group only). y[m * ldy + n] for n < nrows, rounded to bf16 after the bias (nearest even,
// `vcvtneps2bf16`, as packed_linear_bf16 rounds), a C tile transposed in registers into rows of 16 outputs.
template <typename AOf>
inline bool amx_panel(const uint32_t* xt, int64_t M, int64_t K, int64_t nrows, const float* bias, bf16* y,
                      int64_t ldy, AOf&& a_of) {
  const int64_t chunks = K / 32, pairs = K / 2, blocks = (M + 15) / 16;
  alignas(64) float c[16][16];
  const __mmask16 cols = __mmask16((1u << nrows) - 1);
  const __m512 bv = bias ? _mm512_maskz_loadu_ps(cols, bias) : _mm512_setzero_ps();
  for (int64_t rb0 = 0; rb0 < blocks; rb0 += 4) {
    const int64_t nb = std::min<int64_t>(4, blocks - rb0);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t ch = 0; ch < chunks; ++ch) {
      const uint16_t* a = a_of(ch, rb0 == 0);
      if (a == nullptr) return false;
      asm volatile("" : : : "memory");  // a_of's stores before the tile load: the compiler does not see `tileloadd`
                                        // read them (it sank a decoded row's store past one, Q5_0)
      _tile_loadd(4, a, 64);
      const uint32_t* b = xt + (rb0 * pairs + 16 * ch) * 16;
      _tile_loadd(5, b, 64);
      _tile_dpbf16ps(0, 4, 5);
      if (nb > 1) {
        _tile_loadd(5, b + pairs * 16, 64);
        _tile_dpbf16ps(1, 4, 5);
      }
      if (nb > 2) {
        _tile_loadd(5, b + 2 * pairs * 16, 64);
        _tile_dpbf16ps(2, 4, 5);
      }
      if (nb > 3) {
        _tile_loadd(5, b + 3 * pairs * 16, 64);
        _tile_dpbf16ps(3, 4, 5);
      }
    }
    for (int64_t rb = 0; rb < nb; ++rb) {
      switch (rb) {  // tile ids are immediates
        case 0: _tile_stored(0, c, 64); break;
        case 1: _tile_stored(1, c, 64); break;
        case 2: _tile_stored(2, c, 64); break;
        default: _tile_stored(3, c, 64); break;
      }
      // c[n][j] -> row j's 16 outputs in one register: + bias, rounded as packed_linear_bf16 rounds (nearest even)
      __m512i t[16];
      for (int i = 0; i < 16; ++i) t[i] = _mm512_load_si512(c[i]);
      transpose16x16_epi32(t);
      const int64_t m0 = (rb0 + rb) * 16, rows = std::min<int64_t>(16, M - m0);
      for (int64_t j = 0; j < rows; ++j)
        _mm256_mask_storeu_epi16(y + (m0 + j) * ldy, cols,
                                 (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps((__m512)t[j], bv)));
    }
  }
  return true;
}

// Weight rows [nrows <= 16] (MXFP4, row_bytes apart) against the M rows of x in xt: y[m * ldy + n] for n < nrows,
// rounded to bf16 after the bias. false, with nothing written, where a block does not fold.
inline bool fold_panel_amx(const uint32_t* xt, int64_t M, int64_t K, const uint8_t* w, int64_t row_bytes,
                           int64_t nrows, const float* bias, bf16* y, int64_t ldy) {
  constexpr int64_t kBytes = FormatMXFP4::kBytes;
  const int64_t chunks = K / 32;
  alignas(64) uint16_t a[16][32];
  const __m512i table = _mm512_load_si512(kTableMxfp4.v);
  for (int64_t n = nrows; n < 16; ++n) _mm512_store_si512(a[n], _mm512_setzero_si512());
  return amx_panel(xt, M, K, nrows, bias, y, ldy, [&](int64_t ch, bool first) -> const uint16_t* {
    if (first) prefetch_slice(w + 16 * row_bytes, 16 * row_bytes, ch, chunks);  // the next panel (quant.h)
    for (int64_t n = 0; n < nrows; ++n) {
      const uint8_t* blk = w + n * row_bytes + ch * kBytes;
      if (!mxfp4_folds(blk[0])) return nullptr;
      _mm512_store_si512(a[n], mxfp4_folded(blk, table));
    }
    return &a[0][0];
  });
}

// Weight rows [nrows <= 16] of format F against the M rows of x in xt, each weight its fp32 decoding (F::dequant)
// rounded to bf16 (`vcvtne2ps2bf16`, nearest even): the weight the widened engine holds. A is the panel's rows as they
// lie, 32 k a tile row, so nothing is transposed. M <= 64 (kWidenedSlab: one group of C tiles); wa is a ring of one
// block's chunks ([B / 32][16][32]), each decoded A used once while it is in L1. Each output sums its chunks in k
// order and each chunk's pairs as the hardware does, as packed_linear_bf16 on AMX does over the widened weight with
// the roles of A and B swapped (products of two bf16 are exact in fp32): the same bits.
template <typename F>
inline int64_t widened_amx_buffer() {
  return F::kBlock / 32 * 16 * 32;
}

// Rows of x a call of widened_panel_amx takes (its four C tiles): more rows run in slabs of 64, each slab over every
// panel (so x's slab stays in L2: 64 x 9728 bf16 is 1.2 MB) and every panel decoded again per slab into the L1 ring.
// Keeping a panel decoded for all of M instead ([K / 32][16][32] bf16: 80-300 KB, from L2 for each tile) and reading
// all of x per panel was no faster, and slower where K is long: Qwen3-4B shape, 2 threads, 1024 rows (the widened
// weight's kernel in the same run): 19456 x 2560 Q4_K 97.7 -> 98.4 ms (83-85), 2560 x 9728 Q6_K 48.7 -> 36.2 ms
// (32); 32 weight rows a panel with two A and two B tiles a chunk, x read half as often, measured 85-99 and 43-49 ms.
// With x folded in parallel (below), `bench quant`'s 32 concurrent calls on that file went from 0.86x to 0.99x the
// widened engine (the prompts' prefill is half that run's time).
constexpr int64_t kWidenedSlab = 64;
template <typename F>
inline void widened_panel_amx(const uint32_t* xt, int64_t M, int64_t K, const uint8_t* w, int64_t row_bytes,
                              int64_t nrows, const float* bias, bf16* y, int64_t ldy, uint16_t* wa) {
  using KB = Bf16KBlock<F>;
  constexpr int64_t kPer = F::kBlock / 32;  // chunks of a block
  constexpr bool kFp32 = !Bf16Block<F>::kHas && !KB::kHas;
  const int64_t blocks = K / F::kBlock;
  alignas(64) float f[kFp32 ? 16 : 1][F::kBlock];  // the decoded block (formats without a register decoder)
  amx_panel(xt, M, K, nrows, bias, y, ldy, [&](int64_t ch, bool first) -> const uint16_t* {
    uint16_t* a = wa + (ch % kPer) * 16 * 32;
    if (!first) return a;
    if constexpr (Bf16Block<F>::kHas) {  // a block is a chunk: decoded straight into the tile's rows
      prefetch_slice(w + 16 * row_bytes, 16 * row_bytes, ch, blocks);  // the next panel (quant.h)
      for (int64_t n = 0; n < 16; ++n)
        _mm512_storeu_si512(a + n * 32, n < nrows ? Bf16Block<F>::decode(w + n * row_bytes + ch * F::kBytes)
                                                  : _mm512_setzero_si512());
    } else if constexpr (KB::kHas) {  // a row's block decoded whole (its scales once) at the block's first chunk
      if (ch % kPer != 0) return a;
      const int64_t b = ch / kPer;
      prefetch_slice(w + 16 * row_bytes, 16 * row_bytes, b, blocks);
      for (int64_t n = 0; n < 16; ++n) {
        if (n < nrows) {
          KB::decode(w + n * row_bytes + b * F::kBytes, a + n * 32, 16 * 32);
        } else {
          for (int64_t c = 0; c < kPer; ++c) _mm512_storeu_si512(a + (c * 16 + n) * 32, _mm512_setzero_si512());
        }
      }
    } else {  // a block's 16 rows decoded to fp32 at its first chunk, rounded a chunk at a time
      const int64_t b = ch / kPer, c = (ch % kPer) * 32;
      if (c == 0) {
        prefetch_slice(w + 16 * row_bytes, 16 * row_bytes, b, blocks);  // the next panel (quant.h)
        for (int64_t n = 0; n < nrows; ++n) F::dequant(w + n * row_bytes + b * F::kBytes, f[n]);
      }
      for (int64_t n = 0; n < 16; ++n)
        _mm512_storeu_si512(a + n * 32, n < nrows ? (__m512i)_mm512_cvtne2ps_pbh(_mm512_load_ps(f[n] + c + 16),
                                                                                 _mm512_load_ps(f[n] + c))
                                                 : _mm512_setzero_si512());
    }
    return a;
  });
}
#endif

#if defined(AGENTRT_AMX)
// One panel of 16 weight rows (nrows <= 16; w, bias and y start at its first row) on AMX, or where a block does not
// fold, its 4 groups on the register path (qdot_group; sx: x's per-32 sums, as there).
template <typename F>
inline void fold_or_qdot_panel(const uint32_t* xt, const bf16* x, int64_t M, int64_t K, const uint8_t* w,
                               int64_t row_bytes, int64_t nrows, const float* sx, const float* bias, bf16* y,
                               int64_t ldy) {
  if (fold_panel_amx(xt, M, K, w, row_bytes, nrows, bias, y, ldy)) return;
  QdotBuffers& buf = qdot_buffers(K);
  for (int64_t g = 0; g < nrows; g += kQdotCols)
    qdot_group<F>(x, M, K, w + g * row_bytes, row_bytes, std::min(kQdotCols, nrows - g), sx,
                  bias ? bias + g : nullptr, y + g, ldy, buf);
}
#endif

#if defined(AGENTRT_AMX)
// x's rows folded into B operands once (fold_amx_rows), then the weight's panels of 16 rows over the threads, each
// thread's tiles configured once for its share: fn(xt, first weight row, rows of the panel).
template <typename Fn>
inline void amx_row_panels(const bf16* x, int64_t M, int64_t K, int64_t N, Fn&& fn) {
  // every element written by the fold, its row blocks shared out: inside decode_forward's team every thread runs this
  // code (SPMD) and folds only its share, so the buffer is the team's (shared_buffer); outside one, this thread's,
  // kept so that its pages are not new each call
  thread_local std::vector<char> local;
  const size_t bytes = static_cast<size_t>(fold_amx_rows_size(M, K)) * sizeof(uint32_t);
  uint32_t* xp = reinterpret_cast<uint32_t*>(agentrt::shared_buffer(local, bytes));
  agentrt::stealing_for((M + 15) / 16, [&](int64_t b0, int64_t b1) { fold_amx_row_blocks(x, M, K, xp, b0, b1); });
  agentrt::stealing_for((N + 15) / 16, [&](int64_t p0, int64_t p1) {
    FoldAmxTiles tiles;
    for (int64_t p = p0; p < p1; ++p) fn(xp, p * 16, std::min<int64_t>(16, N - p * 16));
  });
  if (local.size() > (size_t(64) << 20)) std::vector<char>().swap(local);  // past 64 MB: not kept for the next call
}
#endif

// Whether format F's bf16 rows take fold_panel_amx (MXFP4 on a CPU with AMX, the tiles granted).
template <typename F>
inline bool fold_amx_applies() {
#if defined(AGENTRT_AMX)
  if constexpr (Bf16Unpack<F>::kFold) return amx_ready();
#endif
  return false;
}

// ---------------------------------------------------------------- many rows: a panel widened to bf16 on the fly
//
// From kQuantWidenMinRows rows of x (outside the engine's deterministic mode) a thread decodes 32 weight rows into
// one bf16 panel of linear.h's layout ([K / 2, 32, 2]) and runs linear.h's bf16 tiles over it (`linear_panel_bf16`:
// one `vdpbf16ps` per 32 products, where the integer path above needs a dot product and an FMA by the scale). Each
// weight is its fp32 decoding rounded to bf16 (nearest even): the weight the widened engine holds
// (`dequantize(w).to(torch.bfloat16)`), so the output is packed_linear_bf16's over that weight, bit for bit. The two
// paths sum differently (and over bf16-rounded weights here), so a row's output depends on whether M reaches the
// threshold: the deterministic mode (`invariant`) keeps the integer path for every M. On AMX the panels are 16 rows
// decoded straight into A tiles instead (widened_panel_amx: no transposes), the same bits; SmolLM2's four weights
// (Q4_1, Q8_0), 2-core Xeon: 8 rows 3.7 -> 2.6 ms, 32 rows 4.5 -> 4.0 ms, 128 about even; with the 32-weight blocks
// decoded in registers (Bf16Block) and the outputs written 16 at a time, one layer's four weights at 32 rows 1.76x ->
// 1.43x the widened weight's bf16 time (both in cache). The K-quants' 256-weight blocks decoded whole in registers
// too (quant_widen.h's Bf16KBlock: Q4_K / Q5_K a sub-block's 16 or 32 weights as one table, a chunk one `vpermw`),
// into a ring of one block's chunks that stays in L1 up to 64 rows; 4096 x 2560, 2 threads, old -> new (bf16 over the
// widened weight): Q4_K 8 rows 0.87 -> 0.40 ms (0.43), 32 rows 1.02 -> 0.51 (0.55), 256 rows 3.28 -> 2.63 (2.37); Q5_K
// 0.97 -> 0.53, 1.09 -> 0.64, 3.37 -> 2.91; Q6_K 1.47 -> 0.58 (0.52), 1.58 -> 0.72 (0.64), 3.87 -> 3.01 (2.55).
// Without the ring (wa [K / 32] chunks whatever M) Q4_K at 8 rows 1.19 ms against 1.04 (one thread). At 1 row that
// path is 1.65x the integer one's time, so the deterministic mode cannot take it for every M as MXFP4's fold does.

// Rows of x from which the widened panels run: every row count past the 1-4 of the register paths. Measured on a
// 2-core AVX512-BF16 EPYC over SmolLM2-135M's shapes (Q4_1 and Q8_0; 960 x 576, 3072 x 576, 576 x 1536): at 5 rows
// 1.05-1.2x the integer tiles, at 8 1.15-1.45x, at 32 1.6-2.2x (0.7-0.77x the bf16 tiles over a widened weight:
// the decoding is the difference).
constexpr int64_t kQuantWidenMinRows = 5;

// 16 rows of 16 dwords (r[i]) transposed in registers: r[j] becomes column j.
inline void transpose16x16_epi32(__m512i (&r)[16]) {
  __m512i a[16], b[16];
  for (int i = 0; i < 8; ++i) {
    a[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    a[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // b[4i + j], lane L: rows 4i .. 4i + 3 of column 4L + j
    b[4 * i] = _mm512_unpacklo_epi64(a[4 * i], a[4 * i + 2]);
    b[4 * i + 1] = _mm512_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
    b[4 * i + 2] = _mm512_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
    b[4 * i + 3] = _mm512_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
  }
  for (int j = 0; j < 4; ++j) {  // a[j]: lanes of columns j and 8 + j, rows 0-7; a[8 + j] the same of rows 8-15
    a[j] = _mm512_shuffle_i32x4(b[j], b[4 + j], 0x88);
    a[4 + j] = _mm512_shuffle_i32x4(b[j], b[4 + j], 0xdd);
    a[8 + j] = _mm512_shuffle_i32x4(b[8 + j], b[12 + j], 0x88);
    a[12 + j] = _mm512_shuffle_i32x4(b[8 + j], b[12 + j], 0xdd);
  }
  for (int j = 0; j < 4; ++j) {
    r[j] = _mm512_shuffle_i32x4(a[j], a[8 + j], 0x88);
    r[8 + j] = _mm512_shuffle_i32x4(a[j], a[8 + j], 0xdd);
    r[4 + j] = _mm512_shuffle_i32x4(a[4 + j], a[12 + j], 0x88);
    r[12 + j] = _mm512_shuffle_i32x4(a[4 + j], a[12 + j], 0xdd);
  }
}

// Weight rows [rows] (rows <= 32, rows row_bytes apart, format F) as one bf16 panel of linear.h's layout
// ([K / 2, 32, 2], pair kk of column n at dword kk * 32 + n), rows past `rows` zero: per block of columns, 16 rows'
// blocks decoded to fp32 (F::dequant, L1), each 32 weights rounded to 16 bf16 pairs (`vcvtne2ps2bf16`: nearest even,
// torch's rounding for normal numbers; it flushes fp32 subnormals, which only MXFP4 blocks of exponent byte 0 or 1
// decode to) and the 16 x 16 pairs transposed in registers.
template <typename F>
inline void unpack_panel_bf16(const uint8_t* w, int64_t row_bytes, int64_t rows, int64_t K, std::vector<bf16>& panel) {
  alignas(64) float blk[16][F::kBlock];
  panel.resize(size_t(bf16_panel_elems(K)));
  uint32_t* out = reinterpret_cast<uint32_t*>(panel.data());
  for (int64_t b = 0; b < K / F::kBlock; ++b) {
    for (int64_t h = 0; h < kPanelBf16; h += 16) {
      for (int64_t i = 0; i < 16 && h + i < rows; ++i) F::dequant(w + (h + i) * row_bytes + b * F::kBytes, blk[i]);
      for (int64_t c = 0; c < F::kBlock; c += 32) {
        __m512i t[16];
        for (int64_t i = 0; i < 16; ++i) {
          const bool row = h + i < rows;
          t[i] = row ? (__m512i)_mm512_cvtne2ps_pbh(_mm512_load_ps(blk[i] + c + 16), _mm512_load_ps(blk[i] + c))
                     : _mm512_setzero_si512();
        }
        transpose16x16_epi32(t);
        const int64_t kk = (b * F::kBlock + c) / 2;
        for (int i = 0; i < 16; ++i) _mm512_storeu_si512(out + (kk + i) * kPanelBf16 + h, t[i]);
      }
    }
  }
}

// quant_linear_bf16 from kQuantWidenMinRows rows outside the deterministic mode: threads take panels of 32 weight
// rows, each widened to bf16 once and run by linear.h's tiles (AMX where packed_linear_bf16 would use it).
template <typename F>
inline void quant_linear_widened_bf16(const bf16* x, int64_t M, int64_t K, const uint8_t* w, const float* bias,
                                      bf16* y, int64_t N, int64_t ldy) {
  const int64_t row_bytes = K / F::kBlock * F::kBytes, panels = (N + kPanelBf16 - 1) / kPanelBf16;
  const bool use_amx = amx_linear_applies(K);
  agentrt::stealing_for(panels, [&](int64_t p0, int64_t p1) {
    thread_local std::vector<bf16> panel;
    Bf16Panels s(use_amx);
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * kPanelBf16, ncols = std::min(kPanelBf16, N - n0);
      unpack_panel_bf16<F>(w + n0 * row_bytes, row_bytes, ncols, K, panel);
      linear_panel_bf16(x, nullptr, M, K, panel.data(), bias ? bias + n0 : nullptr, y + n0, ldy, ncols, s);
    }
  });
}

// x's per-32 sums where format F has offsets (c terms), else empty.
template <typename F>
inline std::vector<float> offset_sums_bf16(const bf16* x, int64_t M, int64_t K) {
  std::vector<float> sx(Bf16Unpack<F>::kOffsets ? size_t(M * (K / 32)) : 0);
  if constexpr (Bf16Unpack<F>::kOffsets) chunk_sums_bf16(x, M, K, sx.data());
  return sx;
}

}  // namespace agentrt

#include "quant_vnni.h"

namespace agentrt {

// x [M, K] bf16, w [N, K / B * bytes] in format F, bias fp32 [N] or null -> y [M, N] bf16, rows ldy apart (N: a
// whole output; more: these N columns of a wider one, e.g. a fused projection's part). `invariant` (the engine's
// deterministic mode): the integer path for every M, so a row's output does not depend on M; else from
// kQuantWidenMinRows rows the widened panels.
template <typename F>
inline void quant_linear_bf16(const bf16* x, int64_t M, int64_t K, const uint8_t* w, const float* bias, bf16* y,
                              int64_t N, int64_t ldy, bool invariant) {
  if (!invariant && M >= kQuantWidenMinRows) {
#if defined(AGENTRT_AMX)
    if (amx_linear_applies(K)) {  // panels of 16 weight rows decoded straight into A tiles (widened_panel_amx)
      const int64_t row_bytes = K / F::kBlock * F::kBytes;
      for (int64_t m0 = 0; m0 < M; m0 += kWidenedSlab) {  // kWidenedSlab rows of x at a time (its comment)
        const int64_t ms = std::min(kWidenedSlab, M - m0);
        amx_row_panels(x + m0 * K, ms, K, N, [&](const uint32_t* xt, int64_t n0, int64_t nrows) {
          thread_local std::vector<uint16_t> wa;
          wa.resize(size_t(widened_amx_buffer<F>()));
          widened_panel_amx<F>(xt, ms, K, w + n0 * row_bytes, row_bytes, nrows, bias ? bias + n0 : nullptr,
                               y + m0 * ldy + n0, ldy, wa.data());
        });
      }
      return;
    }
#endif
    quant_linear_widened_bf16<F>(x, M, K, w, bias, y, N, ldy);
    return;
  }
  const int64_t row_bytes = K / F::kBlock * F::kBytes;
  const std::vector<float> sx = offset_sums_bf16<F>(x, M, K);
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  if constexpr (vnni_applies<F>()) {
    if (!invariant && M <= kQdotRows && K % 64 == 0) {  // decode's rows by integer dot products (quant_vnni.h)
      quant_linear_vnni<F>(x, M, K, w, bias, y, N, ldy, sx.data());
      return;
    }
  }
#endif
#if defined(AGENTRT_AMX)
  if (fold_amx_applies<F>()) {  // panels of 16 weight rows on AMX (fold_panel_amx), the register path where one does not fold
    amx_row_panels(x, M, K, N, [&](const uint32_t* xt, int64_t n0, int64_t nrows) {
      fold_or_qdot_panel<F>(xt, x, M, K, w + n0 * row_bytes, row_bytes, nrows, sx.data(), bias ? bias + n0 : nullptr,
                            y + n0, ldy);
    });
    return;
  }
#endif
  const int64_t groups = (N + kQdotCols - 1) / kQdotCols;
  const int64_t per_task = M <= 4 ? 4 : 1;  // groups a task takes: decode's are short
  agentrt::stealing_for((groups + per_task - 1) / per_task, [&](int64_t t0, int64_t t1) {
    QdotBuffers& buf = qdot_buffers(K);
    for (int64_t g = t0 * per_task; g < std::min(groups, t1 * per_task); ++g) {
      const int64_t n0 = g * kQdotCols;
      qdot_group<F>(x, M, K, w + n0 * row_bytes, row_bytes, std::min(kQdotCols, N - n0), sx.data(),
                    bias ? bias + n0 : nullptr, y + n0, ldy, buf);
    }
  });
}

}  // namespace agentrt

#endif  // __AVX512BF16__
