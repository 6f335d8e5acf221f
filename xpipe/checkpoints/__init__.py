"""Checkpoints of a training run: ``xpipe.save`` and ``xpipe.load``.

A checkpoint is a directory that loads into any layout (other stage counts, meshes,
the other executor) and into the plain model, written and read shard by shard: no
sharded tensor is put together on a host. Where each part lives:

| module | what it owns |
| --- | --- |
| :mod:`~xpipe.checkpoints.saving` | ``save``: the state gathered by name, written in the background or not |
| :mod:`~xpipe.checkpoints.loading` | ``load``: checked first, read into the model's destinations, put in place last |
| :mod:`~xpipe.checkpoints.state` | ``CheckpointState``, the one interface to an executor, and ``WholeState`` |
| :mod:`~xpipe.checkpoints.pieces` | a tensor as DCP chunks of the shards a host holds; DCP's planners and writer |
| :mod:`~xpipe.checkpoints.shards` | a tensor's shards on this host: read for a save, buffers for a load |
| :mod:`~xpipe.checkpoints.group` | the processes that write one checkpoint (one per host on a pod) |
| :mod:`~xpipe.checkpoints.files` | the directory: manifest, hashes, atomic replacement |
"""

from xpipe.checkpoints.loading import load, load_plain
from xpipe.checkpoints.saving import save

__all__ = ["load", "load_plain", "save"]
