"""What PARSE would gain over the target alone on a GPU: the step costs that
``scripts/gpu_costs.py`` measured there, combined with the acceptance counters of runs
on this CPU (``parse_vllm.get_stats`` through ``parse-vllm eval``: the ``acceptance`` of
each summary row), at each row's batch.

Pure: dicts in, dicts and Markdown out; no torch, no vLLM. The model at batch 1 (one
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

At batch B > 1 (a row's batch, or its prompt count when smaller) the same counters are
costed as a throughput run: B requests in every engine step, so

    time(PARSE)  = (target steps / B) x E[step(B)]              each request of a step independently a plain,
                                                                a window or a token-level step, in the counters'
                                                                proportions; step = one forward of B sequences
                                                                over their new tokens (the measured decode step
                                                                at batch B when all are plain)
                 + passes x forward(r sequences, C x L tokens, C logits)   r = drafts / passes, in [1, B]
                 + (draft-model tokens / ρ) x the draft's decode step at batch ρ
                                                                ρ = drafter rows / drafter calls, in [1, B]
                 + (EAGLE-3 tokens / B) x (one target layer + LM head, at batch B)
    time(target) = (tokens / B) x decode at batch B
    speed-up     = time(target) / time(PARSE)                   a throughput ratio at equal batch

which is the batch-1 model at B = 1. A forward of b sequences over n new tokens each is
gpu_costs.py's measurement at batch b (``batch_cases``), piecewise linear in n, linear in
b between the measured batches. The window's balance at batch B is its marginal cost: the
step with one window among B - 1 plain requests over the all-plain step, plus its draft
tokens and its share of passes, against decode(B) / B per token.

    python -m parse_vllm.tools.benchmarks.projection gpu_costs.json bench/eagle3/summary.json

Each arm of one run (issue 47 item 6: target alone, token-level k 4, PARSE's whole window,
chunked judging without and with the next chunk drafted while the target judges, adaptive),
``project_arms`` / ``arms_projection``, ARM_ASSUMPTIONS; ``roofline:h100`` stands in for a
gpu_costs.json where none was measured:

    python -m parse_vllm.tools.benchmarks.projection roofline:h100 --arms [--chunk 16]
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

#: eval summaries whose rows are projected when none are named
DEFAULT_COUNTERS = (Path("bench/eagle3/summary.json"), Path("bench/eval-coder/summary.json"))
#: the run whose arms `--arms` projects when none is named (HumanEval odd, the Coder pair, τ_head)
ARMS_COUNTERS = Path("bench/judge-coder/e2e-odd/summary.json")

ASSUMPTIONS = (
    "Acceptance transfers: the counters come from runs of a small pair on this CPU (float32); the projection "
    "assumes the GPU pair accepts as much per window and per token-level draft (it depends on the models and "
    "the judge, not the hardware, and the pairs differ).",
    "Batch 1: one request, every step of it on the GPU alone.",
    "Batch B > 1 (the row's batch, or its prompt count when that is smaller): a throughput run where every engine "
    "step carries B requests, so (target steps) / B steps; the ramp-up and the tail, when fewer requests are left "
    "in flight, are not modelled. The target alone takes tokens / B decode steps at batch B; the speed-up is the "
    "ratio of throughputs at equal batch.",
    "At batch B, each request of a step is independently in a plain decode step, a window step (W + 1 tokens) or a "
    "token-level step (k + 1 tokens), in the proportions of the counters; a step costs one forward of B sequences "
    "over its new tokens (the measured decode step at batch B when all are plain), averaged over those mixes.",
    "A forward of b sequences with n new tokens in all costs gpu_costs' measured forward of b sequences of n / b "
    "new tokens each (equal lengths and contexts, where a real step mixes them) plus the LM head over its logit "
    "positions; linear in b between measured batch sizes; a batch above the largest measured one is not projected.",
    "A verification pass at batch B covers drafts / passes requests (at least 1, at most B): one forward of that "
    "many sequences over the pass's copies x L tokens, logits at its copies.",
    "The draft decodes drafter rows / drafter calls requests at a time (PARSE's counters; at least 1, at most B); "
    "a PARSE row at batch > 1 without those counters costs every draft token at the draft's batch-1 step (an upper "
    "bound); vLLM's own proposers (rows without PARSE counters) and EAGLE-3 propose for the B requests of a step "
    "at once.",
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


class NotProjectable(ValueError):
    """The gpu_costs.json does not cover what a row needs (a batch it did not measure):
    `model` and `why`."""

    def __init__(self, model: str, why: str):
        super().__init__(f"{model}: {why}")
        self.model, self.why = model, why


def _along_batch(batches: list[int], b: float, at, name: str, what: str) -> float:
    """at(b) where b was measured; linear in b between the two measured batches around it."""
    if b in batches:
        return at(b)
    for b0, b1 in zip(batches, batches[1:]):
        if b0 < b < b1:
            return at(b0) + (at(b1) - at(b0)) * (b - b0) / (b1 - b0)
    have = ", ".join(map(str, batches)) or "none"
    raise NotProjectable(name, f"no {what} measured at batch {b:g} (measured at batch {have})")


@dataclass
class ModelCosts:
    """One geometry's costs from a gpu_costs.json, in ms: the layers of a forward of b
    sequences over n new tokens each (full depth), the head over p logit positions (over
    the whole batch), the decode step at each batch."""

    name: str
    layers: list[tuple[float, float]]  # (new tokens, layer_ms x depth), batch 1
    head: list[tuple[float, float]]  # (logit positions, head_ms)
    layer_decode_ms: float  # one decoder layer, batch 1, one token
    decode_ms: float  # the whole model's decode step at batch 1
    # batch -> (new tokens per sequence, layer_ms x depth): every case at that batch
    layers_by_batch: dict[int, list[tuple[float, float]]] = field(default_factory=dict)
    decode_by_batch: dict[int, float] = field(default_factory=dict)  # batch -> the decode step's model_ms
    layer_decode_by_batch: dict[int, float] = field(default_factory=dict)  # batch -> one layer's decode ms

    def forward_ms(self, new_tokens: float, positions: float) -> float:
        """A batch-1 forward over `new_tokens`, logits at `positions`."""
        return _interp(self.layers, new_tokens) + _interp(self.head, positions)

    def forward_batches(self) -> list[int]:
        """The batches at which forwards over several tokens per sequence were measured."""
        return sorted(b for b, pts in self.layers_by_batch.items() if any(n > 1 for n, _ in pts))

    def layers_at(self, batch: float, per_sequence: float) -> float:
        """The layers of a forward of `batch` sequences over `per_sequence` new tokens each."""
        return _along_batch(
            self.forward_batches(),
            batch,
            lambda b: _interp(self.layers_by_batch[b], per_sequence),
            self.name,
            "window or verification forwards",
        )

    def step_ms(self, batch: float, tokens: float, positions: float) -> float:
        """One forward of `batch` sequences with `tokens` new tokens in all, logits at `positions`."""
        return self.layers_at(batch, tokens / batch) + _interp(self.head, positions)

    def decode_at(self, batch: float) -> float:
        return _along_batch(
            sorted(self.decode_by_batch), batch, self.decode_by_batch.__getitem__, self.name, "decode step"
        )

    def layer_decode_at(self, batch: float) -> float:
        return _along_batch(
            sorted(self.layer_decode_by_batch), batch, self.layer_decode_by_batch.__getitem__, self.name, "decode step"
        )


def model_costs(gpu_costs: dict, name: str) -> ModelCosts:
    """The cost curves of `name` in a gpu_costs.json (scripts/gpu_costs.py): every batch's
    (`cases`, and `batch_cases` where the script measured forwards at larger batches)."""
    m = gpu_costs["models"].get(name)
    if not m or not m["cases"]:
        raise KeyError(f"{name} has no measured cases in this gpu_costs.json")
    depth = m["geometry"]["num_hidden_layers"]
    cases = m["cases"] + m.get("batch_cases", [])
    decode = next((c for c in cases if c["case"] == "decode" and c["batch"] == 1), None)
    if decode is None:
        raise KeyError(f"{name} has no batch-1 decode step in this gpu_costs.json")
    by_batch: dict[int, list] = {}
    for c in cases:
        by_batch.setdefault(int(c["batch"]), []).append((c["new_tokens"], c["layer_ms"] * depth))
    decodes = [c for c in cases if c["case"] == "decode"]
    return ModelCosts(
        name,
        layers=_points(by_batch[1]),
        head=_points((c["logit_positions"], c["head_ms"]) for c in cases),
        layer_decode_ms=decode["layer_ms"],
        decode_ms=decode["model_ms"],
        layers_by_batch={b: _points(v) for b, v in by_batch.items()},
        decode_by_batch={int(c["batch"]): c["model_ms"] for c in decodes},
        layer_decode_by_batch={int(c["batch"]): c["layer_ms"] for c in decodes},
    )


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
    drafter_calls: int = 0  # PARSE's drafter calls (0: the row predates the counter, or no PARSE)
    drafter_rows: int = 0  # requests in those calls
    # vLLM's own proposer (a row without PARSE counters): it drafts for every request of a step at once
    batched_proposer: bool = False
    rejections: int = 0  # judged windows rejected at a boundary (the arms' split: window_split)


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
        drafter_calls=int(a.get("drafter_passes", 0)),
        drafter_rows=int(a.get("drafter_rows", 0)),
        batched_proposer="drafts" not in a,
        rejections=int(a.get("rejections", 0)),
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
            "drafter_calls",
            "drafter_rows",
            "rejections",
        )
    }
    return Counters(
        **plain,
        token_level_drafts=_sum_by(a.token_level_drafts, b.token_level_drafts),
        token_level_draft_tokens=_sum_by(a.token_level_draft_tokens, b.token_level_draft_tokens),
        batched_proposer=a.batched_proposer and b.batched_proposer,
    )


# --------------------------------------------------------------------------- projection


def _mixture(batch: int, kinds: list[tuple[float, float]], cost) -> float:
    """E[cost(tokens, all_plain)] over steps of `batch` requests, each independently of kind i
    with probability p_i, where `kinds` = [(p_i, new tokens of a request of kind i)] and kind
    0 is the plain decode step: a multinomial expectation over the compositions of the batch."""

    def compositions(left: int, n_kinds: int):
        if n_kinds == 1:
            yield (left,)
            return
        for j in range(left + 1):
            for tail in compositions(left - j, n_kinds - 1):
                yield (j, *tail)

    total = 0.0
    for counts in compositions(batch, len(kinds)):
        prob = math.factorial(batch) / math.prod(math.factorial(k) for k in counts)
        prob *= math.prod(p**k for (p, _), k in zip(kinds, counts))
        if prob:
            tokens = sum(n * k for (_, n), k in zip(kinds, counts))
            total += prob * cost(tokens, counts[0] == batch)
    return total


def project(c: Counters, target: ModelCosts, draft: ModelCosts, batch: int = 1) -> dict:
    """Projected time of PARSE and of the target alone over the run's tokens at `batch`
    requests per engine step, in ms, each term apart, and the speed-up (module docstring;
    ASSUMPTIONS). Raises NotProjectable when the costs do not cover that batch.

    time_ms: at batch 1 the target's steps by kind (plain_decode, window_forwards,
    token_level_forwards), at batch > 1 together (target_steps: its steps mix the kinds);
    then verification, draft_model, eagle3, total. step_ms, per step of the whole batch:
    target_decode (all plain), window_forward and token_level_forward (one such request
    among B - 1 plain ones), verification_pass, draft_decode (one step of the draft's
    rows per call), eagle3_token (per token). at_batch: the batch quantities the model
    used (engine steps, the step mix, the mean step, requests per pass, rows per drafter
    call) and both throughputs."""
    B = int(batch)
    if B < 1:
        raise ValueError(f"batch {batch} < 1")
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

    decode_ms = target.decode_at(B)  # one step of B plain requests

    def step(tokens: float, all_plain: bool) -> float:
        return decode_ms if all_plain else target.step_ms(B, tokens, tokens)

    # a step with one window (one token-level step) among B - 1 plain requests
    window_ms = step(B - 1 + W + 1, False) if c.windows else 0.0
    tl_ms = step(B - 1 + k + 1, False) if tl_steps else 0.0
    request_steps = plain + c.windows + tl_steps
    mix = [(plain, 1.0), (c.windows, W + 1), (tl_steps, k + 1)]
    mix = [(n / request_steps, size) for n, size in mix] if request_steps else []
    if B == 1:  # each step is one request's: the kinds apart
        step_terms = {
            "plain_decode": plain * decode_ms,
            "window_forwards": c.windows * window_ms,
            "token_level_forwards": tl_steps * tl_ms,
        }
        mixed_step_ms = sum(step_terms.values()) / request_steps if request_steps else 0.0
    else:
        mixed_step_ms = _mixture(B, mix, step) if request_steps else 0.0
        step_terms = {"target_steps": request_steps / B * mixed_step_ms}

    per_pass = min(max(c.windows / c.passes, 1.0), B) if c.passes else 1.0  # requests in a pass
    pass_ms = target.step_ms(per_pass, C * L, C) if c.passes else 0.0
    rows = 1.0  # requests per drafter call
    if B > 1 and draft_written:
        if c.drafter_calls:
            rows = min(max(c.drafter_rows / c.drafter_calls, 1.0), B)
        elif c.batched_proposer:
            rows = float(B)
        else:
            notes.append("no drafter counters in this row: every draft token costed at the draft's batch-1 step")
    draft_step_ms = draft.decode_at(rows) if draft_written else draft.decode_ms
    eagle3_step_ms = target.layer_decode_at(B) + _interp(target.head, B)  # B proposal tokens
    terms = {
        **step_terms,
        "verification": c.passes * pass_ms,
        "draft_model": draft_written / rows * draft_step_ms,
        "eagle3": eagle3_tokens / B * eagle3_step_ms,
    }
    parse_ms = sum(terms.values())
    target_ms = c.tokens / B * decode_ms
    out = {
        "target": target.name,
        "draft": draft.name,
        "batch": B,
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
            "target_decode": decode_ms,
            "window_forward": window_ms,
            "verification_pass": pass_ms,
            "token_level_forward": tl_ms,
            "draft_decode": draft_step_ms,
            "eagle3_token": eagle3_step_ms / B,
        },
        "time_ms": {**terms, "total": parse_ms},
        "target_alone_ms": target_ms,
        "speedup": target_ms / parse_ms if parse_ms > 0 else None,
        "notes": notes,
    }
    out["at_batch"] = {
        "engine_steps": request_steps / B,
        "step_mix": dict(zip(("plain", "window", "token_level"), (p for p, _ in mix))),
        "mean_step_ms": mixed_step_ms,
        "requests_per_pass": per_pass,
        "rows_per_drafter_call": rows,
        "tokens_per_s": c.tokens / parse_ms * 1e3 if parse_ms > 0 else None,
        "target_tokens_per_s": c.tokens / target_ms * 1e3 if target_ms > 0 else None,
    }
    if c.windows:
        # what the window adds to its step, over the plain step it replaces, plus its draft
        # tokens and its share of the passes; at batch 1 its whole cost
        per_window_ms = (
            decode_ms / B
            + (window_ms - decode_ms)
            + W * draft_step_ms / rows
            + (c.passes / c.windows) * pass_ms  # a pass is shared by the windows it judges
        )
        written = c.accepted_in_windows / c.windows + 1
        out["per_window"] = {
            "tokens": written,  # accepted + the target's own token
            "ms": per_window_ms,
            "ms_per_token": per_window_ms / written,
            "target_ms_per_token": decode_ms / B,
            "pays": per_window_ms / written < decode_ms / B,
        }
    return out


def rows_to_project(summary: dict, source: str) -> tuple[list[dict], list[str]]:
    """The rows of an eval summary that carry counters, summed over the prompt sets per
    (config, τ, guard, batch), each with the batch it is projected at (its batch, or its
    fewest prompts per set when fewer); and what was left out, saying why (nothing here:
    `projection` leaves out the rows at batches the costs miss)."""
    groups: dict[tuple, dict] = {}
    for r in summary.get("rows", []):
        c = counters_from_row(r)
        if c is None:
            continue
        batch = int(r.get("batch") or 1)
        key = (r["config"], r.get("tau"), r.get("guard"), batch)
        g = groups.setdefault(
            key,
            {"source": source, "config": key[0], "tau": key[1], "guard": key[2], "batch": batch, "sets": []},
        )
        g["counters"] = add(g["counters"], c) if "counters" in g else c
        g["sets"].append(r.get("set"))
        n = r.get("n_prompts")
        effective = min(batch, int(n)) if n else batch
        g["effective_batch"] = min(g.get("effective_batch", effective), effective)
    return list(groups.values()), []


def projection(gpu_costs: dict, summaries: dict[str, dict]) -> dict:
    """Every row of `summaries` ({source: eval summary}) projected at its batch on every
    pair of `gpu_costs` that it measured in full (a pair whose costs miss that batch says
    why; a row that no pair covers is left out, saying why)."""
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
    projected = []
    for r in rows:
        r["projections"], whys = [], {}
        for t, d in pairs:
            try:
                r["projections"].append(project(r["counters"], t, d, r["effective_batch"]))
            except NotProjectable as e:
                r["projections"].append({"target": t.name, "draft": d.name, "speedup": None, "not_projected": str(e)})
                whys.setdefault(e.why, []).append(e.model)
        r["counters"] = asdict(r["counters"])
        if pairs and all("not_projected" in p for p in r["projections"]):
            why = "; ".join(f"{', '.join(dict.fromkeys(ms))}: {w}" for w, ms in whys.items())
            guard = f" guard {r['guard']}" if r["guard"] is not None else ""
            skipped.append(f"{r['source']}: {r['config']} τ {r['tau']}{guard} at batch {r['batch']} ({why})")
            continue
        projected.append(r)
    return {
        "gpu": gpu_costs.get("device", {}).get("name"),
        "gpu_costs_measurement": gpu_costs.get("measurement"),
        "dtype": gpu_costs.get("dtype"),
        "context": gpu_costs.get("settings", {}).get("context"),
        "pairs": [f"{d.name} → {t.name}" for t, d in pairs],
        "pairs_not_measured": missing,
        "rows": projected,
        "rows_not_projected": sorted(set(skipped)),
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
        "eval rows below, each at its batch: the speed-up over the target alone that those acceptances would "
        "give on that GPU with each pair's costs (at batch > 1 a ratio of throughputs at equal batch). A model, "
        "not a measurement: every assumption is listed.",
        "",
    ]
    if not proj["pairs"]:
        return out + ["No pair of the gpu_costs.json was measured in full: nothing to project.", ""]
    out += [
        "| run | row | τ | guard | batch | tokens | windows | accepted / window | "
        + " | ".join(f"× target, {p}" for p in proj["pairs"])
        + " |",
        "|---|---|---:|---:|---:|---:|---:|---:|" + "---:|" * len(proj["pairs"]),
    ]
    for r in proj["rows"]:
        c = r["counters"]
        apw = c["accepted_in_windows"] / c["windows"] if c["windows"] else None
        batch = str(r["batch"]) + (f" ({r['effective_batch']} in flight)" if r["effective_batch"] != r["batch"] else "")
        out.append(
            f"| {r['source']} | {r['config']} | {_f(r['tau'], 'g') if r['tau'] is not None else '—'} | "
            f"{r['guard'] if r['guard'] is not None else '—'} | {batch} | {c['tokens']} | {c['windows']} | "
            f"{_f(apw, '.1f')} | " + " | ".join(_f(p["speedup"]) for p in r["projections"]) + " |"
        )
    out += ["", "Measured step costs (ms, full model extrapolated, per step of the whole batch):", ""]
    out += [
        "| model | batch | decode | forward over W tokens a sequence (W: ms) | verification forward (K copies: ms) |",
        "|---|---:|---:|---|---|",
    ]
    for name, m in gpu_costs.get("models", {}).items():
        cases = m["cases"] + m.get("batch_cases", [])
        for b in sorted({c["batch"] for c in cases}):
            at = [c for c in cases if c["batch"] == b]
            dec = next((c["model_ms"] for c in at if c["case"] == "decode"), None)
            win = [f"{c['new_tokens']}: {c['model_ms']:.2f}" for c in at if c["case"] == "window_forward"]
            ver = [f"{c.get('copies', '?')}: {c['model_ms']:.2f}" for c in at if c["case"] == "verify_forward"]
            out.append(f"| {name} | {b} | {_f(dec, '.3f')} | {', '.join(win) or '—'} | {', '.join(ver) or '—'} |")
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
    notes = sorted(
        {
            f"{r['source']} {r['config']} batch {r['batch']}: {n}"
            for r in proj["rows"]
            for p in r["projections"]
            for n in p.get("notes", []) + ([p["not_projected"]] if "not_projected" in p else [])
        }
    )
    if notes:
        out += ["", "Notes: " + "; ".join(notes[:12]) + (f"; … ({len(notes)} in all)" if len(notes) > 12 else "")]
    left = proj["rows_not_projected"] + proj["pairs_not_measured"]
    if left:
        out += ["", "Not projected: " + "; ".join(left[:12]) + (f"; … ({len(left)} in all)" if len(left) > 12 else "")]
    return out


# --------------------------------------------------------------------------- arms (issue 47 item 6)

#: the arms `arms_projection` projects, in its table's order
ARMS = ("target", "token_level", "continue", "chunked", "chunked_overlap", "adaptive")
ARM_LABELS = {
    "target": "target alone",
    "token_level": "token-level k 4",
    "continue": "PARSE whole window (`continue`)",
    "chunked": "PARSE chunked, no overlap",
    "chunked_overlap": "PARSE chunked, draft ‖ judge",
    "adaptive": "adaptive (best arm + exploration)",
    "adaptive_as_run": "adaptive, its CPU run's counters",
}

ARM_ASSUMPTIONS = (
    "Arms: each arm's counters are its own committed row of one eval run (token-level k 4: vLLM's draft-model "
    "proposer; PARSE whole window: the `continue` row at the run's τ_head; adaptive as run: the adaptive row, "
    "whose choices were made with this CPU's costs). Speed-ups are ratios of time per output token against "
    "the target alone at the same batch.",
    "Chunked judging is modelled, not measured: the text accepted is the whole window's (a first-failure rule), "
    "so tokens, target steps, token-level drafts and the rest of the run are the `continue` row's; only each "
    "window's own cost changes (its marginal cost, `per_window`, replaced by the chunked window's).",
    "Where a window fails: a window taken whole drafts W (the row's mean); a rejected window takes "
    "a = (tokens accepted in windows - whole windows x W) / rejections tokens (the counters' mean) and, judged in "
    "chunks of c, drafts min(W, a + c): the chunk that held its first failing boundary (the policy's "
    "expected_drafted rule, an upper bound: the failure lies somewhere in that chunk), so it discards at most c "
    "draft tokens, where whole-window judging discards W - a.",
    "A chunked window is judged J = drafted / c times (each a forward of the target over c tokens, riding in an "
    "engine step beside B - 1 plain requests: its slot plus what c tokens add to the step); its boundaries, the "
    "`continue` row's copies per window, are split over min(J, copies per window) passes (at least the row's "
    "passes per window), each costed as the row's verification pass at that many copies. The window's boundaries "
    "past its failure are still costed (an upper bound). J is a mean (the failure anywhere in its chunk), so "
    "a window's draft costs J x c draft steps.",
    "Overlap (a GPU): the draft drafts chunk i + 1 while the target judges chunk i, on the same GPU, without "
    "slowing each other (an optimistic bound: both read weights from the same memory). A window then costs "
    "c x draft step + (J - 1) x max(c x draft step, judge) + its last judge, never more than without overlap; "
    "where the last judgment fails, what the draft wrote of the next chunk meanwhile (min(c, judge / draft "
    "step) tokens) is thrown away too, so it discards up to 2c. Without overlap the draft and the judge add "
    "up: J x (c x draft step + judge).",
    "Adaptive: the policy picks, per request, the arm of higher expected goodput; the projection gives it the "
    "fastest of token-level, whole-window and chunked (with and without overlap) arms; where token-level is "
    "the fastest, plus what its exploration can cost: request after request, while a MIN_WINDOW-token window "
    "(or W, if shorter) pays at the engine's reading of the judge's survival rate (window_policy.ArmStats.rho, "
    "the request's prior, learning from each window as the `continue` row's rate would have it), the request "
    "opens one, and if it is rejected, probes of that size follow at output tokens b, 3b, 7b, ... "
    "(window_policy.exploration_bound); each window (its draft tokens, a forward over them and one "
    "verification pass) costs what it takes beyond token-level's time for the tokens the judge is expected "
    "to keep of it (the `continue` row's survival rate); where a window arm is the fastest, "
    "its probes are that arm's windows and nothing is added. An estimate, not a bound: the adaptive row's own "
    "counters (`adaptive, its CPU run's counters`) show what its exploration cost in fact, with CPU-made "
    "choices. Every request is taken to favour the same arm (the counters are per run, not per request), so a "
    "mix of requests that favour different arms would do better than this.",
    "Step costs without a gpu_costs.json (`roofline:<gpu>`): a roofline stand-in, not a measurement: per "
    "decoder layer max(bytes read / (peak bandwidth x 0.8), FLOPs / (peak bf16 dense x 0.6)) plus 30 µs of "
    "kernel overheads (CUDA graphs), the LM head likewise plus 20 µs; bytes = the layer's bf16 weights + the KV "
    "cache of a 1,024-token context per sequence; FLOPs = 2 x weights x tokens + the attention's.",
)

#: roofline stand-ins for a gpu_costs.json: peak memory bandwidth (bytes/s), bf16 dense FLOP/s
ROOFLINE_GPUS = {"h100": (3.35e12, 989e12), "h200": (4.8e12, 989e12)}
ROOFLINE_BW_EFF, ROOFLINE_FLOP_EFF = 0.8, 0.6
ROOFLINE_LAYER_OVERHEAD_MS, ROOFLINE_HEAD_OVERHEAD_MS = 0.030, 0.020
#: Qwen3 geometries (scripts/gpu_costs.py's GEOMETRIES: hidden, layers, q heads, kv heads, head dim,
#: intermediate, vocab), copied so that this module stays pure
QWEN3 = {
    "qwen3-0.6b": (1024, 28, 16, 8, 128, 3072, 151936),
    "qwen3-1.7b": (2048, 28, 16, 8, 128, 6144, 151936),
    "qwen3-8b": (4096, 36, 32, 8, 128, 12288, 151936),
    "qwen3-32b": (5120, 64, 64, 8, 128, 25600, 151936),
}
QWEN3_PAIRS = (("qwen3-0.6b", "qwen3-8b"), ("qwen3-1.7b", "qwen3-32b"))


def roofline_costs(gpu: str = "h100", context: int = 1024, batches=(1, 8)) -> dict:
    """A gpu_costs.json-shaped dict for the Qwen3 pairs from a roofline (ARM_ASSUMPTIONS' last),
    for when no measured gpu_costs.json exists: decode steps, forwards over 2..256 new tokens
    a sequence and verification forwards of 1..16 copies of 24 tokens, at each batch."""
    bw, flops = ROOFLINE_GPUS[gpu]
    bw, flops = bw * ROOFLINE_BW_EFF, flops * ROOFLINE_FLOP_EFF

    def layer_ms(g, batch, new):
        H, _, Hq, Hkv, D, Im, _ = g
        weights = H * Hq * D + 2 * H * Hkv * D + Hq * D * H + 3 * H * Im
        kv = batch * context * 2 * Hkv * D
        moved = 2 * (weights + kv)
        work = 2 * weights * batch * new + 4 * batch * new * (context + new) * Hq * D
        return max(moved / bw, work / flops) * 1e3 + ROOFLINE_LAYER_OVERHEAD_MS

    def head_ms(g, positions):
        H, V = g[0], g[6]
        return max(2 * V * H / bw, 2 * V * H * positions / flops) * 1e3 + ROOFLINE_HEAD_OVERHEAD_MS

    models = {}
    for name, g in QWEN3.items():
        depth = g[1]
        cases = []
        for b in batches:
            kinds = [("decode", 1, 1)] + [("window_forward", n, n) for n in (2, 4, 8, 16, 32, 64, 128, 256)]
            kinds += [("verify_forward", k * 24, k) for k in (1, 2, 4, 8, 16)]
            for kind, new, pos in kinds:
                lm, hm = layer_ms(g, b, new), head_ms(g, b * pos)
                cases.append(
                    {
                        "case": kind,
                        "batch": b,
                        "new_tokens": new,
                        "logit_positions": b * pos,
                        "layer_ms": lm,
                        "head_ms": hm,
                        "model_ms": lm * depth + hm,
                    }
                )
        models[name] = {
            "geometry": {"num_hidden_layers": depth},
            "cases": [c for c in cases if c["batch"] == 1 or c["case"] == "decode"],
            "batch_cases": [c for c in cases if c["batch"] != 1 and c["case"] != "decode"],
        }
    return {
        "device": {"name": f"{gpu.upper()} (roofline stand-in)"},
        "dtype": "bfloat16",
        "measurement": f"a roofline stand-in, not measured (projection.roofline_costs('{gpu}'))",
        "settings": {"context": context},
        "pairs": [{"draft": d, "target": t} for d, t in QWEN3_PAIRS],
        "models": models,
        "verify_attention": [],
    }


def window_split(c: Counters) -> dict:
    """Where the row's windows ended (ARM_ASSUMPTIONS): windows taken whole (all that were
    not rejected), rejections, W and the tokens a rejected window took (the means)."""
    W = c.window_tokens / c.windows if c.windows else 0.0
    rejected = min(c.rejections, c.windows)
    whole = c.windows - rejected
    taken = (c.accepted_in_windows - whole * W) / rejected if rejected else 0.0
    return {"window": W, "whole": whole, "rejected": rejected, "taken_when_rejected": min(max(taken, 0.0), W)}


def chunked_window(p: dict, c: Counters, target: ModelCosts, chunk: int, overlap: bool) -> dict:
    """A window of the `continue` projection `p` (project()) judged in chunks of `chunk` draft
    tokens, with or without the draft of the next chunk overlapping the judgment (ARM_ASSUMPTIONS):
    its mean cost in ms (the same terms as p's per_window), the draft tokens it drafts and
    those a rejected window discards."""
    B = p["batch"]
    s = window_split(c)
    W, a, cw = s["window"], s["taken_when_rejected"], float(chunk)
    drafted_whole, drafted_rejected = W, min(W, a + cw)
    decode = p["step_ms"]["target_decode"]
    rows = p["at_batch"]["rows_per_drafter_call"]
    d_tok = p["step_ms"]["draft_decode"] / rows  # one draft token of this request
    forward = target.step_ms(B, B - 1 + cw, B - 1 + cw) if B > 1 else target.forward_ms(cw, cw)
    slot_forward = decode / B + (forward - decode) if B > 1 else forward
    copies_per_window = c.copies / c.windows if c.windows else 0.0
    L = c.suffix_tokens / c.copies if c.copies else 0.0
    per_pass = p["at_batch"]["requests_per_pass"]

    def cost(drafted: float, rejected: bool) -> tuple[float, float]:
        J = max(drafted / cw, 1.0)  # chunks judged (a mean: the last one's failure anywhere in it)
        passes = max(min(J, copies_per_window), c.passes / c.windows) if copies_per_window else 0.0
        copies = copies_per_window / passes if passes else 0.0
        pass_ms = target.step_ms(per_pass, copies * L, copies) if passes else 0.0
        judge = slot_forward + passes * pass_ms / J  # one chunk's judgment, its share of the passes
        draft = cw * d_tok
        if not overlap:
            return J * judge + J * draft, drafted
        # the first chunk alone, then each next chunk drafted while the last is judged; the last
        # judgment alone (a rejection stops the drafter, whose tokens of the next chunk are lost)
        wasted = min(cw, judge / d_tok) if rejected and d_tok > 0 else 0.0
        return draft + (J - 1) * max(draft, judge) + judge, drafted + wasted

    n = s["whole"] + s["rejected"]
    (ms_w, dr_w), (ms_r, dr_r) = cost(drafted_whole, False), cost(drafted_rejected, True)
    ms = (s["whole"] * ms_w + s["rejected"] * ms_r) / n if n else 0.0
    return {
        "chunk": chunk,
        "overlap": overlap,
        "ms": ms,
        "ms_whole": ms_w,
        "ms_rejected": ms_r,
        "drafted_per_window": (s["whole"] * dr_w + s["rejected"] * dr_r) / n if n else 0.0,
        "discarded_per_rejection": dr_r - a,
        "split": s,
    }


def _arm(name: str, ms: float, target_ms: float, tokens: int, **extra) -> dict:
    return {"arm": name, "ms": ms, "ms_per_token": ms / tokens, "speedup": target_ms / ms if ms > 0 else None, **extra}


def project_arms(
    rows: dict[str, Counters],
    target: ModelCosts,
    draft: ModelCosts,
    batch: int,
    requests: int,
    chunk: int = 16,
) -> dict:
    """Each arm (ARMS) of one run at `batch`, from its rows' counters ({"token_level": the
    k 4 row, "continue": the whole-window row, optionally "adaptive": the adaptive row as
    run}), `requests` the run's prompts. Speed-ups per output token against the target alone
    (ARM_ASSUMPTIONS). Raises NotProjectable where the costs miss the batch."""
    out: dict = {"target": target.name, "draft": draft.name, "batch": batch, "chunk": chunk, "arms": {}}
    decode = target.decode_at(batch)
    per_token_target = decode / batch
    arms = out["arms"]
    arms["target"] = {"arm": "target", "ms_per_token": per_token_target, "speedup": 1.0}
    tl = project(rows["token_level"], target, draft, batch)
    arms["token_level"] = _arm("token_level", tl["time_ms"]["total"], tl["target_alone_ms"], rows["token_level"].tokens)
    cont_c = rows["continue"]
    cont = project(cont_c, target, draft, batch)
    base = cont["time_ms"]["total"]
    whole = cont.get("per_window", {}).get("ms", 0.0)
    s = window_split(cont_c)
    arms["continue"] = _arm(
        "continue",
        base,
        cont["target_alone_ms"],
        cont_c.tokens,
        discarded_per_rejection=s["window"] - s["taken_when_rejected"] if s["rejected"] else 0.0,
        window_ms=whole,
        split=s,
    )
    for name, overlap in (("chunked", False), ("chunked_overlap", True)):
        if cont_c.windows:
            w = chunked_window(cont, cont_c, target, chunk, overlap)
            ms = base + cont_c.windows * (w["ms"] - whole)
        else:
            w, ms = {"discarded_per_rejection": 0.0, "ms": 0.0}, base
        arms[name] = _arm(
            name,
            ms,
            cont["target_alone_ms"],
            cont_c.tokens,
            discarded_per_rejection=w["discarded_per_rejection"],
            window_ms=w["ms"],
        )
    # adaptive: the best arm plus the most its exploration can cost (ARM_ASSUMPTIONS)
    from parse_vllm.window_policy import FIRST_BACKOFF, MIN_WINDOW, OPTIMISTIC_RHO, ArmStats, expected_taken

    best = min(("token_level", "continue", "chunked", "chunked_overlap"), key=lambda a: arms[a]["ms_per_token"])
    answer = max(cont_c.tokens / max(requests, 1), 1.0)
    rows_per_call = cont["at_batch"]["rows_per_drafter_call"]

    def window_ms(w: int) -> float:  # a whole window of w: its draft, a forward over it, a pass
        forward = (
            decode / batch + target.step_ms(batch, batch - 1 + w + 1, batch - 1 + w + 1) - decode
            if batch > 1
            else target.forward_ms(w + 1, w + 1)
        )
        return w * cont["step_ms"]["draft_decode"] / rows_per_call + forward + cont["step_ms"]["verification_pass"]

    # The engine explores (window_policy): request after request, while a MIN_WINDOW window (or
    # W, if shorter) pays at the engine's reading of the judge's survival rate (the request's
    # prior), the request opens one, and if it is rejected, probes of that size follow at
    # output tokens b, 3b, ...; the reading learns from each window as the judge's rate (the
    # `continue` row's) would have it, and each window costs what it takes beyond the
    # token-level arm's time for the tokens the judge is expected to keep of it.
    tl_per_token = arms["token_level"]["ms_per_token"]
    rho = cont_c.accepted_in_windows / max(cont_c.accepted_in_windows + cont_c.rejections, 1e-9)
    probe = min(MIN_WINDOW, int(s["window"]))
    probes = 1 + int(math.floor(math.log2(answer / FIRST_BACKOFF + 1)))

    probe_ms = window_ms(probe) if probe else 0.0
    loss = max(probe_ms - (expected_taken(rho, probe) + 1) * tl_per_token, 0.0)  # one window's
    rejected = 1.0 - rho**probe  # the chance a window is rejected (and its request re-probes)
    engine, explore_ms, explored = ArmStats(), 0.0, 0
    for _ in range(max(requests, 1) if probe else 0):
        if probe_ms / (expected_taken(engine.rho(OPTIMISTIC_RHO), probe) + 1) >= tl_per_token:
            break
        explored += 1
        engine.judged_tokens += expected_taken(rho, probe)
        engine.rejections += rejected
        explore_ms += loss * (1 + rejected * (probes - 1))
    # where a window arm is the best, the probes are that arm's own windows: nothing to add
    explore_per_token = explore_ms / max(cont_c.tokens, 1) if best == "token_level" else 0.0
    ms_per_token = arms[best]["ms_per_token"] + explore_per_token
    arms["adaptive"] = {
        "arm": "adaptive",
        "best_arm": best,
        "ms_per_token": ms_per_token,
        "speedup": per_token_target / ms_per_token,
        "exploration_ms_per_token": explore_per_token,
        "probes_per_request": probes if explored else 0,
        "requests_exploring": explored,  # requests that opened a window
        "answer_tokens": answer,
    }
    for a in ("token_level", "continue", "chunked", "chunked_overlap"):
        arms[a]["ms_per_token"] = arms[a]["ms"] / (rows["token_level"].tokens if a == "token_level" else cont_c.tokens)
    if "adaptive" in rows:
        ar = project(rows["adaptive"], target, draft, batch)
        arms["adaptive_as_run"] = _arm(
            "adaptive_as_run", ar["time_ms"]["total"], ar["target_alone_ms"], rows["adaptive"].tokens
        )
    out["adaptive_over_token_level"] = arms["adaptive"]["speedup"] / arms["token_level"]["speedup"]
    return out


def arm_rows(summary: dict) -> dict[int, tuple[dict[str, Counters], int]]:
    """{batch: ({arm: counters}, requests)} of one eval run (a `judge_e2e` summary): its
    `token-k4` row, its whole-window PARSE row at τ_head (else the highest τ) and its adaptive
    row, at each batch that has the first two."""
    tau = (summary.get("tau_head") or {}).get("tau")
    by: dict[int, dict] = {}
    for r in summary.get("rows", []):
        c = counters_from_row(r)
        if c is None:
            continue
        b = int(r.get("batch") or 1)
        cfg = str(r.get("config", ""))
        slot = by.setdefault(b, {"requests": int(r.get("n_prompts") or 1)})
        if cfg == "token-k4":
            slot["token_level"] = c
        elif cfg.startswith("parse") and "adaptive" in cfg:
            slot["adaptive"] = c
        elif cfg.startswith("parse") and r.get("tau") is not None:
            prev = slot.get("_tau")
            if (tau is not None and r["tau"] == tau) or (tau is None and (prev is None or r["tau"] > prev)):
                slot["continue"], slot["_tau"] = c, r["tau"]
    return {
        b: ({k: v for k, v in s.items() if k in ("token_level", "continue", "adaptive")}, s["requests"])
        for b, s in sorted(by.items())
        if "token_level" in s and "continue" in s
    }


def arms_projection(gpu_costs: dict, summary: dict, source: str = "", chunk: int = 16) -> dict:
    """project_arms for every pair of `gpu_costs` at every batch of `summary` (arm_rows)."""
    out = {"source": source, "gpu": gpu_costs.get("device", {}).get("name"), "chunk": chunk, "runs": []}
    out["measurement"] = gpu_costs.get("measurement")
    for p in gpu_costs.get("pairs", []):
        try:
            t, d = model_costs(gpu_costs, p["target"]), model_costs(gpu_costs, p["draft"])
        except KeyError:
            continue
        for b, (rows, n) in arm_rows(summary).items():
            try:
                out["runs"].append(project_arms(rows, t, d, b, n, chunk))
            except NotProjectable as e:
                out["runs"].append({"target": t.name, "draft": d.name, "batch": b, "not_projected": str(e)})
    out["assumptions"] = list(ASSUMPTIONS) + list(ARM_ASSUMPTIONS)
    return out


def arms_section(proj: dict) -> list[str]:
    """The arms as a Markdown table: one column per (pair, batch), one row per arm."""
    runs = [r for r in proj["runs"] if "arms" in r]
    out = [
        f"## The arms on {proj['gpu']} (`{proj['source']}` counters, chunks of {proj['chunk']})",
        "",
        f"Costs: {proj['measurement']}. Speed-up per output token over the target alone at the same batch; "
        "a model, not a measurement (assumptions below).",
        "",
    ]
    if not runs:
        return out + ["Nothing projected.", ""]
    out.append("| arm | " + " | ".join(f"{r['draft']} → {r['target']}, batch {r['batch']}" for r in runs) + " |")
    out.append("|---|" + "---:|" * len(runs))
    names = list(ARMS) + (["adaptive_as_run"] if any("adaptive_as_run" in r["arms"] for r in runs) else [])
    for a in names:
        cells = [_f(r["arms"].get(a, {}).get("speedup")) + "x" if a in r["arms"] else "—" for r in runs]
        out.append(f"| {ARM_LABELS[a]} | " + " | ".join(cells) + " |")
    out.append("| adaptive / token-level k 4 | " + " | ".join(_f(r["adaptive_over_token_level"]) for r in runs) + " |")
    out.append("| adaptive's best arm | " + " | ".join(r["arms"]["adaptive"]["best_arm"] for r in runs) + " |")
    out.append(
        "| draft tokens discarded per rejection: whole / chunked / overlap | "
        + " | ".join(
            " / ".join(
                _f(r["arms"][a]["discarded_per_rejection"], ".0f") for a in ("continue", "chunked", "chunked_overlap")
            )
            for r in runs
        )
        + " |"
    )
    left = [r["not_projected"] for r in proj["runs"] if "not_projected" in r]
    if left:
        out += ["", "Not projected: " + "; ".join(left)]
    out += ["", "Assumptions (the arms):", ""] + [f"- {a}" for a in ARM_ASSUMPTIONS]
    return out


def load_summaries(paths) -> dict[str, dict]:
    """{the summary's folder name: its content} for the eval summaries that exist."""
    return {p.parent.name or str(p): json.loads(p.read_text()) for p in map(Path, paths) if p.is_file()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m parse_vllm.tools.benchmarks.projection", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument(
        "gpu_costs",
        help="a gpu_costs.json (scripts/gpu_costs.py), or roofline:h100 / roofline:h200 (a stand-in, not measured)",
    )
    ap.add_argument("summaries", type=Path, nargs="*", default=list(DEFAULT_COUNTERS), help="eval summary.json files")
    ap.add_argument("--json", action="store_true", help="print the projection as JSON instead of Markdown")
    ap.add_argument(
        "--arms",
        action="store_true",
        help="each arm (target, token-level k 4, whole window, chunked with and without overlap, adaptive) of each "
        f"run instead; summaries default to {ARMS_COUNTERS}",
    )
    ap.add_argument("--chunk", type=int, default=16, help="draft tokens per judged chunk (--arms; default 16)")
    args = ap.parse_intermixed_args(argv)
    if args.gpu_costs.startswith("roofline:"):
        gpu = args.gpu_costs.split(":", 1)[1]
        if gpu not in ROOFLINE_GPUS:
            ap.error(f"no roofline for {gpu!r} (known: {', '.join(ROOFLINE_GPUS)})")
        costs, name = roofline_costs(gpu), args.gpu_costs
    else:
        costs, name = json.loads(Path(args.gpu_costs).read_text()), Path(args.gpu_costs).name
    if args.arms:
        paths = args.summaries if args.summaries != list(DEFAULT_COUNTERS) else [ARMS_COUNTERS]
        summaries = {str(p.parent): json.loads(p.read_text()) for p in map(Path, paths) if p.is_file()}
        if not summaries:
            ap.error("none of the summaries exists: " + ", ".join(map(str, paths)))
        projs = [arms_projection(costs, s, src, args.chunk) for src, s in summaries.items()]
        if args.json:
            print(json.dumps(projs, indent=1))
        else:
            print("\n".join(line for p in projs for line in arms_section(p) + [""]))
        return 0
    summaries = load_summaries(args.summaries)
    if not summaries:
        ap.error("none of the summaries exists: " + ", ".join(map(str, args.summaries)))
    proj = projection(costs, summaries)
    print(json.dumps(proj, indent=1) if args.json else "\n".join(section(proj, costs, name)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
