"""Offline PARSE generation over a JSONL file of prompts with Ray Data.

Each Ray actor builds one vLLM engine with PARSE (`LLM(...)`, once) and
generates the batches Ray Data hands it; run one actor per node or per GPU.

  python scripts/ray_batch.py --input prompts.jsonl --output results.jsonl \\
      --model TARGET --draft DRAFT --window 64 --parse '{"threshold": 0.5}' \\
      --actors 2 --batch-size 32
  python scripts/ray_batch.py --input prompts.jsonl --output results.jsonl \\
      --preset configs/smollm2-135m-demo.yaml

Input, one JSON object a line: `prompt` (text, completion-style) or
`messages` (a chat), optionally `id`, `max_tokens`, `temperature`, `seed`,
and the per-request PARSE options `parse` / `parse_threshold`.

Output, one line per input line, in input order: `id`, `text`, `token_ids`,
`finish_reason`, `num_tokens`, `batch` (the batch it was generated in) and
`actor`. PARSE counts per engine, not per request: each batch's counters
(parse_vllm.get_stats after minus before the batch) go into
OUTPUT.stats.json, beside the totals over all batches.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import uuid
from collections import Counter
from pathlib import Path

REQUEST_KEYS = {"id", "prompt", "messages", "max_tokens", "temperature", "seed", "parse", "parse_threshold"}


def _plain(value):
    """A batch cell as plain Python: Ray Data batches are columnar, so a field some rows
    leave out arrives as NaN (float columns) and numbers as numpy scalars."""
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        try:
            value = value.item()
        except (ValueError, AttributeError):
            return value
    if isinstance(value, float) and math.isnan(value):
        return None
    return value


class ParseGenerator:
    """A Ray Data callable class: one PARSE engine per actor."""

    def __init__(self, engine_kwargs: dict, defaults: dict):
        from vllm import LLM

        self.llm = LLM(**engine_kwargs)
        self.defaults = defaults
        self.actor = uuid.uuid4().hex[:8]

    def _params(self, row: dict):
        from vllm import SamplingParams

        extra = {k: row[k] for k in ("parse", "parse_threshold") if row.get(k) is not None}
        return SamplingParams(
            max_tokens=int(row.get("max_tokens") or self.defaults["max_tokens"]),
            temperature=float(row["temperature"])
            if row.get("temperature") is not None
            else self.defaults["temperature"],
            seed=None if row.get("seed") is None else int(row["seed"]),
            extra_args=extra or None,
        )

    def __call__(self, batch: dict) -> dict:
        import parse_vllm

        rows = [{k: _plain(v) for k, v in zip(batch, values)} for values in zip(*batch.values())]
        before = parse_vllm.get_stats(self.llm)
        outputs: list = [None] * len(rows)
        chats = [i for i, r in enumerate(rows) if r.get("messages") is not None]
        texts = [i for i, r in enumerate(rows) if r.get("messages") is None]
        if texts:
            outs = self.llm.generate(
                [rows[i]["prompt"] for i in texts], [self._params(rows[i]) for i in texts], use_tqdm=False
            )
            for i, out in zip(texts, outs):
                outputs[i] = out.outputs[0]
        if chats:
            outs = self.llm.chat(
                [json.loads(rows[i]["messages"]) for i in chats], [self._params(rows[i]) for i in chats], use_tqdm=False
            )
            for i, out in zip(chats, outs):
                outputs[i] = out.outputs[0]
        batch_id = uuid.uuid4().hex[:12]
        stats = stats_delta(parse_vllm.get_stats(self.llm), before)
        return {
            "id": [r["id"] for r in rows],
            "text": [o.text for o in outputs],
            "token_ids": [json.dumps(list(o.token_ids)) for o in outputs],
            "finish_reason": [o.finish_reason for o in outputs],
            "num_tokens": [len(o.token_ids) for o in outputs],
            "batch": [batch_id] * len(rows),
            "actor": [self.actor] * len(rows),
            # The same batch counters on every row of the batch (kept once
            # per batch by the driver): a Ray Data column of JSON text.
            "batch_parse_stats": [json.dumps(stats)] * len(rows),
        }


def stats_delta(after: dict, before: dict) -> dict:
    out = {k: v - before.get(k, 0) for k, v in after.items() if isinstance(v, (int, float))}
    by = Counter({str(k): v for k, v in after.get("rejections_by_boundary", {}).items()})
    by.subtract({str(k): v for k, v in before.get("rejections_by_boundary", {}).items()})
    out["rejections_by_boundary"] = {k: v for k, v in by.items() if v}
    return out


def add_stats(total: dict, stats: dict) -> None:
    for k, v in stats.items():
        if k == "rejections_by_boundary":
            by = total.setdefault(k, {})
            for b, n in v.items():
                by[b] = by.get(b, 0) + n
        else:
            total[k] = total.get(k, 0) + v


def read_requests(path: Path) -> list[dict]:
    """The input lines, checked (errors name the line and the field)."""
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise SystemExit(f"{path}:{n}: not JSON: {e}") from None
            if not isinstance(row, dict):
                raise SystemExit(f"{path}:{n}: expected a JSON object")
            unknown = sorted(set(row) - REQUEST_KEYS)
            if unknown:
                raise SystemExit(f"{path}:{n}: unknown keys {unknown} (known: {sorted(REQUEST_KEYS)})")
            if ("prompt" in row) == ("messages" in row):
                raise SystemExit(f"{path}:{n}: give exactly one of 'prompt' (text) or 'messages' (a chat)")
            if "prompt" in row and not isinstance(row["prompt"], str):
                raise SystemExit(f"{path}:{n}: prompt must be a string")
            if "messages" in row and not (
                isinstance(row["messages"], list)
                and all(isinstance(m, dict) and "role" in m and "content" in m for m in row["messages"])
            ):
                raise SystemExit(f"{path}:{n}: messages must be a list of {{role, content}} objects")
            if "max_tokens" in row and not (isinstance(row["max_tokens"], int) and row["max_tokens"] >= 1):
                raise SystemExit(f"{path}:{n}: max_tokens must be an integer >= 1")
            # Per-request PARSE options are checked as the server checks them.
            from parse_vllm.config import ParseConfig, ParseConfigError, request_options

            try:
                request_options({k: row[k] for k in ("parse", "parse_threshold") if k in row}, ParseConfig())
            except ParseConfigError as e:
                raise SystemExit(f"{path}:{n}: {e}") from None
            # One column type for Ray Data: every row has every key.
            rows.append(
                {
                    "id": str(row.get("id", n)),
                    "prompt": row.get("prompt"),
                    # JSON text: one Arrow column type whatever the chats hold.
                    "messages": None if row.get("messages") is None else json.dumps(row["messages"]),
                    "max_tokens": row.get("max_tokens"),
                    "temperature": row.get("temperature"),
                    "seed": row.get("seed"),
                    "parse": row.get("parse"),
                    "parse_threshold": row.get("parse_threshold"),
                }
            )
    if not rows:
        raise SystemExit(f"{path}: no requests")
    return rows


def engine_kwargs_from(args) -> dict:
    """LLM(...) arguments from a preset (`engine`, `model`,
    `speculative_config`, `parse`) and the command line (which wins)."""
    kw: dict = {}
    spec: dict = {}
    parse: dict = {}
    if args.preset:
        from parse_vllm.presets import load_preset

        preset = load_preset(args.preset)
        kw.update(preset.engine)
        if preset.model:
            kw["model"] = preset.model
        spec = dict(preset.speculative_config or {})
        parse = dict(preset.parse)
    if args.engine:
        kw.update(json.loads(args.engine))
    if args.model:
        kw["model"] = args.model
    if args.draft:
        spec.update(method="draft_model", model=args.draft)
    if args.window:
        spec["num_speculative_tokens"] = args.window
    if args.parse:
        parse.update(json.loads(args.parse))
    if "model" not in kw:
        raise SystemExit("no model: pass --model or a --preset that names one")
    if not spec.get("model"):
        raise SystemExit("no draft: pass --draft or a --preset with a speculative_config")
    if not spec.get("num_speculative_tokens"):
        raise SystemExit("no draft window: pass --window (W) or a --preset with num_speculative_tokens")
    from parse_vllm.config import ParseConfig

    ParseConfig.from_dict(parse)  # a bad option fails here, naming it, not in an actor
    kw["speculative_config"] = spec
    kw["additional_config"] = {"parse": parse}
    return kw


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--input", type=Path, required=True, help="JSONL of requests")
    ap.add_argument("--output", type=Path, required=True, help="JSONL of results (+ OUTPUT.stats.json)")
    ap.add_argument("--preset", help="a PARSE preset YAML (configs/); flags below override it")
    ap.add_argument("--model", help="target model")
    ap.add_argument("--draft", help="draft model")
    ap.add_argument("--window", type=int, help="draft window W (num_speculative_tokens)")
    ap.add_argument("--parse", help="PARSE options as JSON, e.g. '{\"threshold\": 0.5}'")
    ap.add_argument("--engine", help='more LLM(...) arguments as JSON, e.g. \'{"dtype": "float32"}\'')
    ap.add_argument("--max-tokens", type=int, default=256, help="for requests that give none")
    ap.add_argument("--temperature", type=float, default=0.0, help="for requests that give none")
    ap.add_argument("--actors", type=int, default=1, help="engines (Ray actors): one per node or GPU")
    ap.add_argument("--batch-size", type=int, default=32, help="requests per batch handed to an engine")
    ap.add_argument("--cpus-per-actor", type=float, default=1)
    ap.add_argument("--gpus-per-actor", type=float, default=0)
    ap.add_argument("--ray-address", default=None, help="Ray cluster to join (default: a local one)")
    ap.add_argument("--num-cpus", type=int, default=None, help="CPUs of a local Ray (default: all)")
    args = ap.parse_args(argv)
    for name in ("actors", "batch_size", "max_tokens"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("parse", "engine"):
        if getattr(args, name):
            try:
                value = json.loads(getattr(args, name))
            except json.JSONDecodeError as e:
                ap.error(f"--{name} is not JSON: {e}")
            if not isinstance(value, dict):
                ap.error(f"--{name} must be a JSON object")

    engine_kwargs = engine_kwargs_from(args)
    requests = read_requests(args.input)

    import ray

    ray.init(
        address=args.ray_address,
        num_cpus=args.num_cpus,
        include_dashboard=False,
        log_to_driver=os.environ.get("PARSE_RAY_QUIET") != "1",
    )
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True  # results in input order
    ds = ray.data.from_items(requests).map_batches(
        ParseGenerator,
        fn_constructor_kwargs={
            "engine_kwargs": engine_kwargs,
            "defaults": {"max_tokens": args.max_tokens, "temperature": args.temperature},
        },
        batch_size=args.batch_size,
        batch_format="numpy",
        concurrency=args.actors,
        num_cpus=args.cpus_per_actor,
        num_gpus=args.gpus_per_actor,
    )

    args.output.parent.mkdir(parents=True, exist_ok=True)
    per_batch: dict[str, dict] = {}
    n = 0
    with open(args.output, "w") as f:
        for row in ds.iter_rows():
            stats = json.loads(row.pop("batch_parse_stats"))
            per_batch.setdefault(row["batch"], {"actor": row["actor"], **stats})
            row["token_ids"] = json.loads(row["token_ids"])
            f.write(json.dumps({k: (v.item() if hasattr(v, "item") else v) for k, v in row.items()}) + "\n")
            n += 1
    total: dict = {}
    for stats in per_batch.values():
        add_stats(total, {k: v for k, v in stats.items() if k != "actor"})
    summary = {
        "requests": n,
        "batches": len(per_batch),
        "actors": len({s["actor"] for s in per_batch.values()}),
        "parse_stats": total,
        "per_batch": per_batch,
    }
    Path(str(args.output) + ".stats.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps({k: summary[k] for k in ("requests", "batches", "actors", "parse_stats")}))
    ray.shutdown()
    return 0 if n == len(requests) else 1


if __name__ == "__main__":
    sys.exit(main())
