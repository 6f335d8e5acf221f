"""Pure pieces on the CPU: shift, recompute, the LayerNorm rewrite, hashed attention dropout, side-input
packing, 1F1B's stashed activations, the HLO parser and its dump folder."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from xpipe.collectives import shift
from xpipe.inspect import CommunicationReport, Kernels, collectives, kernels, loop_trips, matmul_flops
from xpipe.recompute import check_mode, recompute
from xpipe.spmd.dropout import hashed_dropout
from xpipe.spmd.lowering import ShardableOps, heads_leading_attention, layer_norm
from xpipe.spmd.sides import packing_for
from xpipe.spmd.stashed_activations import StashedActivations


def test_shift_moves_slices_and_its_gradient_moves_them_back():
    x = torch.arange(4.0).view(4, 1).requires_grad_()
    moved = shift(x, 1)
    assert moved.flatten().tolist() == [0, 0, 1, 2]
    assert shift(x, -2).flatten().tolist() == [2, 3, 0, 0]
    (moved * torch.tensor([[1.0], [2.0], [3.0], [4.0]])).sum().backward()
    assert x.grad.flatten().tolist() == [2, 3, 4, 0]
    with pytest.raises(ValueError, match="offset: must be a non-zero int"):
        shift(x, 4)


def test_stashed_activations_backward_reads_what_the_forward_kept_once_each():
    """Per device under vmap (3 devices), the forward keeps what its backward reads that
    depends on the input: not the weight, a tensor saved twice once, and a transpose as
    the tensor it views. The backward from them is autograd's (float32, rtol 1e-5), and it
    reads them: other kept values give other gradients."""
    def one_stage(weights, valid, x, round_, key):
        hidden = torch.tanh(x @ weights[0])
        return (hidden @ hidden.t()) @ hidden * valid

    devices = 3
    x, weight = torch.randn(devices, 4, 5), torch.randn(devices, 5, 5)
    valid, rounds, keys = torch.ones(devices), torch.ones(devices, 1), torch.zeros(devices, dtype=torch.int32)
    stashed = StashedActivations(one_stage, lambda weights, state: (weights, state), lambda state: state)
    output, kept = stashed.forward((weight,), valid, x, rounds, keys)
    assert all(k.shape[0] == devices for k in kept)
    kept_shapes = [tuple(k.shape[1:]) for k in kept]
    assert kept_shapes == [(4, 5), (4, 5), (4, 4)], "x, tanh's output (its transpose as it), hh^T"
    gradient = torch.randn_like(output)

    def gradients(run):
        leaves = x.clone().requires_grad_(), weight.clone().requires_grad_()
        return torch.autograd.grad(run((leaves[1],), valid, leaves[0], rounds, keys), leaves, gradient)

    found = gradients(stashed.reading(kept))
    expected = gradients(torch.vmap(one_stage))
    torch.testing.assert_close(found, expected, rtol=1e-5, atol=1e-5)
    changed = gradients(stashed.reading(tuple(k * 2 for k in kept)))
    assert not torch.allclose(changed[0], found[0])


def test_recompute_gives_the_same_gradients():
    weight = torch.randn(3, 3, requires_grad=True)
    x = torch.randn(2, 3, requires_grad=True)
    torch.tanh(x @ weight).pow(2).sum().backward()
    expected = weight.grad.clone(), x.grad.clone()
    weight.grad = x.grad = None
    recompute(lambda a, w: torch.tanh(a @ w), x, weight).pow(2).sum().backward()
    torch.testing.assert_close((weight.grad, x.grad), expected)
    fenced = []
    weight.grad = x.grad = None
    recompute(lambda a, w: torch.tanh(a @ w), x, weight, fence=lambda t: fenced.append(t) or t).pow(2).sum().backward()
    torch.testing.assert_close((weight.grad, x.grad), expected)
    assert [t.shape for t in fenced[0]] == [x.shape, weight.shape, (2, 3)]  # the kept tensors, then the gradient
    with pytest.raises(ValueError, match="checkpoint: 'all' is not a mode; use one of always, except_last, never"):
        check_mode("all")


def test_layer_norm_rewrite_matches_torch_and_is_used_in_the_mode():
    x = torch.randn(2, 5, 8)
    weight, bias = torch.randn(8), torch.randn(8)
    torch.testing.assert_close(layer_norm(x, (8,), weight, bias), F.layer_norm(x, (8,), weight, bias),
                               rtol=1e-5, atol=1e-5)
    norm = torch.nn.LayerNorm(8)

    def normalise(t):
        with ShardableOps():
            return norm(t)

    ops = {str(node.target) for node in make_fx(normalise)(x).graph.nodes}
    assert not any("layer_norm" in op for op in ops) and "aten.rsqrt.default" in ops
    torch.testing.assert_close(normalise(x), norm(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mask", ["none", "causal", "per_row", "per_head", "per_head_3d", "square", "bool", "gqa"])
def test_attention_run_heads_first_matches_torch_and_its_gradients(mask):
    """``heads_leading_attention`` (attention on ``[heads, rows, ...]``, so that under
    vmap the heads split over "tensor" lead the fold) is torch's attention: a mask per
    row, per head (4-D, or 3-D broadcast over the rows: as many rows as heads, so that
    a mask lined up with the wrong dim would go unnoticed but for the values), one
    square mask, boolean, causal, and grouped-query key/value heads; inside the mode
    (as the clock loop runs blocks), and through the hashed dropout's ``p = 0`` path."""
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(4, 4, 5, 8, generator=generator, requires_grad=True)
    heads = 2 if mask == "gqa" else 4
    key, value = (torch.randn(4, heads, 5, 8, generator=generator, requires_grad=True) for _ in range(2))
    masks = {"per_row": torch.randn(4, 1, 5, 5, generator=generator), "per_head": torch.randn(4, 4, 5, 5),
             "per_head_3d": torch.randn(4, 5, 5, generator=generator), "square": torch.randn(5, 5),
             "bool": torch.rand(4, 1, 5, 5, generator=generator) > 0.3}
    kwargs = {"attn_mask": masks.get(mask), "is_causal": mask == "causal", "enable_gqa": mask == "gqa"}

    def attend(attention):
        out = attention(query, key, value, **kwargs)
        grads = torch.autograd.grad(out.square().sum(), (query, key, value))
        return out, *grads

    def in_the_loops_mode(*args, **kw):
        with ShardableOps(), hashed_dropout(torch.tensor(0, dtype=torch.int32), 0):
            return F.scaled_dot_product_attention(*args, **kw)

    expected = attend(F.scaled_dot_product_attention)
    for got in (attend(heads_leading_attention), attend(in_the_loops_mode)):
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    if mask == "per_row":  # once: the mode runs attention heads first
        traced = make_fx(lambda q, k, v: in_the_loops_mode(q, k, v, **kwargs))(query, key, value)
        assert "aten.transpose.int" in {str(node.target) for node in traced.graph.nodes}


HLO = """
HloModule step

%body (p: (f32[2])) -> (f32[2]) {
  %cp = f32[1,4]{1,0} collective-permute(f32[1,4]{1,0} %x), channel_id=1, source_target_pairs={{0,2},{1,3}}
}

ENTRY %main () -> f32[] {
  %w = (f32[2]) while(%t), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"7"},"known_init_step":{"init":"0","step":"1"}}
  %ar = f32[4,8]{1,0} all-reduce(%g), channel_id=2, replica_groups={{0,1},{2,3}}, to_apply=%add
  %ag = bf16[16]{0} all-gather-start(%h), replica_groups=[2,2]<=[2,2]T(1,0), dimensions={0}
}
"""


def test_hashed_attention_dropout_gives_a_query_that_sees_nothing_zeros_not_nan():
    """As torch's own attention does: an all-False mask row (a padding row, an idle
    cell of the pipeline) must not put NaN into the gradients."""
    original = F.scaled_dot_product_attention
    query, key, value = (torch.randn(2, 1, 4, 8, requires_grad=True) for _ in range(3))
    mask = torch.ones(2, 1, 4, 4, dtype=torch.bool)
    mask[1] = False  # the second row attends to nothing
    with hashed_dropout(torch.tensor(7, dtype=torch.int32), slot=0):
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=0.5)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert out[0].abs().sum() > 0
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (query, key, value))
    assert F.scaled_dot_product_attention is original, "restored after the block"


def test_side_inputs_pack_into_the_stream_and_come_back_bit_for_bit():
    stream = torch.randn(3, 4, 2)
    mask = torch.rand(3, 1, 4, 4) > 0.5
    positions = torch.arange(12).view(3, 4)
    packing = packing_for(stream, [mask, positions])
    packed = packing.pack([stream, mask, positions])
    assert packed.shape == (3, 8 + 16 + 4) and packed.dtype == torch.float32
    unpacked = packing.unpack(packed)
    assert torch.equal(unpacked[0], stream) and torch.equal(unpacked[1], mask) and torch.equal(unpacked[2], positions)
    assert unpacked[1].dtype == torch.bool and unpacked[2].dtype == torch.int64
    changed = packing.with_stream(packed, stream + 1)
    assert torch.equal(packing.stream(changed), stream + 1) and torch.equal(changed[:, 8:], packed[:, 8:])
    with pytest.raises(ValueError, match="int64 tensor .* cannot hold its values exactly"):
        packing_for(stream.bfloat16(), [positions])


def test_a_packing_for_tensor_devices_gives_each_a_contiguous_share_of_whole_parts_of_every_piece():
    """With ``ways`` tensor devices the packed features are ``ways`` contiguous shares
    (what each device carries between stages), each holding its part of every piece,
    the pieces padded to divide: slicing never cuts a piece's part."""
    stream = torch.randn(3, 4, 2)  # 8 features: parts of 3, one padded
    mask = torch.rand(3, 1, 5) > 0.5  # 5 features: parts of 2, one padded
    packing = packing_for(stream, [mask], ways=3)
    packed = packing.pack([stream, mask])
    assert packed.shape == (3, 3 * (3 + 2))
    shares = packed.view(3, 3, 5)
    for way in range(3):
        assert torch.equal(shares[:, way, :3], F.pad(stream.flatten(1), (0, 1))[:, 3 * way:3 * way + 3])
        assert torch.equal(shares[:, way, 3:], F.pad(mask.flatten(1).float(), (0, 1))[:, 2 * way:2 * way + 2])
    unpacked = packing.unpack(packed)
    assert torch.equal(unpacked[0], stream) and torch.equal(unpacked[1], mask)
    changed = packing.with_stream(packed, stream + 1)
    assert torch.equal(packing.stream(changed), stream + 1) and torch.equal(packing.unpack(changed)[1], mask)


def test_hlo_parser_reads_kinds_sizes_groups_and_loops():
    found = collectives(HLO)
    assert [(c.kind, c.bytes, c.in_loop) for c in found] == [
        ("collective-permute", 16, True), ("all-reduce", 128, False), ("all-gather", 32, False)]
    assert found[0].groups == ((0, 2), (1, 3))
    assert found[1].groups == ((0, 1), (2, 3))
    assert found[2].groups == ((0, 2), (1, 3))


def test_the_per_iteration_view_gives_each_loop_body_its_collectives_and_trip_count():
    report = CommunicationReport(tuple(collectives(HLO)), "step.txt", None, loop_trips(HLO))
    (body,) = report.loops()
    assert (body.name, body.trips) == ("body", 7)
    assert body.count("collective-permute") == 1 and body.bytes_of("collective-permute") == 16
    assert body.count("all-reduce") == 0  # the step's own all-reduce runs once, outside the loop
    assert "per iteration of body (7 iterations): collective-permute x1 over -" in str(report)
    with pytest.raises(ValueError, match="kind: 'allreduce' is not a collective"):
        body.count("allreduce")


def test_the_report_reads_what_the_buffer_assignment_allocates(tmp_path):
    """``allocated_bytes``: parameters, outputs and the packed temporary buffer, as the
    buffer assignment XLA dumps beside the program totals them; None without one."""
    program = tmp_path / "module_0001.step.cpu_after_optimizations.txt"
    program.write_text(HLO)
    (tmp_path / "module_0001.step.cpu_after_optimizations-buffer-assignment.txt").write_text(
        "BufferAssignment:\nallocation 0: size 1200, preallocated-temp:\n\nTotal bytes used: 1300 (1.27KiB)\n\n"
        "Stack trace breakdown for peak usage: 1 024 bytes\n")
    assert CommunicationReport((), str(program), 1024).allocated_bytes == 1300
    assert CommunicationReport((), str(tmp_path / "module_0002.cpu_after_optimizations.txt")).allocated_bytes is None


ASSIGNMENT = """BufferAssignment:
allocation 0: size 180, preallocated-temp:
 value: <1 a @0> (size=100,offset=0): f32[25]{0}
 value: <2 loop.param{1} (phi) @0> (size=50,offset=100): f32[5,2]{1,0}
 value: <3 in_place @0> (size=100,offset=0): f32[25]{0}
 value: <4 c @0> (size=100,offset=0): f32[25]{0}
 value: <5 d @0> (size=30,offset=150): f32[5,2]{1,0}
allocation 1: size 8, parameter 0, shape |f32[2]| at ShapeIndex {}:
 value: <6 p @0> (size=8,offset=0): f32[2]{0}

Total bytes used: 188 (188B)

Stack trace breakdown for peak usage: 108 bytes

HloLiveRange (max 6):
  InstructionSequence:
    0:p
  BufferLiveRange:
    p{}:0-6
    a{}:0-2
    loop.param{1}:1-5
    in_place{}:2-3
    c{}:4-5
    d{}:2-3
"""


def test_the_report_reads_the_most_the_buffers_hold_at_once_from_their_live_ranges(tmp_path):
    """``resident_bytes``: each value's live range and size, the loop-carried (phi) ones
    included, and a value that takes another's place in place (same allocation, same
    offset) counted once; None without a buffer assignment's live ranges."""
    program = tmp_path / "module_0001.step.cpu_after_optimizations.txt"
    program.write_text(HLO)
    (tmp_path / "module_0001.step.cpu_after_optimizations-buffer-assignment.txt").write_text(ASSIGNMENT)
    report = CommunicationReport((), str(program), 108)
    assert report.resident_bytes == 8 + 100 + 50 + 30  # at 2 and 3: p, a or in_place, the loop's value, d
    assert report.allocated_bytes == 188
    assert CommunicationReport((), str(tmp_path / "module_0002.cpu_after_optimizations.txt")).resident_bytes is None


MATMULS = """
HloModule step

%fused (a: f32[4,8], b: f32[8,2]) -> f32[4,2] {
  %a = f32[4,8]{1,0} parameter(0)
  %b = f32[8,2]{1,0} parameter(1)
  ROOT %inner = f32[4,2]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%body (p: (f32[4,8])) -> (f32[4,8]) {
  %x = f32[3,4,8]{2,1,0} parameter(0)
  %y = f32[3,8,5]{2,1,0} parameter(1)
  %batched = f32[3,4,5]{2,1,0} dot(%x, %y), lhs_batch_dims={0}, lhs_contracting_dims={2}, rhs_batch_dims={0}, rhs_contracting_dims={1}
  %f = f32[4,2]{1,0} fusion(%u, %v), kind=kOutput, calls=%fused
}

ENTRY %main () -> f32[] {
  %w = (f32[4,8]) while(%t), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}
  %l = f32[6,16]{1,0} parameter(0)
  %once = f32[6,1]{1,0} dot(%l, %r), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""


def test_matmul_flops_counts_each_dot_as_often_as_its_computation_runs():
    """2 x result x contracted: the entry's dot once, the loop body's (and the fusion it
    calls) five times."""
    once = 2 * 6 * 16
    batched, fused = 2 * 3 * 4 * 5 * 8, 2 * 4 * 2 * 8
    assert matmul_flops(MATMULS) == once + 5 * (batched + fused)


def test_kernels_counts_what_runs_as_work_of_its_own_as_often_as_it_runs():
    """The entry's dot once; the loop body's dot and fusion five times each, not the
    dot the fusion holds nor the parameters, the while or its tuple; the bytes of
    their float32 results as often. A reduction counts, not what it calls."""
    assert kernels(MATMULS) == Kernels(1 + 5 * 2, 4 * (6 * 1 + 5 * (3 * 4 * 5 + 4 * 2)))

    reduced = """
HloModule step

%sum (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %add = f32[] add(%a, %b)
}

%body (p: (s64[], f32[8])) -> (s64[], f32[8]) {
  %p = (s64[], /*index=1*/f32[8]{0}) parameter(0)
  %x = f32[8]{0} get-tuple-element(%p), index=1
  %r = f32[] reduce(%x, %zero), dimensions={0}, to_apply=%sum
  ROOT %t = (s64[], /*index=1*/f32[8]{0}) tuple(%i, %x)
}

ENTRY %main () -> f32[] {
  %w = (s64[], /*index=1*/f32[8]{0}) while(%t), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
}
"""
    # The reduction three times (not the add it calls); the loop's tuple-typed lines (their
    # types hold brackets and XLA's index comments) are not work.
    assert kernels(reduced) == Kernels(3, 3 * 4)


def test_hlo_dump_folder_is_removed_at_exit_unless_the_caller_named_it(tmp_path):
    named = tmp_path / "kept"
    script = ("import sys, xpipe.inspect; "
              "print(xpipe.inspect.enable_hlo_dump(sys.argv[1] if len(sys.argv) > 1 else None))")
    runs = [subprocess.Popen([sys.executable, "-c", script, *argv], stdout=subprocess.PIPE, text=True)
            for argv in ([], [str(named)])]  # side by side: each spends its time importing torch_xla
    made, kept = (run.communicate(timeout=300)[0].strip() for run in runs)
    assert [run.returncode for run in runs] == [0, 0]
    assert made and not Path(made).exists()
    assert Path(kept) == named and named.is_dir()


def test_bytes_per_device_outside_spmd_counts_each_tensor_once_on_its_device():
    import torch_xla

    import xpipe.inspect

    a = torch.zeros(4, 4, device=torch_xla.device(0))
    b = torch.zeros(8, device=torch_xla.device(1))
    assert xpipe.inspect.bytes_per_device([a, b, a]) == {str(a.device): 64, str(b.device): 32}


def test_tensors_tied_to_an_anchor_keep_their_values_and_wait_for_their_own_row_of_it():
    """``xpipe.spmd.ordering.tied_to``: every tensor is ``[devices, ...]``; each device's
    row depends on that device's row of the anchor only (a NaN there shows it), and
    integer tensors pass as they are."""
    from xpipe.spmd.ordering import tied_to

    anchor, state, ids = torch.randn(2, 3, 4), torch.randn(2, 5), torch.arange(2)
    tied_state, tied_ids = tied_to([state, ids], anchor)
    assert torch.equal(tied_state, state) and tied_ids is ids
    anchor[1, 0, 0] = float("nan")
    tied_state, _ = tied_to([state, ids], anchor)
    assert torch.equal(tied_state[0], state[0]) and tied_state[1].isnan().all()


def test_values_read_after_an_anchor_keep_their_values_and_dtypes_whatever_the_anchor_holds():
    """``xpipe.spmd.ordering.read_after``: floats, integers (labels) and bools keep their
    values and dtypes, a non-finite anchor included; the float's gradient passes."""
    from xpipe.spmd.ordering import read_after

    hidden = torch.randn(3, requires_grad=True)
    labels, mask = torch.tensor([3, -100, 7]), torch.tensor([True, False, True])
    for anchor in (torch.randn(2, 4), torch.full((2, 4), float("nan")), torch.full((2, 4), float("inf"))):
        tied = read_after({"hidden": hidden, "labels": labels, "mask": mask, "flag": None}, anchor)
        assert tied["flag"] is None
        for name, value in (("hidden", hidden), ("labels", labels), ("mask", mask)):
            assert tied[name].dtype == value.dtype and torch.equal(tied[name], value), name
    tied["hidden"].sum().backward()
    assert torch.equal(hidden.grad, torch.ones(3))


def test_a_tensor_behind_an_anchor_keeps_its_values_and_hands_the_anchor_a_zero_gradient():
    """``xpipe.spmd.ordering.behind``: element by element, broadcast; the anchor's
    gradient is made from the tensor's (so that in the backward it comes after), zero."""
    from xpipe.spmd.ordering import behind

    x, anchor = torch.randn(2, 3, 4, requires_grad=True), torch.randn(2, 1, 4, requires_grad=True)
    tied = behind(x, anchor)
    assert torch.equal(tied, x)
    tied.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x)) and torch.equal(anchor.grad, torch.zeros_like(anchor))

def test_the_profile_counts_attention_probabilities_however_attention_is_called(monkeypatch):
    """What a layer saves counts each attention call's ``[..., queries, keys]``
    probabilities beside what torch saved (XLA keeps them; torch's fused CPU kernel does
    not), its query and key given by position or by name; nothing where no gradient is
    wanted."""
    import xpipe.capture.graph
    from xpipe.capture.graph import module_graph

    class Attention(torch.nn.Module):
        def __init__(self, by_name: bool) -> None:
            super().__init__()
            self.proj, self.by_name = torch.nn.Linear(8, 8), by_name

        def forward(self, x):
            q = self.proj(x).view(2, 5, 2, 4).transpose(1, 2)
            if self.by_name:
                return F.scaled_dot_product_attention(query=q, key=q, value=q)
            return F.scaled_dot_product_attention(q, q, q)

    def saved(by_name: bool, grad: bool = True) -> int:
        model = torch.nn.Sequential(Attention(by_name), torch.nn.Flatten())
        model.requires_grad_(grad)
        graph = module_graph(model, torch.randn(2, 5, 8))
        return sum(graph.nodes[layer].get("activation_bytes", 0) for layer in graph.graph["layers"])

    counted = {by_name: saved(by_name) for by_name in (False, True)}
    monkeypatch.setattr(xpipe.capture.graph._AttentionProbabilities, "__torch_dispatch__",
                        lambda self, func, types, args=(), kwargs=None: func(*args, **(kwargs or {})))
    probabilities = 2 * 2 * 5 * 5 * 4  # rows, heads, queries, keys, float32
    assert counted[False] - saved(False) == counted[True] - saved(True) == probabilities
    monkeypatch.undo()
    assert saved(by_name=False, grad=False) == 0
