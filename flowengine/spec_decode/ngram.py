"""The n-gram (prompt lookup) proposer: draft tokens copied from the request itself.

After Saxena's prompt lookup decoding, vLLM's `method: "ngram"`: find the longest
suffix n-gram of the request's tokens (prompt + output so far), n from
`prompt_lookup_max` down to `prompt_lookup_min`, that also occurs earlier in them,
and propose the (up to k) tokens that followed that earlier occurrence. Among several
earlier occurrences the most recent one is taken (the text being quoted now is
usually the one quoted last). No match: no drafts.

Pure logic on token ids (numpy, no torch): the scheduler calls it while planning.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    """Args: num_speculative_tokens (k >= 1), prompt_lookup_min <= prompt_lookup_max
    (>= 1). Raises ValueError otherwise."""

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int,
                 prompt_lookup_max: int) -> None:
        if num_speculative_tokens < 1 or not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(
                f"n-gram proposer needs k >= 1 and 1 <= prompt_lookup_min <= prompt_lookup_max, "
                f"got k={num_speculative_tokens}, min={prompt_lookup_min}, "
                f"max={prompt_lookup_max}")
        self.num_speculative_tokens = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, token_ids: list[int], max_num_tokens: int | None = None) -> list[int]:
        """Draft tokens to follow `token_ids` (at most min(k, max_num_tokens); may be []).

        The draft is the run after the most recent earlier occurrence of the longest
        matching suffix n-gram; it may be shorter than k when that occurrence is close to
        the end.
        """
        k = self.num_speculative_tokens if max_num_tokens is None else min(
            self.num_speculative_tokens, max_num_tokens)
        num_tokens = len(token_ids)
        if k <= 0 or num_tokens <= self.min_n:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, num_tokens - 1), self.min_n - 1, -1):
            suffix = tokens[num_tokens - n:]
            # Windows starting at 0 .. num_tokens - n - 1: every earlier occurrence (one that
            # ends before the last token, so at least one token follows it).
            windows = sliding_window_view(tokens[:num_tokens - 1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return token_ids[start:start + k]
        return []
