"""Mesh layouts as plain data: the sizes of a mesh's axes, the rule that says over
which axes each kind of weight is sharded, how blocks and microbatches fill
the stages, and into how many segments a sequence's loss is cut.

Pure: no torch_xla. The spmd executor places tensors by these rules
(:mod:`xpipe.spmd.placement`) and the memory model (:mod:`xpipe.planner.memory`) and the
planner count by the same ones, so they cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

Spec = tuple  # a partition spec: per dim, an axis name, a tuple of them, or None


@dataclass(frozen=True)
class MeshAxes:
    """The sizes of a mesh's axes, 1 for an axis the mesh leaves out."""

    stage: int
    data: int = 1
    fsdp: int = 1
    tensor: int = 1

    @property
    def per_stage(self) -> int:
        """Devices that hold one stage."""
        return self.data * self.fsdp * self.tensor

    @property
    def row_groups(self) -> int:
        """Groups of a stage's devices that run their own rows of every microbatch
        (data x fsdp): the devices of one group (a "tensor" group) share their rows."""
        return self.data * self.fsdp

    @property
    def sharding(self) -> tuple[str, ...]:
        """The axes that shard weights at rest besides "stage" ("tensor", then "fsdp"), those of size > 1."""
        return tuple(name for name in ("tensor", "fsdp") if getattr(self, name) > 1)

    @property
    def devices(self) -> int:
        return self.stage * self.per_stage

    def size(self, axes: str | tuple[str, ...] | None) -> int:
        """How many ways ``axes`` (one name, a tuple of names, or None) split a dim."""
        names = () if axes is None else (axes,) if isinstance(axes, str) else axes
        product = 1
        for name in names:
            product *= getattr(self, name)
        return product


def stacked_spec(axes: MeshAxes) -> Spec:
    """The stacked body ``[S, V * K, numel]`` at rest: "stage" on dim 0, "tensor" and
    "fsdp" on the flattened weight (so any block parameter divides, up to padding).

    "tensor" comes first: a block weight is stored with its tensor-split dim
    first (see :func:`stored_shape`), so each "tensor" device's contiguous share
    of ``numel`` is its own slice of that dim, and gathering over "fsdp" alone
    makes the slice a step runs with.
    """
    sharding = axes.sharding
    return ("stage", None, (sharding[0] if len(sharding) == 1 else sharding) if sharding else None)


def stored_shape(shape: tuple[int, ...], dim: int | None) -> tuple[int, ...]:
    """The shape a block weight is stored in (before flattening): its tensor-split
    dim ``dim`` moved first, so that slices of that dim are contiguous."""
    if dim is None or dim == 0:
        return tuple(shape)
    return (shape[dim], *shape[:dim], *shape[dim + 1:])


def outer_spec(shape: tuple[int, ...], axes: MeshAxes) -> Spec:
    """A parameter of the layers before or after the body (embedding, head, final norm).

    Without "fsdp" or "tensor" they stay replicated (plain data parallelism, as
    before FSDP). With them: sharded over "stage" and those axes together on the
    largest dim that they divide, else over those axes alone, else over one of
    them, else (a dim too small for any) replicated.
    """
    sharding = axes.sharding
    if not sharding or not shape:
        return (None,) * len(shape)
    for names in (("stage", *sharding), sharding, *((name,) for name in sharding)):
        dims = [dim for dim, size in enumerate(shape) if size % axes.size(names) == 0]
        if dims:
            chosen = max(dims, key=lambda dim: shape[dim])
            return tuple(names if dim == chosen else None for dim in range(len(shape)))
    return (None,) * len(shape)


def is_vocabulary_table(shape: tuple[int, ...]) -> bool:
    """Whether a weight of the layers around the body is a table longer than it is wide:
    an embedding or an LM head, ``[vocabulary, hidden]`` (or GPT-2's position table)."""
    return len(shape) == 2 and shape[0] > shape[1]


def outer_step_spec(shape: tuple[int, ...], axes: MeshAxes) -> Spec:
    """What a step holds of a parameter of the layers around the body, gathered from
    its resting shards (:func:`outer_spec`): whole on every device, except a table
    longer than it is wide (an embedding, an LM head: ``[vocabulary, hidden]``),
    which stays split by rows over "tensor" where "tensor" divides them, as
    Megatron splits them by vocabulary; the lookup and the logits are then
    computed per "tensor" device on its part of the vocabulary (XLA reduces the
    lookup, and the softmax's max and sum, over "tensor")."""
    if axes.tensor > 1 and is_vocabulary_table(shape) and shape[0] % axes.tensor == 0:
        return ("tensor", None)
    return (None,) * len(shape)


def outer_step_numel(shapes: Iterable[tuple[int, ...]], axes: MeshAxes) -> int:
    """Elements one device holds, for a step, of the parameters of the layers around
    the body of these ``shapes`` (:func:`outer_step_spec`)."""
    return sum(shard_numel(shape, outer_step_spec(shape, axes), axes) for shape in shapes)


def shard_numel(shape: tuple[int, ...], spec: Spec, axes: MeshAxes) -> int:
    """Elements one device holds of a tensor of ``shape`` sharded by ``spec``
    (a dim that does not divide is padded, as XLA pads it)."""
    count = 1
    for size, names in zip(shape, spec):
        ways = axes.size(names)
        count *= -(-size // ways)
    return count


def spread(blocks: int, stages: int) -> tuple[int, ...]:
    """Blocks per stage, as even as possible, extra blocks on the first stages."""
    return tuple(blocks // stages + (stage < blocks % stages) for stage in range(stages))


def microbatch_slots(chunks: int, stages: int) -> int:
    """Microbatches per stage in the spmd executor's slot buffer: ``chunks`` rounded up
    to fill every stage's slots (it runs ``stages`` times as many)."""
    return -(-chunks // stages)


LOSS_SEGMENT_TOKENS = 256  # the longest segment of a sequence whose logits the loss makes at once
# The logits a device makes for its rows, in elements, from which the loss runs over segments (16 MiB of
# float32): below it two more XLA loops buy nothing worth their cost.
LOSS_SEGMENTS_FROM = 1 << 22


def sequence_segments(seq: int) -> int:
    """The number of segments a sequence of ``seq`` tokens is cut into for the loss: a
    divisor of ``seq``, at least two, and enough that no segment is longer than
    :data:`LOSS_SEGMENT_TOKENS` (1 for a sequence of one token)."""
    if seq < 2:
        return 1
    least = max(2, -(-seq // LOSS_SEGMENT_TOKENS))
    return next(count for count in range(least, seq + 1) if seq % count == 0)


def loss_segments(seq: int, logits: float) -> int:
    """The segments the loss of sequences of ``seq`` tokens runs over, when a device
    would otherwise make ``logits`` elements of logits for its rows: 1 (the whole
    sequence at once) below :data:`LOSS_SEGMENTS_FROM`, else :func:`sequence_segments`."""
    return sequence_segments(seq) if logits >= LOSS_SEGMENTS_FROM else 1
