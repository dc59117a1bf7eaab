"""The verification pass on the target inside vLLM (``scripts/bench_verify.py``).

For each draft length N one engine runs PARSE with W = N and a boundary every N/16 tokens;
one request (an MT-Bench question, ``ignore_eos``) gets one N-token draft, whose
verification step the probe (:mod:`parse_vllm.tools.benchmarks.probe`) studies in place, on the
engine's own KV cache, for K = 1/4/8/16 evenly spaced boundaries (the last one holistic):

  (a) floor       -- the step's target forward over the N draft tokens (+1): a plain
                     target prefill of the draft, the floor of any verification;
  (b) PARSE       -- (a) + ONE verification pass over all K copies;
  (c) sequential  -- (a) + K passes of one copy each, every pass reusing the cached prefix
                     (how SpecReason-style step-by-step semantic verification runs);
  (d) independent -- K separate requests prompt + draft[:b_k] + suffix through the same
                     engine with vLLM's prefix caching (prompt cached, draft not: the target
                     has not seen it), timed as the sum of the engine's forwards.

All times are medians of ``reps`` repetitions of the model's forward calls (no Python
scheduling overhead, same for all four).  Token bound of (b)/(a): (N + K*S)/N.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from parse_vllm.tools import engine
from parse_vllm.tools.benchmarks import common

SUFFIX_NOTE = "S = verification suffix tokens per copy"


def run_one_n(target: Path, draft: Path, n: int, ks: list[int], reps: int, prompt: str) -> dict[str, Any]:
    from parse_vllm._vllm import LLM, SamplingParams
    from parse_vllm.tools.prompts import chat_prompt_ids

    from . import probe

    k_max = max(ks)
    parse = {
        "threshold": 1.5,
        "boundaries": "tokens",
        "every": max(1, n // k_max),
        "max_boundaries": k_max,
        "on_reject": "continue",
    }
    llm = LLM(
        **common.parse_engine(
            target, draft, n, parse, max_model_len=n + 640, max_num_seqs=16, enable_prefix_caching=True
        )
    )
    try:
        prompt_ids = chat_prompt_ids(llm.get_tokenizer(), prompt)
        llm.collective_rpc(probe.install, kwargs={"verify_study": {"ks": ks, "reps": reps}})
        params = SamplingParams(temperature=0.0, max_tokens=n + 4, ignore_eos=True)
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt_ids}], params, use_tqdm=False)
        wall = time.perf_counter() - t0
        llm.collective_rpc(probe.stop_study)
        got = llm.collective_rpc(probe.read)[0]
        if not got["studies"]:
            raise RuntimeError(f"N={n}: no verification pass happened (draft empty?)")
        study = got["studies"][0]
        if len(study["tokens"]) - len(prompt_ids) < n:
            raise RuntimeError(f"N={n}: the draft had only {len(study['tokens']) - len(prompt_ids)} tokens")
        suffix = study["suffix_ids"]
        rows = []
        for k in ks:
            if k not in study["parallel_s"]:
                continue
            picks = study["picks"][k]
            lens = [study["prefix_len"][i] for i in picks]
            # (d): K independent requests, prefix cache holding the prompt only
            indep = []
            for _ in range(reps):
                llm.reset_prefix_cache()
                off = SamplingParams(temperature=0.0, max_tokens=1, extra_args={"parse": False})
                llm.generate([{"prompt_token_ids": prompt_ids}], off, use_tqdm=False)  # cache the prompt
                llm.collective_rpc(probe.reset)
                llm.generate([{"prompt_token_ids": study["tokens"][:m] + suffix} for m in lens], off, use_tqdm=False)
                indep.append(llm.collective_rpc(probe.read)[0]["forward_s"])
            floor = study["floor_s"]
            par, seq = study["parallel_s"][k], study["sequential_s"][k]
            S = len(suffix)
            rows.append(
                {
                    "N": n,
                    "K": k,
                    "S": S,
                    "floor_ms": floor * 1e3,
                    "parse_ms": (floor + par) * 1e3,
                    "sequential_ms": (floor + seq) * 1e3,
                    "independent_ms": statistics.median(indep) * 1e3,
                    "verify_only_parallel_ms": par * 1e3,
                    "verify_only_sequential_ms": seq * 1e3,
                    "parse_over_floor": (floor + par) / floor,
                    "token_bound": (n + k * S) / n,
                    "sequential_over_parse": (floor + seq) / (floor + par),
                    "independent_over_parse": statistics.median(indep) / (floor + par),
                    "sequential_over_parallel_verify_only": seq / par,
                }
            )
        row_bytes = llm.llm_engine.model_config.get_vocab_size() * 4  # one fp32 logits row
        mem = {
            "N": n,
            "verify_logit_rows_max": got["verify_max_logit_rows"],
            "verify_logits_bytes": got["verify_max_logit_rows"] * row_bytes,
            "all_rows_logits_bytes": (n + k_max * len(suffix)) * row_bytes,
            "copies_in_pass": study["copies"],
            "wall_s": wall,
        }
        return {"rows": rows, "memory": mem}
    finally:
        engine.close(llm)


def plot(rows: list[dict], path: Path) -> None:
    fig, axes = common.two_panels()
    for n in sorted({r["N"] for r in rows}):
        rs = [r for r in rows if r["N"] == n]
        ks = [r["K"] for r in rs]
        axes[0].plot(ks, [r["parse_over_floor"] for r in rs], "o-", label=f"N={n} measured")
        axes[0].plot(ks, [r["token_bound"] for r in rs], "--", alpha=0.6, label=f"N={n} (N+KS)/N")
        axes[1].plot(ks, [r["sequential_over_parse"] for r in rs], "o-", label=f"N={n} sequential/PARSE")
        axes[1].plot(ks, [r["independent_over_parse"] for r in rs], "s:", label=f"N={n} independent/PARSE")
    axes[1].plot([1, 16], [0.5, 8], "k--", alpha=0.4, label="K/2 goal")
    axes[0].set(xlabel="K boundaries", ylabel="PARSE / floor", title="(b)/(a) vs token bound")
    axes[1].set(xlabel="K boundaries", ylabel="time / PARSE time", title="(c)/(b) and (d)/(b)")
    for ax in axes:
        ax.set_xscale("log", base=2)
    common.save_panels(fig, axes, path)


COLS = [
    ("N", "N", ""),
    ("K", "K", ""),
    ("S", "S", ""),
    ("floor_ms", "(a) floor ms", ".1f"),
    ("parse_ms", "(b) PARSE ms", ".1f"),
    ("sequential_ms", "(c) sequential ms", ".1f"),
    ("independent_ms", "(d) independent ms", ".1f"),
    ("parse_over_floor", "(b)/(a)", ".3f"),
    ("token_bound", "(N+KS)/N", ".3f"),
    ("sequential_over_parse", "(c)/(b)", ".2f"),
    ("independent_over_parse", "(d)/(b)", ".2f"),
    ("sequential_over_parallel_verify_only", "seq/par verify-only", ".2f"),
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="bench_verify", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="N = 64, 256 and 2 reps (make bench)")
    ap.add_argument("--ns", type=int, nargs="+", default=None)
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--results", type=Path, default=Path("bench/results"))
    ap.add_argument("--target", type=Path, default=None)
    ap.add_argument("--draft", type=Path, default=None)
    args = ap.parse_args(argv)
    common.setup_env()
    ns = args.ns or ([64, 256] if args.quick else [64, 256, 1024])
    reps = args.reps or (2 if args.quick else 5)
    target, draft = common.resolve_models(args.target, args.draft)
    from parse_vllm.tools.prompts import mtbench_questions

    prompt = mtbench_questions()[0]["prompt"]
    rows, mem = [], []
    for n in ns:
        print(f"[bench_verify] N={n} ...", flush=True)
        out = run_one_n(target, draft, n, args.ks, reps, prompt)
        rows += out["rows"]
        mem.append(out["memory"])
    print(common.table(rows, COLS))
    print(f"({SUFFIX_NOTE}; times are medians of {reps}; memory: {mem})")
    data = {
        "mode": "quick" if args.quick else "full",
        "machine": common.machine(),
        "target": str(target),
        "draft": str(draft),
        "reps": reps,
        "rows": rows,
        "memory": mem,
    }
    common.write_json(args.results / "verify.json", data)
    plot(rows, args.results / "verify.png")
    pick = next((r for r in rows if r["N"] == 256 and r["K"] == 8), None)
    common.update_summary(
        args.results,
        {
            "verify_over_floor_N256_K8": pick and pick["parse_over_floor"],
            "verify_token_bound_N256_K8": pick and pick["token_bound"],
            "sequential_over_parallel_N256_K8": pick and pick["sequential_over_parse"],
        },
    )
    (args.results / "verify.md").write_text(common.table(rows, COLS) + "\n")
    return 0
