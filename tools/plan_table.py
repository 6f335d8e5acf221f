"""The table in docs/planning.md: xpipe's plan for public Llama 3 sizes on a few pods.

    python tools/plan_table.py        # markdown tables, about two minutes

Each row of the first is one ``xpipe.plan`` (the model built on the meta device
from Meta's published config): the fastest layout that fits, its predicted bytes
per device and step time, and the smallest pure-pipeline layout's bytes. The
second is issue 36's reference jobs, planned gathering once per step only and
with gathering per block allowed, for batches of packed sequences (no padding
mask) and with a padding mask. The last line is the deepest model of Llama 3
70B's width (its hidden, MLP, head and vocabulary sizes, fewer layers) that fits
256 v5e chips at 256 x 2048 tokens.
"""

from __future__ import annotations

import argparse
from xpipe.planner import GiB, plan
from xpipe.planner.cli import llama3_config
from xpipe.planner.profile import profile_of_config

CASES = [  # model, chip, chips, batch (sequences), sequence length
    ("llama3-8b", "v5e", 16, 16, 2048),
    ("llama3-8b", "v5e", 64, 64, 4096),
    ("llama3-70b", "v5e", 256, 32, 2048),
    ("llama3-70b", "v5p", 64, 64, 4096),
    ("llama3-70b", "v6e", 256, 64, 4096),
    ("llama3-405b", "v5p", 1024, 256, 4096),
]


REFERENCE_JOBS = [  # model, chip, chips, batch (sequences of 2048), bytes a chip may hold (None: its HBM), slices
    ("llama3-8b", "v5e", 64, 256, None, 1),
    ("llama3-8b", "v5e", 64, 256, 12 * GiB, 1),
    ("llama3-70b", "v5e", 256, 256, None, 1),
    ("llama3-70b", "v5e", 256, 256, 14 * GiB, 1),
    ("llama3-70b", "v5e", 256, 32, None, 1),
    ("llama3-70b", "v5e", 1024, 1024, None, 4),
    ("llama3-405b", "v5p", 1024, 1024, None, 1),
    ("llama3-405b", "v5p", 1024, 1024, 48 * GiB, 1),
]


def verdict(result) -> str:
    """The fastest layout that fits, or the smallest and its two largest parts."""
    if result.fitting:
        best = result.fitting[0]
        return f"{best.layout}: {best.bytes / GiB:.2f} GiB, {best.step_seconds:.2f} s"
    smallest = result.least_memory()
    largest = sorted(smallest.memory, key=smallest.memory.get, reverse=True)[:2]
    parts = ", ".join(f"{kind} {smallest.memory[kind] / GiB:.2f}" for kind in largest)
    return f"none fits (smallest {smallest.bytes / GiB:.2f} GiB: {parts})"


def reference_jobs() -> None:
    """Packed sequences (no padding mask) gathered once per step, then per block too;
    the last column with a padding mask, whose [seq, seq] form travels with each row."""
    print("| job | gathered per step only | per block allowed | the same, with a padding mask |")
    print("| --- | --- | --- | --- |")
    choices = [(("step",), False), (("step", "block"), False), (("step", "block"), True)]
    for name, chip, chips, batch, memory, slices in REFERENCE_JOBS:
        cells = [verdict(plan(llama3_config(name), devices=chips, batch=batch, chip=chip, memory_per_device=memory,
                              gathers=gathers, padding_mask=padded, slices=slices)) for gathers, padded in choices]
        within = "" if memory is None else f", within {memory / GiB:.0f} GiB"
        across = "" if slices == 1 else f" in {slices} slices"
        print(f"| {name}, {chips} x {chip}{across}, {batch} x 2048{within} | {' | '.join(cells)} |")


def deepest_fitting(chips: int = 256, chip: str = "v5e", batch: int = 256) -> None:
    """The most layers a model of Llama 3 70B's width may have and still fit (a search
    by halving between 1 layer and twice 70B's 80)."""
    def config(layers: int):
        wide = llama3_config("llama3-70b")
        wide.num_hidden_layers = layers
        return wide

    def fitting(layers: int):
        return plan(config(layers), devices=chips, batch=batch, chip=chip, gathers=("step", "block")).fitting

    fits, fails = 1, 161  # twice Llama 3 70B's 80 layers, and one: a width's depth is searched up to there
    while fails - fits > 1:
        middle = (fits + fails) // 2
        fits, fails = (middle, fails) if fitting(middle) else (fits, middle)
    best = fitting(fits)[0]
    billions = profile_of_config(config(fits), 2048).parameters / 1e9
    print(f"Deepest of Llama 3 70B's width on {chips} x {chip} at {batch} x 2048: {fits} layers "
          f"({billions:.1f}B parameters), {best.layout}: {best.bytes / GiB:.2f} GiB, {best.step_seconds:.2f} s; "
          f"{fits + 1} layers fit nowhere")


def main() -> None:
    print("| model | chips | batch x seq | layouts that fit | fastest: stage x data x fsdp x tensor, schedule, "
          "chunks, checkpoint, gather | GiB per device | step s (lower bound) | bubble | pure pipeline, smallest |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, chip, chips, batch, seq in CASES:
        result = plan(llama3_config(name), devices=chips, batch=batch, chip=chip, seq=seq)
        pure = result.least_memory(lambda layout: layout.pure_pipeline)
        pure_text = "none runs" if pure is None else f"{pure.bytes / GiB:.1f} GiB ({'fits' if pure.fits else 'no'})"
        if result.fitting:
            best = result.fitting[0]
            layout = best.layout
            described = (f"{layout.stages} x {layout.data} x {layout.fsdp} x {layout.tensor}, {layout.schedule_label}, "
                         f"{layout.chunks}, {layout.checkpoint}, {layout.gather}")
            numbers = f"{best.bytes / GiB:.1f} | {best.step_seconds:.2f} | {best.bubble:.2f}"
        else:
            smallest = result.least_memory()
            described = "none" if smallest is None else f"none (smallest {smallest.bytes / GiB:.1f} GiB)"
            numbers = "- | - | -"
        total = len(result.fitting) + len(result.refused)
        print(f"| {name} | {chips} x {result.chip.name} | {batch} x {seq} | {len(result.fitting)} of {total} | "
              f"{described} | {numbers} | {pure_text} |")


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    main()
    print()
    reference_jobs()
    print()
    deepest_fitting()
