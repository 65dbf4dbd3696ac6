// A3B linear on the CPU, reading the 4-bit codes in place.
//
// A weight w = lo + k*step + (s ? +d : -d) with code c = (k << 1) | s, so per
// block  sum_i x_i w_i = (lo - d) * sum_i x_i + step * sum_i x_i k_i + 2d * sum_i x_i s_i.
// Per block the codes are unpacked once into k and s lanes and reused for every
// row of x; the block sums of x are computed once per call.  Metadata stays in
// its stored (double-quantized) form and is decoded per block.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <vector>

namespace {

struct Meta {
  const uint8_t* packed;
  const int8_t* lo;
  const uint8_t* step;
  const uint8_t* delta;
  const at::BFloat16* lo_scale;
  const at::BFloat16* step_scale;
  int64_t n, k, kp, nbc, rows, cols;
};

Meta meta_of(const torch::Tensor& packed, const torch::Tensor& lo, const torch::Tensor& step,
             const torch::Tensor& delta, const torch::Tensor& lo_scale, const torch::Tensor& step_scale,
             int64_t in_features, int64_t rows, int64_t cols) {
  TORCH_CHECK(packed.dtype() == torch::kUInt8 && packed.is_contiguous(), "a3b: packed codes must be contiguous uint8");
  TORCH_CHECK(lo.dtype() == torch::kInt8 && step.dtype() == torch::kUInt8 && delta.dtype() == torch::kUInt8,
              "a3b: metadata dtypes must be int8/uint8/uint8");
  TORCH_CHECK(lo_scale.dtype() == torch::kBFloat16 && step_scale.dtype() == torch::kBFloat16,
              "a3b: row scales must be bf16");
  TORCH_CHECK(cols % 2 == 0 && rows >= 1, "a3b: block columns must be even");
  const int64_t n = packed.size(0);
  const int64_t nbc = (in_features + cols - 1) / cols;
  TORCH_CHECK(packed.size(1) == (in_features + 1) / 2, "a3b: codes have ", packed.size(1),
              " bytes per row for ", in_features, " inputs");
  TORCH_CHECK(lo.size(0) == (n + rows - 1) / rows && lo.size(1) == nbc, "a3b: metadata is ", lo.size(0), "x",
              lo.size(1), " blocks, expected ", (n + rows - 1) / rows, "x", nbc);
  return Meta{packed.data_ptr<uint8_t>(), lo.contiguous().data_ptr<int8_t>(), step.contiguous().data_ptr<uint8_t>(),
              delta.contiguous().data_ptr<uint8_t>(), lo_scale.data_ptr<at::BFloat16>(),
              step_scale.data_ptr<at::BFloat16>(), n, in_features, packed.size(1), nbc, rows, cols};
}

// (lo - d, step, 2d) of block (row n, block column b), decoded from the stored bytes.
inline void block_table(const Meta& m, int64_t row, int64_t b, float& base, float& step, float& d2) {
  const int64_t rb = row / m.rows;
  const int64_t idx = rb * m.nbc + b;
  const float lo = float(m.lo[idx]) * float(m.lo_scale[rb]);
  step = float(m.step[idx]) * float(m.step_scale[rb]);
  const float d = step * float(m.delta[idx]) / 255.0f;
  base = lo - d;
  d2 = 2.0f * d;
}

}  // namespace

// y[M, N] = x[M, K] @ W^T, fp32 accumulation.  For small M (decode).
torch::Tensor a3b_linear(const torch::Tensor& x_in, const torch::Tensor& packed, const torch::Tensor& lo,
                         const torch::Tensor& step, const torch::Tensor& delta, const torch::Tensor& lo_scale,
                         const torch::Tensor& step_scale, int64_t rows, int64_t cols) {
  const torch::Tensor x = x_in.to(torch::kFloat32).contiguous();
  TORCH_CHECK(x.dim() == 2, "a3b: x must be 2-D");
  const int64_t M = x.size(0), K = x.size(1);
  const Meta m = meta_of(packed, lo, step, delta, lo_scale, step_scale, K, rows, cols);
  const float* xp = x.data_ptr<float>();
  // Block sums of x, shared by every output row.
  std::vector<float> xsum(M * m.nbc, 0.0f);
  for (int64_t r = 0; r < M; ++r)
    for (int64_t i = 0; i < K; ++i) xsum[r * m.nbc + i / cols] += xp[r * K + i];
  torch::Tensor y = torch::empty({M, m.n}, x.options());
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, m.n, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> kf(cols), sf(cols), acc(M);
    for (int64_t row = begin; row < end; ++row) {
      std::fill(acc.begin(), acc.end(), 0.0f);
      const uint8_t* codes = m.packed + row * m.kp;
      for (int64_t b = 0; b < m.nbc; ++b) {
        const int64_t c0 = b * cols, width = std::min(cols, K - c0);
        const uint8_t* bytes = codes + c0 / 2;
#pragma omp simd
        for (int64_t j = 0; j < cols / 2; ++j) {
          const uint8_t v = bytes[j < (width + 1) / 2 ? j : 0];
          kf[2 * j] = float((v >> 1) & 7);
          sf[2 * j] = float(v & 1);
          kf[2 * j + 1] = float(v >> 5);
          sf[2 * j + 1] = float((v >> 4) & 1);
        }
        float base, st, d2;
        block_table(m, row, b, base, st, d2);
        for (int64_t r = 0; r < M; ++r) {
          const float* xr = xp + r * K + c0;
          float dot_k = 0.0f, dot_s = 0.0f;
#pragma omp simd reduction(+ : dot_k, dot_s)
          for (int64_t i = 0; i < width; ++i) {
            dot_k += xr[i] * kf[i];
            dot_s += xr[i] * sf[i];
          }
          acc[r] += base * xsum[r * m.nbc + b] + st * dot_k + d2 * dot_s;
        }
      }
      for (int64_t r = 0; r < M; ++r) yp[r * m.n + row] = acc[r];
    }
  });
  return y;
}

// W[N, K] in `dtype`: the whole weight, for large M (prefill), where one
// dequantize plus a GEMM beats re-reading codes per row of x.
torch::Tensor a3b_dequantize(const torch::Tensor& packed, const torch::Tensor& lo, const torch::Tensor& step,
                             const torch::Tensor& delta, const torch::Tensor& lo_scale,
                             const torch::Tensor& step_scale, int64_t in_features, int64_t rows, int64_t cols) {
  const Meta m = meta_of(packed, lo, step, delta, lo_scale, step_scale, in_features, rows, cols);
  torch::Tensor w = torch::empty({m.n, m.k}, torch::TensorOptions().dtype(torch::kFloat32));
  float* wp = w.data_ptr<float>();
  at::parallel_for(0, m.n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const uint8_t* codes = m.packed + row * m.kp;
      for (int64_t b = 0; b < m.nbc; ++b) {
        float base, st, d2;
        block_table(m, row, b, base, st, d2);
        const int64_t c0 = b * cols, c1 = std::min(cols * (b + 1), m.k);
        for (int64_t i = c0; i < c1; ++i) {
          const uint8_t c = (codes[i / 2] >> ((i & 1) * 4)) & 15;
          wp[row * m.k + i] = base + st * float(c >> 1) + d2 * float(c & 1);
        }
      }
    }
  });
  return w;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("a3b_linear", &a3b_linear, "A3B linear, codes read in place (small batches)");
  module.def("a3b_dequantize", &a3b_dequantize, "A3B weight -> float32");
}
