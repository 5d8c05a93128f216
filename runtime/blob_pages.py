"""An OpenVINO blob's memory-mapped pages given back to the system while and after it is imported, and between
uses (the plugin copies most of what it reads into its own layouts; what it reads in place comes back from the
page cache).

Owns: `import_blob` (core.import_model with the pages dropped every RELEASE_EVERY s while it runs, and once
after) and `release_pages` (madvise DONTNEED on the map, never over a page the plugin wrote, as
/proc/self/smaps says). Used by runtime/sessions.py's OpenVinoSession. Standard library and numpy.
"""
from __future__ import annotations

import mmap
import re
import threading
from pathlib import Path

import numpy as np


RELEASE_EVERY = 0.2     # s: how often the pages of a blob being imported are dropped


def import_blob(core, ov, blob: np.memmap, device: str, config: dict):
    """core.import_model over the memory-mapped blob, its pages dropped (release_pages) every RELEASE_EVERY s
    while the import runs -- import_model releases the GIL -- and once after. The plugin copies what it reads
    into its own layouts, so without this the import's peak holds the whole blob beside those copies; with it,
    only the pages read since the last drop (a page read again comes back from the page cache: same bytes).
    The drops stop for good at the first written page found in the map (release_pages says)."""
    done = threading.Event()

    def drop() -> None:
        while not done.wait(RELEASE_EVERY) and release_pages(blob):
            pass
    helper = threading.Thread(target=drop, name="precast-release-pages", daemon=True)
    helper.start()
    try:
        return core.import_model(ov.Tensor(blob, shared_memory=True), device, config)
    finally:
        done.set()
        helper.join()
        release_pages(blob)


def release_pages(blob: np.memmap, clean_parts: bool = False) -> bool:
    """Drop an imported blob's pages from this process (madvise DONTNEED). import_model reads the whole blob and
    copies most weights into the plugin's own layouts, so those pages are a second copy in RSS (SD 1.5's text
    encoder 0.89 -> 0.43 GiB; its UNet while denoising 8.84 -> 6.66 GiB, same step time: benchmarks/memory.py);
    what the compiled model still reads in place (the Winograd-transformed constants) comes back from the page
    cache on first use. The copy-on-write map may hold pages the plugin wrote (it does, once it has run):
    DONTNEED would discard those, so /proc/self/smaps is read first -- without `clean_parts` nothing is dropped
    when any page is written (the import running beside this: it could write between the check and the drop);
    with it (no call of this model running), each mapping of the range with no written page is dropped and the
    others kept. A written page is one copied on write: smaps' `Anonymous`, not `Private_Dirty`, which also
    counts the page cache's own dirty pages of a blob written moments ago (a `precast build` just before: 0.9 of
    a 4.1 GiB UNet blob; DONTNEED only unmaps those, the page cache keeps them) -- read as written, they kept the
    whole blob resident (SD 1.5 generate 8.48 instead of ~5.2 GiB). False when nothing was dropped."""
    base, size = blob.ctypes.data, blob.nbytes
    try:
        smaps = Path("/proc/self/smaps").read_text()
    except OSError:     # not Linux: the pages stay
        return False
    if blob._mmap is None:
        return False
    parts = []          # (start, end, kB copied on write) of each mapping over the blob
    for m in re.finditer(r"^([0-9a-f]+)-([0-9a-f]+) [^\n]*\n((?:[A-Z][\w]*:[^\n]*\n)+)", smaps, re.MULTILINE):
        lo, hi = max(int(m.group(1), 16), base), min(int(m.group(2), 16), base + size)
        if lo < hi:
            parts.append((lo, hi, sum(int(k) for k in re.findall(r"^Anonymous:\s+(\d+)", m.group(3), re.MULTILINE))))
    if not clean_parts:
        if not parts or any(written for *_, written in parts):
            return False
        blob._mmap.madvise(mmap.MADV_DONTNEED)
        return True
    clean = [(lo, hi) for lo, hi, written in parts if not written]
    for lo, hi in clean:
        blob._mmap.madvise(mmap.MADV_DONTNEED, lo - base, hi - lo)
    return bool(clean)
