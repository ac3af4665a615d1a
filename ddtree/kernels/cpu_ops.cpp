// Native CPU ops for the target runner and the drafter, float32: a GEMM for few rows on panel-packed weights
// (float32 or bfloat16 panels), RMSNorm, a request's attention block, SiLU-and-mul. Built on first use on the
// machine that runs them, in plain C++ (GCC/Clang vector extensions, `omp simd`; AVX-512 bf16 intrinsics where
// the CPU has them): the compiler vectorises for that CPU (-march=native).
//
// Why (benchmarks/bench_gemm.py, one core of this project's CPU): a decode step or a verify of a small tree reads
// every weight once, so its matrix products should stream the weights at the memory's read rate (~28 GB/s on one
// core). torch's MKL GEMV reaches 12-15 GB/s on narrow or square matrices, and from 2 rows on neither MKL nor
// oneDNN's packed kernels stream the weights (2-8 rows: 11-17 ms for 30 [576, 3072] matrices, where the read
// alone takes ~8). The panel kernel reads each weight once, in one sequential stream, and keeps 1-8 rows of
// results in registers: 2-8 rows cost about what 1 row costs, up to the compute bound.
//
//   panel_linear(x [M, K], panels [P, K, 32], n, bias [n] or empty, residual [M, n] or empty) -> y [M, n]:
//     y = x @ W (+ bias) (+ residual), W [K, n] stored as panels of 32 output columns (`pack_panels` in Python:
//     panel p holds W[:, 32p : 32p + 32], zero-padded past n), each panel one contiguous [K, 32] block. Each
//     panel is read once and stays in cache while every block of up to 8 rows of x runs over it; threads (torch's
//     intra-op pool) take disjoint ranges of panels.
//   With bfloat16 panels [P, ceil(K / 2), 64] (`pack_panels(w, torch.bfloat16)`: row i of a panel holds its 32
//     columns' weights of inputs 2i and 2i + 1, interleaved in pairs) x is rounded to bfloat16 (nearest even) and
//     each pair of products is summed into float32 as AVX-512's bf16 dot product does (`vdpbf16ps`, where the CPU
//     has it; elsewhere the same sums with float32 vectors, its flushing of subnormal inputs and sums to zero
//     included, so that both builds give the same bits). Half the weight bytes of float32 panels and, with
//     vdpbf16ps, half the instructions per product: for the drafter, whose results only shape the proposals (the
//     target's verify decides every token), and for a target asked for bfloat16 on a CPU. Where the CPU has AMX
//     (and the OS grants its tiles) they run on tiles of 16 rows: the same products, whose sums AMX rounds
//     otherwise than vdpbf16ps does (last bits), each row still alike whatever the other rows of the call.
//   With split panels [B, S, 2, 16, 32] int16 (`pack_split_panels`, AMX only): float32 weights as bf16 hi + lo,
//     x as three bf16 parts, five tile products per step: every product exact, sums in float32 (see
//     split_panel_linear_into). The float32 target's matrices on AMX CPUs: a few rows cost about one.
//
//   rms_norm(x [R, D], weight [D], eps) -> x / sqrt(mean(x^2) + eps) * weight, per row. At one token torch's
//   rms_norm costs ~30 us per call here (several small kernels), 61 calls per step; this loop costs ~1 us.
//
//   attention_block(qkv [n, (heads + 2 kv_heads) D], cos [n, D], sin [n, D], k [kv_heads, T, D], v [kv_heads, T, D],
//                   mask [n, T] bool or empty, heads, qk_norm [heads + kv_heads, D] or empty, eps) -> [n, heads * D]:
//   one request's attention block for its n new tokens after their q/k/v projection: Qwen3's per-head RMSNorm of q
//   and k where qk_norm is given, rotary embedding of q and k (rotate-half convention), their k and v written
//   into cache entries T - n .. T - 1 (k and v are views of the request's region of the KV pool, unit stride along
//   D), then for every query softmax(q k^T / sqrt(D)) v over the entries it may see: `mask` row i (a draft tree's
//   ancestor mask: committed entries and the node's ancestors), or causally every cached entry and the new tokens
//   up to itself when `mask` is empty. Grouped-query heads share a kv head: a kv head's queries (its heads times the
//   n tokens) run in tiles of up to 8 rows, scores Q K^T and then P V on the panel GEMM's tile, so that each key and
//   value vector is loaded once per tile rather than once per query. With torch ops this is ~12 small kernels and
//   one SDPA call per layer; the tiles beat SDPA from 1 to 256 new tokens over 0-2048 cached ones, here.
//
//   silu_and_mul(gate_up [R, 2 I]) -> silu(gate_up[:, :I]) * gate_up[:, I:], the MLP's activation.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#if defined(__AVX512BF16__) || (defined(__AMX_TILE__) && defined(__AMX_BF16__))
#include <immintrin.h>
#endif
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

constexpr int64_t kPanelWidth = 32;  // output columns per panel
// The tiles keep their rows' sums in vector registers: with AVX-512 (32 registers of 16 floats) 8 rows x 2 vectors;
// with AVX2 (16 registers of 8 floats) 3 rows x 4 vectors. Vectors wider than the CPU's are not an option: GCC
// lowers a scalar times such a vector through the stack, element by element (10x slower than torch, measured).
#if defined(__AVX512F__)
constexpr int kLanes = 16;
constexpr int kMaxRowsPerTile = 8;
#else
constexpr int kLanes = 8;
constexpr int kMaxRowsPerTile = 3;
#endif
constexpr int kVectorsPerRow = kPanelWidth / kLanes;

typedef float vf __attribute__((vector_size(kLanes * sizeof(float))));
typedef uint32_t vu __attribute__((vector_size(kLanes * sizeof(uint32_t))));

inline vf load_vector(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// out[m, 0:32] = x[m, 0:k] @ w[0:k, 0:32] for m < MB: x rows `ldx` apart, w rows `ldw` apart (a panel's are 32),
// out rows `ldo` apart. Inlined into its callers, so that a panel's constant strides are the compiler's.
template <int MB>
__attribute__((always_inline)) inline void panel_tile(const float* x, int64_t ldx, int64_t k, const float* w, int64_t ldw, float* out, int64_t ldo) {
  vf sums[MB][kVectorsPerRow];
  for (int m = 0; m < MB; ++m) {
    for (int v = 0; v < kVectorsPerRow; ++v) sums[m][v] = vf{};
  }
  for (int64_t i = 0; i < k; ++i, w += ldw) {
    vf wv[kVectorsPerRow];
    for (int v = 0; v < kVectorsPerRow; ++v) wv[v] = load_vector(w + v * kLanes);
    for (int m = 0; m < MB; ++m) {
      const float xm = x[m * ldx + i];
      for (int v = 0; v < kVectorsPerRow; ++v) sums[m][v] += xm * wv[v];
    }
  }
  for (int m = 0; m < MB; ++m) {
    for (int v = 0; v < kVectorsPerRow; ++v) std::memcpy(out + m * ldo + v * kLanes, &sums[m][v], sizeof(vf));
  }
}

__attribute__((always_inline)) inline void panel_rows(const float* x, int64_t ldx, int rows, int64_t k,
                                                     const float* w, int64_t ldw, float* out, int64_t ldo) {
  switch (rows) {
    case 8: return panel_tile<8>(x, ldx, k, w, ldw, out, ldo);
    case 7: return panel_tile<7>(x, ldx, k, w, ldw, out, ldo);
    case 6: return panel_tile<6>(x, ldx, k, w, ldw, out, ldo);
    case 5: return panel_tile<5>(x, ldx, k, w, ldw, out, ldo);
    case 4: return panel_tile<4>(x, ldx, k, w, ldw, out, ldo);
    case 3: return panel_tile<3>(x, ldx, k, w, ldw, out, ldo);
    case 2: return panel_tile<2>(x, ldx, k, w, ldw, out, ldo);
    default: return panel_tile<1>(x, ldx, k, w, ldw, out, ldo);
  }
}

// ---- bfloat16 panels ----------------------------------------------------------------------------------------

// float32 -> bfloat16 bits, round to nearest even (NaN stays a NaN).
inline uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

#if !defined(__AVX512BF16__)
// float32 bits -> the float, a zero or subnormal one as a zero of its sign (vdpbf16ps's DAZ and FTZ)
inline vf flushed(vu bits) {
  bits = ((bits & 0x7f800000u) == 0) ? (bits & 0x80000000u) : bits;
  vf v;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
}
inline vf flushed(vf v) {
  vu bits;
  std::memcpy(&bits, &v, sizeof(bits));
  return flushed(bits);
}
inline float flushed(uint32_t bits) {
  bits = (bits & 0x7f800000u) == 0 ? (bits & 0x80000000u) : bits;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
#endif

// out[m, 0:32] = x[m] . w over ceil(k / 2) input pairs for m < MB: x rows as bf16 pairs (low half input 2i, high
// half 2i + 1), `ldx` pairs apart; w a bf16 panel, 64 values per pair (column c's two weights at 2c and 2c + 1).
// Each pair's two products are added to the float32 sum, the odd input's first (vdpbf16ps's order).
template <int MB>
__attribute__((always_inline)) inline void panel_tile_bf16(const uint32_t* x, int64_t ldx, int64_t pairs,
                                                           const uint16_t* w, float* out, int64_t ldo) {
#if defined(__AVX512BF16__)
  __m512 lo[MB], hi[MB];
  for (int m = 0; m < MB; ++m) lo[m] = hi[m] = _mm512_setzero_ps();
  for (int64_t i = 0; i < pairs; ++i, w += 2 * kPanelWidth) {
    const __m512bh w_lo = (__m512bh)_mm512_loadu_si512(w), w_hi = (__m512bh)_mm512_loadu_si512(w + kPanelWidth);
    for (int m = 0; m < MB; ++m) {
      const __m512bh xm = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[m * ldx + i]));
      lo[m] = _mm512_dpbf16_ps(lo[m], xm, w_lo);
      hi[m] = _mm512_dpbf16_ps(hi[m], xm, w_hi);
    }
  }
  for (int m = 0; m < MB; ++m) {
    _mm512_storeu_ps(out + m * ldo, lo[m]);
    _mm512_storeu_ps(out + m * ldo + 16, hi[m]);
  }
#else
  // vdpbf16ps's arithmetic with float32 vectors: subnormal inputs read as zero, every sum below float32's normal
  // range flushed to a signed zero, round to nearest even
  vf sums[MB][kVectorsPerRow];
  for (int m = 0; m < MB; ++m) {
    for (int v = 0; v < kVectorsPerRow; ++v) sums[m][v] = vf{};
  }
  const vu high_half = (vu{} + 0xffff0000u);
  for (int64_t i = 0; i < pairs; ++i, w += 2 * kPanelWidth) {
    vf even[kVectorsPerRow], odd[kVectorsPerRow];  // lane c of vector v: column v * kLanes + c's two weights
    for (int v = 0; v < kVectorsPerRow; ++v) {
      vu pair_bits;
      std::memcpy(&pair_bits, w + 2 * v * kLanes, sizeof(pair_bits));
      even[v] = flushed(pair_bits << 16);
      odd[v] = flushed(pair_bits & high_half);
    }
    for (int m = 0; m < MB; ++m) {
      const uint32_t pair = x[m * ldx + i];
      const float x_even = flushed(pair << 16), x_odd = flushed(pair & 0xffff0000u);
      for (int v = 0; v < kVectorsPerRow; ++v) {
        sums[m][v] = flushed(sums[m][v] + x_odd * odd[v]);
        sums[m][v] = flushed(sums[m][v] + x_even * even[v]);
      }
    }
  }
  for (int m = 0; m < MB; ++m) {
    for (int v = 0; v < kVectorsPerRow; ++v) std::memcpy(out + m * ldo + v * kLanes, &sums[m][v], sizeof(vf));
  }
#endif
}

__attribute__((always_inline)) inline void panel_rows(const uint32_t* x, int64_t ldx, int rows, int64_t pairs,
                                                     const uint16_t* w, int64_t /*ldw: always 64*/, float* out,
                                                     int64_t ldo) {
  switch (rows) {
    case 8: return panel_tile_bf16<8>(x, ldx, pairs, w, out, ldo);
    case 7: return panel_tile_bf16<7>(x, ldx, pairs, w, out, ldo);
    case 6: return panel_tile_bf16<6>(x, ldx, pairs, w, out, ldo);
    case 5: return panel_tile_bf16<5>(x, ldx, pairs, w, out, ldo);
    case 4: return panel_tile_bf16<4>(x, ldx, pairs, w, out, ldo);
    case 3: return panel_tile_bf16<3>(x, ldx, pairs, w, out, ldo);
    case 2: return panel_tile_bf16<2>(x, ldx, pairs, w, out, ldo);
    default: return panel_tile_bf16<1>(x, ldx, pairs, w, out, ldo);
  }
}

// y rows [m0, m0 + rows), columns [j0, j0 + width) = a tile of sums (`ld` floats a row) (+ bias) (+ residual): where
// every kernel's results reach y, bias first and residual second, so all of them round those two adds alike.
inline void write_rows(const float* sums, int64_t ld, int rows, int64_t m0, int64_t j0, int64_t width, int64_t n,
                       const float* bp, const float* rp, float* yp) {
  for (int r = 0; r < rows; ++r) {
    float* yr = yp + (m0 + r) * n + j0;
    const float* rr = rp != nullptr ? rp + (m0 + r) * n + j0 : nullptr;
    const float* t = sums + r * ld;
    for (int64_t c = 0; c < width; ++c) {
      float v = t[c];
      if (bp != nullptr) v += bp[j0 + c];
      if (rr != nullptr) v += rr[c];
      yr[c] = v;
    }
  }
}

// y rows [0, m_rows) = x @ panels (+ bias) (+ residual): the loop of panel_linear for either panel dtype. `k` is
// x's row stride in X elements (floats, or bf16 pairs) and a panel's rows (32 floats, or 32 bf16 pairs, each).
template <typename X, typename W>
void panel_linear_into(const X* xp, int64_t m_rows, int64_t k, const W* pp, int64_t num_panels, int64_t n,
                       const float* bp, const float* rp, float* yp) {
  at::parallel_for(0, num_panels, 1, [&](int64_t begin, int64_t end) {
    float tile[kMaxRowsPerTile * kPanelWidth];
    for (int64_t p = begin; p < end; ++p) {
      const W* panel = pp + p * k * (kPanelWidth * (sizeof(X) / sizeof(W)));  // 32 floats or 32 bf16 pairs a row
      const int64_t j0 = p * kPanelWidth;
      const int64_t width = std::min(kPanelWidth, n - j0);
      for (int64_t m0 = 0; m0 < m_rows; m0 += kMaxRowsPerTile) {
        const int rows = static_cast<int>(std::min<int64_t>(kMaxRowsPerTile, m_rows - m0));
        panel_rows(xp + m0 * k, k, rows, k, panel, kPanelWidth, tile, kPanelWidth);
        write_rows(tile, kPanelWidth, rows, m0, j0, width, n, bp, rp, yp);
      }
    }
  });
}

// ---- split panels on AMX tiles ------------------------------------------------------------------------------

constexpr int64_t kSplitBlockWidth = 16;  // output columns per block of split panels (one AMX tile of sums)
constexpr int64_t kSplitStep = 32;        // inputs per step (one AMX tile row of bf16 values: 64 bytes)
constexpr int kSplitRowsPerTile = 16;     // rows of x per tile (AMX's maximum)

// Linux keeps a process's AMX tile state off until the process asks for it once (arch_prctl); a kernel or
// hypervisor that does not offer the state refuses, and then the split panels are not used.
bool amx_tiles_ready() {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
  static const bool ready = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ready;
#else
  return false;
#endif
}

// float32 -> (hi, mid, lo) bfloat16 with x == hi + mid + lo for normal x: each part the remainder of the ones
// before it, rounded to nearest even (the subtractions are exact in float32).
inline void split3(float x, uint16_t& hi, uint16_t& mid, uint16_t& lo) {
  auto widen = [](uint16_t h) {
    const uint32_t u = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &u, sizeof(f));
    return f;
  };
  hi = to_bf16(x);
  const float r1 = x - widen(hi);
  mid = to_bf16(r1);
  lo = to_bf16(r1 - widen(mid));
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Tiles 0-4: the five sums of a block (x_hi W_hi, x_hi W_lo, x_mid W_hi, x_mid W_lo, x_lo W_hi), `rows` x 16 floats;
// tile 5: a part of x, `rows` x 32 bf16; tiles 6, 7: the block's W_hi and W_lo for one step, 16 pairs x 16 columns.
inline void configure_split_tiles(int rows) {
  TileConfig config{};
  config.palette_id = 1;
  for (int t = 0; t < 6; ++t) {
    config.rows[t] = static_cast<uint8_t>(rows);
    config.colsb[t] = 64;
  }
  for (int t = 6; t < 8; ++t) {
    config.rows[t] = 16;
    config.colsb[t] = 64;
  }
  _tile_loadconfig(&config);
}

// sums[t][r][c] (t < 5, r < rows, c < 16): a block's five partial products for `rows` rows of x over `steps`
// steps. `x_parts` holds hi, mid and lo, each [rows, ldx] bf16 (ldx in values). The block's next steps are
// prefetched: tile loads alone do not keep the stream of weights ahead of the products.
inline void split_block(const uint16_t* const x_parts[3], int64_t ldx, int64_t steps, const uint16_t* block,
                        float* sums) {
  constexpr int64_t kStepValues = 2 * kSplitStep * kSplitBlockWidth;  // hi and lo, 16 pairs x 32 values each
  constexpr int kPrefetchSteps = 2;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  _tile_zero(4);
  const int64_t stride = ldx * static_cast<int64_t>(sizeof(uint16_t));
  for (int64_t s = 0; s < steps; ++s) {
    const uint16_t* w = block + s * kStepValues;
    const char* ahead = reinterpret_cast<const char*>(w + kPrefetchSteps * kStepValues);
    for (int line = 0; line < static_cast<int>(kStepValues * sizeof(uint16_t) / 64); ++line) {
      _mm_prefetch(ahead + 64 * line, _MM_HINT_T0);
    }
    _tile_loadd(6, w, 64);
    _tile_loadd(7, w + kStepValues / 2, 64);
    _tile_loadd(5, x_parts[0] + s * kSplitStep, stride);
    _tile_dpbf16ps(0, 5, 6);
    _tile_dpbf16ps(1, 5, 7);
    _tile_loadd(5, x_parts[1] + s * kSplitStep, stride);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
    _tile_loadd(5, x_parts[2] + s * kSplitStep, stride);
    _tile_dpbf16ps(4, 5, 6);
  }
  _tile_stored(0, sums, 64);
  _tile_stored(1, sums + 256, 64);
  _tile_stored(2, sums + 512, 64);
  _tile_stored(3, sums + 768, 64);
  _tile_stored(4, sums + 1024, 64);
}
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// y = x @ W (+ bias) (+ residual) on bfloat16 panels [P, pairs, 64] with AMX tiles: the products vdpbf16ps makes,
// 16 rows of x at a time. A panel's row of pairs is two tile rows of 16 columns (bytes 0-63 and 64-127), so the
// panels load as they are; x comes as bf16 pairs [rows, ldx] zero-padded to whole steps of 16 pairs, and a panel's
// last partial step is copied into a zero-padded tile first (the rows past it belong to the next panel).
void bf16_tile_linear_into(const uint32_t* x_pairs, int64_t m_rows, int64_t ldx, int64_t pairs, const uint16_t* pp,
                           int64_t num_panels, int64_t n, const float* bp, const float* rp, float* yp) {
  constexpr int64_t kPairsPerStep = 16;
  constexpr int64_t kRowValues = 2 * kPanelWidth;  // a panel's row: 32 columns x 2 bf16
  const int tile_rows = static_cast<int>(std::min<int64_t>(m_rows, kSplitRowsPerTile));
  const int64_t full_steps = pairs / kPairsPerStep, tail = pairs % kPairsPerStep;
  at::parallel_for(0, num_panels, 1, [&](int64_t begin, int64_t end) {
    TileConfig config{};
    config.palette_id = 1;
    for (int t = 0; t < 3; ++t) {  // 0, 1: sums of columns 0-15 and 16-31; 2: x
      config.rows[t] = static_cast<uint8_t>(tile_rows);
      config.colsb[t] = 64;
    }
    for (int t = 3; t < 5; ++t) {  // the panel's 16 pairs of one step, columns 0-15 and 16-31
      config.rows[t] = 16;
      config.colsb[t] = 64;
    }
    _tile_loadconfig(&config);
    alignas(64) float sums[kSplitRowsPerTile * kPanelWidth];
    alignas(64) uint16_t tail_step[kPairsPerStep * kRowValues];
    for (int64_t p = begin; p < end; ++p) {
      const uint16_t* panel = pp + p * pairs * kRowValues;
      if (tail) {
        std::memset(tail_step, 0, sizeof(tail_step));
        std::memcpy(tail_step, panel + full_steps * kPairsPerStep * kRowValues, tail * kRowValues * sizeof(uint16_t));
      }
      const int64_t j0 = p * kPanelWidth;
      const int64_t width = std::min(kPanelWidth, n - j0);
      for (int64_t m0 = 0; m0 < m_rows; m0 += tile_rows) {
        _tile_zero(0);
        _tile_zero(1);
        for (int64_t s = 0; s < full_steps + (tail ? 1 : 0); ++s) {
          const uint16_t* w = s < full_steps ? panel + s * kPairsPerStep * kRowValues : tail_step;
          const char* ahead = reinterpret_cast<const char*>(panel + (s + 2) * kPairsPerStep * kRowValues);
          for (int line = 0; line < static_cast<int>(kPairsPerStep * kRowValues * sizeof(uint16_t) / 64); ++line) {
            _mm_prefetch(ahead + 64 * line, _MM_HINT_T0);
          }
          _tile_loadd(2, x_pairs + m0 * ldx + s * kPairsPerStep, ldx * static_cast<int64_t>(sizeof(uint32_t)));
          _tile_loadd(3, w, kRowValues * sizeof(uint16_t));
          _tile_loadd(4, w + kPanelWidth, kRowValues * sizeof(uint16_t));
          _tile_dpbf16ps(0, 2, 3);
          _tile_dpbf16ps(1, 2, 4);
        }
        _tile_stored(0, sums, kPanelWidth * sizeof(float));
        _tile_stored(1, sums + 16, kPanelWidth * sizeof(float));
        const int rows = static_cast<int>(std::min<int64_t>(tile_rows, m_rows - m0));
        write_rows(sums, kPanelWidth, rows, m0, j0, width, n, bp, rp, yp);
      }
    }
    _tile_release();
  });
}
#endif

// y = x @ W (+ bias) (+ residual) on split panels: W [K, n] as bfloat16 pairs hi + lo (hi = bf16(W), lo =
// bf16(W - hi): 16 significant bits of each weight), x as hi + mid + lo (all of its 24). A row's sum is
// x_hi W_hi + (((x_hi W_lo + x_mid W_hi) + x_mid W_lo) + x_lo W_hi), each product exact and each of the five sums
// accumulated in float32 by AMX's dot products in one fixed order, so a row's result does not depend on the other
// rows of the call. Rows run in tiles of up to 16: M <= 16 in one tile of M rows, else in tiles of 16 with x padded
// by zero rows (each tile costs the same few dot products, small beside streaming the weights).
void split_panel_linear_into(const float* xp, int64_t m_rows, int64_t k, const uint16_t* pp, int64_t num_blocks,
                             int64_t steps, int64_t n, const float* bp, const float* rp, float* yp) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  const int tile_rows = static_cast<int>(std::min<int64_t>(m_rows, kSplitRowsPerTile));
  const int64_t padded_rows = (m_rows + tile_rows - 1) / tile_rows * tile_rows;
  const int64_t ldx = steps * kSplitStep;
  std::vector<uint16_t> parts(3 * padded_rows * ldx, 0);
  uint16_t* const hi = parts.data();
  uint16_t* const mid = hi + padded_rows * ldx;
  uint16_t* const lo = mid + padded_rows * ldx;
  for (int64_t m = 0; m < m_rows; ++m) {
    const float* xr = xp + m * k;
    uint16_t *hr = hi + m * ldx, *mr = mid + m * ldx, *lr = lo + m * ldx;
#pragma omp simd
    for (int64_t i = 0; i < k; ++i) split3(xr[i], hr[i], mr[i], lr[i]);
  }
  const int64_t block_values = steps * 2 * kSplitStep * kSplitBlockWidth;
  at::parallel_for(0, num_blocks, 1, [&](int64_t begin, int64_t end) {
    configure_split_tiles(tile_rows);  // per thread: the tile configuration is a thread's state
    alignas(64) float sums[5 * kSplitRowsPerTile * kSplitBlockWidth];
    alignas(64) float row_sums[kSplitRowsPerTile * kSplitBlockWidth];
    for (int64_t b = begin; b < end; ++b) {
      const int64_t j0 = b * kSplitBlockWidth;
      const int64_t width = std::min(kSplitBlockWidth, n - j0);
      for (int64_t m0 = 0; m0 < m_rows; m0 += tile_rows) {
        const uint16_t* const x_parts[3] = {hi + m0 * ldx, mid + m0 * ldx, lo + m0 * ldx};
        split_block(x_parts, ldx, steps, pp + b * block_values, sums);
        const int rows = static_cast<int>(std::min<int64_t>(tile_rows, m_rows - m0));
        for (int r = 0; r < rows; ++r) {  // the five products' sums, in the order given above the function
          const float* t = sums + r * kSplitBlockWidth;
          float* v = row_sums + r * kSplitBlockWidth;
#pragma omp simd
          for (int64_t c = 0; c < kSplitBlockWidth; ++c) {
            v[c] = t[c] + (((t[256 + c] + t[512 + c]) + t[768 + c]) + t[1024 + c]);
          }
        }
        write_rows(row_sums, kSplitBlockWidth, rows, m0, j0, width, n, bp, rp, yp);
      }
    }
    _tile_release();
  });
#else
  TORCH_CHECK(false, "panel_linear: split panels need a build with AMX tiles");
#endif
}

torch::Tensor panel_linear(const torch::Tensor& x, const torch::Tensor& panels, int64_t n, const torch::Tensor& bias,
                           const torch::Tensor& residual) {
  TORCH_CHECK(x.device().is_cpu() && panels.device().is_cpu(), "panel_linear: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == torch::kFloat, "panel_linear: x must be float32");
  TORCH_CHECK(panels.scalar_type() == torch::kFloat || panels.scalar_type() == torch::kBFloat16 ||
                  panels.scalar_type() == torch::kShort,
              "panel_linear: panels must be float32, bfloat16 or split (int16)");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "panel_linear: x must be a contiguous [M, K]");
  const bool has_bias = bias.defined() && bias.numel() > 0;
  const bool has_residual = residual.defined() && residual.numel() > 0;
  TORCH_CHECK((!has_bias || bias.device().is_cpu()) && (!has_residual || residual.device().is_cpu()),
              "panel_linear: CPU tensors only");
  TORCH_CHECK(!has_bias || (bias.scalar_type() == torch::kFloat && bias.is_contiguous() && bias.numel() == n),
              "panel_linear: bias must be a contiguous float32 [n]");
  TORCH_CHECK(!has_residual || (residual.scalar_type() == torch::kFloat && residual.is_contiguous() &&
                                residual.dim() == 2 && residual.size(0) == x.size(0) && residual.size(1) == n),
              "panel_linear: residual must be a contiguous float32 [M, n]");
  if (panels.scalar_type() == torch::kShort) {  // split panels [B, S, 2, 16, 32] (pack_split_panels)
    TORCH_CHECK(panels.dim() == 5 && panels.size(2) == 2 && panels.size(3) == kSplitStep / 2 &&
                    panels.size(4) == 2 * kSplitBlockWidth && panels.is_contiguous(),
                "panel_linear: split panels must be a contiguous [B, S, 2, 16, 32] int16 (pack_split_panels)");
    const int64_t m_rows = x.size(0), k = x.size(1), num_blocks = panels.size(0), steps = panels.size(1);
    TORCH_CHECK(k > (steps - 1) * kSplitStep && k <= steps * kSplitStep, "panel_linear: x has ", k,
                " columns, the split panels ", steps, " steps of 32");
    TORCH_CHECK(n > (num_blocks - 1) * kSplitBlockWidth && n <= num_blocks * kSplitBlockWidth,
                "panel_linear: n = ", n, " does not match ", num_blocks, " blocks of 16 columns");
    TORCH_CHECK(amx_tiles_ready(), "panel_linear: split panels need AMX tiles (amx_tiles_ready() is false)");
    auto y = torch::empty({m_rows, n}, x.options());
    if (m_rows > 0) {
      split_panel_linear_into(x.data_ptr<float>(), m_rows, k,
                              reinterpret_cast<const uint16_t*>(panels.data_ptr<int16_t>()), num_blocks, steps, n,
                              has_bias ? bias.data_ptr<float>() : nullptr,
                              has_residual ? residual.data_ptr<float>() : nullptr, y.data_ptr<float>());
    }
    return y;
  }
  const bool is_float = panels.scalar_type() == torch::kFloat;
  const int64_t row_width = is_float ? kPanelWidth : 2 * kPanelWidth;
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == row_width && panels.is_contiguous(),
              "panel_linear: panels must be a contiguous [P, K, 32] float32 or [P, ceil(K / 2), 64] bfloat16 "
              "(pack_panels)");
  const int64_t m_rows = x.size(0), k = x.size(1), num_panels = panels.size(0);
  TORCH_CHECK(panels.size(1) == (is_float ? k : (k + 1) / 2), "panel_linear: x has ", k, " columns, the ",
              is_float ? "float32" : "bfloat16", " panels ", panels.size(1), " rows");
  TORCH_CHECK(n > (num_panels - 1) * kPanelWidth && n <= num_panels * kPanelWidth,
              "panel_linear: n = ", n, " does not match ", num_panels, " panels");
  auto y = torch::empty({m_rows, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* bp = has_bias ? bias.data_ptr<float>() : nullptr;
  const float* rp = has_residual ? residual.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  if (is_float) {
    panel_linear_into(xp, m_rows, k, panels.data_ptr<float>(), num_panels, n, bp, rp, yp);
  } else {  // x rounded to bf16 pairs once, zero-padded to whole pairs
    const int64_t pairs = panels.size(1);
    const auto* pp = reinterpret_cast<const uint16_t*>(panels.data_ptr<at::BFloat16>());
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    const bool tiles = amx_tiles_ready() && m_rows > 0;
#else
    const bool tiles = false;
#endif
    // on tiles: rows padded to whole tiles of 16 (when more than 16) and pairs to whole steps of 16, with zeros
    const int64_t ldx = tiles ? (pairs + 15) / 16 * 16 : pairs;
    const int64_t padded_rows = tiles && m_rows > kSplitRowsPerTile ? (m_rows + 15) / 16 * 16 : m_rows;
    std::vector<uint32_t> x_pairs(padded_rows * ldx, 0u);
    for (int64_t m = 0; m < m_rows; ++m) {
      for (int64_t i = 0; i < k; ++i) {
        x_pairs[m * ldx + i / 2] |= static_cast<uint32_t>(to_bf16(xp[m * k + i])) << (16 * (i % 2));
      }
    }
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (tiles) {
      bf16_tile_linear_into(x_pairs.data(), m_rows, ldx, pairs, pp, num_panels, n, bp, rp, yp);
      return y;
    }
#endif
    panel_linear_into(x_pairs.data(), m_rows, pairs, pp, num_panels, n, bp, rp, yp);
  }
  return y;
}

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "rms_norm: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == torch::kFloat && weight.scalar_type() == torch::kFloat, "rms_norm: float32 only");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 1 && x.size(1) == weight.size(0), "rms_norm: x [R, D], weight [D]");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "rms_norm: contiguous tensors expected");
  const int64_t rows = x.size(0), d = x.size(1);
  auto y = torch::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = xp + r * d;
    float* yr = yp + r * d;
    float sum_sq = 0.0f;
#pragma omp simd reduction(+ : sum_sq)
    for (int64_t i = 0; i < d; ++i) sum_sq += xr[i] * xr[i];
    const float scale = 1.0f / std::sqrt(sum_sq / static_cast<float>(d) + static_cast<float>(eps));
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) yr[i] = xr[i] * scale * wp[i];
  }
  return y;
}

// a * b + c in one rounding where the CPU has fused multiply-adds (std::fma: the compiler may not fuse some and not
// others, so a vectorised loop's body and its scalar tail round alike); elsewhere two roundings (nothing is fused
// then either, and std::fma would be a library call per element)
#pragma omp declare simd
inline float mul_add(float a, float b, float c) {
#if defined(__FMA__) || defined(__aarch64__)
  return std::fma(a, b, c);
#else
  return a * b + c;
#endif
}

// exp(x) within ~2 ulp for x in [-87, 88], 0 below -87 (and for -inf), exp(88) up to where float32's exp overflows,
// inf beyond (as std::exp: SiLU of -inf is then NaN, as torch's), NaN for NaN: arithmetic only, so that `omp simd`
// loops over it vectorise (std::exp is a scalar library call: ~20 ns each, 0.7 ms of a decode step's softmaxes,
// 1.2 ms of a 9-token verify's SiLU).
#pragma omp declare simd
inline float exp_approx(float x) {
  const bool is_tiny = x < -87.0f;
  const bool is_huge = x > 88.7228394f;  // ln(FLT_MAX)
  x = is_tiny ? -87.0f : (x > 88.0f ? 88.0f : x);
  // mul_add: a vectorised loop's body and its scalar tail round alike, so an entry's weight does not depend on
  // where in a row it falls
  const float k = std::floor(mul_add(x, 1.44269504088896341f, 0.5f));  // x = k ln2 + r, |r| <= ln2 / 2
  const float r = mul_add(k, 2.12194440e-4f, mul_add(-k, 0.693359375f, x));  // ln2 in two parts (Cody-Waite)
  float p = 1.9875691500e-4f;                                                 // exp(r): Cephes' minimax polynomial
  p = mul_add(p, r, 1.3981999507e-3f);
  p = mul_add(p, r, 8.3334519073e-3f);
  p = mul_add(p, r, 4.1665795894e-2f);
  p = mul_add(p, r, 1.6666665459e-1f);
  p = mul_add(p, r, 5.0000001201e-1f);
  p = mul_add(p * r, r, r) + 1.0f;
  const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;  // 2^k, k in [-126, 127]
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return is_tiny ? 0.0f : (is_huge ? INFINITY : p * scale);
}

// The sum of x[0:n]. One function, not inlined, so that every softmax adds its weights in the same association
// for the same n (a vectorised sum's lanes depend on the loop it is compiled in).
__attribute__((noinline)) float sum_of(const float* x, int64_t n) {
  float total = 0.0f;
#pragma omp simd reduction(+ : total)
  for (int64_t i = 0; i < n; ++i) total += x[i];
  return total;
}

torch::Tensor attention_block(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                              const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& mask, int64_t heads,
                              const torch::Tensor& qk_norm, double eps) {
  for (const auto* t : {&qkv, &cos, &sin, &k, &v}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == torch::kFloat, "attention_block: float32 CPU tensors");
  }
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes(), "attention_block: k and v [kv_heads, T, D] expected");
  const int64_t kv_heads = k.size(0), t_len = k.size(1), d = k.size(2);
  TORCH_CHECK(d % 2 == 0, "attention_block: an even head_dim expected");
  TORCH_CHECK(kv_heads > 0 && heads > 0 && heads % kv_heads == 0,
              "attention_block: heads must be a multiple of kv_heads");
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous() && qkv.size(1) == (heads + 2 * kv_heads) * d,
              "attention_block: qkv [n, (heads + 2 kv_heads) * D] contiguous expected");
  const int64_t n = qkv.size(0);
  TORCH_CHECK(n > 0 && n <= t_len, "attention_block: 1 <= n <= T new tokens expected");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.dim() == 2 && cos.size(0) == n && cos.size(1) == d &&
                  cos.is_contiguous() && sin.is_contiguous(),
              "attention_block: cos and sin [n, D] contiguous expected");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1, "attention_block: unit stride along D expected");
  const bool has_mask = mask.defined() && mask.numel() > 0;
  TORCH_CHECK(!has_mask || mask.device().is_cpu(), "attention_block: CPU tensors only");
  TORCH_CHECK(!has_mask || (mask.scalar_type() == torch::kBool && mask.is_contiguous() && mask.dim() == 2 &&
                            mask.size(0) == n && mask.size(1) == t_len),
              "attention_block: mask must be a contiguous bool [n, T]");
  const bool has_qk_norm = qk_norm.defined() && qk_norm.numel() > 0;
  TORCH_CHECK(!has_qk_norm || (qk_norm.device().is_cpu() && qk_norm.scalar_type() == torch::kFloat &&
                               qk_norm.is_contiguous() && qk_norm.dim() == 2 &&
                               qk_norm.size(0) == heads + kv_heads && qk_norm.size(1) == d),
              "attention_block: qk_norm must be a contiguous float32 [heads + kv_heads, D]");
  const int64_t group = heads / kv_heads, half = d / 2, width = (heads + 2 * kv_heads) * d, first_new = t_len - n;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const float* in = qkv.data_ptr<float>();
  float* kp = k.data_ptr<float>();
  float* vp = v.data_ptr<float>();
  const bool* mp = has_mask ? mask.data_ptr<bool>() : nullptr;
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), vs0 = v.stride(0), vs1 = v.stride(1);
  // rotary: out[i] = x[i] cos[i] + rotate_half(x)[i] sin[i], rotate_half(x) = (-x[half:], x[:half])
  // Qwen3's q/k norm first, where given: head j (q heads, then kv heads) RMS-normed with weight row j.
  const float* norm_weights = has_qk_norm ? qk_norm.data_ptr<float>() : nullptr;
  std::vector<float> normed(d);
  auto rope = [&](const float* x, int64_t head, const float* c, const float* sn, float* out) {
    if (norm_weights != nullptr) {
      float sum_sq = 0.0f;
      for (int64_t i = 0; i < d; ++i) sum_sq += x[i] * x[i];
      const float inv = 1.0f / std::sqrt(sum_sq / static_cast<float>(d) + static_cast<float>(eps));
      const float* w = norm_weights + head * d;
      for (int64_t i = 0; i < d; ++i) normed[i] = x[i] * inv * w[i];
      x = normed.data();
    }
    for (int64_t i = 0; i < half; ++i) out[i] = x[i] * c[i] - x[i + half] * sn[i];
    for (int64_t i = half; i < d; ++i) out[i] = x[i] * c[i] + x[i - half] * sn[i];
  };
  // Queries roped, scaled and grouped by kv head: the query of token r and head h is row r * group + h % group of
  // kv head h / group's block, so that a kv head's keys and values are read once for all the queries that share
  // them (its heads and tokens) in GEMM tiles of up to 8 rows.
  const int64_t rows_per_kv_head = n * group;
  std::vector<float> queries(kv_heads * rows_per_kv_head * d);
  for (int64_t r = 0; r < n; ++r) {
    const float* row = in + r * width;
    const float* c = cos.data_ptr<float>() + r * d;
    const float* sn = sin.data_ptr<float>() + r * d;
    for (int64_t h = 0; h < heads; ++h) {
      float* qr = queries.data() + ((h / group) * rows_per_kv_head + r * group + h % group) * d;
      rope(row + h * d, h, c, sn, qr);
      for (int64_t i = 0; i < d; ++i) qr[i] *= scale;
    }
    for (int64_t g = 0; g < kv_heads; ++g) {
      rope(row + (heads + g) * d, heads + g, c, sn, kp + g * ks0 + (first_new + r) * ks1);
      const float* vin = row + (heads + kv_heads + g) * d;
      std::copy(vin, vin + d, vp + g * vs0 + (first_new + r) * vs1);
    }
  }
  auto out = torch::empty({n, heads * d}, qkv.options());
  float* op = out.data_ptr<float>();
  // Keys as panels of 32 entries per kv head ([D, 32] each, contiguous, zero past T): a tile of queries' scores is
  // then the panel GEMM's tile, each key vector loaded once for up to 8 queries.
  const int64_t key_panels = (t_len + kPanelWidth - 1) / kPanelWidth, t_pad = key_panels * kPanelWidth;
  std::unique_ptr<float[]> keys(new float[kv_heads * key_panels * d * kPanelWidth]());
  for (int64_t g = 0; g < kv_heads; ++g) {
    for (int64_t t = 0; t < t_len; ++t) {
      const float* kt = kp + g * ks0 + t * ks1;
      float* panel = keys.get() + ((g * key_panels + t / kPanelWidth) * d) * kPanelWidth + t % kPanelWidth;
      for (int64_t i = 0; i < d; ++i) panel[i * kPanelWidth] = kt[i];
    }
  }
  // Jobs: (kv head, block of up to 8 query rows). Scores Q K^T (tiles), a softmax per row over the entries it may
  // see (its mask row, or causally the cache and the new tokens up to its own), then P V (tiles over D in 32s).
  const int64_t blocks = (rows_per_kv_head + kMaxRowsPerTile - 1) / kMaxRowsPerTile;
  const int64_t d_tiled = d / kPanelWidth * kPanelWidth;
  // A job costs ~2 * 8 * T * D multiply-adds: below ~256k per thread an OpenMP fork costs more than it saves (a
  // decode step runs one call per request and layer).
  const int64_t rows_in_job = std::min<int64_t>(kMaxRowsPerTile, rows_per_kv_head);
  const int64_t grain = std::max<int64_t>(1, (1 << 18) / std::max<int64_t>(1, 2 * rows_in_job * t_len * d));
  at::parallel_for(0, kv_heads * blocks, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(kMaxRowsPerTile * t_pad);
    std::vector<float> tile(kMaxRowsPerTile * d);
    std::vector<float> visible_weights(has_mask ? t_len : 0);
    for (int64_t job = begin; job < end; ++job) {
      const int64_t g = job / blocks, row0 = job % blocks * kMaxRowsPerTile;
      const int rows = static_cast<int>(std::min<int64_t>(kMaxRowsPerTile, rows_per_kv_head - row0));
      // causal: token r sees entries 0 .. first_new + r; the block's last row sees the most
      const int64_t seen = has_mask ? t_len : first_new + (row0 + rows - 1) / group + 1;
      const float* q = queries.data() + (g * rows_per_kv_head + row0) * d;
      for (int64_t c = 0; c * kPanelWidth < seen; ++c) {
        panel_rows(q, d, rows, d, keys.get() + (g * key_panels + c) * d * kPanelWidth, kPanelWidth,
                   scores.data() + c * kPanelWidth, t_pad);
      }
      for (int j = 0; j < rows; ++j) {
        const int64_t r = (row0 + j) / group;
        float* sc = scores.data() + j * t_pad;
        const bool* visible = has_mask ? mp + r * t_len : nullptr;
        const int64_t last = has_mask ? t_len : first_new + r + 1;
        float max_score = -INFINITY;  // NaN once a visible score is NaN: the row is then NaN, as SDPA's
        for (int64_t t = 0; t < last; ++t) {
          if (visible != nullptr && !visible[t]) sc[t] = -INFINITY;
          max_score = (sc[t] > max_score || sc[t] != sc[t]) ? sc[t] : max_score;
        }
        if (max_score == -INFINITY) {  // nothing visible (never for a valid tree): zeros, as SDPA gives
          std::fill(sc, sc + last, 0.0f);
        } else {
#pragma omp simd
          for (int64_t t = 0; t < last; ++t) sc[t] = exp_approx(sc[t] - max_score);  // 0 for the invisible (-inf)
          // The weights summed as a causal row sums them: only the visible entries, in order, contiguous. A tree
          // node then gets exactly the sum that decoding its path token by token gives (its siblings' and
          // cousins' entries between its ancestors would move the others between the sum's vector lanes).
          float total;
          if (visible != nullptr) {
            int64_t num_visible = 0;
            for (int64_t t = 0; t < last; ++t) {
              if (visible[t]) visible_weights[num_visible++] = sc[t];
            }
            total = sum_of(visible_weights.data(), num_visible);
          } else {
            total = sum_of(sc, last);
          }
          const float inv_total = 1.0f / total;
#pragma omp simd
          for (int64_t t = 0; t < last; ++t) sc[t] *= inv_total;
        }
        std::fill(sc + last, sc + seen, 0.0f);  // causal: the entries after this row's token
      }
      const float* vh = vp + g * vs0;
      for (int64_t c = 0; c < d_tiled; c += kPanelWidth) {
        panel_rows(scores.data(), t_pad, rows, seen, vh + c, vs1, tile.data() + c, d);
      }
      for (int64_t c = d_tiled; c < d; ++c) {  // a head_dim that is not a multiple of 32
        for (int j = 0; j < rows; ++j) {
          float s = 0.0f;  // mul_add, as the tiles: the compiler may not pick per loop shape
          for (int64_t t = 0; t < seen; ++t) s = mul_add(scores[j * t_pad + t], vh[t * vs1 + c], s);
          tile[j * d + c] = s;
        }
      }
      for (int j = 0; j < rows; ++j) {
        const int64_t r = (row0 + j) / group, h = g * group + (row0 + j) % group;
        std::copy(tile.data() + j * d, tile.data() + (j + 1) * d, op + (r * heads + h) * d);
      }
    }
  });
  return out;
}

torch::Tensor silu_and_mul(const torch::Tensor& gate_up) {
  TORCH_CHECK(gate_up.device().is_cpu() && gate_up.scalar_type() == torch::kFloat && gate_up.dim() == 2 &&
                  gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "silu_and_mul: a contiguous float32 [R, 2 I] expected");
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2;
  auto out = torch::empty({rows, n}, gate_up.options());
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = gate_up.data_ptr<float>() + r * 2 * n;
    const float* u = g + n;
    float* o = out.data_ptr<float>() + r * n;
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) o[i] = g[i] / (1.0f + exp_approx(-g[i])) * u[i];
  }
  return out;
}

}  // namespace

// The GIL is released while an op runs (as torch's own ops do): the Serve replica's event loop shares the process.
// Whether bfloat16 panels run on vdpbf16ps in this build; the portable loop is several times slower than float32
// panels (AVX2: 0.23-0.47x at 8-16 rows, benchmarks/bench_panel_dtype.py), so callers choose float32 panels then.
bool has_bf16_dot_products() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using release_gil = py::call_guard<py::gil_scoped_release>;
  m.def("panel_linear", &panel_linear, release_gil(),
        "y = x @ W (+ bias) (+ residual), W as [P, K, 32] float32 or bfloat16 panels");
  m.def("has_bf16_dot_products", &has_bf16_dot_products, "whether bf16 panels run on vdpbf16ps in this build");
  m.def("amx_tiles_ready", &amx_tiles_ready, "whether split panels run here: an AMX build, tiles granted by the OS");
  m.def("rms_norm", &rms_norm, release_gil(), "RMSNorm of float32 rows x [R, D] with weight [D]");
  m.def("attention_block", &attention_block, release_gil(), "one request's rotary + KV write + attention");
  m.def("silu_and_mul", &silu_and_mul, release_gil(), "silu(gate) * up of float32 rows [R, 2 I]");
}
