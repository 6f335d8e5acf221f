"""The visualiser: every format, its content, the command line and its errors."""

import json
import re
import shutil
import subprocess
import xml.etree.ElementTree as ElementTree

import pytest
import torch

import xpipe
from xpipe.models import small_cnn, transformer_lm
from xpipe.schedule import Lockstep, by_name, gpipe
from xpipe.viz import PANELS, boxes, render, render_text
from xpipe.viz_cli import main

SVG = "{http://www.w3.org/2000/svg}"


@pytest.fixture(scope="module", params=["lm", "cnn"])
def drawing(request):
    if request.param == "lm":
        model, sample, stages = transformer_lm(blocks=6), torch.zeros(4, 64, dtype=torch.long), 4
    else:
        model, sample, stages = small_cnn(), torch.zeros(2, 3, 32, 32), 3
    partition = xpipe.partition(model, stages, sample_input=sample, cost="flops")
    return partition, gpipe(stages, 8)


def ids(root, prefix):
    return [e.get("id") for e in root.iter() if e.get("id", "").startswith(prefix)]


def test_svg_has_three_panels_every_cell_and_the_cut_labels(drawing, tmp_path):
    partition, schedule = drawing
    render(partition, schedule, tmp_path / "partition.svg")
    root = ElementTree.parse(tmp_path / "partition.svg").getroot()
    assert all(ids(root, panel) == [panel] for panel in PANELS)
    assert len(ids(root, "cell-")) == schedule.stages * schedule.clocks
    assert len(ids(root, "layer-")) == len(boxes(partition))
    texts = " ".join(t.text or "" for t in root.iter(f"{SVG}text"))
    if not texts.strip():  # matplotlib writes text as paths; its comments keep the strings
        texts = (tmp_path / "partition.svg").read_text()
    for cut in partition.boundaries:
        crossing = cut[0]
        assert f"{crossing.name} {list(crossing.shape)}" in texts
    bubble = (schedule.stages - 1) / (schedule.chunks + schedule.stages - 1)
    assert f"bubble {bubble:.1%}" in texts


def test_html_is_self_contained_with_hover_text(drawing, tmp_path):
    partition, schedule = drawing
    render(partition, schedule, tmp_path / "partition.html")
    html = (tmp_path / "partition.html").read_text()
    assert html.startswith("<!DOCTYPE html>") and "<script src" not in html and "<link" not in html
    assert "<title>clock 0, stage 0: forward of model stage 0, microbatch 0</title>" in html
    assert re.search(r"<title>stage 0: forward FLOPs [\d.]+[KMG]?FLOP</title>", html)
    assert all(f'id="{panel}"' in html for panel in PANELS)


def test_png_is_a_picture(drawing, tmp_path):
    partition, schedule = drawing
    render(partition, schedule, tmp_path / "partition.png")
    assert (tmp_path / "partition.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_text_has_the_stages_the_costs_and_the_timeline(drawing):
    partition, schedule = drawing
    text = render_text(partition, schedule)
    assert f"into {schedule.stages} stages" in text and "per stage: parameters" in text
    assert len(re.findall(r"^s\d+ ", text, re.MULTILINE)) == schedule.stages
    assert f"bubble {schedule.bubble_fraction:.1%}" in text


def test_long_chains_are_grouped():
    partition = xpipe.partition(transformer_lm(blocks=48), 8)
    grouped = boxes(partition)
    assert len(grouped) == 1 + 8 + 2  # embed, a run of blocks per stage, norm, head
    assert grouped[1].label == "Block x6" and len(grouped[1].layers) == 6


def test_html_loads_in_headless_chromium(tmp_path):
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    assert browser, "headless Chromium is needed: the README's test command installs it (apt-get install chromium)"
    partition = xpipe.partition(transformer_lm(blocks=4), 2, sample_input=torch.zeros(2, 64, dtype=torch.long))
    render(partition, gpipe(2, 4), tmp_path / "partition.html")
    result = subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}",
         "--enable-logging=stderr", "--v=0", "--dump-dom", (tmp_path / "partition.html").as_uri()],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert all(f'id="{panel}"' in result.stdout for panel in PANELS)
    console = [line for line in result.stderr.splitlines() if "CONSOLE" in line or "Uncaught" in line]
    assert console == []


def test_command_line_renders_a_factory_and_a_saved_partition(tmp_path, capsys):
    assert main(["xpipe.models:transformer_lm", "--stages", "2", "--chunks", "4", "--cost", "flops",
                 "--input-shape", "2,16", "--out", str(tmp_path / "partition.svg")]) == 0
    assert (tmp_path / "partition.svg").exists()
    saved = tmp_path / "partition.json"
    saved.write_text(xpipe.partition(small_cnn(), 3).to_json())
    assert main(["--partition", str(saved), "--chunks", "2", "--out", "-"]) == 0
    out = capsys.readouterr().out
    assert "Partition of Sequential into 3 stages" in out and "gpipe: 3 stages, 2 microbatches" in out
    assert json.loads(saved.read_text())["balance"]


@pytest.mark.parametrize("argv, message", [
    (["no.such.module:model", "--stages", "2"], "factory: importing 'no.such.module' failed (ModuleNotFoundError"),
    (["xpipe.models:nothing", "--stages", "2"], "factory: 'xpipe.models' has no function 'nothing'"),
    (["xpipe.models:small_cnn", "--stages", "2", "--cost", "flops", "--input-shape", "2,5"],
     "--input-shape 2,5 does not fit the model"),
    (["xpipe.models:small_cnn", "--stages", "40"], "stages: 40 stages need at least 40 layers"),
    (["xpipe.models:small_cnn", "--stages", "2", "--cost", "flops"],
     "--input-shape: the model needs a sample batch here (sample_input: cost='flops' runs the model"),
    (["xpipe.models:small_cnn", "--stages", "2", "--input-shape", "2,-3,32,32"],
     "--input-shape: '2,-3,32,32' has a size below 1"),
])
def test_bad_arguments_print_one_line_and_fail(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--chunks", "4", "--out", "-"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and message in error


def test_the_users_own_files_give_one_line_errors(tmp_path, monkeypatch, capsys):
    """A model file in the current directory is found (as ``python -m`` finds it); one
    that fails while it loads, a factory that raises and a partition of another schema each
    end in one line naming the problem, not a traceback."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_model.py").write_text(
        "from xpipe.models import small_cnn\n"
        "def build():\n    return small_cnn()\n"
        "def broken():\n    raise RuntimeError('no weights here')\n")
    (tmp_path / "broken_model.py").write_text("import torch\nraise ImportError('missing dependency')\n")
    (tmp_path / "other.json").write_text('{"schema": "something else"}')
    assert main(["my_model:build", "--stages", "2", "--chunks", "2", "--out", "-"]) == 0
    for argv, message in [
        (["broken_model:build", "--stages", "2"], "factory: importing 'broken_model' failed (ImportError: missing"),
        (["my_model:broken", "--stages", "2"], "factory: my_model:broken() raised RuntimeError: no weights here"),
        (["--partition", "other.json"], "--partition: 'other.json' is not a partition written by Partition.to_json()"),
    ]:
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_info:
            main([*argv, "--chunks", "2", "--out", "-"])
        assert exit_info.value.code == 2
        error = capsys.readouterr().err
        assert error.count("\n") == 1 and message in error, error


def test_a_zero_bubble_schedule_shows_its_split_backward(tmp_path):
    """I and W cells are told apart, and the title reads the bubble and the peak in
    flight from the table."""
    partition = xpipe.partition(small_cnn(), 3)
    render(partition, by_name("zb-h1", 3, 4), tmp_path / "zb.html")
    html = (tmp_path / "zb.html").read_text()
    assert "input gradient (I) of model stage 2, microbatch 0" in html
    assert "weight gradient (W) of model stage 0, microbatch 3" in html
    assert "peak in flight 3 microbatches" in html


def test_command_line_draws_any_schedule_with_its_virtual_stages(capsys):
    assert main(["xpipe.models:small_cnn", "--stages", "2", "--chunks", "4", "--schedule", "interleaved",
                 "--virtual", "2", "--out", "-"]) == 0
    assert "interleaved: 2 stages, 4 microbatches, 2 model stages per rank" in capsys.readouterr().out


def test_1f1b_under_spmd_is_drawn_in_lockstep_in_its_three_loops(tmp_path, capsys):
    """``--executor spmd``: each clock holds a forward and a backward on every stage,
    the loops of S - 1, M and S - 1 clocks named (chunks padded to a multiple of the
    stages, as the executor pads them)."""
    assert main(["xpipe.models:small_cnn", "--stages", "2", "--chunks", "3", "--schedule", "1f1b",
                 "--executor", "spmd", "--out", "-"]) == 0
    text = capsys.readouterr().out
    assert "1f1b under spmd: 2 stages, 4 microbatches, 6 clocks in 3 loops, bubble 20.0%" in text
    assert "loop   F      F+B    F+B    F+B    F+B    B" in text
    assert "s1     .  .   F0 B0  F1 B1  F2 B2  F3 B3  .  ." in text
    partition = xpipe.partition(small_cnn(), 2)
    render(partition, Lockstep(2, 4), tmp_path / "lockstep.html")
    html = (tmp_path / "lockstep.html").read_text()
    assert "clock 1, stage 1: backward of microbatch 0" in html and "clock 1, stage 0: no backward" in html
    assert "1f1b under spmd: 4 microbatches, bubble 20.0%, peak in flight 3 microbatches" in html
