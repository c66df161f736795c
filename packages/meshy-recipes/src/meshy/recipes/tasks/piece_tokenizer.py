"""A tokenizer over a fixed list of text pieces: each id is one piece, text is split longest piece first.

A task whose conversations repeat the same long strings (a chat template's turns, a tool call's JSON
around its one argument) can make each such string one id, as a BPE vocabulary makes its frequent
strings and special tokens one id: the text stays exactly the template's, and a tiny model built from
scratch sees a few ids where bytes would be hundreds. Characters no piece covers encode as the
`unknown` piece; ids outside the vocabulary (a model's vocabulary may be larger) decode to nothing.
"""

from collections.abc import Sequence

from meshy.dataplane import SchemaError


class PieceTokenizer:
    def __init__(self, pieces: Sequence[str], *, bos: str, eos: str, unknown: str) -> None:
        if len(set(pieces)) != len(pieces) or "" in pieces:
            raise SchemaError("piece tokenizer: pieces must be distinct, non-empty strings")
        missing = [p for p in (bos, eos, unknown) if p not in pieces]
        if missing:
            raise SchemaError(f"piece tokenizer: bos, eos and unknown must be pieces; missing {missing}")
        self.pieces = tuple(pieces)
        self._ids = {piece: i for i, piece in enumerate(self.pieces)}
        self._by_first: dict[str, list[str]] = {}
        for piece in sorted(self.pieces, key=len, reverse=True):
            self._by_first.setdefault(piece[0], []).append(piece)
        self.vocab_size = len(self.pieces)
        self.bos_token_id = self.pad_token_id = self._ids[bos]
        self.eos_token_id = self._ids[eos]
        self._unknown = self._ids[unknown]

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise SchemaError(f"piece tokenizer: encode expects a str, got {type(text).__name__}")
        ids, at = [], 0
        while at < len(text):
            piece = next((p for p in self._by_first.get(text[at], ()) if text.startswith(p, at)), None)
            if piece is None:
                ids.append(self._unknown)
                at += 1
            else:
                ids.append(self._ids[piece])
                at += len(piece)
        return ids

    def decode(self, ids: list[int]) -> str:
        return "".join(self.pieces[i] for i in ids if 0 <= i < self.vocab_size)
