"""Device placement tested without a GPU (issue 37, defect 1): CUDA placements mapped to ``meta``.

On the first GPU run every model build failed: megatron's ``TopKRouter`` creates its weight on
the CPU and relies on ``get_model`` moving each chunk to the device, which the project never did.
The CPU emulation could not see it (``CudaToCpuMode`` maps CUDA to the CPU, where the weight
already was). mp_scripts/device_placement.py builds every family (Qwen3-MoE, GLM-4.5-like, GLM-5
with MLA + DSA; actor and critic; bf16) as on a CUDA node (``use_cpu_initialization`` off) under
``CudaToMetaMode``: every parameter and buffer must land on ``meta``, none stay on the CPU.
"""

from __future__ import annotations

import pytest
from megatron_launch import run_json

pytestmark = pytest.mark.component
BUILDS = [f"{family}/{role}" for family in ("tiny_moe", "glm45_like", "tiny_glm5") for role in ("actor", "critic")]


@pytest.fixture(scope="module")
def placement(tmp_path_factory):
    return run_json("device_placement.py", tmp_path_factory.mktemp("device_placement"), timeout=600)


@pytest.mark.parametrize("build", BUILDS)
def test_every_parameter_and_buffer_reaches_the_device(placement, build):
    """Failed before: ``model tensor decoder.layers.0.mlp.router.weight was created on cpu``."""
    result = placement[build]
    assert "error" not in result, result["error"]
    assert result["use_cpu_initialization"] is False  # built as on a GPU node
    assert result["num_tensors"] > 20
    assert result["off_meta"] == []


@pytest.mark.parametrize("build", BUILDS)
def test_megatron_parameter_tags_survive_the_move(placement, build):
    """CPU -> meta makes new Parameters (no in-place ``.data``): Megatron's tensor-parallel, sequence-parallel
    and expert tags must come along, as they do on CPU -> CUDA; the reference is a CPU build's tags."""
    result = placement[build]
    assert result["tags"] == result["cpu_tags"]
    assert sum("tensor_model_parallel" in tags for tags in result["tags"].values()) > 10


@pytest.mark.parametrize("build", BUILDS)
def test_moe_forward_on_the_device_stops_only_where_values_are_read(placement, build):
    """The whole MoE model's forward runs on ``meta`` through embedding, attention (MLA + DSA indexer for
    GLM-5), router and permutation; it stops where the token dispatcher splits tokens by per-expert
    counts (``split_sizes.tolist()``), values a meta tensor does not hold. A tensor left on the CPU
    would stop it earlier with a device mismatch instead."""
    forward = placement[build]["forward"]
    assert forward.get("stopped_in") == "moe_utils.sort_chunks_by_idxs", forward
    assert forward["error"].startswith("NotImplementedError: Cannot copy out of meta tensor"), forward


@pytest.mark.parametrize("build", BUILDS)
def test_batch_path_and_forward_schedule_stay_on_the_device(placement, build):
    """Dense variant (no dispatch): prepare_batch(device=ctx.device) then Megatron's forward schedule
    (compute_logprobs for the actor, compute_values for the critic) give [4, 7] fp32 outputs on ``meta``.
    For GLM-5 this runs the DSA indexer with megatron's own rotate_activation in place, as on a CUDA node
    without fast_hadamard_transform: the builder must put the pure-torch rotation in (defect 7)."""
    dense = placement[build]["dense"]
    assert dense == {"batch_devices": ["meta"], "output_devices": ["meta"], "output_dtypes": ["torch.float32"],
                     "output_shapes": [[4, 7]]}


@pytest.mark.parametrize("family", ["tiny_moe", "glm45_like", "tiny_glm5"])
def test_weight_sync_export_streams_from_the_device(placement, family):
    """The actor's export stream (HF names, full tensors, world 1: no gathers) hands out tensors on the
    device: no host copy on the way. Writing safetensors files reads values: the emulation stops there."""
    export = placement[f"{family}/actor"]["export"]
    assert "error" not in export, export
    assert export["devices"] == ["meta"] and export["num_tensors"] > 40


@pytest.mark.parametrize("family", ["tiny_moe", "glm45_like", "tiny_glm5"])
def test_ddp_buffers_and_fp32_master_params_are_on_the_device(placement, family):
    """setup_optimizer on the placed bf16 actor: Megatron's contiguous param/grad buffers and the distributed
    optimizer's fp32 master copies follow the model onto the device (a model left on the CPU would put
    them there). A step then stops at the gradient reduce-scatter: c10d collectives have no meta kernels."""
    opt = placement[f"{family}/actor"]["optimizer"]
    assert "error" not in opt, opt
    assert opt["buffers"] == ["meta"] and opt["main_params"] == ["meta"], opt
    assert opt["main_dtypes"] == ["torch.float32"] and opt["num_main_params"] > 20
