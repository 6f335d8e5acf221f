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
from xpipe._xla import check_can_enter_spmd, warm_autograd

AXES = ("data", "stage")


def spmd_device() -> torch.device:
    """The XLA device of SPMD mode, switching the process into it on first use.

    SPMD mode is process-wide and must come before the first XLA device is used;
    a process that already used one is refused with what to do, not left to crash.

    Raises:
        RuntimeError: if an XLA device was used before in this process, in
            non-SPMD mode; or if autograd cannot run XLA backward passes
            (``xpipe._xla.warm_autograd``).
    """
    if not xr.is_spmd():
        check_can_enter_spmd()
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
    data, stages = mesh_shape(stages, data)
    spmd_device()
    return xs.Mesh(np.arange(data * stages).reshape(stages, data).T.flatten(), (data, stages), AXES)


def mesh_shape(stages: int, data: int | None = None) -> tuple[int, int]:
    """``(data, stages)`` of a mesh of all XLA devices, checked without entering SPMD mode.

    Raises:
        ValueError: as :func:`make_mesh`.
    """
    devices = xr.global_runtime_device_count()
    stages = check_positive_int(stages, "stages")
    data = devices // stages if data is None else check_positive_int(data, "data")
    if data < 1 or data * stages != devices:
        fits = [s for s in range(1, devices + 1) if devices % s == 0]
        raise ValueError(
            f"stages: a mesh of data={data} x stages={stages} needs {data * stages} devices but there are "
            f"{devices}; use stages in {fits} with data = {devices} // stages"
        )
    return data, stages
