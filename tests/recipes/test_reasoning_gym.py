"""The reasoning-gym task adapter: any dataset by name, its config checked, its own verifier scoring."""

import itertools
import json

import pytest

from meshy.dataplane import SchemaError
from meshy.recipes.prompts.chat_templates import SMOLLM2_SYSTEM
from meshy.recipes.tasks import reasoning_gym as rgt

SUMS = {"dataset": "chain_sum", "config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}}


def first(n: int, seed: int = 0, **options):
    return list(itertools.islice(rgt.problems(seed, **{**SUMS, **options}), n))


def test_a_seed_gives_the_same_stream_and_another_seed_another():
    assert first(20) == first(20)
    assert first(20) != first(20, seed=1)
    questions = [json.loads(p.answer)["metadata"]["expression"] for p in first(20)]
    assert all(len(q.split()) == 3 for q in questions), questions  # two single-digit terms


def test_the_prompt_is_rendered_in_the_chat_template_and_the_answer_is_the_dataset_s():
    (plain,) = first(1)
    assert plain.prompt.startswith("State the final answer to the following arithmetic problem: ")
    (chat,) = first(1, template="smollm2", instruction="{question} Give only the result.")
    assert chat.prompt == (
        f"<|im_start|>system\n{SMOLLM2_SYSTEM}<|im_end|>\n<|im_start|>user\n{plain.prompt} Give only the result."
        "<|im_end|>\n<|im_start|>assistant\n"
    )
    truth = json.loads(chat.answer)
    a, op, b = truth["metadata"]["expression"].split()
    assert truth["dataset"] == "chain_sum" and int(truth["answer"]) == (
        int(a) + int(b) if op == "+" else int(a) - int(b)
    )


def test_the_dataset_s_verifier_scores_the_whole_response_or_its_answer_tag():
    (problem,) = first(1)
    answer = json.loads(problem.answer)["answer"]
    assert rgt.score(f" {answer}\n", problem.answer) == 1.0
    assert rgt.score(f"The answer is {answer}", problem.answer) == pytest.approx(len(answer) / (14 + len(answer)))
    assert rgt.score("no number here", problem.answer) == 0.0
    assert rgt.score_exact(f" {answer}\n", problem.answer) == 1.0
    assert rgt.score_exact(f"The answer is {answer}", problem.answer) == 0.0, "full marks or nothing"
    assert rgt.score_tagged(f"think first <answer> {answer} </answer>", problem.answer) == 1.0
    assert rgt.score_tagged(f"{answer}", problem.answer) == 0.0  # no tag, no answer


def test_another_dataset_scores_with_its_own_verifier():
    (problem,) = list(itertools.islice(rgt.problems(3, dataset="word_sequence_reversal"), 1))
    answer = json.loads(problem.answer)["answer"]
    assert rgt.score(answer, problem.answer) == 1.0
    assert rgt.score(answer[::-1], problem.answer) < 1.0


@pytest.mark.parametrize(
    ("options", "needle"),
    [
        ({"dataset": "no_such_task"}, "dataset: unknown reasoning-gym dataset 'no_such_task'; expected one of ["),
        ({}, "missing option 'dataset'; expected one of ["),
        ({**SUMS, "templat": "plain"}, "unknown option 'templat'; expected some of ["),
        ({"dataset": "chain_sum", "config": {"min_term": 2}}, "config: chain_sum has no field 'min_term'; expected"),
        ({"dataset": "chain_sum", "config": {"seed": 3}}, "config.seed: set by Meshy"),
        ({"dataset": "chain_sum", "config": {"min_terms": 3, "max_terms": 2}}, "config: reasoning-gym refused"),
        ({**SUMS, "template": "chatml"}, "template: unknown chat template 'chatml'"),
        ({**SUMS, "instruction": "Answer:"}, "instruction: expected text containing {question}"),
    ],
)
def test_bad_options_are_refused_naming_the_field(options, needle):
    with pytest.raises(SchemaError) as e:
        rgt.problems(0, **options)
    assert needle in str(e.value)


def test_a_ground_truth_that_is_not_reasoning_gym_s_is_refused_naming_both_fields():
    with pytest.raises(SchemaError, match="task.problems and task.reward must both be reasoning-gym's"):
        rgt.score("4", "4")
