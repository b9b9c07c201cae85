"""TP2 and TP2xEP2 against TP1 (see mp_scripts/tp_ep_layouts.py): over NCCL with two GPUs (one GPU:
the check's verdict is "not applicable below 2 GPUs", asserted), and on the CPU (slow) to prove the
plumbing: the reference in its own process, two-rank layouts with DP 1, sizes recorded."""

from __future__ import annotations

import json
import pathlib
import sys

import pytest
import torch
from megatron_launch import run

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "scripts"))
import gpu_check_multi as multi  # noqa: E402

SCRIPT = pathlib.Path(__file__).resolve().parent / "mp_scripts" / "tp_ep_layouts.py"


def _rows(tmp: pathlib.Path, backend: str) -> tuple[list[dict], list]:
    run(str(SCRIPT), str(tmp / "ref_rows.json"), str(tmp), "--ref-only", nproc=1, timeout=400)
    proc = run(str(SCRIPT), str(tmp / "results.json"), str(tmp), "--backend", backend, nproc=2, timeout=400,
               check=False)
    rows = json.loads((tmp / "results.json").read_text()) if (tmp / "results.json").is_file() else []
    return rows, multi.judge_layout_rows(rows, proc.returncode, backend)


@pytest.mark.gpu
@pytest.mark.component
def test_tp2_and_tp2_ep2_match_tp1_on_cuda(tmp_path):
    if torch.cuda.device_count() < 2:  # what gpu_check says on one GPU, and why
        ctx = multi.Context(mode="gpu", out=tmp_path, deadline=0.0, info={"gpus": torch.cuda.device_count()})
        (line,) = multi.check_tp_ep_layouts(ctx)
        assert line.status == "N/A" and line.detail.startswith("not applicable below 2 GPUs"), line.text()
        return
    backend = multi.two_rank_backend(torch.cuda.device_count())
    rows, lines = _rows(tmp_path, backend)
    print(f"\nGPU_CHECK_NUMBERS test_tp2_and_tp2_ep2_match_tp1_on_cuda: " + "; ".join(
        f"{ln.name} {ln.status}" for ln in lines))
    assert all(ln.status == "PASS" for ln in lines), [ln.text() for ln in lines]
    assert all(r["params_on"][0].startswith("cuda") for r in rows if "params_on" in r)


@pytest.mark.slow
@pytest.mark.component
def test_tp2_and_tp2_ep2_match_tp1_on_cpu_with_the_layout_asserted(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("the CPU variant of the GPU test above")  # a GPU runs the real one
    rows, lines = _rows(tmp_path, "gloo")
    assert [ln.status for ln in lines] == ["PASS"] * 4, [ln.text() for ln in lines]
    assert {(r["layout"], r["tp"], r["ep"], r["dp"]) for r in rows} == {
        ("tp2", 2, 1, 1), ("tp2_ep2", 2, 2, 1), ("tp2 critic", 2, 1, 1), ("tp2_ep2 critic", 2, 2, 1)}
