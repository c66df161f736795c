"""Where a process of a run is: its run's directory, its node's rank and its node's address.

`meshy run --node-rank R` hands both to every rank in the environment; under a plain `torchrun` the node's
rank is torchrun's own. A node's address is the one the
recipe names for it (topology.addresses), or that of the interface that routes to the rendezvous host;
its data-plane servers bind it, and its collectives (gloo, NCCL) use that interface.
"""

import fcntl
import ipaddress
import os
import socket
import struct
from pathlib import Path

from meshy.dataplane import SchemaError
from meshy.recipes.recipe import Recipe

RUN_DIR_ENV = "MESHY_RUN_DIR"
STALL_REPORT = (
    "stall.txt"  # under the run directory's logs/: what a stuck run waited for (meshy.recipes.launch.watchdog)
)
NODE_RANK_ENV = "MESHY_NODE_RANK"
NODE_ADDRESS_ENV = "MESHY_NODE_ADDRESS"
GROUP_RANK_ENV = "GROUP_RANK"  # torchrun's rank of this node
INTERFACE_ENVS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")  # set to the node's interface unless set
_SIOCGIFADDR = 0x8915


def run_dir(recipe: Recipe) -> Path:
    """The run's directory: MESHY_RUN_DIR (`meshy run` sets it), else the recipe's run_dir/name."""
    return Path(os.environ.get(RUN_DIR_ENV) or Path(recipe.run_dir) / recipe.name)


def node_rank(recipe: Recipe) -> int:
    """This process's node: MESHY_NODE_RANK (`meshy run --node-rank` sets it), else torchrun's own node rank
    (GROUP_RANK: `--node-rank` under torchrun's static rendezvous; the order of joining under c10d); 0 for
    a run on one node."""
    name, value = NODE_RANK_ENV, os.environ.get(NODE_RANK_ENV)
    if value is None and recipe.topology.nodes > 1:
        name, value = GROUP_RANK_ENV, os.environ.get(GROUP_RANK_ENV)
        if value is None:
            raise SchemaError(
                f"{NODE_RANK_ENV} is not set: every process of a run over {recipe.topology.nodes} nodes needs its "
                "node's rank (meshy run --node-rank sets it)"
            )
    if value is None:
        return 0
    if not value.isdigit() or int(value) >= recipe.topology.nodes:
        raise SchemaError(f"{name}={value}: expected a node below topology.nodes = {recipe.topology.nodes}")
    return int(value)


def address_toward(host: str) -> str:
    """This machine's address on the interface that routes to `host` (a UDP connect: nothing is sent)."""
    try:
        family, _, _, _, target = socket.getaddrinfo(host, 9, proto=socket.IPPROTO_UDP)[0]
    except socket.gaierror as e:
        raise SchemaError(f"rendezvous host {host!r} does not resolve: {e}") from None
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(target)
        return probe.getsockname()[0]


def node_address(recipe: Recipe, node: int, rendezvous_host: str) -> str:
    """The address node `node` binds: the recipe's for it, or the route toward the rendezvous host."""
    if recipe.topology.addresses:
        return recipe.topology.addresses[node]
    return address_toward(rendezvous_host)


def interface_of(address: str) -> str | None:
    """The name of the network interface that has the IPv4 `address` (None: none has, or it is IPv6)."""
    if ipaddress.ip_address(address).version != 4:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                answer = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, request)
            except OSError:  # an interface without an IPv4 address
                continue
            if socket.inet_ntoa(answer[20:24]) == address:
                return name
    return None
