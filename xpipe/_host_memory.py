"""The host's memory: what the process holds (measured), and what it freed handed
back to the system while a checkpoint streams.

A load (and a save) frees and allocates buffers of one tensor's size, tensor after
tensor, from several threads: torch's for the host buffers, the XLA runtime's for
the device data (which, on the CPU emulation, is host memory too). glibc keeps
what each thread's arena freed for that arena, and after a large block is freed it
raises its threshold for serving blocks straight from the system, so a freed
tensor's memory is seldom reused by the next: a load of a 32-block model grew the
process by 1.6x the checkpoint's tensors while holding about one tensor at a time
(``tools/bench_checkpoint.py --blocks 32``). ``malloc_trim`` returns the free pages
of every arena, so the process grows by what is held, not by what was held once.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import threading
import time


@functools.cache
def _malloc_trim() -> ctypes._CFuncPtr | None:
    """glibc's ``malloc_trim``, or None where the C library has none (macOS, musl)."""
    name = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(name), "malloc_trim")
    except (OSError, AttributeError, TypeError):
        return None


def give_back_freed_memory() -> None:
    """Return the memory the C library holds free to the system; nothing where it
    cannot. It walks every arena: call it after freeing megabytes, not bytes."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def resident_bytes() -> int:
    """The process's resident memory now (Linux's ``/proc/self/statm``)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakResident:
    """The process's peak resident memory while the block runs, sampled every
    millisecond, from what it held at the start with the C library's free memory
    handed back (so that what an earlier action freed does not hide this one's
    growth): ``growth`` is what the block cost the host."""

    def __enter__(self) -> PeakResident:
        give_back_freed_memory()
        self.start = self.peak = resident_bytes()
        self._running = True
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while self._running:
            self.peak = max(self.peak, resident_bytes())
            time.sleep(0.001)

    def __exit__(self, *_: object) -> None:
        self._running = False
        self._thread.join()
        self.peak = max(self.peak, resident_bytes())

    @property
    def growth(self) -> int:
        return self.peak - self.start
