"""The local side of transfers: a download's file and sha256 fed side by side, and transfers in parallel.

Owns: `Download` (a `.partial` file appended to by the thread that reads the socket -- each block received
straight into one of a few reused buffers -- and hashed by another, so the hash overlaps the transfer;
bytes already in the file are hashed first; a disk error is one UserError line -- `DiskFull` for ENOSPC
or a quota --, not retried, the partial file kept for the next run) and `parallel` (a few transfers at
once; the first error stops the rest). Standard library only.
"""
from __future__ import annotations

import errno
import hashlib
import os
import queue
import threading
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from pathlib import Path

from ..errors import UserError

class DiskFull(UserError):
    """The disk under a download filled (ENOSPC, or a quota): the partial file is kept for the next run."""


_RESTART = object()          # a Download's queued "start the file over" (the registry ignored a Range)


class Download:
    """A download's `.partial` file and its sha256. `fill(reader, n)` receives a block with `reader.readinto`
    into one of BUFFERS reused buffers (no allocation and no copy beyond the kernel's), writes it from the
    reading thread (as a plain GET would) and hands it to a thread of its own that hashes it and gives the
    buffer back: the hash runs beside the transfer on another core, at most BUFFERS blocks behind. The bytes
    already in the file are hashed first. A disk error (ENOSPC) is one line and is not retried; the partial
    file stays for the next run."""
    BUFFERS, BLOCK = 8, 1 << 20

    def __init__(self, path: Path, have: int):
        self.path, self.have = path, have
        self.error: BaseException | None = None

    def __enter__(self) -> "Download":
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | getattr(os, "O_BINARY", 0), 0o644)
        self.hash = hashlib.sha256()
        if self.have:
            with open(self.path, "rb") as f:
                while block := f.read(16 << 20):
                    self.hash.update(block)
        self.free: queue.SimpleQueue = queue.SimpleQueue()
        for _ in range(self.BUFFERS):
            self.free.put(bytearray(self.BLOCK))
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def _run(self) -> None:
        while (item := self.queue.get()) is not None:
            if item is _RESTART:
                self.hash = hashlib.sha256()
                continue
            buf, n = item
            try:
                if self.error is None:
                    self.hash.update(memoryview(buf)[:n])      # releases the GIL: the reader goes on meanwhile
            except BaseException as e:
                self.error = e
            self.free.put(buf)

    def fill(self, reader, want: int) -> int:
        """Up to `want` bytes (at most BLOCK) from `reader` (a file-like object with readinto) into the file
        and the hash: how many (0: the stream ended)."""
        if self.error is not None:
            raise self.error
        buf = self.free.get()           # waits while the hash is BUFFERS blocks behind
        try:
            n = reader.readinto(memoryview(buf)[:min(want, self.BLOCK)])
            if n:
                self._write(memoryview(buf)[:n])
        except BaseException:
            self.free.put(buf)
            raise
        if not n:
            self.free.put(buf)
            return 0
        self.queue.put((buf, n))
        return n

    def _write(self, view: memoryview) -> None:
        try:
            while view:
                view = view[os.write(self.fd, view):]
        except OSError as e:
            cls = DiskFull if e.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)) else UserError
            raise cls(f"{self.path}: {e.strerror or e} while writing the download; the part downloaded is kept "
                      "there and a later run resumes it (free space, or remove the folder, and run again)") from None

    def restart(self) -> None:
        os.ftruncate(self.fd, 0)        # O_APPEND: the next write lands at 0
        self.queue.put(_RESTART)

    def digest(self) -> str:
        """The sha256 of the whole file, once every queued block is hashed (all buffers back)."""
        held = [self.free.get() for _ in range(self.BUFFERS)]
        for buf in held:
            self.free.put(buf)
        if self.error is not None:
            raise self.error
        return "sha256:" + self.hash.hexdigest()

    def __exit__(self, *exc) -> None:
        self.queue.put(None)
        self.thread.join()
        os.close(self.fd)


def parallel(fn, items, workers: int, stop: threading.Event) -> list:
    """fn(item) for every item on `workers` threads, results in order; on the first error `stop` is set
    (transfers in flight check it at their next read), the rest are cancelled, and the error is raised."""
    items = list(items)
    if workers <= 1 or len(items) <= 1:
        return [fn(i) for i in items]
    pool = ThreadPoolExecutor(max_workers=workers)
    futures = [pool.submit(fn, i) for i in items]
    try:
        wait(futures, return_when=FIRST_EXCEPTION)
    except BaseException:       # Ctrl+C or SIGTERM (Terminated) in this thread: the transfers are told to stop
        stop.set()              # and not waited for (a stalled one's read could block for ever; the CLI exits
        pool.shutdown(wait=False, cancel_futures=True)      # without joining it)
        raise
    try:
        failed = next((f for f in futures if f.done() and not f.cancelled() and f.exception() is not None), None)
        if failed is not None:
            stop.set()
            for f in futures:
                f.cancel()
            wait(futures)
            raise failed.exception()
        return [f.result() for f in futures]
    finally:
        pool.shutdown(wait=True)
        stop.clear()
