// Registers the parse_vllm op library.  The schema lives here; the CPU kernel
// registers its implementation in csrc/cpu/prefix_verify_attention.cpp and the
// CUDA kernel in csrc/cuda/prefix_verify_attention.cu (only when built).
//
// Built into the Python extension module `parse_vllm._C`.  Importing it (done
// by `import parse_vllm.ops`) runs the static registrations below.
#include <Python.h>

#include <torch/library.h>

#include "ops.h"

namespace parse_vllm {

void check_prefix_verify_inputs(
    const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_new,
    const at::Tensor& v_new, const at::Tensor& key_cache,
    const at::Tensor& value_cache, const at::Tensor& block_table,
    const at::Tensor& copy_req, const at::Tensor& copy_prefix_len,
    const at::Tensor& cu_copy_lens, double scale, double softcap,
    int64_t sliding_window) {
  TORCH_CHECK(q.dim() == 3, "prefix_verify_attention: q must be [T, Hq, D], got ", q.sizes());
  const int64_t T = q.size(0), Hq = q.size(1), D = q.size(2);
  TORCH_CHECK(k_new.dim() == 3 && v_new.dim() == 3,
              "prefix_verify_attention: k_new/v_new must be [T, Hkv, D]");
  const int64_t Hkv = k_new.size(1);
  TORCH_CHECK(k_new.size(0) == T && k_new.size(2) == D && v_new.sizes() == k_new.sizes(),
              "prefix_verify_attention: k_new ", k_new.sizes(), " / v_new ", v_new.sizes(),
              " do not match q ", q.sizes());
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0, "prefix_verify_attention: Hq=", Hq,
              " is not a multiple of Hkv=", Hkv);
  TORCH_CHECK(out.sizes() == q.sizes(), "prefix_verify_attention: out ", out.sizes(),
              " must have q's shape ", q.sizes());
  TORCH_CHECK(key_cache.dim() == 4 && value_cache.dim() == 4,
              "prefix_verify_attention: key_cache/value_cache must be 4-D views "
              "[num_blocks, block_size, Hkv, D]");
  TORCH_CHECK(key_cache.sizes() == value_cache.sizes(),
              "prefix_verify_attention: key_cache ", key_cache.sizes(),
              " and value_cache ", value_cache.sizes(), " differ");
  TORCH_CHECK(key_cache.size(2) == Hkv && key_cache.size(3) == D,
              "prefix_verify_attention: cache view ", key_cache.sizes(),
              " does not match Hkv=", Hkv, ", D=", D);
  TORCH_CHECK(block_table.dim() == 2, "prefix_verify_attention: block_table must be [R, max_blocks]");
  TORCH_CHECK(copy_req.dim() == 1 && copy_prefix_len.dim() == 1 && cu_copy_lens.dim() == 1,
              "prefix_verify_attention: copy_req/copy_prefix_len/cu_copy_lens must be 1-D");
  const int64_t C = copy_req.size(0);
  TORCH_CHECK(copy_prefix_len.size(0) == C && cu_copy_lens.size(0) == C + 1,
              "prefix_verify_attention: need copy_prefix_len [C] and cu_copy_lens [C+1] "
              "for C=", C, " copies");
  const auto dt = q.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kHalf || dt == at::kBFloat16,
              "prefix_verify_attention: dtype ", dt, " not supported (float32/float16/bfloat16)");
  for (const at::Tensor* t : {&out, &k_new, &v_new, &key_cache, &value_cache}) {
    TORCH_CHECK(t->scalar_type() == dt, "prefix_verify_attention: all of out, q, k_new, v_new, "
                "key_cache, value_cache must have one dtype; got ", t->scalar_type(), " and ", dt);
  }
  for (const at::Tensor* t : {&block_table, &copy_req, &copy_prefix_len, &cu_copy_lens}) {
    TORCH_CHECK(t->scalar_type() == at::kInt,
                "prefix_verify_attention: block_table/copy_req/copy_prefix_len/cu_copy_lens "
                "must be int32, got ", t->scalar_type());
    TORCH_CHECK(t->stride(-1) == 1 || t->size(-1) <= 1,
                "prefix_verify_attention: index tensors need a contiguous last dim");
  }
  for (const at::Tensor* t : {&out, &q, &k_new, &v_new, &key_cache, &value_cache}) {
    TORCH_CHECK(t->stride(-1) == 1 || t->size(-1) <= 1,
                "prefix_verify_attention: the head dim (last) must be contiguous");
    TORCH_CHECK(t->device() == q.device(), "prefix_verify_attention: all tensors must be on ",
                q.device(), ", one is on ", t->device());
  }
  for (const at::Tensor* t : {&block_table, &copy_req, &copy_prefix_len, &cu_copy_lens}) {
    TORCH_CHECK(t->device() == q.device(), "prefix_verify_attention: index tensors must be on ",
                q.device(), ", one is on ", t->device());
  }
  TORCH_CHECK(scale > 0.0 && std::isfinite(scale), "prefix_verify_attention: scale must be > 0");
  TORCH_CHECK(softcap >= 0.0 && std::isfinite(softcap),
              "prefix_verify_attention: softcap must be >= 0 (0 = off)");
  TORCH_CHECK(sliding_window >= 0, "prefix_verify_attention: sliding_window must be >= 0 (0 = off)");
}

}  // namespace parse_vllm

TORCH_LIBRARY(parse_vllm, m) {
  m.def(
      "prefix_verify_attention(Tensor(a!) out, Tensor q, Tensor k_new, Tensor v_new, "
      "Tensor key_cache, Tensor value_cache, Tensor block_table, Tensor copy_req, "
      "Tensor copy_prefix_len, Tensor cu_copy_lens, float scale, float softcap, "
      "int sliding_window) -> ()");
  m.def("cpu_isa() -> str", []() { return std::string(parse_vllm::cpu_isa_name()); });
  m.def("cpu_uses_brgemm(ScalarType dtype) -> bool",
        [](c10::ScalarType dt) { return parse_vllm::cpu_uses_brgemm(dt); });
}

// Shape propagation for torch.compile / fake tensors: the op only writes `out`.
TORCH_LIBRARY_IMPL(parse_vllm, Meta, m) {
  m.impl("prefix_verify_attention",
         [](at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
            const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
            const at::Tensor&, const at::Tensor&, double, double, int64_t) {});
}

// A minimal Python module so that `import parse_vllm._C` loads this library
// (no pybind11: keeps the build fast).
static struct PyModuleDef parse_vllm_c_module = {PyModuleDef_HEAD_INIT, "_C", nullptr, 0,
                                                 nullptr};
PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&parse_vllm_c_module); }
