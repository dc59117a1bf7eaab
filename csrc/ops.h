// The op's one argument contract, shared by the bindings (csrc/torch_bindings.cpp),
// the CPU twin (csrc/cpu/prefix_verify_attention.cpp) and the CUDA kernel
// (csrc/cuda/prefix_verify_attention.cu).  What each field means is documented
// once, in parse_vllm/ops/__init__.py (PrefixVerifyMetadata and
// prefix_verify_attention), and mirrored in csrc/README.md.
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <cstdlib>
#include <string>

namespace parse_vllm {

// Head sizes the kernels are instantiated for (exposed as
// torch.ops.parse_vllm.supported_head_sizes()).
inline constexpr std::array<int64_t, 6> kSupportedHeadSizes = {32, 64, 80, 96, 128, 256};

// The arguments of one call, built once from the op's flat schema.
struct PrefixVerifyArgs {
  at::Tensor out;              // [T, Hq, D], written
  at::Tensor q;                // [T, Hq, D]
  at::Tensor k_new, v_new;     // [T, Hkv, D], the suffix tokens' keys / values (scratch)
  at::Tensor key_cache;        // [num_blocks, block_size, Hkv, D] strided view
  at::Tensor value_cache;      // same shape as key_cache
  at::Tensor block_table;      // [R, max_blocks] int32
  at::Tensor copy_req;         // [C] int32, block-table row of copy c
  at::Tensor copy_prefix_len;  // [C] int32, cached tokens copy c sees
  at::Tensor cu_copy_lens;     // [C + 1] int32, copy c owns suffix tokens [cu[c], cu[c+1])
  double scale;                // > 0
  double softcap;              // 0 = off
  int64_t sliding_window;      // 0 = off
  int64_t max_prefix_len;      // >= every copy_prefix_len (the caller knows it on the host); 0 = unknown:
                               // bounded by the block table's width (block_table.size(1) * block_size)
};

// The one check of a call's arguments (csrc/torch_bindings.cpp), before any
// kernel: shapes, dtypes, devices, strides, head size, scalars always; index
// values (cu_copy_lens consistent with T, copy_req within the block table,
// prefixes the block table holds, block ids within the cache) when the index
// tensors are on the host, where reading them costs nothing (on a GPU it would
// synchronise).  Throws c10::Error whose message starts with
// "prefix_verify_attention: " (the Python face turns it into ValueError).
// check_values = false skips the index values wherever they are: what a call
// with its indices on a GPU gets (the CPU emulator of the CUDA kernel uses it
// to run the calls a GPU would take unchecked).
void check_prefix_verify_args(const PrefixVerifyArgs& a, bool check_values = true);

void prefix_verify_attention_cpu(const PrefixVerifyArgs& a);

// Only in builds with the CUDA kernel (PARSE_VLLM_WITH_CUDA).  The tensor-core
// kernel (bf16 / fp16, 16-byte aligned rows) returns false for calls it does not
// take; prefix_verify_attention_cuda tries it first, then the CUDA-core kernel.
void prefix_verify_attention_cuda(const PrefixVerifyArgs& a);
bool prefix_verify_attention_cuda_tc(const PrefixVerifyArgs& a);

// Which CUDA kernel serves a call: the tensor-core one for bf16 / fp16 whose
// rows are 16-byte aligned (and T * Hq < 2^31), unless PARSE_VLLM_CUDA_KERNEL=
// cuda-core asks for the CUDA-core one, which serves everything else.  The one
// rule: prefix_verify_attention_cuda dispatches by it, and the op's
// cuda_kernel_version(dtype) reports it, so that the factory's recorded
// measurements are looked up under the kernel that will serve.
enum class CudaKernel : int { kNone = 0, kTensorCore = 1, kCudaCore = 2 };

inline bool cuda_core_forced() {
  const char* which = std::getenv("PARSE_VLLM_CUDA_KERNEL");
  return which != nullptr && std::string(which) == "cuda-core";
}

inline CudaKernel cuda_kernel_for(at::ScalarType dt, bool rows_aligned) {
  const bool tc_dtype = dt == at::kBFloat16 || dt == at::kHalf;
  return !cuda_core_forced() && tc_dtype && rows_aligned ? CudaKernel::kTensorCore : CudaKernel::kCudaCore;
}

// "tc-<hash>" / "cc-<hash>": the kernel and a hash of csrc/ built in by setup.py
// (parse_vllm/ops/kernel_sources.py), so that a changed kernel never inherits
// old measurements.  Defined in torch_bindings.cpp.
std::string cuda_kernel_version(CudaKernel k);

// The kernel that served the latest CUDA call of this process (kNone before
// any): the CUDA dispatcher notes it, torch.ops.parse_vllm.last_cuda_kernel()
// reports its version.  No host synchronisation: it is known at launch.
void note_cuda_kernel_served(CudaKernel k);
CudaKernel last_cuda_kernel_served();

// The CPU emulation of the tensor-core kernel's schedule and numerics
// (csrc/cpu/prefix_verify_tc_emulator.cpp): same tiling header, same split plan
// for `num_sms`; writes `out` (float32) and counts in `visits` [T, Hq, K + T]
// (int32, zeroed by the caller) how often each (row, key) pair was accumulated:
// column k < K = visits.size(2) - T for cached key k, K + tk for suffix token tk.
void prefix_verify_tc_emulate(const PrefixVerifyArgs& a, int64_t num_sms, const at::Tensor& visits);

// Which SIMD flavour the CPU twin was compiled for ("avx512", "avx2",
// "default"); exposed as torch.ops.parse_vllm.cpu_isa().
const char* cpu_isa_name();

// Whether the CPU twin runs bf16/fp16 products through oneDNN's brgemm (AMX)
// for this dtype on this machine (PARSE_VLLM_CPU_BRGEMM=0 turns it off).
bool cpu_uses_brgemm(at::ScalarType dt);

}  // namespace parse_vllm
