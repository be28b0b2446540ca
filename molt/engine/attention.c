/* Molt's decode attention (fp32, OpenMP): each decode row's query heads over its slot's cached keys, plus
   optionally its own new key not yet in the cache. out[b, h] = softmax(q[b, h] . keys * scale) @ values, where
   keys are k[slots[b], h / group, 0:lens[b]] (then k_new[b, h / group] if given). One (row, kv head) per job:
   each cached key is read once for the group's query heads. Compiled into the operators of ops.cpp. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

static float dot(const float* a, const float* b, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t d = 0; d < n; ++d) acc += a[d] * b[d];
  return acc;
}

static void axpy(float p, const float* x, float* y, int64_t n) {
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) y[d] += p * x[d];
}

void molt_decode_attention(const float* q, const float* k, const float* v, const float* k_new, const float* v_new,
                           float* out, const int64_t* slots, const int64_t* lens, int64_t rows, int64_t kv_heads,
                           int64_t group, int64_t dim, int64_t max_len, float scale, int threads) {
#pragma omp parallel num_threads(threads)
  {
    float* scores = (float*)malloc(sizeof(float) * (max_len + 1));
#pragma omp for schedule(static)
    for (int64_t job = 0; job < rows * kv_heads; ++job) {
      int64_t b = job / kv_heads, len = lens[b];
      const float* kb = k + (slots[b] * kv_heads + job % kv_heads) * max_len * dim;
      const float* vb = v + (slots[b] * kv_heads + job % kv_heads) * max_len * dim;
      for (int64_t g = 0; g < group; ++g) {
        const float* qg = q + (job * group + g) * dim;
        float* o = out + (job * group + g) * dim;
        int64_t n = len;
        for (int64_t s = 0; s < len; ++s) scores[s] = dot(qg, kb + s * dim, dim) * scale;
        if (k_new) scores[n++] = dot(qg, k_new + job * dim, dim) * scale;
        float mx = -INFINITY, sum = 0.f;
        for (int64_t s = 0; s < n; ++s) mx = scores[s] > mx ? scores[s] : mx;
        for (int64_t s = 0; s < n; ++s) sum += (scores[s] = expf(scores[s] - mx));
        float inv = 1.f / sum;
        for (int64_t d = 0; d < dim; ++d) o[d] = 0.f;
        for (int64_t s = 0; s < len; ++s) axpy(scores[s] * inv, vb + s * dim, o, dim);
        if (k_new) axpy(scores[len] * inv, v_new + job * dim, o, dim);
      }
    }
    free(scores);
  }
}
