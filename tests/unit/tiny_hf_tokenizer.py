"""A tiny Hugging Face tokenizer built locally (no download): BPE trained in memory, ChatML template.

Small enough (<= 120 ids) for the tiny CPU model's vocab_size of 128. Shared by the math/code unit
tests and the e2e run (which imports this file by path).
"""

from __future__ import annotations

import json
import pathlib

SPECIALS = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen-style ChatML: the assistant turn ends with <|im_end|>, the generation prompt opens one.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CORPUS = [
    "What is 1/2 + 1/4? The answer is \\boxed{3/4}.",
    "Compute 12 * 7 = 84, so the final answer is \\boxed{84}.",
    "def add(a, b):\n    return a + b\nassert add(1, 2) == 3",
    "```python\nprint(sum(range(10)))\n```",
    "user assistant system: solve the problem step by step, then answer.",
    "0123456789 +-*/=()[]{}<>.,;:!?'\"#%&$@^_|~`\\ abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ",
]


def build_tokenizer(out_dir: pathlib.Path, *, vocab_size: int = 120, chat_template: bool = True,
                    eos: str = "<|endoftext|>") -> pathlib.Path:
    """Train, save (tokenizer.json + tokenizer_config.json) into ``out_dir`` and return it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_next")
    tok.decoder = decoders.Fuse()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token=eos,
                                   pad_token="<|endoftext|>", additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    if chat_template:
        fast.chat_template = CHAT_TEMPLATE
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out_dir))
    return out_dir


def write_generation_config(out_dir: pathlib.Path, eos_ids: list[int]) -> None:
    (out_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_ids}))
