// Molt's GEMM (gemm.c) as the torch operator `molt_kernels::gemm(x, packed, n)`: eager calls and compiled graphs
// (inductor's C++ wrapper) reach the kernel through the dispatcher, with no Python per product. Built by gemm.py.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "gemm.c"

static at::Tensor gemm(const at::Tensor& x, const at::Tensor& packed, int64_t n) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.device().is_cpu() && x.dim() >= 1 && packed.dim() == 3 &&
                  packed.scalar_type() == at::kFloat && packed.is_contiguous() && packed.size(2) == NR &&
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

TORCH_LIBRARY(molt_kernels, m) {
  m.def("gemm(Tensor x, Tensor packed, int n) -> Tensor");
  m.impl("gemm", c10::DispatchKey::CPU, TORCH_FN(gemm));
}
