/* Molt's RMSNorm for the engine's eager steps (fp32, OpenMP): out = x * (1 / sqrt(mean(x^2) + eps)) * weight,
   one pass per row of `dim`. torch's fused op took ~38 us on a [32, 256] tensor, ~8% of the eager engine's time
   in the RL recipe; this is a few us. Large inputs split their rows over the threads. Compiled into the
   operators of ops.cpp. */
#include <math.h>
#include <stdint.h>

void molt_rms_norm(const float* x, const float* weight, float* out, int64_t rows, int64_t dim, float eps,
                   int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * dim >= 32768)
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * dim;
    float *o = out + r * dim, squares = 0.f;
#pragma omp simd reduction(+ : squares)
    for (int64_t d = 0; d < dim; ++d) squares += xr[d] * xr[d];
    float inv = 1.f / sqrtf(squares / dim + eps);
#pragma omp simd
    for (int64_t d = 0; d < dim; ++d) o[d] = xr[d] * inv * weight[d];
  }
}
