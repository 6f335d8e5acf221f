"""The model as xpipe sees it: captured as a graph, and cut for the executors.

- :mod:`xpipe.capture.trace`: the capture (torch.fx, or torch.export for models fx
  cannot trace) and each node's layer.
- :mod:`xpipe.capture.graph`: the module graph (networkx) the partitioner reads.
- :mod:`xpipe.capture.substitutes`, :mod:`xpipe.capture.experts`: operations the
  capture rewrites so that XLA runs them (custom ops, mixture-of-experts layers).
- :mod:`xpipe.capture.stacking`: the capture cut around the repeated body for the
  spmd executor, with :mod:`xpipe.capture.equal_rows` (which side inputs are held
  once) and :mod:`xpipe.capture.batch_rows` (dim 0 is the batch, or refused).

Pure torch: no device is touched here.
"""
