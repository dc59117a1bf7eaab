"""The PARSE model runner: vLLM's V1 model runner, its step translated for PARSE.

vLLM's step already does most of PARSE: the draft model drafts (method "draft_model",
num_speculative_tokens = W) and the next step's target forward writes KV for the last
token and the whole draft and computes logits at every draft position. Each hook below
reads vLLM's objects into PARSE's plain ones, calls the pure modules, and writes the
answer back; the state lives in the controller (`self.parse`). One step:

  _update_states     the step's batch, read once (`_vllm.BatchView`) -> controller.begin_step
  _sample            vLLM's rejection sampler (token-level, lossless), then the drafts PARSE
                     judges (`step.DraftBatch`) -> step.parse_step, judging through the
                     verifier -> controller.sampled; a request that takes more than
                     token-level acceptance did gets draft[:accepted] and one token sampled
                     from the target there, with its own parameters
  propose_draft_token_ids   controller.plan (proposers.py: who drafts for whom) ->
                     drafting.step_rows, plan_passes, run_passes (vLLM's draft-model proposer
                     over chosen rows, `_vllm.RowsDrafter`) -> controller.drafted (windows.py);
                     then the token proposer, if any
  sample_tokens / execute_model   the drafts, cut to their lengths, and the open windows on
                     the step's `windows.StepReport`, for the scheduler (a step with nothing
                     scheduled advances the open windows alone)

The accepted prefix's KV was written by the forward and is kept as is (the scheduler rolls
back only the rejected tail).
"""

from __future__ import annotations

import functools
import time

import numpy as np
import torch

from parse_vllm import _vllm, proposers
from parse_vllm.config import ParseConfig, ParseConfigError, parse_section
from parse_vllm.controller import JudgedRequests, ParseController
from parse_vllm.drafting import DraftRows, pass_spans, plan_passes, run_passes, step_rows, window_rows
from parse_vllm.evidence import from_fixed, to_fixed
from parse_vllm.step import DraftBatch, draft_views, parse_step, resampled_rows, token_checks_with_evidence
from parse_vllm.transfers import watched as _watched
from parse_vllm.verify import factory as verifiers

logger = _vllm.init_logger("parse_vllm.runner")


class ParseRunnerMixin:
    """Mixed into vLLM's CPU and GPU model runners (see bottom of module).
    `self.parse`: the engine's ParseController, None when PARSE is not named."""

    parse: ParseController | None = None
    _token_proposer: _vllm.TokenProposer | None = None  # parse.token_proposer, beside the draft model
    _parse_caches_by_layer: dict | None = None  # the KV cache by layer name, addressed by scheduler block ids

    # -- set-up -----------------------------------------------------------

    def load_model(self, *args, **kwargs) -> None:
        super().load_model(*args, **kwargs)
        section = parse_section(self.vllm_config.additional_config)
        if section is None or self.speculative_config is None:
            self.parse = None
            return
        config = ParseConfig.from_dict(section)
        self.parse = p = ParseController.create(
            config,
            window=self.speculative_config.num_speculative_tokens,
            tokenizer=_vllm.target_tokenizer(self.vllm_config),
            vocab_size=self.model_config.get_vocab_size(),
            layer_names=_vllm.attention_layer_names(self.model),
            served_model_name=str(self.vllm_config.model_config.served_model_name),
            device=str(self.device),
        )
        if config.judge_head is not None:
            p.load_judge_head(
                _vllm.target_shape(self.vllm_config), lambda ids, n: _vllm.lm_head_columns(self.model, ids, n)
            )
        self._parse_staging = _vllm.DrafterStaging.for_runner(self)  # a step's drafter inputs, one copy
        self._rows_drafting_unsupported = why = _vllm.rows_drafting_unsupported(self)
        if why:
            logger.warning("PARSE: the drafter runs over the whole batch each step (%s)", why)
            if p.policy is not None:  # vLLM's proposer: its passes are not counted as the policy's features
                p.policy.token_drafts_counted = False
        if config.token_proposer is not None:
            if why:
                raise ParseConfigError(f"parse.token_proposer needs the draft model drafting chosen rows ({why})")
            self._token_proposer = _vllm.TokenProposer.attach(self, config.token_proposer, config.spec_tokens)
        logger.info("PARSE on: %s", p.describe())

    def initialize_kv_cache_tensors(self, *args, **kwargs):
        caches = super().initialize_kv_cache_tensors(*args, **kwargs)
        self._parse_caches_by_layer = caches
        return caches

    def _cleanup_profiling_kv_cache(self) -> None:
        # Also vLLM's shutdown: the verifier's references to the KV cache go too.
        self._parse_caches_by_layer = None
        if self.parse is not None:
            self.parse.verifier = None
        super()._cleanup_profiling_kv_cache()

    def initialize_metadata_builders(self, kv_cache_config, kernel_block_sizes, *args, **kwargs) -> None:
        super().initialize_metadata_builders(kv_cache_config, kernel_block_sizes, *args, **kwargs)
        if self._token_proposer is not None:
            self._token_proposer.initialize(kv_cache_config, kernel_block_sizes)

    # vLLM gives only its own drafter CUDA-graph keys and dummy runs (warm-up, profiling,
    # capture); the token proposer's head gets them beside it.
    def _check_and_update_cudagraph_mode(self, *args, **kwargs) -> None:
        super()._check_and_update_cudagraph_mode(*args, **kwargs)
        if self._token_proposer is not None:
            self._token_proposer.initialize_cudagraph_keys(self.cudagraph_dispatcher.cudagraph_mode)

    def _dummy_run(self, num_tokens, *args, **kwargs):
        out = super()._dummy_run(num_tokens, *args, **kwargs)
        if self._token_proposer is not None:
            self._token_proposer.dummy_run(num_tokens, *_vllm.dummy_run_arguments(num_tokens, args, kwargs))
        return out

    def initialize_kv_cache(self, kv_cache_config, *args, **kwargs) -> None:
        super().initialize_kv_cache(kv_cache_config, *args, **kwargs)
        if kwargs.get("is_profiling", args[0] if args else False):
            # GPU CUDA-graph memory profiling builds a throwaway cache of a few blocks first:
            # not held past this call (the real one is allocated once vLLM's own references
            # to it are gone), and no verifier is built over it.
            self._parse_caches_by_layer = None
            return
        p = self.parse
        if p is not None:  # (over vLLM's own copy of the config, as its attention groups were built)
            kv_cache_config = getattr(self, "kv_cache_config", kv_cache_config)
            p.verifier = verifiers.build(_vllm.TargetAccess(self), p, kv_cache_config, self._parse_caches_by_layer)
            logger.info("PARSE verification: %s", verifiers.describe(p.verifier, kv_cache_config.num_blocks))

    # -- the step -------------------------------------------------------------

    @_watched
    def _update_states(self, scheduler_output):
        out = super()._update_states(scheduler_output)
        p = self.parse
        if p is not None:
            p.begin_step(
                _vllm.batch_view(self, scheduler_output),
                finished=_vllm.finished_request_ids(scheduler_output),
                resumed=_vllm.resumed_request_ids(scheduler_output),
                preempted=_vllm.preempted_request_ids(scheduler_output),
                new=_vllm.new_request_ids(scheduler_output),
                now=time.monotonic(),
            )
            self._parse_audit_kv()  # this step's tables, before any verification
        return out

    @_watched
    def execute_model(self, scheduler_output, *args, **kwargs):
        """A step that schedules nothing while windows are open (their requests held by
        the scheduler) advances those windows alone."""
        out = super().execute_model(scheduler_output, *args, **kwargs)
        p = self.parse
        if p is None or scheduler_output.total_num_scheduled_tokens:
            return out
        if p.drafting_windows:
            self._draft(window_rows(p.drafting_windows, p.config.draft_chunk), None, self.input_batch.sampling_metadata)
        return _vllm.with_step_report(out, p.step.report)

    @_watched
    def sample_tokens(self, *args, **kwargs):
        out = super().sample_tokens(*args, **kwargs)
        p = self.parse
        if p is None:
            return out
        step = p.step
        if step.drafted:
            drafts = super().take_draft_token_ids()  # vLLM's own copy of the batch rows' drafts
            if drafts is not None:
                p.report_drafts(drafts.req_ids, drafts.draft_token_ids, self.requests.keys())
        elif p.drafting_windows:  # vLLM skipped the drafter this step
            self._draft(window_rows(p.drafting_windows, p.config.draft_chunk), None, self.input_batch.sampling_metadata)
        return _vllm.with_step_report(out, step.report)

    def take_draft_token_ids(self):
        if self.parse is None:
            return super().take_draft_token_ids()
        return None  # every draft reaches the scheduler on the step's report (sample_tokens)

    # -- acceptance ---------------------------------------------------------

    @_watched
    def _sample(self, logits, spec_decode_metadata):
        p, md = self.parse, spec_decode_metadata
        if p is None or md is None:  # (with a speculative config, vLLM always passes metadata)
            return super()._sample(logits, md)

        # The drafts PARSE judges, and the target's checks of their tokens (guard,
        # constraints), started on the device before sampling.
        settings = p.settings(self.model_config.get_vocab_size(), self.model_config.max_model_len)
        batch, judged = self._draft_batch(logits, md)
        batch.views = draft_views(batch, settings.vocab_size)
        # [2, R] on the device; with a judge head that reads evidence, also the target's
        # log-probability of each draft token and whether its greedy token differs, from
        # the same logits rows (evidence.py): no forward, fetched with the checks below.
        checks, evidence = token_checks_with_evidence(batch, batch.views, p.host.to_device, p.reads_evidence)

        # 1. Token-level verification with vLLM's own rejection sampler (on at most its
        #    128-token limit per request; longer drafts are judged).
        limit = _vllm.REJECTION_SAMPLER_MAX_SPEC_LEN
        std_logits, std_md = _vllm.truncate_spec_decode(logits, md, limit, p.host.to_device)
        out = _vllm.widen_sampled(super()._sample(std_logits, std_md), md.max_spec_len + 1)  # [B, W+1]
        # The step's one read of its inputs: sampled tokens and the checks (and the evidence).
        # (The evidence as int64 fixed point: in float64 the checks' NO_LIMIT would not survive.)
        extra = [] if evidence is None else [to_fixed(evidence)]
        sampled, batch.checks, *ev = p.host.fetch(out.sampled_token_ids, checks, *extra)
        batch.evidence = from_fixed(ev[0]) if ev else None
        accepted = (sampled != _vllm.PLACEHOLDER_TOKEN_ID).sum(axis=1) - 1  # [B] token-level
        batch.l_tok = accepted[batch.row]
        p.count_token_level(np.asarray(md.num_draft_tokens), batch.row, accepted)

        # 2-3. The PARSE step over the drafts it judges; 4. draft[:accepted] plus one
        #      token sampled from the target there.
        result = None
        if batch.num_reqs:
            result = parse_step(batch, lambda copies: p.judge(copies, batch, judged), settings)
            if result.resample.any():
                self._resample(logits, md, batch, result, out, sampled)
            if result.commit.any():
                self._commit(batch, result, out, sampled)
        p.sampled(judged, batch, result, sampled)
        p.export()
        self._parse_audit_kv()  # the tables as the verification left them
        return out

    def _draft_batch(self, logits, md) -> tuple[DraftBatch, JudgedRequests]:
        """vLLM's SpecDecodeMetadata -> the DraftBatch of the requests PARSE judges, and who they are."""
        num_draft = np.asarray(md.num_draft_tokens)  # [B]
        drafts = _vllm.scheduled_drafts(self.parse.step.batch, md.num_draft_tokens)  # [Σd]
        logits_start = _vllm.cu_sampled_tokens(md) - (num_draft + 1)  # [B]
        mask = self.input_batch.sampling_metadata.allowed_token_ids_mask
        return self.parse.draft_batch(num_draft, drafts, logits_start, logits, mask)

    def _resample(self, logits, md, batch: DraftBatch, result, out, sampled_host: np.ndarray) -> None:
        """Rows that take more than L_tok: draft[:accepted], then one token sampled from
        the target at that position with the request's own parameters (penalties over its
        output plus the accepted prefix; only these rows' seeded generators advance).
        Updates `out` on the device and `sampled_host`, its host copy."""
        host = self.parse.host
        ks = np.flatnonzero(result.resample)
        rows, n = batch.row[ks], result.accepted[ks]
        prefixes = {int(r): batch.draft_of(k)[:n_k].tolist() for k, r, n_k in zip(ks, rows, n)}
        take = _vllm.cu_sampled_tokens(md) - 1  # default: each request's bonus row
        take[rows] = batch.logits_start[ks] + n
        take_t, rows_t = host.to_device(take, rows)
        sampled = _vllm.sample_after_prefixes(
            self.sampler, logits[take_t], self.input_batch.sampling_metadata, prefixes
        )
        (tail,) = host.fetch(sampled[rows_t])
        new = resampled_rows(prefixes, rows, tail, sampled_host.shape[1], _vllm.PLACEHOLDER_TOKEN_ID)
        sampled_host[rows] = new
        ids = out.sampled_token_ids
        ids[rows_t] = host.to_device(new)[0].to(ids.dtype)

    def _commit(self, batch: DraftBatch, result, out, sampled_host: np.ndarray) -> None:
        """Rows whose judged part of a window passed (chunked judging): draft[:accepted] and
        no token of the target's, whose choice after it belongs to the window's next
        judgment. vLLM keeps the last one as the token to compute next step. Updates `out`
        on the device and `sampled_host`."""
        host = self.parse.host
        ks = np.flatnonzero(result.commit)
        rows = batch.row[ks]
        new = np.full((ks.shape[0], sampled_host.shape[1]), _vllm.PLACEHOLDER_TOKEN_ID, dtype=np.int64)
        for j, (k, n) in enumerate(zip(ks, result.accepted[ks])):
            new[j, :n] = batch.draft_of(k)[:n]
        sampled_host[rows] = new
        ids = out.sampled_token_ids
        rows_t, new_t = host.to_device(rows, new)
        ids[rows_t] = new_t.to(ids.dtype)

    # -- drafting: how many draft tokens each request gets, and from whom -----

    def _input_fits_in_drafter(self, common_attn_metadata) -> bool:
        """vLLM skips the drafter for the whole batch once its longest request plus W
        would pass the drafter's max_model_len, and fills every draft with token 0. The
        per-row drafter bounds each request by its own room instead (step_rows), so it
        always runs."""
        if self.parse is not None and self._rows_drafting_unsupported is None:
            return common_attn_metadata is not None
        return super()._input_fits_in_drafter(common_attn_metadata)

    @_watched
    def propose_draft_token_ids(self, scheduler_output, *args, **kwargs):
        """Draft tokens per request, the drafter run only over the requests that draft this
        step, each at its own length; [B, longest] on the device (sample_tokens cuts each
        to its length for the scheduler)."""
        p = self.parse
        if p is None:
            return super().propose_draft_token_ids(scheduler_output, *args, **kwargs)
        if self._rows_drafting_unsupported is not None:
            return self._propose_whole_batch(scheduler_output, *args, **kwargs)
        call = _vllm.proposer_call(args, kwargs)
        tp = self._token_proposer
        # EAGLE-3's input, taken before the draft model's passes can overwrite the target's outputs.
        target_hidden = tp.target_hidden_states(call) if tp is not None else None
        states, who = p.plan(keeps_kv=tp is not None and tp.keeps_kv)
        view = p.step.batch
        windows = p.drafting_windows
        if who.draft_model_wants.any() or windows:
            new = p.new_tokens(call["sampled_token_ids"])
            max_len = min(self.max_model_len, self.effective_drafter_max_model_len)
            rows = step_rows(view, states, new, windows, max_len=max_len, chunk=p.config.draft_chunk)
            drafts = self._draft(rows, call["common_attn_metadata"].block_table_tensor, call["sampling_metadata"])
        else:
            p.drafted(None, None, None)
            drafts = torch.zeros((view.num_reqs, 0), dtype=torch.int64, device=self.device)
        if tp is None or not who.run_token_proposer:
            return drafts
        new = None
        if not tp.keeps_kv:  # (n-gram: the host's tokens; a row still in prefill has none yet)
            new = [t[:0] if view.prefilling[i] else t for i, t in enumerate(p.new_tokens(call["sampled_token_ids"]))]
        step = _vllm.proposer_step(self, call, new, view.num_tokens, target_hidden, p.host.to_device)
        proposed, lens = tp.propose(step)  # [B, k], [B]
        p.token_proposed(who, lens)
        return proposers.merge(drafts, proposed, who.token_level, p.host.to_device)

    def _propose_whole_batch(self, scheduler_output, *args, **kwargs):
        """vLLM's own proposer over the whole batch, as far as some request needs (controller.plan_whole_batch)."""
        k = self.parse.plan_whole_batch(self.cache_config.enable_prefix_caching)
        if not k:
            return [[] for _ in self.parse.step.batch.req_ids]
        scheduler_output.num_spec_tokens_to_schedule = k
        with self.parse.drafter_clock.span():
            return super().propose_draft_token_ids(scheduler_output, *args, **kwargs)

    def _draft(self, rows: DraftRows, batch_block_table, sampling_metadata) -> torch.Tensor:
        """The drafter over the step's DraftRows, in passes (drafting.py); the batch rows'
        drafts on the device [B, longest]. The windows' chunks are read back once and the
        windows advanced (controller.drafted)."""
        p = self.parse
        passes, kv_len = plan_passes(
            rows.wants,
            rows.kv_len,
            rows.known_len,
            window=min(p.window, p.config.draft_chunk or p.window),
            spec_tokens=p.config.spec_tokens,
            max_tokens=self.scheduler_config.max_num_batched_tokens,
            max_rows=self.scheduler_config.max_num_seqs,
            room=rows.room,
        )
        tokens = p.step.batch.token_ids
        staged = self._parse_staging.stage(
            [(dp.row, *pass_spans(dp, tokens, rows.committed, rows.new), dp.start) for dp in passes]
        )
        block_table = _vllm.drafting_block_table(
            self, batch_block_table, rows.num_batch, rows.req_ids[rows.num_batch :], p.host.to_device
        )
        fetch = functools.partial(p.host.fetch_one, drafter=True)  # the drafter's stop checks, counted apart
        drafter = _vllm.RowsDrafter(self, self._parse_staging, staged, block_table, sampling_metadata, fetch)
        with p.drafter_clock.span():
            run = run_passes(passes, drafter, rows.wants, rows.stops, len(rows.req_ids), self.device)
        p.count_drafter(run)
        win = rows.window_rows
        chunks = fetch(run.drafts[p.host.to_device(win)[0]]) if win.shape[0] else np.zeros((0, 0), dtype=np.int64)
        p.drafted(rows, kv_len, chunks)
        return run.drafts[: rows.num_batch]

    # -- KV audit -------------------------------------------------------------

    def parse_kv_block_use(self) -> tuple[int, set[int], np.ndarray]:
        """(requests in the batch, the KV block ids their tables hold, the
        PARSE scratch block ids [R] — empty on the kernel path)."""
        scratch = self.parse.scratch_ids() if self.parse is not None else np.zeros(0, dtype=np.int64)
        return int(self.input_batch.num_reqs), _vllm.batch_request_block_ids(self.input_batch), scratch

    def _parse_audit_kv(self) -> None:
        if self.parse is not None and self.parse.kv_audit is not None:
            self.parse.audit(int(self.input_batch.num_reqs), _vllm.batch_request_block_ids(self.input_batch))


def _make_runner(base, *mixins):
    return type(f"Parse{base.__name__}", (*mixins, ParseRunnerMixin, base), {"__module__": __name__})


# Each runner is built when its platform's worker asks for it: the bases are
# platform-specific vLLM modules (the GPU runner's imports CUDA-only code).
_BUILDERS = {
    "ParseCPUModelRunner": lambda: _make_runner(_vllm.cpu_model_runner_cls(), _vllm.CpuSeededChunkedPrefill),
    "ParseGPUModelRunner": lambda: _make_runner(_vllm.gpu_model_runner_cls()),
}


def __getattr__(name):
    build = _BUILDERS.get(name)
    if build is None:
        raise AttributeError(name)
    cls = globals()[name] = build()
    return cls
