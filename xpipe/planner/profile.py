"""What the planner needs to know of a model: its repeated block's weights, the
weights around it, and per row of the batch the FLOPs, the bytes that cross
into the block and the bytes a block saves for its backward.

Two sources:

- :func:`profile_of_model`: a model built on the host, captured with a sample
  input as :func:`xpipe.partition` captures it (FLOPs and saved bytes measured
  by torch on that sample);
- :func:`profile_of_config`: a Hugging Face decoder's config, the model built
  on the meta device (shapes only, nothing allocated), FLOPs and saved bytes
  estimated from the config (see docs/planning.md for the formulas).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from xpipe.capture.stacking import StackedModel, block_inputs, cut_for_stacking
from xpipe.capture.trace import trace_layers
from xpipe.layout import is_vocabulary_table
from xpipe.partition import partition_captured
from xpipe.tensor.inference import CannotInfer, infer_tensor_dims
from xpipe.tensor.rules import Packed, Rules, key_value_heads_of, query_head_counts, unruled
from xpipe.tensor.splits import block_splits


# How many stream-wide tensors a block keeps whole over "tensor" for its backward, as
# Megatron counts them without sequence parallelism (Korthikanti et al., 2022, "Reducing
# Activation Recomputation in Large Transformer Models", section 4.1): the two norms' inputs
# and the attention's and the MLP's inputs. Eager PyTorch saves more stream-wide tensors
# (an RMSNorm's intermediates: twelve in all for Llama's block), which XLA fuses away.
WHOLE_STREAMS = 4

# The float32 copies of the logits XLA's loss holds at once: the logits, their exponentials
# and the softmax (or its gradient), read off the buffer assignment at the loss
# (tools/peak_grid.py --buffers); a config's profile counts the same (s V (b + 8) bytes a row).
LOSS_LOGITS_COPIES = 3


@dataclass(frozen=True)
class ModelProfile:
    """A model as the planner sees it. Bytes per row are in the dtype of ``itemsize``."""

    name: str
    blocks: int  # the repeated blocks the spmd executor stacks over "stage"
    block_weights: tuple[tuple[str, tuple[int, ...]], ...]  # block 0's parameters, full names and shapes
    outer_weights: tuple[tuple[int, ...], ...]  # each distinct parameter outside the blocks
    block_flops_per_row: float  # one block's forward FLOPs for one row of the batch
    outer_flops_per_row: float  # the layers around the blocks (embedding, head)
    stream_bytes_per_row: float  # what crosses into a block (the hidden state and side inputs)
    hidden_bytes_per_row: float  # the hidden state alone: what "tensor" reduces after a block's halves
    block_saved_bytes_per_row: float  # what one block keeps for its backward
    outer_saved_bytes_per_row: float  # what the layers around the blocks keep (the logits)
    itemsize: int  # bytes per element the above were counted in
    # Of what one block keeps, what is whole on every tensor device (Megatron's layout without
    # sequence parallelism): the tensors as wide as the stream, at most WHOLE_STREAMS of them.
    block_stream_saved_bytes_per_row: float = 0.0
    # Of what one block keeps, the attention probabilities of its largest attention: their gradient,
    # as large, is made whole in the backward while they are still held.
    block_attention_bytes_per_row: float = 0.0
    # What one block keeps counted once each (block_saved_bytes_per_row counts a tensor once per op
    # that saves it), of the tensors that carry a gradient: what 1F1B's ring holds for each block
    # with checkpoint="never" (xpipe.spmd.stashed_activations). 0: as block_saved_bytes_per_row.
    block_kept_bytes_per_row: float = 0.0
    heads: tuple[int, ...] = ()  # the query head counts a tensor size must divide
    key_value_heads: int | None = None  # config.num_key_value_heads, where the model has one
    tokens_per_row: int = 0  # a row's sequence length, where known (a config's), for the loss's segments
    stream_rank: int = 3  # dims of the tensor the blocks pass on ([batch, seq, features]: 3)
    # The split dims of the block weights no built-in rule names, read from the block's graph
    # (xpipe.tensor.inference) where it tells; empty otherwise.
    read_tensor_dims: tuple[tuple[str, int | Packed | None], ...] = ()

    def tensor_dims(self, tensor: int, rules: Rules | None = None) -> list[int | None]:
        """Each block weight's split dim over ``tensor`` devices (or None), as ``Pipe``
        splits it: by ``rules``, the key/value projections whole where ``tensor`` does not
        divide their heads, and the splits read from the block's graph
        (:func:`xpipe.tensor.rules.tensor_splits`, whose ``ValueError`` it raises).

        A packed weight (:class:`xpipe.tensor.rules.Packed`), which Pipe splits part by
        part, is planned split along its packed dim: each device holds its share of
        every part."""
        names, shapes = zip(*self.block_weights)
        splits = block_splits(names, shapes, tensor, rules, self.key_value_heads, lambda: dict(self.read_tensor_dims))
        return [rule.dim if isinstance(rule, Packed) else rule for rule in splits]

    @property
    def parameters(self) -> int:
        """Parameters of the whole model (tied ones once)."""
        block = sum(math.prod(shape) for _, shape in self.block_weights)
        return self.blocks * block + sum(math.prod(shape) for shape in self.outer_weights)

    def scaled(self, itemsize: int) -> ModelProfile:
        """The same model with its activations counted in ``itemsize`` bytes per element."""
        ratio = itemsize / self.itemsize
        return dataclasses.replace(self, stream_bytes_per_row=self.stream_bytes_per_row * ratio,
                                   hidden_bytes_per_row=self.hidden_bytes_per_row * ratio,
                                   block_saved_bytes_per_row=self.block_saved_bytes_per_row * ratio,
                                   block_stream_saved_bytes_per_row=self.block_stream_saved_bytes_per_row * ratio,
                                   block_attention_bytes_per_row=self.block_attention_bytes_per_row * ratio,
                                   block_kept_bytes_per_row=self.block_kept_bytes_per_row * ratio,
                                   outer_saved_bytes_per_row=self.outer_saved_bytes_per_row * ratio,
                                   itemsize=itemsize)


def profile_of_model(model: nn.Module, sample_input: Any) -> ModelProfile:
    """Profile ``model`` by capturing it on ``sample_input`` (a batch of a few rows,
    as ``Pipe``'s ``sample_input``): the blocks are the run of identical layers the
    spmd executor would stack.

    Raises:
        ValueError: naming ``model`` if it has no run of identical blocks to stack.
    """
    traced = trace_layers(model, sample_input)
    whole = partition_captured(model, traced, 1, sample_input=sample_input, cost="flops")
    repeated = whole.repeated
    if repeated is None:
        raise ValueError("model: it has no run of identical blocks, which the spmd executor (the one that "
                         "shards stages over fsdp and tensor) needs; plan only models with repeated blocks")
    graph = whole.graph
    layers = graph.graph["layers"]
    rows = _rows(sample_input)
    block_layers = [layers[repeated.start + i] for i in range(repeated.period)]
    body_layers = set(layers[repeated.start:repeated.start + repeated.period * repeated.count])
    block_params = [(f"{graph.nodes[layer]['module']}.{name}", p) for layer in block_layers
                    for name, p in model.get_submodule(graph.nodes[layer]["module"]).named_parameters()]
    in_blocks = {id(p) for layer in body_layers
                 for p in model.get_submodule(graph.nodes[layer]["module"]).parameters()}
    outer = {id(p): tuple(p.shape) for p in model.parameters() if id(p) not in in_blocks}
    total_flops = sum(graph.nodes[layer].get("flops", 0) for layer in layers)
    block_flops = sum(graph.nodes[layer].get("flops", 0) for layer in block_layers)
    block_saved = sum(graph.nodes[layer].get("activation_bytes", 0) for layer in block_layers)
    block_kept = sum(graph.nodes[layer].get("kept_bytes", 0) for layer in block_layers)
    attention = max(graph.nodes[layer].get("attention_bytes", 0) for layer in block_layers)
    outer_saved = sum(graph.nodes[layer].get("activation_bytes", 0) for layer in layers if layer not in body_layers)
    itemsize = next(model.parameters()).element_size()
    try:
        stacked = cut_for_stacking(model, whole, sample_input, traced)
    except ValueError as error:
        raise ValueError(f"model: the spmd executor cannot stack its blocks, so Pipe runs none of the layouts "
                         f"xpipe-plan lists ({error})") from error
    inputs = block_inputs(stacked, sample_input)  # the pre-body layers run once on the sample, for all below
    stream_bytes, hidden_bytes, width = _stream_measures(stacked, inputs)
    after_body = layers[repeated.start + repeated.period * repeated.count:]
    logits = _logits_numel_per_row(graph, after_body, outer.values(), inputs[0])
    outer_saved = max(outer_saved, LOSS_LOGITS_COPIES * 4 * logits * rows)
    block_stream_saved = min(sum(dict(graph.nodes[layer].get("activation_bytes_by_width", ())).get(width, 0)
                                 for layer in block_layers), WHOLE_STREAMS * hidden_bytes * rows)
    return ModelProfile(
        name=type(model).__name__, blocks=repeated.count,
        block_weights=tuple((name, tuple(p.shape)) for name, p in block_params),
        outer_weights=tuple(outer.values()),
        block_flops_per_row=block_flops / rows,
        outer_flops_per_row=(total_flops - repeated.count * block_flops) / rows,
        stream_bytes_per_row=stream_bytes,
        hidden_bytes_per_row=hidden_bytes,
        block_saved_bytes_per_row=block_saved / rows, block_stream_saved_bytes_per_row=block_stream_saved / rows,
        block_attention_bytes_per_row=attention / rows, block_kept_bytes_per_row=block_kept / rows,
        outer_saved_bytes_per_row=outer_saved / rows,
        itemsize=itemsize, heads=tuple(sorted(set(query_head_counts(model).values()))),
        key_value_heads=key_value_heads_of(model),
        read_tensor_dims=_read_tensor_dims(stacked, inputs, [name for name, _ in block_params]),
        stream_rank=inputs[0].dim())


def _logits_numel_per_row(graph: Any, after_body: list[str], outer_shapes: Any, stream: torch.Tensor) -> int:
    """Elements of one row's logits where a layer after the body reads a vocabulary table
    (an LM head: the stream's tokens times the table's rows); 0 where none does."""
    tables = {math.prod(shape): shape[0] for shape in outer_shapes if is_vocabulary_table(shape)}
    vocabularies = [tables[graph.nodes[layer].get("params", 0)] for layer in after_body
                    if graph.nodes[layer].get("params", 0) in tables]
    tokens = stream.shape[1] if stream.dim() >= 3 else 1
    return tokens * max(vocabularies, default=0)


def _stream_measures(stacked: StackedModel, inputs: tuple[torch.Tensor, ...]) -> tuple[float, float, int]:
    """Bytes per row of what travels into each block as the spmd executor packs it (the
    stream and every side input with a row per batch row, a padding mask's ``[1, s, s]``
    among them, in the stream's dtype), of the stream alone, and the stream's width
    (its last dim)."""
    stream, *sides = inputs
    per_row = [side for side, rows in zip(sides, stacked.side_rows) if rows]
    itemsize = stream.element_size()
    return (sum(piece[0].numel() for piece in (stream, *per_row)) * itemsize, stream[0].numel() * itemsize,
            stream.shape[-1])


def _read_tensor_dims(stacked: StackedModel, inputs: tuple[torch.Tensor, ...],
                      names: list[str]) -> tuple[tuple[str, int | Packed | None], ...]:
    """The splits read from the block's graph, where a block weight no built-in
    rule names needs them and the graph tells."""
    if not unruled(names):
        return ()
    try:
        return tuple(infer_tensor_dims(stacked.blocks[0], inputs).items())
    except CannotInfer:  # no tensor layout is planned for it, as without a rule
        return ()


def profile_of_config(config: Any, seq: int, itemsize: int = 2, padding_mask: bool = False) -> ModelProfile:
    """Profile a Hugging Face decoder from its ``config`` (a ``PretrainedConfig``) at
    sequence length ``seq``, counting activations in ``itemsize`` bytes: the model is
    built on the meta device, so a 405B model costs no memory.

    ``padding_mask``: whether the batches give an ``attention_mask``. Hugging Face then
    builds a ``[rows, 1, seq, seq]`` mask that differs by row, and it travels with each
    row; without one (packed sequences, as pretraining feeds them) its rows are equal,
    and every stage holds one row of it (:mod:`xpipe.capture.stacking`).

    Raises:
        ValueError: naming ``config`` if transformers cannot build a causal LM from
            it, or the model has no list of identical blocks.
    """
    import transformers

    if seq < 1:
        raise ValueError(f"seq: the sequence length must be at least 1, got {seq}")
    try:
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(f"config: transformers cannot build a causal LM from it ({error}); give the config of a "
                         "decoder such as Llama, Mistral or Qwen2") from error
    block_names = _block_names(model)
    period = _layer_period(config, len(block_names))
    first = block_names[:period]  # one block as Pipe stacks it: a period of layers that differ in kind
    in_blocks = {id(p) for name in block_names for p in model.get_submodule(name).parameters()}
    outer = {id(p): tuple(p.shape) for p in model.parameters() if id(p) not in in_blocks}
    hidden = config.hidden_size
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    intermediate = _intermediate_size(config, hidden)
    vocab = config.vocab_size
    block_numel = sum(p.numel() for name in first for p in model.get_submodule(name).parameters())
    # Per row of seq tokens: every weight's multiply-add once per token, and attention's
    # two seq x seq products (scores and the weighted sum) over all heads.
    block_flops = 2 * seq * block_numel + period * 4 * seq * seq * heads * head_dim
    # What eager PyTorch keeps for the backward of a Llama-like block (counted on
    # LlamaDecoderLayer with saved-tensor hooks): ten hidden-sized tensors per token,
    # k and v, four intermediate-sized ones per MLP (every expert's, in the dense form
    # xpipe runs experts in); and the attention probabilities, which XLA's attention
    # (not a flash kernel) materialises.
    inner = _inner_per_token(config, intermediate)
    saved_elements = period * (seq * (10 * heads * head_dim + 2 * kv_heads * head_dim + 4 * inner) + heads * seq * seq)
    # What 1F1B's ring keeps of it with checkpoint="never", each tensor once (read off XLA's buffer
    # assignment for a Llama of width 64, tools/peak_grid.py --buffers): nine hidden-sized tensors per
    # token, one key/value-sized, the four intermediate-sized, the two norms' scales, the probabilities.
    kept_elements = period * (seq * (9 * heads * head_dim + kv_heads * head_dim + 4 * inner + 2) + heads * seq * seq)
    return ModelProfile(
        name=getattr(config, "name_or_path", "") or type(model).__name__, blocks=len(block_names) // period,
        block_weights=tuple((f"{layer}.{name}", tuple(p.shape)) for layer in first
                            for name, p in model.get_submodule(layer).named_parameters()),
        outer_weights=tuple(outer.values()),
        block_flops_per_row=block_flops, outer_flops_per_row=2 * seq * hidden * vocab,
        # The hidden state, and a padding mask's [rows, 1, seq, seq] form, which travels with
        # each row in the stream's dtype (xpipe.spmd.sides).
        stream_bytes_per_row=seq * (hidden + (seq if padding_mask else 0)) * itemsize,
        hidden_bytes_per_row=seq * hidden * itemsize,
        block_saved_bytes_per_row=saved_elements * itemsize,
        block_stream_saved_bytes_per_row=period * WHOLE_STREAMS * seq * hidden * itemsize,
        block_attention_bytes_per_row=heads * seq * seq * itemsize, block_kept_bytes_per_row=kept_elements * itemsize,
        # The logits in the model's dtype, their float32 copy for the loss, and its gradient.
        outer_saved_bytes_per_row=seq * vocab * (itemsize + 8), itemsize=itemsize,
        heads=(heads,), key_value_heads=kv_heads, tokens_per_row=seq)


def _layer_period(config: Any, layers: int) -> int:
    """How many layers one stacked block holds: the period of ``config.layer_types``
    (Gemma 2's alternate between sliding-window and global attention, and Pipe stacks
    one of each as a block, as their masks alternate), 1 where every layer is alike."""
    kinds = list(getattr(config, "layer_types", None) or [])
    if len(kinds) != layers:
        return 1
    return next(period for period in range(1, layers + 1)
                if layers % period == 0 and all(kinds[i] == kinds[i % period] for i in range(layers)))


def _intermediate_size(config: Any, hidden: int) -> int:
    """The MLP's inner width under each family's name for it (GPT-2's ``n_inner``, OPT's
    ``ffn_dim``), or GPT-2's default of four times the hidden size."""
    for name in ("intermediate_size", "n_inner", "ffn_dim"):
        if getattr(config, name, None):
            return getattr(config, name)
    return 4 * hidden


def _inner_per_token(config: Any, intermediate: int) -> int:
    """The MLP's inner width that a block computes per token: ``intermediate``, or for a
    mixture of experts (Mixtral's ``num_local_experts``, Qwen2-MoE's ``num_experts``)
    every expert's, which :mod:`xpipe.capture.experts` runs on every token, and a shared expert's."""
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    if not experts:
        return intermediate
    per_expert = getattr(config, "moe_intermediate_size", None) or intermediate
    return experts * per_expert + (getattr(config, "shared_expert_intermediate_size", None) or 0)


def _block_names(model: nn.Module) -> list[str]:
    """The names of the blocks of the model's longest ``nn.ModuleList`` of blocks with
    the same parameter names and shapes."""
    best: list[str] = []
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > len(best):
            shapes = [[(n, tuple(p.shape)) for n, p in child.named_parameters()] for child in module]
            if shapes[0] and all(s == shapes[0] for s in shapes):
                best = [f"{name}.{index}" for index in range(len(module))]
    if not best:
        raise ValueError("config: the model it builds has no list of identical blocks to stack over 'stage'")
    return best


def _rows(sample_input: Any) -> int:
    """The batch size of a sample input (its first tensor's first dim)."""
    values = sample_input.values() if isinstance(sample_input, dict) else (
        sample_input if isinstance(sample_input, (tuple, list)) else (sample_input,))
    for value in values:
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return value.shape[0]
    raise ValueError("sample_input: it holds no batched tensor to count its rows from")
