"""How close the plan's peak came to XLA's, per layout kind, on the emulated devices:
the band ``xpipe-plan`` prints beside a layout's bytes.

The ratios are predicted / measured over the cells ``tools/peak_grid.py`` compiles
(a Hugging Face Llama of 8 layers at widths 64 and 128 and GPT-2 at width 128, 8, 64
and 256 tokens a row, 8 emulated devices; docs/planning.md lists every cell). A kind no cell
measured has no band, and says so.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Band:
    """The predicted / measured ratios of one layout kind's cells."""

    low: float
    high: float
    cells: int

    def measured_range(self, predicted: int) -> tuple[float, float]:
        """The bytes XLA would hold where the plan predicts ``predicted``, were this
        layout as far off as the kind's cells were at most, either way."""
        return predicted / self.high, predicted / self.low


# tools/peak_grid.py --measured FILE --bands, on the 108 cells of docs/planning.md (2026-12-06), and
# 1F1B's 36 (the Llama at widths 64 and 128 and GPT-2 at 128, measured 2026-12-07, fsdp x tensor's
# again once each block slot's weights were unbound, not indexed; on the audited LM of
# tests/spmd/test_one_f_one_b.py, outside the grid, "always" was 0.91 and "never" 0.92).
BANDS: dict[str, Band] = {
    "1f1b, always, gather block, no tensor": Band(0.43, 1.35, 9),
    "1f1b, always, gather step, no tensor": Band(1.00, 1.21, 9),
    "1f1b, always, gather step, tensor": Band(0.92, 1.16, 9),
    "1f1b, never, gather step, no tensor": Band(0.89, 1.10, 9),
    "circular, always, gather step, no tensor": Band(0.88, 1.23, 9),
    "circular, except_last, gather step, no tensor": Band(0.94, 1.24, 9),
    "gpipe, always, gather block, no tensor": Band(0.91, 1.35, 9),
    "gpipe, always, gather block, tensor": Band(0.89, 1.42, 9),
    "gpipe, always, gather step, tensor": Band(0.92, 1.25, 9),
    "gpipe, except_last, gather step, no tensor": Band(0.93, 1.30, 36),
    "gpipe, except_last, gather step, tensor, sequence parallel": Band(0.91, 1.32, 9),
    "gpipe, never, gather step, tensor": Band(0.85, 1.23, 9),
    "gpipe, never, gather step, tensor, sequence parallel": Band(0.84, 1.27, 9),
}


def layout_kind(schedule: str, checkpoint: str, gather: str, tensor: int, sequence_parallel: bool) -> str:
    """What sets a layout's memory apart from another's: the schedule, what is
    recomputed, when weights are gathered, and whether "tensor" (and sequence
    parallelism) splits the blocks."""
    split = "no tensor" if tensor == 1 else "tensor, sequence parallel" if sequence_parallel else "tensor"
    return f"{schedule}, {checkpoint}, gather {gather}, {split}"

