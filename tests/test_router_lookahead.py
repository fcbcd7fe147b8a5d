"""The prefetcher's look-ahead calls each MoE block's router on its own: it must pick what the
block picks, for every tested family, whatever extra inputs the router takes from its block
(a correction bias) or the shape of hidden states it unpacks."""

import pytest
import torch

from engine.moe_layers import NO_EXPERT, find_moe_layers, router_top_k
from tests.fixtures.models import FAMILIES, MORE_FAMILIES, build_checkpoint, load_reference


def block_routing(model: torch.nn.Module, prompt_ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(hidden states entering each MoE block [T, H], the top-k ids its experts got [T, k]), per layer; a route
    of weight 0 (LongCat-Flash's zero experts, sent to a real expert) as no expert."""
    seen: list[list[torch.Tensor]] = []
    hooks = []
    for layer in find_moe_layers(model):
        record: list[torch.Tensor] = []
        seen.append(record)
        hooks.append(layer.block.register_forward_pre_hook(
            lambda _m, args, kwargs, r=record: r.append((args or (kwargs["hidden_states"],))[0]), with_kwargs=True))
        hooks.append(layer.experts.register_forward_pre_hook(lambda _m, args, r=record: r.append(args[1].masked_fill(args[2] == 0, NO_EXPERT))))
    try:
        with torch.no_grad():
            model(torch.tensor([prompt_ids]))
    finally:
        for hook in hooks:
            hook.remove()
    return [(hidden.reshape(-1, hidden.shape[-1]), ids) for hidden, ids in seen]


# The look-ahead has the experts' input only. DeepSeek-V4's hash layers route by the token's id: they get
# none. Zaya's routers also add the previous layer's router states, and Gemma 4's read the residual stream
# where its experts get a normed copy: theirs is a guess of the right shape.
NO_LOOKAHEAD = {("deepseek_v4", 0)}
GUESSES = {"zaya", "gemma4_text", "gemma4"}


@pytest.mark.parametrize("family", FAMILIES + MORE_FAMILIES)
def test_the_lookahead_router_picks_what_the_block_picks(family, tmp_path):
    model = load_reference(build_checkpoint(family, tmp_path / family, num_layers=3))
    layers = find_moe_layers(model)
    routed = block_routing(model, list(range(5, 25)))
    assert len(routed) == len(layers) > 0
    for n, (layer, (hidden, expected)) in enumerate(zip(layers, routed)):
        top_k = router_top_k(layer)
        if (family, n) in NO_LOOKAHEAD:
            assert top_k is None
            continue
        assert top_k is not None, f"{family}: layer {layer.decoder_layer} has no look-ahead"
        with torch.no_grad():
            guess = top_k(hidden)
        if family in GUESSES:
            assert guess.shape == expected.shape and 0 <= guess.min() and guess.max() < layer.num_experts
        else:
            # Llama 4's experts get one (token, expert) pair per row: [T·k, 1]
            assert torch.equal(guess.reshape(expected.shape), expected), f"{family}: layer {layer.decoder_layer}"
