"""The ingest's ranks on disk (``--ingest.state-file``), so that a restart loses nothing.

A daemon that restarts (an upgrade, a crash, the OOM killer, a liveness probe) would forget
every rank it held: a rank that failed, or vanished without a goodbye, would no longer be on
the page, so ``GpuTrainRunFailed`` and ``GpuTrainRunVanished`` would resolve by themselves
and the status page and ``top`` would say nothing of the run that died. With a state file the
daemon writes its ranks (:meth:`IngestStore.saved`) and takes them back when it starts, aged
by the time it was down (:meth:`IngestStore.restore`): a failed rank is still failed, a
silent one still silent (and departs when its ttl runs out, as it would have), one whose
process died meanwhile is found gone and marked killed.

The file is written from the sampler's thread, never on a request: on the cycle after a rank
ends (a goodbye, a kill, a departure) and otherwise at most every ``SAVE_SECONDS`` while
pushes change it, then once more at shutdown; atomically (a temporary file renamed over it),
so a crash mid-write leaves the last whole one. A file that cannot be read is logged and left
(kept aside as ``<file>.bad``; a fresh start), a path that cannot be one (no such directory,
no permission, read-only) is an error at start (exit 2); any other failure to write is a
warning.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from exporter.serving.ingest import IngestStore

log = logging.getLogger(__name__)
SAVE_SECONDS = 30.0  # at most this long between writes while only the ranks' totals change
# a rank's row at its largest (64 buckets, 16 phases, 16 GPUs, long names) is under 6 KB
ROW_BYTES = 16384
# the errors of a path that cannot be the state file: said at start (exit 2); any other
# (a full disk) is a warning, and the daemon serves
CONFIG_ERRORS = frozenset({errno.EACCES, errno.EPERM, errno.ENOENT, errno.ENOTDIR,
                           errno.EISDIR, errno.EROFS})


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is no number this daemon writes")


class StateFile:
    """``store``'s ranks kept in ``path`` (see the module docstring)."""

    def __init__(self, path: str, store: IngestStore,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.path = Path(path)
        self.store = store
        self._clock = clock
        self._lock = threading.Lock()  # one writer at a time: the sampler, then shutdown
        self._saved: tuple[int, int] | None = None  # (store.version, store.ends) written
        self._saved_at = -float("inf")
        self._failing = False

    def load(self) -> None:
        """Take back the ranks of the file, if there is one. A file that cannot be read or is
        not one this daemon wrote is logged and kept aside as ``<file>.bad`` (the next write
        replaces it): whatever it holds, the daemon starts."""
        with contextlib.suppress(OSError):  # (what cannot be listed is said below)
            for stale in self.path.parent.glob(f".{self.path.name}.*"):
                stale.unlink(missing_ok=True)  # a write a kill interrupted
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            log.info("--ingest.state-file %s: none yet, starting with no ranks", self.path)
            return
        except OSError as exc:
            log.warning("--ingest.state-file %s cannot be read (%s): starting with no ranks",
                        self.path, exc)
            return
        try:
            if size > self.limit:
                raise ValueError(f"{size} bytes, more than {self.limit} for "
                                 f"--ingest.max-series {self.store.max_series}")
            doc = json.loads(self.path.read_bytes(), parse_constant=_no_constant)
            kept, refused = self.store.restore(doc)
        except Exception as exc:  # nothing in the file may stop the daemon
            log.warning("--ingest.state-file %s is not a state this version wrote (%s): "
                        "starting with no ranks, the file kept as %s.bad", self.path,
                        str(exc)[:200] or type(exc).__name__, self.path.name)
            with contextlib.suppress(OSError):
                os.replace(self.path, self.path.with_name(self.path.name + ".bad"))
            return
        log.info("--ingest.state-file %s: %d rank(s) taken back%s", self.path, kept,
                 f", {refused} unreadable row(s) left out" if refused else "")

    @property
    def limit(self) -> int:
        """The largest file taken (bytes): ROW_BYTES for each live and departed rank."""
        return ROW_BYTES * 2 * self.store.max_series

    def save(self) -> None:
        """Write the ranks now; raises OSError where the file cannot be written."""
        with self._lock:
            marks = (self.store.version, self.store.ends)
            doc = self.store.saved()
            directory = self.path.parent
            data = json.dumps(doc, separators=(",", ":")).encode()  # (the C encoder)
            fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", dir=directory)
            try:
                with os.fdopen(fd, "wb") as out:
                    out.write(data)
                    out.flush()
                    os.fsync(out.fileno())
                os.replace(tmp, self.path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
            self._saved, self._saved_at = marks, self._clock()

    def cycle(self) -> None:
        """Called each sampler cycle: write where a rank ended since the last write, or where
        anything changed and SAVE_SECONDS passed; a failure is a warning (once until a write
        succeeds again), never the sampler's."""
        ends, version = self.store.ends, self.store.version
        if self._saved is not None and (
                ends == self._saved[1] and
                (version == self._saved[0] or self._clock() - self._saved_at < SAVE_SECONDS)):
            return
        try:
            self.save()
        except Exception as exc:  # the sampler's cycle must go on
            if not self._failing:
                log.warning("cannot write --ingest.state-file %s (%s): a restart would "
                            "forget the ranks that ended", self.path, exc)
            self._failing = True
        else:
            if self._failing:
                log.info("--ingest.state-file %s written again", self.path)
            self._failing = False
