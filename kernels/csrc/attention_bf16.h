// Causal attention of any rows (decode, drafts, prefill chunks) from a bf16 paged cache on AVX512-BF16
// (flash-attention's tiling on CPU registers). Per (sequence, kv head) the visible K and V are first
// packed into the operand layouts of `vdpbf16ps` (which multiplies pairs of bf16 and adds both
// products to an fp32 lane), 16 positions at a time (16 x 16 transposes, row-pair interleaves):
//   K^T in pairs: kt[dd][n] = (k[n][2dd], k[n][2dd + 1])     [D / 2][Lp] 32-bit pairs
//   V in pairs:   vp[nn][d] = (v[2nn][d], v[2nn + 1][d])     [Lp / 2][D]
// Then each group of MR query rows (the rows of one kv head: query positions x the heads of its GQA
// group) walks the KV positions it can see in tiles of 32: S = q k^T (2 x MR accumulators of 16
// lanes), online softmax in fp32 (exp in 16 lanes), P rounded to bf16 (as torch's bf16 flash
// attention does), O += P v (MR x D / 16 accumulators, in registers for the whole walk).
// Traffic: K and V read once per (sequence, kv head), the next 16 rows prefetched while packing.
// Rows that fit one register tile (decode) skip the packing: walk_direct reads K and V rows as they lie
// in the cache; longer runs pack the sequence's K/V whole first. Few items (one decode sequence)
// split their positions across the threads and merge the parts (see paged_attention_bf16).
// FLOPs: 4 D per (row, visible position), rounded up to whole tiles of 32 positions on the diagonal;
// against the fp32-lane kernel (attention.h) the dot products do 2x the work per instruction and
// need no horizontal sums: measured 1.4-2.3x faster for decode (9 / 3 heads, D 64, 1-4 sequences).

#pragma once

#if defined(__AVX512BF16__)

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "team.h"
#include "vec.h"

namespace agentrt {

constexpr int64_t kPrefillTile = 32;  // KV positions per tile
constexpr int64_t kRowsPerItem = 64;  // query rows (position x head) per work item
constexpr int64_t kParallelWork = 2048;  // (query row x head, position) pairs from which items go to all threads

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

inline v16 splat16(float x) { return v16{} + x; }

// 2^x in 16 lanes: split x = n + f, f in [-0.5, 0.5], 2^f by a degree-6 polynomial (~1 ulp); x at or
// below -126 gives 0 (masked scores are -inf).
inline v16 exp2_16(v16 x) {
  x = x < splat16(-126.f) ? splat16(-126.f) : x;
  x = x > splat16(126.f) ? splat16(126.f) : x;
  const v16 n = (v16)_mm512_roundscale_ps((__m512)x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const v16 f = x - n;
  v16 p = splat16(1.535336188319500e-4f);
  p = p * f + splat16(1.339887440266574e-3f);
  p = p * f + splat16(9.618437357674640e-3f);
  p = p * f + splat16(5.550332471162809e-2f);
  p = p * f + splat16(2.402264791363012e-1f);
  p = p * f + splat16(6.931472028550421e-1f);
  p = p * f + splat16(1.f);
  const v16i bits = (__builtin_convertvector(n, v16i) + 127) << 23;
  return x <= splat16(-126.f) ? splat16(0.f) : p * (v16)bits;
}

// 16 x 16 transpose of 32-bit elements: r[i] = row i in, column i out (four shuffle stages).
inline void transpose16x16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  __m512i u[16];  // u[4q + c], 128-bit lane k: column 4k + c of rows 4q..4q+3
  for (int q = 0; q < 4; ++q) {
    u[4 * q] = _mm512_unpacklo_epi64(t[4 * q], t[4 * q + 2]);
    u[4 * q + 1] = _mm512_unpackhi_epi64(t[4 * q], t[4 * q + 2]);
    u[4 * q + 2] = _mm512_unpacklo_epi64(t[4 * q + 1], t[4 * q + 3]);
    u[4 * q + 3] = _mm512_unpackhi_epi64(t[4 * q + 1], t[4 * q + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i a0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x88), a1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xdd);
    const __m512i b0 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x88),
                  b1 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xdd);
    r[c] = _mm512_shuffle_i32x4(a0, b0, 0x88);
    r[8 + c] = _mm512_shuffle_i32x4(a0, b0, 0xdd);
    r[4 + c] = _mm512_shuffle_i32x4(a1, b1, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(a1, b1, 0xdd);
  }
}

// Packs the K and V of positions [start, start + count) of kv heads [kvh0, kvh1) of one sequence
// (blocks through `table`), 16 positions at a time, in one pass over their rows: K rows transposed in
// 16 x 16 tiles of pairs, V row pairs interleaved; the next 16 rows are prefetched meanwhile. Head
// h's K^T goes to buf + (h - kvh0) * Lp * D (D / 2 rows of Lp pairs), its V pairs right after (Lp / 2
// rows of D); columns past `count` hold zeros.
inline void pack_kv(const bf16* k_cache, const bf16* v_cache, const int32_t* table, int64_t start, int64_t count,
                    int64_t kvh0, int64_t kvh1, int64_t KVH, int64_t D, int64_t block_size, uint32_t* buf,
                    int64_t Lp) {
  alignas(64) static const bf16 zeros[256] = {};
  const int64_t half = D / 2, heads = kvh1 - kvh0;
  const __m512i lo_idx = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i hi_idx = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  auto row_offset = [&](int64_t j, int64_t bound) {  // of head kvh0 at position start + j, -1 from bound on
    const int64_t n = start + j;
    return j < bound ? ((int64_t)table[n / block_size] * block_size + n % block_size) * KVH * D + kvh0 * D
                     : int64_t(-1);
  };
  for (int64_t n0 = 0; n0 < Lp; n0 += 16) {
    int64_t off[16];
    for (int j = 0; j < 16; ++j) {
      off[j] = row_offset(n0 + j, count);
      const int64_t next = row_offset(n0 + 16 + j, count);  // the next 16 rows: in flight while these are packed
      if (next >= 0) {
        for (int64_t e = 0; e < heads * D; e += 32) {
          __builtin_prefetch(k_cache + next + e);
          __builtin_prefetch(v_cache + next + e);
        }
      }
    }
    for (int64_t h = 0; h < heads; ++h) {
      uint32_t* kt = buf + h * Lp * D;
      uint32_t* vp = kt + half * Lp;
      const bf16* krow[16];
      const bf16* vrow[16];
      for (int j = 0; j < 16; ++j) {
        krow[j] = off[j] >= 0 ? k_cache + off[j] + h * D : zeros;
        vrow[j] = off[j] >= 0 ? v_cache + off[j] + h * D : zeros;
      }
      for (int64_t g = 0; g < half; g += 16) {  // 16 pairs (32 dims) of each of the 16 rows
        __m512i r[16];
        for (int j = 0; j < 16; ++j) r[j] = _mm512_loadu_si512(krow[j] + 2 * g);
        transpose16x16(r);
        for (int c = 0; c < 16 && g + c < half; ++c) _mm512_storeu_si512(kt + (g + c) * Lp + n0, r[c]);
      }
      for (int j = 0; j < 16; j += 2) {
        uint32_t* dst = vp + ((n0 + j) / 2) * D;
        for (int64_t d = 0; d < D; d += 32) {
          const __m512i a = _mm512_loadu_si512(vrow[j] + d), b = _mm512_loadu_si512(vrow[j + 1] + d);
          const __m512i lo = _mm512_unpacklo_epi16(a, b), hi = _mm512_unpackhi_epi16(a, b);
          _mm512_storeu_si512(dst + d, _mm512_permutex2var_epi32(lo, lo_idx, hi));
          _mm512_storeu_si512(dst + d + 16, _mm512_permutex2var_epi32(lo, hi_idx, hi));
        }
      }
    }
  }
}

// The packed K^T and V pairs of the kPrefillTile positions from a tile's first: K^T rows `stride` pairs
// apart, V pair rows D apart.
struct Tile {
  const uint32_t* k;
  int64_t stride;
  const uint32_t* v;
};

// One row's online-softmax step over a tile's 32 scores s0, s1 (log2 units, hidden ones -inf): its
// running max and sum updated, its output accumulators o[NC] rescaled when the max grew, P rounded to
// bf16 pairs into pbuf[16].
// A tile whose scores are all hidden while the row's are so far (a tile before the row's window, walked for
// another row of its register tile) changes nothing: P is zero and the running max, sum and output stay.
template <int NC>
inline void softmax_tile(v16 s0, v16 s1, float& m_run, float& l_run, __m512* o, uint32_t* pbuf) {
  const float m_new = std::max(m_run, _mm512_reduce_max_ps(_mm512_max_ps((__m512)s0, (__m512)s1)));
  if (m_new == -std::numeric_limits<float>::infinity()) {
    _mm512_store_si512(pbuf, _mm512_setzero_si512());
    return;
  }
  const v16 p0 = exp2_16(s0 - m_new), p1 = exp2_16(s1 - m_new);
  if (m_new != m_run) {
    const float alpha = std::exp2(m_run - m_new);
    l_run *= alpha;
    const __m512 av = _mm512_set1_ps(alpha);
    for (int c = 0; c < NC; ++c) o[c] = _mm512_mul_ps(o[c], av);
  }
  l_run += _mm512_reduce_add_ps((__m512)(p0 + p1));
  m_run = m_new;
  _mm512_store_si512(pbuf, (__m512i)_mm512_cvtne2ps_pbh((__m512)p1, (__m512)p0));
}

// A walk's MR rows out: normalized to bf16 rows out[m], or with `partial` each row's unnormalized
// output, running max and sum (D + 2 floats at partial[m]: one part of a split walk).
template <int MR, int NC>
inline void finish_rows(const __m512 (&o)[MR][NC], const float* m_run, const float* l_run, bf16* const* out,
                        float* const* partial) {
  constexpr int64_t D = NC * 16;
  if (partial) {
    for (int m = 0; m < MR; ++m) {
      for (int c = 0; c < NC; ++c) _mm512_storeu_ps(partial[m] + 16 * c, o[m][c]);
      partial[m][D] = m_run[m];
      partial[m][D + 1] = l_run[m];
    }
    return;
  }
  for (int m = 0; m < MR; ++m) {
    const __m512 inv = _mm512_set1_ps(1.f / l_run[m]);
    for (int c = 0; c < NC; ++c)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out[m] + 16 * c),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(o[m][c], inv)));
  }
}

// hides the scores of tile positions before a row's sliding window (`window` > 0: position pos sees
// (pos - window, pos]); t0 = the tile's first position
inline void hide_before_window(v16& s0, v16& s1, int64_t t0, int64_t pos, int64_t window) {
  if (window <= 0 || t0 > pos - window) return;
  const v16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const float first = static_cast<float>(pos - window + 1 - t0);  // the first visible lane
  const v16 inf = splat16(-std::numeric_limits<float>::infinity());
  s0 = lane < first ? inf : s0;
  s1 = lane + 16.f < first ? inf : s1;
}

// MR query rows (bf16 pairs qp[m][dd], positions pos[m]) against the K/V of positions [base, base + Lp),
// at most every row's position for `base`, a tile at a time from tiles(n0), n0 from `from` (a multiple
// of kPrefillTile: the tiles before it hidden from every row by its window); writes out rows, or with
// `partial` each row's unnormalized output, running max and sum (D + 2 floats at partial[m]: one part
// of a split walk).
template <int MR, int NC, typename Tiles>
inline void walk_rows(const uint32_t* qp, const int64_t* pos, int64_t Lp, int64_t base, int64_t from, int64_t window,
                      float scale_log2e, bf16* const* out, float* const* partial, Tiles&& tiles) {
  constexpr int64_t D = NC * 16, half = D / 2;
  __m512 o[MR][NC];
  float m_run[MR], l_run[MR];
  for (int m = 0; m < MR; ++m) {
    for (int c = 0; c < NC; ++c) o[m][c] = _mm512_setzero_ps();
    m_run[m] = -std::numeric_limits<float>::infinity();
    l_run[m] = 0.f;
  }
  int64_t last = 0;
  for (int m = 0; m < MR; ++m) last = std::max(last, pos[m] - base);
  last = std::min(last, Lp - 1);
  alignas(64) uint32_t pbuf[MR][kPrefillTile / 2];
  const v16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  for (int64_t n0 = from; n0 <= last; n0 += kPrefillTile) {
    const Tile t = tiles(n0);
    __m512 s[MR][2];
    for (int m = 0; m < MR; ++m) s[m][0] = s[m][1] = _mm512_setzero_ps();
    for (int64_t dd = 0; dd < half; ++dd) {
      const __m512bh w0 = (__m512bh)_mm512_loadu_si512(t.k + dd * t.stride);
      const __m512bh w1 = (__m512bh)_mm512_loadu_si512(t.k + dd * t.stride + 16);
      for (int m = 0; m < MR; ++m) {
        const __m512bh a = (__m512bh)_mm512_set1_epi32(qp[m * half + dd]);
        s[m][0] = _mm512_dpbf16_ps(s[m][0], a, w0);
        s[m][1] = _mm512_dpbf16_ps(s[m][1], a, w1);
      }
    }
    for (int m = 0; m < MR; ++m) {
      v16 s0 = (v16)s[m][0] * scale_log2e, s1 = (v16)s[m][1] * scale_log2e;
      if (base + n0 + kPrefillTile > pos[m]) {  // the diagonal tile (or past it): hide positions after the row's own
        const float lim = static_cast<float>(pos[m] - base - n0);
        const v16 inf = splat16(-std::numeric_limits<float>::infinity());
        s0 = lane > lim ? inf : s0;
        s1 = lane + 16.f > lim ? inf : s1;
      }
      hide_before_window(s0, s1, base + n0, pos[m], window);
      softmax_tile<NC>(s0, s1, m_run[m], l_run[m], o[m], pbuf[m]);
    }
    for (int64_t nn = 0; nn < kPrefillTile / 2; ++nn) {
      __m512bh v[NC];
      for (int c = 0; c < NC; ++c) v[c] = (__m512bh)_mm512_loadu_si512(t.v + nn * D + 16 * c);
      for (int m = 0; m < MR; ++m) {
        const __m512bh a = (__m512bh)_mm512_set1_epi32(pbuf[m][nn]);
        for (int c = 0; c < NC; ++c) o[m][c] = _mm512_dpbf16_ps(o[m][c], a, v[c]);
      }
    }
  }
  finish_rows<MR, NC>(o, m_run, l_run, out, partial);
}

// Per lane j, the sum of v[j]'s 16 lanes (a transposing reduction: 45 shuffles and adds for 16 sums).
inline __m512 sum16x16(const __m512 v[16]) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: halves of v[2i], v[2i + 1] interleaved
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: that lane's sums of v[4i .. 4i + 3]
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i)  // 128-bit lanes 0 + 1 and 2 + 3 of b[2i], then of b[2i + 1]
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xdd));
}

// Decode's walk (MR query rows of one kv head, D = 32 KZ) straight from the paged cache, no packed
// copy: per chunk of kPrefillTile positions, S = q k^T from K rows as they lie (each row's products in
// 16 lanes, summed across lanes 16 positions at a time by sum16x16), online softmax as in walk_rows,
// O += P v with V row pairs interleaved in registers (unpacklo / unpackhi of two rows: the
// accumulators' lanes hold the dims in that interleaved order, put back once at the end). Against
// packing each tile (walk_rows with a tile source) it skips the 16 x 16 transposes and the stores of
// the packed copy. Positions [base, end) of the kv head at kv_off of each cache row; row m sees up to
// pos[m] (and, with `window`, from pos[m] - window + 1). Outputs as walk_rows.
// INV (batch-invariant mode): each 16 x 32-dim block of K rows is transposed in registers
// (transpose16x16, as pack_kv does) and the scores are summed over dim pairs in walk_rows's order, so a
// decode row's output is bit-identical to the same row's in a prefill chunk (walk_rows), still without
// a packed copy in memory.
template <int MR, int KZ, bool INV = false>
inline void walk_direct(const uint32_t* qp, const int64_t* pos, int64_t base, int64_t end, const bf16* k_cache,
                        const bf16* v_cache, const int32_t* table, int64_t block_size, int64_t row_stride,
                        int64_t kv_off, int64_t window, float scale_log2e, bf16* const* out,
                        float* const* partial) {
  constexpr int64_t D = KZ * 32, half = D / 2, NC = 2 * KZ;
  alignas(64) static const bf16 zeros[D] = {};
  __m512 o[MR][NC];
  float m_run[MR], l_run[MR];
  int64_t last = 0;  // the last position any row sees, from base
  for (int m = 0; m < MR; ++m) {
    for (int c = 0; c < NC; ++c) o[m][c] = _mm512_setzero_ps();
    m_run[m] = -std::numeric_limits<float>::infinity();
    l_run[m] = 0.f;
    last = std::max(last, pos[m] - base);
  }
  last = std::min(last, end - 1 - base);
  alignas(64) uint32_t pbuf[MR][kPrefillTile / 2];
  const v16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  int64_t blk = base / block_size, in = base - blk * block_size;  // the walk's place in the block table
  // offsets of the chunk's rows from n0 (-1 past the walk's end), one chunk ahead of the walk
  auto offsets = [&](int64_t n0, int64_t* off) {
    for (int64_t j = 0; j < kPrefillTile; ++j) {
      if (base + n0 + j >= end) {
        off[j] = -1;
        continue;
      }
      off[j] = ((int64_t)table[blk] * block_size + in) * row_stride + kv_off;
      if (++in == block_size) {
        in = 0;
        ++blk;
      }
    }
  };
  int64_t cur[kPrefillTile], next[kPrefillTile];
  offsets(0, cur);
  for (int64_t n0 = 0; n0 <= last; n0 += kPrefillTile) {
    const int64_t count = std::min(kPrefillTile, end - base - n0);
    const bool more = n0 + kPrefillTile <= last;
    if (more) {  // the next chunk's rows in flight meanwhile
      offsets(n0 + kPrefillTile, next);
      for (int64_t j = 0; j < kPrefillTile; ++j)
        if (next[j] >= 0)
          for (int64_t e = 0; e < D; e += 32) {
            __builtin_prefetch(k_cache + next[j] + e);
            __builtin_prefetch(v_cache + next[j] + e);
          }
    }
    const bf16* krow[kPrefillTile];
    const bf16* vrow[kPrefillTile];
    for (int64_t j = 0; j < kPrefillTile; ++j) {
      krow[j] = cur[j] >= 0 ? k_cache + cur[j] : zeros;
      vrow[j] = cur[j] >= 0 ? v_cache + cur[j] : zeros;
    }
    if (more) std::copy(next, next + kPrefillTile, cur);
    __m512 st[INV ? MR : 1][2];  // INV: the rows' scores, dim pairs in walk_rows's order
    if constexpr (INV) {
      for (int m = 0; m < MR; ++m) st[m][0] = st[m][1] = _mm512_setzero_ps();
      for (int h = 0; h < 2; ++h)
        for (int z = 0; z < KZ; ++z) {
          __m512i r[16];
          for (int j = 0; j < 16; ++j) r[j] = _mm512_loadu_si512(krow[16 * h + j] + 32 * z);
          transpose16x16(r);  // r[c]: dim pair 16 z + c of the 16 positions
          for (int c = 0; c < 16; ++c)
            for (int m = 0; m < MR; ++m)
              st[m][h] = _mm512_dpbf16_ps(st[m][h], (__m512bh)_mm512_set1_epi32(qp[m * half + 16 * z + c]),
                                          (__m512bh)r[c]);
        }
    }
    for (int m = 0; m < MR; ++m) {
      v16 s[2];
      if constexpr (INV) {
        s[0] = (v16)st[m][0] * scale_log2e;
        s[1] = (v16)st[m][1] * scale_log2e;
      } else {
        __m512bh q[KZ];
        for (int z = 0; z < KZ; ++z) q[z] = (__m512bh)_mm512_loadu_si512(qp + m * half + 16 * z);
        for (int h = 0; h < 2; ++h) {
          __m512 acc[16];
          for (int j = 0; j < 16; ++j) {
            const bf16* k = krow[16 * h + j];
            acc[j] = _mm512_dpbf16_ps(_mm512_setzero_ps(), q[0], (__m512bh)_mm512_loadu_si512(k));
            for (int z = 1; z < KZ; ++z) acc[j] = _mm512_dpbf16_ps(acc[j], q[z], (__m512bh)_mm512_loadu_si512(k + 32 * z));
          }
          s[h] = (v16)sum16x16(acc) * scale_log2e;
        }
      }
      // hide positions past the row's own and past the walk's end
      const float lim = static_cast<float>(std::min(pos[m] - base - n0, count - 1));
      const v16 inf = splat16(-std::numeric_limits<float>::infinity());
      v16 s0 = lane > lim ? inf : s[0], s1 = lane + 16.f > lim ? inf : s[1];
      hide_before_window(s0, s1, base + n0, pos[m], window);
      softmax_tile<NC>(s0, s1, m_run[m], l_run[m], o[m], pbuf[m]);
    }
    const int64_t pairs = (std::min(count, last - n0 + 1) + 1) / 2;
    for (int64_t nn = 0; nn < pairs; ++nn) {
      __m512bh v[NC];
      for (int z = 0; z < KZ; ++z) {
        const __m512i a = _mm512_loadu_si512(vrow[2 * nn] + 32 * z), b = _mm512_loadu_si512(vrow[2 * nn + 1] + 32 * z);
        v[2 * z] = (__m512bh)_mm512_unpacklo_epi16(a, b);
        v[2 * z + 1] = (__m512bh)_mm512_unpackhi_epi16(a, b);
      }
      for (int m = 0; m < MR; ++m) {
        const __m512bh a = (__m512bh)_mm512_set1_epi32(pbuf[m][nn]);
        for (int c = 0; c < NC; ++c) o[m][c] = _mm512_dpbf16_ps(o[m][c], a, v[c]);
      }
    }
  }
  // lanes back in dim order: o[2z] lane 4L + i holds dim 32z + 8L + i, o[2z + 1] dim 32z + 8L + 4 + i
  const __m512i lo_idx = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i hi_idx = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int m = 0; m < MR; ++m)
    for (int z = 0; z < KZ; ++z) {
      const __m512 a = o[m][2 * z], b = o[m][2 * z + 1];
      o[m][2 * z] = _mm512_permutex2var_ps(a, lo_idx, b);
      o[m][2 * z + 1] = _mm512_permutex2var_ps(a, hi_idx, b);
    }
  finish_rows<MR, NC>(o, m_run, l_run, out, partial);
}

// Query rows of a walk's register tile: o holds MR x NC accumulators of the 32 registers.
constexpr int64_t walk_rows_per_tile(int64_t D) { return D <= 64 ? 4 : 2; }

// One work item: rows i in [row0, row1) of kv head `kvh` of one sequence (query row r = i / G, head
// kvh * G + i % G; the sequence's rows start at q0, R of them, L positions) over positions
// [base, base + Lp), MR rows at a time. `whole`: the item's K/V packed whole (kt, K^T rows Lp pairs
// apart, then V pairs); else (the rows fit one register tile: decode) the walk reads K and V from the
// cache through `table` up to position `end` (walk_direct).
// With `partial` (a split walk) row r, head h goes to partial + (r * H + h) * (D + 2), not to out.
struct Item {
  int64_t kvh, q0, R, L, row0, row1, base, end, Lp;
  bool whole;          // packed whole (kt), or read from the cache as it lies
  const uint32_t* kt;  // set by the thread that runs the item
  float* partial;
};

template <int NC>
void run_item(const bf16* q, int64_t q_row_stride, bf16* out, int64_t H, int64_t G, const Item& it,
              const bf16* k_cache, const bf16* v_cache, const int32_t* table, int64_t KVH, int64_t block_size,
              float scale_log2e, bool invariant, int64_t window) {
  constexpr int64_t D = NC * 16, half = D / 2;
  constexpr int MR = walk_rows_per_tile(D);
  alignas(64) uint32_t qp[MR * half];
  int64_t pos[MR];
  bf16* dst[MR];
  float* part[MR];
  alignas(64) bf16 sink[MR][D];
  alignas(64) float part_sink[MR][D + 2];
  auto packed = [&](int64_t n0) { return Tile{it.kt + n0, it.Lp, it.kt + half * it.Lp + (n0 / 2) * D}; };
  for (int64_t i0 = it.row0; i0 < it.row1; i0 += MR) {
    for (int m = 0; m < MR; ++m) {
      const int64_t i = std::min(i0 + m, it.row1 - 1);  // a short last group repeats its last row into `sink`
      const int64_t r = i / G, h = it.kvh * G + i % G;
      std::memcpy(qp + m * half, q + (it.q0 + r) * q_row_stride + h * D, D * sizeof(bf16));
      pos[m] = it.L - it.R + r;
      const bool real = i0 + m < it.row1;
      dst[m] = real ? out + ((it.q0 + r) * H + h) * D : sink[m];
      part[m] = it.partial && real ? it.partial + (r * H + h) * (D + 2) : part_sink[m];
    }
    float* const* po = it.partial ? part : nullptr;
    // the walk starts at the tile of the first row's window (the rows' positions do not decrease), tiles
    // counted from position 0 whatever the rows (batch invariance); the item's base is such a tile's too
    int64_t start = it.base;
    if (window > 0) start = std::max(start, std::max<int64_t>(0, pos[0] - window + 1) / kPrefillTile * kPrefillTile);
    if (it.whole) {
      walk_rows<MR, NC>(qp, pos, it.Lp, it.base, start - it.base, window, scale_log2e, dst, po, packed);
    } else {  // one register tile of rows: from the cache as it lies
      static_assert(NC % 2 == 0, "walk_direct reads whole 32-dim vectors");
      const int64_t rows = it.row1 - i0;  // no padding row for a GQA group of 3
      auto direct = [&](auto tile_rows) {
        constexpr int rows_ = decltype(tile_rows)::value;
        if (invariant) {
          walk_direct<rows_, NC / 2, true>(qp, pos, start, it.end, k_cache, v_cache, table, block_size, KVH * D,
                                           it.kvh * D, window, scale_log2e, dst, po);
        } else {
          walk_direct<rows_, NC / 2>(qp, pos, start, it.end, k_cache, v_cache, table, block_size, KVH * D,
                                     it.kvh * D, window, scale_log2e, dst, po);
        }
      };
      if (rows >= MR) {
        direct(std::integral_constant<int, MR>{});
      } else if (rows == 1) {
        direct(std::integral_constant<int, 1>{});
      } else if constexpr (MR > 2) {
        if (rows == 2) {
          direct(std::integral_constant<int, 2>{});
        } else {
          direct(std::integral_constant<int, 3>{});
        }
      }
    }
  }
}

// Merges the parts of split (sequence, kv head) pairs into out: o = sum_p 2^(m_p - m) o_p / sum_p
// 2^(m_p - m) l_p, m = max_p m_p (scores in log2 units); a sequence's part p, kv head h is item
// w0 + p * KVH + h of `list` (w0 its first item).
inline void merge_parts(const std::vector<Item>& list, const std::vector<int64_t>& seq_of,
                        const std::vector<int64_t>& parts, const std::vector<int64_t>& chunks, int64_t KVH, int64_t G,
                        int64_t H, int64_t D, bf16* out) {
  std::vector<float> acc(D);
  for (size_t w0 = 0; w0 < list.size();) {  // w0: the sequence's first item; its part p, kv head h at w0 + p * KVH + h
    const int64_t i = seq_of[w0], n = parts[i];
    if (n == 1) {
      w0 += KVH * chunks[i];
      continue;
    }
    for (int64_t kvh = 0; kvh < KVH; ++kvh) {
      const Item& first = list[w0 + kvh];
      for (int64_t r = 0; r < first.R; ++r)
        for (int64_t g = 0; g < G; ++g) {
          const int64_t row = r * H + kvh * G + g;
          float m = -std::numeric_limits<float>::infinity(), l = 0.f;
          for (int64_t p = 0; p < n; ++p) m = std::max(m, list[w0 + p * KVH + kvh].partial[row * (D + 2) + D]);
          std::fill(acc.begin(), acc.end(), 0.f);
          for (int64_t p = 0; p < n; ++p) {
            const float* part = list[w0 + p * KVH + kvh].partial + row * (D + 2);
            const float f = std::exp2(part[D] - m);
            l += f * part[D + 1];
            for (int64_t d = 0; d < D; ++d) acc[d] += f * part[d];
          }
          bf16* dst = out + (first.q0 * H + row) * D;
          for (int64_t d = 0; d < D; ++d) dst[d] = f32_to_bf16(acc[d] / l);
        }
    }
    w0 += n * KVH;
  }
}

// Sequences `seqs` of the batch (each with its query rows q[qsl[b]:qsl[b+1]], seq_lens[b] positions);
// writes their rows of out [T, H, D]. Work items: up to kRowsPerItem rows of one (sequence, kv head).
// Rows that fit one register tile (decode: one query row of a GQA group of up to 4 heads) walk their
// positions reading K/V as they lie in the cache (no packed copy of the whole sequence, whose writes
// would miss the cache: in a decode step the layers' weights streamed since evicted it); more rows
// of one item pack the sequence's K/V inside the item, longer ones once, first, for all their items.
// When the items would leave threads idle or uneven (one decode sequence of 3 kv heads on 2 threads:
// one thread does two), each (sequence, kv head) splits its positions in parts ("flash decoding")
// that keep unnormalized outputs with their running max and sum, merged after; a part's kv heads are
// consecutive items, so a thread reads whole K/V rows of its positions. Part boundaries are
// multiples of kPrefillTile at or before the first row's position, so every part holds a visible
// position of every row; at least kMinSplit positions per part.
// `invariant` (batch-invariant mode): a row's output does not depend on the other rows of its step,
// whatever they are: no split of positions (a split walk merges its parts in another order), and
// decode rows' walk_direct sums each score's products in walk_rows's order (its INV form). Each row
// then sums over tiles of 32 positions from position 0, its dim pairs in one order, the same whether
// it is a decode row, one of a prefill chunk of any size, or a recomputed one.
// `window` > 0 (a sliding-window layer: position p sees (p - window, p]): a sequence's walks and packed
// K/V start at the tile of its first row's window, each register tile's walk at its own first row's.
constexpr int64_t kMinSplit = 64;

inline void paged_attention_bf16(const bf16* q, int64_t q_row_stride, bf16* out, const bf16* k_cache,
                                    const bf16* v_cache, const int32_t* qsl, const int32_t* lens,
                                    const int32_t* tables, int64_t max_blocks, const int64_t* seqs, int64_t S,
                                    int64_t H, int64_t KVH, int64_t D, int64_t block_size, float scale,
                                    bool invariant = false, int64_t window = 0) {
  const int64_t G = H / KVH, threads = num_threads();
  const float scale_log2e = scale * 1.4426950408889634f;
  // Items go to all threads from kParallelWork (query row x head, position) pairs on: one decode row
  // of ~230 positions (9 heads); below, the fork and join cost more than they save (~0.1 ms per
  // decode step at 20 positions, 2 cores).
  int64_t work = 0, items = 0;
  for (int64_t i = 0; i < S; ++i) work += (qsl[seqs[i] + 1] - qsl[seqs[i]]) * H * lens[seqs[i]];
  std::vector<int64_t> lp(S), lo(S, 0), chunks(S), parts(S, 1), offset(S + 1, 0);
  for (int64_t i = 0; i < S; ++i) {
    const int64_t b = seqs[i], R = qsl[b + 1] - qsl[b];
    if (window > 0)  // the tile of the first row's window: no row sees a position before it
      lo[i] = std::max<int64_t>(0, lens[b] - R - window + 1) / kPrefillTile * kPrefillTile;
    lp[i] = (lens[b] - lo[i] + kPrefillTile - 1) / kPrefillTile * kPrefillTile;
    chunks[i] = (R * G + kRowsPerItem - 1) / kRowsPerItem;
    items += KVH * chunks[i];
    offset[i + 1] = offset[i] + (chunks[i] > 1 ? KVH * lp[i] * D : 0);  // uint32s: Lp * D / 2 for K, as many for V
  }
  const bool split = !invariant && work >= kParallelWork && items < 2 * threads &&
                     std::all_of(chunks.begin(), chunks.end(), [](int64_t c) { return c == 1; });
  std::vector<Item> list;
  std::vector<int64_t> seq_of;  // each item's index in seqs
  for (int64_t i = 0; i < S; ++i) {
    const int64_t b = seqs[i], R = qsl[b + 1] - qsl[b], L = lens[b], span = L - R + 1;  // positions every row sees
    const int64_t seen = span - lo[i];  // the positions every row may see, from the first tile any row sees
    if (split) parts[i] = std::max<int64_t>(1, std::min((2 * threads + items - 1) / items, seen / kMinSplit));
    const int64_t step = ((seen + parts[i] - 1) / parts[i] + kPrefillTile - 1) / kPrefillTile * kPrefillTile;
    parts[i] = (seen + step - 1) / step;  // whole tiles per part may leave fewer parts
    const bool by_tile = R * G <= walk_rows_per_tile(D);
    for (int64_t begin = lo[i]; begin < span; begin += step)  // a part's kv heads side by side: whole rows
      for (int64_t kvh = 0; kvh < KVH; ++kvh)
        for (int64_t c = 0; c < chunks[i]; ++c) {
          const int64_t end = parts[i] > 1 && begin + step < span ? begin + step : L;
          const int64_t Lp = (end - begin + kPrefillTile - 1) / kPrefillTile * kPrefillTile;
          list.push_back({kvh, qsl[b], R, L, c * kRowsPerItem, std::min(R * G, (c + 1) * kRowsPerItem), begin, end,
                          Lp, !by_tile, nullptr, nullptr});
          seq_of.push_back(i);
        }
  }
  // the parts' partial results, then the K/V packed whole for sequences of several items: one buffer
  // all threads see (inside a decode step's team, every thread computes this plan; team.h)
  int64_t floats = 0;
  if (split)
    for (size_t w = 0; w < list.size(); ++w)
      if (parts[seq_of[w]] > 1) floats += list[w].R * H * (D + 2);
  const size_t partial_bytes = (floats * sizeof(float) + 63) / 64 * 64;
  std::vector<char> own;
  char* buffer = shared_buffer(own, partial_bytes + offset[S] * sizeof(uint32_t));
  uint32_t* shared = reinterpret_cast<uint32_t*>(buffer + partial_bytes);
  if (split) {
    floats = 0;
    for (size_t w = 0; w < list.size(); ++w)
      if (parts[seq_of[w]] > 1) {
        list[w].partial = reinterpret_cast<float*>(buffer) + floats;
        floats += list[w].R * H * (D + 2);
      }
  }
  if (offset[S]) {
    agentrt::parallel_for(0, S * KVH, 1, [&](int64_t w0, int64_t w1) {
      for (int64_t w = w0; w < w1; ++w) {
        const int64_t i = w / KVH, kvh = w % KVH, b = seqs[i];
        if (chunks[i] < 2) continue;
        uint32_t* kt = shared + offset[i] + kvh * lp[i] * D;
        pack_kv(k_cache, v_cache, tables + b * max_blocks, lo[i], lens[b] - lo[i], kvh, kvh + 1, KVH, D, block_size,
                kt, lp[i]);
      }
    });
  }
  const int64_t grain = work < kParallelWork ? std::max<int64_t>(list.size(), 1) : 1;
  agentrt::parallel_for(0, list.size(), grain, [&](int64_t w0, int64_t w1) {
    std::vector<uint32_t> local;
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t i = seq_of[w], b = seqs[i];
      Item it = list[w];
      if (it.whole) {  // packed whole: shared by the sequence's items, or this item's own
        if (chunks[i] > 1) {
          it.kt = shared + offset[i] + it.kvh * lp[i] * D;
        } else {
          local.resize(it.Lp * D);
          pack_kv(k_cache, v_cache, tables + b * max_blocks, it.base, it.end - it.base, it.kvh, it.kvh + 1, KVH, D,
                  block_size, local.data(), it.Lp);
          it.kt = local.data();
        }
      }
      auto run = [&](auto fn) {
        fn(q, q_row_stride, out, H, G, it, k_cache, v_cache, tables + b * max_blocks, KVH, block_size, scale_log2e,
           invariant, window);
      };
      switch (D) {
        case 32: run(run_item<2>); break;
        case 64: run(run_item<4>); break;
        case 128: run(run_item<8>); break;
        default: run(run_item<16>); break;
      }
    }
  });
  if (!split) return;
  single([&] { merge_parts(list, seq_of, parts, chunks, KVH, G, H, D, out); });
}

}  // namespace agentrt

#endif  // __AVX512BF16__
