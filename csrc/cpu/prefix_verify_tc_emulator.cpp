// The tensor-core kernel (csrc/cuda/prefix_verify_attention_tc.cu) run on the
// host: the same schedule, from the same header (csrc/prefix_verify_tiling.h),
// with the same numerics in scalar form.  It exists so that tests without a GPU
// can check the kernel's schedule over thousands of fuzzed calls
// (tests/test_kernel_tc_schedule.py):
//   * every visible (row, key) pair is accumulated exactly once and no other
//     pair at all (`visits` counts each pair the kernel would keep: every pair
//     of a FULL tile, the unmasked pairs of a PARTIAL one, none of a SKIP);
//   * a kept pair is always a loaded key (checked here: a kept key the kernel
//     would have zero-filled is an error);
//   * the numerics (inputs in bf16 / fp16, fp32 logits in log2 units, P rounded
//     to the input dtype, fp32 online softmax per key tile, split partials and
//     their merge) match a float64 reference within the dtype's tolerance.
// What it does not model: the fragment layouts, shared-memory addressing and
// the cp.async pipeline (tests/test_kernel_cuda.py on a GPU, and the compile
// checks of tests/test_cuda_compile.py).
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "../ops.h"
#include "../prefix_verify_common.h"
#include "../prefix_verify_tiling.h"

namespace parse_vllm {
namespace {

struct TileRef {
  int64_t c0 = -1, c1 = -1, row0 = 0;
};

// Row tile `x` of the call, found the way each CTA finds it (prefix sum of the
// runs' tile counts), serially.
TileRef find_tile(const int32_t* copy_req, const int32_t* cu, int64_t C, int64_t G, int64_t rows, int64_t x) {
  int64_t first = 0;
  for (int64_t c = 0; c < C; ++c) {
    const int64_t n = pv::run_tile_count(copy_req, cu, c, C, G, rows);
    if (n > 0 && x >= first && x < first + n) {
      return TileRef{c, pv::group_end(copy_req, c, C), (x - first) * rows};
    }
    first += n;
  }
  return TileRef{};
}

template <typename scalar_t, int D>
void emulate(const PrefixVerifyArgs& a, int64_t num_sms, const at::Tensor& visits) {
  using Shape = pv::TcShape<D>;
  constexpr int N = Shape::kKeys;
  constexpr int ROWS = Shape::kRows, WR = Shape::kWarpRows;  // a warp owns rows [w WR, w WR + WR)
  auto rnd = [](float x) { return static_cast<float>(static_cast<scalar_t>(x)); };

  const at::Tensor &q = a.q, &k_new = a.k_new, &v_new = a.v_new, &out = a.out;
  const at::Tensor &kc = a.key_cache, &vc = a.value_cache, &bt = a.block_table;
  const int64_t T = q.size(0), Hq = q.size(1), Hkv = k_new.size(1), G = Hq / Hkv;
  const int64_t C = a.copy_req.size(0), block_size = kc.size(1);
  const int32_t* copy_req = a.copy_req.data_ptr<int32_t>();
  const int32_t* plen = a.copy_prefix_len.data_ptr<int32_t>();
  const int32_t* cu = a.cu_copy_lens.data_ptr<int32_t>();
  const int32_t* btp = bt.data_ptr<int32_t>();
  const scalar_t* qp = q.data_ptr<scalar_t>();
  const scalar_t* knp = k_new.data_ptr<scalar_t>();
  const scalar_t* vnp = v_new.data_ptr<scalar_t>();
  const scalar_t* kcp = kc.data_ptr<scalar_t>();
  const scalar_t* vcp = vc.data_ptr<scalar_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  int32_t* vis = visits.data_ptr<int32_t>();
  const int64_t vis_cols = visits.size(2), K_cols = vis_cols - T;
  const pv::CacheStrides ks{kc.stride(0), kc.stride(1), kc.stride(2)};
  const pv::CacheStrides vs{vc.stride(0), vc.stride(1), vc.stride(2)};
  const int64_t window = a.sliding_window;
  const float scale = static_cast<float>(a.scale), softcap = static_cast<float>(a.softcap);

  const int64_t max_prefix_len = a.max_prefix_len > 0 ? a.max_prefix_len : bt.size(1) * block_size;
  const int64_t est_tiles = pv::ceil_div(T * G, ROWS);
  const int64_t row_tiles = pv::max_row_tiles(T, C, G, ROWS);
  const pv::SplitPlan sp = pv::plan_splits(max_prefix_len, est_tiles, Hkv, pv::kTcCtasPerSm * num_sms, N);
  const int64_t S = sp.num_splits;
  std::vector<float> ws_m, ws_l, ws_acc;
  if (S > 1) {
    ws_m.assign(S * T * Hq, pv::kNegInf);
    ws_l.assign(S * T * Hq, -1.f);  // -1: never written (the merge refuses it)
    ws_acc.assign(S * T * Hq * D, 0.f);
  }

  std::vector<float> Kt(N * D), Vt(N * D);
  std::vector<char> loaded(N);
  // The CTAs in the kernel's dispatch order (one grid dimension, row tile slowest); the rows of
  // a tile are found once per tile, as every CTA of that tile finds them.
  TileRef tile;
  int64_t tile_of_rows = -1;
  pv::RowInfo ri[ROWS];
  pv::RowBounds wb[pv::kTcWarps];
  pv::RowBounds cb = pv::empty_bounds();
  const int32_t* bt_row = nullptr;
  for (int64_t linear = 0; linear < row_tiles * Hkv * S; ++linear) {
    const pv::CtaCoords cta = pv::tc_cta_coords(linear, Hkv, S);
    const int64_t h = cta.h, split = cta.split;
    if (cta.tile != tile_of_rows) {
      tile_of_rows = cta.tile;
      tile = find_tile(copy_req, cu, C, G, ROWS, cta.tile);
      if (tile.c0 < 0) continue;  // a CTA past the real tiles: returns at once
      bt_row = btp + static_cast<int64_t>(copy_req[tile.c0]) * bt.stride(0);
      cb = pv::empty_bounds();
      for (int w = 0; w < pv::kTcWarps; ++w) {
        wb[w] = pv::empty_bounds();
        for (int r = w * WR; r < w * WR + WR; ++r) {
          ri[r] = pv::run_row(cu, plen, tile.c0, tile.c1, G, window, T, tile.row0 + r);
          pv::add_row(wb[w], ri[r]);
        }
        cb = pv::merge_bounds(cb, wb[w]);
      }
    }
    if (tile.c0 < 0) continue;
    const pv::KeyRange cached = pv::split_key_tiles(cb, sp, split, N);
    const pv::KeyRange suffix = split == 0 ? pv::suffix_key_range(cb) : pv::KeyRange{0, 0};
    const int64_t n_cached = cached.hi > cached.lo ? pv::ceil_div(cached.hi - cached.lo, N) : 0;
    const int64_t n_suffix = suffix.hi > suffix.lo ? pv::ceil_div(suffix.hi - suffix.lo, N) : 0;
    // per-row state
    std::vector<float> m(ROWS, pv::kNegInf), l(ROWS, 0.f), o(ROWS * D, 0.f);
    std::vector<float> Q(ROWS * D, 0.f);
    for (int r = 0; r < ROWS; ++r) {
      if (!ri[r].valid) continue;
      const scalar_t* src = qp + ri[r].t * q.stride(0) + (h * G + ri[r].g) * q.stride(1);
      for (int d = 0; d < D; ++d) Q[r * D + d] = static_cast<float>(src[d]);
    }
    for (int64_t i = 0; i < n_cached + n_suffix; ++i) {
      const bool is_cached = i < n_cached;
      const int64_t k0 = is_cached ? cached.lo + i * N : suffix.lo + (i - n_cached) * N;
      const scalar_t* kbase = is_cached ? kcp : knp;
      const scalar_t* vbase = is_cached ? vcp : vnp;
      for (int n = 0; n < N; ++n) {
        const int64_t key = k0 + n;
        const pv::KeySource src =
            is_cached ? pv::cached_key_source(key, cached, cb, bt_row, block_size, ks, vs, h)
                      : pv::suffix_key_source(key, suffix, k_new.stride(0), k_new.stride(1), v_new.stride(0),
                                              v_new.stride(1), h);
        const bool load = src.k >= 0;
        loaded[n] = load;
        for (int d = 0; d < D; ++d) {
          Kt[n * D + d] = load ? static_cast<float>(kbase[src.k + d]) : 0.f;
          Vt[n * D + d] = load ? static_cast<float>(vbase[src.v + d]) : 0.f;
        }
      }
      for (int w = 0; w < pv::kTcWarps; ++w) {
        const pv::TileKind kind =
            is_cached ? pv::classify_cached_tile(k0, k0 + N, wb[w]) : pv::classify_suffix_tile(k0, k0 + N, wb[w]);
        if (kind == pv::kTileSkip) continue;
        for (int r = w * WR; r < w * WR + WR; ++r) {
          float xs[N];
          float mx = pv::kNegInf;
          for (int n = 0; n < N; ++n) {
            const int64_t key = k0 + n;
            bool keep = true;
            if (kind == pv::kTilePartial) {
              keep = ri[r].valid && (is_cached ? pv::cached_pair_visible(key, ri[r].lo, ri[r].P)
                                               : pv::suffix_pair_visible(key, ri[r].t, ri[r].tok0, window));
            }
            float dot = 0.f;
            for (int d = 0; d < D; ++d) dot += Q[r * D + d] * Kt[n * D + d];
            xs[n] = keep ? pv::tc_logit(dot, scale, softcap) : pv::kNegInf;
            mx = std::max(mx, xs[n]);
            if (keep && ri[r].valid) {
              TORCH_CHECK(loaded[n], "prefix_verify_tc_emulate: row ", tile.row0 + r, " of run at copy ",
                          tile.c0, " keeps ", is_cached ? "cached key " : "suffix token ", key,
                          " that the kernel did not load");
              const int64_t col = is_cached ? key : K_cols + key;
              TORCH_CHECK(col >= 0 && col < vis_cols && (!is_cached || key < K_cols),
                          "prefix_verify_tc_emulate: accumulated ", is_cached ? "cached key " : "suffix token ",
                          key, " outside the visits table (", K_cols, " cached columns)");
              ++vis[(ri[r].t * Hq + h * G + ri[r].g) * vis_cols + col];
            }
          }
          const float m_new = std::max(m[r], mx);
          const float alpha = pv::tc_rescale(m[r], m_new);
          m[r] = m_new;
          l[r] *= alpha;
          for (int d = 0; d < D; ++d) o[r * D + d] *= alpha;
          for (int n = 0; n < N; ++n) {
            const float pw = rnd(pv::tc_weight(xs[n], m_new));
            if (pw == 0.f) continue;
            l[r] += pw;
            for (int d = 0; d < D; ++d) o[r * D + d] += pw * Vt[n * D + d];
          }
        }
      }
    }
    for (int r = 0; r < ROWS; ++r) {
      if (!ri[r].valid) continue;
      const int64_t t = ri[r].t, hq = h * G + ri[r].g;
      if (S == 1) {
        const float inv = pv::finalize_scale(l[r]);
        for (int d = 0; d < D; ++d)
          op[t * out.stride(0) + hq * out.stride(1) + d] = static_cast<scalar_t>(o[r * D + d] * inv);
      } else {
        const int64_t idx = (split * T + t) * Hq + hq;
        ws_m[idx] = m[r];
        ws_l[idx] = l[r];
        for (int d = 0; d < D; ++d) ws_acc[idx * D + d] = o[r * D + d];
      }
    }
  }
  if (S == 1) return;
  for (int64_t row = 0; row < T * Hq; ++row) {
    const int64_t t = row / Hq, hq = row - t * Hq;
    if (!pv::merge_row_written(cu, C, t)) continue;  // no split wrote it: the merge leaves it
    float m_max = pv::kNegInf;
    for (int64_t s = 0; s < S; ++s) {
      TORCH_CHECK(ws_l[s * T * Hq + row] >= 0.f, "prefix_verify_tc_emulate: split ", s, " wrote no state for token ",
                  t, ", head ", hq);
      m_max = std::max(m_max, ws_m[s * T * Hq + row]);
    }
    float lsum = 0.f;
    for (int64_t s = 0; s < S; ++s) lsum += pv::tc_rescale(ws_m[s * T * Hq + row], m_max) * ws_l[s * T * Hq + row];
    const float inv = pv::finalize_scale(lsum);
    for (int d = 0; d < D; ++d) {
      float acc = 0.f;
      for (int64_t s = 0; s < S; ++s) {
        const float w = pv::tc_rescale(ws_m[s * T * Hq + row], m_max);
        if (w != 0.f) acc += w * ws_acc[(s * T * Hq + row) * D + d];
      }
      op[t * out.stride(0) + hq * out.stride(1) + d] = static_cast<scalar_t>(acc * inv);
    }
  }
}

template <typename scalar_t>
void emulate_dtype(const PrefixVerifyArgs& a, int64_t num_sms, const at::Tensor& visits) {
  switch (a.q.size(2)) {
    case 32: emulate<scalar_t, 32>(a, num_sms, visits); break;
    case 64: emulate<scalar_t, 64>(a, num_sms, visits); break;
    case 80: emulate<scalar_t, 80>(a, num_sms, visits); break;
    case 96: emulate<scalar_t, 96>(a, num_sms, visits); break;
    case 128: emulate<scalar_t, 128>(a, num_sms, visits); break;
    case 256: emulate<scalar_t, 256>(a, num_sms, visits); break;
    default: TORCH_CHECK(false, "prefix_verify_tc_emulate: head size ", a.q.size(2), " not supported");
  }
}

}  // namespace

void prefix_verify_tc_emulate(const PrefixVerifyArgs& a, int64_t num_sms, const at::Tensor& visits) {
  if (a.q.scalar_type() == at::kBFloat16) {
    emulate_dtype<c10::BFloat16>(a, num_sms, visits);
  } else {
    emulate_dtype<c10::Half>(a, num_sms, visits);
  }
}

}  // namespace parse_vllm
