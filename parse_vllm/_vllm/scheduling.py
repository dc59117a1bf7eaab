"""The scheduler's side of PARSE's steps: the report each step carries from the runner,
the requests held while their window is drafted, and which requests lost their KV."""

from __future__ import annotations


def resumed_request_ids(scheduler_output) -> set[str]:
    """Requests resumed from preemption this step (their KV was recomputed, the draft's
    included only as far as the drafter runs over them again)."""
    return set(scheduler_output.scheduled_cached_reqs.resumed_req_ids or ())


def preempted_request_ids(scheduler_output) -> set[str]:
    """Requests preempted while this step was scheduled (their blocks freed:
    vllm.v1.core.sched.output.SchedulerOutput.preempted_req_ids)."""
    return set(getattr(scheduler_output, "preempted_req_ids", None) or ())


def new_request_ids(scheduler_output) -> set[str]:
    """Requests scheduled for the first time this step (SchedulerOutput.scheduled_new_reqs),
    including a streaming-input session's next turn, which comes back under its old id with
    new sampling parameters and no output yet (0.33: GPUModelRunner._update_streaming_request)."""
    return {r.req_id for r in scheduler_output.scheduled_new_reqs}


def finished_request_ids(scheduler_output) -> set[str]:
    """vllm.v1.core.sched.output.SchedulerOutput.finished_req_ids."""
    return set(scheduler_output.finished_req_ids)


# The runner's StepReport rides on the step's vllm.v1.outputs.ModelRunnerOutput (a
# dataclass: an extra attribute survives the executors' pickling) to the scheduler's
# update_from_output, which every step calls, with or without scheduled tokens
# (vllm.v1.engine.core.EngineCore.step). vLLM's own channel for drafts
# (take_draft_token_ids, then Scheduler.update_draft_token_ids in EngineCore.post_step)
# runs only after steps that ran the model, so every draft takes this one.
STEP_REPORT_ATTR = "parse_step_report"


def with_step_report(output, report):
    """`output` (a ModelRunnerOutput) carrying `report`; the shared
    vllm.v1.outputs.EMPTY_MODEL_RUNNER_OUTPUT is copied first."""
    import copy

    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput

    if report is None or not isinstance(output, ModelRunnerOutput):
        return output
    if output is EMPTY_MODEL_RUNNER_OUTPUT:
        output = copy.copy(output)
    setattr(output, STEP_REPORT_ATTR, report)
    return output


def step_report(output):
    return getattr(output, STEP_REPORT_ATTR, None)


def deliver_drafts(scheduler, drafts: dict[str, list[int]]) -> None:
    """Drafts for the next step, as vLLM delivers its own
    (vllm.v1.core.sched.scheduler.Scheduler.update_draft_token_ids: grammar-checked,
    skipped for finished requests)."""
    from vllm.v1.outputs import DraftTokenIds

    if drafts:
        scheduler.update_draft_token_ids(DraftTokenIds(list(drafts), list(drafts.values())))


# A held request stays in vllm.v1.core.sched.scheduler.Scheduler.running (it counts towards
# max_num_seqs, keeps its blocks and can be preempted) but is passed over when the running
# requests are scheduled: Scheduler.schedule skips a request while
# `current_step < request.next_decode_eligible_step` (vllm.v1.request.Request; otherwise set
# only by vllm.v1.core.sched.async_scheduler.AsyncScheduler and
# vllm.v1.core.sched.diffusion_scheduler, neither of which ParseScheduler derives from).
# 0.33: the same skip and symbols.
_HELD = 1 << 62


def hold_request(request) -> None:
    request.next_decode_eligible_step = _HELD


def release_request(request) -> None:
    if request.next_decode_eligible_step == _HELD:
        request.next_decode_eligible_step = 0
