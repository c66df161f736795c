import fcntl
import multiprocessing
import tempfile
import uuid
from pathlib import Path

import pytest

from meshy.dataplane import DataPlaneClient, DataPlaneConfig, DataPlaneServer, new_secret


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`-n auto` schedules by work stealing: an idle worker takes half of a busy one's queue. xdist's
    default ("load") hands out tests in chunks, and once gave one worker every end-to-end run (half the
    tier's time) while the other sat idle for four minutes. An explicit other --dist is kept."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import WorkStealingScheduling

    return WorkStealingScheduling(config, log)


@pytest.fixture
def sandboxes_alone():
    """The machine's sandbox tests one at a time: a test that counts the sandbox processes it leaves behind
    (test_sandbox's nothing_left) must not count those of a test that runs sandboxes on another worker (any
    test that builds a code tool, which probes the sandbox by running one)."""
    with open(Path(tempfile.gettempdir()) / "meshy-tests-sandboxes.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


@pytest.fixture(scope="session")
def secret() -> bytes:
    return new_secret()


@pytest.fixture(scope="session")
def dataplane(secret):
    """One data plane (two storage units) per test worker; tests keep apart by unique table names."""
    with DataPlaneServer.start(secret, DataPlaneConfig(num_storage_units=2)) as server:
        yield server


@pytest.fixture
def client(dataplane, secret):
    with DataPlaneClient(dataplane.endpoints, secret, name="test") as c:
        yield c


@pytest.fixture
def unique():
    return lambda prefix: f"{prefix}_{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="session")
def mp_context():
    """Real processes, started from a server process that imported meshy once (fast starts)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["meshy.dataplane", "tests.dataplane.workers"])
    return ctx
