// loraplex's native CPU ops, registered as torch.ops.loraplex_cpu.*; built and loaded by
// kernels/native_cpu.py, which states each op's semantics and keeps the torch twin it must match.
//
//   decode_attention   paged attention of one query token per sequence, reading keys and values in
//                      place through the block table (the torch path gathers them into a copy first);
//                      AVX2 builds read a prefix that sequences share in their tables once for the group
//                      (shared_prefix_avx2), then each sequence its own keys
//   prefill_attention  one sequence's prefill chunk over its paged cache: flash-style blocks of 32 queries x
//                      64 keys (16 at head_dim 128), online softmax, keys transposed once per block
//                      (bf16: as k pairs for bf16 dot products, or AMX tile products where the CPU has
//                      them); without AVX-512, blocks of 16 keys in AVX2 FMAs (prefill_item_avx2)
//   add_rms_norm       residual += delta (optional), then out = weight * rmsnorm(residual), one pass
//   silu_mul           silu(x[:, :I]) * x[:, I:] of a fused gate/up projection
//   silu_linear        silu_mul of a fused gate/up projection's product, computed in the AMX tiles'
//                      epilogue where they run (the (rows, 2I) product never stored), else op by op
//   rope_store_kv      rotate q and k in place (rotate-half RoPE), then write k and v into their cache slots
//   bf16_linear        y = x @ W.T (+ bias) for bf16 x and a bf16 weight packed once into 16-column
//                      panels of K pairs (AVX512-BF16 dot products; built only where the compiler targets
//                      avx512_bf16, see has_bf16_linear)
//   int8_linear        the same over int8 panels (per-output-channel scales), widened to bf16 in registers;
//                      float32 x over single-k int8 panels widened to fp32 (AVX2, has_int8_linear_f32)
//   int4_linear        the same over int4 panels (group-wise scales and zeros), nibbles widened to bf16;
//                      float32 x over single-k int4 panels widened to fp32 (AVX2, has_int4_linear_f32)
//   w8a8_linear        int8 weights x the activations rounded to int8 per row at the call, int32 sums by
//                      AVX512-VNNI (bf16 x), or by AVX2 byte and word multiply-adds (bf16 or float32 x)
//   w4a8_linear        int4 group-wise weights x the activations rounded as w8a8_linear's, AVX2 byte
//                      multiply-adds summed 16 k in int16 before they widen, or AVX512-VNNI products of 4 k
//                      straight into int32 where the CPU has them (bf16 or float32 x; set_w4a8_vnni)
//                      bf16_linear, int8_linear and w8a8_linear run 16 rows and more on AMX tiles where the
//                      CPU has them (bf16 and int8 tile products over the same panels; has_amx, set_amx), and
//                      stream 1 or 2 rows' weights in runs of up to 8 panels side by side (parallel_stream;
//                      set_stream_rows)
//   lora_add           every token's LoRA delta of one projection group, all slots in one call (a thread
//                      fetches the next slot's factors while it computes on one: LoraSlot, lora_tokens);
//                      AVX2 builds run float32 by the same tiles, bf16 token by token
//   f32_linear         its float32 twin: 16-column panels of single k, AVX-512 or AVX2 FMA (has_f32_linear)
//   layer_forward      one decoder layer of a step (LoRA adds included), the ops above in order: decode rows
//                      by decode_attention, prefill chunks by prefill_attention; gate/up's deltas (lora_delta)
//                      added inside silu_linear's product on AMX tiles
//
// Floats are accumulated in fp32 whatever the storage dtype (float32 or bfloat16). The KV cache may be finer
// than q (bf16 caches under float32 q, or int8 rows with their scales: kernels/attention.py's module docstring);
// decode_attention and rope_store_kv read and write those, prefill_attention takes caches in q's dtype.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

// AMX tiles (Sapphire Rapids and later) for the panel GEMMs at prefill and batched sizes; the OS must also
// grant the process the tile state (amx::permitted), else the AVX-512 tiles run.
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__) && defined(__AVX512BF16__) && \
    defined(__linux__)
#define LORAPLEX_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

using bf16 = c10::BFloat16;

inline float to_f(float x) { return x; }
inline float to_f(bf16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline void from_f(float x, float* out) { *out = x; }
inline void from_f(float x, bf16* out) { *out = bf16(x); }  // round to nearest even, as torch's .to()

// ---- work split with stealing -----------------------------------------------------------------------------
// Items [0, n) split across the threads in contiguous shares as at::parallel_for splits them, each share
// taken from its front by its owner, in order; a thread done with its own share takes items from the back of
// the others'. A thread the OS deschedules (another process on its core: the gateway, the HTTP client, a
// neighbouring VM) then holds up the item in hand, not the rest of its share: with a static split the other
// thread waits at the region's end for all of it (a 2 ms / 25 ms busy loop on a 2-core machine slowed a
// statically split decode step ~15 %). fn(item, next): `next` the item the owner takes after `item` unless
// a thief gets it first (for prefetching; -1 for a stolen item or the share's last).
class StealRanges {
 public:
  StealRanges(int64_t n, int64_t parts) : r_(new Share[static_cast<size_t>(parts)]) {
    for (int64_t t = 0; t < parts; ++t) r_[t].store(pack(n * t / parts, n * (t + 1) / parts), std::memory_order_relaxed);
  }
  // the front item of share t and the one after it (-1: none), or {-1, -1} once the share is empty
  std::pair<int64_t, int64_t> take_front(int64_t t) {
    uint64_t cur = r_[t].load(std::memory_order_relaxed);
    for (;;) {
      const uint32_t b = static_cast<uint32_t>(cur >> 32), e = static_cast<uint32_t>(cur);
      if (b >= e) return {-1, -1};
      if (r_[t].compare_exchange_weak(cur, pack(b + 1, e), std::memory_order_relaxed))
        return {b, b + 1 < e ? static_cast<int64_t>(b) + 1 : -1};
    }
  }
  int64_t take_back(int64_t t) {  // the back item of share t, or -1
    uint64_t cur = r_[t].load(std::memory_order_relaxed);
    for (;;) {
      const uint32_t b = static_cast<uint32_t>(cur >> 32), e = static_cast<uint32_t>(cur);
      if (b >= e) return -1;
      if (r_[t].compare_exchange_weak(cur, pack(b, e - 1), std::memory_order_relaxed)) return e - 1;
    }
  }
 private:
  static uint64_t pack(int64_t b, int64_t e) { return (static_cast<uint64_t>(b) << 32) | static_cast<uint64_t>(e); }
  // a cache line per share: owners updating their own shares do not contend for one line
  struct alignas(64) Share : std::atomic<uint64_t> {};
  std::unique_ptr<Share[]> r_;
};

struct NoScratch {};

// fn(item, next), or fn(scratch, item, next) with one Scratch per thread (buffers an item reuses)
template <class Scratch = NoScratch, class F>
void parallel_stealing(int64_t n, const F& fn) {
  if (n <= 0) return;
  TORCH_CHECK(n < (int64_t{1} << 31), "parallel_stealing: too many items");
  auto call = [&fn](Scratch& scratch, int64_t i, int64_t next) {
    if constexpr (std::is_invocable_v<const F&, Scratch&, int64_t, int64_t>) {
      fn(scratch, i, next);
    } else {
      (void)scratch;
      fn(i, next);
    }
  };
  const int64_t parts = std::min<int64_t>(at::get_num_threads(), n);
  if (parts <= 1 || at::in_parallel_region()) {
    Scratch scratch;
    for (int64_t i = 0; i < n; ++i) call(scratch, i, i + 1 < n ? i + 1 : -1);
    return;
  }
  StealRanges ranges(n, parts);
  // one index per thread (a thread given several runs each share in turn: every item is still taken once)
  at::parallel_for(0, parts, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch;
    for (int64_t t = begin; t < end; ++t) {
      for (auto [i, next] = ranges.take_front(t); i >= 0; std::tie(i, next) = ranges.take_front(t)) call(scratch, i, next);
      for (int64_t o = 1; o < parts; ++o)
        for (int64_t i = ranges.take_back((t + o) % parts); i >= 0; i = ranges.take_back((t + o) % parts))
          call(scratch, i, -1);
    }
  });
}

// 2^f's polynomial, highest power first (Horner): the scalar and vector exps below all evaluate it
constexpr float kExp2Poly[] = {1.5353362e-4f, 1.3398874e-3f, 9.6180573e-3f, 5.5503393e-2f,
                               2.4022652e-1f, 6.9314718e-1f, 1.0f};
constexpr int kExp2Terms = sizeof(kExp2Poly) / sizeof(float);

// exp(x) as 2^(x log2 e) split into 2^n * 2^f, f in [-0.5, 0.5], a degree-6 Taylor polynomial for 2^f
// (within fp32 softmax rounding: the attention tests hold fp32 to 1e-5 of a float64 reference), x clamped to [-87, 88] (so exp(-inf) = ~1e-38, not 0); written so that `omp simd`
// vectorizes it, which std::exp does not without -ffast-math.
inline float fast_exp(float x) {
  x = std::min(std::max(x, -87.f), 88.f);
  const float t = x * 1.44269504088896341f;
  const float n = std::nearbyint(t);
  const float f = t - n;
  float p = kExp2Poly[0];
  for (int i = 1; i < kExp2Terms; ++i) p = p * f + kExp2Poly[i];
  const int32_t e = static_cast<int32_t>(n) + 127;
  uint32_t bits = static_cast<uint32_t>(e) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define LORAPLEX_AVX2_ATTENTION 1  // decode_one_avx2, prefill_item_avx2: 8-lane FMAs where the CPU has no AVX-512
#endif

#if defined(__AVX2__) && defined(__FMA__)
// 8 lanes of float or bf16 (widened exactly), and horizontal reductions of 8 lanes
inline __m256 load8_f32(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8_f32(const bf16* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
inline __m256 load8_f32(const int8_t* p) {  // an int8 cache row's values as they are (its scale is the caller's)
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

// fast_exp on 8 lanes: the same clamp, split and polynomial, 2^n put into the exponent bits
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)), _mm256_set1_ps(88.f));
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(t, n);
  __m256 p = _mm256_set1_ps(kExp2Poly[0]);
  for (int i = 1; i < kExp2Terms; ++i) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExp2Poly[i]));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// out[i] = column i of the 8 x 8 floats in r
inline void transpose8(const __m256 r[8], __m256 out[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {  // u[4 i + c], each 128-bit lane L: column 4 L + c of rows 4 i .. 4 i + 3
    u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int c = 0; c < 4; ++c) {
    out[c] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x20);
    out[4 + c] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x31);
  }
}
#endif

constexpr int kMaxHeadDim = 512;
constexpr int kMaxGroup = 16;

// scores (G, n): each row's exp(score - its max) in place, and 1 / its sum.
inline void softmax_numerators(float* __restrict scores, const float* mx, int64_t G, int64_t n, float* inv_sum) {
  for (int64_t g = 0; g < G; ++g) {
    float* sg = scores + g * n;
    const float m = mx[g];
    float t = 0.f;
    int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
    // 8 lanes by exp8 (fast_exp's arithmetic), the tail below: the `omp simd` loop alone took 6.9 % of a
    // decode attention microbenchmark's samples on a Zen 1 CPU, against 26.8 % for the rest of the kernel
    const __m256 mv = _mm256_set1_ps(m);
    __m256 tv = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
      const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sg + i), mv));
      _mm256_storeu_ps(sg + i, e);
      tv = _mm256_add_ps(tv, e);
    }
    t = hsum8(tv);
#endif
    for (; i < n; ++i) {
      const float e = fast_exp(sg[i] - m);
      sg[i] = e;
      t += e;
    }
    inv_sum[g] = 1.f / t;
  }
}

// Over a bf16 cache the values weigh bf16 probabilities: each numerator normalized, then rounded to bf16 (the
// torch reference's softmax(...).to(bf16)); scores then hold those p, and inv_sum ones.
inline void round_probs_bf16(float* __restrict scores, int64_t G, int64_t n, float* inv_sum) {
  for (int64_t g = 0; g < G; ++g) {
    float* sg = scores + g * n;
    for (int64_t i = 0; i < n; ++i) sg[i] = static_cast<float>(bf16(sg[i] * inv_sum[g]));
    inv_sum[g] = 1.f;
  }
}

// int8 cache rows (kv_cache_dtype int8): a slot's head is D int8 values then their fp32 scale (absmax / 127),
// D + 4 bytes in all; the row means q * scale. float32 and bfloat16 rows are the values themselves.
constexpr int64_t kInt8ScaleBytes = 4;
template <typename KV>
inline float kv_scale(const KV*, int64_t) { return 1.f; }
inline float kv_scale(const int8_t* row, int64_t D) {
  float s;
  std::memcpy(&s, row + D, sizeof s);
  return s;
}
// A cache's head_dim: its last axis, less the scale of an int8 cache.
inline int64_t kv_head_dim(const at::Tensor& cache) {
  return cache.size(3) - (cache.scalar_type() == at::kChar ? kInt8ScaleBytes : 0);
}

// One head's row (D values of src) stored into a cache row: copied, converted (float32 to bf16, as torch's
// .to()), or rounded to int8 with its scale (q = nearbyint(x / scale), scale = absmax / 127; all zeros: scale 0),
// the same arithmetic as kernels.attention.quantize_kv.
template <typename T, typename KV>
inline void store_kv_row(const T* src, KV* dst, int64_t D) {
  if constexpr (std::is_same_v<T, KV>) {
    std::memcpy(dst, src, static_cast<size_t>(D) * sizeof(T));
  } else if constexpr (std::is_same_v<KV, int8_t>) {
    float amax = 0.f;
    for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(to_f(src[d])));
    const float scale = amax / 127.f;
    for (int64_t d = 0; d < D; ++d) {
      const float r = scale > 0.f ? std::nearbyint(to_f(src[d]) / scale) : 0.f;
      dst[d] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, r)));
    }
    std::memcpy(dst + D, &scale, sizeof scale);
  } else {
    for (int64_t d = 0; d < D; ++d) from_f(to_f(src[d]), dst + d);
  }
}

// x (D floats) replaced by what store_kv_row's int8 rounding of it means (q * scale): attention over int8 caches
// scores with the query rounded as the keys are (llama.cpp rounds the query to its q8_0 keys' type too).
inline void round_like_int8_rows(float* x, int64_t D) {
  float amax = 0.f;
  for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(x[d]));
  const float scale = amax / 127.f;
  for (int64_t d = 0; d < D; ++d)
    x[d] = scale > 0.f ? std::min(127.f, std::max(-127.f, std::nearbyint(x[d] / scale))) * scale : 0.f;
}

// The element offsets of positions lo .. len - 1 along a block table, worked out once per walk (a sequence's
// keys, or a block of them): every pass over the keys and values then reads off[j] (no division or table lookup
// per key and pass).
inline void slot_offsets(const int32_t* table, int64_t block_size, int64_t block_stride, int64_t slot_stride,
                         int64_t lo, int64_t len, int64_t* __restrict off) {
  int64_t j = lo;
  while (j < len) {
    const int64_t block = j / block_size, end = std::min(len, (block + 1) * block_size);
    int64_t at = table[block] * block_stride + (j % block_size) * slot_stride;
    for (; j < end; ++j, at += slot_stride) *off++ = at;
  }
}

// q's G heads of one kv head (heads head_stride apart) as the decode kernels without AVX-512 take them: fp32,
// rounded as the cache's rows are (int8: round_like_int8_rows; bf16: to bf16, as the AVX-512 kernel scores it),
// times scale.
template <typename Q, typename KV>
inline void decode_queries(const Q* src, int64_t head_stride, int64_t G, int64_t D, float scale, float* out) {
  for (int64_t g = 0; g < G; ++g) {
    float* row = out + g * D;
    for (int64_t d = 0; d < D; ++d) row[d] = to_f(src[g * head_stride + d]);
    if constexpr (std::is_same_v<KV, int8_t>) round_like_int8_rows(row, D);
    if constexpr (std::is_same_v<KV, bf16>)
      for (int64_t d = 0; d < D; ++d) row[d] = static_cast<float>(bf16(row[d]));
    for (int64_t d = 0; d < D; ++d) row[d] *= scale;
  }
}

inline const float* row_f32(const float* row, float*, int64_t) { return row; }
inline const float* row_f32(const bf16* row, float* widened, int64_t D) {
#pragma omp simd
  for (int64_t d = 0; d < D; ++d) widened[d] = to_f(row[d]);
  return widened;
}
inline const float* row_f32(const int8_t* row, float* widened, int64_t D) {
  const float s = kv_scale(row, D);
#pragma omp simd
  for (int64_t d = 0; d < D; ++d) widened[d] = static_cast<float>(row[d]) * s;
  return widened;
}

// One (sequence, kv head): the G query heads that share the kv head attend keys [lo, len).
template <typename KV>
void decode_one(const float* __restrict q,  // (G, D), scaled
                const KV* __restrict k_base, const KV* __restrict v_base,  // this kv head's slot 0
                int64_t block_stride, int64_t slot_stride, const int32_t* __restrict table, int64_t block_size,
                int64_t lo, int64_t len, int64_t G, int64_t D, float* __restrict scores,  // (G, len - lo)
                float* __restrict acc) {  // (G, D)
  const int64_t n = len - lo;
  float mx[kMaxGroup];
  for (int64_t g = 0; g < G; ++g) mx[g] = -std::numeric_limits<float>::infinity();
  float widened[kMaxHeadDim];  // a bf16 row in fp32 (fp32 rows are read in place)
  for (int64_t j = lo; j < len; ++j) {
    const KV* k = k_base + table[j / block_size] * block_stride + (j % block_size) * slot_stride;
    const float* kf = row_f32(k, widened, D);
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = q + g * D;
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t d = 0; d < D; ++d) s += qg[d] * kf[d];
      scores[g * n + (j - lo)] = s;
      mx[g] = std::max(mx[g], s);
    }
  }
  float inv_sum[kMaxGroup];
  softmax_numerators(scores, mx, G, n, inv_sum);
  if constexpr (std::is_same_v<KV, bf16>) round_probs_bf16(scores, G, n, inv_sum);
  std::fill(acc, acc + G * D, 0.f);
  for (int64_t j = lo; j < len; ++j) {
    const KV* v = v_base + table[j / block_size] * block_stride + (j % block_size) * slot_stride;
    const float* vf = row_f32(v, widened, D);
    for (int64_t g = 0; g < G; ++g) {
      const float p = scores[g * n + (j - lo)];
      float* ag = acc + g * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) ag[d] += p * vf[d];
    }
  }
  for (int64_t g = 0; g < G; ++g) {
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) acc[g * D + d] *= inv_sum[g];
  }
}

#if defined(LORAPLEX_AVX2_ATTENTION)
// Scores of GN query rows (q + u * D, pre-scaled: 4 positions' rows at prefill) against the 16 keys of kt
// (kt[d][j]: key j's dim d): 2 GN independent chains of 8 lanes, into s[u * ss ...] (16 each).
template <int GN>
inline void scores16(const float* q, int64_t D, const float (*kt)[16], float* s, int64_t ss) {
  __m256 acc[GN][2];
  for (int u = 0; u < GN; ++u) acc[u][0] = acc[u][1] = _mm256_setzero_ps();
#pragma GCC unroll 4
  for (int64_t d = 0; d < D; ++d) {
    const __m256 k0 = _mm256_load_ps(kt[d]), k1 = _mm256_load_ps(kt[d] + 8);
#pragma GCC unroll 4
    for (int u = 0; u < GN; ++u) {
      const __m256 qd = _mm256_broadcast_ss(q + u * D + d);
      acc[u][0] = _mm256_fmadd_ps(qd, k0, acc[u][0]);
      acc[u][1] = _mm256_fmadd_ps(qd, k1, acc[u][1]);
    }
  }
  for (int u = 0; u < GN; ++u) {
    _mm256_storeu_ps(s + u * ss, acc[u][0]);
    _mm256_storeu_ps(s + u * ss + 8, acc[u][1]);
  }
}

// The 8 sums of v[0 .. 8)'s lanes, lane u = v[u]'s (an add tree of horizontal adds, one 128-bit fold).
inline __m256 hsum8x8(const __m256 v[8]) {
  const __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  // lanes: v[0..3] low half | high half
  const __m128 lo = _mm_add_ps(_mm256_castps256_ps128(u0), _mm256_extractf128_ps(u0, 1));
  const __m128 hi = _mm_add_ps(_mm256_castps256_ps128(u1), _mm256_extractf128_ps(u1, 1));
  return _mm256_insertf128_ps(_mm256_castps128_ps256(lo), hi, 1);
}

// Scores of GN query rows (q + u * D, pre-scaled) against the 8 key rows k[0 .. 8) as they lie in the cache
// (D a multiple of 8): KP keys at a time, GN x KP chains of 8-lane partial products over D (enough
// independent FMAs to cover their latency), then one horizontal add tree per row of 8 keys, into
// s[u * ss ...] (8 each). Reading rows in place leaves nothing to transpose: at decode a row meets only the
// G heads of its kv head, too few to pay for transposing it.
template <int GN, typename KV>
inline void scores8_rows(const float* q, int64_t D, const KV* const* k, float* s, int64_t ss) {
  constexpr int KP = GN == 1 ? 8 : GN == 4 ? 2 : 4;  // GN x KP accumulators + GN q + 1 key in 16 registers
  __m256 part[GN][8];
  for (int j0 = 0; j0 < 8; j0 += KP) {
    __m256 acc[GN][KP];
    for (int u = 0; u < GN; ++u)
      for (int j = 0; j < KP; ++j) acc[u][j] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
      __m256 qd[GN];
      for (int u = 0; u < GN; ++u) qd[u] = _mm256_loadu_ps(q + u * D + d);
      for (int j = 0; j < KP; ++j) {
        const __m256 kv = load8_f32(k[j0 + j] + d);
        for (int u = 0; u < GN; ++u) acc[u][j] = _mm256_fmadd_ps(qd[u], kv, acc[u][j]);
      }
    }
    for (int u = 0; u < GN; ++u)
      for (int j = 0; j < KP; ++j) part[u][j0 + j] = acc[u][j];
  }
  for (int u = 0; u < GN; ++u) _mm256_storeu_ps(s + u * ss, hsum8x8(part[u]));
}

// acc[g][c0, c0 + 8 C) += sum_{j < nk} p[g][j] v_j[c0, c0 + 8 C) for GN heads (p rows n apart), values at
// v_base + offs[j]: GN x C chains of 8 lanes, each value slice loaded once for the GN heads.
template <int GN, int C, typename KV>
inline void values_rows(const float* p, int64_t n, int64_t nk, const KV* v_base, const int64_t* offs, int64_t c0,
                        int64_t D, float* acc) {
  __m256 a[GN][C];
  for (int u = 0; u < GN; ++u)
    for (int c = 0; c < C; ++c) a[u][c] = _mm256_loadu_ps(acc + u * D + c0 + 8 * c);
  for (int64_t j = 0; j < nk; ++j) {
    const KV* v = v_base + offs[j] + c0;
    __m256 vc[C];
    for (int c = 0; c < C; ++c) vc[c] = load8_f32(v + 8 * c);
    for (int u = 0; u < GN; ++u) {
      const __m256 pu = _mm256_broadcast_ss(p + u * n + j);
      for (int c = 0; c < C; ++c) a[u][c] = _mm256_fmadd_ps(pu, vc[c], a[u][c]);
    }
  }
  for (int u = 0; u < GN; ++u)
    for (int c = 0; c < C; ++c) _mm256_storeu_ps(acc + u * D + c0 + 8 * c, a[u][c]);
}

// The rows of keys or values [j0, j0 + 16) (or fewer, to n) into L2, while the block before them is computed.
template <typename KV>
inline void fetch_rows(const KV* base, const int64_t* offs, int64_t j0, int64_t n, int64_t D) {
  const int64_t bytes = D * static_cast<int64_t>(sizeof(KV)) + (std::is_same_v<KV, int8_t> ? kInt8ScaleBytes : 0);
  for (int64_t j = j0; j < std::min<int64_t>(n, j0 + 16); ++j)
    for (int64_t b = 0; b < bytes; b += 64)
      __builtin_prefetch(reinterpret_cast<const char*>(base + offs[j]) + b, 0, 2);
}

// decode_one's AVX2 twin for float32, bf16 and int8 rows (widened to fp32 as they are read; an int8 row's scale
// multiplies its key's score, and its value row's folds into that key's probability), D a multiple of 16: keys
// read as rows in place, 8 at a time scored by up to 4 heads in register chains with one horizontal add tree
// per 8 keys and head (scores8_rows; transposing them cost more than it saved: a third of the op's samples);
// then the same softmax; then P @ V in blocks of 16 keys, 32 dims x 3 heads (or 16 x 4) at a time in registers
// (values_rows; decode_one adds every key's row into acc in memory). Each block's rows are fetched while the
// block before them is computed: the rows of a sequence lie in blocks scattered over the cache, and a pass
// that reads one slice of every row waits on memory for each (measured). offs: n scratch offsets.
template <typename KV>
void decode_one_avx2(const float* __restrict q, const KV* __restrict k_base, const KV* __restrict v_base,
                     int64_t block_stride, int64_t slot_stride, const int32_t* __restrict table, int64_t block_size,
                     int64_t lo, int64_t len, int64_t G, int64_t D, float* __restrict scores, int64_t* offs,
                     float* __restrict acc, const float* prior = nullptr) {
  const int64_t n = len - lo;
  slot_offsets(table, block_size, block_stride, slot_stride, lo, len, offs);
  // the rows past n of a last group of 8 keys (an int8 row's scale, 0, past its D values)
  alignas(32) static const KV zeros[kMaxHeadDim + kInt8ScaleBytes] = {};
  alignas(32) float tail[kMaxGroup][8];  // that group's scores (past n: not stored)
  fetch_rows(k_base, offs, 0, n, D);
  fetch_rows(k_base, offs, 16, n, D);
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    fetch_rows(k_base, offs, j0 + 32, n, D);
    fetch_rows(v_base, offs, j0, n, D);  // the values' turn comes after the last block: into L2 meanwhile
    for (int64_t j8 = j0; j8 < std::min<int64_t>(n, j0 + 16); j8 += 8) {
      const int64_t nk = std::min<int64_t>(8, n - j8);
      const KV* rows[8];
      for (int j = 0; j < 8; ++j) rows[j] = j < nk ? k_base + offs[j8 + j] : zeros;
      float* s = nk == 8 ? scores + j8 : &tail[0][0];
      const int64_t ss = nk == 8 ? n : 8;
      for (int64_t g0 = 0; g0 < G; g0 += 4) {
        switch (std::min<int64_t>(4, G - g0)) {
          case 4: scores8_rows<4>(q + g0 * D, D, rows, s + g0 * ss, ss); break;
          case 3: scores8_rows<3>(q + g0 * D, D, rows, s + g0 * ss, ss); break;
          case 2: scores8_rows<2>(q + g0 * D, D, rows, s + g0 * ss, ss); break;
          default: scores8_rows<1>(q + g0 * D, D, rows, s + g0 * ss, ss); break;
        }
      }
      if constexpr (std::is_same_v<KV, int8_t>) {  // int8 rows: each key's dot product times its row's scale
        alignas(32) float ks[8];
        for (int j = 0; j < 8; ++j) ks[j] = kv_scale(rows[j], D);
        const __m256 kscale = _mm256_load_ps(ks);
        for (int64_t g = 0; g < G; ++g) _mm256_storeu_ps(s + g * ss, _mm256_mul_ps(_mm256_loadu_ps(s + g * ss), kscale));
      }
      if (nk < 8)
        for (int64_t g = 0; g < G; ++g) std::memcpy(scores + g * n + j8, tail[g], static_cast<size_t>(nk) * sizeof(float));
    }
  }
  float mx[kMaxGroup], inv_sum[kMaxGroup];
  for (int64_t g = 0; g < G; ++g) {
    const float* sg = scores + g * n;
    __m256 mv = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(sg + i));
    mx[g] = hmax8(mv);
    for (; i < n; ++i) mx[g] = std::max(mx[g], sg[i]);
  }
  softmax_numerators(scores, mx, G, n, inv_sum);
  float sum[kMaxGroup];  // the numerators' sums, for a merge with prior
  for (int64_t g = 0; g < G; ++g) sum[g] = 1.f / inv_sum[g];
  // (probabilities in bf16 as the AVX-512 kernel weighs them; with a prior they stay fp32, as the shared pass
  // keeps them: rounding there would take the row's whole sum, which only the merge below knows)
  if constexpr (std::is_same_v<KV, bf16>)
    if (!prior) round_probs_bf16(scores, G, n, inv_sum);
  if constexpr (std::is_same_v<KV, int8_t>)  // int8 rows: each value row's scale folded into its probabilities
    for (int64_t j = 0; j < n; ++j) {
      const float sv = kv_scale(v_base + offs[j], D);
      for (int64_t g = 0; g < G; ++g) scores[g * n + j] *= sv;
    }
  std::fill(acc, acc + G * D, 0.f);
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const int64_t nk = std::min<int64_t>(16, n - j0);
    for (int64_t g0 = 0; g0 < G; g0 += 4)
      for (int64_t c0 = 0; c0 < D;) {  // 32 columns a pass (16 for 4 heads, or at a 16-column tail)
        const float* p = scores + g0 * n + j0;
        float* a = acc + g0 * D;
        const int64_t gn = std::min<int64_t>(4, G - g0);
        if (gn < 4 && c0 + 32 <= D) {
          switch (gn) {
            case 3: values_rows<3, 4>(p, n, nk, v_base, offs + j0, c0, D, a); break;
            case 2: values_rows<2, 4>(p, n, nk, v_base, offs + j0, c0, D, a); break;
            default: values_rows<1, 4>(p, n, nk, v_base, offs + j0, c0, D, a); break;
          }
          c0 += 32;
          continue;
        }
        switch (gn) {
          case 4: values_rows<4, 2>(p, n, nk, v_base, offs + j0, c0, D, a); break;
          case 3: values_rows<3, 2>(p, n, nk, v_base, offs + j0, c0, D, a); break;
          case 2: values_rows<2, 2>(p, n, nk, v_base, offs + j0, c0, D, a); break;
          default: values_rows<1, 2>(p, n, nk, v_base, offs + j0, c0, D, a); break;
        }
        c0 += 16;
      }
  }
  for (int64_t g = 0; g < G; ++g) {
    if (prior) {  // this pass's result (acc * inv_sum, of weight sum) and prior's (m, l, acc) on one max
      const float* pr = prior + g * (D + 2);
      const float top = std::max(mx[g], pr[0]);
      const float own = sum[g] * std::exp(mx[g] - top), at = std::exp(pr[0] - top);
      const float inv = 1.f / (own + pr[1] * at);
      const __m256 w = _mm256_set1_ps(inv_sum[g] * own * inv), wp = _mm256_set1_ps(at * inv);
      for (int64_t d = 0; d < D; d += 8)
        _mm256_storeu_ps(acc + g * D + d, _mm256_fmadd_ps(_mm256_loadu_ps(acc + g * D + d), w,
                                                          _mm256_mul_ps(_mm256_loadu_ps(pr + 2 + d), wp)));
      continue;
    }
    const __m256 iv = _mm256_set1_ps(inv_sum[g]);
    for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(acc + g * D + d, _mm256_mul_ps(_mm256_loadu_ps(acc + g * D + d), iv));
  }
}

// A block of keys [j0, j0 + nk) (nk <= 16) along `table`, for the AVX2 tiles that score many query rows against
// it: the keys transposed into kt (kt[d][j]: key j's dim d; past nk zeros) and vrow[j] the value rows in fp32
// (float32 rows in place, bf16 ones widened into vf once).
template <typename KV, int D>
inline void key_block_avx2(const KV* k_base, const KV* v_base, int64_t block_stride, int64_t slot_stride,
                           const int32_t* table, int64_t block_size, int64_t j0, int64_t nk, float (*kt)[16],
                           float (*vf)[D], const float** vrow) {
  static_assert(!std::is_same_v<KV, int8_t>, "int8 rows carry a scale: widen them first (widened_blocks)");
  const KV* krow[16];
  int64_t off[16];
  slot_offsets(table, block_size, block_stride, slot_stride, j0, j0 + nk, off);
  for (int64_t j = 0; j < nk; ++j) {
    krow[j] = k_base + off[j];
    if constexpr (std::is_same_v<KV, float>) {
      vrow[j] = v_base + off[j];
    } else {
      for (int d = 0; d < D; d += 8) _mm256_store_ps(vf[j] + d, load8_f32(v_base + off[j] + d));
      vrow[j] = vf[j];
    }
  }
  for (int v = 0; v < 2; ++v)
    for (int d0 = 0; d0 < D; d0 += 8) {
      __m256 in[8], tr[8];
      for (int j = 0; j < 8; ++j) in[j] = 8 * v + j < nk ? load8_f32(krow[8 * v + j] + d0) : _mm256_setzero_ps();
      transpose8(in, tr);
      for (int i = 0; i < 8; ++i) _mm256_store_ps(kt[d0 + i] + 8 * v, tr[i]);
    }
}

// Four rows of acc (D apart): acc[u] = acc[u] * corr[u] + sum_{j < nk} p[u][j] v_j, 16 dims a pass (4 rows x 2
// chains in registers, each value slice loaded once for the 4 rows).
template <int D, int KB = 16>
inline void pv_rows4(float* acc, const float (*p)[KB], const float* corr, int64_t nk, const float* const* vrow) {
  for (int c0 = 0; c0 < D; c0 += 16) {
    __m256 a[4][2];
    for (int u = 0; u < 4; ++u) {
      const __m256 cv = _mm256_set1_ps(corr[u]);
      a[u][0] = _mm256_mul_ps(_mm256_load_ps(acc + u * D + c0), cv);
      a[u][1] = _mm256_mul_ps(_mm256_load_ps(acc + u * D + c0 + 8), cv);
    }
    for (int64_t j = 0; j < nk; ++j) {
      const __m256 v0 = _mm256_loadu_ps(vrow[j] + c0), v1 = _mm256_loadu_ps(vrow[j] + c0 + 8);
#pragma GCC unroll 4
      for (int u = 0; u < 4; ++u) {
        const __m256 pv = _mm256_broadcast_ss(&p[u][j]);
        a[u][0] = _mm256_fmadd_ps(pv, v0, a[u][0]);
        a[u][1] = _mm256_fmadd_ps(pv, v1, a[u][1]);
      }
    }
    for (int u = 0; u < 4; ++u) {
      _mm256_store_ps(acc + u * D + c0, a[u][0]);
      _mm256_store_ps(acc + u * D + c0 + 8, a[u][1]);
    }
  }
}

// ---- Decode over a shared prefix (cascade attention) ----
// Sequences that share cached blocks from position 0 on (the radix cache hands a common prefix's blocks to every
// sequence that starts with it) read those keys once for all of them: one pass per group and kv head scores the
// prefix against every member's query rows together, as prefill scores a chunk's positions (each block of keys
// transposed once for all the rows, then 4-row tiles), and leaves each row's running max, sum and unnormalized
// P @ V. Each member's own pass then covers only its keys past the prefix and merges that state into its result
// (decode_one_avx2's `prior`). Per sequence, a decode row meets a key with only its G heads: too few rows to pay
// for a transpose, so its keys are scored as rows with a reduction per key; a group of 4 sequences brings 4 G.
constexpr int64_t kMinSharedKeys = 64;  // a shorter common prefix: each sequence reads it on its own
constexpr int64_t kSharedTileSeqs = 8;  // members per work item (8 G query rows a pass over the prefix)

// The keys two sequences share from position 0 on: their tables' equal leading blocks, at most all but the last
// key of the shorter (each member keeps a key of its own: its own pass is what merges the prefix's state).
inline int64_t shared_keys(const int32_t* ta, int64_t la, const int32_t* tb, int64_t lb, int64_t block_size) {
  const int64_t limit = std::min(la, lb) - 1;
  int64_t k = 0;
  while (k < limit && ta[k / block_size] == tb[k / block_size]) k += block_size;
  return std::max<int64_t>(0, std::min(k, limit));
}

struct SharedGroup {
  int64_t first, count, keys;  // order[first, first + count) share keys [0, keys)
};

// rows: the batch's rows sorted by their tables (sort_by_tables: the sequences sharing any prefix lie next to each
// other); returns the groups of 2 or more that share at least kMinSharedKeys, each as long a run as shares the
// prefix its first two rows share.
inline std::vector<SharedGroup> shared_groups(const std::vector<int64_t>& rows, const int32_t* tables,
                                              int64_t table_stride, const int64_t* ids, const int32_t* lens,
                                              int64_t block_size) {
  auto common = [&](int64_t a, int64_t c) {
    return shared_keys(tables + ids[a] * table_stride, lens[ids[a]], tables + ids[c] * table_stride, lens[ids[c]],
                       block_size);
  };
  std::vector<SharedGroup> groups;
  const int64_t B = static_cast<int64_t>(rows.size());
  for (int64_t i = 0; i + 1 < B;) {
    const int64_t keys = common(rows[i], rows[i + 1]);
    if (keys < kMinSharedKeys) {
      ++i;
      continue;
    }
    int64_t j = i + 2;
    while (j < B && common(rows[i], rows[j]) >= keys) ++j;
    groups.push_back({i, j - i, keys});
    i = j;
  }
  return groups;
}

// One tile of a group's members against their shared keys [0, keys): each member's G query rows (qsrc[i], heads
// head_stride apart) scored together, 4 rows at a time; state[i] gets that member's G rows' running max, sum and
// unnormalized P @ V (D + 2 floats a row: m, l, acc).
template <typename Q, typename KV, int D>
void shared_prefix_avx2(const Q* const* qsrc, int64_t head_stride, int64_t members, int64_t G, float scale,
                        const KV* k_base, const KV* v_base, int64_t block_stride, int64_t slot_stride,
                        const int32_t* table, int64_t block_size, int64_t keys, float* const* state) {
  constexpr int64_t kRows = kSharedTileSeqs * kMaxGroup;
  const int64_t nr = members * G, tiles = (nr + 3) / 4;
  alignas(32) float qf[kRows][D];
  alignas(32) float acc[kRows][D];
  float m[kRows], l[kRows];
  for (int64_t i = 0; i < members; ++i) decode_queries<Q, KV>(qsrc[i], head_stride, G, D, scale, qf[i * G]);
  for (int64_t r = 0; r < 4 * tiles; ++r) {  // rows past nr: computed in the last tile, never stored
    if (r >= nr) std::fill(qf[r], qf[r] + D, 0.f);
    std::fill(acc[r], acc[r] + D, 0.f);
    m[r] = -std::numeric_limits<float>::infinity();
    l[r] = 0.f;
  }
  constexpr int64_t KB = 32;  // keys a block: two transposed halves of 16, one softmax step, one P @ V pass
  alignas(32) float kt[2][D][16];
  alignas(32) float vf[std::is_same_v<KV, float> ? 1 : KB][D];
  const float* vrow[KB];
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  auto fetch = [&](int64_t f0) {  // the next block's keys and values into L2 while this one is computed
    int64_t off[KB];
    const int64_t n = std::max<int64_t>(0, std::min(keys, f0 + KB) - f0);
    slot_offsets(table, block_size, block_stride, slot_stride, f0, f0 + n, off);
    for (int64_t j = 0; j < n; ++j)
      for (int64_t b = 0; b < D * static_cast<int64_t>(sizeof(KV)); b += 64) {
        __builtin_prefetch(reinterpret_cast<const char*>(k_base + off[j]) + b, 0, 2);
        __builtin_prefetch(reinterpret_cast<const char*>(v_base + off[j]) + b, 0, 2);
      }
  };
  fetch(0);
  for (int64_t j0 = 0; j0 < keys; j0 += KB) {
    const int64_t nk = std::min(KB, keys - j0);
    fetch(j0 + KB);
    for (int64_t h = 0; h < 2 && 16 * h < nk; ++h)
      key_block_avx2<KV, D>(k_base, v_base, block_stride, slot_stride, table, block_size, j0 + 16 * h,
                            std::min<int64_t>(16, nk - 16 * h), kt[h], std::is_same_v<KV, float> ? vf : vf + 16 * h,
                            vrow + 16 * h);
    __m256 valid[4];  // keys [j0, j0 + nk) of the lanes
    for (int v = 0; v < 4; ++v)
      valid[v] = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(nk - 8 * v)), lanes));
    for (int64_t t = 0; t < tiles; ++t) {
      alignas(32) float sc[2][4][16];
      alignas(32) float p[4][KB];
      float corr[4];
      scores16<4>(qf[4 * t], D, kt[0], &sc[0][0][0], 16);
      if (nk > 16) scores16<4>(qf[4 * t], D, kt[1], &sc[1][0][0], 16);
      for (int u = 0; u < 4; ++u) {  // the online softmax of prefill_item_avx2, every key visible
        const int64_t r = 4 * t + u;
        __m256 s[4];
        for (int v = 0; v < 4; ++v)
          s[v] = _mm256_blendv_ps(neg_inf, v < 2 || nk > 16 ? _mm256_load_ps(sc[v / 2][u] + 8 * (v % 2)) : neg_inf,
                                  valid[v]);
        const float m_new = std::max(m[r], hmax8(_mm256_max_ps(_mm256_max_ps(s[0], s[1]), _mm256_max_ps(s[2], s[3]))));
        corr[u] = std::exp(m[r] - m_new);  // 0 on the first block (m = -inf)
        const __m256 mv = _mm256_set1_ps(m_new);
        __m256 total = _mm256_setzero_ps();
        for (int v = 0; v < 4; ++v) {
          const __m256 e = _mm256_and_ps(valid[v], exp8(_mm256_sub_ps(s[v], mv)));
          _mm256_store_ps(p[u] + 8 * v, e);
          total = _mm256_add_ps(total, e);
        }
        l[r] = l[r] * corr[u] + hsum8(total);
        m[r] = m_new;
      }
      pv_rows4<D, KB>(acc[4 * t], p, corr, nk, vrow);
    }
  }
  for (int64_t i = 0; i < members; ++i)
    for (int64_t g = 0; g < G; ++g) {
      float* st = state[i] + g * (D + 2);
      st[0] = m[i * G + g];
      st[1] = l[i * G + g];
      std::memcpy(st + 2, acc[i * G + g], D * sizeof(float));
    }
}
#endif

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const bf16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const int8_t* p) {  // unscaled: the caller applies the row's kv_scale
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// Sum of each of 16 vectors, lane u = sum of s[u]'s lanes (a transpose-and-add tree: 15 vector adds
// for 16 sums where _mm512_reduce_add_ps costs four shuffle-adds per sum).
inline __m512 hsum16(const __m512* s) {
  __m512 a[8], b[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [x0+x2, y0+y2, x1+x3, y1+y3]
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(s[2 * i], s[2 * i + 1]), _mm512_unpackhi_ps(s[2 * i], s[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane L: that lane's partial sum of keys 4i .. 4i+3
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  // add the four 128-bit lanes of each b[i], leaving b[i]'s sums in lane i
  const __m512 d01 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x44), _mm512_shuffle_f32x4(b[0], b[1], 0xEE));
  const __m512 d23 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x44), _mm512_shuffle_f32x4(b[2], b[3], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d01, d23, 0x88), _mm512_shuffle_f32x4(d01, d23, 0xDD));
}

// Rows off[0 .. count) of `base` fetched into L2, row_bytes each: blocks are scattered, so the hardware
// prefetcher starts cold at every block boundary.
template <typename KV>
inline void prefetch_rows(const KV* base, const int64_t* off, int64_t count, int64_t row_bytes) {
  for (int64_t u = 0; u < count; ++u) {
    const char* row = reinterpret_cast<const char*>(base + off[u]);
    for (int64_t b = 0; b < row_bytes; b += 64) _mm_prefetch(row + b, _MM_HINT_T1);
  }
}

// The 16 keys from j0 of n (rows past n read `zeros`): their rows, and how many exist. Meanwhile the next 16
// keys and these 16 positions' values (for the pass over the values) are fetched into L2.
template <typename KV>
inline int key_chunk(const KV* k_base, const KV* v_base, const int64_t* off, int64_t j0, int64_t n,
                     int64_t row_bytes, const KV* zeros, const KV** rows) {
  const int nk = static_cast<int>(std::min<int64_t>(16, n - j0));
  prefetch_rows(k_base, off + j0 + 16, std::min<int64_t>(16, n - j0 - 16), row_bytes);
  prefetch_rows(v_base, off + j0, nk, row_bytes);
  for (int u = 0; u < 16; ++u) rows[u] = u < nk ? k_base + off[j0 + u] : zeros;
  return nk;
}

// The mask of lanes 0 .. k - 1 (all 16 from k = 16 on).
inline __mmask16 first_lanes(int64_t k) { return static_cast<__mmask16>(k >= 16 ? 0xFFFF : (1u << k) - 1); }

// out(NG, D) = (sum_j p[g, j] V[j]) * inv_sum[g] for NG query heads, NG * C accumulators in registers.
template <typename KV, int C, int NG>
void decode_values(const float* __restrict p, int64_t n, const KV* __restrict v_base, const int64_t* __restrict off,
                   const float* inv_sum, float* __restrict out) {
  __m512 a[NG][C];
  for (int g = 0; g < NG; ++g)
    for (int c = 0; c < C; ++c) a[g][c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const KV* v = v_base + off[j];
    const float sv = kv_scale(v, 16 * C);  // 1 but for int8 rows
    __m512 vc[C];
    for (int c = 0; c < C; ++c) vc[c] = load16(v + 16 * c);
    for (int g = 0; g < NG; ++g) {
      const __m512 pg = _mm512_set1_ps(p[g * n + j] * sv);
      for (int c = 0; c < C; ++c) a[g][c] = _mm512_fmadd_ps(pg, vc[c], a[g][c]);
    }
  }
  for (int g = 0; g < NG; ++g)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(out + g * 16 * C + 16 * c, _mm512_mul_ps(a[g][c], _mm512_set1_ps(inv_sum[g])));
}

// The scores of 16 keys (rows[u], fp32, D = 16 C) for each of G query heads (q (G, D) fp32): q . k * scale.
template <int C>
inline void score16_f32(const float* __restrict q, const float* const* rows, int64_t G, float scale, __mmask16 valid,
                        float* __restrict scores, int64_t n, __m512* mxv) {
  for (int64_t g = 0; g < G; ++g) {
    __m512 qc[C];
    for (int c = 0; c < C; ++c) qc[c] = _mm512_loadu_ps(q + g * 16 * C + 16 * c);
    __m512 s[16];
    for (int u = 0; u < 16; ++u) {
      s[u] = _mm512_mul_ps(qc[0], _mm512_loadu_ps(rows[u]));
      for (int c = 1; c < C; ++c) s[u] = _mm512_fmadd_ps(qc[c], _mm512_loadu_ps(rows[u] + 16 * c), s[u]);
    }
    const __m512 sc = _mm512_mul_ps(hsum16(s), _mm512_set1_ps(scale));
    _mm512_mask_storeu_ps(scores + g * n, valid, sc);
    mxv[g] = _mm512_mask_max_ps(mxv[g], valid, mxv[g], sc);
  }
}

#if defined(__AVX512BF16__)
// The same for bf16 keys and bf16 queries (qb: (G, D) bf16): VDPBF16PS multiplies pairs of bf16 exactly and
// sums in fp32, so the keys are read as they are stored, never widened.
template <int C>
inline void score16_bf16(const bf16* __restrict qb, const bf16* const* rows, int64_t G, float scale, __mmask16 valid,
                         float* __restrict scores, int64_t n, __m512* mxv) {
  constexpr int P = C / 2;  // zmm of 32 bf16 per head_dim
  for (int64_t g = 0; g < G; ++g) {
    __m512i qc[P];
    for (int c = 0; c < P; ++c) qc[c] = _mm512_loadu_si512(qb + g * 16 * C + 32 * c);
    __m512 s[16];
    for (int u = 0; u < 16; ++u) {
      s[u] = _mm512_setzero_ps();
      for (int c = 0; c < P; ++c)
        s[u] = _mm512_dpbf16_ps(s[u], (__m512bh)qc[c], (__m512bh)_mm512_loadu_si512(rows[u] + 32 * c));
    }
    const __m512 sc = _mm512_mul_ps(hsum16(s), _mm512_set1_ps(scale));
    _mm512_mask_storeu_ps(scores + g * n, valid, sc);
    mxv[g] = _mm512_mask_max_ps(mxv[g], valid, mxv[g], sc);
  }
}

// The probabilities of G heads (numerators scores (G, n) times inv_sum) rounded to bf16 as round_probs_bf16
// does, laid out as G rows of ceil(n / 2) pairs (p_2i, p_2i+1) (a missing last one 0): bf16 p in order are
// those pairs, the operand VDPBF16PS takes.
inline void prob_pairs_bf16(const float* __restrict scores, int64_t G, int64_t n, const float* inv_sum,
                            int32_t* __restrict pairs) {
  const int64_t np = (n + 1) / 2;
  for (int64_t g = 0; g < G; ++g) {
    const float* e = scores + g * n;
    auto* pb = reinterpret_cast<uint16_t*>(pairs + g * np);
    const __m512 s = _mm512_set1_ps(inv_sum[g]);
    for (int64_t j = 0; j < 2 * np; j += 16) {  // lanes past n load 0, and round to bf16 0
      const __mmask16 in = first_lanes(n - j), out = first_lanes(2 * np - j);
      const __m256bh r = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_maskz_loadu_ps(in, e + j), s));
      _mm256_mask_storeu_epi16(pb + j, out, (__m256i)r);
    }
  }
}

// out(NG, D) = sum_j p[g, j] V[j] over bf16 value rows by VDPBF16PS, two keys per instruction: rows j and j + 1
// interleaved 16 bits at a time (unpacklo / unpackhi), against the pair (p_j, p_j+1) of each head (pairs: NG
// rows of ceil(n / 2)). Lanes of an interleaved vector hold the dims 8 l + {0..3} (unpacklo) or 8 l + {4..7}
// (unpackhi) of its 32-dim half, l the 128-bit lane: put back at the store.
template <int C, int NG>
void decode_values_bf16(const int32_t* __restrict pairs, int64_t n, const bf16* __restrict v_base,
                        const int64_t* __restrict off, float* __restrict out) {
  constexpr int D = 16 * C, H = D / 32;  // zmm of 32 bf16 per row
  const int64_t np = (n + 1) / 2;
  __m512 a[NG][2 * H];
  for (int g = 0; g < NG; ++g)
    for (int c = 0; c < 2 * H; ++c) a[g][c] = _mm512_setzero_ps();
  alignas(64) static const bf16 zeros[D] = {};
  for (int64_t jp = 0; jp < np; ++jp) {
    const bf16* v0 = v_base + off[2 * jp];
    const bf16* v1 = 2 * jp + 1 < n ? v_base + off[2 * jp + 1] : zeros;
    __m512i x[2 * H];
    for (int h = 0; h < H; ++h) {
      const __m512i r0 = _mm512_loadu_si512(v0 + 32 * h), r1 = _mm512_loadu_si512(v1 + 32 * h);
      x[2 * h] = _mm512_unpacklo_epi16(r0, r1);
      x[2 * h + 1] = _mm512_unpackhi_epi16(r0, r1);
    }
    for (int g = 0; g < NG; ++g) {
      const __m512i pg = _mm512_set1_epi32(pairs[g * np + jp]);
      for (int c = 0; c < 2 * H; ++c) a[g][c] = _mm512_dpbf16_ps(a[g][c], (__m512bh)x[c], (__m512bh)pg);
    }
  }
  for (int g = 0; g < NG; ++g) {
    alignas(64) float t[16];
    for (int c = 0; c < 2 * H; ++c) {
      _mm512_store_ps(t, a[g][c]);
      const int64_t base = 32 * (c / 2) + 4 * (c % 2);
      for (int k = 0; k < 16; ++k) out[g * D + base + 8 * (k / 4) + (k % 4)] = t[k];
    }
  }
}
#endif

// decode_one for head_dim = 16 * C, in AVX-512 registers. Scores 16 keys at a time: each query head's 16
// dot products are summed by one hsum16 tree into a vector of 16 scores (bf16 keys with bf16 queries by
// bf16 dot products where the CPU has them, `qb`; otherwise widened once to fp32 and shared by the G
// heads). Values: the query heads in chunks whose accumulators fit in registers (16 / C heads), each chunk
// one pass over the values; bf16 values weigh bf16 probabilities (round_probs_bf16), by bf16 dot products of
// two keys at a time where the CPU has them (pairs: G * ceil(n / 2) scratch). q: (G, D) fp32, unscaled (over
// a bf16 cache, bf16 values: qb's).
template <typename KV, int C>
void decode_one_avx512(const float* __restrict q, const bf16* qb, const KV* __restrict k_base,
                       const KV* __restrict v_base, int64_t block_stride, int64_t slot_stride,
                       const int32_t* __restrict table, int64_t block_size, int64_t lo, int64_t len, int64_t G,
                       float scale, float* __restrict scores, int64_t* __restrict off, int32_t* __restrict pairs,
                       float* __restrict acc) {
  constexpr int D = 16 * C;
  const int64_t n = len - lo;
  alignas(64) static const KV zeros[D] = {};
  alignas(64) float kf[16][D];  // bf16 keys widened once (no bf16 dot products)
  __m512 mxv[kMaxGroup];
  for (int64_t g = 0; g < G; ++g) mxv[g] = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  slot_offsets(table, block_size, block_stride, slot_stride, lo, len, off);
  constexpr int64_t row_bytes = D * static_cast<int64_t>(sizeof(KV)) + (std::is_same_v<KV, int8_t> ? kInt8ScaleBytes : 0);
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const KV* rows[16];
    const int nk = key_chunk(k_base, v_base, off, j0, n, row_bytes, zeros, rows);
    const __mmask16 valid = first_lanes(nk);
    if constexpr (std::is_same_v<KV, float>) {
      score16_f32<C>(q, rows, G, scale, valid, scores + j0, n, mxv);
    } else {
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<KV, bf16>) {
        if (qb != nullptr) {
          score16_bf16<C>(qb, rows, G, scale, valid, scores + j0, n, mxv);
          continue;
        }
      }
#endif
      const float* frows[16];
      for (int u = 0; u < 16; ++u) {  // widened once, shared by the G heads (int8: times the row's scale)
        const __m512 s = _mm512_set1_ps(u < nk ? kv_scale(rows[u], D) : 0.f);
        for (int c = 0; c < C; ++c) _mm512_store_ps(kf[u] + 16 * c, _mm512_mul_ps(load16(rows[u] + 16 * c), s));
        frows[u] = kf[u];
      }
      score16_f32<C>(q, frows, G, scale, valid, scores + j0, n, mxv);
    }
  }
  float mx[kMaxGroup], inv_sum[kMaxGroup];
  for (int64_t g = 0; g < G; ++g) mx[g] = _mm512_reduce_max_ps(mxv[g]);
  softmax_numerators(scores, mx, G, n, inv_sum);
  constexpr int NG = 16 / C;  // query heads per pass over the values
  if constexpr (std::is_same_v<KV, bf16>) {
#if defined(__AVX512BF16__)
    prob_pairs_bf16(scores, G, n, inv_sum, pairs);
    const int64_t np = (n + 1) / 2;
    for (int64_t g0 = 0; g0 < G; g0 += NG) {
      const int32_t* pg = pairs + g0 * np;
      float* out = acc + g0 * D;
      switch (std::min<int64_t>(NG, G - g0)) {
        case 1: decode_values_bf16<C, 1>(pg, n, v_base, off, out); break;
        case 2: decode_values_bf16<C, 2>(pg, n, v_base, off, out); break;
        case 3: if constexpr (NG >= 3) decode_values_bf16<C, 3>(pg, n, v_base, off, out); break;
        default: if constexpr (NG >= 4) decode_values_bf16<C, 4>(pg, n, v_base, off, out); break;
      }
    }
    return;
#else
    (void)pairs;
    round_probs_bf16(scores, G, n, inv_sum);
#endif
  }
  for (int64_t g0 = 0; g0 < G; g0 += NG) {
    const float* p = scores + g0 * n;
    float* out = acc + g0 * D;
    switch (std::min<int64_t>(NG, G - g0)) {
      case 1: decode_values<KV, C, 1>(p, n, v_base, off, inv_sum + g0, out); break;
      case 2: decode_values<KV, C, 2>(p, n, v_base, off, inv_sum + g0, out); break;
      case 3: if constexpr (NG >= 3) decode_values<KV, C, 3>(p, n, v_base, off, inv_sum + g0, out); break;
      default: if constexpr (NG >= 4) decode_values<KV, C, 4>(p, n, v_base, off, inv_sum + g0, out); break;
    }
  }
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// hsum16 of int32 vectors: lane u = the sum of s[u]'s lanes (the same tree).
inline __m512i hsum16_epi32(const __m512i* s) {
  __m512i a[8], b[4];
  for (int i = 0; i < 8; ++i)
    a[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(s[2 * i], s[2 * i + 1]), _mm512_unpackhi_epi32(s[2 * i], s[2 * i + 1]));
  for (int i = 0; i < 4; ++i)
    b[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_epi64(a[2 * i], a[2 * i + 1]));
  const __m512i d01 = _mm512_add_epi32(_mm512_shuffle_i32x4(b[0], b[1], 0x44), _mm512_shuffle_i32x4(b[0], b[1], 0xEE));
  const __m512i d23 = _mm512_add_epi32(_mm512_shuffle_i32x4(b[2], b[3], 0x44), _mm512_shuffle_i32x4(b[2], b[3], 0xEE));
  return _mm512_add_epi32(_mm512_shuffle_i32x4(d01, d23, 0x88), _mm512_shuffle_i32x4(d01, d23, 0xDD));
}

// out(NG, D) over int8 value rows: sum_j p16[g, j] v_j in int32 by VPDPWSSD, two keys per instruction (rows j, j+1
// widened to int16 and interleaved; p16 pairs packed as (p_j, p_j+1)), flushed to fp32 every 256 keys (no int32
// overflow: 256 * 32767 * 127 < 2^31), times unit[g] at the end. Lanes of an interleaved vector hold the dims
// 8 l + {0..3} (unpacklo) or 8 l + {4..7} (unpackhi) of its 32-dim half, l the 128-bit lane: put back at the store.
template <int C, int NG>
void decode_values_int8(const int32_t* __restrict pairs, int64_t n, const int8_t* __restrict v_base,
                        const int64_t* __restrict off, const float* unit, float* __restrict out) {
  constexpr int D = 16 * C, H = D / 32;  // int16 halves of 32 dims per row
  const int64_t np = (n + 1) / 2;  // pairs per head
  __m512 f[NG][2 * H];
  __m512i a[NG][2 * H];
  for (int g = 0; g < NG; ++g)
    for (int c = 0; c < 2 * H; ++c) {
      f[g][c] = _mm512_setzero_ps();
      a[g][c] = _mm512_setzero_si512();
    }
  alignas(64) static const int8_t zeros[D] = {};
  for (int64_t jp = 0; jp < np; ++jp) {
    const int8_t* v0 = v_base + off[2 * jp];
    const int8_t* v1 = 2 * jp + 1 < n ? v_base + off[2 * jp + 1] : zeros;
    __m512i x[2 * H];
    for (int h = 0; h < H; ++h) {
      const __m512i r0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v0 + 32 * h)));
      const __m512i r1 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v1 + 32 * h)));
      x[2 * h] = _mm512_unpacklo_epi16(r0, r1);
      x[2 * h + 1] = _mm512_unpackhi_epi16(r0, r1);
    }
    for (int g = 0; g < NG; ++g) {
      const __m512i pg = _mm512_set1_epi32(pairs[g * np + jp]);
      for (int c = 0; c < 2 * H; ++c) a[g][c] = _mm512_dpwssd_epi32(a[g][c], x[c], pg);
    }
    if ((jp & 127) == 127 || jp + 1 == np) {
      for (int g = 0; g < NG; ++g)
        for (int c = 0; c < 2 * H; ++c) {
          f[g][c] = _mm512_add_ps(f[g][c], _mm512_cvtepi32_ps(a[g][c]));
          a[g][c] = _mm512_setzero_si512();
        }
    }
  }
  for (int g = 0; g < NG; ++g) {
    alignas(64) float t[16];
    for (int c = 0; c < 2 * H; ++c) {
      _mm512_store_ps(t, _mm512_mul_ps(f[g][c], _mm512_set1_ps(unit[g])));
      const int64_t base = 32 * (c / 2) + 4 * (c % 2);
      for (int k = 0; k < 16; ++k) out[g * D + base + 8 * (k / 4) + (k % 4)] = t[k];
    }
  }
}

// decode_one over int8 rows (head_dim = 16 * C, 64 or 128) with integer products. Each query head is rounded
// to int8 as the cache rows are (scale qs = absmax / 127); VPDPBUSD multiplies it by the keys made unsigned
// (k + 128, one xor), and the 128 * sum(q) that adds is taken off once per head: scores = dot * qs * k_scale *
// scale. The probabilities, times each row's value scale, are rounded to int16 against their largest (p16 =
// p * sv * 32767 / max) for the values' VPDPWSSD. Rounding q costs up to half a step of its largest element
// per element, the probabilities 1/65534 of the largest: the tests hold this path to the naive reference over
// q rounded the same way. off: n scratch offsets; scores: (G + 1) * n floats; pairs: G * ceil(n / 2).
template <int C>
void decode_one_int8(const float* __restrict q, const int8_t* __restrict k_base, const int8_t* __restrict v_base,
                     int64_t block_stride, int64_t slot_stride, const int32_t* __restrict table, int64_t block_size,
                     int64_t lo, int64_t len, int64_t G, float scale, float* __restrict scores,
                     int32_t* __restrict pairs, int64_t* __restrict off, float* __restrict acc) {
  constexpr int D = 16 * C, QB = D / 64;  // zmm of 64 bytes per row
  const int64_t n = len - lo;
  alignas(64) static const int8_t zeros[D + kInt8ScaleBytes] = {};
  __m512i qv[kMaxGroup][QB];
  float qscale[kMaxGroup];
  int32_t qoffset[kMaxGroup];
  for (int64_t g = 0; g < G; ++g) {
    const float* qg = q + g * D;
    __m512 m = _mm512_setzero_ps();
    for (int c = 0; c < C; ++c) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(qg + 16 * c)));
    const float qs = _mm512_reduce_max_ps(m) / 127.f;
    const __m512 by = _mm512_set1_ps(qs > 0.f ? qs : 1.f);  // (all zeros: 0 / 1)
    alignas(64) int8_t b[D];
    __m512i total = _mm512_setzero_si512();
    for (int c = 0; c < C; ++c) {  // x / qs rounded to nearest even (MXCSR's default), as round_like_int8_rows
      const __m512i r = _mm512_cvtps_epi32(_mm512_div_ps(_mm512_loadu_ps(qg + 16 * c), by));
      const __m512i cl = _mm512_min_epi32(_mm512_max_epi32(r, _mm512_set1_epi32(-127)), _mm512_set1_epi32(127));
      total = _mm512_add_epi32(total, cl);
      _mm_store_si128(reinterpret_cast<__m128i*>(b + 16 * c), _mm512_cvtepi32_epi8(cl));
    }
    for (int c = 0; c < QB; ++c) qv[g][c] = _mm512_load_si512(b + 64 * c);
    qscale[g] = qs * scale;
    qoffset[g] = 128 * _mm512_reduce_add_epi32(total);
  }
  const __m512i sign = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 mxv[kMaxGroup];
  for (int64_t g = 0; g < G; ++g) mxv[g] = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  slot_offsets(table, block_size, block_stride, slot_stride, lo, len, off);
  constexpr int64_t row_bytes = D + kInt8ScaleBytes;
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const int8_t* rows[16];
    const int nk = key_chunk(k_base, v_base, off, j0, n, row_bytes, zeros, rows);
    const __mmask16 valid = first_lanes(nk);
    alignas(64) float ks[16];
    for (int u = 0; u < 16; ++u) ks[u] = kv_scale(rows[u], D);  // (zeros: scale 0)
    const __m512 kscale = _mm512_load_ps(ks);
    for (int64_t g = 0; g < G; ++g) {
      __m512i s[16];
      for (int u = 0; u < 16; ++u) {
        s[u] = _mm512_setzero_si512();
        for (int c = 0; c < QB; ++c)
          s[u] = _mm512_dpbusd_epi32(s[u], _mm512_xor_si512(_mm512_loadu_si512(rows[u] + 64 * c), sign), qv[g][c]);
      }
      const __m512i dots = _mm512_sub_epi32(hsum16_epi32(s), _mm512_set1_epi32(qoffset[g]));
      const __m512 sc = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(dots), kscale), _mm512_set1_ps(qscale[g]));
      _mm512_mask_storeu_ps(scores + g * n + j0, valid, sc);
      mxv[g] = _mm512_mask_max_ps(mxv[g], valid, mxv[g], sc);
    }
  }
  float mx[kMaxGroup], inv_sum[kMaxGroup], unit[kMaxGroup];
  for (int64_t g = 0; g < G; ++g) mx[g] = _mm512_reduce_max_ps(mxv[g]);
  softmax_numerators(scores, mx, G, n, inv_sum);
  // p * sv per key (the row's value scale), then as int16 against the head's largest: in memory, p16[j] and
  // p16[j + 1] are the pair (low, high) of int32 j / 2
  const int64_t np = (n + 1) / 2;
  float* sv = scores + G * n;  // n spare floats past the scores
  for (int64_t j = 0; j < n; ++j) sv[j] = kv_scale(v_base + off[j], D);
  for (int64_t g = 0; g < G; ++g) {
    float* pg = scores + g * n;
    __m512 m = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 k = first_lanes(n - j);
      const __m512 x = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, pg + j), _mm512_maskz_loadu_ps(k, sv + j));
      _mm512_mask_storeu_ps(pg + j, k, x);
      m = _mm512_max_ps(m, x);
    }
    const float pmax = _mm512_reduce_max_ps(m);
    const __m512 to16 = _mm512_set1_ps(pmax > 0.f ? 32767.f / pmax : 0.f);
    unit[g] = (pmax / 32767.f) * inv_sum[g];
    int16_t* p16 = reinterpret_cast<int16_t*>(pairs + g * np);
    p16[2 * np - 1] = 0;  // the pad of an odd n
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 k = first_lanes(n - j);
      const __m512i r = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_maskz_loadu_ps(k, pg + j), to16));
      _mm256_mask_storeu_epi16(p16 + j, k, _mm512_cvtepi32_epi16(r));
    }
  }
  constexpr int NG = 16 / C;
  for (int64_t g0 = 0; g0 < G; g0 += NG) {
    const int32_t* pp = pairs + g0 * np;
    float* out = acc + g0 * D;
    switch (std::min<int64_t>(NG, G - g0)) {
      case 1: decode_values_int8<C, 1>(pp, n, v_base, off, unit + g0, out); break;
      case 2: decode_values_int8<C, 2>(pp, n, v_base, off, unit + g0, out); break;
      case 3: if constexpr (NG >= 3) decode_values_int8<C, 3>(pp, n, v_base, off, unit + g0, out); break;
      default: if constexpr (NG >= 4) decode_values_int8<C, 4>(pp, n, v_base, off, unit + g0, out); break;
    }
  }
}
#endif

// Batch rows ordered by their sequences' block tables, lexicographically over the blocks they use: sequences
// that share a cached prefix share its blocks from the first one on (the radix cache), so they lie next to each
// other, the longest shared runs innermost.
inline void sort_by_tables(std::vector<int64_t>& rows, const int32_t* tables, int64_t table_stride,
                           const int64_t* ids, const int32_t* lens, int64_t block_size) {
  auto blocks = [&](int64_t b) { return (lens[ids[b]] + block_size - 1) / block_size; };
  std::stable_sort(rows.begin(), rows.end(), [&](int64_t a, int64_t c) {
    const int32_t* ta = tables + ids[a] * table_stride;
    const int32_t* tc = tables + ids[c] * table_stride;
    const int64_t na = blocks(a), nc = blocks(c);
    for (int64_t i = 0; i < std::min(na, nc); ++i)
      if (ta[i] != tc[i]) return ta[i] < tc[i];
    return na < nc;
  });
}

template <typename Q, typename KV>
void decode_attention_impl(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& seq_ids, const at::Tensor& seq_lens,
                           double scale, int64_t window, at::Tensor& out) {
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t Hkv = k_cache.size(2), block_size = k_cache.size(1), G = Hq / Hkv;
  const Q* qp = q.data_ptr<Q>();
  Q* op = out.data_ptr<Q>();
  const KV* kp = k_cache.data_ptr<KV>();
  const KV* vp = v_cache.data_ptr<KV>();
  const int64_t kb = k_cache.stride(0), ks = k_cache.stride(1), kh = k_cache.stride(2);
  const int64_t vb = v_cache.stride(0), vs = v_cache.stride(1), vh = v_cache.stride(2);
  TORCH_CHECK(kb == vb && ks == vs && kh == vh, "decode_attention: k_cache and v_cache need the same strides");
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t table_stride = block_tables.stride(0);
  const int64_t* ids = seq_ids.data_ptr<int64_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const float sc = static_cast<float>(scale);
  // Work items in head-major order, and within a head the rows sorted by their tables (sort_by_tables): the
  // rows sharing a cached prefix one after the other, so the second and later reads of its keys and values
  // come from L2 instead of memory (the order changes no result: every item is computed on its own). Each
  // thread walks its share in that order; a stolen item comes from a share's far end, so it seldom splits a
  // prefix group.
  std::vector<int64_t> rows(static_cast<size_t>(B));
  std::iota(rows.begin(), rows.end(), 0);
  sort_by_tables(rows, tables, table_stride, ids, lens, block_size);
#if defined(LORAPLEX_AVX2_ATTENTION)
  // Shared prefixes first (shared_groups): one pass per group, tile of members and kv head leaves each member's
  // state over the prefix in prior; the items below then read only their own keys and merge it.
  std::vector<int64_t> shared_lo(static_cast<size_t>(B), 0);  // a row's keys [0, shared_lo) are in prior
  // (B, Hq, D + 2): m, l, acc. The calling thread's buffer, kept from call to call (one call a layer); the items
  // reach it through `prior` (a thread_local named in them would be each worker's own)
  thread_local std::vector<float> prior_buffer;
  float* prior = nullptr;
  if constexpr (!std::is_same_v<KV, int8_t>) {
    if (window <= 0 && (D == 64 || D == 128)) {
      const auto groups = shared_groups(rows, tables, table_stride, ids, lens, block_size);
      std::vector<std::pair<const SharedGroup*, int64_t>> tiles;  // (group, its first member of the tile)
      for (const auto& grp : groups)
        for (int64_t i = 0; i < grp.count; i += kSharedTileSeqs) tiles.emplace_back(&grp, grp.first + i);
      if (!tiles.empty()) {
        prior_buffer.resize(static_cast<size_t>(B * Hq * (D + 2)));
        prior = prior_buffer.data();
        const int64_t nt = static_cast<int64_t>(tiles.size());
        parallel_stealing(nt * Hkv, [&](int64_t item, int64_t) {
          const auto [grp, i0] = tiles[item % nt];
          const int64_t h = item / nt, members = std::min(kSharedTileSeqs, grp->first + grp->count - i0);
          const Q* qsrc[kSharedTileSeqs];
          float* state[kSharedTileSeqs];
          for (int64_t i = 0; i < members; ++i) {
            const int64_t b = rows[i0 + i];
            qsrc[i] = qp + b * q.stride(0) + h * G * q.stride(1);
            state[i] = prior + (b * Hq + h * G) * (D + 2);
          }
          const int32_t* table = tables + ids[rows[grp->first]] * table_stride;
          if (D == 64)
            shared_prefix_avx2<Q, KV, 64>(qsrc, q.stride(1), members, G, sc, kp + h * kh, vp + h * kh, kb, ks, table,
                                          block_size, grp->keys, state);
          else
            shared_prefix_avx2<Q, KV, 128>(qsrc, q.stride(1), members, G, sc, kp + h * kh, vp + h * kh, kb, ks, table,
                                           block_size, grp->keys, state);
        });
        for (const auto& grp : groups)
          for (int64_t i = 0; i < grp.count; ++i) shared_lo[rows[grp.first + i]] = grp.keys;
      }
    }
  }
#endif
  struct Scratch {
    std::vector<float> scores;
    std::vector<int32_t> pairs;  // the probabilities in pairs: int16 (int8 caches), bf16 (bf16 caches)
    std::vector<int64_t> offs;  // the cache offsets of a sequence's positions
  };
  parallel_stealing(B * Hkv, [&](int64_t item, int64_t) {
    thread_local Scratch scratch;  // each thread's, kept from call to call (a step makes one call a layer)
    auto& [scores, pairs, offs] = scratch;
    float qf[kMaxGroup * kMaxHeadDim];
    [[maybe_unused]] alignas(64) bf16 qh[kMaxGroup * kMaxHeadDim];  // AVX-512 builds only
    float acc[kMaxGroup * kMaxHeadDim];
    const int64_t b = rows[item % B], h = item / B, s = ids[b];
    const int64_t len = lens[s];
    const int64_t lo = window > 0 ? std::max<int64_t>(0, len - window) : 0;
    if (len <= lo) {  // nothing visible (not reachable from the engine): zeros, not NaN
      for (int64_t i = 0; i < G * D; ++i) from_f(0.f, op + b * Hq * D + h * G * D + i);
      return;
    }
    scores.resize(static_cast<size_t>(G * (len - lo)));
    const Q* qsrc = qp + b * q.stride(0) + h * G * q.stride(1);
    const KV* kh_base = kp + h * kh;
    const KV* vh_base = vp + h * kh;
    const int32_t* table = tables + s * table_stride;
#if defined(__AVX512F__)
    if (D == 64 || D == 128) {
      // over a bf16 cache, q in bf16 (a bf16 q as it is, an fp32 one rounded): the scores' dot products
      const bf16* qbf = nullptr;
      if constexpr (std::is_same_v<KV, bf16>) {
        for (int64_t g = 0; g < G; ++g)
          for (int64_t d = 0; d < D; ++d) from_f(to_f(qsrc[g * q.stride(1) + d]), qh + g * D + d);
        qbf = qh;
      }
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d) qf[g * D + d] = qbf ? to_f(qbf[g * D + d]) : to_f(qsrc[g * q.stride(1) + d]);
      const int64_t n = len - lo;
      offs.resize(static_cast<size_t>(n));
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
      if constexpr (std::is_same_v<KV, int8_t>) {  // integer products (the kernel rounds q itself)
        scores.resize(static_cast<size_t>((G + 1) * n));
        pairs.resize(static_cast<size_t>(G * ((n + 1) / 2)));
        if (D == 64) {
          decode_one_int8<4>(qf, kh_base, vh_base, kb, ks, table, block_size, lo, len, G, sc, scores.data(),
                             pairs.data(), offs.data(), acc);
        } else {
          decode_one_int8<8>(qf, kh_base, vh_base, kb, ks, table, block_size, lo, len, G, sc, scores.data(),
                             pairs.data(), offs.data(), acc);
        }
      } else
#endif
      {
        if constexpr (std::is_same_v<KV, int8_t>)  // without VNNI: int8 rows widened, q rounded as they are
          for (int64_t g = 0; g < G; ++g) round_like_int8_rows(qf + g * D, D);
        if constexpr (std::is_same_v<KV, bf16>) pairs.resize(static_cast<size_t>(G * ((n + 1) / 2)));
        if (D == 64) {
          decode_one_avx512<KV, 4>(qf, qbf, kh_base, vh_base, kb, ks, table, block_size, lo, len, G, sc,
                                   scores.data(), offs.data(), pairs.data(), acc);
        } else {
          decode_one_avx512<KV, 8>(qf, qbf, kh_base, vh_base, kb, ks, table, block_size, lo, len, G, sc,
                                   scores.data(), offs.data(), pairs.data(), acc);
        }
      }
    } else
#endif
    {
      decode_queries<Q, KV>(qsrc, q.stride(1), G, D, sc, qf);
      bool done = false;
#if defined(LORAPLEX_AVX2_ATTENTION)
      if (D % 16 == 0) {
        const int64_t own = std::max(lo, shared_lo[b]);  // keys a group's pass has not covered
        offs.resize(static_cast<size_t>(len - own));
        decode_one_avx2<KV>(qf, kh_base, vh_base, kb, ks, table, block_size, own, len, G, D, scores.data(),
                            offs.data(), acc, own > lo ? prior + (b * Hq + h * G) * (D + 2) : nullptr);
        done = true;
      }
#endif
      if (!done) decode_one<KV>(qf, kh_base, vh_base, kb, ks, table, block_size, lo, len, G, D, scores.data(), acc);
    }
    Q* ob = op + b * Hq * D + h * G * D;
    for (int64_t i = 0; i < G * D; ++i) from_f(acc[i], ob + i);
  });
}

// Whether decode_attention reads a prefix that sequences share once per group (shared_prefix_avx2): AVX2 builds.
bool has_shared_prefix_decode() {
#if defined(LORAPLEX_AVX2_ATTENTION)
  return true;
#else
  return false;
#endif
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_tables, const at::Tensor& seq_ids, const at::Tensor& seq_lens,
                            double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4, "decode_attention: bad ranks");
  TORCH_CHECK(q.stride(2) == 1 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
              "decode_attention: head_dim must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  seq_ids.scalar_type() == at::kLong,
              "decode_attention: block_tables/seq_lens int32, seq_ids int64");
  TORCH_CHECK(block_tables.stride(1) == 1 && seq_lens.is_contiguous() && seq_ids.is_contiguous(),
              "decode_attention: index tensors must be contiguous");
  const int64_t Hq = q.size(1), D = q.size(2), Hkv = k_cache.size(2);
  TORCH_CHECK(Hq % Hkv == 0 && Hq / Hkv <= kMaxGroup && D <= kMaxHeadDim, "decode_attention: unsupported heads");
  TORCH_CHECK(seq_ids.size(0) == q.size(0), "decode_attention: one seq id per query row");
  const auto qt = q.scalar_type(), kt = k_cache.scalar_type();
  TORCH_CHECK(v_cache.scalar_type() == kt && v_cache.size(3) == k_cache.size(3) && kv_head_dim(k_cache) == D,
              "decode_attention: k and v caches differ, or do not hold q's head_dim");
  at::Tensor out = at::empty({q.size(0), Hq, D}, q.options());
  if (qt == at::kFloat && kt == at::kFloat) {
    decode_attention_impl<float, float>(q, k_cache, v_cache, block_tables, seq_ids, seq_lens, scale, window, out);
  } else if (qt == at::kBFloat16 && kt == at::kBFloat16) {
    decode_attention_impl<bf16, bf16>(q, k_cache, v_cache, block_tables, seq_ids, seq_lens, scale, window, out);
  } else if (qt == at::kFloat && kt == at::kBFloat16) {
    decode_attention_impl<float, bf16>(q, k_cache, v_cache, block_tables, seq_ids, seq_lens, scale, window, out);
  } else if (qt == at::kFloat && kt == at::kChar) {
    decode_attention_impl<float, int8_t>(q, k_cache, v_cache, block_tables, seq_ids, seq_lens, scale, window, out);
  } else if (qt == at::kBFloat16 && kt == at::kChar) {
    decode_attention_impl<bf16, int8_t>(q, k_cache, v_cache, block_tables, seq_ids, seq_lens, scale, window, out);
  } else {
    TORCH_CHECK(false, "decode_attention: q float32 or bfloat16, caches float32, bfloat16 or int8 (not finer than q)");
  }
  return out;
}

// ---- AMX tiles: the process's permission and the tile configuration -----------------------------------
namespace amx {

constexpr int64_t kMinRows = 4;  // fewer rows: the AVX-512 tiles (decode sizes stream the weights either way)

#if defined(LORAPLEX_AMX)
// Linux gives a process the 8 KB tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM, XTILEDATA).
bool permitted() {
  static const bool ok = [] {
    constexpr int kReqPerm = 0x1023, kGetPerm = 0x1022, kXtiledata = 18;
    unsigned long granted = 0;
    if (syscall(SYS_arch_prctl, kReqPerm, kXtiledata) != 0) return false;
    if (syscall(SYS_arch_prctl, kGetPerm, &granted) != 0) return false;
    return (granted & (1ul << kXtiledata)) != 0;
  }();
  return ok;
}
#else
bool permitted() { return false; }
#endif

// set_amx(false), or LORAPLEX_AMX=0 in the environment: the AVX-512 tiles everywhere (tests, A/B measurements)
std::atomic<bool> wanted{[] {
  const char* env = std::getenv("LORAPLEX_AMX");
  return env == nullptr || std::strcmp(env, "0") != 0;
}()};

inline bool use(int64_t M) { return M >= kMinRows && wanted.load(std::memory_order_relaxed) && permitted(); }

#if defined(LORAPLEX_AMX)
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Every tile 16 rows x 64 bytes. Loaded at the start of each thread's share: the tile configuration is per
// thread and other libraries (oneDNN) load their own between our calls.
struct Tiles {
  Tiles() {
    TileConfig c;
    for (int t = 0; t < 8; ++t) c.rows[t] = 16, c.colsb[t] = 64;
    _tile_loadconfig(&c);
  }
  ~Tiles() { _tile_release(); }
  Tiles(const Tiles&) = delete;
  Tiles& operator=(const Tiles&) = delete;
};

#endif

}  // namespace amx

// ---- prefill_attention ------------------------------------------------------------------------------------
bool has_prefill_attention() {
#if defined(__AVX512F__) || defined(LORAPLEX_AVX2_ATTENTION)
  return true;
#else
  return false;
#endif
}

constexpr int kPrefillRows = 32;  // queries per work item

#if defined(__AVX512F__)
// exp of x in [-87, 88] for 16 floats: 2^n * p(f) as in fast_exp, scaled by vscalefps.
inline __m512 exp16_in_range(__m512 x) {
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(kExp2Poly[0]);
  for (int i = 1; i < kExp2Terms; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExp2Poly[i]));
  return _mm512_scalef_ps(p, n);
}

// exp of 16 floats, x clamped to [-87, 88] (-inf gives ~0)
inline __m512 exp16(__m512 x) {
  return exp16_in_range(_mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(88.f)));
}

// exp16 for x <= 0 (softmax numerators): the upper clamp never applies there, so the value is exp16's bit for bit
inline __m512 exp16_nonpositive(__m512 x) { return exp16_in_range(_mm512_max_ps(x, _mm512_set1_ps(-87.f))); }

// out[i] = column i of the 16 x 16 32-bit words in r (unpack 32, unpack 64, then two 128-bit lane shuffles)
inline void transpose16_epi32(const __m512i r[16], __m512i out[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // u[4 i + c], 128-bit lane L: column 4 L + c of rows 4 i .. 4 i + 3
    u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i ab_lo = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44), ab_hi = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xEE);
    const __m512i cd_lo = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44);
    const __m512i cd_hi = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xEE);
    out[c] = _mm512_shuffle_i32x4(ab_lo, cd_lo, 0x88);
    out[4 + c] = _mm512_shuffle_i32x4(ab_lo, cd_lo, 0xDD);
    out[8 + c] = _mm512_shuffle_i32x4(ab_hi, cd_hi, 0x88);
    out[12 + c] = _mm512_shuffle_i32x4(ab_hi, cd_hi, 0xDD);
  }
}

// Keys krow[0, nk) of a block of 16 nv (missing ones as zeros) transposed 16 keys x 16 32-bit words at a
// time: row w of kt (ld words apart) holds word w (a k pair, or a float) of every key of the block.
template <typename KV>
inline void transpose_keys(const KV* const* krow, int64_t nk, int nv, int words, uint32_t* kt, int64_t ld) {
  for (int v = 0; v < nv; ++v)
    for (int w0 = 0; w0 < words; w0 += 16) {
      __m512i in[16], tr[16];
      for (int j = 0; j < 16; ++j)
        in[j] = 16 * v + j < nk ? _mm512_loadu_si512(reinterpret_cast<const uint32_t*>(krow[16 * v + j]) + w0)
                                : _mm512_setzero_si512();
      transpose16_epi32(in, tr);
      for (int i = 0; i < 16; ++i) _mm512_store_si512(kt + (w0 + i) * ld + 16 * v, tr[i]);
    }
}

#if defined(__AVX512BF16__)
// bf16 value rows vrow[0, nk) (missing ones as zeros) as key pairs: row j2 of vpair (2 D halves apart) holds
// rows 2 j2 and 2 j2 + 1 interleaved by unpacklo/hi per 32 dims, so a dot product over it leaves each 32
// dims in the order {0-3, 8-11, 16-19, 24-27} then {4-7, 12-15, 20-23, 28-31} (put back by the caller).
template <typename P>
inline void pair_values(const P* const* vrow, int64_t nk, int64_t pairs, int D, uint16_t* vpair) {
  for (int64_t j2 = 0; j2 < pairs; ++j2) {
    const int64_t ja = 2 * j2, jb = 2 * j2 + 1;
    for (int ch = 0; ch < D / 32; ++ch) {
      const __m512i a = ja < nk ? _mm512_loadu_si512(reinterpret_cast<const bf16*>(vrow[ja]) + 32 * ch)
                                : _mm512_setzero_si512();
      const __m512i b = jb < nk ? _mm512_loadu_si512(reinterpret_cast<const bf16*>(vrow[jb]) + 32 * ch)
                                : _mm512_setzero_si512();
      _mm512_store_si512(vpair + j2 * 2 * D + 64 * ch, _mm512_unpacklo_epi16(a, b));
      _mm512_store_si512(vpair + j2 * 2 * D + 64 * ch + 32, _mm512_unpackhi_epi16(a, b));
    }
  }
}
#endif

// Rows [i0, i1) of one kv head's G query heads: out = softmax(q K^T) V over keys lo(row) .. pos(row).
// Per block of keys: the keys transposed once for all the item's rows; then, 4 rows at a time, their scores,
// their softmax bookkeeping, and P @ V for the 4 rows together (4 x 4 independent sums per value chunk: one
// row's sums alone are a chain as long as the block, which ran latency-bound at a third of the issue rate).
template <typename Q, typename KV, int C>
void prefill_item(const Q* qp, int64_t qs0, int64_t qs1, Q* op, int64_t Hq, const KV* k_base, const KV* v_base,
                  int64_t block_stride, int64_t slot_stride, const int32_t* table, int64_t block_size, int64_t start,
                  int64_t i0, int64_t i1, int64_t h, int64_t G, float scale, int64_t window) {
  constexpr int D = 16 * C;
  // bf16 q and keys: scores by bf16 dot products over keys transposed as k pairs (q as it is, the scale
  // applied to the scores); otherwise fp32 FMAs over keys widened once, q pre-scaled
#if defined(__AVX512BF16__)
  constexpr bool kPairs = std::is_same_v<Q, bf16> && std::is_same_v<KV, bf16>;
#else
  constexpr bool kPairs = false;
#endif
  constexpr bool kWords = kPairs || std::is_same_v<KV, float>;  // keys transposed as 32-bit words
  constexpr int W = kPairs ? D / 2 : D;                         // words (k pairs or floats) per key
  const int64_t rows = i1 - i0;
  alignas(64) float qf[kMaxGroup][kPrefillRows][D];
  alignas(64) float acc[kMaxGroup][kPrefillRows][D];
  float m[kMaxGroup][kPrefillRows], l[kMaxGroup][kPrefillRows];
  for (int64_t g = 0; g < G; ++g)
    for (int64_t r = 0; r < kPrefillRows; ++r) {  // rows past the item's are computed in the last 4-row tile, never stored
      if (r < rows) {
        const Q* src = qp + (i0 + r) * qs0 + (h * G + g) * qs1;
        if constexpr (kPairs) {
          std::memcpy(&qf[g][r][0], src, D * sizeof(bf16));  // the first D / 2 floats hold the D bf16 as pairs
        } else {
          for (int d = 0; d < D; ++d) qf[g][r][d] = to_f(src[d]) * scale;
        }
      } else {
        for (int d = 0; d < D; ++d) qf[g][r][d] = 0.f;
      }
      for (int d = 0; d < D; ++d) acc[g][r][d] = 0.f;
      m[g][r] = -std::numeric_limits<float>::infinity();
      l[g][r] = 0.f;
    }
  const int64_t last = start + i1 - 1;  // the block's last query position: keys up to it
  const int64_t first_lo = window > 0 ? std::max<int64_t>(0, start + i0 - window + 1) : 0;
  // keys per block: 64 (four zmm of scores) at head_dim 64, so each row's softmax bookkeeping (max, sum,
  // rescale) runs once per 64 keys (32: 10 % slower, measured); 16 at 128 (the block's keys and values
  // then still fit in L1), with each score split over 4 partial sums so 4 rows still make 16 chains
  constexpr int NV = C == 4 ? 4 : 1;
  constexpr int KB = 16 * NV;
  constexpr int SPLIT = 4 / NV;
  alignas(64) float kt[D][KB];  // kPairs: rows [0, D / 2) hold k pairs (2 bf16 in a float's bits)
  alignas(64) float vf[KB][D];  // bf16 values widened once (fp32 values are read in place)
  const float* vrow[KB];
  const KV* krow[KB];
  // kPairs: the values as key pairs for bf16 dot products, vpair[j2] = rows 2 j2 and 2 j2 + 1 interleaved
  // by unpacklo/hi per 32 dims, so acc holds each 32 dims in the order {0-3, 8-11, 16-19, 24-27} then
  // {4-7, 12-15, 20-23, 28-31} (put back at the end); p rounded to bf16 for them, as flash attention's
  // bf16 P @ V (the row sums l stay fp32)
  alignas(64) uint16_t vpair[KB / 2][2 * D];
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j0 = first_lo; j0 <= last; j0 += KB) {
    const int64_t nk = std::min<int64_t>(KB, last + 1 - j0);
    int64_t off[KB];
    slot_offsets(table, block_size, block_stride, slot_stride, j0, j0 + nk, off);
    for (int64_t j = 0; j < nk; ++j) {
      const int64_t slot = off[j];
      krow[j] = k_base + slot;
      if constexpr (std::is_same_v<KV, float>) {
        vrow[j] = v_base + slot;
      } else if constexpr (!kPairs) {
        for (int d = 0; d < D; ++d) vf[j][d] = to_f(v_base[slot + d]);
        vrow[j] = vf[j];
      } else {
        vrow[j] = reinterpret_cast<const float*>(v_base + slot);  // bf16 rows, paired below
      }
    }
    if constexpr (kWords) {
      transpose_keys(krow, nk, NV, W, reinterpret_cast<uint32_t*>(&kt[0][0]), KB);
    } else {
      for (int64_t j = 0; j < KB; ++j)
        for (int d = 0; d < D; ++d) kt[d][j] = j < nk ? to_f(krow[j][d]) : 0.f;
    }
#if defined(__AVX512BF16__)
    if constexpr (kPairs) pair_values(vrow, nk, KB / 2, D, &vpair[0][0]);
#endif
    __m512i keys[NV];
    for (int v = 0; v < NV; ++v) keys[v] = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(j0 + 16 * v)), lane);
    for (int64_t r0 = 0; r0 < rows; r0 += 4) {  // 4 rows at a time: 4 x NV x SPLIT independent chains per score
      const int64_t nr = std::min<int64_t>(4, rows - r0);
      if (j0 > start + i0 + r0 + nr - 1) continue;  // every key of the block is in these rows' future
      for (int64_t g = 0; g < G; ++g) {
        __m512 sc[4][NV];
        {
          __m512 part[4][NV][SPLIT];
          for (int u = 0; u < 4; ++u)
            for (int v = 0; v < NV; ++v)
              for (int s = 0; s < SPLIT; ++s) part[u][v][s] = _mm512_setzero_ps();
          if constexpr (kPairs) {
#if defined(__AVX512BF16__)
            for (int d2 = 0; d2 < D / 2; d2 += SPLIT)
              for (int s = 0; s < SPLIT; ++s) {
                __m512bh kd[NV];
                for (int v = 0; v < NV; ++v) kd[v] = (__m512bh)_mm512_load_si512(kt[d2 + s] + 16 * v);
                for (int u = 0; u < 4; ++u) {
                  const __m512bh qd = (__m512bh)_mm512_castps_si512(_mm512_set1_ps(qf[g][r0 + u][d2 + s]));
                  for (int v = 0; v < NV; ++v) part[u][v][s] = _mm512_dpbf16_ps(part[u][v][s], qd, kd[v]);
                }
              }
#endif
          } else {
            for (int d = 0; d < D; d += SPLIT)
              for (int s = 0; s < SPLIT; ++s) {
                __m512 kd[NV];
                for (int v = 0; v < NV; ++v) kd[v] = _mm512_load_ps(kt[d + s] + 16 * v);
                for (int u = 0; u < 4; ++u) {
                  const __m512 qd = _mm512_set1_ps(qf[g][r0 + u][d + s]);
                  for (int v = 0; v < NV; ++v) part[u][v][s] = _mm512_fmadd_ps(qd, kd[v], part[u][v][s]);
                }
              }
          }
          for (int u = 0; u < 4; ++u)
            for (int v = 0; v < NV; ++v) {
              __m512 s = part[u][v][0];
              for (int t = 1; t < SPLIT; ++t) s = _mm512_add_ps(s, part[u][v][t]);
              sc[u][v] = kPairs ? _mm512_mul_ps(s, _mm512_set1_ps(scale)) : s;
            }
        }
        // each row's softmax bookkeeping; a row that sees no key of the block keeps acc as it is (p = 0)
        alignas(64) float pj[4][KB];
        float corr[4];
        int64_t seen = 0;  // keys [0, seen) of the block are visible to some row of the tile
        for (int u = 0; u < 4; ++u) {
          const int64_t r = r0 + u, pos = start + i0 + r;
          const int64_t lo = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
          corr[u] = 1.f;
          if (u >= nr || j0 > pos || j0 + KB <= lo) {
            for (int v = 0; v < NV; ++v) _mm512_store_ps(pj[u] + 16 * v, _mm512_setzero_ps());
            continue;
          }
          seen = std::max(seen, std::min(nk, pos + 1 - j0));
          __m512 s_row[NV];
          __mmask16 valid[NV];
          __m512 mx = neg_inf;
          for (int v = 0; v < NV; ++v) {
            valid[v] = _mm512_cmple_epi32_mask(keys[v], _mm512_set1_epi32(static_cast<int32_t>(pos)));
            valid[v] &= _mm512_cmpge_epi32_mask(keys[v], _mm512_set1_epi32(static_cast<int32_t>(lo)));
            s_row[v] = _mm512_mask_blend_ps(valid[v], neg_inf, sc[u][v]);
            mx = _mm512_max_ps(mx, s_row[v]);
          }
          const float m_new = std::max(m[g][r], _mm512_reduce_max_ps(mx));
          corr[u] = std::exp(m[g][r] - m_new);  // 0 on the row's first block (m = -inf)
          __m512 psum = _mm512_setzero_ps();
          for (int v = 0; v < NV; ++v) {
            const __m512 pr = _mm512_maskz_mov_ps(valid[v], exp16(_mm512_sub_ps(s_row[v], _mm512_set1_ps(m_new))));
            psum = _mm512_add_ps(psum, pr);
            _mm512_store_ps(pj[u] + 16 * v, pr);
          }
          l[g][r] = l[g][r] * corr[u] + _mm512_reduce_add_ps(psum);
          m[g][r] = m_new;
        }
        // P @ V for the 4 rows together, 4 value chunks (64 dims) at a time
#if defined(__AVX512BF16__)
        alignas(64) uint32_t pp[4][KB / 2 < 16 ? 16 : KB / 2];  // p as bf16 key pairs (one full store each 32 keys)
        if constexpr (kPairs) {
          for (int u = 0; u < 4; ++u)
            for (int v = 0; v < NV; v += 2) {
              const __m512 hi = v + 1 < NV ? _mm512_load_ps(pj[u] + 16 * (v + 1)) : _mm512_setzero_ps();
              _mm512_store_si512(pp[u] + 8 * v, (__m512i)_mm512_cvtne2ps_pbh(hi, _mm512_load_ps(pj[u] + 16 * v)));
            }
        }
#endif
        for (int c0 = 0; c0 < C; c0 += 4) {
          __m512 a[4][4];
          for (int u = 0; u < 4; ++u) {
            const __m512 cv = _mm512_set1_ps(corr[u]);
            for (int c = 0; c < 4; ++c) a[u][c] = _mm512_mul_ps(_mm512_load_ps(acc[g][r0 + u] + 16 * (c0 + c)), cv);
          }
          if constexpr (kPairs) {
#if defined(__AVX512BF16__)
            for (int64_t j2 = 0; j2 < (seen + 1) / 2; ++j2) {
              __m512bh vv[4];
              for (int c = 0; c < 4; ++c) vv[c] = (__m512bh)_mm512_load_si512(vpair[j2] + 32 * (c0 + c));
              for (int u = 0; u < 4; ++u) {
                const __m512bh pv = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(pp[u][j2]));
                for (int c = 0; c < 4; ++c) a[u][c] = _mm512_dpbf16_ps(a[u][c], pv, vv[c]);
              }
            }
#endif
          } else {
            for (int64_t j = 0; j < seen; ++j) {
              __m512 vv[4];
              for (int c = 0; c < 4; ++c) vv[c] = _mm512_loadu_ps(vrow[j] + 16 * (c0 + c));
              for (int u = 0; u < 4; ++u) {
                const __m512 pv = _mm512_set1_ps(pj[u][j]);
                for (int c = 0; c < 4; ++c) a[u][c] = _mm512_fmadd_ps(pv, vv[c], a[u][c]);
              }
            }
          }
          for (int u = 0; u < 4; ++u)
            for (int c = 0; c < 4; ++c) _mm512_store_ps(acc[g][r0 + u] + 16 * (c0 + c), a[u][c]);
        }
      }
    }
  }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t r = 0; r < rows; ++r) {
      const float inv = l[g][r] > 0.f ? 1.f / l[g][r] : 0.f;
      Q* dst = op + (i0 + r) * Hq * D + (h * G + g) * D;
      if constexpr (kPairs) {  // acc's dims back in order (see vpair)
        const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
        const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
        alignas(64) float ordered[D];
        for (int ch = 0; ch < D / 32; ++ch) {
          const __m512 lo = _mm512_load_ps(acc[g][r] + 32 * ch), hi = _mm512_load_ps(acc[g][r] + 32 * ch + 16);
          _mm512_store_ps(ordered + 32 * ch, _mm512_permutex2var_ps(lo, first, hi));
          _mm512_store_ps(ordered + 32 * ch + 16, _mm512_permutex2var_ps(lo, second, hi));
        }
        for (int d = 0; d < D; ++d) from_f(ordered[d] * inv, dst + d);
      } else {
        for (int d = 0; d < D; ++d) from_f(acc[g][r][d] * inv, dst + d);
      }
    }
}

#if defined(LORAPLEX_AMX)
// prefill_item's bf16 twin on AMX tiles, for bf16 q and caches: per block of 64 keys and each 16-row tile of
// the item, S = q K^T by tile products over the keys transposed as k pairs (the B operand: 16 k pairs x 16
// keys per tile), the online softmax on S in AVX-512 as above, then P @ V by tile products over the values
// as key pairs (P rounded to bf16, 32 keys per A row), added to acc after acc's rescale. Tiles: C 0 .. 3,
// A 4, B 5 and 6.
template <int C>
void prefill_item_amx(const bf16* qp, int64_t qs0, int64_t qs1, bf16* op, int64_t Hq, const bf16* k_base,
                      const bf16* v_base, int64_t block_stride, int64_t slot_stride, const int32_t* table,
                      int64_t block_size, int64_t start, int64_t i0, int64_t i1, int64_t h, int64_t G, float scale,
                      int64_t window) {
  constexpr int D = 16 * C, W = D / 2, KB = 64;
  const int64_t rows = i1 - i0;
  amx::Tiles tiles;
  alignas(64) bf16 qb[kMaxGroup][kPrefillRows][D];
  alignas(64) float acc[kMaxGroup][kPrefillRows][D];
  float m[kMaxGroup][kPrefillRows], l[kMaxGroup][kPrefillRows];
  for (int64_t g = 0; g < G; ++g)
    for (int64_t r = 0; r < kPrefillRows; ++r) {  // rows past the item's are zeros, computed but never stored
      if (r < rows) std::memcpy(qb[g][r], qp + (i0 + r) * qs0 + (h * G + g) * qs1, D * sizeof(bf16));
      else std::memset(qb[g][r], 0, D * sizeof(bf16));
      std::memset(acc[g][r], 0, D * sizeof(float));
      m[g][r] = -std::numeric_limits<float>::infinity();
      l[g][r] = 0.f;
    }
  const int64_t last = start + i1 - 1;
  const int64_t first_lo = window > 0 ? std::max<int64_t>(0, start + i0 - window + 1) : 0;
  alignas(64) uint32_t kt[W][KB];        // k pairs x keys: the S products' B operand, 16 pairs a tile
  alignas(64) uint16_t vpair[KB / 2][2 * D];  // key pairs x dims (as prefill_item's): P @ V's B operand
  alignas(64) float s[16][KB];
  alignas(64) bf16 p[16][KB];
  alignas(64) float pv[16][D];
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j0 = first_lo; j0 <= last; j0 += KB) {
    const int64_t nk = std::min<int64_t>(KB, last + 1 - j0);
    const bf16* krow[KB];
    const bf16* vrow[KB];
    for (int64_t j = 0; j < nk; ++j) {
      const int64_t pos = j0 + j;
      const int64_t slot = table[pos / block_size] * block_stride + (pos % block_size) * slot_stride;
      krow[j] = k_base + slot;
      vrow[j] = v_base + slot;
    }
    // missing keys and values as zeros (their p is 0, and 0 x 0 stays 0)
    transpose_keys(krow, nk, KB / 16, W, &kt[0][0], KB);
    pair_values(vrow, nk, KB / 2, D, &vpair[0][0]);
    __m512i keys[KB / 16];
    for (int v = 0; v < KB / 16; ++v) keys[v] = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(j0 + 16 * v)), lane);
    for (int64_t r0 = 0; r0 < rows; r0 += 16) {
      const int64_t nr = std::min<int64_t>(16, rows - r0);
      if (j0 > start + i0 + r0 + nr - 1) continue;  // every key of the block is in these rows' future
      for (int64_t g = 0; g < G; ++g) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int st = 0; st < D / 32; ++st) {  // 32 dims (16 k pairs) a step
          _tile_loadd(4, qb[g][r0] + 32 * st, D * sizeof(bf16));
          _tile_loadd(5, kt[16 * st], KB * 4);
          _tile_dpbf16ps(0, 4, 5);
          _tile_loadd(6, kt[16 * st] + 16, KB * 4);
          _tile_dpbf16ps(1, 4, 6);
          _tile_loadd(5, kt[16 * st] + 32, KB * 4);
          _tile_dpbf16ps(2, 4, 5);
          _tile_loadd(6, kt[16 * st] + 48, KB * 4);
          _tile_dpbf16ps(3, 4, 6);
        }
        _tile_stored(0, s[0], KB * 4);
        _tile_stored(1, s[0] + 16, KB * 4);
        _tile_stored(2, s[0] + 32, KB * 4);
        _tile_stored(3, s[0] + 48, KB * 4);
        // per row: the new max, p and its sum; then the 16 rows' rescale factors in one exp16
        alignas(64) float m_old[16], m_now[16], psums[16];
        for (int u = 0; u < 16; ++u) {
          const int64_t r = r0 + u, pos = start + i0 + r;
          const int64_t lo = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
          m_old[u] = m_now[u] = psums[u] = 0.f;  // a row that sees no key of the block: corr 1, p 0
          if (u >= nr || j0 > pos || j0 + KB <= lo) {
            std::memset(p[u], 0, sizeof(p[u]));
            continue;
          }
          __m512 s_row[KB / 16];
          __m512 mx = neg_inf;
          __m512 psum = _mm512_setzero_ps();
          __m512 pr[KB / 16];
          float m_new;
          // Masked: a block on the diagonal or the window's edge. A block the row sees whole needs no masks,
          // and exp16's upper clamp never applies (s - max <= 0): the same values, bit for bit, for less work.
          auto row_softmax = [&](auto masked) {
            constexpr bool kMasked = decltype(masked)::value;
            __mmask16 valid[KB / 16];
            for (int v = 0; v < KB / 16; ++v) {
              s_row[v] = _mm512_mul_ps(_mm512_load_ps(s[u] + 16 * v), _mm512_set1_ps(scale));
              if constexpr (kMasked) {
                valid[v] = _mm512_cmple_epi32_mask(keys[v], _mm512_set1_epi32(static_cast<int32_t>(pos)));
                valid[v] &= _mm512_cmpge_epi32_mask(keys[v], _mm512_set1_epi32(static_cast<int32_t>(lo)));
                s_row[v] = _mm512_mask_blend_ps(valid[v], neg_inf, s_row[v]);
              }
              mx = _mm512_max_ps(mx, s_row[v]);
            }
            m_new = std::max(m[g][r], _mm512_reduce_max_ps(mx));  // finite: the row sees a key
            for (int v = 0; v < KB / 16; ++v) {
              const __m512 x = _mm512_sub_ps(s_row[v], _mm512_set1_ps(m_new));
              if constexpr (kMasked) pr[v] = _mm512_maskz_mov_ps(valid[v], exp16(x));
              else pr[v] = exp16_nonpositive(x);
              psum = _mm512_add_ps(psum, pr[v]);
            }
          };
          if (j0 + KB - 1 <= pos && j0 >= lo) row_softmax(std::false_type{});
          else row_softmax(std::true_type{});
          for (int v = 0; v < KB / 16; v += 2)  // keys 16 v .. 16 v + 31 in order, as bf16
            _mm512_store_si512(p[u] + 16 * v, (__m512i)_mm512_cvtne2ps_pbh(pr[v + 1], pr[v]));
          m_old[u] = m[g][r];
          m_now[u] = m[g][r] = m_new;
          psums[u] = _mm512_reduce_add_ps(psum);
        }
        // ~1e-38 on a row's first block (m_old = -inf, clamped): acc and l are still 0 then
        alignas(64) float corr[16];
        _mm512_store_ps(corr, exp16(_mm512_sub_ps(_mm512_load_ps(m_old), _mm512_load_ps(m_now))));
        for (int u = 0; u < nr; ++u) l[g][r0 + u] = l[g][r0 + u] * corr[u] + psums[u];
        for (int c0 = 0; c0 < C; c0 += 4) {  // 64 dims a pass: C tiles 0 .. 3
          _tile_zero(0);
          _tile_zero(1);
          _tile_zero(2);
          _tile_zero(3);
          for (int st = 0; st < KB / 32; ++st) {  // 32 keys (16 key pairs) a step
            _tile_loadd(4, p[0] + 32 * st, KB * sizeof(bf16));
            _tile_loadd(5, vpair[16 * st] + 32 * c0, 2 * D * sizeof(uint16_t));
            _tile_dpbf16ps(0, 4, 5);
            _tile_loadd(6, vpair[16 * st] + 32 * (c0 + 1), 2 * D * sizeof(uint16_t));
            _tile_dpbf16ps(1, 4, 6);
            _tile_loadd(5, vpair[16 * st] + 32 * (c0 + 2), 2 * D * sizeof(uint16_t));
            _tile_dpbf16ps(2, 4, 5);
            _tile_loadd(6, vpair[16 * st] + 32 * (c0 + 3), 2 * D * sizeof(uint16_t));
            _tile_dpbf16ps(3, 4, 6);
          }
          _tile_stored(0, pv[0] + 16 * c0, D * sizeof(float));
          _tile_stored(1, pv[0] + 16 * (c0 + 1), D * sizeof(float));
          _tile_stored(2, pv[0] + 16 * (c0 + 2), D * sizeof(float));
          _tile_stored(3, pv[0] + 16 * (c0 + 3), D * sizeof(float));
        }
        for (int u = 0; u < nr; ++u) {
          const __m512 cv = _mm512_set1_ps(corr[u]);
          float* a = acc[g][r0 + u];
          for (int c = 0; c < C; ++c)
            _mm512_store_ps(a + 16 * c, _mm512_fmadd_ps(_mm512_load_ps(a + 16 * c), cv, _mm512_load_ps(pv[u] + 16 * c)));
        }
      }
    }
  }
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int64_t g = 0; g < G; ++g)
    for (int64_t r = 0; r < rows; ++r) {  // acc's dims back in order (see prefill_item's vpair)
      const __m512 inv = _mm512_set1_ps(l[g][r] > 0.f ? 1.f / l[g][r] : 0.f);
      bf16* dst = op + (i0 + r) * Hq * D + (h * G + g) * D;
      for (int ch = 0; ch < D / 32; ++ch) {
        const __m512 lo = _mm512_load_ps(acc[g][r] + 32 * ch), hi = _mm512_load_ps(acc[g][r] + 32 * ch + 16);
        const __m512 y0 = _mm512_mul_ps(_mm512_permutex2var_ps(lo, first, hi), inv);
        const __m512 y1 = _mm512_mul_ps(_mm512_permutex2var_ps(lo, second, hi), inv);
        _mm512_storeu_si512(dst + 32 * ch, (__m512i)_mm512_cvtne2ps_pbh(y1, y0));
      }
    }
}
#endif

#endif  // __AVX512F__

#if defined(LORAPLEX_AVX2_ATTENTION)
// prefill_item's AVX2 twin (8 lanes, 16 ymm registers) with the arithmetic of its fp32 path: q pre-scaled,
// each block of 16 keys widened and transposed once for all the item's rows, then 4 rows at a time their
// scores (4 x 2 independent chains), their online softmax, and P @ V for the 4 rows together (4 rows x 16
// dims a pass). float32 values are read in place, bf16 ones widened once per block.
template <typename Q, typename KV, int D>
void prefill_item_avx2(const Q* qp, int64_t qs0, int64_t qs1, Q* op, int64_t Hq, const KV* k_base, const KV* v_base,
                       int64_t block_stride, int64_t slot_stride, const int32_t* table, int64_t block_size,
                       int64_t start, int64_t i0, int64_t i1, int64_t h, int64_t G, float scale, int64_t window) {
  constexpr int KB = 16;  // keys per block: two ymm of scores per row
  const int64_t rows = i1 - i0;
  alignas(32) float qf[kMaxGroup][kPrefillRows][D];
  alignas(32) float acc[kMaxGroup][kPrefillRows][D];
  float m[kMaxGroup][kPrefillRows], l[kMaxGroup][kPrefillRows];
  for (int64_t g = 0; g < G; ++g)
    for (int64_t r = 0; r < kPrefillRows; ++r) {  // rows past the item's are computed in the last 4-row tile, never stored
      const Q* src = r < rows ? qp + (i0 + r) * qs0 + (h * G + g) * qs1 : nullptr;
      for (int d = 0; d < D; ++d) {
        qf[g][r][d] = src ? to_f(src[d]) * scale : 0.f;
        acc[g][r][d] = 0.f;
      }
      m[g][r] = -std::numeric_limits<float>::infinity();
      l[g][r] = 0.f;
    }
  const int64_t last = start + i1 - 1;  // the item's last query position: keys up to it
  const int64_t first_lo = window > 0 ? std::max<int64_t>(0, start + i0 - window + 1) : 0;
  alignas(32) float kt[D][KB];  // kt[d][j]: key j's dim d
  alignas(32) float vf[std::is_same_v<KV, float> ? 1 : KB][D];  // bf16 values widened once
  const float* vrow[KB];
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j0 = first_lo; j0 <= last; j0 += KB) {
    const int64_t nk = std::min<int64_t>(KB, last + 1 - j0);
    key_block_avx2<KV, D>(k_base, v_base, block_stride, slot_stride, table, block_size, j0, nk, kt, vf, vrow);
    const __m256i keys0 = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int32_t>(j0)), lane);
    const __m256i keys[2] = {keys0, _mm256_add_epi32(keys0, _mm256_set1_epi32(8))};
    for (int64_t r0 = 0; r0 < rows; r0 += 4) {
      const int64_t nr = std::min<int64_t>(4, rows - r0);
      if (j0 > start + i0 + r0 + nr - 1) continue;  // every key of the block is in these rows' future
      for (int64_t g = 0; g < G; ++g) {
        alignas(32) float sc[4][KB];  // the 4 rows' scores: rows of qf are D apart, as decode's heads are
        scores16<4>(&qf[g][r0][0], D, kt, &sc[0][0], KB);
        // each row's softmax bookkeeping; a row that sees no key of the block keeps acc as it is (p = 0)
        alignas(32) float pj[4][KB];
        float corr[4];
        int64_t seen = 0;  // keys [0, seen) of the block are visible to some row of the tile
        for (int u = 0; u < 4; ++u) {
          const int64_t r = r0 + u, pos = start + i0 + r;
          const int64_t lo = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
          corr[u] = 1.f;
          if (u >= nr || j0 > pos || j0 + KB <= lo) {
            _mm256_store_ps(pj[u], _mm256_setzero_ps());
            _mm256_store_ps(pj[u] + 8, _mm256_setzero_ps());
            continue;
          }
          seen = std::max(seen, std::min(nk, pos + 1 - j0));
          const __m256i after = _mm256_set1_epi32(static_cast<int32_t>(pos));
          const __m256i before = _mm256_set1_epi32(static_cast<int32_t>(lo - 1));
          __m256 valid[2], s_row[2];
          for (int v = 0; v < 2; ++v) {  // lo <= key <= pos
            valid[v] = _mm256_castsi256_ps(
                _mm256_andnot_si256(_mm256_cmpgt_epi32(keys[v], after), _mm256_cmpgt_epi32(keys[v], before)));
            s_row[v] = _mm256_blendv_ps(neg_inf, _mm256_load_ps(sc[u] + 8 * v), valid[v]);
          }
          const float m_new = std::max(m[g][r], hmax8(_mm256_max_ps(s_row[0], s_row[1])));
          corr[u] = std::exp(m[g][r] - m_new);  // 0 on the row's first block (m = -inf)
          const __m256 mv = _mm256_set1_ps(m_new);
          const __m256 p0 = _mm256_and_ps(valid[0], exp8(_mm256_sub_ps(s_row[0], mv)));
          const __m256 p1 = _mm256_and_ps(valid[1], exp8(_mm256_sub_ps(s_row[1], mv)));
          _mm256_store_ps(pj[u], p0);
          _mm256_store_ps(pj[u] + 8, p1);
          l[g][r] = l[g][r] * corr[u] + hsum8(_mm256_add_ps(p0, p1));
          m[g][r] = m_new;
        }
        pv_rows4<D>(acc[g][r0], pj, corr, seen, vrow);  // P @ V for the 4 rows together
      }
    }
  }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t r = 0; r < rows; ++r) {
      const float inv = l[g][r] > 0.f ? 1.f / l[g][r] : 0.f;
      Q* dst = op + (i0 + r) * Hq * D + (h * G + g) * D;
      for (int d = 0; d < D; ++d) from_f(acc[g][r][d] * inv, dst + d);
    }
}
#endif

#if defined(__AVX512F__) || defined(LORAPLEX_AVX2_ATTENTION)
template <typename Q, typename KV>
void prefill_attention_impl(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& table, int64_t seq_len, double scale, int64_t window, at::Tensor& out) {
  const int64_t n = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = k_cache.size(2), G = Hq / Hkv;
  const int64_t start = seq_len - n, items_per_head = (n + kPrefillRows - 1) / kPrefillRows;
  const Q* qp = q.data_ptr<Q>();
  Q* op = out.data_ptr<Q>();
  const KV* kp = k_cache.data_ptr<KV>();
  const KV* vp = v_cache.data_ptr<KV>();
  const int32_t* tp = table.data_ptr<int32_t>();
  const int64_t kb = k_cache.stride(0), ks = k_cache.stride(1), kh = k_cache.stride(2);
  const float sc = static_cast<float>(scale);
  [[maybe_unused]] const bool amx_tiles = amx::use(n);
  parallel_stealing(Hkv * items_per_head, [&](int64_t item, int64_t) {
    // causal rows cost more the later they are: alternate early and late row blocks, so the contiguous
    // shares each thread starts with hold about the same work
    const int64_t h = item % Hkv, t = item / Hkv;
    const int64_t blk = t % 2 == 0 ? t / 2 : items_per_head - 1 - t / 2;
    const int64_t i0 = blk * kPrefillRows, i1 = std::min<int64_t>(n, i0 + kPrefillRows);
#if defined(LORAPLEX_AMX)
    if constexpr (std::is_same_v<Q, bf16> && std::is_same_v<KV, bf16>) {
      if (amx_tiles) {
        if (D == 64)
          prefill_item_amx<4>(qp, q.stride(0), q.stride(1), op, Hq, kp + h * kh, vp + h * kh, kb, ks, tp,
                              k_cache.size(1), start, i0, i1, h, G, sc, window);
        else
          prefill_item_amx<8>(qp, q.stride(0), q.stride(1), op, Hq, kp + h * kh, vp + h * kh, kb, ks, tp,
                              k_cache.size(1), start, i0, i1, h, G, sc, window);
        return;
      }
    }
#endif
#if defined(LORAPLEX_AVX2_ATTENTION)
    if (D == 64) {
      prefill_item_avx2<Q, KV, 64>(qp, q.stride(0), q.stride(1), op, Hq, kp + h * kh, vp + h * kh, kb, ks, tp,
                                   k_cache.size(1), start, i0, i1, h, G, sc, window);
    } else {
      prefill_item_avx2<Q, KV, 128>(qp, q.stride(0), q.stride(1), op, Hq, kp + h * kh, vp + h * kh, kb, ks, tp,
                                    k_cache.size(1), start, i0, i1, h, G, sc, window);
    }
#else
    if (D == 64) {
      prefill_item<Q, KV, 4>(qp, q.stride(0), q.stride(1), op, Hq, kp + h * kh, vp + h * kh, kb, ks, tp, k_cache.size(1),
                             start, i0, i1, h, G, sc, window);
    } else {
      prefill_item<Q, KV, 8>(qp, q.stride(0), q.stride(1), op, Hq, kp + h * kh, vp + h * kh, kb, ks, tp, k_cache.size(1),
                             start, i0, i1, h, G, sc, window);
    }
#endif
  });
}
#endif

// A finer cache's first nb blocks along `table` in out's dtype (out: (nb, block_size, Hkv, D), contiguous).
template <typename T, typename KV>
void widen_blocks(const at::Tensor& cache, const int32_t* table, at::Tensor& out) {
  const int64_t nb = out.size(0), bs = out.size(1), hkv = out.size(2), D = out.size(3);
  const int64_t cb = cache.stride(0), cs = cache.stride(1), ch = cache.stride(2);
  const KV* src = cache.data_ptr<KV>();
  T* dst = out.data_ptr<T>();
  at::parallel_for(0, nb * bs, 64, [&](int64_t begin, int64_t end) {
    float widened[kMaxHeadDim];
    for (int64_t r = begin; r < end; ++r)
      for (int64_t h = 0; h < hkv; ++h) {
        const float* f = row_f32(src + table[r / bs] * cb + (r % bs) * cs + h * ch, widened, D);
        T* d = dst + (r * hkv + h) * D;
        for (int64_t i = 0; i < D; ++i) from_f(f[i], d + i);
      }
  });
}

// q (n, heads, D; rows of heads contiguous, stride qs between tokens) rounded per head like int8 cache rows,
// into out (n, heads, D) contiguous.
template <typename T>
void round_queries_like_int8(const T* q, int64_t qs, int64_t n, int64_t heads, int64_t D, T* out) {
  for (int64_t t = 0; t < n; ++t)
    for (int64_t h = 0; h < heads; ++h) {
      float x[kMaxHeadDim];
      const T* src = q + t * qs + h * D;
      for (int64_t d = 0; d < D; ++d) x[d] = to_f(src[d]);
      round_like_int8_rows(x, D);
      T* dst = out + (t * heads + h) * D;
      for (int64_t d = 0; d < D; ++d) from_f(x[d], dst + d);
    }
}

template <typename T>
at::Tensor widened_blocks(const at::Tensor& cache, const at::Tensor& table, int64_t nb, int64_t D, at::ScalarType dt) {
  at::Tensor out = at::empty({nb, cache.size(1), cache.size(2), D}, cache.options().dtype(dt));
  const int32_t* t = table.data_ptr<int32_t>();
  if (cache.scalar_type() == at::kChar) {
    widen_blocks<T, int8_t>(cache, t, out);
  } else if (cache.scalar_type() == at::kBFloat16) {
    widen_blocks<T, bf16>(cache, t, out);
  } else {
    TORCH_CHECK(false, "prefill_attention: caches finer than q are bfloat16 or int8");
  }
  return out;
}

at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                             const at::Tensor& table, int64_t seq_len, double scale, int64_t window);

// A cache finer than q (bf16 under float32, or int8): the sequence's blocks widened to q's dtype first (a few
// hundred rows), read through a table of their own; over int8, q rounded per head as the keys are.
at::Tensor prefill_attention_finer(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                   const at::Tensor& table, int64_t seq_len, double scale, int64_t window) {
  const int64_t D = q.size(2), nb = (seq_len + k_cache.size(1) - 1) / k_cache.size(1);
  TORCH_CHECK(kv_head_dim(k_cache) == D && v_cache.sizes() == k_cache.sizes() && table.numel() >= nb && q.stride(1) == D,
              "prefill_attention: the caches do not hold q's head_dim, or the table does not cover seq_len");
  const auto qt = q.scalar_type();
#if defined(LORAPLEX_AVX2_ATTENTION)
  // no bf16 arithmetic here: bf16 q over int8 rows runs the float32 kernel over rows widened to float32 (the
  // reference's values, where bf16 rows would round them again), its output rounded to bf16 once
  if (qt == at::kBFloat16 && k_cache.scalar_type() == at::kChar)
    return prefill_attention_finer(q.to(at::kFloat), k_cache, v_cache, table, seq_len, scale, window).to(qt);
#endif
  at::Tensor k, v, qr = q;
  if (qt == at::kFloat) {
    k = widened_blocks<float>(k_cache, table, nb, D, qt);
    v = widened_blocks<float>(v_cache, table, nb, D, qt);
  } else {
    TORCH_CHECK(qt == at::kBFloat16 && k_cache.scalar_type() == at::kChar, "prefill_attention: a cache coarser than q");
    k = widened_blocks<bf16>(k_cache, table, nb, D, qt);
    v = widened_blocks<bf16>(v_cache, table, nb, D, qt);
  }
  if (k_cache.scalar_type() == at::kBFloat16) {  // float32 q over a bf16 cache: scored in bf16, as at decode
    qr = q.to(at::kBFloat16).to(at::kFloat);
  } else if (k_cache.scalar_type() == at::kChar) {
    qr = at::empty({q.size(0), q.size(1), D}, q.options());
    if (qt == at::kFloat) {
      round_queries_like_int8(q.data_ptr<float>(), q.stride(0), q.size(0), q.size(1), D, qr.data_ptr<float>());
    } else {
      round_queries_like_int8(q.data_ptr<bf16>(), q.stride(0), q.size(0), q.size(1), D, qr.data_ptr<bf16>());
    }
  }
  at::Tensor own = at::empty({nb}, table.options());
  int32_t* ids = own.data_ptr<int32_t>();
  for (int64_t i = 0; i < nb; ++i) ids[i] = static_cast<int32_t>(i);
  return prefill_attention(qr, k, v, own, seq_len, scale, window);
}

at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                             const at::Tensor& table, int64_t seq_len, double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && q.stride(2) == 1 && k_cache.stride(3) == 1 &&
                  k_cache.strides() == v_cache.strides(),
              "prefill_attention: q (n, Hq, D), caches (blocks, block_size, Hkv, D) with equal strides");
  TORCH_CHECK(table.scalar_type() == at::kInt && table.is_contiguous(), "prefill_attention: the block table is int32");
  if (k_cache.scalar_type() != q.scalar_type())
    return prefill_attention_finer(q, k_cache, v_cache, table, seq_len, scale, window);
  const int64_t n = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = k_cache.size(2);
  TORCH_CHECK((D == 64 || D == 128) && Hq % Hkv == 0 && Hq / Hkv <= kMaxGroup, "prefill_attention: head_dim 64 or 128");
  TORCH_CHECK(n >= 1 && seq_len >= n, "prefill_attention: seq_len counts the chunk's own tokens");
  TORCH_CHECK(table.scalar_type() == at::kInt && table.is_contiguous() &&
                  table.numel() * k_cache.size(1) >= seq_len,
              "prefill_attention: the block table (int32) must cover seq_len");
  at::Tensor out = at::empty({n, Hq, D}, q.options());
#if defined(__AVX512F__) || defined(LORAPLEX_AVX2_ATTENTION)
  const auto qt = q.scalar_type(), kt = k_cache.scalar_type();
  TORCH_CHECK(v_cache.scalar_type() == kt, "prefill_attention: k and v caches differ in dtype");
  if (qt == at::kFloat && kt == at::kFloat) {
    prefill_attention_impl<float, float>(q, k_cache, v_cache, table, seq_len, scale, window, out);
  } else if (qt == at::kBFloat16 && kt == at::kBFloat16) {
    prefill_attention_impl<bf16, bf16>(q, k_cache, v_cache, table, seq_len, scale, window, out);
  } else {
    TORCH_CHECK(false, "prefill_attention: q and caches both float32 or both bfloat16");
  }
  return out;
#else
  (void)n; TORCH_CHECK(false, "prefill_attention: this build has neither AVX-512 nor AVX2 (see has_prefill_attention)");
#endif
}

// 16 lanes of float or bf16 rows: masked loads and stores (bf16 rounded as torch rounds) for row tails
#if defined(__AVX512F__) && defined(__AVX512BW__)
inline __m512 load16m(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16m(const bf16* p, __mmask16 m) {
  const __m256i raw = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
// v rounded to T and widened back (what storing and reloading it gives): bf16 to nearest even, NaN stays
// NaN, as torch rounds
inline __m512 rounded16(__m512 v, const float*) { return v; }
inline __m512 rounded16(__m512 v, const bf16*) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC00000));
  return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u))));
}
inline void store16m(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
#if defined(__AVX512BF16__)
// v's bf16 bits, rounded to nearest even as torch rounds, NaN as torch's 0x7FC0: one VCVTNEPS2BF16, which
// flushes fp32 denormals (below 1.2e-38) to zero where torch keeps them
inline __m256i bf16_bits16(__m512 v) {
  return _mm256_mask_mov_epi16((__m256i)_mm512_cvtneps_pbh(v), _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q),
                               _mm256_set1_epi16(0x7FC0));
}
#endif
inline void store16m(bf16* p, __m512 v, __mmask16 m) {
#if defined(__AVX512BF16__)
  _mm256_mask_storeu_epi16(p, m, bf16_bits16(v));
#else
  const __m512i r = _mm512_castps_si512(rounded16(v, p));
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
#endif
}
// store16m, returning the value as stored (as loading it back would give)
inline __m512 stored16m(float* p, __m512 v, __mmask16 m) {
  store16m(p, v, m);
  return v;
}
inline __m512 stored16m(bf16* p, __m512 v, __mmask16 m) {
#if defined(__AVX512BF16__)
  const __m256i r = bf16_bits16(v);
  _mm256_mask_storeu_epi16(p, m, r);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(r), 16));
#else
  v = rounded16(v, p);
  store16m(p, v, m);
  return v;
#endif
}
// silu(g) = g / (1 + exp(-g)) rounded to T: silu_mul's first op (F.silu in the input dtype)
template <typename T>
inline __m512 silu16(__m512 g, const T* tag) {
  return rounded16(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), exp16(_mm512_xor_ps(g, _mm512_set1_ps(-0.f))))),
                   tag);
}

#endif

// ---- add_rms_norm: residual (+)= delta in place; returns weight * rmsnorm(residual) ----------------------
template <typename T>
void add_rms_norm_impl(at::Tensor& residual, const at::Tensor* delta, const at::Tensor& weight, double eps,
                       at::Tensor& out) {
  const int64_t rows = residual.size(0), H = residual.size(1);
  T* rp = residual.data_ptr<T>();
  const T* dp = delta ? delta->data_ptr<T>() : nullptr;
  const int64_t ds = delta ? delta->stride(0) : 0;
  const T* wp = weight.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t rs = residual.stride(0);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> xf(static_cast<size_t>(H));
    for (int64_t r = begin; r < end; ++r) {
      T* x = rp + r * rs;
#if defined(__AVX512F__) && defined(__AVX512BW__)
      // 16 lanes at a time, the tail masked; the squares summed per lane, then across
      const T* dr = dp ? dp + r * ds : nullptr;
      __m512 ssv = _mm512_setzero_ps();
      for (int64_t i = 0; i < H; i += 16) {
        const __mmask16 m = first_lanes(H - i);
        __m512 v = load16m(x + i, m);
        if (dr) {
          v = stored16m(x + i, _mm512_add_ps(v, load16m(dr + i, m)), m);  // rounded as torch's x + delta
        }
        _mm512_mask_storeu_ps(xf.data() + i, m, v);
        ssv = _mm512_fmadd_ps(v, v, ssv);
      }
      const __m512 inv = _mm512_set1_ps(
          1.f / std::sqrt(_mm512_reduce_add_ps(ssv) / static_cast<float>(H) + static_cast<float>(eps)));
      T* o = op + r * H;
      for (int64_t i = 0; i < H; i += 16) {
        const __mmask16 m = first_lanes(H - i);
        const __m512 normed = rounded16(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, xf.data() + i), inv), o);
        store16m(o + i, _mm512_mul_ps(load16m(wp + i, m), normed), m);  // the input dtype first, then the weight
      }
#else
      if (dp) {
        const T* dr = dp + r * ds;
        for (int64_t i = 0; i < H; ++i) x[i] = T(to_f(x[i]) + to_f(dr[i]));  // rounded as torch's x + delta
      }
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < H; ++i) {
        xf[i] = to_f(x[i]);
        ss += xf[i] * xf[i];
      }
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(H) + static_cast<float>(eps));
      T* o = op + r * H;
      for (int64_t i = 0; i < H; ++i) {
        T normed;
        from_f(xf[i] * inv, &normed);  // the input dtype first, then the weight: HF's LlamaRMSNorm
        from_f(to_f(wp[i]) * to_f(normed), o + i);
      }
#endif
    }
  });
}

at::Tensor add_rms_norm(at::Tensor residual, const std::optional<at::Tensor>& delta, const at::Tensor& weight,
                        double eps) {
  TORCH_CHECK(residual.dim() == 2 && residual.stride(1) == 1, "add_rms_norm: residual (rows, H), rows contiguous");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == residual.size(1), "add_rms_norm: weight (H,)");
  TORCH_CHECK(weight.scalar_type() == residual.scalar_type(), "add_rms_norm: weight dtype differs");
  if (delta) {
    TORCH_CHECK(delta->sizes() == residual.sizes() && delta->stride(1) == 1 &&
                    delta->scalar_type() == residual.scalar_type(),
                "add_rms_norm: delta must match residual");
  }
  at::Tensor out = at::empty(residual.sizes(), residual.options());
  const at::Tensor* d = delta ? &*delta : nullptr;
  if (residual.scalar_type() == at::kFloat) {
    add_rms_norm_impl<float>(residual, d, weight, eps, out);
  } else if (residual.scalar_type() == at::kBFloat16) {
    add_rms_norm_impl<bf16>(residual, d, weight, eps, out);
  } else {
    TORCH_CHECK(false, "add_rms_norm: dtypes float32 or bfloat16");
  }
  return out;
}

// ---- silu_mul: (rows, 2I) -> (rows, I) ----------------------------------------------------------------
template <typename T>
void silu_mul_impl(const at::Tensor& x, at::Tensor& out) {
  const int64_t rows = x.size(0), I = x.size(1) / 2, xs = x.stride(0);
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = xp + r * xs;
      const T* u = g + I;
      T* o = op + r * I;
#if defined(__AVX512F__) && defined(__AVX512BW__)
      // 16 lanes at a time, the tail masked: the scalar loop's operations (silu in the input dtype, then the
      // product: F.silu(g) * u)
      for (int64_t i = 0; i < I; i += 16) {
        const __mmask16 m = first_lanes(I - i);
        store16m(o + i, _mm512_mul_ps(silu16(load16m(g + i, m), o), load16m(u + i, m)), m);
      }
#else
      int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
      if constexpr (std::is_same_v<T, float>) {  // 8 lanes by exp8 (fast_exp's arithmetic), the tail below
        const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
        for (; i + 8 <= I; i += 8) {
          const __m256 gv = _mm256_loadu_ps(g + i);
          const __m256 act = _mm256_div_ps(gv, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, gv))));
          _mm256_storeu_ps(o + i, _mm256_mul_ps(act, _mm256_loadu_ps(u + i)));
        }
      }
#endif
      for (; i < I; ++i) {
        const float gf = to_f(g[i]);
        T act;
        from_f(gf / (1.f + fast_exp(-gf)), &act);  // silu in the input dtype, then the product: F.silu(g) * u
        from_f(to_f(act) * to_f(u[i]), o + i);
      }
#endif
    }
  });
}

at::Tensor silu_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % 2 == 0, "silu_mul: x (rows, 2I), rows contiguous");
  at::Tensor out = at::empty({x.size(0), x.size(1) / 2}, x.options());
  if (x.scalar_type() == at::kFloat) {
    silu_mul_impl<float>(x, out);
  } else if (x.scalar_type() == at::kBFloat16) {
    silu_mul_impl<bf16>(x, out);
  } else {
    TORCH_CHECK(false, "silu_mul: dtypes float32 or bfloat16");
  }
  return out;
}

// ---- rope_store_kv ---------------------------------------------------------------------------------------
// qk: (T, Hq + Hkv, D) view (head_dim contiguous), rotated in place; heads Hq.. are the keys. v: (T, Hkv, D).
// cos, sin: (T, D) float32. Caches (num_blocks, block_size, Hkv, D), any strides; slot = block * bs + offset.
template <typename T, typename KV>
void rope_store_kv_impl(at::Tensor& qk, const at::Tensor& v, const at::Tensor& cos, const at::Tensor& sin,
                        int64_t num_q_heads, at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slots) {
  const int64_t n_tok = qk.size(0), heads = qk.size(1), D = qk.size(2), half = D / 2;
  const int64_t qs0 = qk.stride(0), qs1 = qk.stride(1), vs0 = v.stride(0), vs1 = v.stride(1);
  const int64_t bs = k_cache.size(1), cb = k_cache.stride(0), cs = k_cache.stride(1), ch = k_cache.stride(2);
  const int64_t hkv = heads - num_q_heads;
  T* qp = qk.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  KV* kc = k_cache.data_ptr<KV>();
  KV* vc = v_cache.data_ptr<KV>();
  const int64_t* sl = slots.data_ptr<int64_t>();
  at::parallel_for(0, n_tok, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cp + t * D;
      const float* s = sp + t * D;
      const int64_t slot = sl[t];
      const int64_t base = (slot / bs) * cb + (slot % bs) * cs;
      for (int64_t h = 0; h < heads; ++h) {
        T* x = qp + t * qs0 + h * qs1;
        float lo[kMaxHeadDim / 2], hi[kMaxHeadDim / 2];
#pragma omp simd
        for (int64_t d = 0; d < half; ++d) {
          const float a = to_f(x[d]), b = to_f(x[d + half]);
          lo[d] = a * c[d] - b * s[d];
          hi[d] = b * c[d + half] + a * s[d + half];
        }
        for (int64_t d = 0; d < half; ++d) {
          from_f(lo[d], x + d);
          from_f(hi[d], x + d + half);
        }
        if (h >= num_q_heads) store_kv_row(x, kc + base + (h - num_q_heads) * ch, D);
      }
      for (int64_t h = 0; h < hkv; ++h) store_kv_row(vp + t * vs0 + h * vs1, vc + base + h * ch, D);
    }
  });
}

void rope_store_kv(at::Tensor qk, const at::Tensor& v, const at::Tensor& cos, const at::Tensor& sin,
                   int64_t num_q_heads, at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slots) {
  TORCH_CHECK(qk.dim() == 3 && v.dim() == 3 && qk.stride(2) == 1 && v.stride(2) == 1, "rope_store_kv: bad q/k/v");
  const int64_t D = qk.size(2), hkv = qk.size(1) - num_q_heads;
  TORCH_CHECK(D % 2 == 0 && D <= kMaxHeadDim && hkv == v.size(1) && hkv == k_cache.size(2) && v.size(2) == D &&
                  kv_head_dim(k_cache) == D,
              "rope_store_kv: head shapes disagree");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.numel() == qk.size(0) * D && sin.numel() == cos.numel(),
              "rope_store_kv: cos/sin (T, D) float32");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == qk.size(0),
              "rope_store_kv: one int64 slot per token");
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1 && k_cache.strides() == v_cache.strides(),
              "rope_store_kv: caches need head_dim contiguous and equal strides");
  const auto dt = qk.scalar_type(), kt = k_cache.scalar_type();
  TORCH_CHECK(v.scalar_type() == dt && v_cache.scalar_type() == kt, "rope_store_kv: q/k/v share one dtype, the caches another");
  if (dt == at::kFloat && kt == at::kFloat) {
    rope_store_kv_impl<float, float>(qk, v, cos, sin, num_q_heads, k_cache, v_cache, slots);
  } else if (dt == at::kBFloat16 && kt == at::kBFloat16) {
    rope_store_kv_impl<bf16, bf16>(qk, v, cos, sin, num_q_heads, k_cache, v_cache, slots);
  } else if (dt == at::kFloat && kt == at::kBFloat16) {
    rope_store_kv_impl<float, bf16>(qk, v, cos, sin, num_q_heads, k_cache, v_cache, slots);
  } else if (dt == at::kFloat && kt == at::kChar) {
    rope_store_kv_impl<float, int8_t>(qk, v, cos, sin, num_q_heads, k_cache, v_cache, slots);
  } else if (dt == at::kBFloat16 && kt == at::kChar) {
    rope_store_kv_impl<bf16, int8_t>(qk, v, cos, sin, num_q_heads, k_cache, v_cache, slots);
  } else {
    TORCH_CHECK(false, "rope_store_kv: q/k/v float32 or bfloat16, caches float32, bfloat16 or int8 (not finer than q)");
  }
}

// ---- lora_add -----------------------------------------------------------------------------------------
// y[t, off_i : off_i + n_i] += scaling[s, i] * (x[t] . A_i[s]) @ B_i[s].T for s = token_slots[t] >= 0 and every
// slice i with rank r = ranks[s, i] > 0; A_i[s] = lora_a[s, i*R : i*R + r] (r, H_in), B_i[s].T = b_t[s, :r,
// off_i : off_i + n_i]. Shrunk activations and the delta stay in fp32; each y element is rounded once.
template <typename T, typename Y = T>
void lora_add_impl(at::Tensor& y, const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& b_t,
                   const at::Tensor& ranks, const at::Tensor& scaling, const at::Tensor& token_slots,
                   const std::vector<int64_t>& sizes) {
  const int64_t n_tok = x.size(0), h_in = x.size(1), n_out = y.size(1);
  const int64_t num_slices = static_cast<int64_t>(sizes.size()), R = lora_a.size(1) / num_slices;
  const T* xp = x.data_ptr<T>();
  Y* yp = y.data_ptr<Y>();
  const T* ap = lora_a.data_ptr<T>();
  const T* bp = b_t.data_ptr<T>();
  const int32_t* rp = ranks.data_ptr<int32_t>();
  const float* sp = scaling.data_ptr<float>();
  const int32_t* slots = token_slots.data_ptr<int32_t>();
  const int64_t xs = x.stride(0), ys = y.stride(0);
  std::vector<int64_t> offsets(static_cast<size_t>(num_slices), 0);
  for (int64_t i = 1; i < num_slices; ++i) offsets[i] = offsets[i - 1] + sizes[i - 1];
  at::parallel_for(0, n_tok, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> xf(static_cast<size_t>(h_in)), delta(static_cast<size_t>(n_out));
    for (int64_t t = begin; t < end; ++t) {
      const int64_t s = slots[t];
      if (s < 0) continue;
      const T* xr = xp + t * xs;
#pragma omp simd
      for (int64_t k = 0; k < h_in; ++k) xf[k] = to_f(xr[k]);
      bool any = false;
      for (int64_t i = 0; i < num_slices; ++i) {
        const int64_t r = rp[s * num_slices + i];
        if (r <= 0) continue;
        const float scale = sp[s * num_slices + i];
        const int64_t off = offsets[i], n = sizes[i];
        if (!any) std::fill(delta.begin(), delta.end(), 0.f);
        any = true;
        for (int64_t j = 0; j < r; ++j) {
          const T* a = ap + (s * num_slices * R + i * R + j) * h_in;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t k = 0; k < h_in; ++k) dot += xf[k] * to_f(a[k]);
          const float coef = scale * dot;
          const T* b = bp + (s * R + j) * n_out + off;
          float* d = delta.data() + off;
#pragma omp simd
          for (int64_t c = 0; c < n; ++c) d[c] += coef * to_f(b[c]);
        }
      }
      if (!any) continue;
      Y* yr = yp + t * ys;
      for (int64_t i = 0; i < num_slices; ++i) {
        if (rp[s * num_slices + i] <= 0) continue;
        const int64_t off = offsets[i], n = sizes[i];
        for (int64_t c = off; c < off + n; ++c) from_f(to_f(yr[c]) + delta[c], yr + c);
      }
    }
  });
}


// Bytes fetched into L2 a few lines per step of a loop that computes on other data: lora_add's next slot
// (lora_tokens), and the panel GEMMs' next group. For the GEMMs: at 7+ rows a bf16 group's first tile would
// otherwise wait on memory (its weights arrive slower than it uses them) while the later tiles find them in
// cache. fp32 gains less (twice the FMAs per byte): the bench model's 120 projections at 32 rows, from
// memory, 2 threads, ~26 to ~23 ms (medians of 8 alternating runs on a noisy 2-core VM).
struct NoPrefetch {  // one tile of rows: nothing to fetch ahead (the tile's loop keeps no check)
  inline void step() {}
};

struct Prefetcher {
  const char* cur = nullptr;
  const char* end = nullptr;
  int64_t per_step = 0;
  Prefetcher() = default;
  // bytes [from, from + bytes) over `steps` calls of step()
  Prefetcher(const void* from, int64_t bytes, int64_t steps)
      : cur(static_cast<const char*>(from)), end(static_cast<const char*>(from) + bytes),
        per_step(steps > 0 ? (bytes / 64 + steps - 1) / steps : 0) {}
  inline void step() {
    for (int64_t i = 0; i < per_step && cur < end; ++i, cur += 64) __builtin_prefetch(cur, 0, 2);  // to L2
  }
  // the rest at once
  inline void all() {
    for (; cur < end; cur += 64) __builtin_prefetch(cur, 0, 2);
  }
};

#if defined(__AVX512F__) && defined(__AVX512BW__)
// out[m, j] = scale * x_m . A[j] for M tokens and the r rows of one slice's A (r, h_in): tiles of M tokens x
// 4 rows, 16-lane partial sums in registers, one hsum16 per tile.
template <typename T, int M>
void lora_shrink_tile(const T* const* xr, const T* a, int64_t r, int64_t h_in, float scale, float* out,
                      int64_t out_stride, Prefetcher& pf) {
  const __m512 zero = _mm512_setzero_ps();
  for (int64_t j0 = 0; j0 < r; j0 += 4) {
    const T* ar[4];
    for (int jj = 0; jj < 4; ++jj) ar[jj] = a + std::min<int64_t>(j0 + jj, r - 1) * h_in;  // past r: ignored
    __m512 acc[16];
    for (int u = 0; u < 16; ++u) acc[u] = zero;
    for (int64_t k = 0; k < h_in; k += 16) {
      const __mmask16 lanes = first_lanes(h_in - k);
      __m512 av[4];
      for (int jj = 0; jj < 4; ++jj) av[jj] = load16m(ar[jj] + k, lanes);
      pf.step();
      for (int m = 0; m < M; ++m) {
        const __m512 xv = load16m(xr[m] + k, lanes);
        for (int jj = 0; jj < 4; ++jj) acc[m * 4 + jj] = _mm512_fmadd_ps(xv, av[jj], acc[m * 4 + jj]);
      }
    }
    alignas(64) float sums[16];
    _mm512_store_ps(sums, _mm512_mul_ps(hsum16(acc), _mm512_set1_ps(scale)));
    for (int m = 0; m < M; ++m)
      for (int jj = 0; jj < 4 && j0 + jj < r; ++jj) out[m * out_stride + j0 + jj] = sums[m * 4 + jj];
  }
}

#if defined(__AVX512BF16__)
// The bf16 twin: x_m and A[j] as k pairs straight into VDPBF16PS (32 products an instruction, no widening),
// fp32 sums; a masked tail loads zeros past h_in.
// The accumulators here and in the expand below are GCC's own vector type, not __m512 (may_alias), and the expand's
// epilogue is unrolled: before, GCC 12 stored all 16 of the expand's accumulators to the stack at every pair of
// rows of B. One layer's adds at 8 slots x 4 tokens, factors in cache: 0.10 -> 0.07 ms (Zen 4, 2 threads).
typedef float v16sf __attribute__((vector_size(64)));

template <int M>
void lora_shrink_tile_bf16(const bf16* const* xr, const bf16* a, int64_t r, int64_t h_in, float scale, float* out,
                           int64_t out_stride, Prefetcher& pf) {
  for (int64_t j0 = 0; j0 < r; j0 += 4) {
    const bf16* ar[4];
    for (int jj = 0; jj < 4; ++jj) ar[jj] = a + std::min<int64_t>(j0 + jj, r - 1) * h_in;  // past r: ignored
    v16sf acc[16];
    for (int u = 0; u < 16; ++u) acc[u] = (v16sf)_mm512_setzero_ps();
    for (int64_t k = 0; k < h_in; k += 32) {
      const int64_t left = h_in - k;
      const __mmask32 lanes = left >= 32 ? static_cast<__mmask32>(0xFFFFFFFFu) : static_cast<__mmask32>((1u << left) - 1);
      __m512i av[4];
      for (int jj = 0; jj < 4; ++jj) av[jj] = _mm512_maskz_loadu_epi16(lanes, ar[jj] + k);
      pf.step();
      for (int m = 0; m < M; ++m) {
        const __m512i xv = _mm512_maskz_loadu_epi16(lanes, xr[m] + k);
        for (int jj = 0; jj < 4; ++jj)
          acc[m * 4 + jj] = __builtin_ia32_dpbf16ps_v16sf(acc[m * 4 + jj], (__v32bh)xv, (__v32bh)av[jj]);
      }
    }
    __m512 sums16[16];
    for (int u = 0; u < 16; ++u) sums16[u] = (__m512)acc[u];
    alignas(64) float sums[16];
    _mm512_store_ps(sums, _mm512_mul_ps(hsum16(sums16), _mm512_set1_ps(scale)));
    for (int m = 0; m < M; ++m)
      for (int jj = 0; jj < 4 && j0 + jj < r; ++jj) out[m * out_stride + j0 + jj] = sums[m * 4 + jj];
  }
}
#endif

// y_m[c] += sum_j u[m, j] * bt[j, c] for M tokens, c < n (bt rows strided by bt_stride): 4 chunks of 16
// columns x M tokens of accumulators, each y element read and rounded once. y's rows are T's, or fp32 ones
// (Y = float: a delta that a later op adds, see lora_delta).
template <typename T, int M, typename Y = T>
void lora_expand_tile(Y* const* yr, const float* u, int64_t u_stride, const T* bt, int64_t bt_stride, int64_t r,
                      int64_t n, Prefetcher& pf) {
  for (int64_t c0 = 0; c0 < n; c0 += 64) {
    __m512 acc[M][4];
    for (int m = 0; m < M; ++m)
      for (int cc = 0; cc < 4; ++cc) acc[m][cc] = _mm512_setzero_ps();
    __mmask16 lanes[4];
    for (int cc = 0; cc < 4; ++cc) lanes[cc] = c0 + 16 * cc < n ? first_lanes(n - c0 - 16 * cc) : 0;
    for (int64_t j = 0; j < r; ++j) {
      const T* b = bt + j * bt_stride + c0;
      pf.step();
      __m512 bv[4];
      for (int cc = 0; cc < 4; ++cc) bv[cc] = load16m(b + 16 * cc, lanes[cc]);
      for (int m = 0; m < M; ++m) {
        const __m512 um = _mm512_set1_ps(u[m * u_stride + j]);
        for (int cc = 0; cc < 4; ++cc) acc[m][cc] = _mm512_fmadd_ps(um, bv[cc], acc[m][cc]);
      }
    }
    for (int m = 0; m < M; ++m)
      for (int cc = 0; cc < 4; ++cc) {
        if (lanes[cc] == 0) continue;
        Y* yc = yr[m] + c0 + 16 * cc;
        store16m(yc, _mm512_add_ps(load16m(yc, lanes[cc]), acc[m][cc]), lanes[cc]);
      }
  }
}

#if defined(__AVX512BF16__)
// The bf16 twin: u rounded to bf16 (as a bf16 matmul rounds the shrunk activations) and consumed as (j, j + 1)
// pairs; rows j and j + 1 of bt interleaved by unpacklo/hi into VDPBF16PS's pair operand, which leaves the
// columns of each 32 in the order {0-3, 8-11, 16-19, 24-27} (lo) and {4-7, 12-15, 20-23, 28-31} (hi),
// put back by one permute each at the store. fp32 sums, each y element read and rounded once.
template <int M, typename Y = bf16>
void lora_expand_tile_bf16(Y* const* yr, const float* u, int64_t u_stride, const bf16* bt, int64_t bt_stride,
                           int64_t r, int64_t n, Prefetcher& pf) {
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int64_t c0 = 0; c0 < n; c0 += 64) {
    v16sf acc[M][4];  // [m][2 g + h]: 32-column group g, lo (h = 0) or hi (h = 1) half
    for (int m = 0; m < M; ++m)
      for (int q = 0; q < 4; ++q) acc[m][q] = (v16sf)_mm512_setzero_ps();
    __mmask32 cols[2];
    for (int g = 0; g < 2; ++g) {
      const int64_t left = n - c0 - 32 * g;
      cols[g] = left <= 0 ? 0 : left >= 32 ? static_cast<__mmask32>(0xFFFFFFFFu) : static_cast<__mmask32>((1u << left) - 1);
    }
    for (int64_t j = 0; j < r; j += 2) {
      const bf16* b0 = bt + j * bt_stride + c0;
      const bool pair = j + 1 < r;
      pf.step();
      __m512i bv[4];
      for (int g = 0; g < 2; ++g) {
        const __m512i row0 = _mm512_maskz_loadu_epi16(cols[g], b0 + 32 * g);
        const __m512i row1 = pair ? _mm512_maskz_loadu_epi16(cols[g], b0 + bt_stride + 32 * g) : _mm512_setzero_si512();
        bv[2 * g] = _mm512_unpacklo_epi16(row0, row1);
        bv[2 * g + 1] = _mm512_unpackhi_epi16(row0, row1);
      }
      for (int m = 0; m < M; ++m) {
        const uint32_t lo = bf16(u[m * u_stride + j]).x, hi = pair ? bf16(u[m * u_stride + j + 1]).x : 0;
        const __m512i um = _mm512_set1_epi32(static_cast<int32_t>(lo | (hi << 16)));
        for (int q = 0; q < 4; ++q) acc[m][q] = __builtin_ia32_dpbf16ps_v16sf(acc[m][q], (__v32bh)um, (__v32bh)bv[q]);
      }
    }
#pragma GCC unroll 4
    for (int m = 0; m < M; ++m)
#pragma GCC unroll 2
      for (int g = 0; g < 2; ++g) {
        if (cols[g] == 0) continue;
        const __m512 lo = (__m512)acc[m][2 * g], hi = (__m512)acc[m][2 * g + 1];
        const __m512 parts[2] = {_mm512_permutex2var_ps(lo, first, hi), _mm512_permutex2var_ps(lo, second, hi)};
        for (int h = 0; h < 2; ++h) {
          const int64_t c = c0 + 32 * g + 16 * h;
          if (c >= n) continue;
          const __mmask16 lanes = first_lanes(n - c);
          Y* yc = yr[m] + c;
          store16m(yc, _mm512_add_ps(load16m(yc, lanes), parts[h]), lanes);
        }
      }
  }
}
#endif

// tiles per step of the shrink (rows of A, k) and the expand (columns), for counting prefetch steps
constexpr int kShrinkRows = 4, kShrinkK = 16, kExpandCols = 64;
#elif defined(__AVX2__) && defined(__FMA__)
#define LORAPLEX_LORA_AVX2 1  // lora_add by tiles of one slot's tokens for float32; bf16 per token
// The AVX2 twins of the float tiles (16 ymm registers): the shrink takes 2 rows of A a pass (2 M partial sums,
// 8 lanes), the expand 16 columns (2 M accumulators); row and column tails load and store masked.
constexpr int kShrinkRows = 2, kShrinkK = 8, kExpandCols = 16;

inline __m256i first_lanes8(int64_t k) {  // a maskload/maskstore mask of lanes [0, min(k, 8))
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(std::min<int64_t>(k, 8))),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

template <typename T, int M>
void lora_shrink_tile(const float* const* xr, const float* a, int64_t r, int64_t h_in, float scale, float* out,
                      int64_t out_stride, Prefetcher& pf) {
  static_assert(std::is_same_v<T, float>, "AVX2 LoRA tiles: float32 only");
  for (int64_t j0 = 0; j0 < r; j0 += 2) {
    const float* ar[2] = {a + j0 * h_in, a + std::min<int64_t>(j0 + 1, r - 1) * h_in};  // past r: ignored
    __m256 acc[M][2];
    for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
    for (int64_t k = 0; k < h_in; k += 8) {
      const bool whole = k + 8 <= h_in;
      const __m256i lanes = whole ? _mm256_set1_epi32(-1) : first_lanes8(h_in - k);
      const __m256 a0 = whole ? _mm256_loadu_ps(ar[0] + k) : _mm256_maskload_ps(ar[0] + k, lanes);
      const __m256 a1 = whole ? _mm256_loadu_ps(ar[1] + k) : _mm256_maskload_ps(ar[1] + k, lanes);
      pf.step();
      for (int m = 0; m < M; ++m) {
        const __m256 xv = whole ? _mm256_loadu_ps(xr[m] + k) : _mm256_maskload_ps(xr[m] + k, lanes);
        acc[m][0] = _mm256_fmadd_ps(xv, a0, acc[m][0]);
        acc[m][1] = _mm256_fmadd_ps(xv, a1, acc[m][1]);
      }
    }
    for (int m = 0; m < M; ++m)
      for (int jj = 0; jj < 2 && j0 + jj < r; ++jj) out[m * out_stride + j0 + jj] = scale * hsum8(acc[m][jj]);
  }
}

template <typename T, int M, typename Y = T>
void lora_expand_tile(Y* const* yr, const float* u, int64_t u_stride, const float* bt, int64_t bt_stride, int64_t r,
                      int64_t n, Prefetcher& pf) {
  static_assert(std::is_same_v<T, float> && std::is_same_v<Y, float>, "AVX2 LoRA tiles: float32 only");
  for (int64_t c0 = 0; c0 < n; c0 += 16) {
    const __m256i lanes[2] = {first_lanes8(n - c0), first_lanes8(n - c0 - 8)};
    const bool whole = c0 + 16 <= n;
    __m256 acc[M][2];
    for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
    for (int64_t j = 0; j < r; ++j) {
      const float* b = bt + j * bt_stride + c0;
      pf.step();
      const __m256 b0 = whole ? _mm256_loadu_ps(b) : _mm256_maskload_ps(b, lanes[0]);
      const __m256 b1 = whole ? _mm256_loadu_ps(b + 8) : _mm256_maskload_ps(b + 8, lanes[1]);
      for (int m = 0; m < M; ++m) {
        const __m256 um = _mm256_broadcast_ss(u + m * u_stride + j);
        acc[m][0] = _mm256_fmadd_ps(um, b0, acc[m][0]);
        acc[m][1] = _mm256_fmadd_ps(um, b1, acc[m][1]);
      }
    }
    for (int m = 0; m < M; ++m)
      for (int h = 0; h < 2; ++h) {
        float* yc = yr[m] + c0 + 8 * h;
        if (whole) {
          _mm256_storeu_ps(yc, _mm256_add_ps(_mm256_loadu_ps(yc), acc[m][h]));
        } else if (c0 + 8 * h < n) {
          _mm256_maskstore_ps(yc, lanes[h], _mm256_add_ps(_mm256_maskload_ps(yc, lanes[h]), acc[m][h]));
        }
      }
  }
}
#endif

#if (defined(__AVX512F__) && defined(__AVX512BW__)) || defined(LORAPLEX_LORA_AVX2)
// A slot's LoRA factors as lora_tokens reads them: per slice its rank's rows of A, and the first max-rank rows
// of b_t (all slices' columns).
constexpr int kMaxLoraSlices = 8;  // more slices in one add: no fetching ahead

struct LoraSlot {
  const char* a[kMaxLoraSlices] = {};
  int64_t a_bytes[kMaxLoraSlices] = {};
  const char* b = nullptr;
  int64_t b_bytes = 0;
  void fetch() const {  // into L2, now
    for (int i = 0; i < kMaxLoraSlices; ++i) Prefetcher(a[i], a_bytes[i], 1).all();
    Prefetcher(b, b_bytes, 1).all();
  }
};

template <typename T>
LoraSlot lora_slot(int64_t s, const T* ap, const T* bp, const int32_t* rp, int64_t num_slices, int64_t R,
                   int64_t h_in, int64_t n_out) {
  LoraSlot slot;
  int64_t r_max = 0;
  for (int64_t i = 0; i < num_slices; ++i) {
    const int64_t r = rp[s * num_slices + i];
    slot.a[i] = reinterpret_cast<const char*>(ap + (s * num_slices * R + i * R) * h_in);
    slot.a_bytes[i] = std::max<int64_t>(r, 0) * h_in * static_cast<int64_t>(sizeof(T));
    r_max = std::max(r_max, r);
  }
  slot.b = reinterpret_cast<const char*>(bp + s * R * n_out);
  slot.b_bytes = r_max * n_out * static_cast<int64_t>(sizeof(T));
  return slot;
}

// Up to 4 tokens of one slot: shrink every slice into u (M, slices * R), then expand each slice into y.
// `next` (or nullptr): the factors of the slot this thread takes next, fetched into L2 meanwhile (its A
// slice by slice during the shrinks, its B during the expands), so a thread streams one slot's factors while
// it computes on another's: a slot's factors are a few short runs that the hardware prefetcher alone fetches
// at about half this machine's bandwidth.
template <typename T, int M, typename Y = T>
void lora_tokens(const T* const* xr, Y* const* yr, int64_t s, const T* ap, const T* bp, const int32_t* rp,
                 const float* sp, int64_t num_slices, int64_t R, int64_t h_in, int64_t n_out, const int64_t* offsets,
                 const int64_t* sizes, float* u, const LoraSlot* next) {
  constexpr bool kBf16 = std::is_same_v<T, bf16>;
  const int64_t us = num_slices * R, k_step = kBf16 ? 32 : kShrinkK;
  int64_t expand_steps = 0;
  for (int64_t i = 0; i < num_slices; ++i) {
    const int64_t r = rp[s * num_slices + i];
    if (r > 0) expand_steps += (sizes[i] + kExpandCols - 1) / kExpandCols * (kBf16 ? (r + 1) / 2 : r);
  }
  Prefetcher pb = next ? Prefetcher(next->b, next->b_bytes, expand_steps) : Prefetcher();
  for (int64_t i = 0; i < num_slices; ++i) {
    const int64_t r = rp[s * num_slices + i];
    Prefetcher pa = next ? Prefetcher(next->a[i], next->a_bytes[i],
                                          std::max<int64_t>(1, (r + kShrinkRows - 1) / kShrinkRows * ((h_in + k_step - 1) / k_step)))
                         : Prefetcher();
    if (r <= 0) {
      pa.all();
      continue;
    }
    const T* a = ap + (s * num_slices * R + i * R) * h_in;
#if defined(__AVX512BF16__)
    if constexpr (kBf16) {
      lora_shrink_tile_bf16<M>(xr, a, r, h_in, sp[s * num_slices + i], u + i * R, us, pa);
      continue;
    }
#endif
    lora_shrink_tile<T, M>(xr, a, r, h_in, sp[s * num_slices + i], u + i * R, us, pa);
  }
  for (int64_t i = 0; i < num_slices; ++i) {
    const int64_t r = rp[s * num_slices + i];
    if (r <= 0) continue;
    Y* yo[M];
    for (int m = 0; m < M; ++m) yo[m] = yr[m] + offsets[i];
#if defined(__AVX512BF16__)
    if constexpr (kBf16) {
      lora_expand_tile_bf16<M, Y>(yo, u + i * R, us, bp + s * R * n_out + offsets[i], n_out, r, sizes[i], pb);
      continue;
    }
#endif
    lora_expand_tile<T, M, Y>(yo, u + i * R, us, bp + s * R * n_out + offsets[i], n_out, r, sizes[i], pb);
  }
  pb.all();
}

// lora_add with the tokens grouped by slot (in their order within a slot) into tiles of up to 4, so each
// tile reads its slot's A and B once; tiles are the parallel items.
template <typename T, typename Y = T>
void lora_add_tiles(at::Tensor& y, const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& b_t,
                     const at::Tensor& ranks, const at::Tensor& scaling, const at::Tensor& token_slots,
                     const std::vector<int64_t>& sizes) {
  const int64_t n_tok = x.size(0), h_in = x.size(1), n_out = y.size(1), S = lora_a.size(0);
  const int64_t num_slices = static_cast<int64_t>(sizes.size()), R = lora_a.size(1) / num_slices;
  const int32_t* slots = token_slots.data_ptr<int32_t>();
  std::vector<int64_t> offsets(static_cast<size_t>(num_slices), 0);
  for (int64_t i = 1; i < num_slices; ++i) offsets[i] = offsets[i - 1] + sizes[i - 1];
  // counting sort of the adapted tokens by slot, then tiles of <= 4 tokens that never straddle two slots
  std::vector<int64_t> count(static_cast<size_t>(S + 1), 0), order;
  for (int64_t t = 0; t < n_tok; ++t)
    if (slots[t] >= 0) ++count[slots[t] + 1];
  for (int64_t s = 0; s < S; ++s) count[s + 1] += count[s];
  order.resize(static_cast<size_t>(count[S]));
  std::vector<int64_t> fill(count.begin(), count.end() - 1);
  for (int64_t t = 0; t < n_tok; ++t)
    if (slots[t] >= 0) order[fill[slots[t]]++] = t;
  std::vector<int64_t> tiles;  // start index into order; a tile runs to min(start + 4, its slot's end)
  for (int64_t s = 0; s < S; ++s)
    for (int64_t i = count[s]; i < count[s + 1]; i += 4) tiles.push_back(i);
  const T* xp = x.data_ptr<T>();
  Y* yp = y.data_ptr<Y>();
  const T* ap = lora_a.data_ptr<T>();
  const T* bp = b_t.data_ptr<T>();
  const int32_t* rp = ranks.data_ptr<int32_t>();
  const float* sp = scaling.data_ptr<float>();
  const int64_t xs = x.stride(0), ys = y.stride(0);
  struct Scratch {
    std::vector<float> u;
    int64_t fetched = -1;  // the slot whose factors the thread's previous tile fetched ahead
  };
  parallel_stealing<Scratch>(static_cast<int64_t>(tiles.size()), [&](Scratch& scratch, int64_t it, int64_t next_it) {
    std::vector<float>& u = scratch.u;
    u.resize(static_cast<size_t>(4 * num_slices * R));
    const int64_t i0 = tiles[it], s = slots[order[i0]];
    // a thread's first tile (or one it did not expect) fetches its own factors first; every tile fetches
    // the next one's while it computes, unless they share a slot (then they are in cache)
    const bool ahead = num_slices <= kMaxLoraSlices;
    if (ahead && scratch.fetched != s) lora_slot(s, ap, bp, rp, num_slices, R, h_in, n_out).fetch();
    const int64_t s_next = ahead && next_it >= 0 ? slots[order[tiles[next_it]]] : -1;
    LoraSlot next_slot;
    if (s_next >= 0 && s_next != s) next_slot = lora_slot(s_next, ap, bp, rp, num_slices, R, h_in, n_out);
    scratch.fetched = s_next >= 0 ? s_next : -1;
    const int M = static_cast<int>(std::min<int64_t>(4, count[s + 1] - i0));
    const T* xr[4];
    Y* yr[4];
    for (int m = 0; m < M; ++m) {
      xr[m] = xp + order[i0 + m] * xs;
      yr[m] = yp + order[i0 + m] * ys;
    }
#define LORAPLEX_LORA_TOKENS(MM) \
  lora_tokens<T, MM, Y>(xr, yr, s, ap, bp, rp, sp, num_slices, R, h_in, n_out, offsets.data(), sizes.data(), u.data(), \
                        s_next >= 0 && s_next != s ? &next_slot : nullptr)
    switch (M) {
      case 1: LORAPLEX_LORA_TOKENS(1); break;
      case 2: LORAPLEX_LORA_TOKENS(2); break;
      case 3: LORAPLEX_LORA_TOKENS(3); break;
      default: LORAPLEX_LORA_TOKENS(4); break;
    }
#undef LORAPLEX_LORA_TOKENS
  });
}
#endif

// lora_add's operand checks; y's dtype is checked by the caller.
void check_lora_operands(const at::Tensor& y, const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& b_t,
                         const at::Tensor& ranks, const at::Tensor& scaling, const at::Tensor& token_slots,
                         const std::vector<int64_t>& slice_sizes) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.stride(1) == 1 && y.stride(1) == 1 && x.size(0) == y.size(0),
              "lora_add: x (T, H_in) and y (T, N) with contiguous rows");
  const int64_t num_slices = static_cast<int64_t>(slice_sizes.size());
  int64_t total = 0;
  for (int64_t n : slice_sizes) total += n;
  TORCH_CHECK(num_slices > 0 && total == y.size(1), "lora_add: slice sizes must add up to y's width");
  TORCH_CHECK(lora_a.dim() == 3 && lora_a.is_contiguous() && lora_a.size(2) == x.size(1) &&
                  lora_a.size(1) % num_slices == 0,
              "lora_add: lora_a (S, slices * R, H_in) contiguous");
  const int64_t S = lora_a.size(0), R = lora_a.size(1) / num_slices;
  TORCH_CHECK(b_t.dim() == 3 && b_t.is_contiguous() && b_t.size(0) == S && b_t.size(1) == R && b_t.size(2) == total,
              "lora_add: b_t (S, R, N) contiguous");
  TORCH_CHECK(ranks.scalar_type() == at::kInt && ranks.is_contiguous() && ranks.numel() == S * num_slices &&
                  scaling.scalar_type() == at::kFloat && scaling.is_contiguous() && scaling.numel() == S * num_slices,
              "lora_add: ranks int32 and scaling float32, (S, slices)");
  TORCH_CHECK(token_slots.scalar_type() == at::kInt && token_slots.is_contiguous() && token_slots.numel() == x.size(0),
              "lora_add: token_slots (T,) int32");
  const auto dt = x.scalar_type();
  TORCH_CHECK(lora_a.scalar_type() == dt && b_t.scalar_type() == dt, "lora_add: x and the factors share one dtype");
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16, "lora_add: dtypes float32 or bfloat16");
  const int32_t* rp = ranks.data_ptr<int32_t>();
  for (int64_t i = 0; i < S * num_slices; ++i) TORCH_CHECK(rp[i] >= 0 && rp[i] <= R, "lora_add: rank past max rank");
  const int32_t* sl = token_slots.data_ptr<int32_t>();
  for (int64_t t = 0; t < x.size(0); ++t) TORCH_CHECK(sl[t] < S, "lora_add: token slot out of range");
}

template <typename T, typename Y>
void lora_add_dispatch(at::Tensor& y, const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& b_t,
                       const at::Tensor& ranks, const at::Tensor& scaling, const at::Tensor& token_slots,
                       const std::vector<int64_t>& slice_sizes) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  lora_add_tiles<T, Y>(y, x, lora_a, b_t, ranks, scaling, token_slots, slice_sizes);
#elif defined(LORAPLEX_LORA_AVX2)
  if constexpr (std::is_same_v<T, float> && std::is_same_v<Y, float>)
    lora_add_tiles<T, Y>(y, x, lora_a, b_t, ranks, scaling, token_slots, slice_sizes);
  else
    lora_add_impl<T, Y>(y, x, lora_a, b_t, ranks, scaling, token_slots, slice_sizes);
#else
  lora_add_impl<T, Y>(y, x, lora_a, b_t, ranks, scaling, token_slots, slice_sizes);
#endif
}

void lora_add(at::Tensor y, const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& b_t,
              const at::Tensor& ranks, const at::Tensor& scaling, const at::Tensor& token_slots,
              std::vector<int64_t> slice_sizes) {
  check_lora_operands(y, x, lora_a, b_t, ranks, scaling, token_slots, slice_sizes);
  TORCH_CHECK(y.scalar_type() == x.scalar_type(), "lora_add: x, y and the factors share one dtype");
  if (x.scalar_type() == at::kFloat) lora_add_dispatch<float, float>(y, x, lora_a, b_t, ranks, scaling, token_slots, slice_sizes);
  else lora_add_dispatch<bf16, bf16>(y, x, lora_a, b_t, ranks, scaling, token_slots, slice_sizes);
}

// The LoRA deltas alone, in fp32 (T, N): what lora_add would add to y before rounding to y's dtype (fp32
// factors' deltas are y's own sums, bf16 ones the fp32 sums lora_add rounds once into y). A fused op adds
// them where the product is rounded (silu_linear's epilogue), so the result equals lora_add's bit for bit.
at::Tensor lora_delta(const at::Tensor& x, int64_t n, const at::Tensor& lora_a, const at::Tensor& b_t,
                      const at::Tensor& ranks, const at::Tensor& scaling, const at::Tensor& token_slots,
                      const std::vector<int64_t>& slice_sizes) {
  at::Tensor delta = at::empty({x.size(0), n}, x.options().dtype(at::kFloat));
  std::memset(delta.data_ptr<float>(), 0, static_cast<size_t>(delta.numel()) * sizeof(float));
  check_lora_operands(delta, x, lora_a, b_t, ranks, scaling, token_slots, slice_sizes);
  if (x.scalar_type() == at::kFloat) lora_add_dispatch<float, float>(delta, x, lora_a, b_t, ranks, scaling, token_slots, slice_sizes);
  else lora_add_dispatch<bf16, float>(delta, x, lora_a, b_t, ranks, scaling, token_slots, slice_sizes);
  return delta;
}

// The fp32 bias of a panel GEMM with n outputs, checked, or nullptr.
inline const float* bias_ptr(const std::optional<at::Tensor>& bias, int64_t n, const char* op) {
  if (!bias) return nullptr;
  TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n, op,
              ": bias (N,) float32");
  return bias->data_ptr<float>();
}

// ---- bf16_linear --------------------------------------------------------------------------------------
// Packed weight: (N_pad / 16, K / 2, 16, 2) bf16, element [p, k2, j, t] = W[16 p + j, 2 k2 + t] (zero past N):
// one 64-byte load is 16 output columns x 2 consecutive k, the operand layout of VDPBF16PS. A tile of MR
// rows x NR panels keeps MR * NR fp32 accumulators in registers; threads split the panels, so each
// thread streams its part of the weight once per MR rows (from memory at decode sizes, from cache when
// many rows re-read a panel group).
bool has_bf16_linear() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

#if defined(__AVX512BF16__)
// One panel's 32 weights at pair k2 as 16 bf16 pairs: bf16 panels are loaded as they are; int8 panels
// (same order, 32 bytes) are widened exactly (an int8 is a bf16 integer).
template <bool I8>
inline __m512i panel_pairs(const void* panel, int64_t k2) {
  if constexpr (I8) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const int8_t*>(panel) + k2 * 32));
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(raw)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(raw, 1)));
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
  } else {
    return _mm512_loadu_si512(static_cast<const uint16_t*>(panel) + k2 * 32);
  }
}

// out[i, 16 (p0 + j) + c] = (sum_k x[i, k] W[16 (p0 + j) + c, k]) * scale + bias, MR rows x NR panels.
template <int MR, int NR, bool I8, class PF>
inline void bf16_tile(const uint16_t* __restrict x, int64_t xs, const void* __restrict w, int64_t K2, int64_t p0,
                      int64_t N, uint16_t* __restrict out, int64_t os, const float* __restrict scale,
                      const float* __restrict bias, PF& pf) {
  constexpr int64_t panel_bytes_per_k2 = I8 ? 32 : 64;
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  const void* panel[NR];
  for (int j = 0; j < NR; ++j) panel[j] = static_cast<const char*>(w) + (p0 + j) * K2 * panel_bytes_per_k2;
  for (int64_t k2 = 0; k2 < K2; ++k2) {
    pf.step();
    __m512i b[NR];
    for (int j = 0; j < NR; ++j) b[j] = panel_pairs<I8>(panel[j], k2);
    for (int i = 0; i < MR; ++i) {
      int32_t pair;
      std::memcpy(&pair, x + i * xs + 2 * k2, sizeof pair);
      const __m512i a = _mm512_set1_epi32(pair);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)a, (__m512bh)b[j]);
    }
  }
  for (int j = 0; j < NR; ++j) {
    const int64_t n0 = (p0 + j) * 16;
    const int64_t valid = std::min<int64_t>(16, N - n0);
    const __mmask16 mask = valid == 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << valid) - 1);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
    const __m512 sv = scale ? _mm512_maskz_loadu_ps(mask, scale + n0) : _mm512_set1_ps(1.f);
    for (int i = 0; i < MR; ++i) {
      const __m256bh r = _mm512_cvtneps_pbh(_mm512_fmadd_ps(acc[i][j], sv, bv));  // round to nearest even
      _mm256_mask_storeu_epi16(out + i * os + n0, mask, (__m256i)r);
    }
  }
}

template <int MR, bool I8, class PF>
void bf16_tile_nr(int nr, const uint16_t* x, int64_t xs, const void* w, int64_t K2, int64_t p0, int64_t N,
                  uint16_t* out, int64_t os, const float* scale, const float* bias, PF& pf) {
  switch (nr) {
    case 4: bf16_tile<MR, 4, I8, PF>(x, xs, w, K2, p0, N, out, os, scale, bias, pf); break;
    case 3: bf16_tile<MR, 3, I8, PF>(x, xs, w, K2, p0, N, out, os, scale, bias, pf); break;
    case 2: bf16_tile<MR, 2, I8, PF>(x, xs, w, K2, p0, N, out, os, scale, bias, pf); break;
    default: bf16_tile<MR, 1, I8, PF>(x, xs, w, K2, p0, N, out, os, scale, bias, pf); break;
  }
}

#endif

constexpr int64_t kPanelsPerTile = 4;
constexpr int64_t kRowsPerTile = 6;

// The fetch of panel group `next` (of kPanelsPerTile panels, panel_bytes each, of `panels` in all) over `steps`
// k steps: a panel GEMM's next item from parallel_stealing, nothing when there is none (-1).
inline Prefetcher next_group_fetch(const void* w, int64_t next, int64_t panels, int64_t panel_bytes, int64_t steps) {
  if (next < 0) return Prefetcher();
  const int64_t p0 = next * kPanelsPerTile;
  return Prefetcher(static_cast<const char*>(w) + p0 * panel_bytes,
                    std::min<int64_t>(kPanelsPerTile, panels - p0) * panel_bytes, steps);
}

// A panel GEMM's items for parallel_stealing: each group of kPanelsPerTile panels, cut into chunks of rows where
// there are too few groups for an even share. One 64-column group of the 1536-deep down projection is ~0.2 ms
// at 512 rows; with 9 groups on 2 threads the one left over kept the other thread idle that long, in every
// such projection of a prefill. Chunk after chunk of one group run back to back, so its panels stay in L2.
struct PanelItems {
  static constexpr int64_t kPerThread = 16;   // items wanted per thread
  static constexpr int64_t kMinRows = 8 * kRowsPerTile;
  int64_t groups, chunks = 1, chunk_rows;
  PanelItems(int64_t M, int64_t panels) : groups((panels + kPanelsPerTile - 1) / kPanelsPerTile), chunk_rows(M) {
    const int64_t want = (kPerThread * at::get_num_threads() + groups - 1) / groups;
    const int64_t split = std::min<int64_t>(want, M / kMinRows);
    if (split > 1) {
      chunk_rows = ((M + split - 1) / split + kRowsPerTile - 1) / kRowsPerTile * kRowsPerTile;
      chunks = (M + chunk_rows - 1) / chunk_rows;
    }
  }
  int64_t count() const { return groups * chunks; }
  int64_t group(int64_t item) const { return item / chunks; }
  int64_t row0(int64_t item) const { return item % chunks * chunk_rows; }
  int64_t rows(int64_t item, int64_t M) const { return std::min(chunk_rows, M - row0(item)); }
  // the group to fetch while `item` computes: the next item's, when that is another group (else -1)
  int64_t fetch(int64_t item, int64_t next) const { return next >= 0 && group(next) != group(item) ? group(next) : -1; }
};

// A GEMM of one or two rows (a decode step's batch) streams each weight from memory once, and its speed is
// how many bytes are in flight: on Zen 4, 8 panels read side by side (8 streams, each its own accumulators)
// ran a standalone copy of the 30 layers' bf16 projections 8-16 % faster than 4, and the engine's batch-1 step
// 2-10 % (bf16), ~8 % (w8a8) and ~11 % (int8 panels) faster (docs/benchmarks.md; fp32 panels, already at ~41
// GB/s, did not gain and keep their groups of 4). Items are runs of up to kStreamPanels panels, as many in
// every thread's share (a 36-panel projection is 6 runs of 6, not 8 + 8 + 8 + 8 + 4 with one thread left
// waiting); the tile is the row tiles' own, so every row's sums are the same to the bit at any M.
constexpr int64_t kStreamPanels = 8;
constexpr int64_t kStreamRows = 2;  // 8 panels x 2 rows: 16 accumulators and 8 operands in 32 registers
// The most rows that stream in runs: kStreamRows, or 0 (set_stream_rows) to run them on the row tiles, for A/B
// runs in one process (the VM's memory speed moved a batch-1 step by up to 40 % between processes).
std::atomic<int64_t> stream_rows{kStreamRows};

int64_t set_stream_rows(int64_t rows) {
  TORCH_CHECK(rows >= 0 && rows <= kStreamRows, "set_stream_rows: 0 .. ", kStreamRows);
  return stream_rows.exchange(rows);
}
inline bool streams(int64_t M) { return M <= stream_rows.load(std::memory_order_relaxed); }

// f(std::integral_constant<int, v>{}) for a count v in [1, Max] (below 1: 1), so the tile kernels take their
// row and panel counts as template arguments.
template <int Max, class F>
inline void as_constant(int64_t v, const F& f) {
  if constexpr (Max == 1) {
    f(std::integral_constant<int, 1>{});
  } else if (v >= Max) {
    f(std::integral_constant<int, Max>{});
  } else {
    as_constant<Max - 1>(v, f);
  }
}

// tile(std::integral_constant<int, MR>{}, std::integral_constant<int, NR>{}, p0) for rows [0, M) (M <=
// kStreamRows) of each run of panels p0 .. p0 + NR - 1: runs of up to kStreamPanels, as many in every thread's
// share.
template <class F>
void parallel_stream(int64_t M, int64_t panels, const F& tile) {
  const int64_t parts = std::max<int64_t>(1, at::get_num_threads());
  const int64_t n = std::min(panels, parts * ((panels + kStreamPanels * parts - 1) / (kStreamPanels * parts)));
  parallel_stealing(n, [&](int64_t it, int64_t) {
    const int64_t p0 = panels * it / n, p1 = panels * (it + 1) / n;
    as_constant<kStreamRows>(M, [&](auto mr) {
      as_constant<kStreamPanels>(p1 - p0, [&](auto nr) { tile(mr, nr, p0); });
    });
  });
}

// Rows [0, M) in tiles of kRowsPerTile: tile(std::integral_constant<int, MR>, m) for each tile's first row m
// and its row count MR (the last tile's may be fewer), so the tile kernels take MR as a template argument.
template <class F>
inline void for_row_tiles(int64_t M, const F& tile) {
  for (int64_t m = 0; m < M; m += kRowsPerTile) as_constant<kRowsPerTile>(M - m, [&](auto mr) { tile(mr, m); });
}

#if defined(__AVX512BF16__)
// Rows [0, M) of panels p0 .. p0 + nr - 1, kRowsPerTile rows per tile.
template <bool I8, class PF>
void bf16_rows(int64_t M, int nr, const uint16_t* xp, int64_t xs, const void* w, int64_t K2, int64_t p0, int64_t n,
               uint16_t* op, int64_t os, const float* scale, const float* bias, PF& pf) {
  for_row_tiles(M, [&](auto mr, int64_t m) {
    bf16_tile_nr<decltype(mr)::value, I8, PF>(nr, xp + m * xs, xs, w, K2, p0, n, op + m * os, os, scale, bias, pf);
  });
}
#endif

// ---- AMX tile GEMMs ---------------------------------------------------------------------------------------
// The panels are already the tile products' B operand: 16 k pairs (bf16) or 16 k quads (int8 quads) of one
// panel are 16 rows of 64 bytes, the layout TDPBF16PS and TDPBSUD read. A is 16 rows of x (32 bf16 or 64
// int8 k each), C a 16 x 16 fp32 / int32 block. A block of up to 2 x 16 rows x 2 panels keeps four C tiles,
// two A and two B (all eight tiles), each A and B load feeding two products; a thread walks its panel pairs
// and, for each, every row block, so the pair's weights stay in L2 while x streams past them.
namespace amx {

#if defined(LORAPLEX_AMX)
// C tiles 0 .. 3 = (row block 0, panel 0), (0, 1), (1, 0), (1, 1), stored to c[4][16][16].
// `between(s)` runs after step s's products are issued: other work (the previous block's epilogue) that the
// vector units do while the tile unit computes.
template <int MT, int NT, bool I8, class Between>
inline void block(const char* x, int64_t xs_bytes, const char* w0, const char* w1, int64_t steps, void* c,
                  Between&& between) {
  _tile_zero(0);
  if constexpr (NT > 1) _tile_zero(1);
  if constexpr (MT > 1) _tile_zero(2);
  if constexpr (MT > 1 && NT > 1) _tile_zero(3);
  const char* x1 = x + 16 * xs_bytes;
  for (int64_t s = 0; s < steps; ++s) {  // 64 bytes of every row of x and 16 rows (1 KB) of each panel
    _tile_stream_loadd(4, x + s * 64, xs_bytes);
    _tile_loadd(6, w0 + s * 1024, 64);
    if constexpr (I8) _tile_dpbsud(0, 4, 6); else _tile_dpbf16ps(0, 4, 6);
    if constexpr (NT > 1) {
      _tile_loadd(7, w1 + s * 1024, 64);
      if constexpr (I8) _tile_dpbsud(1, 4, 7); else _tile_dpbf16ps(1, 4, 7);
    }
    if constexpr (MT > 1) {
      _tile_stream_loadd(5, x1 + s * 64, xs_bytes);
      if constexpr (I8) _tile_dpbsud(2, 5, 6); else _tile_dpbf16ps(2, 5, 6);
      if constexpr (NT > 1) {
        if constexpr (I8) _tile_dpbsud(3, 5, 7); else _tile_dpbf16ps(3, 5, 7);
      }
    }
    between(s);
  }
  auto* cb = static_cast<char*>(c);
  _tile_stored(0, cb, 64);
  if constexpr (NT > 1) _tile_stored(1, cb + 1024, 64);
  if constexpr (MT > 1) _tile_stored(2, cb + 2048, 64);
  if constexpr (MT > 1 && NT > 1) _tile_stored(3, cb + 3072, 64);
}

template <bool I8, class Between>
inline void block_dispatch(int mt, int nt, const char* x, int64_t xs_bytes, const char* w0, const char* w1,
                           int64_t steps, void* c, Between&& between) {
  if (mt == 2 && nt == 2) block<2, 2, I8>(x, xs_bytes, w0, w1, steps, c, between);
  else if (mt == 2) block<2, 1, I8>(x, xs_bytes, w0, w1, steps, c, between);
  else if (nt == 2) block<1, 2, I8>(x, xs_bytes, w0, w1, steps, c, between);
  else block<1, 1, I8>(x, xs_bytes, w0, w1, steps, c, between);
}

// Rows [m0, min(m0 + 16 mt, M)) of panels p .. p + nt - 1 from the C tiles: fp32 sums (or int32, made
// exact by the row's correction) times the column scale (and the row's), plus bias, rounded to bf16.
// Only the block's rows t0 .. t1 - 1 (of its 16 mt) are written: the epilogue runs in slices (amx::gemm).
template <bool I8>
inline void epilogue(const void* c, int64_t t0, int64_t t1, int nt, int64_t m0, int64_t M, int64_t p, int64_t N,
                     uint16_t* out, int64_t os, const float* scale, const float* bias, const float* sx,
                     const int32_t* xsum) {
  t1 = std::min<int64_t>(t1, M - m0);
  for (int j = 0; j < nt; ++j) {
    const int64_t n0 = (p + j) * 16;
    const int64_t valid = std::min<int64_t>(16, N - n0);
    if (valid <= 0) continue;
    const __mmask16 mask = valid == 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << valid) - 1);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
    const __m512 sv = scale ? _mm512_maskz_loadu_ps(mask, scale + n0) : _mm512_set1_ps(1.f);
    for (int64_t t = t0; t < t1; ++t) {
      const char* tile = static_cast<const char*>(c) + ((t / 16) * 2 + j) * 1024;
      const int64_t r = t % 16, row = m0 + t;
      __m512 y;
      if constexpr (I8) {
        const __m512i acc = _mm512_load_si512(tile + r * 64);
        const __m512i exact = _mm512_sub_epi32(acc, _mm512_set1_epi32(128 * xsum[row]));
        y = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), _mm512_mul_ps(sv, _mm512_set1_ps(sx[row])), bv);
      } else {
        y = _mm512_fmadd_ps(_mm512_load_ps(reinterpret_cast<const float*>(tile + r * 64)), sv, bv);
      }
      _mm256_mask_storeu_epi16(out + row * os + n0, mask, (__m256i)_mm512_cvtneps_pbh(y));  // round to nearest even
    }
  }
}

// The fused gate/up projection's epilogue: C tiles (i, 0) hold gate columns q * 16 .., (i, 1) the up columns
// (q + half) * 16 ..; each rounded to bf16 as epilogue stores them, then (with `delta`, fp32 (M, 2 I): the
// LoRA deltas, lora_delta) the delta added and rounded again, as lora_add adds it to the stored product; then
// silu_mul's operations on them (silu in bf16, then the product), so the I = 16 half columns of out equal
// silu_mul(the unfused output) bit for bit.
template <bool I8>
inline void epilogue_silu(const void* c, int64_t t0, int64_t t1, int64_t m0, int64_t M, int64_t q, int64_t half,
                          uint16_t* out, int64_t os, const float* scale, const float* sx, const int32_t* xsum,
                          const float* delta) {
  const __m512 sg = scale ? _mm512_loadu_ps(scale + q * 16) : _mm512_set1_ps(1.f);
  const __m512 su = scale ? _mm512_loadu_ps(scale + (q + half) * 16) : _mm512_set1_ps(1.f);
  auto* o = reinterpret_cast<bf16*>(out);
  t1 = std::min<int64_t>(t1, M - m0);
  for (int64_t t = t0; t < t1; ++t) {
    const char* tg = static_cast<const char*>(c) + (t / 16) * 2 * 1024;
    const char* tu = tg + 1024;
    const int64_t r = t % 16, row = m0 + t;
    __m512 g, u;
    if constexpr (I8) {
      const __m512i fix = _mm512_set1_epi32(128 * xsum[row]);
      const __m512 rs = _mm512_set1_ps(sx[row]);
      g = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_load_si512(tg + r * 64), fix)), _mm512_mul_ps(sg, rs));
      u = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_load_si512(tu + r * 64), fix)), _mm512_mul_ps(su, rs));
    } else {
      g = _mm512_mul_ps(_mm512_load_ps(reinterpret_cast<const float*>(tg + r * 64)), sg);
      u = _mm512_mul_ps(_mm512_load_ps(reinterpret_cast<const float*>(tu + r * 64)), su);
    }
    bf16* dst = o + row * os + q * 16;
    g = rounded16(g, dst);
    u = rounded16(u, dst);
    if (delta != nullptr) {
      const float* d = delta + row * 2 * os;
      g = rounded16(_mm512_add_ps(g, _mm512_loadu_ps(d + q * 16)), dst);
      u = rounded16(_mm512_add_ps(u, _mm512_loadu_ps(d + (q + half) * 16)), dst);
    }
    store16m(dst, _mm512_mul_ps(silu16(g, dst), u), static_cast<__mmask16>(0xFFFF));
  }
}

// A thread's tile state and buffers, for all the items it runs (parallel_stealing's Scratch).
struct Scratch {
  Tiles tiles;
  alignas(64) char c[2][4 * 1024];  // the C tiles of two row blocks: one being computed, one in its epilogue
  std::vector<char> buffer;
};

// x (M, K) with M a multiple of 16 (or padded to one), rows xs_bytes apart; `weights(pair, buffer)` gives the
// B operand of panels 2 pair and 2 pair + 1 (the panels themselves, or a widened copy in `buffer`). One item
// per panel pair, over parallel_stealing (a preempted thread delays only the pair it holds).
// SILU: N = 2 I columns of a fused gate/up projection (I a multiple of 16, no bias) and out (M, I) =
// silu_mul of the product (plus `delta`, fp32 (M, N), before it: see epilogue_silu); item q pairs gate panel q
// with up panel q + half, `weights(q, buffer)` gives panel q and the up panel lies half panels after it.
template <bool I8, bool SILU = false, class Weights>
void gemm(const char* x, int64_t xs_bytes, int64_t M, int64_t steps, int64_t panels, int64_t N, Weights weights,
          uint16_t* out, const float* scale, const float* bias, const float* sx, const int32_t* xsum,
          const float* delta = nullptr) {
  const int64_t Mp = (M + 15) / 16 * 16, panel_bytes = steps * 1024, half = panels / 2;
  const int64_t items = SILU ? half : (panels + 1) / 2, second = SILU ? half * panel_bytes : panel_bytes;
  parallel_stealing<Scratch>(items, [&](Scratch& sc, int64_t item, int64_t) {
    const int64_t p = 2 * item;
    const int nt = SILU ? 2 : static_cast<int>(std::min<int64_t>(2, panels - p));
    const char* w0 = weights(item, sc.buffer);
    // Row block b's epilogue runs in slices between block b + 1's tile steps, from the other C buffer: the
    // vector units work through it while the tile unit computes (run after block b, it kept the tile unit idle).
    auto finish = [&](int64_t m, int64_t t0, int64_t t1) {
      const void* c = sc.c[(m / 32) & 1];
      if constexpr (SILU) epilogue_silu<I8>(c, t0, t1, m, M, item, half, out, N / 2, scale, sx, xsum, delta);
      else epilogue<I8>(c, t0, t1, nt, m, M, p, N, out, N, scale, bias, sx, xsum);
    };
    int64_t prev = -1, prev_rows = 0;
    for (int64_t m = 0; m < Mp; m += 32) {
      const int mt = static_cast<int>(std::min<int64_t>(2, (Mp - m) / 16));
      const int64_t per_step = prev >= 0 ? (prev_rows + steps - 1) / steps : 0;
      block_dispatch<I8>(mt, nt, x + m * xs_bytes, xs_bytes, w0, w0 + second, steps, sc.c[(m / 32) & 1],
                         [&](int64_t s) {
                           if (per_step > 0) finish(prev, s * per_step, std::min((s + 1) * per_step, prev_rows));
                         });
      prev = m;
      prev_rows = 16 * mt;
    }
    finish(prev, 0, prev_rows);
  });
}

// x's rows as tile rows: the rows themselves when M is a multiple of 16, else a zero-padded copy.
const char* padded_rows(const char* x, int64_t xs_bytes, int64_t M, int64_t row_bytes, std::vector<char>& copy,
                        int64_t& stride) {
  if (M % 16 == 0) {
    stride = xs_bytes;
    return x;
  }
  const int64_t Mp = (M + 15) / 16 * 16;
  copy.assign(static_cast<size_t>(Mp * row_bytes), 0);
  for (int64_t i = 0; i < M; ++i) std::memcpy(copy.data() + i * row_bytes, x + i * xs_bytes, row_bytes);
  stride = row_bytes;
  return copy.data();
}
#endif

}  // namespace amx

bool has_amx() { return amx::permitted(); }

// Turn the AMX path on or off for this process; returns whether it runs now (on and permitted).
bool set_amx(bool enable) {
  amx::wanted.store(enable);
  return enable && amx::permitted();
}

#if defined(LORAPLEX_AMX)
// bf16 x over bf16 or int8 panels (int8 widened to bf16 one panel pair at a time), K a multiple of 32.
// SILU (bf16 panels only): the fused gate/up product, out (M, n / 2) = silu_mul of it (amx::gemm).
template <bool SILU = false>
void amx_linear_bf16(const uint16_t* xp, int64_t xs, int64_t M, int64_t K2, const void* wp, bool i8,
                     int64_t panels, int64_t n, uint16_t* op, const float* scale, const float* bias,
                     const float* delta = nullptr) {
  std::vector<char> copy;
  int64_t stride = 0;
  const char* x = amx::padded_rows(reinterpret_cast<const char*>(xp), xs * 2, M, K2 * 4, copy, stride);
  const int64_t steps = K2 / 16;
  if (!i8) {
    const char* w = static_cast<const char*>(wp);
    // an item's first panel: 2 item (a pair), or item (SILU: the gate panel)
    auto weights = [&](int64_t item, std::vector<char>&) { return w + (SILU ? 1 : 2) * item * K2 * 64; };
    amx::gemm<false, SILU>(x, stride, M, steps, panels, n, weights, op, scale, bias, nullptr, nullptr, delta);
    return;
  }
  TORCH_CHECK(!SILU, "silu_linear: int8 panels have no fused tile path");
  const auto* w = static_cast<const int8_t*>(wp);
  auto weights = [&](int64_t pair, std::vector<char>& buffer) {
    const int64_t p = 2 * pair, count = std::min<int64_t>(2, panels - p);
    buffer.resize(static_cast<size_t>(2 * K2 * 64));
    for (int64_t k2 = 0; k2 < count * K2; ++k2)
      _mm512_storeu_si512(buffer.data() + k2 * 64, panel_pairs<true>(w + p * K2 * 32, k2));
    return static_cast<const char*>(buffer.data());
  };
  amx::gemm<false>(x, stride, M, steps, panels, n, weights, op, scale, bias, nullptr, nullptr);
}
#endif

// y = (x @ W.T) * scale + bias over bf16 or int8 panels; int8 with more rows than one tile first widens
// each panel group to bf16 in a per-thread buffer, so the conversion is paid once per group, not per tile.
at::Tensor panel_linear_bf16(const at::Tensor& x, const at::Tensor& w, int64_t n, const float* scale,
                             const float* bp) {
  const bool i8 = w.scalar_type() == at::kChar;
  const int64_t M = x.size(0), K2 = w.size(1), panels = w.size(0), xs = x.stride(0);
  at::Tensor out = at::empty({M, n}, x.options());
#if defined(__AVX512BF16__)
  if (M == 0) return out;
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const void* wp = w.data_ptr();
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
#if defined(LORAPLEX_AMX)
  if (amx::use(M) && K2 % 16 == 0) {
    amx_linear_bf16(xp, xs, M, K2, wp, i8, panels, n, op, scale, bp);
    return out;
  }
#endif
  if (streams(M)) {
    parallel_stream(M, panels, [&](auto mr, auto nr, int64_t p0) {
      NoPrefetch none;
      if (i8) bf16_tile<decltype(mr)::value, decltype(nr)::value, true>(xp, xs, wp, K2, p0, n, op, n, scale, bp, none);
      else bf16_tile<decltype(mr)::value, decltype(nr)::value, false>(xp, xs, wp, K2, p0, n, op, n, scale, bp, none);
    });
    return out;
  }
  const int64_t panel_bytes = K2 * (i8 ? 32 : 64), tiles = (M + kRowsPerTile - 1) / kRowsPerTile;
  const PanelItems items(M, panels);
  struct Scratch {
    std::vector<uint16_t> widened;
    int64_t group = -1;  // the group `widened` holds
  };
  parallel_stealing<Scratch>(items.count(), [&](Scratch& scratch, int64_t it, int64_t next) {
    const int64_t g = items.group(it), p0 = g * kPanelsPerTile, m0 = items.row0(it), rows = items.rows(it, M);
    const int nr = static_cast<int>(std::min<int64_t>(kPanelsPerTile, panels - p0));
    const uint16_t* x0 = xp + m0 * xs;
    uint16_t* o0 = op + m0 * n;
    // the next group of this thread's panels, while several tiles compute this one (with one tile the
    // hardware prefetcher streams the weights better alone: measured)
    if (tiles == 1) {
      NoPrefetch none;
      if (i8) {
        bf16_rows<true>(rows, nr, x0, xs, wp, K2, p0, n, o0, n, scale, bp, none);
      } else {
        bf16_rows<false>(rows, nr, x0, xs, wp, K2, p0, n, o0, n, scale, bp, none);
      }
      return;
    }
    Prefetcher pf = next_group_fetch(wp, items.fetch(it, next), panels, panel_bytes,
                                     (rows + kRowsPerTile - 1) / kRowsPerTile * K2);
    if (!i8) {
      bf16_rows<false>(rows, nr, x0, xs, wp, K2, p0, n, o0, n, scale, bp, pf);
    } else {
      std::vector<uint16_t>& widened = scratch.widened;
      if (scratch.group != g) {  // once per group, whatever its chunks of rows
        widened.resize(static_cast<size_t>(nr * K2 * 32));
        const int8_t* src = static_cast<const int8_t*>(wp) + p0 * K2 * 32;
        for (int64_t k2 = 0; k2 < nr * K2; ++k2)
          _mm512_storeu_si512(widened.data() + k2 * 32, panel_pairs<true>(src, k2));
        scratch.group = g;
      }
      // the buffer holds panels p0 .. p0 + nr - 1 as panels 0 .. nr - 1: shift the output and scales
      bf16_rows<false>(rows, nr, x0, xs, widened.data(), K2, 0, n - p0 * 16, o0 + p0 * 16, n,
                       scale ? scale + p0 * 16 : nullptr, bp ? bp + p0 * 16 : nullptr, pf);
    }
  });
  return out;
#else
  (void)i8; (void)M; (void)K2; (void)panels; (void)xs; (void)scale; (void)bp;
  TORCH_CHECK(false, "bf16_linear: this build has no AVX512-BF16 (see has_bf16_linear)");
#endif
}

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& w, int64_t n, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kBFloat16,
              "bf16_linear: x (M, K) bfloat16, rows contiguous");
  TORCH_CHECK(w.dim() == 4 && w.is_contiguous() && w.size(2) == 16 && w.size(3) == 2 &&
                  w.scalar_type() == at::kBFloat16 && w.size(1) * 2 == x.size(1) && w.size(0) * 16 >= n,
              "bf16_linear: w must be packed for this K and N");
  const float* bp = bias_ptr(bias, n, "bf16_linear");
  return panel_linear_bf16(x, w, n, nullptr, bp);
}

at::Tensor int8_linear_f32(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales,
                           const std::optional<at::Tensor>& bias);

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales,
                       const std::optional<at::Tensor>& bias) {
  if (x.scalar_type() == at::kFloat) return int8_linear_f32(x, w, scales, bias);
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kBFloat16,
              "int8_linear: x (M, K) bfloat16 or float32, rows contiguous");
  const int64_t n = scales.numel();
  TORCH_CHECK(w.dim() == 4 && w.is_contiguous() && w.size(2) == 16 && w.size(3) == 2 && w.scalar_type() == at::kChar &&
                  w.size(1) * 2 == x.size(1) && w.size(0) * 16 >= n && w.size(0) * 16 < n + 16,
              "int8_linear: w must be int8 panels for this K and N");
  TORCH_CHECK((scales.scalar_type() == at::kFloat || scales.scalar_type() == at::kBFloat16) && scales.is_contiguous(),
              "int8_linear: scales (N,) float32 or bfloat16");
  const float* bp = bias_ptr(bias, n, "int8_linear");
  if (scales.scalar_type() == at::kFloat) return panel_linear_bf16(x, w, n, scales.data_ptr<float>(), bp);
  std::vector<float> sf(static_cast<size_t>(n));
  const bf16* sp = scales.data_ptr<bf16>();
  for (int64_t i = 0; i < n; ++i) sf[i] = to_f(sp[i]);
  return panel_linear_bf16(x, w, n, sf.data(), bp);
}


// ---- w8a8_linear -------------------------------------------------------------------------------------------
// int8 weights x int8 activations (the activations rounded per row at each call), int32 sums by AVX512-VNNI
// `vpdpbusd` (64 byte products a instruction: twice the products of a bf16 dot product). Packed weight:
// (P, K / 4, 16, 4) uint8, element [p, k4, j, t] = q[16 p + j, 4 k4 + t] + 128 (128, i.e. q = 0, past N):
// one 64-byte load is 16 output columns x 4 consecutive k, the unsigned operand of VPDPBUSD. Row t of x is
// rounded as qx = rne(x * (127 / max |x[t]|)) in -127..127 (signed operand), so
//   sum_k (q + 128) qx = sum_k q qx + 128 sum_k qx   and   y[t, n] = (acc - 128 xsum[t]) * sx[t] * scale[n] + bias,
// sx[t] = max |x[t]| / 127: exact integer sums, one fp32 rounding per output before bf16.
//
// AVX2 builds (no VNNI) run the same quads with VPMADDUBSW, whose unsigned operand must be the weight's
// magnitude so that a pair of products cannot saturate int16: q = (q + 128) ^ 0x80, then
// |q| * sign(qx, q) summed in pairs (at most 2 * 128 * 127 < 2^15) and by VPMADDWD in quads: exact int32
// sums of q qx with no 128 xsum correction; x and y float32 or bf16. 32 products take four instructions
// (sign, madd-bytes, madd-words, add) where VNNI takes a quarter of one; at decode the weights' bytes bound it.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define LORAPLEX_W8A8_VNNI 1
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define LORAPLEX_W8A8_AVX2 1
#endif

bool has_w8a8_linear() {  // for bf16 x
#if defined(LORAPLEX_W8A8_VNNI) || defined(LORAPLEX_W8A8_AVX2)
  return true;
#else
  return false;
#endif
}

bool has_w8a8_linear_f32() {  // for float32 x
#if defined(LORAPLEX_W8A8_AVX2)
  return true;
#else
  return false;
#endif
}

struct RowsI8 {  // x rounded to int8 per row
  std::vector<int8_t> q;  // (M, K)
  std::vector<float> scale;  // sx
  std::vector<int32_t> sum;  // sum_k qx (the VNNI kernel's correction)
};

#if defined(LORAPLEX_W8A8_VNNI)
typedef int v16si __attribute__((vector_size(64)));  // GCC's type of vpdpbusd's operands

inline __m512 bf16x16_to_f32(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

void round_rows_i8(const uint16_t* x, int64_t xs, int64_t M, int64_t K, RowsI8& r) {
  r.q.resize(static_cast<size_t>(M * K));
  r.scale.resize(static_cast<size_t>(M));
  r.sum.resize(static_cast<size_t>(M));
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const uint16_t* row = x + i * xs;
      __m512 mx = _mm512_setzero_ps();
      for (int64_t k = 0; k < K; k += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(bf16x16_to_f32(row + k)));
      const float amax = _mm512_reduce_max_ps(mx);
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      r.scale[i] = amax / 127.f;
      const __m512 iv = _mm512_set1_ps(inv);
      __m512i acc = _mm512_setzero_si512();
      int8_t* out = r.q.data() + i * K;
      for (int64_t k = 0; k < K; k += 16) {
        const __m512i qi = _mm512_cvtps_epi32(_mm512_mul_ps(bf16x16_to_f32(row + k), iv));  // round to nearest even
        acc = _mm512_add_epi32(acc, qi);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + k), _mm512_cvtsepi32_epi8(qi));
      }
      r.sum[i] = _mm512_reduce_add_epi32(acc);
    }
  });
}

template <int MR, int NR, class PF>
inline void w8a8_tile(const int8_t* __restrict xq, int64_t K, const float* __restrict sx, const int32_t* __restrict xsum,
                      const uint8_t* __restrict w, int64_t K4, int64_t p0, int64_t N, uint16_t* __restrict out,
                      int64_t os, const float* __restrict scale, const float* __restrict bias, PF& pf) {
  // The builtin's own vector type: through the __m512i intrinsic GCC 12 keeps these arrays on the stack
  // (a load and a store around every product, measured at half the speed).
  v16si acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = (v16si)_mm512_setzero_si512();
  const uint8_t* panel[NR];
  for (int j = 0; j < NR; ++j) panel[j] = w + (p0 + j) * K4 * 64;
  for (int64_t k4 = 0; k4 < K4; ++k4) {
    pf.step();
    v16si b[NR];
    for (int j = 0; j < NR; ++j) b[j] = (v16si)_mm512_loadu_si512(panel[j] + k4 * 64);
    for (int i = 0; i < MR; ++i) {
      int32_t quad;
      std::memcpy(&quad, xq + i * K + 4 * k4, sizeof quad);
      const v16si a = (v16si)_mm512_set1_epi32(quad);
      for (int j = 0; j < NR; ++j) acc[i][j] = __builtin_ia32_vpdpbusd_v16si(acc[i][j], b[j], a);
    }
  }
  for (int j = 0; j < NR; ++j) {
    const int64_t n0 = (p0 + j) * 16;
    const int64_t valid = std::min<int64_t>(16, N - n0);
    const __mmask16 mask = valid == 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << valid) - 1);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
    const __m512 sv = _mm512_maskz_loadu_ps(mask, scale + n0);
    for (int i = 0; i < MR; ++i) {
      const __m512i exact = _mm512_sub_epi32((__m512i)acc[i][j], _mm512_set1_epi32(128 * xsum[i]));
      const __m512 y = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), _mm512_mul_ps(sv, _mm512_set1_ps(sx[i])), bv);
      _mm256_mask_storeu_epi16(out + i * os + n0, mask, (__m256i)_mm512_cvtneps_pbh(y));
    }
  }
}

template <int MR, class PF>
void w8a8_tile_nr(int nr, const int8_t* xq, int64_t K, const float* sx, const int32_t* xsum, const uint8_t* w,
                  int64_t K4, int64_t p0, int64_t N, uint16_t* out, int64_t os, const float* scale,
                  const float* bias, PF& pf) {
  switch (nr) {
    case 4: w8a8_tile<MR, 4, PF>(xq, K, sx, xsum, w, K4, p0, N, out, os, scale, bias, pf); break;
    case 3: w8a8_tile<MR, 3, PF>(xq, K, sx, xsum, w, K4, p0, N, out, os, scale, bias, pf); break;
    case 2: w8a8_tile<MR, 2, PF>(xq, K, sx, xsum, w, K4, p0, N, out, os, scale, bias, pf); break;
    default: w8a8_tile<MR, 1, PF>(xq, K, sx, xsum, w, K4, p0, N, out, os, scale, bias, pf); break;
  }
}

template <class PF>
void w8a8_rows(int64_t m0, int64_t m1, int nr, const RowsI8& r, int64_t K, const uint8_t* w, int64_t K4, int64_t p0,
               int64_t n, uint16_t* op, const float* scale, const float* bias, PF& pf) {
  for (int64_t m = m0; m < m1; m += kRowsPerTile) {
    const int64_t mr = std::min<int64_t>(kRowsPerTile, m1 - m);
    const int8_t* xq = r.q.data() + m * K;
    const float* sx = r.scale.data() + m;
    const int32_t* xsum = r.sum.data() + m;
    uint16_t* orow = op + m * n;
    switch (mr) {
      case 6: w8a8_tile_nr<6, PF>(nr, xq, K, sx, xsum, w, K4, p0, n, orow, n, scale, bias, pf); break;
      case 5: w8a8_tile_nr<5, PF>(nr, xq, K, sx, xsum, w, K4, p0, n, orow, n, scale, bias, pf); break;
      case 4: w8a8_tile_nr<4, PF>(nr, xq, K, sx, xsum, w, K4, p0, n, orow, n, scale, bias, pf); break;
      case 3: w8a8_tile_nr<3, PF>(nr, xq, K, sx, xsum, w, K4, p0, n, orow, n, scale, bias, pf); break;
      case 2: w8a8_tile_nr<2, PF>(nr, xq, K, sx, xsum, w, K4, p0, n, orow, n, scale, bias, pf); break;
      default: w8a8_tile_nr<1, PF>(nr, xq, K, sx, xsum, w, K4, p0, n, orow, n, scale, bias, pf); break;
    }
  }
}
#endif

#if defined(LORAPLEX_W8A8_AVX2)
// Each row of x as qx = rne(x * (127 / max |x[t]|)), the reference's operations (kernels.quant.round_rows_int8).
template <class T>
void round_rows_i8_avx2(const T* x, int64_t xs, int64_t M, int64_t K, RowsI8& r) {
  r.q.resize(static_cast<size_t>(M * K));
  r.scale.resize(static_cast<size_t>(M));
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    const __m256i to_bytes = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                              0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
    for (int64_t i = begin; i < end; ++i) {
      const T* row = x + i * xs;
      __m256 mx = _mm256_setzero_ps();
      for (int64_t k = 0; k < K; k += 8) mx = _mm256_max_ps(mx, _mm256_and_ps(load8_f32(row + k), magnitude));
      const float amax = hmax8(mx);
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      r.scale[i] = amax / 127.f;
      const __m256 iv = _mm256_set1_ps(inv);
      int8_t* out = r.q.data() + i * K;
      for (int64_t k = 0; k < K; k += 8) {
        const __m256i qi = _mm256_cvtps_epi32(_mm256_mul_ps(load8_f32(row + k), iv));  // nearest even
        const __m256i b = _mm256_shuffle_epi8(qi, to_bytes);  // low byte of each int32 (|qi| <= 127)
        const int32_t lo = _mm256_extract_epi32(b, 0), hi = _mm256_extract_epi32(b, 4);
        std::memcpy(out + k, &lo, 4);
        std::memcpy(out + k + 4, &hi, 4);
      }
    }
  });
}

inline void store8(float* p, __m256 v, int valid) {
  if (valid >= 8) {
    _mm256_storeu_ps(p, v);
    return;
  }
  alignas(32) float t[8];
  _mm256_store_ps(t, v);
  for (int i = 0; i < valid; ++i) p[i] = t[i];
}

inline void store8(bf16* p, __m256 v, int valid) {  // round to nearest even, as torch's .to()
  alignas(32) float t[8];
  _mm256_store_ps(t, v);
  for (int i = 0; i < valid; ++i) p[i] = bf16(t[i]);
}

inline __m256i quad_products(__m256i acc, __m256i w_abs, __m256i w_signed, __m256i a, __m256i ones) {
  const __m256i pairs = _mm256_maddubs_epi16(w_abs, _mm256_sign_epi8(a, w_signed));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, ones));
}

// MR rows x one panel (16 columns as two 8-lane halves).
template <int MR, class T>
inline void w8a8_tile_avx2(const int8_t* __restrict xq, int64_t K, const float* __restrict sx,
                           const uint8_t* __restrict panel, int64_t K4, int64_t n0, int64_t N, T* __restrict out,
                           int64_t os, const float* __restrict scale, const float* __restrict bias) {
  __m256i acc[MR][2];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_si256();
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80)), ones = _mm256_set1_epi16(1);
  for (int64_t k4 = 0; k4 < K4; ++k4) {
    const __m256i w0 = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + k4 * 64)), flip);
    const __m256i w1 = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + k4 * 64 + 32)), flip);
    const __m256i a0 = _mm256_abs_epi8(w0), a1 = _mm256_abs_epi8(w1);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      int32_t quad;
      std::memcpy(&quad, xq + i * K + 4 * k4, sizeof quad);
      const __m256i a = _mm256_set1_epi32(quad);
      acc[i][0] = quad_products(acc[i][0], a0, w0, a, ones);
      acc[i][1] = quad_products(acc[i][1], a1, w1, a, ones);
    }
  }
#pragma GCC unroll 2
  for (int h = 0; h < 2; ++h) {
    const int64_t c0 = n0 + 8 * h;
    const int valid = static_cast<int>(std::min<int64_t>(8, N - c0));
    if (valid <= 0) break;
    alignas(32) float sb[8] = {0, 0, 0, 0, 0, 0, 0, 0}, bb[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int c = 0; c < valid; ++c) {
      sb[c] = scale[c0 + c];
      if (bias) bb[c] = bias[c0 + c];
    }
    const __m256 sv = _mm256_load_ps(sb), bv = _mm256_load_ps(bb);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m256 y = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[i][h]), _mm256_mul_ps(sv, _mm256_set1_ps(sx[i])), bv);
      store8(out + i * os + c0, y, valid);
    }
  }
}

constexpr int64_t kRowsPerTileAvx2 = 4;  // 8 int32 accumulators of one panel: 16 ymm registers in all

template <class T>
void w8a8_linear_avx2(const T* xp, int64_t xs, int64_t M, int64_t K, const uint8_t* wp, int64_t panels, int64_t n,
                      const float* scale, const float* bias, T* op) {
  RowsI8 rows;
  round_rows_i8_avx2(xp, xs, M, K, rows);
  const int64_t K4 = K / 4;
  parallel_stealing(panels, [&](int64_t p, int64_t) {
    const uint8_t* panel = wp + p * K4 * 64;
    for (int64_t m = 0; m < M; m += kRowsPerTileAvx2) {
      const int64_t mr = std::min<int64_t>(kRowsPerTileAvx2, M - m);
      const int8_t* xq = rows.q.data() + m * K;
      const float* sx = rows.scale.data() + m;
      T* orow = op + m * n;
      switch (mr) {
        case 4: w8a8_tile_avx2<4, T>(xq, K, sx, panel, K4, p * 16, n, orow, n, scale, bias); break;
        case 3: w8a8_tile_avx2<3, T>(xq, K, sx, panel, K4, p * 16, n, orow, n, scale, bias); break;
        case 2: w8a8_tile_avx2<2, T>(xq, K, sx, panel, K4, p * 16, n, orow, n, scale, bias); break;
        default: w8a8_tile_avx2<1, T>(xq, K, sx, panel, K4, p * 16, n, orow, n, scale, bias); break;
      }
    }
  });
}
#endif

// The (N,) scales as fp32: the tensor's own data, or a widened copy in buf.
const float* scales_f32(const at::Tensor& scales, std::vector<float>& buf) {
  if (scales.scalar_type() == at::kFloat) return scales.data_ptr<float>();
  const int64_t n = scales.numel();
  buf.resize(static_cast<size_t>(n));
  const bf16* sp = scales.data_ptr<bf16>();
  for (int64_t i = 0; i < n; ++i) buf[i] = to_f(sp[i]);
  return buf.data();
}

#if defined(LORAPLEX_AMX)
// w8a8 on AMX tiles over the rows rounded to int8 (padded here with zero rows, scale and sum 0, to whole
// tiles); SILU: the fused gate/up product, out (M, n / 2) = silu_mul of it (amx::gemm).
template <bool SILU = false>
void amx_linear_w8a8(RowsI8& rows, int64_t M, int64_t K, const uint8_t* wp, int64_t panels, int64_t n, uint16_t* op,
                     const float* scale, const float* bias, const float* delta = nullptr) {
  rows.q.resize(static_cast<size_t>((M + 15) / 16 * 16 * K));
  const char* base = reinterpret_cast<const char*>(wp);
  // an item's first panel: 2 item (a pair), or item (SILU: the gate panel)
  auto weights = [&](int64_t item, std::vector<char>&) { return base + (SILU ? 1 : 2) * item * K * 16; };
  amx::gemm<true, SILU>(reinterpret_cast<const char*>(rows.q.data()), K, M, K / 64, panels, n, weights, op, scale, bias,
                        rows.scale.data(), rows.sum.data(), delta);
}
#endif

at::Tensor w8a8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales,
                       const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "w8a8_linear: x (M, K) bfloat16 or float32, rows contiguous");
  const int64_t M = x.size(0), K = x.size(1), n = scales.numel();
  TORCH_CHECK(w.dim() == 4 && w.is_contiguous() && w.size(2) == 16 && w.size(3) == 4 && w.scalar_type() == at::kByte &&
                  w.size(1) * 4 == K && w.size(0) * 16 >= n && w.size(0) * 16 < n + 16 && K % 16 == 0,
              "w8a8_linear: w must be uint8 quads for this K and N (K a multiple of 16)");
  TORCH_CHECK((scales.scalar_type() == at::kFloat || scales.scalar_type() == at::kBFloat16) && scales.is_contiguous(),
              "w8a8_linear: scales (N,) float32 or bfloat16");
  const float* bp = bias_ptr(bias, n, "w8a8_linear");
  at::Tensor out = at::empty({M, n}, x.options());
#if defined(LORAPLEX_W8A8_VNNI) || defined(LORAPLEX_W8A8_AVX2)
  if (M == 0) return out;
  std::vector<float> sf;
  const float* scale = scales_f32(scales, sf);
#endif
#if defined(LORAPLEX_W8A8_AVX2)
  if (x.scalar_type() == at::kFloat) {
    w8a8_linear_avx2(x.data_ptr<float>(), x.stride(0), M, K, w.data_ptr<uint8_t>(), w.size(0), n, scale, bp,
                     out.data_ptr<float>());
    return out;
  }
#endif
#if !defined(LORAPLEX_W8A8_VNNI) && defined(LORAPLEX_W8A8_AVX2)
  w8a8_linear_avx2(x.data_ptr<bf16>(), x.stride(0), M, K, w.data_ptr<uint8_t>(), w.size(0), n, scale, bp,
                   out.data_ptr<bf16>());
  return out;
#endif
#if defined(LORAPLEX_W8A8_VNNI)
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "w8a8_linear: this build has no float32 kernel (has_w8a8_linear_f32)");
  RowsI8 rows;
  round_rows_i8(reinterpret_cast<const uint16_t*>(x.data_ptr()), x.stride(0), M, K, rows);
  const auto* wp = w.data_ptr<uint8_t>();
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
#if defined(LORAPLEX_AMX)
  if (amx::use(M) && K % 64 == 0) {
    amx_linear_w8a8(rows, M, K, wp, w.size(0), n, op, scale, bp);
    return out;
  }
#endif
  const int64_t K4 = K / 4, panels = w.size(0);
  if (streams(M)) {
    parallel_stream(M, panels, [&](auto mr, auto nr, int64_t p0) {
      NoPrefetch none;
      w8a8_tile<decltype(mr)::value, decltype(nr)::value>(rows.q.data(), K, rows.scale.data(), rows.sum.data(), wp, K4,
                                                          p0, n, op, n, scale, bp, none);
    });
    return out;
  }
  const int64_t panel_bytes = K4 * 64, tiles = (M + kRowsPerTile - 1) / kRowsPerTile;
  const PanelItems items(M, panels);
  parallel_stealing(items.count(), [&](int64_t it, int64_t next) {
    const int64_t p0 = items.group(it) * kPanelsPerTile, m0 = items.row0(it), m1 = m0 + items.rows(it, M);
    const int nr = static_cast<int>(std::min<int64_t>(kPanelsPerTile, panels - p0));
    if (tiles == 1) {
      NoPrefetch none;
      w8a8_rows(m0, m1, nr, rows, K, wp, K4, p0, n, op, scale, bp, none);
      return;
    }
    Prefetcher pf = next_group_fetch(wp, items.fetch(it, next), panels, panel_bytes,
                                     (m1 - m0 + kRowsPerTile - 1) / kRowsPerTile * K4);
    w8a8_rows(m0, m1, nr, rows, K, wp, K4, p0, n, op, scale, bp, pf);
  });
  return out;
#endif
#if !defined(LORAPLEX_W8A8_VNNI) && !defined(LORAPLEX_W8A8_AVX2)
  (void)M; (void)K; (void)bp;
  TORCH_CHECK(false, "w8a8_linear: this build has neither AVX512-VNNI nor AVX2 (see has_w8a8_linear)");
#endif
}


// ---- int4_linear -------------------------------------------------------------------------------------------
// Packed int4 weight: (P, K / 4, 32) uint8. Byte e of [p, t] holds element e of k-pair 2t (low nibble) and of
// k-pair 2t + 1 (high nibble), each k-pair's 32 elements in the bf16 panel order (16 columns x 2 k). Scales
// and zeros as the model stores them: (G, N, 2) bf16, [g, n] = (s, z), one 64-byte load per panel and
// group. A nibble q widens exactly to the bf16 of 128 + q (bits 0x4300 | q), and
//   sum_{k in g} x_k ((q_k - 8) s + z) = s * sum_{k in g} x_k (128 + q_k) + (z - 136 s) * sum_{k in g} x_k,
// so each group's bf16 dot products are scaled once and corrected by the row's sum over the group.
#if defined(__AVX512BF16__)
inline void int4_pairs(const uint8_t* src, __m512i& a, __m512i& b) {  // k-pairs 2t and 2t + 1 as bf16 pairs
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  const __m512i magic = _mm512_set1_epi16(0x4300);
  a = _mm512_or_si512(_mm512_cvtepu8_epi16(_mm256_and_si256(raw, nibble)), magic);
  b = _mm512_or_si512(_mm512_cvtepu8_epi16(_mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble)), magic);
}

// MR rows x NR panels. WIDENED: `w` holds the panels' 128 + q as bf16 pairs (2 x 64 bytes per t) instead of
// nibbles, made once per panel group for many rows.
template <int MR, int NR, bool WIDENED>
inline void int4_tile(const uint16_t* __restrict x, int64_t xs, const void* __restrict w, int64_t K4,
                      int64_t G, int64_t tpg, int64_t p0, int64_t N, uint16_t* __restrict out, int64_t os,
                      const uint16_t* __restrict sz, int64_t sz_stride, const float* __restrict xsum,
                      const float* __restrict bias) {
  __m512 tot[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) tot[i][j] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512 acc[MR][NR];
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
    for (int64_t t = g * tpg; t < (g + 1) * tpg; ++t) {
      __m512i ba[NR], bb[NR];
      for (int j = 0; j < NR; ++j) {
        if constexpr (WIDENED) {
          const uint16_t* src = static_cast<const uint16_t*>(w) + ((p0 + j) * K4 + t) * 64;
          ba[j] = _mm512_loadu_si512(src);
          bb[j] = _mm512_loadu_si512(src + 32);
        } else {
          int4_pairs(static_cast<const uint8_t*>(w) + ((p0 + j) * K4 + t) * 32, ba[j], bb[j]);
        }
      }
      for (int i = 0; i < MR; ++i) {
        int32_t pa, pb;
        std::memcpy(&pa, x + i * xs + 4 * t, sizeof pa);
        std::memcpy(&pb, x + i * xs + 4 * t + 2, sizeof pb);
        const __m512i xa = _mm512_set1_epi32(pa), xb = _mm512_set1_epi32(pb);
        for (int j = 0; j < NR; ++j) {
          acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)xa, (__m512bh)ba[j]);
          acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)xb, (__m512bh)bb[j]);
        }
      }
    }
    for (int j = 0; j < NR; ++j) {
      const int64_t n0 = (p0 + j) * 16;
      // 16 (s, z) bf16 pairs: s in each 32-bit lane's low half, z in its high half
      const __m512i pairs = _mm512_maskz_loadu_epi32(first_lanes(N - n0), sz + g * sz_stride + 2 * n0);
      const __m512 s = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
      const __m512 z = _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u))));
      const __m512 c = _mm512_fmadd_ps(_mm512_set1_ps(-136.f), s, z);  // z - (128 + 8) s
      for (int i = 0; i < MR; ++i)
        tot[i][j] = _mm512_fmadd_ps(s, acc[i][j], _mm512_fmadd_ps(c, _mm512_set1_ps(xsum[i * G + g]), tot[i][j]));
    }
  }
  for (int j = 0; j < NR; ++j) {
    const int64_t n0 = (p0 + j) * 16;
    const int64_t valid = std::min<int64_t>(16, N - n0);
    const __mmask16 mask = valid == 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << valid) - 1);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
    for (int i = 0; i < MR; ++i) {
      const __m256bh r = _mm512_cvtneps_pbh(_mm512_add_ps(tot[i][j], bv));
      _mm256_mask_storeu_epi16(out + i * os + n0, mask, (__m256i)r);
    }
  }
}

// Rows [0, M) x panels p0 .. p0 + nr - 1 (nr <= 4): tiles of up to 6 rows; 1-2 rows take 4 panels at a
// time, more rows 2 (the accumulators of both sums must fit in registers).
template <bool WIDENED>
void int4_rows(int64_t M, int nr, const uint16_t* xp, int64_t xs, const void* w, int64_t K4, int64_t G, int64_t tpg,
               int64_t p0, int64_t n, uint16_t* op, int64_t os, const uint16_t* sz, int64_t sz_stride,
               const float* xsum, const float* bias) {
  for (int64_t m = 0; m < M; m += kRowsPerTile) {
    const int mr = static_cast<int>(std::min<int64_t>(kRowsPerTile, M - m));
    const uint16_t* xr = xp + m * xs;
    uint16_t* orow = op + m * os;
    const float* xsr = xsum + m * G;
#define LORAPLEX_INT4(MR, NR, P) \
  int4_tile<MR, NR, WIDENED>(xr, xs, w, K4, G, tpg, P, n, orow, os, sz, sz_stride, xsr, bias)
    if (mr <= 2) {
      for (int j = 0; j < nr;) {
        const int left = nr - j;
        if (mr == 1) {
          if (left >= 4) { LORAPLEX_INT4(1, 4, p0 + j); j += 4; } else if (left >= 2) { LORAPLEX_INT4(1, 2, p0 + j); j += 2; } else { LORAPLEX_INT4(1, 1, p0 + j); j += 1; }
        } else {
          if (left >= 4) { LORAPLEX_INT4(2, 4, p0 + j); j += 4; } else if (left >= 2) { LORAPLEX_INT4(2, 2, p0 + j); j += 2; } else { LORAPLEX_INT4(2, 1, p0 + j); j += 1; }
        }
      }
    } else {
      for (int j = 0; j < nr; j += 2) {
        const bool two = nr - j >= 2;
        switch (mr) {
          case 3: if (two) LORAPLEX_INT4(3, 2, p0 + j); else LORAPLEX_INT4(3, 1, p0 + j); break;
          case 4: if (two) LORAPLEX_INT4(4, 2, p0 + j); else LORAPLEX_INT4(4, 1, p0 + j); break;
          case 5: if (two) LORAPLEX_INT4(5, 2, p0 + j); else LORAPLEX_INT4(5, 1, p0 + j); break;
          default: if (two) LORAPLEX_INT4(6, 2, p0 + j); else LORAPLEX_INT4(6, 1, p0 + j); break;
        }
      }
    }
#undef LORAPLEX_INT4
  }
}
#endif

#if defined(LORAPLEX_AMX)
// int4 panels p .. p + count - 1 dequantized to bf16 panels, s (q - 8) + z rounded once per weight (zero past
// N), into out: the AMX path's B operand for many rows (the AVX-512 path sums 128 + q and applies s and z
// per group instead; the two agree to the bf16 rounding of a weight).
void int4_dequant_panels(const uint8_t* w, int64_t K4, int64_t p, int64_t count, const uint16_t* sz, int64_t G,
                         int64_t tpg, int64_t N, char* out) {
  const __m512i lo_cols = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i hi_cols = _mm512_add_epi32(lo_cols, _mm512_set1_epi32(8));
  const __m512 offset = _mm512_set1_ps(136.f);  // the pairs hold 128 + q, q = nibble - 8 ... as 128 + nibble
  for (int64_t j = 0; j < count; ++j) {
    const int64_t n0 = (p + j) * 16;
    for (int64_t g = 0; g < G; ++g) {
      const __m512i pairs = _mm512_maskz_loadu_epi32(first_lanes(N - n0), sz + (g * N + n0) * 2);
      const __m512 s = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
      const __m512 z = _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u))));
      // per element of a pair vector (column c = lane / 2): its column's s and z
      const __m512 s_lo = _mm512_permutexvar_ps(lo_cols, s), s_hi = _mm512_permutexvar_ps(hi_cols, s);
      const __m512 z_lo = _mm512_permutexvar_ps(lo_cols, z), z_hi = _mm512_permutexvar_ps(hi_cols, z);
      for (int64_t t = g * tpg; t < (g + 1) * tpg; ++t) {
        __m512i two[2];
        int4_pairs(w + ((p + j) * K4 + t) * 32, two[0], two[1]);
        for (int h = 0; h < 2; ++h) {  // k pairs 2t and 2t + 1
          const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(two[h])), 16));
          const __m512 hi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(two[h], 1)), 16));
          const __m512 wlo = _mm512_fmadd_ps(_mm512_sub_ps(lo, offset), s_lo, z_lo);
          const __m512 whi = _mm512_fmadd_ps(_mm512_sub_ps(hi, offset), s_hi, z_hi);
          _mm512_storeu_si512(out + (j * 2 * K4 + 2 * t + h) * 64, (__m512i)_mm512_cvtne2ps_pbh(whi, wlo));
        }
      }
    }
  }
}

void amx_linear_int4(const uint16_t* xp, int64_t xs, int64_t M, int64_t K4, const uint8_t* w, int64_t panels,
                     const uint16_t* sz, int64_t G, int64_t n, uint16_t* op, const float* bias) {
  std::vector<char> copy;
  int64_t stride = 0;
  const char* x = amx::padded_rows(reinterpret_cast<const char*>(xp), xs * 2, M, K4 * 8, copy, stride);
  const int64_t tpg = K4 / G;
  auto weights = [&](int64_t pair, std::vector<char>& buffer) {
    const int64_t p = 2 * pair;
    buffer.resize(static_cast<size_t>(2 * K4 * 128));
    int4_dequant_panels(w, K4, p, std::min<int64_t>(2, panels - p), sz, G, tpg, n, buffer.data());
    return static_cast<const char*>(buffer.data());
  };
  amx::gemm<false>(x, stride, M, K4 / 8, panels, n, weights, op, nullptr, bias, nullptr, nullptr);
}
#endif

// int4_linear's operands, checked against x (M, K): panels (P, K / per, 8 per) uint8 (per = 4 k a row of 32
// bytes for bf16 x, 2 a row of 16 for float32 x) holding N columns, and scale_zeros (G, N, 2) in x's dtype with G
// dividing the panel rows.
struct Int4Shape {
  int64_t P, steps, n, G;
};
Int4Shape int4_shape(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale_zeros, int64_t per) {
  const int64_t K = x.size(1);
  TORCH_CHECK(w.dim() == 3 && w.is_contiguous() && w.scalar_type() == at::kByte && w.size(2) == 8 * per &&
                  w.size(1) * per == K,
              "int4_linear: w must be int4 panels (P, K / ", per, ", ", 8 * per, ") for this x");
  TORCH_CHECK(scale_zeros.dim() == 3 && scale_zeros.is_contiguous() && scale_zeros.scalar_type() == x.scalar_type() &&
                  scale_zeros.size(2) == 2 && w.size(1) % scale_zeros.size(0) == 0,
              "int4_linear: scale_zeros (G, N, 2) in x's dtype, G dividing K / ", per);
  const Int4Shape shape{w.size(0), w.size(1), scale_zeros.size(1), scale_zeros.size(0)};
  TORCH_CHECK(shape.P * 16 >= shape.n && shape.P * 16 < shape.n + 16, "int4_linear: the panels do not hold N columns");
  return shape;
}

#if defined(__AVX2__) && defined(__FMA__)
at::Tensor int4_linear_f32(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale_zeros,
                           const std::optional<at::Tensor>& bias);
#endif

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale_zeros,
                       const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "int4_linear: x (M, K) bfloat16 or float32, rows contiguous");
  if (x.scalar_type() == at::kFloat) {
#if defined(__AVX2__) && defined(__FMA__)
    return int4_linear_f32(x, w, scale_zeros, bias);
#else
    TORCH_CHECK(false, "int4_linear: this build has no AVX2 float32 kernel (see has_int4_linear_f32)");
#endif
  }
  const int64_t M = x.size(0), K = x.size(1);
  const Int4Shape shape = int4_shape(x, w, scale_zeros, 4);  // named, not bound: the lambdas below read them
  const int64_t P = shape.P, K4 = shape.steps, n = shape.n, G = shape.G, tpg = K4 / G, group = K / G;
  const float* bp = bias_ptr(bias, n, "int4_linear");
  at::Tensor out = at::empty({M, n}, x.options());
#if defined(__AVX512BF16__)
  if (M == 0) return out;
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const int64_t xs = x.stride(0);
#if defined(LORAPLEX_AMX)
  if (amx::use(M) && K4 % 8 == 0) {
    amx_linear_int4(xp, xs, M, K4, w.data_ptr<uint8_t>(), P, reinterpret_cast<const uint16_t*>(scale_zeros.data_ptr()),
                    G, n, reinterpret_cast<uint16_t*>(out.data_ptr()), bp);
    return out;
  }
#endif
  std::vector<float> xsum(static_cast<size_t>(M * G));  // each row's sum over each group, fp32
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
      for (int64_t g = 0; g < G; ++g) {
        const bf16* row = reinterpret_cast<const bf16*>(xp + m * xs) + g * group;
        __m512 s = _mm512_setzero_ps();
        for (int64_t k = 0; k < group; k += 16) s = _mm512_add_ps(s, load16(row + k));
        xsum[m * G + g] = _mm512_reduce_add_ps(s);
      }
  });
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const auto* szp = reinterpret_cast<const uint16_t*>(scale_zeros.data_ptr());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  struct Scratch {
    std::vector<uint16_t> widened;
    int64_t group = -1;  // the group `widened` holds
  };
  const PanelItems items(M, P);
  parallel_stealing<Scratch>(items.count(), [&](Scratch& scratch, int64_t it, int64_t) {
    const int64_t g = items.group(it), p0 = g * kPanelsPerTile, m0 = items.row0(it), rows = items.rows(it, M);
    const int nr = static_cast<int>(std::min<int64_t>(kPanelsPerTile, P - p0));
    const uint16_t* x0 = xp + m0 * xs;
    uint16_t* o0 = op + m0 * n;
    const float* xsum0 = xsum.data() + m0 * G;
    if (M <= kRowsPerTile) {
      int4_rows<false>(rows, nr, x0, xs, wp, K4, G, tpg, p0, n, o0, n, szp, 2 * n, xsum0, bp);
      return;
    }
    // many rows: widen the group's nibbles once (panels p0.. as 0..), then every tile of its chunks reads bf16
    std::vector<uint16_t>& widened = scratch.widened;
    if (scratch.group != g) {
      widened.resize(static_cast<size_t>(nr * K4 * 64));
      for (int64_t t = 0; t < nr * K4; ++t) {
        __m512i a, b;
        int4_pairs(wp + (p0 * K4 + t) * 32, a, b);
        _mm512_storeu_si512(widened.data() + t * 64, a);
        _mm512_storeu_si512(widened.data() + t * 64 + 32, b);
      }
      scratch.group = g;
    }
    int4_rows<true>(rows, nr, x0, xs, widened.data(), K4, G, tpg, 0, n - p0 * 16, o0 + p0 * 16, n,
                    szp + 2 * p0 * 16, 2 * n, xsum0, bp ? bp + p0 * 16 : nullptr);
  });
  return out;
#else
  (void)M; (void)K4; (void)G; (void)tpg; (void)group; (void)bp;
  TORCH_CHECK(false, "int4_linear: this build has no AVX512-BF16 (see has_bf16_linear)");
#endif
}

#if defined(__AVX512F__)
// The float32 twin of bf16_tile: panels (N_pad / 16, K, 16), one k per FMA.
template <int MR, int NR, class PF>
inline void f32_tile(const float* __restrict x, int64_t xs, const float* __restrict w, int64_t K, int64_t p0,
                     int64_t N, float* __restrict out, int64_t os, const float* __restrict bias, PF& pf) {
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  const float* panel[NR];
  for (int j = 0; j < NR; ++j) panel[j] = w + (p0 + j) * K * 16;
  for (int64_t k = 0; k < K; ++k) {
    pf.step();
    __m512 b[NR];
    for (int j = 0; j < NR; ++j) b[j] = _mm512_loadu_ps(panel[j] + k * 16);
    for (int i = 0; i < MR; ++i) {
      const __m512 a = _mm512_set1_ps(x[i * xs + k]);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_fmadd_ps(a, b[j], acc[i][j]);
    }
  }
  for (int j = 0; j < NR; ++j) {
    const int64_t n0 = (p0 + j) * 16;
    const int64_t valid = std::min<int64_t>(16, N - n0);
    const __mmask16 mask = valid == 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << valid) - 1);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
    for (int i = 0; i < MR; ++i) _mm512_mask_storeu_ps(out + i * os + n0, mask, _mm512_add_ps(acc[i][j], bv));
  }
}

template <int MR, class PF>
void f32_tile_nr(int nr, const float* x, int64_t xs, const float* w, int64_t K, int64_t p0, int64_t N, float* out,
                 int64_t os, const float* bias, PF& pf) {
  switch (nr) {
    case 4: f32_tile<MR, 4, PF>(x, xs, w, K, p0, N, out, os, bias, pf); break;
    case 3: f32_tile<MR, 3, PF>(x, xs, w, K, p0, N, out, os, bias, pf); break;
    case 2: f32_tile<MR, 2, PF>(x, xs, w, K, p0, N, out, os, bias, pf); break;
    default: f32_tile<MR, 1, PF>(x, xs, w, K, p0, N, out, os, bias, pf); break;
  }
}

// Rows [0, M) of panels p0 .. p0 + nr - 1, kRowsPerTile rows per tile.
template <class PF>
void f32_rows(int64_t M, int nr, const float* xp, int64_t xs, const float* w, int64_t K, int64_t p0, int64_t n,
              float* op, const float* bias, PF& pf) {
  for_row_tiles(M, [&](auto mr, int64_t m) {
    f32_tile_nr<decltype(mr)::value, PF>(nr, xp + m * xs, xs, w, K, p0, n, op + m * n, n, bias, pf);
  });
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
#define LORAPLEX_F32_AVX2 1
// The AVX2 twin, also over int8 panels (N_pad / 16, K, 16) widened to fp32 in registers (int8_linear with
// float32 x, per-column scales applied once at the end; built on AVX-512 machines too): a 16-column panel is
// two 8-lane halves, so a tile of MR rows x NR panels holds 2 MR NR accumulators; the shapes below keep
// them, the weights and the broadcast within 16 ymm registers.
inline __m256 load8_weights(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8_weights(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

template <int MR, int NR, class W>
inline void f32_tile_avx2(const float* __restrict x, int64_t xs, const W* __restrict w, int64_t K, int64_t p0,
                          int64_t N, float* __restrict out, int64_t os, const float* __restrict scale,
                          const float* __restrict bias) {
  __m256 acc[MR][2 * NR];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < 2 * NR; ++j) acc[i][j] = _mm256_setzero_ps();
  const W* panel[NR];
  for (int j = 0; j < NR; ++j) panel[j] = w + (p0 + j) * K * 16;
  for (int64_t k = 0; k < K; ++k) {
    __m256 b[2 * NR];
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) {
      b[2 * j] = load8_weights(panel[j] + k * 16);
      b[2 * j + 1] = load8_weights(panel[j] + k * 16 + 8);
    }
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m256 a = _mm256_broadcast_ss(x + i * xs + k);
#pragma GCC unroll 8
      for (int j = 0; j < 2 * NR; ++j) acc[i][j] = _mm256_fmadd_ps(a, b[j], acc[i][j]);
    }
  }
#pragma GCC unroll 8
  for (int j = 0; j < 2 * NR; ++j) {
    const int64_t c0 = (p0 + j / 2) * 16 + 8 * (j % 2);
    const int valid = static_cast<int>(std::min<int64_t>(8, N - c0));
    if (valid <= 0) continue;
    alignas(32) float bb[8] = {0, 0, 0, 0, 0, 0, 0, 0}, sb[8] = {1, 1, 1, 1, 1, 1, 1, 1};
    for (int c = 0; c < valid; ++c) {
      if (bias) bb[c] = bias[c0 + c];
      if (scale) sb[c] = scale[c0 + c];
    }
    const __m256 bv = _mm256_load_ps(bb), sv = _mm256_load_ps(sb);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      store8(out + i * os + c0, _mm256_fmadd_ps(acc[i][j], sv, bv), valid);
    }
  }
}

// Rows [0, mr) of panels p0 .. p0 + nr - 1: 1 row x up to 4 panels, 2-3 rows x 2, 4-6 rows x 1 (at 6 rows
// a k step loads 64 bytes for 12 FMAs: the panel group comes from L2 once per 6 rows of a long prompt).
template <int MR, class W>
void f32_rows_avx2(int nr, const float* x, int64_t xs, const W* w, int64_t K, int64_t p0, int64_t N, float* out,
                   int64_t os, const float* scale, const float* bias) {
  constexpr int kMaxNr = MR == 1 ? 4 : (MR <= 3 ? 2 : 1);
  for (int p = 0; p < nr; p += kMaxNr) {
    switch (std::min(kMaxNr, nr - p)) {
      case 4: f32_tile_avx2<MR, (kMaxNr >= 4 ? 4 : 1), W>(x, xs, w, K, p0 + p, N, out, os, scale, bias); break;
      case 3: f32_tile_avx2<MR, (kMaxNr >= 3 ? 3 : 1), W>(x, xs, w, K, p0 + p, N, out, os, scale, bias); break;
      case 2: f32_tile_avx2<MR, (kMaxNr >= 2 ? 2 : 1), W>(x, xs, w, K, p0 + p, N, out, os, scale, bias); break;
      default: f32_tile_avx2<MR, 1, W>(x, xs, w, K, p0 + p, N, out, os, scale, bias); break;
    }
  }
}

// y = x @ (W * scale).T + bias over fp32 or int8 panels (P, K, 16), float32 x.
template <class W>
void f32_linear_avx2(const float* xp, int64_t xs, int64_t M, const W* wp, int64_t K, int64_t panels, int64_t n,
                     const float* scale, const float* bp, float* op) {
  parallel_stealing((panels + kPanelsPerTile - 1) / kPanelsPerTile, [&](int64_t g, int64_t) {
    const int64_t p0 = g * kPanelsPerTile;
    const int nr = static_cast<int>(std::min<int64_t>(kPanelsPerTile, panels - p0));
    for_row_tiles(M, [&](auto mr, int64_t m) {
      f32_rows_avx2<decltype(mr)::value, W>(nr, xp + m * xs, xs, wp, K, p0, n, op + m * n, n, scale, bp);
    });
  });
}
#endif

bool has_f32_linear() {
#if defined(__AVX512F__) || defined(LORAPLEX_F32_AVX2)
  return true;
#else
  return false;
#endif
}

at::Tensor f32_linear(const at::Tensor& x, const at::Tensor& w, int64_t n, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kFloat,
              "f32_linear: x (M, K) float32, rows contiguous");
  TORCH_CHECK(w.dim() == 3 && w.is_contiguous() && w.size(2) == 16 && w.scalar_type() == at::kFloat &&
                  w.size(1) == x.size(1) && w.size(0) * 16 >= n,
              "f32_linear: w must be packed for this K and N");
  const float* bp = bias_ptr(bias, n, "f32_linear");
  const int64_t M = x.size(0), K = w.size(1), panels = w.size(0), xs = x.stride(0);
  at::Tensor out = at::empty({M, n}, x.options());
#if defined(__AVX512F__)
  if (M == 0) return out;
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  // One or two rows stay on the tiles' groups of 4 panels: in runs of 8 (parallel_stream) the 30 layers'
  // batch-1 step ran 10.47-10.84 ms against 10.27-10.49 (Zen 4, alternated in one process); the fp32 weights
  // already stream at ~41 GB/s there.
  const int64_t panel_bytes = K * 64, tiles = (M + kRowsPerTile - 1) / kRowsPerTile;
  const PanelItems items(M, panels);
  parallel_stealing(items.count(), [&](int64_t it, int64_t next) {
    const int64_t p0 = items.group(it) * kPanelsPerTile, m0 = items.row0(it), rows = items.rows(it, M);
    const int nr = static_cast<int>(std::min<int64_t>(kPanelsPerTile, panels - p0));
    // as panel_linear_bf16: the next group of this thread's panels fetched while several tiles compute this one
    if (tiles == 1) {
      NoPrefetch none;
      f32_rows(rows, nr, xp + m0 * xs, xs, wp, K, p0, n, op + m0 * n, bp, none);
      return;
    }
    Prefetcher pf = next_group_fetch(wp, items.fetch(it, next), panels, panel_bytes,
                                     (rows + kRowsPerTile - 1) / kRowsPerTile * K);
    f32_rows(rows, nr, xp + m0 * xs, xs, wp, K, p0, n, op + m0 * n, bp, pf);
  });
  return out;
#elif defined(LORAPLEX_F32_AVX2)
  if (M == 0) return out;
  f32_linear_avx2(x.data_ptr<float>(), xs, M, w.data_ptr<float>(), K, panels, n, nullptr, bp, out.data_ptr<float>());
  return out;
#else
  (void)bp; (void)M; (void)K; (void)panels; (void)xs;
  TORCH_CHECK(false, "f32_linear: this build has neither AVX-512 nor AVX2 (see has_f32_linear)");
#endif
}

bool has_int8_linear_f32() {
#if defined(LORAPLEX_F32_AVX2)
  return true;
#else
  return false;
#endif
}

// int8 weight-only with float32 x: int8 panels (P, K, 16) widened to fp32 in registers (AVX2 builds).
at::Tensor int8_linear_f32(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales,
                           const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "int8_linear: x (M, K) float32, rows contiguous");
  const int64_t n = scales.numel(), M = x.size(0), K = x.size(1);
  TORCH_CHECK(w.dim() == 3 && w.is_contiguous() && w.size(2) == 16 && w.scalar_type() == at::kChar && w.size(1) == K &&
                  w.size(0) * 16 >= n && w.size(0) * 16 < n + 16,
              "int8_linear: float32 x needs int8 panels (P, K, 16) for this K and N");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous(), "int8_linear: scales (N,) float32");
  const float* bp = bias_ptr(bias, n, "int8_linear");
  at::Tensor out = at::empty({M, n}, x.options());
#if defined(LORAPLEX_F32_AVX2)
  if (M == 0) return out;
  f32_linear_avx2(x.data_ptr<float>(), x.stride(0), M, w.data_ptr<int8_t>(), K, w.size(0), n,
                  scales.data_ptr<float>(), bp, out.data_ptr<float>());
  return out;
#else
  (void)bp;
  TORCH_CHECK(false, "int8_linear: this build has no AVX2 float32 kernel (see has_int8_linear_f32)");
#endif
}

// ---- int4_linear with float32 x (AVX2 builds) ---------------------------------------------------------------
// Single-k int4 panels (P, K / 2, 16) uint8: byte [p, t, j] = q[16 p + j, 2 t] | q[16 p + j, 2 t + 1] << 4 (q = 0
// past N), with the model's (G, N, 2) float32 scales and zeros. Each group sums x * q in fp32 (q = 0..15 as
// floats, exact), then y += s * that + (z - 8 s) * (the row's sum of x over the group): the weights
// (q - 8) s + z, group by group, without making each weight. Up to 4 rows widen the nibbles in registers (1-2
// rows two panels at a time); more rows widen each panel once into fp32 q (K x 16 floats) that tiles of up to 6
// rows read. The same operations in the same order either way, so a row's result does not depend on the rows
// computed beside it.
#if defined(LORAPLEX_F32_AVX2)
bool has_int4_linear_f32() { return true; }

// Group g's terms of columns n0 .. n0 + 15: s and z - 8 s, 8 columns a vector (zero past N).
inline void int4_group_terms(const float* sz, int64_t n, int64_t g, int64_t n0, __m256 s[2], __m256 z8[2]) {
  const float* p = sz + (g * n + n0) * 2;
  alignas(32) float part[32];
  if (n0 + 16 > n) {  // the last panel's columns past N: zero scale and zero
    std::fill(part, part + 32, 0.f);
    std::memcpy(part, p, static_cast<size_t>(n - n0) * 2 * sizeof(float));
    p = part;
  }
  for (int h = 0; h < 2; ++h) {  // (s, z) pairs of 8 columns -> s, z in column order
    const __m256 a = _mm256_loadu_ps(p + 16 * h), b = _mm256_loadu_ps(p + 16 * h + 8);
    s[h] = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0x88)), 0xD8));
    const __m256 z = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0xDD)), 0xD8));
    z8[h] = _mm256_fnmadd_ps(_mm256_set1_ps(8.f), s[h], z);  // 8 s is exact
  }
}

// One panel's terms, group by group, into out (G x 32 floats): s[16], then z - 8 s [16].
void int4_panel_terms(const float* sz, int64_t n, int64_t G, int64_t n0, float* out) {
  for (int64_t g = 0; g < G; ++g) {
    __m256 sv[2], zv[2];
    int4_group_terms(sz, n, g, n0, sv, zv);
    for (int h = 0; h < 2; ++h) {
      _mm256_storeu_ps(out + g * 32 + 8 * h, sv[h]);
      _mm256_storeu_ps(out + g * 32 + 16 + 8 * h, zv[h]);
    }
  }
}

// k pair t of a panel as fp32 q: w[0], w[1] = k 2t, columns 0-7 and 8-15; w[2], w[3] = k 2t + 1.
inline void int4_kpair_f32(const uint8_t* p, __m256 w[4]) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256i c0 = _mm256_cvtepu8_epi32(b), c1 = _mm256_cvtepu8_epi32(_mm_srli_si128(b, 8));
  const __m256i low = _mm256_set1_epi32(15);
  w[0] = _mm256_cvtepi32_ps(_mm256_and_si256(c0, low));
  w[1] = _mm256_cvtepi32_ps(_mm256_and_si256(c1, low));
  w[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(c0, 4));  // a byte >> 4 is its high nibble
  w[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(c1, 4));
}

// The group's terms into a row's running sums: y = s * acc + y, then (z - 8 s) * xsum + y.
inline __m256 int4_group_step(__m256 acc, __m256 s, __m256 z8, __m256 xg, __m256 y) {
  return _mm256_fmadd_ps(xg, z8, _mm256_fmadd_ps(acc, s, y));
}

// bias[c0 .. c0 + valid - 1] in 8 lanes (zero past valid, or all zero without a bias)
inline __m256 bias8(const float* bias, int64_t c0, int valid) {
  alignas(32) float bb[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int c = 0; bias && c < valid; ++c) bb[c] = bias[c0 + c];
  return _mm256_load_ps(bb);
}

// y (16 columns of each of MR rows, from n0) + bias into out, the columns below N.
template <int MR>
inline void int4_store(const float (*y)[16], int64_t n0, int64_t N, float* out, int64_t os, const float* bias) {
  for (int h = 0; h < 2; ++h) {
    const int64_t c0 = n0 + 8 * h;
    const int valid = static_cast<int>(std::min<int64_t>(8, N - c0));
    if (valid <= 0) break;
    const __m256 bv = bias8(bias, c0, valid);
    for (int i = 0; i < MR; ++i) store8(out + i * os + c0, _mm256_add_ps(_mm256_loadu_ps(y[i] + 8 * h), bv), valid);
  }
}

// MR rows (xs apart) x NR panels (from p0), running sums in y (in L1). src[j]: panel j's nibbles, widened here
// k pair by k pair, or (WIDE) its q already widened to fp32 (K x 16 floats, as int4_kpair_f32 makes them);
// terms: the panels' int4_panel_terms one after another, or nullptr to make each group's from sz here.
template <int MR, int NR, bool WIDE>
inline void int4_tile_f32(const float* __restrict x, int64_t xs, const float* __restrict xsum, const void* const* src,
                          const float* __restrict terms, const float* __restrict sz, int64_t K2, int64_t G, int64_t p0,
                          int64_t N, float* __restrict out, int64_t os, const float* __restrict bias) {
  const int64_t tpg = K2 / G;
  alignas(32) float y[NR][MR][16] = {};
  for (int64_t g = 0; g < G; ++g) {
    __m256 acc[MR][NR][2];
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) acc[i][j][0] = acc[i][j][1] = _mm256_setzero_ps();
    for (int64_t t = g * tpg; t < (g + 1) * tpg; ++t) {
#pragma GCC unroll 4
      for (int j = 0; j < NR; ++j) {
        __m256 w[4];
        if constexpr (!WIDE) int4_kpair_f32(static_cast<const uint8_t*>(src[j]) + t * 16, w);
#pragma GCC unroll 2
        for (int kk = 0; kk < 2; ++kk) {  // k = 2t, then 2t + 1: every accumulator sums k in order
          if constexpr (WIDE) {  // two vectors at a time: 6 rows keep 12 accumulators in registers
            const float* wf = static_cast<const float*>(src[j]) + t * 32 + 16 * kk;
            w[2 * kk] = _mm256_loadu_ps(wf);
            w[2 * kk + 1] = _mm256_loadu_ps(wf + 8);
          }
#pragma GCC unroll 8
          for (int i = 0; i < MR; ++i) {
            const __m256 a = _mm256_broadcast_ss(x + i * xs + 2 * t + kk);
            acc[i][j][0] = _mm256_fmadd_ps(a, w[2 * kk], acc[i][j][0]);
            acc[i][j][1] = _mm256_fmadd_ps(a, w[2 * kk + 1], acc[i][j][1]);
          }
        }
      }
    }
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) {
      __m256 sv[2], zv[2];
      if (terms != nullptr) {
        for (int h = 0; h < 2; ++h) {
          sv[h] = _mm256_loadu_ps(terms + (j * G + g) * 32 + 8 * h);
          zv[h] = _mm256_loadu_ps(terms + (j * G + g) * 32 + 16 + 8 * h);
        }
      } else {
        int4_group_terms(sz, N, g, (p0 + j) * 16, sv, zv);
      }
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
        const __m256 xg = _mm256_broadcast_ss(xsum + i * G + g);
        for (int h = 0; h < 2; ++h)
          _mm256_store_ps(y[j][i] + 8 * h, int4_group_step(acc[i][j][h], sv[h], zv[h], xg, _mm256_load_ps(y[j][i] + 8 * h)));
      }
    }
  }
  for (int j = 0; j < NR; ++j) int4_store<MR>(y[j], (p0 + j) * 16, N, out, os, bias);
}

at::Tensor int4_linear_f32(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale_zeros,
                           const std::optional<at::Tensor>& bias) {
  const int64_t M = x.size(0), K = x.size(1);
  const Int4Shape shape = int4_shape(x, w, scale_zeros, 2);
  const int64_t P = shape.P, K2 = shape.steps, n = shape.n, G = shape.G, group = K / G;
  TORCH_CHECK(group % 8 == 0, "int4_linear: float32 x needs groups of a multiple of 8 inputs");
  const float* bp = bias_ptr(bias, n, "int4_linear");
  at::Tensor out = at::empty({M, n}, x.options());
  if (M == 0) return out;
  const float* xp = x.data_ptr<float>();
  const int64_t xs = x.stride(0);
  const float* sz = scale_zeros.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  std::vector<float> xsum(static_cast<size_t>(M * G));  // each row's sum of x over each group
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      const float* row = xp + m * xs + g * group;
      __m256 acc = _mm256_setzero_ps();
      for (int64_t k = 0; k < group; k += 8) acc = _mm256_add_ps(acc, _mm256_loadu_ps(row + k));
      xsum[m * G + g] = hsum8(acc);
    }
  constexpr int64_t kPanels = 2;  // panels an item
  // up to 4 rows widen the nibbles in registers (gate/up, 2 threads: 3 rows 393 -> 301 us, 4 rows 419 -> 365
  // us against widening each panel into memory first)
  constexpr int64_t kDirectRows = 4;
  struct Scratch {
    std::vector<float> terms, wide;
  };
  parallel_stealing<Scratch>((P + kPanels - 1) / kPanels, [&](Scratch& scratch, int64_t item, int64_t) {
    const int64_t p0 = item * kPanels;
    const int nr = static_cast<int>(std::min<int64_t>(kPanels, P - p0));
    const void* panel[kPanels];
    for (int j = 0; j < nr; ++j) panel[j] = wp + (p0 + j) * K2 * 16;
    if (M <= kDirectRows) {  // widened in registers, the group terms made per group
      auto direct = [&](auto mr, auto panels, const void* const* src, int64_t first) {
        int4_tile_f32<decltype(mr)::value, decltype(panels)::value, false>(xp, xs, xsum.data(), src, nullptr, sz, K2, G,
                                                                           first, n, op, n, bp);
      };
      using One = std::integral_constant<int, 1>;
      using Two = std::integral_constant<int, 2>;
      if (M <= 2 && nr == 2) {  // both panels of the item at once
        M == 2 ? direct(Two{}, Two{}, panel, p0) : direct(One{}, Two{}, panel, p0);
        return;
      }
      for (int j = 0; j < nr; ++j) {  // one panel at a time: 4 rows keep 8 accumulators and 4 weight vectors
        switch (M) {
          case 1: direct(One{}, One{}, panel + j, p0 + j); break;
          case 2: direct(Two{}, One{}, panel + j, p0 + j); break;
          case 3: direct(std::integral_constant<int, 3>{}, One{}, panel + j, p0 + j); break;
          default: direct(std::integral_constant<int, 4>{}, One{}, panel + j, p0 + j); break;
        }
      }
      return;
    }
    // more rows: the panels' q once as fp32 (nr x K x 16) and their terms, then tiles over them: up to 3 rows x
    // both panels, 4-6 rows x one (the accumulators in 12 registers)
    scratch.terms.resize(static_cast<size_t>(kPanels * G * 32));
    scratch.wide.resize(static_cast<size_t>(kPanels * K * 16));
    const void* wide[kPanels];
    for (int j = 0; j < nr; ++j) {
      float* dst = scratch.wide.data() + j * K * 16;
      for (int64_t t = 0; t < K2; ++t) {
        __m256 wv[4];
        int4_kpair_f32(static_cast<const uint8_t*>(panel[j]) + t * 16, wv);
        for (int u = 0; u < 4; ++u) _mm256_storeu_ps(dst + 32 * t + 8 * u, wv[u]);
      }
      wide[j] = dst;
      int4_panel_terms(sz, n, G, (p0 + j) * 16, scratch.terms.data() + j * G * 32);
    }
    const float* terms = scratch.terms.data();
    for_row_tiles(M, [&](auto mr, int64_t m) {
      constexpr int MR = decltype(mr)::value;
      const float* xm = xp + m * xs;
      const float* sm = xsum.data() + m * G;
      float* om = op + m * n;
      if constexpr (MR <= 3) {
        if (nr == 2) {
          int4_tile_f32<MR, 2, true>(xm, xs, sm, wide, terms, sz, K2, G, p0, n, om, n, bp);
          return;
        }
      }
      for (int j = 0; j < nr; ++j)
        int4_tile_f32<MR, 1, true>(xm, xs, sm, wide + j, terms + j * G * 32, sz, K2, G, p0 + j, n, om, n, bp);
    });
  });
  return out;
}

// ---- w4a8_linear -------------------------------------------------------------------------------------------
// int4 group-wise weights, W[n, k] = (q - 8) s + z as int4_linear's, times the activations rounded to int8 per
// row at the call, x ~ qx sx as w8a8_linear's (kernels.quant_weights.Int4Weight with int8 activations). Quads:
// (P, K / 16, 4, 32) uint8, byte e of [p, b, t] holds q[16 p + e / 4, 16 b + 4 t + e % 4] (low nibble) and
// q[16 p + 8 + e / 4, the same k] (high): one 32-byte load is 16 columns x 4 k, 8 columns a nibble. Their
// scales and zeros are panel-major, (P, G, 2, 16): a panel's s and z of every group in one block, read as a
// stream beside its quads (kernels.quant_cpu.pack_quads_scale_zeros).
// VPMADDUBSW multiplies q (the unsigned operand, 0..15) by qx (signed): a pair of products is at most
// 2 * 15 * 127 = 3810, so 32 k (eight of them) add up in int16 without saturating (8 * 3810 < 2^15) before
// one VPMADDWD widens them (on Zen 1 both issue on one port, once per 2 cycles, and the integer adds and
// conversions issue beside them). The int32 sums of a group are exact whatever order they are added in; each
// group then goes y += s * sum and y += (z - 8 s) * (the row's sum of qx over the group) in fp32, group after
// group, and y * sx + bias is stored. Two kernels compute that, bit for bit the same: w4a8_half below
// kWideRows rows (each 16 k of a panel unpacked in registers, one half panel at a time) and w4a8_wide from
// there (a panel's nibbles unpacked once into a scratch both halves read, each broadcast of qx multiplied by
// both); so a row's result does not depend on the rows computed beside it, nor on how many there are.
bool has_w4a8_linear() { return true; }

// Group g's s and z - 8 s for columns 8 h .. 8 h + 7 of one panel's panel-major terms (bf16 widened exactly).
template <class S>
inline void w4a8_group_terms(const S* sz, int64_t g, int h, __m256& s, __m256& z8) {
  s = load8_f32(sz + g * 32 + 8 * h);
  z8 = _mm256_fnmadd_ps(_mm256_set1_ps(8.f), s, load8_f32(sz + g * 32 + 16 + 8 * h));
}

// A group's fp32 step, the one both kernels take: y += s * sum, then y += (z - 8 s) * xsum (the row's sum of qx
// over the group).
inline __m256 w4a8_group_step(__m256 y, __m256i sum, __m256 s, __m256 z8, const float* xsum) {
  return _mm256_fmadd_ps(z8, _mm256_broadcast_ss(xsum), _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), s, y));
}

// Columns 8 H .. 8 H + 7 of one panel for MR rows of qx: out[i] as above, before sx. xq: the MR rows interleaved
// by 16 k (w4a8_run), so one pointer walks them.
template <int MR, int H, class S>
inline void w4a8_half(const int8_t* __restrict xq, int64_t K, const float* __restrict xsum, int64_t G,
                      const uint8_t* __restrict panel, const S* __restrict sz, __m256* __restrict out) {
  const int64_t blocks = K / G / 16;  // of 16 k a group
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 y[MR];
#pragma GCC unroll 4
  for (int i = 0; i < MR; ++i) y[i] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m256i sum[MR];  // the group's exact int32 sums
#pragma GCC unroll 4
    for (int i = 0; i < MR; ++i) sum[i] = _mm256_setzero_si256();
    for (int64_t b = g * blocks; b < (g + 1) * blocks; ++b) {
      // the block's 16 k widened once, then row by row, so one row's products are live at a time (all rows' at
      // once, GCC reassociated the sums into trees and kept the accumulators on the stack: 20 % slower)
      __m256i q[4];
#pragma GCC unroll 4
      for (int t = 0; t < 4; ++t) {
        q[t] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + (4 * b + t) * 32));
        if constexpr (H == 1) q[t] = _mm256_srli_epi16(q[t], 4);
        q[t] = _mm256_and_si256(q[t], low);
      }
#pragma GCC unroll 4
      for (int i = 0; i < MR; ++i) {
        // the row's 4 quads of qx, each broadcast straight from memory (a load, no shuffle)
        const float* quads = reinterpret_cast<const float*>(xq + (b * MR + i) * 16);
        __m256i pairs = _mm256_maddubs_epi16(q[0], _mm256_castps_si256(_mm256_broadcast_ss(quads)));
#pragma GCC unroll 3
        for (int t = 1; t < 4; ++t)
          pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(q[t], _mm256_castps_si256(_mm256_broadcast_ss(quads + t))));
        sum[i] = _mm256_add_epi32(sum[i], _mm256_madd_epi16(pairs, ones));
      }
    }
    __m256 s, z8;
    w4a8_group_terms(sz, g, H, s, z8);
#pragma GCC unroll 4
    for (int i = 0; i < MR; ++i) y[i] = w4a8_group_step(y[i], sum[i], s, z8, xsum + i * G + g);
  }
#pragma GCC unroll 4
  for (int i = 0; i < MR; ++i) out[i] = y[i];
}

// Both halves of one panel for MR rows of qx over groups [g0, g1), from `un`: the panel's nibbles of those groups
// unpacked, 32-byte vectors [k / 4][half] (w4a8_run). Each broadcast of qx multiplies the two halves' vectors;
// 32 k add up in int16 before they widen. y: the rows' 16 accumulators (y[i * 16 + c]), updated in place.
template <int MR, class S>
inline void w4a8_wide(const int8_t* __restrict xq, const float* __restrict xsum, int64_t G, int64_t g0, int64_t g1,
                      int64_t group, const uint8_t* __restrict un, const S* __restrict sz, float* __restrict y) {
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t steps = group / 32;
  for (int64_t g = g0; g < g1; ++g) {
    __m256i sum[2][MR];
#pragma GCC unroll 4
    for (int i = 0; i < MR; ++i) sum[0][i] = sum[1][i] = _mm256_setzero_si256();
    for (int64_t c = (g - g0) * steps; c < (g - g0 + 1) * steps; ++c) {  // 32 k: two blocks of 16
      const __m256i* w = reinterpret_cast<const __m256i*>(un + c * 512);
#pragma GCC unroll 4
      for (int i = 0; i < MR; ++i) {
        __m256i p0 = _mm256_setzero_si256(), p1 = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int t = 0; t < 8; ++t) {
          const float* quad = reinterpret_cast<const float*>(xq + ((2 * c + t / 4) * MR + i) * 16) + t % 4;
          const __m256i xb = _mm256_castps_si256(_mm256_broadcast_ss(quad));
          p0 = _mm256_add_epi16(p0, _mm256_maddubs_epi16(_mm256_load_si256(w + 2 * t), xb));
          p1 = _mm256_add_epi16(p1, _mm256_maddubs_epi16(_mm256_load_si256(w + 2 * t + 1), xb));
        }
        sum[0][i] = _mm256_add_epi32(sum[0][i], _mm256_madd_epi16(p0, ones));
        sum[1][i] = _mm256_add_epi32(sum[1][i], _mm256_madd_epi16(p1, ones));
      }
    }
    for (int h = 0; h < 2; ++h) {  // y stays in memory meanwhile: the group's sums take the registers
      __m256 s, z8;
      w4a8_group_terms(sz, g, h, s, z8);
#pragma GCC unroll 4
      for (int i = 0; i < MR; ++i)
        _mm256_storeu_ps(y + i * 16 + 8 * h,
                         w4a8_group_step(_mm256_loadu_ps(y + i * 16 + 8 * h), sum[h][i], s, z8, xsum + i * G + g));
    }
  }
}

// MR rows x one panel (from column n0), stored as y * sx + bias below N.
template <int MR, class T>
inline void w4a8_tile(const int8_t* xq, int64_t K, const float* xsum, int64_t G, const float* sx, const uint8_t* panel,
                      const T* sz, int64_t n0, int64_t N, T* out, const float* bias) {
  __m256 y[2][MR];
  w4a8_half<MR, 0>(xq, K, xsum, G, panel, sz, y[0]);
  w4a8_half<MR, 1>(xq, K, xsum, G, panel, sz, y[1]);
  for (int h = 0; h < 2; ++h) {
    const int64_t c0 = n0 + 8 * h;
    const int valid = static_cast<int>(std::min<int64_t>(8, N - c0));
    if (valid <= 0) break;
    const __m256 bv = bias8(bias, c0, valid);
    for (int i = 0; i < MR; ++i)
      store8(out + i * N + c0, _mm256_fmadd_ps(y[h][i], _mm256_set1_ps(sx[i]), bv), valid);
  }
}

// AVX512-VNNI (where the CPU has it): the same products by VPDPBUSD, q (0..15, the unsigned operand) times qx
// (signed) summed 4 k at a time straight into int32, one instruction for the four above (VPMADDUBSW, the int16
// add, VPMADDWD, the int32 add) and 16 columns a vector: a 32-byte load of 4 k is broadcast to both halves of
// a register, the upper half shifted down a nibble, so its 16 lanes are the panel's 16 columns in order. The
// int32 sums are exact either way and each group's fp32 steps are w4a8_group_step's, in the same order, so it
// gives the AVX2 kernels' results to the bit (set_w4a8_vnni(false) runs those, for the tests and A/B runs).
#if defined(LORAPLEX_W8A8_VNNI) && defined(__AVX512VL__)
#define LORAPLEX_W4A8_VNNI 1
std::atomic<bool> w4a8_vnni_wanted{true};

// A panel's group g of 16 columns for MR rows of qx (row-major, stride K): y[i] += s * sum + (z - 8 s) * xsum.
// Below 4 rows two sums a row alternate by 4 k, so that two products are in flight per row.
template <int MR, class S>
inline void w4a8_vnni_groups(const int8_t* __restrict xq, int64_t K, const float* __restrict xsum, int64_t G,
                             int64_t group, const uint8_t* __restrict panel, const S* __restrict sz, __m512* y) {
  constexpr int A = MR < 4 ? 2 : 1;
  const __m512i low = _mm512_set1_epi8(0x0F);
  const __m512i shift = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
  for (int64_t g = 0; g < G; ++g) {
    v16si sum[A][MR];
    for (int a = 0; a < A; ++a)
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) sum[a][i] = (v16si)_mm512_setzero_si512();
    for (int64_t j = g * group / 4; j < (g + 1) * group / 4; j += A) {  // vector j: 4 k x 16 columns
#pragma GCC unroll 2
      for (int a = 0; a < A; ++a) {
        const __m512i both = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + (j + a) * 32)));
        const v16si q = (v16si)_mm512_and_si512(_mm512_srlv_epi16(both, shift), low);
#pragma GCC unroll 8
        for (int i = 0; i < MR; ++i) {
          int32_t quad;
          std::memcpy(&quad, xq + i * K + 4 * (j + a), sizeof quad);
          sum[a][i] = __builtin_ia32_vpdpbusd_v16si(sum[a][i], q, (v16si)_mm512_set1_epi32(quad));
        }
      }
    }
    const __m512 s = load16(sz + g * 32);
    const __m512 z8 = _mm512_fnmadd_ps(_mm512_set1_ps(8.f), s, load16(sz + g * 32 + 16));
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      __m512i total = (__m512i)sum[0][i];
      if constexpr (A == 2) total = _mm512_add_epi32(total, (__m512i)sum[1][i]);
      y[i] = _mm512_fmadd_ps(z8, _mm512_set1_ps(xsum[i * G + g]), _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), s, y[i]));
    }
  }
}

// MR rows x one panel (from column n0), stored as y * sx + bias below N.
template <int MR, class T>
inline void w4a8_vnni_tile(const int8_t* xq, int64_t K, const float* xsum, int64_t G, int64_t group, const float* sx,
                           const uint8_t* panel, const T* sz, int64_t n0, int64_t N, T* out, const float* bias) {
  __m512 y[MR];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) y[i] = _mm512_setzero_ps();
  w4a8_vnni_groups<MR>(xq, K, xsum, G, group, panel, sz, y);
  const int64_t valid = std::min<int64_t>(16, N - n0);
  const __mmask16 mask = first_lanes(valid);
  const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
  for (int i = 0; i < MR; ++i) store16m(out + i * N + n0, _mm512_fmadd_ps(y[i], _mm512_set1_ps(sx[i]), bv), mask);
}

// Every panel (threads steal panels) x every row, 8 rows a tile: a panel's quads (K / 2 bytes) stay in L1 while
// the row tiles pass.
template <class T>
void w4a8_run_vnni(const RowsI8& rows, const float* xsum, int64_t M, int64_t K, const uint8_t* wp, int64_t P,
                   int64_t n, const T* sz, int64_t G, const float* bias, T* op) {
  constexpr int64_t kRows = 8;
  const int64_t group = K / G;
  parallel_stealing(P, [&](int64_t p, int64_t) {
    const uint8_t* panel = wp + p * K * 8;
    const T* psz = sz + p * G * 32;
    for (int64_t m = 0; m < M; m += kRows) {
      const int8_t* xq = rows.q.data() + m * K;
      const float* xm = xsum + m * G;
      const float* sx = rows.scale.data() + m;
      T* om = op + m * n;
      as_constant<kRows>(M - m, [&](auto mr) {
        w4a8_vnni_tile<decltype(mr)::value>(xq, K, xm, G, group, sx, panel, psz, p * 16, n, om, bias);
      });
    }
  });
}
#endif

template <class T>
void w4a8_run(const T* xp, int64_t xs, int64_t M, int64_t K, const uint8_t* wp, int64_t P, int64_t n, const T* sz,
              int64_t G, const float* bias, T* op) {
  // the calling thread's buffers, kept from call to call (they only grow): a batch-1 step makes ~120 of these
  // calls, and their allocations showed in its profile
  struct Buffers {
    RowsI8 rows;
    std::vector<int8_t> tiles;
    std::vector<float> xsum;
  };
  thread_local Buffers buffers;
  RowsI8& rows = buffers.rows;
  round_rows_i8_avx2(xp, xs, M, K, rows);
  const int64_t group = K / G;
  std::vector<float>& xsum = buffers.xsum;  // each row's sum of qx over each group (exact)
  xsum.resize(static_cast<size_t>(M * G));
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    const __m256i ones8 = _mm256_set1_epi8(1), ones16 = _mm256_set1_epi16(1);
    for (int64_t m = begin; m < end; ++m)
      for (int64_t g = 0; g < G; ++g) {
        const int8_t* row = rows.q.data() + m * K + g * group;
        __m256i acc = _mm256_setzero_si256();
        for (int64_t k = 0; k < group; k += 32) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + k));
          acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, v), ones16));
        }
        alignas(32) int32_t lanes[8];
        _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), acc);
        int32_t total = 0;
        for (int32_t v : lanes) total += v;
        xsum[m * G + g] = static_cast<float>(total);
      }
  });
#if defined(LORAPLEX_W4A8_VNNI)
  if (w4a8_vnni_wanted.load(std::memory_order_relaxed)) {
    w4a8_run_vnni(rows, xsum.data(), M, K, wp, P, n, sz, G, bias, op);
    return;
  }
#endif
  constexpr int64_t kRows = 4;  // rows a tile: w4a8_half's 4 fp32 accumulators, 4 int32 sums and a block's 4 q
  // from here w4a8_wide: measured on Zen 1 (2 threads, the bench model's projections), 4 rows ran 0.92-0.97x
  // w4a8_half's speed, 8 rows 0.99-1.03x, 32 rows 1.08-1.12x, 512 rows 1.12-1.18x (docs/benchmarks.md)
  constexpr int64_t kWideRows = 8;
  // each tile's rows interleaved by 16 k: [k / 16][row][16], so a tile reads its rows through one pointer (with a
  // pointer per row the block loop ran out of general registers and reloaded them from the stack)
  std::vector<int8_t>& tiles = buffers.tiles;
  tiles.resize(static_cast<size_t>(M * K));
  at::parallel_for(0, (M + kRows - 1) / kRows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t tile = begin; tile < end; ++tile) {
      const int64_t m0 = tile * kRows, mr = std::min(kRows, M - m0);
      for (int64_t b = 0; b < K / 16; ++b)
        for (int64_t i = 0; i < mr; ++i)
          std::memcpy(tiles.data() + m0 * K + (b * mr + i) * 16, rows.q.data() + (m0 + i) * K + 16 * b, 16);
    }
  });
  if (M < kWideRows) {
    parallel_stealing(P, [&](int64_t p, int64_t) {
      const uint8_t* panel = wp + p * K * 8;
      const T* psz = sz + p * G * 32;  // the panel's scales and zeros, next to each other (a stream, as its quads)
      for (int64_t m = 0; m < M; m += kRows) {
        const int8_t* xq = tiles.data() + m * K;
        const float* xm = xsum.data() + m * G;
        const float* sx = rows.scale.data() + m;
        T* om = op + m * n;
        switch (std::min<int64_t>(kRows, M - m)) {
          case 4: w4a8_tile<4>(xq, K, xm, G, sx, panel, psz, p * 16, n, om, bias); break;
          case 3: w4a8_tile<3>(xq, K, xm, G, sx, panel, psz, p * 16, n, om, bias); break;
          case 2: w4a8_tile<2>(xq, K, xm, G, sx, panel, psz, p * 16, n, om, bias); break;
          default: w4a8_tile<1>(xq, K, xm, G, sx, panel, psz, p * 16, n, om, bias); break;
        }
      }
    });
    return;
  }
  // kWideRows and more: each panel's nibbles unpacked into a per-thread scratch, a chunk of groups at a time (1024
  // k of both halves are 16 KB: kept in L1), for a block of up to 64 rows whose every tile then reads them; the
  // block's accumulators (4 KB) live in a per-thread buffer across the chunks
  constexpr int64_t kBlockRows = 64;
  const int64_t chunk_groups = std::max<int64_t>(1, 1024 / group);
  parallel_stealing(P, [&](int64_t p, int64_t) {
    struct Scratch {
      std::vector<__m256i> un;  // [k / 4][half]
      std::vector<float> y;  // (rows, 16)
    };
    thread_local Scratch scratch;
    scratch.un.resize(static_cast<size_t>(std::min(G, chunk_groups) * group / 2));
    const uint8_t* panel = wp + p * K * 8;
    const T* psz = sz + p * G * 32;
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int64_t mb = 0; mb < M; mb += kBlockRows) {
      const int64_t me = std::min(M, mb + kBlockRows);
      scratch.y.assign(static_cast<size_t>((me - mb) * 16), 0.f);
      for (int64_t g0 = 0; g0 < G; g0 += chunk_groups) {
        const int64_t g1 = std::min(G, g0 + chunk_groups), k0 = g0 * group, k1 = g1 * group;
        for (int64_t j = k0 / 4; j < k1 / 4; ++j) {  // vector j: 4 k x 8 columns a nibble
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + j * 32));
          scratch.un[2 * (j - k0 / 4)] = _mm256_and_si256(v, low);
          scratch.un[2 * (j - k0 / 4) + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        }
        const uint8_t* un = reinterpret_cast<const uint8_t*>(scratch.un.data());
        for (int64_t m = mb; m < me; m += kRows) {
          const int64_t mr = std::min<int64_t>(kRows, M - m);
          const int8_t* xq = tiles.data() + m * K + k0 * mr;  // the tile's rows interleaved by 16 k, from k0
          const float* xm = xsum.data() + m * G;
          float* y = scratch.y.data() + (m - mb) * 16;
          switch (mr) {
            case 4: w4a8_wide<4>(xq, xm, G, g0, g1, group, un, psz, y); break;
            case 3: w4a8_wide<3>(xq, xm, G, g0, g1, group, un, psz, y); break;
            case 2: w4a8_wide<2>(xq, xm, G, g0, g1, group, un, psz, y); break;
            default: w4a8_wide<1>(xq, xm, G, g0, g1, group, un, psz, y); break;
          }
        }
      }
      for (int h = 0; h < 2; ++h) {  // y * sx + bias below N, as w4a8_tile stores
        const int64_t c0 = p * 16 + 8 * h;
        const int valid = static_cast<int>(std::min<int64_t>(8, n - c0));
        if (valid <= 0) break;
        const __m256 bv = bias8(bias, c0, valid);
        for (int64_t i = mb; i < me; ++i)
          store8(op + i * n + c0, _mm256_fmadd_ps(_mm256_loadu_ps(scratch.y.data() + (i - mb) * 16 + 8 * h),
                                                   _mm256_set1_ps(rows.scale[i]), bv), valid);
      }
    }
  });
}

at::Tensor w4a8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale_zeros, int64_t n,
                       const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "w4a8_linear: x (M, K) bfloat16 or float32, rows contiguous");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(w.dim() == 4 && w.is_contiguous() && w.scalar_type() == at::kByte && w.size(2) == 4 && w.size(3) == 32 &&
                  w.size(1) * 16 == K,
              "w4a8_linear: w must be int4 quads (P, K / 16, 4, 32) for this x");
  const int64_t P = w.size(0);
  TORCH_CHECK(scale_zeros.dim() == 4 && scale_zeros.is_contiguous() && scale_zeros.scalar_type() == x.scalar_type() &&
                  scale_zeros.size(0) == P && scale_zeros.size(2) == 2 && scale_zeros.size(3) == 16 &&
                  scale_zeros.size(1) > 0 && K % (32 * scale_zeros.size(1)) == 0,
              "w4a8_linear: scale_zeros (P, G, 2, 16) in x's dtype, groups of a multiple of 32 inputs");
  const int64_t G = scale_zeros.size(1);
  TORCH_CHECK(P * 16 >= n && P * 16 < n + 16, "w4a8_linear: the quads do not hold N columns");
  const float* bp = bias_ptr(bias, n, "w4a8_linear");
  at::Tensor out = at::empty({M, n}, x.options());
  if (M == 0) return out;
  if (x.scalar_type() == at::kFloat)
    w4a8_run(x.data_ptr<float>(), x.stride(0), M, K, w.data_ptr<uint8_t>(), P, n, scale_zeros.data_ptr<float>(), G, bp,
             out.data_ptr<float>());
  else
    w4a8_run(x.data_ptr<bf16>(), x.stride(0), M, K, w.data_ptr<uint8_t>(), P, n, scale_zeros.data_ptr<bf16>(), G, bp,
             out.data_ptr<bf16>());
  return out;
}
#else
bool has_int4_linear_f32() { return false; }
bool has_w4a8_linear() { return false; }
at::Tensor w4a8_linear(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, const std::optional<at::Tensor>&) {
  TORCH_CHECK(false, "w4a8_linear: this build has no AVX2 kernel (see has_w4a8_linear)");
  return at::Tensor();
}
#endif

// Turn w4a8_linear's AVX512-VNNI kernel on or off for this process (off: the AVX2 kernels); returns whether it
// runs now (on, and built: an AVX512-VNNI CPU).
bool set_w4a8_vnni(bool enable) {
#if defined(LORAPLEX_W4A8_VNNI)
  w4a8_vnni_wanted.store(enable);
  return enable;
#else
  (void)enable;
  return false;
#endif
}

// ---- layer_forward -----------------------------------------------------------------------------------------
// One decoder layer of a step: the ops above in the model's order (engine/models/llama.py), LoRA adds
// included, called from here instead of from Python, so a step pays one Python call per layer instead of nine
// (thirteen with adapters): a batch-1 decode step's dispatch, and a 512-token prefill's ~10 % of single-threaded
// Python between its parallel ops. Projections are panels: float32 (3-d), bf16
// or int8 with bf16 scales (4-d); `ns` their output widths (qkv, o, gate_up, down). Updates the residual
// `x` in place, writes the layer's keys and values, and returns the next sublayer's normed input.
at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& scales, int64_t n,
                        const std::optional<at::Tensor>& bias) {
  if (w.scalar_type() == at::kChar) {
    TORCH_CHECK(scales.has_value(), "layer_forward: an int8 projection needs its scales");
    return int8_linear(x, w, *scales, bias);
  }
  if (w.scalar_type() == at::kByte && w.dim() == 4 && w.size(3) == 32) {
    TORCH_CHECK(scales.has_value(), "layer_forward: a w4a8 projection needs its scales and zeros");
    return w4a8_linear(x, w, *scales, n, bias);
  }
  if (w.scalar_type() == at::kByte && w.dim() == 4) {
    TORCH_CHECK(scales.has_value(), "layer_forward: a w8a8 projection needs its scales");
    return w8a8_linear(x, w, *scales, bias);
  }
  if (w.scalar_type() == at::kByte) {
    TORCH_CHECK(scales.has_value(), "layer_forward: an int4 projection needs its scales and zeros");
    return int4_linear(x, w, *scales, bias);
  }
  if (w.scalar_type() == at::kBFloat16) return bf16_linear(x, w, n, bias);
  return f32_linear(x, w, n, bias);
}

// Which AMX tile path computes silu_linear(x, w, scales, n) in its epilogue, if any.
enum class SiluTiles { kNone, kBf16, kW8a8 };

SiluTiles silu_tiles(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& scales, int64_t n) {
#if defined(LORAPLEX_AMX)
  if (!(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kBFloat16 && amx::use(x.size(0)) && n % 32 == 0 &&
        w.dim() == 4 && w.is_contiguous() && w.size(0) * 16 == n))
    return SiluTiles::kNone;
  const int64_t K = x.size(1);
  if (w.scalar_type() == at::kBFloat16 && w.size(1) * 2 == K && K % 32 == 0 && !scales.has_value())
    return SiluTiles::kBf16;
#if defined(LORAPLEX_W8A8_VNNI)
  if (w.scalar_type() == at::kByte && w.size(3) == 4 && w.size(1) * 4 == K && K % 64 == 0 && scales.has_value() &&
      scales->numel() == n && scales->is_contiguous() &&
      (scales->scalar_type() == at::kFloat || scales->scalar_type() == at::kBFloat16))
    return SiluTiles::kW8a8;
#endif
#else
  (void)x, (void)w, (void)scales, (void)n;
#endif
  return SiluTiles::kNone;
}

// silu_mul(panel_linear(x, w, scales, n)) for a fused gate/up projection of n = 2 I columns, no bias. On AMX
// tiles (bf16 x over bf16 panels or w8a8 quads, I a multiple of 16: silu_tiles) the product's epilogue
// computes silu_mul from the bf16-rounded gate and up sums, so the (M, 2 I) product is never stored and the
// result equals the unfused one bit for bit; elsewhere the two ops run in turn. `delta` (fp32 (M, n), from
// lora_delta; tile paths only, else nullptr): LoRA deltas added to the product first, rounded as lora_add
// rounds them.
at::Tensor silu_linear_impl(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& scales, int64_t n,
                            const at::Tensor* delta) {
  TORCH_CHECK(n % 2 == 0, "silu_linear: n must be even (gate and up halves)");
  TORCH_CHECK(delta == nullptr || (delta->scalar_type() == at::kFloat && delta->is_contiguous() && delta->dim() == 2 &&
                                   delta->size(0) == x.size(0) && delta->size(1) == n),
              "silu_linear: delta (M, n) float32, contiguous");
  const SiluTiles tiles = silu_tiles(x, w, scales, n);
  TORCH_CHECK(delta == nullptr || tiles != SiluTiles::kNone, "silu_linear: LoRA deltas need the fused tile paths");
#if defined(LORAPLEX_AMX)
  const float* dp = delta != nullptr ? delta->data_ptr<float>() : nullptr;
  const int64_t M = x.size(0), K = x.size(1);
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  if (tiles == SiluTiles::kBf16) {
    at::Tensor out = at::empty({M, n / 2}, x.options());
    amx_linear_bf16<true>(xp, x.stride(0), M, K / 2, w.data_ptr(), false, w.size(0), n,
                          reinterpret_cast<uint16_t*>(out.data_ptr()), nullptr, nullptr, dp);
    return out;
  }
#if defined(LORAPLEX_W8A8_VNNI)
  if (tiles == SiluTiles::kW8a8) {
    std::vector<float> sf;
    RowsI8 rows;
    round_rows_i8(xp, x.stride(0), M, K, rows);
    at::Tensor out = at::empty({M, n / 2}, x.options());
    amx_linear_w8a8<true>(rows, M, K, w.data_ptr<uint8_t>(), w.size(0), n,
                          reinterpret_cast<uint16_t*>(out.data_ptr()), scales_f32(*scales, sf), nullptr, dp);
    return out;
  }
#endif
#endif
  return silu_mul(panel_linear(x, w, scales, n, std::nullopt));
}

at::Tensor silu_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& scales, int64_t n) {
  return silu_linear_impl(x, w, scales, n, nullptr);
}

// The step's attention over the paged caches, as kernels.attention.paged_attention_native computes it: the
// decode rows (every row of q when decode_rows is None) by decode_attention, and each prefill chunk (`prefill`:
// first row, end row and sequence index, three ints a chunk) by prefill_attention over its sequence's blocks.
at::Tensor step_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                          const at::Tensor& block_tables, const at::Tensor& seq_ids, const at::Tensor& seq_lens,
                          const std::optional<at::Tensor>& decode_rows, const std::vector<int64_t>& prefill,
                          double scale, int64_t window) {
  if (!decode_rows.has_value() && prefill.empty())
    return decode_attention(q, k_cache, v_cache, block_tables, seq_ids, seq_lens, scale, window);
  TORCH_CHECK(prefill.size() % 3 == 0, "layer_forward: prefill holds (first row, end row, sequence) triples");
  at::Tensor out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  if (decode_rows.has_value() && decode_rows->numel() > 0) {
    out.index_copy_(0, *decode_rows, decode_attention(q.index_select(0, *decode_rows), k_cache, v_cache, block_tables,
                                                      seq_ids, seq_lens, scale, window));
  }
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t block_size = k_cache.size(1), S = seq_lens.numel();
  for (size_t c = 0; c < prefill.size(); c += 3) {
    const int64_t start = prefill[c], n = prefill[c + 1] - start, s = prefill[c + 2];
    TORCH_CHECK(start >= 0 && n >= 1 && start + n <= q.size(0) && s >= 0 && s < S,
                "layer_forward: a prefill chunk outside the step's rows or sequences");
    const int64_t len = lens[s], blocks = (len + block_size - 1) / block_size;
    TORCH_CHECK(blocks <= block_tables.size(1), "layer_forward: a prefill chunk's sequence outgrows its block table");
    out.narrow(0, start, n).copy_(prefill_attention(q.narrow(0, start, n), k_cache, v_cache,
                                                    block_tables.select(0, s).narrow(0, 0, blocks), len, scale, window));
  }
  return out;
}

at::Tensor layer_forward(at::Tensor x, const at::Tensor& h, const at::Tensor& qkv_w, const std::optional<at::Tensor>& qkv_s,
                        const std::optional<at::Tensor>& qkv_b, const at::Tensor& o_w, const std::optional<at::Tensor>& o_s,
                        const at::Tensor& gate_up_w, const std::optional<at::Tensor>& gate_up_s, const at::Tensor& down_w,
                        const std::optional<at::Tensor>& down_s, std::vector<int64_t> ns, const at::Tensor& post_norm,
                        const at::Tensor& next_norm, double eps, const at::Tensor& cos, const at::Tensor& sin,
                        at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slots, const at::Tensor& block_tables,
                        const at::Tensor& seq_ids, const at::Tensor& seq_lens,
                        const std::optional<at::Tensor>& decode_rows, std::vector<int64_t> prefill,
                        int64_t num_q_heads, double scale, int64_t window, at::TensorList lora,
                        std::vector<int64_t> lora_groups, const std::optional<at::Tensor>& token_slots) {
  TORCH_CHECK(ns.size() == 4, "layer_forward: ns holds the widths of qkv, o, gate_up and down");
  // LoRA: per group (qkv, o, gate_up, down) its slice count (0: no adapter of this step touches it), then
  // the slice widths; `lora` holds (lora_a, b_t, ranks, scaling) of each group present (kernels.lora_cpu)
  std::vector<std::vector<int64_t>> slices(4);
  std::vector<int64_t> first(4, -1);
  if (!lora_groups.empty()) {
    TORCH_CHECK(token_slots.has_value(), "layer_forward: LoRA needs the tokens' slots");
    size_t at = 0;
    int64_t tensor = 0;
    for (int g = 0; g < 4; ++g) {
      TORCH_CHECK(at < lora_groups.size(), "layer_forward: lora_groups names every group");
      const int64_t count = lora_groups[at++];
      TORCH_CHECK(count >= 0 && at + count <= lora_groups.size(), "layer_forward: bad lora_groups");
      slices[g].assign(lora_groups.begin() + at, lora_groups.begin() + at + count);
      at += count;
      if (count > 0) {
        first[g] = tensor;
        tensor += 4;
      }
    }
    TORCH_CHECK(static_cast<int64_t>(lora.size()) == tensor, "layer_forward: four LoRA tensors per adapted group");
  }
  auto add_lora = [&](int g, at::Tensor& y, const at::Tensor& in) {
    if (first[g] < 0) return;
    const int64_t t = first[g];
    lora_add(y, in, lora[t], lora[t + 1], lora[t + 2], lora[t + 3], *token_slots, slices[g]);
  };
  const int64_t T = h.size(0), D = kv_head_dim(k_cache), hkv = k_cache.size(2);
  const int64_t q_size = num_q_heads * D, kv_size = hkv * D;
  TORCH_CHECK(ns[0] == q_size + 2 * kv_size, "layer_forward: the qkv width must be (H_q + 2 H_kv) * D");
  const std::optional<at::Tensor> none;
  at::Tensor qkv = panel_linear(h, qkv_w, qkv_s, ns[0], qkv_b);  // (T, q + 2 kv)
  add_lora(0, qkv, h);
  at::Tensor qk = qkv.narrow(1, 0, q_size + kv_size).view({T, num_q_heads + hkv, D});
  const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({T, hkv, D});
  rope_store_kv(qk, v, cos, sin, num_q_heads, k_cache, v_cache, slots);
  const at::Tensor attn = step_attention(qk.narrow(1, 0, num_q_heads), k_cache, v_cache, block_tables, seq_ids,
                                         seq_lens, decode_rows, prefill, scale, window).view({T, q_size});
  at::Tensor o = panel_linear(attn, o_w, o_s, ns[1], none);
  add_lora(1, o, attn);
  const at::Tensor h2 = add_rms_norm(x, o, post_norm, eps);
  // silu_mul fused into the gate/up product where it can be; an adapter's deltas on gate/up are added there
  // on the tile paths, and op by op elsewhere (lora_add in place: no delta buffer)
  at::Tensor act;
  if (first[2] < 0) {
    act = silu_linear_impl(h2, gate_up_w, gate_up_s, ns[2], nullptr);
  } else if (silu_tiles(h2, gate_up_w, gate_up_s, ns[2]) != SiluTiles::kNone) {
    const int64_t t = first[2];
    const at::Tensor delta = lora_delta(h2, ns[2], lora[t], lora[t + 1], lora[t + 2], lora[t + 3], *token_slots, slices[2]);
    act = silu_linear_impl(h2, gate_up_w, gate_up_s, ns[2], &delta);
  } else {
    at::Tensor gate_up = panel_linear(h2, gate_up_w, gate_up_s, ns[2], none);
    add_lora(2, gate_up, h2);
    act = silu_mul(gate_up);
  }
  at::Tensor down = panel_linear(act, down_w, down_s, ns[3], none);
  add_lora(3, down, act);
  return add_rms_norm(x, down, next_norm, eps);
}

// Every decoder layer of a step in one call: layer_forward layer by layer, each layer's arguments sliced from
// flat lists the model builds once (its weights) and per step (its caches, its LoRA operands). A step then
// pays one Python-to-C++ call for all layers instead of one per layer, each converting ~35 arguments (~0.5
// ms of an ~8.6 ms batch-1 w4a8 step on the bench model). Per layer: weights (qkv, o, gate_up, down), extras
// (qkv_s, qkv_b, o_s, gate_up_s, down_s), ns (the four widths), norms (post_norm, next_norm), k_caches and
// v_caches (one each); lora_groups holds every layer's layer_forward lora_groups one after the other (empty:
// no adapter in the step), and lora the layers' operands likewise.
at::Tensor layers_forward(at::Tensor x, at::Tensor h, at::TensorList weights,
                          const c10::List<std::optional<at::Tensor>>& extras, std::vector<int64_t> ns,
                          at::TensorList norms, double eps, const at::Tensor& cos, const at::Tensor& sin,
                          at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& slots,
                          const at::Tensor& block_tables, const at::Tensor& seq_ids, const at::Tensor& seq_lens,
                          const std::optional<at::Tensor>& decode_rows, std::vector<int64_t> prefill,
                          int64_t num_q_heads, double scale, int64_t window, at::TensorList lora,
                          std::vector<int64_t> lora_groups, const std::optional<at::Tensor>& token_slots) {
  const size_t L = k_caches.size();
  TORCH_CHECK(L > 0 && v_caches.size() == L && weights.size() == 4 * L && extras.size() == 5 * L &&
                  ns.size() == 4 * L && norms.size() == 2 * L,
              "layers_forward: per layer 4 weights, 5 extras, 4 widths, 2 norms and one k and v cache");
  size_t at_group = 0, at_lora = 0;
  for (size_t i = 0; i < L; ++i) {
    // the layer's (count, widths...) of its four groups, and 4 operands per adapted group
    const size_t first = at_group;
    size_t tensors = 0;
    for (int g = 0; g < 4 && !lora_groups.empty(); ++g) {
      TORCH_CHECK(at_group < lora_groups.size(), "layers_forward: lora_groups names four groups of every layer");
      const int64_t count = lora_groups[at_group];
      TORCH_CHECK(count >= 0 && at_group + 1 + count <= lora_groups.size(), "layers_forward: bad lora_groups");
      tensors += count > 0 ? 4 : 0;
      at_group += 1 + count;
    }
    const std::vector<int64_t> groups(lora_groups.begin() + first, lora_groups.begin() + at_group);
    TORCH_CHECK(at_lora + tensors <= lora.size(), "layers_forward: fewer LoRA operands than lora_groups names");
    const at::TensorList layer_lora = lora.slice(at_lora, tensors);
    at_lora += tensors;
    auto extra = [&](size_t k) { return static_cast<std::optional<at::Tensor>>(extras.get(5 * i + k)); };
    h = layer_forward(x, h, weights[4 * i], extra(0), extra(1), weights[4 * i + 1], extra(2), weights[4 * i + 2],
                      extra(3), weights[4 * i + 3], extra(4), {ns.begin() + 4 * i, ns.begin() + 4 * i + 4},
                      norms[2 * i], norms[2 * i + 1], eps, cos, sin, k_caches[i], v_caches[i], slots, block_tables,
                      seq_ids, seq_lens, decode_rows, prefill, num_q_heads, scale, window, layer_lora, groups,
                      token_slots);
  }
  TORCH_CHECK(at_lora == lora.size() && at_group == lora_groups.size(),
              "layers_forward: LoRA operands or groups left over");
  return h;
}

}  // namespace

TORCH_LIBRARY(loraplex_cpu, m) {
  m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_ids, "
        "Tensor seq_lens, float scale, int window) -> Tensor");
  m.def("prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor table, int seq_len, float scale, "
        "int window) -> Tensor");
  m.def("has_prefill_attention() -> bool", &has_prefill_attention);
  m.def("has_shared_prefix_decode() -> bool", &has_shared_prefix_decode);
  m.def("add_rms_norm(Tensor(a!) residual, Tensor? delta, Tensor weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor x) -> Tensor");
  m.def("silu_linear(Tensor x, Tensor w, Tensor? scales, int n) -> Tensor");
  m.def("rope_store_kv(Tensor(a!) qk, Tensor v, Tensor cos, Tensor sin, int num_q_heads, Tensor(b!) k_cache, "
        "Tensor(c!) v_cache, Tensor slots) -> ()");
  m.def("bf16_linear(Tensor x, Tensor w, int n, Tensor? bias) -> Tensor");
  m.def("has_bf16_linear() -> bool", &has_bf16_linear);
  m.def("has_amx() -> bool", &has_amx);
  m.def("set_amx(bool enable) -> bool", &set_amx);
  m.def("int8_linear(Tensor x, Tensor w, Tensor scales, Tensor? bias) -> Tensor");
  m.def("lora_add(Tensor(a!) y, Tensor x, Tensor lora_a, Tensor b_t, Tensor ranks, Tensor scaling, "
        "Tensor token_slots, int[] slice_sizes) -> ()");
  m.def("f32_linear(Tensor x, Tensor w, int n, Tensor? bias) -> Tensor");
  m.def("int4_linear(Tensor x, Tensor w, Tensor scale_zeros, Tensor? bias) -> Tensor");
  m.def("has_f32_linear() -> bool", &has_f32_linear);
  m.def("w8a8_linear(Tensor x, Tensor w, Tensor scales, Tensor? bias) -> Tensor");
  m.def("has_w8a8_linear() -> bool", &has_w8a8_linear);
  m.def("has_w8a8_linear_f32() -> bool", &has_w8a8_linear_f32);
  m.def("has_int8_linear_f32() -> bool", &has_int8_linear_f32);
  m.def("has_int4_linear_f32() -> bool", &has_int4_linear_f32);
  m.def("w4a8_linear(Tensor x, Tensor w, Tensor scale_zeros, int n, Tensor? bias) -> Tensor");
  m.def("has_w4a8_linear() -> bool", &has_w4a8_linear);
  m.def("set_w4a8_vnni(bool enable) -> bool", &set_w4a8_vnni);
  m.def("set_stream_rows(int rows) -> int", &set_stream_rows);
  m.def("layer_forward(Tensor(a!) x, Tensor h, Tensor qkv_w, Tensor? qkv_s, Tensor? qkv_b, Tensor o_w, Tensor? o_s, "
        "Tensor gate_up_w, Tensor? gate_up_s, Tensor down_w, Tensor? down_s, int[] ns, Tensor post_norm, "
        "Tensor next_norm, float eps, Tensor cos, Tensor sin, Tensor(b!) k_cache, Tensor(c!) v_cache, Tensor slots, "
        "Tensor block_tables, Tensor seq_ids, Tensor seq_lens, Tensor? decode_rows, int[] prefill, int num_q_heads, "
        "float scale, int window, Tensor[] lora, int[] lora_groups, Tensor? token_slots) -> Tensor");
  m.def("layers_forward(Tensor(a!) x, Tensor h, Tensor[] weights, Tensor?[] extras, int[] ns, Tensor[] norms, "
        "float eps, Tensor cos, Tensor sin, Tensor(b!)[] k_caches, Tensor(c!)[] v_caches, Tensor slots, "
        "Tensor block_tables, Tensor seq_ids, Tensor seq_lens, Tensor? decode_rows, int[] prefill, int num_q_heads, "
        "float scale, int window, Tensor[] lora, int[] lora_groups, Tensor? token_slots) -> Tensor");
}

TORCH_LIBRARY_IMPL(loraplex_cpu, CPU, m) {
  m.impl("decode_attention", &decode_attention);
  m.impl("prefill_attention", &prefill_attention);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_mul", &silu_mul);
  m.impl("silu_linear", &silu_linear);
  m.impl("rope_store_kv", &rope_store_kv);
  m.impl("bf16_linear", &bf16_linear);
  m.impl("int8_linear", &int8_linear);
  m.impl("lora_add", &lora_add);
  m.impl("f32_linear", &f32_linear);
  m.impl("int4_linear", &int4_linear);
  m.impl("w8a8_linear", &w8a8_linear);
  m.impl("w4a8_linear", &w4a8_linear);
  m.impl("layer_forward", &layer_forward);
  m.impl("layers_forward", &layers_forward);
}
