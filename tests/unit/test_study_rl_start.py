"""What the study relies on at the start of RL: a fresh optimizer (``actor.reset_optimizer_before_rl``)
and the update-norm metric (``actor.log_update_norm``)."""

from __future__ import annotations

import copy
import types

import pytest
import torch

from sao_megatron.config import load_config
from sao_megatron.training.step.optim import reset_optimizer_state
from sao_megatron.training.step.rl_step import PolicySettings, param_snapshot, update_norm

pytestmark = pytest.mark.unit
BASE = "configs/experiments/tool_chain_cpu.yaml"


def _model_and_grads(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    grads = [[torch.randn_like(p) * (10.0 if k < 5 else 0.1) for p in model.parameters()] for k in range(8)]
    return model, grads


def _step(model, opt, grads):
    for p, g in zip(model.parameters(), grads):
        p.grad = g.clone()
    opt.step()


class _Wrapper:
    """Megatron's shape: a (chained) optimizer whose parts hold the torch optimizer as ``.optimizer``."""

    def __init__(self, inner):
        self.optimizer = inner


@pytest.mark.parametrize("chained", [False, True])
def test_reset_optimizer_state_makes_the_next_steps_a_fresh_optimizers(chained):
    """After warm-up steps with large gradients, a reset optimizer takes exactly the steps a newly built
    one takes from the same weights; without the reset the warm-up's moments change them."""
    model, grads = _model_and_grads()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for g in grads[:5]:  # the "warm-up"
        _step(model, opt, g)
    fresh_model = copy.deepcopy(model)
    fresh = torch.optim.Adam(fresh_model.parameters(), lr=1e-2)
    carried_model = copy.deepcopy(model)
    carried = torch.optim.Adam(carried_model.parameters(), lr=1e-2)
    carried.load_state_dict(opt.state_dict())
    wrapped = _Wrapper(opt)
    reset_optimizer_state(types.SimpleNamespace(chained_optimizers=[wrapped]) if chained else wrapped)
    for g in grads[5:]:
        _step(model, opt, g)
        _step(fresh_model, fresh, g)
        _step(carried_model, carried, g)
    for a, b, c in zip(model.parameters(), fresh_model.parameters(), carried_model.parameters()):
        assert torch.equal(a, b)
    assert not all(torch.allclose(a, c) for a, c in zip(model.parameters(), carried_model.parameters()))


def test_initial_weights_resets_the_actor_optimizer_only_when_the_config_says_so(monkeypatch):
    from sao_megatron.training.run import components

    calls = []
    monkeypatch.setattr("sao_megatron.training.step.optim.reset_optimizer_state", calls.append)
    for flag in (False, True):
        cfg = load_config(BASE, ["run.sft_steps=0", f"actor.reset_optimizer_before_rl={str(flag).lower()}"])
        actor = types.SimpleNamespace(optimizer=object(), chunks=[])
        components.initial_weights(types.SimpleNamespace(actor=actor, critic=None), cfg)
        assert calls == ([actor.optimizer] if flag else [])


def test_update_norm_is_the_norm_of_the_parameter_change():
    model, grads = _model_and_grads(1)
    model[0].bias.requires_grad_(False)  # frozen parameters do not count
    before = param_snapshot([model])
    start = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    _step(model, opt, grads[0])
    with torch.no_grad():
        model[0].bias.add_(100.0)
    delta = torch.cat([(p.detach() - s).flatten() for p, s in zip(model.parameters(), start) if p.requires_grad])
    assert update_norm([model], before) == pytest.approx(float(delta.norm()))
    assert PolicySettings(vocab_size=8, temperature=1.0, entropy_coef=0.0).update_norm is False  # opt-in
