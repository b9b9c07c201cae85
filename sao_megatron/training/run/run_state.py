"""Run state that survives restarts: atomic keep-last-N checkpoints, RNG capture, the sample audit.

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


class RunState:
    """Everything that survives a restart: checkpoints (models, optimizers, LR schedules, trainer
    state, RNG) and the audit of trained samples. Collective methods run on every rank."""

    def __init__(self, run_dir: pathlib.Path, *, keep_last: int, rank0: bool, offload: bool = False,
                 async_save: bool = False, verify_checksums: bool = True):
        from sao_megatron.training.run.checkpoint import CheckpointSaves

        self.run_dir, self.rank0, self.offload = run_dir, rank0, offload
        self.ckpt = CheckpointManager(run_dir / "checkpoints", keep_last=keep_last)
        self.saves = CheckpointSaves(async_save=async_save)
        self.verify_checksums = verify_checksums
        self.audit_path = run_dir / "audit.jsonl"
        self.dropped_path = run_dir / "audit_dropped.jsonl"

    # ------------------------------------------------------------------ checkpoints
    def save(self, step: int, models: dict[str, Any], trainer_state: dict[str, Any]) -> None:
        """Collective: each model (name -> TrainedModel or None) with its optimizer and LR schedule,
        the trainer state and every rank's RNG, published atomically as ``step_N``."""
        import torch.distributed as dist

        from sao_megatron.training.run.checkpoint import publish_checkpoint, save_checkpoint
        from sao_megatron.training.step.offload import resident

        self.saves.wait()  # one checkpoint in flight at most (publishing prunes *.partial directories)
        part = self.ckpt.partial_dir(step)
        if self.rank0:
            self.ckpt.begin(step)
        dist.barrier()
        state = dict(trainer_state)
        for name, model in models.items():
            if model is None:
                continue
            with resident(model, offload=self.offload):
                save_checkpoint(part / name, model.chunks, model.optimizer, saves=self.saves)
            state[f"{name}_lr"] = model.scheduler.state_dict()
        (part / "rng").mkdir(exist_ok=True)
        torch.save(capture_rng(), part / "rng" / f"rank_{dist.get_rank()}.pt")
        if self.rank0:
            write_json_atomic(part / "trainer_state.json", state)
        dist.barrier()
        # manifest (written last) + atomic rename once the files are complete (async: later, in poll/wait)
        self.saves.then(lambda: publish_checkpoint(part, lambda: self.ckpt.commit(step)))

    def restore(self, path: pathlib.Path, models: dict[str, Any]) -> dict[str, Any]:
        """Collective: load ``models`` (+ optimizers, LR schedules) and this rank's RNG from ``path``;
        returns the trainer state and drops audit lines of the steps rolled back."""
        import torch.distributed as dist

        from sao_megatron.training.run.checkpoint import load_checkpoint

        state = json.loads((path / "trainer_state.json").read_text())
        for name, model in models.items():
            if model is not None:
                load_checkpoint(path / name, model.chunks, model.optimizer)
                model.scheduler.load_state_dict(state[f"{name}_lr"])
        rng = path / "rng" / f"rank_{dist.get_rank()}.pt"
        if rng.is_file():  # absent when resuming at another world size
            restore_rng(torch.load(rng, weights_only=False))
        if self.rank0:
            self.truncate_audit(state["step"])
            log.info("resumed from %s (step %d, version %d)", path, state["step"], state["version"])
        return state

    def resume_path(self, resume: str | None, load: str | None) -> pathlib.Path | None:
        """Collective. The checkpoint to start from: ``auto`` (the newest complete one of this run,
        skipping corrupt ones with a warning, else ``checkpoint.load``), ``never`` (refuses a run
        directory that already holds checkpoints) or an explicit path (verified: a corrupt one fails
        naming its file)."""
        from sao_megatron.training.run.manifest import find_resumable

        if resume in ("never", "", None):
            if self.ckpt.latest() is not None:
                raise ValueError(f"{self.run_dir} already holds checkpoints; pass --resume auto to continue "
                                 "or choose a fresh --run-dir")
            return self._checked(load)
        if resume == "auto":
            return find_resumable(self.ckpt.root, check=self._verify) or self._checked(load)
        return self._checked(resume)

    def _verify(self, path: pathlib.Path) -> None:
        from sao_megatron.training.run.checkpoint import verify_checkpoint

        verify_checkpoint(path, checksums=self.verify_checksums)

    def _checked(self, path: str | None) -> pathlib.Path | None:
        if path is None:
            return None
        p = pathlib.Path(path)
        if not (p / "trainer_state.json").is_file():
            raise ValueError(f"{p} is not a sao-megatron checkpoint (no trainer_state.json); pass a "
                             "RUN_DIR/checkpoints/step_N directory")
        self._verify(p)  # a corrupt explicit checkpoint fails here, naming its file
        return p

    # ------------------------------------------------------------------ audit
    def audit(self, samples: list[Any], *, step: int, version: int, phase: str) -> None:
        """RUN_DIR/audit.jsonl: one line per trained sample (exactly-once checks, staleness audit).

        ``version`` is the trainer version the sample was trained at; lines of steps after the
        last checkpoint are dropped on resume (those samples are trained again)."""
        if not self.rank0:
            return
        with self.audit_path.open("a") as f:
            for s in samples:
                f.write(json.dumps({"step": step, "version": version, "phase": phase, "index": s.index,
                                    "epoch": s.epoch, "attempt": s.attempt, "group_id": s.group_id,
                                    "oldest_version": s.oldest_version(), "reward": s.reward,
                                    "num_action_tokens": s.num_action_tokens,
                                    "response_len": len(s.response_ids)}) + "\n")

    def audit_dropped(self, dropped: list[tuple[Any, int]], *, step: int) -> None:
        """RUN_DIR/audit_dropped.jsonl: one line per sample the scheduler dropped as stale (its prompt was
        re-queued), with the version it was dropped at, its token versions and its length, so that
        drops can be told apart by response length (``sao-megatron report``)."""
        if not self.rank0 or not dropped:
            return
        with self.dropped_path.open("a") as f:
            for s, version in dropped:
                vs = s.action_versions
                f.write(json.dumps({"step": step, "dropped_at_version": version, "index": s.index,
                                    "epoch": s.epoch, "attempt": s.attempt, "group_id": s.group_id,
                                    "oldest_version": min(vs) if vs else None,
                                    "newest_version": max(vs) if vs else None,
                                    "num_action_tokens": s.num_action_tokens, "response_len": len(s.response_ids),
                                    "reward": s.reward}) + "\n")

    def truncate_audit(self, step: int) -> None:
        """Drop audit lines (trained and dropped samples) of steps at or after ``step`` (a fresh start: every line)."""
        for path in (self.audit_path, self.dropped_path):
            if path.is_file():
                keep = [ln for ln in path.read_text().splitlines() if ln and json.loads(ln)["step"] < step]
                path.write_text("".join(ln + "\n" for ln in keep))
