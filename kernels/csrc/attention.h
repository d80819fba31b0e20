// Attention of sequences with a few query rows (decode, draft verification) straight from the paged
// KV cache: each sequence's K and V blocks are read once, through the block table, for all its query
// heads. No gathered copy. fp32 or bf16 cache (converted on load); fp32 scores, softmax and sums.
// A layer's features: a sliding window (a row at position p sees p - window + 1 .. p; the walk starts at
// the block of the first row's window), sinks (a logit per query head counted in the softmax's
// denominator, no value) and a soft cap (scores c tanh(s / c), before the mask).

#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "team.h"
#include "vec.h"

namespace agentrt {

constexpr int64_t kMaxQueryRows = 16;  // query rows per sequence this kernel takes
constexpr int64_t kMaxHeads = 64;       // query heads

// hsum4's sum of one vector's lanes (its pairwise tree, not hsum's halves): a position's score is the
// same number whether it is one of four (hsum4) or in a block's tail, wherever the block ends.
inline float hsum_like4(v8 a) {
  float s[4];
  hsum4(a, splat(0.f), splat(0.f), splat(0.f), s);
  return s[0];
}

// Scores of `nq` queries (fp32 rows of qs, stride D) against m positions of one kv head (rows of kb,
// `stride` elements apart): s[i * L + j] = q_i . k_j. Queries two at a time and positions four at a
// time, so each loaded K row serves two queries and eight FMA chains run side by side.
template <int ND>
inline void block_scores(const float* qs, int64_t nq, const float* kb, int64_t stride, int64_t m, float* s, int64_t L) {
  constexpr int64_t D = ND * 8;
  int64_t i = 0;
  for (; i + 2 <= nq; i += 2) {
    const float *q0 = qs + i * D, *q1 = q0 + D;
    float *s0 = s + i * L, *s1 = s0 + L;
    int64_t j = 0;
    for (; j + 4 <= m; j += 4) {
      const float* kp = kb + j * stride;
      v8 a0 = splat(0.f), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
      for (int d = 0; d < ND; ++d) {
        const v8 k0 = load8(kp + 8 * d), k1 = load8(kp + stride + 8 * d), k2 = load8(kp + 2 * stride + 8 * d),
                 k3 = load8(kp + 3 * stride + 8 * d);
        const v8 x = load8(q0 + 8 * d), y = load8(q1 + 8 * d);
        a0 += x * k0, a1 += x * k1, a2 += x * k2, a3 += x * k3;
        b0 += y * k0, b1 += y * k1, b2 += y * k2, b3 += y * k3;
      }
      hsum4(a0, a1, a2, a3, s0 + j);
      hsum4(b0, b1, b2, b3, s1 + j);
    }
    for (; j < m; ++j) {
      const float* kp = kb + j * stride;
      v8 a = splat(0.f), b = a;
      for (int d = 0; d < ND; ++d) {
        const v8 k = load8(kp + 8 * d);
        a += load8(q0 + 8 * d) * k;
        b += load8(q1 + 8 * d) * k;
      }
      s0[j] = hsum_like4(a);
      s1[j] = hsum_like4(b);
    }
  }
  if (i < nq) {
    const float* q0 = qs + i * D;
    float* s0 = s + i * L;
    int64_t j = 0;
    for (; j + 4 <= m; j += 4) {
      const float* kp = kb + j * stride;
      v8 a0 = splat(0.f), a1 = a0, a2 = a0, a3 = a0;
      for (int d = 0; d < ND; ++d) {
        const v8 x = load8(q0 + 8 * d);
        a0 += x * load8(kp + 8 * d), a1 += x * load8(kp + stride + 8 * d), a2 += x * load8(kp + 2 * stride + 8 * d),
            a3 += x * load8(kp + 3 * stride + 8 * d);
      }
      hsum4(a0, a1, a2, a3, s0 + j);
    }
    for (; j < m; ++j) {
      const float* kp = kb + j * stride;
      v8 a = splat(0.f);
      for (int d = 0; d < ND; ++d) a += load8(q0 + 8 * d) * load8(kp + 8 * d);
      s0[j] = hsum_like4(a);
    }
  }
}

// acc_i += sum_j p_i[j] v_j for `nq` queries (accumulators in acc, stride D; probabilities p + i * L)
// over m positions of one kv head (rows of vb, `stride` apart, in L1 by now).
template <int ND>
inline void block_values(const float* p, int64_t nq, const float* vb, int64_t stride, int64_t m, float* acc, int64_t L) {
  constexpr int64_t D = ND * 8;
  for (int64_t i = 0; i < nq; ++i) {
    v8 a[ND];
    for (int d = 0; d < ND; ++d) a[d] = load8(acc + i * D + 8 * d);
    const float* pi = p + i * L;
    for (int64_t j = 0; j < m; ++j) {
      const v8 pj = splat(pi[j]);
      const float* vp = vb + j * stride;
      for (int d = 0; d < ND; ++d) a[d] += pj * load8(vp + 8 * d);
    }
    for (int d = 0; d < ND; ++d) store8(acc + i * D + 8 * d, a[d]);
  }
}

// Converts the block's rows of kv heads [kvh0, kvh1) to fp32 (bf16 caches: each element is converted
// once instead of once per query head reading it); fp32 caches are read in place.
template <typename T, int ND>
inline const float* block_f32(const T* block, int64_t m, int64_t KVH, int64_t kvh0, int64_t kvh1, float* scratch) {
  constexpr int64_t D = ND * 8;
  if constexpr (std::is_same_v<T, float>) {
    return block;
  } else {
    const int64_t width = (kvh1 - kvh0) * D;  // converted row: this item's kv heads only
    for (int64_t j = 0; j < m; ++j) {
      const T* src = block + (j * KVH + kvh0) * D;
      for (int64_t e = 0; e < width; e += 8) store8(scratch + j * KVH * D + kvh0 * D + e, load8(src + e));
    }
    return scratch;
  }
}

// The blocks kPrefetchBlocks ahead of the walk are announced to the hardware: the first kPrefetchLines lines of
// each 4 KB page of the block are prefetched into L2. A shuffled block table breaks the hardware's stream
// prefetch at every block, and a page's stream starts only after a few misses in it; a prefetch of the page's head
// starts it before the walk gets there. Prefetching every line of the block instead waits on the core's few fill
// buffers (the hardware streams from L2 without them). `agentrt bench paging`, fp32, shuffled / contiguous (median
// of pairs): on a 2-core AMD EPYC the whole block took 1.45x to ~1.2x; on a 2-core Intel Xeon with AMX the page
// heads give 1.13-1.15x where the whole block gives 1.16-1.25x and no prefetch 1.22-1.28x.
constexpr int64_t kPrefetchBlocks = 2;
constexpr int64_t kPrefetchLines = 2;
// The walk reads a block kChunkRows positions at a time, each chunk's rows whole (all of the item's kv heads:
// the block's bytes in address order), and meanwhile prefetches the same rows of the next block into L1: a
// block's lines are asked for one chunk at a time, spread over the block's compute, instead of at once (which
// waits on the fill buffers). `agentrt bench paging`, fp32 on a 2-core Intel Xeon with AMX, against kv heads
// outer and page heads alone: 16 x 4096 and 64 x 1024 1.3-1.5x faster on either table, shuffled / contiguous
// 1.08-1.15x -> 1.07-1.09x (best of 25; medians of pairs 1.06-1.10) in 4 KB pages; 16 x 1024 (25 MB, in the
// last-level cache) ~5% slower, the prefetches' own cost. Prefetching every other line (the pair's buddy by the
// hardware) or two blocks ahead was slower.
constexpr int64_t kChunkRows = 4;

// Into L1: `rows` rows of `width` elements each, `stride` elements apart.
template <typename T>
inline void prefetch_rows(const T* first, int64_t rows, int64_t stride, int64_t width) {
  for (int64_t r = 0; r < rows; ++r) {
    const char* c = reinterpret_cast<const char*>(first + r * stride);
    for (int64_t l = 0; l < width * int64_t(sizeof(T)); l += 64) prefetch_l1(c + l);
  }
}

inline void prefetch_block(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t page = -int64_t(reinterpret_cast<uintptr_t>(c) & 4095); page < bytes; page += 4096) {
    const int64_t head = std::max<int64_t>(page, 0);  // offset of the page's first line (the block's first, in its first)
    for (int64_t l = 0; l < kPrefetchLines && head + 64 * l < bytes; ++l) prefetch_l2(c + head + 64 * l);
  }
}

// One work item of a sequence: kv heads [kvh0, kvh1) and the cached positions [begin, end) (begin a
// multiple of the block size, at or before the first row's position, so every row sees one of them).
// With `partial` set, the item is one part of a split sequence: each row's unnormalized output, its
// score maximum and its sum of exponentials go to partial[(r * H + h) * (D + 2)] for merge_seq_parts.
struct SeqPart {
  int64_t seq;  // index into seqs
  int64_t kvh0, kvh1, begin, end;
  float* partial;
};

// One item's R query rows x G heads each: row r sits at position L - R + r and sees positions
// [0, L - R + r] (causal), or its last `window` of them. Blocks outer, kv heads and their queries inner: a block's K (then V) is
// read from memory once, converted to fp32 once (bf16), and stays in L1 for all the query heads
// reading it; the blocks ahead are prefetched meanwhile. ND = head_dim / 8.
template <typename T, int ND>
void attend_one(const T* q, int64_t q_row_stride, T* out, const T* k_cache, const T* v_cache, const int32_t* table,
                int64_t q0, int64_t R, int64_t L, const SeqPart& it, int64_t H, int64_t KVH, int64_t G,
                int64_t block_size, float scale, std::vector<float>& buf, int64_t window, const float* sinks,
                float softcap) {
  constexpr int64_t D = ND * 8;
  const int64_t kvh0 = it.kvh0, kvh1 = it.kvh1, begin = it.begin, end = it.end, span = end - begin;
  const int64_t nq = R * G * (kvh1 - kvh0);  // query i: head h0 + i / R, row i % R; kv head kvh0 + i / (R G)
  const int64_t per_kvh = R * G;
  const int64_t h0 = kvh0 * G;
  const int64_t pos_stride = KVH * D;  // elements between consecutive positions of one block
  const bool convert = !std::is_same_v<T, float>;
  buf.resize(nq * D + nq * span + (convert ? block_size * pos_stride : 0));
  float* qs = buf.data();       // [nq, D] scaled queries, later the output accumulators
  float* scores = qs + nq * D;  // [nq, span]
  float* scratch = scores + nq * span;  // bf16: one block converted to fp32
  for (int64_t i = 0; i < nq; ++i) {
    const T* src = q + (q0 + i % R) * q_row_stride + (h0 + i / R) * D;
    for (int d = 0; d < ND; ++d) store8(qs + i * D + 8 * d, load8(src + 8 * d) * splat(scale));
  }
  const int64_t block_elems = block_size * pos_stride;
  const int64_t b0 = begin / block_size, b1 = (end + block_size - 1) / block_size;
  const int64_t first_row = L - R;  // position of query row 0; rows see up to first_row + r
  // Scores of positions a row cannot see are computed too (a block of at most R - 1 of them) and
  // skipped by the softmax below, which stops at each row's own last position.
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t t0 = b * block_size, m = std::min(block_size, end - t0);
    if (b == b0)  // the blocks ahead of the first
      for (int64_t j = b0 + 1; j < std::min(b1, b0 + kPrefetchBlocks); ++j)
        prefetch_block(k_cache + (int64_t)table[j] * block_elems, block_elems * sizeof(T));
    if (b + kPrefetchBlocks < b1)
      prefetch_block(k_cache + (int64_t)table[b + kPrefetchBlocks] * block_elems, block_elems * sizeof(T));
    const float* kf = block_f32<T, ND>(k_cache + (int64_t)table[b] * block_elems, m, KVH, kvh0, kvh1, scratch);
    const T* next = b + 1 < b1 ? k_cache + (int64_t)table[b + 1] * block_elems : nullptr;
    for (int64_t j = 0; j < m; j += kChunkRows) {
      const int64_t rows = std::min(kChunkRows, m - j);
      if (next) prefetch_rows(next + j * pos_stride + kvh0 * D, kChunkRows, pos_stride, (kvh1 - kvh0) * D);
      for (int64_t kvh = kvh0; kvh < kvh1; ++kvh) {
        const int64_t i0 = (kvh - kvh0) * per_kvh;
        block_scores<ND>(qs + i0 * D, per_kvh, kf + j * pos_stride + kvh * D, pos_stride, rows,
                         scores + i0 * span + t0 + j - begin, span);
      }
    }
  }
  if (softcap > 0.f) {
    const float inv_cap = 1.f / softcap;
    for (int64_t j = 0; j < nq * span; ++j) scores[j] = softcap * std::tanh(scores[j] * inv_cap);
  }
  // softmax numerators in place over each row's visible positions; their maxima and sums
  float mx_of[kMaxQueryRows * kMaxHeads], sum_of[kMaxQueryRows * kMaxHeads];
  for (int64_t i = 0; i < nq; ++i) {
    const int64_t p = first_row + i % R;  // the row's position; it sees [p - window + 1, p] of [begin, end)
    const int64_t lo = window > 0 ? std::clamp<int64_t>(p - window + 1 - begin, 0, span) : 0;
    const int64_t hi = std::max<int64_t>(std::min(end, p + 1) - begin, lo);
    for (int64_t t = 0; t < lo; ++t) scores[i * span + t] = 0.f;  // before the window: weigh nothing
    float* s = scores + i * span + lo;
    const int64_t n = hi - lo, n8 = n & ~int64_t(7);
    v8 mx8 = splat(-std::numeric_limits<float>::infinity());
    for (int64_t t = 0; t < n8; t += 8) {
      const v8 x = load8(s + t);
      mx8 = x > mx8 ? x : mx8;
    }
    float mx = mx8[0];
    for (int l = 1; l < 8; ++l) mx = std::max(mx, mx8[l]);
    for (int64_t t = n8; t < n; ++t) mx = std::max(mx, s[t]);
    v8 sum8 = splat(0.f);
    for (int64_t t = 0; t < n8; t += 8) {
      v8 e = exp8(load8(s + t) - splat(mx));
      store8(s + t, e);
      sum8 += e;
    }
    float sum = hsum(sum8);
    if (n8 < n) {
      float tail[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int64_t t = n8; t < n; ++t) tail[t - n8] = s[t] - mx;
      v8 e = exp8(load8(tail));
      for (int64_t t = n8; t < n; ++t) {
        s[t] = e[t - n8];
        sum += e[t - n8];
      }
    }
    for (int64_t t = n; t < span - lo; ++t) s[t] = 0.f;  // invisible positions weigh nothing
    mx_of[i] = mx;
    sum_of[i] = sum;
  }
  // out = p @ v, accumulated in qs's place (the scaled queries are no longer needed)
  float* acc = qs;
  for (int64_t j = 0; j < nq * D; ++j) acc[j] = 0.f;
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t t0 = b * block_size, m = std::min(block_size, end - t0);
    if (b == b0)  // the blocks ahead of the first
      for (int64_t j = b0 + 1; j < std::min(b1, b0 + kPrefetchBlocks); ++j)
        prefetch_block(v_cache + (int64_t)table[j] * block_elems, block_elems * sizeof(T));
    if (b + kPrefetchBlocks < b1)
      prefetch_block(v_cache + (int64_t)table[b + kPrefetchBlocks] * block_elems, block_elems * sizeof(T));
    const float* vf = block_f32<T, ND>(v_cache + (int64_t)table[b] * block_elems, m, KVH, kvh0, kvh1, scratch);
    const T* next = b + 1 < b1 ? v_cache + (int64_t)table[b + 1] * block_elems : nullptr;
    for (int64_t j = 0; j < m; j += kChunkRows) {  // a query's sum still runs over positions in order
      const int64_t rows = std::min(kChunkRows, m - j);
      if (next) prefetch_rows(next + j * pos_stride + kvh0 * D, kChunkRows, pos_stride, (kvh1 - kvh0) * D);
      for (int64_t kvh = kvh0; kvh < kvh1; ++kvh) {
        const int64_t i0 = (kvh - kvh0) * per_kvh;
        block_values<ND>(scores + i0 * span + t0 + j - begin, per_kvh, vf + j * pos_stride + kvh * D, pos_stride,
                         rows, acc + i0 * D, span);
      }
    }
  }
  for (int64_t i = 0; i < nq; ++i) {
    const int64_t row = i % R, h = h0 + i / R;
    if (it.partial) {
      float* dst = it.partial + (row * H + h) * (D + 2);
      for (int d = 0; d < ND; ++d) store8(dst + 8 * d, load8(acc + i * D + 8 * d));
      dst[D] = mx_of[i];
      dst[D + 1] = sum_of[i];
    } else {
      T* dst = out + ((q0 + row) * H + h) * D;
      float keep = 1.f, sum = sum_of[i];
      if (sinks) {  // the sink joins the softmax: max over it too, its exponential in the sum
        const float top = std::max(mx_of[i], sinks[h]);
        keep = std::exp(mx_of[i] - top);
        sum = sum * keep + std::exp(sinks[h] - top);
      }
      const v8 inv = splat(keep / sum);
      for (int d = 0; d < ND; ++d) store8(dst + 8 * d, load8(acc + i * D + 8 * d) * inv);
    }
  }
}

// A split sequence's rows out of its P parts (each [R, H, D + 2] floats at parts + p * R * H * (D + 2)):
// o = sum_p e^(m_p - m) o_p / sum_p e^(m_p - m) l_p with m = max_p m_p (and with `sinks`, m over the head's
// sink too and e^(sink - m) in the denominator).
template <typename T>
inline void merge_seq_parts(const float* parts, int64_t P, int64_t R, int64_t H, int64_t D, T* out,
                            const float* sinks) {
  const int64_t part_floats = R * H * (D + 2);
  std::vector<float> acc(D);
  for (int64_t rh = 0; rh < R * H; ++rh) {
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t p = 0; p < P; ++p) m = std::max(m, parts[p * part_floats + rh * (D + 2) + D]);
    if (sinks) m = std::max(m, sinks[rh % H]);
    float l = sinks ? std::exp(sinks[rh % H] - m) : 0.f;
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t p = 0; p < P; ++p) {
      const float* part = parts + p * part_floats + rh * (D + 2);
      if (part[D + 1] == 0.f) continue;  // a part of positions outside this row's window
      const float f = std::exp(part[D] - m);
      l += f * part[D + 1];
      for (int64_t d = 0; d < D; d += 8) store8(acc.data() + d, load8(acc.data() + d) + splat(f) * load8(part + d));
    }
    const v8 inv = splat(1.f / l);
    for (int64_t d = 0; d < D; d += 8) store8(out + rh * D + d, load8(acc.data() + d) * inv);
  }
}

// Positions per part, at least, when a sequence's positions are split across threads.
constexpr int64_t kMinPartPositions = 64;

// Sequences `seqs` (S of them) of the batch described by query_start_loc / seq_lens / block_tables
// (max_blocks columns); writes their rows of out [T, H, D] (contiguous). Work items: whole sequences
// (each block read once for all heads) when there are many of them. With few (under 4 per thread), the
// threads' shares are planned: sequences split in parts of their positions, all kv heads each (flash
// decoding: a thread reads whole K/V rows of its positions; each part keeps its unnormalized output,
// maximum and sum, merged after), parts of about equal size (a per-thread share is split in two at
// least, never below kMinPartPositions); a sequence too short for two such parts, with fewer sequences
// than threads, splits by kv heads instead. The items then go to the threads longest first, each to
// the least loaded (a decode sequence of 3 kv heads, or 3 sequences, or one long and a few short ones
// keep 2 threads evenly busy), laid out one thread's share after another. `invariant` (batch-invariant
// mode): never split a sequence's positions (merged parts sum in another order than one walk), only
// its kv heads, whose rows are independent: a row's output then does not depend on its step's other
// rows or the thread count.
template <typename T>
void paged_attention_small_q(const T* q, int64_t q_row_stride, T* out, const T* k_cache, const T* v_cache,
                             const int32_t* qsl, const int32_t* lens, const int32_t* tables, int64_t max_blocks,
                             const int64_t* seqs, int64_t S, int64_t H, int64_t KVH, int64_t D, int64_t block_size,
                             float scale, bool invariant = false, int64_t window = 0, const float* sinks = nullptr,
                             float softcap = 0.f) {
  const int64_t G = H / KVH, threads = num_threads();
  std::vector<SeqPart> items;
  // split sequences: parts, positions per part, first float of their buffer; `first`: the block where the
  // first row's window starts (0 without a window), where every walk of the sequence starts
  std::vector<int64_t> parts(S, 1), steps(S, 1), part_offset(S, 0), first(S, 0);
  for (int64_t i = 0; i < S; ++i) {
    const int64_t b = seqs[i], R = qsl[b + 1] - qsl[b];
    if (window > 0) first[i] = std::max<int64_t>(0, lens[b] - R + 1 - window) / block_size * block_size;
  }
  int64_t floats = 0;
  if (S >= 4 * threads || threads == 1) {
    for (int64_t i = 0; i < S; ++i) items.push_back({i, 0, KVH, first[i], lens[seqs[i]], nullptr});
  } else {
    int64_t total = 0;  // positions every row of a sequence sees, over the sequences
    for (int64_t i = 0; i < S; ++i) total += lens[seqs[i]] - (qsl[seqs[i] + 1] - qsl[seqs[i]]) + 1 - first[i];
    const int64_t target = std::max(kMinPartPositions, (total + 2 * threads - 1) / (2 * threads));
    std::vector<SeqPart> planned;
    for (int64_t i = 0; i < S; ++i) {
      const int64_t b = seqs[i], R = qsl[b + 1] - qsl[b], L = lens[b], f = first[i], span = L - R + 1 - f;
      if (invariant || (span < 2 * kMinPartPositions && S < threads)) {
        for (int64_t kvh = 0; kvh < KVH; ++kvh) planned.push_back({i, kvh, kvh + 1, f, L, nullptr});
        continue;
      }
      const int64_t want = std::max<int64_t>(1, std::min(span / kMinPartPositions, (span + target - 1) / target));
      const int64_t step = ((span + want - 1) / want + block_size - 1) / block_size * block_size;
      parts[i] = (span + step - 1) / step;  // whole blocks per part may leave fewer parts
      steps[i] = step;
      if (parts[i] > 1) {
        part_offset[i] = floats;
        floats += parts[i] * R * H * (D + 2);
      }
      for (int64_t p = 0; p < parts[i]; ++p)
        planned.push_back({i, 0, KVH, f + p * step, p + 1 < parts[i] ? f + (p + 1) * step : L, nullptr});
    }
    auto work = [&](const SeqPart& it) {
      const int64_t b = seqs[it.seq];
      return (it.end - it.begin) * (it.kvh1 - it.kvh0) * (qsl[b + 1] - qsl[b]);
    };
    std::vector<int64_t> order(planned.size());
    for (size_t w = 0; w < order.size(); ++w) order[w] = w;
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t a, int64_t c) { return work(planned[a]) > work(planned[c]); });
    std::vector<int64_t> load(threads, 0), count(threads, 0), share(planned.size());  // share: item -> thread
    for (int64_t w : order) {
      const int64_t t = std::min_element(load.begin(), load.end()) - load.begin();
      share[w] = t;
      load[t] += work(planned[w]);
      ++count[t];
    }
    const int64_t per_share = *std::max_element(count.begin(), count.end());
    items.assign(threads * per_share, {0, 0, 0, 0, 0, nullptr});  // shares padded with empty items to one
    for (int64_t w : order) items[share[w] * per_share + --count[share[w]]] = planned[w];  // length: a chunk each
  }
  std::vector<char> own;  // the parts' results, seen by every thread of a decode step's team (team.h)
  float* partials = floats ? reinterpret_cast<float*>(shared_buffer(own, floats * sizeof(float))) : nullptr;
  for (SeqPart& it : items) {
    if (it.end > it.begin && parts[it.seq] > 1) {
      const int64_t b = seqs[it.seq], R = qsl[b + 1] - qsl[b];
      it.partial = partials + part_offset[it.seq] + (it.begin - first[it.seq]) / steps[it.seq] * R * H * (D + 2);
    }
  }
  agentrt::parallel_for(0, items.size(), 1, [&](int64_t w0, int64_t w1) {
    std::vector<float> buf;
    for (int64_t w = w0; w < w1; ++w) {
      const SeqPart& it = items[w];
      if (it.end <= it.begin) continue;  // padding of a thread's share
      const int64_t b = seqs[it.seq];
      auto run = [&](auto fn) {
        fn(q, q_row_stride, out, k_cache, v_cache, tables + b * max_blocks, qsl[b], qsl[b + 1] - qsl[b], lens[b], it,
           H, KVH, G, block_size, scale, buf, window, sinks, softcap);
      };
      switch (D) {
        case 32: run(attend_one<T, 4>); break;
        case 64: run(attend_one<T, 8>); break;
        case 128: run(attend_one<T, 16>); break;
        default: run(attend_one<T, 32>); break;
      }
    }
  });
  if (!floats) return;
  agentrt::parallel_for(0, S, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = seqs[i];
      if (parts[i] > 1)
        merge_seq_parts<T>(partials + part_offset[i], parts[i], qsl[b + 1] - qsl[b], H, D, out + qsl[b] * H * D,
                           sinks);
    }
  });
}

}  // namespace agentrt
