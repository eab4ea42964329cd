"""What the sampler returns: token ids on the device, logprobs fetched on demand.

The executor keeps `sampled_token_ids` on the device to feed the next step
(DESIGN.md §5) and calls `tolists()` once per step to read ids and logprobs back with a
single device-to-host transfer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from flowengine.messages import TokenLogprobs


@dataclass(slots=True)
class LogprobsTensors:
    """Logprobs of the rows that asked for them (L rows, in `logprob_rows` order).

    top_token_ids: [L, N] int64 and top_logprobs: [L, N] float32, most likely first,
    N = the batch's largest `logprobs` (may be 0). sampled_logprobs: [L] float32.
    sampled_ranks: [L] int64, 1 + the number of tokens strictly more likely.
    """

    top_token_ids: torch.Tensor
    top_logprobs: torch.Tensor
    sampled_logprobs: torch.Tensor
    sampled_ranks: torch.Tensor

    @classmethod
    def compute(
        cls, logprobs: torch.Tensor, sampled_token_ids: torch.Tensor, num_top: int
    ) -> LogprobsTensors:
        """From `logprobs` [L, V] float32 (log_softmax of the raw logits) and the
        tokens sampled for those rows, [L] int64."""
        num_top = min(num_top, logprobs.shape[1])
        top_logprobs, top_token_ids = logprobs.topk(num_top, dim=-1)
        sampled = logprobs.gather(1, sampled_token_ids.unsqueeze(1))
        # Ties count in the token's favour: the argmax of a tie has rank 1.
        ranks = (logprobs > sampled).sum(dim=-1) + 1
        return cls(top_token_ids, top_logprobs, sampled.squeeze(1), ranks)


@dataclass(slots=True)
class SamplerOutput:
    """Result of sampling R rows.

    sampled_token_ids: [R] int64 on the logits' device. num_logprobs: per row the N
    of `logprobs=N` or None. logprobs_tensors: device logprobs of the rows whose
    num_logprobs is not None (in row order), or None when no row asked.
    """

    sampled_token_ids: torch.Tensor
    num_logprobs: list[int | None]
    logprobs_tensors: LogprobsTensors | None = None
    _host: tuple[list[int], list[TokenLogprobs | None]] | None = field(default=None, repr=False)

    def tolists(self) -> tuple[list[int], list[TokenLogprobs | None]]:
        """Token ids and per-row `TokenLogprobs` (None where not asked) as Python lists.

        One device-to-host copy: everything is packed into one float64 tensor (token
        ids < 2**53 and float32 values round-trip exactly). Cached after the first call.
        """
        if self._host is not None:
            return self._host
        num_reqs = self.sampled_token_ids.shape[0]
        parts = [self.sampled_token_ids.to(torch.float64)]
        lt = self.logprobs_tensors
        if lt is not None:
            parts += [
                lt.top_token_ids.to(torch.float64).flatten(),
                lt.top_logprobs.to(torch.float64).flatten(),
                lt.sampled_logprobs.to(torch.float64),
                lt.sampled_ranks.to(torch.float64),
            ]
        flat = torch.cat(parts).cpu().tolist()
        token_ids = [int(t) for t in flat[:num_reqs]]
        logprobs: list[TokenLogprobs | None] = [None] * num_reqs
        if lt is not None:
            num_rows, width = lt.top_token_ids.shape
            ids_at = num_reqs
            vals_at = ids_at + num_rows * width
            sampled_at = vals_at + num_rows * width
            ranks_at = sampled_at + num_rows
            rows = [i for i, n in enumerate(self.num_logprobs) if n is not None]
            for j, row in enumerate(rows):
                n = min(self.num_logprobs[row] or 0, width)
                top_at = j * width
                logprobs[row] = TokenLogprobs(
                    top_token_ids=[int(t) for t in flat[ids_at + top_at : ids_at + top_at + n]],
                    top_logprobs=flat[vals_at + top_at : vals_at + top_at + n],
                    sampled_logprob=flat[sampled_at + j],
                    sampled_rank=int(flat[ranks_at + j]),
                )
        self._host = (token_ids, logprobs)
        return self._host

    @property
    def logprobs(self) -> list[TokenLogprobs | None]:
        """Per-row logprobs as host objects (triggers `tolists()`)."""
        return self.tolists()[1]
