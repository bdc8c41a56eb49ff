"""Rules the scheduler applies to one request at a time: how many tokens it may run from a point,
whether its next multimodal item needs a step of its own, and whether its last token stopped it.

Pure functions of the request and the limits, so each is tested alone and the scheduler reads as
the loop over requests it is.
"""

from __future__ import annotations

from fdplug.core.multimodal.chunking import legal_end, plan_chunks
from fdplug.core.request import Request, RequestStatus


def chunk_size(request: Request, start: int, budget: int, step_budget: int) -> int:
    """Tokens to run from ``start`` within ``budget``; never ends inside a bidirectional span.

    With spans ahead in the prompt, the chunk follows the balanced plan (fewest chunks of the
    step budget, then the smallest largest chunk), cut back to a legal end if this step has less
    room. 0 means "not this step".
    """
    num_new = min(request.num_tokens - start, budget)
    if not request.mm_spans or start >= request.num_prompt_tokens or num_new <= 0:
        return num_new
    if request.num_prompt_tokens - start > num_new:
        plan = plan_chunks(request.num_prompt_tokens, request.mm_spans, step_budget, start)
        if not plan.oversize[0]:
            num_new = min(num_new, plan.ends[0] - start)
    return legal_end(request.mm_spans, start, start + num_new) - start


def oversize_span(request: Request, start: int, step_budget: int) -> int:
    """The length of the span at ``start`` if it is larger than a whole step's budget, else 0."""
    if not request.mm_spans or start >= request.num_prompt_tokens:
        return 0
    if legal_end(request.mm_spans, start, min(start + step_budget, request.num_tokens)) > start:
        return 0
    return next(e - s for s, e in request.mm_spans if s >= start)


def check_stop(request: Request, max_model_len: int) -> bool:
    """Stop token (after min_tokens) before length: a natural stop on the last allowed token is "stop"."""
    params = request.sampling_params
    last = request.output_token_ids[-1]
    if request.num_output_tokens >= params.min_tokens:
        if not params.ignore_eos and last in request.eos_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        if last in params.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = last
            return True
    max_tokens = params.max_tokens
    if request.num_tokens >= max_model_len or (
            max_tokens is not None and request.num_output_tokens >= max_tokens):
        request.status = RequestStatus.FINISHED_LENGTH
        return True
    return False
