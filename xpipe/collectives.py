"""Stage-group collectives: named moves of tensors over one axis of an SPMD mesh.

Under SPMD a program is written for the whole (global) tensor, and XLA's SPMD
partitioner turns it into per-device code and collectives. These helpers are the
global expressions that the partitioner lowers to one known collective each, so
the executors (and users) never write ``torch.roll`` or ``index_select`` and get
an all-gather they did not ask for (see XLA_FACTS.md).

The convention: a *stacked* tensor has dim 0 of size ``n``, the size of the mesh
axis, sharded over that axis, so slice ``i`` is what axis position ``i`` holds.
Every helper takes a stacked tensor (``scatter`` takes one that every position
holds whole) and returns a stacked tensor. ``dim`` arguments count dim 0, so the
first dim of a slice is ``dim=1``.

    mesh = xpipe.make_mesh(stages=4)                          # 2 data x 4 stage
    x = ...                                                   # [4, 1024], sharded ("stage", None)
    y = collectives.send(x, src=0, dst=3, mesh=mesh)          # y[3] == x[0], one collective-permute
    z = collectives.all_gather(x, dim=1, mesh=mesh)           # z[i] == x.flatten() for every i

What each lowers to on this stack (torch_xla 2.9, optimized HLO; the tests count
them): ``shift``, ``rotate``, ``send``: one collective-permute; ``broadcast``,
``reduce``: one all-reduce; ``scatter``: none; ``gather``, ``all_gather``: one
all-gather; ``reduce_scatter``: ``n - 1`` collective-permutes (a ring);
``all_to_all``: one all-to-all. Only ``shift`` and ``rotate`` work inside a
``torch_xla.experimental.scan`` body (the others annotate their result's
sharding, which scan tracing refuses).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
import torch_xla.distributed.spmd as xs

OPS = ("sum", "mean", "max", "min")


def shift(x: torch.Tensor, offset: int, *, mesh: xs.Mesh | None = None, axis: str = "stage") -> torch.Tensor:
    """Move slice ``i`` to ``i + offset``; slices shifted in from outside are zeros.

    Lowers to one collective-permute (every position to the one ``offset`` on),
    and so does its gradient (the opposite shift).

    Args:
        x: a stacked tensor ``[n, ...]``.
        offset: a non-zero whole number of places, ``|offset| < n``.
        mesh, axis: if given, checked against ``x``, and the result is annotated as
            stacked over ``axis``. Inside a scan body (where annotations are
            refused) leave them out: the partitioner then takes the sharding from
            the tensors around the shift.
    """
    n = _stack_size(x, mesh, axis)
    if isinstance(offset, bool) or not isinstance(offset, int) or not 0 < abs(offset) < n:
        raise ValueError(f"offset: must be a non-zero int smaller in size than dim 0 ({n}), got {offset!r}")
    return _stacked_if(_Move.apply(x, _shift_with_zeros, offset), mesh, axis)


def rotate(x: torch.Tensor, offset: int, *, mesh: xs.Mesh | None = None, axis: str = "stage") -> torch.Tensor:
    """Move slice ``i`` to ``(i + offset) % n``: a ring step.

    Lowers to one collective-permute (a cycle over all ``n`` positions), and so
    does its gradient (the opposite rotation). ``mesh`` and ``axis`` as for
    :func:`shift`.
    """
    n = _stack_size(x, mesh, axis)
    if isinstance(offset, bool) or not isinstance(offset, int):
        raise ValueError(f"offset: must be an int, got {offset!r}")
    if offset % n == 0:
        return x
    return _stacked_if(_Move.apply(x, _rotated, offset % n), mesh, axis)


def send(x: torch.Tensor, src: int, dst: int, *, mesh: xs.Mesh, axis: str = "stage") -> torch.Tensor:
    """Slice ``src`` of ``x`` placed at ``dst``; every other slice is zeros.

    Lowers to one collective-permute. Its pairs are those of ``shift(x, dst - src)``
    (every position sends): XLA's SPMD partitioner has no global expression that
    yields a single source-target pair for positions other than the first.
    ``src == dst`` moves nothing.
    """
    n = _stack_size(x, _required(mesh), axis)
    _check_position(src, n, "src", axis)
    _check_position(dst, n, "dst", axis)
    moved = x if src == dst else _Move.apply(x, _shift_with_zeros, dst - src)
    return _stacked(moved * _one_hot(dst, moved), mesh, axis)


def broadcast(x: torch.Tensor, src: int, *, mesh: xs.Mesh, axis: str = "stage") -> torch.Tensor:
    """Every slice becomes slice ``src``. Lowers to one all-reduce (of ``x`` with all
    other slices masked to zero); its gradient, the sum of all slices' gradients
    delivered to ``src``, is one all-reduce too."""
    n = _stack_size(x, _required(mesh), axis)
    _check_position(src, n, "src", axis)
    chosen = (x * _one_hot(src, x)).sum(0, keepdim=True)
    return _stacked(chosen.expand(x.shape), mesh, axis)


def scatter(x: torch.Tensor, dim: int, *, mesh: xs.Mesh, axis: str = "stage") -> torch.Tensor:
    """Split ``x``, which every position holds whole, into ``n`` chunks along ``dim``
    (a dim of ``x``): result slice ``i`` is chunk ``i``. Each position keeps its own
    chunk, so it lowers to no collective; the gradient is an all-gather."""
    n = _axis_size(mesh, axis)
    _check_dim(x, dim, "dim", first=0)
    _check_divisible(x, dim, n, "dim")
    chunks = x.unflatten(dim, (n, x.shape[dim] // n)).movedim(dim, 0)
    return _stacked(chunks, mesh, axis)


def gather(x: torch.Tensor, dst: int, dim: int, *, mesh: xs.Mesh, axis: str = "stage") -> torch.Tensor:
    """Slice ``dst`` becomes all slices concatenated along ``dim``; the others are zeros.

    Lowers to one all-gather whose result is kept at ``dst`` only: XLA has no
    gather-to-one collective.
    """
    n = _stack_size(x, _required(mesh), axis)
    _check_position(dst, n, "dst", axis)
    _check_dim(x, dim, "dim")
    return _stacked(_everyone_gathers(x, dim) * _one_hot(dst, x), mesh, axis)


def reduce(x: torch.Tensor, dst: int, op: str = "sum", *, mesh: xs.Mesh, axis: str = "stage") -> torch.Tensor:
    """Slice ``dst`` becomes ``op`` over all slices (``"sum"``, ``"mean"``, ``"max"``,
    ``"min"``); the others are zeros. Lowers to one all-reduce: XLA has no
    reduce-to-one collective."""
    n = _stack_size(x, _required(mesh), axis)
    _check_position(dst, n, "dst", axis)
    _check_op(op)
    total = _reduced(x, op)
    return _stacked(total.expand(x.shape) * _one_hot(dst, x), mesh, axis)


def all_gather(x: torch.Tensor, dim: int, *, mesh: xs.Mesh, axis: str = "stage") -> torch.Tensor:
    """Every slice becomes all slices concatenated along ``dim``. Lowers to one
    all-gather; its peak device memory is its output plus its input."""
    _stack_size(x, _required(mesh), axis)
    _check_dim(x, dim, "dim")
    return _stacked(_everyone_gathers(x, dim), mesh, axis)


def reduce_scatter(x: torch.Tensor, dim: int, op: str = "sum", *, mesh: xs.Mesh,
                   axis: str = "stage") -> torch.Tensor:
    """Slice ``i`` becomes chunk ``i`` (along ``dim``) of ``op`` over all slices.

    Lowers to a ring of ``n - 1`` collective-permutes, each carrying one chunk, so
    a device holds its input, one chunk in flight and one arriving: input plus
    twice the output. (The plain expression, ``op`` then slice, lowers on XLA's CPU
    pipeline to an all-reduce of the whole input followed by a slice: input plus
    twice the input.)
    """
    n = _stack_size(x, _required(mesh), axis)
    _check_dim(x, dim, "dim")
    _check_divisible(x, dim, n, "dim")
    _check_op(op)
    chunks = x.unflatten(dim, (n, x.shape[dim] // n))  # chunk c of slice i: chunks[i, ..., c, ...]
    position = torch.arange(n, device=x.device)
    # Step t: position i adds its own chunk (i - 1 - t) % n to what arrived from i - 1,
    # so after n - 1 steps position i holds chunk i reduced over every position.
    total = _own_chunk(chunks, dim, (position - 1) % n)
    for step in range(1, n):
        arrived = _Move.apply(total, _rotated, 1)
        total = _combine(arrived, _own_chunk(chunks, dim, (position - 1 - step) % n), op)
    if op == "mean":
        total = total / n
    return _stacked(total, mesh, axis)


def all_to_all(x: torch.Tensor, split_dim: int, concat_dim: int, *, mesh: xs.Mesh,
               axis: str = "stage") -> torch.Tensor:
    """Slice ``i`` becomes chunk ``i`` (along ``split_dim``) of every slice,
    concatenated along ``concat_dim`` in slice order. Lowers to one all-to-all."""
    n = _stack_size(x, _required(mesh), axis)
    _check_dim(x, split_dim, "split_dim")
    _check_dim(x, concat_dim, "concat_dim")
    _check_divisible(x, split_dim, n, "split_dim")
    pieces = x.unflatten(split_dim, (n, x.shape[split_dim] // n))  # [source, ..., chunk, piece, ...]
    pieces = pieces.movedim(split_dim, 0)  # [chunk, source, ...]: dim d of a slice is now dim d + 1
    merged = pieces.movedim(1, concat_dim).flatten(concat_dim, concat_dim + 1)
    return _stacked(merged, mesh, axis)


class _Move(torch.autograd.Function):
    """A move along dim 0 by ``offset`` places whose backward is the same move back.

    Left to autograd, the backward of a shift's pad-then-slice reaches the
    partitioner in a form it lowers to several permutes (by 1, 2 and 3 stages);
    written as the mirror move it stays one.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, move: Callable[[torch.Tensor, int], torch.Tensor],
                offset: int) -> torch.Tensor:
        ctx.move, ctx.offset = move, offset
        return move(x, offset)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return ctx.move(grad, -ctx.offset), None, None


def _shift_with_zeros(x: torch.Tensor, offset: int) -> torch.Tensor:
    unpadded = [0, 0] * (x.dim() - 1)
    if offset > 0:
        return F.pad(x, unpadded + [offset, 0])[:-offset]
    return F.pad(x, unpadded + [0, -offset])[-offset:]


def _rotated(x: torch.Tensor, offset: int) -> torch.Tensor:
    # cat of two slices is one collective-permute; torch.roll would be an all-gather.
    offset %= x.shape[0]
    return torch.cat([x[-offset:], x[:-offset]], 0)


def _everyone_gathers(x: torch.Tensor, dim: int) -> torch.Tensor:
    """All slices concatenated along ``dim``, repeated for every position."""
    whole = x.movedim(0, dim - 1).flatten(dim - 1, dim)
    return whole.unsqueeze(0).expand(x.shape[0], *whole.shape)


def _own_chunk(chunks: torch.Tensor, dim: int, which: torch.Tensor) -> torch.Tensor:
    """From ``chunks`` (``dim`` split into (n, size)), slice i's chunk ``which[i]``: a
    selection local to each position."""
    shape = [chunks.shape[0]] + [1] * (chunks.dim() - 1)
    index = which.view(shape).expand(*chunks.shape[:dim], 1, *chunks.shape[dim + 1:])
    return torch.gather(chunks, dim, index).squeeze(dim)


def _combine(a: torch.Tensor, b: torch.Tensor, op: str) -> torch.Tensor:
    if op in ("sum", "mean"):
        return a + b
    return torch.maximum(a, b) if op == "max" else torch.minimum(a, b)


def _reduced(x: torch.Tensor, op: str) -> torch.Tensor:
    if op == "sum":
        return x.sum(0, keepdim=True)
    if op == "mean":
        return x.mean(0, keepdim=True)
    return x.amax(0, keepdim=True) if op == "max" else x.amin(0, keepdim=True)


def _one_hot(position: int, like: torch.Tensor) -> torch.Tensor:
    """``[n, 1, ...]``: 1 at ``position``, 0 elsewhere, broadcastable against ``like``."""
    mask = torch.arange(like.shape[0], device=like.device) == position
    return mask.to(like.dtype).view(-1, *[1] * (like.dim() - 1))


def _stacked(x: torch.Tensor, mesh: xs.Mesh, axis: str) -> torch.Tensor:
    """Annotate ``x`` as stacked over ``axis``: dim 0 sharded, the rest whole.

    A view is replaced by a tensor of its own first: a view keeps the chain of
    views it came from alive, and torch_xla makes every live view an output of
    the program, one buffer each.
    """
    if x._is_view():
        x = x.clone()
    xs.mark_sharding(x, mesh, (axis,) + (None,) * (x.dim() - 1))
    return x


def _stacked_if(x: torch.Tensor, mesh: xs.Mesh | None, axis: str) -> torch.Tensor:
    return x if mesh is None else _stacked(x, mesh, axis)


def _axis_size(mesh: xs.Mesh, axis: str) -> int:
    if axis not in _required(mesh).axis_names:
        raise ValueError(f"axis: the mesh has axes {tuple(mesh.axis_names)}, not {axis!r}; pass one of them")
    return int(mesh.mesh_shape[mesh.axis_names.index(axis)])


def _required(mesh: xs.Mesh | None) -> xs.Mesh:
    """``mesh``, which every move but ``shift`` and ``rotate`` needs to place its result."""
    if not isinstance(mesh, xs.Mesh):
        raise TypeError(f"mesh: expected a torch_xla.distributed.spmd.Mesh, got {type(mesh).__name__}; "
                        "pass mesh=xpipe.make_mesh(stages) (or the Pipe's pipe.mesh)")
    return mesh


def _stack_size(x: torch.Tensor, mesh: xs.Mesh | None, axis: str) -> int:
    """The stack size ``n`` (dim 0 of ``x``), checked against ``mesh``'s ``axis`` if given."""
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        raise ValueError(f"x: expected a stacked tensor [n, ...], got {_describe(x)}")
    if mesh is not None:
        n = _axis_size(mesh, axis)
        if x.shape[0] != n:
            raise ValueError(f"x: dim 0 has size {x.shape[0]} but axis {axis!r} has {n} positions; "
                             f"stack one slice per position ([{n}, ...])")
    return x.shape[0]


def _check_position(value: int, n: int, name: str, axis: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < n:
        raise ValueError(f"{name}: must be a position on axis {axis!r}, 0 .. {n - 1}, got {value!r}")


def _check_dim(x: torch.Tensor, dim: int, name: str, first: int = 1) -> None:
    if isinstance(dim, bool) or not isinstance(dim, int) or not first <= dim < x.dim():
        where = "dim 0 is the stacked axis, so" if first else "so"
        raise ValueError(f"{name}: x of shape {list(x.shape)} has no dim {dim!r}; {where} use "
                         f"{first} .. {x.dim() - 1}")


def _check_divisible(x: torch.Tensor, dim: int, n: int, name: str) -> None:
    if x.shape[dim] % n:
        raise ValueError(f"{name}: size {x.shape[dim]} of dim {dim} does not split into {n} equal chunks; "
                         f"pad it to a multiple of {n}")


def _check_op(op: str) -> None:
    if op not in OPS:
        raise ValueError(f"op: {op!r} is not a reduction; use one of {', '.join(OPS)}")


def _describe(x: object) -> str:
    return "a 0-dim tensor" if isinstance(x, torch.Tensor) else type(x).__name__
