// Runs one entry point of a kernel library built for another architecture, under an emulator (qemu-user), on
// inputs read from a file, and writes its output to another file: how the tests check the ARM build's
// numerics on an x86 machine (tests/kernels/test_arm_kernels.py writes the inputs and reads the outputs).
//
//   kernel_main LIBRARY decode_attention|dense_linear INPUT OUTPUT
//
// decode_attention input: int64 dtype, B, Hq, Hkv, D, block size, blocks, max blocks per table, window,
// element bytes; float64 scale; q [B, Hq, D]; the key and value caches [blocks, block size, Hkv, D]; the block
// tables [B, max blocks] and context lengths [B] (int64). Output: [B, Hq, D] in q's dtype.
// dense_linear input: int64 dtype, M, K, N, store, element bytes, has bias; x [M, K]; the packed weight
// [ceil(N / 32) * 32 * K]; the bias [N] if it has one. Output: [M, N] (N / 2 with store 1) as store says.
#include <dlfcn.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

namespace {

using Decode = int (*)(int32_t, void*, const void*, int64_t, int64_t, const void*, const void*, int64_t, int64_t,
                       int64_t, int64_t, const int64_t*, int64_t, const int64_t*, double, int64_t);
using Dense = int (*)(int32_t, void*, const void*, int64_t, int64_t, int64_t, const void*, int64_t, const void*, int);
using LastError = const char* (*)();

struct Input {
  FILE* f;
  bool ok = true;
  template <typename T>
  std::vector<T> read(int64_t n) {
    std::vector<T> v(n);
    ok = ok && std::fread(v.data(), sizeof(T), n, f) == size_t(n);
    return v;
  }
};

int decode_attention(void* lib, Input& in, std::vector<char>& out) {
  const auto h = in.read<int64_t>(10);
  const auto scale = in.read<double>(1);
  if (!in.ok) return 2;
  const int64_t dtype = h[0], B = h[1], Hq = h[2], Hkv = h[3], D = h[4], bs = h[5], blocks = h[6],
                max_blocks = h[7], window = h[8], elem = h[9];
  const auto q = in.read<char>(B * Hq * D * elem);
  const auto k = in.read<char>(blocks * bs * Hkv * D * elem), v = in.read<char>(blocks * bs * Hkv * D * elem);
  const auto tables = in.read<int64_t>(B * max_blocks), lens = in.read<int64_t>(B);
  if (!in.ok) return 2;
  out.resize(q.size());
  auto fn = reinterpret_cast<Decode>(dlsym(lib, "servelm_paged_decode_attention"));
  return fn(int32_t(dtype), out.data(), q.data(), B, Hq, k.data(), v.data(), blocks, bs, Hkv, D, tables.data(),
            max_blocks, lens.data(), scale[0], window);
}

int dense_linear(void* lib, Input& in, std::vector<char>& out) {
  const auto h = in.read<int64_t>(7);
  if (!in.ok) return 2;
  const int64_t dtype = h[0], M = h[1], K = h[2], N = h[3], store = h[4], elem = h[5], has_bias = h[6];
  const auto x = in.read<char>(M * K * elem), packed = in.read<char>((N + 31) / 32 * 32 * K * elem);
  const auto bias = in.read<char>(has_bias ? N * elem : 0);
  if (!in.ok) return 2;
  out.resize(store == 1 ? M * (N / 2) * elem : M * N * (store == 2 ? 4 : elem));
  auto fn = reinterpret_cast<Dense>(dlsym(lib, "servelm_dense_linear"));
  return fn(int32_t(dtype), out.data(), x.data(), M, K, K, packed.data(), N, has_bias ? bias.data() : nullptr,
            int(store));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 5) {
    std::fprintf(stderr, "usage: %s LIBRARY decode_attention|dense_linear INPUT OUTPUT\n", argv[0]);
    return 2;
  }
  void* lib = dlopen(argv[1], RTLD_NOW);
  if (lib == nullptr) {
    std::fprintf(stderr, "dlopen: %s\n", dlerror());
    return 2;
  }
  Input in{std::fopen(argv[3], "rb")};
  if (in.f == nullptr) return 2;
  std::vector<char> out;
  const int rc = std::strcmp(argv[2], "decode_attention") == 0 ? decode_attention(lib, in, out)
                 : std::strcmp(argv[2], "dense_linear") == 0   ? dense_linear(lib, in, out)
                                                                : 2;
  std::fclose(in.f);
  if (rc != 0) {
    const auto last_error = reinterpret_cast<const char* (*)()>(dlsym(lib, "servelm_last_error"));
    std::fprintf(stderr, "%s: %s\n", argv[2], rc == 1 || rc == -1 ? last_error() : "bad input");
    return 1;
  }
  FILE* o = std::fopen(argv[4], "wb");
  if (o == nullptr || std::fwrite(out.data(), 1, out.size(), o) != out.size()) return 2;
  std::fclose(o);
  return 0;
}
