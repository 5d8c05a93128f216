"""compiler/direct_io.py: weight files written (and read) past the page cache, the same bytes as ordinary I/O."""
from __future__ import annotations

import ctypes
import mmap
import os
import threading

import numpy as np
import pytest

from precast.compiler import direct_io
from precast.compiler.direct_io import ALIGN, OutputFile, Scratch, aligned_empty, open_direct, read_range

needs_direct = pytest.mark.skipif(not direct_io.DIRECT, reason="no O_DIRECT on this OS")


def _pieces(rng, size: int, count: int) -> list[tuple[int, np.ndarray]]:
    """`count` disjoint (offset, bytes) pieces tiling [0, size): aligned and unaligned offsets, lengths from
    1 byte to several pages, memory aligned or not."""
    cuts = sorted({0, size, *(int(c) for c in rng.integers(1, size, count - 1))} |
                  {ALIGN * int(k) for k in rng.integers(1, size // ALIGN, count // 2)})
    pieces = []
    for a, b in zip(cuts, cuts[1:]):
        data = rng.integers(0, 256, b - a + 1, dtype=np.uint8)
        if rng.random() < 0.5:
            buf = aligned_empty(b - a)
            buf[:] = data[:b - a]
        else:
            buf = data[1:]                  # one byte in: memory off the page boundary
        pieces.append((a, buf))
    return pieces


@pytest.mark.parametrize("direct", [True, False])
def test_output_file_writes_every_piece_from_threads(tmp_path, monkeypatch, direct):
    """Pieces at any offset and length, aligned memory or not, written from 4 threads in shuffled order:
    the file holds exactly their bytes, whether whole pages go past the page cache or not."""
    monkeypatch.setattr(direct_io, "DIRECT", direct and direct_io.DIRECT)
    rng = np.random.default_rng(7)
    size = 3 * (1 << 20) + 12345
    pieces = _pieces(rng, size, 40)
    order = rng.permutation(len(pieces))
    path = tmp_path / "data.bin"
    with OutputFile(str(path)) as out:
        os.ftruncate(out.fd, size)
        assert out.direct == (direct and direct_io.DIRECT)

        def write(ids):
            for i in ids:
                offset, buf = pieces[i]
                assert out.pwrite(buf, offset) == buf.size
        threads = [threading.Thread(target=write, args=(order[k::4],)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    expected = np.concatenate([buf for _, buf in pieces])
    assert np.array_equal(np.fromfile(path, np.uint8), expected)


def _resident_pages(path) -> int:
    """Pages of `path` in the page cache now (mincore over a shared mapping of it)."""
    size = os.path.getsize(path)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    vec = (ctypes.c_ubyte * pages)()
    with open(path, "rb") as f:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, f.fileno(), 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap")
        try:
            if libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore")
        finally:
            libc.munmap(addr, size)
    return sum(v & 1 for v in vec)


@needs_direct
def test_a_large_write_leaves_the_page_cache_alone(tmp_path):
    """32 MiB written through OutputFile: on a filesystem that takes O_DIRECT (this machine's), at most the
    unaligned head and tail pages are cached -- an export does not evict what the user had in memory; the
    same bytes written the ordinary way are all cached (the measurement can see the difference)."""
    data = aligned_empty(32 << 20)
    data[:] = np.random.default_rng(1).integers(0, 256, data.size, dtype=np.uint8)
    direct, plain = tmp_path / "direct.bin", tmp_path / "plain.bin"
    with OutputFile(str(direct)) as out:
        if not out.direct:
            pytest.skip(f"{tmp_path}'s filesystem refuses O_DIRECT")
        out.pwrite(data[5:], 5)
        out.pwrite(data[:5], 0)
    with open(plain, "wb") as f:
        f.write(data)
    assert direct.read_bytes() == plain.read_bytes()
    assert _resident_pages(plain) > 0.9 * data.size / mmap.PAGESIZE
    # (read_bytes above read `direct` back through the cache: drop it, then write again and look)
    os.truncate(direct, 0)
    with OutputFile(str(direct)) as out:
        out.pwrite(data, 0)
    assert _resident_pages(direct) <= 2


@pytest.mark.parametrize("direct", [True, False])
def test_read_range_gives_the_bytes_asked_for(tmp_path, monkeypatch, direct):
    """Ranges read into a reused Scratch buffer, at unaligned starts and ends, small and large (past
    DIRECT_READ_MIN), up to the end of the file: the file's bytes; a range past the end is EOFError."""
    monkeypatch.setattr(direct_io, "DIRECT", direct and direct_io.DIRECT)
    rng = np.random.default_rng(3)
    size = 3 * direct_io.DIRECT_READ_MIN + 777
    content = rng.integers(0, 256, size, dtype=np.uint8)
    path = tmp_path / "src.bin"
    content.tofile(path)
    fd, dfd = os.open(path, os.O_RDONLY), open_direct(str(path))
    assert (dfd >= 0) == (direct and direct_io.DIRECT)
    scratch = Scratch()
    try:
        for start, end in ((0, 10), (1, direct_io.DIRECT_READ_MIN + 3), (ALIGN, 2 * direct_io.DIRECT_READ_MIN),
                           (12345, size), (size - 5, size), (0, size)):
            got = read_range(fd, dfd, start, end, scratch)
            assert np.array_equal(got, content[start:end]), (start, end)
        with pytest.raises(EOFError):
            read_range(fd, dfd, size - direct_io.DIRECT_READ_MIN, size + 1, scratch)
    finally:
        os.close(fd)
        if dfd >= 0:
            os.close(dfd)


@needs_direct
def test_a_refused_direct_write_falls_back_with_the_same_bytes(tmp_path, monkeypatch):
    """A filesystem that refuses a direct write (EINVAL) mid-file: that write and every later one go the
    ordinary way, the bytes are all there. The refusal is a real one: with ALIGN set to 256 bytes, a direct
    write at an offset of 256 mod 512 is refused by a disk of 512-byte sectors (this machine's ext4)."""
    monkeypatch.setattr(direct_io, "ALIGN", 256)
    rng = np.random.default_rng(11)
    size = 64 * 1024
    content = rng.integers(0, 256, size, dtype=np.uint8)
    path = tmp_path / "data.bin"
    with OutputFile(str(path)) as out:
        if not out.direct:
            pytest.skip(f"{tmp_path}'s filesystem refuses O_DIRECT at open")
        os.ftruncate(out.fd, size)
        cuts = [0, 300, 8192 + 100, 20000, size]     # whole 256-byte "pages" from offset 512 and 256: refused
        for a, b in zip(cuts, cuts[1:]):
            out.pwrite(content[a:b], a)
        if out.direct:
            pytest.skip(f"{tmp_path}'s filesystem takes direct writes at 256-byte offsets")
    assert np.array_equal(np.fromfile(path, np.uint8), content)
