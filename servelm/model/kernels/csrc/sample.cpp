// Sampling one token per row of logits: temperature, top-k, top-p and min-p, then a draw with one uniform
// number per row. PyTorch's way (sort each row, softmax, cumsum, one exponential variate per vocabulary
// entry for the draw) cost about 4 ms per row of a 49k vocabulary on two cores, more than the model's decode
// step at batch 64; this one reads each row a few times and sorts only the few values at a cut.
//
// The distribution, in weights e = exp((x - max) / T) (1 for the most likely token):
//   top-k keeps the tokens whose weight is at least the k-th largest (ties at the cut all stay);
//   top-p keeps the tokens for which the weight of strictly more likely (kept) tokens is below p times the
//   kept weight (the smallest nucleus that reaches p, ties at the cut all stay);
//   min-p keeps the tokens whose weight is at least min_p (min_p times the most likely one's).
// What survives is a weight threshold `lo`; the draw takes the first token, in vocabulary order, at which the
// running sum of the surviving weights exceeds u times their total. servelm/engine/sampler.py holds the same
// definition in torch (the GPU path and the reference the tests hold this kernel to).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <type_traits>
#include <vector>

#include "fast_exp.h"
#include "kernels.h"

namespace {

// Histogram buckets of a weight in (0, 1]: its float bits' exponent and top 6 mantissa bits, so a bucket
// spans 1/64 of an octave and the cut's bucket holds a few tokens of a real model's row.
constexpr int kShift = 17;
constexpr int64_t kBuckets = (0x3F800000 >> kShift) + 1;  // 1.0f is the top bucket

inline int64_t bucket_of(float e) {
  uint32_t b;
  std::memcpy(&b, &e, sizeof(b));
  return b >> kShift;
}

struct Scratch {
  std::vector<float> e;
  std::vector<double> mass;
  std::vector<int32_t> count;
  std::vector<float> members;
  explicit Scratch(int64_t V) : e(V), mass(kBuckets), count(kBuckets) {}
};

// The weights of bucket b that are at least lo, into s.members.
void gather(const Scratch& s, int64_t V, int64_t b, float lo, std::vector<float>& out) {
  out.clear();
  const float* e = s.e.data();
  for (int64_t v = 0; v < V; ++v)
    if (e[v] >= lo && bucket_of(e[v]) == b) out.push_back(e[v]);
}

// The threshold for top-k: the k-th largest weight; `kept` becomes the weight of the tokens at or above it.
float top_k_cut(Scratch& s, int64_t V, int64_t k, double& kept, int64_t& cut_bucket) {
  int64_t seen = 0, b = kBuckets - 1;
  double above = 0;
  for (; b > 0; --b) {
    if (seen + s.count[b] >= k) break;
    seen += s.count[b];
    above += s.mass[b];
  }
  if (b == 0) return 0.f;  // fewer than k tokens have a weight: all of them stay
  gather(s, V, b, 0.f, s.members);
  const int64_t nth = k - seen - 1;
  std::nth_element(s.members.begin(), s.members.begin() + nth, s.members.end(), std::greater<float>());
  const float cut = s.members[nth];
  for (float m : s.members) above += m >= cut ? m : 0.0;
  kept = above;
  cut_bucket = b;
  return cut;
}

// The threshold for top-p over the weights at or above lo (of total `kept`).
float top_p_cut(Scratch& s, int64_t V, float p, double kept, float lo, int64_t lo_bucket) {
  const double target = double(p) * kept;
  double before = 0;
  int64_t b = kBuckets - 1;
  for (; b > 0; --b) {
    if (s.count[b] == 0) continue;
    if (b == lo_bucket) break;  // the last bucket with kept weights: the cut is in it
    if (before + s.mass[b] >= target) break;
    before += s.mass[b];
  }
  if (b == 0) return lo;
  gather(s, V, b, lo, s.members);
  std::sort(s.members.begin(), s.members.end(), std::greater<float>());
  float cut = s.members.empty() ? lo : s.members[0];
  for (size_t i = 0; i < s.members.size();) {
    if (before >= target) break;
    const float v = s.members[i];
    cut = v;
    for (; i < s.members.size() && s.members[i] == v; ++i) before += v;
  }
  return std::max(cut, lo);
}

template <typename T>
int64_t sample_row(const T* row, int64_t V, float temperature, int64_t top_k, float top_p, float min_p, float u,
                   Scratch& s) {
  float* __restrict e = s.e.data();
  float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
  for (int64_t v = 0; v < V; ++v) {
    e[v] = static_cast<float>(row[v]);
    m = std::max(m, e[v]);
  }
  if (!std::isfinite(m)) {  // every logit masked (or +inf): the first maximum, as a greedy row would take
    int64_t v = 0;
    while (v + 1 < V && !(e[v] == m)) ++v;
    return v;
  }
  float total = 0.f;
#pragma omp simd reduction(+ : total)
  for (int64_t v = 0; v < V; ++v) {
    e[v] = servelm::exp_nonpositive((e[v] - m) / temperature);  // NaN logits get weight 0
    total += e[v];
  }
  float lo = std::numeric_limits<float>::min();  // a weight of 0 never stays
  const bool cut_k = top_k > 0 && top_k < V, cut_p = top_p < 1.f;
  if (cut_k || cut_p) {
    std::fill(s.mass.begin(), s.mass.end(), 0.0);
    std::fill(s.count.begin(), s.count.end(), 0);
    for (int64_t v = 0; v < V; ++v) {
      if (e[v] <= 0.f) continue;
      const int64_t b = bucket_of(e[v]);
      s.mass[b] += e[v];
      ++s.count[b];
    }
    double kept = total;
    int64_t lo_bucket = -1;
    if (cut_k) lo = std::max(lo, top_k_cut(s, V, top_k, kept, lo_bucket));
    if (cut_p) lo = top_p_cut(s, V, top_p, kept, lo, lo_bucket);
  }
  if (min_p > 0.f) lo = std::max(lo, min_p);
  // The draw: blocks whose kept weight the running sum passes whole are added as one sum.
  constexpr int64_t kBlock = 64;
  float kept_total = 0.f;
#pragma omp simd reduction(+ : kept_total)
  for (int64_t v = 0; v < V; ++v) kept_total += e[v] >= lo ? e[v] : 0.f;
  const float target = u * kept_total;
  float run = 0.f;
  int64_t last = -1;
  for (int64_t start = 0; start < V; start += kBlock) {
    const int64_t end = std::min(V, start + kBlock);
    float block = 0.f;
#pragma omp simd reduction(+ : block)
    for (int64_t v = start; v < end; ++v) block += e[v] >= lo ? e[v] : 0.f;
    if (block == 0.f) continue;
    if (run + block <= target) {
      run += block;
      for (int64_t v = end - 1; v >= start; --v)
        if (e[v] >= lo) {
          last = v;
          break;
        }
      continue;
    }
    for (int64_t v = start; v < end; ++v) {
      if (e[v] < lo) continue;
      last = v;
      run += e[v];
      if (run > target) return v;
    }
  }
  return last;  // rounding left the target at the very end: the last kept token
}

template <typename T>
void sample_kernel(const T* logits, int64_t n, int64_t V, const float* temperature, const int64_t* top_k,
                   const float* top_p, const float* min_p, const float* u, int64_t* out) {
  servelm::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    Scratch s(V);
    for (int64_t r = begin; r < end; ++r)
      out[r] = sample_row(logits + r * V, V, temperature[r], top_k[r], top_p[r], min_p[r], u[r], s);
  });
}

}  // namespace

// One token per row of float32 or bf16 [n, V] contiguous logits, each row with its temperature (> 0), top-k
// (0: off), top-p (1: off), min-p (0: off) and uniform number u in [0, 1).
SERVELM_API int servelm_sample_rows(const void* logits, int32_t dtype, int64_t n, int64_t V, const float* temperature,
                                    const int64_t* top_k, const float* top_p, const float* min_p, const float* u,
                                    int64_t* out) {
  return servelm::guarded([&] {
    servelm::check(V > 0, "sample_rows: an empty vocabulary");
    for (int64_t r = 0; r < n; ++r)
      servelm::check(temperature[r] > 0.f && u[r] >= 0.f && u[r] < 1.f,
                     "sample_rows: a temperature > 0 and u in [0, 1) per row");
    if (dtype == servelm::kFloat32) sample_kernel(static_cast<const float*>(logits), n, V, temperature, top_k, top_p,
                                                  min_p, u, out);
    else sample_kernel(static_cast<const servelm::bf16*>(logits), n, V, temperature, top_k, top_p, min_p, u, out);
  });
}
