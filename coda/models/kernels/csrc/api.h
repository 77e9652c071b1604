// The checked entry points of coda._native (bound by module.cpp): raw addresses of memory Python
// owns (torch tensors' data_ptr(), checked for dtype and layout by coda/models/kernels/ops.py),
// shapes, and the ISA dispatch. Every index that addresses memory (cache slots, block ids,
// positions) is range-checked here before a kernel runs: bad input is an exception, never a crash.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace coda_native {
namespace api {

using Ptr = std::uintptr_t;

void linear(Ptr x, int64_t M, int64_t K, Ptr sc, Ptr qs, int64_t N, int64_t kind, bool q8,
            Ptr y);
void quantize_rows(Ptr x, int64_t M, int64_t K, Ptr q, Ptr dx, Ptr sx);
void attend(Ptr qkv, Ptr cos, Ptr sin, Ptr kv, Ptr slots, Ptr seq_of, Ptr positions, Ptr tables,
            int64_t T, int64_t H, int64_t Hkv, int64_t d, int64_t blocks, int64_t bs,
            int64_t B, int64_t maxb, Ptr out, int64_t rot, int64_t window, double scale,
            Ptr qn, Ptr kn, double eps);
void rms_norm(Ptr x, Ptr w, double eps, Ptr y, int64_t T, int64_t D);
void add_rms_norm(Ptr x, Ptr r, Ptr w, double eps, Ptr y, int64_t T, int64_t D);
void silu_mul(Ptr gu, Ptr y, int64_t T, int64_t I);
void gelu_tanh_mul(Ptr gu, Ptr y, int64_t T, int64_t I);

// GGUF tensors read in place (issue 18): segs is an int64 [nseg, 6] table (data pointer, rows,
// row bytes, ggml type, row-map pointer or 0, bias pointer or 0), rows concatenated.
void kq_linear(Ptr x, int64_t M, int64_t K, Ptr segs, int64_t nseg, Ptr y);
// The same with Q8_K activations (kquants_q8.h); every segment a K-quant type.
void kq_linear_q8(Ptr x, int64_t M, int64_t K, Ptr segs, int64_t nseg, Ptr y);
void kq_gather(Ptr ids, int64_t T, Ptr seg, int64_t K, Ptr out);

// Q4 quants of re-laid-out tiles ([n, 8 rows, 16 bytes] per tile-block) into the f32 mode's
// dword layout, in place (blocks.h): ISA-free, the same bytes on every machine.
void q4_dwords(Ptr qs, int64_t n);

std::vector<std::string> isas();   // the builds this CPU can run, portable first
std::string isa();                 // the build in use
void set_isa(const std::string& name);  // invalid_argument: unknown or not runnable here

}  // namespace api
}  // namespace coda_native
