"""CPU tests of the GPU acceptance script's plumbing (scripts/gpu_check.sh, gpu_env.py, gpu_check_lib.py).

The fast ones check the offline installer against real pip and local wheels, the reward criterion
and that the trainer path imports and computes GAE without numba. The slow one runs the whole
script in its --cpu mode: every check that needs no GPU runs for real, the others print SKIP.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import pathlib
import subprocess
import sys
import zipfile

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

import gpu_check_lib  # noqa: E402
import gpu_env  # noqa: E402


def _wheel(folder: pathlib.Path, name: str, version: str) -> pathlib.Path:
    """A minimal valid wheel holding module ``name`` with ``VERSION = version``."""
    path = folder / f"{name}-{version}-py3-none-any.whl"
    dist = f"{name}-{version}.dist-info"
    files = {f"{name}.py": f"VERSION = {version!r}\n",
             f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = []
    for arc, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{arc},sha256={digest},{len(text.encode())}")
    files[f"{dist}/RECORD"] = "\n".join(record + [f"{dist}/RECORD,,"]) + "\n"
    with zipfile.ZipFile(path, "w") as z:
        for arc, text in files.items():
            z.writestr(arc, text)
    return path


def _env(tmp, reqs: str, *extra: str) -> subprocess.CompletedProcess:
    (tmp / "reqs.txt").write_text(reqs)
    return subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_env.py"), "--target", str(tmp / "site"),
                           "--requirements", str(tmp / "reqs.txt"), *extra], capture_output=True, text=True,
                          timeout=120)


@pytest.mark.unit
def test_gpu_env_installs_only_what_the_interpreter_lacks(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheel(wheels, "sao_probe_pkg", "1.0")
    # pytest is installed here at another version: '# keep' leaves it; the probe is missing: installed.
    reqs = "sao_probe_pkg==1.0\npytest==0.0.1  # keep\n"
    missing = _env(tmp_path, reqs)
    assert missing.returncode == 2 and "sao_probe_pkg==1.0" in missing.stderr and "pytest" not in missing.stderr
    first = _env(tmp_path, reqs, "--wheels", str(wheels))
    assert first.returncode == 0, first.stdout + first.stderr
    assert "installing 1 wheels" in first.stdout
    assert sorted(p.name for p in (tmp_path / "site").iterdir() if not p.name.startswith(("__", "bin"))) == [
        "sao_probe_pkg-1.0.dist-info", "sao_probe_pkg.py"]
    probe = subprocess.run([sys.executable, "-c", "import sao_probe_pkg; print(sao_probe_pkg.VERSION)"],
                           env=dict(os.environ, PYTHONPATH=str(tmp_path / "site")), capture_output=True, text=True)
    assert probe.stdout.strip() == "1.0"
    again = _env(tmp_path, reqs, "--wheels", str(wheels))
    assert again.returncode == 0 and "0 installed" in again.stdout


@pytest.mark.unit
def test_gpu_env_pins_exact_versions_without_keep(tmp_path):
    """An installed distribution at another version than a strict pin counts as missing."""
    import importlib.metadata as md

    have = md.version("pluggy")
    assert gpu_env.missing([("pluggy", have, False)], sys.path) == []
    assert gpu_env.missing([("pluggy", have + ".1", False)], sys.path) == [f"pluggy=={have}.1"]
    assert gpu_env.missing([("pluggy", have + ".1", True)], sys.path) == []
    failed = _env(tmp_path, f"pluggy=={have}.1\n", "--wheels", str(tmp_path))  # no such wheel here
    assert failed.returncode == 2 and "could not install" in failed.stderr


@pytest.mark.unit
def test_gpu_requirements_parse_and_leave_out_torch_and_numba():
    reqs = gpu_env.parse_requirements((REPO / "scripts" / "gpu_requirements.txt").read_text())
    names = {n for n, _, _ in reqs}
    assert {"megatron-core", "fastapi", "uvicorn", "pytest"} <= names
    assert not names & {"torch", "numba", "llvmlite", "scipy", "triton"}
    assert ("megatron-core", "0.19.2", False) in reqs  # the CPU shims and converters are checked against it
    with pytest.raises(ValueError, match="name==version"):
        gpu_env.parse_requirements("torch>=2.6\n")


@pytest.mark.unit
def test_reward_gain_is_the_main_jobs_criterion(tmp_path):
    rewards = [0.1 * (i % 7) + 0.01 * i for i in range(30)]
    lines = [{"step": i, "reward/mean": r} for i, r in enumerate(rewards)]
    lines.insert(5, {"step": 4, "reward/mean": 99.0})  # a step logged twice (resume): the later one counts
    lines.append({"step": 30, "reward/mean": None})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    lines[5]["reward/mean"] = rewards[4]
    steps, first, last = gpu_check_lib.reward_gain(tmp_path / "metrics.jsonl")
    # 30 steps: the first 10 % are steps 0-2, the last 20 % steps 24-29 (trainer._summary's slices).
    assert steps == 30
    assert first == pytest.approx(sum(rewards[0:3]) / 3)
    assert last == pytest.approx(sum(rewards[24:30]) / 6)


BLOCK_NUMBA = """
import sys
for name in ("numba", "llvmlite", "scipy"):
    sys.modules[name] = None  # import fails as if not installed
import random
import torch
import sao_megatron.cli, sao_megatron.training.run.trainer, sao_megatron.training.step.rl_step
import sao_megatron.rollout.engine.server, sao_megatron.training.verbs.parity, sao_megatron.launch.planner_cli
sys.path.insert(0, sys.argv[1])
import algo_reference as ref
from sao_megatron.algorithms.advantages import gae, gae_impl_for
mask = ref.multi_turn_mask(random.Random(0), 6, 80)
g = torch.Generator().manual_seed(0)
r, v = torch.randn(6, 80, generator=g), torch.randn(6, 80, generator=g)
adv, ret = gae(r, v, mask, gamma=0.99, lam=0.9)
want_adv, want_ret = ref.gae(r, v, mask, 0.99, 0.9)
try:
    gae(r, v, mask, gamma=0.99, lam=0.9, impl="kernel")
    kernel = "ran"
except ValueError as exc:
    kernel = str(exc)
print(gae_impl_for(r), float((adv.double() - want_adv).abs().max()), float((ret.double() - want_ret).abs().max()))
print(kernel)
"""


@pytest.mark.unit
def test_trainer_path_imports_and_gae_runs_without_numba():
    """A GPU image without numba: the trainer, engine, parity and plan modules import; GAE takes the scan."""
    proc = subprocess.run([sys.executable, "-c", BLOCK_NUMBA, str(REPO / "tests" / "unit")], capture_output=True,
                          text=True, timeout=300, env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    first, second = proc.stdout.strip().splitlines()[-2:]
    impl, err_adv, err_ret = first.split()
    assert impl == "scan" and float(err_adv) < 1e-5 and float(err_ret) < 1e-5
    assert "needs numba" in second


@pytest.mark.slow
@pytest.mark.timeout(3800)  # the script bounds itself (--budget-s); on a shared 2-core box it takes 10-20 min
def test_gpu_check_cpu_mode_end_to_end(tmp_path):
    """``gpu_check.sh --cpu``: the real SAO run, parity gate, weight sync, DSA in bf16 and benchmarks
    on CPU; GPU-only checks are N/A (not applicable on CPU), never SKIP."""
    out = tmp_path / "out"
    proc = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), "--cpu", "--python", sys.executable,
                           "--target", str(tmp_path / "site"), "--out", str(out)],
                          capture_output=True, text=True, timeout=3700, cwd=REPO)
    summary = json.loads((out / "gpu_check_summary.json").read_text())
    status = {ln["name"]: ln for ln in summary["lines"]}
    printed = [ln for ln in proc.stdout.splitlines() if ln.startswith(("PASS", "FAIL", "SKIP", "N/A", "INFO"))]
    assert len(printed) == len(summary["lines"]), proc.stdout
    assert proc.returncode == 0 and summary["failed"] == 0, proc.stdout[-4000:]
    for name in ("env", "sao-run", "parity", "weight-sync", "dsa-bf16"):
        assert status[name]["status"] == "PASS", status[name]
    for name in ("bench train-step actor", "bench train-step critic"):  # the tiny shape, beside HF eager
        assert status[name]["status"] == "INFO" and "TFLOP/s" in status[name]["detail"], status[name]
    for name in ("gpu-tests", "tp2-ep2", "dsa-topk", "memory-vs-plan", "bench-gae", "bench-logprobs",
                 "one-gpu-limits"):
        assert status[name]["status"] == gpu_check_lib.NA, status[name]
        assert status[name]["detail"].startswith("not applicable on CPU: ")
    assert summary["counts"]["SKIP"] == 0 and "NCCL NOT exercised" in summary["text"]
    assert "plan: actor" in status["memory-vs-plan"]["detail"]
    assert "reward" in status["sao-run"]["detail"] and "weight_sync=" in status["sao-run"]["detail"]
