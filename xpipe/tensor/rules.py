"""Which dim of each block weight the "tensor" axis splits (Megatron-style tensor
parallelism inside a stage), by parameter-name patterns.

A rule maps a shell-style pattern (``fnmatch``: ``*`` also matches dots) over
the wrapped model's parameter names to the dim that "tensor" splits, or to
``None`` for a weight every device of a tensor group holds whole (a norm's,
a row-parallel layer's bias). Projections that make features from the
hidden state (q/k/v, gate/up) are split on their output features; those that
bring them back (o, down) on their input features, so each block needs one
reduction over "tensor" after each of those (XLA's partitioner inserts it).

The built-in rules cover the families the project tests as shipped: Llama and the
models built like it (Mistral, Qwen2), GPT-2 (whose ``Conv1D`` weights are
``[in, out]``), BERT, T5, torch's ``nn.TransformerEncoderLayer``, OPT, GPT-NeoX,
and the mixture-of-experts blocks of Mixtral and Qwen2-MoE. Weights that pack q,
k and v one after the other (GPT-2's ``c_attn``, ``nn.MultiheadAttention``'s
``in_proj_weight``, Phi-3's ``qkv_proj``; and Phi-3's ``gate_up_proj``) are split
part by part (:class:`Packed`): a contiguous split of the packed features would put
q on one device and v on another, so each device holds its share of every part
(:mod:`xpipe.tensor.packed_projections`). GPT-NeoX packs them head by head, so a contiguous
split keeps whole heads, with their q, k and v, on each device.

Experts are split whole, by their first dim: each device of a tensor group holds
``experts / T`` of them and runs its own experts' matmuls for every token, and one
reduction over "tensor" sums the experts' outputs, as after a row-parallel layer.
A Megatron split of each expert's matrices would need its packed gate and up
projections (``experts.gate_up_proj``) split part by part, which is not built.

Key/value heads the tensor size does not divide (fewer of them than tensor devices)
keep their projections whole, Megatron's way (:func:`with_shared_key_values`).

Weights no rule names are split as read from the block's graph
(:mod:`xpipe.tensor.inference`), which also corrects a built-in rule's dim where
the graph shows the weight split on its other one (:func:`tensor_splits`).

Pure: no torch_xla; the spmd executor applies the rules (:mod:`xpipe.spmd.executor`).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class Packed:
    """A rule for a weight that packs projections one after the other along ``dim``,
    its output features (q, k and v; gate and up): each part is split over "tensor",
    so that each device holds its own heads of every part. The parts are read from
    where the block takes the linear's output apart (:mod:`xpipe.tensor.packed_projections`);
    give the linear's bias the rule ``Packed(0)`` too."""

    dim: int

    def __post_init__(self) -> None:
        if isinstance(self.dim, bool) or not isinstance(self.dim, int) or self.dim < 0:
            raise TypeError(f"Packed: dim must be an int >= 0 (the packed output features' dim), got {self.dim!r}")


Rule = int | None | Packed
Rules = Mapping[str, Rule]

_LLAMA = {
    "*.self_attn.[qkv]_proj.weight": 0, "*.self_attn.[qkv]_proj.bias": 0,
    "*.self_attn.o_proj.weight": 1, "*.self_attn.o_proj.bias": None,
    "*.mlp.gate_proj.weight": 0, "*.mlp.up_proj.weight": 0, "*.mlp.gate_proj.bias": 0, "*.mlp.up_proj.bias": 0,
    "*.mlp.down_proj.weight": 1, "*.mlp.down_proj.bias": None,
}
_GPT2 = {  # Conv1D: weight [in, out]
    "*.attn.c_attn.weight": Packed(1), "*.attn.c_attn.bias": Packed(0),  # q, k, v one after the other
    "*.attn.c_proj.weight": 0, "*.attn.c_proj.bias": None,
    "*.mlp.c_fc.weight": 1, "*.mlp.c_fc.bias": 0,
    "*.mlp.c_proj.weight": 0, "*.mlp.c_proj.bias": None,
}
_BERT = {
    "*.attention.self.query.*": 0, "*.attention.self.key.*": 0, "*.attention.self.value.*": 0,
    "*.attention.output.dense.weight": 1, "*.attention.output.dense.bias": None,
    "*.intermediate.dense.*": 0,
    "*.output.dense.weight": 1, "*.output.dense.bias": None,
}
_T5 = {
    "*.SelfAttention.[qkv].weight": 0, "*.SelfAttention.o.weight": 1,
    "*.EncDecAttention.[qkv].weight": 0, "*.EncDecAttention.o.weight": 1,
    "*.relative_attention_bias.weight": 1,  # [buckets, heads]
    "*.DenseReluDense.wi*.weight": 0, "*.DenseReluDense.wo.weight": 1,
}
_TORCH_ENCODER = {  # nn.TransformerEncoderLayer
    "*.self_attn.in_proj_weight": Packed(0), "*.self_attn.in_proj_bias": Packed(0),  # q, k, v one after the other
    "*.self_attn.out_proj.weight": 1, "*.self_attn.out_proj.bias": None,
    "*.linear1.*": 0, "*.linear2.weight": 1, "*.linear2.bias": None,
}
_OPT = {  # separate q/k/v (the Llama rules) and out_proj (the encoder's); the MLP as fc1, fc2
    "*.fc1.*": 0, "*.fc2.weight": 1, "*.fc2.bias": None,
}
_GPT_NEOX = {  # query_key_value packs q, k and v per head ([heads, 3, head_dim]): whole heads on each device
    "*.attention.query_key_value.*": 0, "*.attention.dense.weight": 1, "*.attention.dense.bias": None,
    "*.mlp.dense_h_to_4h.*": 0, "*.mlp.dense_4h_to_h.weight": 1, "*.mlp.dense_4h_to_h.bias": None,
}
_PHI3 = {  # q, k, v packed one after the other, and gate and up
    "*.self_attn.qkv_proj.weight": Packed(0), "*.mlp.gate_up_proj.weight": Packed(0),
}
_EXPERTS = {  # Mixtral, Qwen2-MoE: whole experts per device ([experts, ...]); the router and shared gate whole
    "*.mlp.experts.gate_up_proj": 0, "*.mlp.experts.down_proj": 0, "*.mlp.gate.weight": None,
    "*.shared_expert.gate_proj.weight": 0, "*.shared_expert.up_proj.weight": 0,
    "*.shared_expert.down_proj.weight": 1, "*.shared_expert_gate.weight": None,
}
_NORMS = {"*norm*.weight": None, "*norm*.bias": None, "*LayerNorm.*": None, "*.ln_[12f].*": None}

BUILT_IN: dict[str, Rule] = {**_LLAMA, **_GPT2, **_BERT, **_T5, **_TORCH_ENCODER, **_OPT, **_GPT_NEOX,
                                   **_PHI3, **_EXPERTS, **_NORMS}

_QUERY_HEAD_COUNTS = ("num_attention_heads", "n_head", "num_heads")
# Where "tensor" does not divide the key/value heads (grouped-query or multi-query attention
# with fewer of them than tensor devices), every device of a tensor group computes them all.
_SHARED_KEY_VALUES = {"*.self_attn.[kv]_proj.weight": None, "*.self_attn.[kv]_proj.bias": None,
                      "*.self_attn.qkv_proj.weight": None}  # Phi-3's key/value heads are packed with its queries


def check_rules(rules: Rules | None) -> dict[str, Rule]:
    """``tensor_rules`` as given to ``Pipe``, checked: patterns to a dim, ``None`` or :class:`Packed`.

    Raises:
        TypeError: naming ``tensor_rules`` if it is not such a mapping.
    """
    if rules is None:
        return {}
    if not isinstance(rules, Mapping) or not all(
            isinstance(k, str) and (v is None or isinstance(v, Packed) or
                                    (isinstance(v, int) and not isinstance(v, bool) and v >= 0))
            for k, v in rules.items()):
        raise TypeError(f"tensor_rules: expected a dict of parameter-name patterns to the dim that 'tensor' "
                        f"splits (an int >= 0), None (kept whole) or xpipe.Packed(dim) (projections packed one "
                        f"after the other, split part by part), e.g. {{'*.q_proj.weight': 0}}; got {rules!r}")
    return dict(rules)


def tensor_dims(names: Iterable[str], shapes: Iterable[tuple[int, ...]], tensor: int,
                rules: Rules | None = None, inferred: Rules | None = None) -> list[int | None]:
    """For each block weight (its name and shape), the dim "tensor" splits, or None
    (a :class:`Packed` weight's is its packed dim): see :func:`tensor_splits`."""
    return [split_dim(rule) for rule in tensor_splits(names, shapes, tensor, rules, inferred)]


def tensor_splits(names: Iterable[str], shapes: Iterable[tuple[int, ...]], tensor: int,
                  rules: Rules | None = None, inferred: Rules | None = None) -> list[Rule]:
    """For each block weight (its name and shape), the rule that splits it over
    "tensor": a dim, :class:`Packed` (split part by part) or None (whole).

    The user's ``rules`` are tried before the built-in ones; the first pattern
    that matches a name decides. A weight no pattern matches takes its rule from
    ``inferred`` (by name: what :mod:`xpipe.tensor.inference` read from the
    block's graph), and so does one a built-in rule splits where the graph shows it
    split on its other dim: a name alone does not tell an ``nn.Linear``'s
    ``[out, in]`` weight from GPT-2's ``Conv1D`` ``[in, out]`` one (GPTBigCode and
    Starcoder2 name their linears as GPT-2 names its Conv1Ds). With ``tensor == 1``
    nothing is split.

    Raises:
        ValueError: with ``tensor > 1``, naming the weights no rule covers and
            ``inferred`` does not name, or those whose split dim the tensor size
            does not divide (or that have no such dim).
    """
    names, shapes = list(names), [tuple(s) for s in shapes]
    if tensor == 1:
        return [None] * len(names)
    inferred = inferred or {}
    missing = [name for name in unruled(names, rules) if name not in inferred]
    if missing:
        raise ValueError(unruled_message(tensor, missing))
    ordered = _ordered(rules)
    splits = [_rule(name, ordered, check_rules(rules), inferred) for name in names]
    uneven = [f"{name} {list(shape)} (dim {split_dim(rule)})" for name, shape, rule in zip(names, shapes, splits)
              if rule is not None and (split_dim(rule) >= len(shape) or shape[split_dim(rule)] % tensor)]
    if uneven:
        raise ValueError(f"tensor: {tensor} does not divide the split dim of {uneven}; use a tensor size that "
                         "divides it, or a rule of None for those weights")
    return splits


def split_dim(rule: Rule) -> int | None:
    """The dim a rule splits: its own, or a :class:`Packed` weight's packed dim."""
    return rule.dim if isinstance(rule, Packed) else rule


def covered_by(name: str, rules: Rules | None) -> bool:
    """Whether one of the user's ``rules`` names ``name``."""
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in check_rules(rules))


def unruled(names: Iterable[str], rules: Rules | None = None) -> list[str]:
    """The names that neither ``rules`` nor the built-in rules cover."""
    ordered = _ordered(rules)
    return [name for name in names if not any(fnmatch.fnmatchcase(name, p) for p in ordered)]


def unruled_message(tensor: int, names: list[str], why: str = "") -> str:
    """The refusal for block weights no rule covers (``why``: what reading the block's graph found)."""
    return (f"tensor_rules: no rule says how tensor={tensor} splits the block weights {names}"
            f"{why}; give Pipe(..., tensor_rules={{'<name pattern>': <dim>}}) (None keeps a weight whole on "
            "every device of a tensor group), or use tensor=1")


def _ordered(rules: Rules | None) -> dict[str, Rule]:
    """The user's rules, then the built-in ones they do not replace."""
    return {**check_rules(rules), **{k: v for k, v in BUILT_IN.items() if k not in (rules or {})}}


def _rule(name: str, ordered: Rules, users: Rules, inferred: Rules) -> Rule:
    """``name``'s rule: the first that matches it, or the graph's (see :func:`tensor_splits`)."""
    pattern = next((p for p in ordered if fnmatch.fnmatchcase(name, p)), None)
    if pattern is None:
        return inferred[name]
    dim, read = ordered[pattern], inferred.get(name)
    if pattern in users or name not in inferred:
        return dim
    if isinstance(dim, Packed):  # whether the parts can be split is the graph's to say
        return read
    return read if None not in (dim, read) else dim


def check_head_counts(model: nn.Module, tensor: int) -> None:
    """Refuse a tensor size that does not divide the model's query heads (its config's
    head counts, and each ``nn.MultiheadAttention``'s): a split head would sit on two
    devices. Key/value heads it does not divide are kept whole instead
    (:func:`with_shared_key_values`).

    Raises:
        ValueError: naming the counts that ``tensor`` does not divide.
    """
    if tensor == 1:
        return
    bad = {field: count for field, count in query_head_counts(model).items() if count % tensor}
    if bad:
        raise ValueError(f"tensor: {tensor} does not divide the model's attention heads {bad}; each device of a "
                         "tensor group holds whole heads. Use a tensor size that divides them")


def query_head_counts(model: nn.Module) -> dict[str, int]:
    """The model's query head counts a tensor size must divide, by where they are read:
    its config's (``num_attention_heads``, ``n_head``, ``num_heads``) and each
    ``nn.MultiheadAttention``'s."""
    counts = {}
    config = getattr(model, "config", None)
    for field in _QUERY_HEAD_COUNTS:
        value = getattr(config, field, None)
        if isinstance(value, int):
            counts[f"config.{field}"] = value
    for name, module in model.named_modules():
        if isinstance(module, nn.MultiheadAttention):
            counts[f"{name}.num_heads"] = module.num_heads
    return counts


def key_value_heads_of(model: nn.Module) -> int | None:
    """The model's key/value head count (``config.num_key_value_heads``), if it says."""
    heads = getattr(getattr(model, "config", None), "num_key_value_heads", None)
    return heads if isinstance(heads, int) else None


def with_shared_key_values(rules: Rules | None, key_value_heads: int | None, tensor: int) -> dict[str, Rule]:
    """``rules``, followed, where ``tensor`` does not divide the model's ``key_value_heads``
    (Falcon's one, a Llama 3 70B's 8 on 16 devices), by rules that keep its key and value
    projections whole, Megatron's way: every device of a tensor group computes every
    key/value head and attends with its own query heads, so no head is cut and none
    moves between devices (measured on Llama with one key/value head on 2 x 2 fsdp x
    2 tensor: in each clock only Megatron's two reductions per block forward, where
    splitting them ran all-to-alls, gathers and permutes over "tensor"). The user's
    rules come first and win."""
    rules = check_rules(rules)
    if tensor == 1 or key_value_heads is None or key_value_heads % tensor == 0:
        return rules
    return {**rules, **{pattern: dim for pattern, dim in _SHARED_KEY_VALUES.items() if pattern not in rules}}


def check_convolutions(block: nn.Module, dims: Mapping[str, int | None]) -> None:
    """Refuse a convolution's weight that "tensor" would split (``dims``: each block
    parameter's split dim, by name).

    torch_xla 2.9's SPMD partitioner aborts the whole process on such a convolution
    (a failed check in XLA's ``convolution_handler.cc``, no Python error) on meshes
    and dims measured to include 4 stages x 2 tensor (dim 0), 2 x 2 data x 2 tensor
    (dim 0) and 2 x 2 fsdp x 2 tensor (dim 1), while neighbouring ones run: no rule
    separates them, so none is attempted.

    Raises:
        ValueError: naming the convolution weights and how to keep them whole.
    """
    split = [f"{name}.weight" for name, module in block.named_modules()
             if isinstance(module, nn.modules.conv._ConvNd) and dims.get(f"{name}.weight") is not None]
    if split:
        raise ValueError(f"tensor_rules: the convolution weights {split} would be split over 'tensor', and XLA's "
                         "SPMD partitioner (torch_xla 2.9) aborts the process on such a convolution on some meshes; "
                         "keep them whole with tensor_rules={'<their name pattern>': None}, or use tensor=1")
