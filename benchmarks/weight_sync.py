"""Weight sync into a live embedded engine vs the raw floor of the same bytes, on CPU.

    python benchmarks/weight_sync.py [--params-m 10 50 200] [--reps 3] [--bucket-mb 512]

For random Qwen3-MoE-shaped checkpoints of about each size (fp32), with one embedded engine
serving the model, prints side by side (best of ``--reps``):
  - ``disk``: ``DiskWeightSync.push`` (write the safetensors parts + index, the engine loads them
    into its live parameters via ``/update_weights_from_disk`` inside an update session);
  - ``disk floor``: the raw bytes written to one file and read back into preallocated tensors
    (no header, no serialisation, no HTTP, no engine);
  - ``dist``: ``DistributedWeightSync.push`` (flattened buckets over a gloo update group with the
    announcements over HTTP, loaded into the engine's parameters; checksums off);
  - ``dist floor``: the same buckets copied into one buffer each (the flattened format's own
    copy) and broadcast over gloo into receive buffers allocated once in a second process;
and the ratios floor/sync (targets: disk >= 0.5, distributed >= 0.7). Each rep times the four
back to back (floor, sync, floor, sync), so a load spike on a busy machine hits both sides alike.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from sao_megatron.rollout.launch import LocalEngines, free_port
from sao_megatron.rollout.update_group import flatten_bucket, init_custom_process_group
from sao_megatron.rollout.weight_sync import DiskWeightSync
from sao_megatron.rollout.weight_sync_distributed import DistributedWeightSync, _buckets


def make_checkpoint(out: Path, params_m: float) -> list[tuple[str, torch.Tensor]]:
    """A random HF dir (config + one safetensors file) of about ``params_m`` million parameters."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    per_layer = 4 * 256 * 256 + 8 * 3 * 256 * 512
    layers = max(1, round((params_m * 1e6 - 2 * 8192 * 256) / per_layer))
    cfg = Qwen3MoeConfig(vocab_size=8192, hidden_size=256, intermediate_size=1024, moe_intermediate_size=512,
                         num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4, head_dim=32,
                         num_experts=8, num_experts_per_tok=2, max_position_embeddings=512, tie_word_embeddings=False)
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


def _receiver(port: int, sizes: list[int], reps: int) -> None:
    """The floor's other end: ``reps`` rounds of every bucket into buffers allocated once."""
    group = init_custom_process_group(backend="gloo", master_address="127.0.0.1", master_port=port, world_size=2,
                                      rank=1, group_name="floor")
    bufs = [torch.zeros(n, dtype=torch.uint8) for n in sizes]
    for _ in range(reps):
        for buf in bufs:
            torch.distributed.broadcast(buf, src=0, group=group)
    # A gloo group alive at interpreter exit aborts the process ~half the time ("terminate called
    # without an active exception", exit code -6): its worker threads are torn down unjoined.
    torch.distributed.destroy_process_group(group)


class GlooFloor:
    """The flattened-bucket protocol's own work, bare: each bucket's bytes copied into one buffer
    (allocated once) and broadcast over gloo to a second process."""

    def __init__(self, tensors, bucket_bytes: int, reps: int):
        self.parts = [[t.reshape(-1).view(torch.uint8) for _, t in b] for b in _buckets(tensors, bucket_bytes)]
        self.bufs = [flatten_bucket(p) for p in self.parts]
        port = free_port()
        self.child = mp.get_context("spawn").Process(target=_receiver,
                                                     args=(port, [b.numel() for b in self.bufs], reps))
        self.child.start()
        self.group = init_custom_process_group(backend="gloo", master_address="127.0.0.1", master_port=port,
                                               world_size=2, rank=0, group_name="floor")

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


def run_size(params_m: float, reps: int, bucket_bytes: int, root: Path) -> dict[str, float]:
    """Floors and syncs interleaved rep by rep (a load spike hits both sides alike); best of each."""
    from sao_megatron.rollout.client import RolloutClient
    from sao_megatron.training.run.async_bridge import AsyncBridge

    tensors = make_checkpoint(root / "model", params_m)
    nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
    row = {"params_m": sum(t.numel() for _, t in tensors) / 1e6, "mb": nbytes / 1e6}
    dests = [torch.zeros_like(t) for _, t in tensors]
    times: dict[str, list[float]] = {"disk_floor_s": [], "disk_s": [], "dist_floor_s": [], "dist_s": []}
    bridge, version = AsyncBridge(), iter(range(1, 1000))
    floor = GlooFloor(tensors, bucket_bytes, reps)
    with LocalEngines(root / "model", 1, log_dir=root / "logs", extra_args=["--num-threads", "1"]) as engines:
        client = RolloutClient(engines.urls)
        disk = DiskWeightSync(client=client, sync_root=root / "sync", template_dir=root / "model", collective=False,
                              verify=False, keep_last=1)
        dist = DistributedWeightSync(backend="gloo", bucket_bytes=bucket_bytes, verify=False,
                                     master_address="127.0.0.1")
        dist.connect(engines.urls, is_sender=True)
        for _ in range(reps):
            times["disk_floor_s"].append(raw_disk_floor(tensors, root, dests))
            times["disk_s"].append(timed(lambda: disk.push(tensors, next(version),
                                                           paused=lambda fn: bridge.run(fn()))))
            times["dist_floor_s"].append(floor.once())
            times["dist_s"].append(timed(lambda: dist.push(tensors, next(version))))
        dist.close()
        disk.close()
        bridge.run(client.aclose())
    bridge.close()
    floor.close()
    row |= {k: min(v) for k, v in times.items()}
    row["disk_ratio"] = row["disk_floor_s"] / row["disk_s"]
    row["dist_ratio"] = row["dist_floor_s"] / row["dist_s"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params-m", type=float, nargs="+", default=[10, 50, 200])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--bucket-mb", type=int, default=512)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"{'params':>8} {'MB':>7} | {'disk s':>7} {'floor s':>7} {'ratio':>5} | {'dist s':>7} {'floor s':>7} "
          f"{'ratio':>5}")
    for size in args.params_m:
        with tempfile.TemporaryDirectory(prefix="wsync-bench-") as tmp:
            r = run_size(size, args.reps, args.bucket_mb << 20, Path(tmp))
        print(f"{r['params_m']:7.1f}M {r['mb']:7.0f} | {r['disk_s']:7.3f} {r['disk_floor_s']:7.3f} "
              f"{r['disk_ratio']:5.2f} | {r['dist_s']:7.3f} {r['dist_floor_s']:7.3f} {r['dist_ratio']:5.2f}")
        print(json.dumps(r))


if __name__ == "__main__":
    main()
