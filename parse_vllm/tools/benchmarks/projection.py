"""What PARSE would gain over the target alone on a GPU: the step costs that
``scripts/gpu_costs.py`` measured there, combined with the acceptance counters of runs
on this CPU (``parse_vllm.get_stats`` through ``parse-vllm eval``: the ``acceptance`` of
each summary row).

Pure: dicts in, dicts and Markdown out; no torch, no vLLM. The model (batch 1, one
request, every step of it costed; ``ASSUMPTIONS`` says what it leaves out):

    time(PARSE)  = plain steps x decode
                 + windows x forward(W + 1 tokens)               the target's step over a judged window
                 + passes x forward(C x L tokens, C logits)      the verification pass
                 + token-level steps x forward(k + 1 tokens)
                 + draft-model tokens x the draft's decode step  windows and its token-level drafts
                 + EAGLE-3 tokens x (one target layer + LM head)
    time(target) = tokens x decode
    speed-up     = time(target) / time(PARSE)

with target steps = tokens - accepted draft tokens (each step writes one token of its own
past what it accepts), plain steps = target steps - windows - token-level steps, W, C, L
and k the runs' means. Per window, the same costs give the window's own balance: accepted
tokens + 1 over W x draft step + forward(W + 1) + its verification passes.

    python -m parse_vllm.tools.benchmarks.projection gpu_costs.json bench/eagle3/summary.json
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

#: eval summaries whose batch-1 rows are projected when none are named
DEFAULT_COUNTERS = (Path("bench/eagle3/summary.json"), Path("bench/eval-coder/summary.json"))

ASSUMPTIONS = (
    "Acceptance transfers: the counters come from runs of a small pair on this CPU (float32); the projection "
    "assumes the GPU pair accepts as much per window and per token-level draft (it depends on the models and "
    "the judge, not the hardware, and the pairs differ).",
    "Batch 1: one request, every step of it on the GPU alone; rows at larger batches are not projected.",
    "Step costs are scripts/gpu_costs.py's: random weights in the geometries' real shapes, a few layers timed "
    "(CUDA graphs) and scaled to the full depth plus the LM head, at the context it used; vLLM's kernels differ.",
    "Target steps = tokens - accepted draft tokens; plain decode steps = target steps - windows - token-level "
    "drafts (the counters' means for W, copies C, suffix L and k).",
    "Forward costs between measured token counts are interpolated linearly; past the largest measured count "
    "they are extrapolated along the last segment. The verification pass is a forward over C x L tokens with "
    "logits at C positions (gpu_costs' upper bound on the copies' attention).",
    "The draft's catch-up tokens (what it missed while the target wrote) ride in its pass's first forward at "
    "no extra cost; an EAGLE-3 proposal token costs one target decoder layer plus the full LM head, and the "
    "head's pass over the target's step tokens is not counted; n-gram proposals are free.",
    "Host work (scheduling, sampling, PARSE's bookkeeping, device read-backs) is not counted on either side.",
)


# --------------------------------------------------------------------------- costs


def _interp(points: list[tuple[float, float]], x: float) -> float:
    """Piecewise-linear through `points` (sorted by x, distinct x); linear past either end
    along the end segment; a single point is a constant."""
    if not points:
        raise ValueError("no measured points")
    if len(points) == 1:
        return points[0][1]
    if x <= points[0][0]:
        (x0, y0), (x1, y1) = points[0], points[1]
    elif x >= points[-1][0]:
        (x0, y0), (x1, y1) = points[-2], points[-1]
    else:
        i = next(i for i in range(1, len(points)) if points[i][0] >= x)
        (x0, y0), (x1, y1) = points[i - 1], points[i]
    y = y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return max(y, 0.0)


def _points(pairs) -> list[tuple[float, float]]:
    """Sorted, one y per x (the mean where a count was measured twice)."""
    by: dict[float, list[float]] = {}
    for x, y in pairs:
        by.setdefault(float(x), []).append(float(y))
    return sorted((x, sum(ys) / len(ys)) for x, ys in by.items())


@dataclass
class ModelCosts:
    """One geometry's costs from a gpu_costs.json, in ms: the layers of a batch-1 forward
    over n new tokens (full depth), the head over p logit positions, the decode step."""

    name: str
    layers: list[tuple[float, float]]  # (new tokens, layer_ms x depth), batch 1
    head: list[tuple[float, float]]  # (logit positions, head_ms)
    layer_decode_ms: float  # one decoder layer, batch 1, one token
    decode_ms: float  # the whole model's decode step at batch 1

    def forward_ms(self, new_tokens: float, positions: float) -> float:
        return _interp(self.layers, new_tokens) + _interp(self.head, positions)


def model_costs(gpu_costs: dict, name: str) -> ModelCosts:
    """The batch-1 cost curves of `name` in a gpu_costs.json (scripts/gpu_costs.py)."""
    m = gpu_costs["models"].get(name)
    if not m or not m["cases"]:
        raise KeyError(f"{name} has no measured cases in this gpu_costs.json")
    depth = m["geometry"]["num_hidden_layers"]
    cases = m["cases"]
    decode = next((c for c in cases if c["case"] == "decode" and c["batch"] == 1), None)
    if decode is None:
        raise KeyError(f"{name} has no batch-1 decode step in this gpu_costs.json")
    layers = _points((c["new_tokens"], c["layer_ms"] * depth) for c in cases if c["batch"] == 1)
    head = _points((c["logit_positions"], c["head_ms"]) for c in cases)
    return ModelCosts(name, layers, head, decode["layer_ms"], decode["model_ms"])


# --------------------------------------------------------------------------- counters


@dataclass
class Counters:
    """A run's PARSE counters, summed over its rows (one request at a time)."""

    tokens: int
    accepted: int  # draft tokens accepted, every kind
    windows: int = 0
    window_tokens: int = 0
    accepted_in_windows: int = 0  # semantically + token-level, inside judged windows
    passes: int = 0
    copies: int = 0
    suffix_tokens: int = 0
    token_level_drafts: dict[str, int] = field(default_factory=dict)  # by proposer
    token_level_draft_tokens: dict[str, int] = field(default_factory=dict)


def _sum_by(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {k: a.get(k, 0) + b.get(k, 0) for k in {**a, **b}}


def counters_from_row(row: dict) -> Counters | None:
    """The counters of one `parse-vllm eval` summary row (None for rows without any: the
    target or the draft alone). Rows before the per-proposer counters existed: the
    token-level drafts are the step drafts that were not windows, by the draft model (by
    EAGLE-3 on vLLM's own `eagle3-k*` rows)."""
    a = row.get("acceptance")
    if not a or a.get("vllm_drafts") is None:
        return None
    windows = int(a.get("drafts", 0))
    window_tokens = int(a.get("draft_tokens", 0))
    in_windows = int(a.get("tokens_accepted_semantic", 0)) + (
        int(a.get("tokens_accepted_token_level", 0)) if "drafts" in a else 0
    )
    by_drafts = {k: int(v) for k, v in (a.get("token_level_drafts") or {}).items()}
    by_tokens = {k: int(v) for k, v in (a.get("token_level_draft_tokens") or {}).items()}
    if "token_level_drafts" not in a:  # older rows
        proposer = "eagle3" if str(row.get("config", "")).startswith("eagle3") else "draft_model"
        steps = max(0, int(a["vllm_drafts"]) - windows)
        toks = max(0, int(a.get("vllm_draft_tokens", 0)) - window_tokens)
        by_drafts, by_tokens = ({proposer: steps}, {proposer: toks}) if steps else ({}, {})
    accepted = a.get("vllm_accepted")
    if accepted is None:
        accepted = in_windows + sum(int(v) for v in (a.get("token_level_accepted_tokens") or {}).values())
    return Counters(
        tokens=int(row["tokens"]),
        accepted=int(accepted),
        windows=windows,
        window_tokens=window_tokens,
        accepted_in_windows=in_windows,
        passes=int(a.get("verification_passes", 0)),
        copies=int(a.get("copies", 0)),
        suffix_tokens=int(a.get("suffix_tokens", 0)),
        token_level_drafts=by_drafts,
        token_level_draft_tokens=by_tokens,
    )


def add(a: Counters, b: Counters) -> Counters:
    plain = {
        k: getattr(a, k) + getattr(b, k)
        for k in (
            "tokens",
            "accepted",
            "windows",
            "window_tokens",
            "accepted_in_windows",
            "passes",
            "copies",
            "suffix_tokens",
        )
    }
    return Counters(
        **plain,
        token_level_drafts=_sum_by(a.token_level_drafts, b.token_level_drafts),
        token_level_draft_tokens=_sum_by(a.token_level_draft_tokens, b.token_level_draft_tokens),
    )


# --------------------------------------------------------------------------- projection


def project(c: Counters, target: ModelCosts, draft: ModelCosts) -> dict:
    """Projected time of PARSE and of the target alone over the run's tokens, in ms, each
    term apart, and the speed-up (module docstring; ASSUMPTIONS)."""
    notes = []
    tl_steps = sum(c.token_level_drafts.values())
    tl_tokens = sum(c.token_level_draft_tokens.values())
    target_steps = c.tokens - c.accepted
    plain = target_steps - c.windows - tl_steps
    if plain < 0:
        notes.append(f"the counters give {plain} plain decode steps (counted as 0)")
        plain = 0
    W = c.window_tokens / c.windows if c.windows else 0.0
    C = c.copies / c.passes if c.passes else 0.0
    L = c.suffix_tokens / c.copies if c.copies else 0.0
    k = tl_tokens / tl_steps if tl_steps else 0.0
    draft_written = c.window_tokens + c.token_level_draft_tokens.get("draft_model", 0)
    eagle3_tokens = c.token_level_draft_tokens.get("eagle3", 0)
    window_ms = target.forward_ms(W + 1, W + 1) if c.windows else 0.0
    pass_ms = target.forward_ms(C * L, C) if c.passes else 0.0
    tl_ms = target.forward_ms(k + 1, k + 1) if tl_steps else 0.0
    eagle3_step_ms = target.layer_decode_ms + _interp(target.head, 1)
    terms = {
        "plain_decode": plain * target.decode_ms,
        "window_forwards": c.windows * window_ms,
        "verification": c.passes * pass_ms,
        "token_level_forwards": tl_steps * tl_ms,
        "draft_model": draft_written * draft.decode_ms,
        "eagle3": eagle3_tokens * eagle3_step_ms,
    }
    parse_ms = sum(terms.values())
    target_ms = c.tokens * target.decode_ms
    out = {
        "target": target.name,
        "draft": draft.name,
        "counters": asdict(c),
        "steps": {
            "target_steps": target_steps,
            "plain_decode_steps": plain,
            "windows": c.windows,
            "verification_passes": c.passes,
            "token_level_steps": tl_steps,
            "draft_model_tokens": draft_written,
            "eagle3_tokens": eagle3_tokens,
        },
        "means": {"window": W, "copies_per_pass": C, "suffix_tokens": L, "token_level_k": k},
        "step_ms": {
            "target_decode": target.decode_ms,
            "window_forward": window_ms,
            "verification_pass": pass_ms,
            "token_level_forward": tl_ms,
            "draft_decode": draft.decode_ms,
            "eagle3_token": eagle3_step_ms,
        },
        "time_ms": {**terms, "total": parse_ms},
        "target_alone_ms": target_ms,
        "speedup": target_ms / parse_ms if parse_ms > 0 else None,
        "notes": notes,
    }
    if c.windows:
        per_window_ms = W * draft.decode_ms + window_ms + (c.passes / c.windows) * pass_ms
        written = c.accepted_in_windows / c.windows + 1
        out["per_window"] = {
            "tokens": written,  # accepted + the target's own token
            "ms": per_window_ms,
            "ms_per_token": per_window_ms / written,
            "target_ms_per_token": target.decode_ms,
            "pays": per_window_ms / written < target.decode_ms,
        }
    return out


def rows_to_project(summary: dict, source: str) -> tuple[list[dict], list[str]]:
    """The batch-1 rows of an eval summary that carry counters, summed over the prompt
    sets per (config, τ, guard); and what was left out, saying why."""
    groups: dict[tuple, dict] = {}
    skipped = []
    for r in summary.get("rows", []):
        c = counters_from_row(r)
        if c is None:
            continue
        if r.get("batch") != 1:
            skipped.append(f"{source}: {r['config']} τ {r.get('tau')} at batch {r.get('batch')} (batch 1 only)")
            continue
        key = (r["config"], r.get("tau"), r.get("guard"))
        g = groups.setdefault(key, {"source": source, "config": key[0], "tau": key[1], "guard": key[2], "sets": []})
        g["counters"] = add(g["counters"], c) if "counters" in g else c
        g["sets"].append(r.get("set"))
    return list(groups.values()), sorted(set(skipped))


def projection(gpu_costs: dict, summaries: dict[str, dict]) -> dict:
    """Every batch-1 row of `summaries` ({source: eval summary}) projected on every pair of
    `gpu_costs` that it measured in full."""
    pairs, missing = [], []
    for p in gpu_costs.get("pairs", []):
        try:
            pairs.append((model_costs(gpu_costs, p["target"]), model_costs(gpu_costs, p["draft"])))
        except KeyError as e:
            missing.append(f"{p['draft']} → {p['target']}: {e.args[0]}")
    rows, skipped = [], []
    for source, summary in summaries.items():
        got, left = rows_to_project(summary, source)
        rows += got
        skipped += left
    for r in rows:
        r["projections"] = [project(r["counters"], t, d) for t, d in pairs]
        r["counters"] = asdict(r["counters"])
    return {
        "gpu": gpu_costs.get("device", {}).get("name"),
        "gpu_costs_measurement": gpu_costs.get("measurement"),
        "dtype": gpu_costs.get("dtype"),
        "context": gpu_costs.get("settings", {}).get("context"),
        "pairs": [f"{d.name} → {t.name}" for t, d in pairs],
        "pairs_not_measured": missing,
        "rows": rows,
        "rows_not_projected": skipped,
        "assumptions": list(ASSUMPTIONS),
    }


# --------------------------------------------------------------------------- Markdown


def _f(x, spec=".2f"):
    return "—" if x is None else format(x, spec)


def section(proj: dict, gpu_costs: dict, costs_name: str = "gpu_costs.json") -> list[str]:
    """BENCHMARKS.md's projection section."""
    out = [
        f"## Projection on {proj['gpu']} (`scripts/gpu_costs.py` + this CPU's counters)",
        "",
        f"Step costs measured on {proj['gpu']} by `scripts/gpu_costs.py` (`{costs_name}`: {proj['dtype']}, "
        f"context {proj['context']}; {proj['gpu_costs_measurement']}), combined with the PARSE counters of the "
        "batch-1 rows of the eval runs below: the speed-up over the target alone that those acceptances would "
        "give on that GPU with each pair's costs. A model, not a measurement: every assumption is listed.",
        "",
    ]
    if not proj["pairs"]:
        return out + ["No pair of the gpu_costs.json was measured in full: nothing to project.", ""]
    out += [
        "| run | row | τ | guard | tokens | windows | accepted / window | "
        + " | ".join(f"× target, {p}" for p in proj["pairs"])
        + " |",
        "|---|---|---:|---:|---:|---:|---:|" + "---:|" * len(proj["pairs"]),
    ]
    for r in proj["rows"]:
        c = r["counters"]
        apw = c["accepted_in_windows"] / c["windows"] if c["windows"] else None
        out.append(
            f"| {r['source']} | {r['config']} | {_f(r['tau'], 'g') if r['tau'] is not None else '—'} | "
            f"{r['guard'] if r['guard'] is not None else '—'} | {c['tokens']} | {c['windows']} | {_f(apw, '.1f')} | "
            + " | ".join(_f(p["speedup"]) for p in r["projections"])
            + " |"
        )
    out += ["", "Measured step costs (ms, full model extrapolated, batch 1 unless said):", ""]
    out += [
        "| model | decode bs 1 | decode bs 8 | decode bs 32 | forward W 16 / 64 / 128 | verify forward K 4 / 8 / 16 |",
        "|---|---:|---:|---:|---|---|",
    ]
    for name, m in gpu_costs.get("models", {}).items():
        dec = {c["batch"]: c["model_ms"] for c in m["cases"] if c["case"] == "decode"}
        win = [f"{c['model_ms']:.2f}" for c in m["cases"] if c["case"] == "window_forward"]
        ver = [f"{c['model_ms']:.2f}" for c in m["cases"] if c["case"] == "verify_forward"]
        out.append(
            f"| {name} | {_f(dec.get(1), '.3f')} | {_f(dec.get(8), '.3f')} | {_f(dec.get(32), '.3f')} | "
            f"{' / '.join(win) or '—'} | {' / '.join(ver) or '—'} |"
        )
    att = gpu_costs.get("verify_attention", [])
    if att:
        out += ["", "Verification attention, one layer (the compiled op against K per-copy SDPA calls, eager):", ""]
        out += ["| model | K × L | op ms | SDPA per copy ms | op speed-up |", "|---|---|---:|---:|---:|"]
        for a in att:
            out.append(
                f"| {a['model']} | {a['copies']} × {a['suffix_tokens']} | {_f(a.get('op_ms'), '.3f')} | "
                f"{_f(a.get('sdpa_per_copy_ms'), '.3f')} | {_f(a.get('op_speedup_vs_sdpa_per_copy'))} |"
            )
    out += ["", "Assumptions:", ""] + [f"- {a}" for a in proj["assumptions"]]
    left = proj["rows_not_projected"] + proj["pairs_not_measured"]
    if left:
        out += ["", "Not projected: " + "; ".join(left[:12]) + (f"; … ({len(left)} in all)" if len(left) > 12 else "")]
    return out


def load_summaries(paths) -> dict[str, dict]:
    """{the summary's folder name: its content} for the eval summaries that exist."""
    return {p.parent.name or str(p): json.loads(p.read_text()) for p in map(Path, paths) if p.is_file()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m parse_vllm.tools.benchmarks.projection", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("gpu_costs", type=Path, help="a gpu_costs.json (scripts/gpu_costs.py)")
    ap.add_argument("summaries", type=Path, nargs="*", default=list(DEFAULT_COUNTERS), help="eval summary.json files")
    ap.add_argument("--json", action="store_true", help="print the projection as JSON instead of Markdown")
    args = ap.parse_args(argv)
    costs = json.loads(args.gpu_costs.read_text())
    summaries = load_summaries(args.summaries)
    if not summaries:
        ap.error("none of the summaries exists: " + ", ".join(map(str, args.summaries)))
    proj = projection(costs, summaries)
    print(json.dumps(proj, indent=1) if args.json else "\n".join(section(proj, costs, args.gpu_costs.name)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
