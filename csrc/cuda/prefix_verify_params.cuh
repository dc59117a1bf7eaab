// The kernels' view of one call: the operands (prefix_verify_operands.h, shared with the CPU
// op), the copy indices, sizes and scalars, built once from the checked PrefixVerifyArgs
// (ops.h) by make_params.  Shared by the CUDA-core kernel
// (prefix_verify_attention.cu) and the tensor-core kernel (prefix_verify_attention_tc.cu);
// each launcher sets the split fields, and the CUDA-core one its vector-load flags.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "../ops.h"
#include "../prefix_verify_common.h"
#include "../prefix_verify_operands.h"

namespace parse_vllm {
namespace cuda_params {

template <typename scalar_t>
struct Params : Operands<scalar_t> {
  const int32_t* copy_req;
  const int32_t* copy_prefix_len;
  const int32_t* cu;
  int block_size, C, T, Hq, Hkv, G;
  float scale, softcap;
  int window;
  int num_splits;  // gridDim.z
  int chunk;       // split s covers cached keys [s * chunk, (s + 1) * chunk)
  float* ws_m;     // [S, T, Hq]      (num_splits > 1; m in log2 units in the tensor-core kernel)
  float* ws_l;     // [S, T, Hq]
  float* ws_acc;   // [S, T, Hq, D]
  bool vec_cache;  // CUDA-core kernel: 16-byte loads from the caches are aligned
  bool vec_new;    // CUDA-core kernel: 16-byte loads from k_new / v_new are aligned
};

template <typename scalar_t>
Params<scalar_t> make_params(const PrefixVerifyArgs& a) {
  Params<scalar_t> p{};
  fill_operands<scalar_t>(p, a);
  p.copy_req = a.copy_req.data_ptr<int32_t>();
  p.copy_prefix_len = a.copy_prefix_len.data_ptr<int32_t>();
  p.cu = a.cu_copy_lens.data_ptr<int32_t>();
  p.block_size = static_cast<int>(a.key_cache.size(1));
  p.C = static_cast<int>(a.copy_req.size(0));
  p.T = static_cast<int>(a.q.size(0));
  p.Hq = static_cast<int>(a.q.size(1));
  p.Hkv = static_cast<int>(a.k_new.size(1));
  p.G = p.Hq / p.Hkv;
  p.scale = static_cast<float>(a.scale);
  p.softcap = static_cast<float>(a.softcap);
  p.window = static_cast<int>(a.sliding_window);
  return p;
}

// The bound the key splits are sized from: the caller's max_prefix_len, else the block
// table's width (in an engine max_model_len: a short context split as if it were long).
inline int64_t prefix_bound(const PrefixVerifyArgs& a) {
  return a.max_prefix_len > 0 ? a.max_prefix_len : a.block_table.size(1) * a.key_cache.size(1);
}

inline bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15) == 0; }

// 16-byte aligned base and every stride but the (contiguous) last one.
inline bool rows_aligned16(const at::Tensor& t) {
  bool ok = aligned16(t.data_ptr());
  for (int64_t i = 0; i + 1 < t.dim(); ++i) ok = ok && (t.stride(i) * t.element_size()) % 16 == 0;
  return ok;
}

}  // namespace cuda_params
}  // namespace parse_vllm
