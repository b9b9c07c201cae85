"""End to end on data.task math with a Hugging Face checkpoint directory (model.hf_dir).

The directory holds a locally trained tiny tokenizer (ChatML template, no download) and random
weights of the tiny CPU MoE: the run goes tokenizer -> chat-template prompts -> embedded engines
-> math-verify rewards in the reward pool -> supervised warm-up on the dataset's solutions ->
SAO steps. The point is that the whole path works, not that four steps learn anything.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "experiments" / "tiny_cpu.yaml"

pytestmark = pytest.mark.e2e


def _tiny_tokenizer_module():
    spec = importlib.util.spec_from_file_location("tiny_hf_tokenizer", REPO / "tests" / "unit" / "tiny_hf_tokenizer.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def make_hf_dir(out: pathlib.Path, data_path: str) -> None:
    """Tokenizer + config.json exactly as the trainer writes its template + seeded random weights."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from sao_megatron.config import load_config
    from sao_megatron.envs import build_task
    from sao_megatron.models.families import write_hf_template

    _tiny_tokenizer_module().build_tokenizer(out)
    cfg = load_config(CONFIG, [f"model.hf_dir={out}", "data.task=math", f"data.path={data_path}",
                               "data.max_prompt_tokens=24", "data.options={}"], check=False)
    write_hf_template(cfg.model, getattr(build_task(cfg.data, model=cfg.model), "tokenizer", None), out)
    config_text = (out / "config.json").read_text()
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(out)).save_pretrained(out, safe_serialization=True)
    (out / "config.json").write_text(config_text)


def write_data(path: pathlib.Path, *, solutions: bool) -> pathlib.Path:
    path.write_text("".join(json.dumps({"prompt": f"{a}+{b}?", "answer": str(a + b)}
                                       | ({"solution": f"\\boxed{{{a + b}}}"} if solutions else {})) + "\n"
                            for a in range(1, 6) for b in range(1, 6)))
    return path


def train(tmp_path, data: pathlib.Path, hf_dir: pathlib.Path) -> tuple[subprocess.CompletedProcess, pathlib.Path]:
    run_dir = tmp_path / "run"
    sets = [f"model.hf_dir={hf_dir}", "data.task=math", "data.options={}", f"data.path={data}",
            "data.max_prompt_tokens=24", "data.max_total_tokens=40", "rollout.max_new_tokens=12", "run.num_steps=3",
            "run.sft_steps=2", "run.sft_batch_size=8", "scheduler.batch_size=8", "scheduler.concurrency=16",
            "critic.pretrain_steps=1", "checkpoint.save_interval=0", "logging.log_interval=1"]
    cmd = [sys.executable, "-m", "sao_megatron.cli", "train", "--config", str(CONFIG), "--run-dir", str(run_dir),
           *[a for s in sets for a in ("--set", s)]]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return proc, run_dir


@pytest.mark.slow  # over 60 s on 2 cores (66-107 s measured): runs in CI's slow stage
def test_math_task_trains_from_an_hf_dir_with_its_own_tokenizer(tmp_path):
    data = write_data(tmp_path / "math.jsonl", solutions=True)
    hf_dir = tmp_path / "hf"
    make_hf_dir(hf_dir, str(data))
    proc, run_dir = train(tmp_path, data, hf_dir)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert sorted({m["step"] for m in metrics}) == [0, 1, 2]
    for m in metrics:
        assert 0.0 <= m["reward/mean"] <= 1.0 and m["actor/update_applied"] == 1.0
    log = proc.stdout + proc.stderr
    assert "supervised warm-up 2/2" in log  # demonstrations from the dataset's "solution" field
    assert "reward worker" not in log and "-> 0 (" not in log  # no reward call failed or timed out
    # the engines' weight dirs carry the checkpoint's tokenizer, not the char tokenizer
    exported = sorted(run_dir.rglob("tokenizer_config.json"))
    assert exported and all("<|im_end|>" in p.read_text() for p in exported)
    # the same directory without solutions: the warm-up stops before its first step, saying how to fix it
    proc, _ = train(tmp_path / "nosol", write_data(tmp_path / "nosol.jsonl", solutions=False), hf_dir)
    assert proc.returncode != 0 and "set run.sft_steps: 0, or add" in proc.stderr, proc.stderr[-3000:]
    assert "supervised warm-up 1/" not in proc.stdout + proc.stderr
