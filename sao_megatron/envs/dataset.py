"""JSONL prompt datasets with errors that say what to fix.

Each line is one JSON object with either ``"prompt"`` (text, tokenized with the task's tokenizer,
bos prepended), ``"messages"`` (chat form, for tasks that pass a ``render`` function) or
``"input_ids"`` (token ids, used as given), plus any task fields (``"answer"``, ...) kept as the
prompt's ``meta``.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Callable

from sao_megatron.envs.base import Prompt
from sao_megatron.envs.tokenizer import CharTokenizer


class DatasetError(ValueError):
    """A dataset file that cannot be used as given."""


def load_jsonl(path: str | pathlib.Path, tokenizer: CharTokenizer, *, max_prompt_tokens: int,
               required: tuple[str, ...] = (), render: Callable[[dict], list[int]] | None = None,
               example: str = '{"prompt": "3+4=", "answer": "7"}') -> list[Prompt]:
    """Read prompts from ``path``; ``required`` names meta fields every line must have.

    ``render(record) -> ids`` tokenizes a ``prompt``/``messages`` line (default: bos + the prompt's
    tokens; ValueError for a bad line); ``example`` is a valid line, quoted in error messages.
    """
    p = pathlib.Path(path)
    if not p.is_file():
        raise DatasetError(f"data.path={str(path)!r}: no such file; point data.path at a JSONL file "
                           "(one JSON object per line) or set it to null to use the task's generator")
    prompts = []
    with p.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                prompts.append(_parse_line(line, f"{p}:{lineno}", len(prompts), tokenizer,
                                           max_prompt_tokens, required, render, example))
    if not prompts:
        raise DatasetError(f"data.path={str(path)!r} holds no prompts (empty file); add lines like "
                           f"{example}")
    return prompts


def _parse_line(line: str, where: str, index: int, tokenizer: CharTokenizer, max_prompt_tokens: int,
                required: tuple[str, ...], render: Callable[[dict], list[int]] | None, example: str) -> Prompt:
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as exc:
        raise DatasetError(f"{where}: not valid JSON ({exc.msg}); each line must be one JSON object") from None
    forms = ("prompt", "messages", "input_ids") if render else ("prompt", "input_ids")
    if not isinstance(rec, dict) or sum(k in rec for k in forms) != 1:
        raise DatasetError(f"{where}: each line must be a JSON object with exactly one of {list(forms)} "
                           "('prompt': text, 'messages': chat turns, 'input_ids': list of token ids)")
    missing = [k for k in required if k not in rec]
    if missing:
        raise DatasetError(f"{where}: missing field(s) {missing} that this task needs; a line looks like {example}")
    ids = _prompt_ids(rec, where, tokenizer, render)
    if len(ids) > max_prompt_tokens:
        raise DatasetError(f"{where}: prompt has {len(ids)} tokens, more than data.max_prompt_tokens="
                           f"{max_prompt_tokens}; shorten it or raise data.max_prompt_tokens")
    meta = {k: v for k, v in rec.items() if k != "input_ids"}
    return Prompt(index=index, input_ids=ids, meta=meta)


def _prompt_ids(rec: dict, where: str, tokenizer: CharTokenizer,
                render: Callable[[dict], list[int]] | None) -> list[int]:
    if "input_ids" in rec:
        ids = rec["input_ids"]
        if not (isinstance(ids, list) and ids and all(isinstance(i, int) and 0 <= i < tokenizer.vocab_size
                                                      for i in ids)):
            raise DatasetError(f"{where}: input_ids must be a non-empty list of ids in [0, {tokenizer.vocab_size})")
        return list(ids)
    if "prompt" in rec and (not isinstance(rec["prompt"], str) or not rec["prompt"]):
        raise DatasetError(f"{where}: 'prompt' must be a non-empty string")
    try:
        return render(rec) if render else [tokenizer.bos_id] + tokenizer.encode(rec["prompt"])
    except ValueError as exc:
        raise DatasetError(f"{where}: {exc}") from None
