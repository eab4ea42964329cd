"""The device side of pooling: a step's token states -> one float32 vector per request.

Under the pooling runner every scheduled request computes its whole prompt in the step
(chunked prefill and prefix caching are off), so request i owns rows
query_start_loc[i]:query_start_loc[i + 1] of the hidden states and pools them at once.
"""

from __future__ import annotations

import torch

from flowengine.pooling.config import PoolingType


def pool(hidden: torch.Tensor, query_start_loc_cpu: torch.Tensor,
         pooling_type: PoolingType) -> torch.Tensor:
    """Pool each request's rows of `hidden`.

    hidden: [T, hidden_size] (model dtype); query_start_loc_cpu: [R + 1] int (host).
    Returns [R, hidden_size] float32: the first row (CLS), the mean of the rows (MEAN,
    sentence-transformers' mean over the attention mask, i.e. the prompt's tokens) or
    the last row (LAST). Raises ValueError for an unknown pooling type or an empty
    request.
    """
    qsl = query_start_loc_cpu.to(torch.int64)
    lens = qsl[1:] - qsl[:-1]
    if bool((lens <= 0).any()):
        raise ValueError("a pooled request has no tokens in this step")
    device = hidden.device
    if pooling_type == "CLS":
        return hidden.index_select(0, qsl[:-1].to(device)).float()
    if pooling_type == "LAST":
        return hidden.index_select(0, (qsl[1:] - 1).to(device)).float()
    if pooling_type == "MEAN":
        num_reqs, num_tokens = lens.shape[0], int(qsl[-1])
        seg = torch.repeat_interleave(torch.arange(num_reqs), lens).to(device)
        sums = torch.zeros(num_reqs, hidden.shape[1], dtype=torch.float32, device=device)
        sums.index_add_(0, seg, hidden[:num_tokens].float())
        return sums / lens.to(device=device, dtype=torch.float32)[:, None]
    raise ValueError(f"unknown pooling type {pooling_type!r}")
