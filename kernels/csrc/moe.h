// Grouped expert projections of a mixture-of-experts layer (kernels/moe.py): the rows of x sorted by expert,
// expert e's rows at offsets[e] .. offsets[e + 1], each times its expert's packed weight. One GEMM per expert
// over its rows, never a pass per row: every (expert with rows, panel) pair is one work item of a single
// parallel loop, so a decode step's few rows per expert still spread over all threads, and each expert's
// weight is streamed once per step however many of the step's tokens chose it. Experts without rows cost
// nothing (their weights are not read).
//
// Weights are the packed panels of linear.h, one block per expert: fp32 [E, ceil(N / 16), K, 16], bf16
// [E, ceil(N / 32), ceil(K / 2), 32, 2]; biases fp32 [E, N]. The per-panel kernels are linear.h's own
// (bf16 on AMX where it applies), so a row's output is what packed_linear gives it with that expert's weight.
//
// Experts kept in a GGUF block format (quant.h: Q8_0, Q4_1, MXFP4, ...): w [E, N, K / B * bytes] uint8, each
// expert's rows as quant_linear takes them. The work items are (expert with rows, 16 weight rows), each run by
// quant_linear's own per-panel code (quant_panel in fp32; qdot_group, 4 groups of 4 rows, for bf16 x on
// AVX512-BF16), so a row's output is bit for bit what quant_linear gives it with that expert's weight in its
// batch-invariant mode (the experts' row groups are small: no widened panels here). MXFP4 experts on a CPU with AMX
// run each (expert, 16 weight rows) item on the tiles instead (quant_bf16.h fold_panel_amx, as quant_linear does for
// MXFP4 there): gpt-oss-20b's shapes, 64 rows an expert, 343 -> 47 ms; a decode step of 8 tokens even. Elsewhere
// a bf16 x is widened to fp32 on entry and its output rounded once, as quant_linear does.

#pragma once

#include <cstdint>
#include <vector>

#include "linear.h"
#include "quant.h"
#include "quant_bf16.h"
#include "team.h"

namespace agentrt {

// The experts that have rows, in expert order.
inline std::vector<int64_t> experts_with_rows(const int64_t* offsets, int64_t E) {
  std::vector<int64_t> used;
  for (int64_t e = 0; e < E; ++e)
    if (offsets[e + 1] > offsets[e]) used.push_back(e);
  return used;
}

// x [M, K] fp32 -> y [M, N] fp32.
inline void grouped_linear_f32(const float* x, const int64_t* offsets, int64_t E, int64_t K, const float* w,
                               const float* bias, float* y, int64_t N) {
  const int64_t panels = (N + kPanel - 1) / kPanel;
  const std::vector<int64_t> used = experts_with_rows(offsets, E);
  agentrt::stealing_for(static_cast<int64_t>(used.size()) * panels, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t e = used[i / panels], p = i % panels, n = p * kPanel, r0 = offsets[e];
      linear_rows_f32(x + r0 * K, K, offsets[e + 1] - r0, K, w + (e * panels + p) * K * kPanel,
                      bias ? bias + e * N + n : nullptr, y + r0 * N + n, N, std::min(kPanel, N - n));
    }
  });
}

// x [M, K] bf16 -> y [M, N] bf16 (fp32 accumulation, rounded once after the bias).
inline void grouped_linear_bf16(const bf16* x, const int64_t* offsets, int64_t E, int64_t M, int64_t K,
                                const bf16* w, const float* bias, bf16* y, int64_t N) {
  const int64_t panels = (N + kPanelBf16 - 1) / kPanelBf16, panel_elems = bf16_panel_elems(K);
  const bool use_amx = amx_linear_applies(K);
  const std::vector<float> xf = use_amx ? std::vector<float>{} : bf16_rows_for_tiles(x, M, K);
  const std::vector<int64_t> used = experts_with_rows(offsets, E);
  agentrt::stealing_for(static_cast<int64_t>(used.size()) * panels, [&](int64_t i0, int64_t i1) {
    Bf16Panels s(use_amx);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t e = used[i / panels], p = i % panels, n = p * kPanelBf16, r0 = offsets[e];
      linear_panel_bf16(x + r0 * K, xf.empty() ? nullptr : xf.data() + r0 * (K + 1), offsets[e + 1] - r0, K,
                        w + (e * panels + p) * panel_elems, bias ? bias + e * N + n : nullptr, y + r0 * N + n, N,
                        std::min(kPanelBf16, N - n), s);
    }
  });
}

// x [M, K] fp32 -> y [M, N] fp32, w [E, N, K / B * bytes] in format F.
template <typename F>
inline void grouped_quant_linear_f32(const float* x, const int64_t* offsets, int64_t E, int64_t K, const uint8_t* w,
                                     const float* bias, float* y, int64_t N) {
  const int64_t row_bytes = K / F::kBlock * F::kBytes, panels = (N + kQuantPanelRows - 1) / kQuantPanelRows;
  const std::vector<int64_t> used = experts_with_rows(offsets, E);
  agentrt::stealing_for(static_cast<int64_t>(used.size()) * panels, [&](int64_t i0, int64_t i1) {
    thread_local std::vector<float> panel;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t e = used[i / panels], n0 = (i % panels) * kQuantPanelRows, r0 = offsets[e];
      quant_panel<F>(x + r0 * K, offsets[e + 1] - r0, K, w + (e * N + n0) * row_bytes, row_bytes,
                     std::min(kQuantPanelRows, N - n0), bias ? bias + e * N + n0 : nullptr, y + r0 * N + n0, N, panel);
    }
  });
}

#if defined(__AVX512BF16__)
// x [M, K] bf16 -> y [M, N] bf16, w [E, N, K / B * bytes] in format F.
template <typename F>
inline void grouped_quant_linear_bf16(const bf16* x, const int64_t* offsets, int64_t E, int64_t M, int64_t K,
                                      const uint8_t* w, const float* bias, bf16* y, int64_t N) {
  constexpr int64_t kGroupsPerItem = 4;  // 16 weight rows, as the fp32 panels
  const int64_t row_bytes = K / F::kBlock * F::kBytes, chunks = K / 32;
  const int64_t items = (N + kQdotCols * kGroupsPerItem - 1) / (kQdotCols * kGroupsPerItem);
  const std::vector<float> sx = offset_sums_bf16<F>(x, M, K);
  const std::vector<int64_t> used = experts_with_rows(offsets, E);
#if defined(AGENTRT_AMX)
  if (fold_amx_applies<F>()) {  // MXFP4 on AMX (quant_bf16.h fold_panel_amx): each expert's rows as B operands
    std::vector<int64_t> at(size_t(E), 0);
    int64_t size = 0;
    for (int64_t e : used) at[e] = size, size += fold_amx_rows_size(offsets[e + 1] - offsets[e], K);
    std::vector<uint32_t> xt(static_cast<size_t>(size));
    for (int64_t e : used) fold_amx_rows(x + offsets[e] * K, offsets[e + 1] - offsets[e], K, xt.data() + at[e]);
    agentrt::stealing_for(static_cast<int64_t>(used.size()) * items, [&](int64_t i0, int64_t i1) {
      FoldAmxTiles tiles;
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t e = used[i / items], r0 = offsets[e], rows = offsets[e + 1] - r0;
        const int64_t n0 = (i % items) * kQdotCols * kGroupsPerItem;
        fold_or_qdot_panel<F>(xt.data() + at[e], x + r0 * K, rows, K, w + (e * N + n0) * row_bytes, row_bytes,
                              std::min<int64_t>(16, N - n0), sx.empty() ? nullptr : sx.data() + r0 * chunks,
                              bias ? bias + e * N + n0 : nullptr, y + r0 * N + n0, N);
      }
    });
    return;
  }
#endif
  agentrt::stealing_for(static_cast<int64_t>(used.size()) * items, [&](int64_t i0, int64_t i1) {
    QdotBuffers& buf = qdot_buffers(K);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t e = used[i / items], r0 = offsets[e], rows = offsets[e + 1] - r0;
      const int64_t first = (i % items) * kQdotCols * kGroupsPerItem;
      for (int64_t n0 = first; n0 < std::min(N, first + kQdotCols * kGroupsPerItem); n0 += kQdotCols)
        qdot_group<F>(x + r0 * K, rows, K, w + (e * N + n0) * row_bytes, row_bytes, std::min(kQdotCols, N - n0),
                      sx.empty() ? nullptr : sx.data() + r0 * chunks, bias ? bias + e * N + n0 : nullptr,
                      y + r0 * N + n0, N, buf);
    }
  });
}
#endif

}  // namespace agentrt
