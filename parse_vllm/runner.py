"""The PARSE model runner: vLLM's model runner with PARSE acceptance.

vLLM's step (model runner V1) already does most of PARSE: the draft model
drafts a window of W tokens (method "draft_model", num_speculative_tokens=W),
the next step's target forward writes KV for the last token and the whole
draft and computes logits at every draft position. PARSE replaces how many of
those draft tokens are accepted, in `_sample`:

  1. token-level verification, vLLM's own rejection sampler  -> L_tok
  2. boundaries of each judged draft; one verification pass over all
     (request, boundary) copies of the suffix                 -> p_k
  3. L_sem = maximal valid prefix; accept max(L_sem, L_tok) draft tokens,
     then one token sampled from the target at that position.

The accepted prefix's KV was written by step 1's forward and is kept as is
(the scheduler rolls back only the rejected tail). Per-request phases (draft
a window / let the target write) steer how many draft tokens each request is
given next (`propose_draft_token_ids`, `take_draft_token_ids`).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from dataclasses import dataclass

import numpy as np
import torch

from parse_vllm import _vllm
from parse_vllm.acceptance import (
    constrained_view,
    final_accept_len,
    first_stop_index,
    guard_mask,
    maximal_valid_prefix,
    view_draft,
)
from parse_vllm.boundaries import BoundaryRule, sentence_end_mask
from parse_vllm.config import ParseConfig, ParseConfigError, parse_section, request_options
from parse_vllm.metrics import KvAudit, ParseStats, PromExporter
from parse_vllm.policy import Phase, RequestState
from parse_vllm.templates import VerificationTemplate, build_template
from parse_vllm.verifier import CopyBatch, ForkedBlockTableVerifier, scratch_block_count

logger = _vllm.init_logger("parse_vllm.runner")


@dataclass
class _Parse:
    """What the runner holds for PARSE once the model is loaded."""

    config: ParseConfig
    window: int  # W = num_speculative_tokens
    rule: BoundaryRule
    sentence_end: np.ndarray  # [vocab] bool
    template: VerificationTemplate
    layer_names: list[str]
    verifier: object | None = None  # ForkedBlockTableVerifier | KernelVerifier


class ParseRunnerMixin:
    """Mixed into vLLM's CPU and GPU model runners (see bottom of module)."""

    # -- set-up -----------------------------------------------------------

    def load_model(self, *args, **kwargs) -> None:
        super().load_model(*args, **kwargs)
        self._parse_states: dict[str, RequestState] = {}
        self.parse_judgments: collections.deque = collections.deque(maxlen=1)
        self.parse_stats = ParseStats()
        self._parse_last_exported = ParseStats()
        self._parse_prom = PromExporter({"model_name": str(self.vllm_config.model_config.served_model_name)})
        self.parse_kv_audit: KvAudit | None = None
        section = parse_section(self.vllm_config.additional_config)
        spec = self.speculative_config
        if section is None or spec is None:
            self._parse = None
            return
        config = ParseConfig.from_dict(section)
        tokenizer = _vllm.target_tokenizer(self.vllm_config)
        template = build_template(tokenizer, config)
        vocab = self.model_config.get_vocab_size()
        sentence_end = sentence_end_mask(tokenizer, vocab)
        self._parse = _Parse(
            config=config,
            window=spec.num_speculative_tokens,
            rule=BoundaryRule(config.boundaries, config.every, config.max_boundaries, sentence_end),
            sentence_end=sentence_end,
            template=template,
            layer_names=_vllm.attention_layer_names(self.model),
        )
        self.parse_judgments = collections.deque(maxlen=max(1, config.record_judgments))
        if config.audit_kv_blocks:
            self.parse_kv_audit = KvAudit()
        logger.info(
            "PARSE on: window W=%d, τ=%.3g, guard=%d, boundaries=%s, max K=%d, suffix %d tokens %r, "
            "labels %r/%r (ids %s/%s), on_reject=%s",
            self._parse.window,
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

    def initialize_kv_cache_tensors(self, *args, **kwargs):
        caches = super().initialize_kv_cache_tensors(*args, **kwargs)
        self._parse_caches_by_layer = caches  # addressed by scheduler block ids
        return caches

    def initialize_kv_cache(self, kv_cache_config, *args, **kwargs) -> None:
        super().initialize_kv_cache(kv_cache_config, *args, **kwargs)
        p = getattr(self, "_parse", None)
        is_profiling = kwargs.get("is_profiling", args[0] if args else False)
        if p is None or is_profiling:
            # (GPU CUDA-graph memory profiling builds a throwaway cache of a
            # few blocks first; the verifier is set up on the real one.)
            return
        gid = _vllm.kv_cache_group_of_layers(kv_cache_config, p.layer_names)
        num_blocks = kv_cache_config.num_blocks
        scratch = scratch_block_count(p.config.scratch_blocks, num_blocks, p.config.verifier)
        common = dict(
            suffix_ids=p.template.suffix_ids,
            labels=p.template.labels,
            kv_cache_group_id=gid,
            layer_names=p.layer_names,
            layer_caches=[self._parse_caches_by_layer[n] for n in p.layer_names],
            num_blocks=num_blocks,
            block_size=kv_cache_config.kv_cache_groups[gid].kv_cache_spec.block_size,
            check_isolation=p.config.record_judgments > 0,
        )
        p.verifier = None
        if p.config.verifier in ("kernel", "auto") and self.device.type != "cpu":
            # The fused prefix-verify kernel reads the backend's standard paged
            # KV layout (GPU backends); it writes no scratch KV.
            from parse_vllm.kernel_verifier import KernelVerifier

            try:
                p.verifier = KernelVerifier(
                    self, **common, max_tokens_per_pass=self.scheduler_config.max_num_batched_tokens
                )
            except (NotImplementedError, ValueError, RuntimeError) as e:
                if p.config.verifier == "kernel":
                    raise
                logger.warning("PARSE: kernel verification unavailable (%s); using forked block tables", e)
        if p.verifier is None:
            # Rows of pseudo-requests per pass are bounded where the backend
            # keeps per-request buffers sized max_num_seqs (kernel block
            # tables, GPU backends).
            needs_row_limit = self.device.type != "cpu" or any(
                g.kernel_block_size is not None for g in self.attn_groups[gid]
            )
            p.verifier = ForkedBlockTableVerifier(
                self,
                **common,
                scratch_ids=np.arange(num_blocks - scratch, num_blocks),
                max_rows_per_pass=self.scheduler_config.max_num_seqs if needs_row_limit else None,
            )
        logger.info(
            "PARSE verification: %s, scratch %d of %d KV blocks",
            type(p.verifier).__name__,
            scratch,
            num_blocks,
        )

    # -- per-request state --------------------------------------------------

    def _parse_state(self, req_id: str) -> RequestState:
        state = self._parse_states.get(req_id)
        if state is None:
            try:
                opts = request_options(_vllm.request_extra_args(self, req_id), self._parse.config)
            except ParseConfigError as e:  # validated at admission; be safe anyway
                logger.warning("request %s: %s; PARSE off for it", req_id, e)
                opts = dataclasses.replace(request_options(None, self._parse.config), enabled=False)
            if _vllm.request_wants_logprobs(self, req_id):
                # Logprobs of semantically accepted tokens are not produced:
                # such requests get token-level speculation only.
                opts = dataclasses.replace(opts, enabled=False)
            state = self._parse_states[req_id] = RequestState(opts)
        return state

    def _update_states(self, scheduler_output):
        out = super()._update_states(scheduler_output)
        states = getattr(self, "_parse_states", None)
        if states:
            for req_id in scheduler_output.finished_req_ids:
                states.pop(req_id, None)
        self._parse_audit_kv()  # this step's tables, before any verification
        return out

    # -- drafting: how many draft tokens each request gets ------------------

    def propose_draft_token_ids(self, scheduler_output, *args, **kwargs):
        p = getattr(self, "_parse", None)
        if p is not None and self.input_batch.req_ids:
            states = [self._parse_state(r) for r in self.input_batch.req_ids]
            if p.config.spec_tokens == 0 and not any(s.will_draft for s in states):
                # No request here drafts again (all are past a rejection in
                # `continue` mode, or have PARSE off): the target decodes
                # alone, like vLLM without speculation, and the drafter's KV
                # for these requests is never read again.
                return [[] for _ in states]
            # Otherwise the drafter runs for the whole batch (it consumes
            # this step's tokens to keep its KV in sync), drafting only as far
            # as some request needs.
            wanted = max(s.draft_len(p.config, p.window) for s in states)
            scheduler_output.num_spec_tokens_to_schedule = max(1, min(wanted, p.window))
        return super().propose_draft_token_ids(scheduler_output, *args, **kwargs)

    def take_draft_token_ids(self):
        drafts = super().take_draft_token_ids()
        p = getattr(self, "_parse", None)
        if p is None or drafts is None:
            return drafts
        for i, req_id in enumerate(drafts.req_ids):
            if req_id not in self.requests:
                continue
            draft = drafts.draft_token_ids[i]
            n = self._parse_state(req_id).draft_len(p.config, p.window)
            # A draft ends at its first stop token: what the drafter wrote
            # after it is not part of the answer and need not be verified.
            stop = first_stop_index(draft[:n], _vllm.request_limits(self, req_id)[2])
            if stop >= 0:
                n = stop + 1
            if len(draft) > n:
                drafts.draft_token_ids[i] = draft[:n]
        return drafts

    # -- acceptance ---------------------------------------------------------

    def _sample(self, logits, spec_decode_metadata):
        p = getattr(self, "_parse", None)
        md = spec_decode_metadata
        if p is None or md is None:
            return super()._sample(logits, md)

        # 1. Token-level verification with vLLM's own rejection sampler (on at
        #    most its 128-token limit per request; longer drafts are judged).
        std_logits, std_md = _vllm.truncate_spec_decode(logits, md, _vllm.REJECTION_SAMPLER_MAX_SPEC_LEN)
        std = super()._sample(std_logits, std_md)
        width = md.max_spec_len + 1
        out = _vllm.widen_sampled(std, width)  # [B, W+1], -1 padded
        out_cpu = out.sampled_token_ids.cpu().numpy()
        l_tok = (out_cpu != _vllm.PLACEHOLDER_TOKEN_ID).sum(axis=1) - 1  # [B]

        req_ids = self.input_batch.req_ids
        num_draft = np.asarray(md.num_draft_tokens)
        cu_draft = np.concatenate([[0], np.cumsum(num_draft)])
        drafts = md.draft_token_ids.cpu().numpy().astype(np.int64)  # [Σd]
        self._parse_step_drafts = (drafts, cu_draft)  # for _draft_of, this step only

        # 2. What each judged request's draft offers, and its boundaries.
        cu_sampled = md.cu_num_sampled_tokens.cpu().numpy()
        starts = cu_sampled - (num_draft + 1)  # logits row of each request's last token
        rows, views, bounds, guard_lens, cu_copies = [], [], [], [], [0]
        for i, req_id in enumerate(req_ids):
            if num_draft[i] == 0:
                continue
            state = self._parse_state(req_id)
            if not state.judging:
                continue
            draft = self._draft_of(i)
            max_tokens, min_tokens, stops = _vllm.request_limits(self, req_id)
            view = view_draft(
                draft,
                stops,
                _vllm.request_output_len(self, req_id),
                max_tokens,
                min_tokens,
                vocab_size=p.sentence_end.shape[0],
            )
            if view.text_len == 0:
                continue  # nothing to judge (placeholder drafts, or a stop first)
            self.parse_stats.drafts += 1
            self.parse_stats.draft_tokens += view.text_len
            if l_tok[i] >= view.text_len:
                # Token-level verification already took the whole draft.
                self.parse_stats.drafts_accepted_whole += 1
                self.parse_stats.tokens_accepted_token_level += int(l_tok[i])
                continue
            b = p.rule.select(draft[: view.text_len])
            guard_len = None
            if state.options.guard:
                # The guard first: no boundary past the first one at or beyond
                # the guard's cut can add accepted tokens, so none is judged;
                # when the guard lets nothing through beyond token-level
                # acceptance, nothing is.
                guard_len = self._guard_len(logits, i, starts[i], view, state.options.guard)
                b = b[:0] if guard_len <= l_tok[i] else b[: np.searchsorted(b, guard_len) + 1]
            if p.config.two_stage and b.shape[0] > 1:
                b = b[-1:]  # holistic check first; prefixes only if it fails
            rows.append(i)
            views.append(view)
            bounds.append(b)
            guard_lens.append(guard_len)
            cu_copies.append(cu_copies[-1] + b.shape[0])

        if rows:
            self._judge_and_accept(
                p, logits, md, out, out_cpu, l_tok, starts, rows, views, bounds, guard_lens, np.asarray(cu_copies)
            )

        # 3. Bookkeeping for requests the target is writing (REWRITE phase);
        #    a request judged this step starts counting from the next one.
        judged = set(rows)
        for i, req_id in enumerate(req_ids):
            state = self._parse_states.get(req_id)
            if state is not None and state.phase is Phase.REWRITE and i not in judged:
                emitted = [int(t) for t in out_cpu[i] if t != _vllm.PLACEHOLDER_TOKEN_ID]
                state.after_tokens(emitted, p.sentence_end)
        self._parse_export()
        self._parse_audit_kv()  # the tables as the verification left them
        return out

    def _judge_and_accept(self, p, logits, md, out, out_cpu, l_tok, starts, rows, views, bounds, guard_lens, cu_copies):
        stats = self.parse_stats
        num_computed = self.input_batch.num_computed_tokens_cpu
        req_ids = self.input_batch.req_ids

        def judge(rows_, bounds_):
            # Copy (i, b): the request's c = num_computed tokens were cached
            # before this step; this step added its last token and the draft,
            # so draft[:b] ends at cached length c + 1 + b.
            req_row = np.repeat(np.asarray(rows_), [x.shape[0] for x in bounds_])
            prefix = np.concatenate([num_computed[r] + 1 + bb for r, bb in zip(rows_, bounds_)])
            t0 = time.perf_counter()
            j = p.verifier.judge(CopyBatch(req_row=req_row, prefix_len=prefix))
            stats.verification_passes += j.passes
            stats.copies += int(req_row.shape[0])
            stats.suffix_tokens += int(req_row.shape[0]) * p.verifier.suffix_len
            logger.debug("PARSE: judged %d copies in %.1f ms", req_row.shape[0], 1e3 * (time.perf_counter() - t0))
            if p.config.record_judgments:
                self._record_judgments(md, rows_, bounds_, prefix, j)
            return j.p_yes.numpy()

        thresholds = np.array([self._parse_states[req_ids[i]].options.threshold for i in rows])
        all_bounds = np.concatenate(bounds)
        # P(yes) is in [0, 1]: every copy passes τ <= 0 and fails τ > 1, so
        # only the requests in between are judged.
        copy_tau = np.repeat(thresholds, np.diff(cu_copies))
        passed = copy_tau <= 0
        asks = [k for k in range(len(rows)) if 0 < thresholds[k] <= 1 and bounds[k].shape[0]]
        if asks:
            p_yes = judge([rows[k] for k in asks], [bounds[k] for k in asks])
            at = np.concatenate([np.arange(cu_copies[k], cu_copies[k + 1]) for k in asks])
            passed[at] = p_yes >= copy_tau[at]

        if p.config.two_stage:
            # Stage 2: drafts that failed the holistic check get their earlier
            # boundaries judged, in one more pass.
            failed = [k for k in asks if not passed[cu_copies[k]]]
            earlier = {k: p.rule.select(self._draft_of(rows[k])[: views[k].text_len]) for k in failed}
            earlier = {k: b[b < bounds[k][0]] for k, b in earlier.items()}
            earlier = {k: b for k, b in earlier.items() if b.shape[0]}
            if earlier:
                p2 = judge([rows[k] for k in earlier], list(earlier.values()))
                cuts = np.cumsum([0] + [b.shape[0] for b in earlier.values()])
                p2_of = {k: p2[cuts[i] : cuts[i + 1]] for i, k in enumerate(earlier)}
                new_bounds, new_passed = [], []
                for k in range(len(rows)):
                    b, ok = bounds[k], passed[cu_copies[k] : cu_copies[k + 1]]
                    if k in earlier:
                        b = np.concatenate([earlier[k], b])
                        ok = np.concatenate([p2_of[k] >= thresholds[k], ok])
                    new_bounds.append(b)
                    new_passed.append(ok)
                bounds = new_bounds
                all_bounds, passed = np.concatenate(new_bounds), np.concatenate(new_passed)
                cu_copies = np.cumsum([0] + [b.shape[0] for b in new_bounds])

        l_sem, first_fail = maximal_valid_prefix(all_bounds, passed, cu_copies)

        override_rows, override_len = [], []
        for k, i in enumerate(rows):
            state = self._parse_states[req_ids[i]]
            view = views[k]
            guard_len = guard_lens[k]
            # Nothing judged because the guard let nothing through past
            # token-level acceptance: a guard cut.
            guard_cut = bounds[k].shape[0] == 0 and guard_len is not None and guard_len < views[k].text_len
            if l_sem[k] > l_tok[i]:
                # Semantic acceptance takes draft tokens the rejection sampler
                # did not: they must still obey the request's constraints and
                # pass its token guard.
                allowed = self._allowed_draft_len(logits, i, starts[i], view)
                view_c, l_c = constrained_view(view, int(l_sem[k]), allowed)
                if guard_len is not None:
                    view, l_sem[k] = constrained_view(view, int(l_sem[k]), min(allowed, guard_len))
                    guard_cut = final_accept_len(int(l_sem[k]), int(l_tok[i]), view) < final_accept_len(
                        l_c, int(l_tok[i]), view_c
                    )
                else:
                    view, l_sem[k] = view_c, l_c
            accepted = final_accept_len(int(l_sem[k]), int(l_tok[i]), view)
            stats.tokens_accepted_token_level += int(l_tok[i])
            stats.tokens_accepted_semantic += max(0, accepted - int(l_tok[i]))
            # A draft the judge passed whole but the guard cut is a token-level
            # correction, not a rejection: the request keeps drafting.
            judge_passed = first_fail[k] < 0
            rejected = accepted < views[k].text_len and not (guard_cut and judge_passed)
            if guard_cut:
                stats.guard_cuts += 1
            if rejected:
                stats.reject_at(int(first_fail[k]) if first_fail[k] >= 0 else 0)
            elif accepted >= views[k].text_len:
                stats.drafts_accepted_whole += 1
            before = state.phase
            state.after_judged_draft(p.config, rejected, guard_cut=guard_cut, accepted=accepted, window=p.window)
            if state.phase is Phase.REWRITE and before is not Phase.REWRITE:
                stats.rounds += 1
            if accepted > l_tok[i]:
                override_rows.append(i)
                override_len.append(accepted)

        if override_rows:
            # draft[:L] plus one token sampled from the target at position L,
            # with the request's own sampling parameters.
            num_reqs = len(req_ids)
            take = starts + np.asarray(md.num_draft_tokens)  # default: bonus rows
            take[override_rows] = starts[override_rows] + np.asarray(override_len)
            sampled = (
                _vllm.sample_rows(
                    self.sampler, logits[torch.from_numpy(take).to(logits.device)], self.input_batch.sampling_metadata
                )
                .view(num_reqs)
                .cpu()
                .numpy()
            )
            ids = out.sampled_token_ids
            for i, n in zip(override_rows, override_len):
                row = np.full(ids.shape[1], _vllm.PLACEHOLDER_TOKEN_ID, dtype=np.int64)
                row[:n] = self._draft_of(i)[:n]
                row[n] = sampled[i]
                out_cpu[i] = row
                ids[i] = torch.from_numpy(row).to(ids.device, ids.dtype)

    def _allowed_draft_len(self, logits, row: int, start: int, view) -> int:
        """How many leading tokens of input-batch row `row`'s draft (its text
        and the stop token after it) the request's constraints allow.

        vLLM's scheduler already cuts drafts of structured-output requests to
        their grammar-valid prefix, and the grammar bitmask has been applied
        to `logits` in place before `_sample`: a forbidden draft token has a
        -inf logit at its position. `allowed_token_ids` is a per-request
        mask. `bad_words` depend on the tokens before each position, which
        the sampler's history does not hold for accepted draft tokens: such
        requests take no draft token beyond the token-level check."""
        md = self.input_batch.sampling_metadata
        if row in (md.bad_words_token_ids or {}):
            return 0
        draft, rows = self._draft_rows(logits, row, start, view)
        ok = torch.isfinite(rows.gather(1, draft[:, None])[:, 0])
        if md.allowed_token_ids_mask is not None:
            ok &= ~md.allowed_token_ids_mask[row, draft]
        return _leading_true(ok)

    def _guard_len(self, logits, row: int, start: int, view, guard: int) -> int:
        """How many leading tokens of row `row`'s draft (text and stop token)
        the token guard lets through (`guard_mask`: within the target's
        top-`guard`). The strictest guard on a sampled request lets none
        through: token-level acceptance only."""
        if guard == 1 and not _vllm.request_is_greedy(self, self.input_batch.req_ids[row]):
            return 0
        draft, rows = self._draft_rows(logits, row, start, view)
        return _leading_true(guard_mask(rows, draft, guard))

    def _draft_rows(self, logits, row: int, start: int, view) -> tuple[torch.Tensor, torch.Tensor]:
        """Row `row`'s draft tokens up to and with the stop token after its
        text [n], and the target's logits at their positions [n, vocab]."""
        n = view.text_len + (1 if view.stop_index == view.text_len else 0)
        draft = torch.from_numpy(self._draft_of(row)[:n]).to(logits.device)
        return draft, logits[start : start + n]

    def _record_judgments(self, md, rows, bounds, prefix_len, j) -> None:
        tokens = self.input_batch.token_ids_cpu
        c = 0
        for row, bb in zip(rows, bounds):
            draft = self._draft_of(row)
            committed = tokens[row, : self.input_batch.num_computed_tokens_cpu[row] + 1].tolist()
            for b in bb:
                self.parse_judgments.append(
                    {
                        "req_id": self.input_batch.req_ids[row],
                        "boundary": int(b),
                        "token_ids": committed + draft[:b].tolist(),
                        "p_yes": float(j.p_yes[c]),
                        "logprob_yes": float(j.logprob_yes[c]),
                        "logprob_no": float(j.logprob_no[c]),
                        "requests_kv_unchanged": j.requests_kv_unchanged,
                    }
                )
                assert len(self.parse_judgments[-1]["token_ids"]) == prefix_len[c]
                c += 1

    def _draft_of(self, row: int) -> np.ndarray:
        """This step's draft of input-batch row `row` [d] (copied to the CPU
        once in `_sample`)."""
        drafts, cu_draft = self._parse_step_drafts
        return drafts[cu_draft[row] : cu_draft[row + 1]]

    # -- metrics ------------------------------------------------------------

    def parse_kv_block_use(self) -> tuple[int, set[int], np.ndarray]:
        """(requests in the batch, the KV block ids their tables hold, the
        PARSE scratch block ids [R] — empty on the kernel path)."""
        verifier = getattr(getattr(self, "_parse", None), "verifier", None)
        scratch = getattr(verifier, "scratch_ids", None)
        scratch = np.zeros(0, dtype=np.int64) if scratch is None else np.asarray(scratch)
        return int(self.input_batch.num_reqs), _vllm.batch_request_block_ids(self.input_batch), scratch

    def _parse_audit_kv(self) -> None:
        audit = getattr(self, "parse_kv_audit", None)
        if audit is not None:
            num_reqs, held, scratch = self.parse_kv_block_use()
            audit.record(num_reqs, len(held), len(held.intersection(scratch.tolist())))

    def _parse_export(self) -> None:
        now, last = self.parse_stats, self._parse_last_exported
        delta = ParseStats(
            **{k: getattr(now, k) - getattr(last, k) for k in now.as_dict() if k != "rejections_by_boundary"}
        )
        delta.rejections_by_boundary = {
            k: v - last.rejections_by_boundary.get(k, 0)
            for k, v in now.rejections_by_boundary.items()
            if v != last.rejections_by_boundary.get(k, 0)
        }
        self._parse_prom.add(delta)
        self._parse_last_exported = ParseStats(
            **{**now.as_dict(), "rejections_by_boundary": dict(now.rejections_by_boundary)}
        )


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


def _leading_true(mask: torch.Tensor) -> int:
    """Length of the all-True head of a [n] bool mask."""
    bad = torch.nonzero(~mask)
    return int(bad[0, 0]) if bad.shape[0] else int(mask.shape[0])


def _make_runner(base, *mixins):
    return type(f"Parse{base.__name__}", (*mixins, ParseRunnerMixin, base), {"__module__": __name__})


ParseCPUModelRunner = _make_runner(_vllm.cpu_model_runner_cls(), CpuSeededChunkedPrefillMixin)


def __getattr__(name):  # the GPU runner imports CUDA-only modules: on demand
    if name == "ParseGPUModelRunner":
        cls = _make_runner(_vllm.gpu_model_runner_cls())
        globals()[name] = cls
        return cls
    raise AttributeError(name)
