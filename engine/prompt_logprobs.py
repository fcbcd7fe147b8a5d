"""Scoring a prompt: each prompt token's logprob given the tokens before it (`echo` with logprobs,
what evaluation harnesses read to compute log-likelihoods).

The engine feeds the prompt `SCORING_CHUNK` positions per forward and scores each chunk's rows as they
come (`score_rows`), so the logits [T, V] of a whole prompt never exist at once."""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.api import TokenLogprob, TopLogprob

# positions per scoring forward: their logits [512, V] in bf16 at a 152k vocabulary are 156 MB, under a tenth
# of the 2 GiB a CUDA device keeps free (an 8k prompt's [T, V] would be 2.5 GB); 512 positions still fill a
# GPU's matmuls, and each chunk fetches the experts its tokens route to, so much smaller chunks cost copies
SCORING_CHUNK = 512
# float32 log-softmax rows held at once: 128 x 152k vocabulary = 78 MB; a chunk's float32 copy would be
# twice its own logits, so the two bounds stay separate
POSITIONS_PER_CHUNK = 128


def score_rows(
    logits: torch.Tensor, targets: list[int], top: int, text: Callable[[int], str]
) -> list[TokenLogprob]:
    """`logits` [C, V]: the model's output at C consecutive prompt positions, row i predicting `targets[i]`
    (the prompt token after it). Each target's logprob and the `top` most likely tokens at its position,
    from the model's own distribution."""
    scored: list[TokenLogprob] = []
    for start in range(0, len(targets), POSITIONS_PER_CHUNK):
        # only [POSITIONS_PER_CHUNK, V] float32 log-softmax rows exist at once, not a [C, V] float32 copy
        rows = torch.log_softmax(logits[start : start + POSITIONS_PER_CHUNK].float(), dim=-1)  # [R, V]
        ids = targets[start : start + rows.shape[0]]
        chosen = rows.gather(1, torch.tensor(ids, device=rows.device)[:, None])[:, 0].tolist()  # [R]
        top_values, top_ids = torch.topk(rows, top, dim=-1) if top > 0 else (rows[:, :0], rows[:, :0].long())
        for token_id, logprob, values, alternatives in zip(ids, chosen, top_values.tolist(), top_ids.tolist()):
            tops = tuple(TopLogprob(i, text(i), v) for v, i in zip(values, alternatives))
            scored.append(TokenLogprob(token_id, text(token_id), logprob, tops))
    return scored
