"""``tools/bench.py`` cannot rot: its smallest configuration runs one step of every
engine (one schedule each), and every engine's loss equals the unpipelined eager model's."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parents[1] / "tools" / "bench.py"


@pytest.mark.full  # 88 s: a tool's health, not the library's; every engine's exactness has quick tests of its own
def test_the_benchmark_runs_every_row_and_every_engine_computes_the_same_loss(tmp_path):
    subprocess.run([sys.executable, str(BENCH), "--smoke", "--out", str(tmp_path)], check=True, timeout=1200,
                   capture_output=True)
    rows = json.loads((tmp_path / "bench.json").read_text())["rows"]
    engines = {(row["engine"], row["schedule"]) for row in rows}
    assert engines == {("torchgpipe", "gpipe"), ("eager", "-"), ("xla", "-"), ("spmd-dp", "-"),
                       ("xpipe-spmd", "gpipe"), ("xpipe-devices", "1f1b"), ("pippy", "1f1b")}
    for row in rows:
        assert row["median_s"] > 0 and row["first_step_s"] > 0 and row["overhead"] > 0, row
        assert row["loss_matches"], row
    for spmd in (row for row in rows if row["engine"] == "xpipe-spmd"):
        assert spmd["collectives"]["collective-permute"] == 4 and "all-gather" not in spmd["collectives"], spmd
    ratios = json.loads((tmp_path / "bench.json").read_text())["ratios"]
    assert {(r["xpipe"], r["peer"]) for r in ratios} >= {("xpipe-devices 1f1b", "torch.distributed.pipelining 1f1b"),
                                                         ("xpipe-spmd gpipe", "torchgpipe gpipe")}
    assert all(r["ratio"] > 0 for r in ratios)
    assert (tmp_path / "bench.md").read_text().count("\n") == len(rows) + 2 + 1 + len(ratios) + 2
    assert (tmp_path / "bench.png").stat().st_size > 0
