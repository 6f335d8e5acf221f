"""Hugging Face mixture-of-experts blocks, captured in a dense form: every expert on
every token, each expert's output weighted by the token's routing weight for it (0
for the experts it was not routed to).

Transformers' own forms of the experts (``grouped_mm``, its default; ``batched_mm``;
the eager loop) sort or gather the tokens by expert, by indices the router computes.
Under the spmd executor the blocks of all stages run as one batched program, and XLA's
partitioner does not keep such data-dependent gathers and scatters inside their stage:
Mixtral on 2 stages x 4 fsdp ran, in every clock, all-gathers and all-reduces over
("stage", "fsdp") of the hidden states, the routing weights and the expert indices,
each stage's experts seeing every stage's tokens. The dense form is einsums,
elementwise products and sums, which stay on their devices; split over "tensor" by
experts (:mod:`xpipe.tensor.rules`), each device runs its own experts and one sum
over "tensor" adds their outputs.

The cost is the one :mod:`xpipe.capture.substitutes` already paid for XLA's static shapes:
each expert's matmuls over all the tokens (``experts / top_k`` times the routed
work) and their activations. Transformers' ``ExpertsInterface`` is the extension
point: the form is registered there as ``"xpipe_dense"`` and chosen through the
model's config while xpipe captures it, then the config is put back.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

DENSE = "xpipe_dense"


def dense_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                          top_k_weights: torch.Tensor) -> torch.Tensor:
    """An experts module's forward (``[tokens, hidden]``, each token's ``top_k`` expert
    indices and routing weights) as the sum over every expert of its output times the
    token's weight for it; the module's gate, biases, layout and norm as it declares them."""
    up = self.gate_up_proj if self.has_gate else self.up_proj
    projected = torch.einsum("sw,ewo->eso" if self.is_transposed else "sw,eow->eso", hidden_states, up)
    if self.has_bias:
        projected = projected + (self.gate_up_proj_bias if self.has_gate else self.up_proj_bias).unsqueeze(1)
    inner = self._apply_gate(projected) if self.has_gate else self.act_fn(projected)
    out = torch.einsum("esi,eiw->esw" if self.is_transposed else "esi,ewi->esw", inner, self.down_proj)
    if self.has_bias:
        out = out + self.down_proj_bias.unsqueeze(1)
    if self.has_post_expert_norm:
        out = self.post_expert_norm(out)
    experts = torch.arange(out.shape[0], device=top_k_index.device)
    chosen = (top_k_index.unsqueeze(-1) == experts).to(top_k_weights.dtype)  # [tokens, top_k, experts]
    routing = (chosen * top_k_weights.unsqueeze(-1)).sum(1)  # [tokens, experts]
    return torch.einsum("esw,se->sw", out, routing.to(out.dtype)).to(hidden_states.dtype)


@contextmanager
def captured_dense(module: nn.Module) -> Iterator[None]:
    """Inside this context, the mixture-of-experts layers of ``module`` (transformers'
    experts modules, dispatched by their config's experts implementation) compute in
    the dense form; nothing changes for a module without them, one whose experts are
    split across processes by transformers' expert parallelism, or where transformers
    has no ``ExpertsInterface``."""
    layers = [layer for layer in module.modules()
              if hasattr(layer, "_apply_gate") and hasattr(getattr(layer, "config", None), "_experts_implementation")]
    interface = _experts_interface()
    if not layers or interface is None or any(getattr(layer, "_is_expert_parallel", False) for layer in layers):
        yield
        return
    interface.register(DENSE, dense_experts_forward)
    configs = {id(layer.config): layer.config for layer in layers}
    before = {key: config._experts_implementation for key, config in configs.items()}
    for config in configs.values():
        config._experts_implementation = DENSE
    try:
        yield
    finally:
        for key, config in configs.items():
            config._experts_implementation = before[key]


def _experts_interface() -> type | None:
    """transformers' ``ExpertsInterface``, or None where the installed transformers has none."""
    try:
        from transformers.integrations.moe import ExpertsInterface
    except ImportError:
        return None
    return ExpertsInterface
