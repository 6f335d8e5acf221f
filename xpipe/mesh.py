"""The device mesh (axes "data", "stage" and, inside the stages, "fsdp" for ZeRO-3
and "tensor" for tensor parallelism), and switching the process into SPMD mode.

    mesh = xpipe.make_mesh(stages=4)                   # on 8 devices: 2 (data) x 4 (stage)
    mesh = xpipe.make_mesh(stages=2, fsdp=4)           # 2 stages, each sharded over 4 devices
    mesh = xpipe.make_mesh(stages=2, fsdp=2, tensor=2)  # and each block split over 2 of them
"""

from __future__ import annotations

import numpy as np
import torch
import torch_xla
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr

from xpipe._checks import check_positive_int
from xpipe._xla import check_can_enter_spmd, warm_autograd
from xpipe.layout import MeshAxes

AXES = ("data", "stage", "fsdp", "tensor")  # the axes a mesh may have; one of size 1 may be left out, but "stage"


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


def make_mesh(stages: int, data: int | None = None, *, fsdp: int = 1, tensor: int = 1,
              slices: int = 1) -> xs.Mesh:
    """A mesh of all XLA devices with axes ``("data", "stage")``, then ``"fsdp"``
    when ``fsdp > 1`` and ``"tensor"`` when ``tensor > 1``.

    Devices are numbered stage-major, "tensor" innermost: device
    ``((s * data + d) * fsdp + f) * tensor + t`` is tensor shard ``t`` of fsdp shard
    ``f`` of position ``d`` on "data" of stage ``s``. A tensor group (which talks after
    every block's split matmuls) is nearest neighbours, the devices of a stage
    are neighbours (on a pod: one host or one slice, where the links are fast),
    and a batch sharded over ("stage", "data", "fsdp") lies on the devices in order.

    "data" replicates each stage's weights; "fsdp" shards them (ZeRO-3: weights,
    gradients and optimizer state), gathered once per step; "tensor" splits each
    block's matrices (:mod:`xpipe.tensor.rules`), so its devices share their rows.

    With ``slices > 1`` (TPU slices joined by the data-center network) the stages
    are spread over the slices, ``stages // slices`` consecutive stages on each:
    only stage neighbours talk across slices (one microbatch slice per clock, the
    least data of any axis), while data, fsdp and tensor groups stay inside one.
    The slice of each device is its runtime attribute ``slice_index``; on TPU the
    devices inside a slice are arranged by torch_xla's ``HybridMesh``.

    Args:
        stages: size of the "stage" axis (pipeline stages).
        data: size of the "data" axis; defaults to ``devices // (stages * fsdp * tensor)``.
        fsdp: size of the "fsdp" axis.
        tensor: size of the "tensor" axis.
        slices: TPU slices the devices span.

    Raises:
        ValueError: if ``stages * data * fsdp * tensor`` is not the device count
            (the message lists the sizes that would fit); if ``slices`` does not
            divide ``stages`` (a stage's fsdp and tensor groups would straddle two
            slices) or is not the number of slices the devices belong to.
    """
    axes = mesh_axes(stages, data, fsdp=fsdp, tensor=tensor)
    slices = check_positive_int(slices, "slices")
    if axes.stage % slices:
        raise ValueError(f"slices: {slices} slices do not divide stages={axes.stage}: a stage would straddle two "
                         "slices, and its fsdp and tensor groups would talk over the data-center network; use a "
                         "stage count that is a multiple of the slices")
    spmd_device()
    sizes = {"data": axes.data, "stage": axes.stage, "fsdp": axes.fsdp, "tensor": axes.tensor}
    names = tuple(name for name in AXES if name in ("data", "stage") or sizes[name] > 1)
    shape = tuple(sizes[name] for name in names)
    if slices > 1 and xr.device_type() == "TPU":
        ici = tuple(size // slices if name == "stage" else size for name, size in zip(names, shape))
        dcn = tuple(slices if name == "stage" else 1 for name in names)
        return xs.HybridMesh(ici_mesh_shape=ici, dcn_mesh_shape=dcn, axis_names=names)
    logical = np.arange(axes.devices).reshape(axes.stage, axes.data, axes.fsdp, axes.tensor).transpose(1, 0, 2, 3)
    return xs.Mesh(_by_slice(slices, axes.devices)[logical].flatten(), shape, names)


def _by_slice(slices: int, devices: int) -> np.ndarray:
    """The devices' ids in slice order (slice 0's, then slice 1's, ...; by id inside a
    slice), so that stage-major numbering puts consecutive stages on one slice.

    Raises:
        ValueError: naming ``slices`` if the devices belong to another number of
            slices, or to slices of unequal sizes.
    """
    if slices == 1:
        return np.arange(devices)
    attributes = xr.global_runtime_device_attributes()
    if not all("slice_index" in device for device in attributes):
        raise ValueError(f"slices: slices={slices} but these devices carry no slice_index (a single slice, or "
                         "the CPU emulation): use slices=1, or run on a multislice TPU deployment")
    members: dict[int, list[int]] = {}
    ordinals = sorted((int(device["name"].rsplit(":", 1)[1]), int(device["slice_index"]))  # name: e.g. "TPU:3"
                      for device in attributes)
    for ordinal, slice_index in ordinals:
        members.setdefault(slice_index, []).append(ordinal)
    sizes = sorted({len(ids) for ids in members.values()})
    if len(members) != slices or len(sizes) != 1:
        raise ValueError(f"slices: slices={slices}, but the devices form {len(members)} slices of "
                         f"{', '.join(map(str, sizes))} devices; give the number of slices the job runs on")
    return np.array([index for key in sorted(members) for index in members[key]])


def mesh_axes(stages: int, data: int | None = None, *, fsdp: int = 1, tensor: int = 1) -> MeshAxes:
    """The axes of a mesh of all XLA devices, checked without entering SPMD mode.

    Raises:
        ValueError: as :func:`make_mesh`.
    """
    devices = xr.global_runtime_device_count()
    stages = check_positive_int(stages, "stages")
    fsdp = check_positive_int(fsdp, "fsdp")
    tensor = check_positive_int(tensor, "tensor")
    inner = fsdp * tensor
    data = devices // (stages * inner) if data is None else check_positive_int(data, "data")
    if data < 1 or data * stages * inner != devices:
        fits = [s for s in range(1, devices + 1) if devices % (s * inner) == 0]
        if not fits:
            raise ValueError(f"fsdp: fsdp={fsdp} x tensor={tensor} does not divide the {devices} devices; use sizes "
                             "whose product divides the device count")
        raise ValueError(
            f"stages: a mesh of stages={stages} x data={data} x fsdp={fsdp} x tensor={tensor} needs "
            f"{stages * data * inner} devices but there are {devices}; with fsdp={fsdp} and tensor={tensor} use "
            f"stages in {fits} and data = {devices} // (stages * fsdp * tensor)")
    return MeshAxes(stages, data, fsdp, tensor)


def axes_of(mesh: xs.Mesh) -> MeshAxes:
    """The axes of ``mesh``, checked to be a mesh the spmd executor runs on.

    Raises:
        ValueError: naming ``mesh`` if it is not a torch_xla Mesh with a "stage"
            axis and otherwise only "data", "fsdp" and "tensor".
    """
    names = tuple(getattr(mesh, "axis_names", None) or ())
    if not isinstance(mesh, xs.Mesh) or "stage" not in names or not set(names) <= set(AXES) \
            or len(set(names)) != len(names):
        raise ValueError(f"mesh: expected a mesh with a 'stage' axis and optionally 'data', 'fsdp' and 'tensor', got "
                         f"{names or mesh!r}; build it with xpipe.make_mesh")
    sizes = dict(zip(names, (int(size) for size in mesh.mesh_shape)))
    return MeshAxes(sizes["stage"], sizes.get("data", 1), sizes.get("fsdp", 1), sizes.get("tensor", 1))
