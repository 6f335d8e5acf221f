"""The planner's step peak against XLA's, across sequence lengths, widths and layout kinds.

    python tools/peak_grid.py                       # the whole grid: about an hour on 2 cores
    python tools/peak_grid.py --seq 64 --width 128  # one shape, every layout kind
    python tools/peak_grid.py --buffers 8           # and the 8 largest buffers live at XLA's peak
    python tools/peak_grid.py --measured tools/peak_grid_cells.jsonl --bands   # predict the measured cells again

For a Hugging Face Llama (8 layers, grouped-query attention, vocabulary 2048) and GPT-2
(8 layers, vocabulary 2048), 16 rows of ``--seq`` tokens at each width, on 8 emulated
devices: one forward and backward of an spmd ``Pipe`` under ``xpipe.inspect.audit``,
and ``xpipe.planner.predict`` for the same layout, less its optimizer term (the audited
program runs no optimizer). Prints one line per cell: predicted / measured, where
measured is the peak XLA's buffer assignment reports (``peak_bytes``), and, for cells
measured since each was recorded, predicted / what the buffer assignment allocates
(``allocated_bytes``) and predicted / the most its buffers hold at once, loop-carried
values included (``resident_bytes``; the reported peak can leave those out). With
``--buffers`` it also lists what XLA's buffer assignment holds at the peak, by size,
so that a term the planner lacks can be read off the listing. ``--save`` keeps each
measured cell (``tools/peak_grid_cells.jsonl`` holds the grid docs/planning.md quotes);
``--measured`` predicts saved cells again, in seconds, and ``--bands`` prints
``xpipe.planner.accuracy.BANDS`` and the table from them.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
from pathlib import Path

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "8")

import torch  # noqa: E402

import xpipe  # noqa: E402
import xpipe.inspect  # noqa: E402

DUMP = xpipe.inspect.enable_hlo_dump(os.environ.get("PEAK_GRID_DUMP"))

from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM  # noqa: E402

from xpipe.planner import Layout, predict, preset  # noqa: E402
from xpipe.planner.profile import ModelProfile, profile_of_model  # noqa: E402

ROWS, LAYERS, VOCAB = 16, 8, 2048

# Each layout kind: stages, data, fsdp, tensor, chunks, schedule, virtual, checkpoint, gather, sequence parallel.
LAYOUTS = {
    "fsdp, except_last": Layout(2, 1, 4, 1, 4, "gpipe", 1, "except_last", "step"),
    "fsdp x tensor, always": Layout(2, 1, 2, 2, 4, "gpipe", 1, "always", "step"),
    "4 stages, except_last": Layout(4, 1, 2, 1, 8, "gpipe", 1, "except_last", "step"),
    "circular x2, always": Layout(2, 1, 4, 1, 4, "circular", 2, "always", "step"),
    "circular x2, except_last": Layout(2, 1, 4, 1, 4, "circular", 2, "except_last", "step"),
    "8 stages, except_last": Layout(8, 1, 1, 1, 8, "gpipe", 1, "except_last", "step"),
    "data x fsdp, except_last": Layout(2, 2, 2, 1, 4, "gpipe", 1, "except_last", "step"),
    "fsdp, per block": Layout(2, 1, 4, 1, 4, "gpipe", 1, "always", "block"),
    "fsdp x tensor, per block": Layout(2, 1, 2, 2, 4, "gpipe", 1, "always", "block"),
    "fsdp x tensor, sequence parallel": Layout(2, 1, 2, 2, 4, "gpipe", 1, "except_last", "step", True),
    "tensor, never": Layout(2, 1, 1, 4, 4, "gpipe", 1, "never", "step"),
    "tensor, never, sequence parallel": Layout(2, 1, 1, 4, 4, "gpipe", 1, "never", "step", True),
    "1f1b, 4 stages x 2 data": Layout(4, 2, 1, 1, 8, "1f1b", 1, "always", "step"),
    "1f1b, fsdp x tensor": Layout(2, 1, 2, 2, 4, "1f1b", 1, "always", "step"),
    "1f1b, fsdp, per block": Layout(2, 1, 4, 1, 4, "1f1b", 1, "always", "block"),
    "1f1b never, 4 stages x 2 data": Layout(4, 2, 1, 1, 8, "1f1b", 1, "never", "step"),
}


def llama(width: int, seq: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=width, intermediate_size=2 * width, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq, tie_word_embeddings=True,
        use_cache=False))


def gpt2(width: int, seq: int) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(
        vocab_size=VOCAB, n_positions=seq, n_embd=width, n_layer=LAYERS, n_head=4, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False))


FAMILIES = {"llama": llama, "gpt2": gpt2}


def inputs_of(seq: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (ROWS, seq), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids}


def measure(family: str, width: int, seq: int, layout: Layout) -> tuple[int, int, int, str]:
    """XLA's reported peak for one forward and backward of ``layout``, what its buffer
    assignment allocates, the most its buffers hold at once, and that assignment's file."""
    inputs = inputs_of(seq)
    pipe = xpipe.Pipe(FAMILIES[family](width, seq), chunks=layout.chunks,
                      mesh=xpipe.make_mesh(layout.stages, layout.data, fsdp=layout.fsdp, tensor=layout.tensor),
                      checkpoint=layout.checkpoint, gather=layout.gather, schedule=layout.schedule,
                      virtual=layout.virtual, sequence_parallel=layout.sequence_parallel,
                      sample_input={key: value[:2] for key, value in inputs.items()})
    report = xpipe.inspect.audit(lambda: pipe(**inputs).loss.backward(), mesh=pipe.mesh)
    return report.peak_bytes, report.allocated_bytes, report.resident_bytes, report.program.replace(
        "after_optimizations.txt", "after_optimizations-buffer-assignment.txt")


@functools.cache
def profile(family: str, width: int, seq: int) -> ModelProfile:
    sample = {key: value[:2] for key, value in inputs_of(seq).items()}
    return profile_of_model(FAMILIES[family](width, seq), sample)


def predicted(family: str, width: int, seq: int, layout: Layout) -> dict[str, int]:
    """The planner's terms for ``layout``, less the optimizer's state (the audited program runs no optimizer)."""
    prediction = predict(profile(family, width, seq), layout, chip=preset("v5e"), batch=ROWS)
    return {kind: value for kind, value in prediction.memory.items() if kind != "optimizer"}


def peak_buffers(assignment: str, count: int) -> list[str]:
    """Where XLA's buffer assignment puts the peak (the computation, e.g. a clock loop's
    body) and the ``count`` largest buffers live there, by size."""
    text = Path(assignment).read_text()
    live = re.search(r"Live ranges at \d+ \(peak\):\n((?:    .*\n)+)", text)
    where = re.findall(r"[├└]── (\S+) \(", text.split("Stack trace breakdown for peak usage", 1)[-1])
    if not live:
        return []
    buffers = re.findall(r"    (\S+): (\d+) bytes", live[1])
    biggest = sorted(buffers, key=lambda buffer: -int(buffer[1]))[:count]
    return [f"      peak in {' / '.join(where[:2])}"] + [f"      {int(size):>10,}  {name}" for name, size in biggest]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=sorted(FAMILIES), action="append")
    parser.add_argument("--seq", type=int, action="append", help="tokens a row (8, 64 and 256 by default)")
    parser.add_argument("--width", type=int, action="append", help="hidden size (64 and 128 by default)")
    parser.add_argument("--layout", choices=sorted(LAYOUTS), action="append")
    parser.add_argument("--buffers", type=int, default=0, help="list this many of the buffers live at the peak")
    parser.add_argument("--save", type=Path, help="append each measured cell to this JSON-lines file")
    parser.add_argument("--measured", type=Path, help="predict the cells of this --save file again; measure nothing")
    parser.add_argument("--bands", action="store_true",
                        help="then print xpipe.planner.accuracy.BANDS for these cells, and the table as markdown")
    args = parser.parse_args()
    if args.measured:
        cells = [json.loads(line) for line in args.measured.read_text().splitlines() if line.strip()]
    else:
        cells = [{"family": family, "width": width, "seq": seq, "layout": name}
                 for family in args.family or sorted(FAMILIES) for width in args.width or (64, 128)
                 for seq in args.seq or (8, 64, 256) for name in args.layout or LAYOUTS]
    print(f"{'family':<6} {'width':>5} {'seq':>4}  {'layout':<34} {'measured':>10} {'predicted':>10} {'ratio':>6}  "
          f"{'allocated':>10} {'ratio':>6}  {'resident':>10} {'ratio':>6}  "
          "terms (KiB: gathered, activations, parameters + gradients)")
    for cell in cells:
        family, width, seq, layout = cell["family"], cell["width"], cell["seq"], LAYOUTS[cell["layout"]]
        buffers = []
        if "measured" not in cell:
            cell["measured"], cell["allocated"], cell["resident"], assignment = measure(family, width, seq, layout)
            buffers = peak_buffers(assignment, args.buffers)
            if args.save:
                with args.save.open("a") as file:
                    file.write(json.dumps(cell) + "\n")
        terms = predicted(family, width, seq, layout)
        total = sum(terms.values())
        beside = "  ".join(f"{cell[key]:>10,} {total / cell[key]:>6.2f}" if cell.get(key) else f"{'-':>10} {'-':>6}"
                           for key in ("allocated", "resident"))
        kib = f"{terms['gathered'] // 1024}, {terms['activations'] // 1024}, " \
              f"{(terms['parameters'] + terms['gradients']) // 1024}"
        print(f"{family:<6} {width:>5} {seq:>4}  {cell['layout']:<34} {cell['measured']:>10,} {total:>10,} "
              f"{total / cell['measured']:>6.2f}  {beside}  {kib}", flush=True)
        for line in buffers:
            print(line, flush=True)
        cell["ratio"] = total / cell["measured"]
    if args.bands:
        print_bands(cells)


def print_bands(cells: list[dict]) -> None:
    """Each layout kind's lowest and highest ratio, as ``xpipe.planner.accuracy.BANDS``
    holds them, and every cell as a markdown table."""
    kinds: dict[str, list[float]] = {}
    for cell in cells:
        kinds.setdefault(LAYOUTS[cell["layout"]].kind, []).append(cell["ratio"])
    print("BANDS = {")
    for kind, ratios in sorted(kinds.items()):
        print(f'    "{kind}": Band({min(ratios):.2f}, {max(ratios):.2f}, {len(ratios)}),')
    print("}")
    print("| model | width | tokens | layout | XLA's peak (bytes) | planned | planned / XLA |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for cell in sorted(cells, key=lambda c: (c["family"], c["width"], c["seq"], list(LAYOUTS).index(c["layout"]))):
        layout = LAYOUTS[cell["layout"]]
        mesh = f"{layout.stages} x {layout.data} x {layout.fsdp} x {layout.tensor}"
        print(f"| {cell['family']} | {cell['width']} | {cell['seq']} | {cell['layout']} ({mesh}) | "
              f"{cell['measured']:,} | {round(cell['ratio'] * cell['measured']):,} | {cell['ratio']:.2f} |")


if __name__ == "__main__":
    main()
