#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cmath>
#include <cstdint>
#include <cstring>
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
  std::vector<float> qf(hq * d), acc(hq * d, 0.0f), m(hq, -INFINITY), l(hq, 0.0f);
  std::vector<float> s(hq * kChunk);
  std::vector<const scalar_t*> krow(kChunk), vrow(kChunk);
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

}  // namespace

// out/q: [B, Hq, D] contiguous; kv_cache: [pages, 2, ps, Hkv, D] contiguous;
// block_tables: int32 [B, max_pages]; context_lens: int32 [B]
void paged_decode_attention(torch::Tensor out, torch::Tensor q, torch::Tensor kv_cache,
                            torch::Tensor block_tables, torch::Tensor context_lens, double scale) {
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && kv_cache.is_contiguous());
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && context_lens.scalar_type() == torch::kInt32);
  const int64_t B = q.size(0), hq = q.size(1), d = q.size(2);
  const int64_t ps = kv_cache.size(2), hkv = kv_cache.size(3);
  const int64_t max_pages = block_tables.size(1);
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int32_t* cl = context_lens.data_ptr<int32_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::Half, at::ScalarType::BFloat16, q.scalar_type(), "paged_decode", [&] {
    const scalar_t* qp = q.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const scalar_t* cp = kv_cache.data_ptr<scalar_t>();
    at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b)
        decode_one<scalar_t>(qp + b * hq * d, op + b * hq * d, cp, bt + b * max_pages, cl[b], ps, hkv,
                             hq / hkv, d, static_cast<float>(scale));
    });
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("paged_decode_attention", &paged_decode_attention); }
