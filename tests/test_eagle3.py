"""PARSE composed with a token-level proposer in one engine (`parse.token_proposer`):
the draft model writes the windows; an EAGLE-3 head (or n-gram matching) proposes the
target's own tokens after a rejection, for PARSE-off requests and for τ > 1. Through
`LLM(...)` and `parse-vllm serve` + an OpenAI client."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import requests
from conftest import BLOCK, PROMPTS, close_llm, engine_kwargs, make_llm, parse_kwargs, running_server

import parse_vllm
from parse_vllm.config import ParseConfig, ParseConfigError
from parse_vllm.tools.server_process import free_port

pytestmark = pytest.mark.slow

HEAD = Path(parse_vllm.__file__).parent / "drafts" / "smollm2-135m-instruct-eagle3"
K = 3  # tokens the token-level proposer proposes (parse.spec_tokens)


def _params(max_tokens=24, **extra_args):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, extra_args=extra_args or None)


def _ids(outs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


def _prompts(n):
    return [{"prompt": p} for p in PROMPTS[:n]]


def _with_proposer(tiny_models, proposer, **parse):
    return parse_kwargs(tiny_models, token_proposer=proposer, spec_tokens=K, **parse)


# -- configuration -------------------------------------------------------------


@pytest.mark.parametrize(
    "section, message",
    [
        ({"token_proposer": {"method": "eagle3", "model": "/x"}}, "spec_tokens is 0"),
        ({"token_proposer": {"method": "medusa", "model": "/x"}, "spec_tokens": 3}, "must be one of"),
        ({"token_proposer": {"method": "eagle3"}, "spec_tokens": 3}, 'needs "model"'),
        ({"token_proposer": "eagle3", "spec_tokens": 3}, "must be an object"),
        (
            {"token_proposer": {"method": "ngram", "num_speculative_tokens": 4}, "spec_tokens": 3},
            "parse.spec_tokens says",
        ),
    ],
)
def test_bad_token_proposer_options_are_refused(section, message):
    with pytest.raises(ParseConfigError, match=message):
        ParseConfig.from_dict(section)


def test_probabilistic_drafts_are_refused(tiny_models, tiny_head):
    from vllm import LLM

    proposer = {"method": "eagle3", "model": str(tiny_head), "draft_sample_method": "probabilistic"}
    with pytest.raises(Exception, match="draft_sample_method='probabilistic'"):
        LLM(**_with_proposer(tiny_models, proposer))


def test_a_missing_head_is_refused_before_any_worker_starts(tiny_models, tmp_path):
    from vllm import LLM

    with pytest.raises(Exception, match="token_proposer") as e:
        LLM(**_with_proposer(tiny_models, {"method": "eagle3", "model": str(tmp_path / "no-head")}))
    assert "no-head" in str(e.value)


def _loaded_head(hf_config, use_aux=True, eagle3_target=True):
    """A TokenProposer for EAGLE-3 loaded over a stand-in target: which layers it asks the
    target for, as vLLM's runner would for its own drafter."""
    from types import SimpleNamespace

    from parse_vllm._vllm.token_proposer import TokenProposer

    tp = TokenProposer.__new__(TokenProposer)
    tp.method = "eagle3"
    tp.proposer = SimpleNamespace(load_model=lambda model: None, eagle3_use_aux_hidden_state=use_aux)
    tp.config = SimpleNamespace(
        speculative_config=SimpleNamespace(draft_model_config=SimpleNamespace(hf_config=hf_config))
    )
    from vllm.model_executor.models.interfaces import SupportsEagle3

    asked = []

    class Target(SupportsEagle3 if eagle3_target else object):
        def set_aux_hidden_state_layers(self, layers):
            asked.append(layers)

        def get_eagle3_default_aux_hidden_state_layers(self):
            return (2, 9, 17)

    model = Target()
    runner = SimpleNamespace(model=model, get_model=lambda: model, use_aux_hidden_state_outputs=False)
    tp.load(runner)
    return tp, asked, runner


@pytest.mark.parametrize(
    "hf_config, layers",
    [
        ({"eagle_aux_hidden_state_layer_ids": [1, 4, 7]}, (1, 4, 7)),
        ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [3, 5, 8]}}, (3, 5, 8)),
        ({}, (2, 9, 17)),  # the target's own defaults
    ],
)
def test_the_heads_layers_are_the_ones_vllm_picks_for_its_own_eagle3(hf_config, layers):
    from types import SimpleNamespace

    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    tp, asked, runner = _loaded_head(SimpleNamespace(**hf_config))
    spec = tp.config.speculative_config
    assert asked == [layers] and tp.aux_layers == layers and runner.use_aux_hidden_state_outputs
    vllm_own = GPUModelRunner._get_eagle3_aux_layers_from_config(SimpleNamespace(speculative_config=spec))
    assert vllm_own == (layers if hf_config else None)


def test_a_head_over_a_target_without_eagle3_support_is_refused_with_a_message():
    """A target class that is not vLLM's SupportsEagle3 returns no auxiliary hidden states:
    loading the head is refused, naming the class, rather than failing in the first step."""
    from types import SimpleNamespace

    with pytest.raises(ValueError, match="SupportsEagle3") as e:
        _loaded_head(SimpleNamespace(), eagle3_target=False)
    assert "Target" in str(e.value)


def test_a_head_without_auxiliary_states_reads_the_last_hidden_state():
    """eagle_config.use_aux_hidden_state false: the target returns no auxiliary states and
    the head reads the target's last hidden state, copied out of the step's outputs."""
    from types import SimpleNamespace

    import torch

    tp, asked, runner = _loaded_head(SimpleNamespace(eagle_config={"use_aux_hidden_state": False}), use_aux=False)
    assert asked == [] and not runner.use_aux_hidden_state_outputs
    hidden = torch.arange(12.0).view(6, 2)
    cm = SimpleNamespace(query_start_loc_cpu=torch.tensor([0, 3, 4]))
    got = tp.target_hidden_states({"hidden_states": hidden, "common_attn_metadata": cm})
    assert torch.equal(got, hidden[:4]) and got.data_ptr() != hidden.data_ptr()


# -- tiny models: EAGLE-3 and n-gram beside the draft model ---------------------


@pytest.fixture(scope="module")
def tiny_target_alone(tiny_models):
    llm = make_llm(**engine_kwargs(tiny_models["target"]))
    yield _ids(llm.generate(_prompts(6), _params()))
    close_llm(llm)


@pytest.fixture(scope="module")
def tiny_eagle3(tiny_models, tiny_head, tiny_target_alone):  # the reference first: one engine at a time
    llm = make_llm(**_with_proposer(tiny_models, {"method": "eagle3", "model": str(tiny_head)}, threshold=0.5))
    yield llm
    close_llm(llm)


def test_lossless_requests_are_the_target_with_eagle3(tiny_eagle3, tiny_target_alone):
    parse_vllm.reset_stats(tiny_eagle3)
    for xargs in ({"parse": False}, {"parse_threshold": 1.5}, {"parse_threshold": 1.0, "parse_guard": 1}):
        assert _ids(tiny_eagle3.generate(_prompts(6), _params(**xargs))) == tiny_target_alone, xargs
    stats = parse_vllm.get_stats(tiny_eagle3)
    assert stats["token_level_drafts"].get("eagle3", 0) > 0
    assert stats["token_level_draft_tokens"]["eagle3"] == K * stats["token_level_drafts"]["eagle3"]
    assert "draft_model" not in stats["token_level_drafts"]  # the draft model wrote no token-level draft
    assert stats["drafts"] > 0  # the guard-1 requests' windows were judged


def test_a_mixed_batch_writes_what_each_request_writes_alone(tiny_eagle3):
    prompts = _prompts(3)
    kinds = [{"parse_threshold": 0.5}, {"parse": False}, {"parse_threshold": 1.5}]
    alone = [_ids(tiny_eagle3.generate([p], _params(**x)))[0] for p, x in zip(prompts, kinds)]
    together = _ids(tiny_eagle3.generate(prompts, [_params(**x) for x in kinds]))
    assert together == alone
    stats = parse_vllm.get_stats(tiny_eagle3)
    assert stats["tokens_accepted_semantic"] > 0 and stats["token_level_drafts"]["eagle3"] > 0


def _head_setup(worker):
    runner = worker.model_runner
    tp = runner._token_proposer
    return tp.dummy_runs, tp.proposer.cudagraph_dispatcher.keys_initialized


def test_the_head_is_warmed_up_and_given_cuda_graph_keys_beside_vllms_drafter(tiny_models, tiny_head):
    """vLLM warms up, profiles and captures only its own drafter; the head rides along in
    the same runs (on a GPU: compiled before the first request, captured in CUDA graphs).
    Here with compilation on, as a GPU engine runs: vLLM's CPU worker warms up then. The
    model is traced by Dynamo once and run by the eager backend (mode DYNAMO_TRACE_ONCE, which
    the CPU platform keeps as given, where it turns VLLM_COMPILE into Inductor's C++ build):
    the warm-up runs the same, without half a minute of code generation."""
    kw = _with_proposer(tiny_models, {"method": "eagle3", "model": str(tiny_head)}, threshold=1.5)
    compile_eager = {"mode": 2, "backend": "eager"}  # CompilationMode.DYNAMO_TRACE_ONCE
    llm = make_llm(**{**kw, "enforce_eager": False, "compilation_config": compile_eager})
    try:
        ((dummy_runs, keys_initialized),) = llm.collective_rpc(_head_setup)
        assert dummy_runs >= 1 and keys_initialized
        assert len(_ids(llm.generate(_prompts(2), _params(8)))) == 2
    finally:
        close_llm(llm)


NGRAM_RUN = """
import json, sys
import parse_vllm
from vllm import LLM, SamplingParams
kw, prompts = json.loads(sys.argv[1]), json.loads(sys.argv[2])
llm = LLM(**kw)
outs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
print("RESULT " + json.dumps({"ids": [list(o.outputs[0].token_ids) for o in outs], "stats": parse_vllm.get_stats(llm)}))
"""


def test_ngram_proposer_is_lossless_and_counted(tiny_models, tiny_target_alone):
    # In a process of its own: once vLLM's n-gram proposer has loaded numba, vLLM
    # 0.32's kernel-override scan (vllm.triton_utils.dispatcher) fails on numba's
    # objects for every later engine in that process (plain vLLM with method
    # "ngram" too); the suite's other engines share this one.
    import subprocess

    proposer = {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    kw = _with_proposer(tiny_models, proposer, threshold=1.5)
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    r = subprocess.run(
        [sys.executable, "-c", NGRAM_RUN, json.dumps(kw), json.dumps(PROMPTS[:6])],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line, r.stderr[-3000:]
    got = json.loads(line[len("RESULT ") :])
    assert got["ids"] == tiny_target_alone
    stats = got["stats"]
    # The tiny target repeats itself: n-gram matching finds its next tokens.
    assert stats["token_level_accepted_tokens"].get("ngram", 0) > 0
    assert "draft_model" not in stats["token_level_drafts"]


# -- the bundled target with its trained head -----------------------------------


@pytest.fixture(scope="module")
def smollm2_pair():
    from parse_vllm.tools.benchmarks.common import resolve_models

    if not (HEAD / "config.json").exists():
        pytest.skip(f"no trained head at {HEAD}")
    target, draft = resolve_models(None, None)
    return {"smollm2-135m-instruct": target, "smollm2-135m-instruct-draft": draft}


CHAT = [
    "Write two sentences about rivers.",
    "What is the capital of Italy? Answer in one sentence.",
    "List three colours.",
]


def _chat_prompts(target):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target)
    return [
        tok.apply_chat_template([{"role": "user", "content": c}], tokenize=False, add_generation_prompt=True)
        for c in CHAT
    ]


def _real_kwargs(pair, **parse):
    return engine_kwargs(
        pair["smollm2-135m-instruct"],
        speculative_config={
            "method": "draft_model",
            "model": str(pair["smollm2-135m-instruct-draft"]),
            "num_speculative_tokens": 16,
        },
        additional_config={
            "parse": {
                "token_proposer": {"method": "eagle3", "model": str(HEAD)},
                "spec_tokens": K,
                "draft_chunk": 8,
                **parse,
            }
        },
    )


@pytest.fixture(scope="module")
def smollm2_alone(smollm2_pair):
    llm = make_llm(**engine_kwargs(smollm2_pair["smollm2-135m-instruct"]))
    yield _ids(llm.generate(_chat_prompts(smollm2_pair["smollm2-135m-instruct"]), _params(40)))
    close_llm(llm)


@pytest.fixture(scope="module")
def smollm2_parse(smollm2_pair, smollm2_alone):  # the reference first
    """The bundled target, its draft and the trained head in one engine (τ 0.5, prefix caching
    off) for the two tests below, each request naming its τ (a request's options are the
    engine's defaults overridden; nothing else reads the engine's τ). The second test rewrites
    the runner's drafting: it is the engine's last user."""
    llm = make_llm(**_real_kwargs(smollm2_pair, threshold=0.5), enable_prefix_caching=False)
    yield llm
    close_llm(llm)


def test_trained_head_lossless_settings_are_the_target_and_eagle3_accepts_tokens(
    smollm2_pair, smollm2_alone, smollm2_parse
):
    prompts = _chat_prompts(smollm2_pair["smollm2-135m-instruct"])
    llm = smollm2_parse
    parse_vllm.reset_stats(llm)
    # τ > 1: the target's tokens, EAGLE-3 proposing them from the first step.
    assert _ids(llm.generate(prompts, _params(40, parse_threshold=1.5))) == smollm2_alone
    stats = parse_vllm.get_stats(llm)
    assert stats["token_level_accepted_tokens"].get("eagle3", 0) > 0
    assert stats["drafts"] == 0
    # guard 1 (τ 1): windows by the draft model, judged token by token only.
    assert _ids(llm.generate(prompts, _params(40, parse_threshold=1.0, parse_guard=1))) == smollm2_alone
    assert parse_vllm.get_stats(llm)["drafts"] > 0


def _overwrite_aux_after_drafting(worker) -> None:
    """In the worker: after the draft model drafts in a step, overwrite the target's
    auxiliary hidden states of that step, as a CUDA-graph replay of the draft model may on
    a GPU (vLLM's graphs share one memory pool; the target's outputs are weak references
    into it). EAGLE-3 must have read them before."""
    from parse_vllm._vllm.drafting import proposer_call

    runner = worker.model_runner
    cls = type(runner)
    step = {}

    def propose_draft_token_ids(scheduler_output, *args, **kwargs):
        step["aux"] = proposer_call(args, kwargs)["aux_hidden_states"]
        return cls.propose_draft_token_ids(runner, scheduler_output, *args, **kwargs)

    def draft(*args, **kwargs):
        out = cls._draft(runner, *args, **kwargs)
        for h in step.get("aux") or ():
            h.normal_()
        return out

    runner.propose_draft_token_ids = propose_draft_token_ids
    runner._draft = draft


def test_eagle3_reads_the_targets_hidden_states_before_the_draft_model_drafts(smollm2_pair, smollm2_parse):
    """Windows (τ 0.5) and EAGLE-3 (PARSE off) in the same steps: EAGLE-3's acceptance is
    the same when the target's auxiliary hidden states are overwritten after drafting."""
    prompts = _chat_prompts(smollm2_pair["smollm2-135m-instruct"])
    params = [_params(40, **x) for x in ({"parse": False}, {"parse_threshold": 0.5}, {"parse": False})]
    llm = smollm2_parse
    runs = []
    for overwrite in (False, True):
        if overwrite:
            llm.collective_rpc(_overwrite_aux_after_drafting)  # for good: no test uses the engine after this one
        parse_vllm.reset_stats(llm)
        outs = _ids(llm.generate(prompts, params))
        stats = parse_vllm.get_stats(llm)
        runs.append((outs, stats["token_level_accepted_tokens"].get("eagle3", 0), stats["drafter_passes"]))
    (outs, accepted, passes), (outs2, accepted2, passes2) = runs
    assert accepted > 0 and passes > 0
    assert (outs2, accepted2, passes2) == (outs, accepted, passes)


def test_server_with_eagle3_is_lossless_and_exports_counters(smollm2_pair, smollm2_alone, tmp_path):
    from openai import OpenAI

    target = smollm2_pair["smollm2-135m-instruct"]
    kw = _real_kwargs(smollm2_pair)
    port = free_port()
    exe = shutil.which("parse-vllm", path=os.path.dirname(sys.executable)) or "parse-vllm"
    cmd = [
        exe, "serve", str(target), "--served-model-name", "smol", "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--enforce-eager", "--block-size", str(BLOCK), "--max-model-len", "1024",
        "--max-num-seqs", "8", "--kv-cache-memory-bytes", str(96 << 20), "--seed", "0",
        "--speculative-config", json.dumps(kw["speculative_config"]),
        "--additional-config", json.dumps(kw["additional_config"]),
    ]  # fmt: skip
    env = {**os.environ}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    with running_server(cmd, tmp_path / "server.log", env) as base:
        client = OpenAI(base_url=base + "/v1", api_key="none")
        for prompt, want in zip(_chat_prompts(target), smollm2_alone):
            for xargs in ({"parse": False}, {"parse_threshold": 1.5}):
                extra = {"vllm_xargs": xargs, "ignore_eos": True, "return_token_ids": True}
                out = client.completions.create(
                    model="smol", prompt=prompt, max_tokens=40, temperature=0.0, extra_body=extra
                )
                assert out.choices[0].token_ids == want, xargs
        body = requests.get(base + "/metrics", timeout=10).text
    accepted = [
        float(line.rsplit(" ", 1)[1])
        for line in body.splitlines()
        if line.startswith("parse:token_level_accepted_tokens_total") and 'proposer="eagle3"' in line
    ]
    assert accepted and sum(accepted) > 0
