"""Per-file and slowest per-test durations of a test run, for docs/testing.md.

Runs pytest (arguments after ``--`` go to it, e.g. ``-- --tier=all``) with
``XPIPE_DURATIONS`` set, so that every pytest process, own-process workers
included, records its tests' seconds (tests/tiers.py); then prints, as
Markdown, each tier's total, the seconds per test file and the slowest tests.
``--from FOLDER`` reports a folder of records from an earlier run instead;
``--write-durations`` also keeps each item's seconds, by tier, in
``tests/durations.json``, from which ``tests/worker_order.py`` deals the items to
pytest-xdist's workers (run it after adding or moving long tests).

    .venv/bin/python tools/test_durations.py -- --tier=quick
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_pytest(folder: Path, pytest_args: list[str]) -> int:
    """Run the suite with durations recorded into ``folder``; pytest's exit code."""
    environment = dict(os.environ, XPIPE_DURATIONS=str(folder))
    return subprocess.run([sys.executable, "-m", "pytest", *pytest_args], cwd=ROOT, env=environment).returncode


def read_records(folder: Path) -> tuple[list[dict], list[dict]]:
    """The main processes' records and the own-process workers' records."""
    records = [json.loads(path.read_text()) for path in sorted(folder.glob("*.json"))]
    return [r for r in records if not r["worker"]], [r for r in records if r["worker"]]


def test_seconds(mains: list[dict], workers: list[dict]) -> dict[str, float]:
    """Seconds per test: the workers' own tests in place of the main process's item
    that ran their file (which counts the worker's start-up too)."""
    seconds: dict[str, float] = {}
    for record in workers:
        for test in record["tests"]:
            seconds[test["nodeid"]] = test["seconds"]
    worker_files = {nodeid.split("::")[0] for nodeid in seconds}
    for record in mains:
        for test in record["tests"]:
            file = test["nodeid"].split("::")[0]
            if file not in worker_files:
                seconds[test["nodeid"]] = test["seconds"]
            else:
                worker_tests = sum(s for n, s in seconds.items() if n.split("::")[0] == file)
                seconds[f"{file}::(process start-up and collection)"] = max(0.0, test["seconds"] - worker_tests)
    return seconds


def per_file(seconds: dict[str, float]) -> dict[str, float]:
    totals: dict[str, float] = defaultdict(float)
    for nodeid, value in seconds.items():
        totals[nodeid.split("::")[0]] += value
    return dict(totals)


def report(folder: Path, slowest: int) -> str:
    """The Markdown report of the records in ``folder``."""
    mains, workers = read_records(folder)
    if not mains:
        raise SystemExit(f"--from: no record of a main pytest process in {folder}")
    seconds = test_seconds(mains, workers)
    lines = []
    for record in mains:
        minutes, rest = divmod(round(record["total_s"]), 60)
        lines.append(f"- {record['tier']} tier: {len(record['tests'])} items, {minutes} min {rest} s of pytest")
    lines += ["", "| file | seconds |", "|---|---:|"]
    lines += [f"| {file} | {value:.0f} |" for file, value in sorted(per_file(seconds).items(), key=lambda kv: -kv[1])]
    lines += ["", f"The {slowest} slowest tests:", "", "| test | seconds |", "|---|---:|"]
    ranked = sorted(((n, s) for n, s in seconds.items() if "(process start-up" not in n), key=lambda kv: -kv[1])
    lines += [f"| {nodeid} | {value:.1f} |" for nodeid, value in ranked[:slowest]]
    return "\n".join(lines)


def write_durations(folder: Path, path: Path = ROOT / "tests" / "durations.json") -> None:
    """Keep each item the main process ran (an own-process file is one item), by tier,
    in ``path``: the seconds ``tests/worker_order.py`` orders a run's items by."""
    mains, _ = read_records(folder)
    kept = json.loads(path.read_text()) if path.exists() else {}
    for record in mains:
        if record["tier"] == "all":  # an own-process file is one item in each tier, of other seconds
            raise SystemExit("--write-durations: run one tier at a time (--tier=quick, then --tier=full)")
        kept[record["tier"]] = {test["nodeid"]: round(test["seconds"], 1) for test in record["tests"]}
    path.write_text(json.dumps(kept, indent=1, sort_keys=True) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--from", dest="folder", type=Path, help="report the records in FOLDER; run nothing")
    parser.add_argument("--slowest", type=int, default=10, help="how many of the slowest tests to list (10)")
    parser.add_argument("--keep", type=Path, help="record into KEEP (kept) instead of a temporary folder")
    parser.add_argument("--write-durations", action="store_true",
                        help="keep each item's seconds in tests/durations.json, for tests/worker_order.py")
    arguments, pytest_args = parser.parse_known_args(argv)
    pytest_args = [a for a in pytest_args if a != "--"]
    with tempfile.TemporaryDirectory() as temporary:
        folder = arguments.folder or arguments.keep or Path(temporary)
        code = 0 if arguments.folder else run_pytest(folder, pytest_args)
        print(report(folder, arguments.slowest))
        if arguments.write_durations:
            write_durations(folder)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
