"""The embedded engine serving GLM-5 (MLA + DeepSeek sparse attention) and DeepSeek-V3 tiny models.

GLM-5's cache layers hold the DSA indexer's own key cache besides the MLA latents; the engine
must carry it through batched left-padded decode, or decode fails (or selects top-k over the
wrong keys). Every log-prob is compared with a fresh full-sequence transformers forward (fp32,
rollout_fixtures.LOGPROB_TOL) on sequences several times longer than the indexer's top-k (8), in
batches of requests of different lengths, across pause (retract / in_place) and a weight update, and for a hub
checkpoint that carries MTP layers (which transformers does not build).
"""

from __future__ import annotations

import pathlib
import sys

import pytest
from rollout_fixtures import assert_close, hf_reference

from sao_megatron.rollout.engine.core import EngineCore, Request, request_generator
from sao_megatron.rollout.engine.model import ModelRunner
from sao_megatron.rollout.engine.sampling import RowParams
from sao_megatron.rollout.types import SamplingParams

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent / "convert_scripts"))
from mla_fixtures import SHAPES, write_hf_dir  # noqa: E402

pytestmark = pytest.mark.component

GLM5, DSV3 = "glm5_shared_idx_mtp", "dsv3_yarn_groups_mtp"
# 16 indexer heads, as GLM-5's 32: with 4, the ReLU'd index scores of a random tiny model often tie
# at exactly 0, and which tied key top-k keeps depends on the sequence length (transformers' own
# full forwards of a sequence and its prefix then disagree by up to 0.9 in the logits).
NO_TIES = {"index_n_heads": 16}
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [9], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33],
           [40, 41, 42]]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, pathlib.Path]:
    root = tmp_path_factory.mktemp("engine-mla")
    return {"glm5": write_hf_dir(GLM5, root / "glm5", seed=0, **NO_TIES),
            "glm5_other": write_hf_dir(GLM5, root / "glm5b", seed=3, **NO_TIES),
            "dsv3": write_hf_dir(DSV3, root / "dsv3", seed=0)}


def make_request(rid: str, prompt: list[int], sp: SamplingParams, replies: dict) -> Request:
    return Request(rid=rid, prompt=prompt, params=RowParams.normalised(sp.temperature, sp.top_p, sp.top_k),
                   max_new_tokens=sp.max_new_tokens, stop_ids=set(), return_logprob=True, want_routing=False,
                   generator=request_generator(0, rid, None), done=lambda reply: replies.__setitem__(rid, reply))


def run_until_done(core: EngineCore, replies: dict, n: int) -> None:
    for _ in range(200):
        if len(replies) >= n:
            return
        core.step()
    raise AssertionError(f"only {len(replies)}/{n} requests finished")


def logprobs_of(reply: dict) -> list[float]:
    return [e[0] for e in reply["meta_info"]["output_token_logprobs"]]


@pytest.mark.parametrize("name", ["glm5", "dsv3"])
def test_batched_decode_matches_full_forward(dirs, name):
    core = EngineCore(ModelRunner(dirs[name]), max_running=8)
    replies: dict = {}
    sps = [SamplingParams(max_new_tokens=14, temperature=t, ignore_eos=True) for t in (1.0, 0.8, 1.2, 1.0)]
    for i, (p, sp) in enumerate(zip(PROMPTS, sps)):
        core.add(make_request(f"r{i}", p, sp, replies))
    run_until_done(core, replies, len(PROMPTS))
    assert core.stats["max_decode_batch"] == len(PROMPTS)
    for i, (p, sp) in enumerate(zip(PROMPTS, sps)):
        out = replies[f"r{i}"]["output_ids"]
        assert len(p) + len(out) > 3 * SHAPES[GLM5]["index_topk"] or len(p) < 4
        assert_close(logprobs_of(replies[f"r{i}"]), hf_reference(dirs[name], p, out, sp))


def test_engine_cache_carries_the_indexer_keys(dirs):
    """Each full-indexer layer caches one indexer key per token; "shared" layers cache none."""
    runner = ModelRunner(dirs["glm5"])
    fwd = runner.prefill(PROMPTS[0])
    step = runner.decode([3], fwd.caches)
    types = SHAPES[GLM5]["indexer_types"]
    for layer, kind in zip(step.caches[0], types):
        keys, _values, indexer = layer
        assert keys.shape[2] == len(PROMPTS[0]) + 1
        if kind == "full":
            assert indexer.shape == (1, len(PROMPTS[0]) + 1, SHAPES[GLM5]["index_head_dim"])
        else:
            assert indexer is None
    # /update_weights_from_disk with a hub checkpoint: its MTP layer is skipped, everything else loads
    from sao_megatron.rollout.engine.weights import EngineWeights

    named = dict(EngineWeights(runner).read_checkpoint(dirs["glm5_other"]))
    first_mtp = f"model.layers.{SHAPES[GLM5]['num_hidden_layers']}."
    assert named and not any(n.startswith(first_mtp) for n in named)
    assert "model.layers.0.self_attn.indexer.wk.weight" in named


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_glm5_pause_update_continue(dirs, mode):
    runner = ModelRunner(dirs["glm5"])
    core = EngineCore(runner, max_running=4)
    replies: dict = {}
    sp = SamplingParams(max_new_tokens=16, ignore_eos=True)
    core.add(make_request("a", PROMPTS[0], sp, replies))
    core.add(make_request("b", PROMPTS[1], sp, replies))
    for _ in range(6):  # tokens 0..6 of both under the old weights
        core.step()
    core.pause(mode)
    runner.swap(runner.load_checked(dirs["glm5_other"]), dirs["glm5_other"])
    core.weight_version = "1"
    core.resume()
    run_until_done(core, replies, 2)
    for rid, prompt in (("a", PROMPTS[0]), ("b", PROMPTS[1])):
        out, lps = replies[rid]["output_ids"], logprobs_of(replies[rid])
        assert replies[rid]["meta_info"]["weight_versions"][0] == {"version": "0", "start": 0, "end": 7}
        assert_close(lps[:7], hf_reference(dirs["glm5"], prompt, out[:7], sp))
        new_ref = hf_reference(dirs["glm5_other"], prompt, out, sp)
        if mode == "retract":  # cache (latents and indexer keys) rebuilt under the new weights
            assert_close(lps[7:], new_ref[7:])
        else:  # in_place keeps the old cache: not the fresh forward of the new weights
            assert max(abs(a - b) for a, b in zip(lps[7:], new_ref[7:])) > 1e-3
