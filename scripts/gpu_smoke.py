#!/usr/bin/env python
"""First contact with a GPU: PARSE end to end through `LLM(...)` on tiny models.

For a machine with a CUDA GPU, vLLM (>= 0.32, the CUDA build) and this package
installed (`pip install --no-build-isolation -e '.[gpu]'`). Nothing is
downloaded: a 4-layer target and a 2-layer draft with random weights are
written on the spot around a real tokenizer shipped in the repository
(tests/fixtures/tokenizers/qwen3, Qwen3's architecture and chat template).

It checks, and prints one JSON line (`"ok": true` when every check that ran
passed; exit status 0, else 1; 2 when it cannot run here: no torch, no CUDA
device, no vLLM). For each verifier V (kernel, forked), in an engine whose
windows are drafted over several engine steps (`draft_chunk` < W):
  lossless_guard1_V      guard 1 (greedy, τ = 0.5) gives exactly the target alone's tokens
  windows_over_steps_V   ... and those windows took several engine steps each
  lossless_tau_above_1_V τ = 1.5 gives exactly the target alone's tokens
  accept_V               τ = 0 takes drafts (tokens accepted semantically > 0)
  judged_V               τ = 0.5 judges drafts (copies > 0), prefix caching on
  kv_V                   no KV block is held once every request is done
  kernel_equals_forked   the kernel verifier's judgments equal the forked one's
                         (same prefixes, |ΔP(yes)| <= 1e-3)
The kernel checks are reported as skipped, saying why, when parse_vllm._C has no
CUDA kernel (built without nvcc); everything else still runs. With EAGLE-3 as
the token-level proposer (`token_proposer`, k = 3), τ = 1.5, once with
enforce_eager and once with CUDA graphs:
  eagle3_lossless_eager, eagle3_lossless_graphs   exactly the target alone's tokens
  eagle3_graphs_agree_with_eager                  EAGLE-3's token-level acceptance is the same
                         (the head reads the target's auxiliary hidden states after the
                         graphs replay: a stale read shows as lost acceptance)
EAGLE-3 runs on the SmolLM2-135M-Instruct pair with the shipped head when the pair
is built (`parse-vllm prepare-models`), else on the tiny target with a head made
here: one layer whose attention and MLP add nothing, its LM head fitted by least
squares to the target's own tokens two positions ahead, so that it proposes them
from the target's hidden states (a high acceptance that depends on reading them).

    python scripts/gpu_smoke.py                 # float32, TRITON_ATTN, W 16, draft_chunk 2
    python scripts/gpu_smoke.py --dtype bfloat16 --attention-backend FLASH_ATTN
    python scripts/gpu_smoke.py --device cpu    # vLLM's CPU engine: checks this script, not the GPU
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

# PARSE runs on vLLM's model runner V1, and vLLM 0.33 picks the runner from this when an
# engine is configured: set before anything imports vLLM, so that the target-alone
# reference engine runs on the runner the PARSE engines run on.
os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [
    "Write a haiku about the sea.",
    "What is 17 times 23? Explain step by step.",
    "List three uses of a paperclip.",
    "Tell me a story about a dragon who learns to fly over the mountains at night.",
]
CHAT = [
    "Write two sentences about rivers.",
    "What is the capital of Italy? Answer in one sentence.",
    "List three colours.",
]
P_YES_TOLERANCE = 1e-3
EAGLE3_K = 3
EAGLE3_LAYERS = (1, 2, 3)  # the tiny target's layers whose inputs feed the head made here
EAGLE3_RATE_TOLERANCE = 0.05  # |acceptance rate with graphs - eager|
EAGLE3_MIN_ACCEPTED = 20  # fewer accepted tokens with enforce_eager: the comparison proves nothing
SHIPPED_HEAD = ROOT / "parse_vllm" / "drafts" / "smollm2-135m-instruct-eagle3"
KERNEL_CHECKS = (
    "lossless_guard1_kernel",
    "windows_over_steps_kernel",
    "lossless_tau_above_1_kernel",
    "accept_kernel",
    "judged_kernel",
    "kv_kernel",
    "kernel_equals_forked",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16", "float16"),
        help="model dtype (float32: token-for-token comparisons are exact)",
    )
    ap.add_argument(
        "--attention-backend",
        default="TRITON_ATTN",
        help="vLLM attention backend (one the kernel verifier reads: TRITON_ATTN, FLASH_ATTN, FLASHINFER)",
    )
    ap.add_argument("--window", type=int, default=16, help="PARSE window W (num_speculative_tokens)")
    ap.add_argument("--draft-chunk", type=int, default=2, help="draft tokens a window advances per engine step (< W)")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens per request")
    ap.add_argument(
        "--eagle3",
        choices=("auto", "smollm2", "tiny", "off"),
        default="auto",
        help="EAGLE-3 checks on the SmolLM2 pair with the shipped head, on the tiny target with a head made "
        "here, or none (auto: SmolLM2 when `parse-vllm prepare-models` has built it, else tiny)",
    )
    ap.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cpu: vLLM's CPU engine (checks this script; no kernel verifier, no CUDA graphs)",
    )
    ap.add_argument("--workdir", type=Path, default=None, help="where the tiny models go (default: a temp dir)")
    args = ap.parse_args(argv)
    if args.window < 2 or args.max_tokens < 1:
        ap.error("--window must be >= 2 and --max-tokens >= 1")
    if not 1 <= args.draft_chunk < args.window:
        ap.error(f"--draft-chunk must be in [1, {args.window - 1}]: windows drafted over several steps")
    return args


def _emit(result: dict, code: int) -> int:
    print(json.dumps(result, sort_keys=True, default=str))
    return code


# --------------------------------------------------------------------------- the checks (pure)


def kernel_unavailable(device: str) -> str | None:
    """Why the kernel verifier cannot run here (None when it can)."""
    if device != "cuda":
        return "the kernel verifier runs on CUDA only (--device cpu)"
    import parse_vllm.ops as ops

    if not ops.has_cuda_op():
        why = ops.compiled_op_error() or "parse_vllm._C was built without its CUDA kernel (no nvcc at build time)"
        return f"no CUDA kernel of the op: {why}; build it (scripts/gpu_check.sh's build step, or pip install -e .)"
    return None


def skipped_checks(names, why: str) -> dict[str, dict]:
    return {n: {"ok": None, "skipped": why} for n in names}


def lossless(got: list[list[int]], want: list[list[int]]) -> dict:
    first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if first is None and len(got) != len(want):
        first = min(len(got), len(want))
    return {"ok": first is None, "first_mismatch_prompt": first}


def windows_over_steps(stats: dict, draft_chunk: int) -> dict:
    """Windows were drafted and took more than one engine step each on average, never
    more than `draft_chunk` tokens a step."""
    drafts, chunks, widest = stats["drafts"], stats.get("window_chunks", 0), stats.get("window_chunk_max", 0)
    return {
        "ok": drafts > 0 and chunks > drafts and 0 < widest <= draft_chunk,
        "drafts": drafts,
        "window_chunks": chunks,
        "window_chunk_max": widest,
        "draft_chunk": draft_chunk,
    }


def compare_judgments(kernel: list[dict], forked: list[dict], tol: float = P_YES_TOLERANCE) -> dict:
    """The kernel verifier's P(yes) against the forked verifier's, prefix by prefix."""
    by_prefix = {tuple(j["token_ids"]): j["p_yes"] for j in forked}
    pairs = [(j["p_yes"], by_prefix[tuple(j["token_ids"])]) for j in kernel if tuple(j["token_ids"]) in by_prefix]
    worst = max((abs(a - b) for a, b in pairs), default=None)
    return {"ok": bool(pairs) and worst <= tol, "compared": len(pairs), "max_abs_p_yes_diff": worst}


def eagle3_acceptance(stats: dict) -> dict:
    drafted = stats.get("token_level_draft_tokens", {}).get("eagle3", 0)
    accepted = stats.get("token_level_accepted_tokens", {}).get("eagle3", 0)
    return {"drafted": drafted, "accepted": accepted, "rate": accepted / drafted if drafted else None}


def graphs_agree_with_eager(eager: dict, graphs: dict, tol: float = EAGLE3_RATE_TOLERANCE) -> dict:
    """EAGLE-3's acceptance with CUDA graphs against enforce_eager (`eagle3_acceptance` of each)."""
    out = {"eager": eager, "graphs": graphs, "tolerance": tol}
    if eager["accepted"] < EAGLE3_MIN_ACCEPTED:
        return {
            **out,
            "ok": False,
            "why": f"inconclusive: EAGLE-3 accepted {eager['accepted']} tokens eagerly "
            f"(< {EAGLE3_MIN_ACCEPTED}): the head proposes too poorly for the comparison to prove anything",
        }
    if graphs["rate"] is None:
        return {**out, "ok": False, "why": "EAGLE-3 drafted nothing with CUDA graphs"}
    diff = abs(graphs["rate"] - eager["rate"])
    return {**out, "ok": diff <= tol, "rate_diff": diff}


def overall(checks: dict[str, dict]) -> bool:
    """Every check that ran passed (skipped ones have ok None)."""
    ran = [c for c in checks.values() if c.get("ok") is not None]
    return bool(ran) and all(c["ok"] for c in ran)


# --------------------------------------------------------------------------- engines


def _ids(outs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


class Engines:
    """vLLM engines for the checks: on the GPU (the backend named), or vLLM's CPU engine."""

    def __init__(self, args):
        self.args = args

    def make(self, target, *, draft=None, parse: dict | None = None, enforce_eager: bool = False):
        """The target alone (parse None), or with PARSE, `draft` writing W-token windows."""
        from vllm import LLM

        a = self.args
        kw = dict(
            model=str(target),
            dtype=a.dtype,
            max_model_len=2048,
            enable_prefix_caching=True,
            seed=0,
            enforce_eager=enforce_eager,
        )
        if a.device == "cuda":
            kw.update(gpu_memory_utilization=0.3, attention_backend=a.attention_backend)
        else:
            kw.update(kv_cache_memory_bytes=256 << 20, block_size=32, max_num_seqs=8)
        if parse is not None:
            kw["speculative_config"] = {
                "method": "draft_model",
                "model": str(draft),
                "num_speculative_tokens": a.window,
            }
            kw["additional_config"] = {"parse": {"record_judgments": 4096, "draft_chunk": a.draft_chunk, **parse}}
        return LLM(**kw)

    def params(self, max_tokens: int, **extra):
        from vllm import SamplingParams

        return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, extra_args=extra or None)

    def finish_steps(self, llm) -> None:
        """generate() returns before the engine step that tells the workers which requests
        finished; with the engine core in this process (the CPU engine), run that step."""
        if hasattr(llm.llm_engine.engine_core, "engine_core"):
            llm.llm_engine.step()

    def close(self, llm) -> None:
        import gc

        try:
            llm.llm_engine.engine_core.shutdown()
        finally:
            del llm
            gc.collect()


def verifier_checks(engines, llm, prompts, want, max_tokens: int, draft_chunk: int) -> tuple[dict, dict, list]:
    """The checks of one PARSE engine (names without the verifier), its τ = 0.5 counters
    and its recorded judgments."""
    import parse_vllm

    def generate(**extra):
        parse_vllm.reset_stats(llm)
        got = _ids(llm.generate(prompts, engines.params(max_tokens, **extra)))
        return got, parse_vllm.get_stats(llm)

    checks = {}
    got, stats = generate(parse_threshold=0.5, parse_guard=1)
    checks["lossless_guard1"] = lossless(got, want)
    checks["windows_over_steps"] = windows_over_steps(stats, draft_chunk)
    got, _ = generate(parse_threshold=1.5)
    checks["lossless_tau_above_1"] = lossless(got, want)
    _, stats = generate(parse_threshold=0.0)
    checks["accept"] = {
        "ok": stats["tokens_accepted_semantic"] > 0,
        "tokens_accepted_semantic": stats["tokens_accepted_semantic"],
    }
    _, stats = generate(parse_threshold=0.5)
    judgments = parse_vllm.get_judgments(llm)
    checks["judged"] = {"ok": stats["copies"] > 0, "copies": stats["copies"]}
    engines.finish_steps(llm)
    kv = llm.collective_rpc("parse_kv_blocks")[0]
    checks["kv"] = {
        "ok": kv["request_blocks_held"] == 0 and kv["runner_requests"] == 0,
        "request_blocks_held": kv["request_blocks_held"],
    }
    return checks, stats, judgments


def _engine_failed(e: BaseException) -> dict:
    return {"ok": False, "error": f"{type(e).__name__}: {e}"[:2000], "traceback": traceback.format_exc()[-3000:]}


def run_verifiers(args, engines, models, prompts, want) -> tuple[dict, dict]:
    """The checks of the PARSE engines (kernel, forked) and their τ = 0.5 counters. An
    engine that fails is one failed check; the other engine still runs."""
    checks: dict[str, dict] = {}
    why = kernel_unavailable(args.device)
    verifiers = ["forked"] if why else ["kernel", "forked"]
    if why:
        checks.update(skipped_checks(KERNEL_CHECKS, why))
    stats, judgments = {}, {}
    for v in verifiers:
        try:
            llm = engines.make(models["target"], draft=models["draft"], parse={"verifier": v})
        except Exception as e:
            checks[f"engine_{v}"] = _engine_failed(e)
            continue
        try:
            got, stats[v], judgments[v] = verifier_checks(
                engines, llm, prompts, want, args.max_tokens, args.draft_chunk
            )
            checks.update({f"{name}_{v}": c for name, c in got.items()})
        except Exception as e:
            checks[f"engine_{v}"] = _engine_failed(e)
        finally:
            engines.close(llm)
    if "kernel" in verifiers:
        if "kernel" in judgments and "forked" in judgments:
            checks["kernel_equals_forked"] = compare_judgments(judgments["kernel"], judgments["forked"])
        else:
            checks["kernel_equals_forked"] = {"ok": False, "why": "an engine failed: nothing to compare"}
    return checks, stats


# --------------------------------------------------------------------------- EAGLE-3


def fit_eagle3_head(target: Path, sequences: list[tuple[list[int], list[int]]], out: Path, seed: int = 0) -> dict:
    """An EAGLE-3 head for `target` in speculators' format (config.json + model.safetensors,
    as `parse-vllm train-eagle3` exports them), made without training.

    Its decoder layer adds nothing (o_proj and down_proj are zero), so the head's output at
    position t is LMhead(RMSNorm(fc(aux(t)))), aux(t) = the target's hidden states entering
    EAGLE3_LAYERS at t. The LM head, over a draft vocabulary of the tokens the target wrote,
    is the least-squares fit of that to the token at t + 2 (what EAGLE-3 proposes there,
    given token t + 1) over `sequences` ((prompt ids, the target's greedy ids)): the head
    proposes the target's tokens on those prompts, from its hidden states."""
    import torch
    import torch.nn.functional as F
    import transformers
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    cfg = json.loads((target / "config.json").read_text())
    H, V, eps = cfg["hidden_size"], cfg["vocab_size"], cfg.get("rms_norm_eps", 1e-6)
    Hq, Hkv, Im = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["intermediate_size"]
    D = cfg.get("head_dim") or H // Hq
    model = AutoModelForCausalLM.from_pretrained(str(target)).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    fc = torch.randn(H, len(EAGLE3_LAYERS) * H, generator=gen) / (len(EAGLE3_LAYERS) * H) ** 0.5
    feats, nexts = [], []
    with torch.no_grad():
        for prompt, output in sequences:
            ids = list(prompt) + list(output)
            hs = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
            aux = torch.cat([hs[i][0] for i in EAGLE3_LAYERS], dim=-1)
            f = F.rms_norm(aux @ fc.t(), (H,), eps=eps)
            for t in range(max(len(prompt) - 1, 0), len(ids) - 2):
                feats.append(f[t])
                nexts.append(ids[t + 2])
    if not feats:
        raise ValueError("no positions to fit the head on (outputs of at least 2 tokens are needed)")
    vocab = sorted(set(nexts))
    col = {tok: i for i, tok in enumerate(vocab)}
    X = torch.stack(feats).double()
    Y = torch.zeros(len(nexts), len(vocab), dtype=torch.float64)
    Y[torch.arange(len(nexts)), torch.tensor([col[t] for t in nexts])] = 1.0
    W = torch.linalg.lstsq(X, Y, driver="gelsd").solution  # [H, draft vocab]
    fit = (X @ W).argmax(-1).eq(torch.tensor([col[t] for t in nexts])).double().mean().item()
    lm_head = (W.t() * 20.0).float()

    def rand(rows, cols):
        return torch.randn(rows, cols, generator=gen) / cols**0.5

    weights = {
        "d2t": torch.tensor([tok - i for i, tok in enumerate(vocab)], dtype=torch.int64),
        "t2d": torch.zeros(V, dtype=torch.bool).index_fill_(0, torch.tensor(vocab), True),
        "fc.weight": fc,
        "layers.0.hidden_norm.weight": torch.ones(H),
        "layers.0.input_layernorm.weight": torch.ones(H),
        "layers.0.post_attention_layernorm.weight": torch.ones(H),
        "layers.0.self_attn.q_proj.weight": rand(Hq * D, 2 * H),
        "layers.0.self_attn.k_proj.weight": rand(Hkv * D, 2 * H),
        "layers.0.self_attn.v_proj.weight": rand(Hkv * D, 2 * H),
        "layers.0.self_attn.o_proj.weight": torch.zeros(H, Hq * D),
        "layers.0.mlp.gate_proj.weight": rand(Im, H),
        "layers.0.mlp.up_proj.weight": rand(Im, H),
        "layers.0.mlp.down_proj.weight": torch.zeros(H, Im),
        "lm_head.weight": lm_head,
        "norm.weight": torch.ones(H),
    }
    rope_theta = (cfg.get("rope_parameters") or {}).get("rope_theta") or cfg.get("rope_theta") or 1e6
    layer = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": H,
        "intermediate_size": Im,
        "num_attention_heads": Hq,
        "num_key_value_heads": Hkv,
        "head_dim": D,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "rms_norm_eps": eps,
        "max_position_embeddings": cfg.get("max_position_embeddings", 2048),
        "rope_theta": rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "tie_word_embeddings": False,
        "vocab_size": V,
    }
    config = {
        "architectures": ["Eagle3DraftModel"],
        "auto_map": {"": "config.Eagle3SpeculatorConfig"},
        "draft_vocab_size": len(vocab),
        "dtype": "float32",
        "torch_dtype": "float32",
        "eagle_aux_hidden_state_layer_ids": list(EAGLE3_LAYERS),
        "embed_requires_grad": False,
        "fc_norm": False,
        "norm_before_fc": False,
        "norm_before_residual": False,
        "norm_output": False,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {
                    "accept_tolerance": 0.0,
                    "proposal_type": "greedy",
                    "speculative_tokens": EAGLE3_K,
                    "verifier_accept_k": 1,
                }
            ],
            "verifier": {"architectures": cfg.get("architectures"), "name_or_path": target.name},
        },
        "speculators_model_type": "eagle3",
        "speculators_version": "0.9.0",
        "target_hidden_size": None,
        "tie_word_embeddings": False,
        "transformer_layer_config": layer,
        "transformers_version": transformers.__version__,
    }
    out.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.contiguous() for k, v in weights.items()}, str(out / "model.safetensors"), metadata={"format": "pt"}
    )
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return {"head": str(out), "draft_vocab": len(vocab), "positions": len(nexts), "fit_accuracy": fit}


def eagle3_setup(args, models, prompt_ids, want, workdir: Path) -> dict:
    """Which pair the EAGLE-3 checks run on: {"pair", "target", "draft", "head", "why", ...}."""
    if args.eagle3 in ("auto", "smollm2"):
        try:
            from parse_vllm.tools.benchmarks.common import resolve_models

            if not (SHIPPED_HEAD / "config.json").is_file():
                raise FileNotFoundError(f"no shipped head at {SHIPPED_HEAD}")
            target, draft = resolve_models(None, None)
            return {
                "pair": "smollm2",
                "target": target,
                "draft": draft,
                "head": SHIPPED_HEAD,
                "why": "SmolLM2-135M-Instruct, its draft and the shipped head",
            }
        except Exception as e:
            if args.eagle3 == "smollm2":
                raise
            why = f"the SmolLM2 pair is not built ({type(e).__name__}: {str(e)[:200]}): the tiny target"
    else:
        why = "--eagle3 tiny"
    fitted = fit_eagle3_head(models["target"], list(zip(prompt_ids, want)), workdir / "eagle3-head")
    return {"pair": "tiny", "target": models["target"], "draft": models["draft"], "why": why, **fitted}


def run_eagle3(args, engines, setup: dict, prompts, want) -> dict:
    """EAGLE-3 as the token-level proposer at τ = 1.5: the target's tokens, and the same
    acceptance with CUDA graphs as with enforce_eager."""
    import parse_vllm

    parse = {"token_proposer": {"method": "eagle3", "model": str(setup["head"])}, "spec_tokens": EAGLE3_K}
    checks: dict[str, dict] = {}
    acceptance = {}
    modes = [("eager", True)] + ([("graphs", False)] if args.device == "cuda" else [])
    for mode, eager in modes:
        try:
            llm = engines.make(setup["target"], draft=setup["draft"], parse=parse, enforce_eager=eager)
        except Exception as e:
            checks[f"engine_eagle3_{mode}"] = _engine_failed(e)
            continue
        try:
            got = _ids(llm.generate(prompts, engines.params(args.max_tokens, parse_threshold=1.5)))
            acceptance[mode] = eagle3_acceptance(parse_vllm.get_stats(llm))
            checks[f"eagle3_lossless_{mode}"] = {**lossless(got, want), "eagle3": acceptance[mode]}
        except Exception as e:
            checks[f"engine_eagle3_{mode}"] = _engine_failed(e)
        finally:
            engines.close(llm)
    if args.device != "cuda":
        checks.update(skipped_checks(["eagle3_graphs_agree_with_eager"], "no CUDA graphs on the CPU"))
    elif "eager" in acceptance and "graphs" in acceptance:
        checks["eagle3_graphs_agree_with_eager"] = graphs_agree_with_eager(acceptance["eager"], acceptance["graphs"])
    else:
        checks["eagle3_graphs_agree_with_eager"] = {"ok": False, "why": "an engine failed: nothing to compare"}
    return checks


# --------------------------------------------------------------------------- the run


def tiny_models(workdir: Path, dtype: str) -> dict[str, Path]:
    sys.path.insert(0, str(ROOT / "tests"))
    from fixtures.families import make_tiny_family_model

    shape = dict(hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2, dtype=dtype)
    return {
        "target": make_tiny_family_model("qwen3", workdir / "target", num_layers=4, seed=0, **shape),
        "draft": make_tiny_family_model("qwen3", workdir / "draft", num_layers=2, seed=1, **shape),
    }


def chat_prompts(target: Path) -> list[str]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target))
    return [
        tok.apply_chat_template([{"role": "user", "content": c}], tokenize=False, add_generation_prompt=True)
        for c in CHAT
    ]


def run(args, engines, workdir: Path) -> dict:
    models = tiny_models(workdir, args.dtype)
    ref = engines.make(models["target"])
    try:
        outs = ref.generate(PROMPTS, engines.params(args.max_tokens))
    finally:
        engines.close(ref)
    want, prompt_ids = _ids(outs), [list(o.prompt_token_ids) for o in outs]
    checks, stats = run_verifiers(args, engines, models, PROMPTS, want)
    eagle3: dict = {"pair": None, "why": "--eagle3 off"}
    if args.eagle3 != "off":
        try:
            eagle3 = eagle3_setup(args, models, prompt_ids, want, workdir)
            prompts, ref_ids = PROMPTS, want
            if eagle3["pair"] == "smollm2":
                prompts = chat_prompts(eagle3["target"])
                ref = engines.make(eagle3["target"])
                try:
                    ref_ids = _ids(ref.generate(prompts, engines.params(args.max_tokens)))
                finally:
                    engines.close(ref)
            checks.update(run_eagle3(args, engines, eagle3, prompts, ref_ids))
        except Exception as e:
            checks["eagle3_setup"] = _engine_failed(e)
    return {
        "ok": overall(checks),
        "checks": checks,
        "skipped": {k: c["skipped"] for k, c in checks.items() if "skipped" in c},
        "device": args.device,
        "dtype": args.dtype,
        "attention_backend": args.attention_backend if args.device == "cuda" else None,
        "window": args.window,
        "draft_chunk": args.draft_chunk,
        "eagle3": {k: str(v) if isinstance(v, Path) else v for k, v in eagle3.items()},
        "stats_tau_0_5": stats,
    }


def main(argv: list[str] | None = None, engines=None) -> int:
    args = parse_args(argv)
    start = time.time()
    try:
        import torch
    except ImportError as e:
        return _emit({"ok": False, "skipped": f"no torch: {e}"}, 2)
    if args.device == "cuda" and not torch.cuda.is_available():
        return _emit({"ok": False, "skipped": "no CUDA device (this smoke test is for a GPU machine)"}, 2)
    # vLLM reads these when it is imported; its log goes to stderr, the result alone to stdout
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    if args.device == "cpu":
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    try:
        import vllm
    except ImportError as e:
        return _emit({"ok": False, "skipped": f"vLLM is not installed: {e}"}, 2)
    info = {
        "torch": torch.__version__,
        "vllm": getattr(vllm, "__version__", None),
        "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else None,
    }
    try:
        with tempfile.TemporaryDirectory() as tmp:
            result = run(args, engines or Engines(args), args.workdir or Path(tmp))
    except Exception as e:
        return _emit({"ok": False, **info, **_engine_failed(e), "seconds": round(time.time() - start, 1)}, 1)
    result.update(info, seconds=round(time.time() - start, 1))
    return _emit(result, 0 if result["ok"] else 1)


if __name__ == "__main__":
    sys.exit(main())
