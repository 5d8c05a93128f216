"""Progress on stderr for every step longer than a second: a bar for counted work, a heartbeat
for opaque calls.

Owns: `bar(total, desc, unit)` (bytes written, denoising steps, ...) and `heartbeat(what)` (a
context manager around a call that reports nothing itself: OpenVINO's compile_model, ONNX
Runtime's optimisation, a TensorRT-RTX build, the sha256 of a big file), and the rule for both:
on a terminal (stderr a TTY, tqdm installed) a tqdm bar or an elapsed-time spinner that appears
after a second; otherwise plain lines, `export: 1.2/3.4 GB (35%), 20 s` or
`compile unet for openvino: 20 s...`, one every PRECAST_PROGRESS_INTERVAL seconds (default 10)
and, after those, one at the end; none at all for a step that ends before the first (a CI log
gets no noise from short steps; a terminal shows a bar once a step has taken a second). PRECAST_PROGRESS=off (or 0) shows nothing. Progress only ever
goes to stderr: stdout stays for results (`--json`). Runtime module: needs no compiler, and
tqdm only when it is installed.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from contextlib import contextmanager

DEFAULT_INTERVAL = 10.0     # seconds between plain lines
QUIET_BEFORE = 1.0          # on a terminal, a step that ends sooner shows nothing


OFF, ON = ("off", "0", "false", "no"), ("", "on", "1", "true", "yes", "plain")
_warned: set[str] = set()


def _warn_once(name: str, value: str, expected: str) -> None:
    if name not in _warned:
        _warned.add(name)
        _emit(f"warning: {name}={value!r} is not {expected}; ignored")


def interval() -> float:
    text = os.environ.get("PRECAST_PROGRESS_INTERVAL", "")
    if not text:
        return DEFAULT_INTERVAL
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        _warn_once("PRECAST_PROGRESS_INTERVAL", text, f"a positive number of seconds (default {DEFAULT_INTERVAL:g})")
        return DEFAULT_INTERVAL
    return value


def shown() -> bool:
    """False when the user turned progress off (PRECAST_PROGRESS=off / 0 / false / no)."""
    value = os.environ.get("PRECAST_PROGRESS", "").strip().lower()
    if value not in OFF + ON:
        _warn_once("PRECAST_PROGRESS", value, "off or plain (or on)")
    return value not in OFF


def _tty() -> bool:
    if os.environ.get("PRECAST_PROGRESS", "").strip().lower() == "plain":
        return False
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


def _tqdm():
    try:
        from tqdm import tqdm
        return tqdm
    except ImportError:   # optional for the runtime: plain lines instead
        return None


def _seconds(t: float) -> str:
    return f"{t:.0f} s" if t >= 10 else f"{t:.1f} s"


def _emit(line: str) -> None:
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError):     # stderr closed: progress is not worth failing for
        pass


def _amount(n: float, total: float | None, unit: str) -> str:
    if unit == "B":
        scale, name = next(((s, u) for s, u in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")) if (total or n) >= s), (1, "B"))
        digits = 0 if scale == 1 else 1
        return f"{n / scale:.{digits}f}/{total / scale:.{digits}f} {name}" if total else f"{n / scale:.{digits}f} {name}"
    return f"{n:g}/{total:g} {unit}" if total else f"{n:g} {unit}"


class _Ticker:
    """A daemon thread that calls `tick(elapsed)` every `every` seconds until stopped."""

    def __init__(self, every: float, tick):
        self.stop_event = threading.Event()
        self.t0 = time.monotonic()
        self.ticks = 0
        self.thread = threading.Thread(target=self._run, args=(every, tick), daemon=True, name="precast-progress")
        self.thread.start()

    def _run(self, every, tick):
        while not self.stop_event.wait(every):
            self.ticks += 1
            tick(time.monotonic() - self.t0)

    def stop(self) -> float:
        self.stop_event.set()
        self.thread.join()
        return time.monotonic() - self.t0


class Bar:
    """Counted progress: `update(n)`, `close()`; also a context manager."""

    def __init__(self, total: float | None, desc: str, unit: str = "B", enabled: bool = True):
        self.total, self.desc, self.unit, self.n = total, desc, unit, 0
        self._lock = threading.Lock()     # export's writer threads update it
        self._tqdm = self._ticker = None
        self._closed = False
        if not (enabled and shown()):
            return
        tqdm = _tqdm() if _tty() else None
        if tqdm is not None:
            self._tqdm = tqdm(total=total, desc=desc, unit=unit, unit_scale=unit == "B", leave=False,
                              delay=QUIET_BEFORE, file=sys.stderr)
        else:
            self._ticker = _Ticker(interval(), self._line)

    def _line(self, elapsed: float, end: str = "") -> None:
        pct = f" ({100 * self.n / self.total:.0f}%)" if self.total else ""
        _emit(f"{self.desc}: {_amount(self.n, self.total, self.unit)}{pct}, {_seconds(elapsed)}{end}")

    def update(self, n: float = 1) -> None:
        with self._lock:
            self.n += n
            if self._tqdm is not None:
                self._tqdm.update(n)

    def close(self, ok: bool = True) -> None:
        if self._closed:
            return
        self._closed = True
        if self._tqdm is not None:
            self._tqdm.close()
        if self._ticker is not None:
            elapsed = self._ticker.stop()
            if ok and self._ticker.ticks:
                self._line(elapsed, " (done)")

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *_):
        self.close(ok=exc_type is None)


def bar(total: float | None, desc: str, unit: str = "B", enabled: bool = True) -> Bar:
    """Progress over `total` units (bytes: unit="B", shown in kB/MB/GB; or e.g. "step")."""
    return Bar(total, desc, unit, enabled)


class Beat:
    """What a heartbeat shows; `note` (e.g. a build phase) is added to its lines while set."""

    def __init__(self, what: str):
        self.what = what
        self.note = ""

    def text(self, elapsed: float) -> str:
        return f"{self.what}{f' ({self.note})' if self.note else ''}: {_seconds(elapsed)}"


@contextmanager
def heartbeat(what: str, enabled: bool = True):
    """Around an opaque call: on a terminal an elapsed-time spinner after a second; otherwise
    `what: 20 s...` every interval and then `what: done in 23 s` at the end (nothing for a call
    shorter than the interval). Yields a `Beat` whose `note` (e.g. a TensorRT-RTX build phase)
    the caller may set; the spinner and the lines show it."""
    beat = Beat(what)
    if not (enabled and shown()):
        yield beat
        return
    tty = _tty()
    tqdm = _tqdm() if tty else None
    if tqdm is not None:
        frames, state = "|/-\\", {}

        def spin(elapsed):      # the spinner appears after a second (created then: tqdm clears it on close)
            if elapsed >= QUIET_BEFORE:
                text = f"{beat.text(elapsed)} {frames[int(elapsed * 4) % 4]}"
                if "bar" not in state:
                    state["bar"] = tqdm(total=None, desc=text, bar_format="{desc}", leave=False, file=sys.stderr)
                state["bar"].set_description_str(text, refresh=True)
        ticker = _Ticker(0.25, spin)
        try:
            yield beat
        finally:
            ticker.stop()
            if "bar" in state:
                state["bar"].close()
        return
    ticker = _Ticker(interval(), lambda elapsed: _emit(beat.text(elapsed) + "..."))
    ok = False
    try:
        yield beat
        ok = True
    finally:
        elapsed = ticker.stop()
        if ok and ticker.ticks:
            _emit(f"{beat.what}: done in {_seconds(elapsed)}")
