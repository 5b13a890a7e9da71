// AMX helpers shared by the tile kernels: the permission request and the one tile configuration they use.
#pragma once

#include "vec.h"

#if defined(SERVELM_AVX512_BF16) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define SERVELM_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace servelm {

// Linux hands out AMX state only on request (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA).
inline bool amx_permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return ok;
}

// Every tile 16 rows of 64 bytes: 16x16 float32 or 16x32 bf16.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  TileConfig() {
    for (int t = 0; t < 8; ++t) colsb[t] = 64, rows[t] = 16;
  }
};

}  // namespace servelm
#endif
