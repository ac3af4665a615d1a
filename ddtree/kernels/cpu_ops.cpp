// Native CPU ops for single-token decode, float32: a one-row GEMV, RMSNorm, the attention block, SiLU-and-mul.
//
// A decode step reads every weight once, so its GEMVs should stream the weights at the memory's read rate. torch's
// default CPU GEMV (MKL) reaches 12-15 GB/s on this project's narrow or square matrices (o_proj, down_proj, fused
// q/k/v) where a plain read stream runs at ~28 GB/s on one core; these loops keep every weight access sequential and
// reach 20-26 GB/s on all of them (benchmarks/bench_gemm.py). Plain C++ with `omp simd`: the compiler vectorises for
// the CPU it builds on (the extension is built on first use, on the machine that runs it).
//
//   gemv(x [K], w, add or empty) -> y [N] = x @ W (+ add), where w is either
//     [K, N] contiguous (W itself, "in x out": rows of W scaled by x[i] and summed, 16 rows per pass), or
//     [K, N] the transpose of a contiguous [N, K] matrix ("out x in": one dot product per output).
// Threads (torch's intra-op pool, at::get_num_threads()): "in x out" splits the K rows (each thread its own
// contiguous slab of W and its own partial sum, added at the end); "out x in" splits the N outputs.
//
//   rms_norm(x [R, D], weight [D], eps) -> x / sqrt(mean(x^2) + eps) * weight, per row. At one token torch's
//   rms_norm costs ~30 us per call here (several small kernels), 61 calls per step; this loop costs ~1 us.
//
//   decode_attention(qkv [q + 2 kv], cos [D], sin [D], k [kv_heads, T, D], v [kv_heads, T, D], heads) -> [heads * D]:
//   one token's attention block after its q/k/v projection: rotary embedding of q and k (rotate-half convention),
//   its k and v written into entry T - 1 of the cache views, softmax(q k^T / sqrt(D)) v over all T entries
//   (grouped-query heads share a kv head). k and v may be strided views of the KV pool (unit stride along D). Done
//   with torch ops this is ~12 small kernels and one SDPA call (~50 us alone at 128 entries) per layer.
//
//   silu_and_mul(gate_up [2 I]) -> silu(gate_up[:I]) * gate_up[I:], the MLP's activation.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

constexpr int64_t kRowsPerPass = 16;

// y[0:n] = sum over rows i in [k0, k1) of x[i] * w[i, 0:n]  (w row-major with n columns)
void rows_times_x(const float* x, const float* w, float* y, int64_t k0, int64_t k1, int64_t n) {
  std::fill(y, y + n, 0.0f);
  int64_t i = k0;
  for (; i + kRowsPerPass <= k1; i += kRowsPerPass) {
    const float* wi = w + i * n;
    float a[kRowsPerPass];
    for (int r = 0; r < kRowsPerPass; ++r) a[r] = x[i + r];
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) {
      float s = y[j];
      for (int r = 0; r < kRowsPerPass; ++r) s += a[r] * wi[r * n + j];
      y[j] = s;
    }
  }
  for (; i < k1; ++i) {
    const float a = x[i];
    const float* wi = w + i * n;
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) y[j] += a * wi[j];
  }
}

// y[j] = dot(w[j, 0:k], x) for j in [n0, n1)  (w row-major with k columns)
void dots(const float* x, const float* w, float* y, int64_t n0, int64_t n1, int64_t k) {
  for (int64_t j = n0; j < n1; ++j) {
    const float* wj = w + j * k;
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < k; ++i) s += wj[i] * x[i];
    y[j] = s;
  }
}

torch::Tensor gemv(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& add) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "gemv: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == torch::kFloat && w.scalar_type() == torch::kFloat, "gemv: float32 only");
  TORCH_CHECK(w.dim() == 2 && x.dim() == 1 && x.size(0) == w.size(0), "gemv: x [K] and w [K, N] expected");
  TORCH_CHECK(x.is_contiguous(), "gemv: x must be contiguous");
  const int64_t k = w.size(0), n = w.size(1);
  const bool in_out = w.is_contiguous();
  TORCH_CHECK(in_out || w.t().is_contiguous(), "gemv: w must be contiguous or the transpose of a contiguous matrix");
  const bool has_add = add.defined() && add.numel() > 0;
  if (has_add) {
    TORCH_CHECK(add.scalar_type() == torch::kFloat && add.is_contiguous() && add.numel() == n,
                "gemv: add must be a contiguous float32 [N]");
  }
  auto y = torch::empty({n}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t num_threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), k / kRowsPerPass));
  if (in_out) {
    if (num_threads == 1) {
      rows_times_x(xp, wp, yp, 0, k, n);
    } else {
      std::vector<float> partial(num_threads * n);
      at::parallel_for(0, num_threads, 1, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
          // slabs on whole passes, so that every thread runs the 16-row loop
          const int64_t passes = k / kRowsPerPass;
          const int64_t k0 = passes * t / num_threads * kRowsPerPass;
          const int64_t k1 = t + 1 == num_threads ? k : passes * (t + 1) / num_threads * kRowsPerPass;
          rows_times_x(xp, wp, partial.data() + t * n, k0, k1, n);
        }
      });
      std::copy(partial.begin(), partial.begin() + n, yp);
      for (int64_t t = 1; t < num_threads; ++t) {
        const float* pt = partial.data() + t * n;
#pragma omp simd
        for (int64_t j = 0; j < n; ++j) yp[j] += pt[j];
      }
    }
  } else {
    at::parallel_for(0, n, std::max<int64_t>(1, n / num_threads),
                     [&](int64_t begin, int64_t end) { dots(xp, wp, yp, begin, end, k); });
  }
  if (has_add) {
    const float* ap = add.data_ptr<float>();
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) yp[j] += ap[j];
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

torch::Tensor decode_attention(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                               const torch::Tensor& k, const torch::Tensor& v, int64_t heads) {
  for (const auto* t : {&qkv, &cos, &sin, &k, &v}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == torch::kFloat, "decode_attention: float32 CPU tensors");
  }
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes(), "decode_attention: k and v [kv_heads, T, D] expected");
  const int64_t kv_heads = k.size(0), t_len = k.size(1), d = k.size(2);
  TORCH_CHECK(t_len > 0 && d % 2 == 0, "decode_attention: T > 0 entries and an even head_dim expected");
  TORCH_CHECK(heads > 0 && heads % kv_heads == 0, "decode_attention: heads must be a multiple of kv_heads");
  TORCH_CHECK(qkv.dim() == 1 && qkv.is_contiguous() && qkv.numel() == (heads + 2 * kv_heads) * d,
              "decode_attention: qkv [(heads + 2 kv_heads) * D] contiguous expected");
  TORCH_CHECK(cos.numel() == d && sin.numel() == d && cos.is_contiguous() && sin.is_contiguous(),
              "decode_attention: cos and sin [D] contiguous expected");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1, "decode_attention: unit stride along D expected");
  const int64_t group = heads / kv_heads, half = d / 2;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const float* in = qkv.data_ptr<float>();
  const float* c = cos.data_ptr<float>();
  const float* sn = sin.data_ptr<float>();
  float* kp = k.data_ptr<float>();
  float* vp = v.data_ptr<float>();
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), vs0 = v.stride(0), vs1 = v.stride(1);
  // rotary: out[i] = x[i] cos[i] + rotate_half(x)[i] sin[i], rotate_half(x) = (-x[half:], x[:half])
  auto rope = [&](const float* x, float* out) {
    for (int64_t i = 0; i < half; ++i) out[i] = x[i] * c[i] - x[i + half] * sn[i];
    for (int64_t i = half; i < d; ++i) out[i] = x[i] * c[i] + x[i - half] * sn[i];
  };
  std::vector<float> q_roped(heads * d);
  for (int64_t h = 0; h < heads; ++h) rope(in + h * d, q_roped.data() + h * d);
  for (int64_t g = 0; g < kv_heads; ++g) {
    rope(in + (heads + g) * d, kp + g * ks0 + (t_len - 1) * ks1);
    const float* vin = in + (heads + kv_heads + g) * d;
    std::copy(vin, vin + d, vp + g * vs0 + (t_len - 1) * vs1);
  }
  auto out = torch::empty({heads * d}, qkv.options());
  float* op = out.data_ptr<float>();
  std::vector<float> scores(t_len);
  for (int64_t h = 0; h < heads; ++h) {
    const float* qh = q_roped.data() + h * d;
    const float* kh = kp + (h / group) * ks0;
    const float* vh = vp + (h / group) * vs0;
    float max_score = -INFINITY;
    for (int64_t t = 0; t < t_len; ++t) {
      const float* kt = kh + t * ks1;
      float s = 0.0f;
#pragma omp simd reduction(+ : s)
      for (int64_t i = 0; i < d; ++i) s += qh[i] * kt[i];
      scores[t] = s * scale;
      max_score = std::max(max_score, scores[t]);
    }
    float total = 0.0f;
    for (int64_t t = 0; t < t_len; ++t) {
      scores[t] = std::exp(scores[t] - max_score);
      total += scores[t];
    }
    float* oh = op + h * d;
    std::fill(oh, oh + d, 0.0f);
    for (int64_t t = 0; t < t_len; ++t) {
      const float* vt = vh + t * vs1;
      const float p = scores[t] / total;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) oh[i] += p * vt[i];
    }
  }
  return out;
}

torch::Tensor silu_and_mul(const torch::Tensor& gate_up) {
  TORCH_CHECK(gate_up.device().is_cpu() && gate_up.scalar_type() == torch::kFloat && gate_up.dim() == 1 &&
                  gate_up.is_contiguous() && gate_up.numel() % 2 == 0,
              "silu_and_mul: a contiguous float32 [2 I] expected");
  const int64_t n = gate_up.numel() / 2;
  auto out = torch::empty({n}, gate_up.options());
  const float* g = gate_up.data_ptr<float>();
  const float* u = g + n;
  float* o = out.data_ptr<float>();
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) o[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gemv", &gemv, "y = x @ w (+ add) for one float32 row x; w [K, N] contiguous or transposed-contiguous");
  m.def("rms_norm", &rms_norm, "RMSNorm of float32 rows x [R, D] with weight [D]");
  m.def("decode_attention", &decode_attention, "one token's rotary + KV write + attention, float32");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up of a float32 [2 I] vector");
}
