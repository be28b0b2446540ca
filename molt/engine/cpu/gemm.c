/* Molt's fp32 GEMM for the engine's linear layers (AVX2 + FMA, OpenMP): c[m, n] = a[m, k] @ w[n, k]^T, with w
   packed once as [ceil(n / 16), k, 16] (16 output columns side by side per input feature, zero padded).
   A 6 x 16 tile keeps its 12 accumulators in registers over the whole k loop; each thread owns whole column
   panels, and a panel, read once from memory, serves every row block from cache. Compiled into the operator of
   ops.cpp by kernels.py. */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define NR 16

static inline void store_row(float* c, __m256 lo, __m256 hi, int64_t cols) {
  if (cols == NR) {
    _mm256_storeu_ps(c, lo);
    _mm256_storeu_ps(c + 8, hi);
    return;
  }
  float tmp[NR] __attribute__((aligned(32)));
  _mm256_store_ps(tmp, lo);
  _mm256_store_ps(tmp + 8, hi);
  memcpy(c, tmp, cols * sizeof(float));
}

#define ROW(r)                                        \
  if (MR > r) {                                       \
    __m256 av = _mm256_broadcast_ss(a + r * lda + p); \
    c##r##0 = _mm256_fmadd_ps(av, b0, c##r##0);       \
    c##r##1 = _mm256_fmadd_ps(av, b1, c##r##1);       \
  }
#define STORE(r) \
  if (MR > r) store_row(c + r * ldc, c##r##0, c##r##1, cols);

/* Separate accumulator variables (not an array) keep GCC from spilling them to the stack every iteration. */
#define TILE(R)                                                                                                   \
  static void tile##R(const float* a, int64_t lda, const float* b, int64_t k, float* c, int64_t ldc, int64_t cols) { \
    enum { MR = R };                                                                                              \
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00,           \
           c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;                                                 \
    for (int64_t p = 0; p < k; ++p) {                                                                             \
      __m256 b0 = _mm256_loadu_ps(b + p * NR), b1 = _mm256_loadu_ps(b + p * NR + 8);                             \
      ROW(0) ROW(1) ROW(2) ROW(3) ROW(4) ROW(5)                                                                   \
    }                                                                                                             \
    STORE(0) STORE(1) STORE(2) STORE(3) STORE(4) STORE(5)                                                         \
  }
TILE(1) TILE(2) TILE(3) TILE(4) TILE(5) TILE(6)

typedef void (*tile_fn)(const float*, int64_t, const float*, int64_t, float*, int64_t, int64_t);
static const tile_fn TILES[7] = {0, tile1, tile2, tile3, tile4, tile5, tile6};

void molt_gemm_packed(const float* a, const float* packed, float* c, int64_t m, int64_t k, int64_t n, int threads) {
  int64_t panels = (n + NR - 1) / NR;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t q = 0; q < panels; ++q) {
    int64_t cols = n - q * NR < NR ? n - q * NR : NR;
    for (int64_t i = 0; i < m; i += 6) {
      int64_t rows = m - i < 6 ? m - i : 6;
      TILES[rows](a + i * k, k, packed + q * k * NR, k, c + i * n + q * NR, n, cols);
    }
  }
}
