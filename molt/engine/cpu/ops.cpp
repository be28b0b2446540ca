// Molt's CPU kernels as torch operators: `molt_kernels::gemm` (gemm.c), `molt_kernels::decode_attention`
// (attention.c) and `molt_kernels::rms_norm` (norm.c). Eager calls and compiled graphs (inductor's C++ wrapper)
// reach them through the dispatcher, with no Python per call. Built and loaded by kernels.py; the checks refuse
// any input a kernel would misread.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "attention.c"
#include "gemm.c"
#include "norm.c"

static bool fp32_cpu(const at::Tensor& t) { return t.scalar_type() == at::kFloat && t.device().is_cpu(); }

static at::Tensor gemm(const at::Tensor& x, const at::Tensor& packed, int64_t n) {
  TORCH_CHECK(fp32_cpu(x) && x.dim() >= 1 && packed.dim() == 3 && fp32_cpu(packed) && packed.is_contiguous() &&
                  packed.size(2) == NR &&
                  x.size(-1) == packed.size(1) && packed.size(0) == (n + NR - 1) / NR,
              "molt gemm: x ", x.scalar_type(), " ", x.sizes(), " on ", x.device(), " vs a packed [", n, ", ",
              packed.size(1), "] fp32 weight");
  at::Tensor a = x.reshape({-1, x.size(-1)}).contiguous();
  at::Tensor out = at::empty({a.size(0), n}, x.options());
  molt_gemm_packed(a.data_ptr<float>(), packed.data_ptr<float>(), out.data_ptr<float>(), a.size(0), a.size(1), n,
                   at::get_num_threads());
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = n;
  return out.view(sizes);
}

// q [B, H, D]; k/v cache of one layer [slots, kv_heads, T, D]; slots, lens [B] int64; k_new/v_new [B, kv_heads, D].
static at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   const at::Tensor& slots, const at::Tensor& lens,
                                   const std::optional<at::Tensor>& k_new, const std::optional<at::Tensor>& v_new,
                                   double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 4 && k.sizes() == v.sizes() && fp32_cpu(q) && fp32_cpu(k) &&
                  fp32_cpu(v) && k.is_contiguous() && v.is_contiguous() && q.size(2) == k.size(3) &&
                  q.size(1) % k.size(1) == 0 && k_new.has_value() == v_new.has_value(),
              "molt decode_attention: q ", q.sizes(), " vs cache ", k.sizes(), " (fp32 CPU, contiguous)");
  int64_t rows = q.size(0), kv_heads = k.size(1), dim = k.size(3);
  at::Tensor slots_b = slots.contiguous(), lens_b = lens.contiguous();
  TORCH_CHECK(slots_b.scalar_type() == at::kLong && lens_b.scalar_type() == at::kLong && slots_b.numel() == rows &&
                  lens_b.numel() == rows,
              "molt decode_attention: slots and lens must be int64 [", rows, "]");
  const int64_t *slot = slots_b.data_ptr<int64_t>(), *len = lens_b.data_ptr<int64_t>();
  for (int64_t b = 0; b < rows; ++b)
    TORCH_CHECK(slot[b] >= 0 && slot[b] < k.size(0) && len[b] >= 0 && len[b] <= k.size(2) && (len[b] || k_new),
                "molt decode_attention: row ", b, " reads slot ", slot[b], " length ", len[b], " of a cache ",
                k.sizes());
  at::Tensor kn, vn;
  if (k_new) {
    kn = k_new->contiguous(), vn = v_new->contiguous();
    TORCH_CHECK(fp32_cpu(kn) && fp32_cpu(vn) && kn.sizes() == vn.sizes() && kn.numel() == rows * kv_heads * dim,
                "molt decode_attention: new keys ", kn.sizes(), " for ", rows, " rows");
  }
  at::Tensor qc = q.contiguous(), out = at::empty(q.sizes(), q.options());
  molt_decode_attention(qc.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(),
                        k_new ? kn.data_ptr<float>() : nullptr, k_new ? vn.data_ptr<float>() : nullptr,
                        out.data_ptr<float>(), slot, len, rows, kv_heads, q.size(1) / kv_heads, dim, k.size(2),
                        (float)scale, at::get_num_threads());
  return out;
}

// x [..., D], weight [D].
static at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(fp32_cpu(x) && fp32_cpu(weight) && weight.dim() == 1 && x.dim() >= 1 && x.size(-1) == weight.size(0),
              "molt rms_norm: x ", x.scalar_type(), " ", x.sizes(), " vs weight ", weight.sizes(), " (fp32 CPU)");
  at::Tensor xc = x.contiguous(), wc = weight.contiguous(), out = at::empty(x.sizes(), x.options());
  molt_rms_norm(xc.data_ptr<float>(), wc.data_ptr<float>(), out.data_ptr<float>(), xc.numel() / wc.numel(),
                wc.numel(), (float)eps, at::get_num_threads());
  return out;
}

TORCH_LIBRARY(molt_kernels, m) {
  m.def("gemm(Tensor x, Tensor packed, int n) -> Tensor");
  m.impl("gemm", c10::DispatchKey::CPU, TORCH_FN(gemm));
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor slots, Tensor lens, Tensor? k_new, Tensor? v_new, "
        "float scale) -> Tensor");
  m.impl("decode_attention", c10::DispatchKey::CPU, TORCH_FN(decode_attention));
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, TORCH_FN(rms_norm));
}
