"""Multi-turn trajectories: one token sequence of the engine's own ids and the template's observation ids."""

import asyncio
import importlib
import itertools
import json
import time
from pathlib import Path

import pytest
import torch

from meshy.dataplane import SchemaError
from meshy.infer.engine import FINISH_LENGTH, FINISH_STOP, Generation, SamplingParams
from meshy.infer.torch_engine import TorchEngine
from meshy.recipes.agents.tool_environment import Step, ToolEnvironment, restore_state, saved_state
from meshy.recipes.agents.tools import MALFORMED, Tool, ToolBox
from meshy.recipes.agents.trajectory import (
    DEADLINE,
    DONE,
    MAX_TOKENS,
    MAX_TURNS,
    NO_VERSION,
    AgentLimits,
    run_trajectory,
)
from meshy.recipes.prompts.chat_templates import Message, observation, render
from meshy.recipes.tasks import calculator
from meshy.recipes.tasks.byte_tokenizer import ByteTokenizer
from meshy.train.models import get_model
from meshy.train.parallel import build_model
from meshy.train.publish import hf_tensors
from meshy.train.training_config import ParallelConfig

TOKENIZER = ByteTokenizer()


def where(values: list, mask: list[bool], policy: bool = True) -> list:
    """The entries of `values` at the policy's tokens (or, policy=False, at the observations' tokens)."""
    return [value for value, is_policy in zip(values, mask, strict=True) if is_policy == policy]


def add(a: int, b: int) -> int:
    return a + b


def calculator_env() -> ToolEnvironment:
    tools = ToolBox([Tool("add", add, "Add two integers.", {"a": "integer", "b": "integer"})], timeout_s=5)
    return ToolEnvironment(tools, prompt=lambda p: p["question"], score=lambda text, p: float(p["answer"] in text))


class ScriptedPolicy:
    """Answers each turn with the next scripted text (as its ids), recording what it was asked to continue."""

    def __init__(self, turns: list[tuple[str, int, str]]):
        self.turns = list(turns)  # (text, weights version, finish reason)
        self.inputs: list[list[int]] = []
        self.sent: list[Generation] = []

    async def __call__(self, input_ids: list[int], max_new_tokens: int) -> Generation:
        self.inputs.append(list(input_ids))
        text, version, finish = self.turns.pop(0)
        ids = TOKENIZER.encode(text)[:max_new_tokens]
        logprobs = [-0.01 * (len(self.sent) + 1) * (k + 1) for k in range(len(ids))]
        self.sent.append(Generation(f"t{len(self.sent)}", ids, logprobs, [version] * len(ids), finish))
        return self.sent[-1]


LIMITS = AgentLimits(max_turns=4, max_tokens=1000, deadline_s=30)
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 12, "b": 30}}\n</tool_call><|im_end|>'


def test_the_trajectory_is_the_engine_s_ids_then_the_template_s_observation_ids_in_turn():
    env, problem = calculator_env(), {"question": "12+30?", "answer": "42"}
    policy = ScriptedPolicy([(CALL, 3, FINISH_STOP), ("It is 42.<|im_end|>", 4, FINISH_STOP)])
    t = asyncio.run(run_trajectory(env, problem, policy, TOKENIZER, "qwen3", LIMITS))
    tools = [env.tool_schemas()[0]]
    assert t.prompt_ids == TOKENIZER.encode(render("qwen3", [Message("user", "12+30?")], tools=tools))
    first, second = (g.output_ids for g in policy.sent)
    shown = TOKENIZER.encode(observation("qwen3", ["42"]))
    assert t.response_ids == first + shown + second
    assert policy.inputs == [t.prompt_ids, t.prompt_ids + first + shown], "each turn continues the exact sequence"
    assert t.policy_mask == [True] * len(first) + [False] * len(shown) + [True] * len(second)
    assert t.logprobs == policy.sent[0].logprobs + [0.0] * len(shown) + policy.sent[1].logprobs
    assert t.token_versions == [3] * len(first) + [NO_VERSION] * len(shown) + [4] * len(second)
    assert (t.finish_reason, t.turns, t.reward) == (DONE, 2, 1.0)
    assert t.tool_calls == {"add": 1} and not t.tool_errors and len(t.tool_seconds) == 1
    assert (
        TOKENIZER.decode(shown)
        == "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


def test_a_malformed_call_is_answered_with_an_error_and_counted():
    policy = ScriptedPolicy(
        [("<tool_call>{oops}</tool_call><|im_end|>", 0, FINISH_STOP), ("42<|im_end|>", 0, FINISH_STOP)]
    )
    t = asyncio.run(
        run_trajectory(calculator_env(), {"question": "?", "answer": "42"}, policy, TOKENIZER, "qwen3", LIMITS)
    )
    assert (t.finish_reason, t.reward) == (DONE, 1.0)
    assert t.tool_calls == {"": 1} and t.tool_errors == {MALFORMED: 1}
    shown = TOKENIZER.decode(where(t.response_ids, t.policy_mask, policy=False))
    assert "<tool_response>\nerror: malformed tool call: not JSON: Expecting property name" in shown


def test_each_limit_ends_the_trajectory_which_is_kept_with_its_reason():
    problem = {"question": "?", "answer": "never"}
    policy = ScriptedPolicy([(CALL, 0, FINISH_STOP)] * 3)
    t = asyncio.run(run_trajectory(calculator_env(), problem, policy, TOKENIZER, "qwen3", AgentLimits(3, 1000, 30)))
    assert (t.finish_reason, t.turns, t.tool_calls) == (MAX_TURNS, 3, {"add": 3})
    assert t.policy_mask[-1], "the last turn's tokens are kept; no observation follows it"

    cut = ScriptedPolicy([(CALL, 0, FINISH_LENGTH)])
    t = asyncio.run(run_trajectory(calculator_env(), problem, cut, TOKENIZER, "qwen3", AgentLimits(3, 10, 30)))
    assert (t.finish_reason, t.turns, len(t.response_ids)) == (MAX_TOKENS, 1, 10)
    assert t.tool_errors == {MALFORMED: 1}, "the cut turn went to the environment: its call was cut"
    cut = ScriptedPolicy([("it is never, as I was saying", 0, FINISH_LENGTH)])  # an answer cut after "never"
    t = asyncio.run(run_trajectory(calculator_env(), problem, cut, TOKENIZER, "qwen3", AgentLimits(3, 11, 30)))
    assert (t.finish_reason, t.reward, TOKENIZER.decode(t.response_ids)) == (MAX_TOKENS, 1.0, "it is never")

    budget = len(TOKENIZER.encode(CALL)) + 5  # the call fits, its observation does not
    full = ScriptedPolicy([(CALL, 0, FINISH_STOP)])
    t = asyncio.run(run_trajectory(calculator_env(), problem, full, TOKENIZER, "qwen3", AgentLimits(3, budget, 30)))
    assert (t.finish_reason, all(t.policy_mask)) == (MAX_TOKENS, True)

    class Stuck(ScriptedPolicy):
        async def __call__(self, input_ids, max_new_tokens):
            if self.sent:
                await asyncio.sleep(60)
            return await super().__call__(input_ids, max_new_tokens)

    stuck = Stuck([(CALL, 0, FINISH_STOP)])
    start = time.monotonic()
    t = asyncio.run(run_trajectory(calculator_env(), problem, stuck, TOKENIZER, "qwen3", AgentLimits(3, 1000, 0.5)))
    assert time.monotonic() - start < 5
    assert (t.finish_reason, t.turns) == (DEADLINE, 1)
    assert len(t.response_ids) == len(t.policy_mask) == len(t.logprobs) == len(t.token_versions) > 0


@pytest.mark.parametrize(("turns", "tokens", "deadline"), [(0, 10, 1.0), (1001, 10, 1.0), (1, 0, 1.0), (1, 10, 0)])
def test_limits_that_cannot_be_met_are_refused(turns, tokens, deadline):
    expected = r"agent limits: expected max_turns in 1\.\.1000, max_tokens >= 1 and deadline_s > 0"
    with pytest.raises(SchemaError, match=expected):
        AgentLimits(turns, tokens, deadline)


class Echo:
    """An environment that answers every turn with "ok" until the trajectory hits a limit."""

    def tool_schemas(self) -> list[dict]:
        return []

    async def reset(self, problem):
        return [Message("user", problem)]

    async def step(self, action: str) -> Step:
        return Step(["ok"], 0.0, False)


def test_a_real_engine_continues_the_exact_sequence_and_tokens_keep_the_version_that_made_them():
    """TorchEngine as the policy (random weights; a turn stops at any byte token, so turns are short):
    every turn's input is the sequence so far, its ids land unchanged, and after a weight update
    between turns the next turn's tokens carry the new version."""
    arch = get_model("qwen3-tiny")
    model, _ = build_model(arch, ParallelConfig(), device="cpu", seed=0)
    engine = TorchEngine((arch.hf_config("float32"), dict(hf_tensors(model, arch, torch.float32))), max_len=512)
    inputs, outputs = [], []

    async def play():
        async def generate(input_ids, max_new_tokens):
            inputs.append(list(input_ids))
            params = SamplingParams(max_new_tokens, seed=len(inputs), stop_token_ids=tuple(range(256)))
            outputs.append(await engine.generate(f"r{len(inputs)}", input_ids, params))
            if len(outputs) == 2:  # between the second and third turn
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(0.01)
                await engine.update_weights(1, dict(hf_tensors(model, arch, torch.float32)))
            return outputs[-1]

        t = await run_trajectory(Echo(), "hi", generate, TOKENIZER, "qwen3", AgentLimits(4, 400, 60))
        await engine.close()
        return t

    t = asyncio.run(play())
    assert t.finish_reason in (MAX_TURNS, MAX_TOKENS) and t.turns >= 3
    assert where(t.response_ids, t.policy_mask) == [i for g in outputs for i in g.output_ids]
    before, after = (sum(len(g.output_ids) for g in part) for part in (outputs[:2], outputs[2:]))
    assert where(t.token_versions, t.policy_mask) == [0] * before + [1] * after
    assert where(t.logprobs, t.policy_mask) == [lp for g in outputs for lp in g.logprobs]
    for k, seen in enumerate(inputs):
        produced = sum(len(g.output_ids) for g in outputs[:k])
        observed = k * len(TOKENIZER.encode(observation("qwen3", ["ok"])))
        assert seen == t.prompt_ids + t.response_ids[: produced + observed], k
    assert json.dumps(t.token_versions)  # plain ints, ready for the data plane's columns


def test_the_byte_tokenizer_gives_back_the_exact_text_with_each_marker_one_id():
    text = 'x<y <|im_start|>user\nçé 3<4<tool_call>\n{"a": 1}\n</tool_call><|im_end|><|im_en'
    ids = TOKENIZER.encode(text)
    assert TOKENIZER.decode(ids) == text
    assert (
        ids.count(TOKENIZER.eos_token_id) == 1 and max(ids) < TOKENIZER.vocab_size <= get_model("qwen3-tiny").vocab_size
    )
    assert TOKENIZER.encode("<tool_call>") == [TOKENIZER.vocab_size - 4] and TOKENIZER.encode("") == []
    assert TOKENIZER.decode([0xC3]) == "\ufffd"  # half a character
    assert TOKENIZER.decode([104, 265, 511, 105]) == "hi"  # ids beyond the vocabulary: nothing
    with pytest.raises(SchemaError, match="byte tokenizer: encode expects a str, got bytes"):
        TOKENIZER.encode(b"x")


def test_the_agent_rollout_bench_plays_the_same_tokens_in_every_mode(monkeypatch, capsys):
    """Every mode, in the bench's process and through a live data plane (the inference service in a
    process of its own), plays the same trajectories token for token. The bench runs in this process:
    an interpreter of its own would import torch and meshy again, a third of the test's time."""
    bench_dir = Path(__file__).resolve().parents[2] / "bench"
    monkeypatch.syspath_prepend(str(bench_dir))  # the bench's spawned inference process imports it from there too
    bench = importlib.import_module("agent_rollout")
    bench.main(["--trajectories", "8", "--sequential", "8", "--turns", "2", "--latency", "0.01"])
    out = capsys.readouterr().out
    rows = [
        [cell.strip() for cell in line.split("|")[1:-1]]
        for line in out.splitlines()
        if line.startswith(("| in-process |", "| data plane |"))
    ]
    tools = ("instant tool", "10 ms tool", "10 ms tool, sequential")
    assert [(path, tool) for path, tool, *_ in rows] == [(p, t) for p in ("in-process", "data plane") for t in tools]
    assert {(done, tokens) for _, _, done, tokens, *_ in rows} == {("8", rows[0][3])}, out


def test_the_calculator_task_rewards_an_answer_found_with_the_tool_and_refuses_anything_but_arithmetic():
    problem = next(calculator.problems(seed=3, digits=3))
    a, b = problem.prompt.rstrip("=").split("*")
    assert len(a) == len(b) == 3 and problem.answer == str(int(a) * int(b))
    assert list(itertools.islice(calculator.problems(7), 5)) == list(itertools.islice(calculator.problems(7), 5))
    call = f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{a}*{b}"}}}}\n</tool_call><|im_end|>'
    right = ScriptedPolicy([(call, 0, FINISH_STOP), (f"{problem.answer}<|im_end|>", 0, FINISH_STOP)])
    t = asyncio.run(run_trajectory(calculator.environment(), problem, right, TOKENIZER, "qwen3", LIMITS))
    assert (t.finish_reason, t.reward, t.tool_calls, dict(t.tool_errors)) == (DONE, 1.0, {"calculator": 1}, {})
    assert f"<tool_response>\n{problem.answer}\n</tool_response>" in TOKENIZER.decode(t.response_ids)
    assert '"name": "calculator"' in TOKENIZER.decode(t.prompt_ids), "the prompt lists the tool"
    wrong = ScriptedPolicy([("12<|im_end|>", 0, FINISH_STOP)])
    t = asyncio.run(run_trajectory(calculator.environment(), problem, wrong, TOKENIZER, "qwen3", LIMITS))
    assert (t.finish_reason, t.reward, t.turns) == (DONE, 0.0, 1)
    assert calculator.calculate(" 12 - 30 ") == "-18"
    for hostile in ("__import__('os').system('id')", "2**99999999", "1+2+3", "9" * 13 + "*2", ""):
        with pytest.raises(ValueError, match="expected an expression like 12\\*34"):
            calculator.calculate(hostile)
    with pytest.raises(SchemaError, match="calculator task: digits in 1..6 and ops from '\\+-\\*', got 7, '/'"):
        next(calculator.problems(0, digits=7, ops="/"))


def test_the_calculator_tokenizer_makes_each_repeated_piece_of_its_conversations_one_id():
    tokenizer, problem = calculator.tokenizer(), next(calculator.problems(seed=1, digits=2))
    env = calculator.environment(partial_credit=True)
    prompt = render("qwen3", asyncio.run(env.reset(problem)), tools=env.tool_schemas())
    call = calculator.CALL_OPEN + problem.prompt.removesuffix("=") + calculator.CALL_CLOSE + "<|im_end|>"
    result = observation("qwen3", [problem.answer])
    for text, ids in ((prompt, 1 + 6 + 1), (call, 1 + 5 + 1 + 1), (result, 1 + len(problem.answer) + 1)):
        assert len(tokenizer.encode(text)) == ids and tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.decode([tokenizer.eos_token_id]) == "<|im_end|>" and tokenizer.vocab_size == 28
    assert tokenizer.decode(tokenizer.encode("7/2")) == "7?2" and tokenizer.decode([27, 500]) == "?"


def test_the_calculator_tokenizer_can_split_numbers_into_pieces_of_several_digits():
    tokenizer = calculator.tokenizer(digits_per_piece=2)
    assert tokenizer.vocab_size == 28 + 100
    for text, pieces in (("47*38=", ["47", "*", "38", "="]), ("1786", ["17", "86"]), ("100", ["10", "0"])):
        ids = tokenizer.encode(text)
        assert [tokenizer.decode([i]) for i in ids] == pieces and tokenizer.decode(ids) == text
    three = calculator.tokenizer(digits_per_piece=3)
    assert [three.decode([i]) for i in three.encode("1234567")] == ["123", "456", "7"]
    with pytest.raises(SchemaError, match=r"tokenizer_options.digits_per_piece: expected 1, 2 or 3, got 4"):
        calculator.tokenizer(digits_per_piece=4)


def test_the_calculator_s_partial_credit_pays_for_a_call_by_its_parts_and_only_an_exact_answer_pays_1():
    problem = calculator.Problem("47*83=", "3901")
    close, end = calculator.CALL_CLOSE, "<|im_end|>"

    def call(expression: str) -> str:
        return calculator.CALL_OPEN + expression + close + end

    def started(*turns: str) -> calculator.CalculatorEnvironment:
        env = calculator.environment(partial_credit=True)
        asyncio.run(env.reset(problem))
        for turn in turns:
            asyncio.run(env.step(turn))
        return env

    def first_call(text: str) -> float:
        return asyncio.run(started().step(text)).reward

    assert first_call(call("47*83")) == pytest.approx(calculator.CALL_CREDIT)
    assert first_call(call("47*93")) == pytest.approx(0.2 * (0.1 + 0.7 * 4 / 5 + 0.2))  # a digit wrong
    assert first_call(call("47?83")) == pytest.approx(0.2 * (0.1 + 0.7 * 4 / 5 + 0.2)), "the operator counts"
    assert first_call(call("47*831")) == pytest.approx(0.2 * (0.1 + 0.7 * 5 / 6 + 0.2)), "a character too many"
    assert first_call(call("11*11")) == pytest.approx(0.2 * (0.1 + 0.7 * 1 / 5 + 0.2)), "only the '*' in place"
    assert first_call(calculator.CALL_OPEN + "47") == pytest.approx(0.2 * (0.1 + 0.7 * 2 / 5)), "cut: not closed"
    assert first_call(calculator.CALL_OPEN + "47*83" + close + "3" + end) == pytest.approx(0.2 * 0.9), "not ended"
    assert first_call("ok " + call("47*83")) == 0.0, "the turn must open with the call"
    assert asyncio.run(started().step("3901" + end)) == Step([], 1.0, True)
    assert asyncio.run(started().step("3911" + end)).reward == 0.0, "no credit for a near answer without a call"
    refused = started(call("47*8x"))  # the calculator refused it: still no credit for near answers
    assert asyncio.run(refused.step("3911" + end)).reward == 0.0
    other = started(call("47*93"))  # the calculator answered, but not with the problem's result
    assert asyncio.run(other.step("3911" + end)).reward == 0.0, "no credit for digits its result did not hold"
    answered = started(call("83*47"))  # the calculator gave the answer (in whatever form it was asked)
    assert asyncio.run(answered.step("3911" + end)).reward == pytest.approx(0.2 * (0.8 * 3 / 4 + 0.2))
    assert asyncio.run(answered.step("390" + end)).reward == pytest.approx(0.2 * (0.8 * 3 / 4 + 0.2))
    assert asyncio.run(answered.step("39011")).reward == pytest.approx(0.2 * 0.8 * 4 / 5), "cut: not ended"
    env = started(call("47*93"))
    assert asyncio.run(env.step(call("47*83"))).reward == 0.0, "a call is paid once per trajectory"
    again = calculator.environment(partial_credit=True)  # the next step, in another process
    asyncio.run(again.reset(problem))
    restore_state(again, saved_state(env))
    assert saved_state(again) == {"called": True, "paid": pytest.approx(first_call(call("47*93"))), "answered": True}
    exact = asyncio.run(again.step("3901" + end))
    assert exact.done and saved_state(again)["paid"] == pytest.approx(1.0), "an exact answer brings the total to 1"
    assert exact.reward == pytest.approx(1.0 - first_call(call("47*93")))
    bare = calculator.environment(tool=False, partial_credit=True)  # the baseline: no tool, no credit for calls
    asyncio.run(bare.reset(problem))
    step = asyncio.run(bare.step(call("47*83")))
    assert bare.tool_schemas() == [] and step.calls[0].error == "unknown-tool" and step.reward == 0.0
    assert asyncio.run(bare.step("3911" + end)).reward == pytest.approx(0.2 * (0.8 * 3 / 4 + 0.2))
    plain = calculator.environment()  # no shaping by default
    asyncio.run(plain.reset(problem))
    assert asyncio.run(plain.step(call("47*83"))).reward == 0.0


def test_a_turn_that_only_writes_the_end_marker_s_text_has_not_ended_and_is_not_paid_as_ended():
    """The piece tokenizer has the user turn's tail ("<|im_end|>\\n<|im_start|>assistant\\n") as one id. A
    policy writing it after the call (or the answer) writes the marker's text, but the engine stops only
    at the end-of-turn id: the turn runs on to its budget and never reaches the tool's result. Paying it
    as ended kept a run from scratch at the call for a thousand versions (the end-of-turn id at p < 0.01)."""
    tokenizer, problem = calculator.tokenizer(), calculator.Problem("47*83=", "3901")
    pieces = [tokenizer.decode([i]) for i in range(tokenizer.vocab_size)]
    (tail,) = [piece for piece in pieces if piece.startswith("<|im_end|>") and piece != "<|im_end|>"]
    call = calculator.CALL_OPEN + "47*83" + calculator.CALL_CLOSE

    def reward(*turns: str) -> float:
        env = calculator.environment(partial_credit=True)
        asyncio.run(env.reset(problem))
        return sum(asyncio.run(env.step(turn)).reward for turn in turns)

    assert reward(call + "<|im_end|>") == pytest.approx(calculator.CALL_CREDIT)
    assert reward(call + tail + "77") == pytest.approx(0.2 * 0.9), "not ended"
    assert reward(call + "<|im_end|>", "3901<|im_end|>") == pytest.approx(1.0)
    assert reward(call + "<|im_end|>", "3901" + tail) == pytest.approx(0.2 + 0.2 * 0.8), "right digits, not ended"
    assert calculator.split_turn("3901 \n<|im_end|>") == ("3901 \n", True)
    assert calculator.split_turn("3901<|im_end|>\n") == ("3901", False)


def test_the_calculator_s_products_always_have_twice_the_digits_of_their_operands():
    for digits in (1, 2, 3):
        products = list(itertools.islice(calculator.problems(0, digits), 2000))
        operands = {int(n) for p in products for n in p.prompt.removesuffix("=").split("*")}
        assert {len(p.answer) for p in products} == {2 * digits}
        assert min(operands) ** 2 >= 10 ** (2 * digits - 1) > (min(operands) - 1) ** 2, "no operand left out"
    sums = list(itertools.islice(calculator.problems(0, 2, ops="+"), 2000))
    assert min(int(n) for p in sums for n in p.prompt.removesuffix("=").split("+")) == 10


@pytest.mark.usefixtures("sandboxes_alone")
def test_the_python_math_task_runs_the_policy_s_code_in_the_sandbox_and_scores_its_boxed_answer():
    from meshy.recipes.agents.sandbox import check_sandbox
    from meshy.recipes.tasks import python_math

    if (why := check_sandbox()) is not None:
        pytest.skip(why)
    problem = next(python_math.problems(seed=0))
    assert "Please reason" not in problem.prompt, "the question alone: the environment poses it"
    code = json.dumps({"name": "python", "arguments": {"code": f"print({problem.answer} * 1)"}})
    policy = ScriptedPolicy(
        [
            (f"<tool_call>\n{code}\n</tool_call><|im_end|>", 0, FINISH_STOP),
            (f"So it is \\boxed{{{problem.answer}}}.<|im_end|>", 0, FINISH_STOP),
        ]
    )
    env = python_math.environment(tool_timeout_s=10)
    t = asyncio.run(run_trajectory(env, problem, policy, TOKENIZER, "qwen3", LIMITS))
    assert (t.finish_reason, t.reward, t.tool_calls, dict(t.tool_errors)) == (DONE, 1.0, {"python": 1}, {})
    assert f"<tool_response>\n{problem.answer}\n\n</tool_response>" in TOKENIZER.decode(t.response_ids)
    assert "You may run Python code with the python tool" in TOKENIZER.decode(t.prompt_ids)
    with pytest.raises(SchemaError, match="agent.tool_timeout_s: the python tool runs each call for up to"):
        python_math.environment(tool_timeout_s=2)
    with pytest.raises(SchemaError, match="task.environment_options.reward: expected one of"):
        python_math.environment(reward="exact")
