"""An append-only file of checksummed records: what a durable storage unit and the controller's journal keep.

A record is an 8-byte header (payload length, CRC-32 of the payload; little endian) and a pickled payload.
A process killed in the middle of a write leaves a torn tail: reading stops at the first record whose
header, length or checksum does not hold, and the file is cut there (`LogContents.torn_bytes` says how
much). A write that fails (a full disk) is cut back too, so the log never holds a torn record before
good ones. `rewrite` replaces the whole file atomically: a compaction, the live state as records.

Durability (`DURABLE_MODES`): "sync" fsyncs before each append returns; "batched" fsyncs from a thread
every `sync_every_s` while there are unsynced writes; "off" keeps no log. Written bytes reach the page
cache at once in every mode, so a killed process loses nothing; the modes differ only for a host that
loses power.
"""

import contextlib
import os
import pickle
import struct
import threading
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

DurableMode = Literal["off", "batched", "sync"]
DURABLE_MODES: tuple[str, ...] = ("off", "batched", "sync")
_HEADER = struct.Struct("<II")
_MAX_RECORD = (1 << 32) - 1


@dataclass
class LogContents:
    records: list[Any]
    sizes: list[int]  # each record's bytes in the file
    torn_bytes: int  # cut from the end: a record that was being written when the writer died


class RecordLog:
    """One log file, appended to by one thread at a time."""

    def __init__(self, path: Path, mode: DurableMode, sync_every_s: float):
        if mode not in ("batched", "sync"):
            raise ValueError(f"RecordLog: mode must be 'batched' or 'sync', got {mode!r}")
        self.path = Path(path)
        self._mode = mode
        self._sync_every_s = sync_every_s
        self._lock = threading.Lock()  # the descriptor, against the fsync thread and rewrite
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self.size = os.fstat(self._fd).st_size
        self._unsynced = False
        self._broken: str | None = None  # why appending is unsafe: a failed write could not be cut back
        self._closed = threading.Event()
        self._syncer = None
        if mode == "batched":
            self._syncer = threading.Thread(target=self._sync_loop, name="meshy-log-fsync", daemon=True)
            self._syncer.start()

    @classmethod
    def open(cls, path: Path, mode: DurableMode, sync_every_s: float) -> tuple["RecordLog", LogContents]:
        """The log at `path` (created if absent) and what it held, its torn tail cut."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        contents = read(path)
        if contents.torn_bytes:
            with open(path, "r+b") as f:
                f.truncate(path.stat().st_size - contents.torn_bytes)
        return cls(path, mode, sync_every_s), contents

    def append(self, record: Any) -> int:
        """Write one record; returns its bytes. On failure (OSError) the file is as it was before."""
        payload = pickle.dumps(record, protocol=pickle.HIGHEST_PROTOCOL)
        if len(payload) > _MAX_RECORD:
            raise ValueError(f"{self.path}: a record of {len(payload)} bytes is over the {_MAX_RECORD}-byte limit")
        header = _HEADER.pack(len(payload), zlib.crc32(payload))
        with self._lock:
            if self._broken is not None:
                raise OSError(f"{self.path}: {self._broken}")
            try:
                _write_all(self._fd, [header, payload], self.size)
            except OSError as e:
                if os.fstat(self._fd).st_size != self.size:
                    self._broken = f"a failed write ({e}) left a torn record that could not be cut"
                raise
            self.size += len(header) + len(payload)
            if self._mode == "sync":
                os.fsync(self._fd)
            else:
                self._unsynced = True
        return len(header) + len(payload)

    def rewrite(self, records: Iterable[Any]) -> None:
        """Replace the file with `records`, atomically (written beside it, synced, renamed over it)."""
        tmp = self.path.with_name(self.path.name + ".compacting")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        size = 0
        try:
            for record in records:
                payload = pickle.dumps(record, protocol=pickle.HIGHEST_PROTOCOL)
                _write_all(fd, [_HEADER.pack(len(payload), zlib.crc32(payload)), payload], size)
                size += _HEADER.size + len(payload)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        with self._lock:
            os.replace(tmp, self.path)
            os.close(self._fd)
            self._fd = fd
            os.lseek(fd, 0, os.SEEK_END)
            self.size = size
            self._unsynced = False
        _sync_directory(self.path.parent)

    def _sync_loop(self) -> None:
        while not self._closed.wait(self._sync_every_s):
            self.sync()

    def sync(self) -> None:
        """fsync what was written so far, on a duplicate descriptor, so that appends go on meanwhile."""
        with self._lock:
            if not self._unsynced or self._closed.is_set():
                return
            fd = os.dup(self._fd)
            self._unsynced = False
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def close(self) -> None:
        self.sync()
        self._closed.set()
        with self._lock:
            os.close(self._fd)


def read(path: Path) -> LogContents:
    """Every whole record of the log at `path` (none if absent), and how many bytes after them are torn."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return LogContents([], [], 0)
    records, sizes, at = [], [], 0
    while at + _HEADER.size <= len(data):
        length, crc = _HEADER.unpack_from(data, at)
        end = at + _HEADER.size + length
        if end > len(data):
            break
        payload = memoryview(data)[at + _HEADER.size : end]
        if zlib.crc32(payload) != crc:
            break
        records.append(pickle.loads(payload))
        sizes.append(end - at)
        at = end
    return LogContents(records, sizes, len(data) - at)


def _write_all(fd: int, parts: list[bytes], size_before: int) -> None:
    """Write every byte of `parts` at the end of `fd`; on failure cut the file back to `size_before`."""
    try:
        for part in parts:
            view = memoryview(part)
            while view:
                view = view[os.write(fd, view) :]
    except OSError:
        with contextlib.suppress(OSError):  # RecordLog.append notices a cut that failed
            os.ftruncate(fd, size_before)
        raise


def _sync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
