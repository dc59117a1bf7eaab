// The tensors of one call as raw pointers and element strides: what every kernel reads the
// paged operands through (the CPU op's Args, the CUDA kernels' Params), filled once from the
// checked PrefixVerifyArgs (ops.h) by fill_operands.  Host-only filling; the struct itself is
// plain data, passed to CUDA kernels by value inside Params.
#pragma once

#include <cstdint>

#include "ops.h"
#include "prefix_verify_common.h"

namespace parse_vllm {

template <typename scalar_t>
struct Operands {
  scalar_t* out;                // [T, Hq, D]
  const scalar_t* q;            // [T, Hq, D]
  const scalar_t* k_new;        // [T, Hkv, D]
  const scalar_t* v_new;        // [T, Hkv, D]
  const scalar_t* kc;           // key cache, [num_blocks, block_size, Hkv, D] strided
  const scalar_t* vc;           // value cache, likewise
  const int32_t* block_table;   // [R, max_blocks]
  int64_t out_s0, out_s1, q_s0, q_s1, kn_s0, kn_s1, vn_s0, vn_s1, bt_s0;
  pv::CacheStrides ks, vs;
};

template <typename scalar_t>
void fill_operands(Operands<scalar_t>& o, const PrefixVerifyArgs& a) {
  o.out = a.out.data_ptr<scalar_t>();
  o.q = a.q.data_ptr<scalar_t>();
  o.k_new = a.k_new.data_ptr<scalar_t>();
  o.v_new = a.v_new.data_ptr<scalar_t>();
  o.kc = a.key_cache.data_ptr<scalar_t>();
  o.vc = a.value_cache.data_ptr<scalar_t>();
  o.block_table = a.block_table.data_ptr<int32_t>();
  o.out_s0 = a.out.stride(0);
  o.out_s1 = a.out.stride(1);
  o.q_s0 = a.q.stride(0);
  o.q_s1 = a.q.stride(1);
  o.kn_s0 = a.k_new.stride(0);
  o.kn_s1 = a.k_new.stride(1);
  o.vn_s0 = a.v_new.stride(0);
  o.vn_s1 = a.v_new.stride(1);
  o.bt_s0 = a.block_table.stride(0);
  o.ks = pv::CacheStrides{a.key_cache.stride(0), a.key_cache.stride(1), a.key_cache.stride(2)};
  o.vs = pv::CacheStrides{a.value_cache.stride(0), a.value_cache.stride(1), a.value_cache.stride(2)};
}

}  // namespace parse_vllm
