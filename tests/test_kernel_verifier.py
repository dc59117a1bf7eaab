"""The kernel path of the verification pass (parse_vllm/verify/kernel.py)
gives the same judgments as the forked-block-table path.

tests/test_offline.py::test_judgments_equal_separate_target_forwards proves
that the forked-block-table judgments equal plain HF-transformers forwards over
prompt + draft[:b] + suffix (1e-4). Here the kernel path is held to the same
reference, on CPU, without a GPU and without an engine:

- a tiny random float32 Llama (HF transformers); its requests' K/V (prompt +
  whole draft, from HF's own cache) written into standard-layout paged caches
  (vLLM 0.32's GPU per-layer view [num_blocks, Hkv, block_size, 2*D] in two
  physical orders, and one split into kernel blocks), random non-contiguous
  block tables, block sizes 16 and 32, prefixes ending on and off block edges;
- `KernelVerifier.judge` itself, over a stand-in runner whose "model" runs the
  HF model's own layers (embeddings, q/k/v projections, RoPE, o_proj, MLP,
  norms, lm_head) with real vLLM `Attention` modules for attention. So each
  layer's attention goes the GPU way: `Attention.forward` ->
  `unified_kv_cache_update` (no slot mapping: nothing written) ->
  `unified_attention_with_output` -> the `PrefixVerifyAttentionImpl` wrapper
  -> `prefix_verify_layer_attention` -> the compiled op, reading the cache
  through `_vllm.standard_kv_cache_views`. The layers' own backend is a test
  backend whose impl fails if anything reaches it.

Only the GPU model's own forward and the GPU backends' caches are not here.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from parse_vllm import ops
from parse_vllm._vllm import TargetAccess
from parse_vllm.ops import PrefixVerifyMetadata
from parse_vllm.verify import CopyBatch
from parse_vllm.verify.kernel import KernelVerifier, PrefixVerifyAttentionImpl

NUM_LAYERS, HQ, HKV, D = 2, 4, 2, 32
TOL = 1e-4


# -- vLLM pieces: a test backend with the standard layout -------------------


def _test_backend():
    from vllm.v1.attention.backend import AttentionBackend, AttentionImpl

    class NeverCalledImpl(AttentionImpl):
        """The layers' "own" impl: the kernel path must never reach it."""

        def __init__(
            self,
            num_heads,
            head_size,
            scale,
            num_kv_heads=None,
            alibi_slopes=None,
            sliding_window=None,
            kv_cache_dtype="auto",
            logits_soft_cap=None,
            attn_type="decoder",
            kv_sharing_target_layer_name=None,
            **kw,
        ):
            self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
            self.num_kv_heads = num_kv_heads
            self.alibi_slopes = alibi_slopes
            self.logits_soft_cap = logits_soft_cap or 0
            self.kv_cache_dtype = kv_cache_dtype

        def forward(self, *args, **kwargs):
            raise AssertionError("the backend's own attention ran in a kernel verification pass")

        def do_kv_cache_update(self, *args, **kwargs):
            raise AssertionError("the backend wrote KV in a kernel verification pass")

    class StandardLayoutBackend(AttentionBackend):
        parse_standard_kv_layout = True  # opt-in read by _vllm.kernel_verify_unsupported
        forward_includes_kv_cache_update = False
        supported_dtypes = [torch.float32, torch.float16, torch.bfloat16]

        @staticmethod
        def get_name() -> str:
            return "CUSTOM"

        @staticmethod
        def get_impl_cls():
            return NeverCalledImpl

        @staticmethod
        def get_builder_cls():
            raise NotImplementedError

    return StandardLayoutBackend


class HFDrivenTarget(torch.nn.Module):
    """The HF Llama's own layers, with vLLM `Attention` modules doing the
    attention; the call signature of a vLLM model."""

    def __init__(self, hf, attn):
        super().__init__()
        self.hf = hf
        self.attn = torch.nn.ModuleList(attn)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        m = self.hf.model
        T = input_ids.shape[0]
        h = m.embed_tokens(input_ids.long())
        cos, sin = m.rotary_emb(h[None], positions[None].long())
        for layer, attn in zip(m.layers, self.attn):
            sa = layer.self_attn
            x = layer.input_layernorm(h)
            q = sa.q_proj(x).view(1, T, HQ, D)
            k = sa.k_proj(x).view(1, T, HKV, D)
            q, k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=2)
            o = attn(q.reshape(T, HQ * D), k.reshape(T, HKV * D), sa.v_proj(x))
            h = h + sa.o_proj(o)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return m.norm(h)

    def compute_logits(self, hidden):
        return self.hf.lm_head(hidden)


# -- fixtures -----------------------------------------------------------------


@pytest.fixture(scope="module")
def env(tmp_path_factory, smollm2_dir):
    from fixtures.tiny_models import make_tiny_model
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.attention.attention import Attention

    from parse_vllm.config import ParseConfig
    from parse_vllm.templates import build_template

    path = make_tiny_model(
        tmp_path_factory.mktemp("kv") / "target",
        smollm2_dir,
        num_layers=NUM_LAYERS,
        hidden_size=128,
        intermediate_size=256,
        num_heads=HQ,
        num_kv_heads=HKV,
    )
    tok = AutoTokenizer.from_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    template = build_template(tok, ParseConfig())
    cfg = VllmConfig(model_config=ModelConfig(model=str(path), dtype="float32"))
    backend = _test_backend()
    scale = hf.model.layers[0].self_attn.scaling
    with set_current_vllm_config(cfg):
        attn = [
            Attention(HQ, D, scale, num_kv_heads=HKV, prefix=f"model.layers.{i}.self_attn.attn", attn_backend=backend)
            for i in range(NUM_LAYERS)
        ]
        cpu_attn = [
            Attention(HQ, D, scale, num_kv_heads=HKV, prefix=f"cpu.layers.{i}.self_attn.attn")
            for i in range(NUM_LAYERS)
        ]

    rng = np.random.default_rng(0)
    questions = [
        "Why is the sky blue?",
        "Write a poem about the sea, please.",
        "What is 2+2?",
        "Tell me a story about a dragon who learns to fly over the mountains at night.",
    ]
    requests = []
    for i, text in enumerate(questions):
        chat = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
        prompt = tok.encode(chat, add_special_tokens=False)
        draft = rng.integers(200, 30000, size=40 + 13 * i).tolist()
        with torch.no_grad():
            cache = hf(torch.tensor([prompt + draft]), use_cache=True).past_key_values
        kv = [
            (
                cache.layers[j].keys[0].transpose(0, 1).contiguous(),  # [n, Hkv, D], after RoPE
                cache.layers[j].values[0].transpose(0, 1).contiguous(),
            )
            for j in range(NUM_LAYERS)
        ]
        requests.append(SimpleNamespace(prompt=prompt, draft=draft, kv=kv))

    reference: dict[tuple[int, ...], tuple[float, float]] = {}

    def hf_logits(tokens: list[int]) -> tuple[float, float]:
        """(log P(yes), log P(no)) of a plain full-sequence HF forward, each
        label's tokens summed (label token j read at the suffix's last token
        plus j)."""
        key = tuple(tokens)
        if key not in reference:
            labels = template.labels
            with torch.no_grad():
                logits = hf(torch.tensor([tokens + list(template.suffix_ids)])).logits[0, -labels.rows :]
            lp = torch.log_softmax(logits.float(), -1)
            reference[key] = tuple(
                sum(float(lp[j, x]) for j, x in enumerate(ids)) for ids in (labels.yes_ids, labels.no_ids)
            )
        return reference[key]

    return SimpleNamespace(
        cfg=cfg,
        hf=hf,
        tok=tok,
        template=template,
        attn=attn,
        cpu_attn=cpu_attn,
        requests=requests,
        hf_logits=hf_logits,
        names=[a.layer_name for a in attn],
    )


def _make_cache(num_blocks: int, block_size: int, physical: str, gen: torch.Generator):
    """Random-filled logical [num_blocks, Hkv, block_size, 2*D] cache
    ("HND": that order in memory; "NHD": [num_blocks, block_size, Hkv, 2*D]
    in memory) and its raw storage."""
    if physical == "HND":
        raw = torch.randn(num_blocks, HKV, block_size, 2 * D, generator=gen)
        return raw, raw
    raw = torch.randn(num_blocks, block_size, HKV, 2 * D, generator=gen)
    return raw.transpose(1, 2), raw


def _boundaries(prompt_len: int, draft_len: int, block: int) -> list[int]:
    """Ascending boundaries: the prefix ends on block edges (of `block` and
    of its half), just before/after them, early, and at the whole draft."""
    b = {1, draft_len}
    for edge in (block, block // 2):
        first = -prompt_len % edge or edge
        for x in (first - 1, first, first + 1, first + edge):
            if 1 <= x <= draft_len:
                b.add(x)
    return sorted(b)


def _setup(env, *, block: int, physical: str, kernel_block: int | None, seed: int):
    """Caches + block tables + a stand-in runner; returns (runner, copies, tokens per copy, caches)."""
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    reqs = env.requests
    need = [-(-(len(r.prompt) + len(r.draft)) // block) for r in reqs]
    num_blocks = sum(need) + 7
    max_reqs, max_blocks = 8, max(need) + 2
    # Request i sits in input-batch row rows[i]; blocks are a random
    # permutation (non-contiguous); other rows and slots hold junk ids.
    rows = [5, 0, 3, 6]
    table = rng.integers(0, num_blocks, size=(max_reqs, max_blocks)).astype(np.int32)
    perm = rng.permutation(num_blocks)
    start = 0
    for i in range(len(reqs)):
        table[rows[i], : need[i]] = perm[start : start + need[i]]
        start += need[i]
    manager_views, bound = [], []
    for layer in range(NUM_LAYERS):
        logical, raw = _make_cache(num_blocks, block, physical, gen)
        for i, r in enumerate(reqs):
            k, v = r.kv[layer]
            pos = np.arange(k.shape[0])
            blk = torch.from_numpy(table[rows[i], pos // block].astype(np.int64))
            off = torch.from_numpy(pos % block)
            logical[blk, :, off, :D] = k  # vLLM GPU layout: K in content [0, D), V in [D, 2D)
            logical[blk, :, off, D:] = v
        manager_views.append(logical)
        if kernel_block is None:
            bound.append(logical)
        else:  # the kernel-block view vLLM binds (NHD memory only splits evenly)
            assert physical == "NHD"
            bound.append(raw.view(num_blocks * (block // kernel_block), kernel_block, HKV, 2 * D).transpose(1, 2))
    for a, kv in zip(env.attn, bound):
        a.bind_kv_cache(kv)

    group = SimpleNamespace(
        layer_names=env.names,
        kernel_block_size=kernel_block,
        kernel_block_stride=0,
        kv_cache_spec=SimpleNamespace(block_size=block),
    )
    runner = SimpleNamespace(
        device=torch.device("cpu"),
        model=HFDrivenTarget(env.hf, env.attn),
        vllm_config=env.cfg,
        input_batch=SimpleNamespace(block_table=[SimpleNamespace(get_numpy_array=lambda: table)]),
        attn_groups=[[group]],
    )
    req_row, prefix, tokens = [], [], []
    for i, r in enumerate(reqs):
        for b in _boundaries(len(r.prompt), len(r.draft), block):
            req_row.append(rows[i])
            prefix.append(len(r.prompt) + b)
            tokens.append(r.prompt + r.draft[:b])
    copies = CopyBatch(req_row=np.array(req_row), prefix_len=np.array(prefix))
    return runner, copies, tokens, manager_views, num_blocks


def _verifier(env, runner, manager_views, num_blocks, block, **kw):
    t = env.template
    return KernelVerifier(
        TargetAccess(runner),
        suffix_ids=t.suffix_ids,
        labels=t.labels,
        kv_cache_group_id=0,
        layer_names=env.names,
        layer_caches=manager_views,
        num_blocks=num_blocks,
        block_size=block,
        scratch_ids=np.arange(0),
        check_isolation=True,
        **kw,
    )


# -- tests --------------------------------------------------------------------


def test_compiled_op_is_used():
    """The kernel path calls the compiled op (no reference fallback here)."""
    assert ops.has_compiled_op(), ops.compiled_op_error()


@pytest.mark.parametrize(
    "block,physical,kernel_block,max_tokens",
    [(16, "HND", None, None), (32, "NHD", None, None), (32, "NHD", 16, 200)],
    ids=["block16-HND", "block32-NHD", "block32-kernel16-NHD-chunked"],
)
def test_kernel_judgments_equal_full_target_forwards(env, block, physical, kernel_block, max_tokens):
    """KernelVerifier.judge == plain HF forwards over prompt + draft[:b] +
    suffix: every logit within 1e-4, identical pass/fail; no cache byte written."""
    runner, copies, tokens, manager_views, num_blocks = _setup(
        env, block=block, physical=physical, kernel_block=kernel_block, seed=block + (kernel_block or 0)
    )
    prefix = copies.prefix_len
    assert (prefix % block == 0).any() and (prefix % block != 0).any()  # on and off block edges
    assert len(copies.req_row) >= 20 and len(set(copies.req_row.tolist())) == 4
    v = _verifier(env, runner, manager_views, num_blocks, block, max_tokens_per_pass=max_tokens)
    impls = [a.impl for a in env.attn]
    before = [c.clone() for c in manager_views]

    j = v.judge(copies)

    assert [a.impl for a in env.attn] == impls  # wrappers removed again
    assert all(torch.equal(a, b) for a, b in zip(before, manager_views))  # the whole cache, bit for bit
    assert j.requests_kv_unchanged is True
    C = len(tokens)
    expected_passes = 1 if max_tokens is None else -(-C // (max_tokens // v.suffix_len))
    assert j.passes == expected_passes and (max_tokens is None or j.passes > 1)
    want = np.array([env.hf_logits(t) for t in tokens])  # [C, 2]
    got = np.stack([j.logprob_yes, j.logprob_no], axis=1)
    worst = float(np.abs(got - want).max())
    assert worst <= TOL, f"max |logit diff| {worst}"
    p_want = 1 / (1 + np.exp(want[:, 1] - want[:, 0]))
    p_got = j.p_yes
    assert np.abs(p_got - p_want).max() <= TOL
    assert ((p_got >= 0.5) == (p_want >= 0.5)).all()
    # A threshold that splits the copies, so pass/fail is compared on both
    # sides; in log-odds (log P(yes) - log P(no)), where P(yes) is monotone
    # and random weights do not saturate it (a 2-token label is ~e^-10 less
    # likely here, so every P(yes) is within 1e-4 of 1).
    d_want, d_got = want[:, 0] - want[:, 1], got[:, 0] - got[:, 1]
    s = np.sort(d_want)
    gaps = np.diff(s)
    k = int(np.argmax(gaps))
    assert gaps[k] > 10 * TOL
    tau = (s[k] + s[k + 1]) / 2
    assert ((d_got >= tau) == (d_want >= tau)).all()
    assert 0 < (d_want >= tau).sum() < C
    print(
        f"\n{block=} {physical=} {kernel_block=}: {C} copies, {j.passes} passes, max |logit diff| {worst:.2e}, "
        f"P(yes) in [{p_want.min():.3f}, {p_want.max():.3f}]"
    )


def test_kernel_judgments_with_a_judge_head_are_its_read_out_of_the_target_hidden_state(env):
    """With a judge head the kernel path's judgment is the head's read-out of the same
    hidden state a plain HF forward ends the chat suffix with, as on the forked path
    (tests/test_judge_head.py): both verifiers share VerifierBase's read-out."""
    from parse_vllm.judge_head import HeadIdentity, JudgeHead, ReadOut

    runner, copies, tokens, manager_views, num_blocks = _setup(env, block=16, physical="HND", kernel_block=None, seed=5)
    H = env.hf.config.hidden_size
    rng = np.random.default_rng(3)
    identity = HeadIdentity("tiny", "LlamaForCausalLM", H, NUM_LAYERS, 0, (), "", ("a", "b"), ((), ()), {})
    head = JudgeHead(rng.normal(size=H + 1), 0.2, rng.normal(size=H + 1), rng.uniform(0.5, 2, H + 1),
                     ("hidden", "zero_shot_logit"), identity)  # fmt: skip
    v = _verifier(env, runner, manager_views, num_blocks, 16, read_out=ReadOut(head, "cpu"))
    j = v.judge(copies)
    chat = list(env.template.suffix_ids[: len(env.template.suffix_ids) - len(env.template.labels.extension)])
    for c, t in enumerate(tokens):
        with torch.no_grad():
            h = env.hf(torch.tensor([t + chat]), output_hidden_states=True).hidden_states[-1][0, -1].numpy()
        ly, ln = env.hf_logits(t)
        assert np.abs(j.hidden[c] - h).max() <= TOL
        assert abs(j.logit[c] - head.logit(h[None], np.array([ly - ln]))[0]) <= 1e-3


def test_standard_kv_cache_views_read_vllm_layouts():
    """The views the kernel reads are the K and V vLLM's GPU backends keep:
    logical [B, Hkv, N, 2D] (K = content [0, D), V = [D, 2D)) in either
    memory order, and the older [2, B, N, Hkv, D]; views, not copies."""
    from parse_vllm import _vllm

    gen = torch.Generator().manual_seed(1)
    for physical in ("HND", "NHD"):
        logical, raw = _make_cache(6, 16, physical, gen)
        k, v = _vllm.standard_kv_cache_views(logical, D)
        assert k.shape == v.shape == (6, 16, HKV, D)
        assert torch.equal(k, logical.permute(0, 2, 1, 3)[..., :D])
        assert torch.equal(v, logical.permute(0, 2, 1, 3)[..., D:])
        assert k.stride(-1) == 1 and k.untyped_storage().data_ptr() == raw.untyped_storage().data_ptr()
    legacy = torch.randn(2, 6, 16, HKV, D, generator=gen)
    k, v = _vllm.standard_kv_cache_views(legacy, D)
    assert k.data_ptr() == legacy[0].data_ptr() and v.data_ptr() == legacy[1].data_ptr()
    with pytest.raises(ValueError, match="unknown KV cache layout"):
        _vllm.standard_kv_cache_views(torch.zeros(6, HKV, 16, 3 * D), D)


def test_impl_wrapper_delegates_everything_else_untouched(env):
    """Non-PARSE metadata, KV writes outside a PARSE forward and every other
    attribute go to the wrapped impl as they came; KV writes inside one are
    dropped."""
    from vllm.forward_context import set_forward_context

    calls = []

    class Inner:
        num_heads = HQ
        sentinel = object()

        def forward(self, *args, **kwargs):
            calls.append(("forward", args, kwargs))
            return self.sentinel

        def do_kv_cache_update(self, *args, **kwargs):
            calls.append(("update", args, kwargs))

    inner = Inner()
    w = PrefixVerifyAttentionImpl(inner)
    layer = SimpleNamespace(layer_name="model.layers.0.self_attn.attn")
    q, k, v, kv, out, md = (torch.zeros(1) for _ in range(6))
    assert w.forward(layer, q, k, v, kv, md, output=out, output_scale=None, output_block_scale=None) is inner.sentinel
    name, args, kwargs = calls.pop()
    assert name == "forward" and all(a is b for a, b in zip(args, (layer, q, k, v, kv, md)))
    assert kwargs.keys() == {"output", "output_scale", "output_block_scale"} and kwargs["output"] is out
    assert w.forward(layer, q, k, v, kv, None, out) is inner.sentinel  # profiling run: metadata None
    assert calls.pop()[1][5:] == (None, out)
    slots = torch.zeros(1, dtype=torch.long)
    w.do_kv_cache_update(layer, k, v, kv, slots)  # no forward context
    assert calls.pop()[1] == (layer, k, v, kv, slots)
    pv = PrefixVerifyMetadata(
        block_table=torch.zeros(1, 1, dtype=torch.int32),
        copy_req=torch.zeros(0),
        copy_prefix_len=torch.zeros(0),
        cu_copy_lens=torch.zeros(1),
        num_actual_tokens=0,
        scale=1.0,
    )
    with set_forward_context({layer.layer_name: pv}, env.cfg, num_tokens=1, slot_mapping={}):
        w.do_kv_cache_update(layer, k, v, kv, slots)
    assert calls == []  # dropped
    with set_forward_context({layer.layer_name: md}, env.cfg, num_tokens=1, slot_mapping={}):
        w.do_kv_cache_update(layer, k, v, kv, slots)
    assert calls.pop()[0] == "update"
    assert w.num_heads == HQ and w.inner is inner
    w.extra_attr = 3
    assert inner.extra_attr == 3


def test_refuses_cpu_backend(env):
    """vLLM's CPU backend packs KV per ISA: the kernel verifier refuses it,
    naming the backend and the alternative."""
    assert env.cpu_attn[0].attn_backend.get_name() == "CPU_ATTN"
    runner = SimpleNamespace(device=torch.device("cpu"), model=torch.nn.ModuleList(env.cpu_attn), vllm_config=env.cfg)
    t = env.template
    with pytest.raises(NotImplementedError, match=r"CPU attention backend \(CPU_ATTN\).*ForkedBlockTableVerifier"):
        KernelVerifier(
            TargetAccess(runner),
            suffix_ids=t.suffix_ids,
            labels=t.labels,
            kv_cache_group_id=0,
            layer_names=[a.layer_name for a in env.cpu_attn],
            layer_caches=[],
            num_blocks=8,
            block_size=32,
        )


def test_refuses_unknown_backend_layout(env, monkeypatch):
    """A backend whose cache layout is not known to be standard is refused."""
    backend = env.attn[0].attn_backend
    runner, copies, tokens, manager_views, num_blocks = _setup(env, block=16, physical="HND", kernel_block=None, seed=3)
    for a in env.attn:
        monkeypatch.setattr(a, "attn_backend", type("Unknown", (backend,), {"parse_standard_kv_layout": False}))
    with pytest.raises(NotImplementedError, match="KV cache layout"):
        _verifier(env, runner, manager_views, num_blocks, 16)
