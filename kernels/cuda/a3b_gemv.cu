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

// The table value of the code in bits 16..19 of `shifted`, as base + code *
// code_scale + (code & 1) * bit_scale (see TableTerms): the masked bits OR-ed
// into the bits of 1.0f make 1 + code / 128, and the 1.0s are folded into
// base, so each term is one mask and one multiply-add (no int-to-float
// conversion, a quarter-rate instruction), within about 2^-14 of a step
// (float32 roundings of terms up to ~260 steps).
__device__ __forceinline__ float code_value(uint32_t shifted, float base, float code_scale, float bit_scale) {
  const float code = __uint_as_float((shifted & 0xF0000u) | 0x3F800000u);
  const float bit = __uint_as_float((shifted & 0x10000u) | 0x3F800000u);
  return fmaf(bit, bit_scale, fmaf(code, code_scale, base));
}

// lo + (code >> 1) * step + (2 * (code & 1) - 1) * d is a + code * b + (code & 1) * c
// with a = lo - d, b = step / 2, c = 2 d - step / 2; code_value's terms for them.
struct TableTerms {
  float base, code_scale, bit_scale;
  __device__ __forceinline__ TableTerms(float lo, float step, float d)
      : code_scale(64.f * step), bit_scale(256.f * d - 64.f * step) {
    base = lo - d - code_scale - bit_scale;
  }
  // the value of the code in bits 16..19 of `shifted`
  __device__ __forceinline__ float value(uint32_t shifted) const {
    return code_value(shifted, base, code_scale, bit_scale);
  }
  // the 8 codes of a word, code j in bits 4j..4j+3
  __device__ __forceinline__ void word(uint32_t w, float* out) const {
    out[0] = value(w << 16);
    out[1] = value(w << 12);
    out[2] = value(w << 8);
    out[3] = value(w << 4);
    out[4] = value(w);
    out[5] = value(w >> 4);
    out[6] = value(w >> 8);
    out[7] = value(w >> 12);
  }
};

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
    const TableTerms table(lo[meta] * los, st, st * delta[meta] * (1.f / 255.f));
    if (vectors && k0 + kCodesPerLoad <= K) {
      const uint4 raw = *reinterpret_cast<const uint4*>(codes + k0 / 2);
      const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {  // word i: codes k0 + 8i .. k0 + 8i + 7
        float w[8];
        table.word(words[i], w);
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
        const uint32_t byte = codes[k0 / 2 + i];
        const float w_even = table.value(byte << 16), w_odd = table.value(byte << 12);
        for (int m = 0; m < M; ++m) {
          acc[m] += __bfloat162float(x[m * K + k]) * w_even;
          if (k + 1 < K) acc[m] += __bfloat162float(x[m * K + k + 1]) * w_odd;
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
