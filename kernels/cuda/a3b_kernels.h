// Host entry points of the CUDA A3B kernels (pure CUDA, no torch): the .cu
// files define them, the torch binding (a3b_ops.cpp) calls them.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <cstdint>

// Decode GEMV y[M, N] = x[M, K] @ W^T, M in 1..16; group a multiple of 32.
// Returns cudaErrorInvalidValue otherwise.
extern "C" cudaError_t a3b_gemv_launch(const __nv_bfloat16* x, const uint8_t* packed, const int8_t* lo,
                                       const uint8_t* step, const uint8_t* delta, const __nv_bfloat16* lo_scale,
                                       const __nv_bfloat16* step_scale, float* y, int M, int N, int K,
                                       int n_kblocks, int group, cudaStream_t stream);

// Warps per thread block of the paged decode attention: each writes a partial,
// so there are splits * a3b_paged_decode_warps() partials per (sequence, KV head).
extern "C" int a3b_paged_decode_warps();

// Paged decode attention on the A3B KV cache, split-K partials (m, l, acc);
// q is the rotated float32 query. head_dim in {64, 128, 256}, query heads per
// KV head in {1, 2, 4, 8, 16}, group a multiple of head_dim / 32 dividing
// head_dim. Returns cudaErrorInvalidValue otherwise.
extern "C" cudaError_t a3b_paged_decode_launch(const float* q, const uint8_t* k_codes, const __half* k_meta,
                                               const uint8_t* v_codes, const __half* v_meta,
                                               const int32_t* block_tables, const int32_t* seq_lens, float* m_out,
                                               float* l_out, float* acc_out, int batch, int heads, int kv_heads,
                                               int head_dim, int group, int block_size, int max_pages,
                                               int pages_per_split, int splits, float sm_scale,
                                               cudaStream_t stream);
