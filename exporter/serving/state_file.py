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
(a fresh start), one that cannot be written is an error at start (exit 2), a warning after.
"""

from __future__ import annotations

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
        """Take back the ranks of the file, if there is one; a file that cannot be read is
        logged and left as it is (the next write replaces it)."""
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            log.info("--ingest.state-file %s: none yet, starting with no ranks", self.path)
            return
        except (OSError, UnicodeDecodeError) as exc:
            log.warning("--ingest.state-file %s cannot be read (%s): starting with no ranks",
                        self.path, exc)
            return
        try:
            kept, refused = self.store.restore(json.loads(text))
        except ValueError as exc:  # json.JSONDecodeError is one
            log.warning("--ingest.state-file %s is not a state this version wrote (%s): "
                        "starting with no ranks", self.path, exc)
            return
        log.info("--ingest.state-file %s: %d rank(s) taken back%s", self.path, kept,
                 f", {refused} unreadable row(s) left out" if refused else "")

    def save(self) -> None:
        """Write the ranks now; raises OSError where the file cannot be written."""
        with self._lock:
            marks = (self.store.version, self.store.ends)
            doc = self.store.saved()
            directory = self.path.parent
            fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", dir=directory)
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as out:
                    json.dump(doc, out, separators=(",", ":"))
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
        except OSError as exc:
            if not self._failing:
                log.warning("cannot write --ingest.state-file %s (%s): a restart would "
                            "forget the ranks that ended", self.path, exc)
            self._failing = True
        else:
            if self._failing:
                log.info("--ingest.state-file %s written again", self.path)
            self._failing = False
