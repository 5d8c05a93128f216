"""File operations that hold on Windows as they do on Linux and macOS.

Owns: `replace_file` and `rename_dir` (a rename that Windows refuses while another process -- an
antivirus scan, the search indexer, an image viewer, a running precast -- holds the file open is
retried with backoff, then raised as `FileBusy`, a PermissionError whose text says so; a folder is
renamed onto an empty folder as POSIX does, which Windows refuses), `process_alive` (a liveness
check that sends nothing: on Windows os.kill(pid, 0) is not a probe, it sends CTRL_C_EVENT or
terminates the process), and the checks a bundle's file names and paths must pass to be unpacked
on any of the three systems: `windows_name_problem` (device names such as CON or nul.txt, characters
Windows refuses, a trailing dot or space), `case_collision` (names that differ only in case: Windows
and macOS keep one file for both) and `long_path_problem` (a path over MAX_PATH where Windows long
paths are off); and for folders written beside their destination (runtime/staging.py):
`exchange_dirs` (two paths swapped in one step: renameat2 RENAME_EXCHANGE on Linux, renamex_np
RENAME_SWAP on macOS; False where the system or file system has none), `hold_path` / `path_held`
(an exclusive lock on the folder or file itself, kept across renames while its writer lives and
released by the kernel when the writer dies, however it dies).

Standard library only (the runtime imports it). WINDOWS is read once; tests set it to simulate Windows.
"""
from __future__ import annotations

import ctypes
import errno
import os
import re
import sys
import time

WINDOWS = os.name == "nt"
RETRY_DELAYS = (0.05, 0.1, 0.2, 0.4, 0.8, 1.6)       # seconds between tries: ~3 s in all
MAX_PATH = 260                                       # Win32's limit, the terminating NUL included
RESERVED = {"CON", "PRN", "AUX", "NUL", *(f"COM{i}" for i in range(1, 10)), *(f"LPT{i}" for i in range(1, 10))}
_BAD_CHARS = re.compile(r'[<>:"|?*\x00-\x1f]')


class FileBusy(PermissionError):
    """Windows refused a rename because another process holds the file (or one inside the folder) open."""

    def __init__(self, path, cause: OSError):
        super().__init__(cause.errno, f"{path} is in use by another process (Windows does not replace or move a "
                                      "file another process holds open); close what has it open and try again",
                         str(path))
        self.cause = cause


def _retrying(op, path, delays):
    """op() again after each delay (RETRY_DELAYS when None) while it raises PermissionError on Windows;
    FileBusy after the last."""
    for delay in (*(RETRY_DELAYS if delays is None else delays), None):
        try:
            return op()
        except PermissionError as e:
            if not WINDOWS or isinstance(e, FileBusy):
                raise
            if delay is None:
                raise FileBusy(path, e) from e
            time.sleep(delay)


def replace_file(src, dst, delays: tuple[float, ...] | None = None) -> None:
    """os.replace(src, dst), retried while Windows says another process holds either open."""
    _retrying(lambda: os.replace(src, dst), dst, delays)


def rename_dir(src, dst, delays: tuple[float, ...] | None = None) -> None:
    """Move folder `src` to `dst`, which must not exist or be an empty folder (as POSIX rename allows;
    on Windows the empty folder is removed first), retried while a file inside is held open."""
    def move():
        if WINDOWS and os.path.isdir(dst) and not os.path.islink(dst) and not os.listdir(dst):
            os.rmdir(dst)
        os.rename(src, dst)
    _retrying(move, src, delays)


def process_alive(pid: int) -> bool:
    """Whether process `pid` is running (True when it exists under another user)."""
    if WINDOWS:
        return _windows_process_alive(pid)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:
        return False
    return True


def _windows_process_alive(pid: int) -> bool:   # Windows only: written against the Win32 docs, not run here
    import ctypes
    kernel32 = ctypes.WinDLL("kernel32", use_last_error=True)
    handle = kernel32.OpenProcess(0x1000, False, pid)          # PROCESS_QUERY_LIMITED_INFORMATION
    if not handle:
        return ctypes.get_last_error() == 5                    # ERROR_ACCESS_DENIED: it exists
    try:
        code = ctypes.c_ulong()
        return bool(kernel32.GetExitCodeProcess(handle, ctypes.byref(code))) and code.value == 259  # STILL_ACTIVE
    finally:
        kernel32.CloseHandle(handle)


_NO_EXCHANGE = {errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EPERM}


def exchange_dirs(a, b) -> bool:
    """Swap paths `a` and `b` (both existing) atomically: True when done; False, with nothing changed,
    where this system or file system cannot (Windows, NFS, old kernels)."""
    if WINDOWS:
        return False
    if sys.platform.startswith("linux"):
        name, call = "renameat2", lambda f, x, y: f(-100, x, -100, y, 2)     # AT_FDCWD, RENAME_EXCHANGE
    elif sys.platform == "darwin":
        name, call = "renamex_np", lambda f, x, y: f(x, y, 2)                # RENAME_SWAP
    else:
        return False
    fn = getattr(ctypes.CDLL(None, use_errno=True), name, None)
    if fn is None:
        return False
    if call(fn, os.fsencode(a), os.fsencode(b)) == 0:
        return True
    err = ctypes.get_errno()
    if err in _NO_EXCHANGE:
        return False
    raise OSError(err, os.strerror(err), os.fspath(a), None, os.fspath(b))


def hold_path(path) -> int | None:
    """Take an exclusive lock on folder or file `path` itself: the descriptor to keep open while it is
    written (the lock follows it through renames; the kernel drops it when the process ends, a kill -9
    included). None where this cannot be locked (Windows, some network file systems)."""
    if WINDOWS:
        return None
    import fcntl
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fd
    except OSError:
        os.close(fd)
        return None


def path_held(path, pid: int) -> bool:
    """Whether a live writer holds folder or file `path` (hold_path); where it cannot be locked, whether
    process `pid` (its writer, from its name) still runs. False for a path that is gone."""
    if WINDOWS:
        return os.path.lexists(path) and process_alive(pid)
    import fcntl
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False                          # taken at once: nobody holds it (released when fd closes)
    except BlockingIOError:
        return True
    except OSError:
        return process_alive(pid)             # no locks here: the writer's liveness instead
    finally:
        os.close(fd)


def windows_name_problem(rel: str) -> str | None:
    """Why a '/'-separated relative path cannot be a file name on Windows, or None."""
    for part in rel.split("/"):
        if _BAD_CHARS.search(part):
            return f"{part!r} holds a character Windows does not allow in file names"
        if part.endswith((".", " ")) and part not in (".", ".."):
            return f"{part!r} ends in a dot or space, which Windows drops"
        if part.split(".")[0].rstrip(" ").upper() in RESERVED:
            return f"{part!r} is a device name on Windows"
    return None


def case_collision(name: str, seen: dict[str, str]) -> str | None:
    """The earlier name (or folder) that `name` or one of its folders differs from only in case, or None;
    records them in `seen` (case-folded -> as first seen)."""
    parts = name.split("/")
    for i in range(1, len(parts) + 1):
        path = "/".join(parts[:i])
        first = seen.setdefault(path.casefold(), path)
        if first != path:
            return first
    return None


def long_paths_enabled() -> bool:
    """Windows: LongPathsEnabled is set (Python's own builds are long-path aware); elsewhere True."""
    if not WINDOWS:
        return True
    try:
        import winreg
        with winreg.OpenKey(winreg.HKEY_LOCAL_MACHINE, r"SYSTEM\CurrentControlSet\Control\FileSystem") as key:
            return winreg.QueryValueEx(key, "LongPathsEnabled")[0] == 1
    except OSError:
        return False


def long_path_problem(paths) -> str | None:
    """On Windows without long paths: the longest of `paths` when it reaches MAX_PATH, said in words."""
    if not WINDOWS or long_paths_enabled():
        return None
    longest = max((os.path.abspath(p) for p in paths), key=len, default="")
    if len(longest) < MAX_PATH:
        return None
    return (f"{longest} would be {len(longest)} characters; Windows allows {MAX_PATH - 1} unless long paths are "
            "enabled (LongPathsEnabled)")
