"""PARSE behind the OpenAI-compatible server: `parse-vllm serve` with PARSE
flags, an OpenAI client (streaming and not), per-request options through
`vllm_xargs`, and the PARSE counters on /metrics and in the periodic log."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import pytest
import requests
from conftest import BLOCK, WINDOW, running_server

from parse_vllm.tools.server_process import free_port

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory):
    port = free_port()
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    exe = shutil.which("parse-vllm", path=os.path.dirname(sys.executable)) or "parse-vllm"
    cmd = [
        exe,
        "serve",
        str(tiny_models["target"]),
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
        "--speculative-config",
        json.dumps({"method": "draft_model", "model": str(tiny_models["draft"]), "num_speculative_tokens": WINDOW}),
        "--additional-config",
        json.dumps({"parse": {"threshold": 0.5}}),
    ]
    env = {**os.environ, "VLLM_LOG_STATS_INTERVAL": "1", "VLLM_LOGGING_LEVEL": "INFO"}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    with running_server(cmd, log_path, env) as base:
        yield {"base": base, "log": log_path}


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server["base"] + "/v1", api_key="none")


MESSAGES = [{"role": "user", "content": "Write two sentences about rivers."}]


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
    body = requests.get(server["base"] + "/metrics", timeout=10).text

    def value(name):
        vals = [float(l.rsplit(" ", 1)[1]) for l in body.splitlines() if l.startswith(name) and not l.startswith("#")]
        return sum(vals) if vals else None

    assert value("parse:drafts_total") > 0
    assert value("parse:copies_total") > 0
    assert value("parse:verification_passes_total") > 0
    assert value("parse:tokens_accepted_semantic_total") > 0
    assert value("vllm:spec_decode_num_drafts_total") > 0
    assert value("vllm:spec_decode_num_accepted_tokens_total") > 0
    deadline = time.time() + 30
    while time.time() < deadline and "PARSE metrics:" not in Path(server["log"]).read_text():
        time.sleep(1)
    assert "PARSE metrics:" in Path(server["log"]).read_text()
