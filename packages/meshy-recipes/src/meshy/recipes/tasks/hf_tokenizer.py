"""The tokenizer of an HF model directory (tokenizer.json, with the special ids from config.json) behind
the task tokenizer interface; recipes name `tokenizer` with tokenizer_options = { model = ... }.

SmolLM2 chats in ChatML: "<|im_start|>user\\n...<|im_end|>\\n<|im_start|>assistant\\n"; it ends a turn with
<|im_end|>, its eos.
"""

import functools
import json
from pathlib import Path

from tokenizers import Tokenizer

from meshy.dataplane import SchemaError
from meshy.recipes.weights.pretrained import resolve


class HFTokenizer:
    """Text <-> ids. Special tokens written in text ("<|im_start|>") encode as their single ids."""

    def __init__(self, directory: str | Path):
        directory = Path(directory)
        for name in ("tokenizer.json", "config.json"):
            if not (directory / name).is_file():
                raise SchemaError(f"tokenizer: expected {name} in the model directory {directory}")
        self._tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
        config = json.loads((directory / "config.json").read_text())
        eos = config.get("eos_token_id")
        eos = eos[0] if isinstance(eos, list) and eos else eos
        if not isinstance(eos, int):
            raise SchemaError(f"tokenizer: {directory / 'config.json'} eos_token_id: expected an id, got {eos!r}")
        self.eos_token_id: int = eos
        self.bos_token_id: int | None = config.get("bos_token_id")
        # The model's embedding rows: ids past the tokenizer's own (padding rows) decode to "".
        self.vocab_size: int = max(config.get("vocab_size", 0), self._tokenizer.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise SchemaError(f"tokenizer: encode expects a str, got {type(text).__name__}")
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        """The exact text of `ids`, special tokens included."""
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise SchemaError(f"tokenizer: ids must be in [0, {self.vocab_size}), got {bad[:5]}")
        return self._tokenizer.decode(ids, skip_special_tokens=False)

    def token_to_id(self, token: str) -> int:
        token_id = self._tokenizer.token_to_id(token)
        if token_id is None:
            raise SchemaError(f"tokenizer: {token!r} is not a token")
        return token_id


@functools.cache
def tokenizer(model: str) -> HFTokenizer:
    """The tokenizer of `model`, named as model.init names weights: an HF directory, "hf:<owner/name>" or
    "gguf:<name>" (meshy.recipes.weights.pretrained; downloaded or converted on first use)."""
    return HFTokenizer(resolve(model))
