"""Parameters a Pipe replaced by its own, made to fail loudly wherever they are still used.

The spmd executor stacks the repeated blocks' weights into new ``[S, K, ...]``
tensors sharded over the mesh, and a parameter that cannot be moved in place
(torch.export holds a weak reference to it) is moved as a new object; the old
Parameters then train nothing. An optimizer built on them, ``model.state_dict()``
and ``model.load_state_dict()`` (spmd) would otherwise go on working on the stale
copies in silence: each raises instead, saying what to use.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch import nn

_MARK = "_xpipe_retired"  # set (True) on a Parameter a Pipe replaced


def retire_parameters(parameters: Iterable[nn.Parameter]) -> None:
    """Mark ``parameters`` as replaced by a Pipe's: no optimizer steps them any more."""
    for parameter in parameters:
        setattr(parameter, _MARK, True)


def retire(module: nn.Module, parameters: Iterable[nn.Parameter]) -> None:
    """Mark ``parameters`` of ``module`` as replaced by a Pipe's, and make every
    module that holds one refuse ``state_dict`` and ``load_state_dict``."""
    parameters = list(parameters)
    retire_parameters(parameters)
    retired = {id(parameter) for parameter in parameters}
    for owner in module.modules():
        if any(id(p) in retired for p in owner.parameters()):
            owner.register_state_dict_pre_hook(_refuse_state_dict)
            owner.register_load_state_dict_pre_hook(_refuse_load_state_dict)


def is_retired(parameter: torch.Tensor) -> bool:
    return getattr(parameter, _MARK, False)


def _refuse_state_dict(module: nn.Module, prefix: str, keep_vars: bool) -> None:
    raise RuntimeError(
        f"module: {type(module).__name__}.state_dict() would return stale weights: an xpipe.Pipe (spmd "
        "executor) took this model over and trains its repeated blocks as stacked tensors of its own. "
        "Use pipe.state_dict(), which has the same keys and shapes")


def _refuse_load_state_dict(module: nn.Module, *args) -> None:
    raise RuntimeError(
        f"module: {type(module).__name__}.load_state_dict() would load into weights nothing uses any "
        "more: an xpipe.Pipe (spmd executor) took this model over. Use pipe.load_state_dict()")


def _refuse_retired_parameters(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    """Optimizer step pre-hook (global): no step over parameters a Pipe replaced."""
    for group in optimizer.param_groups:
        if any(is_retired(p) for p in group["params"]):
            raise RuntimeError(
                f"optimizer: this {type(optimizer).__name__} holds parameters of a model that an "
                "xpipe.Pipe took over and replaced by its own (the spmd executor stacks the "
                "repeated blocks' weights; a model captured by torch.export gets its weights moved as new "
                "objects), so this step would leave the trained weights unchanged. Build the optimizer on "
                "pipe.parameters(), after wrapping")


register_optimizer_step_pre_hook(_refuse_retired_parameters)
