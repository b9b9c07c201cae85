"""Atomic, keep-last-N checkpoint directories and RNG state capture.

Layout: ``RUN_DIR/checkpoints/step_00000010/`` holds ``actor/``, ``critic/``
(Megatron dist checkpoints), ``trainer_state.json`` (version, cursors, the
scheduler's buffers) and ``rng/rank_K.pt``. Every rank writes into
``step_N.partial``; after a barrier rank 0 renames it and updates ``latest``
(both with ``os.replace``), so a crash at any point leaves either the previous
complete checkpoint or the new one, never a half-written one that resume
would pick up.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import random
import re
import shutil
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)
_STEP_DIR = re.compile(r"^step_(\d{8})$")


class CheckpointManager:
    """Names, commits, finds and prunes checkpoint directories under ``root``."""

    def __init__(self, root: str | pathlib.Path, *, keep_last: int):
        if keep_last < 1:
            raise ValueError(f"checkpoint.keep_last must be >= 1, got {keep_last}")
        self.root = pathlib.Path(root)
        self.keep_last = keep_last

    def partial_dir(self, step: int) -> pathlib.Path:
        return self.root / f"step_{step:08d}.partial"

    def final_dir(self, step: int) -> pathlib.Path:
        return self.root / f"step_{step:08d}"

    def begin(self, step: int) -> pathlib.Path:
        """Rank 0: create a clean partial directory for ``step`` (call before a barrier)."""
        path = self.partial_dir(step)
        if path.exists():
            shutil.rmtree(path)
        path.mkdir(parents=True)
        return path

    def commit(self, step: int) -> pathlib.Path:
        """Rank 0, after every rank finished writing: publish the checkpoint atomically."""
        final = self.final_dir(step)
        if final.exists():  # re-saving a step after resume: replace it
            shutil.rmtree(final)
        os.replace(self.partial_dir(step), final)
        tmp = self.root / "latest.tmp"
        tmp.write_text(f"{final.name}\n")
        os.replace(tmp, self.root / "latest")
        self._prune()
        return final

    def complete_steps(self) -> list[int]:
        if not self.root.is_dir():
            return []
        return sorted(int(m.group(1)) for p in self.root.iterdir() if (m := _STEP_DIR.match(p.name)))

    def latest(self) -> pathlib.Path | None:
        """The newest complete checkpoint (``latest`` pointer, else the highest step dir)."""
        pointer = self.root / "latest"
        if pointer.is_file():
            path = self.root / pointer.read_text().strip()
            if path.is_dir():
                return path
        steps = self.complete_steps()
        return self.final_dir(steps[-1]) if steps else None

    def _prune(self) -> None:
        for step in self.complete_steps()[: -self.keep_last]:
            shutil.rmtree(self.final_dir(step), ignore_errors=True)
        for p in self.root.glob("*.partial"):
            shutil.rmtree(p, ignore_errors=True)


def write_json_atomic(path: pathlib.Path, obj: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def capture_rng() -> dict[str, Any]:
    """RNG states of python, numpy and torch (CPU and, if present, CUDA + Megatron's tracker)."""
    state: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(),
                             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    try:
        from megatron.core import tensor_parallel

        state["megatron_tracker"] = tensor_parallel.get_cuda_rng_tracker().get_states()
    except Exception as exc:  # tracker not initialised (e.g. unit tests)
        log.debug("no megatron rng tracker state: %s", exc)
    return state


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if "megatron_tracker" in state:
        from megatron.core import tensor_parallel

        tensor_parallel.get_cuda_rng_tracker().set_states(state["megatron_tracker"])
