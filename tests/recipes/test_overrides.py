"""`--set FIELD=VALUE`: parsed as TOML values, applied to the recipe's data and typed and checked as the
file's own values; the run directory's recipe.toml written with them (meshy.recipes.recipe.toml_writer)."""

import datetime
import math
import subprocess
import sys
import tomllib

import pytest

from meshy.dataplane import SchemaError
from meshy.recipes.launch import run as meshy_run
from meshy.recipes.launch.run import run
from meshy.recipes.launch.startup import START_ENV
from meshy.recipes.recipe import DEFAULT_RECIPE, load_recipe
from meshy.recipes.recipe.catalog import shipped
from meshy.recipes.recipe.overrides import parse_override, recipe_as_run
from meshy.recipes.recipe.toml_writer import dumps


def overridden(*texts: str):
    return load_recipe(DEFAULT_RECIPE, [parse_override(t) for t in texts])


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("algorithm.optim.lr=1e-4", 1e-4),
        ("steps=200", 200),
        ("delta=true", True),
        ('algorithm.pacing="none"', "none"),
        ("algorithm.pacing=none", "none"),  # a bare word that is not TOML: a string
        ("name = my-run", "my-run"),
        ("colocate=[[1, 2], []]", [[1, 2], []]),
        ("model.overrides={vocab_size = 17, tie = true}", {"vocab_size": 17, "tie": True}),
        ("stall_after_s=inf", math.inf),
        ("name=", ""),
        ("task.options.note='a = b'", "a = b"),
    ],
)
def test_a_value_is_read_as_toml_or_else_taken_as_a_string(text, value):
    assert parse_override(text).value == value


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("steps", "--set steps: expected FIELD=VALUE"),
        ("=3", "--set =3: expected FIELD=VALUE"),
        ("algorithm..lr=1", "--set algorithm..lr=1: expected FIELD=VALUE"),
        ("colocate=[1,", "--set colocate=[1,: '[1,' is not a TOML value"),
        ('name="unterminated', "is not a TOML value"),
        ("name=a\nsteps = 3", "is not a TOML value"),  # one value, never a second key
    ],
)
def test_a_malformed_override_is_refused_naming_it(text, needle):
    with pytest.raises(SchemaError, match=needle.replace("[", r"\[")):
        parse_override(text)


def test_overrides_are_typed_and_checked_as_the_file_s_values():
    recipe = overridden(
        "algorithm.optim.lr=1e-4", "steps=200", "algorithm.pacing=none", "model.overrides.vocab_size=18"
    )
    assert (recipe.algorithm.optim.lr, recipe.steps, recipe.algorithm.window) == (1e-4, 200, None)
    assert recipe.model.arch().vocab_size == 18 and recipe.algorithm.optim.betas == (0.9, 0.999)
    assert overridden("colocate=[['training', 'inference']]").colocate == (("training", "inference"),)
    assert overridden("eval.count=4").eval.count == 4  # a section the file lacks is made
    assert overridden("steps=5", "steps=7").steps == 7  # the last one wins


@pytest.mark.parametrize(
    ("texts", "message"),
    [
        (
            ["algorithm.optim.lrr=1e-4"],
            "--set algorithm.optim.lrr=1e-4: recipe.algorithm.optim: unknown field 'lrr'; expected one of",
        ),
        (
            ["algorithm.optim.lr=fast"],
            "--set algorithm.optim.lr=fast: recipe.algorithm.optim: OptimConfig.lr: expected",
        ),
        (["steps=0", "seed=3"], "--set steps=0: recipe: steps >= 1"),
        (["algorithm.group_size='8'"], "--set algorithm.group_size='8': recipe.algorithm: AlgorithmSpec.group_size"),
        (["algorithm.pacing=0"], '--set algorithm.pacing=0: recipe.algorithm: pacing: expected an int >= 1 or "none"'),
        (["steps.every=2"], "--set steps.every=2: recipe.steps is int 800, not a table"),
        (["algorithm.optim=3"], "--set algorithm.optim=3: recipe.algorithm.optim: expected a table, got int 3"),
        (["roles.custom.x=1"], "--set roles.custom.x=1: recipe.roles: RolesSpec.custom: expected tuple"),
        (
            ["algorithm.overlong_buffer=9", "algorithm.optim.lr=1e-4"],
            "--set algorithm.overlong_buffer=9: recipe: algorithm.overlong_buffer: expected <= sampling.max_new_tokens",
        ),
    ],
)
def test_a_bad_override_names_itself_and_the_field_s_full_path(texts, message):
    with pytest.raises(SchemaError) as e:
        overridden(*texts)
    assert str(e.value).startswith(message), str(e.value)


def test_an_error_of_the_file_itself_blames_no_override(tmp_path):
    path = tmp_path / "r.toml"
    path.write_text('name = "x"\nsteps = 0\n')
    with pytest.raises(SchemaError, match=r"^recipe: steps >= 1") as e:
        load_recipe(path, [parse_override("seed=2")])
    assert "--set" not in str(e.value)


TRICKY = {
    "name": 'quote " backslash \\ newline \n tab \t del \x7f bell \x07 unicode é 🙂',
    "int": -3,
    "float": 1e-05,
    "big": 1e16,
    "neg_zero": -0.0,
    "infinite": -math.inf,
    "flag": False,
    "when": datetime.date(2026, 1, 2),
    "at": datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.UTC),
    "list": [1, [2.5, "x"], [], [{"a": 1, "b c": {"d": [True]}}]],
    "inline": [{"name": "r", "options": {}}],
    "a.dotted key": "v",
    "empty": {},
    "section": {"x": 1, "sub": {"y": "z", "deeper": {"w": []}}, "only_tables": {"t": {"u": 1}}},
}


def test_the_toml_writer_round_trips_what_tomllib_reads():
    assert tomllib.loads(dumps(TRICKY)) == TRICKY
    assert math.isnan(tomllib.loads(dumps({"x": math.nan}))["x"])


@pytest.mark.parametrize("name", sorted(shipped()))
def test_every_shipped_recipe_round_trips_through_the_writer(name):
    data = tomllib.loads(shipped()[name].read_text())
    assert tomllib.loads(dumps(data)) == data


def test_the_run_directory_keeps_the_file_as_given_or_the_recipe_with_its_overrides(tmp_path):
    assert recipe_as_run(DEFAULT_RECIPE, []) == DEFAULT_RECIPE.read_bytes()  # comments and all
    overrides = [parse_override(t) for t in ("steps=3", "algorithm.optim.lr=1e-4", "eval.count=4")]
    text = recipe_as_run(DEFAULT_RECIPE, overrides).decode()
    assert text.startswith(f"# {DEFAULT_RECIPE} with --set steps=3 --set algorithm.optim.lr=1e-4 --set eval.count=4\n")
    kept = tmp_path / "recipe.toml"
    kept.write_text(text)
    assert load_recipe(kept) == load_recipe(DEFAULT_RECIPE, overrides)


def test_a_new_run_keeps_its_overrides_and_a_resume_runs_what_it_kept(tmp_path, monkeypatch):
    started = []
    monkeypatch.setattr(meshy_run, "run_one_node", lambda recipe, directory, secret: started.append(recipe) or 0)
    monkeypatch.setenv(START_ENV, "0")  # meshy run sets it for its ranks: undone after the test
    recipe = tmp_path / "r.toml"
    recipe.write_text(DEFAULT_RECIPE.read_text().replace('run_dir = "runs"', f'run_dir = "{tmp_path / "runs"}"'))
    assert run(str(recipe), overrides=[parse_override("steps=3"), parse_override("seed=5")]) == 0
    (directory,) = (tmp_path / "runs").iterdir()
    assert run(None, str(directory)) == 0
    assert [(r.steps, r.seed) for r in started] == [(3, 5), (3, 5)]


def test_set_with_resume_is_refused(tmp_path):
    (tmp_path / "recipe.toml").write_bytes(DEFAULT_RECIPE.read_bytes())
    with pytest.raises(SchemaError, match="--set with --resume: a run carries on with the recipe it started with"):
        run(None, str(tmp_path), overrides=[parse_override("steps=3")])


def meshy(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "meshy.recipes.cli", *args], capture_output=True, text=True)


def test_meshy_check_applies_set():
    result = meshy("check", "default", "--set", "steps=7", "--set", "algorithm.pacing=none")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0].startswith("arithmetic-tiny: qwen3-tiny, grpo, fully asynchronous, 7 versions")
    bad = meshy("check", "default", "--set", "algorithm.optim.lrr=1e-4")
    assert bad.returncode == 2
    assert bad.stderr.startswith("meshy: --set algorithm.optim.lrr=1e-4: recipe.algorithm.optim: unknown field 'lrr'")


def test_meshy_run_refuses_a_bad_set_before_anything_starts(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "meshy.recipes.cli", "run", "--set", "steps=many"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    assert "meshy: --set steps=many: recipe: Recipe.steps: expected int, got str 'many'" in result.stderr
    assert not (tmp_path / "runs").exists()


def test_meshy_run_help_says_where_runs_go_how_to_set_fields_and_how_to_resume():
    text = " ".join(meshy("run", "--help").stdout.split())
    for needle in ("runs/<name>-<stamp>/", "--set steps=200", "--set seed=1", "--resume RUN_DIR"):
        assert needle in text, needle
