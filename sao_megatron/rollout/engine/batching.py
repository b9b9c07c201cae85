"""``/generate`` bodies that SGLang 0.5.23 accepts beyond one token prompt: batches and text.

SGLang's ``GenerateReqInput`` takes ``input_ids`` as one list of ids or a batch (a list of
lists), or ``text`` (a string or a list of strings) when the server loaded a tokenizer; a batch
reply is a JSON list with one reply per prompt, in order. ``rid`` and ``sampling_params`` may be
per prompt (lists) or shared. Without a tokenizer (``--skip-tokenizer-init``) a text prompt is
refused with SGLang's own message (``TokenizerManager._tokenize_one_request``).
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

from sao_megatron.rollout.engine.requests import BadRequest

logger = logging.getLogger(__name__)

TEXT_REFUSED = ("The engine initialized with skip_tokenizer_init=True cannot accept text prompts. Please provide "
                "input_ids or re-initialize the engine with skip_tokenizer_init=False.")


def split_generate_body(body: dict[str, Any], tokenizer) -> tuple[list[dict[str, Any]], bool]:
    """(one body per prompt, whether the reply is a batch); text is tokenized here."""
    body = dict(body)
    if body.get("input_ids") is None and body.get("text") is not None:
        if tokenizer is None:
            raise BadRequest(TEXT_REFUSED)
        text = body.pop("text")
        if not (isinstance(text, str) or (isinstance(text, list) and text and all(isinstance(t, str) for t in text))):
            raise BadRequest("text must be a string or a non-empty list of strings")
        body["input_ids"] = ([tokenizer.encode(t) for t in text] if isinstance(text, list)
                             else tokenizer.encode(text))
    elif body.get("text") is not None:
        raise BadRequest("give either text or input_ids, not both")
    ids = body.get("input_ids")
    if not (isinstance(ids, list) and ids and isinstance(ids[0], list)):
        return [body], False
    n = len(ids)
    rids = body.get("rid")
    rids = rids if isinstance(rids, list) else [None if rids is None else f"{rids}_{i}" for i in range(n)]
    params = body.get("sampling_params")
    params = params if isinstance(params, list) else [params] * n
    if len(rids) != n or len(params) != n:
        raise BadRequest(f"a batch of {n} prompts needs {n} rids and sampling_params (or one shared)")
    return [{**body, "input_ids": ids[i], "rid": rids[i] or uuid.uuid4().hex, "sampling_params": params[i]}
            for i in range(n)], True


def load_tokenizer(model_dir: str):
    """The model directory's HF tokenizer, or None (with a warning) when it has none.

    SGLang refuses to start without one; here a directory without tokenizer files (trainer
    exports of token-level tasks) serves token-in/token-out, as with --skip-tokenizer-init.
    """
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError, TypeError) as exc:
        logger.warning("%s has no loadable tokenizer (%s): serving token ids only", model_dir, exc)
        return None
