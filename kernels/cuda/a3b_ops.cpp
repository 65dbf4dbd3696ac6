// torch binding for the CUDA A3B kernels (built by kernels/cuda/__init__.py
// with torch's extension tooling where torch has CUDA).
#include <ATen/cuda/CUDAContext.h>
#include <cuda_bf16.h>
#include <torch/extension.h>

extern "C" cudaError_t a3b_gemv_launch(const __nv_bfloat16* x, const uint8_t* packed, const int8_t* lo,
                                       const uint8_t* step, const uint8_t* delta, const __nv_bfloat16* lo_scale,
                                       const __nv_bfloat16* step_scale, float* y, int M, int N, int K,
                                       int n_kblocks, int group, cudaStream_t stream);

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
      group, at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "a3b_gemv launch: ", cudaGetErrorString(err));
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("a3b_gemv", &a3b_gemv, "A3B decode GEMV (float32 out)"); }
