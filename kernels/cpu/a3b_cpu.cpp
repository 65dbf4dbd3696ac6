// A3B linear on the CPU, reading the 4-bit codes in place.
//
// Each block is a 16-entry value table (docs/a3b_format.md), decoded per block
// from the stored double-quantized metadata. With AVX-512 the whole table sits
// in one register and 16 weights' values are one permute on their codes; with
// AVX2 8 weights take two 8-lane permutes and a blend. Either way the values
// are reused for every row of x; other CPUs take the scalar loop.
//
// Blocks 128 columns wide (or a multiple), the default, take a faster AVX-512
// path in a3b_linear: 64 code bytes are loaded as 16 dwords of 8 codes each,
// and since the permute reads only an index's low 4 bits, a shift by 4k picks
// code k of every dword with no unpacking. That yields columns 8j + k
// (j = 0..15) together, so x is reordered once per call to match.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#define A3B_SIMD 1
#endif

#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kMaxRows = 8;  // FUSED_MAX_ROWS in __init__.py

// The widest float vector the build targets, and the few operations on it the kernel uses.
#if defined(__AVX512F__)
using VecF = __m512;
constexpr int kLanes = 16;
inline VecF vzero() { return _mm512_setzero_ps(); }
inline VecF vload(const float* p) { return _mm512_loadu_ps(p); }
inline VecF vfma(VecF a, VecF b, VecF c) { return _mm512_fmadd_ps(a, b, c); }
inline VecF vadd(VecF a, VecF b) { return _mm512_add_ps(a, b); }
inline void vstore(float* p, VecF a) { _mm512_storeu_ps(p, a); }
inline float vsum(VecF a) { return _mm512_reduce_add_ps(a); }
// Each lane rounded to the nearest bf16 (even on ties) and widened back: the
// integer form of torch's float -> bf16 rounding, for finite values.
inline __m512 bf16_rounded(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i sum = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd));
  return _mm512_castsi512_ps(_mm512_and_si512(sum, _mm512_set1_epi32(int(0xFFFF0000u))));
}
#elif defined(__AVX2__)
using VecF = __m256;
constexpr int kLanes = 8;
inline VecF vzero() { return _mm256_setzero_ps(); }
inline VecF vload(const float* p) { return _mm256_loadu_ps(p); }
inline VecF vfma(VecF a, VecF b, VecF c) { return _mm256_fmadd_ps(a, b, c); }
inline VecF vadd(VecF a, VecF b) { return _mm256_add_ps(a, b); }
inline void vstore(float* p, VecF a) { _mm256_storeu_ps(p, a); }
inline float vsum(VecF a) {
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, a);
  float sum = 0.0f;
  for (float lane : lanes) sum += lane;
  return sum;
}
#endif

#ifdef A3B_SIMD
// The dot products of M rows of x as vector partial sums. With one row of x,
// four independent chains break the FMA dependency chain.
template <int M>
struct RowSums {
  static constexpr int kChains = M == 1 ? 4 : (M == 2 ? 2 : 1);
  VecF acc[M][kChains];

  RowSums() {
    for (int r = 0; r < M; ++r)
      for (int g = 0; g < kChains; ++g) acc[r][g] = vzero();
  }
  // row r += x * values, for the group-th vector of weights of the row
  void fma(int r, int64_t group, VecF x, VecF values) {
    acc[r][group % kChains] = vfma(x, values, acc[r][group % kChains]);
  }
  float total(int r) const {
    VecF sum = acc[r][0];
    for (int g = 1; g < kChains; ++g) sum = vadd(sum, acc[r][g]);
    return vsum(sum);
  }
};
#endif

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

// The 16-entry value table of block (row, b), decoded from the stored bytes:
// T[c] = lo + (c >> 1) * step + (c & 1 ? d : -d); with `bf16`, each entry
// rounded to the nearest bf16 (even on ties), as torch rounds.
inline void block_table(const Meta& m, int64_t row, int64_t b, float* table, bool bf16) {
  const int64_t rb = row / m.rows;
  const int64_t idx = rb * m.nbc + b;
  const float lo = float(m.lo[idx]) * float(m.lo_scale[rb]);
  const float step = float(m.step[idx]) * float(m.step_scale[rb]);
  const float d = step * float(m.delta[idx]) / 255.0f;
#pragma omp simd
  for (int c = 0; c < 16; ++c) table[c] = lo + float(c >> 1) * step + float(2 * (c & 1) - 1) * d;
  if (!bf16) return;
#if defined(__AVX512F__)
  // 16 scalar roundings per block would cost more than decoding the block
  _mm512_storeu_ps(table, bf16_rounded(_mm512_loadu_ps(table)));
#else
  for (int c = 0; c < 16; ++c) table[c] = float(at::BFloat16(table[c]));
#endif
}

// Calls vec(i, values of weights i..i+kLanes-1) for each whole group of 32
// weights of one block row, then one(i, value) for the tail; `codes` starts at the block.
template <typename Vec, typename One>
inline void for_each_weight(const uint8_t* codes, int64_t width, const float* table, Vec vec, One one) {
  int64_t i = 0;
#ifdef A3B_SIMD
  const __m128i nibble = _mm_set1_epi8(0x0F);
#if defined(__AVX512F__)
  const __m512 table16 = _mm512_loadu_ps(table);
#else
  const __m256 lo_table = _mm256_loadu_ps(table), hi_table = _mm256_loadu_ps(table + 8);
#endif
  for (; i + 32 <= width; i += 32) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + i / 2));
    const __m128i low = _mm_and_si128(bytes, nibble);
    const __m128i high = _mm_and_si128(_mm_srli_epi16(bytes, 4), nibble);
    // Column order: the low nibble of byte j is column 2j, the high one 2j+1.
    const __m128i first = _mm_unpacklo_epi8(low, high), second = _mm_unpackhi_epi8(low, high);
#if defined(__AVX512F__)
    vec(i, _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(first), table16));
    vec(i + 16, _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(second), table16));
#else
    const __m128i groups[4] = {first, _mm_srli_si128(first, 8), second, _mm_srli_si128(second, 8)};
    for (int g = 0; g < 4; ++g) {
      const __m256i c = _mm256_cvtepu8_epi32(groups[g]);
      const __m256 from_low = _mm256_permutevar8x32_ps(lo_table, c);
      const __m256 from_high = _mm256_permutevar8x32_ps(hi_table, c);
      // Bit 3 of the code picks the table half: move it to the sign bit for blendv.
      vec(i + 8 * g, _mm256_blendv_ps(from_low, from_high, _mm256_castsi256_ps(_mm256_slli_epi32(c, 28))));
    }
#endif
  }
#endif
  for (; i < width; ++i) one(i, table[(codes[i / 2] >> ((i & 1) * 4)) & 15]);
}

// Rows [begin, end) of y = x @ W^T for M rows of x; M is a template argument
// so the accumulators live in registers. Out: float, or at::BFloat16 (rounded
// to nearest even from the float sum, as torch's conversion rounds).
template <int M, typename Out>
void linear_rows(const Meta& m, const float* xp, Out* yp, int64_t begin, int64_t end, bool bf16_table) {
  alignas(64) float table[16];
  const int64_t K = m.k, cols = m.cols;
  for (int64_t row = begin; row < end; ++row) {
    float acc[M] = {0.0f};
#ifdef A3B_SIMD
    RowSums<M> sums;
#endif
    const uint8_t* codes = m.packed + row * m.kp;
    for (int64_t b = 0; b < m.nbc; ++b) {
      const int64_t c0 = b * cols;
      block_table(m, row, b, table, bf16_table);
      for_each_weight(
          codes + c0 / 2, std::min(cols, K - c0), table,
          [&](int64_t i, auto values) {
#ifdef A3B_SIMD
            for (int r = 0; r < M; ++r) sums.fma(r, i / kLanes, vload(xp + r * K + c0 + i), values);
#endif
          },
          [&](int64_t i, float value) {
            for (int r = 0; r < M; ++r) acc[r] += xp[r * K + c0 + i] * value;
          });
    }
    for (int r = 0; r < M; ++r) {
#ifdef A3B_SIMD
      acc[r] += sums.total(r);
#endif
      yp[r * m.n + row] = Out(acc[r]);
    }
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define A3B_CHUNKED 1
constexpr int64_t kChunk = 128;  // columns per 64 code bytes
// How far ahead of the chunk being read the codes are prefetched: in a decode
// step every layer's weights come from memory, not from cache as in a call
// repeated alone (perf/cpu_linear.py), and the step waits on them.
constexpr int64_t kPrefetchBytes = 4096;

int64_t chunked_width(int64_t k) { return (k + kChunk - 1) / kChunk * kChunk; }

// x[M, K] (float or bf16) as float in the order the chunk loop reads it:
// within each 128 columns, position 16k + j holds column 8j + k; zeros past K.
template <typename T>
std::vector<float> chunk_order(const T* x, int64_t rows_of_x, int64_t k) {
  const int64_t width = chunked_width(k);
  std::vector<float> out(rows_of_x * width, 0.0f);
  for (int64_t r = 0; r < rows_of_x; ++r)
    for (int64_t c = 0; c < k; ++c) {
      const int64_t c0 = c / kChunk * kChunk, j = (c - c0) / 8, code = (c - c0) % 8;
      out[r * width + c0 + 16 * code + j] = float(x[r * k + c]);
    }
  return out;
}

// lo, step and d of every block of block row rb, decoded 16 blocks at a time
// (block_table's arithmetic), so that a block's table is then two FMAs on
// broadcast loads rather than scalar conversions and shuffles per block.
struct BlockParams {
  std::vector<float> lo, step, d;
  explicit BlockParams(int64_t blocks) : lo(blocks), step(blocks), d(blocks) {}

  void decode(const Meta& m, int64_t rb) {
    const __m512 lo_scale = _mm512_set1_ps(float(m.lo_scale[rb]));
    const __m512 step_scale = _mm512_set1_ps(float(m.step_scale[rb]));
    for (int64_t b = 0; b < m.nbc; b += 16) {
      const __mmask16 mask = m.nbc - b >= 16 ? 0xFFFF : __mmask16((1u << (m.nbc - b)) - 1);
      const int64_t idx = rb * m.nbc + b;
      const __m512i lo_i = _mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask, m.lo + idx));
      const __m512i step_i = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(mask, m.step + idx));
      const __m512i delta_i = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(mask, m.delta + idx));
      const __m512 lo_v = _mm512_mul_ps(_mm512_cvtepi32_ps(lo_i), lo_scale);
      const __m512 step_v = _mm512_mul_ps(_mm512_cvtepi32_ps(step_i), step_scale);
      const __m512 delta_v = _mm512_cvtepi32_ps(delta_i);
      _mm512_mask_storeu_ps(lo.data() + b, mask, lo_v);
      _mm512_mask_storeu_ps(step.data() + b, mask, step_v);
      _mm512_mask_storeu_ps(d.data() + b, mask, _mm512_div_ps(_mm512_mul_ps(step_v, delta_v), _mm512_set1_ps(255.0f)));
    }
  }

  // block b's 16 table values in one register (block_table's, bf16-rounded with `bf16`)
  __m512 table(int64_t b, bool bf16) const {
    const __m512 half = _mm512_setr_ps(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    const __m512 sign = _mm512_setr_ps(-1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1);
    const __m512 base = _mm512_fmadd_ps(half, _mm512_set1_ps(step[b]), _mm512_set1_ps(lo[b]));
    const __m512 values = _mm512_fmadd_ps(sign, _mm512_set1_ps(d[b]), base);
    return bf16 ? bf16_rounded(values) : values;
  }
};

// linear_rows for blocks a multiple of 128 wide; `xc` is chunk_order(x).
template <int M, typename Out>
void chunked_rows(const Meta& m, const float* xc, Out* yp, int64_t begin, int64_t end, bool bf16_table) {
  const int64_t width = chunked_width(m.k);
  BlockParams params(m.nbc);
  for (int64_t row = begin; row < end; ++row) {
    if (row == begin || row % m.rows == 0) params.decode(m, row / m.rows);
    RowSums<M> sums;
    const uint8_t* codes = m.packed + row * m.kp;
    for (int64_t b = 0; b < m.nbc; ++b) {
      const __m512 table = params.table(b, bf16_table);
      for (int64_t c0 = b * m.cols; c0 < std::min((b + 1) * m.cols, m.k); c0 += kChunk) {
        const int64_t bytes = std::min<int64_t>(kChunk / 2, m.kp - c0 / 2);
        _mm_prefetch(reinterpret_cast<const char*>(codes + c0 / 2 + kPrefetchBytes), _MM_HINT_T0);
        const __m512i packed = bytes == kChunk / 2 ? _mm512_loadu_si512(codes + c0 / 2)
                                                   : _mm512_maskz_loadu_epi8((1ULL << bytes) - 1, codes + c0 / 2);
#pragma GCC unroll 8
        for (int code = 0; code < 8; ++code) {
          const __m512 values = _mm512_permutexvar_ps(_mm512_srli_epi32(packed, 4 * code), table);
          for (int r = 0; r < M; ++r) sums.fma(r, code, vload(xc + r * width + c0 + 16 * code), values);
        }
      }
    }
    for (int r = 0; r < M; ++r) yp[r * m.n + row] = Out(sums.total(r));
  }
}
#endif

// body(std::integral_constant<int, rows_of_x>) for rows_of_x in 1..kMaxRows,
// so the kernels get the row count as a template argument.
template <int M = 1, typename Body>
void with_rows(int64_t rows_of_x, Body body) {
  if constexpr (M <= kMaxRows) {
    if (rows_of_x == M) return body(std::integral_constant<int, M>{});
    with_rows<M + 1>(rows_of_x, body);
  }
}

// body(pointer to y's elements as float or at::BFloat16)
template <typename Body>
void with_output(torch::Tensor& y, Body body) {
  if (y.scalar_type() == torch::kBFloat16) return body(y.data_ptr<at::BFloat16>());
  body(y.data_ptr<float>());
}

}  // namespace

// y[M, N] = x[M, K] @ W^T in x's dtype, fp32 accumulation, codes read in place. For small M (decode).
torch::Tensor a3b_linear(const torch::Tensor& x_in, const torch::Tensor& packed, const torch::Tensor& lo,
                         const torch::Tensor& step, const torch::Tensor& delta, const torch::Tensor& lo_scale,
                         const torch::Tensor& step_scale, int64_t rows, int64_t cols) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(0) >= 1 && x_in.size(0) <= kMaxRows,
              "a3b_linear: x must be 2-D with 1..", kMaxRows, " rows");
  TORCH_CHECK(x_in.scalar_type() == torch::kFloat32 || x_in.scalar_type() == torch::kBFloat16,
              "a3b_linear: x must be float32 or bfloat16");
  const int64_t M = x_in.size(0), K = x_in.size(1);
  const Meta m = meta_of(packed, lo, step, delta, lo_scale, step_scale, K, rows, cols);
  // bf16 x multiplies the bf16-rounded weights a3b_dequantize writes for the
  // prefill's bf16 GEMM, so a row's result does not depend on which path its
  // batch takes beyond float32 summation order
  const bool bf16 = x_in.scalar_type() == torch::kBFloat16;
  torch::Tensor y = torch::empty({M, m.n}, x_in.options());
#ifdef A3B_CHUNKED
  if (cols % kChunk == 0) {
    const torch::Tensor x = x_in.contiguous();
    const std::vector<float> xc =
        bf16 ? chunk_order(x.data_ptr<at::BFloat16>(), M, K) : chunk_order(x.data_ptr<float>(), M, K);
    with_output(y, [&](auto yp) {
      at::parallel_for(0, m.n, 16, [&](int64_t begin, int64_t end) {
        with_rows(M, [&](auto x_rows) {
          chunked_rows<decltype(x_rows)::value>(m, xc.data(), yp, begin, end, bf16);
        });
      });
    });
    return y;
  }
#endif
  const torch::Tensor x = x_in.to(torch::kFloat32).contiguous();
  const float* xp = x.data_ptr<float>();
  with_output(y, [&](auto yp) {
    at::parallel_for(0, m.n, 16, [&](int64_t begin, int64_t end) {
      with_rows(M, [&](auto x_rows) { linear_rows<decltype(x_rows)::value>(m, xp, yp, begin, end, bf16); });
    });
  });
  return y;
}

namespace {

#ifdef A3B_SIMD
inline void store_values(float* p, VecF values) { vstore(p, values); }
// `values` are bf16-exact (a rounded table's entries): their high halves are the bf16 bits
inline void store_values(at::BFloat16* p, VecF values) {
#if defined(__AVX512F__)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(values), 16)));
#else
  alignas(32) float lanes[kLanes];
  vstore(lanes, values);
  for (int i = 0; i < kLanes; ++i) p[i] = at::BFloat16(lanes[i]);
#endif
}
#endif

// Rows [begin, end) of W as Out: float, or at::BFloat16 from the bf16-rounded table.
template <typename Out>
void dequantize_rows(const Meta& m, Out* wp, int64_t begin, int64_t end) {
  alignas(64) float table[16];
  for (int64_t row = begin; row < end; ++row) {
    for (int64_t b = 0; b < m.nbc; ++b) {
      const int64_t c0 = b * m.cols;
      Out* out = wp + row * m.k + c0;
      block_table(m, row, b, table, std::is_same_v<Out, at::BFloat16>);
      for_each_weight(
          m.packed + row * m.kp + c0 / 2, std::min(m.cols, m.k - c0), table,
          [&](int64_t i, auto values) {
#ifdef A3B_SIMD
            store_values(out + i, values);
#endif
          },
          [&](int64_t i, float value) { out[i] = Out(value); });
    }
  }
}

}  // namespace

// W[N, K]: the whole weight, for large M (prefill), where one dequantize plus
// a GEMM beats re-reading the codes per row of x. float32, or with `bf16` the
// values rounded to bf16 (what a3b_linear multiplies bf16 x by) for a bf16 GEMM.
torch::Tensor a3b_dequantize(const torch::Tensor& packed, const torch::Tensor& lo, const torch::Tensor& step,
                             const torch::Tensor& delta, const torch::Tensor& lo_scale,
                             const torch::Tensor& step_scale, int64_t in_features, int64_t rows, int64_t cols,
                             bool bf16) {
  const Meta m = meta_of(packed, lo, step, delta, lo_scale, step_scale, in_features, rows, cols);
  torch::Tensor w = torch::empty({m.n, m.k}, torch::TensorOptions().dtype(bf16 ? torch::kBFloat16 : torch::kFloat32));
  with_output(w, [&](auto wp) {
    at::parallel_for(0, m.n, 16, [&](int64_t begin, int64_t end) { dequantize_rows(m, wp, begin, end); });
  });
  return w;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("a3b_linear", &a3b_linear, "A3B linear, codes read in place (small batches)");
  module.def("a3b_dequantize", &a3b_dequantize, "A3B weight -> float32, or bf16-rounded values in bf16");
}
