"""Checkpoint manifests and async saves on real Megatron dist checkpoints (issue 18, part 3).

One subprocess (mp_scripts/checkpoint_integrity.py) writes a sync and an async checkpoint of a tiny
MoE model with its optimizer; the tests here truncate, alter and delete those real files and check
what resume would see. CRCs are recomputed here by reading every file (the slow reference).
"""

from __future__ import annotations

import json
import logging
import pathlib
import shutil
import zlib

import pytest
from megatron_launch import run_json

from sao_megatron.training.run.manifest import (MANIFEST, CorruptCheckpointError, check_checkpoint, find_resumable,
                                            verify_manifest)

pytestmark = pytest.mark.component


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    work = tmp_path_factory.mktemp("ckpt_integrity")
    return work, run_json("checkpoint_integrity.py", work, timeout=600)


def reference_listing(ckpt: pathlib.Path) -> dict[str, tuple[int, str]]:
    """Every file under ``ckpt`` but the manifest: (size, CRC-32 of its bytes read back)."""
    return {p.relative_to(ckpt).as_posix(): (p.stat().st_size, f"{zlib.crc32(p.read_bytes()):08x}")
            for p in sorted(ckpt.rglob("*")) if p.is_file() and p.name != MANIFEST}


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_manifest_lists_every_file_with_the_crc_of_its_bytes(saved, kind):
    work, _ = saved

    manifest = json.loads((work / kind / MANIFEST).read_text())
    ref = reference_listing(work / kind)
    assert {rel: (e["size"], e["crc32"]) for rel, e in manifest["files"].items()} == ref
    data = [rel for rel in ref if rel.endswith(".distcp")]
    assert data and all(manifest["files"][rel]["hashed"] == "write" for rel in data)  # no read-back of the bulk
    assert verify_manifest(work / kind) == []


def test_async_save_publishes_after_the_writer_and_loads_the_weights_at_save_time(saved):
    _, out = saved
    assert out["pending_after_schedule"] == 1 and not out["manifest_before_wait"]
    assert out["published_pending"] == 0 and out["pending_after_wait"] == 0
    assert out["num_params"] > 10
    for part in ("actor", "critic"):  # two parts with optimizers written by one async writer
        assert out[f"async_{part}_vs_at_save"] == 0.0  # the model changed by +1 after the save started
        assert out[f"async_{part}_vs_changed"] > 0.99


def copy_of(saved, tmp_path, name="step_00000002", kind="sync") -> pathlib.Path:
    dst = tmp_path / "checkpoints" / name
    shutil.copytree(saved[0] / kind, dst)
    return dst


def distcp(ckpt: pathlib.Path) -> pathlib.Path:
    return next((ckpt / "actor").glob("*.distcp"))


def test_truncated_file_is_named(saved, tmp_path):
    ckpt = copy_of(saved, tmp_path)
    data = distcp(ckpt)
    with data.open("r+b") as f:
        f.truncate(data.stat().st_size - 100)
    problems = verify_manifest(ckpt)
    assert len(problems) == 1 and str(data) in problems[0] and "truncated" in problems[0]
    with pytest.raises(CorruptCheckpointError, match=data.name):
        check_checkpoint(ckpt)


def test_flipped_byte_is_caught_by_the_crc_of_the_one_rank_that_checks_the_file(saved, tmp_path):
    ckpt = copy_of(saved, tmp_path)
    data = distcp(ckpt)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01  # same size: only the checksum can tell
    data.write_bytes(bytes(raw))
    problems = verify_manifest(ckpt)
    assert len(problems) == 1 and str(data) in problems[0] and "CRC" in problems[0]
    assert verify_manifest(ckpt, checksums=False) == []
    per_rank = [verify_manifest(ckpt, rank=r, world_size=3) for r in range(3)]
    assert sorted(len(p) for p in per_rank) == [0, 0, 1]  # each file is checked by exactly one rank


def test_missing_file_and_missing_manifest(saved, tmp_path):
    ckpt = copy_of(saved, tmp_path)
    (ckpt / "actor" / "metadata.json").unlink()
    assert any("metadata.json is missing" in p for p in verify_manifest(ckpt))
    (ckpt / MANIFEST).unlink()
    with pytest.raises(CorruptCheckpointError, match="no manifest.json"):
        check_checkpoint(ckpt)


def test_resume_auto_falls_back_to_the_newest_complete_checkpoint(saved, tmp_path, caplog):
    copy_of(saved, tmp_path, "step_00000002")
    copy_of(saved, tmp_path, "step_00000004", kind="async")
    newest = copy_of(saved, tmp_path, "step_00000006")
    (tmp_path / "checkpoints" / "step_00000008.partial").mkdir()  # an unfinished save is never considered
    root = tmp_path / "checkpoints"
    assert find_resumable(root) == root / "step_00000006"
    with distcp(newest).open("r+b") as f:
        f.truncate(10)
    with caplog.at_level(logging.WARNING):
        assert find_resumable(root) == root / "step_00000004"
    assert distcp(newest).name in caplog.text and "step_00000006" in caplog.text


def test_resume_auto_fails_clearly_when_no_checkpoint_is_complete(saved, tmp_path):
    root = tmp_path / "checkpoints"
    assert find_resumable(root) is None  # nothing saved yet: a fresh start
    for name in ("step_00000002", "step_00000004"):
        ckpt = copy_of(saved, tmp_path, name)
        (ckpt / MANIFEST).write_text("{trunc")
    with pytest.raises(CorruptCheckpointError, match="no complete checkpoint.*step_00000004.*step_00000002"):
        find_resumable(root)
