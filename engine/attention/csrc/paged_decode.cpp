// Decode attention over a paged KV cache on a CPU, reading K/V in place (no gathered copy).
//
// One query token per sequence; the cache is FlashInfer's NHD layout (engine/attention/base.py):
// kv_cache[pages, 2, page_size, Hkv, D], [:, 0] K and [:, 1] V. Each sequence walks its pages in
// chunks of tokens: the chunk is scored for every query head (the heads of one KV group share
// that group's K row), folded into an online softmax (running max m and sum l per head, the
// accumulator rescaled by exp(m_old - m_new)), and the weights applied to the chunk's V rows.
//
// Two implementations of the same loop:
// - decode_one_avx2 (x86 with AVX2 and FMA, head_dim % 8 == 0): eight query heads' dot products
//   reduced at once (hsum8x8), exp on eight lanes, each head's accumulator kept in registers
//   across a chunk's V rows, and the next chunk's rows prefetched while this one is scored
//   (pages are scattered, so the hardware prefetcher cannot follow them).
// - decode_one (portable C, vectorised by the compiler where it can), for every other CPU and
//   head size; `portable=true` forces it so that tests check it on AVX2 machines too.
// Both accumulate in float32 whatever the cache dtype.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <type_traits>
#include <vector>

namespace {

constexpr int kChunk = 64;  // tokens scored before each online-softmax update

// exp(x) for x <= 0 in plain C that the compiler vectorises (no libm call in the loop).
// Cody-Waite reduction to r in [-ln2/2, ln2/2] and a degree-6 polynomial: ~1 ulp.
#pragma omp declare simd
static inline float exp_nonpos(float x) {
  x = x < -87.0f ? -87.0f : x;
  const float n = std::nearbyint(x * 1.44269504088896341f);
  float r = x - n * 0.693145751953125f;
  r = r - n * 1.428606765330187045e-06f;
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

template <typename T>
inline float to_f(T v) { return static_cast<float>(v); }

template <typename scalar_t>
void decode_one(const scalar_t* q,      // [Hq, D] of this sequence
                scalar_t* out,          // [Hq, D]
                const scalar_t* cache,  // [pages, 2, ps, Hkv, D]
                const int32_t* pages, int64_t ctx, int64_t ps, int64_t hkv, int64_t group,
                int64_t d, float scale) {
  const int64_t hq = hkv * group;
  const int64_t row = hkv * d;          // one token's K (or V) for all heads
  const int64_t page_stride = 2 * ps * row;
  // per-thread scratch, reused across sequences and calls (no allocation per decode)
  thread_local std::vector<float> qf, acc, m, l, s;
  qf.resize(hq * d);
  acc.assign(hq * d, 0.0f);
  m.assign(hq, -INFINITY);
  l.assign(hq, 0.0f);
  s.resize(hq * kChunk);
  const scalar_t* krow[kChunk];
  const scalar_t* vrow[kChunk];
  for (int64_t i = 0; i < hq * d; ++i) qf[i] = to_f(q[i]) * scale;
  for (int64_t t0 = 0; t0 < ctx; t0 += kChunk) {
    const int64_t n = std::min<int64_t>(kChunk, ctx - t0);
    for (int64_t t = 0; t < n; ++t) {
      const int64_t pos = t0 + t;
      const scalar_t* base = cache + pages[pos / ps] * page_stride + (pos % ps) * row;
      krow[t] = base;
      vrow[t] = base + ps * row;
    }
    // scores s[h][t]
    for (int64_t t = 0; t < n; ++t) {
      const scalar_t* k = krow[t];
      for (int64_t h = 0; h < hq; ++h) {
        const scalar_t* kh = k + (h / group) * d;
        const float* qh = qf.data() + h * d;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t i = 0; i < d; ++i) dot += qh[i] * to_f(kh[i]);
        s[h * kChunk + t] = dot;
      }
    }
    for (int64_t h = 0; h < hq; ++h) {
      float* sh = s.data() + h * kChunk;
      float mx = m[h];
      for (int64_t t = 0; t < n; ++t) mx = sh[t] > mx ? sh[t] : mx;
      const float corr = exp_nonpos(m[h] - mx);  // m = -inf first: exp(-inf) -> clamp -> ~0
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t t = 0; t < n; ++t) {
        const float e = exp_nonpos(sh[t] - mx);
        sh[t] = e;
        sum += e;
      }
      l[h] = l[h] * corr + sum;
      m[h] = mx;
      float* ah = acc.data() + h * d;
      for (int64_t i = 0; i < d; ++i) ah[i] *= corr;
    }
    for (int64_t t = 0; t < n; ++t) {
      const scalar_t* v = vrow[t];
      for (int64_t h = 0; h < hq; ++h) {
        const scalar_t* vh = v + (h / group) * d;
        const float p = s[h * kChunk + t];
        float* ah = acc.data() + h * d;
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) ah[i] += p * to_f(vh[i]);
      }
    }
  }
  for (int64_t h = 0; h < hq; ++h) {
    const float inv = 1.0f / l[h];
    for (int64_t i = 0; i < d; ++i) out[h * d + i] = static_cast<scalar_t>(acc[h * d + i] * inv);
  }
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

// exp(x) for x <= 0, 8 lanes: the polynomial of exp_nonpos above.
static inline __m256 exp8_nonpos(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187045e-06f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720.0f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

template <typename T> inline __m256 load8(const T* p);
template <> inline __m256 load8<float>(const float* p) { return _mm256_loadu_ps(p); }
template <> inline __m256 load8<c10::BFloat16>(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
#if defined(__F16C__)
template <> inline __m256 load8<c10::Half>(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
#define PDC_HALF_SIMD 1
#endif

// The sums of eight vectors, one per lane: lane j = sum of v[j]'s lanes.
static inline __m256 hsum8x8(const __m256* v) {
  const __m256 a = _mm256_hadd_ps(v[0], v[1]);  // 0 0 1 1 | 0 0 1 1
  const __m256 b = _mm256_hadd_ps(v[2], v[3]);
  const __m256 c = _mm256_hadd_ps(v[4], v[5]);
  const __m256 d = _mm256_hadd_ps(v[6], v[7]);
  const __m256 ab = _mm256_hadd_ps(a, b);  // 0 1 2 3 | 0 1 2 3 (half sums per 128-bit lane)
  const __m256 cd = _mm256_hadd_ps(c, d);  // 4 5 6 7 | 4 5 6 7
  const __m256 lo = _mm256_permute2f128_ps(ab, cd, 0x20);  // ab.lo | cd.lo
  const __m256 hi = _mm256_permute2f128_ps(ab, cd, 0x31);  // ab.hi | cd.hi
  return _mm256_add_ps(lo, hi);
}

constexpr int kSimdChunk = 32;

// One sequence, all heads: head_dim % 8 == 0. Query heads are processed in blocks of eight
// (the last block padded with zero queries whose scores are never used).
template <typename scalar_t>
void decode_one_avx2(const scalar_t* q, scalar_t* out, const scalar_t* cache, const int32_t* pages, int64_t ctx,
                     int64_t ps, int64_t hkv, int64_t group, int64_t d, float scale) {
  const int64_t hq = hkv * group, nb = (hq + 7) / 8, hp = nb * 8, dv = d / 8;
  const int64_t row = hkv * d, page_stride = 2 * ps * row;
  thread_local std::vector<float> buf;
  thread_local std::vector<int64_t> offs;
  buf.resize(2 * hp * d + kSimdChunk * hp + 2 * hp);
  offs.resize(hp);
  float* qf = buf.data();
  float* acc = qf + hp * d;
  float* s = acc + hp * d;
  float* m = s + kSimdChunk * hp;
  float* l = m + hp;
  int64_t* koff = offs.data();  // offset of each head's K (and V) within a token row
  const scalar_t* krow[kSimdChunk];
  for (int64_t h = 0; h < hp; ++h) {
    koff[h] = h < hq ? (h / group) * d : 0;
    for (int64_t i = 0; i < d; ++i) qf[h * d + i] = h < hq ? static_cast<float>(q[h * d + i]) * scale : 0.0f;
  }
  std::fill(acc, acc + hp * d, 0.0f);
  std::fill(m, m + hp, -1e30f);
  std::fill(l, l + hp, 0.0f);
  for (int64_t t0 = 0; t0 < ctx; t0 += kSimdChunk) {
    const int64_t n = std::min<int64_t>(kSimdChunk, ctx - t0);
    for (int64_t t = 0; t < n; ++t) {
      const int64_t pos = t0 + t;
      krow[t] = cache + pages[pos / ps] * page_stride + (pos % ps) * row;
    }
    // scores: s[t][h]; meanwhile ask for the next chunk's K and V rows (pages are scattered,
    // so the hardware prefetcher cannot guess the next one)
    const int64_t n_next = std::min<int64_t>(kSimdChunk, std::max<int64_t>(ctx - t0 - kSimdChunk, 0));
    for (int64_t t = 0; t < n; ++t) {
      if (t < n_next) {
        const int64_t pos = t0 + kSimdChunk + t;
        const char* nk = reinterpret_cast<const char*>(cache + pages[pos / ps] * page_stride + (pos % ps) * row);
        const char* nv = nk + ps * row * sizeof(scalar_t);
        for (int64_t off = 0; off < row * static_cast<int64_t>(sizeof(scalar_t)); off += 64) {
          _mm_prefetch(nk + off, _MM_HINT_T0);
          _mm_prefetch(nv + off, _MM_HINT_T0);
        }
      }
      const scalar_t* k = krow[t];
      for (int64_t b = 0; b < nb; ++b) {
        __m256 v[8];
        for (int j = 0; j < 8; ++j) {
          const int64_t h = b * 8 + j;
          const float* qh = qf + h * d;
          const scalar_t* kh = k + koff[h];
          __m256 a = _mm256_mul_ps(_mm256_loadu_ps(qh), load8(kh));
          for (int64_t i = 1; i < dv; ++i) a = _mm256_fmadd_ps(_mm256_loadu_ps(qh + 8 * i), load8(kh + 8 * i), a);
          v[j] = a;
        }
        _mm256_storeu_ps(s + t * hp + b * 8, hsum8x8(v));
      }
    }
    // online softmax, eight heads at a time
    for (int64_t b = 0; b < nb; ++b) {
      __m256 mx = _mm256_loadu_ps(m + b * 8);
      for (int64_t t = 0; t < n; ++t) mx = _mm256_max_ps(mx, _mm256_loadu_ps(s + t * hp + b * 8));
      const __m256 corr = exp8_nonpos(_mm256_sub_ps(_mm256_loadu_ps(m + b * 8), mx));
      __m256 sum = _mm256_setzero_ps();
      for (int64_t t = 0; t < n; ++t) {
        const __m256 e = exp8_nonpos(_mm256_sub_ps(_mm256_loadu_ps(s + t * hp + b * 8), mx));
        _mm256_storeu_ps(s + t * hp + b * 8, e);
        sum = _mm256_add_ps(sum, e);
      }
      _mm256_storeu_ps(l + b * 8, _mm256_fmadd_ps(_mm256_loadu_ps(l + b * 8), corr, sum));
      _mm256_storeu_ps(m + b * 8, mx);
      alignas(32) float c[8];
      _mm256_storeu_ps(c, corr);
      for (int j = 0; j < 8; ++j) {
        float* ah = acc + (b * 8 + j) * d;
        const __m256 cj = _mm256_set1_ps(c[j]);
        for (int64_t i = 0; i < dv; ++i) _mm256_storeu_ps(ah + 8 * i, _mm256_mul_ps(_mm256_loadu_ps(ah + 8 * i), cj));
      }
    }
    // acc[h] += sum_t p[t][h] V[t][kv(h)], 32 floats of a head's accumulator held in registers
    for (int64_t h = 0; h < hq; ++h) {
      float* ah = acc + h * d;
      for (int64_t i0 = 0; i0 < dv; i0 += 4) {
        const int64_t w = std::min<int64_t>(4, dv - i0);
        __m256 a0 = _mm256_loadu_ps(ah + 8 * i0), a1 = a0, a2 = a0, a3 = a0;
        if (w > 1) a1 = _mm256_loadu_ps(ah + 8 * i0 + 8);
        if (w > 2) a2 = _mm256_loadu_ps(ah + 8 * i0 + 16);
        if (w > 3) a3 = _mm256_loadu_ps(ah + 8 * i0 + 24);
        for (int64_t t = 0; t < n; ++t) {
          const scalar_t* vh = krow[t] + ps * row + koff[h] + 8 * i0;
          const __m256 p = _mm256_set1_ps(s[t * hp + h]);
          a0 = _mm256_fmadd_ps(p, load8(vh), a0);
          if (w > 1) a1 = _mm256_fmadd_ps(p, load8(vh + 8), a1);
          if (w > 2) a2 = _mm256_fmadd_ps(p, load8(vh + 16), a2);
          if (w > 3) a3 = _mm256_fmadd_ps(p, load8(vh + 24), a3);
        }
        _mm256_storeu_ps(ah + 8 * i0, a0);
        if (w > 1) _mm256_storeu_ps(ah + 8 * i0 + 8, a1);
        if (w > 2) _mm256_storeu_ps(ah + 8 * i0 + 16, a2);
        if (w > 3) _mm256_storeu_ps(ah + 8 * i0 + 24, a3);
      }
    }
  }
  for (int64_t h = 0; h < hq; ++h) {
    const float inv = 1.0f / l[h];
    for (int64_t i = 0; i < d; ++i) out[h * d + i] = static_cast<scalar_t>(acc[h * d + i] * inv);
  }
}
template <typename T> constexpr bool simd_ok() {
  return std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>
#if defined(PDC_HALF_SIMD)
         || std::is_same_v<T, c10::Half>
#endif
      ;
}
#define PDC_AVX2 1
#endif

}  // namespace

// out/q: [B, Hq, D] contiguous; kv_cache: [pages, 2, ps, Hkv, D] contiguous;
// block_tables: int32 [B, max_pages]; context_lens: int32 [B]
void paged_decode_attention(torch::Tensor out, torch::Tensor q, torch::Tensor kv_cache,
                            torch::Tensor block_tables, torch::Tensor context_lens, double scale, bool portable) {
  TORCH_CHECK(q.dim() == 3 && kv_cache.dim() == 5 && kv_cache.size(1) == 2, "q must be [B, Hq, D] and kv_cache "
              "[pages, 2, page_size, Hkv, D]");
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && kv_cache.is_contiguous(), "q, out, kv_cache must be contiguous");
  TORCH_CHECK(out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type() &&
              kv_cache.scalar_type() == q.scalar_type(), "out and kv_cache must match q's shape/dtype");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && context_lens.scalar_type() == torch::kInt32 &&
              block_tables.is_contiguous() && context_lens.is_contiguous(), "block_tables, context_lens: contiguous int32");
  const int64_t B = q.size(0), hq = q.size(1), d = q.size(2);
  const int64_t num_pages = kv_cache.size(0), ps = kv_cache.size(2), hkv = kv_cache.size(3);
  TORCH_CHECK(kv_cache.size(4) == d && hkv > 0 && hq % hkv == 0, "head_dim must match and Hq be a multiple of Hkv");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == B && context_lens.numel() == B,
              "block_tables must be [B, max_pages] and context_lens [B]");
  const int64_t max_pages = block_tables.size(1);
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int32_t* cl = context_lens.data_ptr<int32_t>();
  // Out-of-range pages or lengths would read outside the cache: refuse them (cheap next to the reads).
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(cl[b] >= 1 && cl[b] <= max_pages * ps, "context_lens[", b, "] = ", cl[b], " outside [1, ",
                max_pages * ps, "]");
    for (int64_t p = 0, n = (cl[b] + ps - 1) / ps; p < n; ++p) {
      const int32_t page = bt[b * max_pages + p];
      TORCH_CHECK(page >= 0 && page < num_pages, "block_tables[", b, ", ", p, "] = ", page, " outside [0, ",
                  num_pages, ")");
    }
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::Half, at::ScalarType::BFloat16, q.scalar_type(), "paged_decode", [&] {
    const scalar_t* qp = q.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const scalar_t* cp = kv_cache.data_ptr<scalar_t>();
    at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
#if defined(PDC_AVX2)
        if constexpr (simd_ok<scalar_t>()) {
          if (d % 8 == 0 && !portable) {
            decode_one_avx2<scalar_t>(qp + b * hq * d, op + b * hq * d, cp, bt + b * max_pages, cl[b], ps, hkv,
                                      hq / hkv, d, static_cast<float>(scale));
            continue;
          }
        }
#endif
        decode_one<scalar_t>(qp + b * hq * d, op + b * hq * d, cp, bt + b * max_pages, cl[b], ps, hkv,
                             hq / hkv, d, static_cast<float>(scale));
      }
    });
  });
}

bool has_simd() {
#if defined(PDC_AVX2)
  return true;
#else
  return false;
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention);
  m.def("has_simd", &has_simd);
}
