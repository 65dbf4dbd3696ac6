// A3B decode GEMV in CUDA C++: y[M, N] = x[M, K] @ W^T for M <= 16 rows of
// activations, W read as packed 4-bit codes (two per byte, low nibble = even
// column) with per-block (1 x group) metadata (docs/a3b_format.md):
//   w = lo + (code >> 1) * step + (code & 1 ? +d : -d)
// One warp per output row; each lane streams 16 bytes (32 codes) at a time,
// so the weight is read once, in place, at full width, and x in 16-byte
// vectors (8 columns). Pure CUDA: the torch binding (a3b_ops.cpp) calls
// a3b_gemv_launch.
#include "a3b_kernels.h"

namespace {

constexpr int kWarp = 32;
constexpr int kCodesPerLoad = 32;  // one uint4 = 16 bytes = 32 codes

// float of the masked bits (< 2^23) without an int-to-float conversion, a
// quarter-rate instruction: the bits go into the mantissa of 2^23, which is
// then subtracted, exactly.
__device__ __forceinline__ float exact_float(uint32_t bits) {
  return __uint_as_float(bits | 0x4B000000u) - 8388608.f;
}

// The block's table as w = a + code * b + (code & 1) * c (the format's
// formula regrouped), applied to the four codes in the low 16 bits of `h`:
// each code is read in place, 16^i times larger, so it costs two masks, two
// subtractions and two multiply-adds.
__device__ __forceinline__ void four_values(uint32_t h, float a, float b, float c, float* w) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float scale = 1.f / static_cast<float>(1u << (4 * i));
    w[i] = a + exact_float(h & (0xFu << (4 * i))) * (b * scale) + exact_float(h & (0x1u << (4 * i))) * (c * scale);
  }
}

__device__ __forceinline__ float bf16_low(uint32_t pair) { return __uint_as_float(pair << 16); }
__device__ __forceinline__ float bf16_high(uint32_t pair) { return __uint_as_float(pair & 0xFFFF0000u); }

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
  // 16-byte vectors of codes and of x where every row starts on a 16-byte boundary
  const bool vectors = ((reinterpret_cast<uintptr_t>(codes) | reinterpret_cast<uintptr_t>(x)) & 15) == 0 &&
                       K % 8 == 0;
  float acc[M];
#pragma unroll
  for (int m = 0; m < M; ++m) acc[m] = 0.f;

#pragma unroll 2
  for (int k0 = lane * kCodesPerLoad; k0 < K; k0 += kWarp * kCodesPerLoad) {
    // a 32-code chunk never straddles a block: groups are multiples of 32
    const size_t meta = static_cast<size_t>(row) * n_kblocks + k0 / group;
    const float st = step[meta] * sts;
    const float d = st * delta[meta] * (1.f / 255.f);
    const float a = lo[meta] * los - d, b = 0.5f * st, c = 2.f * d - 0.5f * st;
    if (vectors && k0 + kCodesPerLoad <= K) {
      const uint4 raw = *reinterpret_cast<const uint4*>(codes + k0 / 2);
      const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {  // word i: codes k0 + 8i .. k0 + 8i + 7
        float w[8];
        four_values(words[i], a, b, c, w);
        four_values(words[i] >> 16, a, b, c, w + 4);
#pragma unroll
        for (int m = 0; m < M; ++m) {
          const uint4 xv = *reinterpret_cast<const uint4*>(x + static_cast<size_t>(m) * K + k0 + 8 * i);
          acc[m] += bf16_low(xv.x) * w[0] + bf16_high(xv.x) * w[1] + bf16_low(xv.y) * w[2] +
                    bf16_high(xv.y) * w[3] + bf16_low(xv.z) * w[4] + bf16_high(xv.z) * w[5] +
                    bf16_low(xv.w) * w[6] + bf16_high(xv.w) * w[7];
        }
      }
    } else {
      for (int i = 0; i < 16 && k0 + 2 * i < K; ++i) {
        const int k = k0 + 2 * i;
        float w[4];
        four_values(codes[k0 / 2 + i], a, b, c, w);  // w[0], w[1]: this byte's two codes
        for (int m = 0; m < M; ++m) {
          acc[m] += __bfloat162float(x[m * K + k]) * w[0];
          if (k + 1 < K) acc[m] += __bfloat162float(x[m * K + k + 1]) * w[1];
        }
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
