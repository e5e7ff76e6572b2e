"""The LoRA adapters one worker serves, by name: its ``--lora-modules``, loaded at start, and the adapters an operator
puts in its ``--lora-dir`` while it runs.

``--lora-dir DIR`` is vLLM's filesystem LoRA resolver made to fit a cluster. Each subdirectory of DIR whose name is
an adapter name (``splitserve.common.lora_names``) and which holds a PEFT LoRA checkpoint is served under that name.
A thread looks at DIR every ``scan_seconds``: an adapter that appears is read and checked in full (off the engine's
thread, on the CPU), then served; the worker's heartbeats tell the router its names, so requests reach it within a
heartbeat or two. An adapter whose directory goes is served no more (requests already running finish). Nothing
reaches a worker's disk over the network: a request names an adapter, and only the names found in DIR are served.

A name means one adapter for a worker's life, since the prefix cache finds KV blocks by it (``lora_root_hash``):
an adapter whose files change after it was served is served no more by this worker, with a warning, until it
restarts. To add one, copy it next to DIR's adapters under a name starting with a dot (skipped), then rename it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path

from splitserve.common.errors import InvalidRequest, NotFound
from splitserve.common.lora_names import MAX_LORA_MODULES, check_lora_name, is_lora_name
from splitserve.engine.lora import LoRARequest

logger = logging.getLogger(__name__)

SCAN_SECONDS = 2.0  # how often a worker looks at its --lora-dir


def _stamp(directory: Path) -> tuple:
    """What a change to an adapter's files changes: each file's name, size and modification time (() when the
    directory cannot be read)."""
    try:
        return tuple(sorted((path.name, (info := path.stat()).st_size, info.st_mtime_ns)
                            for path in directory.iterdir() if path.is_file()))
    except OSError:
        return ()


class LoRACatalog:
    """The names a worker serves and the LoRARequest each runs with.

    Args:
        modules: ``--lora-modules``, {name: directory}; ``load`` has loaded each already.
        directory: ``--lora-dir`` (None: none).
        check: reads and checks an adapter in full (``LoRARequest -> None``), raising InvalidRequest with the
            loader's sentence; called on the catalog's thread, never the engine's.
        scan_seconds: how often ``directory`` is looked at.
    """

    def __init__(self, modules: dict[str, str], directory: str | None = None,
                 check: Callable | None = None, scan_seconds: float = SCAN_SECONDS) -> None:
        self._lock = threading.Lock()
        self._requests = {name: LoRARequest(name, index + 1, str(path)) for index, (name, path) in enumerate(modules.items())}
        self._fixed = tuple(self._requests)
        self._next_id = len(self._requests) + 1
        self._directory = Path(directory) if directory else None
        self._check = check
        self._scan_seconds = scan_seconds
        # Names found in the directory: the stamp each was first served at (kept while the worker lives), the stamp
        # each failed its check at (checked again once its files change), and those that changed after they were
        # served (never served again by this worker). A name keeps its id while the worker lives.
        self._served_stamps: dict[str, tuple] = {}
        self._refused_stamps: dict[str, tuple] = {}
        self._retired: set[str] = set()
        self._ids: dict[str, int] = {}
        self._warned_full = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def fixed_requests(self) -> list[LoRARequest]:
        """The LoRARequests of ``--lora-modules``, in their order."""
        return [self._requests[name] for name in self._fixed]

    def names(self) -> list[str]:
        """The adapters served now, by name (what the worker registers and heartbeats)."""
        with self._lock:
            return list(self._requests)

    def request(self, name: str) -> LoRARequest | None:
        """The LoRARequest a request naming adapter ``name`` runs with; None for "" (the base model).

        Raises:
            InvalidRequest: not a valid adapter name.
            NotFound: this worker serves no adapter of that name.
        """
        if not name:
            return None
        check_lora_name(name)
        with self._lock:
            request = self._requests.get(name)
            if request is None:
                served = ", ".join(self._requests) or "none"
        if request is None:
            raise NotFound(f"This worker serves no LoRA adapter {name!r} (it serves {served}).")
        return request

    # ---- the directory ---------------------------------------------------------

    def start(self) -> LoRACatalog:
        """Scan the directory once now (an adapter there at start is served from the first registration), then every
        ``scan_seconds`` on a thread of its own."""
        if self._directory is None:
            return self
        self.scan()
        self._thread = threading.Thread(target=self._run, name="lora-dir", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.wait(self._scan_seconds):
            try:
                self.scan()
            except Exception:  # a scan that breaks must not end the next ones
                logger.exception("Scanning --lora-dir failed")

    def scan(self) -> list[str]:
        """Look at the directory once: serve the adapters that appeared and pass their check, stop serving those that
        went or changed. Returns the names served after it."""
        if self._directory is None:
            return self.names()
        found = self._listing()
        with self._lock:
            gone = [name for name in self._requests if name not in self._fixed and name not in found]
            for name in gone:
                del self._requests[name]
        for name in gone:
            logger.info("LoRA adapter %s left --lora-dir: no longer served", name)
        for name, path in found.items():
            if name in self._retired:
                continue
            stamp = _stamp(path)
            served = self._served_stamps.get(name)
            if served is not None and stamp != served:
                self._retire(name)
            elif served is not None:  # served, or back as it was
                self._serve(name, path)
            elif self._refused_stamps.get(name) != stamp:
                self._admit(name, path, stamp)
        return self.names()

    def _retire(self, name: str) -> None:
        self._retired.add(name)
        with self._lock:
            self._requests.pop(name, None)
        logger.warning("LoRA adapter %s changed on disk after this worker served it: no longer served here (a name "
                       "means one adapter while the worker lives; restart it to serve the new files, or add them "
                       "under another name)", name)

    def _listing(self) -> dict[str, Path]:
        """The directory's adapter directories by name: valid names only (so hidden ones are skipped), at most what
        a worker may serve beside its --lora-modules, in name order."""
        try:
            entries = sorted(entry for entry in self._directory.iterdir()
                             if is_lora_name(entry.name) and entry.is_dir() and entry.name not in self._fixed)
        except OSError as error:
            logger.warning("Cannot read --lora-dir %s: %s", self._directory, error.strerror or type(error).__name__)
            return {}
        room = MAX_LORA_MODULES - len(self._fixed)
        if len(entries) > room and not self._warned_full:
            self._warned_full = True
            logger.warning("--lora-dir holds %d adapters; a worker serves at most %d in all, so the first %d by name are "
                           "served", len(entries), MAX_LORA_MODULES, room)
        return {entry.name: entry for entry in entries[:room]}

    def _admit(self, name: str, path: Path, stamp: tuple) -> None:
        """Check an adapter found (or changed since it failed its check) and serve it if it passes."""
        try:
            if not stamp:
                raise InvalidRequest(f"LoRA adapter {name!r}: its directory cannot be read.")
            if self._check is not None:
                self._check(self._request(name, path))
        except InvalidRequest as error:
            self._refused_stamps[name] = stamp
            logger.warning("Not serving LoRA adapter %s from --lora-dir: %s", name, error)
            return
        if _stamp(path) != stamp:  # still being written: checked again at the next scan
            return
        self._refused_stamps.pop(name, None)
        self._served_stamps[name] = stamp
        self._serve(name, path)
        logger.info("Serving LoRA adapter %s from --lora-dir", name)

    def _serve(self, name: str, path: Path) -> None:
        with self._lock:
            self._requests[name] = self._request(name, path)

    def _request(self, name: str, path: Path) -> LoRARequest:
        if name not in self._ids:
            self._ids[name] = self._next_id
            self._next_id += 1
        return LoRARequest(name, self._ids[name], str(path))
