"""Unit tests of the pieces without an engine: options, boundaries,
acceptance, phases, templates, YAML configs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from parse_vllm.acceptance import final_accept_len, maximal_valid_prefix, view_draft
from parse_vllm.boundaries import BoundaryRule, is_sentence_end, sentence_end_mask
from parse_vllm.config import ParseConfig, ParseConfigError, parse_section, request_options
from parse_vllm.policy import Phase, RequestState

ROOT = Path(__file__).resolve().parents[1]


# -- options -----------------------------------------------------------------


def test_defaults_are_valid_and_documented():
    cfg = ParseConfig.from_dict({})
    assert cfg.threshold == 0.5 and cfg.boundaries == "sentence" and cfg.on_reject == "continue"
    readme = (ROOT / "README.md").read_text()
    for name in ParseConfig.__dataclass_fields__:
        assert f"`{name}`" in readme, f"option {name} is not documented in README"


def test_every_metric_is_documented():
    from parse_vllm.metrics import COUNTERS, LABELLED

    doc = (ROOT / "docs" / "serving.md").read_text()
    for name in COUNTERS:
        assert f"| `parse:{name}_total` |" in doc, f"metric {name} is not in docs/serving.md"
    for name, (label, _) in LABELLED.items():
        assert f"| `parse:{name}_total{{{label}}}` |" in doc, f"metric {name} is not in docs/serving.md"


@pytest.mark.parametrize(
    "raw, needle",
    [
        ({"threshhold": 0.5}, "unknown PARSE option"),
        ({"threshold": -0.1}, ">= 0"),
        ({"threshold": "high"}, "must be a number"),
        ({"boundaries": "paragraph"}, "must be one of"),
        ({"every": 0}, ">= 1"),
        ({"max_boundaries": 2.5}, "integer"),
        ({"on_reject": "stop"}, "must be one of"),
        ({"labels": ["Yes"]}, "two non-empty strings"),
        ({"labels": ["Yes", "Yes"]}, "must differ"),
        ({"two_stage": "yes"}, "true or false"),
        ({"question": "  "}, "non-empty"),
        ({"guard": -1}, "integer >= 0"),
        ({"guard": 2.5}, "integer >= 0"),
        ({"guard": True}, "integer >= 0"),
        ({"adaptive_step_costs": {"step": 0.01}}, 'read only by on_reject "adaptive"'),
        ({"on_reject": "adaptive", "adaptive_step_costs": {}}, "non-empty object of seconds"),
        ({"on_reject": "adaptive", "adaptive_step_costs": {"steps": 0.01}}, r"unknown feature\(s\) \['steps'\]"),
        ({"on_reject": "adaptive", "adaptive_step_costs": {"step": -1}}, r"\['step'\] must be a finite number"),
        ({"on_reject": "adaptive", "adaptive_step_costs": {"step": "1ms"}}, "finite number of seconds"),
    ],
)
def test_bad_engine_options_are_refused(raw, needle):
    with pytest.raises(ParseConfigError, match=needle):
        ParseConfig.from_dict(raw)


def test_threshold_head_is_the_judge_heads_tau_head(tmp_path):
    """parse.threshold "head": the τ_head the named head records; refused, saying why, without
    a head, with a head trained before the rule, or per request (a number there)."""
    from parse_vllm.judge_head import HeadIdentity, JudgeHead, resolve_head_path

    ident = HeadIdentity(target="tiny", architecture="LlamaForCausalLM", hidden_size=4, num_layers=1,
                         vocab_size=10, suffix_ids=(1,), question="Q?", labels=("Correct", "Incorrect"),
                         label_ids=((2,), (3,)), boundaries={"mode": "sentence", "every": 32, "max_boundaries": 8})  # fmt: skip

    def head(training, name):
        h = JudgeHead(np.ones(4), 0.0, np.zeros(4), np.ones(4), ("hidden",), ident, training=training)
        return str(h.save(tmp_path / name))

    with_tau = head({"tau_head": {"tau": 0.625, "rule": "r"}}, "h.safetensors")
    assert ParseConfig.from_dict({"threshold": "head", "judge_head": with_tau}).threshold == 0.625
    with pytest.raises(ParseConfigError, match="takes τ_head from parse.judge_head: name one"):
        ParseConfig.from_dict({"threshold": "head"})
    with pytest.raises(ParseConfigError, match="records no τ_head"):
        ParseConfig.from_dict({"threshold": "head", "judge_head": head({}, "old.safetensors")})
    with pytest.raises(ParseConfigError, match='must be a number \\(or "head" in parse.threshold\\)'):
        ParseConfig.from_dict({"threshold": "hed", "judge_head": with_tau})
    with pytest.raises(ParseConfigError, match="parse_threshold must be a number, got 'head'"):
        request_options({"parse_threshold": "head"}, ParseConfig())
    # the Coder preset runs the shipped head at the τ its training chose
    from parse_vllm.presets import load_preset

    preset = load_preset(ROOT / "configs" / "qwen2.5-coder-1.5b-0.5b-cpu.yaml")
    assert preset.parse["threshold"] == "head"
    shipped = JudgeHead.load(resolve_head_path(preset.parse["judge_head"])).tau
    assert shipped is not None and ParseConfig.from_dict(preset.parse).threshold == shipped


def test_parse_section_names_parse():
    assert parse_section({}) is None
    assert parse_section(None) is None
    assert parse_section({"parse": {}}) == {}
    assert parse_section({"parse": True}) == {}
    with pytest.raises(ParseConfigError):
        parse_section({"parse": 3})


def test_request_options():
    cfg = ParseConfig(threshold=0.6)
    assert request_options(None, cfg).enabled and request_options(None, cfg).threshold == 0.6
    assert not request_options({"parse": False}, cfg).enabled
    assert not request_options({"parse": "off"}, cfg).enabled
    assert request_options({"parse": 1, "parse_threshold": 0.9}, cfg).threshold == 0.9
    assert request_options({"other_plugin": "x"}, cfg).enabled  # not ours
    with pytest.raises(ParseConfigError, match="unknown PARSE request option"):
        request_options({"parse_tau": 0.3}, cfg)
    with pytest.raises(ParseConfigError):
        request_options({"parse_threshold": "abc"}, cfg)
    with pytest.raises(ParseConfigError):
        request_options({"parse": "maybe"}, cfg)
    # the token guard: engine default, per-request override (vllm_xargs may
    # carry it as a float or a string), bad values refused
    assert request_options(None, ParseConfig(guard=5)).guard == 5
    assert request_options({"parse_guard": 3}, cfg).guard == 3
    assert request_options({"parse_guard": 2.0}, cfg).guard == 2
    assert request_options({"parse_guard": "1"}, cfg).guard == 1
    for bad in (-1, 1.5, "top3", None, [1]):
        with pytest.raises(ParseConfigError, match="parse_guard must be an integer >= 0"):
            request_options({"parse_guard": bad}, cfg)


def test_guard_mask_top_k():
    from parse_vllm.acceptance import guard_mask

    logits = torch.tensor(
        [
            [0.0, 3.0, 1.0, 2.0],  # ranks: 1 -> 0, 3 -> 1, 2 -> 2, 0 -> 3
            [5.0, 1.0, 1.0, 0.0],
        ]
    )
    draft = torch.tensor([3, 2])
    assert guard_mask(logits, draft, 1).tolist() == [False, False]
    assert guard_mask(logits, draft, 2).tolist() == [True, True]  # row 1: a tie at the 2nd value passes
    assert guard_mask(logits, torch.tensor([2, 3]), 3).tolist() == [True, False]
    assert guard_mask(logits, torch.tensor([0, 3]), 3).tolist() == [False, False]
    assert guard_mask(logits, torch.tensor([1, 0]), 1).tolist() == [True, True]  # argmax
    assert guard_mask(logits, draft, 100).tolist() == [True, True]  # k beyond the vocabulary


# -- boundaries ----------------------------------------------------------------


def test_sentence_end_text_rule():
    for text in [".", " end.", "?", '!"', ".)", "\n", "x\n", "。"]:
        assert is_sentence_end(text), text
    for text in ["the", " ,", "3", " (", ""]:
        assert not is_sentence_end(text), text


def _rule(mode="sentence", every=4, k=8, ends=(5,)):
    mask = np.zeros(10, dtype=bool)
    mask[list(ends)] = True
    return BoundaryRule(mode, every, k, mask)


def test_boundaries_sentence_tokens_both():
    draft = np.array([1, 2, 5, 3, 3, 5, 1, 1, 2, 1])  # sentence ends after tokens 3 and 6
    assert _rule("sentence").select(draft).tolist() == [3, 6, 10]
    assert _rule("tokens", every=4).select(draft).tolist() == [4, 8, 10]
    assert _rule("both", every=4).select(draft).tolist() == [3, 4, 6, 8, 10]
    assert _rule().select(np.zeros(0, dtype=np.int64)).tolist() == []
    # The whole draft is always judged (the holistic check), even when it
    # ends on a sentence end already.
    assert _rule().select(np.array([1, 5])).tolist() == [2]


def test_boundaries_capped_keep_last_and_spread():
    draft = np.full(40, 5)  # every token ends a sentence
    b = _rule(k=4).select(draft)
    assert b.shape[0] == 4 and b[-1] == 40 and b[0] == 1
    assert np.all(np.diff(b) > 0)


def test_sentence_end_mask_from_tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    mask = sentence_end_mask(tok, len(tok))
    ids = tok.encode("Hello world. How are you?\nFine", add_special_tokens=False)
    ends = [tok.decode([i]) for i in ids if mask[i]]
    assert ends and all(("." in e) or ("?" in e) or ("\n" in e) for e in ends)
    assert not mask[tok.eos_token_id]


# -- acceptance ------------------------------------------------------------------


def test_maximal_valid_prefix():
    bounds = np.array([3, 6, 10, 4, 8, 2])
    passed = np.array([True, False, True, True, True, False])
    cu = np.array([0, 3, 5, 6])
    l_sem, first_fail = maximal_valid_prefix(bounds, passed, cu)
    # Request 0: b=3 passes, b=6 fails -> 3 even though b=10 "passes".
    assert l_sem.tolist() == [3, 8, 0]
    assert first_fail.tolist() == [1, -1, 0]


def test_view_draft_stops_and_limits():
    draft = np.array([7, 8, 2, 9])  # 2 = EOS
    v = view_draft(draft, frozenset({2}), output_len=1, max_tokens=100, min_tokens=0)
    assert (v.text_len, v.stop_index, v.stop_allowed) == (2, 2, True)
    # min_tokens=5: the EOS would be output token 1 + 2 = 3 < 5
    assert not view_draft(draft, frozenset({2}), 1, 100, 5).stop_allowed
    # placeholder (-1) and out-of-vocab drafts are not text
    assert view_draft(np.array([7, -1, -1]), frozenset(), 1, 100, 0).text_len == 1
    assert view_draft(np.array([7, 8, 99]), frozenset(), 1, 100, 0, vocab_size=50).text_len == 2
    # max_tokens caps what may be judged
    assert view_draft(np.array([7, 8, 9, 9]), frozenset(), 1, 3, 0).text_len == 2
    # Judged valid to its EOS: the EOS is accepted too; else max(L_sem, L_tok).
    assert final_accept_len(2, 0, v) == 3
    assert final_accept_len(1, 0, v) == 1
    assert final_accept_len(1, 3, v) == 3
    no_eos = view_draft(draft, frozenset({2}), 1, 100, 5)
    assert final_accept_len(2, 0, no_eos) == 2


# -- phases --------------------------------------------------------------------


def test_phases_continue_and_redraft():
    from parse_vllm.config import RequestOptions

    opts = RequestOptions(enabled=True, threshold=0.5)
    cont = ParseConfig(on_reject="continue", spec_tokens=3)
    s = RequestState(opts)
    assert s.judging and s.draft_len(cont, 64) == 64
    s.after_judged_draft(cont, rejected=False)
    assert s.phase is Phase.DRAFT
    s.after_judged_draft(cont, rejected=True)
    assert s.phase is Phase.CONTINUE and not s.judging and s.draft_len(cont, 64) == 3

    red = ParseConfig(on_reject="redraft", redraft_tokens=4, max_rounds=2)
    mask = np.zeros(100, dtype=bool)
    mask[50] = True
    s = RequestState(opts)
    s.after_judged_draft(red, rejected=True)
    assert s.phase is Phase.REWRITE
    assert not s.after_tokens([1, 2], mask)  # 2 of 4 tokens written
    assert s.after_tokens([3, 4], mask) and s.phase is Phase.DRAFT and s.rounds == 1
    s.after_judged_draft(red, rejected=True)
    assert s.after_tokens([50], mask) and s.rounds == 2  # a sentence end ends the rewrite early
    s.after_judged_draft(red, rejected=True)
    assert s.phase is Phase.CONTINUE  # max_rounds reached

    off = RequestState(RequestOptions(enabled=False, threshold=0.5))
    assert not off.judging and off.draft_len(cont, 64) == 3


def test_guard_cut_shortens_the_window_and_it_grows_back():
    from parse_vllm.policy import GUARD_MIN_WINDOW

    cfg = ParseConfig(guard=3)
    s = RequestState(request_options(None, cfg))
    s.after_judged_draft(cfg, rejected=False, guard_cut=True, accepted=2, window=64)
    assert s.phase is Phase.DRAFT and s.draft_len(cfg, 64) == GUARD_MIN_WINDOW
    s.after_judged_draft(cfg, rejected=False, guard_cut=True, accepted=10, window=64)
    assert s.draft_len(cfg, 64) == 20
    s.after_judged_draft(cfg, rejected=False, window=64)  # taken whole: doubles
    assert s.draft_len(cfg, 64) == 40
    s.after_judged_draft(cfg, rejected=False, window=64)
    assert s.draft_len(cfg, 64) == 64 and s.window_cap == 0
    s.after_judged_draft(cfg, rejected=True, window=64)  # the judge's rejection: on_reject as before
    assert s.phase is Phase.CONTINUE


# -- templates -------------------------------------------------------------------


def test_verification_suffix_from_chat_template(smollm2_dir):
    from transformers import AutoTokenizer

    from parse_vllm.templates import build_template

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    cfg = ParseConfig()
    t = build_template(tok, cfg)
    assert t.suffix_text == ("<|im_end|>\n<|im_start|>user\n" + cfg.question + "<|im_end|>\n<|im_start|>assistant\n")
    assert t.suffix_ids[0] == tok.convert_tokens_to_ids("<|im_end|>")
    chat = t.suffix_ids[: len(t.suffix_ids) - len(t.labels.extension)]
    assert tok.decode(chat) == t.suffix_text
    # SmolLM2 reads "Correct" as one token and "Incorrect" as "In" + "correct":
    # the longer label's first token is appended to the suffix, and both are
    # scored whole.
    assert [tok.decode([x]) for x in t.labels.yes_ids] == ["Correct"]
    assert [tok.decode([x]) for x in t.labels.no_ids] == ["In", "correct"]
    assert t.labels.extension == t.labels.no_ids[:1] and t.labels.rows == 2
    assert t.suffix_ids[-1] == t.labels.no_ids[0]


def test_label_scoring_sums_each_labels_tokens():
    """log P(label) = Σ_j log_softmax(row j)[label_j], copy-major rows."""
    from parse_vllm.templates import LabelScoring

    s = LabelScoring(yes_ids=(3,), no_ids=(1, 4, 2), extension=(1, 4))
    last = torch.tensor([5, 11])
    assert s.row_index(last).tolist() == [3, 4, 5, 9, 10, 11]
    logits = torch.randn(6, 7)
    lp = torch.log_softmax(logits, -1).view(2, 3, 7)
    yes, no = s.log_probs(logits)
    assert torch.allclose(yes, lp[:, 0, 3])
    assert torch.allclose(no, lp[:, 0, 1] + lp[:, 1, 4] + lp[:, 2, 2])


@pytest.mark.parametrize(
    "labels, match",
    [
        (("Correctly", "Correct"), "start with the same token"),
        (("Incorrect", "Inaccurate"), "start with the same token"),
        (("Incorrectly wrong", "Absolutely not right"), "at most one label may be more than one token"),
    ],
)
def test_bad_labels_are_refused(smollm2_dir, labels, match):
    from transformers import AutoTokenizer

    from parse_vllm.templates import build_template

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    with pytest.raises(ParseConfigError, match=match):
        build_template(tok, ParseConfig(labels=labels))


def test_no_chat_template_is_refused(smollm2_dir, tmp_path):
    from transformers import AutoTokenizer

    from parse_vllm.templates import build_template

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    tok.chat_template = None
    with pytest.raises(ParseConfigError, match="no chat template"):
        build_template(tok, ParseConfig())


# -- YAML configs and CLI flags ------------------------------------------------------


def test_yaml_configs_turn_into_flags():
    from parse_vllm.cli import expand_config_flag
    from parse_vllm.presets import load_preset

    configs = sorted((ROOT / "configs").glob("*.yaml"))
    assert configs
    for path in configs:
        preset = load_preset(path)
        argv, _ = expand_config_flag(["--port", "8000", "--parse-config", str(path)])
        if preset.speculative_config:
            # PARSE named in the speculative config, its options with it
            j = argv.index("--speculative-config")
            assert json.loads(argv[j + 1]) == {**preset.speculative_config, "method": "parse", **preset.parse}
            assert "--additional-config" not in argv
        else:
            i = argv.index("--additional-config")
            assert json.loads(argv[i + 1]) == {"parse": preset.parse}


def test_yaml_config_errors(tmp_path):
    from parse_vllm.cli import expand_config_flag

    bad = tmp_path / "bad.yaml"
    bad.write_text("parse:\n  threshold: 2x\n")
    with pytest.raises(ParseConfigError):
        expand_config_flag(["--parse-config", str(bad)])
    bad.write_text("parsee: {}\n")
    with pytest.raises(SystemExit, match="unknown top-level keys"):
        expand_config_flag(["--parse-config", str(bad)])


def test_demo_yaml_names_the_demo_models():
    from parse_vllm.cache import model_dir
    from parse_vllm.presets import load_preset
    from parse_vllm.tools.prepare_models import DEMO_DRAFT_NAME, DEMO_TARGET_NAME

    preset = load_preset(ROOT / "configs" / "smollm2-135m-demo.yaml")
    assert preset.model == str(model_dir(DEMO_TARGET_NAME))
    assert preset.speculative_config["model"] == str(model_dir(DEMO_DRAFT_NAME))


def test_defaults_yaml_is_the_defaults():
    from parse_vllm.presets import load_preset

    parse = load_preset(ROOT / "configs" / "parse-defaults.yaml").parse
    assert ParseConfig.from_dict(parse) == ParseConfig()
    assert set(parse) == set(ParseConfig.__dataclass_fields__)


def test_kv_audit_counts_blocks_held_and_scratch_found_in_request_tables():
    # The runner's per-step scan (parse option audit_kv_blocks) over an input
    # batch laid out like vLLM's: per KV group, a [max_reqs, W] table valid up
    # to num_blocks_per_row[row]; stale ids past that count must be ignored.
    from types import SimpleNamespace

    from parse_vllm.controller import ParseController
    from parse_vllm.metrics import KvAudit
    from parse_vllm.runner import ParseRunnerMixin

    ids = np.array([[1, 2, 3, 99], [4, 5, 0, 98], [97, 96, 95, 94]])
    table = SimpleNamespace(get_numpy_array=lambda: ids, num_blocks_per_row=np.array([3, 2, 4]))
    batch = SimpleNamespace(num_reqs=2, block_table=SimpleNamespace(block_tables=[table]))
    parse = SimpleNamespace(verifier=SimpleNamespace(scratch_ids=np.array([98, 99, 100])), kv_audit=KvAudit())
    parse.scratch_ids = lambda: ParseController.scratch_ids(parse)
    parse.audit = lambda n, held: ParseController.audit(parse, n, held)
    runner = SimpleNamespace(input_batch=batch, parse=parse)
    runner.parse_kv_block_use = lambda: ParseRunnerMixin.parse_kv_block_use(runner)
    num_reqs, held, scratch = runner.parse_kv_block_use()
    assert (num_reqs, held, scratch.tolist()) == (2, {1, 2, 3, 4, 5}, [98, 99, 100])
    ParseRunnerMixin._parse_audit_kv(runner)
    assert parse.kv_audit == KvAudit(
        steps=1, batch_requests_max=2, request_blocks_held_max=5, scratch_blocks_in_request_tables_max=0
    )
    table.num_blocks_per_row[1] = 4  # row 1 now (wrongly) reaches scratch block 98
    ParseRunnerMixin._parse_audit_kv(runner)
    assert parse.kv_audit.scratch_blocks_in_request_tables_max == 1
    assert parse.kv_audit.request_blocks_held_max == 7 and parse.kv_audit.steps == 2


def test_request_stop_ids_follow_ignore_eos():
    """The tokens that end a request, as vLLM's check_stop reads them: EOS (and
    the generation config's extra EOS ids) only without ignore_eos; stop_token_ids
    always. A draft is cut at the first of them."""

    from vllm import SamplingParams

    from parse_vllm import _vllm

    def limits(**kw):
        sp = SamplingParams(max_tokens=9, stop_token_ids=[7], **kw)
        sp.update_from_generation_config({"eos_token_id": [2, 3]}, eos_token_id=2)
        return _vllm.request_stops(sp)

    assert limits() == frozenset({2, 3, 7})
    assert limits(ignore_eos=True) == frozenset({7})
