// Helpers shared by kvrag's C++ CPU kernels (kvrag/kernels/*.cpp; kvrag/kernels/native.py builds each
// source with this directory on its include path and keys the built library by these headers too).
#pragma once

#include <cstdint>
#include <cstring>

namespace kvrag {

// float32 -> bfloat16, round to nearest even; NaN stays NaN.
inline uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

}  // namespace kvrag
