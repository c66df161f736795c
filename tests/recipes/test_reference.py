"""The recipe reference (meshy.recipes.recipe.field_reference): every recipe field documented, every one rendered."""

import dataclasses
import typing
from dataclasses import dataclass, field

from meshy.recipes.recipe import ModelSpec, Recipe, spec
from meshy.recipes.recipe.field_reference import field_docs, render, sections, undocumented


def field_paths(cls: type, prefix: str = "") -> list[str]:
    """Every key path of a recipe, found here apart from the module: a table's fields under its key,
    an array of tables' as `key[].field`."""
    paths = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        path = prefix + f.name
        paths.append(path)
        annotation = hints[f.name]
        args = typing.get_args(annotation)
        if dataclasses.is_dataclass(annotation):
            paths += field_paths(annotation, path + ".")
        elif typing.get_origin(annotation) is tuple and args and dataclasses.is_dataclass(args[0]):
            paths += field_paths(args[0], path + "[].")
        else:
            paths += [p for a in args if dataclasses.is_dataclass(a) for p in field_paths(a, path + ".")]
    return paths


def test_every_recipe_dataclass_is_a_section_of_the_reference():
    """So the docstring test below reaches every field of every dataclass the recipe module defines."""
    defined = {c for c in vars(spec).values() if dataclasses.is_dataclass(c) and c.__module__ == spec.__name__}
    assert defined and defined <= {section.cls for section in sections()}


def test_every_recipe_field_has_a_docstring():
    missing = undocumented()
    assert not missing, (
        "recipe fields without an attribute docstring (a string literal on the line right under the field): "
        + ", ".join(missing)
    )


@dataclass(frozen=True)
class Inner:
    documented: int = 0
    """Has one."""
    bare: int = 1


@dataclass(frozen=True)
class Outer:
    inner: Inner = field(default_factory=Inner)
    """A table."""
    items: tuple[Inner, ...] = ()


def test_a_field_without_a_docstring_is_named_with_its_path():
    assert sorted(undocumented(Outer)) == [
        "inner.bare (Inner.bare)",
        "items (Outer.items)",
        "items[].bare (Inner.bare)",
    ]


def test_field_docs_reads_the_string_under_each_field():
    docs = field_docs(ModelSpec)
    assert set(docs) == {f.name for f in dataclasses.fields(ModelSpec)}
    assert docs["overrides"] == "Architecture fields to change (e.g. vocab_size for a task tokenizer)."
    assert field_docs(Inner) == {"documented": "Has one."}


def test_the_reference_lists_every_field_path_with_its_type_default_and_doc():
    page = render()
    paths = field_paths(Recipe)
    assert {"name", "algorithm.loss.clip_low", "roles.custom[].cls", "extra_columns[].dtype", "eval.count"} <= set(
        paths
    )
    missing = [p for p in paths if f"| `{p}` |" not in page]
    assert not missing, f"fields missing from the rendered reference: {missing}"
    assert "| `name` | str | *required* |" in page
    assert "| `steps` | int | `100` |" in page
    assert '| `publish` | "disk" \\| "shared-memory" \\| "collective" | `"disk"` |' in page
    assert "| `algorithm.optim.betas` | tuple[float, float] | `[0.9, 0.999]` |" in page
    assert "| `model.teacher` | str \\| None | *unset* |" in page
    assert "| `eval` | table [`[eval]`](#eval) | *absent* |" in page
    # A docstring's text, on one line, with what Markdown would take for HTML escaped.
    assert '"hf:&lt;owner/name&gt;" or "gguf:&lt;name&gt;" (meshy.recipes.weights.pretrained). |' in page
    assert "## `[roles.custom]`" not in page and "## `[[roles.custom]]`" in page
