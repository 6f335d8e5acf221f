"""xpipe next to the pipelines users would pick instead, in one run: one table, one chart.

    python tools/bench.py --quick      # the transformer LM, chunks 8          (under 10 minutes)
    python tools/bench.py --full       # the LM and the ResNet-style CNN, chunks 8 and 32
    python tools/bench.py --smoke      # a tiny LM, one schedule per engine, one step (what the test runs)

Rows, on S = 4 pipeline stages, for each model and chunk count:

- xpipe spmd: one SPMD program on 8 emulated XLA devices (2 data x 4 stages), GPipe
  and circular (2 rounds of the ring) (the LM only: the CNN has no run of identical
  blocks to stack);
- xpipe devices: one stage per emulated XLA device (4), every schedule it runs;
- torch.distributed.pipelining: GPipe, 1F1B and interleaved 1F1B (2 stages per
  rank), 4 processes on gloo, eager CPU;
- torchgpipe 0.0.7 with ``devices=['cpu'] * 4``, eager CPU;
- the unpipelined model: eager CPU, one XLA device, and data-parallel under SPMD
  on the same 8 devices.

Every row lives in worker processes of its own (`tools/bench_worker.py`; SPMD mode is process-global, the
emulated device count is fixed at start, torch.distributed wants a process per
rank). A backend's rows and their unpipelined baseline are started together;
the controller then asks each for one step in turn, A B C A B C ..., so that
drift of this machine hits a row and its baseline alike. The
same model (untied weights, so that every engine can split it), the same batch
every step and SGD; a row's loss after N steps is compared with the eager
unpipelined row's. Overhead is a row's median step time over the unpipelined
step time on its own backend (eager CPU for torch.distributed.pipelining and
torchgpipe, one XLA device for xpipe devices, SPMD data-parallel for xpipe spmd).

Step times are taken by the controller, from sending ``step`` to the last answer
(each worker answers once its step is done and its loss read back).

Writes ``bench.json``, ``bench.md`` (the table) and ``bench.png`` (overhead and
first-step time per row) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench_worker import (BASELINE_OF, DEVICES_OF, LOSS_RTOL, REPLY, SCHEDULES_DEVICES, SCHEDULES_PIPPY,
                         SCHEDULES_SPMD, SMOKE_SCHEDULES, STAGES, Row)


@dataclass
class Result:
    row: Row
    first_step: float = 0.0
    steps: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    report: dict = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------
# The controller: start every row's workers, step them in turn, write the table and chart.


class Worker:
    """A row's process, or its processes (one per rank, for torch.distributed.pipelining)."""

    def __init__(self, row: Row, log: Path) -> None:
        self.row = row
        environment = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(DEVICES_OF.get(row.engine, 1)))
        command = [sys.executable, str(Path(__file__).with_name("bench_worker.py")), json.dumps(asdict(row))]
        ranks = [{}]
        if row.engine == "pippy":
            environment.update(WORLD_SIZE=str(STAGES), XPIPE_BENCH_INIT=f"tcp://127.0.0.1:{free_port()}")
            ranks = [{"RANK": str(rank)} for rank in range(STAGES)]
        self.processes = [subprocess.Popen(command, env={**environment, **rank}, stdin=subprocess.PIPE,
                                           stdout=subprocess.PIPE, stderr=log.open("a"), text=True)
                          for rank in ranks]

    def wait_ready(self) -> None:
        """Return once every process has built its model and step."""
        for process in self.processes:
            self._answer(process)

    def ask(self, command: str) -> tuple[dict, float]:
        """Send ``command`` to every process; their answers merged (a loss from the rank
        that has it, memory summed), and the seconds until the last one answered."""
        start = time.perf_counter()
        for process in self.processes:
            process.stdin.write(command + "\n")
            process.stdin.flush()
        answers = [self._answer(process) for process in self.processes]
        seconds = time.perf_counter() - start
        merged = {key: value for answer in answers for key, value in answer.items() if value is not None}
        if "rss_mb" in merged:
            merged["rss_mb"] = sum(answer["rss_mb"] for answer in answers)
        return merged, seconds

    def _answer(self, process: subprocess.Popen) -> dict:
        for line in process.stdout:
            if line.startswith(REPLY):
                return json.loads(line[len(REPLY):])
        raise RuntimeError(f"{self.row.name} ({self.row.model}, chunks {self.row.chunks}) stopped; see the log")

    def close(self) -> None:
        for process in self.processes:
            try:
                process.stdin.write("quit\n")
                process.stdin.close()
            except BrokenPipeError:  # it stopped already
                pass
        for process in self.processes:
            try:
                process.wait(timeout=120)
            except subprocess.TimeoutExpired:
                process.kill()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def rows_for(models: list[str], chunk_counts: list[int], size: str) -> list[Row]:
    rows = []
    for model in models:
        for chunks in chunk_counts:
            if model == "lm":  # the CNN has no run of identical blocks to stack
                rows += [Row("xpipe-spmd", schedule, model, chunks, size) for schedule in SCHEDULES_SPMD]
            rows += [Row("xpipe-devices", schedule, model, chunks, size) for schedule in SCHEDULES_DEVICES]
            rows += [Row("pippy", schedule, model, chunks, size) for schedule in SCHEDULES_PIPPY]
            rows += [Row("torchgpipe", "gpipe", model, chunks, size)]
            rows += [Row(engine, "-", model, chunks, size) for engine in ("eager", "xla", "spmd-dp")]
    if size == "smoke":
        rows = [row for row in rows if row.schedule in SMOKE_SCHEDULES.get(row.engine, (row.schedule,))]
    return rows


def measure(rows: list[Row], steps: int, log: Path) -> list[Result]:
    """Start a group's workers together, then step them in turn; the first step (trace and
    compile) is timed apart. A group is a backend's rows with their unpipelined baseline,
    for one model and chunk count: each overhead is measured within one group, and at
    most one group's processes hold memory at a time (all rows at once ran a 23 GiB
    machine out of memory with the LM at 32 chunks)."""
    results = []
    groups: dict[tuple, list[Row]] = {}
    for row in rows:
        groups.setdefault((row.model, row.chunks, BASELINE_OF.get(row.engine, row.engine)), []).append(row)
    for group in groups.values():
        workers = [Worker(row, log) for row in group]
        group_results = [Result(row) for row in group]
        try:
            for worker_ in workers:  # no row's first step shares the machine with another's start-up
                worker_.wait_ready()
            for round_index in range(steps + 1):
                for worker_, result in zip(workers, group_results):
                    answer, seconds = worker_.ask("step")
                    if round_index == 0:
                        result.first_step = seconds
                    else:
                        result.steps.append(seconds)
                    result.losses.append(answer["loss"])
                    print(f"  {worker_.row.model} chunks {worker_.row.chunks}: {worker_.row.name:48s} "
                          f"step {round_index}: {seconds:.3f} s", flush=True)
            for worker_, result in zip(workers, group_results):
                result.report = worker_.ask("report")[0]
        finally:
            for worker_ in workers:
                worker_.close()
        results += group_results
    return results


def summarise(results: list[Result]) -> list[dict]:
    """One table row per result: times, overhead against its backend's unpipelined row, loss check."""
    by_key = {(r.row.engine, r.row.model, r.row.chunks): r for r in results}
    table = []
    for result in results:
        row = result.row
        median = statistics.median(result.steps)
        baseline = by_key.get((BASELINE_OF.get(row.engine, row.engine), row.model, row.chunks))
        eager = by_key[("eager", row.model, row.chunks)]
        difference = max(abs(a - b) / abs(b) for a, b in zip(result.losses, eager.losses))
        table.append({
            "model": row.model, "chunks": row.chunks, "row": row.name, "engine": row.engine,
            "schedule": row.schedule, "median_s": median,
            "spread_s": [min(result.steps), max(result.steps)], "steps": len(result.steps),
            "samples_per_s": 2 * row.chunks / median,
            "overhead": median / statistics.median(baseline.steps) if baseline else None,
            "baseline": baseline.row.name if baseline else None,
            "first_step_s": result.first_step, "compiles": result.report.get("compiles"),
            "rss_mb": result.report.get("rss_mb"), "device_peak_mb": result.report.get("device_peak_mb"),
            "collectives": result.report.get("collectives"),
            "loss_rel_diff": difference, "loss_matches": difference <= LOSS_RTOL,
        })
    return table


def markdown(table: list[dict]) -> str:
    lines = ["| model | chunks | row | median step (s) | spread (s) | samples/s | overhead | first step (s) | "
             "compiles | peak RSS (MiB) | collectives in the step | loss = eager's |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for t in table:
        overhead = f"{t['overhead']:.2f}" if t["overhead"] is not None else "-"
        collectives = ", ".join(f"{kind} {count}" for kind, count in (t["collectives"] or {}).items()) or "-"
        lines.append(
            f"| {t['model']} | {t['chunks']} | {t['row']} | {t['median_s']:.3f} | {t['spread_s'][0]:.3f}-"
            f"{t['spread_s'][1]:.3f} | {t['samples_per_s']:.1f} | {overhead} | {t['first_step_s']:.1f} | "
            f"{t['compiles'] if t['compiles'] is not None else '-'} | {t['rss_mb']:.0f} | {collectives} | "
            f"{'yes' if t['loss_matches'] else 'no'} ({t['loss_rel_diff']:.1e}) |")
    return "\n".join(lines) + "\n"


def ratios(table: list[dict]) -> list[dict]:
    """xpipe's overhead over each peer's, where both run the same schedule (model, chunks)."""
    found = []
    for ours in (t for t in table if t["engine"].startswith("xpipe")):
        for peer in (t for t in table if t["engine"] in ("pippy", "torchgpipe")):
            if (peer["model"], peer["chunks"], peer["schedule"]) == (ours["model"], ours["chunks"], ours["schedule"]):
                found.append({"model": ours["model"], "chunks": ours["chunks"], "xpipe": ours["row"],
                              "peer": peer["row"], "ratio": ours["overhead"] / peer["overhead"]})
    return found


def ratio_markdown(found: list[dict]) -> str:
    lines = ["| model | chunks | xpipe row | peer row | xpipe overhead / peer overhead |",
             "| --- | --- | --- | --- | --- |"]
    lines += [f"| {r['model']} | {r['chunks']} | {r['xpipe']} | {r['peer']} | {r['ratio']:.2f} |" for r in found]
    return "\n".join(lines) + "\n"


def chart(table: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{t['model']} c{t['chunks']} {t['row']}" for t in table]
    figure, (left, right) = plt.subplots(1, 2, figsize=(14, 0.28 * len(table) + 1.5), sharey=True)
    positions = range(len(table))
    left.barh(positions, [t["overhead"] or 0 for t in table], color="tab:blue")
    left.axvline(1.0, color="black", linewidth=0.8)
    left.set_xlabel("step time / its backend's unpipelined step time")
    right.barh(positions, [t["first_step_s"] for t in table], color="tab:orange")
    right.set_xlabel("first step (trace + compile + run), s")
    left.set_yticks(list(positions), labels, fontsize=7)
    left.invert_yaxis()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description="xpipe next to torch.distributed.pipelining and torchgpipe")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="the LM, chunks 8, 5 steps (default)")
    size.add_argument("--full", action="store_true", help="the LM and the CNN, chunks 8 and 32, 7 steps")
    size.add_argument("--smoke", action="store_true", help="a tiny LM, chunks 4, one schedule per engine, one step")
    parser.add_argument("--out", type=Path, default=Path("bench-out"))
    parser.add_argument("--only", nargs="+", metavar="ENGINE",
                        help="these engines only (with their baselines and eager, the loss reference), "
                        "e.g. xpipe-spmd xpipe-devices pippy torchgpipe xla spmd-dp")
    options = parser.parse_args()
    if options.full:
        rows, steps = rows_for(["lm", "cnn"], [8, 32], "full"), 7
    elif options.smoke:
        rows, steps = rows_for(["lm"], [4], "smoke"), 1
    else:
        rows, steps = rows_for(["lm"], [8], "full"), 5
    if options.only:
        kept = {*options.only, "eager", *(BASELINE_OF.get(engine, engine) for engine in options.only)}
        rows = [row for row in rows if row.engine in kept]
    options.out.mkdir(parents=True, exist_ok=True)
    log = options.out / "workers.log"
    log.write_text("")
    started = time.perf_counter()
    table = summarise(measure(rows, steps, log))
    machine = {"cpus": os.cpu_count(), "python": sys.version.split()[0], "seconds": time.perf_counter() - started}
    found = ratios(table)
    (options.out / "bench.json").write_text(json.dumps({"machine": machine, "rows": table, "ratios": found}, indent=1))
    (options.out / "bench.md").write_text(markdown(table) + "\n" + ratio_markdown(found))
    chart(table, options.out / "bench.png")
    print(markdown(table))
    print(ratio_markdown(found))
    print(f"{len(table)} rows in {machine['seconds']:.0f} s; written to {options.out}/")


if __name__ == "__main__":
    main()
