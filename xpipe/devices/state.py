"""The devices executor's state: the wrapped module's own tensors, on the stages' devices.

The stages run the wrapped module's parameters and buffers in place (one device per
stage), so every ``state_dict`` key is the module's own tensor and every name its own.
:class:`ModuleState` is that view, for ``pipe.state_dict()``, its gradients and
checkpoints (whole tensors: a checkpoint's :class:`xpipe.checkpoints.state.WholeState`).
"""

from __future__ import annotations

import torch

from xpipe._xla import to_host
from xpipe.checkpoints.state import WholeState


class ModuleState(WholeState):
    """The wrapped ``module``'s state, read and written where its stages hold it."""

    def state_tensor(self, key: str) -> torch.Tensor:
        """The parameter or buffer behind ``state_dict`` key ``key``."""
        owner, _, name = key.rpartition(".")
        return getattr(self.module.get_submodule(owner), name)

    def named_gradients(self) -> dict[str, torch.Tensor | None]:
        """Gradients under the wrapped module's parameter names."""
        return {name: p.grad for name, p in self.module.named_parameters(remove_duplicate=False)}

    def host_state(self, keys: list[str]) -> dict[str, torch.Tensor]:
        """``state_dict`` keys ``keys`` as CPU copies."""
        return dict(zip(keys, to_host([self.state_tensor(key) for key in keys])))
