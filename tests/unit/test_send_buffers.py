"""The sender's reused flattened-bucket buffers and the choice of the version-carrying tensor."""

from __future__ import annotations

import pytest
import torch
from torch.utils._pytree import tree_leaves, tree_map

from sao_megatron.weights.send_buffers import SendBuffers, smallest_alone

pytestmark = pytest.mark.unit


class OnDevice(torch.Tensor):
    """A tensor that torch's device rules see on ``device`` (e.g. CUDA) while its data stays on the CPU.

    Every op first runs on meta stand-ins of its OnDevice arguments, so torch's own checks refuse what
    they refuse across real devices (``cat(out=)`` into a buffer elsewhere); ``copy_``, the op that
    crosses devices on purpose, is exempt. Then the op runs on the CPU data.
    """

    @staticmethod
    def __new__(cls, data: torch.Tensor, device: str | torch.device):
        t = torch.Tensor._make_wrapper_subclass(cls, data.size(), strides=data.stride(), dtype=data.dtype,
                                                device=torch.device(device))
        t.cpu_data = data
        return t

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = next(a.device for a in tree_leaves((args, kwargs)) if isinstance(a, OnDevice))
        if func is not torch.ops.aten.copy_.default:
            meta = tree_map(lambda a: torch.empty_strided(a.size(), a.stride(), dtype=a.dtype, device="meta")
                            if isinstance(a, OnDevice) else a, (args, kwargs))
            func(*meta[0], **meta[1])  # torch's device checks, on the stand-ins
        plain = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor) and not isinstance(a, OnDevice)]
        data_args, data_kwargs = tree_map(lambda a: a.cpu_data if isinstance(a, OnDevice) else a, (args, kwargs))
        out = func(*data_args, **data_kwargs)
        # An argument written in place (copy_'s destination, out=) comes back as itself; the rest live on device.
        return tree_map(lambda r: r if not isinstance(r, torch.Tensor) or any(r is p for p in plain)
                        else OnDevice(r, device), out)


def test_buckets_alternate_between_two_reused_buffers_with_the_flattened_bytes():
    buffers = SendBuffers(torch.device("cpu"), flattened=True)
    gen = torch.Generator().manual_seed(0)
    buckets = [[(f"t{k}.{i}", torch.randn(3 + k, 5, generator=gen)) for i in range(3)] for k in range(5)]
    flats = []
    for k, bucket in enumerate(buckets):
        flat = buffers.flatten(bucket, k)
        reference = b"".join(t.numpy().tobytes() for _, t in bucket)  # the tensors' bytes back to back
        assert flat.buf.numpy().tobytes() == reference and flat.nbytes == len(reference)
        flats.append(flat)
    assert [f.slot for f in flats] == [0, 1, 0, 1, 0]
    assert flats[1].buf.data_ptr() != flats[2].buf.data_ptr()  # bucket k never overwrites k-1 on the wire
    buffers.drop(flats[4])
    assert buffers.bufs[0].numel() == 0  # a buffer an abandoned send may read is never written again


def test_the_device_emulation_refuses_a_cross_device_cat_as_torch_does():
    """What the buffers' old ``torch.cat(parts, out=buffer)`` did with CUDA parts and a CPU buffer."""
    part = OnDevice(torch.arange(4, dtype=torch.uint8), "cuda")
    assert part.device.type == "cuda" and (part.detach().reshape(-1).view(torch.uint8)).device.type == "cuda"
    with pytest.raises(RuntimeError, match="cross-device"):
        torch.cat([part], out=torch.empty(4, dtype=torch.uint8))


def test_parts_on_the_trainer_device_are_packed_into_the_cpu_buffers():
    """gloo with ``rollout.weight_sync.overlap=false`` on a GPU: the bucket's tensors are CUDA tensors, the send
    buffers are on the CPU (torch.cat refused that: cross-device ``out=``)."""
    buffers = SendBuffers(torch.device("cpu"), flattened=True)
    gen = torch.Generator().manual_seed(1)
    for k in range(3):
        tensors = [torch.randn(4 + k, 3, generator=gen).to(dtype) for dtype in (torch.bfloat16, torch.float32)]
        flat = buffers.flatten([(f"t{k}.{i}", OnDevice(t, "cuda")) for i, t in enumerate(tensors)], k)
        reference = b"".join(t.view(torch.uint8).numpy().tobytes() for t in tensors)  # bytes back to back
        assert type(flat.buf) is torch.Tensor and flat.buf.device.type == "cpu" and flat.slot == k % 2
        assert flat.buf.numpy().tobytes() == reference and flat.nbytes == len(reference)


def test_the_version_rides_on_the_smallest_tensor_outside_every_loader_group():
    bucket = [("model.layers.0.self_attn.q_a_proj.weight", torch.zeros(2)),  # MLA pair member: never alone
              ("model.layers.0.input_layernorm.weight", torch.zeros(8)),
              ("model.embed_tokens.weight", torch.zeros(64, 8))]
    name, _ = smallest_alone(bucket, None)
    assert name == "model.layers.0.input_layernorm.weight"
    assert smallest_alone([("model.norm.weight", torch.zeros(4))], (name, bucket[1][1]))[0] == "model.norm.weight"
