"""Starting real SGLang servers: python resolution, arguments, Slurm rollout-node commands."""

from __future__ import annotations

import json

import httpx
import pytest

from sao_megatron.config import RolloutConfig
from sao_megatron.launch import node
from sao_megatron.launch.layout import LaunchPlan
from sao_megatron.rollout import sglang_cpu
from sao_megatron.rollout.launch import checkpoint_dtype, sglang_python, sglang_server_args


@pytest.mark.unit
def test_missing_sglang_python_says_how_to_build_it(monkeypatch, tmp_path):
    monkeypatch.delenv("SAO_SGLANG_PYTHON", raising=False)
    with pytest.raises(ValueError, match=r"scripts/setup.sh --sglang"):
        sglang_python(None)
    with pytest.raises(ValueError, match="not an executable file"):
        sglang_python(str(tmp_path / "nope" / "python"))


@pytest.mark.unit
def test_a_python_without_the_pinned_sglang_is_refused():
    import sys

    with pytest.raises(ValueError, match=r"has sglang not installed.*sglang==0.5.23"):
        sglang_python(sys.executable)  # the main venv has no sglang


@pytest.mark.unit
@pytest.mark.parametrize("declared, want", [("float32", "float32"), ("bfloat16", "bfloat16"),
                                            ("torch.float16", "float16")])
def test_dtype_comes_from_the_checkpoint(tmp_path, declared, want):
    """Passed explicitly: SGLang's --dtype auto serves a float32 checkpoint in float16."""
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": declared}))
    assert checkpoint_dtype(tmp_path) == want
    args = sglang_server_args(tmp_path, max_total_tokens=1024, device="cpu")
    assert args[args.index("--dtype") + 1] == want and args[args.index("--max-total-tokens") + 1] == "1024"
    assert "--device" in args and "--device" not in sglang_server_args(tmp_path, max_total_tokens=0, device="cuda")


@pytest.mark.sglang
def test_served_dtype_is_the_trainers(sglang_server):
    info = httpx.get(sglang_server.url + "/server_info", headers=sglang_server.headers, trust_env=False).json()
    state = info["internal_states"][0]
    assert state["dtype"] == "float32" and state["max_total_tokens"] > 0 and state["device"] == "cpu"


@pytest.mark.sglang
def test_cpu_rollout_node_runs_sglang_from_its_venv(sglang_python, tiny_moe, monkeypatch):
    """`sao-megatron node rollout --server sglang` on a node without GPUs: SGLang's python, the CPU
    site directory, the same arguments as servers the trainer starts, no tensor parallelism."""
    monkeypatch.delenv("SAO_SGLANG_PYTHON", raising=False)
    plan = LaunchPlan(config="/c.yaml", run_dir="/r", server="sglang", gpus_per_node=0, engine_args=["--x", "1"])
    rollout = RolloutConfig(engine="sglang", sglang_python=sglang_python, sglang_max_total_tokens=2048)
    model_dir = str(tiny_moe("bf16"))
    python, extra, env = node._engine_setup(plan, rollout, model_dir, {"PATH": "/bin"})
    assert python == sglang_python
    assert env["PYTHONPATH"].split(":")[0] == str(sglang_cpu.SITE_DIR)
    assert extra == ["--dtype", "bfloat16", "--skip-server-warmup", "--max-total-tokens", "2048", "--device", "cpu"]


@pytest.mark.sglang
def test_parity_verb_measures_the_megatron_actor_against_a_real_sglang_server(sglang_python, tmp_path):
    """`sao-megatron parity --set rollout.engine=sglang` starts a real SGLang server on the exported
    actor (it used to start the embedded engine whatever rollout.engine said). Both sides fp32 on CPU:
    the gap is summation-order noise (measured 4.8e-7 max over 1024 tokens), far under the 1e-4 gate."""
    import pathlib
    import subprocess
    import sys

    run_dir = tmp_path / "parity"
    out = subprocess.run([sys.executable, "-m", "sao_megatron.cli", "parity", "--config",
                          "configs/experiments/tiny_cpu.yaml", "--set", "rollout.engine=sglang",
                          "--set", f"rollout.sglang_python={sglang_python}", "--run-dir", str(run_dir),
                          "--num-prompts", "8"], cwd=pathlib.Path(__file__).resolve().parents[2],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "started 1 SGLang engines" in out.stderr
    stats = json.loads((run_dir / "parity.json").read_text())
    assert stats["parity/num_tokens"] > 0 and stats["parity/max_abs"] < 1e-4, stats
