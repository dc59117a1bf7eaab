"""The OpenAI API surface with PARSE on: `parse-vllm serve` on loopback, an
OpenAI client, one server for the module.

The server's draft is the tiny target cut to its first 3 of 4 layers: it agrees
with the target on about a third of greedy tokens, so vLLM's token-level check
accepts some draft tokens and rejects others, and with τ = 0 PARSE accepts
what the token-level check rejected. `spec_tokens=2` gives requests that
PARSE leaves to token-level speculation (logprobs) two draft tokens per step.

The server is started as README spells PARSE: `"method": "parse"` in
--speculative-config with PARSE's options beside the draft (the plugin rewrites
it into vLLM's draft-model config and the parse section; old spelling and
rewrite: tests/test_speculative_method.py). Its periodic stats log runs every
second, for the PARSE log line.

Also here: per-request options through `vllm_xargs`, the PARSE counters on
/metrics and in the periodic log (one server start shared with the checks
above, where each had a module and a server of its own), and start-up refusals
of the server (the process exits non-zero with a message naming the field, and
leaves no process behind).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
from conftest import BLOCK, V1_BY_TRITON, V2_ENV, WINDOW, running_server

from parse_vllm.tools.server_process import free_port

pytestmark = pytest.mark.slow

ACCEPT_ALL = {"vllm_xargs": {"parse_threshold": 0.0}}
# Judged, yet exactly the target's greedy output (the guard keeps only its argmax).
LOSSLESS = {"vllm_xargs": {"parse_threshold": 1.0, "parse_guard": 1}}
MESSAGES = [{"role": "user", "content": "Write two sentences about rivers."}]
PROMPT = "The river flows to the sea because"


def _serve_cmd(
    target, draft, port, parse: dict, window: int = WINDOW, extra: tuple[str, ...] = (), named: bool = False
) -> list[str]:
    """`parse-vllm serve` with the draft and PARSE's options `parse`: as vLLM's draft-model
    config plus --additional-config, or with `named` as `"method": "parse"` (README)."""
    exe = shutil.which("parse-vllm", path=os.path.dirname(sys.executable)) or "parse-vllm"
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": window}
    if named:
        parse_flags = ["--speculative-config", json.dumps({**spec, "method": "parse", **parse})]
    else:
        parse_flags = ["--speculative-config", json.dumps(spec), "--additional-config", json.dumps({"parse": parse})]
    return [
        exe,
        "serve",
        str(target),
        "--served-model-name",
        "tiny",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--enforce-eager",
        "--block-size",
        str(BLOCK),
        "--max-model-len",
        "1024",
        "--max-num-seqs",
        "8",
        "--kv-cache-memory-bytes",
        str(96 << 20),
        "--seed",
        "0",
        *parse_flags,
        *extra,
    ]


def _session_processes(sid: int) -> list[int]:
    """Live processes of session `sid` (a server started with
    start_new_session=True and everything it spawned, orphans included)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.getsid(int(entry)) == sid:
                with open(f"/proc/{entry}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                        pids.append(int(entry))
        except (ProcessLookupError, PermissionError, FileNotFoundError):
            pass
    return pids


@pytest.fixture(scope="module")
def models(tiny_models, tmp_path_factory):
    from fixtures.tiny_models import make_layer_skip_draft

    root = tmp_path_factory.mktemp("api-models")
    return {
        "target": tiny_models["target"],
        "draft": make_layer_skip_draft(tiny_models["target"], root / "skip3", 3, dtype=None),
    }


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    port = free_port()
    log_path = tmp_path_factory.mktemp("api-server") / "server.log"
    # Compact JSON: the random target would otherwise write whitespace forever.
    compact = json.dumps({"backend": "xgrammar", "disable_any_whitespace": True})
    cmd = _serve_cmd(
        models["target"],
        models["draft"],
        port,
        {"threshold": 0.5, "spec_tokens": 2},
        extra=("--structured-outputs-config", compact),
        named=True,
    )
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "INFO", "VLLM_LOG_STATS_INTERVAL": "1"}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    env.pop(V2_ENV, None)  # the plugin sets it when PARSE is named (checked: V1_BY_TRITON)
    with running_server(cmd, log_path, env) as base:
        yield {"base": base, "log": log_path}


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server["base"] + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def hf_target(models):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(models["target"], dtype=torch.float32).eval()


def _metric(server, name: str) -> float:
    body = requests.get(server["base"] + "/metrics", timeout=10).text
    vals = [
        float(l.rsplit(" ", 1)[1])
        for l in body.splitlines()
        if l.startswith(name) and not l.startswith("#") and not l.startswith(name + "_created")
    ]
    return sum(vals)


def _hf_logprobs(model, prompt_ids, out_ids):
    """log-softmax of the target's logits at each output position [n, vocab]
    (one HF forward over prompt + output, float32)."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([list(prompt_ids) + list(out_ids)])).logits[0]
    n = len(prompt_ids)
    return torch.log_softmax(logits[n - 1 : n - 1 + len(out_ids)].float(), -1)


# -- PARSE named in the speculative config ----------------------------------------------------


def test_parse_vllm_serve_with_parse_method_answers_an_openai_client(server, client):
    """`parse-vllm serve` with `"method": "parse"` (this module's server) answers an OpenAI
    client through PARSE's judged windows, and the plugin set runner V1 before vLLM looked
    for Triton (the variable unset in the server's environment)."""
    before = _metric(server, "parse:drafts_total")
    reply = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=30, extra_body=ACCEPT_ALL)
    assert reply.choices[0].message.content and reply.usage.completion_tokens <= 30
    assert _metric(server, "parse:drafts_total") > before  # the answer came through PARSE's judged windows
    assert V1_BY_TRITON not in Path(server["log"]).read_text()


# -- completions and chat, streaming and not, usage ----------------------------------


def test_completions_usage_counts_each_token_once(server, client):
    """τ = 0 (PARSE accepts whole drafts): usage counts every output token once,
    accepted draft tokens included; streaming gives the same text and usage."""
    before = _metric(server, "parse:tokens_accepted_semantic_total")
    full = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=60, temperature=0.0, extra_body={**ACCEPT_ALL, "return_token_ids": True}
    )
    assert _metric(server, "parse:tokens_accepted_semantic_total") > before  # drafts were accepted
    c = full.choices[0]
    # usage counts the tokens returned, whether the answer ran to max_tokens or stopped
    assert full.usage.completion_tokens == len(c.token_ids)
    assert len(c.token_ids) == 60 if c.finish_reason == "length" else c.finish_reason == "stop"
    assert full.usage.prompt_tokens == len(c.prompt_token_ids)
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    chunks = list(
        client.completions.create(
            model="tiny",
            prompt=PROMPT,
            max_tokens=60,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=ACCEPT_ALL,
        )
    )
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == c.text
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_chat_streaming_in_order(server, client):
    """Streamed chat deltas concatenate to the non-streamed answer and arrive in
    several pieces. (No timing check: on a busy 2-core machine the client can
    receive every piece in one burst, which says nothing about the server.)"""
    kw = dict(model="tiny", messages=MESSAGES, max_tokens=200, temperature=0.0, extra_body=ACCEPT_ALL)
    full = client.chat.completions.create(**kw)
    pieces = []
    for ch in client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        if ch.choices and ch.choices[0].delta.content:
            pieces.append(ch.choices[0].delta.content)
        if ch.usage is not None:
            usage = ch.usage
    assert "".join(pieces) == full.choices[0].message.content
    assert usage.completion_tokens == full.usage.completion_tokens
    assert len(pieces) > 3


def test_max_tokens_stop_and_seed(client):
    base = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=48, temperature=0.0, extra_body=ACCEPT_ALL
    ).choices[0]
    # max_tokens inside an accepted draft
    short = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=WINDOW // 2 + 3,
        temperature=0.0,
        extra_body={**ACCEPT_ALL, "return_token_ids": True},
    )
    assert short.usage.completion_tokens == WINDOW // 2 + 3 and short.choices[0].finish_reason == "length"
    assert base.text.startswith(short.choices[0].text)
    # a stop string in the middle of accepted text
    cut = base.text[len(base.text) // 2 :][:5]
    assert cut.strip()
    stopped = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=48, temperature=0.0, stop=[cut], extra_body=ACCEPT_ALL
    ).choices[0]
    assert stopped.finish_reason == "stop" and cut not in stopped.text
    assert base.text.startswith(stopped.text)
    # seeded sampling through PARSE repeats; another seed differs
    sampled = [
        client.completions.create(
            model="tiny",
            prompt=PROMPT,
            max_tokens=32,
            temperature=1.0,
            seed=s,
            extra_body={"vllm_xargs": {"parse_threshold": 0.3}},
        )
        .choices[0]
        .text
        for s in (11, 11, 12)
    ]
    assert sampled[0] == sampled[1] and sampled[0] != sampled[2]


def test_n_greater_than_one(client):
    out = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=24,
        temperature=1.0,
        seed=3,
        n=3,
        extra_body={**ACCEPT_ALL, "return_token_ids": True},
    )
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert out.usage.completion_tokens == sum(len(c.token_ids) for c in out.choices)
    assert len({c.text for c in out.choices}) > 1
    chat = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=16,
        temperature=0.8,
        seed=5,
        n=2,
        extra_body={**ACCEPT_ALL, "return_token_ids": True},
    )
    assert sorted(c.index for c in chat.choices) == [0, 1]
    assert chat.usage.completion_tokens == sum(len(c.token_ids) for c in chat.choices)
    # vLLM itself refuses n > 1 with greedy sampling (400, not a PARSE matter)
    from openai import BadRequestError

    with pytest.raises(BadRequestError, match="n must be 1"):
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0.0, n=2)


# -- logprobs ---------------------------------------------------------------------------


def test_logprobs_are_the_targets(server, client, hf_target):
    """Requests with logprobs: every token's logprob and top logprobs equal a
    plain HF forward of the target (float32, within 1e-4), including the draft
    tokens token-level speculation accepted; greedy output is the target's."""
    accepted_before = _metric(server, "vllm:spec_decode_num_accepted_tokens_total")
    sem_before = _metric(server, "parse:tokens_accepted_semantic_total")
    out = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=64,
        temperature=0.0,
        logprobs=3,
        extra_body={**ACCEPT_ALL, "return_token_ids": True},
    )
    assert _metric(server, "vllm:spec_decode_num_accepted_tokens_total") > accepted_before
    assert _metric(server, "parse:tokens_accepted_semantic_total") == sem_before  # token-level only
    c = out.choices[0]
    ref = _hf_logprobs(hf_target, c.prompt_token_ids, c.token_ids)
    assert c.token_ids == ref.argmax(-1).tolist()  # lossless
    worst = 0.0
    for k, (t, lp, top) in enumerate(zip(c.token_ids, c.logprobs.token_logprobs, c.logprobs.top_logprobs)):
        worst = max(worst, abs(lp - float(ref[k, t])))
        assert len(top) >= 3
        want_top = ref[k].topk(3)
        got_top = sorted(top.values(), reverse=True)[:3]
        worst = max(worst, max(abs(a - float(b)) for a, b in zip(got_top, want_top.values)))
    assert worst <= 1e-4, worst

    chat = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=32,
        temperature=0.0,
        logprobs=True,
        top_logprobs=2,
        extra_body={**ACCEPT_ALL, "return_token_ids": True},
    )
    ch = chat.choices[0]
    ref = _hf_logprobs(hf_target, chat.prompt_token_ids, ch.token_ids)
    assert ch.token_ids == ref.argmax(-1).tolist()
    for k, (t, item) in enumerate(zip(ch.token_ids, ch.logprobs.content)):
        assert abs(item.logprob - float(ref[k, t])) <= 1e-4
        assert abs(item.top_logprobs[0].logprob - float(ref[k].max())) <= 1e-4


# -- structured output --------------------------------------------------------------------

SCHEMA = {
    "type": "object",
    "properties": {"river": {"type": "string", "maxLength": 40}, "long": {"type": "boolean"}},
    "required": ["river", "long"],
    "additionalProperties": False,
}


def test_structured_output_with_semantic_acceptance(server, client):
    """JSON schema and choice constraints with τ = 0: PARSE accepts draft text
    (inside the JSON string), yet every output parses and matches."""
    import jsonschema

    before = _metric(server, "parse:tokens_accepted_semantic_total")
    prompts = ["Describe a river as JSON.", "Name a long river.", "The Nile?", "Give me data."]
    for i, p in enumerate(prompts):
        out = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": p}],
            max_tokens=120,
            temperature=0.0,
            response_format={"type": "json_schema", "json_schema": {"name": "river", "schema": SCHEMA}},
            extra_body=ACCEPT_ALL if i % 2 == 0 else {"vllm_xargs": {"parse_threshold": 0.5}},
        )
        c = out.choices[0]
        assert c.finish_reason == "stop", c.message.content
        jsonschema.validate(json.loads(c.message.content), SCHEMA)
    assert _metric(server, "parse:tokens_accepted_semantic_total") > before

    choices = ["the Amazon river", "the Danube river", "the Mississippi"]
    for p in prompts[:2]:
        out = client.completions.create(
            model="tiny",
            prompt=p,
            max_tokens=20,
            temperature=0.0,
            extra_body={**ACCEPT_ALL, "structured_outputs": {"choice": choices}},
        )
        assert out.choices[0].text in choices
    out = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=40,
        temperature=0.0,
        extra_body={**ACCEPT_ALL, "structured_outputs": {"regex": r"[a-z ]{10,30}\."}},
    )
    text = out.choices[0].text
    assert out.choices[0].finish_reason == "stop" and text.endswith(".") and 11 <= len(text) <= 31


# -- disconnects and per-request options ---------------------------------------------------


def test_client_disconnect_mid_stream_frees_everything(server, client):
    with requests.post(
        server["base"] + "/v1/completions",
        stream=True,
        timeout=60,
        json={
            "model": "tiny",
            "prompt": PROMPT,
            "max_tokens": 900,
            "temperature": 0.0,
            "stream": True,
            "ignore_eos": True,
            "vllm_xargs": {"parse_threshold": 0.5},
        },
    ) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(l.startswith(b"data: {") for l in got)
    # The connection is closed: vLLM aborts the request and frees its blocks.
    deadline = time.time() + 60
    while time.time() < deadline:
        if _metric(server, "vllm:num_requests_running") == 0 and _metric(server, "vllm:kv_cache_usage_perc") == 0:
            break
        time.sleep(0.5)
    assert _metric(server, "vllm:num_requests_running") == 0
    assert _metric(server, "vllm:kv_cache_usage_perc") == 0
    assert client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4).usage.completion_tokens == 4


@pytest.mark.parametrize(
    "xargs",
    [
        {"parse_threshold": -0.5},
        {"parse_threshold": "nan"},
        {"parse": 2},
        {"parse_mode": "x"},
        {"parse_guard": -1},
        {"parse_guard": 1.5},
    ],
)
def test_bad_vllm_xargs_get_http_400(client, xargs):
    from openai import BadRequestError

    with pytest.raises(BadRequestError, match="parse"):
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, extra_body={"vllm_xargs": xargs})


def test_lossless_over_http(client, hf_target):
    """Guard 1 over HTTP: the target's own greedy tokens (an HF forward checks)."""
    out = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=48,
        temperature=0.0,
        extra_body={**LOSSLESS, "return_token_ids": True},
    )
    ref = _hf_logprobs(hf_target, out.prompt_token_ids, out.choices[0].token_ids)
    assert out.choices[0].token_ids == ref.argmax(-1).tolist()


# -- PARSE per request through vllm_xargs, /metrics and the periodic log -----------------------


def _chat(client, **extra):
    return client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=40, temperature=0.0, seed=0, **extra
    )


def test_chat_completion_non_streaming_and_streaming(client):
    full = _chat(client)
    text = full.choices[0].message.content
    assert text and full.usage.completion_tokens <= 40
    chunks = _chat(client, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text


def test_vllm_xargs_per_request(client):
    # PARSE off and τ > 1 are both lossless: the target's own greedy answer.
    off = _chat(client, extra_body={"vllm_xargs": {"parse": False}}).choices[0].message.content
    strict = _chat(client, extra_body={"vllm_xargs": {"parse_threshold": 1.5}}).choices[0].message.content
    assert off == strict
    # τ = 0 accepts the draft's text, which differs from the target's here.
    loose = _chat(client, extra_body={"vllm_xargs": {"parse_threshold": 0.0}}).choices[0].message.content
    assert loose != off


@pytest.mark.parametrize("xargs", [{"parse_threshold": "high"}, {"parse_tau": 0.3}, {"parse": "maybe"}])
def test_bad_xargs_get_http_400(server, client, xargs):
    from openai import BadRequestError

    with pytest.raises(BadRequestError) as e:
        _chat(client, extra_body={"vllm_xargs": xargs})
    assert "parse" in str(e.value)
    assert _chat(client).choices[0].message.content  # the server is fine


def test_metrics_endpoint_and_log_line(server, client):
    _chat(client, extra_body={"vllm_xargs": {"parse_threshold": 0.5}})
    for name in (
        "parse:drafts_total",
        "parse:copies_total",
        "parse:verification_passes_total",
        "parse:tokens_accepted_semantic_total",
        "vllm:spec_decode_num_drafts_total",
        "vllm:spec_decode_num_accepted_tokens_total",
    ):
        assert _metric(server, name) > 0, name
    deadline = time.time() + 30
    while time.time() < deadline and "PARSE metrics:" not in Path(server["log"]).read_text():
        time.sleep(1)
    assert "PARSE metrics:" in Path(server["log"]).read_text()


# -- start-up refusals of the server ---------------------------------------------------------


@pytest.mark.parametrize("case", ["threshold", "draft_missing", "labels"])
def test_server_refuses_bad_config_and_leaves_nothing(models, tmp_path, case):
    parse, draft, want = {}, models["draft"], None
    if case == "threshold":
        parse, want = {"threshold": -0.2}, "parse.threshold"
    elif case == "draft_missing":
        draft, want = tmp_path / "no-such-draft", "no-such-draft"
    elif case == "labels":
        parse, want = {"labels": ["Correct", "Correctly"]}, "parse.labels"
    cmd = _serve_cmd(models["target"], draft, free_port(), parse)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0
    assert want in out, out[-3000:]
    deadline = time.time() + 30
    while _session_processes(proc.pid) and time.time() < deadline:
        time.sleep(0.5)
    assert _session_processes(proc.pid) == []
