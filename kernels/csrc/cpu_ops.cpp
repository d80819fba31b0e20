// CPU kernels for the engine's memory-bound fp32 ops, built on first use by kernels/cpu.py.
//
// - agentrt::packed_linear: y[M, N] = x[M, K] @ w[N, K]^T (+ bias) from a copy of the weight packed in
//   panels of 16 rows: for one row a single sequential pass over the weight (what bounds decode),
//   for many rows a BLIS-style register-tiled GEMM.
// - agentrt::paged_attention_small_q: attention of sequences with a few query rows (decode, draft
//   verification) straight from the paged KV cache: each sequence's K and V blocks are read once,
//   through the block table, for all its query heads. No gathered copy.
// - agentrt::rms_norm, agentrt::silu_and_mul: one pass each instead of torch's 4-5 elementwise ops.
//
// Portable GCC/Clang vector extensions (8 fp32 lanes: one AVX2 register with -march=native), no
// intrinsics; the loader compiles with -O3 -march=native -ffp-contract=fast.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));  // unaligned access
typedef int32_t v8i __attribute__((vector_size(32)));

inline v8 load8(const float* p) { return *reinterpret_cast<const v8u*>(p); }
inline void store8(float* p, v8 x) { *reinterpret_cast<v8u*>(p) = x; }
inline v8 splat(float x) { return v8{x, x, x, x, x, x, x, x}; }
inline float hsum(v8 x) {
  typedef float v4 __attribute__((vector_size(16)));
  v4 h = __builtin_shufflevector(x, x, 0, 1, 2, 3) + __builtin_shufflevector(x, x, 4, 5, 6, 7);
  h += __builtin_shufflevector(h, h, 2, 3, 0, 1);
  return h[0] + h[1];
}

// s[0..3] = the lane sums of a0..a3 (two pairwise-add levels, then the two 128-bit halves).
inline void hsum4(v8 a0, v8 a1, v8 a2, v8 a3, float* s) {
  typedef float v4u __attribute__((vector_size(16), aligned(4)));
  const v8 h01 = __builtin_shufflevector(a0, a1, 0, 2, 8, 10, 4, 6, 12, 14) +
                 __builtin_shufflevector(a0, a1, 1, 3, 9, 11, 5, 7, 13, 15);
  const v8 h23 = __builtin_shufflevector(a2, a3, 0, 2, 8, 10, 4, 6, 12, 14) +
                 __builtin_shufflevector(a2, a3, 1, 3, 9, 11, 5, 7, 13, 15);
  const v8 h = __builtin_shufflevector(h01, h23, 0, 2, 8, 10, 4, 6, 12, 14) +
               __builtin_shufflevector(h01, h23, 1, 3, 9, 11, 5, 7, 13, 15);
  *reinterpret_cast<v4u*>(s) = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
}

// exp: Cephes' expf (range reduction by ln 2, degree-5 polynomial), about 1 ulp; inputs are
// clamped to [-87, 88] (below: ~1e-38 instead of 0 or a denormal; above: ~1.6e38 instead of inf).
inline v8 exp8(v8 x) {
  x = x < splat(-87.0f) ? splat(-87.0f) : x;
  x = x > splat(88.0f) ? splat(88.0f) : x;
  v8 fx = x * splat(1.44269504088896341f) + splat(0.5f);
  v8 t = __builtin_convertvector(__builtin_convertvector(fx, v8i), v8);  // truncate
  fx = t - (t > fx ? splat(1.f) : splat(0.f));                              // floor
  x = x - fx * splat(0.693359375f) - fx * splat(-2.12194440e-4f);
  v8 z = x * x;
  v8 y = splat(1.9875691500e-4f);
  y = y * x + splat(1.3981999507e-3f);
  y = y * x + splat(8.3334519073e-3f);
  y = y * x + splat(4.1665795894e-2f);
  y = y * x + splat(1.6666665459e-1f);
  y = y * x + splat(5.0000001201e-1f);
  y = y * z + x + splat(1.f);
  v8i n = (__builtin_convertvector(fx, v8i) + 127) << 23;
  return y * reinterpret_cast<v8&>(n);
}

// ------------------------------------------------------------------------------------ packed_linear

constexpr int64_t kPanel = 16;  // output columns (weight rows) per panel of the packed layout
constexpr int kMaxTileRows = 6;  // rows of x per register tile: 6 x 16 outputs = 12 accumulators

// One register tile: MR rows of x times one weight panel ([K][16], column n of the panel = weight
// row n, so each k reads 16 consecutive floats). Broadcast x[m, k], two FMAs per row (the BLIS
// Haswell micro-kernel shape): 12 accumulators + 2 weight vectors + 1 broadcast = 15 registers.
template <int MR>
inline void linear_tile(const float* x, int64_t K, const float* panel, const float* bias, float* y, int64_t ldy,
                        int64_t ncols) {
  v8 c0[MR], c1[MR];
  for (int m = 0; m < MR; ++m) c0[m] = c1[m] = splat(0.f);
#pragma GCC unroll 4
  for (int64_t k = 0; k < K; ++k) {
    const v8 b0 = load8(panel + k * kPanel), b1 = load8(panel + k * kPanel + 8);
    for (int m = 0; m < MR; ++m) {
      const v8 a = splat(x[m * K + k]);
      c0[m] += a * b0;
      c1[m] += a * b1;
    }
  }
  if (bias) {
    float b[kPanel] = {};
    for (int64_t j = 0; j < ncols; ++j) b[j] = bias[j];
    for (int m = 0; m < MR; ++m) {
      c0[m] += load8(b);
      c1[m] += load8(b + 8);
    }
  }
  for (int m = 0; m < MR; ++m) {
    float* row = y + m * ldy;
    if (ncols == kPanel) {
      store8(row, c0[m]);
      store8(row + 8, c1[m]);
    } else {
      for (int64_t j = 0; j < ncols; ++j) row[j] = j < 8 ? c0[m][j] : c1[m][j - 8];
    }
  }
}

// y [M, N] = x [M, K] @ w^T (+ bias), w packed by `pack_linear_weight` ([ceil(N / 16), K, 16]: each
// panel of 16 weight rows transposed, so a one-row product streams the weight sequentially and a
// many-row product keeps a panel in L2 while all row tiles pass over it). Threads split the panels.
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& w_packed, const std::optional<at::Tensor>& bias,
                        int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "packed_linear: x [M, K] fp32");
  const int64_t M = x.size(0), K = x.size(1), panels = (N + kPanel - 1) / kPanel;
  TORCH_CHECK(w_packed.scalar_type() == at::kFloat && w_packed.is_contiguous() && w_packed.dim() == 3 &&
                  w_packed.size(0) == panels && w_packed.size(1) == K && w_packed.size(2) == kPanel,
              "packed_linear: packed weight [", panels, ", ", K, ", 16] fp32 for N=", N, " K=", K, ", got ",
              w_packed.sizes());
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "packed_linear: bias [N] fp32");
    b = bias->data_ptr<float>();
  }
  at::Tensor y = at::empty({M, N}, x.options());
  const float *xp = x.data_ptr<float>(), *wp = w_packed.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n = p * kPanel, ncols = std::min(kPanel, N - n);
      const float* panel = wp + p * K * kPanel;
      const float* bn = b ? b + n : nullptr;
      for (int64_t m0 = 0; m0 < M; m0 += kMaxTileRows) {
        const float* xm = xp + m0 * K;
        float* ym = yp + m0 * N + n;
        switch (std::min<int64_t>(kMaxTileRows, M - m0)) {
          case 1: linear_tile<1>(xm, K, panel, bn, ym, N, ncols); break;
          case 2: linear_tile<2>(xm, K, panel, bn, ym, N, ncols); break;
          case 3: linear_tile<3>(xm, K, panel, bn, ym, N, ncols); break;
          case 4: linear_tile<4>(xm, K, panel, bn, ym, N, ncols); break;
          case 5: linear_tile<5>(xm, K, panel, bn, ym, N, ncols); break;
          default: linear_tile<6>(xm, K, panel, bn, ym, N, ncols); break;
        }
      }
    }
  });
  return y;
}

// ------------------------------------------------------------------------- paged_attention_small_q

constexpr int64_t kMaxQueryRows = 16;  // query rows per sequence this kernel takes
constexpr int64_t kMaxHeads = 64;       // query heads

// One sequence, kv heads [kvh0, kvh1): R query rows x G heads each, against the sequence's L cached
// positions. Row r sits at position L - R + r and sees positions [0, L - R + r] (causal). Blocks
// outer, queries inner: a block's K (then V) is read from memory once, whole, and stays in L1 for
// all the queries reading it. ND = head_dim / 8.
template <int ND>
void attend_one(const float* q, int64_t q_row_stride, float* out, const float* k_cache, const float* v_cache,
                const int32_t* table, int64_t q0, int64_t R, int64_t L, int64_t kvh0, int64_t kvh1, int64_t H,
                int64_t KVH, int64_t G, int64_t block_size, float scale, std::vector<float>& buf) {
  constexpr int64_t D = ND * 8;
  const int64_t nq = R * G * (kvh1 - kvh0);  // query i: head h0 + i / R, row i % R
  const int64_t h0 = kvh0 * G;
  const int64_t pos_stride = KVH * D;  // floats between consecutive positions of one block
  buf.resize(nq * D + nq * L);
  float* qs = buf.data();       // [nq, D] scaled queries, later the output accumulators
  float* scores = qs + nq * D;  // [nq, L]
  int64_t vis[kMaxQueryRows * kMaxHeads];
  int64_t koff[kMaxQueryRows * kMaxHeads];  // offset of the query's kv head within a position
  for (int64_t i = 0; i < nq; ++i) {
    const int64_t h = h0 + i / R, r = i % R;
    vis[i] = L - R + r + 1;
    koff[i] = (h / G) * D;
    const float* src = q + (q0 + r) * q_row_stride + h * D;
    for (int64_t d = 0; d < D; ++d) qs[i * D + d] = src[d] * scale;
  }
  // scores = q . k over every visible position, 4 positions at a time (independent FMA chains)
  const int64_t block_floats = block_size * pos_stride;
  for (int64_t t0 = 0; t0 < L; t0 += block_size) {
    const float* kblock = k_cache + (int64_t)table[t0 / block_size] * block_floats;
    for (int64_t i = 0; i < nq; ++i) {
      const int64_t m = std::min(block_size, vis[i] - t0);
      if (m <= 0) continue;
      const float* kb = kblock + koff[i];
      v8 qv[ND];
      for (int d = 0; d < ND; ++d) qv[d] = load8(qs + i * D + 8 * d);
      float* s = scores + i * L + t0;
      int64_t j = 0;
      for (; j + 4 <= m; j += 4) {
        const float* kp = kb + j * pos_stride;
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
        const float* kp = kb + j * pos_stride;
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
    const float* vblock = v_cache + (int64_t)table[t0 / block_size] * block_floats;
    for (int64_t i = 0; i < nq; ++i) {
      const int64_t m = std::min(block_size, vis[i] - t0);
      if (m <= 0) continue;
      const float* vb = vblock + koff[i];
      v8 a[ND];
      for (int d = 0; d < ND; ++d) a[d] = load8(acc + i * D + 8 * d);
      const float* p = scores + i * L + t0;
      for (int64_t j = 0; j < m; ++j) {
        const v8 pj = splat(p[j]);
        const float* vp = vb + j * pos_stride;
        for (int d = 0; d < ND; ++d) a[d] += pj * load8(vp + 8 * d);
      }
      for (int d = 0; d < ND; ++d) store8(acc + i * D + 8 * d, a[d]);
    }
  }
  for (int64_t i = 0; i < nq; ++i) {
    float* dst = out + ((q0 + i % R) * H + h0 + i / R) * D;
    const v8 inv = splat(inv_sum[i]);
    for (int d = 0; d < ND; ++d) store8(dst + 8 * d, load8(acc + i * D + 8 * d) * inv);
  }
}

// Writes out[rows of `seqs`] in place. q: [T, H, D] (any row stride); out: [T, H, D] contiguous;
// caches: [num_blocks, block_size, KVH, D]; query_start_loc [B + 1], seq_lens [B], block_tables
// [B, max_blocks] int32; seqs: int64 indices of the sequences to process (1 to 16 query rows each).
void paged_attention_small_q(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                             const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                             const at::Tensor& block_tables, const at::Tensor& seqs, double scale, at::Tensor& out) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat &&
                  v_cache.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat,
              "paged_attention_small_q: fp32 only");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2) && out.is_contiguous() &&
                  k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_attention_small_q: contiguous heads of q, contiguous out and caches");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && out.sizes() == q.sizes(), "paged_attention_small_q: shapes");
  TORCH_CHECK(query_start_loc.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  block_tables.scalar_type() == at::kInt && seqs.scalar_type() == at::kLong,
              "paged_attention_small_q: int32 metadata, int64 seqs");
  TORCH_CHECK(block_tables.is_contiguous() && seqs.is_contiguous(), "paged_attention_small_q: contiguous metadata");
  const int64_t H = q.size(1), D = q.size(2), block_size = k_cache.size(1), KVH = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && (D == 64 || D == 128 || D == 32 || D == 256) && H % KVH == 0 && H <= kMaxHeads,
              "paged_attention_small_q: head_dim 32, 64, 128 or 256, whole GQA groups, at most ", kMaxHeads, " heads");
  const int64_t G = H / KVH, max_blocks = block_tables.size(1), S = seqs.numel();
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t* sp = seqs.data_ptr<int64_t>();
  for (int64_t i = 0; i < S; ++i) {
    const int64_t b = sp[i], R = qsl[b + 1] - qsl[b];
    TORCH_CHECK(R >= 1 && R <= kMaxQueryRows && lens[b] >= R && (lens[b] + block_size - 1) / block_size <= max_blocks,
                "paged_attention_small_q: sequence ", b, " has ", R, " query rows and ", lens[b], " positions");
  }
  const float *qp = q.data_ptr<float>(), *kp = k_cache.data_ptr<float>(), *vp = v_cache.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  const int64_t q_row_stride = q.stride(0);
  // Work items: whole sequences (each block read once for all heads) when there are enough of them
  // to keep every thread busy, else (sequence, kv head) pairs.
  const int64_t split = S >= at::get_num_threads() ? 1 : KVH, heads_per_item = KVH / split;
  at::parallel_for(0, S * split, 1, [&](int64_t w0, int64_t w1) {
    std::vector<float> buf;
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t b = sp[w / split], kvh0 = (w % split) * heads_per_item;
      auto run = [&](auto fn) {
        fn(qp, q_row_stride, op, kp, vp, tables + b * max_blocks, qsl[b], qsl[b + 1] - qsl[b], lens[b], kvh0,
           kvh0 + heads_per_item, H, KVH, G, block_size, sc, buf);
      };
      switch (D) {
        case 32: run(attend_one<4>); break;
        case 64: run(attend_one<8>); break;
        case 128: run(attend_one<16>); break;
        default: run(attend_one<32>); break;
      }
    }
  });
}

// ------------------------------------------------------------------------- rms_norm, silu_and_mul

// y = w * (x / sqrt(mean(x^2) + eps)) per row of x [T, hidden] (HF Llama's fp32 RMSNorm).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && w.scalar_type() == at::kFloat &&
                  w.is_contiguous() && w.numel() == x.size(1),
              "rms_norm: x [T, hidden] and weight [hidden], contiguous fp32");
  const int64_t T = x.size(0), Hd = x.size(1), H8 = Hd & ~int64_t(7);
  at::Tensor y = at::empty_like(x);
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, T, std::max<int64_t>(1, 16384 / std::max<int64_t>(Hd, 1)), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* xr = xp + t * Hd;
      float* yr = yp + t * Hd;
      v8 ss8 = splat(0.f);
      for (int64_t i = 0; i < H8; i += 8) {
        const v8 v = load8(xr + i);
        ss8 += v * v;
      }
      float ss = hsum(ss8);
      for (int64_t i = H8; i < Hd; ++i) ss += xr[i] * xr[i];
      const float r = 1.f / std::sqrt(ss / static_cast<float>(Hd) + static_cast<float>(eps));
      for (int64_t i = 0; i < H8; i += 8) store8(yr + i, load8(wp + i) * (load8(xr + i) * splat(r)));
      for (int64_t i = H8; i < Hd; ++i) yr[i] = wp[i] * (xr[i] * r);
    }
  });
  return y;
}

// silu(x[:, :I]) * x[:, I:] for x [T, 2I] (the fused gate/up projection's output) -> [T, I].
at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(1) % 2 == 0,
              "silu_and_mul: x [T, 2I] contiguous fp32");
  const int64_t T = x.size(0), I = x.size(1) / 2, I8 = I & ~int64_t(7);
  at::Tensor y = at::empty({T, I}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, T, std::max<int64_t>(1, 8192 / std::max<int64_t>(I, 1)), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float *g = xp + t * 2 * I, *u = g + I;
      float* yr = yp + t * I;
      for (int64_t i = 0; i < I8; i += 8) {
        const v8 gv = load8(g + i);
        store8(yr + i, gv / (splat(1.f) + exp8(-gv)) * load8(u + i));
      }
      for (int64_t i = I8; i < I; ++i) yr[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(agentrt_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("packed_linear(Tensor x, Tensor w_packed, Tensor? bias, int N) -> Tensor");
  m.def(
      "paged_attention_small_q(Tensor q, Tensor k_cache, Tensor v_cache, Tensor query_start_loc, Tensor seq_lens, "
      "Tensor block_tables, Tensor seqs, float scale, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(agentrt_cpu, CPU, m) {
  m.impl("rms_norm", rms_norm);
  m.impl("silu_and_mul", silu_and_mul);
  m.impl("packed_linear", packed_linear);
  m.impl("paged_attention_small_q", paged_attention_small_q);
}
