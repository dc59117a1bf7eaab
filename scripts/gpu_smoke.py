#!/usr/bin/env python
"""First contact with a GPU: PARSE end to end through `LLM(...)` on tiny models.

For a machine with a CUDA GPU, vLLM (>= 0.32, the CUDA build) and this package
installed (`pip install --no-build-isolation -e '.[gpu]'`). Nothing is
downloaded: a 4-layer target and a 2-layer draft with random weights are
written on the spot around a real tokenizer shipped in the repository
(tests/fixtures/tokenizers/qwen3, Qwen3's architecture and chat template).

It checks, and prints one JSON line (`"ok": true` when every check passed;
exit status 0, else 1; 2 when it cannot run here):
  lossless   guard 1 (greedy, τ = 0.5) gives exactly the target alone's tokens
  accept     τ = 0 takes drafts (tokens accepted semantically > 0)
  judged     τ = 0.5 judges drafts (copies > 0), prefix caching on
  kernel     the kernel verifier's judgments equal the forked verifier's
             (same prefixes, |ΔP(yes)| <= 1e-3)
  kv         no KV block is held once every request is done

    python scripts/gpu_smoke.py                 # float32, TRITON_ATTN, W 16
    python scripts/gpu_smoke.py --dtype bfloat16 --attention-backend FLASH_ATTN
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [
    "Write a haiku about the sea.",
    "What is 17 times 23? Explain step by step.",
    "List three uses of a paperclip.",
    "Tell me a story about a dragon who learns to fly over the mountains at night.",
]
P_YES_TOLERANCE = 1e-3


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
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens per request")
    ap.add_argument("--workdir", type=Path, default=None, help="where the tiny models go (default: a temp dir)")
    args = ap.parse_args(argv)
    if args.window < 1 or args.max_tokens < 1:
        ap.error("--window and --max-tokens must be >= 1")
    return args


def _emit(result: dict, code: int) -> int:
    print(json.dumps(result, sort_keys=True))
    return code


def _tiny_models(workdir: Path, dtype: str) -> dict[str, Path]:
    sys.path.insert(0, str(ROOT / "tests"))
    from fixtures.families import make_tiny_family_model

    shape = dict(hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2, dtype=dtype)
    return {
        "target": make_tiny_family_model("qwen3", workdir / "target", num_layers=4, seed=0, **shape),
        "draft": make_tiny_family_model("qwen3", workdir / "draft", num_layers=2, seed=1, **shape),
    }


def _engine(models: dict[str, Path], args, parse: dict | None):
    """The target alone (parse None), or with PARSE and these options."""
    from vllm import LLM

    kw = dict(
        model=str(models["target"]),
        dtype=args.dtype,
        max_model_len=2048,
        gpu_memory_utilization=0.3,
        enable_prefix_caching=True,
        seed=0,
        attention_backend=args.attention_backend,
    )
    if parse is not None:
        kw["speculative_config"] = {
            "method": "draft_model",
            "model": str(models["draft"]),
            "num_speculative_tokens": args.window,
        }
        kw["additional_config"] = {"parse": {"record_judgments": 4096, **parse}}
    return LLM(**kw)


def _close(llm) -> None:
    import gc

    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def run(args) -> dict:
    import torch
    from vllm import SamplingParams

    import parse_vllm

    checks: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        models = _tiny_models(args.workdir or Path(tmp), args.dtype)

        def params(**extra):
            return SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True, extra_args=extra)

        ref = _engine(models, args, None)
        want = [list(o.outputs[0].token_ids) for o in ref.generate(PROMPTS, params())]
        _close(ref)

        stats: dict[str, dict] = {}
        judgments: dict[str, list[dict]] = {}
        for verifier in ("kernel", "forked"):
            llm = _engine(models, args, {"verifier": verifier})
            try:
                got = [
                    list(o.outputs[0].token_ids)
                    for o in llm.generate(PROMPTS, params(parse_threshold=0.5, parse_guard=1))
                ]
                first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
                checks[f"lossless_{verifier}"] = {"ok": first is None, "first_mismatch_prompt": first}
                parse_vllm.reset_stats(llm)
                llm.generate(PROMPTS, params(parse_threshold=0.0))
                st = parse_vllm.get_stats(llm)
                checks[f"accept_{verifier}"] = {
                    "ok": st["tokens_accepted_semantic"] > 0,
                    "tokens_accepted_semantic": st["tokens_accepted_semantic"],
                }
                parse_vllm.reset_stats(llm)
                llm.generate(PROMPTS, params(parse_threshold=0.5))
                stats[verifier] = parse_vllm.get_stats(llm)
                judgments[verifier] = parse_vllm.get_judgments(llm)
                checks[f"judged_{verifier}"] = {
                    "ok": stats[verifier]["copies"] > 0,
                    "copies": stats[verifier]["copies"],
                }
                kv = llm.collective_rpc("parse_kv_blocks")[0]
                checks[f"kv_{verifier}"] = {
                    "ok": kv["request_blocks_held"] == 0 and kv["runner_requests"] == 0,
                    "request_blocks_held": kv["request_blocks_held"],
                }
            finally:
                _close(llm)

        forked = {tuple(j["token_ids"]): j["p_yes"] for j in judgments["forked"]}
        pairs = [
            (j["p_yes"], forked[tuple(j["token_ids"])]) for j in judgments["kernel"] if tuple(j["token_ids"]) in forked
        ]
        worst = max((abs(a - b) for a, b in pairs), default=None)
        checks["kernel_equals_forked"] = {
            "ok": bool(pairs) and worst <= P_YES_TOLERANCE,
            "compared": len(pairs),
            "max_abs_p_yes_diff": worst,
        }
        return {
            "ok": all(c["ok"] for c in checks.values()),
            "checks": checks,
            "device": torch.cuda.get_device_name(0),
            "torch": torch.__version__,
            "vllm": __import__("vllm").__version__,
            "dtype": args.dtype,
            "attention_backend": args.attention_backend,
            "window": args.window,
            "stats_tau_0_5": stats,
        }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.time()
    try:
        import torch
    except ImportError as e:
        return _emit({"ok": False, "skipped": f"no torch: {e}"}, 2)
    if not torch.cuda.is_available():
        return _emit({"ok": False, "skipped": "no CUDA device (this smoke test is for a GPU machine)"}, 2)
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        return _emit({"ok": False, "skipped": f"vLLM is not installed: {e}"}, 2)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    result = run(args)
    result["seconds"] = round(time.time() - start, 1)
    return _emit(result, 0 if result["ok"] else 1)


if __name__ == "__main__":
    sys.exit(main())
