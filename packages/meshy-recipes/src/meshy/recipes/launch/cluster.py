"""The nodes of a multi-node run as their `meshy run` processes see each other, through the rendezvous store.

Node 0's `meshy run` hosts the store at --rdzv-endpoint and every node's torchrun joins its c10d
rendezvous there (as a client), so the store outlives any torchrun agent. Before torchrun starts, the
nodes check they are distinct and run the same recipe, and agree on the run directory; while it runs,
each beats a heartbeat and watches the others'; when it ends, each posts how its node ended, so every
node can say which rank died. Only addresses, hashes, names and statuses go through the store (it is
unauthenticated), never the secret.
"""

import hashlib
import json
import sys
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from meshy.dataplane import SchemaError

JOIN_TIMEOUT_S = 600.0  # as long as torchrun waits for the nodes to join its rendezvous
STORE_TIMEOUT_S = 10.0  # one store call once every node has joined; longer means its host is gone
NODE_LOST_S = 20.0  # a node whose heartbeat has not moved for this long is gone
SILENT = f"stopped answering (no heartbeat for {NODE_LOST_S:.0f} s): its meshy run, torchrun agent or machine is gone"
POLL_S = 0.2
SAY_WAITING_S = 5.0  # a wait at start longer than this is said (a node not started yet, most likely)
_KEY = "meshy/cluster/"


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise SchemaError(f"--rdzv-endpoint {endpoint!r}: expected HOST:PORT (node 0's address and a free port)")
    return host.strip("[]"), int(port)


class Cluster:
    def __init__(self, endpoint: str, node: int, nodes: int):
        self.endpoint, self.node, self.nodes = endpoint, node, nodes
        host, port = parse_endpoint(endpoint)
        try:
            self.store = dist.TCPStore(
                host, port, is_master=node == 0, timeout=timedelta(seconds=JOIN_TIMEOUT_S), wait_for_workers=False
            )
        except (RuntimeError, ValueError) as e:
            what = f"host the rendezvous store at {endpoint}" if node == 0 else f"reach node 0 at {endpoint}"
            raise SchemaError(f"--rdzv-endpoint: cannot {what}: {str(e).splitlines()[0]}") from None
        self._beats = {n: (-1, time.monotonic()) for n in range(nodes) if n != node}

    # ---- before torchrun ----------------------------------------------------------------------
    def refuse(self, message: str) -> None:
        """Tell every node this run cannot start (they stop waiting and say why); node 0, whose exit takes
        the store with it, waits a moment for the others to read it."""
        self.store.compare_set(f"{_KEY}refused", "", json.dumps({"node": self.node, "message": message}))
        deadline = time.monotonic() + 5.0
        while self.node == 0 and self.store.add(f"{_KEY}refused-read", 0) < self.nodes - 1:
            if time.monotonic() > deadline:
                return
            time.sleep(POLL_S)

    def _wait(self, keys: list[str], what: str) -> list[bytes]:
        started, said = time.monotonic(), False
        try:
            while not self.store.check(keys):
                if self.store.check([f"{_KEY}refused"]):
                    refused = json.loads(self.store.get(f"{_KEY}refused"))
                    self.store.add(f"{_KEY}refused-read", 1)
                    raise SchemaError(f"node {refused['node']} refused the run: {refused['message']}")
                waited = time.monotonic() - started
                if waited > JOIN_TIMEOUT_S:
                    raise SchemaError(f"no {what} within {JOIN_TIMEOUT_S:.0f} s: are all {self.nodes} nodes started?")
                if waited > SAY_WAITING_S and not said:
                    waiting = f"meshy: node {self.node}: waiting for {what} at {self.endpoint}"
                    print(waiting, file=sys.stderr, flush=True)
                    said = True
                time.sleep(POLL_S)
            return self.store.multi_get(keys)
        except dist.DistError:
            raise SchemaError(f"the rendezvous store on node 0 ({self.endpoint}) went away; node 0 says why") from None

    def join(self, recipe_text: str) -> None:
        """Every node started once, with the same recipe."""
        if self.store.add(f"{_KEY}node/{self.node}", 1) > 1:
            message = f"two nodes were started with --node-rank {self.node}"
            self.refuse(message)
            raise SchemaError(message)
        digest = hashlib.sha256(recipe_text.encode()).hexdigest()
        self.store.set(f"{_KEY}recipe/{self.node}", digest)
        digests = self._wait([f"{_KEY}recipe/{n}" for n in range(self.nodes)], f"all {self.nodes} nodes")
        differ = [n for n, d in enumerate(digests) if d.decode() != digests[0].decode()]
        if differ:
            raise SchemaError(f"node {differ[0]} runs a different recipe than node 0; every node needs the same one")

    def agree(self, key: str, value: str) -> list[str]:
        """Every node's value under `key`, this node's among them."""
        self.store.set(f"{_KEY}{key}/{self.node}", value)
        keys = [f"{_KEY}{key}/{n}" for n in range(self.nodes)]
        return [v.decode() for v in self._wait(keys, f"the nodes' {key}")]

    def decided(self, key: str, value: str) -> str:
        """Node 0's `value` under `key`, on every node (the others' `value` is not used)."""
        if self.node == 0:
            self.store.set(f"{_KEY}{key}", value)
        return self._wait([f"{_KEY}{key}"], f"node 0's {key}")[0].decode()

    # ---- while torchrun runs ------------------------------------------------------------------
    def beat(self) -> str | None:
        """Beat this node's heartbeat and check the others'; why the run must stop here, if it must: another
        node ended badly, or went silent, or the store's host (node 0's meshy run) is gone."""
        try:
            self.store.set_timeout(timedelta(seconds=STORE_TIMEOUT_S))
            self.store.add(f"{_KEY}beat/{self.node}", 1)
            for other in self._beats:
                ended = self.status(other)
                if ended is not None:
                    if ended["cause"]:
                        return f"node {other} stopped: {ended['message']}"
                elif self._silent(other):
                    return f"node {other} {SILENT}"
        except dist.DistError:
            return f"the run's store on node 0 ({self.endpoint}) is gone: node 0's meshy run or machine stopped"
        return None

    def _silent(self, other: int) -> bool:
        """Whether node `other`'s heartbeat has not moved for NODE_LOST_S (its meshy run beats until it exits)."""
        count, (seen, since) = self.store.add(f"{_KEY}beat/{other}", 0), self._beats[other]
        if count != seen:
            self._beats[other] = (count, time.monotonic())
            return False
        return time.monotonic() - since > NODE_LOST_S

    # ---- after torchrun -----------------------------------------------------------------------
    def post(self, failed: bool, cause: bool, message: str, newest_checkpoint: str | None) -> None:
        """How this node's torchrun ended. cause: the node failed by itself (not stopped for another's)."""
        status = {"failed": failed, "cause": cause, "message": message, "checkpoint": newest_checkpoint}
        status["time"] = time.time()
        self.store.set(f"{_KEY}status/{self.node}", json.dumps(status))

    def status(self, node: int) -> dict[str, Any] | None:
        key = f"{_KEY}status/{node}"
        return json.loads(self.store.get(key)) if self.store.check([key]) else None

    def statuses(self, timeout_s: float) -> dict[int, dict[str, Any] | None]:
        """Every node's posted end, waiting up to `timeout_s` for those not posted yet (None: never came,
        or the store went away first; a silent node is not waited for). Node 0, whose exit takes the store
        with it, then waits (as long again at most) until every node still answering has read them."""
        deadline = time.monotonic() + timeout_s
        seen: dict[int, dict[str, Any] | None] = {}
        try:
            while True:
                self.store.add(f"{_KEY}beat/{self.node}", 1)
                seen = {n: self.status(n) for n in range(self.nodes)}
                waiting = [n for n, s in seen.items() if s is None and n != self.node and not self._silent(n)]
                if not waiting or time.monotonic() > deadline:
                    break
                time.sleep(POLL_S)
            self.store.set(f"{_KEY}statuses-read/{self.node}", "1")
            deadline = time.monotonic() + timeout_s
            while self.node == 0 and time.monotonic() < deadline:
                self.store.add(f"{_KEY}beat/{self.node}", 1)
                unread = [n for n in self._beats if not self.store.check([f"{_KEY}statuses-read/{n}"])]
                if all(self._silent(n) for n in unread):
                    break
                time.sleep(POLL_S)
        except dist.DistError:
            pass
        return {n: seen.get(n) for n in range(self.nodes)}
