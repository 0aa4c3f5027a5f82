"""The structured-output bitmask applied to a step's logits, before any
sampling parameter: a constrained row keeps only the tokens its constraint
allows (the others get -inf), so greedy and sampled rows alike pick among
them, with penalties, temperature and filters then applied as usual. Rows
the bitmask does not name are untouched."""

from __future__ import annotations

import numpy as np
import torch

from trioserve.messages import GrammarBitmask


def apply_grammar_bitmask(logits: torch.Tensor, req_ids: list[str], bitmask: GrammarBitmask) -> torch.Tensor:
    """``logits [S, V]``, one row per request of ``req_ids`` (the step's
    sampling rows, in order), with the bitmask's rows applied; a new tensor
    when any row is constrained. Raises ``ValueError`` if the bitmask names
    a request that does not sample in this step, or its size is wrong."""
    num_rows, words = len(bitmask.req_ids), bitmask.words
    if not num_rows:
        return logits
    if len(bitmask.bitmask) != num_rows * words * 4:
        raise ValueError(f"grammar bitmask: {len(bitmask.bitmask)} bytes for {num_rows} rows of {words} words")
    index = {req_id: i for i, req_id in enumerate(req_ids)}
    missing = [r for r in bitmask.req_ids if r not in index]
    if missing:
        raise ValueError(f"grammar bitmask: requests {missing[:3]!r} do not sample in this step")
    device, vocab = logits.device, logits.shape[1]
    packed = torch.from_numpy(np.frombuffer(bitmask.bitmask, dtype="<i4").reshape(num_rows, words).copy())
    packed = packed.to(device, non_blocking=True)  # [R, W]
    shifts = torch.arange(32, dtype=torch.int32, device=device)
    allowed = ((packed[:, :, None] >> shifts) & 1).view(num_rows, words * 32).bool()  # [R, W * 32]
    if words * 32 < vocab:  # tokens past the last word are never allowed
        allowed = torch.nn.functional.pad(allowed, (0, vocab - words * 32), value=False)
    rows = torch.tensor([index[r] for r in bitmask.req_ids], dtype=torch.long, device=device)  # [R]
    masked = logits[rows].masked_fill(~allowed[:, :vocab], float("-inf"))  # [R, V]
    return logits.index_put((rows,), masked)
