"""Weight placement for the spmd executor: each tensor sharded at rest by the rules
of :mod:`xpipe.layout` (nothing that trains replicated over "stage" or "fsdp";
"data" replicates), and gathered whole for a step, or for a block slot.

Gradients take their weight's sharding (a hook annotates each one), and the
optimizer's state follows the gradient it is computed from. The outer layers'
weights are gathered once per step into one whole copy each. The body's are
gathered as ``Pipe``'s ``gather`` says: once per step (``"step"``), before the
clock loop, into a per-device copy ``[S * P, V * K, numel]`` (``P`` devices per stage),
whose gradients come back the same way, reduced once, after the loop (a
reduce-scatter over "fsdp", an all-reduce over "data"); or per block slot
(``"block"``), inside the loop, from a per-device copy of each resting shard,
whose gradients are reduced over "fsdp" in the clock that made them.

The stream the conveyor carries between stages is held, with "tensor", as each
tensor device's share of every row (Megatron's scatter-gather), and gathered whole
for the stage that runs it (:meth:`Placement.from_conveyor`).
"""

from __future__ import annotations

import torch
import torch_xla.distributed.spmd as xs
from torch import nn

from xpipe.layout import MeshAxes, Spec, outer_spec, outer_step_spec, stacked_spec
from xpipe.mesh import axes_of



class Placement:
    """The shardings of one mesh's tensors.

    Args:
        mesh: the spmd executor's mesh (``xpipe.make_mesh``).
        sequence_parallel: whether the blocks hold the stream as sequence slices
            (:mod:`xpipe.spmd.sequence_parallel`).
    """

    def __init__(self, mesh: xs.Mesh, sequence_parallel: bool = False) -> None:
        self.mesh = mesh
        self.sequence_parallel = sequence_parallel
        self.axes: MeshAxes = axes_of(mesh)
        names = tuple(mesh.axis_names)
        # A batch dim is sharded over the whole mesh, stage-major: device index s * P + p.
        self.batch_axes = tuple(axis for axis in ("stage", "data", "fsdp") if axis in names)

    @property
    def replicas(self) -> int:
        """P: row groups per stage (data x fsdp), each running its own rows of every microbatch."""
        return self.axes.row_groups

    def stacked_spec(self) -> Spec:
        """``[S, V * K, numel]``: see :func:`xpipe.layout.stacked_spec`."""
        return stacked_spec(self.axes)

    def outer_spec(self, tensor: torch.Tensor) -> Spec:
        """A parameter of the layers around the body: see :func:`xpipe.layout.outer_spec`."""
        return outer_spec(tuple(tensor.shape), self.axes)

    def place_outer(self, modules: list[nn.Module]) -> None:
        """Shard the parameters of the layers around the body (each once, a tied one
        too) by :meth:`outer_spec`, and replicate their buffers.

        Everything is annotated from the start: an unannotated weight or buffer
        (Llama's rotary ``inv_freq``) comes out of the first step annotated
        "replicated", and the second step would compile anew.
        """
        parameters = {id(p): p for module in modules for p in module.parameters()}
        for parameter in parameters.values():
            self.place(parameter, self.outer_spec(parameter))
        for module in modules:
            for buffer in module.buffers():
                self.place(buffer, (None,) * buffer.dim())

    def place(self, tensor: torch.Tensor, spec: Spec) -> torch.Tensor:
        """Shard ``tensor`` (a leaf: a parameter or a buffer) by ``spec``, and, for a
        parameter, every gradient it gets."""
        xs.mark_sharding(tensor, self.mesh, spec)
        if tensor.requires_grad and any(axis is not None for axis in spec):
            tensor.register_hook(lambda grad: self.annotated(grad, spec))
        return tensor

    def annotated(self, tensor: torch.Tensor, spec: Spec) -> torch.Tensor:
        """``tensor`` (an intermediate) annotated with ``spec``."""
        xs.mark_sharding(tensor, self.mesh, spec)
        return tensor

    def conveyed_spec(self, dims: int) -> Spec:
        """A tensor of the conveyor (``[S * P, ..., F]``): rows over the mesh, stage-major,
        and with "tensor" each tensor device's share of the features."""
        return (self.batch_axes, *[None] * (dims - 2), "tensor" if self.axes.tensor > 1 else None)

    def conveyed(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` annotated as the conveyor holds it (:meth:`conveyed_spec`)."""
        return self.annotated(x, self.conveyed_spec(x.dim()))

    def to_conveyor(self, x: torch.Tensor) -> torch.Tensor:
        """Inside the clock loop: a stage's output, whole as the stage made it, sliced to
        each tensor device's share of the features. With sequence parallelism the stage
        made sequence slices, which are the conveyor's shares where "tensor" divides the
        sequence (:class:`xpipe.spmd.sides.Packing` gives each tensor device its part of
        every piece, and a part of the stream's flattened features is a slice of its
        sequence): nothing moves."""
        whole = () if self.sequence_parallel else (self._rows_spec(x.dim()),)
        return self._resharded(x, (*whole, self.conveyed_spec(x.dim())))

    def from_conveyor(self, x: torch.Tensor) -> torch.Tensor:
        """Inside the clock loop: a stage's input, from each tensor device's share to
        whole on every one of them: one all-gather over "tensor". With sequence
        parallelism the share stays as it is: the first block reads its slice."""
        whole = () if self.sequence_parallel else (self._rows_spec(x.dim()),)
        return self._resharded(x, (self.conveyed_spec(x.dim()), *whole))

    def whole_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Outside the clock loop: ``x`` (the packed stream entering the conveyor, or leaving
        it) whole on every tensor device, its gradient too, so that how the conveyor holds
        the stream does not reach into the layers before and after the body."""
        return self._resharded(x, (self._rows_spec(x.dim()),))

    def _rows_spec(self, dims: int) -> Spec:
        """Rows over the mesh, stage-major, everything else whole."""
        return (self.batch_axes, *[None] * (dims - 1))

    def _resharded(self, x: torch.Tensor, specs: tuple[Spec, ...]) -> torch.Tensor:
        """With "tensor": ``x`` as each spec in turn holds it, it and its gradient. Given
        both, XLA moves it from one to the other right there, neither earlier (gathering
        each input of the operation that made ``x``) nor later (inside the stage's work)."""
        if self.axes.tensor == 1:
            return x
        for spec in specs:
            x = xs.mark_sharding_with_gradients(x, self.mesh, spec)
        return x

    def gathered_body(self, per_stage: torch.Tensor, *, split: bool = False) -> torch.Tensor:
        """``[S, ...] -> [S * P, ...]``: each row group's own copy of its stage's
        slice, made once, before the clock loop: whole on each device, or with
        ``split`` each "tensor" device's share of the last dim.

        From weights sharded over "fsdp" this copy is the step's one all-gather;
        its backward, after the loop, the one reduction of their gradients over
        the stage's devices, so gradients add up locally across clocks.
        """
        copies = per_stage.unsqueeze(1).expand(-1, self.replicas, *per_stage.shape[1:]).flatten(0, 1)
        return self.annotated(copies, self._body_spec(copies.dim(), split))

    def pinned_body(self, weights: tuple[torch.Tensor, ...], dims: list[int | None]) -> tuple[torch.Tensor, ...]:
        """Inside the clock loop, with "tensor": the body's weights (``[S * P, V * K, numel]``,
        ``dims`` each one's split dim or None) held as they entered the loop
        (:meth:`gathered_body`), and their gradients too.

        Unpinned, XLA's propagation chose how the loop holds them from what the block
        suggests, and in blocks with biases or LayerNorms (Qwen2, OPT, BERT, Qwen2-MoE)
        it split the norms' weights by features, and with them the stream inside the
        block: each clock then gathered the activation or reduced norm statistics
        around most operations, where Megatron runs two all-reduces a block each way.
        """
        if self.axes.tensor == 1:
            return weights
        return tuple(xs.mark_sharding_with_gradients(w, self.mesh, self._body_spec(w.dim(), dim is not None))
                     for w, dim in zip(weights, dims))

    def _body_spec(self, dims: int, split: bool) -> Spec:
        """A per-device copy of the body (``[S * P, ..., numel]``): rows of devices over the
        mesh, stage-major; with ``split`` each "tensor" device's share of the last dim."""
        return (self.batch_axes, *[None] * (dims - 2), "tensor" if split else None)

    def resting_body(self, per_stage: torch.Tensor, *, split: bool = False) -> torch.Tensor:
        """``[S, V * K, numel] -> [S * P, V * K, parts, c]``: each row group's own copy of
        its resting shard, for gathering one block slot at a time inside the clock loop
        (:meth:`gathered_slot`). ``parts`` is the "tensor" count for a weight that
        ``split`` says "tensor" splits (each device keeps its own part), else 1;
        ``c`` a part's share per "fsdp" device, the part padded to divide.

        Made once, before the loop: no more than a copy over "data" (and, for a weight
        kept whole over "tensor", a gather over it), never over "fsdp".
        """
        stages, slots, numel = per_stage.shape
        parts = self.axes.tensor if split else 1
        fsdp, data = self.axes.fsdp, self.axes.data
        per_part = numel // parts
        share = -(-per_part // fsdp)
        grid = per_stage.reshape(stages, slots, parts, per_part)
        if share * fsdp != per_part:
            grid = torch.nn.functional.pad(grid, (0, share * fsdp - per_part))
        grid = grid.reshape(stages, slots, parts, fsdp, share).permute(0, 3, 1, 2, 4)  # [S, F, VK, parts, c]
        copies = grid.unsqueeze(1).expand(stages, data, fsdp, slots, parts, share)
        copies = copies.reshape(stages * self.replicas, slots, parts, share)
        return self.annotated(copies, (self.batch_axes, None, "tensor" if split else None, None))

    def gathered_slot(self, shard: torch.Tensor, numel: int, *, split: bool = False) -> torch.Tensor:
        """``[S * P, parts, c] -> [S * P, numel]``: one block slot's weight, from each
        device's resting shard (:meth:`resting_body`) to its stage's whole weight (each
        "tensor" device's part of it where ``split``), by an all-gather over "fsdp".

        Its backward reduces the slot's gradient back to each device's shard over
        "fsdp", once per use: the ZeRO-3 form, with one block's weights whole at once.
        """
        devices, parts, share = shard.shape
        fsdp = self.axes.fsdp
        part_axis = "tensor" if split else None
        # Annotated as it rests, the gradient too: unannotated, XLA moved the gradient of a
        # weight kept whole over "tensor" between devices every clock.
        shard = xs.mark_sharding_with_gradients(shard, self.mesh, (self.batch_axes, part_axis, None))
        groups = devices // fsdp  # S * D: the fsdp groups
        whole = shard.reshape(groups, fsdp, parts, share).transpose(1, 2).reshape(groups, parts, fsdp * share)
        whole = whole[..., :numel // parts].reshape(groups, numel)
        copies = whole.unsqueeze(1).expand(groups, fsdp, numel).reshape(devices, numel)
        return xs.mark_sharding_with_gradients(copies, self.mesh, (self.batch_axes, part_axis))

    def per_device(self, tensor: torch.Tensor, spec: Spec | None = None) -> torch.Tensor:
        """``[...] -> [S * P, ...]``: a copy of ``tensor`` (a constant side input, the LM
        head for the loss) for every row group, held as ``spec`` says (whole by default)."""
        copies = tensor.unsqueeze(0).expand(self.axes.stage * self.replicas, *tensor.shape)
        return self.annotated(copies, (self.batch_axes, *(spec or [None] * tensor.dim())))

    def step_spec(self, parameter: torch.Tensor) -> Spec:
        """How a step holds a parameter of the layers around the body: see
        :func:`xpipe.layout.outer_step_spec`."""
        return outer_step_spec(tuple(parameter.shape), self.axes)

    def gathered_outer(self, modules: list[nn.Module]) -> dict[nn.Module, dict[str, torch.Tensor]]:
        """Each module's parameters, by name, as the step holds them
        (:func:`xpipe.layout.outer_step_spec`: whole on every device, an embedding or
        head split by vocabulary over "tensor"): each gathered once (a weight tied
        between two modules, once for both); those replicated at rest (without "fsdp"
        or "tensor") as they are."""
        gathered: dict[int, torch.Tensor] = {}
        named: dict[nn.Module, dict[str, torch.Tensor]] = {}
        for module in modules:
            named[module] = {}
            for name, parameter in module.named_parameters(remove_duplicate=False):
                if id(parameter) not in gathered:
                    gathered[id(parameter)] = self._whole(parameter)
                named[module][name] = gathered[id(parameter)]
        return named

    def _whole(self, parameter: torch.Tensor) -> torch.Tensor:
        if not self.axes.sharding:
            return parameter
        return xs.mark_sharding_with_gradients(parameter * 1, self.mesh, self.step_spec(parameter))
