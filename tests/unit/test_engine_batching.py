"""Splitting SGLang /generate bodies into single prompts: batches, shared or per-prompt params, text."""

from __future__ import annotations

import pytest

from sao_megatron.rollout.engine.batching import TEXT_REFUSED, split_generate_body
from sao_megatron.rollout.engine.requests import BadRequest

pytestmark = pytest.mark.unit


class CharTokenizer:
    def encode(self, text):
        return [ord(c) % 100 for c in text]


def test_single_prompt_passes_through():
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}
    assert split_generate_body(body, None) == ([body], False)


def test_batch_shared_and_per_prompt_params():
    bodies, batch = split_generate_body({"input_ids": [[1], [2, 3]], "sampling_params": {"top_k": 5},
                                         "rid": "x", "return_logprob": True}, None)
    assert batch and [b["input_ids"] for b in bodies] == [[1], [2, 3]]
    assert [b["rid"] for b in bodies] == ["x_0", "x_1"] and all(b["return_logprob"] for b in bodies)
    assert all(b["sampling_params"] == {"top_k": 5} for b in bodies)
    bodies, _ = split_generate_body({"input_ids": [[1], [2]], "sampling_params": [{"top_k": 1}, {"top_k": 2}],
                                     "rid": ["a", "b"]}, None)
    assert [(b["rid"], b["sampling_params"]["top_k"]) for b in bodies] == [("a", 1), ("b", 2)]
    bodies, _ = split_generate_body({"input_ids": [[1], [2]]}, None)
    assert len({b["rid"] for b in bodies}) == 2  # fresh distinct ids
    with pytest.raises(BadRequest, match="2 rids"):
        split_generate_body({"input_ids": [[1], [2]], "rid": ["a"]}, None)


def test_text_needs_a_tokenizer():
    with pytest.raises(BadRequest) as info:
        split_generate_body({"text": "hi"}, None)
    assert str(info.value) == TEXT_REFUSED
    assert split_generate_body({"text": "hi"}, CharTokenizer())[0][0]["input_ids"] == [4, 5]
    bodies, batch = split_generate_body({"text": ["a", "bc"]}, CharTokenizer())
    assert batch and [b["input_ids"] for b in bodies] == [[97], [98, 99]]
    with pytest.raises(BadRequest, match="not both"):
        split_generate_body({"text": "a", "input_ids": [1]}, CharTokenizer())
