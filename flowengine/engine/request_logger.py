"""`--enable-log-requests`: one INFO line per admitted request, as vLLM's RequestLogger.

The line names the request id, the number of prompt tokens and the sampling
parameters. The prompt itself (its text and token ids) is user data: it is logged only
when the operator asks for it with `--max-log-len N`, and then cut to N characters and N
token ids. This is the one difference from vLLM, whose default (None) logs whole prompts.
"""

from __future__ import annotations

import logging

from flowengine.engine.input_processor import ProcessedPrompt

logger = logging.getLogger("flowengine.requests")


class RequestLogger:
    """Formats and logs admitted requests.

    Args:
        max_log_len: prompt characters and token ids to show; None or 0: none shown.
    Raises ValueError for a negative `max_log_len`.
    """

    def __init__(self, max_log_len: int | None = None) -> None:
        if max_log_len is not None and max_log_len < 0:
            raise ValueError(f"max_log_len must be >= 0, got {max_log_len}")
        self.max_log_len = max_log_len or 0
        if self.max_log_len:
            logger.warning("--max-log-len %d: the first %d characters and token ids of every "
                           "prompt go to the log", self.max_log_len, self.max_log_len)

    def format(self, request_id: str, processed: ProcessedPrompt) -> str:
        params = processed.sampling_params
        line = (f"Received request {request_id}: prompt_tokens={len(processed.prompt_token_ids)}"
                f", params={params!r}")
        if processed.cache_salt is not None:
            line += ", cache_salt=<set>"  # a tenant secret: never its value
        if self.max_log_len:
            n = self.max_log_len
            text = None if processed.prompt is None else processed.prompt[:n]
            line += f", prompt={text!r}, prompt_token_ids={processed.prompt_token_ids[:n]}"
        return line

    def log_inputs(self, request_id: str, processed: ProcessedPrompt) -> None:
        if logger.isEnabledFor(logging.INFO):
            logger.info("%s", self.format(request_id, processed))
