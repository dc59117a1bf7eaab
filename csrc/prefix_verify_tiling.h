// Schedule of the tensor-core kernel (csrc/cuda/prefix_verify_attention_tc.cu):
// which CTA owns which query rows, which cached keys each split walks, how each
// key tile is classified against the staircase, and which (row, key) pairs a
// partial tile keeps.  Host + device, no torch: the CUDA kernel calls these
// functions, and the CPU emulator (csrc/cpu/prefix_verify_tc_emulator.cpp) runs
// the same schedule on the host so that tests can check, over thousands of
// fuzzed calls, that every visible (row, key) pair is accumulated exactly once
// and no other pair at all (tests/test_kernel_tc_schedule.py).
//
// Rows.  Copies are grouped in runs (maximal runs of consecutive copies of one
// request, prefix_verify_common.h).  The query rows of one (run, kv head) are
// all G = Hq / Hkv query heads of every suffix token of the run, token-major
// and head-minor: row r of the run is token cu[c0] + r / G, query head
// h * G + r % G.  So the G heads of a token and the copies of a request share
// every key tile a CTA loads (FlashInfer / FA3 "packed GQA", Hydragen's batching
// of the queries that share a prefix).
//
// Worked example (the schedule of one call), with tiles of 64 rows and 64 keys to
// keep the numbers small (TcShape gives the real ones by head size).  G = 4, a request
// judged by K = 3 copies of an L = 24-token suffix after P = 1000, 1100, 1200
// cached tokens, then a second request with one copy after P = 300:
//   copy_req = [0, 0, 0, 1], cu = [0, 24, 48, 72, 96], copy_prefix_len = [1000, 1100, 1200, 300]
//   run 0 = copies [0, 3): 72 tokens x 4 heads = 288 rows -> 5 row tiles (4 x 64 + 32)
//   run 1 = copy 3:        24 x 4 = 96 rows              -> 2 row tiles (64 + 32)
//   row tile 1 of run 0 = rows [64, 128) = tokens 16..31: copy 0 (tokens 16..23, P 1000)
//   and copy 1 (tokens 24..31, P 1100).  Its cached keys: [0, 1100).  With 64-key
//   tiles, keys [0, 960) are FULL (seen by every row: no mask), [960, 1024) too
//   (960 + 64 <= 1000), [1024, 1088) and [1088, 1152) PARTIAL (rows of copy 0 stop
//   at 1000), [1152, ...) SKIPPED (never loaded).  Its suffix keys: tokens
//   [0, 32) of k_new, causal within each copy.
//   Grid: one dimension of (row tile, kv head, split) CTAs, row tile slowest
//   (tc_cta_coords), over an upper bound of the row tiles, ceil(T * G / rows) +
//   C = 6 + 4 = 10: the CTAs of the 3 tiles past the real 7 come last in
//   dispatch order and return at once.
#pragma once

#include <cstdint>

#include "prefix_verify_common.h"

namespace parse_vllm {
namespace pv {

// ---------------------------------------------------------------- tile shapes

// Query rows per CTA: 4 warps, each owning kMTiles m16 MMA tiles of rows.
constexpr int kTcWarps = 4;
constexpr int kTcThreads = kTcWarps * 32;

// The CTA's tile shape by head size.
//   * Rows: up to D = 128, 128 rows (two m16 tiles per warp), so that each K and
//     V fragment a warp reads from shared memory feeds two MMAs, halving the
//     shared-memory reads and the L2 -> shared traffic per FLOP (FA2's 128-row
//     tiles at head size 128); at D = 256, 64 rows (one m16 tile per warp: the O
//     accumulator of two would take 256 registers).
//   * Keys per shared-memory tile and pipeline stages: 64 keys double-buffered
//     up to D = 80, 32 keys double-buffered at D = 96 and 128, 32 keys in one
//     stage at D = 256, so that Q plus the K / V ring (rows padded by 16 bytes)
//     fits the 99 KB per block of sm_86 / sm_89 at every head size (D = 80: Q
//     22.5 KB + 2 x (K + V) 45 KB = 67.5 KB; D = 128: 34.8 + 34.8 = 70 KB; D =
//     256: 33.8 + 33.8 = 68 KB), and the registers of O (kMTiles x D / 2 a
//     thread) and S (kMTiles x kKeys / 2) stay within 255 without spills
//     (tests/test_cuda_compile.py checks it for every head size and
//     architecture; 64-key tiles spilled at D = 96).
template <int D>
struct TcShape {
  static_assert(D % 16 == 0, "head size must be a multiple of 16 for the MMA path");
  static constexpr int kMTiles = D <= 128 ? 2 : 1;  // m16 row tiles per warp
  static constexpr int kWarpRows = 16 * kMTiles;
  static constexpr int kRows = kTcWarps * kWarpRows;  // query rows per CTA
  static constexpr int kKeys = D <= 80 ? 64 : 32;
  static constexpr int kStages = D <= 128 ? 2 : 1;
  static constexpr int kPad = 8;  // elements of padding per shared row: conflict-free fragment loads
  static constexpr int kRowStride = D + kPad;
};

// The same shape for a head size known only at run time (the launch plan's binding),
// read from the very instance the kernel uses: a head size the kernel is instantiated
// for (32, 64, 80, 96, 128, 256), else {0, 0} (callers check the head size first).
struct TcTile {
  int64_t rows, keys;
};

template <int D>
constexpr TcTile tc_tile_of() {
  return TcTile{TcShape<D>::kRows, TcShape<D>::kKeys};
}

inline TcTile tc_tile(int64_t D) {
  switch (D) {
    case 32: return tc_tile_of<32>();
    case 64: return tc_tile_of<64>();
    case 80: return tc_tile_of<80>();
    case 96: return tc_tile_of<96>();
    case 128: return tc_tile_of<128>();
    case 256: return tc_tile_of<256>();
    default: return TcTile{0, 0};
  }
}

// Smallest key range one split covers (FlashInfer's minimum KV chunk).
constexpr int64_t kTcMinChunk = 128;
// Upper bound on splits (the merge reads every split's partial state).
constexpr int64_t kTcMaxSplits = 64;

// ---------------------------------------------------------------- row tiles

// Row tiles the run starting at copy c contributes (0 when c does not start a
// run).  Every CTA computes this for all copies and prefix-sums it (in
// parallel); the emulator does the same serially.
PV_HD int64_t run_tile_count(const int32_t* copy_req, const int32_t* cu, int64_t c, int64_t num_copies,
                             int64_t G, int64_t rows_per_tile) {
  if (!is_group_start(copy_req, c)) return 0;
  const int64_t ce = group_end(copy_req, c, num_copies);
  return ceil_div((static_cast<int64_t>(cu[ce]) - cu[c]) * G, rows_per_tile);
}

// An upper bound of the row tiles of a call from what the host knows without
// reading the index tensors: each run adds at most one partial tile.
PV_HD int64_t max_row_tiles(int64_t T, int64_t num_copies, int64_t G, int64_t rows_per_tile) {
  return ceil_div(T * G, rows_per_tile) + num_copies;
}

// CTA `linear` of the one-dimensional grid: row tile slowest, then kv head,
// then split.  The grid holds max_row_tiles x Hkv x S CTAs; GPUs dispatch
// blockIdx.x in increasing order, so every CTA of a real row tile is dispatched
// before the empty ones past the last tile (which only find that they have no
// rows and return).
struct CtaCoords {
  int64_t tile, h, split;
};

PV_HD CtaCoords tc_cta_coords(int64_t linear, int64_t Hkv, int64_t num_splits) {
  CtaCoords c;
  c.split = linear % num_splits;
  const int64_t th = linear / num_splits;
  c.h = th % Hkv;
  c.tile = th / Hkv;
  return c;
}

// One query row of a run.
struct RowInfo {
  bool valid;     // false past the run's last row (tile padding)
  int32_t t;      // suffix token (row of q / k_new / out)
  int32_t g;      // query head within the kv head's group
  int32_t copy;   // copy of token t
  int32_t P;      // cached keys the copy sees: [lo, P)
  int32_t lo;     // first cached key the row sees (sliding window), 0 without one
  int32_t tok0;   // first suffix token of the copy (its own keys: [tok0, t])
};

// Row r of the run of copies [c0, c1).  The copy of token t is found by a
// binary search of cu over the run's copies (empty copies are skipped).  A
// token at or past T (cu_copy_lens[-1] > T breaks the contract, and on a GPU
// the values are not checked) is no row: nothing is read or written past T.
PV_HD RowInfo run_row(const int32_t* cu, const int32_t* copy_prefix_len, int64_t c0, int64_t c1, int64_t G,
                      int64_t window, int64_t T, int64_t r) {
  RowInfo x{};
  const int64_t tok0 = cu[c0];
  const int64_t t = tok0 + r / G;
  x.valid = t < cu[c1] && t < T;
  if (!x.valid) return x;
  int64_t lo = c0, hi = c1;  // invariant: cu[lo] <= t < cu[hi]
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) >> 1;
    if (cu[mid] <= t) lo = mid; else hi = mid;
  }
  x.t = static_cast<int32_t>(t);
  x.g = static_cast<int32_t>(r % G);
  x.copy = static_cast<int32_t>(lo);
  x.P = copy_prefix_len[lo];
  x.tok0 = cu[lo];
  x.lo = static_cast<int32_t>(prefix_window_lo(x.P, t - x.tok0, window));
  return x;
}

// ---------------------------------------------------------------- staircase

// The cached-key bounds of a set of rows (a CTA's or a warp's): each row sees
// [lo, P).  Empty set: lo_min = INT32_MAX, hi_max = 0 (every tile skips).
struct RowBounds {
  int32_t lo_min, lo_max;  // min / max of the rows' first visible key
  int32_t hi_min, hi_max;  // min / max of the rows' prefix lengths P
  int32_t t_min, t_max;    // min / max suffix token
  int32_t tok0_min;        // min first token of the rows' copies
};

PV_HD RowBounds empty_bounds() {
  return RowBounds{2147483647, -2147483647 - 1, 2147483647, 0, 2147483647, -1, 2147483647};
}

PV_HD RowBounds merge_bounds(RowBounds a, const RowBounds& b) {
  a.lo_min = b.lo_min < a.lo_min ? b.lo_min : a.lo_min;
  a.lo_max = b.lo_max > a.lo_max ? b.lo_max : a.lo_max;
  a.hi_min = b.hi_min < a.hi_min ? b.hi_min : a.hi_min;
  a.hi_max = b.hi_max > a.hi_max ? b.hi_max : a.hi_max;
  a.t_min = b.t_min < a.t_min ? b.t_min : a.t_min;
  a.t_max = b.t_max > a.t_max ? b.t_max : a.t_max;
  a.tok0_min = b.tok0_min < a.tok0_min ? b.tok0_min : a.tok0_min;
  return a;
}

PV_HD void add_row(RowBounds& b, const RowInfo& x) {
  if (x.valid) b = merge_bounds(b, RowBounds{x.lo, x.lo, x.P, x.P, x.t, x.t, x.tok0});
}

enum TileKind : int { kTileSkip = 0, kTilePartial = 1, kTileFull = 2 };

// How the cached keys [k0, k1) relate to the rows of `b`: FULL when every row
// sees every key (no mask is applied), SKIP when no row sees any (the tile is
// not loaded, or the warp does no MMA), else PARTIAL (each pair is masked by
// cached_pair_visible).
PV_HD TileKind classify_cached_tile(int64_t k0, int64_t k1, const RowBounds& b) {
  if (b.hi_max <= 0 || k0 >= b.hi_max || k1 <= b.lo_min) return kTileSkip;
  if (k0 >= b.lo_max && k1 <= b.hi_min) return kTileFull;
  return kTilePartial;
}

PV_HD bool cached_pair_visible(int64_t key, int32_t lo, int32_t P) { return key >= lo && key < P; }

// Suffix keys are tokens of k_new: row (token t of a copy starting at tok0)
// sees tokens [max(tok0, t - W + 1), t].  A tile of tokens [j0, j1) against a
// set of rows: SKIP when it holds no token any row sees.  (Suffix tiles are
// always masked: they are one or two tiles per row tile.)
PV_HD bool suffix_pair_visible(int64_t tk, int32_t t, int32_t tok0, int64_t window) {
  return tk >= tok0 && tk <= t && (window <= 0 || t - tk < window);
}

PV_HD TileKind classify_suffix_tile(int64_t j0, int64_t j1, const RowBounds& b) {
  if (b.t_max < 0 || j0 > b.t_max || j1 <= b.tok0_min) return kTileSkip;
  return kTilePartial;
}

// The suffix tokens a CTA's rows may see: [tok0_min, t_max + 1).
PV_HD KeyRange suffix_key_range(const RowBounds& b) {
  KeyRange r;
  r.lo = b.tok0_min;
  r.hi = b.t_max + 1;
  if (b.t_max < 0) r.lo = r.hi = 0;
  return r;
}

// ---------------------------------------------------------------- key splits

// Split-KV (flash-decoding): split s walks the cached keys [s * chunk, (s + 1)
// * chunk), and the last split runs on to the largest prefix of its rows: a
// prefix longer than the max_prefix_len the plan was made for (a caller's
// mistake, or a CUDA graph captured with shorter prefixes and replayed with
// longer ones) costs time in the last split, never keys.  The chunk is a whole
// number of key tiles, so that no tile straddles two splits.
struct SplitPlan {
  int64_t num_splits;
  int64_t chunk;
};

// The plan's cost model, in units of one key tile of one CTA: a CTA costs its
// key tiles plus kTcCtaOverheadTiles (finding its rows, loading Q, the first
// tile's latency); several splits add kTcMergeTiles (the fp32 partial states
// written and read again, and the merge launch).  CTAs run in waves of `slots`
// (SMs x resident CTAs per SM), and a call costs its number of waves times one
// CTA, except that a last wave of at most kTcFreeSliverPct % of the slots is
// not charged: the CTAs of nested prefixes are unequal (a row tile of short
// prefixes ends its last split early), so a sliver past whole waves overlaps
// the long CTAs' tails.  Rough figures from the 2026-11-28 review's H100 model
// (about 0.9 us a tile, a 3 us cold prologue, about 5 us for the merge and its
// launch); the sliver from a list-scheduling simulation of the goal shapes'
// staircases (docs/compiled-op.md, "Kernel round two").
constexpr int64_t kTcCtaOverheadTiles = 2;
constexpr int64_t kTcMergeTiles = 5;
constexpr int64_t kTcFreeSliverPct = 15;
// Resident CTAs per SM the plan assumes: at most 70 KB of shared memory and 128
// threads x 255 registers per CTA, two per SM on sm_80 / sm_90 (one on sm_86 /
// sm_89, whose plan is then half a wave deep, never wrong).
constexpr int64_t kTcCtasPerSm = 2;

PV_HD int64_t tc_plan_cost(int64_t key_tiles, int64_t splits, int64_t pairs, int64_t slots) {
  const int64_t per_cta = ceil_div(key_tiles, splits) + kTcCtaOverheadTiles;
  const int64_t charged = pairs * splits - slots * kTcFreeSliverPct / 100;
  const int64_t waves = charged > slots ? ceil_div(charged, slots) : 1;
  return waves * per_cta + (splits > 1 ? kTcMergeTiles : 0);
}

// The split count of least modelled cost for `est_row_tiles` row tiles x Hkv
// kv heads over max_prefix_len keys (the caller's bound, never the block
// table's width), each split at least kTcMinChunk keys and at most
// kTcMaxSplits splits; ties go to fewer splits.  So a split count is not
// rounded up into a partial wave of more than a sliver, and where unsplit CTAs
// already fill their waves there is no split and no merge launch.
PV_HD SplitPlan plan_splits(int64_t max_prefix_len, int64_t est_row_tiles, int64_t Hkv, int64_t slots,
                            int64_t keys_per_tile) {
  const int64_t P = max_prefix_len > 0 ? max_prefix_len : 1;
  const int64_t pairs = (est_row_tiles > 0 ? est_row_tiles : 1) * (Hkv > 0 ? Hkv : 1);
  const int64_t S_slots = slots > 0 ? slots : 1;
  const int64_t tiles = ceil_div(P, keys_per_tile);
  const int64_t min_tiles = ceil_div(kTcMinChunk, keys_per_tile);
  int64_t most = ceil_div(tiles, min_tiles);
  most = most < kTcMaxSplits ? most : kTcMaxSplits;
  SplitPlan best{1, tiles * keys_per_tile};
  int64_t best_cost = tc_plan_cost(tiles, 1, pairs, S_slots);
  for (int64_t s = 2; s <= most; ++s) {
    const int64_t per = ceil_div(tiles, s);
    if (ceil_div(tiles, per) != s) continue;  // the same chunk as a smaller count
    const int64_t cost = tc_plan_cost(tiles, s, pairs, S_slots);
    if (cost < best_cost) {
      best_cost = cost;
      best = SplitPlan{s, per * keys_per_tile};
    }
  }
  return best;
}

// The cached key tiles split `s` walks for rows `b`: tile starts k0 in
// [first, end) step keys_per_tile, aligned to keys_per_tile.  The last split
// has no upper end of its own (see SplitPlan).
PV_HD KeyRange split_key_tiles(const RowBounds& b, const SplitPlan& sp, int64_t s, int64_t keys_per_tile) {
  KeyRange r;
  const int64_t s_lo = s * sp.chunk;
  const bool last = s + 1 >= sp.num_splits;
  const int64_t lo = b.lo_min > s_lo ? b.lo_min : s_lo;
  const int64_t hi = last || b.hi_max < s_lo + sp.chunk ? b.hi_max : s_lo + sp.chunk;
  r.lo = (lo / keys_per_tile) * keys_per_tile;
  r.hi = hi;
  if (hi <= lo) r.lo = r.hi = 0;
  return r;
}

// Which keys of a cached tile are loaded from the cache (the rest of the tile
// is zero-filled): those some row of the CTA sees.  Keys at or past hi_max may
// lie in blocks the request does not own.
PV_HD bool cached_key_loaded(int64_t key, const RowBounds& b) { return key >= b.lo_min && key < b.hi_max; }

// Where slot n of a key tile is read from: the element offset of its key row
// (kv head h) in the key and value source (the caches for a cached tile, k_new
// and v_new for a suffix tile), or -1 for a zero-filled slot.  Computed once
// per key of a tile (one block-table read, one division), not per 16-byte chunk.
struct KeySource {
  int64_t k, v;
};

PV_HD KeySource cached_key_source(int64_t key, const KeyRange& walk, const RowBounds& b, const int32_t* bt_row,
                                  int64_t block_size, const CacheStrides& ks, const CacheStrides& vs, int64_t h) {
  if (key >= walk.hi || !cached_key_loaded(key, b)) return KeySource{-1, -1};
  const int64_t logical_block = key / block_size;
  const int64_t slot = key - logical_block * block_size;
  const int64_t physical = static_cast<int64_t>(bt_row[logical_block]);
  return KeySource{physical * ks.block + slot * ks.token + h * ks.head, physical * vs.block + slot * vs.token + h * vs.head};
}

PV_HD KeySource suffix_key_source(int64_t tk, const KeyRange& walk, int64_t kn_s0, int64_t kn_s1, int64_t vn_s0,
                                  int64_t vn_s1, int64_t h) {
  if (tk >= walk.hi) return KeySource{-1, -1};
  return KeySource{tk * kn_s0 + h * kn_s1, tk * vn_s0 + h * vn_s1};
}

// Rows the merge writes: those some split wrote a state for, the tokens
// [cu[0], min(cu[C], T)) (a call whose cu_copy_lens stops short of T leaves the
// rest of `out` as it was, with one split or several).
PV_HD bool merge_row_written(const int32_t* cu, int64_t num_copies, int64_t t) {
  return num_copies > 0 && t >= cu[0] && t < cu[num_copies];
}

// ---------------------------------------------------------------- softmax, base 2
//
// The kernel keeps logits in log2 units (x = s * scale * log2(e), or the
// soft-capped logit times log2(e)) so that every weight is one exp2.  Split
// partial states store m in those units; the merge uses the same base.

constexpr float kLog2e = 1.4426950408889634f;

PV_HD float tc_logit(float dot, float scale, float softcap) {
  const float s = dot * scale;
  return (softcap > 0.f ? softcap * tanhf(s / softcap) : s) * kLog2e;
}

PV_HD float exp2_of(float x) {
#if defined(__CUDA_ARCH__)
  return exp2f(x);
#else
  return std::exp2(x);
#endif
}

// Rescale factor of the state when the running max moves m_old -> m_new; 0
// when nothing was accumulated (m_old = -inf).
PV_HD float tc_rescale(float m_old, float m_new) { return m_old == kNegInf ? 0.f : exp2_of(m_old - m_new); }

// Weight of logit x under running max m; 0 for a masked logit.
PV_HD float tc_weight(float x, float m) { return x == kNegInf ? 0.f : exp2_of(x - m); }

}  // namespace pv
}  // namespace parse_vllm
