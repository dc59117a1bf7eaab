#!/usr/bin/env python
"""What the pieces of a PARSE window cost on this GPU, measured with random weights
in real model shapes (no vLLM, no network, no checkpoint: PyTorch alone).

Whether PARSE pays on a GPU depends on a few costs, all measured here for each
geometry in GEOMETRIES (Qwen3-0.6B/1.7B/8B/32B, from their config.json):

  decode           one new token per sequence over a KV cache of --context tokens,
                   at batch 1, 8, 32 (the target alone's step; the draft's step)
  window_forward   W new tokens per sequence after the context (W 16/64/128): the
                   target's step over a drafted window, logits at every position;
                   at batch 1, and at the larger --batches (B sequences, each with
                   its own context and window: a throughput step)
  verify_forward   a verification forward over K copies of an L-token suffix
                   (K 4/8/16, L --suffix): costed as one forward over K*L new tokens
                   after the context, logits at K positions; at batch 1 and at the
                   larger --batches (B requests, each with its K copies)
  verify_attention the attention of that pass alone, one layer: the compiled op
                   parse_vllm.ops.prefix_verify_attention (when parse_vllm._C is
                   built for this device) against K per-copy SDPA calls, each copy
                   over its own prefix of the shared context

How a model is measured: --layers decoder layers of the geometry (Qwen3's layer
in plain PyTorch: fused QKV, q/k RMSNorm, RoPE, SDPA over a preallocated KV
cache, SwiGLU MLP) are built on the device with random weights; a forward of
that stack is captured in a CUDA graph (vLLM replays graphs for steps of up to
512 tokens; eager timing where capture fails, said per case) and timed with CUDA
events after warm-up, L2 flushed before each call, median of --repeats.  The
full model's time is extrapolated: (stack time / layers built) x the geometry's
num_hidden_layers + the head (embedding gather, final norm and LM head over the
positions whose logits the step needs), the head measured the same way.

Where cases go in the JSON: models[m]["cases"] holds the decode steps at every
batch and the window and verification forwards at batch 1; models[m]["batch_cases"]
holds the window and verification forwards at the larger batches (the same fields,
`batch` > 1).  Cases run in priority order (the batch-1 costs of the first pair
first, then the larger batches pair by pair), so a run cut by --budget-s keeps
whole pairs.

    python scripts/gpu_costs.py                              # CUDA, bf16, all geometries, JSON to gpu_costs.json
    python scripts/gpu_costs.py --models qwen3-8b qwen3-0.6b --json out.json
    python scripts/gpu_costs.py --device cpu --tiny          # tiny shapes on the CPU (batches 1, 8): checks the script, measures nothing

Exit status: 0 when the JSON was written with at least one measured case, 1 when
no case could be measured, 2 on bad usage or when the device is missing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = "parse-vllm/gpu-costs/1"


@dataclass(frozen=True)
class Geometry:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    source: str


# From each model's config.json on the Hugging Face hub (Qwen/Qwen3-*).
GEOMETRIES = {
    "qwen3-0.6b": Geometry(1024, 28, 16, 8, 128, 3072, 151936, "Qwen/Qwen3-0.6B config.json"),
    "qwen3-1.7b": Geometry(2048, 28, 16, 8, 128, 6144, 151936, "Qwen/Qwen3-1.7B config.json"),
    "qwen3-8b": Geometry(4096, 36, 32, 8, 128, 12288, 151936, "Qwen/Qwen3-8B config.json"),
    "qwen3-32b": Geometry(5120, 64, 64, 8, 128, 25600, 151936, "Qwen/Qwen3-32B config.json"),
}
# (draft, target): the smaller geometry drafting for the larger
PAIRS = [("qwen3-0.6b", "qwen3-8b"), ("qwen3-0.6b", "qwen3-1.7b"), ("qwen3-1.7b", "qwen3-32b")]

# Shapes that run in seconds on a CPU (head size 64: one the compiled op is built for).
TINY_GEOMETRIES = {
    "tiny-draft": Geometry(128, 4, 2, 1, 64, 256, 2048, "made up (--tiny)"),
    "tiny-target": Geometry(256, 8, 4, 2, 64, 512, 2048, "made up (--tiny)"),
}
TINY_PAIRS = [("tiny-draft", "tiny-target")]

UNITS = {
    "*_ms": "milliseconds per call (median over repeats)",
    "tokens_per_s": "tokens per second of the whole model at that batch (batch / model_ms)",
    "context": "tokens already in the KV cache of each sequence",
    "new_tokens": "tokens the forward computes per sequence",
    "batch": "sequences in the forward (requests; a verification sequence carries its request's K copies)",
    "logit_positions": "positions the LM head is applied to, over the whole batch",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny made-up geometries (a smoke run, not a measurement)")
    ap.add_argument(
        "--dtype",
        choices=("bfloat16", "float16", "float32"),
        default=None,
        help="default: bfloat16 on CUDA, float32 on the CPU",
    )
    ap.add_argument("--models", nargs="+", default=None, help="geometries to measure (default: all of the pairs')")
    ap.add_argument(
        "--context", type=int, default=None, help="tokens in the KV cache before the step (1024; 256 --tiny)"
    )
    ap.add_argument("--layers", type=int, default=4, help="decoder layers built per geometry (time scaled to depth)")
    ap.add_argument(
        "--batches",
        type=int,
        nargs="+",
        default=None,
        help="batch sizes of every decode step, and (those above 1) of the window and verification forwards "
        "(default: 1 8 32; 1 8 with --tiny, whose batch-32 forwards take a minute on a CPU)",
    )
    ap.add_argument("--windows", type=int, nargs="+", default=[16, 64, 128], help="window sizes W")
    ap.add_argument("--copies", type=int, nargs="+", default=[4, 8, 16], help="verification copies K")
    ap.add_argument("--suffix", type=int, default=24, help="verification suffix tokens L per copy")
    ap.add_argument("--repeats", type=int, default=None, help="timed calls per case (default: 20, 3 with --tiny)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed calls first (default: 3, 1 with --tiny)")
    ap.add_argument("--no-graphs", action="store_true", help="time eagerly instead of replaying CUDA graphs")
    ap.add_argument(
        "--budget-s",
        type=float,
        default=210.0,
        help="stop starting new cases after this many seconds (the rest are listed as not measured)",
    )
    ap.add_argument("--json", type=Path, default=Path("gpu_costs.json"), help="where the JSON goes")
    args = ap.parse_args(argv)
    geos = TINY_GEOMETRIES if args.tiny else GEOMETRIES
    if args.models is None:
        args.models = [m for m in geos if any(m in p for p in (TINY_PAIRS if args.tiny else PAIRS))]
    bad = [m for m in args.models if m not in geos]
    if bad:
        ap.error(f"unknown geometries {bad}: choose from {sorted(geos)}" + ("" if args.tiny else " (or --tiny)"))
    if args.batches is None:
        args.batches = [1, 8] if args.tiny else [1, 8, 32]
    args.batches = list(dict.fromkeys(args.batches))
    if args.context is None:
        args.context = 256 if args.tiny else 1024
    if min([args.context, args.layers, args.suffix, *args.batches, *args.windows, *args.copies]) < 1:
        ap.error("--context, --layers, --suffix, --batches, --windows and --copies take integers >= 1")
    if args.repeats is None:
        args.repeats = 3 if args.tiny else 20
    if args.warmup is None:
        args.warmup = 1 if args.tiny else 3
    if args.repeats < 1 or args.warmup < 0:
        ap.error("--repeats must be >= 1 and --warmup >= 0")
    if args.dtype is None:
        args.dtype = "bfloat16" if args.device == "cuda" else "float32"
    return args


# --------------------------------------------------------------------------- the model pieces


class Stack:
    """`n` Qwen3 decoder layers with random weights, forward over new tokens whose
    K/V are written into a preallocated cache after `context` cached tokens."""

    def __init__(self, g: Geometry, n: int, dtype, device, seed: int = 0):
        import torch

        self.g, self.n, self.dtype, self.device = g, n, dtype, device
        gen = torch.Generator(device=device).manual_seed(seed)
        H, D, Hq, Hkv, Im = g.hidden_size, g.head_dim, g.num_attention_heads, g.num_key_value_heads, g.intermediate_size

        def w(rows, cols):
            return (torch.randn(rows, cols, generator=gen, device=device, dtype=torch.float32) / math.sqrt(cols)).to(
                dtype
            )

        def ones(k):
            return torch.ones(k, device=device, dtype=dtype)

        self.layers = [
            dict(
                ln1=ones(H),
                qkv=w((Hq + 2 * Hkv) * D, H),
                q_norm=ones(D),
                k_norm=ones(D),
                o=w(H, Hq * D),
                ln2=ones(H),
                gate_up=w(2 * Im, H),
                down=w(H, Im),
            )
            for _ in range(n)
        ]
        self.attention_form = None

    def cache(self, batch: int, context: int, new: int):
        import torch

        g = self.g
        shape = (batch, g.num_key_value_heads, context + new, g.head_dim)
        return [
            (
                torch.randn(shape, device=self.device, dtype=self.dtype),
                torch.randn(shape, device=self.device, dtype=self.dtype),
            )
            for _ in range(self.n)
        ]

    def rope(self, context: int, new: int):
        import torch

        D = self.g.head_dim
        inv = 1.0 / (1_000_000.0 ** (torch.arange(0, D, 2, device=self.device, dtype=torch.float32) / D))
        ang = torch.arange(context, context + new, device=self.device, dtype=torch.float32)[:, None] * inv[None]
        ang = torch.cat([ang, ang], dim=-1)
        return ang.cos().to(self.dtype)[None, :, None], ang.sin().to(self.dtype)[None, :, None]

    def attend(self, q, k, v, new: int):
        """SDPA of `new` query tokens over the whole cache slice, causal at the bottom
        right; the first form that runs here is kept (backends differ in what they take)."""
        if new == 1:
            return _attention(None, q, k, v, new)
        forms = [self.attention_form] if self.attention_form else ATTENTION_FORMS
        err = None
        for form in forms:
            try:
                out = _attention(form, q, k, v, new)
            except (RuntimeError, TypeError, ValueError, NotImplementedError) as e:
                err = e
                continue
            self.attention_form = form
            return out
        raise RuntimeError(f"no SDPA form runs here: {err}") from err

    def forward(self, x, kv, cos, sin, context: int):
        import torch.nn.functional as F

        g = self.g
        B, n, H = x.shape
        Hq, Hkv, D = g.num_attention_heads, g.num_key_value_heads, g.head_dim
        for p, (kc, vc) in zip(self.layers, kv):
            h = F.rms_norm(x, (H,), p["ln1"], 1e-6)
            qkv = h @ p["qkv"].t()
            q, k, v = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
            q = F.rms_norm(q.view(B, n, Hq, D), (D,), p["q_norm"], 1e-6)
            k = F.rms_norm(k.view(B, n, Hkv, D), (D,), p["k_norm"], 1e-6)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            kc[:, :, context : context + n] = k.transpose(1, 2)
            vc[:, :, context : context + n] = v.view(B, n, Hkv, D).transpose(1, 2)
            a = self.attend(q.transpose(1, 2), kc[:, :, : context + n], vc[:, :, : context + n], n)
            x = x + a.transpose(1, 2).reshape(B, n, Hq * D) @ p["o"].t()
            h = F.rms_norm(x, (H,), p["ln2"], 1e-6)
            gate, up = (h @ p["gate_up"].t()).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ p["down"].t()
        return x


ATTENTION_FORMS = ("lower_right_gqa", "mask_gqa", "mask_expand")


def _rotate_half(x):
    import torch

    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


def _attention(form: str | None, q, k, v, new: int):
    """q [B, Hq, new, D] over k, v [B, Hkv, S, D]: the last `new` keys causally."""
    import torch
    import torch.nn.functional as F

    S = k.shape[2]
    if new == 1:
        mask = None  # one query sees every key
    elif form == "lower_right_gqa":
        from torch.nn.attention.bias import causal_lower_right

        mask = causal_lower_right(new, S)
    else:
        mask = torch.ones(new, S, dtype=torch.bool, device=q.device).tril(S - new)
    if form == "mask_expand" and q.shape[1] != k.shape[1]:
        rep = q.shape[1] // k.shape[1]
        return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), mask)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


class Head:
    """Embedding gather, final RMSNorm and LM head of a geometry."""

    def __init__(self, g: Geometry, dtype, device, seed: int = 1):
        import torch

        gen = torch.Generator(device=device).manual_seed(seed)
        V, H = g.vocab_size, g.hidden_size
        self.embed = torch.randn(V, H, generator=gen, device=device, dtype=torch.float32).to(dtype)
        self.lm_head = (torch.randn(V, H, generator=gen, device=device, dtype=torch.float32) / math.sqrt(H)).to(dtype)
        self.norm = torch.ones(H, device=device, dtype=dtype)
        self.g = g

    def forward(self, ids, x):
        import torch.nn.functional as F

        e = self.embed[ids]
        h = F.rms_norm(x + e, (self.g.hidden_size,), self.norm, 1e-6)
        return h @ self.lm_head.t()


# --------------------------------------------------------------------------- timing


class Timer:
    """Median time of `fn()`: CUDA events (L2 flushed before each call, not timed),
    replaying a CUDA graph of `fn` when `graphs`; perf_counter on the CPU."""

    def __init__(self, device, warmup: int, repeats: int, graphs: bool):
        import torch

        self.device, self.warmup, self.repeats = device, warmup, repeats
        self.cuda = device.type == "cuda"
        self.graphs = graphs and self.cuda
        self.flush = None
        if self.cuda:
            l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or (50 << 20)
            self.flush = torch.empty(max(256 << 20, 4 * l2) // 4, dtype=torch.float32, device=device)

    def __call__(self, fn) -> tuple[float, str, str | None]:
        """(median ms, "graph" or "eager", why eager where graphs were asked for)."""
        import torch

        for _ in range(self.warmup):
            fn()
        how, why = "eager", None
        call = fn
        if self.graphs:
            try:
                call = _graphed(fn)
                how = "graph"
            except Exception as e:  # capture is refused by some kernels; eager timing still says something
                why = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
                torch.cuda.synchronize()
        times = []
        if self.cuda:
            for _ in range(self.repeats):
                self.flush.zero_()
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                call()
                e.record()
                e.synchronize()
                times.append(s.elapsed_time(e))
        else:
            for _ in range(self.repeats):
                t0 = time.perf_counter()
                call()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times), how, why


def _graphed(fn):
    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


# --------------------------------------------------------------------------- cases


def stack_case(stack: Stack, timer: Timer, batch: int, new: int, context: int) -> dict:
    import torch

    g = stack.g
    with torch.no_grad():
        kv = stack.cache(batch, context, new)
        cos, sin = stack.rope(context, new)
        x = torch.randn(batch, new, g.hidden_size, device=stack.device, dtype=stack.dtype)
        ms, how, why = timer(lambda: stack.forward(x, kv, cos, sin, context))
    form = stack.attention_form if new > 1 else "no mask (one query token)"
    out = {"stack_ms": ms, "layer_ms": ms / stack.n, "timing": how, "attention_form": form}
    if why:
        out["graph_refused"] = why
    return out


def head_case(head: Head, timer: Timer, positions: int) -> dict:
    import torch

    with torch.no_grad():
        ids = torch.randint(0, head.g.vocab_size, (positions,), device=head.embed.device)
        x = torch.randn(positions, head.g.hidden_size, device=head.embed.device, dtype=head.embed.dtype)
        ms, how, why = timer(lambda: head.forward(ids, x))
    out = {"head_ms": ms, "timing": how}
    if why:
        out["graph_refused"] = why
    return out


def attention_case(g: Geometry, timer: Timer, context: int, copies: int, suffix: int, dtype, device) -> dict:
    """One layer's verification attention: the compiled op against K per-copy SDPA calls
    (scripts/bench_kernel.py's inputs and baselines: nested prefixes of one request),
    both timed eagerly (`timer` without graphs), as attention runs between vLLM's
    piecewise CUDA graphs; bench_kernel.py times both replayed from graphs too."""
    import torch

    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_kernel as bk

    import parse_vllm.ops as ops

    x = bk.make_inputs(
        context, copies, suffix, g.num_attention_heads, g.num_key_value_heads, g.head_dim, 16, dtype, device=device
    )
    out = torch.empty_like(x["q"])
    res: dict = {"context": context, "copies": copies, "suffix_tokens": suffix, "block_size": 16}
    forms = {}
    for form in ("lower_right_gqa", "mask_gqa"):
        try:
            run = bk.make_per_copy_sdpa(x, form)
            forms[form] = timer(lambda run=run: run(x, out))[0]
        except Exception as e:
            res.setdefault("sdpa_forms_failed", {})[form] = f"{type(e).__name__}: {e}"[:200]
    if forms:
        best = min(forms, key=forms.get)
        res.update(sdpa_per_copy_ms=forms[best], sdpa_form=best, sdpa_form_ms=forms)
    available = ops.has_cuda_op() if device.type == "cuda" else ops.has_compiled_op()
    if not available:
        why = ops.compiled_op_error() or "built without it"
        res["op"] = f"not measured: parse_vllm._C has no {device.type.upper()} kernel ({why})"
        return res
    ref = bk.prefix_verify_attention_ref(*bk.op_inputs(x)).float()
    op_out = torch.empty_like(x["q"])
    ops.prefix_verify_attention(*bk.op_inputs(x), out=op_out)
    res["op_rel_err"] = bk.rel_err(op_out, ref)
    res["op_ms"] = timer(lambda: ops.prefix_verify_attention(*bk.op_inputs(x), out=op_out))[0]
    if "sdpa_per_copy_ms" in res:
        res["op_speedup_vs_sdpa_per_copy"] = res["sdpa_per_copy_ms"] / res["op_ms"]
    return res


# --------------------------------------------------------------------------- the run


def plan(args) -> list[tuple]:
    """The cases in the order they run: every pair's batch-1 costs first (the first pair's
    first), then the larger batches model by model in the same order (a target's decode
    steps and its window and verification forwards at each batch, a draft's decode
    steps), so that a run cut short by the time budget still has whole pairs.
    Items: (kind, model, size, batch); size is the batch (decode), W or K."""
    all_pairs = TINY_PAIRS if args.tiny else PAIRS
    pairs = [(d, t) for d, t in all_pairs if d in args.models and t in args.models]
    order = list(dict.fromkeys([m for p in pairs for m in reversed(p)] + list(args.models)))
    targets = {t for _, t in all_pairs}  # a target's window and verification costs, with its draft or not
    larger = [b for b in args.batches if b > 1]  # the forwards' batches besides 1
    cases = []
    for m in order:
        cases += [("decode", m, b, b) for b in args.batches[:1]]
        if m in targets:
            cases += [("window_forward", m, w, 1) for w in args.windows]
            cases += [("verify_forward", m, k, 1) for k in args.copies]
            cases += [("verify_attention", m, k, 1) for k in args.copies]
    for m in order:
        cases += [("decode", m, b, b) for b in args.batches[1:]]
        if m in targets:
            for b in larger:
                cases += [("window_forward", m, w, b) for w in args.windows]
                cases += [("verify_forward", m, k, b) for k in args.copies]
    return cases


def new_tokens(kind: str, size: int, suffix: int) -> tuple[int, int]:
    """(new tokens per sequence, logit positions per sequence) of a case: logits at every
    decoded token, at every window position, at one position per verification copy (the
    label's token right after its suffix)."""
    if kind == "decode":
        return 1, 1
    if kind == "window_forward":
        return size, size
    return size * suffix, size  # verify_forward: K copies of L tokens, costed as one sequence per request


def run(args) -> dict:
    import torch

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    geos = TINY_GEOMETRIES if args.tiny else GEOMETRIES
    timer = Timer(device, args.warmup, args.repeats, graphs=not args.no_graphs)
    eager = Timer(device, args.warmup, args.repeats, graphs=False)
    t_start = time.monotonic()
    models: dict[str, dict] = {}
    attention: list[dict] = []
    not_measured: list[dict] = []
    errors: list[dict] = []
    built: dict[str, tuple[Stack, Head]] = {}
    heads_ms: dict[tuple[str, int], dict] = {}
    for kind, m, size, batch in plan(args):
        if time.monotonic() - t_start > args.budget_s:
            not_measured.append(
                {"case": kind, "model": m, "size": size, "batch": batch, "why": f"time budget {args.budget_s:g} s"}
            )
            continue
        g = geos[m]
        entry = models.setdefault(m, {"geometry": asdict(g), "cases": [], "batch_cases": []})
        try:
            if m not in built:
                if len(built) >= 1:  # one geometry's weights on the device at a time
                    built.clear()
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                built[m] = (Stack(g, min(args.layers, g.num_hidden_layers), dtype, device), Head(g, dtype, device))
            stack, head = built[m]
            if kind == "verify_attention":
                a = attention_case(g, eager, args.context, size, args.suffix, dtype, device)
                a["model"] = m
                a["layers"] = g.num_hidden_layers
                if "op_ms" in a:
                    a["model_op_ms"] = a["op_ms"] * g.num_hidden_layers
                if "sdpa_per_copy_ms" in a:
                    a["model_sdpa_per_copy_ms"] = a["sdpa_per_copy_ms"] * g.num_hidden_layers
                attention.append(a)
                continue
            new, per_seq = new_tokens(kind, size, args.suffix)
            pos = batch * per_seq  # the head runs over the whole batch's positions
            if (m, pos) not in heads_ms:
                heads_ms[(m, pos)] = head_case(head, timer, pos)
            h = heads_ms[(m, pos)]
            c = stack_case(stack, timer, batch, new, args.context)
            c.update(
                case=kind,
                batch=batch,
                new_tokens=new,
                context=args.context,
                logit_positions=pos,
                layers_built=stack.n,
                head_ms=h["head_ms"],
                model_ms=c["layer_ms"] * g.num_hidden_layers + h["head_ms"],
            )
            if kind == "decode":
                c["tokens_per_s"] = batch / c["model_ms"] * 1e3
            if kind == "verify_forward":
                c.update(copies=size, suffix_tokens=args.suffix)
            if kind == "window_forward":
                c["window"] = size
            entry["batch_cases" if kind != "decode" and batch > 1 else "cases"].append(c)
        except Exception as e:
            errors.append(
                {"case": kind, "model": m, "size": size, "batch": batch, "error": f"{type(e).__name__}: {e}"[:400]}
            )
            if device.type == "cuda" and isinstance(e, torch.cuda.OutOfMemoryError):
                built.clear()
                torch.cuda.empty_cache()
    pairs = [
        {"draft": d, "target": t}
        for d, t in (TINY_PAIRS if args.tiny else PAIRS)
        if d in args.models and t in args.models
    ]
    return {
        "schema": SCHEMA,
        "tool": "scripts/gpu_costs.py",
        "written_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "device": device_info(device),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "dtype": args.dtype,
        "tiny": args.tiny,
        "measurement": (
            "a smoke run on tiny made-up shapes, not a measurement"
            if args.tiny or device.type != "cuda"
            else "random weights in the geometries' real shapes"
        ),
        "settings": {
            "context": args.context,
            "layers_built": args.layers,
            "suffix_tokens": args.suffix,
            "batches": args.batches,
            "windows": args.windows,
            "copies": args.copies,
            "repeats": args.repeats,
            "warmup": args.warmup,
            "graphs": not args.no_graphs and device.type == "cuda",
            "budget_s": args.budget_s,
            "timing": (
                "CUDA events around each call, L2 flushed before it (not timed), median of repeats; CUDA graph "
                "replay unless the case says eager"
                if device.type == "cuda"
                else "time.perf_counter around each call, median of repeats"
            ),
        },
        "extrapolation": (
            "model_ms = layer_ms x num_hidden_layers + head_ms, where layer_ms = the time of a stack of "
            "layers_built decoder layers / layers_built (Qwen3's layer in plain PyTorch over a preallocated KV "
            "cache, SDPA attention; vLLM's own kernels differ) and head_ms = embedding gather + final RMSNorm + "
            "LM head over logit_positions positions, measured alone. verify_forward is one forward over "
            "copies x suffix_tokens new tokens after the context, causal over all of them: an upper bound on the "
            "copies' attention (each sees only its own prefix and suffix), the rest of the layer exact; "
            "verify_attention gives that attention alone per layer (model_* = x num_hidden_layers). At batch B "
            "(batch_cases, and decode at every batch) the forward carries B sequences of new_tokens each, every "
            "one over its own context-token cache, logits at B x the per-sequence positions: equal lengths, where "
            "a real engine step mixes requests of different lengths and contexts."
        ),
        "units": UNITS,
        "pairs": pairs,
        "models": models,
        "verify_attention": attention,
        "not_measured": not_measured,
        "errors": errors,
        "seconds": round(time.monotonic() - t_start, 1),
    }


def device_info(device) -> dict:
    import torch

    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        cap = torch.cuda.get_device_capability(device)
        return {
            "type": "cuda",
            "name": p.name,
            "capability": f"{cap[0]}.{cap[1]}",
            "sms": p.multi_processor_count,
            "memory_GiB": round(p.total_memory / 2**30, 1),
        }
    return {"type": "cpu", "name": platform.processor() or platform.machine(), "cpus": os.cpu_count()}


def measured_cases(report: dict) -> int:
    return sum(len(m["cases"]) + len(m.get("batch_cases", [])) for m in report["models"].values()) + sum(
        1 for a in report["verify_attention"] if "op_ms" in a or "sdpa_per_copy_ms" in a
    )


def table(report: dict) -> str:
    """The short table printed at the end."""

    def fmt(x, spec=".3f"):
        return "-" if x is None else format(x, spec)

    lines = [
        f"{report['device']['name']} ({report['device']['type']}), torch {report['torch']}, {report['dtype']}, "
        f"context {report['settings']['context']}: full-model ms per step (extrapolated from "
        f"{report['settings']['layers_built']} layers)"
    ]
    for name, m in report["models"].items():
        by = {}
        for c in m["cases"]:
            key = {"decode": "batch", "window_forward": "window", "verify_forward": "copies"}[c["case"]]
            by.setdefault(c["case"], []).append(f"{c[key]}: {fmt(c['model_ms'])}")
        parts = [
            f"{k} ({'batch' if k == 'decode' else 'W' if k == 'window_forward' else 'K'}) " + ", ".join(v)
            for k, v in by.items()
        ]
        lines.append(f"  {name:<12} " + "; ".join(parts))
        for b in dict.fromkeys(c["batch"] for c in m.get("batch_cases", [])):
            by = {}
            for c in (c for c in m["batch_cases"] if c["batch"] == b):
                key = "window" if c["case"] == "window_forward" else "copies"
                by.setdefault(c["case"], []).append(f"{c[key]}: {fmt(c['model_ms'])}")
            parts = [f"{k} ({'W' if k == 'window_forward' else 'K'}) " + ", ".join(v) for k, v in by.items()]
            lines.append(f"  {'':<12} at batch {b}: " + "; ".join(parts))
    for a in report["verify_attention"]:
        lines.append(
            f"  {a['model']:<12} verify attention, one layer, K {a['copies']} x L {a['suffix_tokens']}: "
            f"op {fmt(a.get('op_ms'))} ms, {a['copies']} SDPA calls {fmt(a.get('sdpa_per_copy_ms'))} ms"
            + (f" ({a['op_speedup_vs_sdpa_per_copy']:.2f}x)" if "op_speedup_vs_sdpa_per_copy" in a else "")
            + (f" [{a['op']}]" if "op" in a else "")
        )
    if report["not_measured"]:
        lines.append(f"  not measured (time budget): {len(report['not_measured'])} case(s)")
    for e in report["errors"]:
        lines.append(f"  FAILED {e['case']} {e['model']} {e['size']}: {e['error'][:160]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, str(ROOT))
    try:
        import torch
    except ImportError as e:
        print(f"gpu_costs: torch does not import: {e}", file=sys.stderr)
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "gpu_costs: no CUDA device visible to torch (use --device cpu --tiny to check the script)", file=sys.stderr
        )
        return 2
    report = run(args)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1, allow_nan=False) + "\n")
    print(table(report))
    print(f"wrote {args.json}")
    return 0 if measured_cases(report) else 1


if __name__ == "__main__":
    sys.exit(main())
