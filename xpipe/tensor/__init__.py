"""Tensor parallelism's reading of a block: which dim of each block weight the
"tensor" axis splits, Megatron-style.

- :mod:`xpipe.tensor.rules`: the built-in rules on parameter names, the user's
  ``tensor_rules``; :func:`xpipe.tensor.splits.block_splits`, the one answer
  the build and the planner both read.
- :mod:`xpipe.tensor.inference`: the split read from the block's graph where no
  rule names a weight.
- :mod:`xpipe.tensor.packed_projections`, :mod:`xpipe.tensor.joined_projections`:
  projections packed in one weight split part by part; column-parallel linears
  that read one input run as one.
- :mod:`xpipe.tensor.linear_operands`, :mod:`xpipe.tensor.head_folds`: how a
  captured linear's operands are read, and heads folded into the batch unfolded.

Pure torch: no device is touched here.
"""
