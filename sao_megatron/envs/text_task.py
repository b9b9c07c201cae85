"""Shared base of the natural-language tasks (``math``, ``code``) read from a JSONL dataset.

Each line holds ``"prompt"`` (text) or ``"messages"`` (chat form: ``[{"role": ..., "content": ...}]``)
plus the task's fields. With a chat tokenizer (``model.hf_dir`` set) the prompt is rendered by the
checkpoint's chat template with the assistant's generation prompt; ``data.options``:

- ``chat_template`` (default true): false feeds the raw text (bos + system prompt + prompt).
- ``system_prompt`` (default ""): a system message put before every prompt.
- ``instruction`` (default ""): text appended to every user prompt (e.g. "Put the final answer in
  \\boxed{}."), for datasets that do not carry it.

An optional ``"solution"`` field is the reference response used by the supervised warm-up.

Held-out evaluation problems (``heldout_prompts``, ``envs.split``): ``heldout_path`` (a second JSONL
file; lines whose prompt is also a training prompt are dropped) or ``heldout_fraction`` (a fixed hash
bucket of ``data.path`` held out of training).
"""

from __future__ import annotations

from typing import Any

from sao_megatron.config.schema import DataConfig
from sao_megatron.envs.arithmetic import parse_options
from sao_megatron.envs.base import Prompt, Task
from sao_megatron.envs.dataset import DatasetError, load_jsonl
from sao_megatron.envs.split import check_fraction, problem_key, require_heldout, split_by_bucket

_ROLES = ("system", "user", "assistant", "tool")


class TextTask(Task):
    """Prompts from ``data.path``; subclasses add the fields they need and the reward."""

    name = "text"
    required: tuple[str, ...] = ()
    """Fields every dataset line must have besides the prompt."""
    example = '{"prompt": "..."}'
    """One dataset line, for error messages."""
    defaults: dict[str, Any] = {"chat_template": True, "system_prompt": "", "instruction": "",
                                "heldout_fraction": 0.0, "heldout_path": ""}
    targets = "'answer'"
    """The reward-phase targets the task accepts (``data.phases``), for error messages."""

    @classmethod
    def check_target(cls, target: str) -> None:
        """ValueError unless ``target`` is a reward-phase target of this task (``data.phases``)."""
        if target not in ("", "answer"):
            raise ValueError(f"data.phases: task {cls.name!r} has only the target 'answer' (got {target!r}); "
                             "remove the phase or use task arithmetic/calculator for changing targets")

    def __init__(self, data: DataConfig, tokenizer) -> None:
        super().__init__(tokenizer)
        self.opts = parse_options(data.options, self.defaults, self.name)
        if data.path is None:
            raise ValueError(f"data.task={self.name!r} needs data.path: a JSONL file with one object per line "
                             f"like {self.example} (see examples/data/ for a sample)")
        self.path = data.path
        check_fraction(self.opts["heldout_fraction"])
        self._max_prompt_tokens = data.max_prompt_tokens
        # Every line of data.path (subclasses validate these); the split happens on first use.
        self._prompts = self._load(data.path)
        self._split: tuple[list[Prompt], list[Prompt]] | None = None

    def _load(self, path: str) -> list[Prompt]:
        return load_jsonl(path, self.tokenizer, max_prompt_tokens=self._max_prompt_tokens,
                          required=self.required, render=self.render, example=self.example)

    def _train_heldout(self) -> tuple[list[Prompt], list[Prompt]]:
        if self._split is None:
            train, heldout = split_by_bucket(self._prompts, self.opts["heldout_fraction"])
            if self.opts["heldout_path"]:
                keys = {problem_key(p) for p in train}
                heldout = [p for p in self._load(self.opts["heldout_path"]) if problem_key(p) not in keys]
            if not train:
                raise DatasetError(f"data.options.heldout_fraction={self.opts['heldout_fraction']} holds out every "
                                   f"prompt of {self.path!r}; lower it")
            self._split = (train, heldout)
        return self._split

    def prompts(self) -> list[Prompt]:
        """The training prompts: ``data.path`` minus the held-out bucket."""
        return self._train_heldout()[0]

    def heldout_prompts(self, num: int) -> list[Prompt]:
        found = self._train_heldout()[1][:num]
        return require_heldout(found, num, self.name, "set data.options.heldout_path (a JSONL file of evaluation "
                               "problems) or data.options.heldout_fraction (e.g. 0.1)")

    @property
    def stop_token_ids(self) -> list[int]:
        return list(getattr(self.tokenizer, "stop_ids", [self.tokenizer.eos_id]))

    @property
    def uses_chat(self) -> bool:
        return self.opts["chat_template"] and getattr(self.tokenizer, "has_chat_template", False)

    def render(self, rec: dict[str, Any]) -> list[int]:
        """Prompt tokens of one dataset line (ValueError saying what is wrong with it)."""
        messages = self._messages(rec)
        tok = self.tokenizer
        if self.uses_chat:
            return tok.encode(tok.render_chat(messages))
        text = "\n\n".join(str(m["content"]) for m in messages)
        return ([] if tok.bos_id is None else [tok.bos_id]) + tok.encode(text)

    def _messages(self, rec: dict[str, Any]) -> list[dict[str, Any]]:
        if "messages" in rec:
            msgs = rec["messages"]
            if not (isinstance(msgs, list) and msgs and all(
                    isinstance(m, dict) and m.get("role") in _ROLES and isinstance(m.get("content"), str)
                    for m in msgs)):
                raise ValueError(f"'messages' must be a non-empty list of {{\"role\": one of {list(_ROLES)}, "
                                 "\"content\": text}")
            msgs = [dict(m) for m in msgs]
        else:
            msgs = [{"role": "user", "content": rec["prompt"]}]
        if self.opts["instruction"]:
            users = [m for m in msgs if m["role"] == "user"]
            if not users:
                raise ValueError("'messages' has no user message to append data.options.instruction to")
            users[-1]["content"] += "\n\n" + self.opts["instruction"]
        if self.opts["system_prompt"] and msgs[0]["role"] != "system":
            msgs.insert(0, {"role": "system", "content": self.opts["system_prompt"]})
        return msgs

    def decode_actions(self, trajectory_ids: list[int], action_mask: list[int]) -> str:
        """Text of the policy's tokens up to the first stop token (eos or end of turn)."""
        ids = [t for t, m in zip(trajectory_ids, action_mask) if m]
        stops = set(self.stop_token_ids)
        end = next((k for k, t in enumerate(ids) if t in stops), len(ids))
        return self.tokenizer.decode(ids[:end], skip_special=True, strict=False)

    def ended(self, trajectory_ids: list[int]) -> bool:
        """The response was closed by a stop token (not cut at the length limit)."""
        return not set(self.stop_token_ids).isdisjoint(trajectory_ids)

    # ------------------------------------------------------------------ supervised warm-up
    def check_demonstrations(self) -> None:
        missing = [p.index for p in self._prompts if not isinstance(p.meta.get("solution"), str)]
        if missing:
            raise DatasetError(
                f"the supervised warm-up (run.sft_steps > 0) needs a reference response per prompt, but "
                f"{len(missing)} of {len(self._prompts)} lines of data.path={str(self.path)!r} have no string "
                f"'solution' field (first: line {missing[0] + 1}); set run.sft_steps: 0, or add "
                "\"solution\": \"<the full reference response>\" to every line")

    def demonstration(self, prompt: Prompt) -> list[int]:
        """The line's ``solution`` followed by the end-of-turn token."""
        solution = prompt.meta.get("solution")
        if not isinstance(solution, str):
            self.check_demonstrations()
        tok = self.tokenizer
        return tok.encode(solution) + [getattr(tok, "eot_id", tok.eos_id)]

