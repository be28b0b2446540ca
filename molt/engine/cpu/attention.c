/* Molt's decode attention (fp32, AVX2 + FMA, OpenMP): each row's query heads over its slot's cached keys, plus
   optionally its own new key not yet in the cache. A row is one token: a decoding sequence's, or in eager steps
   also a prefill token's (its length = its position + 1, which makes attention within a chunk causal).
   out[b, h] = softmax(q[b, h] . keys * scale) @ values, where keys are k[slots[b], h / group, 0:lens[b]] (then
   k_new[b, h / group] if given). One (row, kv head) per job. Latency, not memory, bounded a plain loop here, so
   a head size that is a multiple of 8 takes a path with independent accumulators throughout: four keys' dot
   products at once, a vectorized exp, and each value row mixed into two query heads' outputs 32 columns at a
   time. Other head sizes take the plain loop. Compiled into the operators of ops.cpp. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

static inline float hsum(__m256 x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* e^x for x <= 0 (softmax after the max is subtracted): Cephes' polynomial, within 2 ulp of expf down to
   -87 (values below flush to e^-87, ~1e-38, which no softmax sum can notice). */
static inline __m256 exp_neg(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

static inline const float* row_at(const float* cached, const float* own, int64_t s, int64_t len, int64_t dim) {
  return s < len ? cached + s * dim : own;
}

static float dot8(const float* a, const float* b, int64_t dim) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0;
  int64_t d = 0;
  for (; d + 16 <= dim; d += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d + 8), _mm256_loadu_ps(b + d + 8), acc1);
  }
  if (d < dim) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc0);
  return hsum(_mm256_add_ps(acc0, acc1));
}

/* p[s] = q . key_s * scale for s < n, four keys at a time (dim a multiple of 8). */
static void scores8(const float* q, const float* keys, const float* own, int64_t len, int64_t n, int64_t dim,
                    float scale, float* p) {
  int64_t s = 0;
  for (; s + 4 <= len; s += 4) {
    const float *k0 = keys + s * dim, *k1 = k0 + dim, *k2 = k1 + dim, *k3 = k2 + dim;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t d = 0; d < dim; d += 8) {
      __m256 qv = _mm256_loadu_ps(q + d);
      a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + d), a0);
      a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k1 + d), a1);
      a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k2 + d), a2);
      a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k3 + d), a3);
    }
    __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    __m128 sums = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    _mm_storeu_ps(p + s, _mm_mul_ps(sums, _mm_set1_ps(scale)));
  }
  for (; s < n; ++s) p[s] = dot8(q, row_at(keys, own, s, len, dim), dim) * scale;
}

/* p[0:n] becomes its softmax. */
static void softmax8(float* p, int64_t n) {
  __m256 mv = _mm256_set1_ps(-INFINITY);
  int64_t s = 0;
  for (; s + 8 <= n; s += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(p + s));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mv), _mm256_extractf128_ps(mv, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  float mx = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
  for (int64_t t = s; t < n; ++t) mx = p[t] > mx ? p[t] : mx;
  __m256 sv = _mm256_setzero_ps(), m = _mm256_set1_ps(mx);
  for (s = 0; s + 8 <= n; s += 8) {
    __m256 e = exp_neg(_mm256_sub_ps(_mm256_loadu_ps(p + s), m));
    _mm256_storeu_ps(p + s, e);
    sv = _mm256_add_ps(sv, e);
  }
  float sum = hsum(sv);
  for (; s < n; ++s) sum += (p[s] = expf(p[s] - mx));
  float inv = 1.f / sum;
  for (s = 0; s + 8 <= n; s += 8) _mm256_storeu_ps(p + s, _mm256_mul_ps(_mm256_loadu_ps(p + s), _mm256_set1_ps(inv)));
  for (; s < n; ++s) p[s] *= inv;
}

/* o0 = sum_s p0[s] * value_s and o1 likewise with p1 (dim a multiple of 8; o1 may alias o0 when p1 == p0). */
static void mix8(const float* p0, const float* p1, const float* values, const float* own, int64_t len, int64_t n,
                 int64_t dim, float* o0, float* o1) {
  int64_t d = 0;
  for (; d + 32 <= dim; d += 32) {
    __m256 x0 = _mm256_setzero_ps(), x1 = x0, x2 = x0, x3 = x0, y0 = x0, y1 = x0, y2 = x0, y3 = x0;
    for (int64_t s = 0; s < n; ++s) {
      const float* v = row_at(values, own, s, len, dim) + d;
      __m256 w0 = _mm256_broadcast_ss(p0 + s), w1 = _mm256_broadcast_ss(p1 + s);
      __m256 v0 = _mm256_loadu_ps(v), v1 = _mm256_loadu_ps(v + 8), v2 = _mm256_loadu_ps(v + 16),
             v3 = _mm256_loadu_ps(v + 24);
      x0 = _mm256_fmadd_ps(w0, v0, x0), x1 = _mm256_fmadd_ps(w0, v1, x1);
      x2 = _mm256_fmadd_ps(w0, v2, x2), x3 = _mm256_fmadd_ps(w0, v3, x3);
      y0 = _mm256_fmadd_ps(w1, v0, y0), y1 = _mm256_fmadd_ps(w1, v1, y1);
      y2 = _mm256_fmadd_ps(w1, v2, y2), y3 = _mm256_fmadd_ps(w1, v3, y3);
    }
    _mm256_storeu_ps(o1 + d, y0), _mm256_storeu_ps(o1 + d + 8, y1);
    _mm256_storeu_ps(o1 + d + 16, y2), _mm256_storeu_ps(o1 + d + 24, y3);
    _mm256_storeu_ps(o0 + d, x0), _mm256_storeu_ps(o0 + d + 8, x1);
    _mm256_storeu_ps(o0 + d + 16, x2), _mm256_storeu_ps(o0 + d + 24, x3);
  }
  for (; d < dim; d += 8) {
    __m256 x = _mm256_setzero_ps(), y = x;
    for (int64_t s = 0; s < n; ++s) {
      __m256 v = _mm256_loadu_ps(row_at(values, own, s, len, dim) + d);
      x = _mm256_fmadd_ps(_mm256_broadcast_ss(p0 + s), v, x), y = _mm256_fmadd_ps(_mm256_broadcast_ss(p1 + s), v, y);
    }
    _mm256_storeu_ps(o1 + d, y), _mm256_storeu_ps(o0 + d, x);
  }
}

/* The plain loop, for any head size. */
static void attend_any(const float* q, const float* keys, const float* values, const float* own_k, const float* own_v,
                       int64_t len, int64_t n, int64_t dim, float scale, float* p, float* o) {
  for (int64_t s = 0; s < n; ++s) {
    const float* key = row_at(keys, own_k, s, len, dim);
    float acc = 0.f;
    for (int64_t d = 0; d < dim; ++d) acc += q[d] * key[d];
    p[s] = acc * scale;
  }
  float mx = -INFINITY, sum = 0.f;
  for (int64_t s = 0; s < n; ++s) mx = p[s] > mx ? p[s] : mx;
  for (int64_t s = 0; s < n; ++s) sum += (p[s] = expf(p[s] - mx));
  for (int64_t d = 0; d < dim; ++d) o[d] = 0.f;
  for (int64_t s = 0; s < n; ++s) {
    const float *value = row_at(values, own_v, s, len, dim), w = p[s] / sum;
    for (int64_t d = 0; d < dim; ++d) o[d] += w * value[d];
  }
}

void molt_decode_attention(const float* q, const float* k, const float* v, const float* k_new, const float* v_new,
                           float* out, const int64_t* slots, const int64_t* lens, int64_t rows, int64_t kv_heads,
                           int64_t group, int64_t dim, int64_t max_len, float scale, int threads) {
#pragma omp parallel num_threads(threads)
  {
    float* p = (float*)malloc(sizeof(float) * 2 * (max_len + 8));
#pragma omp for schedule(static)
    for (int64_t job = 0; job < rows * kv_heads; ++job) {
      int64_t b = job / kv_heads, len = lens[b], n = len + (k_new != 0);
      int64_t at = (slots[b] * kv_heads + job % kv_heads) * max_len * dim;
      const float *keys = k + at, *values = v + at;
      const float *own_k = k_new ? k_new + job * dim : 0, *own_v = v_new ? v_new + job * dim : 0;
      for (int64_t g = 0; g < group; g += 2) {
        const float* q0 = q + (job * group + g) * dim;
        float* o0 = out + (job * group + g) * dim;
        if (dim % 8) {
          attend_any(q0, keys, values, own_k, own_v, len, n, dim, scale, p, o0);
          if (g + 1 < group) attend_any(q0 + dim, keys, values, own_k, own_v, len, n, dim, scale, p, o0 + dim);
          continue;
        }
        int pair = g + 1 < group;
        float* p1 = pair ? p + max_len + 8 : p;
        scores8(q0, keys, own_k, len, n, dim, scale, p);
        softmax8(p, n);
        if (pair) {
          scores8(q0 + dim, keys, own_k, len, n, dim, scale, p1);
          softmax8(p1, n);
        }
        mix8(p, p1, values, own_v, len, n, dim, o0, pair ? o0 + dim : o0);
      }
    }
    free(p);
  }
}
