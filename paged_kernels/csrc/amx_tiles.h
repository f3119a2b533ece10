// AMX plumbing that every C++ kernel using Intel's tile unit shares (the cpu backend's attention,
// cpu_impl/csrc/amx.h; the engine's tiled matmul, engine/csrc/tiled_matmul.cpp): whether Linux
// lets this process use tile data, and the 64-byte tile configuration record of palette 1.
// Included only by builds whose flags enable AMX-TILE (Linux: arch_prctl).
#pragma once

#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace pk_amx {

// Whether this process may use AMX tile data (asked once per process: arch_prctl with
// ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA).
inline bool granted() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

// The operand of LDTILECFG: palette 1, then each tile's bytes per row and rows (unused tiles 0).
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

}  // namespace pk_amx
