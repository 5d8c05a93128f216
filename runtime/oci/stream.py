"""The local side of transfers: a download's file and sha256 fed side by side, and transfers in parallel.

Owns: `Download` (a `.partial` file appended to by the thread that reads the socket and hashed by another,
so the hash overlaps the transfer; bytes already in the file are hashed first; a disk error such as
ENOSPC is one UserError line, not retried, the partial file kept for the next run) and
`parallel` (a few transfers at once; the first error stops the rest). Standard library only.
"""
from __future__ import annotations

import hashlib
import queue
import threading
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from pathlib import Path

from ..errors import UserError

_RESTART = object()          # a Download's queued "start the file over" (the registry ignored a Range)

class Download:
    """A download's `.partial` file and its sha256: blocks are written by the thread that reads the socket
    (as a plain GET would) and hashed on a thread of their own (bounded: at most DEPTH blocks wait), so the
    hash runs beside the transfer on another core. The bytes already in the file are hashed first. A disk
    error (ENOSPC) is one line and is not retried; the partial file stays for the next run."""
    DEPTH = 32

    def __init__(self, path: Path, have: int):
        self.path, self.have = path, have
        self.error: BaseException | None = None

    def __enter__(self) -> "Download":
        self.file = open(self.path, "ab", buffering=0)
        self.hash = hashlib.sha256()
        if self.have:
            with open(self.path, "rb") as f:
                while block := f.read(16 << 20):
                    self.hash.update(block)
        self.queue: queue.Queue = queue.Queue(self.DEPTH)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def _run(self) -> None:
        while (block := self.queue.get()) is not None:
            try:
                if block is _RESTART:
                    self.hash = hashlib.sha256()
                else:
                    self.hash.update(block)
            except BaseException as e:
                self.error = e
            finally:
                self.queue.task_done()
        self.queue.task_done()

    def put(self, block) -> None:
        if self.error is not None:
            raise self.error
        try:
            view = memoryview(block)
            while view:
                view = view[self.file.write(view):]
        except OSError as e:
            raise UserError(f"{self.path}: {e.strerror or e} while writing the download; the part downloaded is kept "
                            "there and a later run resumes it (free space, or remove the folder, and run again)") from None
        self.queue.put(block)

    def restart(self) -> None:
        self.file.truncate(0)
        self.file.seek(0)
        self.queue.put(_RESTART)

    def digest(self) -> str:
        self.queue.join()
        if self.error is not None:
            raise self.error
        return "sha256:" + self.hash.hexdigest()

    def __exit__(self, *exc) -> None:
        self.queue.put(None)
        self.thread.join()
        self.file.close()


def parallel(fn, items, workers: int, stop: threading.Event) -> list:
    """fn(item) for every item on `workers` threads, results in order; on the first error `stop` is set
    (transfers in flight check it at their next read), the rest are cancelled, and the error is raised."""
    items = list(items)
    if workers <= 1 or len(items) <= 1:
        return [fn(i) for i in items]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(fn, i) for i in items]
        wait(futures, return_when=FIRST_EXCEPTION)
        failed = next((f for f in futures if f.done() and not f.cancelled() and f.exception() is not None), None)
        if failed is not None:
            stop.set()
            for f in futures:
                f.cancel()
            wait(futures)
            stop.clear()
            raise failed.exception()
        return [f.result() for f in futures]
