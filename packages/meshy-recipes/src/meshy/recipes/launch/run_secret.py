"""The run's secret, from which every data-plane connection's credentials derive.

One node makes a fresh one. A run over several nodes needs the same secret on each, and it never
travels between them (not in the store, not on a command line): it comes from MESHY_DATAPLANE_SECRET or
from a file the user puts on every node (`--secret-file`), in hex, readable by its owner only.
"""

import os
import stat
from pathlib import Path

from meshy.dataplane import SchemaError
from meshy.dataplane.security import SECRET_ENV
from meshy.dataplane.server import new_secret, parse_secret, secret_from_env

MAKE_ONE = (
    "make one with `openssl rand -hex 32 > run.secret && chmod 600 run.secret`, copy it to every node, and pass "
    f"--secret-file run.secret on each (or export {SECRET_ENV} with that hex on each)"
)


def run_secret(secret_file: str | None, nodes: int) -> bytes:
    """The secret from `secret_file`, else from the environment, else (one node only) a fresh one."""
    if secret_file is not None:
        return _from_file(Path(secret_file))
    if os.environ.get(SECRET_ENV):
        return secret_from_env()
    if nodes > 1:
        raise SchemaError(
            f"a run over {nodes} nodes needs the same secret on every node, and it must never travel between "
            f"them in the clear: {MAKE_ONE}"
        )
    return new_secret()


def _from_file(path: Path) -> bytes:
    try:
        mode = path.stat().st_mode
        text = path.read_text().strip()
    except OSError as e:
        raise SchemaError(f"--secret-file {path}: {e.strerror}; {MAKE_ONE}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise SchemaError(f"--secret-file {path}: readable by others (mode {stat.filemode(mode)}); chmod 600 {path}")
    return parse_secret(text, f"--secret-file {path}", f"; {MAKE_ONE}")
