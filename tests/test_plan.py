"""``xpipe.plan`` and ``xpipe-plan``: the layouts that fit, their predicted bytes, bubble
and time, and one clear line for bad input. (The predicted bytes against the bytes
measured on emulated devices: ``tests/spmd/test_fsdp.py``.)"""

import dataclasses
import math
import re
import subprocess
import sys

import pytest
import torch
from hf_models import llama, tokens
from transformers import LlamaConfig

import xpipe
from xpipe.layout import LOSS_SEGMENTS_FROM, MeshAxes, sequence_segments
from xpipe.planner import GiB, Layout, predict, preset
from xpipe.planner.accuracy import BANDS
from xpipe.planner.cli import draw_timeline, llama3_config, main
from xpipe.planner.memory import per_device
from xpipe.planner.profile import WHOLE_STREAMS, profile_of_config, profile_of_model
from xpipe.recompute import first_kept_clock
from xpipe.schedule import gpipe

SMALL = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True)


def test_a_config_built_on_the_meta_device_has_the_captured_models_weights():
    captured = profile_of_model(llama(4), {"input_ids": tokens(2, 8)})
    configured = profile_of_config(LlamaConfig(**SMALL), seq=8, itemsize=4)
    assert configured.blocks == captured.blocks == 4
    assert configured.block_weights == captured.block_weights
    assert sorted(configured.outer_weights) == sorted(captured.outer_weights) == [(32,), (128, 32)], "tied: once"
    assert configured.parameters == captured.parameters == sum(p.numel() for p in llama(4).parameters())
    assert configured.heads == captured.heads == (4,)
    assert configured.key_value_heads == captured.key_value_heads == 2
    # The config's estimates of one block, against what torch measured on the same block
    # (FLOPs: torch's counter; saved bytes: the graph's, which also holds the block's weights).
    assert configured.block_flops_per_row == pytest.approx(captured.block_flops_per_row, rel=0.25)
    # What travels with each row, as the spmd executor packs it: the hidden state, and with a padding
    # mask its row of the [rows, 1, seq, seq] mask. Without one the mask's rows are equal and, like the
    # rotary cos/sin, held once by every stage.
    assert configured.stream_bytes_per_row == captured.stream_bytes_per_row == 8 * 32 * 4
    padded = profile_of_model(llama(4), {"input_ids": tokens(2, 8), "attention_mask": torch.ones(2, 8, dtype=int)})
    assert profile_of_config(LlamaConfig(**SMALL), seq=8, itemsize=4, padding_mask=True).stream_bytes_per_row == \
        padded.stream_bytes_per_row == 8 * (32 + 8) * 4
    assert padded.hidden_bytes_per_row == configured.hidden_bytes_per_row == 8 * 32 * 4, "what 'tensor' reduces"
    layout = Layout(stages=2, data=1, fsdp=1, tensor=2, chunks=4)
    masked, unmasked = (predict(p, layout, chip=preset("v5e"), batch=16).communication for p in (padded, captured))
    assert masked["stage"] == unmasked["stage"] * (32 + 8) / 32
    # Each tensor device sends the next stage its share of the rows: half of what one device sends without "tensor".
    untensored = predict(captured, dataclasses.replace(layout, tensor=1), chip=preset("v5e"), batch=16).communication
    assert unmasked["stage"] == untensored["stage"] / 2
    # Over "tensor" the same reductions; the conveyor's gathers of each stage's input (every clock, and the
    # recomputed forward's) also gather the mask: 4 rows x 8 tokens x 8 mask floats, half from the other device.
    schedule = gpipe(2, 4)
    gathers = schedule.clocks + first_kept_clock(schedule, layout.checkpoint)
    assert masked["tensor"] - unmasked["tensor"] == pytest.approx(gathers * 4 * 8 * 8 * 4 / 2)


def test_a_layouts_weights_are_the_memory_models_and_its_bubble_the_schedules_table():
    profile = profile_of_model(llama(4), {"input_ids": tokens(2, 8)})
    layout = Layout(stages=2, data=1, fsdp=2, tensor=2, chunks=4)
    prediction = predict(profile, layout, chip=preset("v5e"), batch=16)
    stacked = [(2, 2, math.prod(shape)) for _, shape in profile.block_weights]
    split = [name.endswith("_proj.weight") for name, _ in profile.block_weights]  # Llama's rules: norms whole
    model = per_device(stacked=stacked, outer=profile.outer_weights, axes=MeshAxes(2, 1, 2, 2), split=split)
    clocks = len(gpipe(2, 4).forward_clocks())  # the clock loop keeps the stage's weights with every clock
    assert {k: prediction.memory[k] for k in ("parameters", "gradients", "optimizer", "gathered")} == {
        "parameters": model.parameters, "gradients": model.gradients, "optimizer": model.optimizer,
        "gathered": model.gathered + clocks * model.kept_per_clock}
    assert prediction.bubble == gpipe(2, 4).bubble_fraction
    assert prediction.communication["stage"] > 0 and prediction.communication["tensor"] > 0
    assert prediction.communication["data"] == 0, "no data axis, nothing reduced over it"


def test_what_a_block_saves_as_wide_as_the_stream_is_planned_whole_on_every_tensor_device():
    """Megatron's layout without sequence parallelism (docs/scaling.md): the block's saved
    tensors as wide as the stream, at most ``WHOLE_STREAMS`` of them (a Llama block
    measured saves 12 in eager PyTorch), are whole on every tensor device; the rest
    is split over "tensor". So a block whose stream-wide share is all it saves is
    planned as one saving twice as much, all of it split, on 2 tensor devices."""
    profile = profile_of_model(llama(4), {"input_ids": tokens(2, 8)})
    assert profile.block_stream_saved_bytes_per_row == WHOLE_STREAMS * profile.hidden_bytes_per_row
    assert profile.block_saved_bytes_per_row > 2 * profile.block_stream_saved_bytes_per_row
    saved = profile.block_saved_bytes_per_row

    def activations(stream_saved: float, block_saved: float, tensor: int) -> int:
        layout = Layout(stages=2, data=1, fsdp=1, tensor=tensor, chunks=4, checkpoint="never")
        planned = dataclasses.replace(profile, block_stream_saved_bytes_per_row=stream_saved,
                                      block_saved_bytes_per_row=block_saved)
        return predict(planned, layout, chip=preset("v5e"), batch=16).memory["activations"]

    assert activations(saved, saved, 2) == activations(0.0, 2 * saved, 2)
    assert activations(saved, saved, 2) > activations(0.0, saved, 2)
    assert activations(saved, saved, 1) == activations(0.0, saved, 1)


def test_with_sequence_parallelism_what_a_block_saves_as_wide_as_the_stream_is_split_too():
    """``Pipe(sequence_parallel=True)`` holds the stream between the blocks' tensor-parallel
    regions as sequence slices: the plan splits every tensor a block saves over "tensor",
    and counts the conveyor's slices alike; a layout without "tensor" has nothing to split."""
    profile = profile_of_model(llama(4), {"input_ids": tokens(2, 8)})
    whole = dataclasses.replace(profile, block_stream_saved_bytes_per_row=0.0)

    def activations(planned, sequence_parallel: bool, gather: str = "step") -> int:
        layout = Layout(stages=2, data=1, fsdp=2, tensor=2, chunks=4, checkpoint="always", gather=gather,
                        sequence_parallel=sequence_parallel)
        return predict(planned, layout, chip=preset("v5e"), batch=16).memory["activations"]

    assert activations(profile, True) == activations(whole, True) < activations(profile, False)
    assert activations(profile, True, "block") < activations(whole, False, "block")
    assert "sequence parallel" in str(Layout(2, 1, 1, 2, 4, sequence_parallel=True))
    with pytest.raises(ValueError, match=r"layout: sequence_parallel splits the sequence over \"tensor\", and this "
                                         r"layout has tensor=1"):
        predict(profile, Layout(2, 1, 4, 1, 4, sequence_parallel=True), chip=preset("v5e"), batch=16)
    planned = xpipe.plan(profile, devices=8, batch=16, sequence_parallel=True)
    assert all(p.layout.sequence_parallel == (p.layout.tensor > 1) for p in planned.fitting + planned.refused)


def test_the_loss_over_sequence_segments_is_planned_a_segment_of_logits_and_a_float32_head_gradient():
    """Where a device's logits reach ``LOSS_SEGMENTS_FROM`` elements the loss runs over
    ``sequence_segments(seq)`` segments (xpipe.spmd.segmented_loss): the plan counts a
    segment's share of the logits of the device's rows, and the float32 sum of the
    head's gradient (the vocabulary table's share of a tensor device)."""
    profile = profile_of_config(LlamaConfig(**{**SMALL, "vocab_size": 4096}), seq=1024, itemsize=2)
    layout = Layout(stages=2, data=1, fsdp=2, tensor=2, chunks=4)
    logits_per_device = layout.outer_rows(16) * 1024 * 4096 // 2
    assert logits_per_device >= LOSS_SEGMENTS_FROM and sequence_segments(1024) == 4
    segmented = predict(profile, layout, chip=preset("v5e"), batch=16)
    whole = predict(dataclasses.replace(profile, tokens_per_row=0), layout, chip=preset("v5e"), batch=16)
    logits = layout.outer_rows(16) * profile.outer_saved_bytes_per_row / layout.tensor
    assert whole.memory["activations"] - segmented.memory["activations"] == pytest.approx(0.75 * logits, abs=1)
    assert segmented.memory["gathered"] - whole.memory["gathered"] == 4 * 4096 * 32 // 2
    small = predict(profile, layout, chip=preset("v5e"), batch=4)  # a row per device: logits below the bound
    assert small.memory["activations"] == predict(dataclasses.replace(profile, tokens_per_row=0), layout,
                                                  chip=preset("v5e"), batch=4).memory["activations"]


def test_the_plans_ranking_of_chunk_counts_by_bubble_is_the_schedules_tables():
    profile = profile_of_model(llama(4), {"input_ids": tokens(2, 8)})
    chunk_counts = [1, 2, 4, 8, 16, 32]
    bubbles = {m: predict(profile, Layout(4, 2, 1, 1, m), chip=preset("v4"), batch=64).bubble for m in chunk_counts}
    tables = {m: gpipe(4, -(-m // 4) * 4).bubble_fraction for m in chunk_counts}
    assert sorted(chunk_counts, key=bubbles.get) == sorted(chunk_counts, key=tables.get)
    assert bubbles == tables


def test_llama3_70b_on_256_chips_of_32_gib_fits_and_pure_pipeline_parallelism_is_refused(capsys):
    assert main(["llama3-70b", "--devices", "256", "--chip", "v6e", "--batch", "32", "--seq", "2048"]) == 0
    out = capsys.readouterr().out
    listed = [line for line in out.splitlines() if re.match(r"\s+\d+\s+\d+\s", line)]  # index, stages, ...
    assert listed, out
    for line in listed:
        assert float(line.split("(")[0].split()[-1]) <= 32.0, line  # GiB per device, before its parts
    refusal = next(line for line in out.splitlines() if line.startswith("pure pipeline parallelism"))
    assert "GiB per device" in refusal and "over 32.00 GiB" in refusal


def test_llama3_70b_at_256_x_2048_fits_15_gib_of_v5e_and_with_a_padding_mask_only_under_1f1b(capsys):
    """Packed sequences' causal mask is held once by every stage; a padding mask's
    [seq, seq] form travels with every row: with it, only 1F1B's layouts fit (a ring of
    stage inputs, not every microbatch's). Only the layouts that fit are searched (per
    block, recomputing every block). Issue 36 planned this job in 14 GiB; the plan now
    also counts the outer layers' whole gradients at the loss, which XLA's buffer
    assignment holds there (14.59 GiB when this test was changed)."""
    job = ["llama3-70b", "--devices", "256", "--chip", "v5e", "--batch", "256", "--memory", "15GiB", "--top", "1",
           "--gather", "block", "--checkpoint", "always"]
    assert main(job) == 0
    best = capsys.readouterr().out.splitlines()[3].split()  # index, stage, data, fsdp, tensor, ...
    assert best[1:5] == ["1", "1", "128", "2"] and float(best[9]) <= 15.0, best
    assert main([*job, "--padding-mask"]) == 0
    padded = capsys.readouterr().out.splitlines()[3].split()
    assert padded[5] == "1f1b" and float(padded[9]) <= 15.0, padded  # GPipe's layouts hold every microbatch's


def test_planning_a_405b_model_allocates_nothing():
    """Built on the meta device: the planner's process stays far below the model's 810 GB."""
    script = ("import resource, sys; from xpipe.planner.cli import main; main(['llama3-405b', '--devices', '1024', "
              "'--chip', 'v5p', '--batch', '1024']); print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True)
    peak_kib = int(done.stdout.split()[-1])
    assert peak_kib < 3 * (1 << 20), f"{peak_kib / (1 << 20):.1f} GiB resident"
    assert "layouts fit" in done.stdout


@pytest.mark.parametrize(("arguments", "message"), [
    (["--chip", "v9"], "chip: 'v9' is not a preset"),
    (["--memory", "0GiB"], "--memory: '0GiB' is no memory at all"),
    (["--memory", "lots"], "--memory: 'lots' is not a size"),
    (["--memory", "1GiB"], "fits nowhere on 256 x TPU v5e"),
    (["--devices", "0"], "devices: must be a positive integer, got 0"),
])
def test_bad_input_gets_one_line_and_status_2(capsys, arguments, message):
    options = {"--devices": "256", "--batch": "32", "--chip": "v5e"}
    options.update(dict(zip(arguments[::2], arguments[1::2])))
    with pytest.raises(SystemExit) as exit_:
        main(["llama3-8b", *(item for pair in options.items() for item in pair)])
    assert exit_.value.code == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and captured.err.startswith("xpipe-plan: error: "), captured.err
    assert message in captured.err, captured.err


def test_the_plan_as_a_picture(tmp_path, capsys):
    assert main(["llama3-8b", "--devices", "32", "--chip", "v6e", "--batch", "64", "--plot",
                 str(tmp_path / "plan.png")]) == 0
    assert (tmp_path / "plan.png").stat().st_size > 10_000


def test_a_layouts_memory_is_the_peak_of_its_step_timeline():
    """The step's moments in program order: each forward clock, the loss, each backward
    clock. The outer layers' gradients exist from the loss on; the recomputing loop
    keeps every round's weights per clock and the keeping loop the round's only (XLA's
    buffer assignment, tools/peak_grid.py); the prediction's bytes are the peak's."""
    profile = profile_of_model(llama(8), {"input_ids": tokens(2, 8)})
    layouts = {checkpoint: Layout(2, 1, 4, 1, 4, "circular", 2, checkpoint) for checkpoint in ("always", "except_last")}
    predictions = {checkpoint: predict(profile, layout, chip=preset("v5e"), batch=16)
                   for checkpoint, layout in layouts.items()}
    for checkpoint, prediction in predictions.items():
        timeline = prediction.timeline
        clocks = len(xpipe.schedule.circular(2, 4, 2).forward_clocks())
        assert [m.label for m in timeline.moments] == ([f"forward clock {c}" for c in range(clocks)] + ["loss"]
                                                       + [f"backward clock {c}" for c in reversed(range(clocks))])
        assert prediction.memory == timeline.peak.memory and prediction.bytes == max(m.bytes for m in timeline.moments)
        forward, loss = timeline.moments[clocks - 1], timeline.moments[clocks]
        assert loss.memory["gathered"] > forward.memory["gathered"], "the outer layers' gradients, from the loss on"
    weights = per_device(stacked=[(2, 4, math.prod(shape)) for _, shape in profile.block_weights],
                         outer=profile.outer_weights, axes=MeshAxes(2, 1, 4, 1))
    recomputing = first_kept_clock(xpipe.schedule.circular(2, 4, 2), "except_last")
    kept_always = predictions["always"].timeline.moments[clocks]
    kept_some = predictions["except_last"].timeline.moments[clocks]
    assert kept_always.memory["gathered"] - kept_some.memory["gathered"] == (
        (clocks - recomputing) * (weights.kept_per_clock - weights.kept_per_clock // 2))


def test_1f1b_is_planned_with_a_ring_of_stage_inputs_or_of_activations_not_one_per_microbatch():
    """1F1B under the spmd executor (``xpipe.spmd.one_f_one_b``): listed with more than one
    stage and ``checkpoint="always"`` or ``"never"`` (no ``"except_last"``: it would save
    no work); a moment per loop and one after them, where the gradients are reduced, the
    steady loop's the peak.
    From 8 to 32 microbatches of fixed rows its activations grow by the slot buffer
    alone, where GPipe's keep every microbatch's; GPipe's bubble, the layers after the
    body on the pieces the exiting microbatch is cut into (two rows a device: 2 pieces
    of 4 stages, so twice GPipe's rows), a stream and a slot's column sent each way
    every clock, and each steady clock one piece down and its gradient back. With
    ``"never"`` the ring holds ``2S - 1`` cells' activations, whatever ``chunks`` is, and
    the step computes no forward twice."""
    result = xpipe.plan(LlamaConfig(**SMALL), devices=8, batch=64, checkpoints=("except_last", "always", "never"))
    listed = [p.layout for p in result.fitting + result.refused if p.layout.schedule == "1f1b"]
    assert listed and all(layout.stages > 1 for layout in listed)
    assert {layout.checkpoint for layout in listed} == {"always", "never"}
    assert {layout.gather for layout in listed if layout.checkpoint == "always"} == {"step", "block"}
    profile = profile_of_model(llama(8), {"input_ids": tokens(2, 8)})

    def planned(schedule: str, chunks: int, checkpoint: str = "always"):
        return predict(profile, Layout(4, 2, 1, 1, chunks, schedule, 1, checkpoint), chip=preset("v5e"),
                       batch=chunks * 2 * 2)  # two rows a device per microbatch

    one_f_one_b = {chunks: planned("1f1b", chunks) for chunks in (8, 32)}
    gpipe_ = {chunks: planned("gpipe", chunks) for chunks in (8, 32)}
    assert [m.label.split(" (")[0] for m in one_f_one_b[8].timeline.moments] == [
        "warm-up loop", "steady loop", "cool-down loop", "after the loops"]
    assert one_f_one_b[8].timeline.peak.label.startswith("steady loop")
    stage_input = 2 * profile.stream_bytes_per_row
    growth = one_f_one_b[32].memory["activations"] - one_f_one_b[8].memory["activations"]
    assert growth == pytest.approx((32 - 8) // 4 * stage_input, abs=2), "six more slots a stage, nothing else"
    assert gpipe_[32].bytes - gpipe_[8].bytes > 4 * growth
    assert one_f_one_b[32].bubble == gpipe_[32].bubble == xpipe.schedule.Lockstep(4, 32).bubble_fraction
    head = one_f_one_b[32].seconds["compute"] - gpipe_[32].seconds["compute"]
    never = {chunks: planned("1f1b", chunks, "never") for chunks in (8, 32)}
    cell = 2 * profile.block_kept_bytes_per_row * profile.blocks // 4  # a stage's blocks, two rows
    ring = never[8].memory["activations"] - one_f_one_b[8].memory["activations"]
    assert ring >= xpipe.schedule.Lockstep(4, 8).ring * cell, "a ring of 2S - 1 cells' activations besides"
    assert never[32].memory["activations"] - never[8].memory["activations"] == pytest.approx(growth, abs=2)
    assert never[32].seconds["compute"] < one_f_one_b[32].seconds["compute"], "no recomputed forward"
    with pytest.raises(ValueError, match="checkpoint: schedule='1f1b' under the spmd executor .* 'except_last'"):
        predict(profile, Layout(4, 2, 1, 1, 8, "1f1b", 1, "except_last"), chip=preset("v5e"), batch=32)
    with pytest.raises(ValueError, match="layout: schedule 'zb-h1' is not one the spmd executor runs"):
        predict(profile, Layout(4, 2, 1, 1, 8, "zb-h1"), chip=preset("v5e"), batch=32)
    rows = 32 * 2 * 2 // 8  # a device's rows in GPipe: the batch over stage x data
    assert xpipe.schedule.Lockstep(4, 32).head_pieces(2) == 2
    assert head == pytest.approx(3 * (4 / 2 - 1) * rows * profile.outer_flops_per_row / preset("v5e").flops)
    pieces_sent = 2 * 32 * stage_input / 2
    assert one_f_one_b[32].communication["stage"] == 4 * (32 + 2 * 4 - 2) * stage_input + pieces_sent


def test_1f1b_gathered_for_the_step_holds_the_vocabulary_table_whole_before_its_loops():
    """With fsdp and tensor, before the loops XLA gathers the tied table whole over "fsdp"
    and slices each device's vocabulary half out of it, beside the zeroed gradient of the
    layers around the body: a moment of its own, before the warm-up loop. Without "tensor"
    the gathered table is the copy the loops hold; per block, and with nothing sharded,
    nothing is gathered before the loops."""
    profile = profile_of_model(llama(4), {"input_ids": tokens(2, 8)})
    table, norm = 128 * 32 * 4, 32 * 4  # the tied embedding and head (vocabulary x width), the final norm; float32
    moments = {}
    for fsdp, tensor, gather in ((2, 2, "step"), (4, 1, "step"), (4, 1, "block"), (1, 1, "step")):
        layout = Layout(2, 4 // (fsdp * tensor), fsdp, tensor, 4, "1f1b", 1, "always", gather)
        moments[fsdp, tensor, gather] = predict(profile, layout, chip=preset("v5e"), batch=32).timeline.moments
    before, warm_up = moments[2, 2, "step"][:2]
    assert before.label == "before the loops (weights gathered)" and warm_up.label.startswith("warm-up loop")
    assert before.memory["gathered"] - warm_up.memory["gathered"] == table + (table // 2 + norm)
    fsdp_only = moments[4, 1, "step"]
    assert fsdp_only[0].memory["gathered"] - fsdp_only[1].memory["gathered"] == table + norm  # the zeroed gradient
    assert not any(m.label.startswith("before the loops") for m in (*moments[4, 1, "block"], *moments[1, 1, "step"]))


def test_the_timeline_of_a_listed_layout_marks_the_plans_peak(tmp_path, capsys):
    job = ["llama3-8b", "--devices", "32", "--chip", "v6e", "--batch", "64", "--top", "1"]
    assert main(job) == 0
    listed = float(capsys.readouterr().out.splitlines()[3].split("(")[0].split()[-1])
    assert main([*job, "--timeline", "1", "--plot", str(tmp_path / "timeline.svg")]) == 0
    lines = capsys.readouterr().out.splitlines()
    peak = [line for line in lines if line.endswith("<- peak")]
    assert len(peak) == 1 and float(re.findall(r"\d+\.\d+", peak[0])[0]) == listed, lines
    assert any(line.strip().startswith("forward clock") for line in lines), lines
    assert (tmp_path / "timeline.svg").stat().st_size > 5_000
    best = xpipe.plan(llama3_config("llama3-8b"), devices=32, chip="v6e", batch=64).fitting[0]
    draw_timeline(best, str(tmp_path / "beside.svg"), measured_peak=best.bytes // 2)  # with an audit's peak
    assert "XLA's peak" in (tmp_path / "beside.svg").read_text()
    with pytest.raises(SystemExit):
        main([*job, "--timeline", "100000"])
    assert "--timeline: 100000 is not a layout that fits; give 1 to " in capsys.readouterr().err


def test_a_layouts_band_is_how_far_xlas_peak_was_from_the_plan_for_its_kind(capsys):
    """``tools/peak_grid.py``'s measured ratios per layout kind: each listed layout prints
    the bytes XLA held at the plan's figure as far off as its kind's cells were, or that
    no cell of its kind was measured."""
    assert BANDS and all(0.4 < band.low <= band.high < 2 and band.cells > 0 for band in BANDS.values())
    profile = profile_of_model(llama(8), {"input_ids": tokens(2, 8)})
    measured = predict(profile, Layout(2, 1, 4, 1, 4), chip=preset("v5e"), batch=16)
    band = BANDS["gpipe, except_last, gather step, no tensor"]
    assert measured.band is band
    assert band.measured_range(measured.bytes) == (measured.bytes / band.high, measured.bytes / band.low)
    unmeasured = Layout(2, 1, 4, 1, 4, "circular", 2, "always", "block")
    assert unmeasured.kind not in BANDS and predict(profile, unmeasured, chip=preset("v5e"), batch=16).band is None
    assert main(["llama3-70b", "--devices", "256", "--chip", "v6e", "--batch", "32", "--top", "20"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if re.match(r"\s+\d+\s+\d+\s", line)]
    assert rows and all(re.search(r"\d+\.\d+-\d+\.\d+ \(\d+ cells\)$", row) or row.endswith("kind not measured")
                        for row in rows), rows


def test_the_python_api_names_what_is_missing():
    with pytest.raises(ValueError, match="sample_input"):
        xpipe.plan(llama(2), devices=8, batch=16)
    with pytest.raises(ValueError, match="chip: 'tpu' is not a preset"):
        xpipe.plan(LlamaConfig(**SMALL), devices=8, batch=16, chip="tpu")
    result = xpipe.plan(llama(4), devices=8, batch=16, sample_input={"input_ids": tokens(2, 8)},
                        memory_per_device=GiB)
    assert result.fitting and all(p.bytes <= GiB for p in result.fitting)
    assert [p.step_seconds for p in result.fitting] == sorted(p.step_seconds for p in result.fitting)
    assert torch.get_default_device().type == "cpu", "the meta device is not left as the default"


@pytest.mark.parametrize("arguments, error, message", [
    (dict(chip=None), TypeError, r"chip: expected a preset's name \(v4, v5e, v5p, v6e\) or an xpipe.planner.Chip, got "
                                 r"NoneType"),
    (dict(optimizer_states=-1), ValueError, r"optimizer_states: the tensors the optimizer keeps per weight, a whole "
                                            r"number >= 0 \(AdamW 2, SGD with momentum 1, plain SGD 0\), got -1"),
    (dict(optimizer_states=1.5), ValueError, r"optimizer_states: .* got 1.5"),
    (dict(max_tensor=0), ValueError, r"max_tensor: must be a positive integer"),
    (dict(gathers=("step", "layer")), ValueError, r"gather: 'layer' is not a choice; use one of 'step', 'block'"),
    (dict(gathers="block"), ValueError, r"gathers: a tuple of some of 'step', 'block', got 'block'"),
    (dict(padding_mask="yes"), TypeError, r"padding_mask: expected True or False .* got 'yes'"),
    (dict(sequence_parallel=1), TypeError, r"sequence_parallel: expected True or False \(Pipe's\), got 1"),
    (dict(memory_per_device=64 * GiB), ValueError, r"memory_per_device: 64.00 GiB is more than a TPU v5e holds "
                                                   r"\(16.00 GiB of HBM\).*over_chip_memory=True"),
    (dict(gathers=("block",), checkpoints=("except_last",)), ValueError,
     r"gathers: gather 'block' .* recomputes every block .* add 'always' to them \(--checkpoint always\)"),
])
def test_every_argument_is_checked_before_planning(arguments, error, message):
    with pytest.raises(error, match=message):
        xpipe.plan(LlamaConfig(**SMALL), devices=8, batch=16, **arguments)


def test_per_block_gathering_is_planned_where_fsdp_shards_and_every_block_recomputes():
    result = xpipe.plan(LlamaConfig(**SMALL), devices=8, batch=16)
    per_block = [p.layout for p in result.fitting + result.refused if p.layout.gather == "block"]
    assert per_block and all(layout.fsdp > 1 and layout.checkpoint == "always" for layout in per_block)
    only_step = xpipe.plan(LlamaConfig(**SMALL), devices=8, batch=16, gathers=("step",))
    assert all(p.layout.gather == "step" for p in only_step.fitting + only_step.refused)


def test_a_budget_above_the_chip_is_planned_only_when_asked_for(capsys):
    """Layouts needing four times a v5e's memory were called fitting with --memory 64GiB."""
    with pytest.raises(SystemExit):
        main(["llama3-8b", "--devices", "8", "--batch", "8", "--memory", "64GiB"])
    assert "--over-chip-memory" in capsys.readouterr().err
    over = xpipe.plan(LlamaConfig(**SMALL), devices=8, batch=16, memory_per_device=64 * GiB, over_chip_memory=True)
    assert over.capacity == 64 * GiB and over.fitting
