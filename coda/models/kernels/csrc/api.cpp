// See api.h. Dispatch: the best build the CPU reports (__builtin_cpu_supports) is chosen at load;
// coda/models/kernels/__init__.py applies CODA_KERNEL_ISA through set_isa. All builds give the
// same bits (isa.h's canonical order), so the choice only changes speed.
#include "api.h"

#include <atomic>
#include <stdexcept>

#include "table.h"

namespace coda_native {
namespace api {
namespace {

struct Build {
  const char* name;
  const Kernels& (*table)();
  bool (*runs_here)();
};

bool always() { return true; }
#if defined(__x86_64__)
bool has_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("f16c");
}
bool has_avx512() {
  __builtin_cpu_init();
  return has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
}
#endif

const Build kBuilds[] = {
    {"scalar", kernels_scalar, always},
#if defined(__x86_64__)
    {"avx2", kernels_avx2, has_avx2},
    {"avx512", kernels_avx512, has_avx512},
#endif
};

const Kernels* best() {
  const Kernels* k = nullptr;
  for (const Build& b : kBuilds)
    if (b.runs_here()) k = &b.table();
  return k;
}

std::atomic<const Kernels*> g_active{best()};

const Kernels& active() { return *g_active.load(std::memory_order_relaxed); }

template <class T>
T* at(Ptr p) { return reinterpret_cast<T*>(p); }

void require(bool ok, const char* what) {
  if (!ok) throw std::invalid_argument(what);
}

void in_range(bool ok, const char* what) {
  if (!ok) throw std::out_of_range(what);
}

// NOTE: scratch of the calling thread, reused across calls (a decode step makes ~150).
thread_local std::vector<int8_t> t_xq;
thread_local std::vector<float> t_f32;

}  // namespace

void linear(Ptr x, int64_t M, int64_t K, Ptr sc, Ptr qs, int64_t N, int64_t kind, bool q8,
            Ptr y) {
  require(kind >= Q4_0 && kind <= Q8_0, "unknown block kind");
  require(K > 0 && K % QK == 0, "K must be a positive multiple of 32");
  require(M >= 0 && N > 0, "bad M or N");
  if (M == 0) return;
  LinearCall a{at<const float>(x), M, K, N, at<const uint16_t>(sc), at<const uint8_t>(qs),
               static_cast<int>(kind), q8, at<float>(y), nullptr, nullptr, nullptr};
  if (q8) {
    const int64_t nb = K / QK;
    t_xq.resize(static_cast<size_t>(M * nb * XQB));
    t_f32.resize(static_cast<size_t>(2 * M * nb));
    a.xq = t_xq.data();
    a.dx = t_f32.data();
    a.sx = t_f32.data() + M * nb;
  }
  active().linear(a);
}

void quantize_rows(Ptr x, int64_t M, int64_t K, Ptr q, Ptr dx, Ptr sx) {
  require(K > 0 && K % QK == 0 && M >= 0, "x must be [M, K] with K a multiple of 32");
  const int64_t nb = K / QK;
  std::vector<int8_t> wide(static_cast<size_t>(M * nb * XQB));
  active().quantize_rows(at<const float>(x), M, K, wide.data(), at<float>(dx), at<float>(sx));
  int8_t* out = at<int8_t>(q);
  for (int64_t r = 0; r < M; ++r)
    for (int64_t e = 0; e < K; ++e)
      out[r * K + e] = wide[r * nb * XQB + (e / QK) * XQB + (e % QK / 16) * 32 + e % 16];
}

void attend(Ptr qkv, Ptr cos, Ptr sin, Ptr kv, Ptr slots, Ptr seq_of, Ptr positions, Ptr tables,
            int64_t T, int64_t H, int64_t Hkv, int64_t d, int64_t blocks, int64_t bs,
            int64_t B, int64_t maxb, Ptr out, int64_t rot, int64_t window, double scale,
            Ptr qn, Ptr kn, double eps) {
  require(Hkv > 0 && H > 0 && H % Hkv == 0 && H / Hkv <= 16, "bad head counts");
  require(d == 32 || d == 64 || d == 96 || d == 128 || d == 256,
          "head_dim must be 32, 64, 96, 128 or 256");
  require(T >= 0 && blocks > 0 && bs > 0 && B >= 0 && maxb >= 0, "bad shapes");
  require(rot > 0 && rot <= d && rot % 2 == 0, "rotary dims must be even, in (0, head_dim]");
  require(window >= 0 && scale >= 0.0, "bad window or scale");
  AttendCall a{at<const float>(qkv), at<const float>(cos), at<const float>(sin), at<float>(kv),
               at<const int64_t>(slots), at<const int64_t>(seq_of), at<const int64_t>(positions),
               at<const int64_t>(tables), T, H, Hkv, d, blocks * bs, maxb, bs, 0, nullptr,
               at<float>(out), rot, window, static_cast<float>(scale), at<const float>(qn),
               at<const float>(kn), static_cast<float>(eps)};
  for (int64_t t = 0; t < T; ++t) {
    in_range(a.slot[t] >= 0 && a.slot[t] < a.slots, "slot out of range");
    in_range(a.seq[t] >= 0 && a.seq[t] < B, "sequence index out of range");
    in_range(a.pos[t] >= 0 && a.pos[t] / bs < maxb, "position beyond the block table");
    if (a.pos[t] > a.max_pos) a.max_pos = a.pos[t];
  }
  for (int64_t i = 0; i < B * maxb; ++i)
    in_range(a.tables[i] >= 0 && a.tables[i] < blocks, "block id out of range");
  if (T == 0) return;
  std::vector<float> qr(static_cast<size_t>(T * H * d));
  a.qr = qr.data();
  active().attend(a);
}

void rms_norm(Ptr x, Ptr w, double eps, Ptr y, int64_t T, int64_t D) {
  require(T >= 0 && D > 0, "bad shapes");
  active().rms_norm(at<const float>(x), at<const float>(w), static_cast<float>(eps), at<float>(y), T, D);
}

void add_rms_norm(Ptr x, Ptr r, Ptr w, double eps, Ptr y, int64_t T, int64_t D) {
  require(T >= 0 && D > 0, "bad shapes");
  active().add_rms_norm(at<float>(x), at<const float>(r), at<const float>(w), static_cast<float>(eps),
                   at<float>(y), T, D);
}

void gelu_tanh_mul(Ptr gu, Ptr y, int64_t T, int64_t I) {
  require(T >= 0 && I > 0 && I % 8 == 0, "I must be a positive multiple of 8");
  active().gelu_tanh_mul(at<const float>(gu), at<float>(y), T, I);
}

void silu_mul(Ptr gu, Ptr y, int64_t T, int64_t I) {
  require(T >= 0 && I > 0 && I % 8 == 0, "gate_up must be [T, 2I] with I a multiple of 8");
  active().silu_mul(at<const float>(gu), at<float>(y), T, I);
}

namespace {

// The segment table as structs, each checked against K (known type, whole blocks, row bytes).
std::vector<KqSeg> kq_segs(Ptr table, int64_t nseg, int64_t K) {
  require(nseg > 0 && K > 0 && K % 16 == 0, "K must be a positive multiple of 16");
  const int64_t* t = at<const int64_t>(table);
  std::vector<KqSeg> segs;
  for (int64_t s = 0; s < nseg; ++s, t += 6) {
    const int32_t type = static_cast<int32_t>(t[3]);
    const int64_t bs = ggml::block_size(type);
    require(bs > 0, "unknown ggml tensor type");
    require(K % bs == 0 && t[2] == K / bs * ggml::block_bytes(type) && t[1] > 0 && t[0] != 0,
            "a segment does not fit K (whole blocks, row bytes)");
    segs.push_back({at<const uint8_t>(static_cast<Ptr>(t[0])), t[1], t[2], type,
                    at<const int32_t>(static_cast<Ptr>(t[4])), at<const float>(static_cast<Ptr>(t[5]))});
  }
  return segs;
}

}  // namespace

void kq_linear(Ptr x, int64_t M, int64_t K, Ptr segs, int64_t nseg, Ptr y) {
  require(M >= 0, "bad M");
  const std::vector<KqSeg> table = kq_segs(segs, nseg, K);
  int64_t N = 0;
  for (const KqSeg& g : table) N += g.rows;
  if (M == 0) return;
  active().kq_linear({at<const float>(x), M, K, table.data(), static_cast<int>(table.size()), N,
                      at<float>(y)});
}

void kq_linear_q8(Ptr x, int64_t M, int64_t K, Ptr segs, int64_t nseg, Ptr y) {
  require(M >= 0, "bad M");
  const std::vector<KqSeg> table = kq_segs(segs, nseg, K);
  int64_t N = 0;
  for (const KqSeg& g : table) {
    require(g.type == ggml::Q2_K || g.type == ggml::Q3_K || g.type == ggml::Q4_K ||
                g.type == ggml::Q5_K || g.type == ggml::Q6_K,
            "q8 activations need K-quant segments (Q2_K..Q6_K)");
    N += g.rows;
  }
  if (M == 0) return;
  active().kq_linear_q8({at<const float>(x), M, K, table.data(), static_cast<int>(table.size()),
                         N, at<float>(y)});
}

void q4_dwords(Ptr qs, int64_t n) {
  require(n >= 0, "bad block count");
  uint8_t* p = at<uint8_t>(qs);
  for (int64_t b = 0; b < n; ++b, p += TILE * 16) {
    uint8_t t[TILE * 16];
    for (int g = 0; g < 2; ++g)  // NOTE: byte (g, l, j) = row 4 g + j's byte l (blocks.h)
      for (int l = 0; l < 16; ++l)
        for (int j = 0; j < 4; ++j) t[g * 64 + 4 * l + j] = p[(4 * g + j) * 16 + l];
    for (int i = 0; i < TILE * 16; ++i) p[i] = t[i];
  }
}

void kq_gather(Ptr ids, int64_t T, Ptr seg, int64_t K, Ptr out) {
  require(T >= 0, "bad T");
  const std::vector<KqSeg> table = kq_segs(seg, 1, K);
  const int64_t* id = at<const int64_t>(ids);
  for (int64_t t = 0; t < T; ++t) in_range(id[t] >= 0 && id[t] < table[0].rows, "row id out of range");
  active().kq_gather(table[0], K, id, T, at<float>(out));
}

std::vector<std::string> isas() {
  std::vector<std::string> names;
  for (const Build& b : kBuilds)
    if (b.runs_here()) names.emplace_back(b.name);
  return names;
}

std::string isa() { return active().name; }

void set_isa(const std::string& name) {
  for (const Build& b : kBuilds) {
    if (name != b.name) continue;
    if (!b.runs_here())
      throw std::invalid_argument("this CPU cannot run the " + name + " kernels");
    g_active.store(&b.table());
    return;
  }
  throw std::invalid_argument("no kernel build named " + name);
}

}  // namespace api
}  // namespace coda_native
