"""The reference policy's weights: the policy's version 0, kept for the whole run.

The training role writes them when the run starts from version 0 (`run_dir/reference/v000000`, an HF
directory in the model dtype, with its announcement beside it in `published.json`; a LoRA policy's as a whole
model, its adapters, still zero, merged) and announces them on the `reference` stream at every start: a resumed
run announces the saved copy again, since version 0 is long gone from the `weights` stream and directory by
then. The reference role loads what the stream
announces, verified against its checksum.
"""

import json
import os
import shutil
from dataclasses import replace

import torch

from meshy.dataplane import SchemaError
from meshy.dataplane.weights import Published
from meshy.recipes.roles.context import RoleContext
from meshy.train.models import DecoderArch
from meshy.train.publish import DirectoryPublisher

REFERENCE_STREAM = "reference"


def publish_reference(
    ctx: RoleContext, model: torch.nn.Module, arch: DecoderArch, version: int, stream: str = REFERENCE_STREAM
) -> None:
    """Write (at version 0) and announce the reference weights, as the training role starts at `version`.
    Every training process calls it: the weights are gathered tensor by tensor, a collective; process 0
    writes and announces."""
    root = ctx.run_dir / "reference"
    saved = root / "published.json"
    lead = ctx.slot.index == 0
    if version == 0:
        if lead:  # a start that stopped before its first checkpoint may have written them already
            shutil.rmtree(root, ignore_errors=True)
        published = DirectoryPublisher(root, arch, dtype=ctx.recipe.model.dtype, adapters=False).publish(model, 0)
        if published is None:
            return
        partial = saved.with_suffix(f".tmp{os.getpid()}")
        partial.write_text(json.dumps(published.to_message()))
        partial.rename(saved)
    elif not lead:
        return
    elif not saved.is_file():
        raise SchemaError(f"resuming at version {version}: no reference weights at {saved} (the run wrote none)")
    else:  # where the directory is now, should the run directory have moved since
        published = replace(Published.from_message(json.loads(saved.read_text())), location=str(root / "v000000"))
    ctx.client.append(stream, published.to_message())


def wait_for_reference(ctx: RoleContext, stream: str = REFERENCE_STREAM) -> Published | None:
    """The reference weights as the training role announced them, or None if the run stops first."""
    reader = ctx.client.reader(stream, f"reference-{ctx.slot.index}", start=1)
    try:
        while not ctx.stop.is_set():
            messages = reader.read(max_n=1, timeout=1.0)
            if messages:
                return Published.from_message(messages[0].payload)
        return None
    finally:
        reader.close()
