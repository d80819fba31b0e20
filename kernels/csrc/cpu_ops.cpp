// CPU kernels for the engine's fp32 and bf16 paths, built on first use by kernels/cpu.py, once per CPU
// kind (AVX2 / AVX512 / AVX512-BF16), each build registering its ops under its own namespace
// (AGENTRT_NS, e.g. torch.ops.agentrt_cpu_avx512_bf16) so that several kinds load side by side.
// This file checks tensors and dispatches on the dtype; the kernels live in the headers:
//
// - linear.h: packed_linear (fp32) and packed_linear_bf16, x @ w^T from a panel-packed weight;
// - attention.h: paged_attention_small_q, attention of few-row sequences from the paged cache;
// - attention_bf16.h: paged_attention_bf16, tiled attention of any rows on AVX512-BF16 (bf16 only);
// - elementwise.h: rms_norm (optionally after the residual add), silu_and_mul, rope_store_kv;
// - moe.h: grouped_linear, a mixture-of-experts layer's expert projections, one GEMM per expert, and
//   grouped_quant_linear, the same from experts kept in a GGUF block format;
// - quant.h: quant_linear and quant_dequantize, x @ w^T from a weight kept in a GGUF block format;
// - sampler.h: topk_rows, logsumexp_rows and penalize_rows, the sampler's row kernels;
// - decode_forward (here): all decoder layers of a decode step in one call; decode_steps: greedy
//   decode steps (layers, final norm, LM head, argmax) in one call.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "attention.h"
#include "attention_bf16.h"
#include "elementwise.h"
#include "linear.h"
#include "moe.h"
#include "quant.h"
#include "quant_bf16.h"
#include "team.h"
#include "sampler.h"
#include "vec.h"

#ifndef AGENTRT_NS
#define AGENTRT_NS agentrt_cpu
#endif

namespace {

using agentrt::bf16;

bool is_float_or_bf16(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16;
}

template <typename T>
T* ptr(const at::Tensor& t) {
  if constexpr (std::is_same_v<T, float>) {
    return t.data_ptr<float>();
  } else {
    return reinterpret_cast<bf16*>(t.data_ptr<at::BFloat16>());
  }
}

// Calls fn(T{}) with T = float or bf16 after x's dtype.
template <typename Fn>
void by_dtype(const at::Tensor& x, const char* op, Fn fn) {
  if (x.scalar_type() == at::kFloat) {
    fn(float{});
  } else if (x.scalar_type() == at::kBFloat16) {
    fn(bf16{});
  } else {
    TORCH_CHECK(false, op, ": fp32 or bf16 only, got ", x.scalar_type());
  }
}

std::string isa() { return agentrt::compiled_isa(); }
// Whether this process's bf16 projections run on AMX (built for it, granted by Linux, not AGENTRT_CPU_AMX=0).
bool amx() { return agentrt::amx_linear_applies(32); }

// The packed weight (and fp32 bias) of an [N, K] projection; returns the bias pointer (or null).
const float* check_packed(const at::Tensor& w_packed, const std::optional<at::Tensor>& bias, int64_t K, int64_t N,
                          bool bf) {
  const char* op = bf ? "packed_linear_bf16" : "packed_linear";
  if (bf) {
    const int64_t panels = (N + agentrt::kPanelBf16 - 1) / agentrt::kPanelBf16;
    TORCH_CHECK(w_packed.scalar_type() == at::kBFloat16 && w_packed.is_contiguous() && w_packed.dim() == 4 &&
                    w_packed.size(0) == panels && w_packed.size(1) == (K + 1) / 2 &&
                    w_packed.size(2) == agentrt::kPanelBf16 && w_packed.size(3) == 2,
                op, ": packed weight [", panels, ", ", (K + 1) / 2, ", 32, 2] bf16 for N=", N, " K=", K, ", got ",
                w_packed.sizes());
  } else {
    const int64_t panels = (N + agentrt::kPanel - 1) / agentrt::kPanel;
    TORCH_CHECK(w_packed.scalar_type() == at::kFloat && w_packed.is_contiguous() && w_packed.dim() == 3 &&
                    w_packed.size(0) == panels && w_packed.size(1) == K && w_packed.size(2) == agentrt::kPanel,
                op, ": packed weight [", panels, ", ", K, ", 16] fp32 for N=", N, " K=", K, ", got ", w_packed.sizes());
  }
  if (!bias.has_value() || !bias->defined()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N, op, ": bias [N] fp32");
  return bias->data_ptr<float>();
}

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& w_packed, const std::optional<at::Tensor>& bias,
                         int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "packed_linear: x [M, K] fp32");
  const int64_t M = x.size(0), K = x.size(1);
  const float* b = check_packed(w_packed, bias, K, N, false);
  at::Tensor y = at::empty({M, N}, x.options());
  agentrt::packed_linear_f32(x.data_ptr<float>(), M, K, w_packed.data_ptr<float>(), b, y.data_ptr<float>(), N);
  return y;
}

// x [M, K] bf16, w_packed [ceil(N / 32), ceil(K / 2), 32, 2] bf16, bias [N] fp32 or None -> [M, N] bf16.
at::Tensor packed_linear_bf16(const at::Tensor& x, const at::Tensor& w_packed, const std::optional<at::Tensor>& bias,
                              int64_t N, bool invariant) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "packed_linear_bf16: x [M, K] contiguous bf16");
  const int64_t M = x.size(0), K = x.size(1);
  const float* b = check_packed(w_packed, bias, K, N, true);
  at::Tensor y = at::empty({M, N}, x.options());
  (void)invariant;  // the packed kernel's output is row-invariant either way (AMX where it applies, else tiles)
  agentrt::packed_linear_bf16(ptr<bf16>(x), M, K, ptr<bf16>(w_packed), b, ptr<bf16>(y), N);
  return y;
}

// x [M, K] fp32, w [N, K / B * bytes] uint8 in GGUF block format `type` (ggml's type id), bias [N] fp32 or None
// -> [M, N] fp32.
const uint8_t* check_quant(const at::Tensor& w, int64_t type, int64_t N, int64_t K, const char* op,
                           int64_t& block, int64_t& bytes) {
  const bool known = agentrt::by_quant_type(type, [&](auto f) {
    block = decltype(f)::kBlock;
    bytes = decltype(f)::kBytes;
  });
  TORCH_CHECK(known, op, ": unsupported GGUF block type ", type, " (supported: Q4_0=2 Q4_1=3 Q5_0=6 Q8_0=8 Q4_K=12 "
              "Q5_K=13 Q6_K=14 MXFP4=39)");
  TORCH_CHECK(K % block == 0, op, ": K=", K, " is not a multiple of the format's ", block, "-weight block");
  TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous() && w.numel() == N * (K / block) * bytes, op,
              ": w [", N, ", ", K / block * bytes, "] contiguous uint8 for N=", N, " K=", K, ", got ", w.sizes(), " ",
              w.scalar_type());
  return w.data_ptr<uint8_t>();
}

// A bf16 x gives a bf16 y (rounded once, after the bias): on AVX512-BF16 by the blocks' integer dot products
// (quant_bf16.h; from kQuantWidenMinRows rows, unless `invariant`, over panels widened to bf16), elsewhere widened
// to fp32 for the tiles above.
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& w, int64_t type, int64_t N,
                        const std::optional<at::Tensor>& bias, bool invariant) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) && x.is_contiguous(),
              "quant_linear: x [M, K] contiguous fp32 or bf16");
  const int64_t M = x.size(0), K = x.size(1);
  int64_t block = 0, bytes = 0;
  const uint8_t* wp = check_quant(w, type, N, K, "quant_linear", block, bytes);
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "quant_linear: bias [N] fp32");
    b = bias->data_ptr<float>();
  }
  if (x.scalar_type() == at::kBFloat16) {
#if defined(__AVX512BF16__)
    at::Tensor y = at::empty({M, N}, x.options());
    if (M == 0 || N == 0) return y;
    agentrt::by_quant_type(type, [&](auto f) {
      agentrt::quant_linear_bf16<decltype(f)>(ptr<bf16>(x), M, K, wp, b, ptr<bf16>(y), N, N, invariant);
    });
    return y;
#else
    return quant_linear(x.to(at::kFloat), w, type, N, bias, invariant).to(at::kBFloat16);
#endif
  }
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  agentrt::by_quant_type(type, [&](auto f) {
    agentrt::quant_linear<decltype(f)>(x.data_ptr<float>(), M, K, wp, b, y.data_ptr<float>(), N);
  });
  return y;
}

// w as quant_linear takes it -> [N, K] fp32.
at::Tensor quant_dequantize(const at::Tensor& w, int64_t type, int64_t N, int64_t K) {
  int64_t block = 0, bytes = 0;
  const uint8_t* wp = check_quant(w, type, N, K, "quant_dequantize", block, bytes);
  at::Tensor y = at::empty({N, K}, w.options().dtype(at::kFloat));
  agentrt::by_quant_type(type, [&](auto f) { agentrt::quant_dequantize<decltype(f)>(wp, N, K, y.data_ptr<float>()); });
  return y;
}

// The checks of grouped_linear's x and offsets: x [M, K] contiguous fp32 or bf16, offsets [E + 1] int64 from 0 to M,
// not decreasing. Returns E.
int64_t check_grouped_rows(const at::Tensor& x, const at::Tensor& offsets, const char* op) {
  TORCH_CHECK(x.dim() == 2 && is_float_or_bf16(x) && x.is_contiguous(), op, ": x [M, K] contiguous fp32 or bf16");
  TORCH_CHECK(offsets.dim() == 1 && offsets.size(0) >= 2 && offsets.scalar_type() == at::kLong &&
                  offsets.is_contiguous(),
              op, ": offsets [E + 1] int64");
  const int64_t M = x.size(0), E = offsets.size(0) - 1;
  const int64_t* off = offsets.data_ptr<int64_t>();
  TORCH_CHECK(off[0] == 0 && off[E] == M, op, ": offsets run from 0 to the ", M, " rows of x, got ", off[0], " .. ",
              off[E]);
  for (int64_t e = 0; e < E; ++e) TORCH_CHECK(off[e] <= off[e + 1], op, ": offsets decrease at expert ", e);
  return E;
}

// x [M, K] (fp32 or bf16) with its rows sorted by expert, offsets [E + 1] int64 (expert e's rows at
// offsets[e] .. offsets[e + 1]), w_packed one packed weight per expert ([E, ...] of packed_linear's layout in
// x's dtype), bias [E, N] fp32 or None -> [M, N] in x's dtype: each row times its expert's weight.
at::Tensor grouped_linear(const at::Tensor& x, const at::Tensor& offsets, const at::Tensor& w_packed,
                          const std::optional<at::Tensor>& bias, int64_t N) {
  const int64_t E = check_grouped_rows(x, offsets, "grouped_linear");
  const int64_t M = x.size(0), K = x.size(1);
  const int64_t* off = offsets.data_ptr<int64_t>();
  TORCH_CHECK(w_packed.size(0) == E && w_packed.scalar_type() == x.scalar_type(), "grouped_linear: w_packed [", E,
              ", ...] in x's dtype, got ", w_packed.sizes(), " ", w_packed.scalar_type());
  const bool bf = x.scalar_type() == at::kBFloat16;
  check_packed(w_packed[0], std::nullopt, K, N, bf);
  TORCH_CHECK(w_packed.is_contiguous(), "grouped_linear: w_packed contiguous");
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->dim() == 2 && bias->size(0) == E &&
                    bias->size(1) == N,
                "grouped_linear: bias [E, N] fp32, got ", bias->sizes(), " ", bias->scalar_type());
    b = bias->data_ptr<float>();
  }
  at::Tensor y = at::empty({M, N}, x.options());
  if (bf) {
    agentrt::grouped_linear_bf16(ptr<bf16>(x), off, E, M, K, ptr<bf16>(w_packed), b, ptr<bf16>(y), N);
  } else {
    agentrt::grouped_linear_f32(x.data_ptr<float>(), off, E, K, w_packed.data_ptr<float>(), b, y.data_ptr<float>(), N);
  }
  return y;
}

// x [M, K] (fp32 or bf16) with its rows sorted by expert, offsets [E + 1] int64, w [E, N, K / B * bytes] uint8: each
// expert's weight in GGUF block format `type` (quant_linear's layout), bias [E, N] fp32 or None -> [M, N] in x's
// dtype: each row times its expert's weight, the bits quant_linear gives it.
at::Tensor grouped_quant_linear(const at::Tensor& x, const at::Tensor& offsets, const at::Tensor& w, int64_t type,
                                int64_t N, const std::optional<at::Tensor>& bias) {
  const int64_t E = check_grouped_rows(x, offsets, "grouped_quant_linear");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(w.dim() == 3 && w.size(0) == E && w.size(1) == N, "grouped_quant_linear: w [E, N, bytes] = [", E, ", ",
              N, ", ...] expected, got ", w.sizes());
  TORCH_CHECK(w.is_contiguous(), "grouped_quant_linear: w contiguous");
  int64_t block = 0, bytes = 0;
  check_quant(w[0], type, N, K, "grouped_quant_linear", block, bytes);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->dim() == 2 && bias->size(0) == E &&
                    bias->size(1) == N,
                "grouped_quant_linear: bias [E, N] fp32, got ", bias->sizes(), " ", bias->scalar_type());
    b = bias->data_ptr<float>();
  }
  const int64_t* off = offsets.data_ptr<int64_t>();
  if (x.scalar_type() == at::kBFloat16) {
#if defined(__AVX512BF16__)
    at::Tensor y = at::empty({M, N}, x.options());
    if (M == 0 || N == 0) return y;
    agentrt::by_quant_type(type, [&](auto f) {
      agentrt::grouped_quant_linear_bf16<decltype(f)>(ptr<bf16>(x), off, E, M, K, wp, b, ptr<bf16>(y), N);
    });
    return y;
#else
    return grouped_quant_linear(x.to(at::kFloat), offsets, w, type, N, bias).to(at::kBFloat16);
#endif
  }
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  agentrt::by_quant_type(type, [&](auto f) {
    agentrt::grouped_quant_linear_f32<decltype(f)>(x.data_ptr<float>(), off, E, K, wp, b, y.data_ptr<float>(), N);
  });
  return y;
}

// Each sequence seqs[i] has 1 to max_rows query rows, at least as many positions, and its blocks in the table.
void check_rows(const int32_t* qsl, const int32_t* lens, const int64_t* seqs, int64_t S, int64_t block_size,
                int64_t max_blocks, int64_t max_rows, const char* op) {
  for (int64_t i = 0; i < S; ++i) {
    const int64_t b = seqs[i], R = qsl[b + 1] - qsl[b];
    TORCH_CHECK(R >= 1 && R <= max_rows && lens[b] >= R && (lens[b] + block_size - 1) / block_size <= max_blocks, op,
                ": sequence ", b, " has ", R, " query rows and ", lens[b], " positions");
  }
}

// Writes out[rows of `seqs`] in place. q: [T, H, D] (any row stride); out: [T, H, D] contiguous;
// caches: [num_blocks, block_size, KVH, D], all of one dtype (fp32 or bf16); query_start_loc [B + 1],
// seq_lens [B], block_tables [B, max_blocks] int32; seqs: int64 indices of the sequences to process
// (1 to 16 query rows each). The layer's features: window (0 = none), sinks ([H] fp32 or None),
// softcap (0 = none); see attention.h.
void paged_attention_small_q(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                             const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                             const at::Tensor& block_tables, const at::Tensor& seqs, double scale, at::Tensor& out,
                             bool invariant, int64_t window, const std::optional<at::Tensor>& sinks, double softcap) {
  TORCH_CHECK(is_float_or_bf16(q) && k_cache.scalar_type() == q.scalar_type() &&
                  v_cache.scalar_type() == q.scalar_type() && out.scalar_type() == q.scalar_type(),
              "paged_attention_small_q: q, caches and out all fp32 or all bf16");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2) && out.is_contiguous() &&
                  k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_attention_small_q: contiguous heads of q, contiguous out and caches");
  TORCH_CHECK(k_cache.dim() == 4 && out.sizes() == q.sizes(), "paged_attention_small_q: shapes");
  TORCH_CHECK(query_start_loc.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  block_tables.scalar_type() == at::kInt && seqs.scalar_type() == at::kLong,
              "paged_attention_small_q: int32 metadata, int64 seqs");
  TORCH_CHECK(block_tables.is_contiguous() && seqs.is_contiguous(), "paged_attention_small_q: contiguous metadata");
  const int64_t H = q.size(1), D = q.size(2), block_size = k_cache.size(1), KVH = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && (D == 64 || D == 128 || D == 32 || D == 256) && H % KVH == 0 &&
                  H <= agentrt::kMaxHeads,
              "paged_attention_small_q: head_dim 32, 64, 128 or 256, whole GQA groups, at most ", agentrt::kMaxHeads,
              " heads");
  const int64_t max_blocks = block_tables.size(1), S = seqs.numel();
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t* sp = seqs.data_ptr<int64_t>();
  check_rows(qsl, lens, sp, S, block_size, max_blocks, agentrt::kMaxQueryRows, "paged_attention_small_q");
  TORCH_CHECK(window >= 0 && softcap >= 0, "paged_attention_small_q: window ", window, " and softcap ", softcap,
              " must not be negative");
  const float* sink = nullptr;
  if (sinks.has_value() && sinks->defined()) {
    TORCH_CHECK(sinks->scalar_type() == at::kFloat && sinks->is_contiguous() && sinks->numel() == H,
                "paged_attention_small_q: sinks [", H, "] contiguous fp32, got ", sinks->sizes(), " ",
                sinks->scalar_type());
    sink = sinks->data_ptr<float>();
  }
  by_dtype(q, "paged_attention_small_q", [&](auto tag) {
    using T = decltype(tag);
    agentrt::paged_attention_small_q<T>(ptr<T>(q), q.stride(0), ptr<T>(out), ptr<T>(k_cache), ptr<T>(v_cache), qsl,
                                        lens, block_tables.data_ptr<int32_t>(), max_blocks, sp, S, H, KVH, D,
                                        block_size, static_cast<float>(scale), invariant, window, sink,
                                        static_cast<float>(softcap));
  });
}

// Like paged_attention_small_q for sequences with any number of query rows, bf16 only, in the
// AVX512-BF16 build only (attention_bf16.h); of a layer's features the sliding window (0 = none).
void paged_attention_bf16(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                             const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                             const at::Tensor& block_tables, const at::Tensor& seqs, double scale, at::Tensor& out,
                             bool invariant, int64_t window) {
#if defined(__AVX512BF16__)
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16 &&
                  v_cache.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16,
              "paged_attention_bf16: bf16 only");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2) && out.is_contiguous() &&
                  k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 4 && out.sizes() == q.sizes(),
              "paged_attention_bf16: contiguous heads of q, contiguous out and caches");
  TORCH_CHECK(query_start_loc.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  block_tables.scalar_type() == at::kInt && seqs.scalar_type() == at::kLong &&
                  block_tables.is_contiguous() && seqs.is_contiguous(),
              "paged_attention_bf16: int32 metadata, int64 seqs, contiguous");
  const int64_t H = q.size(1), D = q.size(2), block_size = k_cache.size(1), KVH = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && (D == 64 || D == 128 || D == 32 || D == 256) && H % KVH == 0,
              "paged_attention_bf16: head_dim 32, 64, 128 or 256, whole GQA groups");
  const int64_t max_blocks = block_tables.size(1), S = seqs.numel();
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t* sp = seqs.data_ptr<int64_t>();
  check_rows(qsl, lens, sp, S, block_size, max_blocks, std::numeric_limits<int64_t>::max(), "paged_attention_bf16");
  TORCH_CHECK(window >= 0, "paged_attention_bf16: window ", window, " must be >= 0 (0 = none)");
  agentrt::paged_attention_bf16(ptr<bf16>(q), q.stride(0), ptr<bf16>(out), ptr<bf16>(k_cache), ptr<bf16>(v_cache),
                                   qsl, lens, block_tables.data_ptr<int32_t>(), max_blocks, sp, S, H, KVH, D,
                                   block_size, static_cast<float>(scale), invariant, window);
#else
  TORCH_CHECK(false, "paged_attention_bf16: needs the avx512_bf16 build, this is ", agentrt::compiled_isa());
#endif
}

void check_norm(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && is_float_or_bf16(x) && x.is_contiguous() && w.scalar_type() == x.scalar_type() &&
                  w.is_contiguous() && w.numel() == x.size(1),
              "rms_norm: x [T, hidden] and weight [hidden], contiguous, both fp32 or both bf16");
}

// y = w * (x / sqrt(mean(x^2) + eps)) per row of x [T, hidden] (HF Llama's RMSNorm).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_norm(x, w);
  at::Tensor y = at::empty_like(x);
  by_dtype(x, "rms_norm", [&](auto tag) {
    using T = decltype(tag);
    agentrt::rms_norm<T>(ptr<T>(x), nullptr, ptr<T>(w), static_cast<float>(eps), ptr<T>(y), nullptr, x.size(0),
                         x.size(1));
  });
  return y;
}

// (rms_norm(x + residual), x + residual): the residual add before each norm of a pre-norm layer.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& w,
                                                double eps) {
  check_norm(x, w);
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type() && residual.is_contiguous(),
              "add_rms_norm: residual like x, contiguous");
  at::Tensor y = at::empty_like(x), sum = at::empty_like(x);
  by_dtype(x, "add_rms_norm", [&](auto tag) {
    using T = decltype(tag);
    agentrt::rms_norm<T>(ptr<T>(x), ptr<T>(residual), ptr<T>(w), static_cast<float>(eps), ptr<T>(y), ptr<T>(sum),
                         x.size(0), x.size(1));
  });
  return {y, sum};
}

// silu(x[:, :I]) * x[:, I:] for x [T, 2I] -> [T, I].
at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && is_float_or_bf16(x) && x.is_contiguous() && x.size(1) % 2 == 0,
              "silu_and_mul: x [T, 2I] contiguous fp32 or bf16");
  const int64_t T = x.size(0), I = x.size(1) / 2;
  at::Tensor y = at::empty({T, I}, x.options());
  by_dtype(x, "silu_and_mul", [&](auto tag) {
    using E = decltype(tag);
    agentrt::silu_and_mul<E>(ptr<E>(x), ptr<E>(y), T, I);
  });
  return y;
}

// The inputs of rope_store_kv (see there).
void check_rope(const at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos_sin, const at::Tensor& k_cache,
                const at::Tensor& v_cache, const at::Tensor& slot_mapping, int64_t num_heads) {
  TORCH_CHECK(qkv.dim() == 2 && is_float_or_bf16(qkv) && qkv.stride(1) == 1 &&
                  k_cache.scalar_type() == qkv.scalar_type() && v_cache.scalar_type() == qkv.scalar_type() &&
                  k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.is_contiguous() &&
                  v_cache.is_contiguous(),
              "rope_store_kv: qkv [T, (H + 2 KVH) * D] and contiguous caches [blocks, block_size, KVH, D] of one dtype");
  const int64_t T = qkv.size(0), KVH = k_cache.size(2), D = k_cache.size(3), H = num_heads;
  TORCH_CHECK(qkv.size(1) == (H + 2 * KVH) * D && D % 8 == 0, "rope_store_kv: qkv width ", qkv.size(1),
              " != (", H, " + 2 * ", KVH, ") * ", D, ", or head_dim not a multiple of 8");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.numel() == T &&
                  slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() && slot_mapping.numel() == T,
              "rope_store_kv: positions and slot_mapping [T] int64");
  TORCH_CHECK(cos_sin.scalar_type() == at::kFloat && cos_sin.is_contiguous() && cos_sin.dim() == 3 &&
                  cos_sin.size(1) * 2 == D && cos_sin.size(2) == 2,
              "rope_store_kv: cos_sin [positions, D / 2, 2] fp32");
  const int64_t *pos = positions.data_ptr<int64_t>(), *slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos_sin.size(0), "rope_store_kv: position ", pos[t], " outside the table");
    TORCH_CHECK(slots[t] < k_cache.size(0) * k_cache.size(1), "rope_store_kv: slot ", slots[t], " outside the cache");
  }
}

// qkv [T, (H + 2 KVH) * D] (unit stride along the row), positions [T] int64, cos_sin [P, D / 2, 2] fp32,
// caches [num_blocks, block_size, KVH, D] contiguous, slot_mapping [T] int64 -> rotated q [T, H, D].
at::Tensor rope_store_kv(const at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos_sin,
                         at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slot_mapping, int64_t num_heads) {
  check_rope(qkv, positions, cos_sin, k_cache, v_cache, slot_mapping, num_heads);
  const int64_t T = qkv.size(0), KVH = k_cache.size(2), D = k_cache.size(3), H = num_heads;
  const int64_t *pos = positions.data_ptr<int64_t>(), *slots = slot_mapping.data_ptr<int64_t>();
  at::Tensor q = at::empty({T, H, D}, qkv.options());
  by_dtype(qkv, "rope_store_kv", [&](auto tag) {
    using E = decltype(tag);
    agentrt::rope_store_kv<E>(ptr<E>(qkv), qkv.stride(0), pos, cos_sin.data_ptr<float>(), ptr<E>(q), ptr<E>(k_cache),
                              ptr<E>(v_cache), slots, T, H, KVH, D);
  });
  return q;
}

// A projection kept in GGUF blocks (kernels.quant): its row parts, each in one format (a fused q/k/v may hold
// q and k in Q4_K and v in Q6_K).
struct QuantPart {
  const uint8_t* w;
  int64_t type, rows;
};

// decode_forward's projections of one kind (K inputs, N outputs) of every layer from the flat list `parts` (each
// layer's parts in row order, their rows adding up to N) and their ggml types from types[next...]; next advances.
std::vector<std::vector<QuantPart>> quant_projections(at::TensorList parts, at::IntArrayRef types, size_t& next,
                                                      int64_t layers, int64_t K, int64_t N, const char* what) {
  std::vector<std::vector<QuantPart>> out(layers);
  size_t p = 0;
  for (int64_t i = 0; i < layers; ++i) {
    int64_t rows = 0;
    while (rows < N) {
      TORCH_CHECK(p < parts.size() && next < types.size(), "decode_forward: the packed ", what, " parts of layer ", i,
                  " cover ", rows, " of its ", N, " rows");
      const at::Tensor& w = parts[p++];
      const int64_t type = types[next++], n = w.dim() == 2 ? w.size(0) : -1;
      int64_t block = 0, bytes = 0;
      TORCH_CHECK(n > 0 && rows + n <= N, "decode_forward: a packed ", what, " part of layer ", i, " has ", n,
                  " rows past the projection's ", N);
      check_quant(w, type, n, K, "decode_forward", block, bytes);
      out[i].push_back({w.data_ptr<uint8_t>(), type, n});
      rows += n;
    }
  }
  TORCH_CHECK(p == parts.size(), "decode_forward: ", parts.size() - p, " packed ", what, " parts past the last layer");
  return out;
}

// The decoder layers of a decode step in one call (every op above, no Python between them): x [T, hidden]
// embeddings of T rows, sequences of 1-16 rows each; per layer the input norm, packed weights (fp32:
// [N / 16, K, 16]; bf16: [N / 32, K / 2, 32, 2] with fp32 biases), post-attention norm; kv_cache
// [layers, 2, blocks, block_size, KVH, D]. Returns the residual stream after the last layer (before
// the final norm), the same numbers as the module-by-module path. The threads run all layers as one
// team (team.h): the projections and attention split across them, norms, RoPE and SiLU on the first
// thread, a spin barrier between dependent phases instead of an OpenMP fork and join per op.
at::Tensor decode_forward(const at::Tensor& x, at::TensorList input_norms, at::TensorList qkv,
                          const c10::List<std::optional<at::Tensor>>& qkv_bias, at::TensorList o_proj,
                          at::TensorList post_norms, at::TensorList gate_up, at::TensorList down,
                          at::TensorList qk_norms, at::Tensor& kv_cache, const at::Tensor& positions,
                          const at::Tensor& slot_mapping, const at::Tensor& cos_sin,
                          const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                          const at::Tensor& block_tables, int64_t num_heads, int64_t intermediate, double eps,
                          double scale, bool invariant, at::IntArrayRef quant_types) {
  const int64_t layers = input_norms.size();
  // quant_types empty: one packed bf16 / fp32 weight per layer in each list; else the lists hold GGUF block parts
  // (quant_projections) with their types in quant_types, qkv's then o_proj's, gate_up's, down's.
  const bool quant = !quant_types.empty();
  TORCH_CHECK(qkv_bias.size() == layers && post_norms.size() == layers &&
                  (quant || (qkv.size() == layers && o_proj.size() == layers && gate_up.size() == layers &&
                             down.size() == layers)) &&
                  kv_cache.dim() == 6 && kv_cache.size(0) == layers && kv_cache.size(1) == 2 && layers >= 1,
              "decode_forward: one weight of each kind per layer (at least one layer) and kv_cache "
              "[layers, 2, blocks, block_size, KVH, D]");
  TORCH_CHECK(x.dim() == 2 && is_float_or_bf16(x) && x.is_contiguous() && kv_cache.scalar_type() == x.scalar_type() &&
                  kv_cache.is_contiguous(),
              "decode_forward: x [T, hidden] contiguous and a contiguous kv_cache, both fp32 or both bf16");
  const bool bf = x.scalar_type() == at::kBFloat16;
  const int64_t T = x.size(0), hidden = x.size(1), H = num_heads, KVH = kv_cache.size(4), D = kv_cache.size(5);
  const int64_t qkv_n = (H + 2 * KVH) * D, block_size = kv_cache.size(3);
  TORCH_CHECK((D == 64 || D == 128 || D == 32 || D == 256) && H >= 1 && H % KVH == 0 && H <= agentrt::kMaxHeads,
              "decode_forward: head_dim 32, 64, 128 or 256, whole GQA groups, at most ", agentrt::kMaxHeads, " heads");
  // every check before the team starts: nothing may throw inside it
  std::vector<const float*> biases(layers);
  std::vector<std::vector<QuantPart>> q_qkv, q_o, q_gu, q_down;
  if (quant) {
#if defined(__AVX512BF16__)
    TORCH_CHECK(bf, "decode_forward: GGUF block weights take bf16 rows");
#else
    TORCH_CHECK(false, "decode_forward: GGUF block weights need the AVX512-BF16 build (this one is ", isa(), ")");
#endif
    size_t next = 0;
    q_qkv = quant_projections(qkv, quant_types, next, layers, hidden, qkv_n, "qkv");
    q_o = quant_projections(o_proj, quant_types, next, layers, H * D, hidden, "o_proj");
    q_gu = quant_projections(gate_up, quant_types, next, layers, hidden, 2 * intermediate, "gate_up");
    q_down = quant_projections(down, quant_types, next, layers, intermediate, hidden, "down");
    TORCH_CHECK(next == quant_types.size(), "decode_forward: ", quant_types.size() - next, " quant types past the parts");
  }
  for (int64_t i = 0; i < layers; ++i) {
    check_norm(x, input_norms[i]);
    check_norm(x, post_norms[i]);
    if (quant) {
      const std::optional<at::Tensor>& b = qkv_bias.get(i);
      const bool has = b.has_value() && b->defined();
      TORCH_CHECK(!has || (b->scalar_type() == at::kFloat && b->is_contiguous() && b->numel() == qkv_n),
                  "decode_forward: a qkv bias of packed weights is fp32 [", qkv_n, "]");
      biases[i] = has ? b->data_ptr<float>() : nullptr;
      continue;
    }
    biases[i] = check_packed(qkv[i], qkv_bias.get(i), hidden, qkv_n, bf);
    check_packed(o_proj[i], std::nullopt, H * D, hidden, bf);
    check_packed(gate_up[i], std::nullopt, hidden, 2 * intermediate, bf);
    check_packed(down[i], std::nullopt, intermediate, hidden, bf);
  }
  TORCH_CHECK(qk_norms.empty() || static_cast<int64_t>(qk_norms.size()) == 2 * layers,
              "decode_forward: qk_norms is empty or each layer's q norm and k norm, got ", qk_norms.size());
  for (const at::Tensor& w : qk_norms)
    TORCH_CHECK(w.scalar_type() == x.scalar_type() && w.is_contiguous() && w.numel() == D,
                "decode_forward: q and k norm weights [head_dim] contiguous, of x's dtype");
  const auto opts = x.options();
  at::Tensor qkv_out = at::empty({T, qkv_n}, opts), q = at::empty({T, H, D}, opts), attn = at::empty({T, H, D}, opts);
  at::Tensor o_out = at::empty({T, hidden}, opts), normed = at::empty({T, hidden}, opts);
  at::Tensor residual = at::empty({T, hidden}, opts), h = at::empty({T, hidden}, opts);
  at::Tensor gu = at::empty({T, 2 * intermediate}, opts), act = at::empty({T, intermediate}, opts);
  const at::Tensor k0 = kv_cache.select(0, 0).select(0, 0), v0 = kv_cache.select(0, 0).select(0, 1);
  check_rope(qkv_out, positions, cos_sin, k0, v0, slot_mapping, H);
  TORCH_CHECK(query_start_loc.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  block_tables.scalar_type() == at::kInt && query_start_loc.is_contiguous() && seq_lens.is_contiguous() &&
                  block_tables.is_contiguous() && query_start_loc.numel() == seq_lens.numel() + 1 &&
                  block_tables.size(0) == seq_lens.numel(),
              "decode_forward: int32 metadata, contiguous: query_start_loc [B + 1], seq_lens [B], block_tables [B, W]");
  std::vector<int64_t> seqs;  // sequences with query rows (a batch may hold some without)
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t max_blocks = block_tables.size(1);
  for (int64_t b = 0; b < seq_lens.size(0); ++b)
    if (qsl[b + 1] > qsl[b]) seqs.push_back(b);
  TORCH_CHECK(qsl[0] == 0 && qsl[seq_lens.size(0)] == T, "decode_forward: query_start_loc must run from 0 to ", T);
#if defined(__AVX512BF16__)
  const int64_t max_rows = bf ? std::numeric_limits<int64_t>::max() : agentrt::kMaxQueryRows;
#else
  const int64_t max_rows = agentrt::kMaxQueryRows;
#endif
  check_rows(qsl, lens, seqs.data(), seqs.size(), block_size, max_blocks, max_rows, "decode_forward");
  for (int64_t b : seqs)
    for (int64_t j = 0; j < (lens[b] + block_size - 1) / block_size; ++j)
      TORCH_CHECK(tables[b * max_blocks + j] >= 0 && tables[b * max_blocks + j] < kv_cache.size(2),
                  "decode_forward: sequence ", b, " block ", j, " is ", tables[b * max_blocks + j]);
  // Few short sequences: attention waits on memory latency, not bandwidth. Their K and V of a layer
  // (at most ~512 KB) are fetched before its qkv projection; from 64 KB on each thread a share of
  // every sequence's blocks in order: the share its attention items read when a sequence's positions
  // are split across the threads (below, the first thread fetches all: attention runs on one thread
  // there). Prefetch hints alone do not keep them: the lines prefetched (t0 or t2) are gone by the
  // time attention reads them, after the qkv projection's weights streamed through L2, while lines
  // the thread has loaded stay. So each line is prefetched to L2 (t2: the misses overlap) and then
  // loaded. Per token at 300 positions, one A/B of decode_forward builds in one process: bf16 fetch +
  // attention 0.92 -> 0.79 ms (decode_forward 5.80 -> 5.68 ms p10), fp32 1.41 -> 1.36 ms.
  const int64_t block_bytes = block_size * KVH * D * kv_cache.element_size();
  int64_t kv_bytes = 0;
  for (int64_t b : seqs) kv_bytes += 2 * ((lens[b] + block_size - 1) / block_size) * block_bytes;
  by_dtype(x, "decode_forward", [&](auto tag) {
    using E = decltype(tag);
    const E *xp = ptr<E>(x);
    E *qkvp = ptr<E>(qkv_out), *qp = ptr<E>(q), *attnp = ptr<E>(attn), *op = ptr<E>(o_out), *np = ptr<E>(normed);
    E *resp = ptr<E>(residual), *hp = ptr<E>(h), *gup = ptr<E>(gu), *actp = ptr<E>(act);
    const int64_t* pos = positions.data_ptr<int64_t>();
    const int64_t* slots = slot_mapping.data_ptr<int64_t>();
    const float* cs = cos_sin.data_ptr<float>();
    const float feps = static_cast<float>(eps), fscale = static_cast<float>(scale);
    // layer i's projection: `lists` (packed bf16 / fp32) or `parts` (GGUF blocks, one call per part)
    auto linear = [&](const E* in, int64_t K, at::TensorList lists, const std::vector<std::vector<QuantPart>>& parts,
                      int64_t i, const float* bias, E* out, int64_t N) {
      if constexpr (std::is_same_v<E, float>) {
        agentrt::packed_linear_f32(in, T, K, lists[i].data_ptr<float>(), bias, out, N);
      } else {
        if (!quant) {
          agentrt::packed_linear_bf16(in, T, K, ptr<bf16>(lists[i]), bias, out, N);
          return;
        }
#if defined(__AVX512BF16__)
        int64_t r0 = 0;
        for (const QuantPart& p : parts[i]) {
          agentrt::by_quant_type(p.type, [&](auto f) {
            agentrt::quant_linear_bf16<decltype(f)>(in, T, K, p.w, bias ? bias + r0 : nullptr, out + r0, p.rows, N,
                                                    invariant);
          });
          r0 += p.rows;
        }
#endif
      }
    };
    agentrt::run_team([&] {
      const agentrt::TeamSeat seat = agentrt::seat();
      const int64_t threads = seat.team ? seat.team->size() : 1;
      int loaded = 0;  // the K/V lines' loads (volatile: kept)
      for (int64_t i = 0; i < layers; ++i) {
        E* kc = ptr<E>(kv_cache) + (i * 2) * kv_cache.stride(1);
        E* vc = kc + kv_cache.stride(1);
        if (kv_bytes <= (512 << 10)) {  // this thread's share of the layer's K/V, into its cache
          const int64_t share = kv_bytes >= (64 << 10) ? threads : 1, t = seat.id;
          const char *kb = reinterpret_cast<const char*>(kc), *vb = reinterpret_cast<const char*>(vc);
          if (t < share)
            for (int64_t b : seqs) {
              const int64_t blocks = (lens[b] + block_size - 1) / block_size;
              for (int64_t j = blocks * t / share; j < blocks * (t + 1) / share; ++j) {
                const int64_t off = (int64_t)tables[b * max_blocks + j] * block_bytes;
                for (int64_t c = 0; c < block_bytes; c += 64) {
                  __builtin_prefetch(kb + off + c, 0, 1);
                  __builtin_prefetch(vb + off + c, 0, 1);
                }
                for (int64_t c = 0; c < block_bytes; c += 64) {
                  loaded += *reinterpret_cast<const volatile char*>(kb + off + c);
                  loaded += *reinterpret_cast<const volatile char*>(vb + off + c);
                }
              }
            }
        }
        agentrt::single([&] {
          const E* in = i == 0 ? xp : hp;
          agentrt::rms_norm<E>(in, i == 0 ? nullptr : resp, ptr<E>(input_norms[i]), feps, np, i == 0 ? nullptr : resp,
                               T, hidden);
          if (i == 0) std::copy(xp, xp + T * hidden, resp);
        });
        linear(np, hidden, qkv, q_qkv, i, biases[i], qkvp, qkv_n);
        agentrt::single([&] {
          if (!qk_norms.empty())
            agentrt::qk_head_norms<E>(qkvp, qkv_n, ptr<E>(qk_norms[2 * i]), ptr<E>(qk_norms[2 * i + 1]), feps, T, H,
                                      KVH, D);
          agentrt::rope_store_kv<E>(qkvp, qkv_n, pos, cs, qp, kc, vc, slots, T, H, KVH, D);
        });
#if defined(__AVX512BF16__)
        if constexpr (std::is_same_v<E, bf16>) {
          agentrt::paged_attention_bf16(qp, H * D, attnp, kc, vc, qsl, lens, tables, max_blocks, seqs.data(),
                                        seqs.size(), H, KVH, D, block_size, fscale, invariant);
        } else {
          agentrt::paged_attention_small_q<E>(qp, H * D, attnp, kc, vc, qsl, lens, tables, max_blocks, seqs.data(),
                                              seqs.size(), H, KVH, D, block_size, fscale, invariant);
        }
#else
        agentrt::paged_attention_small_q<E>(qp, H * D, attnp, kc, vc, qsl, lens, tables, max_blocks, seqs.data(),
                                            seqs.size(), H, KVH, D, block_size, fscale, invariant);
#endif
        linear(attnp, H * D, o_proj, q_o, i, nullptr, op, hidden);
        agentrt::single([&] {
          agentrt::rms_norm<E>(op, resp, ptr<E>(post_norms[i]), feps, np, resp, T, hidden);
        });
        linear(np, hidden, gate_up, q_gu, i, nullptr, gup, 2 * intermediate);
        agentrt::single([&] { agentrt::silu_and_mul<E>(gup, actp, T, intermediate); });
        linear(actp, intermediate, down, q_down, i, nullptr, hp, hidden);
      }
    });
  });
  return h + residual;
}

// Per row of logits [R, V] (fp32 or bf16), the index of its largest by torch.argmax's rule -> [R] int64;
// rows split over at::parallel_for's threads.
at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && is_float_or_bf16(logits) && logits.is_contiguous() && logits.size(1) >= 1,
              "argmax_rows: logits [R, V] contiguous fp32 or bf16, V >= 1");
  const int64_t R = logits.size(0), V = logits.size(1);
  at::Tensor out = at::empty({R}, logits.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  by_dtype(logits, "argmax_rows", [&](auto tag) {
    using T = decltype(tag);
    const T* lp = ptr<T>(logits);
    at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) o[r] = agentrt::argmax_row<T>(lp + r * V, V);
    });
  });
  return out;
}

// The k best of each row of x [R, V] fp32, best first (sampler.h's order: NaN first, ties to the lower
// index) -> (values [R, k] fp32, indices [R, k] int64); rows split over at::parallel_for's threads.
std::tuple<at::Tensor, at::Tensor> topk_rows(const at::Tensor& x, int64_t k) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "topk_rows: x [R, V] contiguous fp32, got ", x.sizes(), " ", x.scalar_type());
  const int64_t R = x.size(0), V = x.size(1);
  TORCH_CHECK(k >= 1 && k <= V, "topk_rows: k must be in [1, ", V, "], got ", k);
  at::Tensor vals = at::empty({R, k}, x.options()), idx = at::empty({R, k}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  float* vp = vals.data_ptr<float>();
  int64_t* ip = idx.data_ptr<int64_t>();
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    std::vector<uint64_t> buf;
    for (int64_t r = r0; r < r1; ++r) agentrt::topk_row(xp + r * V, V, k, buf, vp + r * k, ip + r * k);
  });
  return {vals, idx};
}

// log(sum(exp(row))) of each row of x [R, V] fp32 -> [R] fp32 (torch.logsumexp(x, dim=-1)'s rule).
at::Tensor logsumexp_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(1) >= 1,
              "logsumexp_rows: x [R, V] contiguous fp32, V >= 1, got ", x.sizes(), " ", x.scalar_type());
  const int64_t R = x.size(0), V = x.size(1);
  at::Tensor out = at::empty({R}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) op[r] = agentrt::logsumexp_row(xp + r * V, V);
  });
  return out;
}

// Penalties of rows of logits [B, V] fp32, in place (sampler.h penalize_row): row rows[i] from
// histories[i] ([L] int64: prompt, then output; its first num_prompt[i] ids the prompt) with
// repetition[i], frequency[i], presence[i].
void penalize_rows(at::Tensor& logits, at::IntArrayRef rows, at::TensorList histories, at::IntArrayRef num_prompt,
                   at::ArrayRef<double> repetition, at::ArrayRef<double> frequency, at::ArrayRef<double> presence) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous() && logits.size(1) >= 1,
              "penalize_rows: logits [B, V] contiguous fp32, got ", logits.sizes(), " ", logits.scalar_type());
  const int64_t R = static_cast<int64_t>(rows.size()), B = logits.size(0), V = logits.size(1);
  TORCH_CHECK(static_cast<int64_t>(histories.size()) == R && static_cast<int64_t>(num_prompt.size()) == R &&
                  static_cast<int64_t>(repetition.size()) == R && static_cast<int64_t>(frequency.size()) == R &&
                  static_cast<int64_t>(presence.size()) == R,
              "penalize_rows: one history, num_prompt and penalty of each kind per row");
  for (int64_t i = 0; i < R; ++i) {
    TORCH_CHECK(rows[i] >= 0 && rows[i] < B, "penalize_rows: row ", rows[i], " outside [0, ", B, ")");
    const at::Tensor& h = histories[i];
    TORCH_CHECK(h.dim() == 1 && h.scalar_type() == at::kLong && h.is_contiguous() && h.device().is_cpu(),
                "penalize_rows: histories are 1-D contiguous int64 CPU tensors");
  }
  std::vector<uint8_t> seen(V, 0);
  std::vector<int32_t> count(V, 0), touched;
  float* lp = logits.data_ptr<float>();
  for (int64_t i = 0; i < R; ++i) {
    const at::Tensor& h = histories[i];
    agentrt::penalize_row(lp + rows[i] * V, V, h.data_ptr<int64_t>(), h.numel(), num_prompt[i],
                          static_cast<float>(repetition[i]), frequency[i], presence[i], seen, count, touched);
  }
}

// Greedy decode of R sequences of one row each, up to `steps` steps in one call (the runner's
// multi-step decode): each step embeds the rows' tokens, runs decode_forward, the final norm and the
// LM head (packed, no bias), and takes each row's argmax (torch.argmax's rule) as its next token at
// the next position; no Python in between. A row is done at its first token among its stop_ids
// (row of [R, S] int64, -1 = none); the call ends once every row is done, or after `steps`.
// block_tables [R, W] int32 (-1 = no block) must hold every position from positions[r] to
// positions[r] + steps - 1. Returns (tokens [R, steps] int64, counts [R] int64: each row's tokens up
// to and including its stop; the tokens after it are the steps the other rows still needed).
std::tuple<at::Tensor, at::Tensor> decode_steps(
    const at::Tensor& input_ids, const at::Tensor& embed, at::TensorList input_norms, at::TensorList qkv,
    const c10::List<std::optional<at::Tensor>>& qkv_bias, at::TensorList o_proj, at::TensorList post_norms,
    at::TensorList gate_up, at::TensorList down, at::TensorList qk_norms, at::Tensor& kv_cache,
    const at::Tensor& positions, const at::Tensor& cos_sin, const at::Tensor& block_tables, const at::Tensor& final_norm,
    const at::Tensor& lm_head, int64_t vocab, const at::Tensor& stop_ids, int64_t steps, int64_t num_heads,
    int64_t intermediate, double eps, double scale, bool invariant, at::IntArrayRef quant_types) {
  const int64_t R = input_ids.numel();
  // quant_types non-empty: decode_forward's (the layers' GGUF block parts), then the embedding's and the LM head's
  // ggml types, 0 where that one is widened (bf16 / fp32, packed as above)
  TORCH_CHECK(quant_types.empty() || quant_types.size() >= 2, "decode_steps: quant_types ends with the embedding's "
              "and the LM head's types");
  const at::IntArrayRef layer_types = quant_types.empty() ? quant_types : quant_types.slice(0, quant_types.size() - 2);
  const int64_t embed_type = quant_types.empty() ? 0 : quant_types[quant_types.size() - 2];
  const int64_t head_type = quant_types.empty() ? 0 : quant_types.back();
  const int64_t hidden = input_norms.empty() ? 0 : input_norms[0].numel();
  int64_t block = 0, bytes = 0;
  if (embed_type) check_quant(embed, embed_type, embed.size(0), hidden, "decode_steps (embedding)", block, bytes);
  if (head_type) check_quant(lm_head, head_type, vocab, hidden, "decode_steps (LM head)", block, bytes);
  TORCH_CHECK(steps >= 1, "decode_steps: steps must be >= 1, got ", steps);
  TORCH_CHECK(input_ids.scalar_type() == at::kLong && input_ids.dim() == 1 && R >= 1 &&
                  positions.scalar_type() == at::kLong && positions.sizes() == input_ids.sizes(),
              "decode_steps: input_ids and positions [R] int64, R >= 1");
  TORCH_CHECK(embed.dim() == 2 && (embed_type || embed.scalar_type() == kv_cache.scalar_type()) && embed.is_contiguous() &&
                  kv_cache.dim() == 6,
              "decode_steps: embed [vocab, hidden] contiguous, of the cache's dtype; kv_cache 6-D");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 && block_tables.size(0) == R &&
                  block_tables.is_contiguous(),
              "decode_steps: block_tables [R, W] int32 contiguous");
  TORCH_CHECK(stop_ids.scalar_type() == at::kLong && stop_ids.dim() == 2 && stop_ids.size(0) == R &&
                  stop_ids.is_contiguous(),
              "decode_steps: stop_ids [R, S] int64 contiguous");
  const int64_t bs = kv_cache.size(3), width = block_tables.size(1), num_blocks = kv_cache.size(2);
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const at::Tensor ids0 = input_ids.contiguous(), pos0 = positions.contiguous();
  for (int64_t r = 0; r < R; ++r) {
    const int64_t id = ids0.data_ptr<int64_t>()[r], first = pos0.data_ptr<int64_t>()[r];
    TORCH_CHECK(id >= 0 && id < embed.size(0), "decode_steps: token id ", id, " outside the vocabulary");
    TORCH_CHECK(first >= 0 && (first + steps - 1) / bs < width, "decode_steps: row ", r, " at position ", first,
                " has no block table entry for ", steps, " steps");
    for (int64_t p = first; p < first + steps; ++p) {
      const int32_t b = tables[r * width + p / bs];
      TORCH_CHECK(b >= 0 && b < num_blocks, "decode_steps: row ", r, " position ", p, " maps to block ", b,
                  " (cache of ", num_blocks, " blocks)");
    }
  }
  const auto long_opts = input_ids.options().dtype(at::kLong);
  at::Tensor ids = ids0.clone(), pos = pos0.clone(), slots = at::empty({R}, long_opts);
  at::Tensor qsl = at::arange(R + 1, long_opts.dtype(at::kInt)), seq_lens = at::empty({R}, long_opts.dtype(at::kInt));
  at::Tensor tokens = at::zeros({R, steps}, long_opts), counts = at::full({R}, steps, long_opts);
  int64_t *idp = ids.data_ptr<int64_t>(), *posp = pos.data_ptr<int64_t>(), *slotp = slots.data_ptr<int64_t>();
  int64_t *tokp = tokens.data_ptr<int64_t>(), *countp = counts.data_ptr<int64_t>();
  int32_t* lenp = seq_lens.data_ptr<int32_t>();
  const int64_t* stops = stop_ids.data_ptr<int64_t>();
  const int64_t S = stop_ids.size(1);
  const bool bf = kv_cache.scalar_type() == at::kBFloat16;
  std::vector<char> done(R, 0);
  int64_t remaining = R;
  for (int64_t j = 0; j < steps && remaining; ++j) {
    for (int64_t r = 0; r < R; ++r) {
      slotp[r] = (int64_t)tables[r * width + posp[r] / bs] * bs + posp[r] % bs;
      lenp[r] = static_cast<int32_t>(posp[r] + 1);
    }
    const at::Tensor x = embed_type ? quant_dequantize(embed.index_select(0, ids), embed_type, R, hidden)
                                          .to(kv_cache.scalar_type())
                                    : embed.index_select(0, ids);
    const at::Tensor h = decode_forward(x, input_norms, qkv, qkv_bias, o_proj, post_norms, gate_up, down, qk_norms,
                                        kv_cache, pos, slots, cos_sin, qsl, seq_lens, block_tables, num_heads, intermediate,
                                        eps, scale, invariant, layer_types);
    const at::Tensor normed = rms_norm(h, final_norm, eps);
    const at::Tensor logits = head_type ? quant_linear(normed, lm_head, head_type, vocab, std::nullopt, invariant)
                              : bf      ? packed_linear_bf16(normed, lm_head, std::nullopt, vocab, invariant)
                                        : packed_linear(normed, lm_head, std::nullopt, vocab);
    const at::Tensor next = argmax_rows(logits);
    const int64_t* best = next.data_ptr<int64_t>();
    for (int64_t r = 0; r < R; ++r) {
      const int64_t t = best[r];
      tokp[r * steps + j] = idp[r] = t;
      posp[r] += 1;
      if (done[r]) continue;
      for (int64_t s = 0; s < S; ++s)
        if (stops[r * S + s] == t) {
          done[r] = 1;
          countp[r] = j + 1;
          --remaining;
          break;
        }
    }
  }
  return {tokens, counts};
}

}  // namespace

#define AGENTRT_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define AGENTRT_LIBRARY_IMPL(ns, k, m) TORCH_LIBRARY_IMPL(ns, k, m)

AGENTRT_LIBRARY(AGENTRT_NS, m) {
  m.def("isa() -> str", &isa);
  m.def("amx() -> bool", &amx);
  m.def("argmax_rows(Tensor logits) -> Tensor");
  m.def("topk_rows(Tensor x, int k) -> (Tensor, Tensor)");
  m.def("logsumexp_rows(Tensor x) -> Tensor");
  m.def(
      "penalize_rows(Tensor(a!) logits, int[] rows, Tensor[] histories, int[] num_prompt, float[] repetition, "
      "float[] frequency, float[] presence) -> ()");
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor w, float eps) -> (Tensor, Tensor)");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("packed_linear(Tensor x, Tensor w_packed, Tensor? bias, int N) -> Tensor");
  m.def("packed_linear_bf16(Tensor x, Tensor w_packed, Tensor? bias, int N, bool invariant=False) -> Tensor");
  m.def("grouped_linear(Tensor x, Tensor offsets, Tensor w_packed, Tensor? bias, int N) -> Tensor");
  m.def("grouped_quant_linear(Tensor x, Tensor offsets, Tensor w, int type, int N, Tensor? bias=None) -> Tensor");
  m.def("quant_linear(Tensor x, Tensor w, int type, int N, Tensor? bias=None, bool invariant=False) -> Tensor");
  m.def("quant_dequantize(Tensor w, int type, int N, int K) -> Tensor");
  m.def(
      "paged_attention_small_q(Tensor q, Tensor k_cache, Tensor v_cache, Tensor query_start_loc, Tensor seq_lens, "
      "Tensor block_tables, Tensor seqs, float scale, Tensor(a!) out, bool invariant=False, int window=0, "
      "Tensor? sinks=None, float softcap=0.0) -> ()");
  m.def(
      "paged_attention_bf16(Tensor q, Tensor k_cache, Tensor v_cache, Tensor query_start_loc, Tensor seq_lens, "
      "Tensor block_tables, Tensor seqs, float scale, Tensor(a!) out, bool invariant=False, int window=0) -> ()");
  m.def(
      "decode_forward(Tensor x, Tensor[] input_norms, Tensor[] qkv, Tensor?[] qkv_bias, Tensor[] o_proj, "
      "Tensor[] post_norms, Tensor[] gate_up, Tensor[] down, Tensor[] qk_norms, Tensor(a!) kv_cache, "
      "Tensor positions, Tensor slot_mapping, Tensor cos_sin, Tensor query_start_loc, Tensor seq_lens, Tensor block_tables, "
      "int num_heads, int intermediate, float eps, float scale, bool invariant=False, int[] quant_types=[]) -> Tensor");
  m.def(
      "decode_steps(Tensor input_ids, Tensor embed, Tensor[] input_norms, Tensor[] qkv, Tensor?[] qkv_bias, "
      "Tensor[] o_proj, Tensor[] post_norms, Tensor[] gate_up, Tensor[] down, Tensor[] qk_norms, Tensor(a!) kv_cache, "
      "Tensor positions, "
      "Tensor cos_sin, Tensor block_tables, Tensor final_norm, Tensor lm_head, int vocab, Tensor stop_ids, int steps, "
      "int num_heads, int intermediate, float eps, float scale, bool invariant=False, int[] quant_types=[]) -> "
      "(Tensor, Tensor)");
  m.def(
      "rope_store_kv(Tensor qkv, Tensor positions, Tensor cos_sin, Tensor(a!) k_cache, Tensor(b!) v_cache, "
      "Tensor slot_mapping, int num_heads) -> Tensor");
}

AGENTRT_LIBRARY_IMPL(AGENTRT_NS, CPU, m) {
  m.impl("rms_norm", rms_norm);
  m.impl("add_rms_norm", add_rms_norm);
  m.impl("silu_and_mul", silu_and_mul);
  m.impl("packed_linear", packed_linear);
  m.impl("packed_linear_bf16", packed_linear_bf16);
  m.impl("grouped_linear", grouped_linear);
  m.impl("grouped_quant_linear", grouped_quant_linear);
  m.impl("quant_linear", quant_linear);
  m.impl("quant_dequantize", quant_dequantize);
  m.impl("paged_attention_small_q", paged_attention_small_q);
  m.impl("paged_attention_bf16", paged_attention_bf16);
  m.impl("rope_store_kv", rope_store_kv);
  m.impl("decode_forward", decode_forward);
  m.impl("decode_steps", decode_steps);
  m.impl("argmax_rows", argmax_rows);
  m.impl("topk_rows", topk_rows);
  m.impl("logsumexp_rows", logsumexp_rows);
  m.impl("penalize_rows", penalize_rows);
}
