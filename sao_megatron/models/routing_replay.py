"""Routing replay (R3): the actor's MoE routers take the experts the engines routed each token to.

Uses megatron-core 0.19.2's own hook: ``TopKRouter.router_replay`` (a ``RouterReplay``), which
``topk_routing_with_score_function`` asks for the top-k; the gate's scores are then gathered at the
replayed ids, so the routing weights stay differentiable and only the discrete choice is replayed.

Process-wide state. Megatron keeps every ``RouterReplay`` in one class-level list and its static
methods (``set_replay_data``, ``set_global_router_replay_action``) act on all of them. Actor and
critic live in one process, so those would mix the models' layers. Here each model owns its slots:
``attach_route_replay`` gives the routers of *one* model's chunks a ``LayerReplay`` each, removed
from the class-level list, and only this module's per-chunk ``RouteReplay`` drives them. A model
without ``attach_route_replay`` (the critic) routes with its own router, untouched.

Token mapping. A micro-batch carries ``routed_experts`` [b, s, num_layers * topk] (int, the
engine's rows: position i = the route of token i when it was fed) and ``route_valid`` [b, s]
(bool: a row exists; false for the last token, padding and samples without routes). A router sees
its layer's tokens as ``[s * b]`` rows, sequence-major (``logits.view(-1, E)`` of [s, b, E]); with
sequence parallelism each TP rank sees its contiguous ``s / tp`` slice. Each pipeline stage (and
virtual stage) holds only its own layers, found by the router's global ``layer_number``. Rows
without a route keep the router's own choice. Expert parallelism needs nothing: routing happens on
each rank's local tokens before the dispatch.

Activation recomputation (``recompute_granularity: full``) re-runs the router in backward: every
training forward queues its targets, and a forward inside the autograd engine pops them in order
(Megatron's REPLAY_BACKWARD idea; backward runs micro-batches in forward order in every schedule).

Metric: in each replayed forward the router's own top-k is computed too, and
``route_metrics`` reports ``rollout/route_mismatch_frac``: the fraction of (token, MoE layer)
pairs whose own top-k set differs from the engine's, i.e. what routing without replay would change.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

if TYPE_CHECKING:
    from sao_megatron.parallel.bootstrap import ParallelContext

ROUTES_KEY, VALID_KEY = "routed_experts", "route_valid"


class LayerReplay(RouterReplay):
    """Megatron's replay slot of one router, owned by one model (not in the process-wide list)."""

    def __init__(self, layer: int, topk: int):
        super().__init__()
        RouterReplay.global_router_replay_instances.remove(self)
        self.layer, self.topk = layer, topk
        """0-based global layer index (the column block of the engine's rows) and the router's top-k."""
        self.valid: torch.Tensor | None = None
        self.recompute: deque[tuple[torch.Tensor, torch.Tensor] | None] = deque()
        self.counts: torch.Tensor | None = None  # mismatched, compared (token, layer) pairs, on the device

    def set_targets(self, target_nk: torch.Tensor | None, valid_n: torch.Tensor | None, *, queue: bool) -> None:
        """The next forward's ids [tokens, topk] and which rows to replay [tokens] (None: own routing);
        ``queue``: its backward will re-run the router (activation recomputation)."""
        if queue:
            self.recompute.append(None if target_nk is None else (target_nk, valid_n))
        if target_nk is None:
            self.release()
            return
        self.target_topk_idx, self.valid = target_nk, valid_n
        self.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    def release(self) -> None:
        """Back to the router's own choice (the queue for recomputation is kept)."""
        self.target_topk_idx = self.valid = None
        self.clear_router_replay_action()

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        in_backward = torch._C._current_graph_task_id() != -1  # a recompute inside the autograd engine
        entry = self.recompute.popleft() if in_backward and self.recompute else None
        if entry is None and (in_backward or self.router_replay_action != RouterReplayAction.REPLAY_FORWARD):
            return default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        target, valid = entry if entry is not None else (self.target_topk_idx, self.valid)
        if target.shape[0] != scores.shape[0]:
            raise RuntimeError(f"layer {self.layer}: {target.shape[0]} replay rows for {scores.shape[0]} router "
                               "tokens (routes were prepared for another micro-batch layout)")
        _, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        idx = torch.where(valid[:, None], target, own)
        if not in_backward:
            with torch.no_grad():
                differ = (idx.sort(-1).values != own.sort(-1).values).any(-1) & valid
                step = torch.stack([differ.sum(), valid.sum()])  # no host sync: read in take_counts
                self.counts = step if self.counts is None else self.counts + step
        return scores.gather(1, idx), idx


class RouteReplay:
    """The replay slots of one model chunk on this rank; ``prepare`` before each forward of the chunk."""

    def __init__(self, slots: list[LayerReplay], *, sequence_parallel: bool, tp_rank: int, tp_size: int,
                 recompute: bool):
        self.slots = slots
        self.sequence_parallel, self.tp_rank, self.tp_size = sequence_parallel, tp_rank, tp_size
        self.recompute = recompute

    def prepare(self, mb: dict[str, torch.Tensor], shape: Sequence[int]) -> None:
        """Targets for the forward of ``mb`` whose model input is ``shape`` = [b, s] (>= the micro-batch's own
        shape: fixed-shape pipelines pad it; padded rows keep the router's own choice). A micro-batch
        without routes runs with the router's own choice."""
        queue = self.recompute and torch.is_grad_enabled()
        if ROUTES_KEY not in mb:
            for slot in self.slots:
                slot.set_targets(None, None, queue=queue)
            return
        routes, valid = _pad(mb[ROUTES_KEY], mb[VALID_KEY], shape)
        routes, valid = routes.transpose(0, 1), valid.transpose(0, 1)  # the routers' [s, b] order
        if self.sequence_parallel and self.tp_size > 1:
            chunk = routes.shape[0] // self.tp_size
            part = slice(self.tp_rank * chunk, (self.tp_rank + 1) * chunk)
            routes, valid = routes[part], valid[part]
        valid_n = valid.reshape(-1)
        for slot in self.slots:
            cols = routes[..., slot.layer * slot.topk:(slot.layer + 1) * slot.topk]
            slot.set_targets(cols.reshape(-1, slot.topk).long(), valid_n, queue=queue)

    @contextlib.contextmanager
    def replaying(self, mb: dict[str, torch.Tensor], shape: Sequence[int]) -> Iterator[None]:
        """``prepare`` for one forward; afterwards the routers choose on their own again (a forward
        outside ``training.step.forward`` never sees a stale micro-batch's routes)."""
        self.prepare(mb, shape)
        try:
            yield
        finally:
            for slot in self.slots:
                slot.release()

    def take_counts(self) -> torch.Tensor:
        """[mismatched, compared] (token, layer) pairs since the last call (then reset)."""
        total = torch.zeros(2, dtype=torch.float64)
        for s in self.slots:
            if s.counts is not None:
                total += s.counts.double().cpu()
            s.counts = None
        return total


def _pad(routes: torch.Tensor, valid: torch.Tensor, shape: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    b, s = routes.shape[:2]
    rows, cols = shape
    if (rows, cols) == (b, s):
        return routes, valid
    routes = torch.nn.functional.pad(routes, (0, 0, 0, cols - s, 0, rows - b))
    return routes, torch.nn.functional.pad(valid, (0, cols - s, 0, rows - b), value=False)


def attach_route_replay(chunks: Sequence[torch.nn.Module], ctx: ParallelContext) -> list[RouteReplay]:
    """Give every MoE router of ``chunks`` (one model) its own replay slot; returns one handle per chunk,
    also reachable from the chunk (``find_route_replay``). Call once per model, before DDP wrapping or
    after (the routers are the same modules)."""
    handles = []
    for chunk in chunks:
        config = chunk.config
        slots = []
        for module in chunk.modules():
            if isinstance(module, TopKRouter):
                module.router_replay = LayerReplay(module.layer_number - 1, module.topk)
                slots.append(module.router_replay)
        handle = RouteReplay(slots, sequence_parallel=bool(config.sequence_parallel), tp_rank=ctx.tp_rank,
                             tp_size=ctx.tp_size, recompute=config.recompute_granularity == "full")
        chunk.route_replay = handle
        handles.append(handle)
    return handles


def replaying(model: torch.nn.Module, mb: dict[str, torch.Tensor], shape: Sequence[int]):
    """Context for one forward of ``model`` (a chunk, possibly wrapped) on micro-batch ``mb`` whose
    model input has ``shape``: replays its routes when the chunk has replay attached, else nothing."""
    handle = find_route_replay(model)
    return handle.replaying(mb, shape) if handle is not None else contextlib.nullcontext()


def find_route_replay(model: torch.nn.Module) -> RouteReplay | None:
    """The handle of a chunk, also through DDP / Float16Module wrappers; None when not attached."""
    while model is not None:
        handle = model.__dict__.get("route_replay")
        if handle is not None:
            return handle
        model = getattr(model, "module", None)
    return None


def route_metrics(chunks: Sequence[torch.nn.Module], *, device: torch.device | str = "cpu",
                  group: dist.ProcessGroup | None = None) -> dict[str, float]:
    """Collective over ``group`` (default: the world): ``rollout/route_mismatch_frac`` since the last call,
    the fraction of replayed (token, MoE layer) pairs whose own top-k set differs from the engine's.
    Without sequence parallelism every TP rank counts the same tokens: the fraction is unchanged."""
    counts = sum((h.take_counts() for c in chunks if (h := find_route_replay(c)) is not None),
                 torch.zeros(2, dtype=torch.float64))
    if dist.is_initialized():  # on ``device``: NCCL reduces device tensors only
        reduced = counts.to(device)
        dist.all_reduce(reduced, group=group)
        counts = reduced.cpu()
    mismatched, compared = counts.tolist()
    return {"rollout/route_mismatch_frac": mismatched / compared} if compared else {}
