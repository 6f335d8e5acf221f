"""xpipe.collectives on 8 emulated devices: values and gradients against a host-side
reference written slice by slice, the collectives in the optimized HLO, peak memory
of all_gather and reduce_scatter, and errors for bad arguments. First, the smoke
test of SPMD itself: a real sharded XLA computation on the 8 devices.
"""

import xpipe.inspect

xpipe.inspect.enable_hlo_dump()  # before the runtime starts  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import torch_xla  # noqa: E402
import torch_xla.distributed.spmd as xs  # noqa: E402
import torch_xla.runtime as xr  # noqa: E402

from xpipe import collectives  # noqa: E402
from xpipe.mesh import make_mesh, spmd_device  # noqa: E402

N = 4  # the "stage" axis of a 2 (data) x 4 (stage) mesh
MiB = 2**20


@pytest.fixture(scope="module")
def mesh():
    return make_mesh(N, 2)


def stacked_on_device(host: torch.Tensor, mesh, axis: str = "stage") -> torch.Tensor:
    x = host.to(spmd_device())
    xs.mark_sharding(x, mesh, (axis,) + (None,) * (x.dim() - 1))
    torch_xla.sync()
    return x


# Host references, one output slice at a time.
def combine(slices, op):
    stacked = torch.stack(slices)
    return {"sum": stacked.sum(0), "mean": stacked.mean(0), "max": stacked.amax(0), "min": stacked.amin(0)}[op]


def shift_ref(x, offset):
    return torch.stack([x[i - offset] if 0 <= i - offset < len(x) else torch.zeros_like(x[0]) for i in range(len(x))])


def rotate_ref(x, offset):
    return torch.stack([x[(i - offset) % len(x)] for i in range(len(x))])


def send_ref(x, src, dst):
    return torch.stack([x[src] if i == dst else torch.zeros_like(x[0]) for i in range(len(x))])


def broadcast_ref(x, src):
    return torch.stack([x[src] for _ in range(len(x))])


def scatter_ref(x, dim):
    return torch.stack(list(x.chunk(N, dim)))


def gather_ref(x, dst, dim):
    whole = torch.cat(list(x), dim - 1)
    return torch.stack([whole if i == dst else torch.zeros_like(whole) for i in range(len(x))])


def reduce_ref(x, dst, op):
    total = combine(list(x), op)
    return torch.stack([total if i == dst else torch.zeros_like(total) for i in range(len(x))])


def all_gather_ref(x, dim):
    return torch.stack([torch.cat(list(x), dim - 1) for _ in range(len(x))])


def reduce_scatter_ref(x, dim, op):
    return torch.stack(list(combine(list(x), op).chunk(len(x), dim - 1)))


def all_to_all_ref(x, split_dim, concat_dim):
    return torch.stack([torch.cat([x[j].chunk(len(x), split_dim - 1)[i] for j in range(len(x))], concat_dim - 1)
                        for i in range(len(x))])


# (name, helper call, reference, input shape, collectives expected in the forward program)
CASES = [
    ("shift", lambda x, m: collectives.shift(x, 1, mesh=m), lambda x: shift_ref(x, 1), (N, 6),
     {"collective-permute": 1}),
    ("shift back 2", lambda x, m: collectives.shift(x, -2, mesh=m), lambda x: shift_ref(x, -2), (N, 6),
     {"collective-permute": 1}),
    ("rotate", lambda x, m: collectives.rotate(x, 3, mesh=m), lambda x: rotate_ref(x, 3), (N, 6),
     {"collective-permute": 1}),
    ("send", lambda x, m: collectives.send(x, 1, 3, mesh=m), lambda x: send_ref(x, 1, 3), (N, 6),
     {"collective-permute": 1}),
    ("send to itself", lambda x, m: collectives.send(x, 2, 2, mesh=m), lambda x: send_ref(x, 2, 2), (N, 6), {}),
    ("broadcast", lambda x, m: collectives.broadcast(x, 2, mesh=m), lambda x: broadcast_ref(x, 2), (N, 3, 2),
     {"all-reduce": 1}),
    ("gather", lambda x, m: collectives.gather(x, 3, 2, mesh=m), lambda x: gather_ref(x, 3, 2), (N, 3, 2),
     {"all-gather": 1}),
    ("reduce sum", lambda x, m: collectives.reduce(x, 0, mesh=m), lambda x: reduce_ref(x, 0, "sum"), (N, 6),
     {"all-reduce": 1}),
    ("reduce max", lambda x, m: collectives.reduce(x, 1, "max", mesh=m), lambda x: reduce_ref(x, 1, "max"),
     (N, 6), {"all-reduce": 1}),
    ("all_gather", lambda x, m: collectives.all_gather(x, 1, mesh=m), lambda x: all_gather_ref(x, 1), (N, 3, 2),
     {"all-gather": 1}),
    ("all_gather dim 2", lambda x, m: collectives.all_gather(x, 2, mesh=m), lambda x: all_gather_ref(x, 2),
     (N, 3, 2), {"all-gather": 1}),
    ("reduce_scatter", lambda x, m: collectives.reduce_scatter(x, 1, mesh=m),
     lambda x: reduce_scatter_ref(x, 1, "sum"), (N, 8), {"collective-permute": N - 1}),
    ("reduce_scatter mean dim 2", lambda x, m: collectives.reduce_scatter(x, 2, "mean", mesh=m),
     lambda x: reduce_scatter_ref(x, 2, "mean"), (N, 3, 8), {"collective-permute": N - 1}),
    ("reduce_scatter min", lambda x, m: collectives.reduce_scatter(x, 1, "min", mesh=m),
     lambda x: reduce_scatter_ref(x, 1, "min"), (N, 8), {"collective-permute": N - 1}),
    ("all_to_all", lambda x, m: collectives.all_to_all(x, 1, 2, mesh=m), lambda x: all_to_all_ref(x, 1, 2),
     (N, 8, 2), {"all-to-all": 1}),
    ("all_to_all same dim", lambda x, m: collectives.all_to_all(x, 2, 2, mesh=m), lambda x: all_to_all_ref(x, 2, 2),
     (N, 3, 8), {"all-to-all": 1}),
]


def test_eight_devices_in_spmd_mode():
    spmd_device()
    assert xr.is_spmd()
    assert xr.global_runtime_device_count() == 8


def test_sharded_matmul_matches_cpu():
    spmd_device()
    mesh = xs.Mesh(np.arange(8), (2, 4), ("data", "stage"))
    x = torch.arange(64 * 16, dtype=torch.float32).reshape(64, 16) / 100
    w = torch.linspace(-1, 1, 16 * 8).reshape(16, 8)
    x_xla = x.to(torch_xla.device())
    w_xla = w.to(torch_xla.device())
    xs.mark_sharding(x_xla, mesh, ("data", None))
    xs.mark_sharding(w_xla, mesh, (None, "stage"))
    result = (x_xla @ w_xla).sum(0)  # reduces over the sharded "data" axis
    torch.testing.assert_close(result.cpu(), (x @ w).sum(0), rtol=1e-5, atol=1e-4)
    spec = torch_xla._XLAC._get_xla_sharding_spec(x_xla)
    assert spec.startswith("{devices=[2,1,4]"), spec


@pytest.mark.parametrize("name, helper, reference, shape, expected", CASES, ids=[c[0] for c in CASES])
def test_values_gradient_and_lowering(mesh, name, helper, reference, shape, expected):
    generator = torch.Generator().manual_seed(len(name))
    host = torch.randn(shape, generator=generator)
    weights = torch.randn(reference(host).shape, generator=generator)

    x = stacked_on_device(host, mesh)
    report = xpipe.inspect.audit(lambda: helper(x, mesh))
    found = {kind: report.count(kind) for kind in xpipe.inspect.KINDS if report.count(kind)}
    assert found == expected, f"{name} lowered to\n{report}"

    x.requires_grad_()
    output = helper(x, mesh)
    (output * weights.to(x.device)).sum().backward()
    torch_xla.sync()
    reference_input = host.clone().requires_grad_()
    expected_output = reference(reference_input)
    (expected_output * weights).sum().backward()
    torch.testing.assert_close(output.cpu(), expected_output.detach())  # fp32 defaults
    torch.testing.assert_close(x.grad.cpu(), reference_input.grad)


def test_scatter_keeps_each_positions_chunk(mesh):
    host = torch.randn(5, 8)
    x = host.to(spmd_device())
    xs.mark_sharding(x, mesh, (None, None))
    torch_xla.sync()
    report = xpipe.inspect.audit(lambda: collectives.scatter(x, 1, mesh=mesh))
    assert [op.kind for op in report.ops] == []
    torch.testing.assert_close(collectives.scatter(x, 1, mesh=mesh).cpu(), scatter_ref(host, 1))


def test_send_along_the_data_axis(mesh):
    host = torch.randn(2, 6)
    x = stacked_on_device(host, mesh, axis="data")
    report = xpipe.inspect.audit(lambda: collectives.send(x, 0, 1, mesh=mesh, axis="data"))
    (permute,) = report.of("collective-permute")
    assert all(b - a == 1 for a, b in permute.groups), "data replicas are neighbours: devices s*2+d"
    torch.testing.assert_close(collectives.send(x, 0, 1, mesh=mesh, axis="data").cpu(), send_ref(host, 0, 1))


def test_all_gather_and_reduce_scatter_memory():
    """A 16 MiB float32 shard per device on 8 devices: peak device memory from XLA's
    buffer assignment. all_gather stays within output + input + 10%; reduce_scatter
    holds input + twice its output (a ring: one chunk in flight, one arriving),
    less than the all-reduce that the plain expression becomes."""
    ring = make_mesh(8)
    shard = 4 * MiB  # float32 elements: 16 MiB
    flat = torch.ones(8 * shard).to(spmd_device())
    xs.mark_sharding(flat, ring, ("stage",))
    torch_xla.sync()

    def plain_all_gather():
        whole = flat * 1
        xs.mark_sharding(whole, ring, (None,))
        return whole

    plain = xpipe.inspect.audit(plain_all_gather)
    gathered = xpipe.inspect.audit(lambda: collectives.all_gather(flat.view(8, shard), 1, mesh=ring))
    bound = 16 * MiB + 128 * MiB
    print(f"all_gather peak {gathered.peak_bytes / MiB:.1f} MiB, plain XLA all-gather {plain.peak_bytes / MiB:.1f} "
          f"MiB, output + input {bound / MiB:.0f} MiB")
    assert gathered.count("all-gather") == 1
    assert gathered.peak_bytes <= 1.1 * bound

    full = torch.ones(8, 8 * shard // 8).to(spmd_device())  # each device holds 16 MiB, reduced to 2 MiB
    xs.mark_sharding(full, ring, ("stage", None))
    torch_xla.sync()
    scattered = xpipe.inspect.audit(lambda: collectives.reduce_scatter(full, 1, mesh=ring))

    def plain_reduce_scatter():
        piece = full.sum(0).view(8, shard // 8)
        xs.mark_sharding(piece, ring, ("stage", None))
        return piece

    all_reduced = xpipe.inspect.audit(plain_reduce_scatter)
    bound = 16 * MiB + 2 * MiB
    print(f"reduce_scatter peak {scattered.peak_bytes / MiB:.1f} MiB, sum-then-slice {all_reduced.peak_bytes / MiB:.1f}"
          f" MiB, output + input {bound / MiB:.0f} MiB")
    assert scattered.count("collective-permute") == 7 and scattered.count("all-reduce") == 0
    assert scattered.peak_bytes <= 1.01 * (16 * MiB + 2 * 2 * MiB), "input, one chunk in flight, one arriving"
    assert scattered.peak_bytes < all_reduced.peak_bytes


def test_bad_arguments_name_themselves(mesh):
    x = stacked_on_device(torch.zeros(N, 6), mesh)
    with pytest.raises(ValueError, match=r"axis: the mesh has axes \('data', 'stage'\), not 'pipe'"):
        collectives.send(x, 0, 1, mesh=mesh, axis="pipe")
    with pytest.raises(ValueError, match="x: dim 0 has size 4 but axis 'data' has 2 positions"):
        collectives.broadcast(x, 0, mesh=mesh, axis="data")
    with pytest.raises(ValueError, match=r"dst: must be a position on axis 'stage', 0 \.\. 3, got 4"):
        collectives.send(x, 0, 4, mesh=mesh)
    with pytest.raises(ValueError, match=r"src: must be a position on axis 'stage', 0 \.\. 3, got -1"):
        collectives.broadcast(x, -1, mesh=mesh)
    with pytest.raises(ValueError, match=r"dim: x of shape \[4, 6\] has no dim 2; dim 0 is the stacked axis"):
        collectives.all_gather(x, 2, mesh=mesh)
    with pytest.raises(ValueError, match="dim: x of shape \\[4, 6\\] has no dim 0"):
        collectives.gather(x, 1, 0, mesh=mesh)
    with pytest.raises(ValueError, match="split_dim: size 6 of dim 1 does not split into 4 equal chunks"):
        collectives.all_to_all(x, 1, 1, mesh=mesh)
    with pytest.raises(ValueError, match="op: 'prod' is not a reduction"):
        collectives.reduce(x, 0, "prod", mesh=mesh)
    with pytest.raises(ValueError, match="offset: must be a non-zero int smaller in size than dim 0"):
        collectives.shift(x, 4)
    with pytest.raises(TypeError, match="mesh: expected a torch_xla.distributed.spmd.Mesh, got str"):
        collectives.all_gather(x, 1, mesh="stage")
    with pytest.raises(TypeError, match=r"mesh: expected a torch_xla.distributed.spmd.Mesh, got NoneType; "
                                        r"pass mesh=xpipe.make_mesh\(stages\)"):
        collectives.broadcast(x, 0, mesh=None)
