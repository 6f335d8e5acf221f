"""xpipe: GPipe-style pipeline parallelism for PyTorch/XLA.

    split = xpipe.partition(model, stages=4, sample_input=batch, cost="flops")
    pipe = xpipe.Pipe(model, chunks=8, mesh=xpipe.make_mesh(stages=4))
    xpipe.save("run/ckpt", pipe, optimizer, step=step)
    layouts = xpipe.plan(model, devices=256, batch=32, chip="v5e", sample_input=batch)
"""

from xpipe._xla import start_runtime_before_first_backward
from xpipe.capture.graph import module_graph
from xpipe.partition import Partition, partition
from xpipe.planner import plan
from xpipe.tensor.rules import Packed

start_runtime_before_first_backward()

__all__ = ["Packed", "Partition", "Pipe", "load", "make_mesh", "module_graph", "partition", "plan", "save"]


def __getattr__(name: str):
    # Pipe, make_mesh, save and load import torch_xla, which the pure partitioner does not need.
    if name == "Pipe":
        from xpipe.pipe import Pipe

        return Pipe
    if name == "make_mesh":
        from xpipe.mesh import make_mesh

        return make_mesh
    if name in ("save", "load"):
        from xpipe import checkpoints

        return getattr(checkpoints, name)
    raise AttributeError(f"module 'xpipe' has no attribute {name!r}")
