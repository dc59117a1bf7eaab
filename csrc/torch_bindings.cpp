// The parse_vllm op library: the schema, the one entry point (flat schema
// arguments -> PrefixVerifyArgs, checked once, handed to the device's kernel)
// and its registrations, and the `parse_vllm._C` Python module.
//
// Built into the Python extension module `parse_vllm._C`.  Importing it (done
// by `import parse_vllm.ops`) runs the static registrations below.
#include <Python.h>

#include <torch/library.h>
#include <torch/version.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <vector>

#include "ops.h"
#include "prefix_verify_tiling.h"

namespace parse_vllm {

#define PV_CHECK(cond, ...) TORCH_CHECK(cond, "prefix_verify_attention: ", __VA_ARGS__)

void check_prefix_verify_args(const PrefixVerifyArgs& a, bool check_values) {
  PV_CHECK(a.q.dim() == 3, "q must be [T, Hq, D], got shape ", a.q.sizes());
  const int64_t T = a.q.size(0), Hq = a.q.size(1), D = a.q.size(2);
  for (const auto& [t, name] : {std::pair{&a.k_new, "k_new"}, std::pair{&a.v_new, "v_new"}}) {
    PV_CHECK(t->dim() == 3 && t->size(0) == T && t->size(2) == D, name, " must be [T=", T, ", Hkv, D=", D,
             "], got shape ", t->sizes());
  }
  PV_CHECK(a.k_new.sizes() == a.v_new.sizes(), "k_new ", a.k_new.sizes(), " and v_new ", a.v_new.sizes(),
           " differ");
  const int64_t Hkv = a.k_new.size(1);
  PV_CHECK(Hkv > 0 && Hq % Hkv == 0, "Hq=", Hq, " query heads is not a multiple of Hkv=", Hkv, " kv heads");
  PV_CHECK(std::find(kSupportedHeadSizes.begin(), kSupportedHeadSizes.end(), D) != kSupportedHeadSizes.end(),
           "head size D=", D, " not supported (supported: 32, 64, 80, 96, 128, 256)");
  PV_CHECK(a.out.sizes() == a.q.sizes(), "out must have q's shape ", a.q.sizes(), ", got ", a.out.sizes());
  for (const auto& [t, name] :
       {std::pair{&a.key_cache, "key_cache"}, std::pair{&a.value_cache, "value_cache"}}) {
    PV_CHECK(t->dim() == 4 && t->size(2) == Hkv && t->size(3) == D, name,
             " must be a [num_blocks, block_size, Hkv=", Hkv, ", D=", D, "] view, got shape ", t->sizes(),
             " (HND caches: pass cache.transpose(1, 2); FlashInfer's [num_blocks, 2, block_size, Hkv, D]: "
             "pass kv[:, 0] and kv[:, 1])");
  }
  PV_CHECK(a.key_cache.sizes() == a.value_cache.sizes(), "key_cache ", a.key_cache.sizes(), " and value_cache ",
           a.value_cache.sizes(), " differ");
  PV_CHECK(a.block_table.dim() == 2, "block_table must be [R, max_blocks], got shape ", a.block_table.sizes());
  for (const auto& [t, name] : {std::pair{&a.copy_req, "copy_req"}, std::pair{&a.copy_prefix_len, "copy_prefix_len"},
                                std::pair{&a.cu_copy_lens, "cu_copy_lens"}}) {
    PV_CHECK(t->dim() == 1, name, " must be 1-D, got shape ", t->sizes());
  }
  const int64_t C = a.copy_req.size(0);
  PV_CHECK(a.copy_prefix_len.size(0) == C, "copy_prefix_len has ", a.copy_prefix_len.size(0),
           " entries, copy_req has ", C);
  PV_CHECK(a.cu_copy_lens.size(0) == C + 1, "cu_copy_lens must have C+1=", C + 1, " entries, got ",
           a.cu_copy_lens.size(0));
  const auto dt = a.q.scalar_type();
  PV_CHECK(dt == at::kFloat || dt == at::kHalf || dt == at::kBFloat16, "q has dtype ", dt,
           "; supported: float32, float16, bfloat16");
  for (const auto& [t, name] : {std::pair{&a.out, "out"}, std::pair{&a.k_new, "k_new"}, std::pair{&a.v_new, "v_new"},
                                std::pair{&a.key_cache, "key_cache"}, std::pair{&a.value_cache, "value_cache"}}) {
    PV_CHECK(t->scalar_type() == dt, name, " has dtype ", t->scalar_type(), ", q has ", dt, " (all must match)");
  }
  for (const auto& [t, name] : {std::pair{&a.block_table, "block_table"}, std::pair{&a.copy_req, "copy_req"},
                                std::pair{&a.copy_prefix_len, "copy_prefix_len"},
                                std::pair{&a.cu_copy_lens, "cu_copy_lens"}}) {
    PV_CHECK(t->scalar_type() == at::kInt, name, " must be int32, got ", t->scalar_type());
    PV_CHECK(t->numel() <= 1 || t->stride(-1) == 1, name, " needs a contiguous last dim (strides ", t->strides(), ")");
    PV_CHECK(t->device() == a.q.device(), name, " is on ", t->device(), ", q on ", a.q.device(),
             " (all tensors must share a device)");
  }
  for (const auto& [t, name] : {std::pair{&a.out, "out"}, std::pair{&a.q, "q"}, std::pair{&a.k_new, "k_new"},
                                std::pair{&a.v_new, "v_new"}, std::pair{&a.key_cache, "key_cache"},
                                std::pair{&a.value_cache, "value_cache"}}) {
    PV_CHECK(t->device() == a.q.device(), name, " is on ", t->device(), ", q on ", a.q.device(),
             " (all tensors must share a device)");
    PV_CHECK(t->size(-1) <= 1 || t->stride(-1) == 1, name,
             " must have a contiguous head dim (last stride 1), got strides ", t->strides());
  }
  PV_CHECK(a.scale > 0.0 && std::isfinite(a.scale), "scale must be a finite float > 0, got ", a.scale);
  PV_CHECK(a.softcap >= 0.0 && std::isfinite(a.softcap), "softcap must be >= 0 (0 = off), got ", a.softcap);
  PV_CHECK(a.sliding_window >= 0, "sliding_window must be >= 0 (0 = off), got ", a.sliding_window);
  PV_CHECK(a.max_prefix_len >= 0, "max_prefix_len must be >= 0 (0 = bounded by the block table), got ",
           a.max_prefix_len);

  if (!check_values || !a.copy_req.device().is_cpu()) return;  // values: only where reading them is free
  const int32_t* cu = a.cu_copy_lens.data_ptr<int32_t>();
  const int32_t* req = a.copy_req.data_ptr<int32_t>();
  const int32_t* plen = a.copy_prefix_len.data_ptr<int32_t>();
  const int32_t* bt = a.block_table.data_ptr<int32_t>();
  const int64_t R = a.block_table.size(0), max_blocks = a.block_table.size(1), bt_s0 = a.block_table.stride(0);
  const int64_t num_blocks = a.key_cache.size(0), block_size = a.key_cache.size(1);
  PV_CHECK(C == 0 || cu[0] == 0, "cu_copy_lens[0] must be 0, got ", cu[0]);
  PV_CHECK(cu[C] == T, "cu_copy_lens[-1]=", cu[C], " must equal the number of suffix tokens T=", T);
  for (int64_t c = 0; c < C; ++c) {
    PV_CHECK(cu[c + 1] >= cu[c], "cu_copy_lens must be non-decreasing (cu[", c, "]=", cu[c], ", cu[", c + 1,
             "]=", cu[c + 1], ")");
    PV_CHECK(req[c] >= 0 && req[c] < R, "copy_req[", c, "]=", req[c], " is not a block-table row (R=", R, ")");
    PV_CHECK(plen[c] >= 0, "copy_prefix_len[", c, "]=", plen[c], " is negative");
    PV_CHECK(a.max_prefix_len == 0 || plen[c] <= a.max_prefix_len, "copy_prefix_len[", c, "]=", plen[c],
             " exceeds max_prefix_len=", a.max_prefix_len);
    PV_CHECK(plen[c] <= max_blocks * block_size, "copy_prefix_len[", c, "]=", plen[c],
             " is longer than the block table holds (", max_blocks, " blocks x ", block_size, " tokens = ",
             max_blocks * block_size, ")");
    const int64_t nb = (plen[c] + block_size - 1) / block_size;
    for (int64_t b = 0; b < nb; ++b) {
      const int32_t pb = bt[req[c] * bt_s0 + b];
      PV_CHECK(pb >= 0 && pb < num_blocks, "block_table row ", req[c], " names blocks outside the cache (0..",
               num_blocks - 1, "): block_table[", req[c], ", ", b, "]=", pb);
    }
  }
}

#undef PV_CHECK

namespace {

void prefix_verify_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_new, const at::Tensor& v_new,
                             const at::Tensor& key_cache, const at::Tensor& value_cache,
                             const at::Tensor& block_table, const at::Tensor& copy_req,
                             const at::Tensor& copy_prefix_len, const at::Tensor& cu_copy_lens, double scale,
                             double softcap, int64_t sliding_window, int64_t max_prefix_len) {
  const PrefixVerifyArgs a{out,         q,        k_new,           v_new,        key_cache, value_cache,
                           block_table, copy_req, copy_prefix_len, cu_copy_lens, scale,     softcap,
                           sliding_window, max_prefix_len};
  check_prefix_verify_args(a);
  if (a.q.size(0) == 0) return;
  if (a.q.is_cuda()) {
#ifdef PARSE_VLLM_WITH_CUDA
    prefix_verify_attention_cuda(a);
#else
    TORCH_CHECK(false, "prefix_verify_attention: this build has no CUDA kernel");
#endif
  } else {
    prefix_verify_attention_cpu(a);
  }
}

// The tensor-core kernel's schedule run on the host (tests/test_kernel_tc_schedule.py): same
// arguments as the op (CPU tensors), the GPU's SM count for the split plan, the pair counter, and
// whether the index values are checked (false: as a call with its indices on a GPU, unchecked).
void prefix_verify_tc_emulate_op(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_new,
                                 const at::Tensor& v_new, const at::Tensor& key_cache,
                                 const at::Tensor& value_cache, const at::Tensor& block_table,
                                 const at::Tensor& copy_req, const at::Tensor& copy_prefix_len,
                                 const at::Tensor& cu_copy_lens, double scale, double softcap,
                                 int64_t sliding_window, int64_t max_prefix_len, int64_t num_sms,
                                 at::Tensor& visits, bool check_values) {
  const PrefixVerifyArgs a{out,         q,        k_new,           v_new,        key_cache, value_cache,
                           block_table, copy_req, copy_prefix_len, cu_copy_lens, scale,     softcap,
                           sliding_window, max_prefix_len};
  check_prefix_verify_args(a, check_values);
  TORCH_CHECK(q.device().is_cpu(), "prefix_verify_tc_emulate: CPU tensors only");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf,
              "prefix_verify_tc_emulate: the tensor-core kernel takes bfloat16 / float16, got ", q.scalar_type());
  TORCH_CHECK(num_sms > 0, "prefix_verify_tc_emulate: num_sms must be > 0, got ", num_sms);
  TORCH_CHECK(visits.dim() == 3 && visits.size(0) == q.size(0) && visits.size(1) == q.size(1) &&
                  visits.size(2) >= q.size(0) && visits.scalar_type() == at::kInt && visits.is_contiguous(),
              "prefix_verify_tc_emulate: visits must be a contiguous int32 [T, Hq, K + T], got ", visits.sizes());
  if (q.size(0) == 0) return;
  prefix_verify_tc_emulate(a, num_sms, visits);
}

std::atomic<int> g_last_cuda_kernel{0};

// The tensor-core kernel's launch plan for a call of these sizes on a GPU of `num_sms` SMs
// (tests/test_kernel_tc_schedule.py): [splits, chunk, row tiles bound, CTAs, rows a tile, keys a tile].
std::vector<int64_t> prefix_verify_tc_plan(int64_t max_prefix_len, int64_t T, int64_t C, int64_t G, int64_t Hkv,
                                           int64_t num_sms, int64_t head_size) {
  TORCH_CHECK(T >= 0 && C >= 0 && G > 0 && Hkv > 0 && num_sms > 0, "prefix_verify_tc_plan: bad sizes");
  TORCH_CHECK(std::find(kSupportedHeadSizes.begin(), kSupportedHeadSizes.end(), head_size) != kSupportedHeadSizes.end(),
              "prefix_verify_tc_plan: head size ", head_size, " not supported");
  const pv::TcTile tile = pv::tc_tile(head_size);
  const int64_t est = pv::ceil_div(T * G, tile.rows), bound = pv::max_row_tiles(T, C, G, tile.rows);
  const pv::SplitPlan sp = pv::plan_splits(max_prefix_len, est, Hkv, pv::kTcCtasPerSm * num_sms, tile.keys);
  return {sp.num_splits, sp.chunk, bound, bound * Hkv * sp.num_splits, tile.rows, tile.keys};
}

std::vector<int64_t> supported_head_sizes() {
  return {kSupportedHeadSizes.begin(), kSupportedHeadSizes.end()};
}

}  // namespace

#ifndef PARSE_VLLM_KERNEL_HASH
#error "PARSE_VLLM_KERNEL_HASH (a hash of csrc/, parse_vllm/ops/kernel_sources.py) is set by setup.py"
#endif
#define PV_HASH_STRINGIFY(x) #x
#define PV_HASH_XSTRINGIFY(x) PV_HASH_STRINGIFY(x)

std::string cuda_kernel_version(CudaKernel k) {
  const std::string hash = PV_HASH_XSTRINGIFY(PARSE_VLLM_KERNEL_HASH);
  switch (k) {
    case CudaKernel::kTensorCore: return "tc-" + hash;
    case CudaKernel::kCudaCore: return "cc-" + hash;
    default: return "";
  }
}

void note_cuda_kernel_served(CudaKernel k) { g_last_cuda_kernel.store(static_cast<int>(k), std::memory_order_relaxed); }

CudaKernel last_cuda_kernel_served() {
  return static_cast<CudaKernel>(g_last_cuda_kernel.load(std::memory_order_relaxed));
}

}  // namespace parse_vllm

// setup.py passes the CUDA archs as a bare comma-separated list (-DPARSE_VLLM_CUDA_ARCHS=8.0,9.0+PTX:
// no quotes or semicolons to survive the build's shell); stringified here.
#define PV_STRINGIFY(...) #__VA_ARGS__
#define PV_XSTRINGIFY(...) PV_STRINGIFY(__VA_ARGS__)
#ifdef PARSE_VLLM_CUDA_ARCHS
#define PV_CUDA_ARCHS PV_XSTRINGIFY(PARSE_VLLM_CUDA_ARCHS)
#else
#define PV_CUDA_ARCHS ""
#endif

TORCH_LIBRARY(parse_vllm, m) {
  m.def(
      "prefix_verify_attention(Tensor(a!) out, Tensor q, Tensor k_new, Tensor v_new, "
      "Tensor key_cache, Tensor value_cache, Tensor block_table, Tensor copy_req, "
      "Tensor copy_prefix_len, Tensor cu_copy_lens, float scale, float softcap, "
      "int sliding_window, int max_prefix_len=0) -> ()");
  m.def(
      "prefix_verify_tc_emulate(Tensor(a!) out, Tensor q, Tensor k_new, Tensor v_new, "
      "Tensor key_cache, Tensor value_cache, Tensor block_table, Tensor copy_req, "
      "Tensor copy_prefix_len, Tensor cu_copy_lens, float scale, float softcap, "
      "int sliding_window, int max_prefix_len, int num_sms, Tensor(b!) visits, bool check_values=True) -> ()");
  // Which CUDA kernel would serve a call of this dtype with rows 16-byte aligned or not, under
  // this process's PARSE_VLLM_CUDA_KERNEL (the verifier factory keys its recorded measurements by
  // it): "tc-<hash of csrc/>" (tensor cores) or "cc-<hash>" (CUDA cores).
  m.def("cuda_kernel_version(ScalarType dtype, bool rows_aligned=True) -> str",
        [](c10::ScalarType dt, bool rows_aligned) {
          return parse_vllm::cuda_kernel_version(parse_vllm::cuda_kernel_for(dt, rows_aligned));
        });
  // The version of the kernel that served this process's latest CUDA call ("" before any).
  m.def("last_cuda_kernel() -> str",
        []() { return parse_vllm::cuda_kernel_version(parse_vllm::last_cuda_kernel_served()); });
  m.def("prefix_verify_tc_plan(int max_prefix_len, int T, int C, int G, int Hkv, int num_sms, int head_size) -> int[]",
        &parse_vllm::prefix_verify_tc_plan);
  m.def("cpu_isa() -> str", []() { return std::string(parse_vllm::cpu_isa_name()); });
  m.def("cpu_uses_brgemm(ScalarType dtype) -> bool",
        [](c10::ScalarType dt) { return parse_vllm::cpu_uses_brgemm(dt); });
  m.def("supported_head_sizes() -> int[]", &parse_vllm::supported_head_sizes);
  // What this library was built against: the torch version its ABI is tied to, and the CUDA
  // architectures of its kernel ("8.0,9.0+PTX"; "" without CUDA).
  m.def("built_for_torch() -> str", []() {
    return std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR) + "." +
           std::to_string(TORCH_VERSION_PATCH);
  });
  m.def("cuda_archs() -> str", []() { return std::string(PV_CUDA_ARCHS); });
}

TORCH_LIBRARY_IMPL(parse_vllm, CPU, m) {
  m.impl("prefix_verify_attention", &parse_vllm::prefix_verify_attention);
  m.impl("prefix_verify_tc_emulate", &parse_vllm::prefix_verify_tc_emulate_op);
}

#ifdef PARSE_VLLM_WITH_CUDA
TORCH_LIBRARY_IMPL(parse_vllm, CUDA, m) { m.impl("prefix_verify_attention", &parse_vllm::prefix_verify_attention); }
#endif

// Shape propagation for torch.compile / fake tensors: the op only writes `out`.
TORCH_LIBRARY_IMPL(parse_vllm, Meta, m) {
  m.impl("prefix_verify_attention",
         [](at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
            const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
            double, int64_t, int64_t) {});
}

// A minimal Python module so that `import parse_vllm._C` loads this library
// (no pybind11: keeps the build fast).
static struct PyModuleDef parse_vllm_c_module = {PyModuleDef_HEAD_INIT, "_C", nullptr, 0, nullptr};
PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&parse_vllm_c_module); }
