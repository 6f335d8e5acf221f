"""``checkpoint="never"`` under 1F1B in the one SPMD program: a stage's forward keeps
what its backward will read, and the backward clock reads it back instead of
recomputing the forward.

The stages run per device under ``torch.vmap``. Autograd outside the vmap saves the
tensors of the batched program, whose layout (where vmap put the device dim, or
folded it into another) is not known from outside: a ring cannot be indexed by device
on them. So each device's vector-Jacobian product is taken inside the vmap, at a
functorch grad level of its own (:func:`_at_grad_level`: ``torch.func.vjp``'s forward
and backward at one level, where saved-tensor hooks are allowed; ``torch.func.vjp``
refuses them), and what autograd saves leaves the vmapped forward as outputs, each
``[S * P, ...]`` with the device dim first, for the 1F1B ring
(:mod:`xpipe.spmd.one_f_one_b`).

Which saved tensors go into the ring: those the autograd graph shows to depend on the
stage's input, each once, and for a view (a reshape, a transpose) the tensor it views,
which the backward clock views again the same way. The others (the weights and views
of them, dropout masks drawn from the cell's key, constants) are made again in the
backward clock, which runs the stage's forward on its stashed input with the ring's
tensors in place of the ones that forward would save; XLA drops the forward's work
that nothing reads. A tensor made from the input without gradients (an index) is not
on the graph: it is made again from the stashed input, which costs work and is never
a wrong value.

The grad level and a view's replay onto the ring's tensor (``Tensor._view_func``) are
functorch's and autograd's internals in the pinned torch 2.9; a backward trace that
saves other tensors than the forward's raises, naming ``checkpoint="always"``.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch._C import _functorch as functorch
from torch._functorch.eager_transforms import (_create_differentiable, _undo_create_differentiable,
                                               _wrap_all_tensors, grad_increment_nesting)

Stage = Callable[..., torch.Tensor]  # one device's stage: (weights, valid, x, round_, key) -> x

AGAIN, VIEW = "again", "view"  # a saved tensor made again in the backward clock; a view of one in the ring


class StashedActivations:
    """Every stage's forward that keeps its activations, and its backward from them.

    Args:
        one_stage: one device's stage, run under ``torch.vmap`` over the devices.
        enter: the stage's weights and input as the clock loop carries them, to how the
            stages read them (sharding annotations, :class:`xpipe.spmd.clock.ClockBody`'s).
        leave: the stages' output back to how the loop holds it.
    """

    def __init__(self, one_stage: Stage, enter: Callable, leave: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.one_stage, self.enter, self.leave = one_stage, enter, leave
        # Per tensor autograd saves: AGAIN, its place in the ring, or (VIEW, the place of what it views).
        self.kinds: tuple[int | str | tuple[str, int], ...] | None = None

    def forward(self, weights: tuple[torch.Tensor, ...], valid: torch.Tensor, state: torch.Tensor,
                rounds: torch.Tensor, keys: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """Every stage's output and the activations its backward reads, each
        ``[S * P, ...]``."""
        weights, state = self.enter(weights, state)
        output, kept = torch.vmap(self._forward_one)(weights, valid, state, rounds, keys)
        return self.leave(output), kept

    def reading(self, kept: tuple[torch.Tensor, ...]) -> Callable[..., torch.Tensor]:
        """Every stage's blocks, ``(weights, valid, state, rounds, keys) -> state`` as the
        clock loop runs them, whose backward reads ``kept`` (what :meth:`forward` kept for
        that input) instead of running the forward again: the value of the output is not
        computed, only its gradient."""
        def run(weights: tuple[torch.Tensor, ...], valid: torch.Tensor, state: torch.Tensor, rounds: torch.Tensor,
                keys: torch.Tensor) -> torch.Tensor:
            weights, state = self.enter(weights, state)
            return self.leave(_FromKept.apply(self, valid, rounds, keys, len(kept), *kept, state, *weights))

        return run

    def _forward_one(self, weights: tuple[torch.Tensor, ...], valid: torch.Tensor, x: torch.Tensor,
                     round_: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """One device's stage, and what autograd saves that depends on ``x``: each tensor
        once (autograd saves a tensor that several operations read once for each), and
        for a view (a reshape, a transpose) the tensor it views, once too (the backward
        clock views it again the same way)."""
        kinds, kept, seen = [], [], []
        depends = _DependsOn()

        def pack(saved: torch.Tensor, level: int, inputs: list[torch.Tensor]) -> None:
            if not depends.on(saved, inputs[0]):
                kinds.append(AGAIN)
                return
            whole = saved if saved._base is None else saved._base
            place = next((place for place, earlier in enumerate(seen) if earlier is whole), None)
            if place is None:
                place = len(kept)
                seen.append(whole)
                kept.append(_unwrapped(whole, level))
            kinds.append(place if whole is saved else (VIEW, place))

        output = _at_grad_level(partial(self.one_stage, valid=valid, round_=round_, key=key), (x, *weights),
                                pack, lambda handle, level: None)
        depends.forget()
        seen.clear()
        self._check_same(tuple(kinds))
        return output, tuple(kept)

    def _vjp_one(self, kept: tuple[torch.Tensor, ...], x: torch.Tensor, weights: tuple[torch.Tensor, ...],
                 valid: torch.Tensor, round_: torch.Tensor, key: torch.Tensor, gradient: torch.Tensor
                 ) -> tuple[torch.Tensor, ...]:
        """One device's gradients of ``x`` and ``weights``, reading the ring's ``kept``."""
        kinds = iter(self.kinds)
        made = []

        def pack(saved: torch.Tensor, level: int, inputs: list[torch.Tensor]) -> int:
            kind = next(kinds, None)
            if kind is None or (kind != AGAIN and (saved._base is None) != isinstance(kind, int)):
                raise RuntimeError("stashed activations: the stage's backward saves other tensors than its forward "
                                   "did; run checkpoint='always'")
            made.append((kind, saved))
            return len(made) - 1

        def unpack(index: int, level: int) -> torch.Tensor:
            kind, saved = made[index]
            if kind == AGAIN:
                return saved
            if isinstance(kind, int):
                return functorch._wrap_for_grad(kept[kind], level)
            return saved._view_func(functorch._wrap_for_grad(kept[kind[1]], level))

        found = _at_grad_level(partial(self.one_stage, valid=valid, round_=round_, key=key), (x, *weights),
                               pack, unpack, gradient)
        made.clear()  # the traced tensors of this level go with the trace (see _DependsOn.forget)
        return found

    def _check_same(self, kinds: tuple[int | str | tuple[str, int], ...]) -> None:
        """Every trace of the forward saves the same tensors, in the same order."""
        if self.kinds is not None and self.kinds != kinds:
            raise RuntimeError("stashed activations: the stage's forward saved other tensors in another trace; "
                               "run checkpoint='always'")
        self.kinds = kinds


class _FromKept(torch.autograd.Function):
    """Every stage's output, whose backward is :meth:`StashedActivations._vjp_one` on
    every device: the stage's gradients from the kept activations. Its forward's value
    is not read (the backward clock needs only its gradient)."""

    @staticmethod
    def forward(ctx, stashed: StashedActivations, valid: torch.Tensor, rounds: torch.Tensor, keys: torch.Tensor,
                count: int, *tensors: torch.Tensor) -> torch.Tensor:
        ctx.stashed, ctx.count = stashed, count
        ctx.save_for_backward(valid, rounds, keys, *tensors)
        return torch.zeros_like(tensors[count])

    @staticmethod
    def backward(ctx, gradient: torch.Tensor) -> tuple:
        valid, rounds, keys, *tensors = ctx.saved_tensors
        kept, (x, *weights) = tuple(tensors[:ctx.count]), tensors[ctx.count:]
        found = torch.vmap(ctx.stashed._vjp_one)(kept, x, tuple(weights), valid, rounds, keys, gradient)
        found = [g if t.is_floating_point() else None for g, t in zip(found, (x, *weights))]
        return (None, None, None, None, None, *(None for _ in kept), *found)


def _at_grad_level(stage: Stage, primals: tuple[torch.Tensor, ...], pack: Callable, unpack: Callable,
                   gradient: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """``stage(primals[1:], x=primals[0])`` at a functorch grad level of its own, every
    tensor autograd saves passed through ``pack(saved, level, inputs)`` and read back by
    ``unpack(handle, level)``: its output, or given its output's ``gradient``, the
    gradients of the floating primals (zeros for the others)."""
    with grad_increment_nesting() as level, torch.enable_grad():
        wrapped = _wrap_all_tensors(primals, level)
        inputs = [_create_differentiable(t, level) if t.is_floating_point() else t for t in wrapped]
        with torch.autograd.graph.saved_tensors_hooks(lambda saved: pack(saved, level, inputs),
                                                      lambda handle: unpack(handle, level)):
            output = stage(tuple(inputs[1:]), x=inputs[0])
            if gradient is None:
                return _undo_create_differentiable(output, level)
            wanted = [t for t in inputs if t.requires_grad]
            found = iter(torch.autograd.grad(output, wanted, _wrap_all_tensors(gradient, level),
                                             materialize_grads=True))
        grads = [next(found) if t.requires_grad else torch.zeros_like(t, dtype=torch.float32) for t in inputs]
        return tuple(_undo_create_differentiable(g, level) for g in grads)


def _unwrapped(saved: torch.Tensor, level: int) -> torch.Tensor:
    """A tensor autograd saved at grad level ``level``, as the vmap around it holds it."""
    if not (functorch.is_gradtrackingtensor(saved) and functorch.maybe_get_level(saved) == level):
        raise RuntimeError("stashed activations: the stage's forward saved a tensor made outside its own grad "
                           "level; run checkpoint='always'")
    return functorch.get_unwrapped(saved)


class _DependsOn:
    """Whether a tensor autograd saves depends on an input, read from the autograd
    graph (each node's answer kept: the graph is walked once)."""

    def __init__(self) -> None:
        self._reaches: dict[torch.autograd.graph.Node, bool] = {}

    def forget(self) -> None:
        """Drop the graph's nodes. They hold the level's tensors, and a tensor a node
        saved holds the hook that holds this: a cycle through C++ that Python's
        collector cannot break, and a traced tensor left alive when the step runs
        points at the loop's placeholders (torch_xla then crashes)."""
        self._reaches.clear()

    def on(self, saved: torch.Tensor, leaf: torch.Tensor) -> bool:
        if saved is leaf:
            return True
        if saved.grad_fn is None:
            return False
        target = torch.autograd.graph.get_gradient_edge(leaf).node
        return self._reach(saved.grad_fn, target)

    def _reach(self, node: torch.autograd.graph.Node, target: torch.autograd.graph.Node) -> bool:
        """Whether ``target`` is reached from ``node``: a post-order walk, iterative (a
        stage's graph can be deeper than Python's recursion limit)."""
        stack = [(node, False)]
        while stack:
            current, expanded = stack.pop()
            if current in self._reaches:
                continue
            children = [child for child, _ in current.next_functions if child is not None]
            if expanded:
                self._reaches[current] = current is target or any(self._reaches[child] for child in children)
                continue
            stack.append((current, True))
            stack.extend((child, False) for child in children if child not in self._reaches)
        return self._reaches[node]
