"""The CPU support of rollout.sglang_cpu: each piece is needed (without it SGLang 0.5.23 fails where
its comment says), and the site directory refuses any other sglang release.

Each case runs the SGLang code that fails in SGLang's own python, with and without the piece; a full
server start per case would cost ~25 s each for the same evidence."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from sao_megatron.rollout import sglang_cpu
from sao_megatron.rollout.launch import _offline_env


def _run(python: str, code: str, disable: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    env = sglang_cpu.cpu_env(_offline_env(), disable=disable)
    return subprocess.run([python, "-c", code], env=env, capture_output=True, text=True, timeout=300)


# Each: (piece, code that reaches the failure, what the failure says without the piece).
CASES = {
    "sgl_kernel": ("import sglang.kernels.ops.kvcache.cache_move", "libcuda"),
    "cpu_engine": ("import torch\n"
                   "from sglang.srt.layers.rotary_embedding.base import RotaryEmbedding\n"
                   "RotaryEmbedding(16, 16, 64, 10000, True, torch.float32)", "vllm"),
    "host_alloc": ("from sglang.srt.state_capturer.base import BaseHostCache\n"
                   "BaseHostCache(8, 2, 2, 'routed_experts', 'cpu')", "cuda"),
}


@pytest.mark.sglang
@pytest.mark.parametrize("piece", list(CASES))
def test_each_cpu_piece_is_needed(sglang_python, piece):
    code, failure = CASES[piece]
    without = _run(sglang_python, code, disable=(piece,))
    assert without.returncode != 0, f"{piece} is not needed any more: the code ran without it"
    assert failure in (without.stderr + without.stdout).lower(), without.stderr[-2000:]


@pytest.mark.sglang
def test_with_every_piece_each_case_runs(sglang_python):
    """The counterpart of the test above, in one process (each import of SGLang costs seconds)."""
    with_all = _run(sglang_python, "\n".join(code for code, _ in CASES.values()))
    assert with_all.returncode == 0, with_all.stderr[-3000:]


@pytest.mark.sglang
def test_stand_in_kernel_raises_when_called(sglang_python):
    """A kernel that IS reached fails loudly with its name instead of computing nonsense."""
    r = _run(sglang_python, "from sgl_kernel.kvcacheio import transfer_kv_all_layer as f\n"
                            "try:\n    f(1)\nexcept RuntimeError as e:\n    print('raised:', e)")
    assert r.returncode == 0 and "raised: sgl_kernel.kvcacheio.transfer_kv_all_layer" in r.stdout, r.stderr


@pytest.mark.unit
def test_site_refuses_other_sglang_releases():
    """The main venv has no sglang: a python started with the site directory refuses to run, naming
    the pinned release and the command that builds its venv."""
    env = sglang_cpu.cpu_env(os.environ)
    r = subprocess.run([sys.executable, "-c", "print('ran')"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "ran" not in r.stdout
    assert "sglang==0.5.23" in r.stderr and "scripts/setup.sh --sglang" in r.stderr


@pytest.mark.unit
def test_cpu_env_refuses_unknown_patch_names():
    with pytest.raises(ValueError, match="unknown SGLang CPU patches"):
        sglang_cpu.cpu_env({}, disable=("no_such_patch",))
