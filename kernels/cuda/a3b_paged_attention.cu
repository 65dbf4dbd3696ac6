// A3B paged decode attention in CUDA C++: one query token per sequence, GQA,
// K/V read from the A3B paged cache of kernels/kv_cache.py and dequantized in
// registers:
//   codes  uint8 [blocks, block_size, kv_heads, D/2]   low nibble = even channel
//   meta   fp16  [blocks, block_size, kv_heads, D/group, 3]   (lo, step, d)
//   value = lo + (code >> 1) * step + (code & 1 ? +d : -d)
// K/V were stored Hadamard-rotated: the caller passes the rotated float32
// query and rotates the merged output back. A thread block takes one (sequence, KV head, split of its pages);
// each warp walks every WARPS-th token of the split with all QG query heads of
// the KV head, each lane owning D/32 consecutive channels, and keeps its own
// online softmax. Every warp writes its (m, l, acc) as a partial; the caller
// merges partials (kernels/kv_cache.py merge_splits). Pure CUDA: the torch
// binding (a3b_ops.cpp) calls a3b_paged_decode_launch.
#include "a3b_kernels.h"

namespace {

constexpr int kWarp = 32;
constexpr int kWarps = 4;

// The kChannels values of one lane's channels of a cached K or V row.
template <int kChannels>
__device__ __forceinline__ void dequant_lane(const uint8_t* codes, const __half* meta, float* out) {
  const float lo = __half2float(meta[0]), st = __half2float(meta[1]), d = __half2float(meta[2]);
#pragma unroll
  for (int i = 0; i < kChannels; ++i) {
    const int code = (codes[i / 2] >> (4 * (i & 1))) & 0xF;
    out[i] = lo + (code >> 1) * st + ((code & 1) ? d : -d);
  }
}

template <int D, int QG>
__global__ void __launch_bounds__(kWarps* kWarp)
    a3b_paged_decode_kernel(const float* __restrict__ q, const uint8_t* __restrict__ k_codes,
                            const __half* __restrict__ k_meta, const uint8_t* __restrict__ v_codes,
                            const __half* __restrict__ v_meta,
                            const int32_t* __restrict__ block_tables, const int32_t* __restrict__ seq_lens,
                            float* __restrict__ m_out, float* __restrict__ l_out, float* __restrict__ acc_out,
                            int heads, int kv_heads, int group, int block_size, int max_pages, int pages_per_split,
                            float sm_scale) {
  constexpr int kChannels = D / kWarp;  // per lane: 2, 4 or 8, inside one group
  const int b = blockIdx.x, h = blockIdx.y, split = blockIdx.z;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int c0 = lane * kChannels;

  __shared__ float q_s[QG][D];
  for (int i = threadIdx.x; i < QG * D; i += blockDim.x) {
    const int g = i / D, c = i % D;
    q_s[g][c] = q[(static_cast<size_t>(b) * heads + h * QG + g) * D + c] * sm_scale;
  }
  __syncthreads();

  float m[QG], l[QG], acc[QG][kChannels];
#pragma unroll
  for (int g = 0; g < QG; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.f;
#pragma unroll
    for (int i = 0; i < kChannels; ++i) acc[g][i] = 0.f;
  }

  const int n = seq_lens[b];
  const int first = split * pages_per_split * block_size;
  const int last = min(n, (split + 1) * pages_per_split * block_size);
  const int groups = D / group;
  for (int t = first + warp; t < last; t += kWarps) {
    const int phys = block_tables[b * max_pages + t / block_size];
    const size_t row = (static_cast<size_t>(phys) * block_size + t % block_size) * kv_heads + h;
    const size_t meta = (row * groups + c0 / group) * 3;

    float key[kChannels], value[kChannels];
    dequant_lane<kChannels>(k_codes + row * (D / 2) + c0 / 2, k_meta + meta, key);
    float p[QG];
#pragma unroll
    for (int g = 0; g < QG; ++g) {
      float s = 0.f;
#pragma unroll
      for (int i = 0; i < kChannels; ++i) s += q_s[g][c0 + i] * key[i];
#pragma unroll
      for (int off = kWarp / 2; off > 0; off /= 2) s += __shfl_xor_sync(0xffffffffu, s, off);
      const float m_new = fmaxf(m[g], s);
      const float alpha = __expf(m[g] - m_new);
      p[g] = __expf(s - m_new);
      l[g] = l[g] * alpha + p[g];
      m[g] = m_new;
#pragma unroll
      for (int i = 0; i < kChannels; ++i) acc[g][i] *= alpha;
    }
    dequant_lane<kChannels>(v_codes + row * (D / 2) + c0 / 2, v_meta + meta, value);
#pragma unroll
    for (int i = 0; i < kChannels; ++i) {
#pragma unroll
      for (int g = 0; g < QG; ++g) acc[g][i] += p[g] * value[i];
    }
  }

  // partial index: [b, h, split * kWarps + warp, g]
  const size_t part = ((static_cast<size_t>(b) * kv_heads + h) * gridDim.z + split) * kWarps + warp;
#pragma unroll
  for (int g = 0; g < QG; ++g) {
    if (lane == 0) {
      m_out[part * QG + g] = m[g];
      l_out[part * QG + g] = l[g];
    }
#pragma unroll
    for (int i = 0; i < kChannels; ++i) acc_out[(part * QG + g) * D + c0 + i] = acc[g][i];
  }
}

template <int D, int QG>
cudaError_t launch(const float* q, const uint8_t* k_codes, const __half* k_meta, const uint8_t* v_codes,
                   const __half* v_meta, const int32_t* block_tables,
                   const int32_t* seq_lens, float* m_out, float* l_out, float* acc_out, int batch, int heads,
                   int kv_heads, int group, int block_size, int max_pages, int pages_per_split, int splits,
                   float sm_scale, cudaStream_t stream) {
  const dim3 grid(batch, kv_heads, splits);
  a3b_paged_decode_kernel<D, QG><<<grid, kWarps * kWarp, 0, stream>>>(
      q, k_codes, k_meta, v_codes, v_meta, block_tables, seq_lens, m_out, l_out, acc_out, heads, kv_heads,
      group, block_size, max_pages, pages_per_split, sm_scale);
  return cudaGetLastError();
}

template <int D>
cudaError_t launch_qg(int qg, const float* q, const uint8_t* k_codes, const __half* k_meta,
                      const uint8_t* v_codes, const __half* v_meta, const int32_t* block_tables, const int32_t* seq_lens, float* m_out, float* l_out,
                      float* acc_out, int batch, int heads, int kv_heads, int group, int block_size, int max_pages,
                      int pages_per_split, int splits, float sm_scale, cudaStream_t stream) {
  switch (qg) {
#define A3B_QG(n)                                                                                              \
  case n:                                                                                                      \
    return launch<D, n>(q, k_codes, k_meta, v_codes, v_meta, block_tables, seq_lens, m_out, l_out,    \
                        acc_out, batch, heads, kv_heads, group, block_size, max_pages, pages_per_split, splits, \
                        sm_scale, stream);
    A3B_QG(1) A3B_QG(2) A3B_QG(4) A3B_QG(8) A3B_QG(16)
#undef A3B_QG
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace

extern "C" int a3b_paged_decode_warps() { return kWarps; }

extern "C" cudaError_t a3b_paged_decode_launch(const float* q, const uint8_t* k_codes,
                                               const __half* k_meta, const uint8_t* v_codes, const __half* v_meta,
                                               const int32_t* block_tables,
                                               const int32_t* seq_lens, float* m_out, float* l_out, float* acc_out,
                                               int batch, int heads, int kv_heads, int head_dim, int group,
                                               int block_size, int max_pages, int pages_per_split, int splits,
                                               float sm_scale, cudaStream_t stream) {
  if (kv_heads <= 0 || heads % kv_heads != 0 || group <= 0 || head_dim % group != 0 ||
      group % (head_dim / kWarp) != 0)
    return cudaErrorInvalidValue;
  const int qg = heads / kv_heads;
  switch (head_dim) {
#define A3B_D(d)                                                                                               \
  case d:                                                                                                      \
    return launch_qg<d>(qg, q, k_codes, k_meta, v_codes, v_meta, block_tables, seq_lens, m_out, l_out, \
                        acc_out, batch, heads, kv_heads, group, block_size, max_pages, pages_per_split, splits, \
                        sm_scale, stream);
    A3B_D(64) A3B_D(128) A3B_D(256)
#undef A3B_D
    default:
      return cudaErrorInvalidValue;
  }
}
