"""Scoring a prompt: each prompt token's logprob given the tokens before it (`echo` with logprobs,
what evaluation harnesses read to compute log-likelihoods)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.api import TokenLogprob, TopLogprob

POSITIONS_PER_CHUNK = 128  # float32 log-softmax rows held at once: 128 x 152k vocabulary = 78 MB


def prompt_logprobs(
    logits: torch.Tensor, prompt: list[int], top: int, decode: Callable[[int], str]
) -> tuple[TokenLogprob | None, ...]:
    """`logits` [T, V]: the model's output at every prompt position (row i predicts token i + 1).
    One entry per prompt token: None for the first (nothing predicts it), else its logprob and the
    `top` most likely tokens at its position, from the model's own distribution."""
    targets = torch.tensor(prompt[1:], dtype=torch.long, device=logits.device)  # [T-1]
    texts: dict[int, str] = {}

    def text(token_id: int) -> str:
        if token_id not in texts:
            texts[token_id] = decode(token_id)
        return texts[token_id]

    scored: list[TokenLogprob | None] = [None]
    for start in range(0, len(prompt) - 1, POSITIONS_PER_CHUNK):
        # a chunk of rows at a time: the logits [T, V] stay as they are (the model's dtype); only
        # [POSITIONS_PER_CHUNK, V] float32 log-softmax rows exist at once, not a [T, V] float32 copy
        rows = torch.log_softmax(logits[start : start + POSITIONS_PER_CHUNK].float(), dim=-1)  # [C, V]
        chunk_targets = targets[start : start + rows.shape[0]]  # [C]
        chosen = rows.gather(1, chunk_targets[:, None])[:, 0].tolist()  # [C]
        top_values, top_ids = torch.topk(rows, top, dim=-1) if top > 0 else (rows[:, :0], rows[:, :0].long())
        for token_id, logprob, values, ids in zip(chunk_targets.tolist(), chosen, top_values.tolist(),
                                                  top_ids.tolist()):
            alternatives = tuple(TopLogprob(i, text(i), v) for v, i in zip(values, ids))
            scored.append(TokenLogprob(token_id, text(token_id), logprob, alternatives))
    return tuple(scored)
