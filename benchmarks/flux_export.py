"""Benchmark: full-size Flux.1-dev transformer and T5-XXL encoder exports (the Flux issue's floors).

What it measures, in one run (each part can be chosen with --parts):

1. flux-bf16: the full-size Flux.1-dev transformer (11.9 B parameters, BFL key layout, deterministic
   random weights) written as one bare bf16 .safetensors file (23.8 GB), then
   - the physical limit: a plain copy of the same bytes in a fresh process (read the source with
     readinto, write a file of the export's output size with write(), fsync), run once before and
     once after the export (the disk of a VM drifts; the mean of the two is the limit, both recorded);
   - `precast export FILE --component transformer --dtype bf16` in a fresh process: wall time, the
     time until its output is on disk (the process's wall time + fsync of its two files: the copy
     pays its fsync too), peak RSS (the process's own VmHWM at exit, and the sampled RSS of its
     process tree), and where its time goes (phase timers wrapped around precast's functions in the
     child, precast's code unchanged). The output is checked (sizes, onnx.load without external
     data, every external initializer in bounds and named as a source tensor, three tensors'
     bytes compared with the source) and deleted.
   Page cache: cold for every timed step (sync, then `echo 3 > /proc/sys/vm/drop_caches` as root,
   plus posix_fadvise(DONTNEED) on the source), so the copy and the export both read from the disk.
2. flux-fp8 / flux-fp8-scaled: the same model with fp8 e4m3fn Linear weights (plain, and ComfyUI's
   scaled fp8 with a scale_weight per layer) exported to bf16: the copy reads the 11.9 GB source and
   writes the 23.8 GB output size.
3. t5: the full-size T5-XXL encoder (4.76 B parameters, bf16 file in HF names, as comfyanonymous'
   t5xxl file) exported as `text_encoder_2` (a T5 file alone is refused by design, so a tiny Flux
   transformer file carries it: `precast export tiny.safetensors --text-encoder t5.safetensors
   --component text_encoder_2`).
4. peer: torch.onnx.export of the same Flux model (diffusers FluxTransformer2DModel, full config) in
   a child with a memory cap (default: a watchdog SIGKILLs it when its anonymous RSS, sampled every
   50 ms, passes --peer-cap-gib or the machine's available memory drops below 1.5 GiB, and its
   oom_score_adj is 1000 so the kernel would take it first; --peer-cap-mode rlimit-data adds a hard
   RLIMIT_DATA, which also counts safetensors' private file map, so load_file of a 23.8 GB file fails
   at mmap: a failure of the cap, not of the machine), for up to three ways of getting the weights in:
   `defaults` (the model built as diffusers builds it, fp32, then the weights loaded),
   `from_single_file` (diffusers' documented single-file loader, torch_dtype=bfloat16, local config),
   `mmap` (the leanest torch can do: built on the meta device, bf16 parameters assigned as zero-copy
   views of a read-only map of the file). Each records its phases, how it ended (Python error, killed),
   where (the phase and the frames), its peak RSS and the time until it ended. Before the real
   export, the exporters as installed are tried on a 1+1-block, 32-wide instance of the class
   (the dynamo one needs onnxscript; the TorchScript one lacks aten::rms_norm): the real export
   runs the TorchScript exporter with a symbolic for rms_norm registered, as a user would have to.
6. fp8 decode probe and what-if (with the fp8 parts): the ml_dtypes casts precast runs per fp8
   tensor vs a 65536-entry table over byte pairs, on one single_blocks.linear1 weight, bit-equal
   checked; then (unless --no-fp8-what-if) the same export again in a child where this script has
   patched that table into precast's cast / scaled read / fp8 NaN check (precast's files unchanged),
   output checked against the source on 15+ tensors: what the change would buy, measured.
5. A table (with the machine, benchmarks/machine.py) and a small JSON file in benchmarks/results/.

Floors (the issue): peak RSS <= 1.5 GB (1.5e9 bytes); time <= 2x the plain copy of the same bytes.

Every file lives in one work folder (default benchmarks/results/work/flux_export), deleted at the
end, also on failure or interrupt. Disk needed at once: ~48 GB (source + output).

Usage: .venv/bin/python benchmarks/flux_export.py [--parts flux-bf16,peer,flux-fp8,flux-fp8-scaled,t5]
       [--peer-variants defaults,from_single_file,mmap] [--peer-cap-gib 18] [--work DIR] [--json OUT]
       [--small]   (--small: 1+1-block Flux and 2-layer T5, to try the script in a minute)
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from machine import describe  # noqa: E402  (benchmarks/machine.py, beside this script)

GB = 1e9
RSS_FLOOR = 1.5e9                 # peak RSS at most 1.5 GB
TIME_FLOOR = 2.0                  # at most 2x the plain copy of the same bytes
ALL_PARTS = ("flux-bf16", "peer", "flux-fp8", "flux-fp8-scaled", "t5")
PEER_VARIANTS = ("defaults", "from_single_file", "mmap")
MARKER = ".flux_export_work"      # a work folder this script made (and may delete)
PEER_CLASS = "FluxTransformer2DModel"   # named in run_peer's progress line (benchmarks/sd3_export.py sets its own)
DISK_MARGIN = 4 * GB
COPY_CHUNK = 8 << 20

# diffusers' FluxTransformer2DModel config of FLUX.1-dev (transformer/config.json)
FLUX_DEV_DIFFUSERS = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                          num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768,
                          guidance_embeds=True, axes_dims_rope=[16, 56, 56])


# ---- files, page cache --------------------------------------------------------------------
def free_bytes(path: Path) -> int:
    path = Path(path)
    while not path.exists():       # the work folder (and its parent) may be gone at the end
        path = path.parent
    return shutil.disk_usage(path).free


def need_disk(work: Path, need: float, what: str) -> None:
    free = free_bytes(work)
    if free < need + DISK_MARGIN:
        raise RuntimeError(f"{what}: needs {need / GB:.1f} GB (+{DISK_MARGIN / GB:.0f} GB margin) on {work}, "
                           f"{free / GB:.1f} GB free")


def cold_cache(*files: Path) -> str:
    """Write back dirty pages, then drop the page cache: every timed step reads from the disk."""
    os.sync()
    for f in files:
        if f.exists():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError:
        return "fadvise_dontneed"


def meminfo() -> dict[str, int]:
    out = {}
    for line in open("/proc/meminfo"):
        k, v = line.split(":", 1)
        out[k] = int(v.split()[0]) * 1024
    return out


def fsync_files(*paths: Path) -> float:
    t0 = time.perf_counter()
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return time.perf_counter() - t0


# ---- a sampled child process --------------------------------------------------------------
class Sampler(threading.Thread):
    """Every `interval` s: RSS of the child's process tree, its anonymous RSS, the machine's
    available memory and dirty + writeback pages. With `anon_limit` / `min_available` it is also
    a watchdog that kills the child's process group before the machine runs out of memory."""

    def __init__(self, proc: subprocess.Popen, interval: float = 0.2, anon_limit: int | None = None,
                 min_available: int | None = None):
        super().__init__(daemon=True)
        self.proc, self.interval = proc, interval
        self.anon_limit, self.min_available = anon_limit, min_available
        self.peak_rss = self.peak_anon = self.peak_dirty = 0
        self.min_avail = None
        self.timeline: list[tuple[float, float, float]] = []     # (s, tree RSS GB, dirty+writeback GB)
        self.killed: str | None = None
        self.stop = threading.Event()

    @staticmethod
    def _anon(pid: int) -> int:
        try:
            with open(f"/proc/{pid}/status") as f:
                m = re.search(r"RssAnon:\s+(\d+) kB", f.read())
            return int(m.group(1)) * 1024 if m else 0
        except OSError:
            return 0

    def run(self) -> None:
        import psutil
        t0 = time.perf_counter()
        try:
            root = psutil.Process(self.proc.pid)
        except psutil.NoSuchProcess:
            return
        last = -1.0
        while not self.stop.is_set() and self.proc.poll() is None:
            try:
                procs = [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                break
            rss = anon = 0
            seen: dict[int, tuple] = {}
            for p in procs:
                try:
                    mem, a = p.memory_info(), self._anon(p.pid)
                    seen[p.pid] = (mem.vms, mem.rss, a)
                    if seen.get(p.ppid()) == seen[p.pid]:
                        continue    # a vfork child before its exec: its parent's memory, not more of it
                    rss += mem.rss
                    anon += a
                except psutil.NoSuchProcess:
                    pass
            mi = meminfo()
            dirty = mi.get("Dirty", 0) + mi.get("Writeback", 0)
            avail = mi.get("MemAvailable", 0)
            self.peak_rss, self.peak_anon = max(self.peak_rss, rss), max(self.peak_anon, anon)
            self.peak_dirty = max(self.peak_dirty, dirty)
            self.min_avail = avail if self.min_avail is None else min(self.min_avail, avail)
            now = time.perf_counter() - t0
            if now - last >= 2.0:
                self.timeline.append((round(now, 1), round(rss / GB, 3), round(dirty / GB, 2)))
                last = now
            reason = None
            if self.anon_limit is not None and anon > self.anon_limit:
                reason = f"watchdog: anonymous RSS {anon / GB:.2f} GB > {self.anon_limit / GB:.2f} GB"
            elif self.min_available is not None and avail < self.min_available:
                reason = f"watchdog: machine MemAvailable {avail / GB:.2f} GB < {self.min_available / GB:.2f} GB"
            if reason:
                self.killed = reason
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                break
            self.stop.wait(self.interval)


RUNNING: list[subprocess.Popen] = []    # children to kill if this script is interrupted


def run_child(cmd: list[str], log: Path, timeout: float, preexec=None, env: dict | None = None, **watch) -> dict:
    """Run `cmd` in its own process group (output to `log`); wall time, rc, sampled peaks."""
    load_before, avail_before = os.getloadavg()[0], meminfo()["MemAvailable"]
    t0 = time.perf_counter()
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
                                preexec_fn=preexec, env=env)
        RUNNING.append(proc)
        sampler = Sampler(proc, **watch)
        sampler.start()
        timed_out = False
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(proc.pid, signal.SIGKILL)
            rc = proc.wait()
        finally:
            RUNNING.remove(proc)
        wall = time.perf_counter() - t0
        sampler.stop.set()
        sampler.join()
    return {"rc": rc, "wall_s": round(wall, 2), "timed_out": timed_out,
            "sampled_peak_rss_gb": round(sampler.peak_rss / GB, 3),
            "sampled_peak_anon_gb": round(sampler.peak_anon / GB, 3),
            "peak_dirty_writeback_gb": round(sampler.peak_dirty / GB, 2),
            "min_mem_available_gb": None if sampler.min_avail is None else round(sampler.min_avail / GB, 2),
            "watchdog_kill": sampler.killed, "rss_timeline": sampler.timeline, "log": str(log),
            "loadavg_1min_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)],
            "mem_available_before_gb": round(avail_before / GB, 2)}


def tail(log: str | Path, n: int = 25) -> str:
    return "\n".join(Path(log).read_text(errors="replace").splitlines()[-n:])


# ---- the physical limit: a plain copy -----------------------------------------------------
COPY_CHILD = r"""
import json, os, sys, time
src, dst, out_size, chunk = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
src_size = os.path.getsize(src)
buf = bytearray(chunk); view = memoryview(buf)
t_read = t_write = 0.0; done_read = done_write = 0
t0 = time.perf_counter()
with open(src, "rb", buffering=0) as fi, open(dst, "wb", buffering=0) as fo:
    while True:
        a = time.perf_counter(); n = fi.readinto(buf); b = time.perf_counter(); t_read += b - a
        if not n:
            break
        done_read += n
        target = out_size if done_read == src_size else (done_read * out_size) // src_size
        while done_write < target:          # the output may be wider than the source (fp8 -> bf16)
            k = min(n, target - done_write)
            done_write += fo.write(view[:k])
        t_write += time.perf_counter() - b
    loop = time.perf_counter() - t0
    a = time.perf_counter(); os.fsync(fo.fileno()); fsync = time.perf_counter() - a
print(json.dumps({"read_bytes": done_read, "written_bytes": done_write, "loop_s": round(loop, 2),
                  "read_s": round(t_read, 2), "write_s": round(t_write, 2), "fsync_s": round(fsync, 2),
                  "total_s": round(time.perf_counter() - t0, 2)}))
"""


# The disk's own limit: the same copy with both files opened O_DIRECT (no page cache), as precast's export writes
# and reads its large tensors (compiler/direct_io.py). On this machine the cached copy above spends most of its
# time in the kernel's page-cache work, not on the disk, so its time is far above the disk's (README: benchmarks).
DIRECT_COPY_CHILD = r"""
import json, os, sys, time
import numpy as np
src, dst, out_size, chunk = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
raw = np.empty(2 * chunk + 4096, np.uint8); buf = raw[(-raw.ctypes.data) % 4096:][:2 * chunk]
size = os.path.getsize(src); done_read = done_write = 0
t0 = time.perf_counter()
fi = os.open(src, os.O_RDONLY | os.O_DIRECT)
fo = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT)
while done_read < size:
    n = os.preadv(fi, [memoryview(buf[:chunk])], done_read)
    if n <= 0:
        break
    done_read += n
    target = out_size if done_read >= size else done_read * out_size // size
    target -= target % 4096                 # whole pages direct; the tail below through the cache
    while done_write < target:
        done_write += os.pwrite(fo, memoryview(buf[:min(2 * chunk, target - done_write)]), done_write)
os.close(fo)
with open(dst, "r+b") as f:
    f.seek(done_write); f.write(bytes(out_size - done_write)); f.flush(); os.fsync(f.fileno())
done_write = out_size
os.close(fi)
print(json.dumps({"read_bytes": done_read, "written_bytes": done_write, "total_s": round(time.perf_counter() - t0, 2)}))
"""


def _copy(child: str, what: str, src: Path, out_size: int, work: Path, logs: Path, tag: str) -> dict:
    """Run a copy child (cold cache first) from `src` into a scratch file of `out_size` bytes, deleted after;
    its wall time and the JSON it prints."""
    dst = work / f"copy_{tag}.bin"
    need_disk(work, out_size, f"{what} {tag}")
    cache = cold_cache(src)
    print(f"  {what}: read {src.stat().st_size / GB:.2f} GB, write {out_size / GB:.2f} GB, fsync ...", flush=True)
    try:
        res = run_child([sys.executable, "-c", child, str(src), str(dst), str(out_size), str(COPY_CHUNK)],
                        logs / f"copy_{tag}.log", timeout=3600)
        if res["rc"] != 0:
            raise RuntimeError(f"{what} failed (rc {res['rc']}):\n{tail(res['log'])}")
        res.update(json.loads(Path(res["log"]).read_text().strip().splitlines()[-1]))
    finally:
        dst.unlink(missing_ok=True)
    res["cache"] = cache
    del res["rss_timeline"]
    return res


def direct_copy(src: Path, out_size: int, work: Path, logs: Path, tag: str) -> dict | None:
    """The copy of `plain_copy` past the page cache (None where O_DIRECT does not exist)."""
    if not hasattr(os, "O_DIRECT"):
        return None
    res = _copy(DIRECT_COPY_CHILD, "direct copy (O_DIRECT)", src, out_size, work, logs, tag)
    print(f"    {res['wall_s']:.1f} s", flush=True)
    return res


def plain_copy(src: Path, out_size: int, work: Path, logs: Path, tag: str) -> dict:
    res = _copy(COPY_CHILD, "plain copy", src, out_size, work, logs, tag)
    moved = res["read_bytes"] + res["written_bytes"]
    res["moved_gb_s"] = round(moved / GB / res["wall_s"], 3)
    print(f"    {res['wall_s']:.1f} s (read {res['read_s']:.1f} s, write {res['write_s']:.1f} s, fsync "
          f"{res['fsync_s']:.1f} s) = {res['moved_gb_s']:.2f} GB/s read+written", flush=True)
    return res


# ---- precast export, with phase timers in the child ---------------------------------------
# Runs `precast ...` (the CLI) after wrapping a few of precast's functions with timers (the code is
# unchanged; each call costs ~1 us more); at exit writes VmHWM and the timers to a JSON file.
# "[threads]" rows are summed over the weight-writer threads (they overlap each other and the wall).
EXPORT_CHILD = r"""
import atexit, json, os, re, sys, threading, time
t_start = time.perf_counter()
stats_file = sys.argv[1]
sys.argv = ["precast", *sys.argv[2:]]
stats, lock, extra = {}, threading.Lock(), {}
def timed(owner, name, label):
    fn = getattr(owner, name)
    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            dt = time.perf_counter() - t0
            with lock:
                s = stats.setdefault(label, [0.0, 0]); s[0] += dt; s[1] += 1
    setattr(owner, name, wrapper)
def write():
    status = open("/proc/self/status").read()
    hwm = int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1))
    json.dump({"vmhwm_bytes": hwm * 1024, "total_s": time.perf_counter() - t_start, **extra,
               "phases": {k: {"s": round(v[0], 3), "calls": v[1]} for k, v in stats.items()}}, open(stats_file, "w"))
atexit.register(write)
t0 = time.perf_counter()
import precast.compiler.cli as cli
import precast.compiler.export as ex
import precast.compiler.graphs.onnx_writer as ow
from precast.compiler.graphs.onnx_graph import Graph
from precast.compiler.sources.safetensors_file import SafetensorsFile
from precast.compiler.sources.checkpoint import TensorRef
extra["imports_s"] = round(time.perf_counter() - t0, 3)
if os.environ.get("FLUX_BENCH_FP8_TABLE") == "1":
    # What-if (benchmark only, bf16 exports only): fp8 decoded through a 65536-entry table indexed by byte
    # pairs (ComfyUI's per-layer scale folded into the table, computed as precast computes each value:
    # float32(fp8) * scale, rounded to bf16, so the bytes are the same); fp8 NaN checked on the bits.
    import ml_dtypes, numpy as np
    F8 = (np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2))
    NAN_MASK = {F8[0]: 0x7F, F8[1]: 0x7C}
    _plain = {}
    def decode(raw, scale=None):
        if scale is None and raw.dtype in _plain:
            table = _plain[raw.dtype]
        else:
            pairs = np.arange(65536, dtype=np.uint16).view(np.uint8).view(raw.dtype)
            values = pairs if scale is None else pairs.astype(np.float32) * scale
            table = values.astype(ml_dtypes.bfloat16).view(np.uint32)
            if scale is None:
                _plain[raw.dtype] = table
        flat = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
        even = flat.size - flat.size % 2
        out = np.empty(flat.size, np.uint16)
        out[:even] = table[flat[:even].view(np.uint16)].view(np.uint16)
        if even < flat.size:
            out[even] = table[int(flat[even])] & 0xFFFF      # little-endian: the low half decodes the first byte
        return out.view(ml_dtypes.bfloat16).reshape(raw.shape)
    _cast = ow._cast_weight
    def cast_weight(arr, elem_type):
        if arr.dtype in F8 and ow.NP_OF[elem_type] == ml_dtypes.bfloat16:
            return decode(arr)
        return _cast(arr, elem_type)
    ow._cast_weight = cast_weight
    _finite = ow._has_non_finite
    def has_non_finite(arr):
        if arr.dtype in F8:
            bits, mask = np.ascontiguousarray(arr).reshape(-1).view(np.uint8), NAN_MASK[arr.dtype]
            step = 1 << 22
            return any(int(np.bitwise_and(bits[i:i + step], mask).max()) == mask for i in range(0, bits.size, step))
        return _finite(arr)
    ow._has_non_finite = has_non_finite
    _read = TensorRef.read
    def read(self, raw=False):
        if raw and self.scale is not None and not self.parts and self.rows is None and \
                self.file.tensors[self.key].dtype.startswith("F8"):
            arr = self.file.read(self.key, raw=True)
            scale = self.file.read(self.scale).astype(np.float32).reshape(())
            return decode(arr, scale).reshape(self.shape)
        return _read(self, raw)
    TensorRef.read = read
    extra["what_if"] = "fp8 pair table"
timed(ex, "open_checkpoint", "open checkpoint (headers)")
timed(ex, "detect_family", "detect family")
timed(ex, "plan_graphs", "build graphs (from headers)")
timed(ex, "save_model", "save_model (weights + model.onnx)")
timed(ex, "_commit", "commit (rename into place)")
timed(ow, "_allocate", "allocate data file (ftruncate + posix_fallocate)")
timed(ow, "_write_weights", "stream weights (wall)")
timed(Graph, "to_proto", "graph to proto")
timed(TensorRef, "read", "[threads] read + decode (TensorRef.read: pread, fp8 scale)")
timed(TensorRef, "read_block", "[threads] read + decode in row blocks (TensorRef.read_block)")
timed(SafetensorsFile, "read", "[threads]   of which pread source tensors")
timed(ow, "_cast_weight", "[threads] cast to the target dtype")
timed(ow, "_has_non_finite", "[threads] NaN/inf check")
timed(os, "pwrite", "[threads] pwrite")
cli.main(prog_name="precast")
"""


def precast_export(args: list[str], out: Path, component: str, logs: Path, tag: str, sources: list[Path],
                   what_if: bool = False) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    cache = cold_cache(*sources)
    stats_file = logs / f"export_{tag}.stats.json"
    cmd = [sys.executable, "-c", EXPORT_CHILD, str(stats_file), "export", *args, "--out", str(out),
           "--component", component, "--dtype", "bf16", "--json"]
    print(f"  precast export --component {component} --dtype bf16{' (WHAT-IF: fp8 pair table)' if what_if else ''} ...",
          flush=True)
    res = run_child(cmd, logs / f"export_{tag}.log", timeout=3600, env={**os.environ, "FLUX_BENCH_FP8_TABLE": "1"}
                    if what_if else None)
    if res["rc"] != 0:
        raise RuntimeError(f"precast export failed (rc {res['rc']}):\n{tail(res['log'])}")
    files = [out / component / "model.onnx_data", out / component / "model.onnx"]
    res["fsync_after_s"] = round(fsync_files(*files), 2)
    res["durable_s"] = round(res["wall_s"] + res["fsync_after_s"], 2)
    res["cache"] = cache
    text = Path(res["log"]).read_text()
    report = json.loads(text[text.index("{"):text.rindex("}") + 1])
    res["reported_s"] = report["seconds"]
    res["out_bytes"] = sum(sum(c["files"].values()) for c in report["components"])
    stats = json.loads(stats_file.read_text())
    res["peak_rss_gb"] = round(stats["vmhwm_bytes"] / GB, 3)
    res["imports_s"] = stats["imports_s"]
    res["phases"] = stats["phases"]
    print(f"    process {res['wall_s']:.1f} s + fsync {res['fsync_after_s']:.1f} s = {res['durable_s']:.1f} s, "
          f"peak RSS {res['peak_rss_gb']:.3f} GB (sampled tree {res['sampled_peak_rss_gb']:.3f} GB), "
          f"output {res['out_bytes'] / GB:.2f} GB", flush=True)
    return res


def check_export(out: Path, component: str, sources: dict[str, Path], expected_count: int, spread: int = 0) -> dict:
    """The output loads, every external initializer lies inside the data file and names a source tensor,
    it holds as many as the source has weights, and three tensors' bytes equal the source's (cast to bf16)."""
    import ml_dtypes
    import numpy as np
    import onnx
    from onnx import TensorProto
    from precast.compiler.sources.safetensors_file import SafetensorsFile
    folder = out / component
    data = folder / "model.onnx_data"
    t0 = time.perf_counter()
    model = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    load_s = time.perf_counter() - t0
    size = data.stat().st_size
    ext = {}
    for t in model.graph.initializer:
        if t.data_location == TensorProto.EXTERNAL:
            e = {x.key: x.value for x in t.external_data}
            ext[t.name] = (int(e["offset"]), int(e["length"]), t.data_type, tuple(t.dims))
    in_bounds = all(o + n <= size for o, n, _, _ in ext.values())
    np_of = {TensorProto.BFLOAT16: ml_dtypes.bfloat16, TensorProto.FLOAT: np.float32, TensorProto.FLOAT16: np.float16}
    dtypes = {}
    for _, _, dt, _ in ext.values():
        name = TensorProto.DataType.Name(dt)
        dtypes[name] = dtypes.get(name, 0) + 1
    opened = {k: SafetensorsFile(p) for k, p in sources.items()}
    where = {key: f for f in opened.values() for key in f.keys()}
    unknown = [k for k in ext if k not in where]
    names = sorted(ext, key=lambda k: ext[k][0])
    picks = [names[0], max(names, key=lambda k: ext[k][1]), names[-1]] if names else []
    spaced = [names[i * len(names) // (spread + 1)] for i in range(1, spread + 1)]
    picks += [k for k in spaced if k not in picks]
    picks += [next(k for k in names if ext[k][2] != TensorProto.BFLOAT16)] if dtypes.keys() - {"BFLOAT16"} else []
    compared = {}
    with open(data, "rb") as fd:
        for k in picks:
            if k not in where:
                continue
            f = where[k]
            raw = f.read(k, raw=True)
            scale = k[: -len(".weight")] + ".scale_weight" if k.endswith(".weight") else None
            if scale in f.tensors:     # ComfyUI scaled fp8: stored * scale, in float32, then cast
                raw = raw.astype(np.float32) * f.read(scale).astype(np.float32).reshape(())
            o, n, dt, _ = ext[k]
            want = np.ascontiguousarray(raw.astype(np_of[dt])).reshape(-1).view(np.uint8)
            fd.seek(o)
            got = np.frombuffer(fd.read(n), np.uint8)
            compared[k] = bool(got.size == want.size and np.array_equal(got, want))
    for f in opened.values():
        f.close()
    ok = in_bounds and not unknown and len(ext) == expected_count and all(compared.values())
    res = {"ok": ok, "onnx_load_s": round(load_s, 2), "nodes": len(model.graph.node), "external_initializers": len(ext),
           "expected_weights": expected_count, "in_bounds": in_bounds, "dtypes": dtypes,
           "unknown_names": unknown[:5], "bytes_equal": compared, "data_bytes": size,
           "onnx_bytes": (folder / "model.onnx").stat().st_size}
    print(f"    check: {'ok' if ok else 'FAILED'} ({len(ext)} weights of {expected_count}, "
          f"{len(model.graph.node)} nodes, "
          f"{dtypes}, onnx.load {load_s:.2f} s, bytes equal: {sum(compared.values())}/{len(compared)})", flush=True)
    return res


# ---- one part: write the source, copy, export, copy ----------------------------------------
def write_source(path: Path, writer, what: str) -> dict:
    print(f"writing {path.name} ({what}) ...", flush=True)
    t0 = time.perf_counter()
    plan = writer(path)
    fsync_files(path)
    s = time.perf_counter() - t0
    size = path.stat().st_size
    print(f"  {size / GB:.2f} GB in {s:.0f} s ({size / GB / s:.2f} GB/s, fsync included)", flush=True)
    return {"path": path.name, "bytes": size, "tensors": len(plan), "write_s": round(s, 1), "plan": plan}


def expected_out_bytes(plan: dict, keys: list[str]) -> int:
    """Bytes the bf16 export of these tensors takes (the data file; its 4 KiB alignment adds < 0.1%)."""
    return sum(2 * math.prod(plan[k][0]) for k in keys)


def run_part(name: str, src: dict, export_args: list[str], component: str, sources: dict[str, Path],
             weight_keys: list[str], work: Path, logs: Path, plan: dict, what_if: bool = False) -> dict:
    src_path = work / src["path"]
    out_guess = expected_out_bytes(plan, weight_keys)
    need_disk(work, out_guess, f"{name} export")
    res = {"source": {k: v for k, v in src.items() if k != "plan"}, "copies": []}
    res["copies"].append(plain_copy(src_path, out_guess, work, logs, f"{name}_before"))
    out = work / f"export_{name}"
    try:
        res["export"] = precast_export(export_args, out, component, logs, name, list(sources.values()))
        res["check"] = check_export(out, component, sources, len(weight_keys))
    finally:
        shutil.rmtree(out, ignore_errors=True)
    if what_if:
        try:
            res["what_if_export"] = precast_export(export_args, out, component, logs, name + "_what_if",
                                                   list(sources.values()), what_if=True)
            res["what_if_check"] = check_export(out, component, sources, len(weight_keys), spread=12)
        finally:
            shutil.rmtree(out, ignore_errors=True)
    out_bytes = res["export"]["out_bytes"]
    res["direct_copy"] = direct_copy(src_path, out_bytes, work, logs, f"{name}_direct")
    res["copies"].append(plain_copy(src_path, out_bytes, work, logs, f"{name}_after"))
    copy_s = sum(c["wall_s"] for c in res["copies"]) / len(res["copies"])
    read = sum(s.stat().st_size for s in sources.values())
    e = res["export"]
    res["summary"] = summary_row(name, read, out_bytes, copy_s, [c["wall_s"] for c in res["copies"]], e)
    if res["direct_copy"]:
        res["summary"]["direct_copy_s"] = res["direct_copy"]["wall_s"]
        res["summary"]["ratio_to_direct_copy"] = round(e["durable_s"] / res["direct_copy"]["wall_s"], 2)
    if what_if:
        res["what_if_summary"] = summary_row(name + " what-if", read, out_bytes, copy_s,
                                             [c["wall_s"] for c in res["copies"]], res["what_if_export"])
    return res


def summary_row(name: str, read: int, written: int, copy_s: float, copies: list[float], e: dict) -> dict:
    ratio, ratio_proc = e["durable_s"] / copy_s, e["wall_s"] / copy_s
    return {"part": name, "read_gb": round(read / GB, 2), "written_gb": round(written / GB, 2),
            "copy_s": round(copy_s, 1), "copies_s": copies, "copy_gb_s": round((read + written) / GB / copy_s, 3),
            "export_s": e["wall_s"], "export_durable_s": e["durable_s"],
            "export_gb_s": round((read + written) / GB / e["durable_s"], 3),
            "peak_rss_gb": e["peak_rss_gb"], "ratio_to_copy": round(ratio, 2),
            "ratio_process_wall": round(ratio_proc, 2),
            "ratio_to_fastest_copy": round(e["durable_s"] / min(copies), 2),
            "time_floor": "PASS" if ratio <= TIME_FLOOR else "FAIL",
            "rss_floor": "PASS" if e["peak_rss_gb"] * GB <= RSS_FLOOR else "FAIL"}


# ---- the torch peer, run inside its own capped process -------------------------------------
def peer_child(variant: str, src: str, out: str, phase_file: str, config_json: str) -> None:
    """torch.onnx.export of diffusers' FluxTransformer2DModel; each phase logged as it starts."""
    t0 = time.perf_counter()
    log = open(phase_file, "a", buffering=1)

    def rss_gb() -> float:
        return round(int(re.search(r"VmRSS:\s+(\d+)", open("/proc/self/status").read()).group(1)) * 1024 / GB, 3)

    def phase(name: str) -> None:
        log.write(json.dumps({"t": round(time.perf_counter() - t0, 2), "phase": name, "rss_gb": rss_gb()}) + "\n")

    cfg = json.loads(config_json)
    try:
        phase("import torch + diffusers")
        import torch
        from diffusers import FluxTransformer2DModel
        from diffusers.loaders.single_file_utils import convert_flux_transformer_checkpoint_to_diffusers
        log.write(json.dumps({"versions": {"torch": torch.__version__, "diffusers": __import__("diffusers").__version__,
                                           "threads": torch.get_num_threads()}}) + "\n")
        dtype = torch.float32 if variant == "defaults" else torch.bfloat16
        if variant == "defaults":
            phase("instantiate FluxTransformer2DModel(**config) (fp32, on the CPU)")
            model = FluxTransformer2DModel(**cfg)
            phase("load weights (safetensors load_file + diffusers converter + load_state_dict)")
            from safetensors.torch import load_file
            sd = convert_flux_transformer_checkpoint_to_diffusers(load_file(src))
            model.load_state_dict(sd, strict=True)
            del sd
        elif variant == "from_single_file":
            cfg_dir = Path(out) / "config"
            cfg_dir.mkdir(parents=True, exist_ok=True)
            (cfg_dir / "config.json").write_text(json.dumps({"_class_name": "FluxTransformer2DModel", **cfg}))
            phase("FluxTransformer2DModel.from_single_file(torch_dtype=bfloat16)")
            model = FluxTransformer2DModel.from_single_file(src, config=str(cfg_dir), torch_dtype=torch.bfloat16)
        else:
            import mmap
            phase("instantiate on the meta device (bf16)")
            with torch.device("meta"):
                model = FluxTransformer2DModel(**cfg).to(torch.bfloat16)
            phase("map the file; parameters = zero-copy bf16 views of the map")
            fd = os.open(src, os.O_RDONLY)
            mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
            n = struct.unpack("<Q", mm[:8])[0]
            header = json.loads(mm[8:8 + n])
            sd = {}
            import warnings
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")          # "the given buffer is not writable": read-only by design
                for k, v in header.items():
                    if k == "__metadata__":
                        continue
                    a, b = v["data_offsets"]
                    view = torch.frombuffer(mm, dtype=torch.bfloat16, count=(b - a) // 2, offset=8 + n + a)
                    sd[k] = view.view(v["shape"])
            sd = convert_flux_transformer_checkpoint_to_diffusers(sd)
            phase("load_state_dict(assign=True)")
            model.load_state_dict(sd, strict=True, assign=True)
            del sd
        model.requires_grad_(False).eval()
        params = sum(p.numel() for p in model.parameters())
        log.write(json.dumps({"parameters": params, "param_dtype": str(next(model.parameters()).dtype)}) + "\n")

        class Wrapped(torch.nn.Module):
            def __init__(self, m):
                super().__init__()
                self.m = m

            def forward(self, hidden_states, encoder_hidden_states, pooled_projections, timestep, img_ids, txt_ids,
                        guidance):
                return self.m(hidden_states=hidden_states, encoder_hidden_states=encoder_hidden_states,
                              pooled_projections=pooled_projections, timestep=timestep, img_ids=img_ids,
                              txt_ids=txt_ids, guidance=guidance, return_dict=False)[0]

        def example(c: dict):      # a 4x4 packed latent, 8 tokens: the trace's activations are tiny, its weights not
            img, txt = 16, 8
            return (torch.randn(1, img, 64, dtype=dtype), torch.randn(1, txt, c["joint_attention_dim"], dtype=dtype),
                    torch.randn(1, c["pooled_projection_dim"], dtype=dtype), torch.tensor([0.5], dtype=dtype),
                    torch.zeros(img, 3), torch.zeros(txt, 3), torch.tensor([3.5], dtype=dtype))
        names = ["hidden_states", "encoder_hidden_states", "pooled_projections", "timestep", "img_ids", "txt_ids",
                 "guidance"]
        path = os.path.join(out, "model.onnx")
        # The exporters as installed: the default (dynamo) one needs onnxscript; the TorchScript one has no
        # aten::rms_norm (diffusers' RMSNorm) at any opset. Shown on a 1+1-block, 32-wide instance of the same
        # class, then worked around (a symbolic for rms_norm, as a user would register) for the real model.
        import importlib.util
        import io
        tiny_cfg = dict(cfg, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
                        joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=[4, 6, 6])
        tiny = Wrapped(FluxTransformer2DModel(**tiny_cfg).to(dtype).eval())
        probe = {"onnxscript_installed": importlib.util.find_spec("onnxscript") is not None}
        for dynamo in (True, False):
            try:
                with torch.no_grad():
                    torch.onnx.export(tiny, example(tiny_cfg), io.BytesIO(), dynamo=dynamo, opset_version=17)
                probe[f"dynamo={dynamo}"] = "ok"
            except Exception as e:  # noqa: BLE001
                probe[f"dynamo={dynamo}"] = f"{type(e).__name__}: {str(e)[:200]}"
        from torch.onnx import symbolic_helper as sh

        def rms_norm(g, x, shape, weight, eps):     # x / sqrt(mean(x^2) + eps) * weight, in fp32
            xf = g.op("Cast", x, to_i=1)
            ms = g.op("ReduceMean", g.op("Mul", xf, xf), axes_i=list(range(-len(shape), 0)), keepdims_i=1)
            e = 1e-6 if sh._is_none(eps) else sh._maybe_get_const(eps, "f")
            eps_c = g.op("Constant", value_t=torch.tensor(e, dtype=torch.float32))
            y = g.op("Div", xf, g.op("Sqrt", g.op("Add", ms, eps_c)))
            y = g.op("CastLike", y, x)
            return y if sh._is_none(weight) else g.op("Mul", y, weight)
        torch.onnx.register_custom_op_symbolic("aten::rms_norm", sh.parse_args("v", "is", "v", "v")(rms_norm), 17)
        try:
            with torch.no_grad():
                torch.onnx.export(tiny, example(tiny_cfg), io.BytesIO(), dynamo=False, opset_version=17)
            probe["dynamo=False + rms_norm symbolic"] = "ok"
        except Exception as e:  # noqa: BLE001
            probe["dynamo=False + rms_norm symbolic"] = f"{type(e).__name__}: {str(e)[:200]}"
        del tiny
        log.write(json.dumps({"exporter_probe": probe}) + "\n")
        phase("torch.onnx.export (TorchScript exporter + rms_norm symbolic: trace, passes, serialize)")
        with torch.no_grad():
            torch.onnx.export(Wrapped(model), example(cfg), path, dynamo=False, opset_version=17, input_names=names,
                              output_names=["out"])
        phase("done")
        files = [p for p in Path(out).rglob("*") if p.is_file() and p.parent.name != "config"]
        import onnx
        proto = onnx.load(path, load_external_data=False)
        log.write(json.dumps({"exported_bytes": sum(p.stat().st_size for p in files), "exported_check": {
            "files": len(files), "nodes": len(proto.graph.node), "initializers": len(proto.graph.initializer),
            "external_initializers": sum(t.data_location == onnx.TensorProto.EXTERNAL
                                         for t in proto.graph.initializer)}})
                  + "\n")
    except BaseException as e:  # noqa: BLE001 (MemoryError, RuntimeError from the allocator, ...)
        frames = traceback.extract_tb(e.__traceback__)
        log.write(json.dumps({"t": round(time.perf_counter() - t0, 2), "error": type(e).__name__,
                              "message": str(e)[:600], "rss_gb": rss_gb(),
                              "where": [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames[-6:]]}) + "\n")
        log.close()
        os._exit(3)


def run_peer(variant: str, src: Path, work: Path, logs: Path, cap: int, timeout: float, cfg: dict,
             cap_mode: str) -> dict:
    import resource
    out = work / f"peer_{variant}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    phase_file = logs / f"peer_{variant}.phases.jsonl"
    phase_file.unlink(missing_ok=True)
    need_disk(work, src.stat().st_size, f"peer {variant} (its output may be as large as the source)")
    cache = cold_cache(src)

    def cap_memory():           # in the child, before exec
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")     # should the machine run out anyway, the kernel's OOM killer takes the peer first
        if cap_mode == "rlimit-data":    # a hard limit on private writable memory (private file maps count too)
            resource.setrlimit(resource.RLIMIT_DATA, (cap, cap))

    print(f"peer {variant}: diffusers {PEER_CLASS} + torch.onnx.export, cap {cap / 2**30:.0f} GiB "
          f"({cap_mode}) ...", flush=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--peer-child", variant, str(src), str(out), str(phase_file),
           json.dumps(cfg)]
    try:
        res = run_child(cmd, logs / f"peer_{variant}.log", timeout=timeout, preexec=cap_memory, interval=0.05,
                        anon_limit=cap if cap_mode == "watchdog" else cap + 2**30, min_available=int(1.5 * 2**30))
    finally:
        shutil.rmtree(out, ignore_errors=True)
    res["cache"] = cache
    res["cap_gib"], res["cap_mode"] = cap / 2**30, cap_mode
    lines = [json.loads(x) for x in phase_file.read_text().splitlines() if x.strip()] if phase_file.exists() else []
    phases = [x for x in lines if "phase" in x]
    error = next((x for x in lines if "error" in x), None)
    for x in lines:
        for k in ("versions", "parameters", "param_dtype", "exported_bytes", "exported_check", "exporter_probe"):
            if k in x:
                res[k] = x[k]
    res["phases"] = phases
    last = phases[-1]["phase"] if phases else None
    if error:
        res["outcome"] = f"{error['error']} during '{last}' after {error['t']:.1f} s"
        res["error"] = error
    elif res["watchdog_kill"]:
        res["outcome"] = f"killed ({res['watchdog_kill']}) during '{last}'"
    elif res["timed_out"]:
        res["outcome"] = f"timed out after {timeout:.0f} s during '{last}'"
    elif res["rc"] < 0:
        res["outcome"] = f"killed by signal {-res['rc']} during '{last}'"
    elif res["rc"] == 0 and last == "done":
        res["outcome"] = f"exported ({res.get('exported_bytes', 0) / GB:.2f} GB)"
    else:
        res["outcome"] = f"exit {res['rc']} during '{last}'"
    if res["rc"] != 0 and not error:
        res["log_tail"] = tail(res["log"], 15)
    print(f"  {res['outcome']}; wall {res['wall_s']:.1f} s, sampled peak RSS {res['sampled_peak_rss_gb']:.2f} GB "
          f"(anonymous {res['sampled_peak_anon_gb']:.2f} GB)", flush=True)
    if error:
        print(f"    {error['error']}: {error['message'][:300]}\n    at {' <- '.join(reversed(error['where'][-3:]))}",
              flush=True)
    return res


# ---- fp8 decode: what precast's cast costs, and what a table would -------------------------
def decode_probe(src: Path, key: str, scaled: bool) -> dict:
    """One fp8 tensor decoded to bf16 the way precast does it (ml_dtypes astype; scaled: astype(float32) *
    scale, then to bf16) and through a 65536-entry table indexed by byte pairs (the scale folded into the
    table, computed the same way, so the bytes are the same), in this process, one thread."""
    import ml_dtypes
    import numpy as np
    from precast.compiler.sources.safetensors_file import SafetensorsFile
    f = SafetensorsFile(src)
    try:
        raw = f.read(key, raw=True).reshape(-1)
        scale = f.read(key[: -len(".weight")] + ".scale_weight").astype(np.float32).reshape(()) if scaled else None
    finally:
        f.close()
    n = raw.size
    t0 = time.perf_counter()
    ref = (raw.astype(np.float32) * scale if scaled else raw).astype(ml_dtypes.bfloat16)
    t_ml = time.perf_counter() - t0
    t0 = time.perf_counter()
    pairs = np.arange(65536, dtype=np.uint16).view(np.uint8).view(raw.dtype)
    table = (pairs.astype(np.float32) * scale if scaled else pairs).astype(ml_dtypes.bfloat16).view(np.uint32)
    lut = table[raw.view(np.uint8)[: n - n % 2].view(np.uint16)].view(np.uint16)
    t_lut = time.perf_counter() - t0
    equal = bool(np.array_equal(lut, ref.view(np.uint16)[: lut.size]))
    return {"tensor": key, "elements": n, "scaled": scaled, "ml_dtypes_s": round(t_ml, 3),
            "ml_dtypes_melem_s": round(n / t_ml / 1e6), "pair_table_s": round(t_lut, 3),
            "pair_table_melem_s": round(n / t_lut / 1e6), "speedup": round(t_ml / t_lut, 1), "bit_equal": equal}


# ---- the report ---------------------------------------------------------------------------
def print_table(rows: list[dict], peers: dict, mach: dict) -> None:
    print(f"\nmachine: {mach['cpu']} ({mach['virtualization']}), {mach['cores']} cores, {mach['ram_gib']} GiB RAM, "
          f"no GPU; Python {mach['python']}; commit {mach['git_commit']}"
          f"{' (compiler/runtime modified)' if mach['compiler_or_runtime_modified'] else ''}")
    head = (f"{'part':<24} {'read GB':>7} {'write GB':>8} {'copy s':>7} {'copy GB/s':>9} {'export s':>8} "
            f"{'+fsync s':>8} {'GB/s':>6} {'peak RSS GB':>11} {'x copy':>7} {'<=' + format(TIME_FLOOR, 'g') + 'x':>5} {'<=1.5GB':>7}")
    print("\n" + head + "\n" + "-" * len(head))
    for r in rows:
        print(f"{r['part']:<24} {r['read_gb']:>7.2f} {r['written_gb']:>8.2f} {r['copy_s']:>7.1f} "
              f"{r['copy_gb_s']:>9.3f} "
              f"{r['export_s']:>8.1f} {r['export_durable_s']:>8.1f} {r['export_gb_s']:>6.3f} {r['peak_rss_gb']:>11.3f} "
              f"{r['ratio_to_copy']:>6.2f}x {r['time_floor']:>5} {r['rss_floor']:>7}")
    print("copy s = mean of the plain copies before and after the export (read + write + fsync, cold cache);\n"
          "export s = precast process wall time; +fsync s = that plus fsync of its output (the ratio's numerator);\n"
          "GB/s = (bytes read + bytes written) / time; peak RSS = the export process's VmHWM;\n"
          "what-if = the same export with fp8 decoded through a byte-pair table patched in by this script "
          "(not precast as shipped; its output checked against the source like the others)")
    for r in rows:
        direct = (f"; the same copy past the page cache (O_DIRECT, the disk's own limit) {r['direct_copy_s']:.1f} s, "
                  f"export {r['ratio_to_direct_copy']:.2f}x that") if "direct_copy_s" in r else ""
        print(f"  {r['part']}: copies {', '.join(f'{c:.1f}' for c in r['copies_s'])} s; ratio to the faster copy "
              f"{r['ratio_to_fastest_copy']:.2f}x; process wall alone {r['ratio_process_wall']:.2f}x{direct}")
    ours = next((r for r in rows if r["part"] == "flux-bf16"), None)
    for v, p in peers.items():
        vs = ""
        if ours and p["outcome"].startswith("exported"):
            vs = (f"; precast bf16 is {p['wall_s'] / ours['export_durable_s']:.1f}x faster and peaks "
                  f"{p['sampled_peak_rss_gb'] / ours['peak_rss_gb']:.0f}x lower in RSS")
        print(f"peer {v}: {p['outcome']}; wall {p['wall_s']:.1f} s, sampled peak RSS {p['sampled_peak_rss_gb']:.2f} GB "
              f"(anonymous {p['sampled_peak_anon_gb']:.2f} GB), cap {p['cap_gib']:.0f} GiB ({p['cap_mode']}){vs}")


def print_phases(parts: dict) -> None:
    for name, e in [(n + suffix, p[key]) for n, p in parts.items()
                    for key, suffix in (("export", ""), ("what_if_export", " what-if")) if key in p]:
        print(f"\nwhere {name}'s export time goes (process {e['wall_s']:.1f} s, imports {e['imports_s']:.2f} s):")
        for k, v in sorted(e["phases"].items(), key=lambda kv: -kv[1]["s"]):
            print(f"  {k:<52} {v['s']:>8.2f} s  ({v['calls']} calls)")


# ---- main ---------------------------------------------------------------------------------
def start_work(work: Path) -> Path:
    """The work folder made (prepare_work), its logs folder, and SIGTERM / SIGHUP made to end the run as
    Ctrl-C does (the work folder is deleted on the way out). Returns the logs folder."""
    prepare_work(work)
    logs = work / "logs"
    logs.mkdir()

    def on_signal(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")
    for s in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, on_signal)
    return logs


def aborted(results: dict, e: BaseException) -> None:
    """Why the run stopped, in `results`; the children still running killed; a bug's traceback printed."""
    results["aborted"] = f"{type(e).__name__}: {e}"
    print(f"\naborted: {results['aborted']}", flush=True)
    for p in list(RUNNING):
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if not isinstance(e, (KeyboardInterrupt, RuntimeError)):
        traceback.print_exc()


def finish(results: dict, work: Path, logs: Path, t_all: float, packages: tuple) -> None:
    """The end of a run: the logs' tails kept, the work folder deleted (and results/work when empty), the
    disk, time, load and machine (with these packages' versions) recorded, each part's table row collected."""
    results["logs"] = {p.name: tail(p, 8) for p in sorted(logs.glob("*.log"))} if logs.exists() else {}
    shutil.rmtree(work, ignore_errors=True)
    if work.parent == (HERE / "results" / "work").resolve():
        try:
            work.parent.rmdir()                   # only if empty: other benchmarks keep files there
        except OSError:
            pass
    results["work_folder_removed"] = not work.exists()
    results["disk_free_gb_end"] = round(free_bytes(work.parent) / GB, 1)
    results["total_s"] = round(time.perf_counter() - t_all, 1)
    results["loadavg_end"] = os.getloadavg()
    results["machine"] = describe(packages)
    results["machine"]["kernel"] = os.uname().release
    results["machine"]["disk"] = "virtio block device (/dev/vda), ext4"
    for p in results["parts"].values():
        p["source"].pop("plan", None)
    results["table"] = [p["summary"] for p in results["parts"].values() if p.get("summary")]


def prepare_work(work: Path) -> None:
    if work.exists() and any(work.iterdir()) and not (work / MARKER).exists():
        raise SystemExit(f"--work {work}: exists, is not empty and was not made by this script; "
                         "give a new or empty folder (it is deleted at the end)")
    shutil.rmtree(work, ignore_errors=True)          # an interrupted run's leftovers
    work.mkdir(parents=True)
    (work / MARKER).write_text("made by benchmarks/flux_export.py; deleted at the end of its run\n")


def main() -> None:
    if len(sys.argv) == 7 and sys.argv[1] == "--peer-child":
        peer_child(*sys.argv[2:])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", default=",".join(ALL_PARTS), help=f"comma-separated subset of {','.join(ALL_PARTS)}")
    ap.add_argument("--peer-variants", default=",".join(PEER_VARIANTS), help="defaults,from_single_file,mmap")
    ap.add_argument("--peer-cap-gib", type=float, default=18.0, help="memory cap of the torch peer (GiB)")
    ap.add_argument("--peer-cap-mode", choices=("watchdog", "rlimit-data"), default="watchdog",
                    help="watchdog: the child is SIGKILLed when its anonymous RSS (sampled every 50 ms) passes the cap "
                         "or the machine's MemAvailable drops below 1.5 GiB, and is the OOM killer's first pick; "
                         "rlimit-data: also RLIMIT_DATA = cap (hard, but it counts safetensors' private file map "
                         "as memory, so load_file of a file larger than the cap fails at mmap)")
    ap.add_argument("--peer-timeout", type=float, default=1200.0, help="seconds per peer variant")
    ap.add_argument("--work", type=Path, default=HERE / "results" / "work" / "flux_export",
                    help="work folder (new or empty; deleted at the end)")
    ap.add_argument("--json", type=Path, default=HERE / "results" / "flux_export.json", help="results file")
    ap.add_argument("--no-fp8-what-if", dest="fp8_what_if", action="store_false",
                    help="skip the what-if export of the fp8 sources with a byte-pair decode table patched in")
    ap.add_argument("--small", action="store_true", help="1+1-block Flux, 2-layer T5 (a quick try of the script)")
    opts = ap.parse_args()
    parts = [p for p in opts.parts.split(",") if p]
    variants = [v for v in opts.peer_variants.split(",") if v]
    bad = [p for p in parts if p not in ALL_PARTS] + [v for v in variants if v not in PEER_VARIANTS]
    if bad:
        raise SystemExit(f"unknown part or peer variant: {', '.join(bad)}")
    if "peer" in parts and meminfo()["MemTotal"] / 2**30 < opts.peer_cap_gib + 2:
        raise SystemExit(f"--peer-cap-gib {opts.peer_cap_gib}: leave at least 2 GiB of this machine's memory free")

    from precast.compiler import demo_dit as dd
    flux_cfg, t5_cfg, peer_cfg = dd.FLUX_DEV, dd.T5_XXL, dict(FLUX_DEV_DIFFUSERS)
    if opts.small:
        flux_cfg, t5_cfg = replace(dd.FLUX_DEV, depth=1, depth_single=1), replace(dd.T5_XXL, layers=2)
        peer_cfg.update(num_layers=1, num_single_layers=1)

    work = opts.work.resolve()
    logs = start_work(work)
    results: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "small": opts.small, "parts": {}, "peer": {},
                     "disk_free_gb_start": round(free_bytes(work) / GB, 1), "loadavg_start": os.getloadavg(),
                     "floors": {"peak_rss_max_gb": RSS_FLOOR / GB, "time_max_x_copy": TIME_FLOOR},
                     "flux_parameters": dd.parameter_count(dd.flux_layout(flux_cfg)),
                     "t5_parameters": dd.parameter_count(dd.t5_layout(t5_cfg))}
    print(f"work folder {work}; {results['disk_free_gb_start']:.1f} GB free; "
          f"Flux {results['flux_parameters'] / 1e9:.2f} B "
          f"parameters, T5 {results['t5_parameters'] / 1e9:.2f} B", flush=True)
    t_all = time.perf_counter()
    try:
        flux_sources = {"flux-bf16": "bf16", "flux-fp8": "fp8_e4m3", "flux-fp8-scaled": "fp8_e4m3_scaled"}
        names = [p for p in ("flux-bf16", "flux-fp8", "flux-fp8-scaled") if p in parts]
        if "peer" in parts and "flux-bf16" not in names:
            names.insert(0, "flux-bf16")         # the peer exports the bf16 file
        for name in names:
            dtype = flux_sources[name]
            src_path = work / f"flux1-dev_{dtype}.safetensors"
            need_disk(work, 2 * dd.parameter_count(dd.flux_layout(flux_cfg)) * (2 if dtype == "bf16" else 1), name)
            src = write_source(src_path, lambda p: dd.write_flux_checkpoint(p, flux_cfg, dtype=dtype, layout="bare"),
                               f"Flux.1-dev transformer, {dtype}, bare BFL layout")
            plan = src["plan"]
            try:
                if name in parts:
                    print(f"\n== {name} ==", flush=True)
                    extras = (".scale_weight", ".scale_input", dd.SCALED_FP8_MARKER)   # consumed, not exported
                    weights = [k for k in plan if not k.endswith(extras)]
                    results["parts"][name] = run_part(name, src, [str(src_path)], "transformer", {"flux": src_path},
                                                      weights, work, logs, plan,
                                                      what_if=opts.fp8_what_if and dtype.startswith("fp8"))
                    if dtype.startswith("fp8"):
                        probe = decode_probe(src_path, "single_blocks.0.linear1.weight", dtype.endswith("_scaled"))
                        results["parts"][name]["fp8_decode_probe"] = probe
                        print(f"  fp8 decode probe ({probe['tensor']}, {probe['elements'] / 1e6:.0f} M): ml_dtypes "
                              f"{probe['ml_dtypes_melem_s']} M/s, pair table {probe['pair_table_melem_s']} M/s "
                              f"({probe['speedup']}x, bit-equal {probe['bit_equal']})", flush=True)
                if name == "flux-bf16" and "peer" in parts:
                    print("\n== peer: torch.onnx.export of the same model ==", flush=True)
                    for v in variants:
                        results["peer"][v] = run_peer(v, src_path, work, logs, int(opts.peer_cap_gib * 2**30),
                                                      opts.peer_timeout, peer_cfg, opts.peer_cap_mode)
            finally:
                src_path.unlink(missing_ok=True)
        if "t5" in parts:
            print("\n== t5 ==", flush=True)
            t5_path, host = work / "t5xxl_bf16.safetensors", work / "host_tiny_flux.safetensors"
            need_disk(work, 2 * 2 * dd.parameter_count(dd.t5_layout(t5_cfg)), "t5")
            try:
                src = write_source(t5_path, lambda p: dd.write_t5_file(p, t5_cfg, dtype="bf16"), "T5-XXL encoder, bf16")
                # the tiny transformer that carries the T5 (its own weights are not exported): T5-wide context
                dd.write_flux_checkpoint(host, replace(dd.TINY_FLUX_DEV, context_in_dim=t5_cfg.d_model), layout="bare")
                results["parts"]["t5"] = run_part("t5", src, [str(host), "--text-encoder", str(t5_path)],
                                                  "text_encoder_2", {"t5": t5_path}, list(src["plan"]), work, logs,
                                                  src["plan"])
            finally:
                t5_path.unlink(missing_ok=True)
                host.unlink(missing_ok=True)
    except BaseException as e:
        aborted(results, e)
    finally:
        finish(results, work, logs, t_all, ("precast", "numpy", "onnx", "ml_dtypes", "safetensors", "torch", "diffusers",
                                            "psutil"))
        rows = [r for p in results["parts"].values() for r in (p.get("summary"), p.get("what_if_summary")) if r]
        results["table"] = rows
        results["note"] = ("page cache dropped (sync + drop_caches + fadvise) before every copy, export and peer; "
                           "copy and export both pay for writing their output to the disk (fsync)")
        opts.json.parent.mkdir(parents=True, exist_ok=True)
        opts.json.write_text(json.dumps(results, indent=1, default=str) + "\n")
        print_phases(results["parts"])
        print_table(rows, results["peer"], results["machine"])
        print(f"\nwrote {opts.json}; work folder removed; {results['disk_free_gb_end']:.1f} GB free; "
              f"total {results['total_s'] / 60:.1f} min")


if __name__ == "__main__":
    main()
