"""xpipe: GPipe-style pipeline parallelism for PyTorch/XLA.

    plan = xpipe.partition(model, stages=4, sample_input=batch, cost="flops")
    print(plan)
"""

from xpipe.graph import module_graph
from xpipe.partition import Partition, partition

__all__ = ["Partition", "module_graph", "partition"]
