// Replays a kernel tape: a decode step's kernel calls as the Python layer loop (model/decoder.py) made them
// when model/tape.py recorded it, in the same order, with no Python between them (about
// 0.85 ms of Python-level work in a SmolLM2 batch-1 step of 10 ms at one thread, and the OpenMP workers are
// not left idle between calls). The forward pass is defined once, in Python; this file knows no layer.
#include <cstdint>
#include <cstring>
#include <string>

#include "kernels.h"
#include "tape.h"
#include "vec.h"

// tape: `words` int64 words, per call [address of an `entry_tape` function, n, n argument words]. Stops at
// the first call that fails, with its error (prefixed by the call's index) in servelm_last_error.
SERVELM_API int servelm_run_tape(const int64_t* tape, int64_t words) {
  using Entry = int (*)(const int64_t*);
  int64_t call = 0;
  for (int64_t i = 0; i < words; i += 2 + tape[i + 1], ++call) {
    const Entry entry = reinterpret_cast<Entry>(static_cast<intptr_t>(tape[i]));
    if (entry(tape + i + 2) != 0) {
      servelm::last_error() = "tape call " + std::to_string(call) + ": " + servelm::last_error();
      return -1;
    }
  }
  return 0;
}

// rows rows of row_bytes each, out_stride and x_stride bytes apart: a column slice of a fused projection
// (a step's queries or values) made contiguous, as a kernel call so that a tape holds it.
SERVELM_API int servelm_copy_rows(void* out, int64_t out_stride, const void* x, int64_t x_stride, int64_t rows,
                                  int64_t row_bytes) {
  return servelm::guarded([&] {
    servelm::check(rows >= 0 && row_bytes >= 0 && out_stride >= row_bytes, "copy_rows: bad sizes");
    char* o = static_cast<char*>(out);
    const char* p = static_cast<const char*>(x);
    for (int64_t r = 0; r < rows; ++r) std::memcpy(o + r * out_stride, p + r * x_stride, row_bytes);
  });
}
SERVELM_TAPE_ENTRY(servelm_copy_rows)

// Whether this build has the AVX512-BF16 kernels (the fused elementwise ones and the linear).
SERVELM_API int servelm_avx512_bf16_compiled() {
#ifdef SERVELM_AVX512_BF16
  return 1;
#else
  return 0;
#endif
}

std::string& servelm::last_error() {
  thread_local std::string message;
  return message;
}

SERVELM_API const char* servelm_last_error() { return servelm::last_error().c_str(); }
