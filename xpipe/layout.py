"""Mesh layouts as plain data: the sizes of a mesh's axes, and the rule that says
over which axes each kind of weight is sharded.

Pure: no torch_xla. The spmd executor places tensors by these rules
(:mod:`xpipe.spmd.placement`) and the memory model (:mod:`xpipe.memory`) counts
bytes by the same ones, so the two cannot drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass

Spec = tuple  # a partition spec: per dim, an axis name, a tuple of them, or None


@dataclass(frozen=True)
class MeshAxes:
    """The sizes of a mesh's axes, 1 for an axis the mesh leaves out."""

    stage: int
    data: int = 1
    fsdp: int = 1

    @property
    def per_stage(self) -> int:
        """Devices that hold one stage: a batch row is on exactly one of them."""
        return self.data * self.fsdp

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
    """The stacked body ``[S, V * K, numel]``: "stage" on dim 0, "fsdp" on the
    flattened weight (so any block parameter divides, up to padding)."""
    return ("stage", None, "fsdp" if axes.fsdp > 1 else None)


def outer_spec(shape: tuple[int, ...], axes: MeshAxes) -> Spec:
    """A parameter of the layers before or after the body (embedding, head, final norm).

    Without "fsdp" they stay replicated (plain data parallelism, as before FSDP).
    With it: sharded over ("stage", "fsdp") together on the largest dim that they
    divide, else over "fsdp" alone, else (a dim too small for either) replicated.
    """
    if axes.fsdp == 1 or not shape:
        return (None,) * len(shape)
    for names in (("stage", "fsdp"), ("fsdp",)):
        dims = [dim for dim, size in enumerate(shape) if size % axes.size(names) == 0]
        if dims:
            chosen = max(dims, key=lambda dim: shape[dim])
            return tuple(names if dim == chosen else None for dim in range(len(shape)))
    return (None,) * len(shape)


def shard_numel(shape: tuple[int, ...], spec: Spec, axes: MeshAxes) -> int:
    """Elements one device holds of a tensor of ``shape`` sharded by ``spec``
    (a dim that does not divide is padded, as XLA pads it)."""
    count = 1
    for size, names in zip(shape, spec):
        ways = axes.size(names)
        count *= -(-size // ways)
    return count
