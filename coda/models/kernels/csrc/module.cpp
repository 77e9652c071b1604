// coda._native: the Python bindings of Coda's kernels (issue 18). No torch here: Python passes
// data pointers and shapes (coda/models/kernels/ops.py). The GIL is released during every kernel
// call, so the server's event loop keeps serving during the engine thread's forward step.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "api.h"
#include "pool.h"

#ifndef CODA_NATIVE_SOURCE_HASH
#define CODA_NATIVE_SOURCE_HASH "unknown"
#endif

namespace py = pybind11;
namespace api = coda_native::api;

PYBIND11_MODULE(_native, m) {
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.doc() = "Coda's CPU kernels (GGUF block matmuls, row ops), built at install";
  m.attr("source_hash") = CODA_NATIVE_SOURCE_HASH;
  m.attr("canonical_order") = "lanes16-v2";  // NOTE: isa.h; change it when the order changes
  m.def("linear", &api::linear, "y[M, N] = x[M, K] @ W.T on re-laid-out GGUF blocks", nogil);
  m.def("quantize_rows", &api::quantize_rows, "the q8 mode's activation quantisation", nogil);
  m.def("attend", &api::attend, "RoPE + cache write + row-by-row paged attention", nogil);
  m.def("rms_norm", &api::rms_norm, "row-wise RMSNorm", nogil);
  m.def("add_rms_norm", &api::add_rms_norm, "x += r in place; y = rms_norm(x)", nogil);
  m.def("silu_mul", &api::silu_mul, "silu(gate) * up of [T, 2I] rows", nogil);
  m.def("gelu_tanh_mul", &api::gelu_tanh_mul, "gelu_tanh(gate) * up of [T, 2I] rows", nogil);
  m.def("kq_linear", &api::kq_linear, "y[M, N] = x[M, K] @ W.T over GGUF tensors read in place",
        nogil);
  m.def("kq_linear_q8", &api::kq_linear_q8,
        "kq_linear with Q8_K activations (K-quant tensors; llama.cpp's numerics)", nogil);
  m.def("kq_gather", &api::kq_gather, "rows of one GGUF tensor decoded to float32", nogil);
  m.def("q4_dwords", &api::q4_dwords, "Q4 tile quants into the f32 mode's dword layout", nogil);
  m.def("isas", &api::isas, "the kernel builds this CPU can run");
  m.def("isa", &api::isa, "the kernel build in use");
  m.def("set_isa", &api::set_isa, "use the named build (ValueError if unknown or not runnable)");
  m.def("set_threads", &coda_native::pool::set_threads, "size the kernels' thread pool", nogil);
  m.def("threads", &coda_native::pool::threads, "the kernels' thread count");
}
