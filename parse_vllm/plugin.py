"""What the plugin does inside vLLM's own processes.

`register()` (entry point `vllm.general_plugins`) runs in every vLLM process:
it checks the vLLM version, registers the head-pruned draft architecture
(draft_vocab.py, draft_model.py) and hooks `name_parse` in front of vLLM's
engine-config construction, which reads `"method": "parse"` in the speculative
config and chooses model runner V1. The real arrangement happens in
`arrange_engine`, called by the PARSE platform (platform.py) from vLLM's
`Platform.check_and_update_config` hook in process 0 while the engine config
is built: when `additional_config` names PARSE, it validates the PARSE
options and the draft model, and points vLLM at the PARSE worker and
scheduler — the user never passes --worker-cls or --scheduler-cls. Without a
`parse` section it changes nothing.
"""

from __future__ import annotations

from parse_vllm.config import (
    PARSE_METHOD,
    VLLM_METHOD,
    ParseConfig,
    ParseConfigError,
    merge_parse_options,
    parse_section,
    request_options,
    split_speculative_config,
)

SCHEDULER_CLS = "parse_vllm.scheduler.ParseScheduler"
CPU_WORKER_CLS = "parse_vllm.worker.ParseCPUWorker"
GPU_WORKER_CLS = "parse_vllm.worker.ParseGPUWorker"
DRAFT_MODEL_CLS = "parse_vllm.draft_model:ParseDraftLlamaForCausalLM"  # for draft_vocab.ARCHITECTURE

_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    from parse_vllm import _vllm  # fails clearly on an unsupported vLLM
    from parse_vllm.draft_vocab import ARCHITECTURE

    _vllm.register_model(ARCHITECTURE, DRAFT_MODEL_CLS)
    _vllm.hook_engine_config(name_parse)
    _registered = True


def name_parse(engine_args) -> None:
    """Run by vLLM's EngineArgs.create_engine_config before it reads its arguments
    (_vllm.hook_engine_config), for LLM(...), `vllm serve` and `parse-vllm serve` alike.
    `"method": "parse"` (or `spec_method="parse"`) becomes vLLM's draft-model config and
    additional_config["parse"]; an engine that names PARSE either way gets model runner V1."""
    spec, additional = named_speculative_config(
        engine_args.speculative_config,
        engine_args.additional_config,
        spec_method=engine_args.spec_method,
        aliases={"model": engine_args.spec_model, "num_speculative_tokens": engine_args.spec_tokens},
    )
    if engine_args.spec_method == PARSE_METHOD:
        engine_args.spec_method = VLLM_METHOD
    engine_args.speculative_config, engine_args.additional_config = spec, additional
    if parse_section(additional) is not None:
        select_runner_v1(engine_args)


def named_speculative_config(spec, additional_config, spec_method=None, aliases=None):
    """(speculative_config, additional_config) as vLLM takes them, for a speculative config
    that may name PARSE: `{"method": "parse", "model": DRAFT, "num_speculative_tokens": W,
    <PARSE options>, <vLLM's draft-model keys>}` becomes `{"method": "draft_model", ...}`
    and additional_config["parse"] with the options (merged with a `parse` section there,
    where no option has two values). `spec_method` is vLLM's --spec-method alias, and
    `aliases` the values of --spec-model/--spec-tokens, which stand in for the dict's
    "model"/"num_speculative_tokens". Anything else comes back as it was given."""
    from parse_vllm import _vllm

    by_alias = spec_method == PARSE_METHOD
    if not by_alias and not (isinstance(spec, dict) and spec.get("method") == PARSE_METHOD):
        return spec, additional_config
    spec = dict(spec or {})
    if by_alias and "method" in spec:  # vLLM's own words (EngineArgs.create_speculative_config)
        raise ParseConfigError("--spec-method and --speculative-config['method'] are mutually exclusive")
    # --spec-model/--spec-tokens stay vLLM's to merge (it refuses a key given twice).
    given = {k for k, v in (aliases or {}).items() if v is not None} if by_alias else set()
    vllm_spec, options = split_speculative_config(spec, _vllm.speculative_config_keys(), given=given)
    if additional_config is None:
        additional_config = {}
    if not isinstance(additional_config, dict):
        raise ParseConfigError(
            f'"method": "{PARSE_METHOD}" puts PARSE\'s options in additional_config["parse"], and '
            f"additional_config is a {type(additional_config).__name__}, not a mapping"
        )
    options = merge_parse_options(options, parse_section(additional_config))
    ParseConfig.from_dict(options)
    if by_alias:
        vllm_spec.pop("method", None)
    else:
        vllm_spec["method"] = VLLM_METHOD
    return vllm_spec, {**additional_config, "parse": options}


# Why PARSE needs model runner V1, for the errors that refuse V2.
RUNNER_V1_WHY = (
    "PARSE replaces token acceptance inside vLLM's model runner V1 (its worker subclasses "
    "GPUModelRunner / CPUModelRunner); model runner V2 has no such hook"
)


def select_runner_v1(engine_args) -> None:
    """Model runner V1 for an engine that names PARSE, chosen before vLLM chooses:
    VllmConfig.use_v2_model_runner reads VLLM_USE_V2_MODEL_RUNNER (vLLM 0.33 picks V2 when
    it is unset), and the engine core and workers inherit this process's environment. The
    variable stays set in this process: vLLM reads it again in every process and step."""
    from parse_vllm import _vllm

    forced = _vllm.v2_runner_forced_by(engine_args)
    if forced is not None:
        raise ParseConfigError(
            f"PARSE cannot run with {forced}: vLLM uses model runner V2 for it whatever "
            f"{_vllm.V2_RUNNER_ENV} says (VllmConfig.use_v2_model_runner), and {RUNNER_V1_WHY}"
        )
    if _vllm.v2_runner_env():
        raise ParseConfigError(
            f"{_vllm.V2_RUNNER_ENV}=1 asks for vLLM's model runner V2, and {RUNNER_V1_WHY}; "
            "unset it (PARSE selects V1 itself)"
        )
    _vllm.set_vllm_env(_vllm.V2_RUNNER_ENV, "0")


def parse_enabled(vllm_config) -> bool:
    return parse_section(getattr(vllm_config, "additional_config", None)) is not None


def arrange_engine(vllm_config, worker_cls: str) -> None:
    section = parse_section(vllm_config.additional_config)
    if section is None or is_draft_config(vllm_config):
        return
    from parse_vllm import _vllm

    logger = _vllm.init_logger("parse_vllm")
    config = ParseConfig.from_dict(section)
    spec = vllm_config.speculative_config
    if spec is None or spec.method != "draft_model":
        raise ParseConfigError(
            'PARSE needs a draft model: pass speculative_config={"method": '
            '"parse", "model": DRAFT, "num_speculative_tokens": W} '
            f"(got {None if spec is None else spec.method!r})"
        )
    method = getattr(spec, "rejection_sample_method", "standard")
    if method != "standard":
        raise ParseConfigError(
            f"PARSE's token-level acceptance must be lossless; rejection_sample_method={method!r} "
            "is not supported (use the default 'standard')"
        )
    tokenizer = _vllm.target_tokenizer(vllm_config)  # once: a load takes 0.5-1 s for a 49k vocabulary
    check_same_tokenizer(vllm_config, tokenizer)
    check_verification_template(vllm_config, config, tokenizer)
    check_token_proposer(vllm_config, config)
    check_judge_head(vllm_config, config, tokenizer)
    if vllm_config.parallel_config.pipeline_parallel_size != 1:
        raise ParseConfigError("PARSE does not support pipeline parallelism yet")

    pc = vllm_config.parallel_config
    if pc.data_parallel_size > 1:
        raise ParseConfigError(
            f"PARSE does not support data parallelism (data_parallel_size={pc.data_parallel_size}): "
            "verification passes run only on ranks that judged something, so the ranks' collectives "
            "(an MoE target's all-to-all) would wait on each other; run one engine per replica"
        )
    # The verifier, chosen once here and written back, so that the scheduler
    # (which holds scratch blocks back for the forked one) and the runner agree.
    from parse_vllm.verify import factory

    section = {**section, "verifier": factory.resolve(config.verifier, vllm_config, worker_cls == GPU_WORKER_CLS)}
    vllm_config.additional_config["parse"] = section
    config = ParseConfig.from_dict(section)
    if pc.worker_cls == "auto":
        pc.worker_cls = worker_cls
    elif pc.worker_cls != worker_cls:
        raise ParseConfigError(
            f"PARSE installs its own worker ({worker_cls}) but worker_cls is {pc.worker_cls!r}; drop --worker-cls"
        )
    sc = vllm_config.scheduler_config
    if sc.scheduler_cls is None:
        sc.scheduler_cls = SCHEDULER_CLS
    elif sc.scheduler_cls != SCHEDULER_CLS:
        raise ParseConfigError(
            f"PARSE installs its own scheduler ({SCHEDULER_CLS}) but scheduler_cls "
            f"is {sc.scheduler_cls!r}; drop --scheduler-cls"
        )
    # PARSE replaces acceptance in model runner V1 and needs sync scheduling.
    sc.async_scheduling = False
    # The verification pass forks one block table per copy, so all target
    # layers must share one KV-cache group: models with sliding-window layers
    # (Gemma 3) keep full KV in every layer instead of vLLM's hybrid groups.
    if sc.disable_hybrid_kv_cache_manager is False:
        raise ParseConfigError(
            "PARSE needs one KV-cache group for all target layers; drop "
            "--no-disable-hybrid-kv-cache-manager (disable_hybrid_kv_cache_manager=False)"
        )
    sc.disable_hybrid_kv_cache_manager = True
    if worker_cls == GPU_WORKER_CLS:
        _vllm.set_vllm_env("VLLM_USE_V2_MODEL_RUNNER", "0")
    window = spec.num_speculative_tokens
    max_model_len = vllm_config.model_config.max_model_len
    if window >= max_model_len:
        raise ParseConfigError(
            f"speculative_config.num_speculative_tokens={window} (the PARSE window W) must be "
            f"below max_model_len={max_model_len}: no request could hold one window"
        )
    if config.spec_tokens > window:
        raise ParseConfigError(
            f"parse.spec_tokens={config.spec_tokens} is longer than the PARSE window "
            f"W={window} (speculative_config.num_speculative_tokens): the scheduler reserves "
            "W lookahead slots per request, so a token-level draft can be at most W tokens"
        )
    if sc.max_num_batched_tokens < window + 1:
        raise ParseConfigError(
            f"max_num_batched_tokens={sc.max_num_batched_tokens} cannot hold one "
            f"verification of a {window}-token window; raise it to at least {window + 1}"
        )
    logger.info(
        "PARSE named: draft %s, window W=%d, options %s",
        spec.draft_model_config.model,
        window,
        config.to_dict(),
    )


def is_draft_config(vllm_config) -> bool:
    """Whether `vllm_config` is the draft model's copy of an engine's config: vLLM's draft
    proposer rebuilds the engine's config with the draft as its model
    (DraftModelProposer._create_draft_vllm_config), which runs the platform hook again with
    the PARSE section still in it. That copy was arranged as the engine; judged again, the
    draft would be taken for the target (its head size checked for the kernel, its
    tokenizer and template built)."""
    spec = getattr(vllm_config, "speculative_config", None)
    return spec is not None and vllm_config.model_config is spec.draft_model_config


def check_same_tokenizer(vllm_config, target) -> None:
    """Refuse a draft whose own tokenizer differs from the target's (`target`, the target's
    tokenizer): vLLM would feed it the target's token ids, which then mean other text."""
    from parse_vllm import _vllm

    spec = vllm_config.speculative_config
    if spec.use_heterogeneous_vocab:
        raise ParseConfigError(
            "PARSE needs a draft model with the target's tokenizer (use_heterogeneous_vocab is not supported)"
        )
    draft_path = spec.draft_model_config.model
    mc = vllm_config.model_config
    if not mc.trust_remote_code and same_fast_tokenizer_files(mc.tokenizer, draft_path):
        return
    try:
        draft = _vllm.get_tokenizer(draft_path, trust_remote_code=mc.trust_remote_code)
    except Exception:  # a draft folder without tokenizer files: vLLM uses the target's
        return
    if draft.get_vocab() != target.get_vocab():
        raise ParseConfigError(
            f"the draft model {draft_path!r} has a different tokenizer from the "
            f"target {vllm_config.model_config.model!r}; PARSE needs a draft "
            "with the same tokenizer (vocabulary and ids)"
        )


# A fast tokenizer is its tokenizer.json (vocabulary, merges, added tokens) read with these
# (added and special tokens, its class): the same bytes in two folders, the same tokenizer.
FAST_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "added_tokens.json", "special_tokens_map.json")


def same_fast_tokenizer_files(a: str, b: str) -> bool:
    """Whether two local model folders hold the same fast tokenizer, by its files' bytes
    (FAST_TOKENIZER_FILES, each in both or in neither, tokenizer.json in both), without
    loading either; False where that cannot tell (a hub name, no tokenizer.json), and the
    tokenizers are then loaded and compared."""
    from pathlib import Path

    a, b = Path(a), Path(b)
    if not ((a / "tokenizer.json").is_file() and (b / "tokenizer.json").is_file()):
        return False
    for name in FAST_TOKENIZER_FILES:
        x, y = a / name, b / name
        if x.is_file() != y.is_file() or (x.is_file() and x.read_bytes() != y.read_bytes()):
            return False
    return True


def check_token_proposer(vllm_config, config: ParseConfig) -> None:
    """Build the token-level proposer's speculative config once here, so a
    missing head or a bad n-gram setting is refused before any worker
    starts (the worker builds the same, _vllm.token_proposer)."""
    if config.token_proposer is None:
        return
    from parse_vllm import _vllm

    try:
        spec = _vllm.token_proposer_config(vllm_config, config.token_proposer, config.spec_tokens)
    except Exception as e:
        raise ParseConfigError(f"parse.token_proposer={config.token_proposer!r}: {e}") from e
    why = _vllm.token_proposer_unsupported(spec)
    if why:
        raise ParseConfigError(f"parse.token_proposer: {why} is not supported beside PARSE")
    if spec.method != config.token_proposer["method"]:
        raise ParseConfigError(
            f"parse.token_proposer: vLLM reads {config.token_proposer.get('model')!r} as method "
            f"{spec.method!r}, not {config.token_proposer['method']!r}"
        )


def check_verification_template(vllm_config, config: ParseConfig, tokenizer) -> None:
    """Build the verification suffix and label tokens once here, in process 0,
    so a bad `question`/`labels` (or a target without a chat template) is
    refused before any engine process starts; the worker builds the same."""
    from parse_vllm.templates import build_template

    try:
        build_template(tokenizer, config)
    except ParseConfigError as e:
        raise ParseConfigError(f"{e} (target {vllm_config.model_config.model!r})") from e


def check_judge_head(vllm_config, config: ParseConfig, tokenizer) -> None:
    """Refuse, before any worker starts, a judge head (parse.judge_head) trained for
    another target, hidden size, question or labels (the worker then checks the weights)."""
    if config.judge_head is None:
        return
    from parse_vllm import _vllm
    from parse_vllm.judge_head import JudgeHeadError, engine_identity, load_for_engine
    from parse_vllm.templates import build_template

    template = build_template(tokenizer, config)
    try:
        load_for_engine(
            config.judge_head, engine_identity(**_vllm.target_shape(vllm_config), template=template, config=config)
        )
    except JudgeHeadError as e:
        raise ParseConfigError(str(e)) from e


def validate_request_params(params) -> None:
    """Per-request PARSE options (SamplingParams.extra_args / vllm_xargs);
    raises vLLM's validation error (HTTP 400 on the server)."""
    extra = getattr(params, "extra_args", None)
    if not extra:
        return
    try:
        request_options(extra, ParseConfig())
    except ParseConfigError as e:
        from parse_vllm import _vllm

        raise _vllm.ValidationError(str(e)) from e
