"""The weight-sync transport, trainer -> engine, with checksums compared in the engine's dtype.

    torchrun --standalone --nproc_per_node=2 weight_sync_transport.py RESULTS.json --backend nccl|gloo
        [--engine-dtype float32] [--sent-dtype bfloat16]

Rank 0 plays the trainer, rank 1 the engine. They join an update group with the project's own
``rollout.update_group.init_custom_process_group`` (what trainer and engines use), rank 0 broadcasts
one flattened bucket of ``--sent-dtype`` tensors, rank 1 unflattens it and holds the tensors in
``--engine-dtype`` (the embedded engine holds float32 whatever it is sent). Both sides hash with
``weight_check.tensor_checksum``: the trainer's expectation is the sent tensors cast to the
engine's dtype, and the engine's report must equal it. The hashes of the bytes as sent are also
compared, to show they differ when the dtypes do (the mismatch a bf16 run hit).

Devices: ``nccl`` puts rank r on cuda:r (two GPUs); ``gloo`` with CUDA puts both ranks on cuda:0
(CUDA tensors through gloo: NCCL is then not exercised); without CUDA both are CPU tensors.
RESULTS.json (rank 0): ``{"backend", "devices", "tensors", "equal", "as_sent_differ", ...}``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys

import torch
import torch.distributed as dist

from sao_megatron.rollout.update_group import flatten_bucket, init_custom_process_group, torch_dtype
from sao_megatron.rollout.weight_check import tensor_checksum

SHAPES = {"model.embed_tokens.weight": (100, 32), "model.layers.0.self_attn.q_proj.weight": (32, 32),
          "model.layers.0.mlp.experts.0.down_proj.weight": (32, 16), "model.norm.weight": (32,)}


def tensors(device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {n: torch.randn(s, generator=g).to(device=device, dtype=dtype) for n, s in SHAPES.items()}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("results")
    p.add_argument("--backend", choices=["nccl", "gloo"], default="gloo")
    p.add_argument("--engine-dtype", default="float32")
    p.add_argument("--sent-dtype", default="bfloat16")
    args = p.parse_args()
    rank = int(os.environ["RANK"])
    sent, held = torch_dtype(args.sent_dtype), torch_dtype(args.engine_dtype)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", rank if args.backend == "nccl" else 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("gloo")  # bookkeeping only (the port, the engine's report): not the transport
    port = [free_port() if rank == 0 else None]
    dist.broadcast_object_list(port, src=0)
    group = init_custom_process_group(backend=args.backend, master_address="127.0.0.1", master_port=port[0],
                                      world_size=2, rank=rank, group_name="weight_sync_check")
    ref = tensors(device, sent)
    buf = flatten_bucket(list(ref.values())) if rank == 0 else torch.empty(
        sum(t.numel() * t.element_size() for t in ref.values()), dtype=torch.uint8, device=device)
    dist.broadcast(buf, src=0, group=group)
    got, offset = {}, 0
    for name, t in ref.items():  # the engine's unflatten, then its own dtype
        size = t.numel() * t.element_size()
        got[name] = buf[offset: offset + size].view(sent).view(t.shape).to(held)
        offset += size
    engine = {n: tensor_checksum(t) for n, t in got.items()}
    boxes = [None, None]
    dist.all_gather_object(boxes, {"engine": engine, "device": str(buf.device)})
    if rank == 0:
        expected = {n: tensor_checksum(t.to(held)) for n, t in ref.items()}
        as_sent = {n: tensor_checksum(t) for n, t in ref.items()}
        reported = boxes[1]["engine"]
        out = {"backend": dist.get_backend(group), "devices": [boxes[0]["device"], boxes[1]["device"]],
               "tensors": len(ref), "sent_dtype": args.sent_dtype, "engine_dtype": args.engine_dtype,
               "equal": sum(expected[n] == reported[n] for n in ref),
               "as_sent_differ": sum(as_sent[n] != reported[n] for n in ref)}
        with open(args.results, "w") as f:
            json.dump(out, f)
    dist.destroy_process_group(group)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
