"""`parse-vllm train-judge`: build the data of one prompt set (data.py), then train a judge
head on it (probe.py) or evaluate a given head on it (``--evaluate``), and write the report
(report.py).

HumanEval's rule: tune everything on the even task ids (``--split even``: cross-validated
numbers, the head), then run the odd ids once with the chosen head (``--split odd
--evaluate HEAD``). ``--data-only`` builds a set's data and stops (both splits' data can be
built first, in one background run).

Several prompt sets (``--prompts humaneval PATH/mbpp.jsonl``, or the flag repeated; a set may
name its split: ``humaneval:even``, ``mbpp.jsonl:test``, prompts.py): each gets its own data
folder (OUT/data/<set>); training fits one head on all of them (figures per set and together,
split ``train``), ``--evaluate`` scores each one. MBPP trains on train + validation + prompt
and is held out on test (its official split, prompts.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from . import baselines, data

DEFAULT_SAMPLES = 2
DEFAULT_TEMPERATURE = 0.8
DEFAULT_PREFIXES_PASSING = 1
DEFAULT_PREFIXES_FAILING = 2
DEFAULT_MAX_TOKENS = 384  # the Coder eval's answer cap
DEFAULT_WINDOW = 128  # the Coder preset's W
DEFAULT_BATCH = 32
DEFAULT_KV_GIB = 2.0
DEFAULT_BALANCE_TEMPERATURE = 1.1
DEFAULT_BALANCE_BELOW = 0.25
HEAD_FILE = "judge_head.safetensors"
SHIPPED = Path(__file__).resolve().parents[2] / "judges"  # parse_vllm/judges/<target name>/


class JudgeError(Exception):
    """A bad argument or input: printed as one line, exit status 2."""


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="parse-vllm train-judge",
        description="Train a judge head (a logistic read-out of the target's hidden state at the verification "
        "suffix) on a checkable prompt set, or evaluate one: data in resumable stages, grouped cross-validation, "
        "a report.",
    )
    m = ap.add_argument_group("models (default: the Qwen2.5-Coder pair of `make pair`)")
    m.add_argument("--config", metavar="PRESET.yaml", help="a preset: target, draft, W and the parse options")
    m.add_argument("--target", help="target model folder; overrides the preset's")
    m.add_argument("--draft", help="draft model folder; overrides the preset's")
    m.add_argument("--window", type=int, help=f"W: the runtime judges windows of W tokens (default {DEFAULT_WINDOW})")
    m.add_argument("--parse", metavar="JSON", help="PARSE options over the preset's (boundaries, question, labels)")
    m.add_argument("--engine", metavar="JSON", help="more vllm.LLM arguments for every engine")
    p = ap.add_argument_group("prompts and data")
    p.add_argument("--prompts", nargs="+", action="extend", metavar="SET[:SPLIT]", help="humaneval (default), a "
                   "JSONL file with test/reference, or MBPP's mbpp.jsonl (split train+validation+prompt when "
                   "training, test with --evaluate; or name it: mbpp.jsonl:test); several sets, or the flag "
                   "repeated: one head on all of them (or each evaluated)")  # fmt: skip
    p.add_argument("--split", choices=("even", "odd", "all"), default="even", help="humaneval task ids (default even)")
    p.add_argument("--num-prompts", type=int, help="the first N prompts of each set (default all)")
    p.add_argument("--samples", type=int, default=DEFAULT_SAMPLES, help="sampled draft answers per prompt, beside "
                   f"the greedy one (default {DEFAULT_SAMPLES})")  # fmt: skip
    p.add_argument("--temperature", type=float, default=DEFAULT_TEMPERATURE, help="of the sampled answers")
    p.add_argument("--prefixes-passing", type=int, default=DEFAULT_PREFIXES_PASSING, help="prefixes labelled per "
                   f"answer that passes its tests, drawn from its runtime boundaries (default {DEFAULT_PREFIXES_PASSING})")  # fmt: skip
    p.add_argument("--prefixes-failing", type=int, default=DEFAULT_PREFIXES_FAILING, help="... per answer that "
                   f"fails them (default {DEFAULT_PREFIXES_FAILING})")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, help="answer cap (default 384)")
    p.add_argument("--batch", type=int, default=DEFAULT_BATCH, help="requests in flight per engine (default 32)")
    p.add_argument("--kv-cache-gib", type=float, default=DEFAULT_KV_GIB, help="KV cache of each engine (default 2)")
    p.add_argument("--code-timeout", type=float, default=10.0, help="seconds an answer's tests may run")
    p.add_argument("--balance-samples", type=int, default=0, help="more sampled answers on each task where the "
                   "draft rarely fails and the target passes (more failing prefixes; default 0: off)")  # fmt: skip
    p.add_argument("--balance-temperature", type=float, default=DEFAULT_BALANCE_TEMPERATURE,
                   help=f"of the balancing answers (default {DEFAULT_BALANCE_TEMPERATURE})")  # fmt: skip
    p.add_argument("--balance-below", type=float, default=DEFAULT_BALANCE_BELOW, help="a task is balanced when "
                   f"the share of its failing distinct answers is <= this (default {DEFAULT_BALANCE_BELOW})")  # fmt: skip
    p.add_argument("--evidence", action="store_true", help="build the evidence stage too (the target's "
                   "log-probabilities of the answers' tokens: parse_vllm/evidence.py); implied by --features "
                   "select or a list naming an evidence feature")  # fmt: skip
    p.add_argument("--baselines", action="store_true", help="build the baselines stage too: the KL judge's "
                   "draft-target divergences and the hidden state at the prefix itself, without the verification "
                   "suffix (tools/judge/baselines.py)")  # fmt: skip
    p.add_argument("--judges-on-tables", action="store_true", help="score the compared judges (KL, suffix-free) "
                   "on the examples OUT's score tables name: the draft's answers rebuilt and checked against the "
                   "tables, then the baselines stage alone, in OUT/data-tables/<set>; the training sets fit the "
                   "judges, held-out sets are scored with them (tools/judge/tables.py)")  # fmt: skip
    o = ap.add_argument_group("run and output")
    o.add_argument("--out", type=Path, default=Path("bench/results/judge"), help="report folder (and the head)")
    o.add_argument("--data", type=Path, help="data folder (default OUT/data/<prompt set>)")
    o.add_argument("--max-minutes", type=float, help="stop after the batch that passes this bound (resumable)")
    o.add_argument("--data-only", action="store_true", help="build the data and stop")
    o.add_argument("--evaluate", metavar="HEAD", type=Path, help="evaluate this head on the set (no training)")
    o.add_argument(
        "--features",
        default="auto",
        help="auto (default): zero_shot_logit only if it raises the cross-validated AUC; select: forward "
        "selection over zero_shot_logit and the evidence features (each kept only if nested CV shows it helps; "
        "needs the evidence stage); or a list: hidden,zero_shot_logit,draft_logprob_mean,...",
    )
    o.add_argument("--tau-max-wrong", type=float, default=None, help="τ_head: the smallest τ whose out-of-fold "
                   "rate of accepting failing whole answers is <= this (default 0.10)")  # fmt: skip
    o.add_argument("--old-head", metavar="HEAD", type=Path, help="with --evaluate: score this (older) head too, "
                   "for the report's comparison")  # fmt: skip
    o.add_argument("--report-only", action="store_true", help="no models: recompute OUT's summary (every score "
                   "figure, from OUT/scores/*.csv), summary.md and plots")  # fmt: skip
    o.add_argument("--retau", action="store_true", help="with --report-only: write the τ_head the rule gives on "
                   f"the training scores into OUT/{HEAD_FILE} (with --ship, the shipped copy too)")  # fmt: skip
    o.add_argument("--ship", action="store_true", help=f"copy the head to {SHIPPED}/<target name>/{HEAD_FILE}")
    return ap


def split_name(set_name: str) -> str:
    """The name a set's figures are keyed by: even / odd / all for HumanEval, else the set's
    (mbpp-test -> mbpp_test; mbpp-train+validation+prompt -> mbpp_train_validation_prompt)."""
    if set_name.startswith("humaneval-"):
        return set_name.split("-", 1)[1]
    return "".join(c if c.isalnum() else "_" for c in set_name)


def resolve_models(args) -> dict[str, Any]:
    from parse_vllm.cache import default_cache_dir
    from parse_vllm.tools.eval import run as eval_run
    from parse_vllm.tools.prepare_models import CODER_DRAFT_NAME, CODER_TARGET_NAME

    ns = argparse.Namespace(
        config=args.config, parse=args.parse, engine=args.engine, target=args.target, draft=args.draft,
        window=args.window,
    )  # fmt: skip
    try:
        res = eval_run.resolve(ns)
    except eval_run.EvalError as e:
        raise JudgeError(str(e)) from None
    if not args.config and not args.window:
        res["window"] = DEFAULT_WINDOW
    models = default_cache_dir() / "models"
    res["target"] = res["target"] or str(models / CODER_TARGET_NAME)
    res["draft"] = res["draft"] or str(models / CODER_DRAFT_NAME)
    for role in ("target", "draft"):
        if not (Path(res[role]) / "config.json").is_file():
            raise JudgeError(f"--{role} {res[role]}: not a model folder (the default pair: `make pair`)")
    return res


def engines(res: dict, args, max_model_len: int) -> tuple[dict, dict]:
    """LLM arguments of the draft's engine and the target's. Seeded sampling with prompts
    prefilled in chunks kills vLLM 0.32's CPU engine (README "Limits"), so no chunked prefill:
    a step holds whole prompts (max_num_batched_tokens >= max_model_len)."""
    from parse_vllm.tools.benchmarks import common

    mode = common.setup_env()
    base: dict[str, Any] = {"dtype": mode["dtype"], "enforce_eager": True, "block_size": 32, "seed": 0}
    base.update(res["engine"])
    mlen = int(base.get("max_model_len") or max_model_len)
    base.update(
        max_model_len=mlen,
        max_num_seqs=args.batch,
        kv_cache_memory_bytes=int(args.kv_cache_gib * (1 << 30)),
        enable_prefix_caching=True,
        enable_chunked_prefill=False,
        max_num_batched_tokens=max(4096, mlen),
    )
    base.update(eval_json(args.engine, "--engine"))
    return dict(base, model=res["draft"]), dict(base, model=res["target"])


def eval_json(value: str | None, flag: str) -> dict:
    """A JSON-object flag, as `parse-vllm eval` reads its own."""
    from parse_vllm.tools.eval import run as eval_run

    try:
        return eval_run._json_arg(value or None, flag)
    except eval_run.EvalError as e:
        raise JudgeError(str(e)) from None


def identity(target: Path, tokenizer, template, parse) -> Any:
    from parse_vllm.judge_head import HeadIdentity, lm_head_fingerprint

    cfg = json.loads((target / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    label_ids = (template.labels.yes_ids, template.labels.no_ids)
    rows = data.lm_head_rows(target, [ids[0] for ids in label_ids])  # [2, H]: each label's first token
    fp = lm_head_fingerprint(rows, [(0,), (1,)])
    return HeadIdentity(
        target=target.name,
        architecture=(cfg.get("architectures") or ["?"])[0],
        hidden_size=int(text["hidden_size"]),
        num_layers=int(text["num_hidden_layers"]),
        vocab_size=int(text["vocab_size"]),
        suffix_ids=tuple(int(x) for x in template.suffix_ids),
        question=parse.question,
        labels=tuple(parse.labels),
        label_ids=label_ids,
        boundaries={"mode": parse.boundaries, "every": parse.every, "max_boundaries": parse.max_boundaries},
        lm_head_fingerprint=fp,
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _main(args)
    except JudgeError as e:
        print(f"parse-vllm train-judge: error: {e}", file=sys.stderr)
        return 2
    except data.DataError as e:
        print(f"parse-vllm train-judge: error: {e}", file=sys.stderr)
        return 2


def log(msg: str) -> None:
    print(f"[train-judge {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def report_only(out: Path, *, retau: bool = False, ship: bool = False) -> int:
    """The report regenerated from the folder's summary and score tables (scores.py)."""
    from . import report, scores

    path = out / "summary.json"
    if not path.is_file():
        raise JudgeError(f"{path}: no report here to regenerate")
    summary = json.loads(path.read_text())
    if summary.get("train_split") not in summary.get("score_files", {}):
        raise JudgeError(
            f"{path}: this report names no score table of its training split (it predates them): train again"
        )
    try:
        summary = scores.rescore(out, summary)
    except scores.ScoresError as e:
        raise JudgeError(str(e)) from None
    paths = report.write(out, summary)
    log("wrote " + ", ".join(str(p) for p in paths))
    if retau:
        retau_head(out, summary, ship=ship)
    return 0


def retau_head(out: Path, summary: dict, *, ship: bool) -> None:
    """OUT's head with the τ_head its summary's rule gives on the training scores (the rule's
    record without its table, as training writes it); the weights stay as trained."""
    from dataclasses import replace

    from parse_vllm.judge_head import JudgeHead, JudgeHeadError

    path = out / HEAD_FILE
    try:
        head = JudgeHead.load(path)
    except JudgeHeadError as e:
        raise JudgeError(f"--retau: {e}") from None
    rule = {k: v for k, v in summary["tau_head_rule"].items() if k != "table"}
    old = head.tau
    head = replace(head, training={**head.training, "tau_head": rule})
    target = Path(summary["models"]["target"]).name
    if ship and not (SHIPPED / target / HEAD_FILE).is_file():
        raise JudgeError(f"--retau --ship: {SHIPPED / target / HEAD_FILE}: no shipped head to update")
    head.save(path)
    log(f"{path}: τ_head {old} -> {rule['tau']:g}")
    if ship:
        ship_head(path, target)


def ship_head(head_path: Path, target_name: str) -> Path:
    """`head_path` copied to the package's heads, where `parse.judge_head: <target name>` finds it."""
    dest = SHIPPED / target_name / HEAD_FILE
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(head_path, dest)
    os.chmod(dest, 0o644)
    log(f"shipped to {dest}")
    return dest


def _main(args) -> int:
    if args.report_only:
        given = [
            f
            for f in ("evaluate", "old_head", "data_only", "prompts", "config", "tau_max_wrong")
            if getattr(args, f) is not None and getattr(args, f) is not False
        ] + (["features"] if args.features != "auto" else [])
        if given:
            raise JudgeError(f"--report-only reads OUT alone: leave out --{given[0].replace('_', '-')}")
        if args.ship and not args.retau:
            raise JudgeError("--report-only --ship: only with --retau (the report alone ships nothing)")
        return report_only(args.out, retau=args.retau, ship=args.ship)
    if args.retau:
        raise JudgeError("--retau goes with --report-only")
    from transformers import AutoTokenizer

    from parse_vllm.boundaries import BoundaryRule, sentence_end_mask
    from parse_vllm.config import ParseConfig
    from parse_vllm.evidence import EVIDENCE_FEATURES
    from parse_vllm.templates import build_template
    from parse_vllm.tools.eval.run import _render

    from . import prompts as jprompts

    for name in ("samples", "prefixes_passing", "prefixes_failing", "balance_samples"):
        if getattr(args, name) < 0:
            raise JudgeError(f"--{name.replace('_', '-')} must be >= 0")
    if args.max_tokens < 1 or args.batch < 1 or (args.num_prompts is not None and args.num_prompts < 1):
        raise JudgeError("--max-tokens, --batch and --num-prompts must be >= 1")
    if args.features not in probe_modes() and not args.features.startswith("hidden"):
        raise JudgeError(f"--features {args.features!r}: one of {probe_modes()} or a list starting with hidden")
    wants_evidence = args.evidence or args.features == "select" or any(f in args.features for f in EVIDENCE_FEATURES)
    if args.evaluate and not wants_evidence:
        from parse_vllm.judge_head import JudgeHead, JudgeHeadError

        try:  # a head that reads evidence needs the evidence stage of the sets it scores
            wants_evidence = JudgeHead.load(args.evaluate).reads_evidence
        except JudgeHeadError:
            pass  # said below, with the head's other checks
    specs = args.prompts or ["humaneval"]
    if args.data and len(specs) > 1:
        raise JudgeError("--data names one set's folder: leave it out with several --prompts")
    if args.old_head and not args.evaluate:
        raise JudgeError("--old-head goes with --evaluate")
    res = resolve_models(args)
    sets = []
    for spec in specs:
        try:
            pset = jprompts.load(
                spec, humaneval_split=args.split, evaluating=bool(args.evaluate),
                checkable_n=args.num_prompts or 16, seed=args.seed,
            )  # fmt: skip
        except jprompts.PromptSpecError as e:
            raise JudgeError(str(e)) from None
        items = [it for it in pset.take(args.num_prompts) if it.get("check")]
        if not items:
            raise JudgeError(f"{spec}: no checkable prompts (a JSONL item needs a test or a reference)")
        sets.append((pset, items))
    names = [p.name for p, _ in sets]
    if len(set(names)) != len(names):
        raise JudgeError(f"prompt sets named twice: {names}")
    target = Path(res["target"])
    tok = AutoTokenizer.from_pretrained(target)
    parse = ParseConfig.from_dict(res["parse"])
    template = build_template(tok, parse)
    cfg = json.loads((target / "config.json").read_text())
    vocab = int(cfg.get("text_config", cfg)["vocab_size"])
    rule = BoundaryRule(parse.boundaries, parse.every, parse.max_boundaries, sentence_end_mask(tok, vocab))
    balance = (
        {"samples": args.balance_samples, "temperature": args.balance_temperature, "below": args.balance_below}
        if args.balance_samples
        else None
    )
    jobs = []
    for pset, items in sets:
        prompt_ids = {it["id"]: _render(tok, it) for it in items}
        longest = max(len(p) for p in prompt_ids.values())
        mlen = -(-(longest + args.max_tokens + len(template.suffix_ids) + 64) // 32) * 32
        draft_engine, target_engine = engines(res, args, mlen)
        settings = data.DataSettings(
            set_name=pset.name,
            target=str(target),
            draft=str(res["draft"]),
            window=int(res["window"]),
            boundaries={"mode": parse.boundaries, "every": parse.every, "max_boundaries": parse.max_boundaries},
            question=parse.question,
            labels=tuple(parse.labels),
            samples=args.samples,
            temperature=args.temperature,
            seed=args.seed,
            max_tokens=args.max_tokens,
            prefixes_passing=args.prefixes_passing,
            prefixes_failing=args.prefixes_failing,
            tasks=tuple(it["id"] for it in items),
            balance=balance,
        )
        folder = args.data or args.out / "data" / pset.name
        jobs.append(
            data.Job(
                folder=folder,
                settings=settings,
                items=items,
                prompt_ids=prompt_ids,
                tokenizer=tok,
                template=template,
                rule=rule,
                draft_engine=draft_engine,
                target_engine=target_engine,
                batch=args.batch,
                deadline=data.Deadline(None if args.max_minutes is None else args.max_minutes * 60),
                code_timeout=args.code_timeout,
                log=log,
                evidence=wants_evidence,
                extra_stages=[(baselines.STAGE, baselines.stage_baselines)] if args.baselines else [],
            )
        )
    deadline = jobs[0].deadline
    for job in jobs:
        job.deadline = deadline  # one time bound for every set
    if args.judges_on_tables:
        from . import report, tables

        given = [f for f in ("evaluate", "old_head", "data_only", "ship", "data") if getattr(args, f)]
        if given:
            raise JudgeError(f"--judges-on-tables scores the judges alone: leave out --{given[0].replace('_', '-')}")
        for job in jobs:
            job.folder = args.out / tables.FOLDER / job.settings.set_name
        try:
            summary = tables.run(args.out, [(job, split_name(p.name)) for (p, _), job in zip(sets, jobs)], log=log)
        except data.TimeBound:
            log(f"stopped at the time bound (--max-minutes {args.max_minutes:g}): run the same command again to resume")
            return 3
        except tables.TablesError as e:
            raise JudgeError(str(e)) from None
        print(report.markdown(summary))
        return 0
    for job in jobs:
        log(f"{job.settings.set_name}: {len(job.items)} prompts, data in {job.folder}")
        try:
            data.build(job)
        except data.TimeBound:
            log(f"stopped at the time bound (--max-minutes {args.max_minutes:g}): run the same command again to resume")
            return 3
    if args.data_only:
        return 0

    from . import compare, probe, report, scores

    ident = identity(target, tok, template, parse)
    summary_path = args.out / "summary.json"
    per_set = [(pset, job, split_name(pset.name)) for (pset, _), job in zip(sets, jobs)]
    loaded = {sp: probe.Examples.load(job.folder, source=sp) for _, job, sp in per_set}
    if args.evaluate:
        from parse_vllm.judge_head import JudgeHead, JudgeHeadError

        heads = {}
        for role, path in (("head", args.evaluate), ("old_head", args.old_head)):
            if path is None:
                continue
            try:
                h = JudgeHead.load(path)
            except JudgeHeadError as e:
                raise JudgeError(str(e)) from None
            why = h.mismatch(ident) or h.fingerprint_mismatch(ident.lm_head_fingerprint)
            if why:
                raise JudgeError(f"--{'evaluate' if role == 'head' else 'old-head'} {path}: {why}")
            if h.reads_evidence and not all(ex.evidence is not None for ex in loaded.values()):
                raise JudgeError(f"{path}: the head reads evidence features: build the sets with --evidence")
            heads[role] = h
        if not summary_path.is_file():
            raise JudgeError(f"{summary_path}: no training report here (train on the tuning split first)")
        summary = json.loads(summary_path.read_text())
        for pset, job, split in per_set:
            ex = loaded[split]
            summary.setdefault("split_roles", {})[split] = (
                f"held out: evaluated once with {args.evaluate.name}, trained on `{summary.get('train_split')}`"
            )
            summary.setdefault("prompt_sets", {})[split] = pset.meta("held out", len(job.items))
            if heads["head"].tau is not None:
                summary.setdefault("pass_rates_at_tau_head", {})[split] = {"tau": heads["head"].tau}
            else:  # a head without τ_head: no rates at another head's τ
                summary.get("pass_rates_at_tau_head", {}).pop(split, None)
            summary.setdefault("data", {})[split] = data_summary(job, ex)
            old = probe.head_logits(heads["old_head"], ex) if "old_head" in heads else None
            fits = args.out / compare.FITS_FILE
            judges = compare.score(ex, *compare.load(fits)) if fits.is_file() and compare.available(ex) else None
            scores.write(scores.path_of(args.out, split), ex, probe.head_logits(heads["head"], ex), old, judges)
            summary.setdefault("score_files", {})[split] = str(scores.path_of(Path(), split))
    else:
        ex = probe.Examples.concat(list(loaded.values()))
        split = per_set[0][2] if len(per_set) == 1 else "train"
        try:
            result = probe.train(ex, split, features=args.features, log=log)
        except ValueError as e:
            raise JudgeError(str(e)) from None
        if args.tau_max_wrong is not None:
            result["tau"] = probe.choose_tau(result["oof"], ex, max_wrong=args.tau_max_wrong)
        z_selected, selection_folds = compare.selection_nested_oof(ex, args.features, log=log)
        compared = compare.train(ex, result["features"], log=log) if compare.available(ex) else None
        prompt_sets = [pset.meta("train", len(job.items)) for pset, job, _ in per_set]
        training = {
            "prompt_set": "+".join(p.name for p, _, _ in per_set),
            "prompt_sets": prompt_sets,
            "examples": len(ex),
            **ex.counts(),
            "examples_by_set": result["examples_by_source"],
            "features": list(result["features"]),
            "feature_selection": {
                "mode": args.features,
                "min_gain": probe.MIN_FEATURE_GAIN,
                "scalar_boost": probe.SCALAR_BOOST,
                "scores": {k: v["score"] for k, v in result["feature_comparison"].items()},
            },
            "C": result["C"],
            "cv_auc_whole": result["aucs"]["head"][0],
            "cv_auc_prefix": result["aucs"]["head"][1],
            "zero_shot_auc_whole": result["aucs"]["zero_shot"][0],
            "zero_shot_auc_prefix": result["aucs"]["zero_shot"][1],
            "tau_head": {k: v for k, v in result["tau"].items() if k != "table"},
            "draft": Path(res["draft"]).name,
            "samples": args.samples,
            "balance": balance,
            "prefixes_per_answer": {"passing": args.prefixes_passing, "failing": args.prefixes_failing},
        }
        head = probe.export(result["pipe"], result["features"], ident, training)
        head_path = head.save(args.out / HEAD_FILE)
        log(f"head written to {head_path} ({head_path.stat().st_size} bytes); τ_head {result['tau']['tau']:g}")
        z = result["oof"]
        summary = {
            "models": {},
            "train_split": split,
            "split_roles": {
                split: "tunes everything: head trained on it, figures from nested cross-validation (folds grouped by task)"
            },
            "n_train": len(ex),
            "features_kept": list(result["features"]),
            "min_feature_gain": probe.MIN_FEATURE_GAIN,
            "C": result["C"],
            "C_grid": result["C_grid"],
            "feature_comparison": result["feature_comparison"],
            "cv_selection_nested": dict(
                zip(("auc_whole", "auc_prefix"), probe.kind_aucs(z_selected, ex)), folds=selection_folds
            ),
            "training_labels_comparison": result["training_labels_comparison"],
            "data_size_curve": result["data_size_curve"],
            "head_bytes": head_path.stat().st_size,
            "tau_head_rule": {"max_wrong": result["tau"]["max_wrong"]},  # the rule, applied by scores.figures
            "prompt_sets": {p["name"]: p for p in prompt_sets},
        }
        if result["feature_ablation"] is not None:
            summary["feature_ablation"] = result["feature_ablation"]
            summary["scalar_boost"] = result["scalar_boost"]
        if result["data_size_curves"]:
            summary["data_size_curves"] = result["data_size_curves"]
        if len(per_set) > 1:
            summary["train_sets"] = [sp for _, _, sp in per_set]
            for _, job, sp in per_set:
                summary.setdefault("data", {})[sp] = data_summary(job, loaded[sp])
        if args.ship:
            ship_head(head_path, target.name)
        summary.setdefault("data", {})[split] = data_summary(jobs[0], ex) if len(per_set) == 1 else {
            "counts": ex.counts(), "sets": [sp for _, _, sp in per_set]}  # fmt: skip
        for stale in (*(args.out / scores.FOLDER).glob("*.csv"), args.out / compare.FITS_FILE):
            stale.unlink(missing_ok=True)  # a new head: the held-out tables of the old one no longer describe it
        if compared is not None:
            compare.save(args.out / compare.FITS_FILE, compared["kl_statistic"], compared["fits"])
            summary["judges_compared"] = {
                "kl_statistic": compared["kl_statistic"],
                "kl_statistic_aucs": compared["kl_statistic_aucs"],
                "features": {n: list(f.features) for n, f in compared["fits"].items()},
                "C": compared["C"],
            }
        scores.write(scores.path_of(args.out, split), ex, z, judges=None if compared is None else compared["oof"])
        summary["score_files"] = {split: str(scores.path_of(Path(), split))}
    summary["models"] = {
        "target": str(target),
        "draft": str(res["draft"]),
        "window": int(res["window"]),
        "boundaries": jobs[0].settings.boundaries,
        "question": parse.question,
        "labels": list(parse.labels),
        "suffix_text": template.suffix_text,
    }
    splits = list(dict.fromkeys([summary["train_split"], *summary.get("data", {})]))
    summary["splits"] = splits
    summary = scores.rescore(args.out, summary)
    paths = report.write(args.out, summary)
    print(report.markdown(json.loads(summary_path.read_text())))
    log("wrote " + ", ".join(str(p) for p in paths))
    return 0


def probe_modes() -> tuple[str, ...]:
    from .probe import FEATURE_MODES

    return FEATURE_MODES


def data_summary(job: data.Job, ex) -> dict[str, Any]:
    done = {s: job.done(s) or {} for s in data.STAGES}
    extra = {stage: job.seconds(stage) for stage in
             [data.EVIDENCE_STAGE] * job.evidence + [name for name, _ in job.extra_stages]}  # fmt: skip
    return {
        "folder": str(job.folder),
        "settings": job.settings.of("features"),
        "counts": ex.counts(),
        "answers": done["boundaries"].get("answers"),
        "duplicates_dropped": done["boundaries"].get("duplicates_dropped"),
        "target_passes": done["labels"].get("target_passes"),
        "continuations": done["labels"].get("continuations"),
        "prefix_label_sources": done["labels"].get("prefixes_by_source"),
        "stage_seconds": {**{s: job.seconds(s) for s in data.STAGES}, **extra},
        "balanced_tasks": len(done["boundaries"].get("balanced_tasks", [])) if job.settings.balance else None,
        **({"kl_check": json.loads(check.read_text())} if (check := job.path("kl_check.json")).is_file() else {}),
    }
