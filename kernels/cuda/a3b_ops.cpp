// torch binding for the CUDA A3B kernels (built by kernels/cuda/__init__.py
// with torch's extension tooling where torch has CUDA).
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include "a3b_kernels.h"

torch::Tensor a3b_gemv(torch::Tensor x, torch::Tensor packed, torch::Tensor lo, torch::Tensor step,
                       torch::Tensor delta, torch::Tensor lo_scale, torch::Tensor step_scale, int64_t group) {
  TORCH_CHECK(x.is_cuda() && x.scalar_type() == at::kBFloat16 && x.dim() == 2, "x: 2-D bf16 CUDA tensor");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= 16, "x: 1..16 rows (decode); use the GEMM above that");
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0);
  TORCH_CHECK(packed.size(1) == (K + 1) / 2, "packed: [N, ceil(K/2)] codes for K = ", K);
  auto xc = x.contiguous();
  auto y = torch::empty({M, N}, x.options().dtype(torch::kFloat32));
  const cudaError_t err = a3b_gemv_launch(
      reinterpret_cast<const __nv_bfloat16*>(xc.data_ptr()), packed.data_ptr<uint8_t>(), lo.data_ptr<int8_t>(),
      step.data_ptr<uint8_t>(), delta.data_ptr<uint8_t>(),
      reinterpret_cast<const __nv_bfloat16*>(lo_scale.data_ptr()),
      reinterpret_cast<const __nv_bfloat16*>(step_scale.data_ptr()), y.data_ptr<float>(), M, N, K, lo.size(1),
      group, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "a3b_gemv launch: ", cudaGetErrorString(err));
  return y;
}

// Split-K partials (m, l, acc) of A3B paged decode attention; merged by the caller.
std::vector<torch::Tensor> a3b_paged_decode(torch::Tensor q, torch::Tensor k_codes, torch::Tensor k_meta,
                                            torch::Tensor v_codes, torch::Tensor v_meta, torch::Tensor block_tables,
                                            torch::Tensor seq_lens, int64_t pages_per_split, double sm_scale) {
  TORCH_CHECK(q.is_cuda() && q.scalar_type() == at::kFloat && q.dim() == 3, "q: [batch, heads, D] float32 CUDA");
  TORCH_CHECK(k_codes.scalar_type() == at::kByte && k_codes.dim() == 4, "k_codes: uint8 [blocks, bs, kv_heads, D/2]");
  TORCH_CHECK(k_meta.scalar_type() == at::kHalf && k_meta.dim() == 5, "k_meta: fp16 [blocks, bs, kv_heads, G, 3]");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt, "int32 tables/lens");
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t block_size = k_codes.size(1), kv_heads = k_codes.size(2), groups = k_meta.size(3);
  const int64_t max_pages = block_tables.size(1);
  const int64_t splits = (max_pages + pages_per_split - 1) / pages_per_split;
  const int64_t qg = heads / kv_heads, parts = splits * a3b_paged_decode_warps();
  auto f32 = q.options().dtype(torch::kFloat32);
  auto m = torch::empty({batch, kv_heads, parts, qg}, f32);
  auto l = torch::empty({batch, kv_heads, parts, qg}, f32);
  auto acc = torch::empty({batch, kv_heads, parts, qg, dim}, f32);
  auto qc = q.contiguous();
  const cudaError_t err = a3b_paged_decode_launch(
      qc.data_ptr<float>(), k_codes.data_ptr<uint8_t>(), reinterpret_cast<const __half*>(k_meta.data_ptr()),
      v_codes.data_ptr<uint8_t>(), reinterpret_cast<const __half*>(v_meta.data_ptr()), block_tables.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(), m.data_ptr<float>(), l.data_ptr<float>(),
      acc.data_ptr<float>(), batch, heads, kv_heads, dim, dim / groups, block_size, max_pages, pages_per_split,
      splits, static_cast<float>(sm_scale), c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "a3b_paged_decode launch: ", cudaGetErrorString(err),
              " (head_dim 64/128/256, 1/2/4/8/16 query heads per KV head)");
  return {m, l, acc};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("a3b_gemv", &a3b_gemv, "A3B decode GEMV (float32 out)");
  m.def("a3b_paged_decode", &a3b_paged_decode, "A3B paged decode attention, split-K partials");
}
