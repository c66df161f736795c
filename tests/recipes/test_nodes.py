"""Recipes over several nodes: the layout every node computes, and the layouts refused at load."""

import subprocess
import sys

import pytest

from meshy.dataplane import SchemaError
from meshy.recipes.recipe import DEFAULT_RECIPE, load_recipe
from meshy.recipes.recipe.topology import assign, on_node

DEFAULT = DEFAULT_RECIPE.read_text()


def over(text: str, topology: str = "nodes = 2", top: str = "") -> str:
    """A recipe text laid out by `topology` (the [topology] section's body), with top-level fields `top`."""
    return f"{top}{text}\n[topology]\n{topology}\n"


def recipe_from(tmp_path, text: str):
    path = tmp_path / "recipe.toml"
    path.write_text(text)
    return load_recipe(path)


def roles(text: str, **sections: str) -> str:
    """The default recipe with its role sections replaced: roles(training="processes = 8\\n...")."""
    for role, body in sections.items():
        text = text.replace(f"[roles.{role}]\nprocesses = 1\n", f"[roles.{role}]\n{body}\n")
    return text


def split(tmp_path):
    """The default recipe over two nodes: training on node 0, inference and rollout on node 1."""
    return recipe_from(tmp_path, over(roles(DEFAULT, inference="processes = 1\nnode = 1")))


def placed(slots) -> list[tuple]:
    return [(s.rank, s.node, s.role, s.index, s.devices) for s in slots.values()]


def test_the_default_split_over_two_nodes_puts_training_on_one_and_the_rest_on_the_other(tmp_path):
    recipe = split(tmp_path)
    slots = assign(recipe, 3)
    assert placed(slots) == [(0, 0, "training", 0, ()), (1, 1, "inference", 0, ()), (2, 1, "rollout", 0, ())]
    assert [s.rank for s in on_node(slots, 1)] == [1, 2], "a node's processes are consecutive ranks"


def test_roles_fill_a_node_s_gpus_and_move_on_to_the_next_node(tmp_path):
    text = over(
        roles(
            DEFAULT,
            training="processes = 12\ndevices_per_process = 1",
            inference="processes = 2\ndevices_per_process = 2",
            rollout="processes = 2",
        ),
        "nodes = 2\ngpus_per_node = 8",
    )
    recipe = recipe_from(tmp_path, text.replace("prompts_per_step = 32", "prompts_per_step = 36"))
    slots = assign(recipe, 16, gpus_per_node=8)
    training = [(s.node, s.devices) for s in slots.values() if s.role == "training"]
    assert training == [(0, (d,)) for d in range(8)] + [(1, (d,)) for d in range(4)]
    assert [(s.node, s.devices) for s in slots.values() if s.role == "inference"] == [(1, (4, 5)), (1, (6, 7))]
    assert [s.node for s in slots.values() if s.role == "rollout"] == [1, 1], "CPU processes stay where filling ended"
    assert [s.rank for s in slots.values()] == list(range(16))


def test_a_role_that_names_an_earlier_node_gets_ranks_there(tmp_path):
    text = over(roles(DEFAULT, inference="processes = 1\nnode = 1", rollout="processes = 1\nnode = 0"))
    slots = assign(recipe_from(tmp_path, text), 3)
    assert placed(slots) == [(0, 0, "training", 0, ()), (1, 0, "rollout", 0, ()), (2, 1, "inference", 0, ())]


def test_colocated_roles_spanning_nodes_share_each_gpu_pair_by_pair(tmp_path):
    text = over(
        roles(
            DEFAULT,
            training="processes = 4\ndevices_per_process = 1",
            inference="processes = 4\ndevices_per_process = 1",
        ),
        "nodes = 2\ngpus_per_node = 2",
        top='colocate = [["training", "inference"]]\n',
    )
    slots = assign(recipe_from(tmp_path, text), 9, gpus_per_node=2)
    by_role = {(s.role, s.index): (s.node, s.devices) for s in slots.values()}
    for index, where in enumerate([(0, (0,)), (0, (1,)), (1, (0,)), (1, (1,))]):
        assert by_role[("training", index)] == by_role[("inference", index)] == where
    assert [s.role for s in on_node(slots, 0)] == ["training", "training", "inference", "inference"]


def test_a_host_without_gpus_runs_the_same_layout_on_cpus_and_one_with_too_few_is_refused(tmp_path):
    text = over(
        roles(
            DEFAULT,
            training="processes = 1\ndevices_per_process = 1",
            inference="processes = 1\ndevices_per_process = 1",
        ),
        "nodes = 2\ngpus_per_node = 1",
    )
    recipe = recipe_from(tmp_path, text)
    assert placed(assign(recipe, 3, gpus_per_node=0)) == [
        (0, 0, "training", 0, ()),
        (1, 1, "inference", 0, ()),
        (2, 1, "rollout", 0, ()),
    ]
    assert [s.devices for s in assign(recipe, 3, gpus_per_node=4).values()] == [(0,), (0,), ()]
    wide = roles(
        DEFAULT, training="processes = 1\ndevices_per_process = 1", inference="processes = 1\ndevices_per_process = 2"
    )
    two = recipe_from(tmp_path, over(wide, "nodes = 2\ngpus_per_node = 2"))
    with pytest.raises(SchemaError, match="topology.gpus_per_node: the recipe places 2 GPUs per node; this node has 1"):
        assign(two, 3, gpus_per_node=1)


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        (
            over(roles(DEFAULT, inference="processes = 1\nnode = 2")),
            "recipe: roles.inference.node: no node 2; topology.nodes = 2 (nodes 0-1)",
        ),
        (roles(DEFAULT, inference="processes = 1\nnode = 1"), "roles.inference.node: no node 1; topology.nodes = 1"),
        (over(roles(DEFAULT, training="processes = 1\nnode = 1")), "roles.training.node: training process 0"),
        (
            over(roles(DEFAULT, inference="processes = 1\ndevices_per_process = 1\nnode = 1")),
            "topology.gpus_per_node: a recipe for 2 nodes with GPU roles names the GPUs of each node",
        ),
        (
            over(roles(DEFAULT, inference="processes = 5\ndevices_per_process = 2"), "nodes = 2\ngpus_per_node = 4"),
            "roles.inference.processes: 5 processes of 2 GPUs do not fit on the nodes left (topology.nodes = 2, 4 GPUs",
        ),
        (
            over(roles(DEFAULT, inference="processes = 1\ndevices_per_process = 8"), "nodes = 2\ngpus_per_node = 4"),
            "roles.inference.devices_per_process: 8 GPUs per process, more than a node's 4",
        ),
        (over(DEFAULT), "topology.nodes: 2 nodes, but no process is placed on node 1"),
        (
            over(roles(DEFAULT, inference="processes = 1\nnode = 1"), top='publish = "shared-memory"\n'),
            'publish: "shared-memory" reaches engines on the node of training process 0 only',
        ),
        (
            over(roles(DEFAULT, inference="processes = 1\nnode = 1") + '\n[dataplane]\nhost = "10.0.0.1"\n'),
            "dataplane.host: a multi-node run binds each node's own address",
        ),
        (
            over(roles(DEFAULT, inference="processes = 1\nnode = 1"), 'nodes = 2\naddresses = ["10.0.0.1"]'),
            "recipe.topology: addresses: expected one per node (2), got 1",
        ),
        (
            over(
                roles(
                    DEFAULT,
                    training="processes = 1\ndevices_per_process = 1",
                    inference="processes = 1\ndevices_per_process = 1\nnode = 1",
                    rollout="processes = 1\nnode = 1",
                ),
                "nodes = 2\ngpus_per_node = 1",
                top='colocate = [["training", "inference"]]\n',
            ),
            "roles.inference.node: inference shares its devices with training+inference (process 0 on node 0)",
        ),
    ],
)
def test_an_impossible_layout_is_refused_at_load_naming_the_field(tmp_path, text, needle):
    with pytest.raises(SchemaError) as raised:
        recipe_from(tmp_path, text)
    assert needle in str(raised.value)


def meshy(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "meshy.recipes.cli", *args], capture_output=True, text=True)


def test_meshy_check_prints_which_node_and_rank_runs_which_role_and_refuses_other_node_counts(tmp_path):
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(over(roles(DEFAULT, inference="processes = 1\nnode = 1")))
    result = meshy("check", str(recipe), "--nnodes", "2")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].endswith("3 processes on 2 nodes of CPU (rank 0 hosts the data plane)")
    assert [line.split() for line in lines[1:5]] == [
        ["node", "rank", "role", "process", "devices", "ring"],
        ["0", "0", "training", "1/1", "cpu", "-"],
        ["1", "1", "inference", "1/1", "cpu", "-"],
        ["1", "2", "rollout", "1/1", "cpu", "-"],
    ]
    assert lines[5:] == [
        "node 0: rank 0, torchrun --nproc-per-node=1 (meshy run ... --nnodes 2 --node-rank 0)",
        "node 1: ranks 1-2, torchrun --nproc-per-node=2 (meshy run ... --nnodes 2 --node-rank 1)",
    ]
    other = meshy("check", str(recipe), "--nnodes", "3")
    assert other.returncode == 2
    assert "--nnodes 3: recipe arithmetic-tiny is laid out for topology.nodes = 2" in other.stderr


def test_the_shipped_two_node_recipes_are_listed_with_their_nodes():
    from meshy.recipes.recipe.catalog import listing

    rows = {line.split()[0]: line for line in listing().splitlines()}
    assert "  2 x 8 GPU  grpo, fully asynchronous" in rows["qwen3-1.7b-grpo-dapo-2x8gpu"]
    assert "  2 x 8 GPU  grpo, off-policy (W=2)" in rows["qwen3-30b-a3b-grpo-dapo-2x8gpu"]
