"""A local Hugging Face tokenizer behind the interface the tasks use from ``CharTokenizer``.

``HFTokenizer(model.hf_dir)`` loads the checkpoint's own tokenizer with ``local_files_only=True``
(never the network). Stop tokens are the tokenizer's eos, the ``eos_token_id`` list of the
directory's ``generation_config.json`` (GLM-4.5 lists ``<|user|>`` / ``<|observation|>`` there) and
the chat template's end-of-turn token (``<|im_end|>`` for Qwen3), found by rendering a short
conversation: the special tokens right after the assistant's text close its turn.
"""

from __future__ import annotations

import json
import logging
import pathlib
from typing import Any

logger = logging.getLogger(__name__)
_PROBE = "Zq7Xy"  # assistant text for finding the end-of-turn token; unlikely to merge with neighbours


class HFTokenizer:
    """``encode``/``decode``/``bos_id``/``eos_id``/``pad_id``/``vocab_size`` over a transformers tokenizer."""

    def __init__(self, path: str | pathlib.Path) -> None:
        from transformers import AutoTokenizer

        self.path = pathlib.Path(path)
        if not self.path.is_dir():
            raise ValueError(f"model.hf_dir={str(path)!r} is not a directory; point it at a local Hugging Face "
                             "checkpoint directory (with tokenizer.json / tokenizer_config.json)")
        try:
            self.hf = AutoTokenizer.from_pretrained(str(self.path), local_files_only=True)
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot load the tokenizer of model.hf_dir={str(path)!r} ({exc}); the directory "
                             "needs the checkpoint's tokenizer files (tokenizer.json, tokenizer_config.json)") from exc
        if self.hf.eos_token_id is None:
            raise ValueError(f"the tokenizer in {path} has no eos token; set eos_token in its tokenizer_config.json")
        self.eos_id: int = self.hf.eos_token_id
        self.bos_id: int | None = self.hf.bos_token_id
        self.pad_id: int = self.hf.pad_token_id if self.hf.pad_token_id is not None else self.eos_id
        self.vocab_size: int = len(self.hf)
        self.eot_id: int = self._end_of_turn() or self.eos_id
        self.stop_ids: list[int] = sorted({self.eos_id, self.eot_id, *self._generation_eos()})

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def encode(self, text: str, *, strict: bool = True) -> list[int]:
        """Text -> ids; no bos/eos added (special tokens written in the text, e.g. by a chat
        template, become their ids). ``strict`` is accepted for interface parity: a byte-level
        tokenizer encodes any text."""
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int], *, skip_special: bool = False, strict: bool = True) -> str:
        """Ids -> text. Ids outside the tokenizer (a model's padded vocabulary) raise, or with
        ``strict=False`` decode to U+FFFD."""
        if strict and any(not 0 <= i < self.vocab_size for i in ids):
            bad = next(i for i in ids if not 0 <= i < self.vocab_size)
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        parts, run = [], []  # decode runs of known ids; each unknown id becomes U+FFFD between them
        for i in ids:
            if 0 <= i < self.vocab_size:
                run.append(i)
            else:
                parts.append(self.hf.decode(run, skip_special_tokens=skip_special) + "\ufffd")
                run = []
        parts.append(self.hf.decode(run, skip_special_tokens=skip_special))
        return "".join(parts)

    def render_chat(self, messages: list[dict[str, Any]]) -> str:
        """The chat template's text of ``messages`` followed by the assistant's generation prompt."""
        return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def save_hf_tokenizer(self, out_dir: str | pathlib.Path) -> None:
        """Write this tokenizer's files into ``out_dir`` (an exported model directory)."""
        self.hf.save_pretrained(str(out_dir))

    def _end_of_turn(self) -> int | None:
        if not self.has_chat_template:
            return None
        try:
            text = self.hf.apply_chat_template([{"role": "user", "content": "hi"},
                                                {"role": "assistant", "content": _PROBE}], tokenize=False)
        except Exception as exc:  # noqa: BLE001 - a template that needs other fields: fall back to eos
            logger.warning("chat template of %s did not render a probe conversation (%s); stop on eos only",
                           self.path, exc)
            return None
        tail = self.encode(text.rsplit(_PROBE, 1)[-1]) if _PROBE in text else []
        special = set(self.hf.all_special_ids) | set(self.hf.added_tokens_decoder)
        return next((i for i in tail if i in special), None)

    def _generation_eos(self) -> list[int]:
        path = self.path / "generation_config.json"
        if not path.is_file():
            return []
        try:
            eos = json.loads(path.read_text()).get("eos_token_id")
        except (json.JSONDecodeError, AttributeError):
            return []
        ids = eos if isinstance(eos, list) else [eos]
        return [i for i in ids if isinstance(i, int) and 0 <= i < self.vocab_size]


def check_vocab(tokenizer, vocab_size: int, where: str) -> None:
    """ValueError when the tokenizer can emit ids the model has no embedding for."""
    if tokenizer.vocab_size > vocab_size:
        raise ValueError(f"the tokenizer of {where} has {tokenizer.vocab_size} ids but model.vocab_size={vocab_size}; "
                         f"set model.vocab_size >= {tokenizer.vocab_size} (the checkpoint's config.json vocab_size), "
                         "or point model.hf_dir at the checkpoint this tokenizer belongs to")
