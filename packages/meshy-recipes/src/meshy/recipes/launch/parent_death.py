"""Dying with the parent process: the kernel SIGKILLs this process when its parent exits.

torchrun starts each rank in a session of its own and stops the ranks itself, which a SIGKILLed agent
cannot do: without this, its ranks carry on training, orphaned, until the run ends. (The data-plane
launcher does the same for its server processes; it cannot import this module, which is why the few
lines are repeated there.)
"""

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Ask for SIGKILL when the parent exits; exit now if it already has (between the two reads of it)."""
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(1)
