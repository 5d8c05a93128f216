"""Writing multi-GB weight files past the page cache.

Owns: `OutputFile`, a file written at offsets from several threads: the whole 4 KiB pages of each write go
through an O_DIRECT handle (the disk reads them from our buffer), the unaligned head and tail through an
ordinary one; `read_range`, a large read straight into a reused buffer (O_DIRECT where the file allows);
`Scratch`, a thread's reused aligned buffers; `aligned_empty`, buffers a direct write can take as they are.

Why: through the page cache, the kernel spends more CPU per byte than the disk spends time on this virtio
machine -- a 12.6 GB `dd` took 43.4 s, 41.7 s of it system time (290 MB/s); with `oflag=direct` it took 9.3 s,
1.8 s system (1.4 GB/s); reading 10 GB: 0.75 s of system time direct, 12 s through the cache. Fresh
memory costs too (0.42 s of system time per GB faulted in): the buffers a thread decodes into are reused.
A 41 GB export written through the cache also evicts everything else the user had cached. Where O_DIRECT does not exist (macOS, Windows) or a filesystem refuses it (tmpfs before Linux 6.6, some
FUSE mounts: EINVAL at open or at the first write), every write is an ordinary one; the bytes are the same.
No page is written by both handles: a direct write covers whole pages only, which no ordinary write touches.
"""
from __future__ import annotations

import errno
import os
import threading

import numpy as np

ALIGN = 4096                 # file offset, length and memory alignment a direct write needs (a page; >= the sector)
BOUNCE_BYTES = 8 << 20       # an unaligned buffer goes to the disk through a reused aligned copy of this size
DIRECT_READ_MIN = 1 << 20   # reads below this go through the page cache (norms, biases: many, small)
DIRECT = hasattr(os, "O_DIRECT")
HAVE_PREADV = hasattr(os, "preadv")


def aligned_empty(nbytes: int) -> np.ndarray:
    """An uninitialised uint8 buffer of `nbytes` whose first byte sits on an ALIGN boundary."""
    raw = np.empty(nbytes + ALIGN, dtype=np.uint8)
    skip = (-raw.ctypes.data) % ALIGN
    return raw[skip:skip + nbytes]


class Scratch:
    """One thread's reused buffers, by name, each aligned and grown as needed (never shrunk): a tensor's
    bytes read into one, decoded into another, written, and the next tensor reuses both."""

    def __init__(self):
        self._bufs: dict[str, np.ndarray] = {}

    def take(self, name: str, nbytes: int) -> np.ndarray:
        buf = self._bufs.get(name)
        if buf is None or buf.size < nbytes:
            buf = self._bufs[name] = aligned_empty(nbytes)
        return buf[:nbytes]


def open_direct(path: str) -> int:
    """A read-only O_DIRECT handle on `path`, or -1 where there is none (the OS or filesystem cannot)."""
    if not DIRECT:
        return -1
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECT | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return -1


def read_range(fd: int, direct_fd: int, start: int, end: int, scratch: Scratch) -> np.ndarray:
    """Bytes [start, end) of a file as a uint8 view into `scratch`'s "read" buffer (valid until the thread's
    next read): the whole pages around them read with `direct_fd` where there is one and the range is large,
    else an ordinary read; a short read raises EOFError (the file changed)."""
    size = end - start
    if direct_fd >= 0 and size >= DIRECT_READ_MIN:
        first = start - start % ALIGN
        span = end - first + (-(end - first)) % ALIGN
        buf = scratch.take("read", span)
        try:
            got = _read_full(direct_fd, buf, first)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
        else:
            if got < end - first:
                raise EOFError(f"{got} of {end - first} bytes")
            return buf[start - first:end - first]
    buf = scratch.take("read", size)
    if _read_full(fd, buf, start) < size:
        raise EOFError(f"short read at {start}")
    return buf


def _read_full(fd: int, buf: np.ndarray, offset: int) -> int:
    """Read into all of `buf` from `offset`; the bytes read (fewer only at the end of the file)."""
    done = 0
    while done < buf.size:
        if HAVE_PREADV:
            n = os.preadv(fd, [memoryview(buf[done:])], offset + done)
        else:                      # no preadv (older macOS): a read and a copy
            chunk = os.pread(fd, buf.size - done, offset + done)
            n = len(chunk)
            buf[done:done + n] = np.frombuffer(chunk, np.uint8)
        if n <= 0:
            break
        done += n
    return done


class OutputFile:
    """A new file (created or truncated at `path`), written with `pwrite(data, offset)` from any thread."""

    def __init__(self, path: str):
        flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC | getattr(os, "O_BINARY", 0) | getattr(os, "O_CLOEXEC", 0)
        self.fd = os.open(path, flags, 0o666)
        self._direct_fd, self._refused = -1, False
        if DIRECT:
            try:
                self._direct_fd = os.open(path, os.O_WRONLY | os.O_DIRECT | getattr(os, "O_CLOEXEC", 0))
            except OSError:         # the filesystem cannot: every write is an ordinary one
                pass
        self._local = threading.local()

    @property
    def direct(self) -> bool:
        """Whether whole pages still go past the page cache (False once a filesystem refused it)."""
        return self._direct_fd >= 0 and not self._refused

    def pwrite(self, data: np.ndarray, offset: int) -> int:
        """Write the bytes of `data` (any contiguous array) at `offset`; returns how many (all of them)."""
        buf = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        head = min(buf.size, (-offset) % ALIGN)
        end = head + (buf.size - head) // ALIGN * ALIGN
        if not self.direct or end == head:
            return self._pwrite(self.fd, buf, offset)
        self._pwrite(self.fd, buf[:head], offset)
        self._write_pages(buf[head:end], offset + head)
        self._pwrite(self.fd, buf[end:], offset + end)
        return buf.size

    def _write_pages(self, pages: np.ndarray, offset: int) -> None:
        """Whole pages at an aligned offset: straight from `pages` when its memory is aligned, else a chunk at a
        time through this thread's bounce buffer; ordinary writes from the first one the filesystem refuses
        (EINVAL), and from then on."""
        aligned = pages.ctypes.data % ALIGN == 0
        step = pages.size if aligned else BOUNCE_BYTES
        done = 0
        try:
            while done < pages.size:
                chunk = pages[done:done + step]
                self._pwrite(self._direct_fd, chunk if aligned else self._bounced(chunk), offset + done)
                done += chunk.size
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            self._refused = True
            self._pwrite(self.fd, pages[done:], offset + done)

    def _bounced(self, chunk: np.ndarray) -> np.ndarray:
        """`chunk` (at most BOUNCE_BYTES) copied into this thread's aligned bounce buffer."""
        bounce = getattr(self._local, "bounce", None)
        if bounce is None:
            bounce = self._local.bounce = aligned_empty(BOUNCE_BYTES)
        bounce[:chunk.size] = chunk
        return bounce[:chunk.size]

    @staticmethod
    def _pwrite(fd: int, buf: np.ndarray, offset: int) -> int:
        """All of `buf` at `offset` (a write may take part of it: the rest follows)."""
        done = 0
        while done < buf.size:
            n = os.pwrite(fd, memoryview(buf[done:]), offset + done)
            if n <= 0:
                raise OSError(errno.EIO, f"write returned {n}")
            done += n
        return done

    def close(self) -> None:
        for fd in (self._direct_fd, self.fd):
            if fd >= 0:
                os.close(fd)
        self._direct_fd = self.fd = -1

    def __enter__(self) -> OutputFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
