"""Weight sync into live engines vs the raw floor of the same bytes, on CPU.

    python benchmarks/weight_sync.py [--params-m 10 30 100] [--reps 3] [--bucket-mb 512]
                                     [--pipeline-mb 8 16 64] [--engine embedded sglang] [--sglang-python PATH]

For random Qwen3-MoE-shaped checkpoints of about each size (fp32), with one server per engine kind
(``embedded``: this project's engine; ``sglang``: the real SGLang 0.5.23 server on CPU, its python
from ``--sglang-python`` or ``$SAO_SGLANG_PYTHON``), prints side by side (best of ``--reps``):
  - ``disk``: ``DiskWeightSync.push`` (write the safetensors parts + index, the engine loads them
    into its live parameters via ``/update_weights_from_disk``);
  - ``disk floor``: the raw bytes written to one file and read back into preallocated tensors
    (no header, no serialisation, no HTTP, no engine);
  - ``dist``: ``DistributedWeightSync.push`` (flattened buckets over a gloo update group with the
    announcements over HTTP, loaded into the engine's parameters; checksums off);
  - ``dist floor``: the same buckets (the sync's own bucket size) copied into one buffer each (the
    flattened format's own copy) and broadcast over gloo into receive buffers allocated once in a
    second process;
and the ratios floor/sync (targets: disk >= 0.5, distributed >= 0.7). Several ``--pipeline-mb`` values
(the distributed sync's bucket cap) are compared in the same reps, each against its own floor, on the
same servers (one update group per cap). Each rep times the floors and
every engine's syncs back to back, so a load spike on a busy machine hits all sides alike. Then the
fixed per-push costs of the distributed push (the best rep's breakdown from its metrics, a
pause/continue round trip, one verified push's checksum comparison, and the embedded engine's
in-place load of the same tensors, measured in this process).
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from sao_megatron.rollout.launch import LocalEngines, free_port
from sao_megatron.rollout.update_group import flatten_bucket, init_custom_process_group
from sao_megatron.weights.disk import DiskWeightSync
from sao_megatron.weights.distributed import DistributedWeightSync, _buckets


def make_checkpoint(out: Path, params_m: float) -> list[tuple[str, torch.Tensor]]:
    """A random HF dir (config + one safetensors file) of about ``params_m`` million parameters."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    per_layer = 4 * 256 * 256 + 8 * 3 * 256 * 512
    layers = max(1, round((params_m * 1e6 - 2 * 8192 * 256) / per_layer))
    cfg = Qwen3MoeConfig(vocab_size=8192, hidden_size=256, intermediate_size=1024, moe_intermediate_size=512,
                         num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4, head_dim=32,
                         num_experts=8, num_experts_per_tok=2, max_position_embeddings=512, tie_word_embeddings=False,
                         dtype=torch.float32, architectures=["Qwen3MoeForCausalLM"])
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(cfg)
    from transformers.core_model_loading import revert_weight_conversion

    shapes = {n: t.shape for n, t in revert_weight_conversion(model, model.state_dict()).items()}
    gen = torch.Generator().manual_seed(0)
    tensors = sorted((n, torch.randn(s, generator=gen) * 0.02) for n, s in shapes.items())
    out.mkdir(parents=True)
    cfg.save_pretrained(out)
    save_file(dict(tensors), str(out / "model.safetensors"), metadata={"format": "pt"})
    return tensors


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def raw_disk_floor(tensors, root: Path, dests: list[torch.Tensor]) -> float:
    """The bytes written to one file (no header, no serialisation) and read back into ``dests``."""
    path = root / "floor.bin"

    def once():
        with open(path, "wb") as fh:
            for _, t in tensors:
                fh.write(t.numpy().data.cast("B"))
        with open(path, "rb") as fh:
            for d in dests:
                fh.readinto(d.numpy().data.cast("B"))
        path.unlink()
    return timed(once)


def _receiver(port: int, sizes: list[int], reps: int, name: str) -> None:
    """The floor's other end: ``reps`` rounds of every bucket into buffers allocated once."""
    group = init_custom_process_group(backend="gloo", master_address="127.0.0.1", master_port=port, world_size=2,
                                      rank=1, group_name=name)
    bufs = [torch.zeros(n, dtype=torch.uint8) for n in sizes]
    for _ in range(reps):
        for buf in bufs:
            torch.distributed.broadcast(buf, src=0, group=group)
    # A gloo group alive at interpreter exit aborts the process ~half the time ("terminate called
    # without an active exception", exit code -6): its worker threads are torn down unjoined.
    torch.distributed.destroy_process_group(group)


_FLOOR_IDS = itertools.count()


class GlooFloor:
    """The flattened-bucket protocol's own work, bare: each bucket's bytes copied into one buffer
    (allocated once) and broadcast over gloo to a second process."""

    def __init__(self, tensors, bucket_bytes: int, reps: int):
        name = f"floor_{next(_FLOOR_IDS)}"  # one group per floor: torch refuses a group name twice
        self.parts = [[t.reshape(-1).view(torch.uint8) for _, t in b] for b in _buckets(tensors, bucket_bytes)]
        self.bufs = [flatten_bucket(p) for p in self.parts]
        port = free_port()
        self.child = mp.get_context("spawn").Process(target=_receiver,
                                                     args=(port, [b.numel() for b in self.bufs], reps, name))
        self.child.start()
        self.group = init_custom_process_group(backend="gloo", master_address="127.0.0.1", master_port=port,
                                               world_size=2, rank=0, group_name=name)

    def once(self) -> float:
        def send():
            for parts, buf in zip(self.parts, self.bufs):
                torch.cat(parts, out=buf)
                torch.distributed.broadcast(buf, src=0, group=self.group)
        return timed(send)

    def close(self) -> None:
        self.child.join(60)
        torch.distributed.destroy_process_group(self.group)
        if self.child.exitcode != 0:
            raise RuntimeError(f"the floor's receiver process exited with {self.child.exitcode}")


def start_engines(kind: str, model_dir: Path, root: Path, sglang_python: str | None):
    """One server of ``kind`` on the checkpoint (a started ``LocalEngines``/``SGLangEngines``)."""
    if kind == "embedded":
        return LocalEngines(model_dir, 1, log_dir=root / f"logs-{kind}", extra_args=["--num-threads", "1"]).__enter__()
    from sao_megatron.rollout.launch import SGLangEngines, sglang_python as find_python

    return SGLangEngines(model_dir, 1, python=find_python(sglang_python), device="cpu", max_total_tokens=4096,
                         log_dir=root / f"logs-{kind}", extra_args=["--skip-tokenizer-init"]).__enter__()


class EngineSide:
    """One engine kind's server, its disk transport and one distributed transport per bucket cap."""

    def __init__(self, kind: str, root: Path, bucket_bytes: int, sglang_python: str | None,
                 caps: dict[str, int | None]):
        from sao_megatron.rollout.client import RolloutClient

        self.kind = kind
        self.engines = start_engines(kind, root / "model", root, sglang_python)
        self.client = RolloutClient(self.engines.urls)
        self.disk = DiskWeightSync(client=self.client, sync_root=root / f"sync-{kind}", template_dir=root / "model",
                                   collective=False, verify=False, keep_last=1, strict_names=kind == "embedded",
                                   checkpoint_dtype="float32")
        self.dists: dict[str, DistributedWeightSync] = {}
        for i, (label, cap) in enumerate(caps.items()):
            self.dists[label] = DistributedWeightSync(
                backend="gloo", bucket_bytes=bucket_bytes, verify=False, master_address="127.0.0.1",
                group_prefix=f"bench_{kind}_{i}", strict_names=kind == "embedded", checkpoint_dtype="float32",
                pipeline_bytes=cap)
            self.dists[label].connect(self.engines.urls, is_sender=True)
        self.times: dict[str, list[float]] = {"disk_s": [], **{f"dist_s@{label}": [] for label in caps}}
        self.metrics: dict[str, list[dict[str, float]]] = {label: [] for label in caps}

    def rep(self, tensors, bridge, version) -> None:
        self.times["disk_s"].append(timed(lambda: self.disk.push(tensors, next(version),
                                                                 paused=lambda fn: bridge.run(fn()))))
        for label, dist in self.dists.items():
            start = time.perf_counter()
            self.metrics[label].append(dist.push(tensors, next(version)))
            self.times[f"dist_s@{label}"].append(time.perf_counter() - start)

    def fixed_costs(self, label: str, tensors, bridge, version) -> dict[str, float]:
        """The best distributed rep's breakdown, a pause/continue round trip and a verified push's check."""
        times, metrics = self.times[f"dist_s@{label}"], self.metrics[label]
        best = metrics[min(range(len(metrics)), key=lambda i: times[i])]
        out = {k.removeprefix("weight_sync/").removesuffix("_seconds"): v for k, v in best.items()
               if k.endswith("_seconds") and "sender_seconds" not in k}

        async def pause_continue():
            await self.client.pause_generation("retract")
            await self.client.continue_generation()
        out["pause+continue"] = min(timed(lambda: bridge.run(pause_continue())) for _ in range(3))
        out["verify"] = self.dists[label].push(tensors, next(version),
                                               verify=True).get("weight_sync/verify_seconds", 0.0)
        return out

    def close(self, bridge) -> None:
        for dist in self.dists.values():
            dist.close()
        self.disk.close()
        bridge.run(self.client.aclose())
        self.engines.__exit__(None, None, None)


def embedded_load_seconds(model_dir: Path, tensors, reps: int) -> float:
    """The embedded engine's in-place load of ``tensors`` into its live parameters (this process)."""
    from sao_megatron.rollout.engine.model import ModelRunner
    from sao_megatron.rollout.engine.weights import EngineWeights

    weights = EngineWeights(ModelRunner(model_dir))
    weights.load(tensors)  # builds the slot table once, as the engine's first push does
    return min(timed(lambda: weights.load(tensors)) for _ in range(reps))


def run_size(params_m: float, reps: int, bucket_bytes: int, root: Path, kinds: list[str],
             sglang_python: str | None, caps: dict[str, int | None]) -> dict:
    """Floors and syncs interleaved rep by rep (a load spike hits every side alike); best of each."""
    from sao_megatron.rollout.async_bridge import AsyncBridge

    tensors = make_checkpoint(root / "model", params_m)
    nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
    row: dict = {"params_m": sum(t.numel() for _, t in tensors) / 1e6, "mb": nbytes / 1e6}
    dests = [torch.zeros_like(t) for _, t in tensors]
    floors: dict[str, list[float]] = {"disk_floor_s": [], **{f"dist_floor_s@{label}": [] for label in caps}}
    bridge, version = AsyncBridge(), iter(range(1, 10000))
    sides, gloo_floors = [], {}
    try:
        for kind in kinds:
            sides.append(EngineSide(kind, root, bucket_bytes, sglang_python, caps))
        for label in caps:  # the floor on the buckets the sync itself cuts at this cap
            gloo_floors[label] = GlooFloor(tensors, sides[0].dists[label].chunk_bytes, reps)
        for _ in range(reps):
            floors["disk_floor_s"].append(raw_disk_floor(tensors, root, dests))
            for label, floor in gloo_floors.items():
                floors[f"dist_floor_s@{label}"].append(floor.once())
            for side in sides:
                side.rep(tensors, bridge, version)
        for floor in gloo_floors.values():
            floor.close()
        row |= {k: min(v) for k, v in floors.items()}
        for side in sides:
            row[side.kind] = {k: min(v) for k, v in side.times.items()}
            for label in caps:
                row[side.kind][f"buckets@{label}"] = side.metrics[label][-1].get("weight_sync/buckets", 0.0)
                row[side.kind][f"fixed@{label}"] = side.fixed_costs(label, tensors, bridge, version)
    finally:
        for side in sides:
            side.close(bridge)
        bridge.close()
    if "embedded" in kinds:
        row["embedded"]["engine_load_s"] = embedded_load_seconds(root / "model", tensors, reps)
    for kind in kinds:
        row[kind]["disk_ratio"] = row["disk_floor_s"] / row[kind]["disk_s"]
        for label in caps:
            row[kind][f"dist_ratio@{label}"] = row[f"dist_floor_s@{label}"] / row[kind][f"dist_s@{label}"]
    return row


def print_row(r: dict, kinds: list[str], caps: list[str]) -> None:
    for kind in kinds:
        e = r[kind]
        for i, label in enumerate(caps):
            disk = (f"{e['disk_s']:7.3f} {r['disk_floor_s']:7.3f} {e['disk_ratio']:5.2f}" if i == 0
                    else f"{'':7} {'':7} {'':5}")
            print(f"{r['params_m']:7.1f}M {r['mb']:7.0f} {kind:>8} | {disk} | {label:>7} {e[f'buckets@{label}']:4.0f} "
                  f"{e[f'dist_s@{label}']:7.3f} {r[f'dist_floor_s@{label}']:7.3f} {e[f'dist_ratio@{label}']:5.2f}")
    for kind in kinds:
        for label in caps:
            fixed = "  ".join(f"{k} {v * 1e3:.1f}" for k, v in r[kind][f"fixed@{label}"].items())
            print(f"{'':17}{kind:>8} {label:>7} fixed costs, ms: {fixed}")
        if "engine_load_s" in r[kind]:
            print(f"{'':17}{kind:>8} load of every tensor into the live parameters, in-process: "
                  f"{r[kind]['engine_load_s'] * 1e3:.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params-m", type=float, nargs="+", default=[10, 30, 100])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--bucket-mb", type=int, default=512)
    parser.add_argument("--pipeline-mb", type=float, nargs="+", default=None,
                        help="bucket caps of the distributed sync, compared side by side (default: its own, "
                             "16 MB over gloo)")
    parser.add_argument("--engine", nargs="+", choices=["embedded", "sglang"], default=["embedded"])
    parser.add_argument("--sglang-python", default=None, help="SGLang venv's python (else $SAO_SGLANG_PYTHON)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    kinds = list(dict.fromkeys(args.engine))
    caps: dict[str, int | None] = ({"default": None} if args.pipeline_mb is None else
                                   {f"{mb:g}MB": int(mb * (1 << 20)) for mb in dict.fromkeys(args.pipeline_mb)})
    print(f"{'params':>8} {'MB':>7} {'engine':>8} | {'disk s':>7} {'floor s':>7} {'ratio':>5} | {'cap':>7} "
          f"{'bkts':>4} {'dist s':>7} {'floor s':>7} {'ratio':>5}")
    for size in args.params_m:
        with tempfile.TemporaryDirectory(prefix="wsync-bench-") as tmp:
            r = run_size(size, args.reps, args.bucket_mb << 20, Path(tmp), kinds, args.sglang_python, caps)
        print_row(r, kinds, list(caps))
        print(json.dumps(r))


if __name__ == "__main__":
    main()
