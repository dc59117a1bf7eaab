// Declarations shared by the bindings (csrc/torch_bindings.cpp), the CPU twin
// (csrc/cpu/prefix_verify_attention.cpp) and the CUDA kernel
// (csrc/cuda/prefix_verify_attention.cu).  The op's contract (shapes, dtypes,
// semantics) is documented once, in parse_vllm/ops/__init__.py, and mirrored in
// csrc/README.md.
#pragma once

#include <ATen/core/Tensor.h>

namespace parse_vllm {

// Metadata checks (shapes, dtypes, devices, strides) common to every backend.
// Throws c10::Error (RuntimeError in Python) with a message naming the bad
// argument.  Does not look at tensor values (that would sync a GPU).
void check_prefix_verify_inputs(
    const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_new,
    const at::Tensor& v_new, const at::Tensor& key_cache,
    const at::Tensor& value_cache, const at::Tensor& block_table,
    const at::Tensor& copy_req, const at::Tensor& copy_prefix_len,
    const at::Tensor& cu_copy_lens, double scale, double softcap,
    int64_t sliding_window);

void prefix_verify_attention_cpu(
    at::Tensor& out, const at::Tensor& q, const at::Tensor& k_new,
    const at::Tensor& v_new, const at::Tensor& key_cache,
    const at::Tensor& value_cache, const at::Tensor& block_table,
    const at::Tensor& copy_req, const at::Tensor& copy_prefix_len,
    const at::Tensor& cu_copy_lens, double scale, double softcap,
    int64_t sliding_window);

// Only in builds with the CUDA kernel (csrc/cuda/prefix_verify_attention.cu).
void prefix_verify_attention_cuda(
    at::Tensor& out, const at::Tensor& q, const at::Tensor& k_new,
    const at::Tensor& v_new, const at::Tensor& key_cache,
    const at::Tensor& value_cache, const at::Tensor& block_table,
    const at::Tensor& copy_req, const at::Tensor& copy_prefix_len,
    const at::Tensor& cu_copy_lens, double scale, double softcap,
    int64_t sliding_window);

// Which SIMD flavour the CPU twin was compiled for ("avx512", "avx2",
// "default"); exposed as torch.ops.parse_vllm.cpu_isa().
const char* cpu_isa_name();

// Whether the CPU twin runs bf16/fp16 products through oneDNN's brgemm (AMX)
// for this dtype on this machine (PARSE_VLLM_CPU_BRGEMM=0 turns it off).
bool cpu_uses_brgemm(at::ScalarType dt);

}  // namespace parse_vllm
