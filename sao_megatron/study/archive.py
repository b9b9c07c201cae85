"""A study's measured runs kept outside its working directory: ``sao-megatron study --archive DIR``.

A full study matrix takes longer than one machine session, and a study directory holds checkpoints
that no one wants to keep. The archive keeps what the tables, the paired analysis and the plots read,
small enough to commit beside the document it backs:

- ``DIR/runs/<variant>/w<k>r<j>.json.gz`` per finished RL run: its rows of ``metrics.jsonl`` cut to
  :data:`RECORD_KEYS` (6 significant digits), its wall and CPU seconds, the commit and date it ran at;
- ``DIR/warmups/w<k>.tar.gz`` per finished warm-up: the warmed-up actor every arm loads, so that
  runs added later start from the same weights as the runs already archived (a warm-up run again on
  another machine is not bit-identical).

Each record carries the fingerprint of the run's resolved configuration (the study directory's own
paths left out). ``study`` restores a record into its run directory only where the fingerprint
matches the plan: a changed study file, base config or default of this version makes the run count
as not done, with a warning naming it. Restored runs count as done; the runs finished afterwards are
archived as they finish.
"""

from __future__ import annotations

import datetime
import gzip
import hashlib
import io
import json
import logging
import pathlib
import subprocess
import tarfile

from sao_megatron.study.spec import Plan, PlannedRun, PlannedWarmup

log = logging.getLogger(__name__)

RECORD_KEYS = ("step", "version", "reward/mean", "eval/pass_at_1", "eval_start/pass_at_1", "actor/entropy",
               "actor/dis_masked_low_frac", "actor/dis_masked_high_frac", "critic/explained_var",
               "advantages/mean", "advantages/std", "actor/grad_norm", "actor/update_norm",
               "train/staleness_mean", "rollout/phase", "timing/step_s", "timing/wait_batch_s", "timing/train_s",
               "actor/clip_frac", "actor/kl_k3")
"""What ``study.summary`` reads (its tables, pairs and plots) plus the step timings of the Speed section."""


def fingerprint(plan: Plan, overrides: list[str]) -> str:
    """sha256 of the resolved config of a run (``overrides`` on the plan's base), with the study
    directory written as ``<out>`` so that the same run planned in another directory matches."""
    from sao_megatron.config import load_config
    from sao_megatron.config.loader import to_dict

    out = str(_out_dir(plan))
    resolved = json.dumps(to_dict(load_config(plan.base_path, overrides)), sort_keys=True, default=str)
    return hashlib.sha256(resolved.replace(out, "<out>").encode()).hexdigest()


def _out_dir(plan: Plan) -> pathlib.Path:
    return plan.warmups[0].run_dir.parent.parent if plan.warmups else plan.runs[0].run_dir.parent.parent


def _run_path(archive: pathlib.Path, run: PlannedRun) -> pathlib.Path:
    return archive / "runs" / run.variant / f"w{run.warmup_index}r{run.seed_index}.json.gz"


def _warmup_path(archive: pathlib.Path, warmup: PlannedWarmup) -> pathlib.Path:
    return archive / "warmups" / f"w{warmup.index}.tar.gz"


def _provenance() -> dict[str, str]:
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                                cwd=pathlib.Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return {"commit": commit or "unknown", "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}


def _compact(value):
    return float(f"{value:.6g}") if isinstance(value, float) else value


def save_run(plan: Plan, run: PlannedRun, archive: pathlib.Path, done: dict) -> pathlib.Path:
    """Archive a finished RL run (``done``: its ``study_done.json``)."""
    from sao_megatron.training.run.metrics_log import read_metrics

    rows = [{k: _compact(r[k]) for k in RECORD_KEYS if k in r} for r in read_metrics(run.run_dir)]
    record = {"variant": run.variant, "pair": list(run.pair), "fingerprint": fingerprint(plan, run.overrides),
              "num_steps": run.num_steps, "done": done, **_provenance(), "rows": rows}
    path = _run_path(archive, run)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with gzip.open(tmp, "wt", compresslevel=9) as f:
        json.dump(record, f, separators=(",", ":"))
    tmp.replace(path)
    return path


def save_warmup(plan: Plan, warmup: PlannedWarmup, archive: pathlib.Path) -> pathlib.Path:
    """Archive a finished warm-up's actor (and its fingerprint)."""
    path = _warmup_path(archive, warmup)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    meta = json.dumps({"fingerprint": fingerprint(plan, warmup.overrides), **_provenance()}).encode()
    with tarfile.open(tmp, "w:gz") as tar:
        tar.add(warmup.actor, arcname=warmup.actor.name)
        info = tarfile.TarInfo("archive.json")
        info.size = len(meta)
        tar.addfile(info, io.BytesIO(meta))
    tmp.replace(path)
    return path


def restore(plan: Plan, archive: pathlib.Path, done_file: str) -> tuple[int, int]:
    """Put every archived warm-up and run whose fingerprint matches the plan into its directory, as a
    finished one; returns (warm-ups, runs) restored. A stale record is left alone with a warning."""
    warmups = sum(_restore_warmup(plan, w, archive, done_file) for w in plan.warmups)
    runs = sum(_restore_run(plan, r, archive, done_file) for r in plan.runs)
    return warmups, runs


def backfill(plan: Plan, archive: pathlib.Path, done_file: str) -> int:
    """Archive the plan's finished warm-ups and runs that are not archived yet (finished before the study
    was given ``--archive``); returns how many."""
    count = 0
    for w in plan.warmups:
        if (w.run_dir / done_file).is_file() and not _warmup_path(archive, w).is_file():
            save_warmup(plan, w, archive)
            count += 1
    for r in plan.runs:
        if (r.run_dir / done_file).is_file() and not _run_path(archive, r).is_file():
            save_run(plan, r, archive, json.loads((r.run_dir / done_file).read_text()))
            count += 1
    return count


def _restore_run(plan: Plan, run: PlannedRun, archive: pathlib.Path, done_file: str) -> bool:
    path = _run_path(archive, run)
    if (run.run_dir / done_file).is_file() or not path.is_file():
        return False
    with gzip.open(path, "rt") as f:
        record = json.load(f)
    if record["fingerprint"] != fingerprint(plan, run.overrides):
        log.warning("archive: %s was measured with another configuration (commit %s); it runs again",
                    path, record.get("commit"))
        return False
    run.run_dir.mkdir(parents=True, exist_ok=True)
    (run.run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in record["rows"]))
    (run.run_dir / done_file).write_text(json.dumps({**record["done"], "archived": str(path)}))
    return True


def _restore_warmup(plan: Plan, warmup: PlannedWarmup, archive: pathlib.Path, done_file: str) -> bool:
    path = _warmup_path(archive, warmup)
    if (warmup.run_dir / done_file).is_file() or not path.is_file():
        return False
    with tarfile.open(path, "r:gz") as tar:
        meta = json.loads(tar.extractfile("archive.json").read())
        if meta["fingerprint"] != fingerprint(plan, warmup.overrides):
            log.warning("archive: %s was measured with another configuration (commit %s); it runs again",
                        path, meta.get("commit"))
            return False
        warmup.run_dir.mkdir(parents=True, exist_ok=True)
        members = [m for m in tar.getmembers() if m.name.split("/")[0] == warmup.actor.name]
        tar.extractall(warmup.run_dir, members=members, filter="data")
    (warmup.run_dir / done_file).write_text(json.dumps({"archived": str(path)}))
    return True
