"""A byte-level tokenizer with Qwen3's chat and tool markers as single ids: any text, in a vocabulary a
tiny model (512 ids) covers, so a model built from scratch on the CPU can hold multi-turn, tool-using
conversations in Qwen3's chat template (meshy.recipes.prompts.chat_templates).

Ids 0-255 are the bytes of the UTF-8 text; the markers follow, in MARKERS order. Decoding gives the exact
text back (bytes that do not form UTF-8 are replaced). A model's vocabulary may be larger than this one:
ids beyond it, which a model from scratch can sample, decode to nothing (as the arithmetic task's
character tokenizer does).
"""

from meshy.dataplane import SchemaError

MARKERS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
)
_FIRST_MARKER = 256


class ByteTokenizer:
    vocab_size = _FIRST_MARKER + len(MARKERS)
    bos_token_id = pad_token_id = _FIRST_MARKER + MARKERS.index("<|endoftext|>")
    eos_token_id = _FIRST_MARKER + MARKERS.index("<|im_end|>")

    def encode(self, text: str) -> list[int]:
        """Ids of exactly `text` (no special token added): each marker one id, anything else its bytes."""
        if not isinstance(text, str):
            raise SchemaError(f"byte tokenizer: encode expects a str, got {type(text).__name__}")
        ids: list[int] = []
        start = 0
        while start < len(text):
            at = text.find("<", start)
            end = len(text) if at == -1 else at
            ids += text[start:end].encode()
            if at == -1:
                break
            marker = next((m for m in MARKERS if text.startswith(m, at)), None)
            if marker is None:
                ids += b"<"
                start = at + 1
            else:
                ids.append(_FIRST_MARKER + MARKERS.index(marker))
                start = at + len(marker)
        return ids

    def decode(self, ids: list[int]) -> str:
        out, pending = [], bytearray()
        for i in ids:
            if 0 <= i < _FIRST_MARKER:
                pending.append(i)
            elif _FIRST_MARKER <= i < self.vocab_size:
                out += [pending.decode(errors="replace"), MARKERS[i - _FIRST_MARKER]]
                pending = bytearray()
        return "".join(out) + pending.decode(errors="replace")


def tokenizer() -> ByteTokenizer:
    return ByteTokenizer()
