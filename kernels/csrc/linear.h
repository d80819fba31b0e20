// y[M, N] = x[M, K] @ w[N, K]^T (+ bias) from a copy of the weight packed in panels (kernels/linear.py
// packs it once per weight): for one row a single sequential pass over the weight (what bounds
// decode), for many rows a BLIS-style register-tiled GEMM that keeps a panel in L2 while all row
// tiles pass over it. Threads split the panels (inside a decode step's team, each its share: team.h).
//
// fp32: panels of 16 weight rows, [ceil(N / 16), K, 16]; broadcast x[m, k], two 8-lane FMAs per row
// (the BLIS Haswell micro-kernel shape).
// bf16: panels of 32 weight rows holding k in pairs, [ceil(N / 32), ceil(K / 2), 32, 2]: the layout of
// AVX512-BF16's `vdpbf16ps`, which multiplies 16 pairs of bf16 and adds both products to 16 fp32
// lanes; x[m, k:k+2] is broadcast as one 32-bit pair. Without AVX512-BF16 the same layout is read
// as fp32 (a pair's low half is w[k], its high half w[k + 1]: one shift and one mask), and for many rows
// each panel is widened to fp32 once for the fp32 tiles. Accumulation is fp32 either way; the output is
// rounded to bf16 once, after the bias.

#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "team.h"
#include "vec.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif
#if defined(__AVX512BF16__) && defined(__AMX_BF16__) && defined(__AMX_TILE__)
#include <sys/syscall.h>
#include <unistd.h>
#define AGENTRT_AMX 1
#endif

namespace agentrt {

// -------------------------------------------------------------------------------------------- fp32

constexpr int64_t kPanel = 16;   // output columns (weight rows) per fp32 panel
constexpr int kMaxTileRows = 6;  // rows of x per fp32 register tile: 6 x 16 outputs = 12 accumulators

template <int MR>
inline void linear_tile(const float* x, int64_t ldx, int64_t K, const float* panel, const float* bias, float* y,
                        int64_t ldy, int64_t ncols) {
  v8 c0[MR], c1[MR];
  for (int m = 0; m < MR; ++m) c0[m] = c1[m] = splat(0.f);
#pragma GCC unroll 4
  for (int64_t k = 0; k < K; ++k) {
    const v8 b0 = load8(panel + k * kPanel), b1 = load8(panel + k * kPanel + 8);
    for (int m = 0; m < MR; ++m) {
      const v8 a = splat(x[m * ldx + k]);
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

// All M rows of x (row stride ldx) through one fp32 panel: y[m, 0:ncols] (row stride ldy).
inline void linear_rows_f32(const float* x, int64_t ldx, int64_t M, int64_t K, const float* panel, const float* bias,
                            float* y, int64_t ldy, int64_t ncols) {
  for (int64_t m0 = 0; m0 < M; m0 += kMaxTileRows) {
    const float* xm = x + m0 * ldx;
    float* ym = y + m0 * ldy;
    switch (std::min<int64_t>(kMaxTileRows, M - m0)) {
      case 1: linear_tile<1>(xm, ldx, K, panel, bias, ym, ldy, ncols); break;
      case 2: linear_tile<2>(xm, ldx, K, panel, bias, ym, ldy, ncols); break;
      case 3: linear_tile<3>(xm, ldx, K, panel, bias, ym, ldy, ncols); break;
      case 4: linear_tile<4>(xm, ldx, K, panel, bias, ym, ldy, ncols); break;
      case 5: linear_tile<5>(xm, ldx, K, panel, bias, ym, ldy, ncols); break;
      default: linear_tile<6>(xm, ldx, K, panel, bias, ym, ldy, ncols); break;
    }
  }
}

inline void packed_linear_f32(const float* x, int64_t M, int64_t K, const float* w, const float* bias, float* y,
                              int64_t N) {
  const int64_t panels = (N + kPanel - 1) / kPanel;
  agentrt::stealing_for(panels, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n = p * kPanel;
      linear_rows_f32(x, K, M, K, w + p * K * kPanel, bias ? bias + n : nullptr, y + n, N, std::min(kPanel, N - n));
    }
  });
}

// -------------------------------------------------------------------------------------------- bf16

constexpr int64_t kPanelBf16 = 32;  // output columns per bf16 panel

inline void store_row_bf16(bf16* row, const float* acc, int64_t ncols) {
  for (int64_t j = 0; j < ncols; ++j) row[j] = f32_to_bf16(acc[j]);
}

#if defined(__AVX512BF16__)

// 6 rows x 2 vectors x 2 accumulator sets = 24 of the 32 zmm registers. Every tile, whatever its row count,
// sums a row's k pairs in the same order (even pairs in one set, odd in the other, then the two added):
// a row's output does not depend on how many rows share the call (batch invariance, kernels/linear.py).
constexpr int kMaxTileRowsBf16 = 6;

// A panel's bias (ncols of its 32 columns, zeros past them or without one) as two 16-lane vectors.
inline void load_panel_bias(const float* bias, int64_t ncols, __m512& b0, __m512& b1) {
  float b[kPanelBf16] = {};
  if (bias)
    for (int64_t j = 0; j < ncols; ++j) b[j] = bias[j];
  b0 = _mm512_loadu_ps(b);
  b1 = _mm512_loadu_ps(b + 16);
}

// One output row of a panel (fp32 columns 0-15 in s0, 16-31 in s1) rounded to bf16: its first ncols columns.
inline void store_panel_row_bf16(bf16* row, __m512 s0, __m512 s1, int64_t ncols) {
  if (ncols == kPanelBf16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(row), (__m256i)_mm512_cvtneps_pbh(s0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + 16), (__m256i)_mm512_cvtneps_pbh(s1));
    return;
  }
  float out[kPanelBf16];
  _mm512_storeu_ps(out, s0);
  _mm512_storeu_ps(out + 16, s1);
  store_row_bf16(row, out, ncols);
}

inline int32_t load_pair(const bf16* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// MR rows of x times one panel; KU independent accumulator sets over alternating k pairs (few rows
// would otherwise wait on the dot product's latency); linear_rows_bf16 uses KU = 2 for every tile.
template <int MR, int KU>
inline void linear_tile_bf16(const bf16* x, int64_t K, const bf16* panel, const float* bias, bf16* y, int64_t ldy,
                             int64_t ncols) {
  const int64_t pairs = K / 2;
  __m512 acc[KU][MR][2];
  for (int u = 0; u < KU; ++u)
    for (int m = 0; m < MR; ++m) acc[u][m][0] = acc[u][m][1] = _mm512_setzero_ps();
  int64_t kk = 0;
  for (; kk + KU <= pairs; kk += KU) {
    for (int u = 0; u < KU; ++u) {
      const bf16* wp = panel + (kk + u) * 2 * kPanelBf16;
      const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wp), w1 = (__m512bh)_mm512_loadu_si512(wp + 32);
      for (int m = 0; m < MR; ++m) {
        const __m512bh a = (__m512bh)_mm512_set1_epi32(load_pair(x + m * K + 2 * (kk + u)));
        acc[u][m][0] = _mm512_dpbf16_ps(acc[u][m][0], a, w0);
        acc[u][m][1] = _mm512_dpbf16_ps(acc[u][m][1], a, w1);
      }
    }
  }
  for (; kk < pairs + (K & 1); ++kk) {  // leftover pairs, then a last odd k paired with zero
    const bf16* wp = panel + kk * 2 * kPanelBf16;
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wp), w1 = (__m512bh)_mm512_loadu_si512(wp + 32);
    for (int m = 0; m < MR; ++m) {
      const int32_t pair = kk < pairs ? load_pair(x + m * K + 2 * kk) : int32_t(x[m * K + 2 * kk]);
      const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
      acc[0][m][0] = _mm512_dpbf16_ps(acc[0][m][0], a, w0);
      acc[0][m][1] = _mm512_dpbf16_ps(acc[0][m][1], a, w1);
    }
  }
  __m512 b0, b1;
  load_panel_bias(bias, ncols, b0, b1);
  for (int m = 0; m < MR; ++m) {
    __m512 s0 = acc[0][m][0], s1 = acc[0][m][1];
    for (int u = 1; u < KU; ++u) {
      s0 = _mm512_add_ps(s0, acc[u][m][0]);
      s1 = _mm512_add_ps(s1, acc[u][m][1]);
    }
    store_panel_row_bf16(y + m * ldy, _mm512_add_ps(s0, b0), _mm512_add_ps(s1, b1), ncols);
  }
}

inline void linear_rows_bf16(const bf16* x, int64_t rows, int64_t K, const bf16* panel, const float* bias, bf16* y,
                             int64_t N, int64_t ncols) {
  for (int64_t m0 = 0; m0 < rows; m0 += kMaxTileRowsBf16) {
    const bf16* xm = x + m0 * K;
    bf16* ym = y + m0 * N;
    switch (std::min<int64_t>(kMaxTileRowsBf16, rows - m0)) {
      case 1: linear_tile_bf16<1, 2>(xm, K, panel, bias, ym, N, ncols); break;
      case 2: linear_tile_bf16<2, 2>(xm, K, panel, bias, ym, N, ncols); break;
      case 3: linear_tile_bf16<3, 2>(xm, K, panel, bias, ym, N, ncols); break;
      case 4: linear_tile_bf16<4, 2>(xm, K, panel, bias, ym, N, ncols); break;
      case 5: linear_tile_bf16<5, 2>(xm, K, panel, bias, ym, N, ncols); break;
      default: linear_tile_bf16<6, 2>(xm, K, panel, bias, ym, N, ncols); break;
    }
  }
}

#else  // no AVX512-BF16: read the pair layout as fp32, 8 lanes at a time

constexpr int kMaxTileRowsBf16 = 2;  // 2 rows x 4 vectors = 8 accumulators (16 AVX2 registers)

template <int MR>
inline void linear_tile_bf16(const float* xf, int64_t K, const bf16* panel, const float* bias, bf16* y,
                             int64_t ldy, int64_t ncols) {
  const int64_t pairs = (K + 1) / 2;  // xf holds K + 1 floats per row, the last one zero
  v8 acc[MR][4];
  for (int m = 0; m < MR; ++m)
    for (int c = 0; c < 4; ++c) acc[m][c] = splat(0.f);
  for (int64_t kk = 0; kk < pairs; ++kk) {
    const bf16* wp = panel + kk * 2 * kPanelBf16;
    v8 lo[4], hi[4];
    for (int c = 0; c < 4; ++c) {
      const v8w u = *reinterpret_cast<const v8wu*>(wp + 16 * c);
      lo[c] = (v8)(u << 16);          // w[n, 2kk] of 8 columns
      hi[c] = (v8)(u & 0xffff0000u);  // w[n, 2kk + 1]
    }
    for (int m = 0; m < MR; ++m) {
      const v8 a = splat(xf[m * (K + 1) + 2 * kk]), b = splat(xf[m * (K + 1) + 2 * kk + 1]);
      for (int c = 0; c < 4; ++c) {  // k = 2kk, then 2kk + 1: the order of the widened path's fp32 tiles
        acc[m][c] += a * lo[c];
        acc[m][c] += b * hi[c];
      }
    }
  }
  float bv[kPanelBf16] = {};
  if (bias)
    for (int64_t j = 0; j < ncols; ++j) bv[j] = bias[j];
  for (int m = 0; m < MR; ++m) {
    float out[kPanelBf16];
    for (int c = 0; c < 4; ++c) store8(out + 8 * c, acc[m][c] + load8(bv + 8 * c));
    if (ncols == kPanelBf16) {
      for (int c = 0; c < 4; ++c) store8(y + m * ldy + 8 * c, load8(out + 8 * c));
    } else {
      store_row_bf16(y + m * ldy, out, ncols);
    }
  }
}

// From this many rows a panel is widened to fp32 once and every row runs the fp32 register tiles over it,
// instead of each row pair widening it again. Measured on an AVX2 Zen 3 (projections 1536 x 576 and
// 576 x 1536): row pairs 79-103 GFLOP/s at 4-8 rows where widening gives 53-87, about even at 16, and
// 93 against 117-125 from 32-64 rows on (torch's bf16 GEMM there: 13-20).
constexpr int64_t kWidenMinRows = 16;

// A bf16 panel ([ceil(K / 2), 32, 2]) as two fp32 panels of 16 columns ([2][K][16], the fp32 layout).
inline void widen_panel_bf16(const bf16* panel, int64_t K, float* out) {
  const int64_t pairs = (K + 1) / 2;
  for (int64_t kk = 0; kk < pairs; ++kk) {
    const bf16* wp = panel + kk * 2 * kPanelBf16;
    for (int c = 0; c < 4; ++c) {  // columns 8c .. 8c + 7
      const v8w u = *reinterpret_cast<const v8wu*>(wp + 16 * c);
      float* o = out + (c / 2) * K * kPanel + (c % 2) * 8;
      store8(o + 2 * kk * kPanel, (v8)(u << 16));
      if (2 * kk + 1 < K) store8(o + (2 * kk + 1) * kPanel, (v8)(u & 0xffff0000u));
    }
  }
}

// Rows [M] of xf (fp32, row stride ldx) through a widened panel pair: y[m, 0:ncols] in bf16 (row stride ldy).
inline void linear_rows_widened(const float* xf, int64_t ldx, int64_t M, int64_t K, const bf16* panel,
                                const float* bias, bf16* y, int64_t ldy, int64_t ncols, std::vector<float>& wf,
                                std::vector<float>& yf) {
  wf.resize(2 * K * kPanel);
  yf.resize(M * kPanel);
  widen_panel_bf16(panel, K, wf.data());
  for (int64_t s = 0; s * kPanel < ncols; ++s) {
    const int64_t nc = std::min(kPanel, ncols - s * kPanel);
    linear_rows_f32(xf, ldx, M, K, wf.data() + s * K * kPanel, bias ? bias + s * kPanel : nullptr, yf.data(), kPanel,
                    nc);
    for (int64_t m = 0; m < M; ++m) {
      bf16* row = y + m * ldy + s * kPanel;
      if (nc == kPanel) {
        store8(row, load8(yf.data() + m * kPanel));
        store8(row + 8, load8(yf.data() + m * kPanel + 8));
      } else {
        store_row_bf16(row, yf.data() + m * kPanel, nc);
      }
    }
  }
}

#endif

#if defined(AGENTRT_AMX)
// AMX (Sapphire Rapids on): the same packed panels are the B operand of `tdpbf16ps` as they lie: 16 rows
// of k pairs x 16 columns, 128 bytes apart. Where it applies every bf16 projection the packed kernel runs
// takes this path, decode rows and the LM head included (on a Sapphire Rapids-class Xeon 1.3-5x faster
// than the AVX512-BF16 tiles from 1 to 64 rows: docs/benchmarks/throughput.md), and in batch-invariant mode
// (kernels/linear.py) prefill rows too: each output sums its k pairs 32 at a time in k order, in hardware
// that computes every row alike, so a row's output does not depend on the others in its tile.

// Linux grants the tile data state to a process that asks (arch_prctl ARCH_REQ_XCOMP_PERM, XTILEDATA);
// AGENTRT_CPU_AMX=0 keeps the kernels off AMX (the AVX512-BF16 tiles instead).
inline bool amx_ready() {
  static const bool ok = [] {
    const char* env = std::getenv("AGENTRT_CPU_AMX");
    if (env != nullptr && std::string(env) == "0") return false;
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles of a block of r rows: C 0 and 1 (r x 16 fp32, a panel's two halves), A 2 (r x 32 bf16 of x), B 3
// and 4 (16 k pairs x 16 columns).
inline void amx_configure(int r) {
  TileConfig c;
  for (int t = 0; t < 5; ++t) c.colsb[t] = 64;
  c.rows[0] = c.rows[1] = c.rows[2] = static_cast<uint8_t>(r);
  c.rows[3] = c.rows[4] = 16;
  _tile_loadconfig(&c);
}

// All M rows of x through one panel (K a multiple of 32), 16 rows at a time.
inline void linear_rows_amx(const bf16* x, int64_t M, int64_t K, const bf16* panel, const float* bias, bf16* y,
                            int64_t N, int64_t ncols, int& configured) {
  alignas(64) float c[16][kPanelBf16];
  __m512 b0, b1;
  load_panel_bias(bias, ncols, b0, b1);
  for (int64_t m0 = 0; m0 < M; m0 += 16) {
    const int r = static_cast<int>(std::min<int64_t>(16, M - m0));
    if (r != configured) {
      amx_configure(r);
      configured = r;
    }
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t k0 = 0; k0 < K; k0 += 32) {
      _tile_loadd(2, x + m0 * K + k0, K * sizeof(bf16));
      _tile_loadd(3, panel + k0 * kPanelBf16, 2 * kPanelBf16 * sizeof(bf16));
      _tile_loadd(4, panel + k0 * kPanelBf16 + kPanelBf16, 2 * kPanelBf16 * sizeof(bf16));
      _tile_dpbf16ps(0, 2, 3);
      _tile_dpbf16ps(1, 2, 4);
    }
    _tile_stored(0, &c[0][0], kPanelBf16 * sizeof(float));
    _tile_stored(1, &c[0][16], kPanelBf16 * sizeof(float));
    for (int i = 0; i < r; ++i)
      store_panel_row_bf16(y + (m0 + i) * N, _mm512_add_ps(_mm512_load_ps(c[i]), b0),
                           _mm512_add_ps(_mm512_load_ps(c[i] + 16), b1), ncols);
  }
}
#endif

// Whether packed_linear_bf16 runs on AMX for a weight of K inputs (else its AVX512-BF16 or AVX2 tiles, which
// also sum every row alike).
inline bool amx_linear_applies(int64_t K) {
#if defined(AGENTRT_AMX)
  return K % 32 == 0 && amx_ready();
#else
  (void)K;
  return false;
#endif
}

// x's rows as the AVX2 bf16 tiles read them: fp32, each row padded with a zero to whole pairs ([M, K + 1]); empty
// where the kernels are built with AVX512-BF16 (their tiles read bf16 pairs).
inline std::vector<float> bf16_rows_for_tiles(const bf16* x, int64_t M, int64_t K) {
#if defined(__AVX512BF16__)
  (void)x, (void)M, (void)K;
  return {};
#else
  std::vector<float> xf(M * (K + 1), 0.f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) xf[m * (K + 1) + k] = to_f32(x[m * K + k]);
  return xf;
#endif
}

// One thread's state across the bf16 panels it runs: its widened panel and fp32 outputs (AVX2), whether and for
// how many rows its AMX tiles are configured (released when it goes).
struct Bf16Panels {
  explicit Bf16Panels(bool use_amx) : amx(use_amx) {}
  Bf16Panels(const Bf16Panels&) = delete;
  Bf16Panels& operator=(const Bf16Panels&) = delete;
  ~Bf16Panels() {
#if defined(AGENTRT_AMX)
    if (amx_rows) _tile_release();
#endif
  }
  const bool amx;  // amx_linear_applies(K) of the weight
  int amx_rows = 0;
  std::vector<float> wf, yf;
};

// Rows [M] of x (bf16 [M, K]; xf: the same rows from bf16_rows_for_tiles) through one bf16 panel (+ its bias):
// y[m, 0:ncols] (row stride N), on AMX where s.amx.
inline void linear_panel_bf16(const bf16* x, const float* xf, int64_t M, int64_t K, const bf16* panel,
                              const float* bias, bf16* y, int64_t N, int64_t ncols, Bf16Panels& s) {
#if defined(AGENTRT_AMX)
  if (s.amx) {
    linear_rows_amx(x, M, K, panel, bias, y, N, ncols, s.amx_rows);
    return;
  }
#endif
#if defined(__AVX512BF16__)
  (void)xf, (void)s;
  linear_rows_bf16(x, M, K, panel, bias, y, N, ncols);
#else
  (void)x;
  if (M >= kWidenMinRows) {
    linear_rows_widened(xf, K + 1, M, K, panel, bias, y, N, ncols, s.wf, s.yf);
    return;
  }
  for (int64_t m0 = 0; m0 < M; m0 += kMaxTileRowsBf16) {
    const float* xm = xf + m0 * (K + 1);
    bf16* ym = y + m0 * N;
    if (M - m0 >= 2) {
      linear_tile_bf16<2>(xm, K, panel, bias, ym, N, ncols);
    } else {
      linear_tile_bf16<1>(xm, K, panel, bias, ym, N, ncols);
    }
  }
#endif
}

// Elements of one bf16 panel of a weight with K inputs.
inline int64_t bf16_panel_elems(int64_t K) { return ((K + 1) / 2) * 2 * kPanelBf16; }

// x [M, K] bf16, w packed as above, bias fp32 [N] or null -> y [M, N] bf16; on AMX where amx_linear_applies.
inline void packed_linear_bf16(const bf16* x, int64_t M, int64_t K, const bf16* w, const float* bias, bf16* y,
                               int64_t N) {
  const int64_t panels = (N + kPanelBf16 - 1) / kPanelBf16, panel_elems = bf16_panel_elems(K);
  const bool use_amx = amx_linear_applies(K);
  const std::vector<float> xf = use_amx ? std::vector<float>{} : bf16_rows_for_tiles(x, M, K);
  agentrt::stealing_for(panels, [&](int64_t p0, int64_t p1) {
    Bf16Panels s(use_amx);
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n = p * kPanelBf16;
      linear_panel_bf16(x, xf.data(), M, K, w + p * panel_elems, bias ? bias + n : nullptr, y + n, N,
                        std::min(kPanelBf16, N - n), s);
    }
  });
}

}  // namespace agentrt
