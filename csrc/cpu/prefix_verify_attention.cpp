// CPU twin of the PARSE prefix-verification attention kernel.
//
// Same layout and tiling as the CUDA kernel (see csrc/README.md):
//   * copies are grouped per request (maximal runs of equal copy_req);
//   * one work item = (group, kv head, key split); it walks the request's cached
//     keys of its split ONCE, in tiles of kKeyTile keys, packs each tile (K
//     transposed, V row-major) and applies it to every query row of every
//     copy of the group that sees any key of the tile (all Hq/Hkv query heads of
//     the kv head: GQA-aware), with a per-row visible key interval (prefix end,
//     sliding window) instead of a mask;
//   * copies inside a group are ordered by prefix length, longest first, so the
//     rows that see a tile are one contiguous run of rows: the score and PV
//     products are dense register-blocked micro-GEMMs on at::vec vectors (fp32),
//     or, for bf16/fp16 where torch's oneDNN micro-kernels support them (AMX),
//     cpublas::brgemm on VNNI-packed tiles (apply_tile_lp);
//   * the own-copy suffix keys (causal) are applied by split 0 after the prefix;
//   * long prefixes are split over several items (flash-decoding style) when
//     there are fewer (group, kv head) pairs than 2x the threads; the partial
//     online-softmax states are merged at the end.
// Accumulation is fp32 throughout.  Parallel over work items with
// at::parallel_for (OpenMP; respects torch.set_num_threads).
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/native/CPUBlas.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "../ops.h"
#include "../prefix_verify_common.h"
#include "../prefix_verify_operands.h"

namespace parse_vllm {

const char* cpu_isa_name() {
#if defined(CPU_CAPABILITY_AVX512)
  return "avx512";
#elif defined(CPU_CAPABILITY_AVX2)
  return "avx2";
#else
  return "default";
#endif
}

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t VS = Vec::size();
constexpr int64_t kKeyTile = 256;         // keys per packed tile (amortises per-row softmax work)
constexpr int64_t kPackN = 64;            // oneDNN pack: output width of one VNNI block
constexpr int64_t kMinSplitKeys = 512;    // never split a prefix finer than this
constexpr int64_t kRowChunk = 64;         // query rows per score block (L1-resident)
static_assert(kKeyTile % 16 == 0 && kKeyTile % kPackN == 0, "tile must hold whole vectors / blocks");

// Register blocking of the micro-kernels (chosen for 32 zmm / 16 ymm registers).
constexpr int kQkRows = VS >= 16 ? 8 : 4;   // rows per score block
constexpr int kQkVecs = 2;                  // key vectors per score block
constexpr int kPvRows = 4;                  // rows per PV block
constexpr int kPvVecs = VS >= 16 ? 4 : 2;   // head-dim vectors per PV block

// A copy inside a group.
struct Slot {
  int64_t copy;    // copy index c
  int64_t tok0;    // first packed token of the copy (cu_copy_lens[c])
  int64_t len;     // number of suffix tokens L_c
  int64_t prefix;  // P_c = copy_prefix_len[c]
  int64_t row0;    // first row of the copy in the group's row space (row = row0 + j*G + g)
};

struct Group {
  int64_t req;
  std::vector<Slot> slots;  // sorted by prefix, longest first
  int64_t rows = 0;         // sum(len) * G
  int64_t key_lo = 0;       // lowest cached key any row sees
  int64_t key_hi = 0;       // max prefix
};

struct Item {
  int64_t group, head, key_begin, key_end;
  bool suffix;          // this item also applies the own-copy suffix keys
  int64_t split;        // split index inside its (group, head)
  int64_t ws_offset;    // partial-state offset in the workspace, -1: write `out` directly
};

// ------------------------------------------------------------------ micro-kernels

// S[r][n] = sum_d Q[r][d] * Kt[d][n] for RB rows and NV*VS keys.
template <int RB, int NV>
inline void qk_block(const float* Q, int64_t ldq, const float* Kt, float* S, int64_t Dp) {
  Vec acc[RB][NV];
  for (int r = 0; r < RB; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = Vec(0.f);
  for (int64_t d = 0; d < Dp; ++d) {
    Vec kv[NV];
    for (int v = 0; v < NV; ++v) kv[v] = Vec::loadu(Kt + d * kKeyTile + v * VS);
    for (int r = 0; r < RB; ++r) {
      const Vec qb(Q[r * ldq + d]);
      for (int v = 0; v < NV; ++v) acc[r][v] = at::vec::fmadd(qb, kv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v].store(S + r * kKeyTile + v * VS);
}

// S[rows][0:n] = Q[rows] . Kt[:, 0:n]   (columns rounded up to whole vectors)
inline void qk_tile(const float* Q, int64_t ldq, const float* Kt, float* S, int64_t rows,
                    int64_t n, int64_t Dp) {
  const int64_t ncols = pv::ceil_div(n, VS) * VS;
  for (int64_t c0 = 0; c0 < ncols; c0 += kQkVecs * VS) {
    const bool full = c0 + kQkVecs * VS <= ncols;
    int64_t r = 0;
    for (; r + kQkRows <= rows; r += kQkRows) {
      if (full) qk_block<kQkRows, kQkVecs>(Q + r * ldq, ldq, Kt + c0, S + r * kKeyTile + c0, Dp);
      else qk_block<kQkRows, 1>(Q + r * ldq, ldq, Kt + c0, S + r * kKeyTile + c0, Dp);
    }
    for (; r < rows; ++r) {
      if (full) qk_block<1, kQkVecs>(Q + r * ldq, ldq, Kt + c0, S + r * kKeyTile + c0, Dp);
      else qk_block<1, 1>(Q + r * ldq, ldq, Kt + c0, S + r * kKeyTile + c0, Dp);
    }
  }
}

// A[r][d] += sum_{i<n} P[r][i] * V[i][d] for RB rows and DV*VS head-dim lanes.
template <int RB, int DV>
inline void pv_block(const float* P, const float* V, int64_t ldv, float* A, int64_t lda, int64_t n) {
  Vec acc[RB][DV];
  for (int r = 0; r < RB; ++r)
    for (int v = 0; v < DV; ++v) acc[r][v] = Vec::loadu(A + r * lda + v * VS);
  for (int64_t i = 0; i < n; ++i) {
    Vec vv[DV];
    for (int v = 0; v < DV; ++v) vv[v] = Vec::loadu(V + i * ldv + v * VS);
    for (int r = 0; r < RB; ++r) {
      const Vec pb(P[r * kKeyTile + i]);
      for (int v = 0; v < DV; ++v) acc[r][v] = at::vec::fmadd(pb, vv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int v = 0; v < DV; ++v) acc[r][v].store(A + r * lda + v * VS);
}

template <int RB>
inline void pv_rows(const float* P, const float* V, float* A, int64_t n, int64_t Dp) {
  int64_t d = 0;
  for (; d + kPvVecs * VS <= Dp; d += kPvVecs * VS) pv_block<RB, kPvVecs>(P, V + d, Dp, A + d, Dp, n);
  for (; d < Dp; d += VS) pv_block<RB, 1>(P, V + d, Dp, A + d, Dp, n);
}

// A[rows] += P[rows][0:n] . V[0:n]
inline void pv_tile(const float* P, const float* V, float* A, int64_t rows, int64_t n, int64_t Dp) {
  int64_t r = 0;
  for (; r + kPvRows <= rows; r += kPvRows) pv_rows<kPvRows>(P + r * kKeyTile, V, A + r * Dp, n, Dp);
  for (; r < rows; ++r) pv_rows<1>(P + r * kKeyTile, V, A + r * Dp, n, Dp);
}

// Online-softmax update of one row with the scores s[0:n] of one tile, of which
// only [vis.lo, vis.hi) are visible.  Leaves the probabilities in s (0 outside
// the visible range) and rescales the row's accumulator.
inline void row_update(float* s, int64_t n, pv::KeyRange vis, float softcap, float& m, float& l,
                       float* acc, int64_t Dp, float score_scale = 1.f) {
  if (vis.lo >= vis.hi) {
    std::fill(s, s + n, 0.f);
    return;
  }
  std::fill(s, s + vis.lo, 0.f);
  std::fill(s + vis.hi, s + n, 0.f);
  float* sv = s + vis.lo;
  const int64_t nv = vis.hi - vis.lo;
  if (softcap > 0.f) {  // (low-precision path: q is not pre-scaled, score_scale != 1)
    const Vec cap(softcap), inv(score_scale / softcap);
    int64_t i = 0;
    for (; i + VS <= nv; i += VS) (cap * (Vec::loadu(sv + i) * inv).tanh()).store(sv + i);
    for (; i < nv; ++i) sv[i] = pv::apply_softcap(sv[i] * score_scale, softcap);
  } else if (score_scale != 1.f) {
    const Vec sc(score_scale);
    int64_t i = 0;
    for (; i + VS <= nv; i += VS) (Vec::loadu(sv + i) * sc).store(sv + i);
    for (; i < nv; ++i) sv[i] *= score_scale;
  }
  float mx = pv::kNegInf;
  {
    int64_t i = 0;
    if (nv >= VS) {
      Vec vm = Vec::loadu(sv);
      for (i = VS; i + VS <= nv; i += VS) vm = at::vec::maximum(vm, Vec::loadu(sv + i));
      mx = at::vec::vec_reduce_all<float>([](Vec x, Vec y) { return at::vec::maximum(x, y); }, vm);
    }
    for (; i < nv; ++i) mx = std::max(mx, sv[i]);
  }
  const float m_new = std::max(m, mx);
  const float alpha = pv::softmax_rescale(m, m_new);
  float sum = 0.f;
  {
    const Vec mv(m_new);
    Vec vsum(0.f);
    int64_t i = 0;
    for (; i + VS <= nv; i += VS) {
      const Vec p = (Vec::loadu(sv + i) - mv).exp_u20();
      p.store(sv + i);
      vsum = vsum + p;
    }
    if (i < nv) {
      const Vec p = (Vec::loadu(sv + i, nv - i) - mv).exp_u20();
      p.store(sv + i, nv - i);
      float tmp[VS];
      p.store(tmp);
      for (int64_t k = 0; k < nv - i; ++k) sum += tmp[k];
    }
    sum += at::vec::vec_reduce_all<float>([](Vec x, Vec y) { return x + y; }, vsum);
  }
  l = l * alpha + sum;
  m = m_new;
  if (alpha != 1.f) {
    const Vec av(alpha);
    for (int64_t d = 0; d < Dp; d += VS) (Vec::loadu(acc + d) * av).store(acc + d);
  }
}

// ------------------------------------------------------------------ packing

template <typename scalar_t>
inline void load_row(const scalar_t* src, float* dst, int64_t D) {
  for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<float>(src[d]);
}

template <typename scalar_t>
struct Args : Operands<scalar_t> {
  int64_t block_size, Hq, Hkv, G, D, Dp;
  float scale, softcap;
  int64_t window;
  bool lp = false;  // bf16/fp16 through oneDNN brgemm (see apply_tile_lp)
};

// Thread-local scratch of one work item.
template <typename scalar_t>
struct Scratch {
  std::vector<float> Q, Kt, V, S, acc, m, l;
  std::vector<int64_t> row_prefix, row_j;
  // Low-precision (oneDNN brgemm, AMX where present) path: q, the K tile (transposed,
  // then VNNI-packed), the V tile per 64-wide head-dim block (then packed), probabilities.
  std::vector<scalar_t> Qr, Ktr, Kp, Vr, Vp, Pr;
  void reserve(int64_t rows, int64_t Dp, int64_t D, bool lp) {
    acc.resize(rows * Dp);
    S.resize(kRowChunk * kKeyTile);
    m.resize(rows);
    l.resize(rows);
    if (!lp) {
      Q.resize(rows * Dp);
      if (Kt.size() < static_cast<size_t>(Dp * kKeyTile)) {
        Kt.assign(Dp * kKeyTile, 0.f);
        V.assign(kKeyTile * Dp, 0.f);
      }
    } else {
      Qr.resize(rows * D);
      if (Ktr.size() < static_cast<size_t>(D * kKeyTile)) {
        Ktr.assign(D * kKeyTile, scalar_t(0));
        Kp.assign(D * kKeyTile, scalar_t(0));
        Vr.assign(kKeyTile * Dp, scalar_t(0));  // [Dp/64 blocks][kKeyTile][64]
        Vp.assign(kKeyTile * Dp, scalar_t(0));
        Pr.assign(kRowChunk * kKeyTile, scalar_t(0));
      }
    }
  }
};

// Applies one packed key tile (Kt, V: n keys) to rows [r_begin, r_end), in
// chunks of kRowChunk rows so that a chunk's scores stay in L1: scores, online
// softmax with each row's visible interval vis(r), then PV.
template <typename Sc, typename Vis>
inline void apply_tile(const float* Q, const float* Kt, const float* V, float* S, Sc& sc,
                       int64_t r_begin, int64_t r_end, int64_t n, int64_t Dp, float softcap,
                       const Vis& vis) {
  for (int64_t rc = r_begin; rc < r_end; rc += kRowChunk) {
    const int64_t nr = std::min(kRowChunk, r_end - rc);
    qk_tile(Q + rc * Dp, Dp, Kt, S, nr, n, Dp);
    for (int64_t i = 0; i < nr; ++i) {
      const int64_t r = rc + i;
      row_update(S + i * kKeyTile, n, vis(r), softcap, sc.m[r], sc.l[r], sc.acc.data() + r * Dp, Dp);
    }
    pv_tile(S, V, sc.acc.data() + rc * Dp, nr, n, Dp);
  }
}

// Low-precision twin of apply_tile (bf16/fp16 with oneDNN's brgemm): the same
// row chunks and online softmax; the two products run on bf16/fp16 operands
// (q unscaled, K^T and V VNNI-packed, probabilities rounded to the input dtype
// as in torch's CPU flash attention) with fp32 accumulation.
// Kp: packed K^T, kKeyTile/64 blocks of [D x 64]; Vp: packed V, Dp/64 blocks of [ne x 64].
template <typename scalar_t, typename Vis>
inline void apply_tile_lp(Scratch<scalar_t>& sc, const scalar_t* Kp, const scalar_t* Vp, int64_t r_begin,
                          int64_t r_end, int64_t n, int64_t D, int64_t Dp, float scale, float softcap,
                          const Vis& vis) {
  using namespace at::native;
  const int64_t ne = n + (n & 1);  // VNNI needs an even reduction dim
  float* S = sc.S.data();
  scalar_t* Pr = sc.Pr.data();
  for (int64_t rc = r_begin; rc < r_end; rc += kRowChunk) {
    const int64_t nr = std::min(kRowChunk, r_end - rc);
    for (int64_t nb = 0; nb < n; nb += kPackN)  // scores, one 64-key VNNI block at a time
      cpublas::brgemm(nr, kPackN, D, D, kPackN, kKeyTile, false, sc.Qr.data() + rc * D, Kp + nb * D,
                      S + nb, true);
    for (int64_t i = 0; i < nr; ++i) {
      const int64_t r = rc + i;
      float* srow = S + i * kKeyTile;
      row_update(srow, n, vis(r), softcap, sc.m[r], sc.l[r], sc.acc.data() + r * Dp, Dp, scale);
      scalar_t* prow = Pr + i * ne;
      at::vec::convert(srow, prow, n);
      if (ne != n) prow[n] = scalar_t(0);
    }
    for (int64_t b = 0; b < Dp; b += 64) {
      cpublas::brgemm(nr, 64, ne, ne, 64, Dp, true, Pr, Vp + b * ne, sc.acc.data() + rc * Dp + b, true);
    }
  }
}

// Packs n key rows (K transposed to kKeyTile/64 blocks of [D x 64], V to Dp/64 blocks of
// [ne x 64]) into VNNI layout for apply_tile_lp.  key_ptr(i) / val_ptr(i)
// give the source rows.
template <typename scalar_t, typename KPtr, typename VPtr>
inline void pack_tile_lp(Scratch<scalar_t>& sc, int64_t n, int64_t D, int64_t Dp, const KPtr& key_ptr,
                         const VPtr& val_ptr) {
  using namespace at::native;
  const int64_t ne = n + (n & 1);
  scalar_t* Kt = sc.Ktr.data();
  scalar_t* Vr = sc.Vr.data();
  for (int64_t i = 0; i < n; ++i) {
    const scalar_t* k = key_ptr(i);
    scalar_t* kt = Kt + (i / kPackN) * D * kPackN + (i % kPackN);
    for (int64_t d = 0; d < D; ++d) kt[d * kPackN] = k[d];
    const scalar_t* v = val_ptr(i);
    for (int64_t b = 0; b < Dp; b += 64) {
      scalar_t* dst = Vr + b * ne + i * 64;
      const int64_t w = std::min<int64_t>(64, D - b);
      std::memcpy(dst, v + b, w * sizeof(scalar_t));
      for (int64_t d = w; d < 64; ++d) dst[d] = scalar_t(0);
    }
  }
  for (int64_t i = n; i < pv::ceil_div(n, kPackN) * kPackN; ++i)  // pad the last block
    for (int64_t d = 0; d < D; ++d) Kt[(i / kPackN) * D * kPackN + d * kPackN + i % kPackN] = scalar_t(0);
  if (ne != n)
    for (int64_t b = 0; b < Dp; b += 64)
      for (int64_t d = 0; d < 64; ++d) Vr[b * ne + n * 64 + d] = scalar_t(0);
  const auto dt = c10::CppTypeToScalarType<scalar_t>::value;
  for (int64_t nb = 0; nb < n; nb += kPackN)
    cpublas::pack(D, kPackN, kPackN, kPackN, dt, dt, Kt + nb * D, sc.Kp.data() + nb * D);
  for (int64_t b = 0; b < Dp; b += 64) cpublas::pack(ne, 64, 64, 64, dt, dt, Vr + b * ne, sc.Vp.data() + b * ne);
}

// Runs one work item: the rows of `grp` for kv head `h` against cached keys
// [key_begin, key_end) (and the own-copy suffix keys when item.suffix).
// Leaves the un-normalised state in sc.acc / sc.m / sc.l.
template <typename scalar_t>
void run_item(const Args<scalar_t>& a, const Group& grp, const Item& it, Scratch<scalar_t>& sc) {
  const int64_t Dp = a.Dp, D = a.D, G = a.G, h = it.head;
  const int64_t rows = grp.rows;
  constexpr bool kReduced = !std::is_same_v<scalar_t, float>;
  const bool lp = kReduced && a.lp;
  sc.reserve(rows, Dp, D, lp);
  std::fill(sc.acc.begin(), sc.acc.begin() + rows * Dp, 0.f);
  std::fill(sc.m.begin(), sc.m.begin() + rows, pv::kNegInf);
  std::fill(sc.l.begin(), sc.l.begin() + rows, 0.f);
  float* Q = lp ? nullptr : sc.Q.data();
  // Pack the group's queries for this kv head: fp32, pre-scaled, zero-padded to
  // Dp; or (low-precision path) a plain copy.
  for (const Slot& s : grp.slots) {
    for (int64_t j = 0; j < s.len; ++j) {
      for (int64_t g = 0; g < G; ++g) {
        const int64_t r = s.row0 + j * G + g;
        const scalar_t* src = a.q + (s.tok0 + j) * a.q_s0 + (h * G + g) * a.q_s1;
        if (lp) {
          std::memcpy(sc.Qr.data() + r * D, src, D * sizeof(scalar_t));
          continue;
        }
        float* dst = Q + r * Dp;
        for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<float>(src[d]) * a.scale;
        for (int64_t d = D; d < Dp; ++d) dst[d] = 0.f;
      }
    }
  }
  // Per-row copy prefix and suffix index (row = slot.row0 + j * G + g).
  sc.row_prefix.resize(rows);
  sc.row_j.resize(rows);
  for (const Slot& s : grp.slots)
    for (int64_t j = 0; j < s.len; ++j)
      for (int64_t g = 0; g < G; ++g) {
        sc.row_prefix[s.row0 + j * G + g] = s.prefix;
        sc.row_j[s.row0 + j * G + g] = j;
      }
  const int64_t* row_prefix = sc.row_prefix.data();
  const int64_t* row_j = sc.row_j.data();
  float* Kt = sc.Kt.data();
  float* V = sc.V.data();
  float* S = sc.S.data();
  const int32_t* bt_row = a.block_table + grp.req * a.bt_s0;
  const int64_t nslots = static_cast<int64_t>(grp.slots.size());

  // ---- walk the request's cached keys once
  for (int64_t k0 = it.key_begin; k0 < it.key_end; k0 += kKeyTile) {
    const int64_t n = std::min(kKeyTile, it.key_end - k0);
    // Rows that may see this tile: slots with prefix > k0 (a leading run, as
    // slots are sorted longest first) whose window reaches below k0 + n (also
    // a leading-run boundary from the other side: window lo grows with prefix).
    int64_t s_end = 0;
    while (s_end < nslots && grp.slots[s_end].prefix > k0) ++s_end;
    int64_t s_begin = 0;
    while (s_begin < s_end &&
           pv::prefix_window_lo(grp.slots[s_begin].prefix, 0, a.window) >= k0 + n)
      ++s_begin;
    if (s_begin >= s_end) continue;
    const int64_t r_begin = grp.slots[s_begin].row0;
    const int64_t r_end = grp.slots[s_end - 1].row0 + grp.slots[s_end - 1].len * G;
    if (r_begin >= r_end) continue;
    // Pack the tile: each cached key row is read exactly once per item.
    if constexpr (kReduced) if (lp) {
      pack_tile_lp(sc, n, D, Dp,
                   [&](int64_t i) { return a.kc + pv::cache_offset(bt_row, k0 + i, a.block_size, a.ks, h); },
                   [&](int64_t i) { return a.vc + pv::cache_offset(bt_row, k0 + i, a.block_size, a.vs, h); });
      apply_tile_lp(sc, sc.Kp.data(), sc.Vp.data(), r_begin, r_end, n, D, Dp, a.scale, a.softcap,
                    [&](int64_t r) { return pv::prefix_visible_in_tile(row_prefix[r], row_j[r], a.window, k0, n); });
      continue;
    }
    for (int64_t i = 0; i < n; ++i) {
      const int64_t ko = pv::cache_offset(bt_row, k0 + i, a.block_size, a.ks, h);
      const int64_t vo = pv::cache_offset(bt_row, k0 + i, a.block_size, a.vs, h);
      const scalar_t* ksrc = a.kc + ko;
      for (int64_t d = 0; d < D; ++d) Kt[d * kKeyTile + i] = static_cast<float>(ksrc[d]);
      load_row(a.vc + vo, V + i * Dp, D);
    }
    apply_tile(Q, Kt, V, S, sc, r_begin, r_end, n, Dp, a.softcap, [&](int64_t r) {
      return pv::prefix_visible_in_tile(row_prefix[r], row_j[r], a.window, k0, n);
    });
  }

  // ---- own-copy suffix keys (causal), once per copy
  if (!it.suffix) return;
  for (const Slot& s : grp.slots) {
    for (int64_t j0 = 0; j0 < s.len; j0 += kKeyTile) {
      const int64_t n = std::min(kKeyTile, s.len - j0);
      // rows j >= j0 see this tile (causal); with a window, rows j < j0 + n + W - 1.
      const int64_t jr_begin = j0;
      const int64_t r_begin = s.row0 + jr_begin * G;
      const int64_t r_end = s.row0 + s.len * G;
      if constexpr (kReduced) if (lp) {
        pack_tile_lp(sc, n, D, Dp,
                     [&](int64_t i) { return a.k_new + (s.tok0 + j0 + i) * a.kn_s0 + h * a.kn_s1; },
                     [&](int64_t i) { return a.v_new + (s.tok0 + j0 + i) * a.vn_s0 + h * a.vn_s1; });
        apply_tile_lp(sc, sc.Kp.data(), sc.Vp.data(), r_begin, r_end, n, D, Dp, a.scale, a.softcap,
                      [&](int64_t r) { return pv::suffix_visible_in_tile(row_j[r], a.window, j0, n); });
        continue;
      }
      for (int64_t i = 0; i < n; ++i) {
        const int64_t t = s.tok0 + j0 + i;
        const scalar_t* ksrc = a.k_new + t * a.kn_s0 + h * a.kn_s1;
        for (int64_t d = 0; d < D; ++d) Kt[d * kKeyTile + i] = static_cast<float>(ksrc[d]);
        load_row(a.v_new + t * a.vn_s0 + h * a.vn_s1, V + i * Dp, D);
      }
      apply_tile(Q, Kt, V, S, sc, r_begin, r_end, n, Dp, a.softcap, [&](int64_t r) {
        return pv::suffix_visible_in_tile(row_j[r], a.window, j0, n);
      });
    }
  }
}

template <typename scalar_t>
void write_rows(const Args<scalar_t>& a, const Group& grp, int64_t h, const float* acc,
                const float* l) {
  const int64_t G = a.G, Dp = a.Dp, D = a.D;
  for (const Slot& s : grp.slots) {
    for (int64_t j = 0; j < s.len; ++j) {
      for (int64_t g = 0; g < G; ++g) {
        const int64_t r = s.row0 + j * G + g;
        const float inv = pv::finalize_scale(l[r]);
        scalar_t* dst = a.out + (s.tok0 + j) * a.out_s0 + (h * G + g) * a.out_s1;
        for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<scalar_t>(acc[r * Dp + d] * inv);
      }
    }
  }
}

template <typename scalar_t>
void run(const Args<scalar_t>& a, const std::vector<Group>& groups, const std::vector<Item>& items,
         int64_t ws_size, const std::vector<std::vector<int64_t>>& split_items) {
  const int64_t Dp = a.Dp;
  std::vector<float> ws(static_cast<size_t>(ws_size));
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t b, int64_t e) {
    Scratch<scalar_t> sc;
    for (int64_t i = b; i < e; ++i) {
      const Item& it = items[i];
      const Group& grp = groups[it.group];
      run_item(a, grp, it, sc);
      if (it.ws_offset < 0) {
        write_rows(a, grp, it.head, sc.acc.data(), sc.l.data());
      } else {
        float* p = ws.data() + it.ws_offset;
        std::memcpy(p, sc.m.data(), grp.rows * sizeof(float));
        std::memcpy(p + grp.rows, sc.l.data(), grp.rows * sizeof(float));
        std::memcpy(p + 2 * grp.rows, sc.acc.data(), grp.rows * Dp * sizeof(float));
      }
    }
    if constexpr (!std::is_same_v<scalar_t, float>) {
      if (a.lp) at::native::cpublas::brgemm_release(true);
    }
  });
  // Merge the split partial states (only (group, head) pairs that were split).
  if (split_items.empty()) return;
  at::parallel_for(0, static_cast<int64_t>(split_items.size()), 1, [&](int64_t b, int64_t e) {
    std::vector<float> acc, l;
    for (int64_t pi = b; pi < e; ++pi) {
      const auto& its = split_items[pi];
      const Item& first = items[its[0]];
      const Group& grp = groups[first.group];
      const int64_t rows = grp.rows;
      acc.assign(rows * Dp, 0.f);
      l.assign(rows, 0.f);
      for (int64_t r = 0; r < rows; ++r) {
        float m_max = pv::kNegInf;
        for (int64_t idx : its) m_max = std::max(m_max, ws[items[idx].ws_offset + r]);
        for (int64_t idx : its) {
          const float* p = ws.data() + items[idx].ws_offset;
          const float w = pv::merge_weight(p[r], m_max);
          if (w == 0.f) continue;
          l[r] += w * p[rows + r];
          const float* pa = p + 2 * rows + r * Dp;
          for (int64_t d = 0; d < Dp; ++d) acc[r * Dp + d] += w * pa[d];
        }
      }
      write_rows(a, grp, first.head, acc.data(), l.data());
    }
  });
}

// bf16/fp16 products through oneDNN's brgemm (AMX / AVX512-BF16/FP16) when
// torch says the machine supports its packed format; PARSE_VLLM_CPU_BRGEMM=0
// forces the at::vec fp32 micro-kernels (the only path for fp32).
bool use_lowp(at::ScalarType dt) {
  if (dt != at::kBFloat16 && dt != at::kHalf) return false;
  const char* env = std::getenv("PARSE_VLLM_CPU_BRGEMM");
  if (env != nullptr && env[0] == '0') return false;
  return at::native::cpublas::could_pack(dt);
}

}  // namespace

bool cpu_uses_brgemm(at::ScalarType dt) { return use_lowp(dt); }

void prefix_verify_attention_cpu(const PrefixVerifyArgs& a) {
  // Arguments checked by check_prefix_verify_args (csrc/torch_bindings.cpp),
  // index values included: they are on the host here.
  const at::Tensor &q = a.q, &k_new = a.k_new, &key_cache = a.key_cache;
  const double scale = a.scale, softcap = a.softcap;
  const int64_t sliding_window = a.sliding_window;
  TORCH_CHECK(q.device().is_cpu(), "prefix_verify_attention (CPU): tensors must be on the CPU");
  const int64_t T = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = k_new.size(1);
  const int64_t G = Hq / Hkv;
  const int64_t C = a.copy_req.size(0);
  const int64_t block_size = key_cache.size(1);
  const int32_t* req = a.copy_req.data_ptr<int32_t>();
  const int32_t* plen = a.copy_prefix_len.data_ptr<int32_t>();
  const int32_t* cu = a.cu_copy_lens.data_ptr<int32_t>();
  if (T == 0) return;

  // ---- groups: runs of copies of one request, copies sorted longest prefix first
  std::vector<Group> groups;
  for (int64_t c0 = 0; c0 < C;) {
    const int64_t c1 = pv::group_end(req, c0, C);
    Group g;
    g.req = req[c0];
    for (int64_t c = c0; c < c1; ++c) {
      if (cu[c + 1] == cu[c]) continue;  // a copy without suffix tokens has no rows
      g.slots.push_back(Slot{c, cu[c], cu[c + 1] - cu[c], plen[c], 0});
    }
    std::stable_sort(g.slots.begin(), g.slots.end(),
                     [](const Slot& x, const Slot& y) { return x.prefix > y.prefix; });
    int64_t row = 0;
    g.key_lo = std::numeric_limits<int64_t>::max();
    for (Slot& s : g.slots) {
      s.row0 = row;
      row += s.len * G;
      g.key_hi = std::max(g.key_hi, s.prefix);
      g.key_lo = std::min(g.key_lo, pv::prefix_window_lo(s.prefix, 0, sliding_window));
    }
    g.rows = row;
    if (g.key_lo > g.key_hi) g.key_lo = g.key_hi;
    if (g.rows > 0) groups.push_back(std::move(g));
    c0 = c1;
  }

  // ---- work items: (group, kv head, key split)
  const int64_t threads = at::get_num_threads();
  const int64_t pairs = static_cast<int64_t>(groups.size()) * Hkv;
  const int64_t want_splits = pairs >= 2 * threads ? 1 : pv::ceil_div(2 * threads, std::max<int64_t>(pairs, 1));
  const bool lp = use_lowp(q.scalar_type());
  const int64_t Dp = lp ? pv::ceil_div(D, 64) * 64 : pv::ceil_div(D, VS) * VS;
  std::vector<Item> items;
  std::vector<std::vector<int64_t>> split_items;
  int64_t ws_size = 0;
  for (int64_t gi = 0; gi < static_cast<int64_t>(groups.size()); ++gi) {
    const Group& g = groups[gi];
    const int64_t span = g.key_hi - g.key_lo;
    int64_t ns = std::min(want_splits, std::max<int64_t>(1, span / kMinSplitKeys));
    const int64_t chunk = ns > 1 ? pv::ceil_div(pv::ceil_div(span, ns), kKeyTile) * kKeyTile : span;
    if (ns > 1) ns = pv::ceil_div(span, chunk);
    for (int64_t h = 0; h < Hkv; ++h) {
      if (ns <= 1) {
        items.push_back(Item{gi, h, g.key_lo, g.key_hi, true, 0, -1});
        continue;
      }
      std::vector<int64_t> ids;
      for (int64_t s = 0; s < ns; ++s) {
        const int64_t kb = g.key_lo + s * chunk, ke = std::min(g.key_hi, kb + chunk);
        ids.push_back(static_cast<int64_t>(items.size()));
        items.push_back(Item{gi, h, kb, ke, s == 0, s, ws_size});
        ws_size += g.rows * (Dp + 2);
      }
      split_items.push_back(std::move(ids));
    }
  }
  // Items stay in (group, head, split) order: parallel_for hands each thread a
  // contiguous range, so a thread's items are cache neighbours.

  auto launch = [&](auto* tag) {
    using scalar_t = std::remove_pointer_t<decltype(tag)>;
    Args<scalar_t> p;
    fill_operands<scalar_t>(p, a);
    p.block_size = block_size;
    p.lp = lp;
    p.Hq = Hq; p.Hkv = Hkv; p.G = G; p.D = D; p.Dp = Dp;
    p.scale = static_cast<float>(scale);
    p.softcap = static_cast<float>(softcap);
    p.window = sliding_window;
    run<scalar_t>(p, groups, items, ws_size, split_items);
  };
  switch (q.scalar_type()) {
    case at::kFloat: launch(static_cast<float*>(nullptr)); break;
    case at::kHalf: launch(static_cast<at::Half*>(nullptr)); break;
    case at::kBFloat16: launch(static_cast<at::BFloat16*>(nullptr)); break;
    default: TORCH_CHECK(false, "prefix_verify_attention: unsupported dtype ", q.scalar_type());
  }
}

}  // namespace parse_vllm
