// kvrag's attention of one decode row over a sequence's bfloat16 KV on a CPU (kvrag/kernels/row_attention_cpu.py).
//
// Two passes around torch's softmax, for the G = H / Hkv query heads that share each KV head:
//   kvrag_row_scores: scores[h, g, s] = scale * sum_d q[h, g, d] k[h, s, d], in float32 (exact bf16 products,
//                     float32 sums), each key read once for the G queries;
//   kvrag_row_values: out[h, g, d] = sum_s p[h, g, s] v[h, s, d], float32 weights and sums, rounded once.
// PyTorch's fused CPU attention does the same arithmetic as small matrix products per block of 512 keys,
// slow for G rows (a decode step): 2.2x this kernel's time on SmolLM2's shapes, 1.7x on the Qwen2.5-1.5B's
// (docs/journal/real-models.md). Its work is split into (KV head, 256-key block) pieces over
// torch's intra-op pool (at::parallel_for), so 3 KV heads keep 2 threads busy; the blocks' value sums are added
// in block order afterwards, so a row's result does not depend on the thread count or on other rows.
//
// Keys and values are read in place: any head and row strides, the last dimension contiguous; nothing past
// key S - 1 is read. Built by kvrag at first use with -march=native (AVX-512F needed), called through ctypes.
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "bf16.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if !defined(__AVX512F__)
#error "kvrag row attention: this CPU lacks AVX-512F"
#endif

namespace {

constexpr int64_t kBlock = 256;  // keys per piece of work
constexpr int64_t kMaxGroups = 16;
constexpr int64_t kMaxDim = 256;

inline __m512 load_bf16(const uint16_t* p) {  // 16 bfloat16 -> float32 (exact: a shift)
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

using kvrag::to_bf16;

// keys [s0, s1) of one KV head: the key's D/16 vectors stay in registers for the G queries
template <int C>
void scores_block(const float* qf, const uint16_t* k, int64_t k_row, int64_t groups, int64_t s0, int64_t s1,
                  int64_t keys, float scale, float* out) {
  for (int64_t s = s0; s < s1; ++s) {
    const uint16_t* kr = k + s * k_row;
    __m512 kv[C];
    for (int c = 0; c < C; ++c) kv[c] = load_bf16(kr + 16 * c);
    for (int64_t g = 0; g < groups; ++g) {
      const float* qg = qf + g * C * 16;
      __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qg), kv[0]);
      for (int c = 1; c < C; ++c) acc = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * c), kv[c], acc);
      out[g * keys + s] = scale * _mm512_reduce_add_ps(acc);
    }
  }
}

template <int C>
void scores_dispatch(int64_t dim16, const float* qf, const uint16_t* k, int64_t k_row, int64_t groups, int64_t s0,
                     int64_t s1, int64_t keys, float scale, float* out) {
  if constexpr (C <= 16) {
    if (dim16 == C) return scores_block<C>(qf, k, k_row, groups, s0, s1, keys, scale, out);
    return scores_dispatch<C + 1>(dim16, qf, k, k_row, groups, s0, s1, keys, scale, out);
  }
}

}  // namespace

extern "C" {

// 0, or 1 for shapes the kernel does not take (the caller checks first)
int kvrag_row_scores(const uint16_t* q, const uint16_t* k, int64_t k_head, int64_t k_row, int64_t heads,
                     int64_t groups, int64_t keys, int64_t dim, float scale, float* scores) {
  if (dim % 16 || dim > kMaxDim || groups > kMaxGroups || groups < 1 || keys < 1) return 1;
  const int64_t blocks = (keys + kBlock - 1) / kBlock;
  at::parallel_for(0, heads * blocks, 1, [&](int64_t begin, int64_t end) {
    float qf[kMaxGroups * kMaxDim];
    int64_t loaded = -1;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item / blocks, b = item % blocks;
      if (h != loaded) {  // this head's queries in float32 (exact)
        for (int64_t i = 0; i < groups * dim; ++i) {
          uint32_t u = uint32_t(q[h * groups * dim + i]) << 16;
          std::memcpy(qf + i, &u, 4);
        }
        loaded = h;
      }
      const int64_t s0 = b * kBlock, s1 = std::min(keys, s0 + kBlock);
      scores_dispatch<1>(dim / 16, qf, k + h * k_head, k_row, groups, s0, s1, keys, scale, scores + h * groups * keys);
    }
  });
  return 0;
}

int kvrag_row_values(const float* p, const uint16_t* v, int64_t v_head, int64_t v_row, int64_t heads,
                     int64_t groups, int64_t keys, int64_t dim, uint16_t* out) {
  if (dim % 16 || dim > kMaxDim || groups > kMaxGroups || groups < 1 || keys < 1) return 1;
  const int64_t blocks = (keys + kBlock - 1) / kBlock;
  std::vector<float> part(heads * blocks * groups * dim);  // each piece's sums
  at::parallel_for(0, heads * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item / blocks, b = item % blocks;
      const int64_t s0 = b * kBlock, s1 = std::min(keys, s0 + kBlock);
      const float* ph = p + h * groups * keys;
      const uint16_t* vh = v + h * v_head;
      float* acc = part.data() + item * groups * dim;
      for (int64_t d = 0; d < dim; d += 16) {  // a 16-wide column of the values: G sums in registers
        __m512 a[kMaxGroups];
        for (int64_t g = 0; g < groups; ++g) a[g] = _mm512_setzero_ps();
        for (int64_t s = s0; s < s1; ++s) {
          const __m512 vv = load_bf16(vh + s * v_row + d);
          for (int64_t g = 0; g < groups; ++g) a[g] = _mm512_fmadd_ps(_mm512_set1_ps(ph[g * keys + s]), vv, a[g]);
        }
        for (int64_t g = 0; g < groups; ++g) _mm512_storeu_ps(acc + g * dim + d, a[g]);
      }
    }
  });
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t i = 0; i < groups * dim; ++i) {
      float sum = 0.f;
      for (int64_t b = 0; b < blocks; ++b) sum += part[(h * blocks + b) * groups * dim + i];
      out[h * groups * dim + i] = to_bf16(sum);
    }
  }
  return 0;
}

}  // extern "C"
