"""Routing replay on one CPU process: the parity gate against a real embedded engine over HTTP.

    python routing_replay_single.py RESULTS.json WORKDIR CONFIG

The tiny CPU experiment with ``rollout.routing_replay=true``: actor (with replay) and critic in one
process. Weights are drawn large (std 0.3) so experts differ, and router weights near zero (x1e-3)
so routing is a near tie everywhere. The engine serves the actor's export and returns routed
experts; the actor then recomputes the log-probs with and without replay:
- ``same``: trainer weights = engine weights;
- ``perturbed``: the trainer's router weights moved by noise of their own size (a router a step
  ahead of, or numerically off from, the engine's): without replay top-k choices flip, with replay not.
Also records the critic's isolation from the actor's replay state.
"""

from __future__ import annotations

import json
import pathlib
import sys

import torch


def routers(chunks):
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for c in chunks for m in c.modules() if isinstance(m, TopKRouter)]


def near_tie_weights(chunks) -> None:
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in (kv for c in chunks for kv in c.named_parameters()):
            if "norm" not in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        for r in routers(chunks):
            r.weight.mul_(1e-3)


def critic_isolation(c, mb) -> dict:
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    from sao_megatron.models.routing_replay import LayerReplay
    from sao_megatron.training.step.forward import compute_values

    plain = compute_values(c.critic.chunks, [{"tokens": mb["tokens"]}], ctx=c.ctx)[0]
    # What megatron's own inference code does process-wide: it must reach neither model.
    RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    with_routes = compute_values(c.critic.chunks, [mb], ctx=c.ctx)[0]
    RouterReplay.clear_global_router_replay_action()
    return {"critic_values_maxdiff": float((plain - with_routes).abs().max()),
            "critic_has_replay": any(r.router_replay is not None for r in routers(c.critic.chunks)),
            "actor_slots": sum(isinstance(r.router_replay, LayerReplay) for r in routers(c.actor.chunks)),
            "slots_in_global_list": sum(isinstance(r, LayerReplay)
                                        for r in RouterReplay.global_router_replay_instances)}


def main(out_path: str, workdir: str, config: str) -> None:
    from sao_megatron.config import load_config
    from sao_megatron.models.routing_replay import route_metrics
    from sao_megatron.parallel.bootstrap import destroy
    from sao_megatron.training.run.components import build_components
    from sao_megatron.training.verbs.parity import _parity_batch, generate_pairs, parity_gaps

    cfg = load_config(config, ["rollout.routing_replay=true", "run.sft_steps=0"])
    c = build_components(cfg)
    near_tie_weights(c.actor.chunks)
    from sao_megatron.models.critic import init_critic_from_actor

    init_critic_from_actor(c.critic.chunks, c.actor.chunks)
    run_dir = pathlib.Path(workdir)
    pairs = generate_pairs(c, cfg.model, run_dir, num_prompts=12, max_new_tokens=12, temperature=1.0, seed=3,
                           routes=True)
    kw = dict(vocab_size=cfg.model.vocab_size, temperature=1.0, replay=True)
    out = {"same": parity_gaps(c, pairs, **kw)}
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for r in routers(c.actor.chunks):
            r.weight.add_(torch.randn(r.weight.shape, generator=g) * r.weight.std())
    out["perturbed"] = parity_gaps(c, pairs, **kw)
    mb = _parity_batch(pairs, c.ctx.tp_size, c.ctx.device)
    route_metrics(c.actor.chunks)
    out["routes_shape"] = list(pairs[0][3].shape)
    out["num_rows_ok"] = all(len(r) == len(p) + len(o) - 1 for p, o, _, r in pairs)
    out |= critic_isolation(c, mb)
    destroy()
    pathlib.Path(out_path).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main(*sys.argv[1:4])
