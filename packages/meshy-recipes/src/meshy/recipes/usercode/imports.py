"""Recipes name code by import path ("package.module:name"); one loader resolves them all.

A user's own task module (mytask.py) may sit beside the recipe or in the current directory: `meshy check`
and `meshy run` import from both (`import_beside`), and hand both to the run's processes
(`code_path`), whose recipe is a copy in the run directory; the run directory records them
(CODE_DIRS_FILE), so that `--resume` and `meshy sample` find the task from anywhere.
"""

import importlib
import os
import sys
import traceback
from pathlib import Path
from typing import Any

from meshy.dataplane import SchemaError

CODE_PATH_ENV = "PYTHONPATH"
CODE_DIRS_FILE = "code_dirs.txt"  # in a run directory: where `meshy run` imported the task's code from


def import_object(path: str, field: str) -> Any:
    """The object `path` names; a SchemaError naming the recipe `field` if it cannot be imported."""
    module, _, name = path.partition(":")
    try:
        imported = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name is None or not (module == e.name or module.startswith(e.name + ".")):
            raise SchemaError(raised(f"{field}: {path!r}: importing {module!r}", e)) from None
        file = module.replace(".", "/") + ".py"
        raise SchemaError(
            f"{field}: {path!r}: no module {e.name!r}: expected {file} beside the recipe or in the current "
            f"directory, or its directory on {CODE_PATH_ENV} (`{CODE_PATH_ENV}=/path/to/dir meshy ...`), or the "
            "package that holds it installed"
        ) from None
    except Exception as e:  # the module's own code failed: its traceback says where
        raise SchemaError(raised(f"{field}: {path!r}: importing {module!r}", e)) from None
    try:
        return getattr(imported, name)
    except AttributeError:
        raise SchemaError(f"{field}: {path!r}: module {module!r} has no {name!r}") from None


def raised(what: str, error: BaseException, caller: str = __file__) -> str:
    """'<what> raised <Error>: <message>' and the traceback of the code that raised it (traceback_from)."""
    message = "".join(traceback.format_exception_only(error)).strip()
    where = traceback_from(error, caller, with_error=False)
    return f"{what} raised {message}" + (f"\n{where}" if where else "")


def traceback_from(error: BaseException, caller: str, with_error: bool = True) -> str:
    """The traceback of `error` without the frames of the `caller` file that called the code, nor of this
    file and the import machinery: a user's error names their file and line (and then the error itself)."""
    frames = [
        f
        for f in traceback.extract_tb(error.__traceback__)
        if f.filename not in (caller, __file__) and not f.filename.startswith("<frozen importlib")
    ]
    text = "".join(traceback.format_list(frames))
    return (text + "".join(traceback.format_exception_only(error)) if with_error else text).rstrip()


def code_dirs(recipe_file: Path) -> list[str]:
    """Where a recipe's own modules are imported from besides sys.path: the recipe's directory (not for a
    shipped recipe: Meshy's own modules are beside the default one) and the current directory."""
    here = recipe_file.resolve().parent
    shipped = here.is_relative_to(Path(__file__).resolve().parents[1])
    recorded = here / CODE_DIRS_FILE  # the recipe is a run directory's copy
    earlier = recorded.read_text().splitlines() if recorded.is_file() else []
    return list(dict.fromkeys([*earlier, *([] if shipped else [str(here)]), os.getcwd()]))


def record_code_dirs(run_dir: Path, recipe_file: Path) -> None:
    """Keep where the recipe's task code is imported from in its run directory (CODE_DIRS_FILE)."""
    (run_dir / CODE_DIRS_FILE).write_text("".join(f"{d}\n" for d in code_dirs(recipe_file)))


def import_beside(recipe_file: Path) -> None:
    """Make the modules beside `recipe_file` and in the current directory importable in this process, found
    first as in the run's processes (PYTHONPATH, and `python -m` puts the current directory first)."""
    sys.path[:0] = [d for d in code_dirs(recipe_file) if d not in sys.path]


def code_path(recipe_file: Path, env: dict[str, str]) -> str:
    """The PYTHONPATH for the run's processes: `env`'s, then the recipe's directory and the current one."""
    existing = [p for p in env.get(CODE_PATH_ENV, "").split(os.pathsep) if p]
    return os.pathsep.join(dict.fromkeys([*existing, *code_dirs(recipe_file)]))
