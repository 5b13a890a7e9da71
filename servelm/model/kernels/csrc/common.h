// What every kernel file shares, with no PyTorch headers: the bf16 and fp16 element types, a parallel loop
// with at::parallel_for's split of the work, argument checks that raise, and the C entry-point wrapper.
// The kernels take raw pointers and sizes; servelm/model/kernel_ops.py checks tensors and calls them
// through ctypes, so a build parses no torch header and the library does not depend on torch's version.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <sstream>
#include <stdexcept>
#include <string>

#define SERVELM_API extern "C" __attribute__((visibility("default")))

namespace servelm {

// bfloat16: the top half of a float32. Conversion from float rounds to nearest even, NaN stays NaN, as
// c10::BFloat16 does, so results match PyTorch's bit for bit.
struct bf16 {
  uint16_t x;
  bf16() = default;
  bf16(float f) {  // NOLINT: implicit, like the type it replaces
    uint32_t u;
    std::memcpy(&u, &f, sizeof(u));
    x = f != f ? uint16_t(0x7FC0) : uint16_t((u + (((u >> 16) & 1) + 0x7FFF)) >> 16);
  }
  operator float() const {
    const uint32_t u = uint32_t(x) << 16;
    float f;
    std::memcpy(&f, &u, sizeof(f));
    return f;
  }
};

// IEEE half precision, converted in software (the generic attention path only; rounding to nearest even).
struct f16 {
  uint16_t x;
  f16() = default;
  f16(float f) {  // NOLINT
    uint32_t u;
    std::memcpy(&u, &f, sizeof(u));
    const uint32_t sign = (u >> 16) & 0x8000u, a = u & 0x7FFFFFFFu;
    if (a >= 0x7F800000u) {  // inf or NaN
      x = uint16_t(sign | 0x7C00u | (a > 0x7F800000u ? 0x200u : 0u));
    } else if (a >= 0x477FF000u) {  // rounds to beyond the largest half: inf
      x = uint16_t(sign | 0x7C00u);
    } else if (a < 0x38800000u) {  // subnormal or zero: let the float unit round (2^-24 is one half ulp)
      float v;
      std::memcpy(&v, &a, sizeof(v));
      x = uint16_t(sign | uint32_t(std::nearbyint(v * 16777216.f)));
    } else {
      const uint32_t m = a + ((a >> 13) & 1u) + 0xFFFu;  // round to nearest even at bit 13
      x = uint16_t(sign | ((m - 0x38000000u) >> 13));
    }
  }
  operator float() const {
    const uint32_t sign = uint32_t(x & 0x8000u) << 16, e = (x >> 10) & 0x1Fu, m = x & 0x3FFu;
    uint32_t u;
    if (e == 0x1F) {
      u = sign | 0x7F800000u | (m << 13);
    } else if (e != 0) {
      u = sign | ((e + 112) << 23) | (m << 13);
    } else {  // zero or subnormal: m * 2^-24
      const float v = float(m) * 5.9604644775390625e-8f;
      std::memcpy(&u, &v, sizeof(u));
      u |= sign;
    }
    float f;
    std::memcpy(&f, &u, sizeof(f));
    return f;
  }
};

// Raises std::runtime_error with the streamed message parts when `cond` is false.
template <typename... Parts>
inline void check(bool cond, const Parts&... parts) {
  if (cond) return;
  std::ostringstream s;
  (s << ... << parts);
  throw std::runtime_error(s.str());
}

// f(begin, end) over [begin, end) split into one contiguous range per thread of the OpenMP pool that
// PyTorch uses (the same libgomp, so torch.set_num_threads applies), exactly as at::parallel_for splits it:
// inline when the range is at most `grain`, or already inside a parallel region. An exception in any thread
// is rethrown here.
template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (begin >= end) return;
  const int64_t n = end - begin;
  if (n <= grain || n <= 1 || omp_in_parallel() || omp_get_max_threads() <= 1) {
    f(begin, end);
    return;
  }
  std::exception_ptr error;
#pragma omp parallel
  {
    int64_t threads = omp_get_num_threads();
    if (grain > 0) threads = std::min<int64_t>(threads, (n + grain - 1) / grain);
    const int64_t chunk = (n + threads - 1) / threads, b = begin + omp_get_thread_num() * chunk;
    if (b < end) {
      try {
        f(b, std::min(end, b + chunk));
      } catch (...) {
#pragma omp critical(servelm_error)
        if (!error) error = std::current_exception();
      }
    }
  }
  if (error) std::rethrow_exception(error);
}

// The message of the last failed call on this thread (servelm_last_error).
std::string& last_error();

// Runs an entry point's body: 0 on success, -1 with last_error() set when it threw.
template <typename F>
inline int guarded(const F& f) {
  try {
    f();
    return 0;
  } catch (const std::exception& e) {
    last_error() = e.what();
  } catch (...) {
    last_error() = "unknown error";
  }
  return -1;
}

}  // namespace servelm
