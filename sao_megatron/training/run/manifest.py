"""Checkpoint manifests: every file's size and CRC-32, computed while the file is written.

Megatron's dist-checkpointing writer (``FileSystemWriterAsync.write_preloaded_data``, used by the
sync save and by megatron-core's ``mcore`` async save alike) opens each ``__R_I.distcp`` file with
the name ``open`` from its module. Inside :func:`hashing_writes` that name resolves to
:class:`HashingFile`, which forwards every write to the real file and folds the same bytes into a
CRC-32 (zlib releases the GIL, so the writer threads keep writing in parallel). On close it leaves
a small sidecar ``<file>.crc32`` next to the file: the async writer runs in a forked process, so
the digests come back through the file system, not through memory. No byte is read back.

:func:`write_manifest` (rank 0, after every rank finished writing, before the checkpoint
directory is published) turns the sidecars into ``manifest.json``, the last file written.
Files written outside the hooked path (``metadata.json``, ``.metadata``, ``trainer_state.json``,
RNG states: kilobytes to megabytes) are hashed by reading them once; a large file without a
write-time digest gets its size only, with a warning.

:func:`verify_manifest` checks each file's size (stat) and CRC, split across ranks (each file is
read by one rank); every problem names its file. :func:`find_resumable` walks ``step_N``
directories newest first and returns the first complete one.

The hook replaces a module attribute of megatron-core for the duration of a save (restored on
exit). If a megatron-core upgrade stops opening files through it, nothing breaks: the data files
are then hashed by reading (or get sizes only above ``READ_HASH_LIMIT``), and the component test
that requires ``"hashed": "write"`` for every ``.distcp`` file fails.
"""

from __future__ import annotations

import builtins
import contextlib
import io
import json
import logging
import os
import pathlib
import re
import zlib
from collections.abc import Callable, Iterator
from typing import Any

from sao_megatron.errors import SaoError

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
SIDECAR = ".crc32"
READ_HASH_LIMIT = 64 << 20
"""Files without a write-time digest are hashed by reading them only up to this size."""
_STEP_DIR = re.compile(r"^step_(\d{8})$")
_CHUNK = 64 << 20


class CorruptCheckpointError(SaoError):
    """A checkpoint's files do not match its manifest (truncated, altered, missing) or it has none."""


class HashingFile(io.RawIOBase):
    """A binary file opened for writing whose bytes are CRC-32'd on their way to disk.

    ``close()`` writes ``<path>.crc32`` = ``{"size": bytes written, "crc32": "%08x"}``.
    """

    def __init__(self, path: str | os.PathLike, mode: str = "wb"):
        super().__init__()
        self._f = builtins.open(path, mode)
        self.path = os.fspath(path)
        self.size, self.crc = 0, 0

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        n = self._f.write(view)
        self.crc = zlib.crc32(view[:n], self.crc)
        self.size += n
        return n

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._f.tell()

    def flush(self) -> None:
        self._f.flush()

    def fileno(self) -> int:
        return self._f.fileno()

    def close(self) -> None:
        if self.closed:
            return
        super().close()  # flushes first
        self._f.close()
        with builtins.open(self.path + SIDECAR, "w") as f:
            json.dump({"size": self.size, "crc32": f"{self.crc:08x}"}, f)


def _hashing_open(file, mode="r", *args, **kwargs):
    """``open`` for megatron's writer module: binary writes from the start are hashed."""
    if mode in ("wb", "bw") and not args and not kwargs:
        return HashingFile(file, mode)
    return builtins.open(file, mode, *args, **kwargs)


@contextlib.contextmanager
def hashing_writes() -> Iterator[None]:
    """Within the block, megatron's dist-checkpoint writer hashes the files it writes.

    Scoped: the module name is restored on exit (an async save's forked writer keeps the hook it
    was forked with). Checked by the tests: every ``.distcp`` file of a save gets a sidecar.
    """
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "open", None) is _hashing_open:  # nested (actor + critic inside one)
        yield
        return
    filesystem_async.open = _hashing_open
    try:
        yield
    finally:
        del filesystem_async.open


def _crc_of_file(path: pathlib.Path) -> str:
    crc = 0
    with builtins.open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def _checkpoint_files(ckpt_dir: pathlib.Path) -> list[pathlib.Path]:
    return sorted(p for p in ckpt_dir.rglob("*") if p.is_file() and p.name != MANIFEST
                  and not p.name.endswith(SIDECAR) and not p.name.endswith(".tmp"))


def _file_entry(path: pathlib.Path) -> dict[str, Any]:
    size = path.stat().st_size
    sidecar = pathlib.Path(str(path) + SIDECAR)
    if sidecar.is_file():
        side = json.loads(sidecar.read_text())
        if side["size"] == size:
            return {"size": size, "crc32": side["crc32"], "hashed": "write"}
        log.warning("%s: %d bytes on disk but %d written through the hash; hashing it again", path, size,
                    side["size"])
    if size <= READ_HASH_LIMIT:
        return {"size": size, "crc32": _crc_of_file(path), "hashed": "read"}
    log.warning("%s (%d bytes) was written outside the hashed path: its manifest entry has its size only",
                path, size)
    return {"size": size, "crc32": None, "hashed": "none"}


def write_manifest(ckpt_dir: str | os.PathLike) -> dict[str, Any]:
    """Rank 0, once every rank's files are on disk: write ``ckpt_dir/manifest.json`` (last) and
    remove the sidecars. Returns the manifest ``{"version": 1, "files": {relpath: entry}}``."""
    ckpt_dir = pathlib.Path(ckpt_dir)
    files = {p.relative_to(ckpt_dir).as_posix(): _file_entry(p) for p in _checkpoint_files(ckpt_dir)}
    manifest = {"version": 1, "files": files, "total_bytes": sum(e["size"] for e in files.values())}
    tmp = ckpt_dir / (MANIFEST + ".tmp")
    with builtins.open(tmp, "w") as f:
        json.dump(manifest, f, indent=0)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, ckpt_dir / MANIFEST)
    for side in ckpt_dir.rglob("*" + SIDECAR):
        side.unlink()
    return manifest


def read_manifest(ckpt_dir: str | os.PathLike) -> dict[str, Any]:
    path = pathlib.Path(ckpt_dir) / MANIFEST
    if not path.is_file():
        raise CorruptCheckpointError(f"{ckpt_dir} has no {MANIFEST}: the save did not finish (or the "
                                     "checkpoint predates manifests)")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CorruptCheckpointError(f"{path} is unreadable ({exc})") from exc


def verify_manifest(ckpt_dir: str | os.PathLike, *, checksums: bool = True, rank: int = 0,
                    world_size: int = 1) -> list[str]:
    """Problems found in ``ckpt_dir`` (empty: complete), among the files ``i % world_size == rank``
    (each rank checks its share: sizes by stat, CRCs by reading the file once)."""
    ckpt_dir = pathlib.Path(ckpt_dir)
    try:
        files = read_manifest(ckpt_dir)["files"]
    except CorruptCheckpointError as exc:
        return [str(exc)]
    problems = []
    for i, (rel, entry) in enumerate(sorted(files.items())):
        if i % world_size != rank:
            continue
        path = ckpt_dir / rel
        if not path.is_file():
            problems.append(f"{path} is missing")
        elif (size := path.stat().st_size) != entry["size"]:
            problems.append(f"{path} has {size} bytes, the manifest says {entry['size']} (truncated or altered)")
        elif checksums and entry["crc32"] and _crc_of_file(path) != entry["crc32"]:
            problems.append(f"{path}: CRC-32 differs from the manifest (the file is corrupt)")
    return problems


def check_checkpoint(ckpt_dir: str | os.PathLike, *, checksums: bool = True,
                     gather: Callable[[list[str]], list[str]] | None = None, rank: int = 0,
                     world_size: int = 1) -> None:
    """Raise :class:`CorruptCheckpointError` naming the bad files of ``ckpt_dir``.

    ``gather``: collects every rank's problem list (all ranks must call with the same directory);
    None checks everything on this process."""
    problems = verify_manifest(ckpt_dir, checksums=checksums, rank=rank, world_size=world_size)
    if gather is not None:
        problems = gather(problems)
    if problems:
        raise CorruptCheckpointError(f"checkpoint {ckpt_dir} is not usable: " + "; ".join(problems[:5]))


def step_dirs(ckpt_root: str | os.PathLike) -> list[pathlib.Path]:
    """Published ``step_NNNNNNNN`` directories under ``ckpt_root``, newest first."""
    root = pathlib.Path(ckpt_root)
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if _STEP_DIR.match(p.name) and p.is_dir()), reverse=True)


def find_resumable(ckpt_root: str | os.PathLike, *, check: Callable[[pathlib.Path], None] = check_checkpoint
                   ) -> pathlib.Path | None:
    """The newest checkpoint under ``ckpt_root`` that passes ``check``; None when there is none at all.

    A newer one that fails is skipped with a warning naming its bad file; when every one fails,
    :class:`CorruptCheckpointError` lists them (there is nothing safe to resume from)."""
    failures = []
    for path in step_dirs(ckpt_root):
        try:
            check(path)
        except CorruptCheckpointError as exc:
            log.warning("skipping %s: %s", path.name, exc)
            failures.append(str(exc))
            continue
        if failures:
            log.warning("resuming from %s, the newest complete checkpoint", path)
        return path
    if failures:
        raise CorruptCheckpointError(f"no complete checkpoint under {ckpt_root}: " + " | ".join(failures)
                                     + ". Restore a checkpoint or start a fresh --run-dir.")
    return None
