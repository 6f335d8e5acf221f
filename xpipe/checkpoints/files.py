"""A checkpoint's directory on disk: what it consists of, how it is checked, and how a
finished one is put in place.

A checkpoint is a directory of DCP's data files, ``training.pt`` (the step, the
caller's ``extra``, the optimizer's param groups by parameter name, the
random-number states) and ``manifest.json`` (the layout it was saved from, every
key's shape and dtype, every file's CRC-32). Writes are atomic: a checkpoint is
written into a staging directory beside ``path``, which replaces ``path`` only
when complete and durable, in one step: ``path`` holds the old checkpoint or the
new one at every instant. Only a directory that holds an xpipe checkpoint (or
nothing) is ever replaced: a user's own files are never moved or deleted.
"""

from __future__ import annotations

import ctypes
import errno
import glob
import json
import os
import shutil
import warnings
import zlib
from pathlib import Path
from typing import Any

FORMAT = 1
MANIFEST = "manifest.json"
TRAINING = "training.pt"


def check_replaceable(path: Path) -> None:
    """Raise unless ``path`` is free, an empty directory, or a directory holding an xpipe
    checkpoint and nothing else: a save replaces it whole, and must never take a
    user's own files with it."""
    if not path.parent.is_dir():
        raise FileNotFoundError(f"path: the directory {str(path.parent)!r} that should hold the checkpoint "
                                "does not exist; create it first")
    if not path.exists() and not path.is_symlink():
        return
    if not path.is_dir():
        raise FileExistsError(f"path: {str(path)!r} is a file, not a checkpoint directory; xpipe.save writes a "
                              "directory there and leaves your file alone: choose another path")
    entries = set(os.listdir(path))
    if not entries:
        return
    ours = _checkpoint_files(path)
    if ours is None:
        raise FileExistsError(f"path: {str(path)!r} holds files that are not an xpipe checkpoint "
                              f"({', '.join(sorted(entries)[:5])}); xpipe.save replaces the whole directory, so "
                              "it refuses: save to a new or empty directory (e.g. a 'checkpoint' folder inside it)")
    foreign = sorted(entries - ours)
    if foreign:
        raise FileExistsError(f"path: the checkpoint directory {str(path)!r} also holds {foreign[:5]}, which "
                              "xpipe.save did not write and would delete when it replaces the checkpoint; move "
                              "them elsewhere, or save to another directory")



def _checkpoint_files(path: Path) -> set[str] | None:
    """The names of the files an xpipe checkpoint at ``path`` consists of, read from its
    manifest; None if ``path`` holds no xpipe manifest."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        return {MANIFEST, *manifest["files"]} if "format" in manifest else None
    except (OSError, ValueError, KeyError, TypeError):
        return None



def check_shared(staging: Path) -> None:
    """Raise unless this process sees the staging directory process 0 made: the hosts
    must write into one directory."""
    if not staging.is_dir():
        raise FileNotFoundError(f"path: process 0 made the staging directory {str(staging)!r}, which this "
                                "process does not see; on several hosts the checkpoint's directory must lie on a "
                                "filesystem every host mounts at the same path")



def checksum(file: Path) -> str:
    """The file's CRC-32 (as zip files keep one per member): it changes with any
    truncation or flipped byte, and costs less than half a SHA-256."""
    crc = 0
    with open(file, "rb") as stream:
        for block in iter(lambda: stream.read(1 << 22), b""):
            crc = zlib.crc32(block, crc)
    return f"{crc:08x}"



def fsync(path: Path) -> None:
    """Make ``path`` (a file, or a directory's entries) durable: after a power loss the
    new checkpoint is whole, or the previous one is still in place."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)



def put_in_place(path: Path, staging: Path) -> None:
    """Put the complete checkpoint ``staging`` at ``path``, so that at every instant
    ``path`` holds the old checkpoint or the new one: the two directories swap in one
    step (Linux's ``renameat2(RENAME_EXCHANGE)``), and ``staging`` then holds the old
    one, which the caller removes. Where the filesystem cannot swap, the old one is
    renamed aside first (``.NAME.PID.replaced``), and :func:`readable_checkpoint` finds
    it there if the save stops between the two renames."""
    if not path.exists():
        os.rename(staging, path)
    elif not _exchanged(staging, path):
        retired = path.with_name(f".{path.name}.{os.getpid()}{RETIRED}")
        os.rename(path, retired)
        os.rename(staging, path)
        fsync(path.parent)
        shutil.rmtree(retired)
    fsync(path.parent)
    for stale in _retired_beside(path):  # left by a save that stopped between its renames
        shutil.rmtree(stale, ignore_errors=True)


RETIRED = ".replaced"
_RENAME_EXCHANGE, _AT_FDCWD = 2, -100


def _exchanged(a: Path, b: Path) -> bool:
    """Swap the directories ``a`` and ``b`` in one step; False where this system or
    filesystem cannot (no ``renameat2``, or it refuses the flag)."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    error = ctypes.get_errno()
    if error in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(error, os.strerror(error), str(b))


def _retired_beside(path: Path) -> list[Path]:
    """The checkpoints a save renamed aside from ``path`` and did not remove, newest first."""
    found = [entry for entry in path.parent.glob(f".{glob.escape(path.name)}.*{RETIRED}")
             if entry.is_dir() and _checkpoint_files(entry) is not None]
    return sorted(found, key=lambda entry: entry.stat().st_mtime, reverse=True)


def readable_checkpoint(path: Path) -> Path:
    """Where the checkpoint at ``path`` is: ``path`` itself, or, where a save stopped
    between renaming the old checkpoint aside and the new one in (no manifest at
    ``path``), the old one beside it."""
    if (path / MANIFEST).is_file():
        return path
    retired = _retired_beside(path) if path.parent.is_dir() else []
    if retired:
        warnings.warn(f"xpipe.load: {str(path)!r} holds no checkpoint: a save stopped while it replaced the "
                      f"previous one, which is read from {str(retired[0])!r}; the next save to {str(path)!r} "
                      "removes it", stacklevel=3)
        return retired[0]
    return path



def checked_manifest(path: Path) -> dict[str, Any]:
    """The manifest, once every file it lists is there with its hash."""
    manifest_file = path / MANIFEST
    if not manifest_file.is_file():
        raise ValueError(f"checkpoint: {str(manifest_file)!r} does not exist: {str(path)!r} is not an xpipe "
                         "checkpoint, or its save did not finish")
    try:
        manifest = json.loads(manifest_file.read_text())
        files = manifest["files"]
    except (json.JSONDecodeError, KeyError, TypeError) as error:
        raise ValueError(f"checkpoint: {str(manifest_file)!r} is damaged ({error})") from error
    for name, digest in files.items():
        file = path / name
        if not file.is_file():
            raise ValueError(f"checkpoint: {str(file)!r} is missing")
        if checksum(file) != digest:
            raise ValueError(f"checkpoint: {str(file)!r} is truncated or corrupted (its CRC-32 differs from "
                             "the one written at save time)")
    return manifest
