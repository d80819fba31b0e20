// Attention of sequences with a few query rows (decode, draft verification) straight from the paged
// KV cache: each sequence's K and V blocks are read once, through the block table, for all its query
// heads. No gathered copy. fp32 or bf16 cache (converted on load); fp32 scores, softmax and sums.

#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "vec.h"

namespace agentrt {

constexpr int64_t kMaxQueryRows = 16;  // query rows per sequence this kernel takes
constexpr int64_t kMaxHeads = 64;       // query heads

// One sequence, kv heads [kvh0, kvh1): R query rows x G heads each, against the sequence's L cached
// positions. Row r sits at position L - R + r and sees positions [0, L - R + r] (causal). Blocks
// outer, queries inner: a block's K (then V) is read from memory once, whole, and stays in L1 for
// all the queries reading it. ND = head_dim / 8.
template <typename T, int ND>
void attend_one(const T* q, int64_t q_row_stride, T* out, const T* k_cache, const T* v_cache, const int32_t* table,
                int64_t q0, int64_t R, int64_t L, int64_t kvh0, int64_t kvh1, int64_t H, int64_t KVH, int64_t G,
                int64_t block_size, float scale, std::vector<float>& buf) {
  constexpr int64_t D = ND * 8;
  const int64_t nq = R * G * (kvh1 - kvh0);  // query i: head h0 + i / R, row i % R
  const int64_t h0 = kvh0 * G;
  const int64_t pos_stride = KVH * D;  // elements between consecutive positions of one block
  buf.resize(nq * D + nq * L);
  float* qs = buf.data();       // [nq, D] scaled queries, later the output accumulators
  float* scores = qs + nq * D;  // [nq, L]
  int64_t vis[kMaxQueryRows * kMaxHeads];
  int64_t koff[kMaxQueryRows * kMaxHeads];  // offset of the query's kv head within a position
  for (int64_t i = 0; i < nq; ++i) {
    const int64_t h = h0 + i / R, r = i % R;
    vis[i] = L - R + r + 1;
    koff[i] = (h / G) * D;
    const T* src = q + (q0 + r) * q_row_stride + h * D;
    for (int d = 0; d < ND; ++d) store8(qs + i * D + 8 * d, load8(src + 8 * d) * splat(scale));
  }
  // scores = q . k over every visible position, 4 positions at a time (independent FMA chains)
  const int64_t block_elems = block_size * pos_stride;
  for (int64_t t0 = 0; t0 < L; t0 += block_size) {
    const T* kblock = k_cache + (int64_t)table[t0 / block_size] * block_elems;
    for (int64_t i = 0; i < nq; ++i) {
      const int64_t m = std::min(block_size, vis[i] - t0);
      if (m <= 0) continue;
      const T* kb = kblock + koff[i];
      v8 qv[ND];
      for (int d = 0; d < ND; ++d) qv[d] = load8(qs + i * D + 8 * d);
      float* s = scores + i * L + t0;
      int64_t j = 0;
      for (; j + 4 <= m; j += 4) {
        const T* kp = kb + j * pos_stride;
        v8 a0 = qv[0] * load8(kp), a1 = qv[0] * load8(kp + pos_stride), a2 = qv[0] * load8(kp + 2 * pos_stride),
           a3 = qv[0] * load8(kp + 3 * pos_stride);
        for (int d = 1; d < ND; ++d) {
          a0 += qv[d] * load8(kp + 8 * d);
          a1 += qv[d] * load8(kp + pos_stride + 8 * d);
          a2 += qv[d] * load8(kp + 2 * pos_stride + 8 * d);
          a3 += qv[d] * load8(kp + 3 * pos_stride + 8 * d);
        }
        hsum4(a0, a1, a2, a3, s + j);
      }
      for (; j < m; ++j) {
        const T* kp = kb + j * pos_stride;
        v8 a = qv[0] * load8(kp);
        for (int d = 1; d < ND; ++d) a += qv[d] * load8(kp + 8 * d);
        s[j] = hsum(a);
      }
    }
  }
  // softmax numerators in place; 1 / denominators
  float inv_sum[kMaxQueryRows * kMaxHeads];
  for (int64_t i = 0; i < nq; ++i) {
    float* s = scores + i * L;
    const int64_t n = vis[i], n8 = n & ~int64_t(7);
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < n; ++t) mx = std::max(mx, s[t]);
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
    inv_sum[i] = 1.f / sum;
  }
  // out = p @ v, accumulated in qs's place (the scaled queries are no longer needed)
  float* acc = qs;
  for (int64_t j = 0; j < nq * D; ++j) acc[j] = 0.f;
  for (int64_t t0 = 0; t0 < L; t0 += block_size) {
    const T* vblock = v_cache + (int64_t)table[t0 / block_size] * block_elems;
    for (int64_t i = 0; i < nq; ++i) {
      const int64_t m = std::min(block_size, vis[i] - t0);
      if (m <= 0) continue;
      const T* vb = vblock + koff[i];
      v8 a[ND];
      for (int d = 0; d < ND; ++d) a[d] = load8(acc + i * D + 8 * d);
      const float* p = scores + i * L + t0;
      for (int64_t j = 0; j < m; ++j) {
        const v8 pj = splat(p[j]);
        const T* vp = vb + j * pos_stride;
        for (int d = 0; d < ND; ++d) a[d] += pj * load8(vp + 8 * d);
      }
      for (int d = 0; d < ND; ++d) store8(acc + i * D + 8 * d, a[d]);
    }
  }
  for (int64_t i = 0; i < nq; ++i) {
    T* dst = out + ((q0 + i % R) * H + h0 + i / R) * D;
    const v8 inv = splat(inv_sum[i]);
    for (int d = 0; d < ND; ++d) store8(dst + 8 * d, load8(acc + i * D + 8 * d) * inv);
  }
}

// Sequences `seqs` (S of them) of the batch described by query_start_loc / seq_lens / block_tables
// (max_blocks columns); writes their rows of out [T, H, D] (contiguous).
template <typename T>
void paged_attention_small_q(const T* q, int64_t q_row_stride, T* out, const T* k_cache, const T* v_cache,
                             const int32_t* qsl, const int32_t* lens, const int32_t* tables, int64_t max_blocks,
                             const int64_t* seqs, int64_t S, int64_t H, int64_t KVH, int64_t D, int64_t block_size,
                             float scale) {
  const int64_t G = H / KVH;
  // Work items: whole sequences (each block read once for all heads) when there are enough of them
  // to keep every thread busy, else (sequence, kv head) pairs.
  const int64_t split = S >= at::get_num_threads() ? 1 : KVH, heads_per_item = KVH / split;
  at::parallel_for(0, S * split, 1, [&](int64_t w0, int64_t w1) {
    std::vector<float> buf;
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t b = seqs[w / split], kvh0 = (w % split) * heads_per_item;
      auto run = [&](auto fn) {
        fn(q, q_row_stride, out, k_cache, v_cache, tables + b * max_blocks, qsl[b], qsl[b + 1] - qsl[b], lens[b], kvh0,
           kvh0 + heads_per_item, H, KVH, G, block_size, scale, buf);
      };
      switch (D) {
        case 32: run(attend_one<T, 4>); break;
        case 64: run(attend_one<T, 8>); break;
        case 128: run(attend_one<T, 16>); break;
        default: run(attend_one<T, 32>); break;
      }
    }
  });
}

}  // namespace agentrt
