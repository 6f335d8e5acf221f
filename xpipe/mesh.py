"""The ("data", "stage") device mesh, and switching the process into SPMD mode.

    mesh = xpipe.make_mesh(stages=4)          # on 8 devices: 2 (data) x 4 (stage)
"""

from __future__ import annotations

import numpy as np
import torch
import torch_xla
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr

from xpipe._checks import check_positive_int
from xpipe._xla import warm_autograd

AXES = ("data", "stage")


def spmd_device() -> torch.device:
    """The XLA device of SPMD mode, switching the process into it on first use.

    SPMD mode is process-wide and must come before the first XLA tensor. It also
    runs autograd's first XLA backward (``xpipe._xla.warm_autograd``).
    """
    if not xr.is_spmd():
        xr.use_spmd()
    device = torch_xla.device()
    warm_autograd(device)
    return device


def make_mesh(stages: int, data: int | None = None) -> xs.Mesh:
    """A mesh of all XLA devices with axes ``("data", "stage")``.

    Device ``s * data + d`` is data replica ``d`` of stage ``s``: the devices of a
    stage are neighbours, and a batch sharded over ("stage", "data") lies on the
    devices in order.

    Args:
        stages: size of the "stage" axis (pipeline stages).
        data: size of the "data" axis; defaults to ``devices // stages``.

    Raises:
        ValueError: if ``data * stages`` is not the device count; the message lists
            the stage counts that would fit.
    """
    spmd_device()
    devices = xr.global_runtime_device_count()
    check_positive_int(stages, "stages")
    if data is None:
        data = devices // stages
    if data < 1 or data * stages != devices:
        fits = [s for s in range(1, devices + 1) if devices % s == 0]
        raise ValueError(
            f"stages: a mesh of data={data} x stages={stages} needs {data * stages} devices but there are "
            f"{devices}; use stages in {fits} with data = {devices} // stages"
        )
    return xs.Mesh(np.arange(devices).reshape(stages, data).T.flatten(), (data, stages), AXES)
