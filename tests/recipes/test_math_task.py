"""The math task: data loaders, chat templates, rewards and the problems() entry point, on small files
the tests write (no hub, no network)."""

import itertools
import json
import sys
import time
import types
from concurrent.futures import ThreadPoolExecutor

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from meshy.dataplane import SchemaError
from meshy.recipes.prompts.chat_templates import Message, observation, render, render_minicpm5, render_qwen3
from meshy.recipes.prompts.problem import Problem
from meshy.recipes.tasks import math_reward
from meshy.recipes.tasks.math import BOXED_INSTRUCTION, problems
from meshy.recipes.tasks.math_data import Record, generated_records, load_records
from meshy.recipes.tasks.math_reward import (
    boxed_reward,
    dapo_reward,
    extract_boxed,
    extract_dapo_answer,
    math_verify_reward,
)
from meshy.recipes.tasks.verify_worker import VerifyWorker

DAPO_INSTRUCTION = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{q}\n\nRemember to put "
    'your answer on its own line after "Answer:".'
)
DAPO_PROBLEMS = [("What is 1+1?", "2"), ("Compute $\\frac{3}{6}$.", "\\frac{1}{2}"), ("What is 6*7?", "42")]


def dapo_row(question: str, answer: str, index: int) -> dict:
    return {
        "data_source": "math_dapo",
        "prompt": [{"role": "user", "content": DAPO_INSTRUCTION.format(q=question)}],
        "ability": "MATH",
        "reward_model": {"ground_truth": answer, "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": str(index)},
    }


def write(path, rows: list[dict]):
    if path.suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    elif path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    else:
        path.write_text(json.dumps(rows))
    return path


@pytest.fixture
def dapo_rows() -> list[dict]:
    """Each problem three times, interleaved, as DAPO-Math-17k repeats its problems."""
    return [dapo_row(q, a, i) for i, (q, a) in enumerate(DAPO_PROBLEMS * 3)]


# ---- data ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("suffix", [".parquet", ".jsonl", ".json"])
def test_dapo_rows_are_deduplicated_in_file_order(tmp_path, dapo_rows, suffix):
    records = load_records(str(write(tmp_path / f"dapo{suffix}", dapo_rows)), "dapo")
    assert records == [Record(DAPO_INSTRUCTION.format(q=q), a) for q, a in DAPO_PROBLEMS]


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_ultradata_rows_filtered_by_domain(tmp_path, suffix):
    rows = [
        {"uuid": "a", "query": "What is 2+3?", "ground_truth": "5", "source": "x", "domain": "Math"},
        {"uuid": "b", "query": "Name a prime.", "ground_truth": "2", "source": "x", "domain": "Science"},
        {"uuid": "c", "query": "Solve x+1=3.", "ground_truth": "2", "source": "y", "domain": "Math"},
    ]
    path = str(write(tmp_path / f"ultra{suffix}", rows))
    assert load_records(path, "ultradata", domain="Math") == [Record("What is 2+3?", "5"), Record("Solve x+1=3.", "2")]
    assert len(load_records(path, "ultradata")) == 3
    with pytest.raises(SchemaError, match="no ultradata records of domain 'Art'"):
        load_records(path, "ultradata", domain="Art")


def test_gsm8k_answers_are_the_number_after_the_hashes_without_commas(tmp_path):
    rows = [
        {"question": "Sam has 1,200 coins and finds 34 more. How many?", "answer": "1200 + 34 = 1234\n#### 1,234"},
        {"question": "What is 5-7?", "answer": "5 - 7 = -2\n#### -2"},
    ]
    assert load_records(str(write(tmp_path / "gsm8k.jsonl", rows)), "gsm8k") == [
        Record(rows[0]["question"], "1234"),
        Record("What is 5-7?", "-2"),
    ]


@pytest.mark.parametrize(
    ("name", "format", "rows", "needle"),
    [
        (
            "dapo.jsonl",
            "dapo",
            [dapo_row("a", "1", 0), {"prompt": [{"role": "user", "content": "b"}]}],
            "dapo.jsonl: row 1: missing field 'reward_model'",
        ),
        (
            "dapo.parquet",
            "dapo",
            [dapo_row("a", "1", 0), {**dapo_row("b", "2", 1), "reward_model": {"ground_truth": None, "style": "s"}}],
            "dapo.parquet: row 1: missing field 'ground_truth'",
        ),
        ("dapo.json", "dapo", [{"prompt": [], "reward_model": {}}], "dapo.json: row 0: field 'prompt': expected"),
        (
            "ultra.parquet",
            "ultradata",
            [{"query": "q", "answer": "1"}],
            "ultra.parquet: missing field 'ground_truth' (no such column",
        ),
        (
            "ultra.jsonl",
            "ultradata",
            [{"query": "q", "ground_truth": "1"}, {"query": " ", "ground_truth": "2"}],
            "ultra.jsonl: row 1: field 'query': expected non-empty text",
        ),
        (
            "gsm8k.jsonl",
            "gsm8k",
            [{"question": "q", "answer": "#### 3"}, {"question": "q2", "answer": "the answer is 4"}],
            "gsm8k.jsonl: row 1: field 'answer': expected a solution ending in '#### <number>'",
        ),
        ("rows.json", "gsm8k", {"question": "q"}, "rows.json: expected a JSON array of rows"),
    ],
)
def test_a_bad_row_names_the_file_and_the_row(tmp_path, name, format, rows, needle):
    path = tmp_path / name
    if name.endswith(".json"):
        path.write_text(json.dumps(rows))
    else:
        write(path, rows)
    with pytest.raises(SchemaError, match=needle.replace("(", r"\(").replace("*", r"\*")):
        load_records(str(path), format)


def test_unreadable_files(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"question": "q", "answer": "#### 1"}\n{not json\n')
    with pytest.raises(SchemaError, match=r"bad.jsonl: line 2: not valid JSON"):
        load_records(str(tmp_path / "bad.jsonl"), "gsm8k")
    (tmp_path / "rows.csv").write_text("question,answer\n")
    with pytest.raises(SchemaError, match=r"unknown file type '.csv'"):
        load_records(str(tmp_path / "rows.csv"), "gsm8k")
    (tmp_path / "broken.parquet").write_text("not parquet")
    with pytest.raises(SchemaError, match=r"broken.parquet: not a readable parquet file"):
        load_records(str(tmp_path / "broken.parquet"), "dapo")
    with pytest.raises(SchemaError, match=r"format: unknown data format 'csv'; expected one of \('dapo'"):
        load_records(str(tmp_path / "bad.jsonl"), "csv")
    with pytest.raises(SchemaError, match=r"source: no file .*missing.parquet"):
        load_records(str(tmp_path / "missing.parquet"), "dapo")


def test_a_hub_name_without_huggingface_hub_says_what_it_needs(monkeypatch):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # import fails
    with pytest.raises(
        SchemaError, match="no file BytedTsinghua-SIA/DAPO-Math-17k; hub dataset names need the optional "
    ):
        load_records("BytedTsinghua-SIA/DAPO-Math-17k", "dapo")


def test_a_hub_name_downloads_its_one_data_file(tmp_path, monkeypatch, dapo_rows):
    local = write(tmp_path / "dapo-math-17k.parquet", dapo_rows)
    calls = []

    def hf_hub_download(repo, filename, repo_type):
        calls.append((repo, filename, repo_type))
        return str(local)

    def list_repo_files(repo, repo_type):
        return ["README.md", "data/dapo-math-17k.parquet"] if repo == "org/one" else ["a.parquet", "b.parquet"]

    hub = types.SimpleNamespace(hf_hub_download=hf_hub_download, list_repo_files=list_repo_files)
    monkeypatch.setitem(sys.modules, "huggingface_hub", hub)
    assert len(load_records("org/one", "dapo")) == 3
    assert len(load_records("org/two:b.parquet", "dapo")) == 3
    assert calls == [("org/one", "data/dapo-math-17k.parquet", "dataset"), ("org/two", "b.parquet", "dataset")]
    with pytest.raises(SchemaError, match=r"has data files \['a.parquet', 'b.parquet'\]; name one as 'org/two:<path>'"):
        load_records("org/two", "dapo")

    def offline(repo, repo_type):
        raise ConnectionError("no network")

    monkeypatch.setattr(hub, "list_repo_files", offline)
    with pytest.raises(SchemaError, match=r"downloading it from the hub failed \(ConnectionError: no network\)"):
        load_records("org/one", "dapo")


def test_generated_problems_are_seeded_integer_word_problems():
    first = list(itertools.islice(generated_records(7), 200))
    assert first == list(itertools.islice(generated_records(7), 200))
    assert first != list(itertools.islice(generated_records(8), 200))
    assert all(r.question.endswith("?") and int(r.answer) >= 0 for r in first)
    assert len({r.question.split(" ")[1] for r in first}) > 2  # several kinds of problem


# ---- chat templates -----------------------------------------------------------------------------
def test_qwen3_one_turn_matches_the_official_template():
    user = [Message("user", "What is 1+1?")]
    assert render_qwen3(user, enable_thinking=False) == (
        "<|im_start|>user\nWhat is 1+1?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    expected = "<|im_start|>user\nWhat is 1+1?<|im_end|>\n<|im_start|>assistant\n"
    assert render_qwen3(user, enable_thinking=True) == expected
    assert render_qwen3(user) == expected  # undefined: the model decides, as with True
    assert render_qwen3([Message("system", "Be brief."), *user], enable_thinking=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is 1+1?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert render_qwen3(user, add_generation_prompt=False) == "<|im_start|>user\nWhat is 1+1?<|im_end|>\n"


def test_qwen3_keeps_thinking_only_after_the_last_user_turn():
    messages = [
        Message("user", "1+1?"),
        Message("assistant", "<think>\nadd them\n</think>\n\n2"),
        Message("user", "2+2?"),
        Message("assistant", "4"),
    ]
    assert render_qwen3(messages, add_generation_prompt=False) == (
        "<|im_start|>user\n1+1?<|im_end|>\n<|im_start|>assistant\n2<|im_end|>\n"
        "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n4<|im_end|>\n"
    )
    assert render_minicpm5(messages, add_generation_prompt=False) == (
        "<s><|im_start|>user\n1+1?<|im_end|>\n<|im_start|>assistant\n2<|im_end|>\n"
        "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n"
    )


def test_minicpm5_generation_prompt():
    user = [Message("user", "Hi")]
    start = "<s><|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert render_minicpm5(user, enable_thinking=False) == start + "<think>\n\n</think>\n\n"
    assert render_minicpm5(user, enable_thinking=True) == start + "<think>\n"
    assert render_minicpm5(user) == start


def test_template_names_and_roles_are_checked():
    assert render("plain", [Message("system", "S"), Message("user", "Q")]) == "S\n\nQ"
    with pytest.raises(SchemaError, match=r"template: unknown chat template 'llama'; expected one of \('qwen3'"):
        render("llama", [Message("user", "Q")])
    with pytest.raises(SchemaError, match="Message.role: expected"):
        Message("robot", "x")
    for template in ("minicpm5", "plain"):
        with pytest.raises(SchemaError, match=f"template '{template}': renders no tools or tool messages"):
            render(template, [Message("user", "Q"), Message("tool", "42")])
        with pytest.raises(SchemaError, match=f"template '{template}': renders no tools"):
            observation(template, ["42"])
    with pytest.raises(SchemaError, match="observation results: expected at least one tool result"):
        observation("qwen3", [])


CALC = {"type": "function", "function": {"name": "calc", "description": "Evaluate.", "parameters": {}}}
CALC_JSON = '{"type": "function", "function": {"name": "calc", "description": "Evaluate.", "parameters": {}}}'
TOOLS_SYSTEM = (  # Qwen3's tokenizer_config.json template, its `tools` branch, written out by hand
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n" + CALC_JSON + "\n</tools>"
    "\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call>"
    ' XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
)


def test_qwen3_lists_tools_in_the_system_turn_and_groups_tool_results_in_one_user_turn():
    call = '<tool_call>\n{"name": "calc", "arguments": {"e": "6*7"}}\n</tool_call>'
    messages = [
        Message("system", "Be brief."),
        Message("user", "6*7?"),
        Message("assistant", "<think>\nuse the tool\n</think>\n\n" + call),
        Message("tool", "42"),
        Message("tool", "ok"),
        Message("assistant", "42"),
    ]
    assert render_qwen3(messages, add_generation_prompt=False, tools=[CALC]) == (
        "<|im_start|>system\nBe brief.\n\n" + TOOLS_SYSTEM + "<|im_start|>user\n6*7?<|im_end|>\n"
        # both assistant turns come after the last query (a turn of tool responses is not one)
        "<|im_start|>assistant\n<think>\nuse the tool\n</think>\n\n" + call + "<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n42\n</tool_response>\n<tool_response>\nok\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n42<|im_end|>\n"
    )
    assert render("qwen3", messages[1:2], tools=[CALC]).startswith("<|im_start|>system\n" + TOOLS_SYSTEM)


def test_an_observation_is_what_the_template_writes_between_two_assistant_turns():
    results = ["42", "ok"]
    expected = (
        "\n<|im_start|>user\n<tool_response>\n42\n</tool_response>\n<tool_response>\nok\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n"
    )
    assert observation("qwen3", results) == expected
    assert observation("qwen3", results, enable_thinking=False) == expected + "<think>\n\n</think>\n\n"
    turn = [Message("user", "Q"), Message("assistant", "<think>\nr\n</think>\n\nA")]
    whole = render("qwen3", [*turn, *(Message("tool", r) for r in results)])
    assert whole == render("qwen3", turn, add_generation_prompt=False).removesuffix("\n") + observation(
        "qwen3", results
    )


# ---- the task entry point -----------------------------------------------------------------------
def test_generated_problems_need_no_files():
    stream = problems(3)
    first = list(itertools.islice(stream, 20))
    assert first == list(itertools.islice(problems(3), 20))
    assert all(isinstance(p, Problem) and p.answer.isdigit() for p in first)
    assert first[0].prompt.startswith("<|im_start|>user\n")
    assert first[0].prompt.endswith("within \\boxed{}.<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_file_problems_repeat_in_a_seeded_shuffled_order(tmp_path, dapo_rows):
    path = str(write(tmp_path / "dapo.parquet", dapo_rows))
    run = [(p.prompt, p.answer) for p in itertools.islice(problems(5, source=path, format="dapo"), 30)]
    assert run == [(p.prompt, p.answer) for p in itertools.islice(problems(5, source=path, format="dapo"), 30)]
    epochs = [run[i : i + 3] for i in range(0, 30, 3)]
    assert all(sorted(a for _, a in epoch) == ["2", "42", "\\frac{1}{2}"] for epoch in epochs)
    assert len({tuple(epoch) for epoch in epochs}) > 1  # a new order each epoch
    other = [(p.prompt, p.answer) for p in itertools.islice(problems(6, source=path, format="dapo"), 30)]
    assert other != run
    question = DAPO_INSTRUCTION.format(q="What is 1+1?")  # DAPO rows carry their own instruction
    assert (render_qwen3([Message("user", question)], enable_thinking=False), "2") in run


def test_prompt_options(tmp_path):
    path = str(write(tmp_path / "gsm8k.jsonl", [{"question": "What is 2+2?", "answer": "2+2=4\n#### 4"}]))
    boxed = BOXED_INSTRUCTION.replace("{question}", "What is 2+2?")
    assert next(problems(0, source=path, format="gsm8k", template="plain")) == Problem(boxed, "4")
    custom = next(
        problems(
            0,
            source=path,
            format="gsm8k",
            template="minicpm5",
            enable_thinking=True,
            instruction="Q: {question}\nEnd with Answer:",
            system="You are a careful solver.",
        )
    )
    assert custom.prompt == (
        "<s><|im_start|>system\nYou are a careful solver.<|im_end|>\n"
        "<|im_start|>user\nQ: What is 2+2?\nEnd with Answer:<|im_end|>\n<|im_start|>assistant\n<think>\n"
    )


@pytest.mark.parametrize(
    ("options", "needle"),
    [
        ({"source": "x.parquet", "format": "csv"}, r"format: expected one of \('dapo', 'ultradata', 'gsm8k'\)"),
        ({"source": "x.parquet"}, r"format: expected one of .* for source 'x.parquet', got None"),
        ({"format": "dapo"}, 'format, domain: the "generated" source takes neither'),
        ({"template": "llama3"}, r"template: unknown chat template 'llama3'; expected one of \('qwen3', 'minicpm5'"),
        ({"instruction": "Solve it."}, r"instruction: expected text containing \{question\}"),
        ({"enable_thinking": "no"}, "MathOptions.enable_thinking: expected bool, got str 'no'"),
        ({"shuffle": True}, r"math task: unknown option 'shuffle'; expected some of \['source'"),
        ({"source": "missing/nowhere.jsonl", "format": "gsm8k"}, "source: no file missing/nowhere.jsonl"),
    ],
)
def test_bad_options_fail_when_the_stream_is_made(options, needle):
    with pytest.raises(SchemaError, match=needle):
        problems(0, **options)


# ---- rewards ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so \\boxed{42}.", "42"),
        ("\\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),
        ("\\fbox{x^{2}}", "x^{2}"),
        ("\\boxed {7}", "7"),
        ("\\boxed{\\frac{1}{", None),
        ("\\boxed{}", None),
        ("no box here: 42", None),
    ],
)
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Work...\nAnswer: 42", "42"),
        ("answer: 1\nso\nANSWER:  $\\frac{1}{2}$  \n", "$\\frac{1}{2}$"),
        ("Answer:\n", None),
        ("The result is 42", None),
    ],
)
def test_extract_dapo_answer(text, expected):
    assert extract_dapo_answer(text) == expected


EQUIVALENT = [
    ("0.5", "\\frac{1}{2}"),
    ("1/2", "\\frac{1}{2}"),
    ("\\dfrac{1}{2}", "0.5"),
    ("42.0", "42"),
    ("1,234", "1234"),
    ("\\{2, 1\\}", "\\{1,2\\}"),
    ("(1, 2]", "(1,2]"),
    ("2\\sqrt{2}", "\\sqrt{8}"),
    ("x = 5", "5"),
]
NOT_EQUIVALENT = [("-42", "42"), ("[1, 2]", "(1,2]"), ("\\frac{1}{3}", "0.5"), ("\\{1,2,3\\}", "\\{1,2\\}")]


@pytest.mark.parametrize(("answer", "truth"), EQUIVALENT)
def test_equivalent_forms_score_one(answer, truth):
    assert boxed_reward(f"Thinking.\nSo the answer is \\boxed{{{answer}}}", truth) == 1.0
    assert dapo_reward(f"Thinking.\nAnswer: {answer}", truth) == 1.0
    assert math_verify_reward(f"Thinking. The final answer is $\\boxed{{{answer}}}$", truth) == 1.0


@pytest.mark.parametrize(("answer", "truth"), NOT_EQUIVALENT)
def test_different_answers_score_zero(answer, truth):
    assert boxed_reward(f"\\boxed{{{answer}}}", truth) == 0.0
    assert dapo_reward(f"Answer: {answer}", truth) == 0.0
    assert math_verify_reward(f"\\boxed{{{answer}}}", truth) == 0.0


@pytest.mark.parametrize(
    "response",
    ["", "I do not know.", "\\boxed{\\frac{1}{", "Answer: \\frac{1}{", "Answer: $$", "\\boxed{}", "}{\\left( ^_^"],
)
def test_missing_or_malformed_answers_score_zero(response):
    assert (boxed_reward(response, "42"), dapo_reward(response, "42"), math_verify_reward(response, "42")) == (0, 0, 0)


def test_huge_responses_are_cut_to_their_tail():
    filler = "Let me think about \\frac{1}{ this {" * 300_000  # 10 MB, unbalanced braces everywhere
    start = time.monotonic()
    assert boxed_reward(filler + "\n\\boxed{42}", "42") == 1.0
    assert dapo_reward(filler + "\nAnswer: 42", "42") == 1.0
    assert math_verify_reward(filler + " The final answer is \\boxed{42}", "42") == 1.0
    assert boxed_reward(filler, "42") == dapo_reward(filler, "42") == 0.0
    assert boxed_reward("\\boxed{" + "1" * 5000 + "}", "1" * 5000) == 0.0  # over MAX_ANSWER_CHARS
    assert time.monotonic() - start < 30


def test_a_check_that_never_ends_is_killed_and_the_worker_recovers(monkeypatch):
    worker = VerifyWorker(timeout_s=1.0)
    monkeypatch.setattr(math_reward, "_WORKER", worker)
    try:
        start = time.monotonic()
        assert boxed_reward("\\boxed{9^{9^{9^{9}}}}", "42") == 0.0  # sympy would compute it for ever
        assert time.monotonic() - start < 20
        assert boxed_reward("\\boxed{0.5}", "\\frac{1}{2}") == 1.0
    finally:
        worker.close()


def test_rewards_from_worker_threads_match_the_main_thread():
    cases = [
        (reward, text.format(a=answer), truth)
        for answer, truth in EQUIVALENT[:5] + NOT_EQUIVALENT
        for reward, text in (
            (boxed_reward, "\\boxed{{{a}}}"),
            (dapo_reward, "Answer: {a}"),
            (math_verify_reward, "The final answer is $\\boxed{{{a}}}$"),
        )
    ]
    main = [reward(text, truth) for reward, text, truth in cases]
    with ThreadPoolExecutor(4) as pool:
        threaded = list(pool.map(lambda case: case[0](case[1], case[2]), cases))
    assert threaded == main
    assert sum(main) == 15
