"""The table in docs/planning.md: xpipe's plan for public Llama 3 sizes on a few pods.

    python tools/plan_table.py        # a markdown table, about a minute

Each row is one ``xpipe.plan`` (the model built on the meta device from Meta's
published config): the fastest layout that fits, its predicted bytes per device
and step time, and the smallest pure-pipeline layout's bytes.
"""

from __future__ import annotations

import argparse
from xpipe.plan_cli import llama3_config
from xpipe.planner import GiB, plan

CASES = [  # model, chip, chips, batch (sequences), sequence length
    ("llama3-8b", "v5e", 16, 16, 2048),
    ("llama3-8b", "v5e", 64, 64, 4096),
    ("llama3-70b", "v5e", 256, 32, 2048),
    ("llama3-70b", "v5p", 64, 64, 4096),
    ("llama3-70b", "v6e", 256, 64, 4096),
    ("llama3-405b", "v5p", 1024, 256, 4096),
]


def main() -> None:
    print("| model | chips | batch x seq | layouts that fit | fastest: stage x data x fsdp x tensor, schedule, "
          "chunks, checkpoint | GiB per device | step s (lower bound) | bubble | pure pipeline, smallest |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, chip, chips, batch, seq in CASES:
        result = plan(llama3_config(name), devices=chips, batch=batch, chip=chip, seq=seq)
        pure = result.least_memory(lambda layout: layout.pure_pipeline)
        pure_text = "none runs" if pure is None else f"{pure.bytes / GiB:.1f} GiB ({'fits' if pure.fits else 'no'})"
        if result.fitting:
            best = result.fitting[0]
            layout = best.layout
            described = (f"{layout.stages} x {layout.data} x {layout.fsdp} x {layout.tensor}, {layout.schedule_label}, "
                         f"{layout.chunks}, {layout.checkpoint}")
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
