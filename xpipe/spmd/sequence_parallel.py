"""Sequence parallelism over "tensor" inside the clock loop (Megatron's, Korthikanti
et al., 2022, "Reducing Activation Recomputation in Large Transformer Models").

Tensor parallelism alone holds the stream between a block's tensor-parallel regions
(its input, the residual adds, the norms) whole on every tensor device, and so
every tensor the block saves for its backward at the stream's width. With
sequence parallelism each tensor device holds a slice of the sequence there: the
row-parallel linears' all-reduce becomes a reduce-scatter onto the slices, and
the column-parallel linears read the sequence whole through an all-gather of the
same bytes. A stage sends the next one only its slices.

Under GSPMD this is a question of annotations, not of code: the block's input and
every residual add (each add whose result has the stream's shape) are held as
sequence slices, and XLA's propagation places the gather before each
column-parallel linear and the reduce-scatter after each row-parallel one (seen in
the optimized HLO of every family the tests run). The blocks run under
``torch.vmap``, where torch_xla's annotations do not reach: :func:`sharding_hint`
is an op that does, annotating the tensor that vmap batches, and its gradient.
"""

from __future__ import annotations

import ast

import torch
import torch_xla.distributed.spmd as xs
from torch.overrides import TorchFunctionMode

aten = torch.ops.aten


@torch.library.custom_op("xpipe::sharding_hint", mutates_args=())
def _hint(x: torch.Tensor, mesh: str, spec: str, batch: str) -> torch.Tensor:
    """``x`` annotated on ``mesh`` (``str(xs.Mesh)``) by ``spec`` (a partition spec's
    ``repr``). Under ``torch.vmap``, ``spec`` names the dims the function sees and
    ``batch`` (a ``repr`` too) the mesh axes of the dim vmap adds."""
    return torch.ops.xla.aot_mark_sharding(x, mesh, spec)


@_hint.register_fake
def _(x: torch.Tensor, mesh: str, spec: str, batch: str) -> torch.Tensor:
    return torch.empty_like(x)


def _batched(info, in_dims: tuple, x: torch.Tensor, mesh: str, spec: str, batch: str) -> tuple:
    """vmap's rule: the batched tensor annotated with the batch dim's axes leading."""
    dim = in_dims[0]
    if dim is None:
        return _hint(x, mesh, spec, batch), None
    if batch == repr(None):
        raise RuntimeError("sharding_hint: the tensor is batched by a second vmap; the hint names one batch dim")
    leading = (ast.literal_eval(batch), *ast.literal_eval(spec))
    return _hint(x.movedim(dim, 0), mesh, repr(leading), repr(None)), 0


_hint.register_vmap(_batched)


class _Hinted(torch.autograd.Function):
    """The hint and its gradient's, as an autograd.Function with ``setup_context``, so
    that it also runs under functorch's transforms (1F1B's stashed activations take
    each device's gradients at a grad level of their own: :mod:`xpipe.spmd.stashed_activations`)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor, mesh: str, spec: str, batch: str) -> torch.Tensor:
        return _hint(x, mesh, spec, batch)

    @staticmethod
    def setup_context(ctx, inputs: tuple, output: torch.Tensor) -> None:
        _, ctx.mesh, ctx.spec, ctx.batch = inputs

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple:
        return _Hinted.apply(grad, ctx.mesh, ctx.spec, ctx.batch), None, None, None


def sharding_hint(x: torch.Tensor, mesh: str, spec: str, batch: str) -> torch.Tensor:
    """``x`` annotated on ``mesh`` (``str(xs.Mesh)``) by ``spec`` (a partition spec's
    ``repr``), and its gradient too. Under ``torch.vmap``, ``spec`` names the dims
    the function sees and ``batch`` (a ``repr`` too) the mesh axes of the dim vmap adds."""
    return _Hinted.apply(x, mesh, spec, batch)


_ADDS = {aten.add.Tensor, torch.add, torch.Tensor.add, torch.Tensor.__add__, torch.Tensor.__radd__}


class SequenceSlices(TorchFunctionMode):
    """Inside this mode (a block run under vmap by the clock loop), the stream is held as
    each tensor device's slice of its sequence (dim 1 of ``[rows, seq, ..., features]``):
    :meth:`sliced` it, and every residual add, whose result has the stream's shape.

    Args:
        shape: the stream's shape as the block sees it.
        mesh: the spmd executor's mesh.
        batch_axes: the mesh axes of the dim vmap adds (the rows of devices).
    """

    def __init__(self, shape: torch.Size, mesh: xs.Mesh, batch_axes: tuple[str, ...]) -> None:
        super().__init__()
        self.shape = tuple(shape)
        self._mesh = str(mesh)
        self._spec = repr((None, "tensor", *[None] * (len(shape) - 2)))
        self._batch = repr(batch_axes)

    def sliced(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (the stream's shape) held as sequence slices, its gradient too."""
        return sharding_hint(x, self._mesh, self._spec, self._batch)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _ADDS and isinstance(out, torch.Tensor) and tuple(out.shape) == self.shape:
            return self.sliced(out)
        return out


def check_sequence_dim(shape: tuple[int, ...], read: str) -> None:
    """Refuse sequence parallelism for a stream of ``shape`` (``read``: where it was
    seen) that has no sequence dim to split."""
    if len(shape) < 3:
        raise ValueError(f"sequence_parallel: the stream between the blocks is {tuple(shape)} {read}, with no "
                         "sequence dim to split (it splits dim 1 of [batch, seq, ..., features]); leave "
                         "sequence_parallel off for this model")
