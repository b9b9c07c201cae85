"""Metric sinks on rank 0: metrics.jsonl, a rich console line, TensorBoard, wandb.

``metrics.jsonl`` is the source of truth (one JSON object per trainer step);
``sao-megatron report`` plots from it. wandb runs offline unless configured.

Resume: :meth:`MetricsLogger.resume_at` rolls the sinks back to a checkpoint's step. Rows of
steps that will be trained again leave ``metrics.jsonl``; TensorBoard reopens with
``purge_step`` (its readers hide the older events at and after that step); wandb cannot rewind,
so steps it already received are not sent again (``wandb_last_step`` in the run directory keeps
the highest one across restarts).
"""

from __future__ import annotations

import json
import logging
import math
import os
import pathlib
from typing import Any

from sao_megatron.config import LoggingConfig

log = logging.getLogger(__name__)

CONSOLE_KEYS = (
    ("reward/mean", "reward", "{:.3f}"),
    ("rollout/staleness_max", "stale", "{:.0f}"),
    ("actor/pg_loss", "pg", "{:+.4f}"),
    ("critic/value_loss", "vf", "{:.4f}"),
    ("actor/dis_masked_low_frac", "mask_lo", "{:.3f}"),
    ("timing/tokens_per_s", "tok/s", "{:.0f}"),
    ("timing/step_s", "step_s", "{:.2f}"),
)


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item") and getattr(value, "numel", lambda: 1)() == 1:
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf; keep them visible
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


class MetricsLogger:
    """Write step metrics to every configured sink. Create on rank 0 only."""

    def __init__(self, run_dir: str | pathlib.Path, cfg: LoggingConfig, *, run_name: str,
                 config_dict: dict[str, Any] | None = None):
        self.run_dir = pathlib.Path(run_dir)
        self.cfg = cfg
        self.path = self.run_dir / "metrics.jsonl"
        self._file = self.path.open("a")
        self._tb = self._wandb = None
        self._wandb_last = -1  # steps up to here were sent to wandb before a resume
        if cfg.wandb and cfg.wandb_mode != "disabled":
            import wandb

            self._wandb = wandb.init(project=cfg.wandb_project, name=run_name, dir=str(self.run_dir),
                                     mode=cfg.wandb_mode, config=config_dict or {}, resume="allow",
                                     id=run_name.replace("/", "_"))

    def _tensorboard(self, purge_step: int | None = None):
        """The TensorBoard writer, opened on first use (a resume opens it with ``purge_step``)."""
        if self._tb is None and self.cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"), purge_step=purge_step)
        return self._tb

    def resume_at(self, step: int) -> None:
        """Continue the run from a checkpoint taken after ``step`` trainer steps (0: from scratch).

        Rows logged under steps >= ``step`` are dropped from metrics.jsonl (they are trained
        again); TensorBoard purges its events from ``step`` on; wandb skips steps it already has.
        """
        rows = [ln for ln in self.path.read_text().splitlines() if ln.strip()] if self.path.is_file() else []
        steps = [json.loads(ln)["step"] for ln in rows]
        self._file.close()
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(ln + "\n" for ln, s in zip(rows, steps) if s < step))
        os.replace(tmp, self.path)
        self._file = self.path.open("a")
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self.cfg.tensorboard and (self.run_dir / "tensorboard").is_dir():
            self._tensorboard(purge_step=step)
        if self._wandb is not None:
            mark = self.run_dir / "wandb_last_step"
            self._wandb_last = max([self._wandb_last, *steps, int(mark.read_text()) if mark.is_file() else -1])
            mark.write_text(f"{self._wandb_last}\n")
        if any(s >= step for s in steps):
            log.info("metrics: dropped %d rows of steps >= %d (trained again after the resume)",
                     sum(s >= step for s in steps), step)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step, **{k: _jsonable(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        scalars = {k: v for k, v in record.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if (tb := self._tensorboard()) is not None:
            for k, v in scalars.items():
                tb.add_scalar(k, v, step)
        if self._wandb is not None and step > self._wandb_last:
            self._wandb.log(scalars, step=step)
        if self.cfg.log_interval and step % self.cfg.log_interval == 0:
            log.info(format_console(step, record))

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def format_console(step: int, record: dict[str, Any]) -> str:
    parts = [f"step {step}"]
    for key, short, fmt in CONSOLE_KEYS:
        value = record.get(key)
        if isinstance(value, (int, float)):
            parts.append(f"{short}={fmt.format(value)}")
    return "  ".join(parts)


def read_metrics(run_dir: str | pathlib.Path) -> list[dict[str, Any]]:
    """Read metrics.jsonl; a step logged twice (resume) keeps its last record."""
    path = pathlib.Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"{path} not found: is {run_dir} a run directory of `sao-megatron train`?")
    by_step: dict[int, dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            by_step[rec["step"]] = rec
    return [by_step[s] for s in sorted(by_step)]


def reward_summary(run_dir: str | pathlib.Path) -> str | None:
    """One line a person can check: did the reward go up over the run? (None below 10 steps.)"""
    rewards = [r["reward/mean"] for r in read_metrics(run_dir) if isinstance(r.get("reward/mean"), float)]
    if len(rewards) < 10:
        return None
    head, tail = rewards[: max(1, len(rewards) // 10)], rewards[-max(1, len(rewards) // 5):]
    return (f"{len(rewards)} steps; reward/mean {sum(head) / len(head):.3f} over the first 10% of steps -> "
            f"{sum(tail) / len(tail):.3f} over the last 20%")
