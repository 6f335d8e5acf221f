"""Operations a captured graph may call that XLA runs wrongly, and what runs instead.

A library's own operator (``torch.library.custom_op``) runs on an XLA device with
no error and can still compute something else: Hugging Face's mixture-of-experts
blocks call ``transformers::grouped_mm_fallback``, whose kernel writes each
expert's rows into a slice of its output with ``torch.mm(..., out=...)``; run as a
custom op on XLA, those writes never reach the output, which stays zero (measured
with torch_xla 2.9: the experts' output and every expert and router gradient are
lost, in silence). The same blocks count tokens per expert with ``torch.histc``,
which torch_xla's eager path refuses on integers and ``torch.vmap`` cannot batch
(with it inside the spmd executor's stacked blocks, the process crashed). xpipe
rewrites such calls in the graphs it captures to functions of plain torch
operations with the same meaning. (xpipe captures transformers' experts layers in
a dense form, :mod:`xpipe.capture.experts`, which calls neither; these rewrites serve the
graphs where that form is not chosen.)

The substitute also suits XLA better than the original: it has static shapes (the
original slices by token counts read back to the host, so every new routing would
compile a new program), at the cost of one matmul per expert over all the rows.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.fx


def grouped_mm(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Each run of rows of ``input`` times its expert's matrix.

    Args:
        input: ``[S, in]``, rows sorted by expert.
        weight: ``[E, in, out]``, one matrix per expert.
        offs: ``[E]``, where each expert's rows end (cumulative row counts).

    Returns:
        ``[S, out]``: row ``r`` is ``input[r] @ weight[e]`` for the expert ``e`` whose
        rows hold ``r``.
    """
    rows = torch.arange(input.shape[0], device=input.device)
    expert_of_row = (rows.unsqueeze(1) >= offs.to(rows.dtype).unsqueeze(0)).sum(1)  # [S]: ends passed
    output = input.new_zeros(input.shape[0], weight.shape[2])
    for expert in range(weight.shape[0]):
        mine = (expert_of_row == expert).unsqueeze(1).to(input.dtype)  # [S, 1]
        output = output + mine * (input @ weight[expert])
    return output


def histc(input: torch.Tensor, bins: int = 100, min: float = 0.0, max: float = 0.0) -> torch.Tensor:
    """``torch.histc`` in operations that ``torch.vmap`` and XLA both run (XLA has no
    histogram for the counts a mixture-of-experts router takes, and vmap no batching
    rule): each value's bin, one-hot, summed. A range left to the data (``min ==
    max``) is ``torch.histc``'s own."""
    if min >= max:
        return torch.histc(input, bins, min, max)
    values = input.reshape(-1)
    low, high, span = _range_as_torch_computes_it(input.dtype, min, max)
    inside = (values >= low) & (values <= high)
    # torch's own order, (x - min) * bins / (max - min), in the input's dtype: a value on a bin's edge
    # lands where torch puts it (a product by bins / (max - min) rounds otherwise); max goes in the last bin.
    bin_of = ((values - low) * bins / span).floor().long().clamp(0, bins - 1)
    one_hot = (bin_of.unsqueeze(1) == torch.arange(bins, device=input.device)) & inside.unsqueeze(1)
    return one_hot.sum(0).to(input.dtype)


def _range_as_torch_computes_it(dtype: torch.dtype, min: float, max: float) -> tuple[float, float, float]:
    """``min``, ``max`` and ``max - min`` rounded as ``torch.histc`` rounds them: to the
    input's floating dtype (float32 for integer inputs), the difference taken in it."""
    dtype = dtype if dtype.is_floating_point else torch.float32
    low, high = torch.tensor(min, dtype=dtype), torch.tensor(max, dtype=dtype)
    return low.item(), high.item(), (high - low).item()


# an operator's name, as fx prints a call's target -> what runs in its place
SUBSTITUTES: dict[str, Callable[..., torch.Tensor]] = {
    "transformers.grouped_mm_fallback.default": grouped_mm,
    "aten.histc.default": histc,
}


def substitute_operators(traced: torch.fx.GraphModule) -> list[str]:
    """Rewrite, in place, the calls of ``traced`` to operators in :data:`SUBSTITUTES`;
    returns the names of those it found."""
    found = []
    for node in traced.graph.nodes:
        name = str(node.target)
        if node.op == "call_function" and name in SUBSTITUTES:
            node.target = SUBSTITUTES[name]
            found.append(name)
    if found:
        traced.recompile()
    return found
