"""The PARSE model runner: vLLM's V1 model runner with PARSE acceptance.

A thin binding. vLLM's step already does most of PARSE: the draft model
drafts a window of W tokens (method "draft_model", num_speculative_tokens=W)
and the next step's target forward writes KV for the last token and the whole
draft and computes logits at every draft position. In `_sample` this runner
  1. runs vLLM's own rejection sampler (token-level, lossless)      -> L_tok
  2. packs the drafts PARSE judges into a `step.DraftBatch`
  3. runs `step.parse_step` (judging through the verifier)          -> accepted
  4. for requests that take more than L_tok: draft[:accepted] and one token
     sampled from the target there, with the request's own parameters.
The accepted prefix's KV was written by the forward and is kept as is (the
scheduler rolls back only the rejected tail). Per-request phases live in the
`controller.ParseController` (`self.parse`), which also says how many draft
tokens each request gets next; `propose_draft_token_ids` runs the drafter only
over the requests that draft (`drafting.plan_passes`). A window longer than
`draft_chunk` is drafted over several engine steps while the scheduler holds
its request out of the batch (`drafting.OpenWindow`, `ParseScheduler`): its
chunks are drafted beside the batch's own drafts, or alone in `execute_model`
when a step has nothing for the target, and the runner reports the open and
completed windows on the step's output (`drafting.WindowReport`).
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import torch

from parse_vllm import _vllm
from parse_vllm.acceptance import first_stop_index
from parse_vllm.boundaries import BoundaryRule, sentence_end_mask
from parse_vllm.config import ParseConfig, ParseConfigError, parse_section, request_options
from parse_vllm.controller import JudgedRequests, ParseController
from parse_vllm.drafting import (
    DRAFT_CHUNK,
    DraftRows,
    WindowReport,
    advance_windows,
    open_window_rows,
    pass_spans,
    plan_passes,
    step_rows,
)
from parse_vllm.policy import RequestState
from parse_vllm.step import DraftBatch, draft_views, parse_step, token_checks
from parse_vllm.templates import build_template
from parse_vllm.verify import factory as verifiers

logger = _vllm.init_logger("parse_vllm.runner")


def _watched(hook):
    """A hook whose host-to-device copies are watched when the engine audits them
    (parse.audit_transfers: `transfers.PageableCopyCounter`)."""

    @functools.wraps(hook)
    def run(self, *args, **kwargs):
        p = self.parse
        if p is None or p.host.pageable is None:
            return hook(self, *args, **kwargs)
        with p.host.watching():
            return hook(self, *args, **kwargs)

    return run


class ParseRunnerMixin:
    """Mixed into vLLM's CPU and GPU model runners (see bottom of module).
    `self.parse`: the engine's ParseController, None when PARSE is not named."""

    parse: ParseController | None = None
    _parse_drafted = False  # this step's drafter ran (take_draft_token_ids)
    _parse_sampled: np.ndarray | None = None  # [B, W+1] this step's sampled tokens on the host, once fetched
    _parse_draft_lens: dict[str, int]  # this step's draft length per request
    _parse_window_report: WindowReport | None = None  # for the scheduler, on the step's output
    _token_proposer: _vllm.TokenProposer | None = None  # parse.token_proposer, beside the draft model
    _parse_caches_by_layer: dict | None = None  # the KV cache by layer name, addressed by scheduler block ids

    # -- set-up -----------------------------------------------------------

    def load_model(self, *args, **kwargs) -> None:
        super().load_model(*args, **kwargs)
        section = parse_section(self.vllm_config.additional_config)
        spec = self.speculative_config
        if section is None or spec is None:
            self.parse = None
            return
        config = ParseConfig.from_dict(section)
        tokenizer = _vllm.target_tokenizer(self.vllm_config)
        template = build_template(tokenizer, config)
        sentence_end = sentence_end_mask(tokenizer, self.model_config.get_vocab_size())
        self.parse = ParseController(
            config=config,
            window=spec.num_speculative_tokens,
            rule=BoundaryRule(config.boundaries, config.every, config.max_boundaries, sentence_end),
            sentence_end=sentence_end,
            template=template,
            layer_names=_vllm.attention_layer_names(self.model),
            served_model_name=str(self.vllm_config.model_config.served_model_name),
            device=str(self.device),
        )
        if config.judge_head is not None:
            self.parse.read_out = self._load_judge_head(config, template)
        self._parse_draft_lens = {}
        # Every drafter call's inputs of a step, moved in one copy; sized for a
        # step's first passes (catch-up beyond it grows it).
        self._parse_staging = _vllm.DrafterStaging(
            self.device, 4 * (self.scheduler_config.max_num_batched_tokens + self.scheduler_config.max_num_seqs)
        )
        self._rows_drafting_unsupported = _vllm.rows_drafting_unsupported(self)
        if self._rows_drafting_unsupported:
            logger.warning(
                "PARSE: the drafter runs over the whole batch each step (%s)", self._rows_drafting_unsupported
            )
        if config.token_proposer is not None:
            if self._rows_drafting_unsupported:
                raise ParseConfigError(
                    f"parse.token_proposer needs the draft model drafting chosen rows ({self._rows_drafting_unsupported})"
                )
            self._token_proposer = _vllm.TokenProposer(self, config.token_proposer, config.spec_tokens)
            self._token_proposer.load(self)
            logger.info(
                "PARSE token-level proposer: %s, %d tokens (the draft model writes the windows)",
                config.token_proposer,
                config.spec_tokens,
            )
        logger.info(
            "PARSE on: window W=%d, τ=%.3g, guard=%d, boundaries=%s, max K=%d, suffix %d tokens %r, "
            "labels %r/%r (ids %s/%s), on_reject=%s",
            self.parse.window,
            config.threshold,
            config.guard,
            config.boundaries,
            config.max_boundaries,
            template.suffix_len,
            template.suffix_text,
            *config.labels,
            template.labels.yes_ids,
            template.labels.no_ids,
            config.on_reject,
        )

    def _load_judge_head(self, config, template):
        """The judge head's read-out on this worker's device, once its weights are known to
        be the ones it was trained on (process 0 checked the rest)."""
        from parse_vllm.judge_head import FINGERPRINT_DIMS, ReadOut, engine_identity, load_for_engine

        identity = engine_identity(**_vllm.target_shape(self.vllm_config), template=template, config=config)
        head = load_for_engine(config.judge_head, identity)
        first_ids = [ids[0] for ids in identity.label_ids]
        why = head.fingerprint_mismatch(_vllm.lm_head_columns(self.model, first_ids, FINGERPRINT_DIMS))
        if why is not None:
            raise ParseConfigError(f"parse.judge_head={config.judge_head!r}: {why}")
        logger.info("PARSE judge head %s (%s)", config.judge_head, head.training.get("summary", head.features))
        return ReadOut(head, self.device)

    def initialize_kv_cache_tensors(self, *args, **kwargs):
        caches = super().initialize_kv_cache_tensors(*args, **kwargs)
        self._parse_caches_by_layer = caches  # addressed by scheduler block ids
        return caches

    def _check_and_update_cudagraph_mode(self, *args, **kwargs) -> None:
        super()._check_and_update_cudagraph_mode(*args, **kwargs)
        if self._token_proposer is not None:
            self._token_proposer.initialize_cudagraph_keys(self.cudagraph_dispatcher.cudagraph_mode)

    def _dummy_run(self, num_tokens, *args, **kwargs):
        out = super()._dummy_run(num_tokens, *args, **kwargs)
        if self._token_proposer is not None:
            mode, capturing = _vllm.dummy_run_arguments(num_tokens, args, kwargs)
            self._token_proposer.dummy_run(num_tokens, mode, capturing)
        return out

    def _cleanup_profiling_kv_cache(self) -> None:
        self._parse_caches_by_layer = None
        super()._cleanup_profiling_kv_cache()

    def initialize_metadata_builders(self, kv_cache_config, kernel_block_sizes, *args, **kwargs) -> None:
        super().initialize_metadata_builders(kv_cache_config, kernel_block_sizes, *args, **kwargs)
        if self._token_proposer is not None:
            self._token_proposer.initialize(kv_cache_config, kernel_block_sizes)

    def initialize_kv_cache(self, kv_cache_config, *args, **kwargs) -> None:
        super().initialize_kv_cache(kv_cache_config, *args, **kwargs)
        p = self.parse
        if kwargs.get("is_profiling", args[0] if args else False):
            # GPU CUDA-graph memory profiling builds a throwaway cache of a few blocks
            # first: not held past this call (the real one is allocated while vLLM's own
            # references to it are gone), and no verifier is built over it.
            self._parse_caches_by_layer = None
            return
        if p is None:
            return
        p.verifier = verifiers.build(self, p, kv_cache_config, self._parse_caches_by_layer)
        logger.info(
            "PARSE verification: %s, scratch %d of %d KV blocks",
            type(p.verifier).__name__,
            p.scratch_ids().shape[0],
            kv_cache_config.num_blocks,
        )

    # -- per-request state --------------------------------------------------

    def _parse_state(self, req_id: str) -> RequestState:
        return self.parse.state(req_id, lambda: self._request_options(req_id))

    def _request_options(self, req_id: str):
        config = self.parse.config
        try:
            opts = request_options(_vllm.request_extra_args(self, req_id), config)
        except ParseConfigError as e:  # validated at admission; be safe anyway
            logger.warning("request %s: %s; PARSE off for it", req_id, e)
            opts = dataclasses.replace(request_options(None, config), enabled=False)
        if _vllm.request_wants_logprobs(self, req_id):
            # Logprobs of semantically accepted tokens are not produced:
            # such requests get token-level speculation only.
            opts = dataclasses.replace(opts, enabled=False)
        return opts

    @_watched
    def _update_states(self, scheduler_output):
        out = super()._update_states(scheduler_output)
        if self.parse is not None:
            self.parse.forget(scheduler_output.finished_req_ids)
            resumed = _vllm.resumed_request_ids(scheduler_output)
            for req_id in resumed & self.parse.states.keys():
                # Preempted: its blocks were freed, the draft's KV with them.
                self.parse.states[req_id].draft_kv_len = self.parse.states[req_id].draft_ahead = 0
            # A window whose request is preempted (or, held or not, scheduled
            # again) is dropped: its request drafts again from scratch.
            self.parse.drop_windows(
                resumed
                | _vllm.preempted_request_ids(scheduler_output)
                | (self.parse.windows.keys() & scheduler_output.num_scheduled_tokens.keys())
            )
        self._parse_audit_kv()  # this step's tables, before any verification
        return out

    # -- steps with no request for the target --------------------------------

    @_watched
    def execute_model(self, scheduler_output, *args, **kwargs):
        """A step that schedules nothing while windows are open (their
        requests held by the scheduler) advances those windows alone."""
        out = super().execute_model(scheduler_output, *args, **kwargs)
        p = self.parse
        if p is None or scheduler_output.total_num_scheduled_tokens:
            return out
        p.host.new_step()
        self._parse_window_report = WindowReport()
        if p.windows:
            self._draft_open_windows()
        return _vllm.with_window_report(out, self._parse_window_report)

    @_watched
    def sample_tokens(self, *args, **kwargs):
        out = super().sample_tokens(*args, **kwargs)
        p = self.parse
        if p is None:
            return out
        if not self._parse_drafted and p.windows:  # (vLLM skipped the drafter this step)
            self._draft_open_windows()
        return _vllm.with_window_report(out, self._parse_window_report)

    def _draft_open_windows(self) -> None:
        """The open windows' next chunks, in a step whose batch does not draft."""
        p = self.parse
        rows = open_window_rows(p.windows, p.config.draft_chunk)
        self._draft_rows(rows, _vllm.committed_tokens(self)[0], None, self.input_batch.sampling_metadata, [])

    # -- drafting: how many draft tokens each request gets ------------------

    def _input_fits_in_drafter(self, common_attn_metadata) -> bool:
        """vLLM skips the drafter for the whole batch once its longest request
        plus W would pass the drafter's max_model_len, and fills every draft
        with token 0. The per-row drafter bounds each request by its own room
        instead (propose_draft_token_ids), so it always runs."""
        if self.parse is not None and self._rows_drafting_unsupported is None:
            return common_attn_metadata is not None
        return super()._input_fits_in_drafter(common_attn_metadata)

    @_watched
    def propose_draft_token_ids(self, scheduler_output, *args, **kwargs):
        """Draft tokens per request, the drafter run only over the requests
        that draft this step, each at its own length (drafting.py). Returns
        them on the device, [B, longest]; vLLM copies them back
        asynchronously and `take_draft_token_ids` cuts each to its length."""
        p = self.parse
        if p is None:
            return super().propose_draft_token_ids(scheduler_output, *args, **kwargs)
        self._parse_drafted = True
        req_ids = list(self.input_batch.req_ids)
        states = [self._parse_state(r) for r in req_ids]
        wants = np.array([p.draft_len(s) for s in states], dtype=np.int64)
        if self._rows_drafting_unsupported is not None:
            # vLLM's own proposer for the whole batch (it consumes this step's
            # tokens to keep the draft KV in sync, and cannot catch up later),
            # as far as some request needs. Skipped once no request here
            # drafts again, unless prefix caching is on: blocks filled in a
            # skipped step would hold no draft KV, and a later request that
            # hits them in the cache would draft over it.
            self._parse_draft_lens = dict(zip(req_ids, wants.tolist()))
            if (
                p.config.spec_tokens == 0
                and not any(s.will_draft for s in states)
                and not self.cache_config.enable_prefix_caching
            ):
                return [[] for _ in req_ids]
            scheduler_output.num_spec_tokens_to_schedule = max(1, min(int(wants.max(initial=0)), p.window))
            return super().propose_draft_token_ids(scheduler_output, *args, **kwargs)

        sampled, sampling_metadata, attn_metadata = _vllm.proposer_arguments(args, kwargs)
        tp = self._token_proposer
        # EAGLE-3's input, taken before the draft model's passes can overwrite the target's outputs.
        target_hidden = tp.target_hidden_states(args, kwargs) if tp is not None else None
        token_level = np.zeros(len(req_ids), dtype=bool)
        if tp is not None:  # token-level drafts come from it; the draft model writes windows only
            token_level = (wants > 0) & ~np.array([s.judging for s in states], dtype=bool)
            wants = np.where(token_level, 0, wants)
        tokens, committed = _vllm.committed_tokens(self)  # [max_reqs, max_len], [B]
        if not wants.any() and not p.windows:
            for state in states:  # (the credit needs this step's tokens, not read here)
                state.draft_ahead = 0
            self._parse_draft_lens = {}
            self._parse_window_report = WindowReport()
            drafts = torch.zeros((len(req_ids), 0), dtype=torch.int64, device=self.device)
        else:
            new = self._parse_new_tokens(sampled)  # B x [n]: this step's accepted draft tokens, then the sampled one
            limits = [_vllm.request_limits(self, r) for r in req_ids]  # (max_tokens, min_tokens, stops)
            rows = step_rows(
                req_ids,
                wants,
                np.array([s.judging for s in states], dtype=bool),
                np.array([s.draft_kv_len for s in states], dtype=np.int64),
                np.array([s.draft_ahead for s in states], dtype=np.int64),
                committed.astype(np.int64),
                new,
                np.array([lim[0] for lim in limits], dtype=np.int64),
                np.array([_vllm.request_output_len(self, r) for r in req_ids], dtype=np.int64),
                [lim[2] for lim in limits],
                _vllm.rows_in_partial_prefill(self, scheduler_output),
                min(self.max_model_len, self.effective_drafter_max_model_len),
                p.windows,
                p.config.draft_chunk,
            )
            drafts = self._draft_rows(rows, tokens, attn_metadata.block_table_tensor, sampling_metadata, states)
        if tp is None or not (tp.keeps_kv or token_level.any()):
            return drafts
        # Last: EAGLE's draft steps advance the step's attention metadata in place.
        new = None
        if not tp.keeps_kv:  # (n-gram: the host's tokens; a row still in prefill has none yet)
            partial = _vllm.rows_in_partial_prefill(self, scheduler_output)
            new = [t[:0] if partial[i] else t for i, t in enumerate(self._parse_new_tokens(sampled))]
        proposed, lens = tp.propose(self, args, kwargs, new, committed, target_hidden, p.host.to_device)  # [B, k], [B]
        if token_level.any():
            width = max(drafts.shape[1], proposed.shape[1])
            merged = torch.zeros((len(req_ids), width), dtype=torch.int64, device=self.device)
            merged[:, : drafts.shape[1]] = drafts
            (rows_t,) = p.host.to_device(np.flatnonzero(token_level))
            merged[rows_t, : proposed.shape[1]] = proposed[rows_t].to(torch.int64)
            drafts = merged
            for i in np.flatnonzero(token_level):
                self._parse_draft_lens[req_ids[i]] = min(int(lens[i]), p.draft_len(states[i]))
        return drafts

    def _draft_rows(self, rows: DraftRows, tokens, batch_block_table, sampling_metadata, states) -> torch.Tensor:
        """Run the drafter over the step's DraftRows; the batch rows' drafts on
        the device [B, longest]. Open windows advance (`_advance_windows`)."""
        p = self.parse
        B = rows.num_batch
        passes, kv_len = plan_passes(
            rows.wants,
            rows.kv_len,
            rows.known_len,
            window=min(p.window, p.config.draft_chunk) if p.config.draft_chunk else p.window,
            spec_tokens=p.config.spec_tokens,
            max_tokens=self.scheduler_config.max_num_batched_tokens,
            max_rows=self.scheduler_config.max_num_seqs,
        )
        staged = self._parse_staging.stage(
            [(dp.row, *pass_spans(dp, tokens, rows.committed, rows.new), dp.start) for dp in passes]
        )
        drafts = torch.zeros(
            (len(rows.req_ids), max((dp.num_draft for dp in passes), default=0)), dtype=torch.int64, device=self.device
        )
        block_table = _vllm.drafting_block_table(self, batch_block_table, B, rows.req_ids[B:], p.host.to_device)
        for dp, inputs in zip(passes, staged):
            self._draft_pass(dp, inputs, block_table, sampling_metadata, rows.wants, rows.stops, drafts)
        for i, state in enumerate(states):
            state.draft_kv_len = int(kv_len[i])
            state.draft_ahead = max(0, int(rows.wants[i]) - 1)  # the KV of the draft tokens it is given
        lens = self._advance_windows(rows, drafts, states)
        self._parse_draft_lens = dict(zip(rows.req_ids[:B], lens.tolist()))
        return drafts[:B]

    def _advance_windows(self, rows: DraftRows, drafts: torch.Tensor, states) -> np.ndarray:
        """This step's chunk of every window drafted in chunks, read back once
        (drafting.advance_windows); the batch rows' draft lengths [B]. Sets the
        step's WindowReport."""
        p = self.parse
        win = rows.window_rows
        got = np.zeros((0, 0), dtype=np.int64)
        if win.shape[0]:
            (got,) = p.host.fetch(drafts[p.host.to_device(win)[0]], drafter=True)
        lens, done = advance_windows(rows, got, p.windows)
        for r in win:
            p.stats.note_window_chunk(int(rows.wants[r]))
        for r in np.flatnonzero(lens < rows.wants[: rows.num_batch]):
            states[r].draft_ahead = 0  # its window is open: no draft this step
        for req_id, window in done.items():
            state = p.states[req_id]
            state.draft_kv_len, state.draft_ahead = window.start, len(window.draft) - 1
        self._parse_window_report = WindowReport(open=frozenset(p.windows), done={r: w.draft for r, w in done.items()})
        return lens

    def _draft_pass(self, dp, inputs, block_table, sampling_metadata, wants, stops, drafts) -> None:
        """One pass of the drafter (drafting.py), writing its rows' drafts into `drafts`
        [B, longest]: DRAFT_CHUNK tokens per call, the rows whose draft ended (a stop
        token, or all they want) leaving between calls."""
        p = self.parse
        active = np.arange(dp.row.shape[0])  # rows of the pass still drafting
        done = 0
        while True:
            n = min(DRAFT_CHUNK, dp.num_draft - done)
            ids = _vllm.propose_rows(self, block_table, sampling_metadata, inputs, n)  # [len(active), n]
            p.host.count_drafter_call()
            p.stats.drafter_passes += 1
            p.stats.drafter_rows += int(active.shape[0])
            p.stats.drafter_tokens += int(inputs.target_tokens.shape[0] + active.shape[0])
            if n == 0:
                return
            drafts[inputs.rows, done : done + n] = ids
            done += n
            if done >= dp.num_draft:
                return
            (got,) = p.host.fetch(ids, drafter=True)
            going = [
                g for g, r in enumerate(dp.row[active]) if done < wants[r] and first_stop_index(got[g], stops[r]) < 0
            ]
            if not going:
                return
            active = active[going]
            (keep,) = p.host.to_device(np.array(going, dtype=np.int64))
            inputs = self._parse_staging.stage_continuation(
                dp.row[active], ids[keep, n - 2 :], dp.end[active] + done - 1
            )

    def _parse_new_tokens(self, sampled: torch.Tensor) -> list[np.ndarray]:
        """Each row's tokens from this step (accepted draft tokens, then the
        sampled one) on the host: as `_sample` fetched them, or fetched here
        (at most once a step)."""
        if self._parse_sampled is None:
            (self._parse_sampled,) = self.parse.host.fetch(sampled)
        return [row[row != _vllm.PLACEHOLDER_TOKEN_ID] for row in self._parse_sampled]

    @_watched
    def take_draft_token_ids(self):
        drafts = super().take_draft_token_ids()
        p = self.parse
        if p is None or drafts is None:
            return drafts
        if not self._parse_drafted:
            # vLLM skipped the drafter this step and left placeholder drafts
            # (token 0): they are no one's draft.
            drafts.draft_token_ids = [[] for _ in drafts.req_ids]
            return drafts
        for i, req_id in enumerate(drafts.req_ids):
            draft = drafts.draft_token_ids[i][: self._parse_draft_lens.get(req_id, 0)]
            if draft and req_id in self.requests:
                # A draft ends at its first stop token: what the drafter wrote
                # after it is not part of the answer and need not be verified.
                stop = first_stop_index(draft, _vllm.request_limits(self, req_id)[2])
                if stop >= 0:
                    draft = draft[: stop + 1]
            drafts.draft_token_ids[i] = draft
        return drafts

    # -- acceptance ---------------------------------------------------------

    @_watched
    def _sample(self, logits, spec_decode_metadata):
        p = self.parse
        md = spec_decode_metadata
        if p is None:
            return super()._sample(logits, md)
        p.host.new_step()
        self._parse_drafted = False  # until this step's drafter runs (propose_draft_token_ids)
        self._parse_window_report = WindowReport(open=frozenset(p.windows))  # until it runs
        self._parse_sampled = None  # this step's sampled tokens on the host, once fetched
        if md is None:  # (with a speculative config, vLLM always passes metadata)
            return super()._sample(logits, md)
        req_ids = list(self.input_batch.req_ids)

        # The drafts PARSE judges, and the target's checks of their tokens
        # (guard, constraints), started on the device before sampling.
        settings = p.settings(self.model_config.get_vocab_size(), self.model_config.max_model_len)
        batch, judged = self._draft_batch(logits, md)
        batch.views = draft_views(batch, settings.vocab_size)
        checks = token_checks(batch, batch.views, p.host.to_device)  # [2, R] on the device

        # 1. Token-level verification with vLLM's own rejection sampler (on at
        #    most its 128-token limit per request; longer drafts are judged).
        std_logits, std_md = _vllm.truncate_spec_decode(
            logits, md, _vllm.REJECTION_SAMPLER_MAX_SPEC_LEN, p.host.to_device
        )
        out = _vllm.widen_sampled(super()._sample(std_logits, std_md), md.max_spec_len + 1)  # [B, W+1]
        # The step's one read of its inputs: sampled tokens and the checks.
        sampled, batch.checks = p.host.fetch(out.sampled_token_ids, checks)
        accepted = (sampled != _vllm.PLACEHOLDER_TOKEN_ID).sum(axis=1) - 1  # [B] token-level
        batch.l_tok = accepted[batch.row]
        self._count_token_level(np.asarray(md.num_draft_tokens), batch.row, accepted)

        # 2-3. The PARSE step over the drafts it judges.
        if batch.num_reqs:
            result = parse_step(batch, lambda copies: p.judge(copies, batch, judged), settings)
            p.apply(judged.req_ids, batch, result)
            # 4. draft[:accepted] plus one token sampled from the target there.
            if result.resample.any():
                self._resample(logits, md, batch, result, out, sampled)
        self._parse_sampled = sampled

        # Requests the target is writing (REWRITE phase) count its tokens; a
        # request judged this step starts counting from the next one.
        judged = set(judged.req_ids)
        for i, req_id in enumerate(req_ids):
            if req_id not in judged and p.rewriting(req_id):
                p.after_tokens(req_id, sampled[i][sampled[i] != _vllm.PLACEHOLDER_TOKEN_ID].tolist())
        p.export()
        self._parse_audit_kv()  # the tables as the verification left them
        return out

    def _count_token_level(self, num_draft: np.ndarray, judged_rows: np.ndarray, accepted: np.ndarray) -> None:
        """Drafts verified token by token only (not judged), counted by the
        proposer that wrote them."""
        plain = num_draft > 0
        plain[judged_rows] = False
        if plain.any():
            tp = self._token_proposer
            self.parse.stats.token_level(
                "draft_model" if tp is None else tp.method,
                int(plain.sum()),
                int(num_draft[plain].sum()),
                int(accepted[plain].sum()),
            )

    def _draft_batch(self, logits, md) -> tuple[DraftBatch, JudgedRequests]:
        """vLLM's batch -> the DraftBatch of requests PARSE judges this step
        (those in the DRAFT phase with a draft), all on the host but the
        logits, and who they are; `l_tok` is filled once the rejection
        sampler has run."""
        req_ids = self.input_batch.req_ids
        num_draft = np.asarray(md.num_draft_tokens)  # [B]
        cu_all = np.concatenate([[0], np.cumsum(num_draft)])
        drafts = _vllm.scheduled_drafts(self, md.num_draft_tokens)  # [Σd]
        starts = _vllm.cu_sampled_tokens(md) - (num_draft + 1)  # logits row of each last token
        rows = np.array(
            [i for i, r in enumerate(req_ids) if num_draft[i] and self._parse_state(r).judging], dtype=np.int64
        )
        options = [self._parse_state(req_ids[i]).options for i in rows]
        limits = [_vllm.request_limits(self, req_ids[i]) for i in rows]
        sm = self.input_batch.sampling_metadata
        forbidden = None
        if sm.allowed_token_ids_mask is not None and rows.shape[0]:
            forbidden = sm.allowed_token_ids_mask[self.parse.host.to_device(rows)[0]]
        bad_words = sm.bad_words_token_ids or {}
        cached_len = self.input_batch.num_computed_tokens_cpu[rows].astype(np.int64) + 1
        judged = JudgedRequests(
            req_ids=[req_ids[i] for i in rows],
            # (read only when judgments are recorded)
            context=[self.input_batch.token_ids_cpu[i, :n].copy() for i, n in zip(rows, cached_len)]
            if self.parse.config.record_judgments
            else [],
        )
        batch = DraftBatch(
            row=rows,
            draft=np.concatenate([drafts[cu_all[i] : cu_all[i + 1]] for i in rows]) if rows.shape[0] else drafts[:0],
            cu_draft=np.concatenate([[0], np.cumsum(num_draft[rows])]).astype(np.int64),
            logits_start=starts[rows],
            cached_len=cached_len,
            output_len=np.array([_vllm.request_output_len(self, req_ids[i]) for i in rows], dtype=np.int64),
            max_tokens=np.array([m for m, _, _ in limits], dtype=np.int64),
            min_tokens=np.array([m for _, m, _ in limits], dtype=np.int64),
            stop_ids=[st for _, _, st in limits],
            l_tok=np.zeros(rows.shape[0], dtype=np.int64),
            threshold=np.array([o.threshold for o in options], dtype=np.float64),
            guard=np.array([o.guard for o in options], dtype=np.int64),
            greedy=np.array([_vllm.request_is_greedy(self, req_ids[i]) for i in rows], dtype=bool),
            bad_words=np.array([int(i) in bad_words for i in rows], dtype=bool),
            logits=logits,
            forbidden=forbidden,
        )
        return batch, judged

    def _resample(self, logits, md, batch: DraftBatch, result, out, sampled_host: np.ndarray) -> None:
        """Rows that take more than L_tok: draft[:accepted], then one token
        sampled from the target at that position with the request's own
        parameters (penalties over its output plus the accepted prefix; only
        these rows' seeded generators advance). Updates `out` on the device
        and `sampled_host`, its host copy."""
        ks = np.flatnonzero(result.resample)
        rows, n = batch.row[ks], result.accepted[ks]
        prefixes = {int(r): batch.draft_of(k)[:n_k].tolist() for k, r, n_k in zip(ks, rows, n)}
        take = _vllm.cu_sampled_tokens(md) - 1  # default: each request's bonus row
        take[rows] = batch.logits_start[ks] + n
        host = self.parse.host
        take_t, rows_t = host.to_device(take, rows)
        sampled = _vllm.sample_after_prefixes(
            self.sampler, logits[take_t], self.input_batch.sampling_metadata, prefixes
        )  # [B]
        (tail,) = host.fetch(sampled[rows_t])
        new = np.full((ks.shape[0], sampled_host.shape[1]), _vllm.PLACEHOLDER_TOKEN_ID, dtype=np.int64)
        for j, (r, n_k) in enumerate(zip(rows, n)):
            new[j, :n_k] = prefixes[int(r)]
        new[np.arange(ks.shape[0]), n] = tail
        sampled_host[rows] = new
        ids = out.sampled_token_ids
        ids[rows_t] = host.to_device(new)[0].to(ids.dtype)

    # -- KV audit -------------------------------------------------------------

    def parse_kv_block_use(self) -> tuple[int, set[int], np.ndarray]:
        """(requests in the batch, the KV block ids their tables hold, the
        PARSE scratch block ids [R] — empty on the kernel path)."""
        scratch = self.parse.scratch_ids() if self.parse is not None else np.zeros(0, dtype=np.int64)
        return int(self.input_batch.num_reqs), _vllm.batch_request_block_ids(self.input_batch), scratch

    def _parse_audit_kv(self) -> None:
        if self.parse is not None and self.parse.kv_audit is not None:
            self.parse.audit(int(self.input_batch.num_reqs), _vllm.batch_request_block_ids(self.input_batch))


class CpuSeededChunkedPrefillMixin:
    """Seeded requests whose prompt is prefilled in chunks, on the CPU.

    A row still in prefill samples a token that is thrown away; vLLM then
    rewinds that request's generator with `set_offset`, which only CUDA
    generators have: on the CPU it raises and the engine dies, losing every
    request in flight (vLLM 0.32, with or without PARSE). Here the rewind is
    done the CPU way, by the generator's state: saved before sampling,
    restored after, and the generator kept out of vLLM's rewind. A seeded
    request's tokens then do not depend on how its prompt was chunked, as on
    a GPU."""

    def _sample(self, logits, spec_decode_metadata):
        gens = _vllm.discarded_rows_cpu_generators(self)
        states = {i: g.get_state() for i, g in gens.items()}
        try:
            return super()._sample(logits, spec_decode_metadata)
        finally:
            for i, g in gens.items():
                g.set_state(states[i])

    def _bookkeeping_sync(self, *args, **kwargs):
        with _vllm.generators_hidden(self, _vllm.discarded_rows_cpu_generators(self)):
            return super()._bookkeeping_sync(*args, **kwargs)


def _make_runner(base, *mixins):
    return type(f"Parse{base.__name__}", (*mixins, ParseRunnerMixin, base), {"__module__": __name__})


# Each runner is built when its platform's worker asks for it: the bases are
# platform-specific vLLM modules (the GPU runner's imports CUDA-only code).
_BUILDERS = {
    "ParseCPUModelRunner": lambda: _make_runner(_vllm.cpu_model_runner_cls(), CpuSeededChunkedPrefillMixin),
    "ParseGPUModelRunner": lambda: _make_runner(_vllm.gpu_model_runner_cls()),
}


def __getattr__(name):
    build = _BUILDERS.get(name)
    if build is None:
        raise AttributeError(name)
    cls = globals()[name] = build()
    return cls
