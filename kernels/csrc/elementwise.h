// One-pass row ops of the Llama layer: RMSNorm (optionally after the residual add), SiLU-and-mul, and
// RoPE fused with the KV-cache write. fp32 math; with bf16 storage every intermediate that HF
// transformers' bf16 model stores as a tensor is rounded to bf16 at the same point (`round_as<T>`),
// so the engine in bf16 computes what HF's bf16 model computes, not a more precise neighbour of it.

#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "vec.h"

namespace agentrt {

// y = w * (s / sqrt(mean(s^2) + eps)) per row, s = x or, with `residual`, s = x + residual (then
// also written to `sum`). HF LlamaRMSNorm: statistics in fp32, the normalized row rounded to the
// dtype before the weight multiplies it.
template <typename T>
inline void rms_norm_row(const T* src, const T* w, float eps, T* yr, int64_t hidden) {
  const int64_t h8 = hidden & ~int64_t(7);
  v8 ss8 = splat(0.f);
  for (int64_t i = 0; i < h8; i += 8) {
    const v8 v = load8(src + i);
    ss8 += v * v;
  }
  float ss = hsum(ss8);
  for (int64_t i = h8; i < hidden; ++i) ss += to_f32(src[i]) * to_f32(src[i]);
  const float r = 1.f / std::sqrt(ss / static_cast<float>(hidden) + eps);
  for (int64_t i = 0; i < h8; i += 8) store8(yr + i, load8(w + i) * round_as<T>(load8(src + i) * splat(r)));
  for (int64_t i = h8; i < hidden; ++i) yr[i] = from_f32<T>(to_f32(w[i]) * round_as<T>(to_f32(src[i]) * r));
}

template <typename T>
void rms_norm(const T* x, const T* residual, const T* w, float eps, T* y, T* sum, int64_t rows, int64_t hidden) {
  const int64_t h8 = hidden & ~int64_t(7);
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(hidden, 1)), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const T* xr = x + t * hidden;
      const T* src = xr;
      if (residual) {
        const T* rr = residual + t * hidden;
        T* sr = sum + t * hidden;
        for (int64_t i = 0; i < h8; i += 8) store8(sr + i, load8(xr + i) + load8(rr + i));
        for (int64_t i = h8; i < hidden; ++i) sr[i] = from_f32<T>(to_f32(xr[i]) + to_f32(rr[i]));
        src = sr;
      }
      rms_norm_row<T>(src, w, eps, y + t * hidden, hidden);
    }
  });
}

// Qwen3's q and k norms: rms_norm_row over each head of q (weight qw [D]) and of k (kw [D]), in place in
// the fused projection's output qkv [T, (H + 2 KVH) D] (row stride `stride`); v is left as it is.
template <typename T>
void qk_head_norms(T* qkv, int64_t stride, const T* qw, const T* kw, float eps, int64_t T_, int64_t H, int64_t KVH,
                   int64_t D) {
  for (int64_t t = 0; t < T_; ++t) {
    T* row = qkv + t * stride;
    for (int64_t h = 0; h < H + KVH; ++h) rms_norm_row<T>(row + h * D, h < H ? qw : kw, eps, row + h * D, D);
  }
}

// silu(x[:, :I]) * x[:, I:] for x [rows, 2I] (the fused gate/up projection's output) -> y [rows, I];
// HF rounds silu(gate) to the dtype before the product.
template <typename T>
void silu_and_mul(const T* x, T* y, int64_t rows, int64_t inter) {
  const int64_t i8 = inter & ~int64_t(7);
  at::parallel_for(0, rows, std::max<int64_t>(1, 8192 / std::max<int64_t>(inter, 1)), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const T *g = x + t * 2 * inter, *u = g + inter;
      T* yr = y + t * inter;
      for (int64_t i = 0; i < i8; i += 8) {
        const v8 gv = load8(g + i);
        store8(yr + i, round_as<T>(gv / (splat(1.f) + exp8(-gv))) * load8(u + i));
      }
      for (int64_t i = i8; i < inter; ++i) {
        const float gi = to_f32(g[i]);
        yr[i] = from_f32<T>(round_as<T>(gi / (1.f + std::exp(-gi))) * to_f32(u[i]));
      }
    }
  });
}

// Rotary embedding of q and k, and the KV-cache write, for rows of the fused qkv projection.
// qkv: [rows, (H + 2 KVH) * D] (row stride `ld`), heads in the adjacent-pair layout (engine/model.py:
// pair (x[2i], x[2i+1]) rotates by angle i); cos_sin: [positions, D / 2, 2] fp32 (cos, sin).
// q_out: [rows, H, D] rotated queries; rotated keys and the values go to slot slot_mapping[row] of
// k_cache / v_cache [blocks * block_size, KVH, D] (slot -1: not stored). HF applies RoPE in the
// dtype: cos and sin rounded to it, then q*cos and rotate_half(q)*sin rounded, then their sum.
template <typename T>
void rope_store_kv(const T* qkv, int64_t ld, const int64_t* positions, const float* cos_sin, T* q_out, T* k_cache,
                   T* v_cache, const int64_t* slot_mapping, int64_t rows, int64_t H, int64_t KVH, int64_t D) {
  const v8 sign = {-1.f, 1.f, -1.f, 1.f, -1.f, 1.f, -1.f, 1.f};
  at::parallel_for(0, rows, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const T* row = qkv + t * ld;
      const float* cs = cos_sin + positions[t] * D;
      const int64_t slot = slot_mapping[t];
      for (int64_t h = 0; h < H + KVH; ++h) {
        T* dst = h < H ? q_out + (t * H + h) * D : (slot >= 0 ? k_cache + (slot * KVH + h - H) * D : nullptr);
        if (!dst) continue;
        const T* src = row + h * D;
        for (int64_t i = 0; i < D; i += 8) {
          const v8 x = load8(src + i), c = round_as<T>(load8(cs + i));
          const v8 cc = __builtin_shufflevector(c, c, 0, 0, 2, 2, 4, 4, 6, 6);
          const v8 ss = __builtin_shufflevector(c, c, 1, 1, 3, 3, 5, 5, 7, 7);
          const v8 xs = __builtin_shufflevector(x, x, 1, 0, 3, 2, 5, 4, 7, 6);
          store8(dst + i, round_as<T>(x * cc) + round_as<T>(sign * xs * ss));
        }
      }
      if (slot >= 0) {
        const T* v = row + (H + KVH) * D;
        std::copy(v, v + KVH * D, v_cache + slot * KVH * D);
      }
    }
  });
}

// Index of the largest of row[0, V) by torch.argmax's rule: the first of equal maxima, and a NaN
// counts as the largest (the first NaN wins). Two passes of 8 lanes: the maximum, then its first index.
template <typename T>
inline int64_t argmax_row(const T* row, int64_t V) {
  bool any_nan;
  const float best = row_max(row, V, &any_nan);
  auto hit = [&](float v) { return any_nan ? v != v : v == best; };
  int64_t j = 0;
  for (; j + 8 <= V; j += 8) {
    const v8 v = load8(row + j);
    const v8i h = any_nan ? v8i(v != v) : v8i(v == splat(best));
    for (int l = 0; l < 8; ++l)
      if (h[l]) return j + l;
  }
  for (; j < V; ++j)
    if (hit(to_f32(row[j]))) return j;
  return 0;
}

}  // namespace agentrt
