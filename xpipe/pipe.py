"""``xpipe.Pipe``: wrap a model, keep the training loop.

    mesh = xpipe.make_mesh(stages=4)                  # 8 devices: 2 (data) x 4 (stage)
    pipe = xpipe.Pipe(model, chunks=8, mesh=mesh)
    optimizer = torch.optim.AdamW(pipe.parameters())
    for tokens, targets in batches:
        loss = F.cross_entropy(pipe(tokens).flatten(0, 1), targets.flatten().to(pipe.devices[-1]))
        loss.backward(); optimizer.step(); optimizer.zero_grad(); torch_xla.sync()

The spmd executor (``xpipe.spmd``) runs models with a run of identical blocks as one
SPMD program; the devices executor (``xpipe.devices``) runs any model, one XLA
device per stage.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch_xla.distributed.spmd as xs
from torch import nn
from torch.utils._pytree import tree_flatten

from xpipe._batch import batch_size, check_floating_inputs
from xpipe._checks import check_gather, check_positive_int
from xpipe._xla import kept_shardings, restore_shardings
from xpipe.build import ModelCapture, Options, build_devices, build_spmd, choose_executor
from xpipe.checkpoints.state import CheckpointState
from xpipe.partition import Partition
from xpipe.recompute import check_mode
from xpipe.schedule import Schedule, check_schedule
from xpipe.tensor.rules import check_rules


class Pipe(nn.Module):
    """A model run as a GPipe pipeline on XLA devices.

    Args:
        module: the model. Pipe takes it over: its layers move to the XLA
            device(s), keeping their Parameter objects (an optimizer built on
            them before wrapping still steps them), except the repeated blocks
            under spmd, which become stacked tensors of the Pipe's own: the
            blocks' old Parameters then refuse to be stepped or saved. Build the
            optimizer on ``pipe.parameters()``, after wrapping.
        chunks: microbatches per step; the batch is split into this many (a last
            batch that does not divide runs too, as in torchgpipe).
        stages: pipeline stages; defaults to the mesh's "stage" size, or
            ``len(balance)``, or the device count.
        balance: layers per stage, as ``xpipe.partition`` takes it. The spmd
            executor spreads the repeated blocks evenly over the stages, so a
            balance other than that split is an error there; the devices
            executor takes any balance.
        mesh: the spmd executor's mesh: axes "stage" and "data", "fsdp" to
            shard every stage's weights, gradients and optimizer state, and
            "tensor" to split each block's matrices over devices that share
            their rows (``xpipe.make_mesh(stages, data, fsdp=..., tensor=...)``);
            defaults to ``xpipe.make_mesh(stages)``.
        schedule: the schedule's name (``xpipe.schedule.SCHEDULES``). The spmd
            executor runs ``"gpipe"`` and ``"circular"`` (with ``pipe(x)`` or
            :meth:`step`); the devices executor runs every schedule with
            :meth:`step`, and with ``pipe(x)`` those whose forwards all come
            before their backwards (``"gpipe"``, ``"circular"``), or any under
            ``torch.no_grad()``. ``"auto"`` picks the devices executor for a
            schedule the spmd one does not run.
        virtual: model stages per device (or stage group, under spmd), for
            ``"interleaved"`` and ``"circular"`` (model stage ``s`` on device
            ``s % stages``); a ``balance`` then lists
            ``stages * virtual`` entries.
        loss_fn: ``loss_fn(output, target)`` for :meth:`step`, a scalar, e.g.
            ``torch.nn.CrossEntropyLoss()``. Its ``reduction`` (``"mean"`` or
            ``"sum"``) and ``ignore_index`` attributes say how the devices executor
            weighs the microbatches' losses (:mod:`xpipe.reduction`); a function
            without them (or a ``functools.partial`` of torch's loss function that
            gives them) is taken to mean over rows, checked on its first step and
            on every batch whose targets tell the two apart (see docs/api.md).
        checkpoint: ``"always"``, ``"except_last"`` or ``"never"``: which
            microbatches recompute their stage activations in the backward pass.
        deferred_batch_norm: devices executor: BatchNorm layers normalise each
            microbatch with its own statistics but update their running
            statistics once per step, over the whole mini-batch, as the
            unpipelined model does (torchgpipe's option). Under spmd the layers
            outside the stacked body already see the whole mini-batch at once.
        executor: ``"spmd"`` (one SPMD program over the mesh), ``"devices"`` (one
            XLA device per stage, any model) or ``"auto"``: spmd when a mesh is
            given, the process is already in SPMD mode, or the model has a
            stackable run of at least one identical block per stage; devices
            otherwise.
        sample_input: a batch as the model takes it (a tensor, a tuple, or a dict
            of keyword inputs), for models torch.fx cannot trace (Hugging Face
            transformers): xpipe captures them with torch.export on it, with the
            batch dim left free, in the mode the model is in.
        tensor_rules: on a mesh with a "tensor" axis, which dim of each block
            weight it splits: parameter-name patterns (``fnmatch``) to a dim, or
            to None to keep a weight whole; tried before the built-in rules of
            :mod:`xpipe.tensor.rules`, which cover Llama-like models, GPT-2, BERT,
            T5, ``nn.TransformerEncoderLayer``, OPT, GPT-NeoX, and the experts
            of Mixtral and Qwen2-MoE.
        gather: spmd executor, on a mesh with "fsdp": when the body's weights are
            gathered from their shards. ``"step"``: once per step, before the
            clock loop (each device holds its stage's weights whole for the
            step). ``"block"``: each block slot's weights inside the loop, right
            before the block runs, and again for its backward (ZeRO-3): a device
            holds one block's weights whole at a time, for an all-gather and a
            reduce-scatter per block per clock. It recomputes every block, so it
            takes ``checkpoint="always"``. See docs/scaling.md.
        sequence_parallel: spmd executor, on a mesh with "tensor": hold the stream
            between the blocks' tensor-parallel regions (a block's input, its
            residual adds and norms) as each tensor device's slice of the
            sequence (Megatron's sequence parallelism): the tensors a block saves
            at the stream's width take 1/T of the memory, the reduction after a
            row-parallel linear is a reduce-scatter and the column-parallel
            linears read the sequence through an all-gather of the same bytes.
            For models whose blocks take ``[batch, seq, ..., features]``. See
            docs/scaling.md.

    Attributes:
        partition: the :class:`xpipe.Partition` in use.
        schedule: the :class:`xpipe.schedule.Schedule` every step runs (under spmd,
            ``chunks`` rounded up to a multiple of the stages: the padding
            microbatches run too).
        executor: ``"spmd"`` or ``"devices"``, the one chosen.
        devices: the XLA devices in use, in stage order; the output is on ``devices[-1]``.

    Calling ``pipe(x)`` with ``x`` batch-first (a tensor, or a tuple of tensors)
    returns what ``module(x)`` returns, batch-first; ``pipe(x, microbatch_dim=d)``
    takes ``x`` with a dim ``d`` of size ``chunks`` and keeps that layout.
    Every argument is checked before the process's XLA runtime is touched.
    """

    def __init__(
        self,
        module: nn.Module,
        chunks: int,
        *,
        stages: int | None = None,
        balance: Sequence[int] | None = None,
        mesh: xs.Mesh | None = None,
        schedule: str = "gpipe",
        virtual: int = 1,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        checkpoint: str = "except_last",
        deferred_batch_norm: bool = False,
        executor: str = "auto",
        sample_input: Any = None,
        tensor_rules: Mapping[str, int | None] | None = None,
        gather: str = "step",
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"module: expected a torch.nn.Module, got {type(module).__name__}")
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"loss_fn: expected a callable loss_fn(output, target), got {type(loss_fn).__name__}")
        self.__dict__["loss_fn"] = loss_fn  # not a submodule: the loss is not part of the model's state
        options = _checked_options(chunks, stages, balance, mesh, schedule, virtual, checkpoint, deferred_batch_norm,
                                   tensor_rules, gather, sequence_parallel)
        self.chunks, self.checkpoint, self.virtual = options.chunks, options.checkpoint, options.virtual
        capture = ModelCapture(module, sample_input)
        self.executor = choose_executor(executor, capture, options)
        self._original_keys = list(module.state_dict(keep_vars=True))
        built = (build_spmd if self.executor == "spmd" else build_devices)(capture, options)
        self.runner = built.runner
        self.partition: Partition = built.partition
        self.schedule: Schedule = built.schedule
        self.mesh: xs.Mesh | None = built.mesh
        self.devices: list[torch.device] = built.devices
        if not module.training:
            self.eval()  # a model wrapped in eval mode stays in eval mode

    def forward(self, *inputs: torch.Tensor, microbatch_dim: int | None = None, **keyword_inputs: torch.Tensor):
        inputs, microbatch_dim = self._prepared(inputs, keyword_inputs, microbatch_dim)
        return self.runner(*inputs, microbatch_dim=microbatch_dim)

    def step(self, inputs: Any, target: Any, *, microbatch_dim: int | None = None) -> torch.Tensor:
        """One training step with the loss inside the pipeline: runs the whole schedule
        (forwards, ``loss_fn`` of each microbatch on the last stage, backwards) and
        adds to ``.grad`` the gradients of ``loss_fn(module(inputs), target)``.

        Args:
            inputs: what ``pipe(...)`` takes: a tensor, a tuple of tensors, or a dict
                of keyword inputs.
            target: what ``loss_fn`` takes beside the output, batch-first (a tensor
                or a structure of them), split into microbatches as the inputs are.
            microbatch_dim: as for ``pipe(x, microbatch_dim=d)``, for inputs and target.

        Returns:
            The loss of the whole batch (detached), on the last stage's device.
        """
        if self.loss_fn is None:
            raise ValueError("loss_fn: pipe.step computes the loss inside the pipeline; build the Pipe with "
                             "loss_fn=... (e.g. torch.nn.CrossEntropyLoss()), or call pipe(x) and compute it yourself")
        inputs, microbatch_dim = self._prepared(*_positional_and_keyword(inputs), microbatch_dim)
        _check_target(target, batch_size(inputs, self.chunks, microbatch_dim), self.chunks, microbatch_dim)
        return self.runner.step(inputs, target, self.loss_fn, microbatch_dim)

    def _prepared(self, inputs: tuple, keyword_inputs: dict[str, Any],
                  microbatch_dim: int | None) -> tuple[tuple, int | None]:
        """The model's inputs in order, checked, and ``microbatch_dim`` made non-negative."""
        if len(inputs) == 1 and isinstance(inputs[0], (tuple, list)) and len(self.runner.input_names) > 1:
            inputs = tuple(inputs[0])  # pipe((x, y)) for forward(x, y); forward(pair) gets the tuple
        inputs = _in_order(inputs, keyword_inputs, self.runner.input_names)
        if not inputs:
            raise TypeError("x: pass the model's input (a tensor, or a tuple of tensors)")
        batch_size(inputs, self.chunks, microbatch_dim)
        check_floating_inputs(inputs, next((p.dtype for p in self.parameters() if p.is_floating_point()), None))
        if microbatch_dim is not None:
            microbatch_dim %= tree_flatten(inputs)[0][0].dim()
        return inputs, microbatch_dim

    def _apply(self, fn, recurse: bool = True):
        raise TypeError(  # torchgpipe's type for a refused move
            "pipe: a Pipe's weights are placed on their XLA devices (and sharded, under spmd) when it is "
            "built; .to(), .cpu(), .cuda(), .half() and the like would move them out from under the "
            "pipeline. Convert the model before wrapping it (model.to(dtype)), or take pipe.state_dict() "
            "for a copy elsewhere")

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        """The wrapped module's state: exactly its keys and shapes, the body unstacked."""
        state = OrderedDict() if destination is None else destination
        for key in self._original_keys:
            tensor = self.runner.state.state_tensor(key)
            state[prefix + key] = tensor if keep_vars else tensor.detach()
        return state

    def host_state_dict(self) -> dict[str, torch.Tensor]:
        """``state_dict()`` as CPU copies, fetched a whole tensor at a time: under spmd,
        moving each block's view of the stacked weights would compile a program per view."""
        return self.runner.state.host_state(self._original_keys)

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True, assign: bool = False):
        """Load a state dict of the wrapped module (as ``module.state_dict()`` gives)."""
        missing = [k for k in self._original_keys if k not in state_dict]
        unexpected = [k for k in state_dict if k not in self._original_keys]
        if strict and (missing or unexpected):
            raise RuntimeError(f"state_dict: missing keys {missing}, unexpected keys {unexpected}")
        targets = {key: self.runner.state.state_tensor(key) for key in state_dict if key in self._original_keys}
        _copy_into(targets, state_dict, [*self.parameters(), *self.buffers()])
        return nn.modules.module._IncompatibleKeys(missing, unexpected)

    def checkpoint_state(self) -> CheckpointState:
        """The wrapped module's state as ``xpipe.save`` and ``xpipe.load`` read and
        write it (:mod:`xpipe.checkpoints.state`): the executor's own view of it."""
        return self.runner.state

    def checkpoint_layout(self) -> dict[str, Any]:
        """The layout a checkpoint's manifest records (a load into any layout ignores it)."""
        mesh = None if self.mesh is None else dict(zip(self.mesh.axis_names, map(int, self.mesh.mesh_shape)))
        return {"executor": self.executor, "stages": len(self.partition.balance),
                "balance": list(self.partition.balance), "mesh": mesh}

    def named_gradients(self) -> dict[str, torch.Tensor | None]:
        """Gradients under the wrapped module's parameter names, the body unstacked."""
        return self.runner.state.named_gradients()


def _checked_options(chunks: int, stages: int | None, balance: Sequence[int] | None, mesh: xs.Mesh | None,
                     schedule: str, virtual: int, checkpoint: str, deferred_batch_norm: bool,
                     tensor_rules: Mapping[str, int | None] | None, gather: str, sequence_parallel: bool) -> Options:
    """``Pipe``'s arguments checked, each refused by name before any device work."""
    chunks = check_positive_int(chunks, "chunks")
    checkpoint = check_mode(checkpoint)
    if not isinstance(deferred_batch_norm, bool):
        raise ValueError(f"deferred_batch_norm: must be True or False, got {deferred_batch_norm!r}")
    virtual = check_positive_int(virtual, "virtual")
    check_schedule(schedule, virtual)  # an unknown name, or a virtual it cannot run, fails before device work
    if not isinstance(sequence_parallel, bool):
        raise ValueError(f"sequence_parallel: must be True or False, got {sequence_parallel!r}")
    return Options(chunks, stages, balance, mesh, schedule, virtual, checkpoint, deferred_batch_norm,
                   check_rules(tensor_rules), check_gather(gather, checkpoint), sequence_parallel)


def _positional_and_keyword(inputs: Any) -> tuple[tuple, dict[str, Any]]:
    """What ``pipe.step`` was given as the model's inputs, as ``pipe(...)``'s positional
    and keyword inputs: a dict is keywords, a tuple or list positional, else one input."""
    if isinstance(inputs, Mapping):
        return (), dict(inputs)
    return (tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)), {}


def _copy_into(targets: dict[str, torch.Tensor], state_dict: Mapping[str, torch.Tensor],
               held: list[torch.Tensor]) -> None:
    """``state_dict``'s tensors copied into ``targets`` by key, each checked for its
    target's shape first; the shardings of the ``held`` tensors kept as they were."""
    for key, target in targets.items():
        if target.shape != state_dict[key].shape:
            raise RuntimeError(f"state_dict: {key!r} has shape {list(state_dict[key].shape)}, "
                               f"expected {list(target.shape)}")
    shardings = kept_shardings(held)
    with torch.no_grad():
        for key, target in targets.items():
            target.copy_(state_dict[key].to(target.device, target.dtype))
    restore_shardings(shardings)


def _in_order(inputs: tuple, keyword_inputs: dict[str, Any], names: tuple[str, ...]) -> tuple:
    """Positional and keyword inputs as one tuple in the order of the model's inputs."""
    if not keyword_inputs:
        return inputs
    unknown = [key for key in keyword_inputs if key not in names[len(inputs):]]
    missing = [name for name in names[len(inputs):] if name not in keyword_inputs]
    if unknown or missing:
        raise TypeError(f"x: the pipelined model takes the inputs {list(names)}; got {len(inputs)} positional and "
                        f"keywords {list(keyword_inputs)} (unknown: {unknown}, missing: {missing}). A model "
                        "captured with torch.export takes exactly the inputs of its sample_input")
    return inputs + tuple(keyword_inputs[name] for name in names[len(inputs):])


def _check_target(target: Any, rows: int, chunks: int, microbatch_dim: int | None) -> None:
    """``pipe.step``'s target is split as the inputs are: it needs their batch size."""
    try:
        target_rows = batch_size((target,), chunks, microbatch_dim)
    except (TypeError, ValueError) as error:
        raise type(error)(f"target: {error}") from error
    if target_rows != rows:
        raise ValueError(f"target: has {target_rows} rows and the inputs {rows}; pass one target row per "
                         "input row (pipe.step splits both into the same microbatches)")


