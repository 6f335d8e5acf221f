"""XLA's peak per device for a step, against what ``xpipe.plan`` predicts, and what moves
the peak: weights gathered per block (ZeRO-3), the stream split over "tensor" between
stages, Megatron's sequence parallelism. Each layout's step is compiled once, under
``xpipe.inspect.audit``, for every test that reads it (tests/spmd/test_audit.py holds
the collectives of the conveyor and of the mesh's other axes)."""

import pytest

import xpipe
import xpipe.inspect

DUMP = xpipe.inspect.enable_hlo_dump()  # before any XLA tensor: XLA reads its flags once

from hf_models import gpt2, llama, padding_mask, tokens  # noqa: E402
from xpipe.planner import Layout, predict, preset  # noqa: E402
from xpipe.planner.profile import profile_of_model  # noqa: E402


# Layouts whose step's peak XLA reports and the planner predicts: (family, layers, stages, fsdp,
# tensor, gather, schedule, checkpoint, sequence parallel). Llama with 4 blocks per stage on 2 x 4 fsdp,
# gathered per step and per block, is also the per-block test's.
PEAK_LAYOUTS = {
    "llama, 4 blocks a stage, 2 x 4 fsdp, gathered per step": ("llama", 8, 2, 4, 1, "step", "gpipe", "always"),
    "llama, 4 blocks a stage, 2 x 4 fsdp, gathered per block": ("llama", 8, 2, 4, 1, "block", "gpipe", "always"),
    "llama, 2 x 2 x 2, gathered per step": ("llama", 4, 2, 2, 2, "step", "gpipe", "except_last"),
    "llama, 2 x 2 x 2, gathered per block": ("llama", 8, 2, 2, 2, "block", "gpipe", "always"),
    "llama, circular x2 on 2 x 4 fsdp, gathered per step": ("llama", 8, 2, 4, 1, "step", "circular", "except_last"),
    "gpt2, 2 x 4 fsdp, gathered per block": ("gpt2", 4, 2, 4, 1, "block", "gpipe", "always"),
    "llama, 4 blocks a stage, 2 x 2 x 2, 1f1b": ("llama", 8, 2, 2, 2, "step", "1f1b", "always"),
    "gpt2, 2 x 1 x 4, nothing recomputed": ("gpt2", 4, 2, 1, 4, "step", "gpipe", "never"),
    "gpt2, 2 x 1 x 4, nothing recomputed, sequence parallel": ("gpt2", 4, 2, 1, 4, "step", "gpipe", "never", True),
}


@pytest.fixture(scope="module")
def peak_audits():
    """Per layout: the Pipe, the audit of one forward and backward, and the planner's prediction."""
    audits, profiles = {}, {}  # a model's profile, once for all its layouts
    for name, (family, layers, stages, fsdp, tensor, gather, schedule, checkpoint, *sequence) in PEAK_LAYOUTS.items():
        sequence_parallel = bool(sequence)
        ids = tokens(16, 8)
        inputs = ({"input_ids": ids, "attention_mask": padding_mask(16), "labels": ids.roll(1, 1)}
                  if family == "llama" else {"input_ids": ids, "labels": ids})
        sample = {key: value[:2] for key, value in inputs.items()}
        make = (lambda: llama(layers)) if family == "llama" else (lambda: gpt2(layers, dropout=0.0))
        virtual = 2 if schedule == "circular" else 1
        pipe = xpipe.Pipe(make(), chunks=4, mesh=xpipe.make_mesh(stages, fsdp=fsdp, tensor=tensor),
                          checkpoint=checkpoint, gather=gather, schedule=schedule, virtual=virtual, sample_input=sample,
                          sequence_parallel=sequence_parallel)
        report = xpipe.inspect.audit(lambda: pipe(**inputs).loss.backward(), mesh=pipe.mesh)
        layout = Layout(stages, 1, fsdp, tensor, 4, schedule, virtual, checkpoint, gather, sequence_parallel)
        if (family, layers) not in profiles:
            profiles[family, layers] = profile_of_model(make(), sample)
        prediction = predict(profiles[family, layers], layout, chip=preset("v5e"), batch=16)
        audits[name] = pipe, report, prediction
    return audits


@pytest.mark.full
def test_gathering_per_block_gathers_one_slot_at_a_time_inside_the_loop_and_lowers_the_peak(peak_audits):
    """Llama with 4 blocks per stage on 2 stages x 4 fsdp, every block recomputed, its
    weights gathered once per step or per block (ZeRO-3). Per block, the loops' only
    all-gathers are over "fsdp", each of at most one block's weight, and they gather a
    stage's weights twice per clock (the forward, and the recomputation in the backward);
    each clock reduces the gradients it made over "fsdp". XLA's peak for the step:
    1,278,560 bytes gathered once, 382,356 per block, when this test was last changed
    (with 8 blocks a stage, 2,508,920 and 626,626)."""
    _, once, _ = peak_audits["llama, 4 blocks a stage, 2 x 4 fsdp, gathered per step"]
    pipe, report, _ = peak_audits["llama, 4 blocks a stage, 2 x 4 fsdp, gathered per block"]
    assert pipe.runner.depth == 4
    body = pipe.runner.body
    one_block = {w[0, 0].numel() * w.element_size() for w in body.weights}
    gathers = report.of("all-gather", in_loop=True)
    assert gathers and all(op.axes == ("fsdp",) and op.bytes in one_block for op in gathers), report
    stage = sum(w[0].numel() * w.element_size() for w in body.weights)
    # Per clock (5 of them: 4 microbatches on 2 stages), the forward loop gathers the stage's weights
    # once; the backward loop gathers them again for the recomputation and reduces their gradients.
    clock_loops = [loop for loop in report.loops() if loop.count("collective-permute")]  # not the loss's
    forward, backward = sorted(clock_loops, key=lambda loop: loop.count("all-reduce", axis="fsdp"))
    assert forward.trips == backward.trips == 5, report
    assert forward.bytes_of("all-gather", axis="fsdp") == backward.bytes_of("all-gather", axis="fsdp") == stage
    assert forward.count("all-reduce") == 0, report
    reductions = backward.of("all-reduce") + backward.of("reduce-scatter")
    assert reductions and all(op.axes == ("fsdp",) for op in reductions), report
    assert sum(op.bytes for op in reductions) == stage, report  # all-reduce + slice on XLA's CPU compiler
    assert report.count("all-to-all") == 0, report
    assert once.count("all-gather", in_loop=True) == 0, once
    assert report.peak_bytes <= 0.7 * once.peak_bytes, (report.peak_bytes, once.peak_bytes)


def per_block_peak(layers: int, heads: int, seq: int) -> tuple[int, int]:
    """XLA's peak for one forward and backward of a Llama whose attention probabilities
    dominate what a block saves, on 2 stages x 4 fsdp, gathered per block, and what
    ``xpipe.plan`` predicts for it (less the optimizer's state, which the step does not
    hold)."""

    def make():
        model = llama(layers, heads=heads, kv_heads=heads // 2)
        model.config.max_position_embeddings = seq
        return model

    ids = tokens(16, seq)
    inputs = {"input_ids": ids, "labels": ids.roll(1, 1)}
    sample = {key: value[:2] for key, value in inputs.items()}
    pipe = xpipe.Pipe(make(), chunks=4, mesh=xpipe.make_mesh(2, fsdp=4), checkpoint="always", gather="block",
                      sample_input=sample)
    peak = xpipe.inspect.audit(lambda: pipe(**inputs).loss.backward(), mesh=pipe.mesh).peak_bytes
    layout = Layout(2, 1, 4, 1, 4, "gpipe", 1, "always", "block")
    prediction = predict(profile_of_model(make(), sample), layout, chip=preset("v5e"), batch=16)
    return peak, prediction.bytes - prediction.memory["optimizer"]


def test_gathering_per_block_holds_one_blocks_weights_and_activations_at_a_time():
    """Llama (16 heads, 64 tokens) on 2 stages x 4 fsdp, gathered per block, every block
    recomputed: 4 blocks a stage instead of 1 grow XLA's peak for the step by less than
    one block's attention probabilities per block added (a device's one row of a
    microbatch: heads x seq x seq floats). Each slot is gathered once the slot before it
    has run, and recomputed in the backward once the gradient it serves exists
    (``xpipe.spmd.ordering.tied_to``). Without that, XLA's CPU compiler gathered every
    slot at the loop body's start and recomputed every slot before the first backward:
    933,238 bytes more per block (3.6 times its probabilities) when this test was
    written, against 190,603 with it. The plan predicts the one-block peak within 15%
    (1.03: XLA's peak is in a backward clock, which holds the recomputed probabilities and
    their gradient at once) and the four-block peak over it, within 30% (1.24: XLA's peak
    is then in a forward clock, and its backward holds less than the plan's backward
    moment; docs/planning.md lists it among the cells the plan does not yet meet)."""
    heads, seq = 16, 64
    (one, one_planned), (four, four_planned) = per_block_peak(2, heads, seq), per_block_peak(8, heads, seq)
    probabilities = heads * seq * seq * 4
    assert (four - one) / 3 < probabilities, (one, four, probabilities)
    assert abs(one_planned - one) <= 0.15 * one, (one_planned, one)
    assert four <= four_planned <= 1.3 * four, (four_planned, four)


@pytest.mark.full
def test_each_tensor_device_carries_its_share_of_the_stream_between_stages(peak_audits):
    """Megatron's scatter-gather: on 2 stages x 4 tensor each device sends the next stage
    a quarter of every microbatch it passes on (the state, and the two columns of the slot
    buffer that move each clock: 3 x 4 rows x 8 tokens x 32 features x 4 bytes whole,
    3,072 bytes a clock; 12,288 before), and gathers the stage's input from its group once
    a clock, forward and backward (counted in the GPT-NeoX test below). XLA's peak for
    this step, nothing recomputed, was 698,250 bytes before and 689,046 with it;
    recomputing every cell, which keeps each clock's input as the conveyor holds it,
    295,776 and 260,960 (docs/scaling.md)."""
    _, report, _ = peak_audits["gpt2, 2 x 1 x 4, nothing recomputed"]
    whole = 4 * 8 * 32 * 4
    clock_loops = [loop for loop in report.loops() if loop.count("collective-permute")]
    assert len(clock_loops) == 2, report
    assert all(loop.bytes_of("collective-permute") == 3 * whole // 4 for loop in clock_loops), report


@pytest.mark.full  # the quick tier checks a sequence-parallel step's exactness in spmd/test_fsdp.py
def test_sequence_parallelism_runs_megatrons_collectives_carries_slices_and_lowers_the_peak(peak_audits):
    """GPT-2 on 2 stages x 4 tensor, nothing recomputed, ``sequence_parallel=True``: in each
    clock, per block, forward and backward, two all-gathers of the sequence over "tensor"
    (before the column-parallel linears) and two reductions onto the slices (after the
    row-parallel ones: on TPU a reduce-scatter; XLA's CPU compiler writes it as an
    all-reduce and a slice), each of one device's microbatch activation; besides them
    the backward reduces the norms' weight gradients (32 floats each), which the slices
    make partial sums. No gather of the stage's input: a stage reads the slices the
    conveyor brought, and each device sends the next stage its quarter of every
    microbatch (3,072 bytes a clock). XLA's peak for the step is lower than without
    sequence parallelism: 599,598 bytes against 724,366 when this test was written (the
    tensors a block saves at the stream's width, split by sequence)."""
    _, plain, _ = peak_audits["gpt2, 2 x 1 x 4, nothing recomputed"]
    _, report, _ = peak_audits["gpt2, 2 x 1 x 4, nothing recomputed, sequence parallel"]
    activation = 4 * 8 * 32 * 4  # a device's 4 rows of 8 tokens, 32 features, float32
    clock_loops = [loop for loop in report.loops() if loop.count("collective-permute")]
    assert len(clock_loops) == 2, report
    for loop in clock_loops:
        assert loop.bytes_of("collective-permute") == 3 * activation // 4, report
        over_tensor = [op for op in loop.ops if "tensor" in op.axes]
        assert all(op.axes == ("tensor",) for op in over_tensor), report
        gathers = [op for op in over_tensor if op.kind == "all-gather"]
        reductions = [op for op in over_tensor if op.kind in ("all-reduce", "reduce-scatter") and op.bytes > 128]
        assert len(gathers) == len(reductions) == 2 * 2, report  # 2 blocks a stage
        assert all(op.bytes == activation for op in gathers + reductions), report
        assert len(gathers) + len(reductions) + len([op for op in over_tensor if op.bytes <= 128]) == len(over_tensor)
    assert report.peak_bytes < 0.9 * plain.peak_bytes, (report.peak_bytes, plain.peak_bytes)


# The cells of PEAK_LAYOUTS the plan does not yet predict within 10%, with the bound they
# hold (predicted / measured when it was last changed; docs/planning.md lists every cell).
# 1F1B's cell: 0.89 (0.67 while each block slot's weights were picked out of the stack by index,
# whose gradient held a padded copy of the stack per slot: docs/planning.md, "1F1B gathered for the step").
NOT_YET_WITHIN_10_PERCENT = {"llama, 2 x 2 x 2, gathered per block": 0.15,  # 1.11
                             "llama, 4 blocks a stage, 2 x 2 x 2, 1f1b": 0.15}  # 0.89


@pytest.mark.full
@pytest.mark.parametrize("name", PEAK_LAYOUTS)
def test_the_plan_predicts_the_peak_xla_compiles_for_the_step_within_10_percent(peak_audits, name):
    """What ``xpipe.plan`` predicts a device holds at the step's peak, less the optimizer's
    state (the audited program is the forward and backward; the optimizer runs after),
    against the peak of XLA's buffer assignment for that program."""
    _, report, prediction = peak_audits[name]
    predicted = prediction.bytes - prediction.memory["optimizer"]
    bound = NOT_YET_WITHIN_10_PERCENT.get(name, 0.10)
    assert abs(predicted - report.peak_bytes) <= bound * report.peak_bytes, (predicted, report.peak_bytes,
                                                                             prediction.memory)
