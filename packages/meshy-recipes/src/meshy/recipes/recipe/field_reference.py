"""The recipe reference: every recipe field's TOML key, type, default and description, rendered as Markdown
from the section dataclasses themselves, so it cannot drift from the code. A field's description is its
attribute docstring (the string literal right under the field), read from the class's source with `ast`.

`uv run python -m meshy.recipes.recipe.field_reference` prints it; the docs site generates reference/recipe.md from it
(docs/hooks.py)."""

import ast
import dataclasses
import enum
import inspect
import itertools
import re
import textwrap
import types
import typing
from dataclasses import dataclass
from functools import cache
from typing import Any

from meshy.recipes.recipe.spec import Recipe

INTRO = """\
# Recipe reference

A recipe is one TOML file that declares a whole run (`meshy run recipe.toml`); it is checked whole, field
by field, before any process starts, and an error names the field's full path. Every key is optional
unless its default says *required*. Types are the recipe's own: `tuple[...]` is a TOML array, `dict` an
inline table, `A | B` either; a field whose default is *unset* is left out to keep it unset. A table's
defaults are its keys'; a table that is *absent* by default is added by writing it.

This page is generated from the recipe's dataclasses and their field docstrings
(`meshy.recipes.recipe.field_reference`).
"""


@dataclass(frozen=True)
class Section:
    """One TOML table of a recipe: its key path ("" for the top level), the dataclass it is built into, whether
    it is an array of tables ([[...]]) and whether it is absent unless written."""

    path: str
    cls: type
    array: bool = False
    optional: bool = False

    @property
    def title(self) -> str:
        if not self.path:
            return "Top level"
        return f"[[{self.path}]]" if self.array else f"[{self.path}]"

    @property
    def anchor(self) -> str:
        """The heading's id, as Python-Markdown's toc extension (MkDocs) derives it from the title."""
        return re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", self.title).strip().lower())

    def key(self, name: str) -> str:
        """A field's full key path, as the reference lists it (`roles.custom[].name` in an array of tables)."""
        prefix = f"{self.path}[]." if self.array else f"{self.path}." if self.path else ""
        return prefix + name


@cache
def field_docs(cls: type) -> dict[str, str]:
    """The attribute docstrings of a dataclass's own fields, by field name, read from its source."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body  # type: ignore[attr-defined]
    docs = {}
    for statement, following in itertools.pairwise(body):
        if (
            isinstance(statement, ast.AnnAssign)
            and isinstance(statement.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[statement.target.id] = inspect.cleandoc(following.value.value)
    return docs


def _section_of(annotation: Any) -> tuple[type, bool, bool] | None:
    """(dataclass, array, optional) when a field holds a table rather than a value."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if dataclasses.is_dataclass(annotation):
        return annotation, False, False  # type: ignore[return-value]
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if dataclasses.is_dataclass(a)]
        return (inner[0], False, type(None) in args) if inner else None
    if origin is tuple and args and dataclasses.is_dataclass(args[0]):
        return args[0], True, False
    return None


def sections(cls: type = Recipe, path: str = "", array: bool = False, optional: bool = False) -> list[Section]:
    """Every table of a recipe, depth first in field order, starting with `cls`'s own."""
    found = [Section(path, cls, array, optional)]
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        inner = _section_of(hints[f.name])
        if inner is not None:
            found += sections(inner[0], f"{path}.{f.name}" if path else f.name, *inner[1:])
    return found


def undocumented(cls: type = Recipe) -> list[str]:
    """Every recipe field without an attribute docstring, as "key path (Class.field)"."""
    return [
        f"{section.key(f.name)} ({section.cls.__name__}.{f.name})"
        for section in sections(cls)
        for f in dataclasses.fields(section.cls)
        if not field_docs(section.cls).get(f.name)
    ]


def type_name(annotation: Any) -> str:
    """An annotation as a recipe writer reads it: `int | None`, `"disk" | "collective"`, `tuple[str, ...]`."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is type(None):
        return "None"
    if origin is typing.Literal:
        return " | ".join(f'"{a}"' if isinstance(a, str) else repr(a) for a in args)
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):  # written as its members' values
        return type_name(typing.Literal[tuple(member.value for member in annotation)])
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin is tuple:
        return "tuple[" + ", ".join("..." if a is Ellipsis else type_name(a) for a in args) + "]"
    return getattr(origin or annotation, "__name__", str(annotation))


def toml_value(value: Any) -> str:
    """A default as TOML writes it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, tuple | list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + "}"
    return repr(value)


def default(f: dataclasses.Field) -> str:
    """A value field's default for the reference: a TOML value, *unset* (None: left out) or *required*."""
    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
        return "*required*"
    value = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    return "*unset*" if value is None else f"`{toml_value(value)}`"


_CODE = re.compile(r"(`[^`]*`)")


def markdown(text: str, cell: bool = False) -> str:
    """Docstring text as Markdown: `<`, `>` and `*` outside code spans escaped (a docstring's "hf:<owner/name>"
    is not HTML); in a table cell, on one line with `|` escaped."""
    parts = []
    for i, part in enumerate(_CODE.split(text)):
        if i % 2 == 0:
            part = part.replace("<", "&lt;").replace(">", "&gt;").replace("*", r"\*")
        parts.append(part.replace("|", r"\|") if cell else part)
    joined = "".join(parts)
    return " ".join(joined.split()) if cell else joined


def _row(section: Section, f: dataclasses.Field) -> str:
    """A field's table row; a field that holds a table links to that table's own section."""
    key = section.key(f.name)
    annotation = typing.get_type_hints(section.cls)[f.name]
    inner = _section_of(annotation)
    if inner is None:
        kind, value = markdown(type_name(annotation), cell=True), default(f)
    else:
        nested = Section(key, *inner)
        kind = f"{'array of tables' if nested.array else 'table'} [`{nested.title}`](#{nested.anchor})"
        value = "*absent*" if nested.optional else "`[]`" if nested.array else "—"
    return f"| `{key}` | {kind} | {value} | {markdown(field_docs(section.cls).get(f.name, ''), cell=True)} |"


def render() -> str:
    """The whole reference, as Markdown."""
    out = [INTRO]
    for section in sections():
        out.append(f"## `{section.title}`\n" if section.path else f"## {section.title}\n")
        out.append(markdown(inspect.cleandoc(section.cls.__doc__ or "")) + "\n")
        if section.optional:
            out.append("*Absent unless written.*\n")
        out.append("| Key | Type | Default | Description |\n|---|---|---|---|")
        out += [_row(section, f) for f in dataclasses.fields(section.cls)]
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    print(render())
