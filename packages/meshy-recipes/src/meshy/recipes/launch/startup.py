"""What a run shows while it starts: one line as each start-up phase is done (the data plane up, training
built, the first weights published, the inference engine built, the first batch ready), with the seconds
since `meshy run` started, so that the minute or two before the first version (imports, model build,
engine start on a busy machine) is not silent. Rank processes print them on their stdout, which is
`meshy run`'s own (torchrun passes it through)."""

import os
import time

START_ENV = "MESHY_RUN_START"  # when `meshy run` started (time.time()), for its ranks
_IMPORTED = time.time()  # under a plain torchrun: roughly when this process started
_done: set[str] = set()


def mark_start() -> None:
    """`meshy run` starts: its ranks time their start-up from now."""
    os.environ[START_ENV] = repr(time.time())


def phase_done(phase: str) -> None:
    """One line, the first time a phase is done in this process: `meshy: start-up: data plane up (3.1 s)`."""
    if phase in _done:
        return
    _done.add(phase)
    start = float(os.environ.get(START_ENV) or _IMPORTED)
    print(f"meshy: start-up: {phase} ({time.time() - start:.1f} s)", flush=True)
