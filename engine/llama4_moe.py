"""Llama 4's MoE blocks on transformers' experts interface.

Llama 4's blocks predate the interface: every expert computes every token (the router's scores zero the
unrouted ones), and the router's sigmoid score scales an expert's input, not its output. Each block is rebuilt
here with the same parameters (`router.weight`, `experts.gate_up_proj [E, H, 2I]`, `experts.down_proj [E, I, H]`,
`shared_expert.*`): a router that returns its top-k ids, and interface experts called with each token already
scaled by its expert's score, one (token, expert) pair per row and a weight of 1, so offloaded experts compute
it as any family's. What it computes is the block's own: an unrouted expert adds an exact zero there. Published
Llama 4 models route each token to one expert, so a row is a token; with more, the cache sees k rows per token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN
from transformers.integrations import use_experts_implementation

FAMILIES = ("llama4", "llama4_text")  # the model types whose blocks are rebuilt


class Llama4TopKRouter(nn.Module):
    """Llama 4's router: hidden [T, H] → (sigmoid scores [T, k] of the top-k logits, their expert ids [T, k])."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.top_k = top_k

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(hidden, self.weight)  # [T, E]
        top_logits, top_index = torch.topk(logits, self.top_k, dim=1)
        return torch.sigmoid(top_logits.float()).to(logits.dtype), top_index


@use_experts_implementation(is_transposed=True)
class Llama4InterfaceExperts(nn.Module):
    """Llama 4's experts as the interface holds them: `gate_up_proj [E, H, 2I]` (gate columns first) and
    `down_proj [E, I, H]`, multiplied from the right."""

    def __init__(self, config) -> None:
        super().__init__()
        self.num_experts = config.num_local_experts
        hidden, inner = config.hidden_size, config.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(self.num_experts, hidden, 2 * inner))
        self.down_proj = nn.Parameter(torch.empty(self.num_experts, inner, hidden))
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden)  # [T, H]
        for expert in top_k_index.unique().tolist():
            token, k = torch.where(top_k_index == expert)
            gate, up = (hidden[token] @ self.gate_up_proj[expert]).chunk(2, dim=-1)
            y = (self.act_fn(gate) * up) @ self.down_proj[expert]
            out.index_add_(0, token, (y * top_k_weights[token, k, None]).to(out.dtype))
        return out


class Llama4SparseMoe(nn.Module):
    """A Llama 4 MoE block computing only the routed experts: `shared_expert(x) + Σ_k expert_k(x · score_k)`."""

    def __init__(self, block: nn.Module, config) -> None:
        super().__init__()
        self.top_k = block.top_k
        self.router = Llama4TopKRouter(config.hidden_size, config.num_local_experts, block.top_k)
        self.experts = Llama4InterfaceExperts(config)
        self.shared_expert = block.shared_expert

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, None]:
        x = hidden_states.reshape(-1, hidden_states.shape[-1])  # [T, H]
        scores, index = self.router(x)  # [T, k] each
        routed_in = x.repeat_interleave(self.top_k, dim=0) * scores.reshape(-1, 1)  # [T·k, H]
        ones = torch.ones(len(routed_in), 1, dtype=x.dtype, device=x.device)
        routed = self.experts(routed_in, index.reshape(-1, 1), ones).view(len(x), self.top_k, -1)  # [T, k, H]
        return self.shared_expert(x) + routed.sum(dim=1), None  # the decoder layer drops the second


def adapt(model: nn.Module) -> None:
    """Rebuild `model`'s Llama 4 MoE blocks on the interface, in place (a model without them is left as it is).
    Parameters on the meta device (a model built for loading) stay there."""
    config = getattr(model.config, "get_text_config", lambda: model.config)()
    if config.model_type not in FAMILIES:
        return
    for name, module in list(model.named_modules()):
        if type(module).__name__ != "Llama4TextMoe":
            continue
        device, dtype = module.router.weight.device, module.router.weight.dtype
        with torch.device(device):
            sparse = Llama4SparseMoe(module, config).to(dtype)
        if device.type != "meta":  # a built model: keep its weights
            with torch.no_grad():
                sparse.router.weight.copy_(module.router.weight)
                sparse.experts.gate_up_proj.copy_(module.experts.gate_up_proj)
                sparse.experts.down_proj.copy_(module.experts.down_proj)
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, sparse)
