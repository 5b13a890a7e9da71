// How far ahead, and into which cache, the float-FMA form of the AVX512 linear kernel should prefetch
// when one row streams a packed bf16 weight (batch-1 decode: servelm/model/kernels/csrc/avx512_linear.cpp,
// few_rows). The same loop as the kernel's, one thread, over a weight in huge pages that is larger than
// the L3 (from DRAM) and one that fits it (SmolLM2's 269 MB and llama-rand-60m's ~85 MB read per step),
// beside a plain read of the same bytes. Prints one JSON object, GB/s of weight read, best of 5. Build it
// with the kernels' -O3: at -O2 the prefetch variants rank differently. The L3 figures swing with the
// neighbours' use of the shared cache.
// A benchmark, not a test:
//
//   g++ -O3 -march=native bench/few_rows_read.cpp -o /tmp/few_rows_read && /tmp/few_rows_read
#include <immintrin.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

namespace {

using u16 = uint16_t;
constexpr int64_t kK = 576;  // SmolLM2's hidden size: one 32-column block is kK * 32 bf16 values

// One row times one packed 32-column block (the kernel's order: per 32 inputs, two 16-column halves of
// 16 pair lines), prefetching L2_AHEAD elements ahead into L2 and L1_AHEAD into L1 (0: not).
template <int64_t L2_AHEAD, int64_t L1_AHEAD>
__attribute__((noinline)) void one_row(const float* x, const u16* b, float* c) {
  __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
  const __m512i odd_mask = _mm512_set1_epi32(int32_t(0xFFFF0000u));
  for (int64_t k = 0; k < kK; k += 32)
    for (int h = 0; h < 2; ++h) {
      const u16* bh = b + k * 32 + h * 512;
      for (int p = 0; p < 16; ++p) {
        if (L2_AHEAD) _mm_prefetch(reinterpret_cast<const char*>(bh + p * 32 + L2_AHEAD), _MM_HINT_T1);
        if (L1_AHEAD) _mm_prefetch(reinterpret_cast<const char*>(bh + p * 32 + L1_AHEAD), _MM_HINT_T0);
        const __m512i w = _mm512_loadu_si512(bh + p * 32);
        const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
        const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(w, odd_mask));
        acc[h] = _mm512_fmadd_ps(_mm512_set1_ps(x[k + 2 * p]), even,
                                 _mm512_fmadd_ps(_mm512_set1_ps(x[k + 2 * p + 1]), odd, acc[h]));
      }
    }
  _mm512_store_ps(c, acc[0]);
  _mm512_store_ps(c + 16, acc[1]);
}

template <class Fn>
double best_gb_s(Fn fn, double bytes) {
  double best = 1e9;
  for (int t = 0; t < 5; ++t) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return bytes / best / 1e9;
}

template <int64_t L2_AHEAD, int64_t L1_AHEAD>
double stream(const float* x, const u16* w, int64_t blocks) {
  alignas(64) float c[32];
  return best_gb_s([&] {
    for (int64_t nb = 0; nb < blocks; ++nb) {
      one_row<L2_AHEAD, L1_AHEAD>(x, w + nb * 32 * kK, c);
      asm volatile("" : : "r"(c) : "memory");
    }
  }, 2.0 * kK * 32 * blocks);
}

double plain_read(const u16* w, int64_t n) {
  return best_gb_s([&] {
    __m512i a[8];
    for (auto& v : a) v = _mm512_setzero_si512();
    for (int64_t i = 0; i < n; i += 256)
      for (int j = 0; j < 8; ++j) a[j] = _mm512_add_epi32(a[j], _mm512_loadu_si512(w + i + j * 32));
    for (int j = 1; j < 8; ++j) a[0] = _mm512_add_epi32(a[0], a[j]);
    asm volatile("" : : "v"(a[0]));
  }, 2.0 * n);
}

void report(const char* name, int64_t blocks, const float* x, bool last) {
  const int64_t n = kK * 32 * blocks;
  constexpr int64_t kHuge = 2 << 20;
  void* raw = mmap(nullptr, 2 * n + kHuge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  auto* w = reinterpret_cast<u16*>((reinterpret_cast<uintptr_t>(raw) + kHuge - 1) & ~uintptr_t(kHuge - 1));
  madvise(w, 2 * n, MADV_HUGEPAGE);
  for (int64_t i = 0; i < n; ++i) w[i] = u16(0x3f80 + (i & 7));
  std::printf("  \"%s\": {\"mb\": %.0f, \"plain_read\": %.1f, \"none\": %.1f, \"l1_8kb\": %.1f, \"l2_4kb\": %.1f, "
              "\"l2_16kb_l1_8kb\": %.1f}%s\n",
              name, 2.0 * n / 1e6, plain_read(w, n), stream<0, 0>(x, w, blocks), stream<0, 4096>(x, w, blocks),
              stream<2048, 0>(x, w, blocks), stream<8192, 4096>(x, w, blocks), last ? "" : ",");
  munmap(raw, 2 * n + kHuge);
}

}  // namespace

int main() {
  alignas(64) static float x[kK];
  for (auto& v : x) v = 0.5f;
  std::printf("{\n");
  report("dram", 7500, x, false);
  report("l3", 2300, x, true);
  std::printf("}\n");
}
