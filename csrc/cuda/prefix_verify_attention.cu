// CUDA-core kernel of the PARSE prefix-verification attention op: float32, and
// bf16 / fp16 calls the tensor-core kernel (prefix_verify_attention_tc.cu) does
// not take (rows not 16-byte aligned), or all calls with
// PARSE_VLLM_CUDA_KERNEL=cuda-core.  Ran on an H200 (2026-11-26: 97 CUDA tests
// pass; slower than generic attention, csrc/README.md).
//
// Layout and tiling (same as the CPU twin, csrc/cpu/prefix_verify_attention.cpp):
//   * copies are grouped per request (maximal runs of equal copy_req); inside a
//     group the query rows are token-major: row = (suffix token - first token of
//     the group) * G + g, for the G = Hq / Hkv query heads of one kv head, so a
//     row tile spans several copies and all heads of a GQA group;
//   * one CTA = (row tile of one group, kv head, key split).  It walks the
//     request's cached keys of its split once, in tiles of 32 keys loaded with
//     16-byte vector loads into shared memory (fp32), and applies each tile to
//     all of its rows: a row sees the cached keys [window_lo, P_copy) and, in
//     split 0, its own copy's suffix keys causally (shared visibility rules in
//     csrc/prefix_verify_common.h);
//   * long prefixes are split over gridDim.z CTAs (flash-decoding); partial
//     online-softmax states go to an fp32 workspace and a second kernel merges
//     them.  With one split the CTA writes `out` directly.
//   * math: fp32 CUDA-core FMAs (no tensor cores yet), online softmax in
//     registers, one warp per RPW rows, lane n scores key n, lane d accumulates
//     head dims d, d+32, ...
// Which CTA handles which rows is derived on the device from copy_req /
// cu_copy_lens (a serial scan over the C copies by thread 0), so the launch
// needs no host synchronisation and is CUDA-graph friendly.
// Deliberately not <ATen/cuda/CUDAContext.h>: it pulls in cuBLAS/cuSPARSE
// headers, which a bare CUDA toolkit (nvcc + cudart) does not ship.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <type_traits>

#include "../ops.h"
#include "../prefix_verify_common.h"
#include "prefix_verify_params.cuh"

namespace parse_vllm {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kKT = 32;            // keys per shared-memory tile (= warp size)
constexpr int kMinSplitKeys = 256; // never split a prefix finer than this

using cuda_params::Params;

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// Loads `n` key rows of D elements into dst (fp32, row stride dst_stride).
// Row i starts at element offset off(i) of src.  16-byte loads when allowed.
template <typename scalar_t, int D, typename OffsetFn>
__device__ __forceinline__ void load_rows(float* dst, int dst_stride, const scalar_t* src, int n,
                                          bool vec, const OffsetFn& off) {
  constexpr int EPC = 16 / sizeof(scalar_t);  // elements per 16-byte chunk
  if (vec && (D % EPC) == 0) {
    constexpr int CPR = D / EPC;  // chunks per row
    for (int i = threadIdx.x; i < n * CPR; i += kThreads) {
      const int row = i / CPR, part = i - row * CPR;
      const uint4 raw = *reinterpret_cast<const uint4*>(src + off(row) + part * EPC);
      const scalar_t* e = reinterpret_cast<const scalar_t*>(&raw);
      float* d = dst + row * dst_stride + part * EPC;
#pragma unroll
      for (int k = 0; k < EPC; ++k) d[k] = static_cast<float>(e[k]);
    }
  } else {
    for (int i = threadIdx.x; i < n * D; i += kThreads) {
      const int row = i / D, d = i - row * D;
      dst[row * dst_stride + d] = static_cast<float>(src[off(row) + d]);
    }
  }
}

template <int D, int ROWS>
struct Smem {
  static constexpr int KS = D + 1;  // padded K row: lane n reads Ks[n][d] without bank conflicts
  static constexpr int q_off = 0;
  static constexpr int k_off = q_off + ROWS * D;
  static constexpr int v_off = k_off + kKT * KS;
  static constexpr int p_off = v_off + kKT * D;
  static constexpr int floats = p_off + ROWS * kKT;
  static constexpr size_t bytes = sizeof(float) * floats;
};

template <typename scalar_t, int D, int ROWS>
__global__ void __launch_bounds__(kThreads)
    prefix_verify_attention_kernel(const Params<scalar_t> p) {
  constexpr int RPW = ROWS / kWarps;  // rows per warp
  constexpr int DPL = (D + 31) / 32;  // head dims per lane
  using SM = Smem<D, ROWS>;
  extern __shared__ float smem[];
  float* Qs = smem + SM::q_off;  // [ROWS][D], pre-scaled queries
  float* Ks = smem + SM::k_off;  // [kKT][KS]
  float* Vs = smem + SM::v_off;  // [kKT][D]
  float* Ps = smem + SM::p_off;  // [ROWS][kKT], probabilities of the current tile

  __shared__ int sh_found, sh_c0, sh_c1, sh_row0, sh_lo, sh_hi, sh_need, sh_cfirst, sh_clast;
  __shared__ int row_t[ROWS], row_p[ROWS], row_j[ROWS], row_c[ROWS];

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int h = blockIdx.y, split = blockIdx.z;

  // ---- which group / row tile is mine (serial scan of the copies)
  if (tid == 0) {
    sh_found = 0;
    int tiles = 0;
    for (int c = 0; c < p.C;) {
      const int ce = static_cast<int>(pv::group_end(p.copy_req, c, p.C));
      const int rows = (p.cu[ce] - p.cu[c]) * p.G;
      const int nt = (rows + ROWS - 1) / ROWS;
      if (static_cast<int>(blockIdx.x) < tiles + nt) {
        sh_found = 1;
        sh_c0 = c;
        sh_c1 = ce;
        sh_row0 = (static_cast<int>(blockIdx.x) - tiles) * ROWS;
        break;
      }
      tiles += nt;
      c = ce;
    }
    sh_lo = INT_MAX;
    sh_hi = 0;
    sh_need = 0;
  }
  __syncthreads();
  if (!sh_found) return;
  const int c0 = sh_c0, c1 = sh_c1;
  const int tok0 = p.cu[c0];
  const int rows_g = (p.cu[c1] - tok0) * p.G;

  // ---- my rows: token, copy, prefix length, suffix index
  if (tid < ROWS) {
    const int rho = sh_row0 + tid;
    int t = -1, P = 0, j = 0, cc = -1;
    if (rho < rows_g && tok0 + rho / p.G < p.T) {  // no row past T (cu[C] > T breaks the contract)
      t = tok0 + rho / p.G;
      cc = c0;
      while (p.cu[cc + 1] <= t) ++cc;  // skips copies without suffix tokens
      P = p.copy_prefix_len[cc];
      j = t - p.cu[cc];
      if (P > 0) {
        atomicMin(&sh_lo, static_cast<int>(pv::prefix_window_lo(P, j, p.window)));
        atomicMax(&sh_hi, P);
      }
      if (split == 0 || static_cast<int64_t>(split) * p.chunk < P) sh_need = 1;
    }
    row_t[tid] = t;
    row_p[tid] = P;
    row_j[tid] = j;
    row_c[tid] = cc;
  }
  __syncthreads();
  if (!sh_need) return;  // uniform: nothing of this split concerns my rows
  if (tid == 0) {
    sh_cfirst = row_c[0];
    int last = 0;
    for (int r = 0; r < ROWS; ++r)
      if (row_t[r] >= 0) last = r;
    sh_clast = row_c[last];
  }

  // ---- queries of my rows, pre-scaled, fp32 in shared memory
  for (int i = tid; i < ROWS * D; i += kThreads) {
    const int r = i / D, d = i - r * D;
    float v = 0.f;
    if (row_t[r] >= 0) {
      const int g = (sh_row0 + r) % p.G;
      v = static_cast<float>(p.q[row_t[r] * p.q_s0 + (h * p.G + g) * p.q_s1 + d]) * p.scale;
    }
    Qs[i] = v;
  }
  __syncthreads();  // Qs, sh_cfirst, sh_clast visible to all threads

  float acc[RPW][DPL];
  float m[RPW], l[RPW];
#pragma unroll
  for (int rr = 0; rr < RPW; ++rr) {
    m[rr] = pv::kNegInf;
    l[rr] = 0.f;
#pragma unroll
    for (int i = 0; i < DPL; ++i) acc[rr][i] = 0.f;
  }

  // One key tile (n keys in Ks / Vs) applied to the warp's rows; vis(r, n)
  // says whether row r sees key n of the tile.
  auto process_tile = [&](int n, auto vis) {
    float s[RPW];
#pragma unroll
    for (int rr = 0; rr < RPW; ++rr) s[rr] = 0.f;
    if (lane < n) {
      const float* krow = Ks + lane * SM::KS;
#pragma unroll 8
      for (int d = 0; d < D; ++d) {
        const float kd = krow[d];
#pragma unroll
        for (int rr = 0; rr < RPW; ++rr) s[rr] = fmaf(Qs[(warp * RPW + rr) * D + d], kd, s[rr]);
      }
    }
#pragma unroll
    for (int rr = 0; rr < RPW; ++rr) {
      const int r = warp * RPW + rr;
      const bool ok = row_t[r] >= 0 && lane < n && vis(r, lane);
      const float x = ok ? pv::apply_softcap(s[rr], p.softcap) : pv::kNegInf;
      const float m_new = fmaxf(m[rr], warp_max(x));
      if (m_new == pv::kNegInf) {  // row has seen nothing yet (warp-uniform)
        Ps[r * kKT + lane] = 0.f;
        continue;
      }
      const float alpha = pv::softmax_rescale(m[rr], m_new);
      const float w = pv::softmax_weight(x, m_new);
      l[rr] = l[rr] * alpha + warp_sum(w);
      m[rr] = m_new;
#pragma unroll
      for (int i = 0; i < DPL; ++i) acc[rr][i] *= alpha;
      Ps[r * kKT + lane] = w;
    }
    __syncwarp();
    for (int kk = 0; kk < n; ++kk) {
      float v[DPL];
#pragma unroll
      for (int i = 0; i < DPL; ++i) {
        const int d = lane + 32 * i;
        v[i] = d < D ? Vs[kk * D + d] : 0.f;
      }
#pragma unroll
      for (int rr = 0; rr < RPW; ++rr) {
        const float pw = Ps[(warp * RPW + rr) * kKT + kk];
#pragma unroll
        for (int i = 0; i < DPL; ++i) acc[rr][i] = fmaf(pw, v[i], acc[rr][i]);
      }
    }
  };

  // ---- walk the request's cached keys of this split, once
  const int req = p.copy_req[c0];
  const int32_t* bt_row = p.block_table + static_cast<int64_t>(req) * p.bt_s0;
  const int64_t split_lo = static_cast<int64_t>(split) * p.chunk;
  const int64_t kb = split_lo > sh_lo ? split_lo : sh_lo;
  // the last split runs to the largest prefix: a prefix past max_prefix_len costs time, never keys
  const int64_t ke = split + 1 == p.num_splits ? sh_hi : pv::pv_min64(sh_hi, split_lo + p.chunk);
  for (int64_t k0 = kb; k0 < ke; k0 += kKT) {
    const int n = static_cast<int>(pv::pv_min64(kKT, ke - k0));
    __syncthreads();  // previous tile fully consumed (and Qs ready on the first pass)
    load_rows<scalar_t, D>(Ks, SM::KS, p.kc, n, p.vec_cache, [&](int i) {
      return pv::cache_offset(bt_row, k0 + i, p.block_size, p.ks, h);
    });
    load_rows<scalar_t, D>(Vs, D, p.vc, n, p.vec_cache, [&](int i) {
      return pv::cache_offset(bt_row, k0 + i, p.block_size, p.vs, h);
    });
    __syncthreads();
    process_tile(n, [&](int r, int key) {
      return pv::prefix_key_visible(k0 + key, row_p[r], row_j[r], p.window);
    });
  }

  // ---- split 0: each copy's own suffix keys, causally
  if (split == 0) {
    for (int cc = sh_cfirst; cc <= sh_clast; ++cc) {
      const int t0 = p.cu[cc], L = p.cu[cc + 1] - t0;
      for (int j0 = 0; j0 < L; j0 += kKT) {
        const int n = min(kKT, L - j0);
        __syncthreads();
        load_rows<scalar_t, D>(Ks, SM::KS, p.k_new, n, p.vec_new, [&](int i) {
          return static_cast<int64_t>(t0 + j0 + i) * p.kn_s0 + h * p.kn_s1;
        });
        load_rows<scalar_t, D>(Vs, D, p.v_new, n, p.vec_new, [&](int i) {
          return static_cast<int64_t>(t0 + j0 + i) * p.vn_s0 + h * p.vn_s1;
        });
        __syncthreads();
        process_tile(n, [&](int r, int key) {
          return row_c[r] == cc && pv::suffix_key_visible(j0 + key, row_j[r], p.window);
        });
      }
    }
  }

  // ---- write: normalised output (one split) or the partial state
#pragma unroll
  for (int rr = 0; rr < RPW; ++rr) {
    const int r = warp * RPW + rr;
    const int t = row_t[r];
    if (t < 0) continue;
    const int hq = h * p.G + (sh_row0 + r) % p.G;
    if (p.num_splits == 1) {
      const float inv = pv::finalize_scale(l[rr]);
      scalar_t* dst = p.out + t * p.out_s0 + hq * p.out_s1;
#pragma unroll
      for (int i = 0; i < DPL; ++i) {
        const int d = lane + 32 * i;
        if (d < D) dst[d] = static_cast<scalar_t>(acc[rr][i] * inv);
      }
    } else if (split == 0 || static_cast<int64_t>(split) * p.chunk < row_p[r]) {
      const int64_t idx = (static_cast<int64_t>(split) * p.T + t) * p.Hq + hq;
      if (lane == 0) {
        p.ws_m[idx] = m[rr];
        p.ws_l[idx] = l[rr];
      }
#pragma unroll
      for (int i = 0; i < DPL; ++i) {
        const int d = lane + 32 * i;
        if (d < D) p.ws_acc[idx * D + d] = acc[rr][i];
      }
    }
  }
}

// Merges the split partial states of (token blockIdx.x, query head blockIdx.y).
// Split s holds a state for a row of copy c iff s == 0 or s * chunk < P_c (the
// writer's rule above).
template <typename scalar_t, int D>
__global__ void __launch_bounds__(128) prefix_verify_merge_kernel(const Params<scalar_t> p) {
  const int t = blockIdx.x, hq = blockIdx.y;
  if (p.C == 0 || t < p.cu[0] || t >= p.cu[p.C]) return;  // no split wrote this row (cu[C] < T): out untouched
  // copy of token t: last c with cu[c] <= t
  int lo = 0, hi = p.C;  // invariant: cu[lo] <= t < cu[hi]
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (p.cu[mid] <= t) lo = mid; else hi = mid;
  }
  const int P = p.copy_prefix_len[lo];
  int ns = static_cast<int>(pv::ceil_div(P, p.chunk));
  ns = ns < 1 ? 1 : (ns > p.num_splits ? p.num_splits : ns);
  float m_max = pv::kNegInf;
  for (int s = 0; s < ns; ++s) m_max = fmaxf(m_max, p.ws_m[(static_cast<int64_t>(s) * p.T + t) * p.Hq + hq]);
  float l = 0.f;
  for (int s = 0; s < ns; ++s) {
    const int64_t idx = (static_cast<int64_t>(s) * p.T + t) * p.Hq + hq;
    l += pv::merge_weight(p.ws_m[idx], m_max) * p.ws_l[idx];
  }
  const float inv = pv::finalize_scale(l);
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float o = 0.f;
    for (int s = 0; s < ns; ++s) {
      const int64_t idx = (static_cast<int64_t>(s) * p.T + t) * p.Hq + hq;
      const float w = pv::merge_weight(p.ws_m[idx], m_max);
      if (w != 0.f) o += w * p.ws_acc[idx * D + d];
    }
    p.out[t * p.out_s0 + hq * p.out_s1 + d] = static_cast<scalar_t>(o * inv);
  }
}

template <typename scalar_t, int D>
void launch(Params<scalar_t>& p, int64_t max_prefix_bound, cudaStream_t stream, const at::Tensor& q) {
  // Rows per CTA: 64 (8 per warp) up to D = 128; 24 for D = 256 so that the
  // shared memory (93 KB) fits the 99 KB opt-in limit of sm_86 / sm_89.
  constexpr int ROWS = D <= 128 ? 64 : 24;
  using SM = Smem<D, ROWS>;
  static_assert(ROWS % kWarps == 0, "whole rows per warp");
  const int64_t est_tiles = pv::ceil_div(static_cast<int64_t>(p.T) * p.G, ROWS);
  const int64_t max_tiles = est_tiles + p.C;  // each group adds at most one partial tile
  int device = 0, sms = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  // Split long prefixes until there are ~2 CTAs per SM.
  const int64_t max_splits = std::max<int64_t>(1, max_prefix_bound / kMinSplitKeys);
  int64_t S = std::min<int64_t>(max_splits, pv::ceil_div(2 * sms, std::max<int64_t>(1, est_tiles * p.Hkv)));
  S = std::max<int64_t>(1, std::min<int64_t>(S, 64));
  int64_t chunk = pv::ceil_div(pv::ceil_div(std::max<int64_t>(max_prefix_bound, 1), S), kKT) * kKT;
  S = std::max<int64_t>(1, pv::ceil_div(std::max<int64_t>(max_prefix_bound, 1), chunk));
  p.num_splits = static_cast<int>(S);
  p.chunk = static_cast<int>(chunk);
  at::Tensor ws;
  if (S > 1) {
    ws = at::empty({S * p.T * p.Hq * (D + 2)}, q.options().dtype(at::kFloat));
    p.ws_m = ws.data_ptr<float>();
    p.ws_l = p.ws_m + S * p.T * p.Hq;
    p.ws_acc = p.ws_l + S * p.T * p.Hq;
  }
  auto kernel = prefix_verify_attention_kernel<scalar_t, D, ROWS>;
  int smem_optin = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  TORCH_CHECK(static_cast<int64_t>(SM::bytes) <= smem_optin,
              "prefix_verify_attention (CUDA): head size ", D, " needs ", SM::bytes,
              " bytes of shared memory per block, this GPU allows ", smem_optin,
              " (sm_80 or newer is required)");
  if (SM::bytes > 48 * 1024) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(SM::bytes)));
  }
  const dim3 grid(static_cast<unsigned>(max_tiles), static_cast<unsigned>(p.Hkv), static_cast<unsigned>(S));
  kernel<<<grid, kThreads, SM::bytes, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (S > 1) {
    prefix_verify_merge_kernel<scalar_t, D>
        <<<dim3(static_cast<unsigned>(p.T), static_cast<unsigned>(p.Hq)), 128, 0, stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

}  // namespace

void prefix_verify_attention_cuda(const PrefixVerifyArgs& a) {
  // Arguments checked by check_prefix_verify_args (csrc/torch_bindings.cpp);
  // index values are not read here (that would synchronise): bad values are
  // undefined behaviour.
  const at::Tensor &q = a.q, &k_new = a.k_new, &v_new = a.v_new;
  const at::Tensor &key_cache = a.key_cache, &value_cache = a.value_cache;
  TORCH_CHECK(q.is_cuda(), "prefix_verify_attention (CUDA): tensors must be on a CUDA device");
  const c10::cuda::CUDAGuard guard(q.device());
  // bf16 / fp16 with aligned rows: the tensor-core kernel (prefix_verify_attention_tc.cu), unless
  // PARSE_VLLM_CUDA_KERNEL=cuda-core asks for this one (benchmarks compare the two): cuda_kernel_for,
  // the rule the op's cuda_kernel_version reports.
  if (q.size(0) > 0 && !cuda_core_forced() && prefix_verify_attention_cuda_tc(a)) {
    note_cuda_kernel_served(CudaKernel::kTensorCore);
    return;
  }
  const int64_t T = q.size(0), Hq = q.size(1), D = q.size(2);
  if (T == 0) return;
  TORCH_CHECK(T * Hq < (int64_t{1} << 31) && key_cache.numel() < (int64_t{1} << 62),
              "prefix_verify_attention (CUDA): problem too large");
  const int64_t max_prefix_bound = cuda_params::prefix_bound(a);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();

  auto run = [&](auto* tag) {
    using scalar_t = std::remove_pointer_t<decltype(tag)>;
    Params<scalar_t> p = cuda_params::make_params<scalar_t>(a);
    const int64_t es = sizeof(scalar_t);
    auto strides16 = [&](const at::Tensor& t) { return (D * es) % 16 == 0 && cuda_params::rows_aligned16(t); };
    p.vec_cache = strides16(key_cache) && strides16(value_cache);
    p.vec_new = strides16(k_new) && strides16(v_new);
    switch (D) {
      case 32: launch<scalar_t, 32>(p, max_prefix_bound, stream, q); break;
      case 64: launch<scalar_t, 64>(p, max_prefix_bound, stream, q); break;
      case 80: launch<scalar_t, 80>(p, max_prefix_bound, stream, q); break;
      case 96: launch<scalar_t, 96>(p, max_prefix_bound, stream, q); break;
      case 128: launch<scalar_t, 128>(p, max_prefix_bound, stream, q); break;
      case 256: launch<scalar_t, 256>(p, max_prefix_bound, stream, q); break;
      default: TORCH_CHECK(false, "prefix_verify_attention (CUDA): head size ", D,
                           " not supported (32, 64, 80, 96, 128, 256)");
    }
  };
  note_cuda_kernel_served(CudaKernel::kCudaCore);
  switch (q.scalar_type()) {  // float32 / float16 / bfloat16 only (no double instances)
    case at::kFloat: run(static_cast<float*>(nullptr)); break;
    case at::kHalf: run(static_cast<c10::Half*>(nullptr)); break;
    case at::kBFloat16: run(static_cast<c10::BFloat16*>(nullptr)); break;
    default: TORCH_CHECK(false, "prefix_verify_attention (CUDA): unsupported dtype ", q.scalar_type());
  }
}

}  // namespace parse_vllm
