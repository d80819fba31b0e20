// Row kernels of the sampler (engine/sampling.py), fp32, one row at a time:
//
// - topk_row: the k best of a row of scores (its CANDIDATES tokens of a random row, the top-N
//   log-probs). torch.topk over [32, 49152] fp32 with k = 256 measured ~10 ms on one thread here; this
//   bounds the k-th best in one pass and keeps what passes the bound in a second. Order: larger first;
//   a NaN ranks above every number (as torch.topk and torch.argmax treat it); of equal values (NaNs
//   included) the lower index first, so the result is a function of the row alone.
// - logsumexp_row: log(sum(exp(row))) by torch.logsumexp's rule, for log-probs (raw logit - it)
//   without a [B, V] log_softmax; torch's took 1.5-3 ms over [32, 49152] on one thread here.
// - penalize_row: repetition / frequency / presence penalties from a row's token history, touching
//   only its distinct tokens (numpy's sort-and-count path took ~0.9 ms for 32 rows of 140 tokens).

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

#include "vec.h"

namespace agentrt {

// An entry's rank as one integer (larger ranks first): the value's order in the high 32 bits (every
// NaN above +inf, -0 equal to +0), the index's complement in the low 32 (the lower index first among
// equal values). V < 2^32.
inline uint64_t rank_key(float v, int64_t i) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  if (v != v) {
    u = 0xffffffffu;
  } else if (v == 0.f) {
    u = 0x80000000u;
  } else {
    u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  }
  return (uint64_t(u) << 32) | uint32_t(~uint32_t(i));
}

inline int64_t key_index(uint64_t key) { return int64_t(~uint32_t(key)); }

// Bit l set where lane l of m is set.
inline unsigned lane_bits(v8i m) {
#if defined(__AVX2__)
  return static_cast<unsigned>(_mm256_movemask_ps((__m256)m));
#else
  unsigned bits = 0;
  for (int l = 0; l < 8; ++l) bits |= unsigned(m[l] != 0) << l;
  return bits;
#endif
}

// A lower bound of the k-th best value of row[0, V): cut the row into k runs; each run's largest is
// a distinct entry, so the k-th best is at least the smallest of them. NaNs are skipped (a run of
// them only lowers the bound). One pass of 8 lanes.
inline float kth_lower_bound(const float* row, int64_t V, int64_t k) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  float lo = std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < k; ++j) {
    const int64_t b = j * V / k, e = (j + 1) * V / k;
    v8 m = splat(neg_inf);
    int64_t i = b;
    for (; i + 8 <= e; i += 8) {
      const v8 v = load8(row + i);
      m = v > m ? v : m;
    }
    float best = neg_inf;
    for (int l = 0; l < 8; ++l) best = m[l] > best ? m[l] : best;
    for (; i < e; ++i) best = row[i] > best ? row[i] : best;
    lo = std::min(lo, best);
  }
  return lo;
}

// The k best of row[0, V) (1 <= k <= V), best first, into vals / idx; `buf` is scratch. One pass
// keeps every entry that can still be among the k best: at first those at or above
// kth_lower_bound (or NaN); when the buffer holds 4k entries it is cut back to its k best, and from
// then on an entry must rank before the k-th kept: above its value, since it comes later than every
// kept entry (equal values rank by index). Linear time whatever the order of the row.
inline void topk_row(const float* row, int64_t V, int64_t k, std::vector<uint64_t>& buf, float* vals, int64_t* idx) {
  const size_t keep = static_cast<size_t>(k), cap = static_cast<size_t>(std::max<int64_t>(4 * k, 64));
  buf.clear();
  buf.reserve(cap + 8);
  float thr = kth_lower_bound(row, V, k);
  bool strict = false;  // after a cut: above thr, not at it
  bool closed = false;  // the k kept are all NaN: nothing after them ranks before them
  auto cut = [&] {
    std::nth_element(buf.begin(), buf.begin() + (keep - 1), buf.end(), std::greater<uint64_t>());
    buf.resize(keep);
    thr = row[key_index(buf[keep - 1])];
    strict = true;
    closed = thr != thr;
  };
  int64_t i = 0;
  for (; i + 8 <= V && !closed; i += 8) {
    const v8 v = load8(row + i), t = splat(thr);
    unsigned bits = lane_bits((strict ? v > t : v >= t) | (v != v));
    while (bits) {
      const int l = __builtin_ctz(bits);
      bits &= bits - 1;
      buf.push_back(rank_key(v[l], i + l));
    }
    if (buf.size() >= cap) cut();
  }
  for (; i < V && !closed; ++i) {
    const float v = row[i];
    if ((strict ? v > thr : v >= thr) || v != v) buf.push_back(rank_key(v, i));
  }
  if (buf.size() > keep) cut();
  std::sort(buf.begin(), buf.end(), std::greater<uint64_t>());
  for (size_t j = 0; j < keep; ++j) {
    idx[j] = key_index(buf[j]);
    vals[j] = row[idx[j]];
  }
}

// log(sum(exp(row[0, V)))) as torch.logsumexp: the maximum m, then m + log(sum(exp(row - m))), the
// exponentials summed in fp64 lanes (exp8: ~1 ulp each); any NaN gives NaN; a row whose maximum is
// +-inf gives it (all -inf: -inf).
inline float logsumexp_row(const float* row, int64_t V) {
  typedef double v4d __attribute__((vector_size(32)));
  const float inf = std::numeric_limits<float>::infinity();
  bool nan;
  const float m = row_max(row, V, &nan);
  if (nan) return std::numeric_limits<float>::quiet_NaN();
  if (m == inf || m == -inf) return m;
  v4d lo = {}, hi = {};
  const v8 mm = splat(m);
  int64_t i = 0;
  for (; i + 8 <= V; i += 8) {
    const v8 e = exp8(load8(row + i) - mm);
    lo += __builtin_convertvector(__builtin_shufflevector(e, e, 0, 1, 2, 3), v4d);
    hi += __builtin_convertvector(__builtin_shufflevector(e, e, 4, 5, 6, 7), v4d);
  }
  double sum = 0.0;
  for (int l = 0; l < 4; ++l) sum += lo[l] + hi[l];
  for (; i < V; ++i) sum += std::exp(double(row[i]) - m);
  return static_cast<float>(double(m) + std::log(sum));
}

// Repetition, frequency and presence penalties of one row of logits, in place, as engine/sampling.py's
// numpy path applies them (vLLM's semantics): every distinct token of the history (prompt, then
// output) gets `v > 0 ? v / repetition : v * repetition` (repetition in fp32), then every distinct
// output token has fp32(frequency * count + presence) (computed in fp64) subtracted. Ids outside
// [0, V) are clipped into it, as the numpy path's np.clip. `seen` and `count` are V-long scratch,
// zero on entry and left zero; `touched` is scratch. O(history), never O(V).
inline void penalize_row(float* row, int64_t V, const int64_t* ids, int64_t n, int64_t num_prompt, float repetition,
                         double frequency, double presence, std::vector<uint8_t>& seen, std::vector<int32_t>& count,
                         std::vector<int32_t>& touched) {
  touched.clear();
  for (int64_t j = 0; j < n; ++j) {
    const int32_t t = static_cast<int32_t>(std::clamp<int64_t>(ids[j], 0, V - 1));
    if (!seen[t]) {
      seen[t] = 1;
      touched.push_back(t);
    }
    count[t] += j >= num_prompt;
  }
  for (const int32_t t : touched) {
    float v = row[t];
    v = v > 0.f ? v / repetition : v * repetition;
    if (count[t]) v -= static_cast<float>(frequency * count[t] + presence);
    row[t] = v;
    seen[t] = 0;
    count[t] = 0;
  }
}

}  // namespace agentrt
