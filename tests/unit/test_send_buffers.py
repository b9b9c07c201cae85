"""The sender's reused flattened-bucket buffers and the choice of the version-carrying tensor."""

from __future__ import annotations

import pytest
import torch

from sao_megatron.rollout.send_buffers import SendBuffers, smallest_alone

pytestmark = pytest.mark.unit


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


def test_the_version_rides_on_the_smallest_tensor_outside_every_loader_group():
    bucket = [("model.layers.0.self_attn.q_a_proj.weight", torch.zeros(2)),  # MLA pair member: never alone
              ("model.layers.0.input_layernorm.weight", torch.zeros(8)),
              ("model.embed_tokens.weight", torch.zeros(64, 8))]
    name, _ = smallest_alone(bucket, None)
    assert name == "model.layers.0.input_layernorm.weight"
    assert smallest_alone([("model.norm.weight", torch.zeros(4))], (name, bucket[1][1]))[0] == "model.norm.weight"
