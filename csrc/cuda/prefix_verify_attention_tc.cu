// Tensor-core kernel of the PARSE prefix-verification attention op (bf16 / fp16).
//
// The schedule (row tiles, key splits, staircase classification, masks) lives
// in csrc/prefix_verify_tiling.h, shared with the CPU emulator that tests it;
// this file holds what only a GPU does: the loads, the MMAs and the softmax in
// registers.  fp32 inputs and unaligned tensors go to the CUDA-core kernel
// (prefix_verify_attention.cu).
//
// One CTA = 4 warps = (row tile of kRows packed rows of one run, kv head, key
// split), all CTAs in one grid dimension with the row tile slowest
// (pv::tc_cta_coords: real tiles are dispatched before the empty ones past
// them).  Warp w owns rows [w R, w R + R), R = kWarpRows: kMTiles m16 MMA tiles
// (pv::TcShape: 2 up to D = 128, so 128 rows a CTA and every K / V fragment
// read from shared memory feeds two MMAs; 1 at D = 256, 64 rows).
//   * Q of the tile is loaded once into shared memory (bf16/fp16, padded rows).
//   * The split's cached key tiles (kKeys: 64 up to D = 80, else 32) are gathered
//     through the block table with 16-byte cp.async into a 2-stage ring, keys
//     no row sees zero-filled; tiles no row sees are never loaded.  Each key's
//     source offset (one block-table read and one division per key, not per
//     16-byte chunk) is computed two tiles ahead into shared memory: read from
//     global memory before a tile's MMAs, stored after them.
//   * S = Q K^T and O += P V by mma.sync m16n8k16 (bf16/fp16 in, fp32
//     accumulate), fragments read by ldmatrix (x4; .trans for V) from rows
//     padded by 16 bytes (conflict-free).  P is rounded to the input dtype in
//     registers, as in FA2.
//   * Each warp classifies each tile against its own rows: FULL (no mask),
//     PARTIAL (per-pair mask from each row's [lo, P)), SKIP (no MMA).
//   * Online softmax in fp32 registers, logits in log2 units (exp2).
//   * Split 0 also walks the rows' own suffix keys (k_new), causally per copy.
//   * One split: the CTA writes `out`.  Several: partial (m, l, acc) to an fp32
//     workspace, merged by prefix_verify_tc_merge_kernel in the same stream.
//     The split count (pv::plan_splits) fills whole waves and is 1, with no
//     merge launch, where one wave of unsplit CTAs covers the work; the last
//     split runs to the rows' largest prefix whatever max_prefix_len said.
// Nothing is read on the host: the grid comes from T, C, Hkv and the caller's
// max_prefix_len; the CTA finds its run and row tile on the device by a
// block-wide prefix sum of the runs' tile counts (CUDA-graph safe).
//
// Fragment layouts (PTX ISA, mma.m16n8k16, .bf16/.f16): lane = 4 * gid + tig.
//   A (16 x 16, row): a0..a7 = rows {gid, gid + 8} x cols {2 tig, 2 tig + 1, 2 tig + 8, 2 tig + 9},
//     registers {a0 a1} (gid, 2tig..) {a2 a3} (gid+8, 2tig..) {a4 a5} (gid, 2tig+8..) {a6 a7} (gid+8, 2tig+8..)
//   B (16 x 8, col): {b0 b1} = k rows 2 tig, 2 tig + 1 of col gid; {b2 b3} = k rows 2 tig + 8, + 9
//   C (16 x 8, f32): {c0 c1} = row gid, cols 2 tig, 2 tig + 1; {c2 c3} = row gid + 8, same cols
// so the C fragments of two adjacent n8 tiles of S are the A fragment of P for
// the next MMA (k = the 16 keys of those two tiles) without leaving registers.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <mutex>

#include "../ops.h"
#include "../prefix_verify_common.h"
#include "../prefix_verify_tiling.h"
#include "prefix_verify_params.cuh"

namespace parse_vllm {
namespace {

using pv::kTcThreads;
using pv::kTcWarps;

using cuda_params::Params;

// ---------------------------------------------------------------- PTX wrappers

template <typename scalar_t>
struct MmaOp;

template <>
struct MmaOp<c10::BFloat16> {
  static __device__ __forceinline__ void run(float* c, const uint32_t* a, const uint32_t* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x = lo (low 16 bits)
    return *reinterpret_cast<const uint32_t*>(&v);
  }
};

template <>
struct MmaOp<c10::Half> {
  static __device__ __forceinline__ void run(float* c, const uint32_t* a, const uint32_t* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    const __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
};

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte asynchronous copy global -> shared; src_bytes 0 zero-fills the 16 bytes.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool load) {
  const int src_bytes = load ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Four 8x8 b16 matrices from shared memory: lane l gives the address of row l % 8 of matrix
// l / 8; register i of lane l receives matrix i's elements (row l / 4, cols 2 (l % 4), +1), or
// with .trans (rows 2 (l % 4), +1 of col l / 4).
__device__ __forceinline__ void ldsm_x4(uint32_t* r, const uint16_t* row_addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(row_addr)));
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t* r, const uint16_t* row_addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(row_addr)));
}

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// Block-wide bounds: each warp reduces its rows' RowBounds, every thread merges the warps'.
__device__ __forceinline__ int warp_min_i(int x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = min(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
__device__ __forceinline__ int warp_max_i(int x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = max(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
__device__ __forceinline__ pv::RowBounds warp_bounds(pv::RowBounds b) {
  b.lo_min = warp_min_i(b.lo_min);
  b.lo_max = warp_max_i(b.lo_max);
  b.hi_min = warp_min_i(b.hi_min);
  b.hi_max = warp_max_i(b.hi_max);
  b.t_min = warp_min_i(b.t_min);
  b.t_max = warp_max_i(b.t_max);
  b.tok0_min = warp_min_i(b.tok0_min);
  return b;
}

// ---------------------------------------------------------------- shared memory

template <int D>
struct TcSmem {
  using Shape = pv::TcShape<D>;
  static constexpr int kRS = Shape::kRowStride;  // elements per padded row
  static constexpr int q_elems = Shape::kRows * kRS;
  static constexpr int kv_elems = Shape::kKeys * kRS;  // one K or V tile
  static constexpr size_t bytes = sizeof(uint16_t) * (q_elems + 2 * Shape::kStages * kv_elems);
  static_assert((kRS * 2) % 16 == 0, "padded rows keep 16-byte alignment (ldmatrix row addresses)");
  static_assert((D / 8) % 2 == 0 && (Shape::kKeys / 8) % 2 == 0, "ldmatrix.x4 loads n8 tiles in pairs");
};

// ---------------------------------------------------------------- the kernel

template <typename scalar_t, int D>
__global__ void __launch_bounds__(kTcThreads, 1)
    prefix_verify_tc_kernel(const Params<scalar_t> p) {
  using Shape = pv::TcShape<D>;
  using SM = TcSmem<D>;
  using Mma = MmaOp<scalar_t>;
  constexpr int N = Shape::kKeys;  // keys per tile
  constexpr int RS = SM::kRS;
  constexpr int NT = N / 8;        // n8 tiles of S per key tile
  constexpr int DT = D / 8;        // n8 tiles of O
  constexpr int KS = D / 16;       // k16 steps of Q K^T
  constexpr int CPR = D / 8;       // 16-byte chunks per row (8 elements of 2 bytes)
  constexpr int MT = Shape::kMTiles;  // m16 row tiles per warp
  constexpr int WR = Shape::kWarpRows;
  constexpr int ROWS = Shape::kRows;

  extern __shared__ __align__(16) uint16_t smem[];
  uint16_t* Qs = smem;
  uint16_t* Ks = smem + SM::q_elems;                         // [stage][N][RS]
  uint16_t* Vs = Ks + Shape::kStages * SM::kv_elems;         // [stage][N][RS]

  __shared__ int sh_c0, sh_c1, sh_row0, sh_found, sh_carry;
  __shared__ int sh_scan[kTcThreads];
  __shared__ pv::RowBounds sh_wb[kTcWarps];
  // each row's token (-1: no row), query head, and the keys it sees: cached [lo, P), its
  // copy's suffix tokens from tok0 (read by the masks of PARTIAL tiles: kept here, not in
  // registers, which the O and S fragments of two m16 tiles need)
  __shared__ int32_t row_t[ROWS], row_hq[ROWS], row_lo[ROWS], row_P[ROWS], row_tok0[ROWS];
  __shared__ pv::KeySource sh_src[2][N];  // key sources of tiles j (buffer j & 1)

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int gid = lane >> 2, tig = lane & 3;
  const pv::CtaCoords cta = pv::tc_cta_coords(blockIdx.x, p.Hkv, p.num_splits);
  const int h = static_cast<int>(cta.h), split = static_cast<int>(cta.split);
  const int my_tile = static_cast<int>(cta.tile);

  // ---- which run and row tile is mine: prefix sum of the runs' tile counts
  if (tid == 0) {
    sh_found = 0;
    sh_carry = 0;
  }
  __syncthreads();
  for (int base = 0; base < p.C; base += kTcThreads) {
    const int c = base + tid;
    const int n = c < p.C ? static_cast<int>(pv::run_tile_count(p.copy_req, p.cu, c, p.C, p.G, ROWS)) : 0;
    sh_scan[tid] = n;
    __syncthreads();
    for (int o = 1; o < kTcThreads; o <<= 1) {  // Hillis-Steele inclusive scan
      const int v = tid >= o ? sh_scan[tid - o] : 0;
      __syncthreads();
      sh_scan[tid] += v;
      __syncthreads();
    }
    const int first = sh_carry + sh_scan[tid] - n;  // exclusive
    if (n > 0 && my_tile >= first && my_tile < first + n) {
      sh_found = 1;
      sh_c0 = c;
      sh_c1 = static_cast<int>(pv::group_end(p.copy_req, c, p.C));
      sh_row0 = (my_tile - first) * ROWS;
    }
    __syncthreads();
    if (tid == kTcThreads - 1) sh_carry += sh_scan[tid];
    __syncthreads();
    if (sh_found) break;
  }
  if (!sh_found) return;
  const int c0 = sh_c0, c1 = sh_c1;

  // ---- my rows (gid, gid + 8 of each of my warp's m16 tiles: row index 2 mt + i) and the
  // bounds of warp and CTA
  pv::RowBounds wb = pv::empty_bounds();
#pragma unroll
  for (int i = 0; i < 2 * MT; ++i) {
    const int r = warp * WR + (i >> 1) * 16 + gid + 8 * (i & 1);
    const pv::RowInfo ri = pv::run_row(p.cu, p.copy_prefix_len, c0, c1, p.G, p.window, p.T, sh_row0 + r);
    pv::add_row(wb, ri);
    if (tig == 0) {
      row_t[r] = ri.valid ? ri.t : -1;
      row_hq[r] = h * p.G + ri.g;
      row_lo[r] = ri.lo;
      row_P[r] = ri.P;
      row_tok0[r] = ri.tok0;
    }
  }
  wb = warp_bounds(wb);
  if (lane == 0) sh_wb[warp] = wb;
  __syncthreads();
  pv::RowBounds cb = sh_wb[0];
#pragma unroll
  for (int w = 1; w < kTcWarps; ++w) cb = pv::merge_bounds(cb, sh_wb[w]);

  const pv::SplitPlan sp{p.num_splits, p.chunk};
  const pv::KeyRange cached = pv::split_key_tiles(cb, sp, split, N);
  const pv::KeyRange suffix = split == 0 ? pv::suffix_key_range(cb) : pv::KeyRange{0, 0};
  const int n_cached = cached.hi > cached.lo ? static_cast<int>(pv::ceil_div(cached.hi - cached.lo, N)) : 0;
  const int n_suffix = suffix.hi > suffix.lo ? static_cast<int>(pv::ceil_div(suffix.hi - suffix.lo, N)) : 0;
  const int n_tiles = n_cached + n_suffix;
  if (n_tiles == 0 && p.num_splits > 1 && split > 0) {
    // Nothing of this split concerns my rows: say so to the merge.
    for (int r = tid; r < ROWS; r += kTcThreads) {
      if (row_t[r] < 0) continue;
      const int64_t idx = (static_cast<int64_t>(split) * p.T + row_t[r]) * p.Hq + row_hq[r];
      p.ws_m[idx] = pv::kNegInf;
      p.ws_l[idx] = 0.f;
    }
    return;
  }

  // ---- Q of my rows -> shared memory (16-byte chunks; padding rows zero)
  for (int i = tid; i < ROWS * CPR; i += kTcThreads) {
    const int r = i / CPR, part = i - r * CPR;
    const int t = row_t[r];
    const scalar_t* src = t >= 0 ? p.q + t * p.q_s0 + row_hq[r] * p.q_s1 + part * 8 : p.q;
    cp_async16(Qs + r * RS + part * 8, src, t >= 0);
  }

  const int req = p.copy_req[c0];
  const int32_t* bt_row = p.block_table + static_cast<int64_t>(req) * p.bt_s0;

  // Tile i: cached tiles first, then suffix tiles.  Key index of slot n of tile i.
  // (keys and suffix tokens are below 2^31: prefixes are int32 and T * Hq < 2^31)
  const int cached_lo = static_cast<int>(cached.lo), suffix_lo = static_cast<int>(suffix.lo);
  auto tile_key0 = [&](int i) -> int {
    return i < n_cached ? cached_lo + i * N : suffix_lo + (i - n_cached) * N;
  };
  // Source of slot tid of tile j (threads tid < N), or nothing past the last tile.
  auto key_source = [&](int j) -> pv::KeySource {
    if (j >= n_tiles || tid >= N) return pv::KeySource{-1, -1};
    const int64_t key = tile_key0(j) + tid;
    return j < n_cached ? pv::cached_key_source(key, cached, cb, bt_row, p.block_size, p.ks, p.vs, h)
                        : pv::suffix_key_source(key, suffix, p.kn_s0, p.kn_s1, p.vn_s0, p.vn_s1, h);
  };
  auto load_tile = [&](int i, int stage) {
    uint16_t* kd = Ks + stage * SM::kv_elems;
    uint16_t* vd = Vs + stage * SM::kv_elems;
    const bool is_cached = i < n_cached;
    const scalar_t* kbase = is_cached ? p.kc : p.k_new;
    const scalar_t* vbase = is_cached ? p.vc : p.v_new;
    const pv::KeySource* src = sh_src[i & 1];
    for (int e = tid; e < N * CPR; e += kTcThreads) {
      const int n = e / CPR, part = e - n * CPR;
      const pv::KeySource ks = src[n];
      const bool load = ks.k >= 0;
      cp_async16(kd + n * RS + part * 8, load ? kbase + ks.k + part * 8 : kbase, load);
      cp_async16(vd + n * RS + part * 8, load ? vbase + ks.v + part * 8 : vbase, load);
    }
  };
  {
    const pv::KeySource s0 = key_source(0), s1 = key_source(1);
    if (tid < N) {
      sh_src[0][tid] = s0;
      sh_src[1][tid] = s1;
    }
  }
  __syncthreads();  // sources of tiles 0 and 1 visible

  // ---- accumulators, per m16 tile mt: O [DT][4], m and l for rows gid and gid + 8
  // (index 2 mt + i, as ri)
  float o[MT][DT][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int d = 0; d < DT; ++d) o[mt][d][0] = o[mt][d][1] = o[mt][d][2] = o[mt][d][3] = 0.f;
  float m_row[2 * MT], l_row[2 * MT];  // l: this thread's share (summed over the quad at the end)
#pragma unroll
  for (int i = 0; i < 2 * MT; ++i) {
    m_row[i] = pv::kNegInf;
    l_row[i] = 0.f;
  }
  // A fragments of tile mt: q_lane + mt * 16 * RS
  const uint16_t* q_lane = Qs + (warp * WR + ((lane >> 3) & 1) * 8 + (lane & 7)) * RS + (lane >> 4) * 8;

  if (n_tiles > 0) load_tile(0, 0);
  cp_async_commit();  // group 0: Q (+ tile 0)

  for (int i = 0; i < n_tiles; ++i) {
    const int stage = Shape::kStages == 1 ? 0 : (i & 1);
    if (Shape::kStages == 1) {  // one buffer: tile i is loaded now (the last iteration ended in a barrier)
      if (i > 0) {
        load_tile(i, 0);
        cp_async_commit();
      }
      cp_async_wait<0>();
    } else if (i + 1 < n_tiles) {  // two buffers: tile i + 1 loads while tile i is computed
      load_tile(i + 1, (i + 1) & 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();  // tile i (and Q) visible to every warp; every thread has issued tile i's and i + 1's loads
    // sources of tile i + 2 (into tile i's buffer, free now): read before the MMAs, stored after
    const pv::KeySource next_src = key_source(i + 2);

    const int k0 = tile_key0(i);
    const bool is_cached = i < n_cached;
    const pv::TileKind kind =
        is_cached ? pv::classify_cached_tile(k0, k0 + N, wb) : pv::classify_suffix_tile(k0, k0 + N, wb);
    if (kind != pv::kTileSkip) {  // warp-uniform
      const uint16_t* kt = Ks + stage * SM::kv_elems;
      const uint16_t* vt = Vs + stage * SM::kv_elems;
      // S = Q K^T (WR rows x N keys per warp): each B fragment of K feeds the MT m16 tiles
      float s[MT][NT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) s[mt][nt][0] = s[mt][nt][1] = s[mt][nt][2] = s[mt][nt][3] = 0.f;
#pragma unroll
      for (int ks = 0; ks < KS; ++ks) {
        // A of each m16 tile: matrices (rows 0/8.., dims ks*16 + 0), (.., + 8); lane l
        // addresses row mt*16 + ((l/8)%2)*8 + l%8, dim ks*16 + (l/16)*8
        uint32_t a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) ldsm_x4(a[mt], q_lane + mt * 16 * RS + ks * 16);
        // B of n8 tiles nt, nt + 1 in one ldmatrix: matrices (keys nt*8.., dims ks*16 + 0/8),
        // (keys (nt+1)*8.., dims ks*16 + 0/8); lane l addresses key (nt + l/16)*8 + l%8, dim half (l/8)%2
        const uint16_t* k_lane = kt + ((lane >> 4) * 8 + (lane & 7)) * RS + ks * 16 + ((lane >> 3) & 1) * 8;
#pragma unroll
        for (int nt = 0; nt < NT; nt += 2) {
          uint32_t b[4];
          ldsm_x4(b, k_lane + nt * 8 * RS);
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            Mma::run(s[mt][nt], a[mt], b);
            Mma::run(s[mt][nt + 1], a[mt], b + 2);
          }
        }
      }
      // Per m16 tile in turn (its S dies as its P is made): logits, mask, running max of rows
      // gid (i = 2 mt) and gid + 8 (2 mt + 1); O and l rescaled; P = exp2(x - m) rounded to the
      // input dtype, l from the rounded values (the weights the P V product uses).
      uint32_t pa[MT][NT][2];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        float mx[2] = {pv::kNegInf, pv::kNegInf};
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int key = k0 + nt * 8 + 2 * tig + (e & 1);
            bool keep = true;
            if (kind == pv::kTilePartial) {
              const int r = warp * WR + mt * 16 + gid + 8 * (e >> 1), t = row_t[r];
              keep = t >= 0 && (is_cached ? pv::cached_pair_visible(key, row_lo[r], row_P[r])
                                          : pv::suffix_pair_visible(key, t, row_tok0[r], p.window));
            }
            const float x = keep ? pv::tc_logit(s[mt][nt][e], p.scale, p.softcap) : pv::kNegInf;
            s[mt][nt][e] = x;
            mx[e >> 1] = fmaxf(mx[e >> 1], x);
          }
        }
        float alpha[2];
#pragma unroll
        for (int i2 = 0; i2 < 2; ++i2) {
          const int i = 2 * mt + i2;
          const float m_new = fmaxf(m_row[i], quad_max(mx[i2]));
          alpha[i2] = pv::tc_rescale(m_row[i], m_new);
          m_row[i] = m_new;
          l_row[i] *= alpha[i2];
        }
#pragma unroll
        for (int d = 0; d < DT; ++d) {
          o[mt][d][0] *= alpha[0];
          o[mt][d][1] *= alpha[0];
          o[mt][d][2] *= alpha[1];
          o[mt][d][3] *= alpha[1];
        }
        const float m0 = m_row[2 * mt], m1 = m_row[2 * mt + 1];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          pa[mt][nt][0] = Mma::pack(pv::tc_weight(s[mt][nt][0], m0), pv::tc_weight(s[mt][nt][1], m0));
          pa[mt][nt][1] = Mma::pack(pv::tc_weight(s[mt][nt][2], m1), pv::tc_weight(s[mt][nt][3], m1));
          const scalar_t* lo2 = reinterpret_cast<const scalar_t*>(&pa[mt][nt][0]);
          const scalar_t* hi2 = reinterpret_cast<const scalar_t*>(&pa[mt][nt][1]);
          l_row[2 * mt] += static_cast<float>(lo2[0]) + static_cast<float>(lo2[1]);
          l_row[2 * mt + 1] += static_cast<float>(hi2[0]) + static_cast<float>(hi2[1]);
        }
      }
      // O += P V: k16 = keys of n8 tiles 2 kk, 2 kk + 1; each B fragment of V feeds the MT m16 tiles
#pragma unroll
      for (int kk = 0; kk < N / 16; ++kk) {
        // B of dim tiles d, d + 1 in one transposing ldmatrix: matrices (keys kk*16 + 0/8, dims
        // d*8..), (keys kk*16 + 0/8, dims (d+1)*8..); lane l addresses key kk*16 + ((l/8)%2)*8 + l%8,
        // dim (d + l/16)*8
        const uint16_t* v_lane = vt + (kk * 16 + ((lane >> 3) & 1) * 8 + (lane & 7)) * RS + (lane >> 4) * 8;
#pragma unroll
        for (int d = 0; d < DT; d += 2) {
          uint32_t b[4];
          ldsm_x4_trans(b, v_lane + d * 8);
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            const uint32_t a[4] = {pa[mt][2 * kk][0], pa[mt][2 * kk][1], pa[mt][2 * kk + 1][0],
                                   pa[mt][2 * kk + 1][1]};
            Mma::run(o[mt][d], a, b);
            Mma::run(o[mt][d + 1], a, b + 2);
          }
        }
      }
    }
    if (tid < N && i + 2 < n_tiles) sh_src[i & 1][tid] = next_src;
    __syncthreads();  // every warp done with this stage before it is refilled; tile i + 2's sources visible
  }
  cp_async_wait<0>();

  // ---- write: out (one split) or the partial state; row i = 2 mt + i2 (as ri)
#pragma unroll
  for (int i = 0; i < 2 * MT; ++i) {
    const int mt = i >> 1, i2 = i & 1;
    const float l_tot = quad_sum(l_row[i]);  // every lane of the quad takes part
    const int r = warp * WR + mt * 16 + gid + 8 * i2;
    const int t = row_t[r];
    if (t < 0) continue;
    const int hq = row_hq[r];
    if (p.num_splits == 1) {
      const float inv = pv::finalize_scale(l_tot);
      scalar_t* dst = p.out + t * p.out_s0 + hq * p.out_s1 + 2 * tig;
#pragma unroll
      for (int d = 0; d < DT; ++d) {
        const uint32_t v = Mma::pack(o[mt][d][2 * i2] * inv, o[mt][d][2 * i2 + 1] * inv);
        *reinterpret_cast<uint32_t*>(dst + d * 8) = v;
      }
    } else {
      const int64_t idx = (static_cast<int64_t>(split) * p.T + t) * p.Hq + hq;
      if (tig == 0) {
        p.ws_m[idx] = m_row[i];
        p.ws_l[idx] = l_tot;
      }
      float* dst = p.ws_acc + idx * D + 2 * tig;
#pragma unroll
      for (int d = 0; d < DT; ++d) {
        *reinterpret_cast<float2*>(dst + d * 8) = make_float2(o[mt][d][2 * i2], o[mt][d][2 * i2 + 1]);
      }
    }
  }
}

// Merges the split partial states: one warp per (token, query head).  Every
// split wrote a state for every row of every row tile that exists (an empty one
// with m = -inf, l = 0 when the split held nothing for the row); rows of no row
// tile are not touched.
template <typename scalar_t, int D>
__global__ void __launch_bounds__(128) prefix_verify_tc_merge_kernel(const Params<scalar_t> p) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * 4 + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (row >= static_cast<int64_t>(p.T) * p.Hq) return;
  const int64_t t = row / p.Hq, hq = row - t * p.Hq;
  if (!pv::merge_row_written(p.cu, p.C, t)) return;  // no split wrote this row's state
  const int64_t stride = static_cast<int64_t>(p.T) * p.Hq;
  float m_max = pv::kNegInf;
  for (int s = 0; s < p.num_splits; ++s) m_max = fmaxf(m_max, p.ws_m[s * stride + row]);
  float l = 0.f;
  for (int s = 0; s < p.num_splits; ++s) l += pv::tc_rescale(p.ws_m[s * stride + row], m_max) * p.ws_l[s * stride + row];
  const float inv = pv::finalize_scale(l);
  for (int d = lane; d < D; d += 32) {
    float acc = 0.f;
    for (int s = 0; s < p.num_splits; ++s) {
      const float w = pv::tc_rescale(p.ws_m[s * stride + row], m_max);
      if (w != 0.f) acc += w * p.ws_acc[(s * stride + row) * D + d];
    }
    p.out[t * p.out_s0 + hq * p.out_s1 + d] = static_cast<scalar_t>(acc * inv);
  }
}

// What the launcher needs of a device, read once per device (attribute queries
// and cudaFuncSetAttribute cost microseconds on every eager call otherwise).
struct TcDevice {
  int sms = 0, smem_optin = 0;
};
constexpr int kTcMaxDevices = 64;

inline const TcDevice& tc_device(int device) {
  static TcDevice cache[kTcMaxDevices];
  static std::once_flag once[kTcMaxDevices];
  TORCH_CHECK(device >= 0 && device < kTcMaxDevices, "prefix_verify_attention (CUDA): device ", device);
  std::call_once(once[device], [device] {
    TcDevice d;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&d.sms, cudaDevAttrMultiProcessorCount, device));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&d.smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    cache[device] = d;
  });
  return cache[device];
}

// The kernel instance's shared-memory opt-in, once per (instance, device). The block's whole
// use is its static arrays (row bounds, key sources: 3-5 KB) plus the dynamic tiles, and only
// the sum is bounded by the opt-in: checked here, with the head size in the message, rather
// than left to cudaFuncSetAttribute's bare cudaErrorInvalidValue.
template <typename scalar_t, int D>
void tc_set_smem(int device, const TcDevice& dev) {
  static std::once_flag once[kTcMaxDevices];
  std::call_once(once[device], [&dev] {
    cudaFuncAttributes attr;
    C10_CUDA_CHECK(cudaFuncGetAttributes(&attr, prefix_verify_tc_kernel<scalar_t, D>));
    const int64_t total = static_cast<int64_t>(attr.sharedSizeBytes) + static_cast<int64_t>(TcSmem<D>::bytes);
    TORCH_CHECK(total <= dev.smem_optin, "prefix_verify_attention (CUDA): head size ", D, " needs ", total,
                " bytes of shared memory per block (", attr.sharedSizeBytes, " static, ", TcSmem<D>::bytes,
                " dynamic), this GPU allows ", dev.smem_optin);
    C10_CUDA_CHECK(cudaFuncSetAttribute(prefix_verify_tc_kernel<scalar_t, D>,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(TcSmem<D>::bytes)));
  });
}

template <typename scalar_t, int D>
void launch_tc(Params<scalar_t>& p, int64_t max_prefix_len, const at::Tensor& q, cudaStream_t stream) {
  using SM = TcSmem<D>;
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  const TcDevice& dev = tc_device(device);
  tc_set_smem<scalar_t, D>(device, dev);
  constexpr int ROWS = pv::TcShape<D>::kRows;
  const int64_t est_tiles = pv::ceil_div(static_cast<int64_t>(p.T) * p.G, ROWS);
  const int64_t row_tiles = pv::max_row_tiles(p.T, p.C, p.G, ROWS);
  const pv::SplitPlan sp = pv::plan_splits(max_prefix_len, est_tiles, p.Hkv, pv::kTcCtasPerSm * dev.sms,
                                           pv::TcShape<D>::kKeys);
  p.num_splits = static_cast<int>(sp.num_splits);
  p.chunk = static_cast<int>(sp.chunk);
  at::Tensor ws;
  if (sp.num_splits > 1) {
    const int64_t n = sp.num_splits * static_cast<int64_t>(p.T) * p.Hq;
    ws = at::empty({n * (D + 2)}, q.options().dtype(at::kFloat));
    p.ws_m = ws.data_ptr<float>();
    p.ws_l = p.ws_m + n;
    p.ws_acc = p.ws_l + n;
  }
  const int64_t ctas = row_tiles * p.Hkv * sp.num_splits;
  TORCH_CHECK(ctas < (int64_t{1} << 31), "prefix_verify_attention (CUDA): ", ctas, " CTAs is too many for one grid");
  prefix_verify_tc_kernel<scalar_t, D>
      <<<static_cast<unsigned>(ctas), kTcThreads, SM::bytes, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (sp.num_splits > 1) {
    const int64_t rows = static_cast<int64_t>(p.T) * p.Hq;
    prefix_verify_tc_merge_kernel<scalar_t, D>
        <<<static_cast<unsigned>(pv::ceil_div(rows, 4)), 128, 0, stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

template <typename scalar_t>
bool run_tc(const PrefixVerifyArgs& a) {
  const at::Tensor& q = a.q;
  // 16-byte loads and 4-byte stores everywhere: pointers and row strides aligned
  for (const at::Tensor* t : {&a.q, &a.k_new, &a.v_new, &a.key_cache, &a.value_cache, &a.out})
    if (!cuda_params::rows_aligned16(*t)) return false;
  Params<scalar_t> p = cuda_params::make_params<scalar_t>(a);
  const int64_t D = q.size(2), max_prefix_len = cuda_params::prefix_bound(a);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  switch (D) {
    case 32: launch_tc<scalar_t, 32>(p, max_prefix_len, q, stream); break;
    case 64: launch_tc<scalar_t, 64>(p, max_prefix_len, q, stream); break;
    case 80: launch_tc<scalar_t, 80>(p, max_prefix_len, q, stream); break;
    case 96: launch_tc<scalar_t, 96>(p, max_prefix_len, q, stream); break;
    case 128: launch_tc<scalar_t, 128>(p, max_prefix_len, q, stream); break;
    case 256: launch_tc<scalar_t, 256>(p, max_prefix_len, q, stream); break;
    default: return false;
  }
  return true;
}

}  // namespace

bool prefix_verify_attention_cuda_tc(const PrefixVerifyArgs& a) {
  const int64_t T = a.q.size(0), Hq = a.q.size(1);
  if (T * Hq >= (int64_t{1} << 31)) return false;
  switch (a.q.scalar_type()) {
    case at::kBFloat16: return run_tc<c10::BFloat16>(a);
    case at::kHalf: return run_tc<c10::Half>(a);
    default: return false;  // float32: the CUDA-core kernel
  }
}

}  // namespace parse_vllm
