"""A recipe: what a run is, as data (schema), read from TOML with --set overrides (overrides), checked
as a whole (the topology it lays out, the data flow between its roles), and the shipped ones (catalog).

The names a user reaches for are here: `load_recipe`, `Recipe` and its sections."""

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
    load_recipe,
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
    "load_recipe",
]
