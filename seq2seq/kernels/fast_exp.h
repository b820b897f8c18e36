// exp(x) for x <= 0 (Cephes' expf: 2^n · p(r), |r| <= ln2 / 2; a few ulp), branch-free so
// the loop around it is vectorised; below -87 it gives ~1e-38 instead of 0.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float n = std::rint(x * 1.44269504088896341f);
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const uint32_t bits = uint32_t(int32_t(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}
