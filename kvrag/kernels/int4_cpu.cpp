// kvrag's int4-weight x int8-activation matrix product for a CPU decode step (kvrag/kernels/int4_cpu.py).
//
// y[m, n] = sum_k W[n, k] x[m, k] for a few rows m (a decode step and its drafts), with
//   W[n, k] = scale[n, g] * q[n, k] + low[n, g]    (q: 4-bit codes 0..15, g = k / 32, scale and low fp16)
//   x[m, k] ~ dx[m, g] * p[m, k]                   (p: int8, quantized here per row and group of 32)
// so that y[m, n] = sum_g scale[n, g] dx[m, g] (sum_j q p) + sum_g low[n, g] (dx[m, g] sum_j p)
// and the inner sums are integer dot products: vpdpbusd (AVX512-VNNI) or vpmaddubsw + vpmaddwd (AVX2).
//
// Weight layout: row n is K / 2 bytes, one 16-byte block per group; byte j of a group holds the code
// of element j in its low nibble and of element j + 16 in its high nibble, so one AND and one shift
// unpack a group into its two halves. The activations are quantized once per call into the order the
// unpacked weights come in (the weights are read once; the activations fit in L1), so no shuffle runs
// in the inner loop. Each output row reads its own input row only: rows never mix.
//
// Only <ATen/Parallel.h> comes from torch: the output rows are split over torch's own intra-op pool
// (at::parallel_for), never a second thread pool. Built by kvrag at first use with -march=native;
// called through ctypes.
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "bf16.h"

#include <cstdint>
#include <cstring>
#include <vector>

#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "kvrag int4 kernel: this CPU lacks AVX2, FMA or F16C"
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define KVRAG_VNNI 1
#else
#define KVRAG_VNNI 0
#endif

namespace {

constexpr int64_t kGroup = 32;
constexpr int kRowsAtOnce = 4;  // input rows sharing one unpacked weight block (accumulators in registers)
// Bytes of codes prefetched ahead of the ones being read (rows lie end to end): one core's hardware
// prefetcher alone left the LM head's stream at ~12-18 GB/s against ~25 with this (1 thread, shared).
constexpr int64_t kAhead = 4096;

enum Isa { kAuto = 0, kAvx2 = 1, kVnni = 2 };

using kvrag::to_bf16;

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline int32_t hsum4i(__m128i v) {
  v = _mm_add_epi32(v, _mm_shuffle_epi32(v, 0x4e));
  v = _mm_add_epi32(v, _mm_shuffle_epi32(v, 0xb1));
  return _mm_cvtsi128_si32(v);
}

// One input row quantized: codes in the unpack order of `block` groups at a time, then single groups.
struct Acts {
  int64_t k, groups, block, full;  // full: groups covered by whole blocks
  std::vector<int8_t> q;           // [M, K]
  std::vector<float> dx;           // [M, groups]: each group's scale
  std::vector<float> xs;           // [M, groups]: dx * sum of the group's codes (the offset term)
  std::vector<float> dxe;          // [M, full / block * 4 * block]: dx, each repeated over its 4 int32 lanes

  Acts(const uint16_t* x, int64_t m, int64_t k_, int64_t block_)
      : k(k_), groups(k_ / kGroup), block(block_), full(groups / block_ * block_),
        q(m * k_), dx(m * groups), xs(m * groups), dxe(m * full * 4) {
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int64_t r = 0; r < m; r++) {
      for (int64_t g = 0; g < groups; g++) {
        const uint16_t* src = x + r * k + g * kGroup;
        __m256 v[4];
        for (int t = 0; t < 4; t++) {
          __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 8 * t));
          v[t] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
        }
        __m256 a = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], absmask), _mm256_and_ps(v[1], absmask)),
                                 _mm256_max_ps(_mm256_and_ps(v[2], absmask), _mm256_and_ps(v[3], absmask)));
        __m128 a4 = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
        a4 = _mm_max_ps(a4, _mm_movehl_ps(a4, a4));
        a4 = _mm_max_ss(a4, _mm_movehdup_ps(a4));
        const float amax = _mm_cvtss_f32(a4);
        const float d = amax / 127.0f;
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        const __m256 vi = _mm256_set1_ps(inv);
        __m256i i[4];
        for (int t = 0; t < 4; t++) i[t] = _mm256_cvtps_epi32(_mm256_mul_ps(v[t], vi));  // nearest, ties to even
        __m256i sum = _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3]));
        __m256i w01 = _mm256_permute4x64_epi64(_mm256_packs_epi32(i[0], i[1]), 0xd8);
        __m256i w23 = _mm256_permute4x64_epi64(_mm256_packs_epi32(i[2], i[3]), 0xd8);
        __m256i b = _mm256_permute4x64_epi64(_mm256_packs_epi16(w01, w23), 0xd8);  // elements 0..31 in order
        const int64_t nb = g < full ? block : 1, at = g < full ? g % block : 0;
        int8_t* dst = q.data() + r * k + (g - at) * kGroup;
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + at * 16), _mm256_castsi256_si128(b));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + nb * 16 + at * 16), _mm256_extracti128_si256(b, 1));
        const int32_t total = hsum4i(_mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1)));
        dx[r * groups + g] = d;
        xs[r * groups + g] = d * static_cast<float>(total);
        if (g < full)
          for (int l = 0; l < 4; l++) dxe[r * full * 4 + g * 4 + l] = d;
      }
    }
  }
};

// sum_g low[g] * xs[g] over a row (the offset term).
inline float offset_dot(const uint16_t* low, const float* xs, int64_t groups) {
  __m256 acc = _mm256_setzero_ps();
  int64_t g = 0;
  for (; g + 8 <= groups; g += 8)
    acc = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(low + g))),
                          _mm256_loadu_ps(xs + g), acc);
  float s = hsum8(acc);
  for (; g < groups; g++) s += _cvtsh_ss(low[g]) * xs[g];
  return s;
}

// The groups past the whole blocks, one at a time (SSE integer dots).
template <int R>
inline void tail_groups(const uint8_t* w, const uint16_t* scale, const Acts& a, int64_t r0, float* out) {
  const __m128i mask = _mm_set1_epi8(0x0f), ones = _mm_set1_epi16(1);
  for (int64_t g = a.full; g < a.groups; g++) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + g * 16));
    const __m128i lo = _mm_and_si128(v, mask), hi = _mm_and_si128(_mm_srli_epi16(v, 4), mask);
    const float s = _cvtsh_ss(scale[g]);
    for (int r = 0; r < R; r++) {
      const int8_t* p = a.q.data() + (r0 + r) * a.k + g * kGroup;
      __m128i d = _mm_add_epi16(_mm_maddubs_epi16(lo, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
                                _mm_maddubs_epi16(hi, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
      out[r] += s * a.dx[(r0 + r) * a.groups + g] * static_cast<float>(hsum4i(_mm_madd_epi16(d, ones)));
    }
  }
}

// R input rows (r0 ...) times one weight row, two groups per step: 32 packed bytes.
template <int R>
inline void row_avx2(const uint8_t* w, const uint16_t* scale, const uint16_t* low, const Acts& a, int64_t r0,
                     float* out) {
  const __m256i mask = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
  const __m256i spread = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
  __m256 acc[R];
  for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < a.full / 2; b++) {
    if (b % 2 == 0) _mm_prefetch(reinterpret_cast<const char*>(w + b * 32 + kAhead), _MM_HINT_T0);
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + b * 32));
    const __m256i lo = _mm256_and_si256(v, mask), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
    int32_t s2;
    std::memcpy(&s2, scale + b * 2, 4);
    const __m256 s = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_cvtph_ps(_mm_cvtsi32_si128(s2))), spread);
    for (int r = 0; r < R; r++) {
      const int8_t* p = a.q.data() + (r0 + r) * a.k + b * 64;
      __m256i d = _mm256_add_epi16(
          _mm256_maddubs_epi16(lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))),
          _mm256_maddubs_epi16(hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32))));
      const __m256 dx = _mm256_loadu_ps(a.dxe.data() + (r0 + r) * a.full * 4 + b * 8);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(d, ones)), _mm256_mul_ps(s, dx), acc[r]);
    }
  }
  for (int r = 0; r < R; r++) out[r] = hsum8(acc[r]);
  tail_groups<R>(w, scale, a, r0, out);
  for (int r = 0; r < R; r++) out[r] += offset_dot(low, a.xs.data() + (r0 + r) * a.groups, a.groups);
}

#if KVRAG_VNNI
// R input rows times one weight row, four groups per step: 64 packed bytes, one cache line.
template <int R>
inline void row_vnni(const uint8_t* w, const uint16_t* scale, const uint16_t* low, const Acts& a, int64_t r0,
                     float* out) {
  const __m512i mask = _mm512_set1_epi8(0x0f);
  const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  __m512 acc[R];
  for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < a.full / 4; b++) {
    _mm_prefetch(reinterpret_cast<const char*>(w + b * 64 + kAhead), _MM_HINT_T0);
    const __m512i v = _mm512_loadu_si512(w + b * 64);
    const __m512i lo = _mm512_and_si512(v, mask), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
    const __m128 s4 = _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(scale + b * 4)));
    const __m512 s = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(s4));
    for (int r = 0; r < R; r++) {
      const int8_t* p = a.q.data() + (r0 + r) * a.k + b * 128;
      __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(p));
      d = _mm512_dpbusd_epi32(d, hi, _mm512_loadu_si512(p + 64));
      const __m512 dx = _mm512_loadu_ps(a.dxe.data() + (r0 + r) * a.full * 4 + b * 16);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(s, dx), acc[r]);
    }
  }
  for (int r = 0; r < R; r++) out[r] = _mm512_reduce_add_ps(acc[r]);
  tail_groups<R>(w, scale, a, r0, out);
  for (int r = 0; r < R; r++) out[r] += offset_dot(low, a.xs.data() + (r0 + r) * a.groups, a.groups);
}
#endif

template <int R>
inline void row(int isa, const uint8_t* w, const uint16_t* scale, const uint16_t* low, const Acts& a, int64_t r0,
                float* out) {
#if KVRAG_VNNI
  if (isa == kVnni) return row_vnni<R>(w, scale, low, a, r0, out);
#endif
  row_avx2<R>(w, scale, low, a, r0, out);
}

}  // namespace

extern "C" {

// The widest path built: 2 AVX512-VNNI (and AVX2), 1 AVX2 only.
int kvrag_int4_isa() { return KVRAG_VNNI ? kVnni : kAvx2; }

// y [M, N] (bf16, or float32 when out_f32) = x [M, K] (bf16) times W [N, K] (codes [N, K/2], scale and
// low [N, K/32] fp16). isa: 0 the widest built, 1 AVX2, 2 AVX512-VNNI. Returns 0, or -1 for K not a
// multiple of 32, -2 for an ISA not built. Every pointer is to contiguous memory.
int kvrag_int4_mm(const uint16_t* x, int64_t m, int64_t k, const uint8_t* codes, const uint16_t* scale,
                  const uint16_t* low, int64_t n, void* y, int out_f32, int isa) {
  if (k % kGroup != 0 || k <= 0) return -1;
  if (isa == kAuto) isa = kvrag_int4_isa();
  if (isa != kAvx2 && (isa != kVnni || !KVRAG_VNNI)) return -2;
  if (m <= 0 || n <= 0) return 0;
  const Acts a(x, m, k, isa == kVnni ? 4 : 2);
  const int64_t groups = k / kGroup;
  at::parallel_for(0, n, 16, [&](int64_t first, int64_t last) {
    float out[kRowsAtOnce];
    for (int64_t j = first; j < last; j++) {
      const uint8_t* w = codes + j * (k / 2);
      const uint16_t* s = scale + j * groups;
      const uint16_t* l = low + j * groups;
      _mm_prefetch(reinterpret_cast<const char*>(s + kAhead / 8), _MM_HINT_T0);  // their streams: 1/8 as fast
      _mm_prefetch(reinterpret_cast<const char*>(l + kAhead / 8), _MM_HINT_T0);
      for (int64_t r0 = 0; r0 < m; r0 += kRowsAtOnce) {
        const int64_t rows = m - r0 < kRowsAtOnce ? m - r0 : kRowsAtOnce;
        switch (rows) {
          case 1: row<1>(isa, w, s, l, a, r0, out); break;
          case 2: row<2>(isa, w, s, l, a, r0, out); break;
          case 3: row<3>(isa, w, s, l, a, r0, out); break;
          default: row<4>(isa, w, s, l, a, r0, out); break;
        }
        for (int64_t r = 0; r < rows; r++) {
          if (out_f32)
            static_cast<float*>(y)[(r0 + r) * n + j] = out[r];
          else
            static_cast<uint16_t*>(y)[(r0 + r) * n + j] = to_bf16(out[r]);
        }
      }
    }
  });
  return 0;
}

}  // extern "C"
