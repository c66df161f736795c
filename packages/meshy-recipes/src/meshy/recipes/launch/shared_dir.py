"""Whether a multi-node run needs its run directory to be one directory on every node, and a probe of it.

Weights published to disk, the reference weights, and the policy's checkpoints are written on one node
and read on another when their roles are placed apart (or, for checkpoints, span nodes). Then every
node writes a probe file with a fresh token into the run directory, posts the token through the store,
and reads every other node's file: a node that cannot see them refuses the run, before any rank starts.
"""

import secrets
from pathlib import Path

from meshy.dataplane import SchemaError
from meshy.dataplane.weights import Transport
from meshy.recipes.launch.cluster import Cluster
from meshy.recipes.recipe import Recipe
from meshy.recipes.recipe.topology import Slot

PROBE = ".meshy-probe-node"  # + node, in the run directory


def shared_reasons(recipe: Recipe, slots: dict[int, Slot]) -> list[str]:
    """Why the run directory must be the same on every node (empty: each node may keep its own)."""
    nodes = {role: sorted({s.node for s in slots.values() if s.role == role}) for role, _ in recipe.roles.items()}
    publisher = nodes["training"][0]
    reasons = []
    elsewhere = [n for n in nodes["inference"] if n != publisher]
    if recipe.publish is Transport.DISK and elsewhere:
        reasons.append(
            f'publish = "disk": inference on node {elsewhere[0]} loads the weights training writes on node '
            f"{publisher} (weights/)"
        )
    if any(n != publisher for n in nodes.get("reference", [])):
        reasons.append(f"the reference role loads the reference weights training writes on node {publisher}")
    if len(nodes["training"]) > 1:
        reasons.append(f"training's processes on nodes {nodes['training']} write and read one checkpoint")
    if any(n != publisher for n in nodes.get("critic", [])):
        reasons.append(f"the critic resumes from the policy's checkpoints, written on node {publisher}")
    return reasons


def probe(cluster: Cluster, directory: Path, reasons: list[str]) -> None:
    """Refuse the run (on every node) unless every node sees every other node's probe in `directory`."""
    token = secrets.token_hex(16)
    mine = directory / f"{PROBE}{cluster.node}"
    mine.write_text(token)
    try:
        tokens = cluster.agree("probe", token)
        unseen = []
        for node, expected in enumerate(tokens):
            path = directory / f"{PROBE}{node}"
            if node != cluster.node and (not path.is_file() or path.read_text() != expected):
                unseen.append(node)
        verdicts = cluster.agree("probe-seen", ",".join(map(str, unseen)))
    finally:
        mine.unlink(missing_ok=True)
    blind = [(node, seen) for node, seen in enumerate(verdicts) if seen]
    if blind:
        node, unseen = blind[0]
        raise SchemaError(
            f"run directory {directory}: node {node} cannot see what node {unseen.split(',')[0]} writes there, and "
            f"this run needs one directory on every node: {'; '.join(reasons)}. Put run_dir on a filesystem every "
            'node mounts at the same path, or use publish = "collective" with roles that keep their checkpoints '
            "on one node"
        )
