"""MkDocs hooks (mkdocs.yml `hooks:`): the recipe reference page is generated from the recipe's dataclasses
and their field docstrings at every build (meshy.recipes.recipe.field_reference), so it cannot drift from the code."""

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files

from meshy.recipes.recipe.field_reference import render

RECIPE_REFERENCE = "reference/recipe.md"


def on_files(files: Files, config: MkDocsConfig) -> Files:
    files.append(File.generated(config, RECIPE_REFERENCE, content=render()))
    return files
