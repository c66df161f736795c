"""A recipe: what a run is, as data (spec), read from TOML with --set overrides (load, overrides), checked
as a whole (checks: the topology it lays out, the data flow between its roles), and the shipped ones (catalog).

The names a user reaches for are here: `load_recipe`, `Recipe` and its sections."""

from meshy.recipes.recipe.checks import check_recipe
from meshy.recipes.recipe.load import load_recipe
from meshy.recipes.recipe.spec import (
    BUILTIN_ROLES,
    DEFAULT_RECIPE,
    EVAL_SEED,
    AgentSpec,
    AlgorithmSpec,
    CustomRoleSpec,
    EvalSpec,
    LoggingSpec,
    ModelSpec,
    Recipe,
    RoleSpec,
    RolesSpec,
    SamplingSpec,
    TaskSpec,
    TopologySpec,
    build,
)

__all__ = [
    "BUILTIN_ROLES",
    "DEFAULT_RECIPE",
    "EVAL_SEED",
    "AgentSpec",
    "AlgorithmSpec",
    "CustomRoleSpec",
    "EvalSpec",
    "LoggingSpec",
    "ModelSpec",
    "Recipe",
    "RoleSpec",
    "RolesSpec",
    "SamplingSpec",
    "TaskSpec",
    "TopologySpec",
    "build",
    "check_recipe",
    "load_recipe",
]
