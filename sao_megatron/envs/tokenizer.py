"""Character-level tokenizer for the tiny CPU tasks (vocabulary of 103 ids, < 128).

Ids: 0 pad, 1 bos, 2 eos, 3 ``<call>``, 4 ``</call>``, 5 ``<obs>``, 6 ``</obs>``, then one id per
printable ASCII character (space .. ``~``) and one for newline. ``save_hf_tokenizer`` writes an
equivalent ``tokenizers`` tokenizer.json (+ tokenizer_config.json) so a Hugging Face model
directory built for these tasks is complete and loads with ``AutoTokenizer``.
"""

from __future__ import annotations

import json
import pathlib

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<call>", "</call>", "<obs>", "</obs>")
_CHARS = [chr(c) for c in range(32, 127)] + ["\n"]


class CharTokenizer:
    """Maps text to ids one character at a time; special tokens only by id (never parsed from text)."""

    pad_id, bos_id, eos_id = 0, 1, 2
    call_id, call_end_id, obs_id, obs_end_id = 3, 4, 5, 6

    def __init__(self) -> None:
        self.id_to_token = list(SPECIAL_TOKENS) + _CHARS
        self._char_to_id = {ch: i + len(SPECIAL_TOKENS) for i, ch in enumerate(_CHARS)}

    @property
    def vocab_size(self) -> int:
        return len(self.id_to_token)

    def encode(self, text: str, *, strict: bool = True) -> list[int]:
        """Text -> ids (no bos/eos added). Raises ValueError naming the first unsupported character
        (``strict=False`` drops such characters instead: tool output, model-written text)."""
        if not strict:
            return [self._char_to_id[ch] for ch in text if ch in self._char_to_id]
        try:
            return [self._char_to_id[ch] for ch in text]
        except KeyError as exc:
            raise ValueError(f"character {exc.args[0]!r} is not in the char tokenizer's vocabulary "
                             f"(printable ASCII and newline only): {text[:60]!r}") from None

    def decode(self, ids: list[int], *, skip_special: bool = False, strict: bool = True) -> str:
        """Ids -> text; special ids render as their names unless ``skip_special``.

        A model's (padded) vocabulary can be larger than this one: with ``strict=False`` ids outside
        it decode to U+FFFD (never a vocabulary character) instead of raising.
        """
        out = []
        for i in ids:
            if not 0 <= i < self.vocab_size:
                if not strict:
                    out.append("\ufffd")
                    continue
                raise ValueError(f"token id {i} is outside the vocabulary [0, {self.vocab_size})")
            if i < len(SPECIAL_TOKENS) and skip_special:
                continue
            out.append(self.id_to_token[i])
        return "".join(out)

    def save_hf_tokenizer(self, out_dir: str | pathlib.Path) -> pathlib.Path:
        """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into ``out_dir``."""
        from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

        out = pathlib.Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        vocab = {tok: i for i, tok in enumerate(self.id_to_token)}
        tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
        # Every character is its own pre-token; [\s\S] also matches the newline.
        tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
        tok.decoder = decoders.Fuse()
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
        tok.save(str(out / "tokenizer.json"))
        specials = {"pad_token": "<pad>", "bos_token": "<bos>", "eos_token": "<eos>"}
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 20,
                  "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
                  "additional_special_tokens": list(SPECIAL_TOKENS[3:]), **specials}
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
        (out / "special_tokens_map.json").write_text(json.dumps(specials, indent=2))
        return out / "tokenizer.json"
