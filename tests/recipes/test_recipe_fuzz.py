"""Hostile recipes: whatever a TOML file holds, loading it returns a Recipe or raises one SchemaError naming
a field path under `recipe`, never another exception.

Recipes are the embedded default with a few mutations: fields dropped, unknown fields added, values replaced
by values of the wrong type (or of the right type but out of range), tables nested wrongly. The paths come
from the Recipe dataclasses themselves, so sections the default leaves out (critic, custom roles, extra
columns) are fuzzed too. Derandomized: every run tries the same examples.
"""

import copy
import dataclasses
import tomllib
import types
import typing
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshy.dataplane import SchemaError
from meshy.recipes.recipe import BUILTIN_ROLES, DEFAULT_RECIPE, Recipe, build, check_recipe, load_recipe

DEFAULT_TEXT = DEFAULT_RECIPE.read_text()
DEFAULT = tomllib.loads(DEFAULT_TEXT)
FUZZ = settings(
    max_examples=300, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None
)

EDGE_NUMBERS = [0, 1, -1, 2, 3, 17, 2**31, 2**63, -(2**63), 10**30, 0.0, -0.0, 0.5, 1e-300, 1e300]
EDGE_NUMBERS += [float("nan"), float("inf"), float("-inf")]
EDGE_STRINGS = ["", " ", "none", "None", "0", "scratch", "gguf:", "gguf:nope", "a:b", ":", "x" * 300, "\x00", "é🦀"]
EDGE_STRINGS += [*BUILTIN_ROLES, "qwen3-tiny", "qwen3-tiny-moe", "grpo", "ppo", "distill", "float32", "str", "::1"]
EDGE_STRINGS += ["127.0.0.1", "0.0.0.0", "/", ".", "..", "/nonexistent", "meshy.recipes.tasks.arithmetic:problems"]

scalars = st.one_of(
    st.sampled_from(EDGE_NUMBERS),
    st.sampled_from(EDGE_STRINGS),
    st.integers(),
    st.floats(),
    st.booleans(),
    st.none(),
    st.text(max_size=12),
)
hostile = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(["a", "name", "x"]), inner, max_size=3),
    max_leaves=6,
)


def _fields(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def plausible(annotation: Any, depth: int = 0) -> st.SearchStrategy:
    """Values of about the annotated type (TOML's types, so no None), often at the edge of their range."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if dataclasses.is_dataclass(annotation):
        if depth > 3:
            return st.just({})
        optional = {name: plausible(hint, depth + 1) for name, hint in _fields(annotation).items()}
        return st.fixed_dictionaries({}, optional=optional)
    if origin in (typing.Union, types.UnionType):
        return st.one_of([plausible(a, depth) for a in args if a is not type(None)])
    if origin is typing.Literal:
        return st.sampled_from(args) | st.sampled_from(EDGE_STRINGS)
    if origin is tuple:
        return st.lists(plausible(args[0], depth + 1), max_size=3)
    if annotation is bool:
        return st.booleans()
    if annotation is int:
        return st.integers(-3, 70) | st.sampled_from([n for n in EDGE_NUMBERS if isinstance(n, int)])
    if annotation is float:
        return st.floats() | st.sampled_from(EDGE_NUMBERS) | st.integers(-3, 10)
    if annotation is str:
        return st.sampled_from(EDGE_STRINGS) | st.text(max_size=12)
    return hostile  # dict, Any


def schema_paths(cls: type, prefix: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    """Every field path of a dataclass tree (through Optional sections), with its annotation."""
    paths = []
    for name, hint in _fields(cls).items():
        path = (*prefix, name)
        paths.append((path, hint))
        inner = [a for a in typing.get_args(hint) if dataclasses.is_dataclass(a)]
        for section in [hint] if dataclasses.is_dataclass(hint) else inner:
            paths += schema_paths(section, path)
    return paths


SCHEMA = schema_paths(Recipe)


def tables(data: dict, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """The paths of every table in a parsed recipe, the root included."""
    found = [prefix]
    for key, value in data.items():
        if isinstance(value, dict):
            found += tables(value, (*prefix, key))
    return found


def table_at(data: dict, path: tuple[str, ...], create: bool) -> dict | None:
    for key in path:
        if create and not isinstance(data.get(key), dict):
            data[key] = {}
        data = data.get(key)
        if not isinstance(data, dict):
            return None
    return data


@st.composite
def mutation(draw: st.DrawFn, data: dict) -> None:
    """Apply one random mutation to `data` in place."""
    kind = draw(st.sampled_from(["set-plausible", "set-hostile", "drop", "add-unknown", "nest", "unwrap"]))
    if kind in ("set-plausible", "set-hostile"):
        path, hint = draw(st.sampled_from(SCHEMA))
        table = table_at(data, path[:-1], create=True)
        table[path[-1]] = draw(plausible(hint) if kind == "set-plausible" else hostile)
        return
    table = table_at(data, draw(st.sampled_from(tables(data))), create=False)
    if kind == "add-unknown":
        table[draw(st.sampled_from(["extra", "Name", "steps ", "", "é"]))] = draw(hostile)
    elif table:
        key = draw(st.sampled_from(sorted(table)))
        if kind == "drop":
            del table[key]
        elif kind == "nest":
            table[key] = draw(st.sampled_from([[table[key]], {"value": table[key]}, {key: table[key]}]))
        elif isinstance(table[key], dict):  # unwrap: a table becomes one of its values, or a scalar
            table[key] = draw(st.sampled_from([*table[key].values(), 1, "x"]))
        else:
            table[key] = [table[key], table[key]]


@st.composite
def recipes(draw: st.DrawFn) -> dict:
    data = copy.deepcopy(DEFAULT)
    for _ in range(draw(st.integers(1, 4))):
        draw(mutation(data))
    return data


def check_build(data: Any) -> Recipe | None:
    """The loader's contract: a Recipe, or a SchemaError whose message starts with a path under `recipe`."""
    try:
        recipe = build(Recipe, data, "recipe")
        check_recipe(recipe)
    except SchemaError as e:
        assert str(e).startswith(("recipe.", "recipe:", "recipe ")), str(e)
        return None
    assert isinstance(recipe, Recipe)
    return recipe


@FUZZ
@given(recipes())
def test_mutated_default_recipes_build_or_name_the_field(data):
    check_build(data)


@FUZZ
@given(plausible(Recipe) | hostile)
def test_recipes_from_scratch_build_or_name_the_field(data):
    check_build(data)


DEEP = b"[" * 3000 + b"]" * 3000
JUNK = [
    b"[",
    b"]]",
    b"=",
    b'"',
    b"\n[model]\n",
    b"\xff",
    b"\n",
    b"\nx = " + DEEP + b"\n",
    b"\nsteps = {a = " + DEEP + b"}\n",
]


def garble(text: str, data: st.DataObject) -> bytes:
    raw = text.encode()
    start = data.draw(st.integers(0, len(raw)))
    kind = data.draw(st.sampled_from(["truncate", "replace", "insert", "flip"]))
    if kind == "truncate":
        return raw[:start]
    if kind == "flip":
        flipped = bytearray(raw)
        for i in data.draw(st.lists(st.integers(0, len(raw) - 1), min_size=1, max_size=4)):
            flipped[i] ^= 1 << data.draw(st.integers(0, 7))
        return bytes(flipped)
    junk = data.draw(st.binary(max_size=8) | st.sampled_from(JUNK))
    end = start + (data.draw(st.integers(0, 20)) if kind == "replace" else 0)
    return raw[:start] + junk + raw[end:]


@pytest.fixture(scope="module")
def recipe_file(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz") / "recipe.toml"


@FUZZ
@given(data=st.data())
def test_garbled_recipe_files_load_or_name_the_problem(recipe_file, data):
    recipe_file.write_bytes(garble(DEFAULT_TEXT, data))
    try:
        load_recipe(recipe_file)
    except SchemaError as e:
        assert str(e).startswith(("recipe.", "recipe:", "recipe ")), str(e)


def test_the_fuzzers_reach_a_valid_recipe_and_every_section():
    assert check_build(copy.deepcopy(DEFAULT)) is not None
    assert {path[0] for path, _ in SCHEMA} == {f.name for f in dataclasses.fields(Recipe)}
    assert ("roles", "critic", "processes") in {path for path, _ in SCHEMA}


@pytest.mark.parametrize(
    ("path", "message"),
    [
        (("roles", "inference", "processes"), "processes: expected 1 to 65536"),
        (("roles", "rollout", "node"), "node: expected a node index from 0 to 16383"),
        (("topology", "nodes"), "nodes: expected 1 to 16384"),
    ],
)
@pytest.mark.parametrize("count", [2**31, 2**63, 10**30])
def test_a_huge_count_is_refused_not_laid_out(path, message, count):
    """A count no cluster has (the fuzzer found roles.inference.processes = 2**31 laid out rank by rank, until
    the machine ran out of memory) is refused by name."""
    data = copy.deepcopy(DEFAULT)
    section = data
    for key in path[:-1]:
        section = section.setdefault(key, {})
    section[path[-1]] = count
    with pytest.raises(SchemaError, match=message):
        build(Recipe, data, "recipe")
