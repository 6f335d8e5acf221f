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

Every row lives in worker processes of its own (SPMD mode is process-global, the
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
import resource
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

STAGES = 4
SCHEDULES_SPMD = ("gpipe", "circular")
SCHEDULES_DEVICES = ("gpipe", "1f1b", "zb-h1", "interleaved", "circular")
VIRTUAL = {"interleaved": 2, "circular": 2}  # model stages per device (pippy: per rank)
SCHEDULES_PIPPY = ("gpipe", "1f1b", "interleaved")
# --smoke keeps the rows the peer ratios need: every engine runs, each schedule's own
# equivalence is the test suite's business, not the benchmark's.
SMOKE_SCHEDULES = {"xpipe-spmd": ("gpipe",), "xpipe-devices": ("1f1b",), "pippy": ("1f1b",)}
BASELINE_OF = {"xpipe-spmd": "spmd-dp", "xpipe-devices": "xla", "pippy": "eager", "torchgpipe": "eager"}
DEVICES_OF = {"xpipe-spmd": 8, "spmd-dp": 8, "xpipe-devices": STAGES, "xla": 1}
LOSS_RTOL = 1e-3  # XLA's CPU kernels and eager PyTorch's round differently; N steps of SGD amplify it


@dataclass(frozen=True)
class Row:
    """One configuration to measure."""

    engine: str  # xpipe-spmd, xpipe-devices, pippy, torchgpipe, eager, xla, spmd-dp
    schedule: str  # gpipe, 1f1b, zb-h1, interleaved, circular; "-" for the unpipelined rows
    model: str  # lm or cnn
    chunks: int
    size: str  # full or smoke

    @property
    def name(self) -> str:
        engine = {"pippy": "torch.distributed.pipelining", "eager": "unpipelined eager CPU",
                  "xla": "unpipelined 1 XLA device", "spmd-dp": "unpipelined SPMD data-parallel x8"}.get(
            self.engine, self.engine)
        return engine if self.schedule == "-" else f"{engine} {self.schedule}"


@dataclass
class Result:
    row: Row
    first_step: float = 0.0
    steps: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    report: dict = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------
# Models and batches: built the same way in every worker (seeded), on the CPU.


def build_model(row: Row):
    """The model (untied weights, seeded) and, for the engines that split by layer, its layers in order."""
    from torch import nn

    from xpipe.models import resnet_like, transformer_lm

    if row.model == "lm":
        width, seq = (256, 128) if row.size == "full" else (32, 16)
        model = transformer_lm(blocks=8, width=width, heads=4, seq=seq, vocab=256, tie_weights=False)
        layers = [model.embed, *model.blocks, model.norm, model.head]
    else:
        model = resnet_like((16, 32, 64, 128) if row.size == "full" else (8, 8, 16, 16))
        layers = list(model)
    return model, nn.Sequential(*layers)


def batch(row: Row):
    """Two rows per microbatch: ``(inputs, targets)``."""
    import torch

    generator = torch.Generator().manual_seed(2)
    rows = 2 * row.chunks
    if row.model == "lm":
        seq = 128 if row.size == "full" else 16
        tokens = torch.randint(0, 256, (rows, seq + 1), generator=generator)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    side = 32 if row.size == "full" else 16
    return torch.randn(rows, 3, side, side, generator=generator), torch.randint(0, 10, (rows,), generator=generator)


def loss_fn(output, target):
    import torch.nn.functional as F

    return F.cross_entropy(output.flatten(0, -2), target.flatten())


def balance(row: Row, parts: int) -> list[int]:
    """xpipe's partition of the model into ``parts`` (by parameters), used by every engine."""
    import xpipe

    model, _ = build_model(row)
    return list(xpipe.partition(model, parts).balance)


# ---------------------------------------------------------------------------------------------
# Workers: build the row's step, then answer the controller's commands.


def worker(row: Row) -> None:
    """Serve one row (or one rank of it): ``step`` (one training step; replies its loss,
    or None on a rank without the loss), ``report`` (its counters), ``quit``."""
    if row.engine in ("xpipe-spmd", "spmd-dp"):
        import xpipe.inspect

        xpipe.inspect.enable_hlo_dump()  # before the XLA runtime starts
    step, report = make_step(row)
    reply({"ready": True})
    audited: dict = {}
    for command in sys.stdin:
        command = command.strip()
        if command == "step":
            if row.engine == "xpipe-spmd" and not audited:
                audited = audit(step)  # the first step, which compiles the program audited
                loss = audited.pop("loss")
            else:
                loss = step()
            reply({"loss": loss})
        elif command == "report":
            reply({**report(), **audited})
        else:
            break


REPLY = "xpipe-bench-reply "  # marks the worker's answers among whatever else it prints


def reply(message: dict) -> None:
    sys.stdout.write(REPLY + json.dumps(message) + "\n")
    sys.stdout.flush()


def audit(step) -> dict:
    """Run ``step`` (a first, compiling one) under xpipe.inspect.audit: its loss and the
    collectives of the program it compiled, counted per kind."""
    import xpipe.inspect

    outcome = {}
    report = xpipe.inspect.audit(lambda: outcome.setdefault("loss", step()))
    kinds = ("collective-permute", "all-reduce", "all-gather", "all-to-all", "reduce-scatter")
    return {**outcome, "collectives": {kind: report.count(kind) for kind in kinds if report.count(kind)}}


def make_step(row: Row):
    """``(step, report)``: one training step returning its loss, and the row's counters."""
    if row.engine == "pippy":
        return pippy_step(row)
    import torch

    model, layers = build_model(row)
    inputs, targets = batch(row)
    if row.engine in ("eager", "torchgpipe"):
        if row.engine == "torchgpipe":
            from torchgpipe import GPipe

            model = GPipe(layers, balance=balance(row, STAGES), devices=["cpu"] * STAGES, chunks=row.chunks,
                          checkpoint="never")
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

        def eager_step() -> float:
            loss = loss_fn(model(inputs), targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            return loss.item()

        return eager_step, host_report
    return xla_step(row, model, inputs, targets)


def xla_step(row: Row, model, inputs, targets):
    import torch
    import torch_xla
    import torch_xla.debug.metrics as metrics

    import xpipe

    if row.engine == "xpipe-spmd":
        pipe = xpipe.Pipe(model, chunks=row.chunks, mesh=xpipe.make_mesh(STAGES, 2), loss_fn=loss_fn,
                          checkpoint="never", schedule=row.schedule, virtual=VIRTUAL.get(row.schedule, 1))
    elif row.engine == "xpipe-devices":
        pipe = xpipe.Pipe(model, chunks=row.chunks, stages=STAGES, executor="devices", schedule=row.schedule,
                          virtual=VIRTUAL.get(row.schedule, 1), loss_fn=loss_fn, checkpoint="never")
    else:
        pipe = None
    if pipe is not None:
        optimizer = torch.optim.SGD(pipe.parameters(), lr=0.01)

        def run() -> torch.Tensor:
            return pipe.step(inputs, targets)
    else:
        if row.engine == "spmd-dp":
            import torch_xla.runtime as xr

            xr.use_spmd()
        device = torch_xla.device()
        model.to(device)
        placed_inputs, placed_targets = inputs.to(device), targets.to(device)
        if row.engine == "spmd-dp":
            mark_data_parallel(model, placed_inputs, placed_targets)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

        def run() -> torch.Tensor:
            loss = loss_fn(model(placed_inputs), placed_targets)
            loss.backward()
            return loss

    def step() -> float:
        loss = run()
        optimizer.step()
        optimizer.zero_grad()
        torch_xla.sync()
        return loss.item()

    def report() -> dict:
        return {**host_report(), "compiles": metrics.metric_data("CompileTime")[0],
                "device_peak_mb": device_peak_mb(pipe.devices if pipe is not None else [torch_xla.device()])}

    return step, report


def mark_data_parallel(model, inputs, targets) -> None:
    """The unpipelined model data-parallel over all 8 devices: weights replicated, the batch sharded."""
    import numpy as np
    import torch_xla.distributed.spmd as xs

    mesh = xs.Mesh(np.arange(8), (8,), ("data",))
    for tensor in model.parameters():
        xs.mark_sharding(tensor, mesh, (None,) * tensor.dim())
    for tensor in (inputs, targets):
        xs.mark_sharding(tensor, mesh, ("data",) + (None,) * (tensor.dim() - 1))


def device_peak_mb(devices) -> float | None:
    """The largest peak memory XLA reports over ``devices``; None where it reports none (CPU)."""
    import torch_xla.core.xla_model as xm

    peaks = []
    for device in devices:
        try:
            info = xm.get_memory_info(device)
        except (RuntimeError, NotImplementedError):
            return None
        peak = info.get("peak_bytes_used") or info.get("bytes_used")
        if peak is None:
            return None
        peaks.append(peak / 2**20)
    return max(peaks)


def host_report() -> dict:
    return {"rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def pippy_step(row: Row):
    """torch.distributed.pipelining, this process's rank of it; every rank gets the
    controller's commands, and the last one reports the loss."""
    import atexit

    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    from torch.distributed.pipelining.stage import _PipelineStageBase

    # PyTorch 2.9 warms up each stage's links by sending an int64 and receiving a float32;
    # gloo requires matching sizes and aborts the process. gloo needs no warm-up.
    _PipelineStageBase._get_init_p2p_neighbors_ops = lambda self: []
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=os.environ["XPIPE_BENCH_INIT"])
    atexit.register(dist.destroy_process_group)
    _, layers = build_model(row)
    inputs, targets = batch(row)
    virtual = VIRTUAL.get(row.schedule, 1)
    parts = split(layers, balance(row, world * virtual))
    mine = [rank + world * v for v in range(virtual)]
    stages = [PipelineStage(parts[index], index, world * virtual, torch.device("cpu")) for index in mine]
    kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B}[row.schedule]
    schedule = kind(stages if virtual > 1 else stages[0], n_microbatches=row.chunks, loss_fn=loss_fn)
    optimizer = torch.optim.SGD([p for index in mine for p in parts[index].parameters()], lr=0.01)

    def step() -> float | None:
        losses: list[torch.Tensor] = []
        if rank == 0:
            schedule.step(inputs)
        elif rank == world - 1:
            schedule.step(target=targets, losses=losses)
        else:
            schedule.step()
        optimizer.step()
        optimizer.zero_grad()
        return torch.stack(losses).mean().item() if losses else None

    return step, host_report


def split(layers, balance: list[int]) -> list:
    """``layers`` (an ``nn.Sequential``) cut into consecutive pieces of ``balance`` layers."""
    from torch import nn

    pieces, start = [], 0
    for count in balance:
        pieces.append(nn.Sequential(*list(layers)[start:start + count]))
        start += count
    return pieces


# ---------------------------------------------------------------------------------------------
# The controller: start every row's workers, step them in turn, write the table and chart.


class Worker:
    """A row's process, or its processes (one per rank, for torch.distributed.pipelining)."""

    def __init__(self, row: Row, log: Path) -> None:
        self.row = row
        environment = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(DEVICES_OF.get(row.engine, 1)))
        command = [sys.executable, __file__, "--worker", json.dumps(asdict(row))]
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
    lines = ["| model | chunks | xpipe row | peer row | xpipe overhead / peer overhead |", "| --- | --- | --- | --- | --- |"]
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
    parser.add_argument("--only", nargs="+", metavar="ENGINE", help="these engines only (with their baselines and eager, the loss reference), "
                        "e.g. xpipe-spmd xpipe-devices pippy torchgpipe xla spmd-dp")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.worker:
        worker(Row(**json.loads(options.worker)))
        return
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
