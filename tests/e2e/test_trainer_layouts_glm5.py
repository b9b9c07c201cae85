"""The trainer's update on a tiny GLM-5 (MLA + DeepSeek sparse attention) is layout-independent.

Same procedure as test_trainer_layouts.py (mp_scripts/update_parity.py: one `Trainer.update` on a
fixed batch whose sequences reach 16 tokens, twice the indexer's top-k): the TP1 run saves its
freshly initialised actor + critic, every layout loads them (resharding) and must reproduce the
TP1 losses, grad norm and entropy. TP2xEP2 with sequence parallelism and EP2xDP2 take 4 ranks,
PP2 2 ranks (`slow`: minutes each on 2 cores). PP2 uses an indexer in every layer: megatron
refuses a pipeline split between a shared indexer layer and the layer whose top-k it reuses.
"""

from __future__ import annotations

import pytest

from tests.e2e.test_trainer_layouts import REPO, torchrun

CONFIG = REPO / "configs" / "experiments" / "tiny_glm5_cpu.yaml"
KEYS = ("actor/loss", "critic/loss", "actor/grad_norm", "advantages/mean", "actor/entropy")
ALL_FULL = ("--set", "model.dsa_indexer_topk_freq=1", "--set", "model.dsa_indexer_skip_topk_offset=0")

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def assert_same(ref: dict, other: dict) -> None:
    assert ref["actor/loss"] != 0.0 and ref["critic/loss"] > 0.0
    for key in KEYS:
        assert other[key] == pytest.approx(ref[key], rel=1e-4, abs=1e-6), key


def test_tp2ep2_sp_and_ep2dp2_equal_tp1(tmp_path):
    ckpt = tmp_path / "ckpt"
    ref = torchrun(1, ckpt, tmp_path / "tp1.json", "--save", config=CONFIG, timeout=1500)
    tp2ep2 = torchrun(4, ckpt, tmp_path / "tp2ep2.json", "--set", "parallel.tensor_model_parallel_size=2",
                      "--set", "parallel.expert_model_parallel_size=2", "--set", "parallel.sequence_parallel=true",
                      config=CONFIG, timeout=1500)
    ep2dp2 = torchrun(4, ckpt, tmp_path / "ep2dp2.json", "--set", "parallel.expert_model_parallel_size=2",
                      config=CONFIG, timeout=1500)
    assert_same(ref, tp2ep2)
    assert_same(ref, ep2dp2)


def test_pp2_equals_tp1(tmp_path):
    ckpt = tmp_path / "ckpt"
    ref = torchrun(1, ckpt, tmp_path / "tp1.json", "--save", *ALL_FULL, config=CONFIG, timeout=1500)
    pp2 = torchrun(2, ckpt, tmp_path / "pp2.json", "--set", "parallel.pipeline_model_parallel_size=2", *ALL_FULL,
                   config=CONFIG, timeout=1500)
    assert_same(ref, pp2)
