"""Every module of the four packages has a name of its own: a traceback's or a grep's `rollout.py` is one
file, not one of several (a package's __init__ and __main__ aside)."""

from collections import Counter
from pathlib import Path

PACKAGES = Path(__file__).resolve().parents[1] / "packages"


def test_module_names_are_unique_across_the_packages():
    names = Counter(
        p.name for p in PACKAGES.glob("*/src/meshy/**/*.py") if p.name not in ("__init__.py", "__main__.py")
    )
    assert len(names) > 100, "the packages' modules were found"
    assert [name for name, n in names.items() if n > 1] == []
