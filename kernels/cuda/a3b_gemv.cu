// A3B decode GEMV in CUDA C++: y[M, N] = x[M, K] @ W^T for M <= 16 rows of
// activations, W read as packed 4-bit codes (two per byte, low nibble = even
// column) with per-block (1 x group) metadata (docs/a3b_format.md):
//   w = lo + (code >> 1) * step + (code & 1 ? +d : -d)
// One warp per output row; each lane streams 16 bytes (32 codes) at a time,
// so the weight is read once, in place, at full width. Pure CUDA: the torch
// binding (a3b_ops.cpp) calls a3b_gemv_launch.
#include "a3b_kernels.h"

namespace {

constexpr int kWarp = 32;
constexpr int kCodesPerLoad = 32;  // one uint4 = 16 bytes = 32 codes

template <int M>
__global__ void a3b_gemv_kernel(const __nv_bfloat16* __restrict__ x, const uint8_t* __restrict__ packed,
                                const int8_t* __restrict__ lo, const uint8_t* __restrict__ step,
                                const uint8_t* __restrict__ delta, const __nv_bfloat16* __restrict__ lo_scale,
                                const __nv_bfloat16* __restrict__ step_scale, float* __restrict__ y,
                                int N, int K, int n_kblocks, int group) {
  const int row = blockIdx.x * (blockDim.x / kWarp) + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (row >= N) return;
  const float los = __bfloat162float(lo_scale[row]);
  const float sts = __bfloat162float(step_scale[row]);
  const uint8_t* codes = packed + static_cast<size_t>(row) * ((K + 1) / 2);
  float acc[M];
#pragma unroll
  for (int m = 0; m < M; ++m) acc[m] = 0.f;

  for (int k0 = lane * kCodesPerLoad; k0 < K; k0 += kWarp * kCodesPerLoad) {
    // a 32-code chunk never straddles a block: groups are multiples of 32
    const int kb = k0 / group;
    const float base = lo[row * n_kblocks + kb] * los;
    const float st = step[row * n_kblocks + kb] * sts;
    const float d = st * delta[row * n_kblocks + kb] * (1.f / 255.f);
    uint8_t bytes[16];
    if (k0 + kCodesPerLoad <= K && ((reinterpret_cast<uintptr_t>(codes + k0 / 2) & 15) == 0)) {
      *reinterpret_cast<uint4*>(bytes) = *reinterpret_cast<const uint4*>(codes + k0 / 2);
    } else {
#pragma unroll
      for (int i = 0; i < 16; ++i) bytes[i] = (k0 + 2 * i < K) ? codes[k0 / 2 + i] : 0;
    }
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const int k = k0 + 2 * i;
      const int c0 = bytes[i] & 0xF, c1 = bytes[i] >> 4;
      const float w0 = base + (c0 >> 1) * st + ((c0 & 1) ? d : -d);
      const float w1 = base + (c1 >> 1) * st + ((c1 & 1) ? d : -d);
#pragma unroll
      for (int m = 0; m < M; ++m) {
        if (k < K) acc[m] += __bfloat162float(x[m * K + k]) * w0;
        if (k + 1 < K) acc[m] += __bfloat162float(x[m * K + k + 1]) * w1;
      }
    }
  }
#pragma unroll
  for (int m = 0; m < M; ++m) {
    float v = acc[m];
#pragma unroll
    for (int off = kWarp / 2; off > 0; off /= 2) v += __shfl_xor_sync(0xffffffffu, v, off);
    if (lane == 0) y[m * N + row] = v;
  }
}

template <int M>
cudaError_t launch(const __nv_bfloat16* x, const uint8_t* packed, const int8_t* lo, const uint8_t* step,
                   const uint8_t* delta, const __nv_bfloat16* lo_scale, const __nv_bfloat16* step_scale, float* y,
                   int N, int K, int n_kblocks, int group, cudaStream_t stream) {
  constexpr int kWarpsPerBlock = 4;
  const dim3 grid((N + kWarpsPerBlock - 1) / kWarpsPerBlock);
  a3b_gemv_kernel<M><<<grid, kWarpsPerBlock * kWarp, 0, stream>>>(x, packed, lo, step, delta, lo_scale,
                                                                   step_scale, y, N, K, n_kblocks, group);
  return cudaGetLastError();
}

}  // namespace

extern "C" cudaError_t a3b_gemv_launch(const __nv_bfloat16* x, const uint8_t* packed, const int8_t* lo,
                                       const uint8_t* step, const uint8_t* delta, const __nv_bfloat16* lo_scale,
                                       const __nv_bfloat16* step_scale, float* y, int M, int N, int K,
                                       int n_kblocks, int group, cudaStream_t stream) {
  if (group % kCodesPerLoad != 0) return cudaErrorInvalidValue;
  switch (M) {
#define A3B_CASE(m) \
  case m:           \
    return launch<m>(x, packed, lo, step, delta, lo_scale, step_scale, y, N, K, n_kblocks, group, stream);
    A3B_CASE(1) A3B_CASE(2) A3B_CASE(3) A3B_CASE(4) A3B_CASE(5) A3B_CASE(6) A3B_CASE(7) A3B_CASE(8)
    A3B_CASE(9) A3B_CASE(10) A3B_CASE(11) A3B_CASE(12) A3B_CASE(13) A3B_CASE(14) A3B_CASE(15) A3B_CASE(16)
#undef A3B_CASE
    default:
      return cudaErrorInvalidValue;
  }
}
