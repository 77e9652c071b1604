// Temporary torch binding of the K-quant kernels (kquant_kernels.h) for the JIT loader, until the
// plain extension module of issue 18 (branch k-native) hosts them. Python passes a segment table
// (int64 [nseg, 6]: data pointer, rows, row bytes, ggml type, row-map pointer, bias pointer);
// the pointed-to memory (the file's mapped bytes) is kept alive by the Python module.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <vector>

#include "kquant_kernels.h"

namespace {

std::vector<kq::Seg> segs_of(const at::Tensor& table) {
  TORCH_CHECK(table.dim() == 2 && table.size(1) == 6 && table.scalar_type() == at::kLong &&
              table.is_contiguous(), "segment table must be a contiguous int64 [nseg, 6]");
  std::vector<kq::Seg> segs;
  const int64_t* t = table.data_ptr<int64_t>();
  for (int64_t s = 0; s < table.size(0); ++s, t += 6)
    segs.push_back({reinterpret_cast<const uint8_t*>(t[0]), t[1], t[2], static_cast<int32_t>(t[3]),
                    reinterpret_cast<const int32_t*>(t[4]), reinterpret_cast<const float*>(t[5])});
  return segs;
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& table, int64_t isa) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be a contiguous float32 [M, K] tensor");
  const std::vector<kq::Seg> segs = segs_of(table);
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(kq::segs_fit(segs.data(), static_cast<int>(segs.size()), K),
              "segments do not fit K=", K);
  int64_t N = 0;
  for (const auto& g : segs) N += g.rows;
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // NOTE: any split of the outputs gives the same bits: each output is one thread's fixed loop.
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    std::vector<float> scratch(kq::scratch_floats());
    kq::linear_range_isa(static_cast<int32_t>(isa), xp, M, K, segs.data(),
                         static_cast<int>(segs.size()), n0, n1, yp, N, scratch.data());
  });
  return y;
}

at::Tensor gather(const at::Tensor& ids, const at::Tensor& table, int64_t K, int64_t isa) {
  const std::vector<kq::Seg> segs = segs_of(table);
  TORCH_CHECK(segs.size() == 1 && kq::segs_fit(segs.data(), 1, K), "one segment of K=", K);
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong && ids.is_contiguous(),
              "ids must be a contiguous int64 [T] tensor");
  const int64_t T = ids.size(0);
  const int64_t* ip = ids.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(ip[t] >= 0 && ip[t] < segs[0].rows, "row id ", ip[t], " out of range");
  at::Tensor out = at::empty({T, K}, at::TensorOptions().dtype(at::kFloat));
  kq::gather_rows(static_cast<int32_t>(isa), segs[0], K, ip, T, out.data_ptr<float>());
  return out;
}

int64_t best_isa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return kq::AVX512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return kq::AVX2;
  return kq::SCALAR;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  const auto nogil = pybind11::call_guard<pybind11::gil_scoped_release>();
  mod.def("linear", &linear, "y[M, N] = x[M, K] @ W.T over GGUF row segments", nogil);
  mod.def("gather", &gather, "rows of one segment decoded to float32", nogil);
  mod.def("best_isa", &best_isa, "the widest ISA this CPU runs (0 scalar, 1 avx2, 2 avx512)");
}
