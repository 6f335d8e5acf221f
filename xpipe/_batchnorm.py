"""BatchNorm's running statistics as PyTorch keeps them, once per microbatch or once per step.

Both executors run the model's BatchNorm layers through :class:`RunningStatistics`:

- torch_xla 2.9 updates ``running_var`` with the biased variance of the batch,
  where PyTorch uses the unbiased one (seen: after one step on 4 rows, 0.948 on
  XLA against 0.964 on the CPU). Here every training-mode call normalises with the
  batch's own statistics and moves the running statistics itself, as PyTorch does.
- A pipeline runs each layer once per microbatch. By default each call moves the
  running statistics (the model fed the microbatches in turn, as in torchgpipe).
  Deferred (``Pipe(..., deferred_batch_norm=True)``), the calls only add their sums
  up and :meth:`RunningStatistics.commit` moves the statistics once, with the whole
  mini-batch's mean and unbiased variance: what the unpipelined model's become.
- A recomputed microbatch (checkpointing) normalises again and moves nothing.
- In eval mode the layers normalise with elementwise ops, which torch_xla can
  differentiate (its own eval-mode BatchNorm fails in the backward).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.overrides import TorchFunctionMode


def normalizes_over_rows(module: nn.Module) -> bool:
    """Whether ``module`` (a captured piece of a model) holds a batch normalization in any
    form: a BatchNorm layer, or the operation torch.export records for one."""
    if any(isinstance(layer, _BatchNorm) for layer in module.modules()):
        return True
    graph = getattr(module, "graph", None)
    return graph is not None and any(node.op == "call_function" and "batch_norm" in str(node.target)
                                     for node in graph.nodes)


class RunningStatistics:
    """The running statistics of every BatchNorm in ``modules`` that tracks them."""

    def __init__(self, modules: list[nn.Module], *, deferred: bool = False) -> None:
        self.layers = {id(layer.running_mean): layer for module in modules for layer in module.modules()
                       if isinstance(layer, _BatchNorm) and layer.track_running_stats}
        self.deferred = deferred
        self.sums: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}  # sum, sum of squares, rows
        self.tracked: dict[int, torch.Tensor] = {}  # num_batches_tracked when the step began

    @contextlib.contextmanager
    def updating(self) -> Iterator[None]:
        """Within: training-mode BatchNorm calls update (or, deferred, collect) statistics."""
        with _Intercept(self, update=True):
            yield

    @contextlib.contextmanager
    def recomputing(self) -> Iterator[None]:
        """Within: training-mode BatchNorm calls normalise and leave the statistics alone."""
        with _Intercept(self, update=False):
            yield

    def observe(self, key: int, x: torch.Tensor, momentum: float) -> None:
        """Take one call's batch ``x`` into the statistics of layer ``key``."""
        layer = self.layers[key]
        dims = [d for d in range(x.dim()) if d != 1]
        values = x.detach().to(layer.running_mean.dtype)
        total, squares, rows = values.sum(dims), (values * values).sum(dims), x.numel() // x.shape[1]
        if not self.deferred:
            with torch.no_grad():
                _move(layer, total, squares, rows, momentum)
            return
        if key not in self.tracked:
            self.tracked[key] = layer.num_batches_tracked.detach().clone() - 1  # the layer already counted this call
        before = self.sums.get(key, (0, 0, 0))
        self.sums[key] = (before[0] + total, before[1] + squares, before[2] + rows)

    def commit(self) -> None:
        """Deferred: move each running statistic once, with the step's whole mini-batch."""
        with torch.no_grad():
            for key, (total, squares, rows) in self.sums.items():
                layer = self.layers[key]
                layer.num_batches_tracked.copy_(self.tracked[key] + 1)
                momentum = 1.0 / layer.num_batches_tracked if layer.momentum is None else layer.momentum
                _move(layer, total, squares, rows, momentum)
        self.sums.clear()
        self.tracked.clear()


def _move(layer: _BatchNorm, total: torch.Tensor, squares: torch.Tensor, rows: int, momentum) -> None:
    """One exponential-average step towards the batch's mean and unbiased variance."""
    mean = total / rows
    variance = (squares / rows - mean * mean) * rows / max(rows - 1, 1)
    layer.running_mean.mul_(1 - momentum).add_(mean * momentum)
    layer.running_var.mul_(1 - momentum).add_(variance * momentum)


class _Intercept(TorchFunctionMode):
    """Routes training-mode ``F.batch_norm`` calls of known layers through the statistics."""

    def __init__(self, statistics: RunningStatistics, *, update: bool) -> None:
        super().__init__()
        self.statistics = statistics
        self.update = update

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.batch_norm:
            return self._batch_norm(*args, **kwargs)
        return func(*args, **kwargs)

    def _batch_norm(self, x, running_mean, running_var, weight=None, bias=None, training=False, momentum=0.1,
                    eps=1e-5):
        key = id(running_mean)
        if not training and running_mean is not None:
            return _normalized(x, running_mean, running_var, weight, bias, eps)
        if not training or key not in self.statistics.layers:
            return F.batch_norm(x, running_mean, running_var, weight, bias, training, momentum, eps)
        if self.update:
            self.statistics.observe(key, x, momentum)
        return F.batch_norm(x, None, None, weight, bias, True, 0.0, eps)


def _normalized(x: torch.Tensor, mean: torch.Tensor, var: torch.Tensor, weight: torch.Tensor | None,
                bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Eval-mode batch norm from elementwise ops: torch_xla 2.9's own fails in the
    backward ("The size of mean should be compatible with feature count")."""
    shape = (1, -1) + (1,) * (x.dim() - 2)
    y = (x - mean.view(shape)) * torch.rsqrt(var.view(shape) + eps)
    if weight is not None:
        y = y * weight.view(shape)
    return y + bias.view(shape) if bias is not None else y
