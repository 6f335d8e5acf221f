"""What one device holds at each moment of an spmd step, by kind: the plan's peak is
the largest of them.

The spmd executor's step is one XLA program: the layers before the body, the
forward clock loops (one that keeps only each clock's input, for recomputation,
then one that keeps everything), the loss, and the backward loops in reverse. XLA
sizes a loop's carried stacks for all of its clocks when the loop begins (each
clock writes its slice into them), so what a loop keeps for the backward is held
whole from its first clock on, and stays until the backward loop that reads it
has run. The moments here follow that program:

- ``forward clock c``: the weights at rest, those gathered for the step, the
  conveyor's slots, the stacks of every forward loop begun so far, and the cell
  the clock runs;
- ``loss``: everything the forward kept, the logits of the layers after the body
  and, from here on, the gradients of the layers around the body;
- ``backward clock c``: the stacks of the loops whose backward has not finished,
  the gradients of the gathered body too, the cell the clock differentiates (recomputed where its loop
  kept only the input), and the gradient of an attention's probabilities, which
  XLA makes whole while the probabilities are held.

docs/planning.md derives the terms and lists, per layout kind, how close the
peak comes to XLA's on the emulated devices (``tools/peak_grid.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

KINDS = ("parameters", "gradients", "optimizer", "gathered", "activations")


@dataclass(frozen=True)
class Moment:
    """One point of the step and the bytes one device holds there, by kind (KINDS)."""

    label: str
    memory: dict[str, int]

    @property
    def bytes(self) -> int:
        return sum(self.memory.values())


@dataclass(frozen=True)
class Timeline:
    """A step's moments in program order (see the module's docstring)."""

    moments: tuple[Moment, ...]

    @property
    def peak(self) -> Moment:
        """The first moment that holds the most."""
        return max(self.moments, key=lambda moment: moment.bytes)


@dataclass(frozen=True)
class StepTerms:
    """The bytes each part of a step holds on one device, as the planner counts them."""

    resting: dict[str, int]  # parameters, gradients, optimizer: the whole step
    gathered: int  # the weights gathered for the step (or a block slot's), the whole step
    gathered_gradients: int  # their gradients, in the backward clocks
    outer_gradients: int  # of those, the layers around the body's: from the loss on
    kept_weights: int  # the body's weights the recomputing loop keeps for its backward, per clock
    kept_round_weights: int  # those the keeping loop keeps per clock: the round's the cell ran
    conveyor: int  # the conveyor's slots and the stage state, the whole step
    recomputing_input: int  # what a recomputing clock keeps: its input
    keeping_cell: int  # what a keeping clock keeps: everything its cell saves
    working: int  # one cell's activations while it runs (forward, recomputation or backward)
    attention_gradient: int  # the gradient of one attention's probabilities, in each backward clock
    loss: int  # the logits of the layers after the body, at the loss
    loss_accumulator: int  # the float32 head gradient the segmented loss adds up
    recomputing: int  # forward clocks of the loop that recomputes
    keeping: int  # forward clocks of the loop that keeps


def step_timeline(terms: StepTerms) -> Timeline:
    """The moments of one step (see the module's docstring) from its ``terms``."""
    clocks = terms.recomputing + terms.keeping
    moments = []

    def at(label: str, stacks: int, kept: int, gradients: int, activations: int) -> None:
        memory = {**terms.resting, "gathered": terms.gathered + kept + gradients,
                  "activations": terms.conveyor + stacks + activations}
        moments.append(Moment(label, memory))

    def held(keeping_loop: bool) -> tuple[int, int]:
        """The activations and the weights the live stacks keep: the recomputing loop's
        always (it runs first, its backward last), the keeping loop's while ``keeping_loop``."""
        activations = terms.recomputing * terms.recomputing_input + terms.keeping * terms.keeping_cell * keeping_loop
        weights = terms.recomputing * terms.kept_weights + terms.keeping * terms.kept_round_weights * keeping_loop
        return activations, weights

    for clock in range(clocks):
        stacks, kept = held(clock >= terms.recomputing)
        at(f"forward clock {clock}", stacks, kept, 0, terms.working if clock < terms.recomputing else 0)
    stacks, kept = held(True)
    at("loss", stacks, kept, terms.outer_gradients + terms.loss_accumulator, terms.loss)
    for clock in reversed(range(clocks)):
        stacks, kept = held(clock >= terms.recomputing)
        recomputed = clock < terms.recomputing  # a kept cell's backward reads its stack entry
        at(f"backward clock {clock}", stacks, kept, terms.gathered_gradients,
           (terms.working if recomputed else 0) + terms.attention_gradient)
    return Timeline(tuple(moments))


@dataclass(frozen=True)
class LockstepTerms:
    """The bytes each part of a 1F1B step under the spmd executor holds on one device
    (:mod:`xpipe.spmd.one_f_one_b`). Its loops keep no stacks that grow with the clocks:
    each stage input waits in a ring of ``2S - 1`` slots, and every backward recomputes
    its cell from it."""

    resting: dict[str, int]  # parameters, gradients, optimizer: the whole step
    gathered: int  # the weights gathered for the step and the carry their gradients add up in
    buffers: int  # the slot buffer, the ring of stashed inputs and the streams: the whole step
    forward: int  # what the clock's forward holds while it runs, keeping nothing: one block's activations
    working: int  # one recomputed cell's activations, in each backward
    attention_gradient: int  # the gradient of one attention's probabilities, in each backward
    head: int  # one microbatch's logits and their gradient, in each steady clock
    head_gradient: int  # the head's weight gradient of the clock and its sum with the carry
    reduced: int  # after the loops: the carry the gradients are reduced from, and the layers before the body's
    entering: int  # before the loops, beside the gathered weights: what gathering the layers around the body holds
    warm_up: int  # clocks of forwards alone
    steady: int  # clocks of a forward, the head and a backward


def lockstep_timeline(terms: LockstepTerms) -> Timeline:
    """The moments of a 1F1B step: one a loop, whose clocks all hold the same."""
    def at(label: str, activations: int) -> Moment:
        return Moment(label, {**terms.resting, "gathered": terms.gathered,
                              "activations": terms.buffers + activations})

    # A steady clock's forward and backward read nothing of each other's: XLA may run them side by side.
    backward = terms.working + terms.attention_gradient
    steady = terms.forward + backward
    loops = [("warm-up loop (forwards)", terms.warm_up, terms.forward),
             ("steady loop (forward, head, backward)", terms.steady, steady + terms.head),
             ("steady loop (forward, head's weight gradient, backward)", terms.steady * bool(terms.head_gradient),
              steady + terms.head_gradient),
             ("cool-down loop (backwards)", terms.warm_up, backward)]
    moments = [at(label, activations) for label, clocks, activations in loops if clocks]
    if terms.entering:
        moments.insert(0, Moment("before the loops (weights gathered)", {
            **terms.resting, "gathered": terms.gathered + terms.entering, "activations": terms.buffers}))
    reduced = Moment("after the loops (gradients reduced)", {**terms.resting, "gathered": terms.reduced,
                                                              "activations": terms.buffers})
    return Timeline((*moments, reduced))
