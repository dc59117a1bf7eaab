#!/usr/bin/env python
"""The judge head end to end: a `parse-vllm eval` run on HumanEval's odd ids with the head
(`make bench-adaptive` writes bench/judge-coder/e2e-odd/) -> the issue's keys in
bench/judge-coder/summary.json (odd_pass_at_1_target, odd_pass_at_1_head,
odd_semantic_share_head, odd_speed_head_over_accept_all_bs1, tau_head) and the rows in
`e2e_odd`.

    python scripts/judge_e2e.py bench/judge-coder/e2e-odd --tau 0.7 --summary bench/judge-coder/summary.json

The head's configuration is PARSE `continue` with k 4 after a rejection (eval config
"parse W=… k4") at --tau; accept-all is the same configuration at τ 0.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path


def figures(summary: dict, tau: float) -> dict:
    rows = summary["rows"]

    def one(config_re: str, batch: int, t=None) -> dict:
        got = [r for r in rows if re.fullmatch(config_re, r["config"]) and r["batch"] == batch and r.get("tau") == t]
        if len(got) != 1:
            raise SystemExit(f"judge_e2e: expected one row {config_re!r} bs {batch} τ {t}, found {len(got)}")
        return got[0]

    head8, head1 = one(r"parse W=\d+ k4", 8, tau), one(r"parse W=\d+ k4", 1, tau)
    all1 = one(r"parse W=\d+ k4", 1, 0.0)
    target8 = one("target", 8)
    return {
        "tau_head": tau,
        "odd_pass_at_1_target": target8["pass_at_1"],
        "odd_pass_at_1_head": head8["pass_at_1"],
        "odd_e2e_n": head8["n"],
        "odd_semantic_share_head": head8["acceptance"]["tokens_accepted_semantic"] / head8["tokens"],
        "odd_semantic_share_head_bs1": head1["acceptance"]["tokens_accepted_semantic"] / head1["tokens"],
        "odd_speed_head_over_accept_all_bs1": head1["tok_s"] / all1["tok_s"],
        "e2e_odd": [
            {k: r.get(k) for k in ("config", "tau", "batch", "n", "tok_s", "pass_at_1", "tokens")}
            | {"semantic_tokens": (r.get("acceptance") or {}).get("tokens_accepted_semantic")}
            for r in rows
        ],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path, help="the eval run's folder (summary.json)")
    ap.add_argument("--tau", type=float, required=True, help="the head's τ, chosen on the even ids")
    ap.add_argument("--summary", type=Path, default=Path("bench/judge-coder/summary.json"))
    args = ap.parse_args(argv)
    if not (args.run / "summary.json").is_file() or not args.summary.is_file():
        print(f"judge_e2e: {args.run / 'summary.json'} or {args.summary} is missing", file=sys.stderr)
        return 2
    summary = json.loads(args.summary.read_text())
    summary.update(figures(json.loads((args.run / "summary.json").read_text()), args.tau))
    args.summary.write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k.startswith(("odd_", "tau_head"))}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
