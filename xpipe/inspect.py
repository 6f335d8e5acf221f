"""Communication audit: the collectives in a compiled step, read from XLA's optimized HLO.

XLA writes the program it really runs (after SPMD partitioning) only when asked
before the runtime starts, so the audit is two calls:

    xpipe.inspect.enable_hlo_dump()          # first thing, before any XLA tensor
    ...
    report = xpipe.inspect.audit(lambda: train_step(batch), mesh=pipe.mesh)
    print(report)                              # kind, axes, in loop or not, bytes, groups
    report.count("all-gather", axis="fsdp", in_loop=True), report.peak_bytes
    [(body.trips, body.count("all-reduce", axis="tensor")) for body in report.loops()]   # per clock
    xpipe.inspect.bytes_per_device(pipe.parameters())   # what each device holds

:func:`collectives` parses HLO text on its own, for dumps made any other way.
"""

from __future__ import annotations

import atexit
import glob
import os
import re
import shutil
import tempfile
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

KINDS = ("all-reduce", "all-gather", "all-to-all", "reduce-scatter", "collective-permute",
         "collective-broadcast")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
          "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_OP = re.compile(r"^\s*(?:ROOT )?%?[\w.\-]+ = (?P<type>.+?) (?P<kind>" + "|".join(KINDS) + r")(?:-start)?\(")
_SHAPE = re.compile(r"(\w+)\[([\d,]*)\]")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%?(?P<name>[\w.\-]+) .*\{\s*$")
_WHILE_BODY = re.compile(r"while\(.*body=%?(?P<body>[\w.\-]+)")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CALLED = re.compile(r"(?:calls|to_apply)=%?([\w.\-]+)")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?(?P<name>[\w.\-]+) = (?P<dtype>\w+)\[(?P<dims>[\d,]*)\]")
_ANY_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?[\w.\-]+ = ")
_OPCODE = re.compile(r"[\]\)}] (?P<op>[a-z][a-z\-]*)\(")
_NOT_WORK = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "while", "partition-id",
             "replica-id", "after-all", "opt-barrier"}
_ALLOCATION = re.compile(r"^allocation (\d+): ")
_VALUE = re.compile(r"^ value: <\d+ (\S+)(?: \(phi\))? @\d+> \(size=(\d+),offset=(\d+)\)")
_LIVE_RANGE = re.compile(r"^    (\S+):(\d+)-(\d+)$", re.MULTILINE)
_DOT = re.compile(r" dot\(%?(?P<lhs>[\w.\-]+).*lhs_contracting_dims=\{(?P<contracting>[\d,]*)\}")


@dataclass(frozen=True)
class Collective:
    """One collective instruction of a compiled program."""

    kind: str  # e.g. "all-reduce"
    shapes: tuple[tuple[str, tuple[int, ...]], ...]  # (dtype, dims) of each result
    bytes: int  # bytes of the result, per device
    groups: tuple[tuple[int, ...], ...]  # replica groups, or source-target pairs for permutes
    computation: str  # HLO computation that holds it
    in_loop: bool  # inside a while loop body: runs once per iteration
    axes: tuple[str, ...] = ()  # the mesh axes its groups span (or its pairs move along), when audited with a mesh


@dataclass(frozen=True)
class LoopBody:
    """The collectives of one while loop's body: what runs once per iteration (for the
    pipeline's clock loops, once per clock)."""

    name: str  # the body's HLO computation
    trips: int | None  # the iterations XLA knows the loop runs, when it says
    ops: tuple[Collective, ...]

    def count(self, kind: str, *, axis: str | None = None) -> int:
        """How many ``kind`` instructions the body holds, optionally only those spanning ``axis``."""
        return len(self.of(kind, axis=axis))

    def of(self, kind: str, *, axis: str | None = None) -> list[Collective]:
        _check_kind(kind)
        return [op for op in self.ops if op.kind == kind and (axis is None or axis in op.axes)]

    def bytes_of(self, kind: str, *, axis: str | None = None) -> int:
        """The result bytes per device of the body's ``kind`` instructions: what one iteration moves."""
        return sum(op.bytes for op in self.of(kind, axis=axis))


@dataclass(frozen=True)
class CommunicationReport:
    """Every collective of one compiled program."""

    ops: tuple[Collective, ...]
    program: str  # path of the HLO dump read
    peak_bytes: int | None = None  # the peak XLA's buffer assignment reports (see resident_bytes)
    trips: tuple[tuple[str, int | None], ...] = ()  # each while body of the program, with its known trip count

    @property
    def allocated_bytes(self) -> int | None:
        """What XLA's buffer assignment allocates for the program on one device: its
        parameters, its outputs and the one temporary buffer its heap packs every other value
        into ("Total bytes used"): the memory a device must have for the program. It exceeds
        :attr:`resident_bytes` by the gaps the packing leaves (0.2-6% on the peak grid's
        Llama steps at 64 and 256 tokens, up to 15% at 8), and can exceed :attr:`peak_bytes`
        by far more (a 4-stage Llama step at 64 tokens: 12.09 MB allocated, 11.84 MB resident
        at most, 9.40 MB reported)."""
        match = re.search(r"Total bytes used: (\d+)", _assignment_text(self.program))
        return int(match[1]) if match else None

    @property
    def resident_bytes(self) -> int | None:
        """The most bytes the program's buffers hold at once on one device, by XLA's own
        buffer assignment: every value's live range over its flattened instruction sequence
        (loop-carried values included) and the place its heap gives it (values that share a
        place counted once). The peak XLA reports (:attr:`peak_bytes`) can leave loop-carried
        values out: on a 4-stage Llama step at 64 tokens it reports 9.40 MB, where 11.84 MB of
        values are live at once inside the clock loop, each in a place of its own. None
        without a buffer assignment."""
        return _resident_bytes(_assignment_text(self.program))

    @property
    def matmul_flops(self) -> int:
        """Floating-point operations of the program's matrix products on one device, each
        loop body's counted as often as it runs (:func:`matmul_flops`)."""
        return matmul_flops(Path(self.program).read_text())

    def loops(self) -> list[LoopBody]:
        """The per-iteration view: each while loop body's collectives (a body that holds
        none included), in the order the program lists them."""
        return [LoopBody(name, trips, tuple(op for op in self.ops if op.computation == name))
                for name, trips in self.trips]

    def count(self, kind: str, *, in_loop: bool | None = None, axis: str | None = None) -> int:
        """How many ``kind`` instructions, optionally only those in (or out of) loops,
        or only those whose groups span mesh axis ``axis``."""
        return len(self.of(kind, in_loop=in_loop, axis=axis))

    def of(self, kind: str, *, in_loop: bool | None = None, axis: str | None = None) -> list[Collective]:
        _check_kind(kind)
        return [op for op in self.ops if op.kind == kind and (in_loop is None or op.in_loop == in_loop)
                and (axis is None or axis in op.axes)]

    def __str__(self) -> str:
        lines = [f"{'collective':<20} {'axes':<18} {'where':<6} {'bytes':>10}  groups"]
        for op in self.ops:
            groups = " ".join("{" + ",".join(map(str, g)) + "}" for g in op.groups[:8])
            axes = ",".join(op.axes) or "-"
            lines.append(f"{op.kind:<20} {axes:<18} {'loop' if op.in_loop else 'step':<6} {op.bytes:>10}  {groups}")
        totals = ", ".join(f"{kind} {self.count(kind)}" for kind in KINDS if self.count(kind))
        for body in self.loops():
            counts = Counter((op.kind, ",".join(op.axes) or "-") for op in body.ops)
            each = ", ".join(f"{kind} x{n} over {axes}" for (kind, axes), n in sorted(counts.items()))
            lines.append(f"per iteration of {body.name} ({body.trips or '?'} iterations): {each or 'nothing'}")
        return "\n".join([*lines, f"total: {totals or 'none'}"])


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"kind: {kind!r} is not a collective; use one of {', '.join(KINDS)}")


def enable_hlo_dump(directory: str | os.PathLike | None = None) -> Path:
    """Ask XLA to write every compiled program's optimized HLO to ``directory``.

    Must run before the XLA runtime starts (before the first XLA tensor): XLA reads
    its flags once. Returns the directory: by default a new temporary one, removed
    when the process exits, so that repeated runs leave no dumps behind.

    Raises:
        RuntimeError: if the runtime has already started.
    """
    from xpipe._xla import runtime_started

    if runtime_started():
        raise RuntimeError("enable_hlo_dump: the XLA runtime has already started; call it before the "
                           "first XLA tensor is made (e.g. right after import)")
    if not directory:
        directory = tempfile.mkdtemp(prefix="xpipe-hlo-")
        atexit.register(shutil.rmtree, directory, ignore_errors=True)
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = f"{flags} --xla_dump_to={path} --xla_dump_hlo_as_text"
    os.environ["XPIPE_HLO_DUMP"] = str(path)
    return path


def audit(step: Callable[[], object], mesh: Any = None) -> CommunicationReport:
    """Run ``step`` (which builds a training step's lazy graph), compile and execute it,
    and report the collectives of the largest program it compiled. What ``step``
    returns, and the gradients it leaves, are what gets computed.

    With ``mesh`` (a torch_xla ``Mesh``, e.g. ``pipe.mesh``) each collective names
    the mesh axes its replica groups span (for a collective-permute: the axes its
    pairs move along).

    Raises:
        RuntimeError: without :func:`enable_hlo_dump`, or if ``step`` compiled nothing
            new (it hit the compile cache: audit before the first run of a step).
    """
    import torch_xla

    from xpipe._xla import wait_device_ops

    directory = os.environ.get("XPIPE_HLO_DUMP")
    if not directory:
        raise RuntimeError("audit: call xpipe.inspect.enable_hlo_dump() before the XLA runtime starts")
    pattern = os.path.join(directory, "*after_optimizations.txt")
    before = set(glob.glob(pattern))
    result = step()  # kept alive through the sync, so that its graph is compiled
    torch_xla.sync()
    wait_device_ops()
    new = sorted(set(glob.glob(pattern)) - before, key=os.path.getsize)
    del result
    if not new:
        raise RuntimeError("audit: the step compiled no new program (it was cached); audit a step's first run")
    hlo = Path(new[-1]).read_text()
    ops = collectives(hlo)
    if mesh is not None:
        ops = [replace(op, axes=spanned_axes(op, mesh)) for op in ops]
    return CommunicationReport(tuple(ops), new[-1], _peak_bytes(new[-1]), loop_trips(hlo))


def spanned_axes(op: Collective, mesh: Any) -> tuple[str, ...]:
    """The axes of ``mesh`` along which the devices of ``op``'s groups (or of each of a
    permute's source-target pairs) differ, in the mesh's order."""
    coordinates = {int(device): index for index, device in np.ndenumerate(np.asarray(mesh.get_logical_mesh()))}
    names = tuple(mesh.axis_names)
    varying: set[int] = set()
    for group in op.groups:
        places = np.array([coordinates[device] for device in group if device in coordinates])
        if len(places) > 1:
            varying.update(int(axis) for axis in np.flatnonzero((places != places[0]).any(0)))
    return tuple(names[axis] for axis in sorted(varying))


def bytes_per_device(tensors: Iterable[torch.Tensor]) -> dict[str, int]:
    """The bytes each XLA device holds of ``tensors`` (each counted once), by the
    device's name as torch_xla gives it: under SPMD read from the shards each device
    holds (a replicated tensor counts whole on every device); outside SPMD each
    tensor counts whole on its own device."""
    from xpipe._xla import shard_bytes

    return shard_bytes(list({id(t): t.detach() for t in tensors if t.device.type == "xla"}.values()))


def collectives(hlo: str) -> list[Collective]:
    """Every collective in optimized HLO text, with the computation that holds it."""
    bodies = set(_WHILE_BODY.findall(hlo))
    found = []
    computation = ""
    for line in hlo.splitlines():
        header = _COMPUTATION.match(line)
        if header and " = " not in line.split("{")[0]:
            computation = header["name"]
            continue
        match = _OP.match(line)
        if match:
            shapes = tuple((dtype, tuple(int(d) for d in dims.split(",") if d))
                           for dtype, dims in _SHAPE.findall(match["type"]))
            size = sum(_BYTES.get(dtype, 4) * int(np.prod(dims, dtype=np.int64)) for dtype, dims in shapes)
            found.append(Collective(match["kind"], shapes, size, _groups(line), computation, computation in bodies))
    return found


def loop_trips(hlo: str) -> tuple[tuple[str, int | None], ...]:
    """Each while loop body of optimized HLO text, with the trip count XLA knows for it
    (None where it does not say), in the order the text lists the loops."""
    found: dict[str, int | None] = {}
    for line in hlo.splitlines():
        body = _WHILE_BODY.search(line)
        if body:
            trips = _TRIPS.search(line)
            found.setdefault(body["body"], int(trips[1]) if trips else None)
    return tuple(found.items())


def matmul_flops(hlo: str) -> int:
    """Floating-point operations of the dot instructions of optimized HLO text
    (``2 x`` the result's elements ``x`` the contracted size), each times the runs of
    the computation that holds it: a while body its known trip count times its
    caller's runs, a fusion or a call its caller's. The step's compute up to its
    elementwise work, which matrix products dwarf in a transformer."""
    program = _Program(hlo)
    total = 0
    for where, line in program.instructions:
        dot = _DOT.search(line)
        if dot:
            result = program.shapes[_INSTRUCTION.match(line)["name"]]
            contracted = np.prod([program.shapes[dot["lhs"]][int(i)] for i in dot["contracting"].split(",") if i],
                                 dtype=np.int64)
            total += program.runs.get(where, 0) * int(2 * np.prod(result, dtype=np.int64) * contracted)
    return total


@dataclass(frozen=True)
class Kernels:
    """What one device's program launches in a run (:func:`kernels`)."""

    launches: int  # instructions that run as work of their own, each as often as it runs
    bytes_written: int  # the bytes of their results (tuples not counted), as often


def kernels(hlo: str) -> Kernels:
    """The instructions of optimized HLO text that run as work of their own (a fusion,
    a dot, a copy, a collective, a reduction: not a parameter, tuple, bitcast, constant
    or while, and nothing a fusion, a call or a reduction calls), each times the runs of the
    computation that holds it, as :func:`matmul_flops` counts them. Two programs of the
    same arithmetic can still differ in these: on XLA's CPU runtime each launch costs
    its dispatch, and each byte written its memory traffic."""
    program = _Program(hlo)
    launches = written = 0
    for where, line in program.instructions:
        op = _OPCODE.search(line)
        if where in program.fused or not op or op["op"] in _NOT_WORK:
            continue
        runs = program.runs.get(where, 0)
        launches += runs
        shape = _INSTRUCTION.match(line)
        if shape:
            dims = [int(d) for d in shape["dims"].split(",") if d]
            written += runs * int(np.prod(dims, dtype=np.int64)) * _BYTES.get(shape["dtype"], 4)
    return Kernels(launches, written)


class _Program:
    """Optimized HLO text read for counting: each computation's instructions, how often
    each computation runs (a while body its known trip count times its caller's runs,
    what a fusion, call or reduction calls its caller's), the result shape of each
    array-valued instruction, and the computations that run inside another instruction
    (a fusion's, a call's, a reduction's) rather than as a computation of their own."""

    def __init__(self, hlo: str) -> None:
        self.instructions: list[tuple[str, str]] = []  # (computation, instruction line)
        self.shapes: dict[str, list[int]] = {}
        self.fused: set[str] = set()
        calls: list[tuple[str, str, int]] = []  # (caller, callee, times per call)
        computation, entry = "", ""
        for line in hlo.splitlines():
            header = _COMPUTATION.match(line)
            if header and " = " not in line.split("{")[0]:
                computation = header["name"]
                entry = computation if line.startswith("ENTRY") else entry
                continue
            body = _WHILE_BODY.search(line)
            if body:
                trips = _TRIPS.search(line)
                calls.append((computation, body["body"], int(trips[1]) if trips else 1))
            for callee in _CALLED.findall(line):
                calls.append((computation, callee, 1))
                self.fused.add(callee)
            instruction = _INSTRUCTION.match(line)
            if instruction:
                self.shapes[instruction["name"]] = [int(d) for d in instruction["dims"].split(",") if d]
            if _ANY_INSTRUCTION.match(line):
                self.instructions.append((computation, line))
        self.runs: dict[str, int] = {entry: 1}
        for _ in range(len(calls)):  # callers come in any order in the text: settle, at most once per call
            settled = dict(self.runs)
            for caller, callee, times in calls:
                if caller in settled:
                    self.runs[callee] = max(self.runs.get(callee, 0), settled[caller] * times)
            if settled == self.runs:
                break


def _peak_bytes(program: str) -> int | None:
    """Peak device memory of ``program`` from the buffer assignment XLA dumps beside it."""
    match = re.search(r"Stack trace breakdown for peak usage: ([\d ]+) bytes", _assignment_text(program))
    return int(match[1].replace(" ", "")) if match else None


def _resident_bytes(assignment: str) -> int | None:
    """The most bytes the values of a buffer assignment's text hold at once (see
    :attr:`CommunicationReport.resident_bytes`)."""
    if "BufferLiveRange:" not in assignment:
        return None
    places, allocation = {}, None
    for line in assignment.splitlines():
        if match := _ALLOCATION.match(line):
            allocation = match[1]
        elif match := _VALUE.match(line):
            name = match[1] if "{" in match[1] else match[1] + "{}"  # as the live ranges name it
            places[name] = (allocation, int(match[3]), int(match[2]))
    spans = defaultdict(list)  # per place in the heap: when each of its values is live, and its size
    for name, start, end in _LIVE_RANGE.findall(assignment.split("BufferLiveRange:", 1)[1]):
        if name in places:
            allocation, offset, size = places[name]
            spans[allocation, offset].append((int(start), int(end), size))
    changes = Counter()
    for place in spans.values():
        for start, end, size in _merged(place):
            changes[start] += size
            changes[end + 1] -= size
    held = most = 0
    for position in sorted(changes):
        held += changes[position]
        most = max(most, held)
    return most


def _merged(spans: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Overlapping ``(start, end, size)`` spans of one place as one (a value and the one
    that takes its place in place, or aliases it), of the larger size."""
    merged: list[tuple[int, int, int]] = []
    for start, end, size in sorted(spans):
        if merged and start <= merged[-1][1]:
            first, last, most = merged[-1]
            merged[-1] = (first, max(last, end), max(most, size))
        else:
            merged.append((start, end, size))
    return merged


def _assignment_text(program: str) -> str:
    """The buffer assignment XLA dumps beside ``program``; empty where it dumped none."""
    assignment = Path(program.replace("after_optimizations.txt", "after_optimizations-buffer-assignment.txt"))
    return assignment.read_text() if assignment.exists() else ""


def _groups(line: str) -> tuple[tuple[int, ...], ...]:
    """Replica groups (explicit or iota form) or source-target pairs of one instruction."""
    pairs = re.search(r"source_target_pairs=\{(.*?)\}\}", line)
    if pairs:
        return tuple(tuple(map(int, p.split(","))) for p in re.findall(r"\{(\d+,\d+)", pairs[1] + "}"))
    explicit = re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", line)
    if explicit:
        return tuple(tuple(map(int, g.split(","))) for g in re.findall(r"\{([\d,]+)\}", explicit[1]))
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
    if iota:
        count, size = int(iota[1]), int(iota[2])
        devices = np.arange(np.prod([int(d) for d in iota[3].split(",")])).reshape([int(d) for d in iota[3].split(",")])
        if iota[4]:
            devices = devices.transpose([int(p) for p in iota[4].split(",")])
        return tuple(tuple(int(d) for d in row) for row in devices.reshape(count, size))
    return ()
