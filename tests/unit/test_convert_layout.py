"""The converters' layout checks with expert-TP (``--etp``) apart from TP."""

from __future__ import annotations

import math

import pytest

from checkpoints_tools import common
from sao_megatron.config.schema import ModelConfig
from sao_megatron.models.families import ConversionError

pytestmark = pytest.mark.unit


def _processes_needed(tp: int, pp: int, ep: int, etp: int) -> int:
    """Megatron's rule: TP*PP and ETP*EP*PP must both divide the world."""
    return math.lcm(tp * pp, etp * ep * pp)


@pytest.mark.parametrize("tp,pp,ep,etp", [(2, 1, 2, 1), (2, 1, 4, 1), (1, 1, 2, 2), (2, 2, 2, 1), (4, 1, 1, 2)])
@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_check_launch_accepts_exactly_the_worlds_megatron_accepts(monkeypatch, tp, pp, ep, etp, world):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    if world % _processes_needed(tp, pp, ep, etp) == 0:
        common.check_launch(tp, pp, ep, etp)
    else:
        with pytest.raises(ConversionError, match=f"--etp {etp} needs a multiple of"):
            common.check_launch(tp, pp, ep, etp)


def test_expert_tp_defaults_to_tp():
    moe = ModelConfig(num_moe_experts=4, moe_ffn_hidden_size=32)
    assert common.parallel_config(moe, 2, 1, 2).expert_tensor_parallel_size is None  # Megatron: None = TP
    cfg = common.parallel_config(moe, 2, 1, 2, etp=1)
    assert (cfg.tensor_model_parallel_size, cfg.expert_model_parallel_size, cfg.expert_tensor_parallel_size,
            cfg.sequence_parallel) == (2, 2, 1, True)
