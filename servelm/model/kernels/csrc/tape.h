// Kernel tapes: a decode step's kernel calls, recorded once by the Python layer loop and replayed from C++
// (servelm_run_tape in tape.cpp; servelm/model/tape.py records them). A kernel takes part by following its
// C entry point with SERVELM_TAPE_ENTRY(entry), which defines `entry_tape(const int64_t* argv)`: the entry
// called with each argument read from one int64 word of argv (pointers as addresses, integers as
// themselves, doubles as their bits), so every entry has the one signature the tape calls through. The
// arguments' types come from the entry's own declaration: there is no second list of them here.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#include "common.h"

namespace servelm::tape {

template <typename T>
inline T from_word(int64_t w) {
  if constexpr (std::is_pointer_v<T>) {
    return reinterpret_cast<T>(static_cast<intptr_t>(w));
  } else if constexpr (std::is_floating_point_v<T>) {
    double d;
    std::memcpy(&d, &w, sizeof(d));
    return static_cast<T>(d);
  } else {
    static_assert(std::is_integral_v<T>, "a tape word holds a pointer, an integer or a double");
    return static_cast<T>(w);
  }
}

template <typename... A, std::size_t... I>
inline int call(int (*entry)(A...), const int64_t* argv, std::index_sequence<I...>) {
  return entry(from_word<A>(argv[I])...);
}

template <typename... A>
inline int call(int (*entry)(A...), const int64_t* argv) {
  return call(entry, argv, std::index_sequence_for<A...>{});
}

template <typename... A>
constexpr int64_t arity(int (*)(A...)) {
  return sizeof...(A);
}

}  // namespace servelm::tape

// `entry_tape(argv)` and `entry_tape_arity()` (the number of words it reads, which kernel_ops.py checks
// against its own signature table when it loads the library).
#define SERVELM_TAPE_ENTRY(entry)                                                                        \
  SERVELM_API int entry##_tape(const int64_t* argv) { return servelm::tape::call(&entry, argv); }        \
  SERVELM_API int64_t entry##_tape_arity() { return servelm::tape::arity(&entry); }
