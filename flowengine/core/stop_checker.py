"""Stop conditions on token ids, checked after each generated token (DESIGN.md §4).

Stop strings need text and are matched by the detokenizer, which then aborts the
request through `Scheduler.finish_requests`.

Pure Python: this module must not import torch.
"""

from __future__ import annotations

from flowengine.request import Request, RequestStatus


def check_stop(request: Request, max_len: int) -> RequestStatus | None:
    """Decide whether `request` ends with its last output token.

    Rules, in order:
      1. EOS (`request.eos_token_id`, unless `sampling_params.ignore_eos`) or one of
         `sampling_params.stop_token_ids` -> FINISHED_STOPPED; for a stop token id,
         `request.stop_reason` is that id. Both count only once more than `min_tokens`
         outputs exist, matching the sampler, which suppresses them until `min_tokens`
         tokens have been generated (vLLM's and OpenAI's meaning of min_tokens).
      2. `request.max_tokens` outputs, or `max_len` tokens in all (prompt + outputs)
         -> FINISHED_LENGTH_CAPPED.

    A stop token is checked before the length limits, so a last token that is EOS
    reports "stop", the more informative reason.

    Args:
        request: a request with at least one output token.
        max_len: the longest sequence allowed, in tokens (max_model_len, or less).
    Returns the finished status to give the request, or None to keep it running. The
    status is not set here: `Scheduler._finish` moves the request and sets it.
    """
    # NOTE: runs for every generated token: reads the lists and params directly
    # rather than through Request's properties.
    params = request.sampling_params
    output_token_ids = request.output_token_ids
    num_output_tokens = len(output_token_ids)
    if num_output_tokens > params.min_tokens:
        last_token_id = output_token_ids[-1]
        if last_token_id == request.eos_token_id and not params.ignore_eos:
            return RequestStatus.FINISHED_STOPPED
        stop_token_ids = params.stop_token_ids
        if stop_token_ids and last_token_id in stop_token_ids:
            request.stop_reason = last_token_id
            return RequestStatus.FINISHED_STOPPED
    if (
        num_output_tokens >= request.max_tokens
        or num_output_tokens + len(request.prompt_token_ids) >= max_len
    ):
        return RequestStatus.FINISHED_LENGTH_CAPPED
    return None


def append_token_ids(
    request: Request, token_ids: list[int], max_len: int
) -> tuple[int, RequestStatus | None]:
    """Append sampled tokens one by one until a stop condition holds (`check_stop`).

    Tokens after the one that stops are dropped (several tokens come with speculative
    decoding). Returns (number of tokens appended, finished status or None).
    """
    append = request.output_token_ids.append
    for num_appended, token_id in enumerate(token_ids, start=1):
        append(token_id)
        status = check_stop(request, max_len)
        if status is not None:
            return num_appended, status
    return len(token_ids), None
