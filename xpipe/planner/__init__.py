"""Planning a layout before anything is built: ``xpipe.plan`` and ``xpipe-plan``.

- :mod:`xpipe.planner.search`: the layouts the spmd executor runs, each predicted
  (bytes per device by kind, bubble, communication, step time), best first.
- :mod:`xpipe.planner.profile`: a model (or a Hugging Face config, on the meta
  device) as the planner sees it.
- :mod:`xpipe.planner.timeline`: what a device holds at each moment of a step; a
  layout's predicted memory is its timeline's peak.
- :mod:`xpipe.planner.memory`: the bytes of weights, gradients and optimizer state
  per device on a mesh.
- :mod:`xpipe.planner.cli`: the ``xpipe-plan`` command.
"""

from xpipe.planner.search import GiB, KINDS, PRESETS, Chip, Layout, Plan, Prediction, layouts, plan, predict, preset
from xpipe.planner.timeline import Moment, Timeline

__all__ = ["GiB", "KINDS", "PRESETS", "Chip", "Layout", "Moment", "Plan", "Prediction", "Timeline", "layouts", "plan",
           "predict", "preset"]
