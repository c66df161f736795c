"""Old import paths of modules that moved, kept for one release: importing one (or running it with
`python -m`) gives the module at its new path, with a DeprecationWarning that names it.

Each meshy package registers its own moves in its `__init__`, which Python runs before it looks for
any of its submodules, so the old paths resolve without a file left behind at each of them."""

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from types import CodeType, ModuleType


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, moved: dict[str, str], removed_in: str):
        self.moved = moved
        self.removed_in = removed_in

    def find_spec(self, fullname: str, path=None, target=None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.moved:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def _warn(self, old: str) -> str:
        new = self.moved[old]
        warnings.warn(
            f"{old} moved to {new}; import it from there (the old path is removed in meshy {self.removed_in})",
            DeprecationWarning,
            stacklevel=3,
        )
        return new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(self._warn(spec.name))

    def exec_module(self, module: ModuleType) -> None:
        """The new module has run already."""

    def get_code(self, fullname: str) -> CodeType | None:
        """What `python -m OLD` runs: the new module's code."""
        new = self._warn(fullname)
        return importlib.util.find_spec(new).loader.get_code(new)


def keep_old_paths(moved: dict[str, str], removed_in: str) -> None:
    """Resolve each old dotted path in `moved` (old -> new) to its new one, until meshy `removed_in`."""
    sys.meta_path.append(_MovedModules(moved, removed_in))
