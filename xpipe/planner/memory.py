"""The memory model of the spmd executor: bytes per device, by kind, for a mesh.

Pure arithmetic over shapes (no torch, no torch_xla), by the same sharding rules
the executor places tensors with (:mod:`xpipe.layout`), so a layout can be judged
before anything is built. docs/scaling.md derives it and checks it against the
bytes measured on emulated devices.

    memory = xpipe.planner.memory.per_device(stacked=[(2, 4, 1024)], outer=[(128, 32)],
                                     axes=MeshAxes(stage=2, fsdp=4))
    memory.resting            # parameters + gradients + optimizer state, between steps
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from xpipe._checks import check_gather, check_optimizer_states, check_positive_int
from xpipe.layout import MeshAxes, outer_spec, outer_step_numel, shard_numel, stacked_spec


@dataclass(frozen=True)
class DeviceMemory:
    """Bytes one device holds, by kind (the busiest device: shards are padded up)."""

    parameters: int  # the weights at rest
    gradients: int  # their gradients, sharded as the weights
    optimizer: int  # the optimizer's per-parameter state (AdamW: two tensors per weight)
    gathered: int  # during a step: the whole weights of its stage (or of a block slot) and of the outer layers,
    # and their gradients
    kept_per_clock: int = 0  # the body's weights the clock loop keeps for its backward, with every clock
    gathered_outer: int = 0  # of one gathered copy, the layers around the body's (in ``gathered`` once or twice)

    @property
    def resting(self) -> int:
        """What stays between steps: parameters, gradients and optimizer state."""
        return self.parameters + self.gradients + self.optimizer

    @property
    def step(self) -> int:
        """What a step adds to that, before activations."""
        return self.resting + self.gathered


def per_device(*, stacked: Iterable[tuple[int, ...]], outer: Iterable[tuple[int, ...]], axes: MeshAxes,
               split: Iterable[bool] = (), itemsize: int = 4, optimizer_states: int = 2,
               optimizer_itemsize: int | None = None, gather: str = "step") -> DeviceMemory:
    """Bytes per device of the spmd executor's weights on a mesh of ``axes``.

    Args:
        stacked: shape of each stacked body weight, ``[S, V * K, numel]``.
        outer: shape of each distinct parameter of the layers before and after the body.
        axes: the mesh.
        split: per stacked weight, whether "tensor" splits it in a step (see
            :mod:`xpipe.tensor.rules`); those left out are not split.
        itemsize: bytes per element of the weights and their gradients.
        optimizer_states: tensors shaped like a weight that the optimizer keeps for
            it (AdamW and Adam 2, SGD with momentum 1, plain SGD 0).
        optimizer_itemsize: bytes per element of that state; ``itemsize`` by default.
        gather: when the body's weights are gathered (``Pipe``'s ``gather``): ``"step"``,
            a stage's slice of each whole for the step; ``"block"``, one block slot's
            at a time.

    Raises:
        ValueError: naming the argument that is not what it should be (a stacked
            shape other than ``[axes.stage, slots, numel]``, a block's own shape
            among them, for one).
    """
    stacked, outer, split = _checked(stacked, outer, axes, split, itemsize, optimizer_states, optimizer_itemsize)
    check_gather(gather)
    body = sum(shard_numel(shape, stacked_spec(axes), axes) for shape in stacked)
    around = sum(shard_numel(shape, outer_spec(shape, axes), axes) for shape in outer)
    parameters = (body + around) * itemsize
    # The step's gathered copies: one stage's slice of the body, or of one block slot
    # (a tensor device's share of it where "tensor" splits a weight), and the outer
    # layers whole but for the vocabulary tables' "tensor" split (nothing is gathered
    # without fsdp or tensor). Gathered once per step, each with a gradient of its size.
    # Per block, without: the step's peak is then the forward loop's, before any
    # gradient exists (XLA's buffer assignment, on every per-block layout of the tests).
    stage_body = sum(shard_numel(shape, ("stage", None, "tensor" if cut else None), axes)
                     // (shape[1] if gather == "block" else 1) for shape, cut in zip(stacked, split))
    step_outer = outer_step_numel(outer, axes) if axes.sharding else 0
    gathered = (1 if gather == "block" else 2) * (stage_body + step_outer) * itemsize
    # torch_xla's scan keeps what its backward reads once per clock, the loop's weights too
    # (measured: XLA's peak grows by them with every clock): gathered whole for the step,
    # or each device's resting shard of them when every block slot gathers its own.
    kept = body if gather == "block" else sum(shard_numel(shape, ("stage", None, "tensor" if cut else None), axes)
                                               for shape, cut in zip(stacked, split))
    state_itemsize = itemsize if optimizer_itemsize is None else optimizer_itemsize
    return DeviceMemory(parameters, parameters, (body + around) * optimizer_states * state_itemsize, gathered,
                        kept * itemsize, step_outer * itemsize)


def _checked(stacked: Iterable[tuple[int, ...]], outer: Iterable[tuple[int, ...]], axes: MeshAxes,
             split: Iterable[bool], itemsize: int, optimizer_states: int, optimizer_itemsize: int | None
             ) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]], list[bool]]:
    """:func:`per_device`'s arguments checked: the shapes as lists of tuples, ``split``
    filled up with False to one entry per stacked weight."""
    if not isinstance(axes, MeshAxes):
        raise ValueError(f"axes: expected a xpipe.layout.MeshAxes, got {type(axes).__name__}")
    stacked, outer = [_shape(shape, "stacked") for shape in stacked], [_shape(shape, "outer") for shape in outer]
    wrong = [list(shape) for shape in stacked if len(shape) != 3 or shape[0] != axes.stage]
    if wrong:
        raise ValueError(f"stacked: each stacked body weight is [stages, slots, numel] = [{axes.stage}, V * K, "
                         f"numel] on this mesh, got {wrong[:3]}; pass each block parameter as the executor "
                         "stacks it (stages, blocks per stage, the parameter's numel), not a block's own shapes")
    split = list(split)
    if len(split) > len(stacked) or not all(isinstance(cut, bool) for cut in split):
        raise ValueError(f"split: one True or False per stacked weight (at most {len(stacked)}), got {split!r}")
    check_positive_int(itemsize, "itemsize")
    check_optimizer_states(optimizer_states)
    if optimizer_itemsize is not None:
        check_positive_int(optimizer_itemsize, "optimizer_itemsize")
    return stacked, outer, split + [False] * (len(stacked) - len(split))


def _shape(shape: object, name: str) -> tuple[int, ...]:
    try:
        dims = tuple(shape)
    except TypeError:
        dims = None
    if dims is None or not dims or any(isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in dims):
        raise ValueError(f"{name}: each shape is a sequence of positive ints, got {shape!r}")
    return dims
