"""Downloads from the Hugging Face hub (huggingface_hub, optional; network): what a failed one raises, and
running with no downloads at all.

`meshy check` tries a recipe's task with what this machine has already downloaded (`no_downloads`): a
dataset or tokenizer still on the hub is then `NotDownloaded`, which the trial reports as not tried rather
than as wrong. `meshy run` downloads it (its processes need it), and a failure there is an error.
"""

import contextlib
from collections.abc import Iterator

from meshy.dataplane import SchemaError

_downloads_off = False  # within no_downloads()


class NotDownloaded(SchemaError):
    """A hub file the task needs is not on this machine, and could not be downloaded now (no network, or
    downloads were off)."""


def download_error(message: str, error: Exception) -> SchemaError:
    """The error for a failed download: NotDownloaded when the hub could not be reached (or was not asked),
    a plain SchemaError when it answered (no such repository or file, no access)."""
    if _downloads_off:  # the hub was not asked: whatever huggingface_hub says, it says at length
        return NotDownloaded(f"{message}: it is not in this machine's hub cache, and downloads are off")
    text = f"{message} ({type(error).__name__}: {error})"
    if getattr(error, "response", None) is not None:  # huggingface_hub's HTTP errors carry the hub's answer
        return SchemaError(text)
    return NotDownloaded(f"{text}; it is not downloaded on this machine, and the hub was not reached")


@contextlib.contextmanager
def no_downloads() -> Iterator[None]:
    """Within it, huggingface_hub downloads nothing: what is not in its cache fails at once, as
    HF_HUB_OFFLINE=1 makes it (and without retrying for half a minute when there is no network)."""
    try:
        from huggingface_hub import constants
    except ImportError:  # without huggingface_hub nothing is downloaded anyway
        yield
        return
    global _downloads_off
    offline, off = constants.HF_HUB_OFFLINE, _downloads_off
    constants.HF_HUB_OFFLINE = _downloads_off = True
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE, _downloads_off = offline, off
