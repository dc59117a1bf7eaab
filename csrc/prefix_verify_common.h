// Shared math of the PARSE prefix-verification attention op.
//
// Included by both csrc/cpu/prefix_verify_attention.cpp and
// csrc/cuda/prefix_verify_attention.cu, so that the two kernels agree, by
// construction, on: which keys a query row sees (prefix / causal suffix /
// sliding window), logit soft-capping, the online-softmax recurrences
// (including the "row has seen nothing yet" case and the merge of split-KV
// partial states), the paged-cache index arithmetic, and how copies are
// grouped per request.  Everything here is header-only, has no torch
// dependency and is callable from host and device code.
//
// Positions.  Cached key i of a request sits at absolute position i.  Suffix
// token j of copy c sits at absolute position copy_prefix_len[c] + j.  A query
// at absolute position p sees a key at position k iff k <= p (causal) and, when
// sliding_window W > 0, k > p - W.  Copy c sees the cached keys [0, P_c) of its
// request (P_c = copy_prefix_len[c]) and its own suffix tokens 0..j; never the
// suffix tokens of another copy.
#pragma once

#include <cstdint>
#include <cmath>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define PV_HD __host__ __device__ __forceinline__
#else
#define PV_HD inline
#endif

namespace parse_vllm {
namespace pv {

// ---------------------------------------------------------------- visibility

// Half-open range [lo, hi) of key indices inside one key tile that a query row
// sees.  Empty when lo >= hi.
struct KeyRange {
  int64_t lo;
  int64_t hi;
};

PV_HD int64_t pv_max64(int64_t a, int64_t b) { return a > b ? a : b; }
PV_HD int64_t pv_min64(int64_t a, int64_t b) { return a < b ? a : b; }

// Lowest cached-key index visible to suffix row j of a copy with prefix P.
// (Keys k with k > (P + j) - W, i.e. k >= P + j - W + 1.)
PV_HD int64_t prefix_window_lo(int64_t prefix_len, int64_t j, int64_t window) {
  return window > 0 ? pv_max64(prefix_len + j - window + 1, 0) : 0;
}

// Cached keys visible to suffix row j: [window_lo, P).  Intersected with the
// tile [k0, k0 + n) and returned relative to k0.
PV_HD KeyRange prefix_visible_in_tile(int64_t prefix_len, int64_t j,
                                      int64_t window, int64_t k0, int64_t n) {
  const int64_t lo = prefix_window_lo(prefix_len, j, window);
  KeyRange r;
  r.lo = pv_max64(lo - k0, 0);
  r.hi = pv_min64(prefix_len - k0, n);
  return r;
}

// Own-copy suffix keys visible to suffix row j: j' in [j - W + 1, j] (causal),
// intersected with the suffix tile [j0, j0 + n), relative to j0.
PV_HD KeyRange suffix_visible_in_tile(int64_t j, int64_t window, int64_t j0,
                                      int64_t n) {
  const int64_t lo = window > 0 ? pv_max64(j - window + 1, 0) : 0;
  KeyRange r;
  r.lo = pv_max64(lo - j0, 0);
  r.hi = pv_min64(j + 1 - j0, n);
  return r;
}

// Element-wise forms (used by the CUDA kernel and the tests' mental model).
PV_HD bool prefix_key_visible(int64_t key, int64_t prefix_len, int64_t j,
                              int64_t window) {
  return key < prefix_len && key >= prefix_window_lo(prefix_len, j, window);
}
PV_HD bool suffix_key_visible(int64_t jk, int64_t jq, int64_t window) {
  return jk <= jq && (window <= 0 || jq - jk < window);
}

// ---------------------------------------------------------------- logits

// Gemma-style logit soft-capping: softcap * tanh(s / softcap); 0 = off.
// `s` is already multiplied by `scale`.
PV_HD float apply_softcap(float s, float softcap) {
  return softcap > 0.f ? softcap * tanhf(s / softcap) : s;
}

// ---------------------------------------------------------------- online softmax
//
// State of one query row: running max m, running denominator l and an
// un-normalised accumulator acc[D] (acc = sum_k exp(s_k - m) v_k).  The initial
// state is m = -inf, l = 0, acc = 0.  A row that has seen no key yet keeps
// m = -inf; every formula below is written so that this never produces NaN.

constexpr float kNegInf = -INFINITY;

// Factor by which l and acc are multiplied when the running max moves from
// m_old to m_new (m_new >= m_old).  0 when nothing was accumulated yet.
PV_HD float softmax_rescale(float m_old, float m_new) {
#if defined(__CUDA_ARCH__)
  return m_old == kNegInf ? 0.f : __expf(m_old - m_new);
#else
  return m_old == kNegInf ? 0.f : std::exp(m_old - m_new);
#endif
}

// Probability weight of a logit s given the (updated) running max m.
PV_HD float softmax_weight(float s, float m) {
#if defined(__CUDA_ARCH__)
  return s == kNegInf ? 0.f : __expf(s - m);
#else
  return s == kNegInf ? 0.f : std::exp(s - m);
#endif
}

// Merge of split-KV partial states (m_i, l_i, acc_i), i = 0..S-1:
//   M = max_i m_i;  w_i = exp(m_i - M) (0 for m_i = -inf);
//   l = sum_i w_i l_i;  out = sum_i w_i acc_i / l.
PV_HD float merge_weight(float m_i, float m_max) {
  return softmax_rescale(m_i, m_max);
}

// 1/l, or 0 for a row that saw nothing (cannot happen for a well-formed call:
// every suffix row sees at least its own token).
PV_HD float finalize_scale(float l) { return l > 0.f ? 1.f / l : 0.f; }

// ---------------------------------------------------------------- paged cache
//
// The cache is addressed as a 4-D strided view [num_blocks, block_size, Hkv, D]
// (element strides; the last dim must be contiguous).  vLLM's FlashAttention
// layout is the contiguous case; FlashInfer's [num_blocks, 2, block_size, Hkv,
// D] (K = [:, 0], V = [:, 1]) and HND [num_blocks, Hkv, block_size, D] (pass
// .transpose(1, 2)) are just other strides.
struct CacheStrides {
  int64_t block;  // stride of dim 0 (physical block)
  int64_t token;  // stride of dim 1 (slot inside the block)
  int64_t head;   // stride of dim 2 (kv head)
};

// Element offset of (request's logical token `key`, kv head `h`) given the
// request's block-table row.
PV_HD int64_t cache_offset(const int32_t* block_table_row, int64_t key,
                           int64_t block_size, const CacheStrides& s,
                           int64_t h) {
  const int64_t logical_block = key / block_size;
  const int64_t slot = key - logical_block * block_size;
  const int64_t physical = static_cast<int64_t>(block_table_row[logical_block]);
  return physical * s.block + slot * s.token + h * s.head;
}

// ---------------------------------------------------------------- grouping
//
// Copies are processed in groups: a group is a maximal run of consecutive
// copies with the same copy_req.  All copies of a group share one walk over the
// request's cached blocks.  (Copies of one request that are not consecutive
// still give correct results; they just form separate groups and the request's
// blocks are read once per group.)

// One past the last copy of the group that starts at copy c0.
PV_HD int64_t group_end(const int32_t* copy_req, int64_t c0, int64_t num_copies) {
  int64_t c = c0 + 1;
  while (c < num_copies && copy_req[c] == copy_req[c0]) ++c;
  return c;
}

// True iff copy c starts a group.
PV_HD bool is_group_start(const int32_t* copy_req, int64_t c) {
  return c == 0 || copy_req[c] != copy_req[c - 1];
}

PV_HD int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace pv
}  // namespace parse_vllm
