"""The old name of :mod:`xpipe.recompute` (activation recomputation), one letter from
:mod:`xpipe.checkpoints` (saving and loading): kept so that code written against it
still runs, with a warning that names the new module."""

import warnings

from xpipe.recompute import MODES, check_mode, kept_cells, recompute

warnings.warn("xpipe.checkpoint is now xpipe.recompute (activation recomputation); import from there",
              DeprecationWarning, stacklevel=2)

__all__ = ["MODES", "check_mode", "kept_cells", "recompute"]
