"""Benchmark: bundles through a local OCI registry (Debian's docker-registry on 127.0.0.1, as the tests run it).

1. The tiny SD 1.x bundle (recipe tiny-sd15-rtx: ONNX Runtime, OpenVINO CPU, TensorRT-RTX sm_86): `precast push`
   (cold, then again: HEADs only), `precast pull` for this machine and `--all`: seconds and bytes.
2. Pull throughput of one random blob (--gib, default 1.5 GiB) with precast's client (`Registry.fetch_blob`:
   sha256 while streaming, written to disk) against the limit, a plain `requests` GET of the same blob from the
   same registry written to disk, and `curl -o`; best of --rounds, the order alternating per round. Prints the ratio
   (floor 0.8x) and, as what bounds it, the CPU seconds per GiB each spent (the client's, and the registry's:
   all three share this machine's cores) and sha256's own speed on one core (hashlib, the hash precast runs), and
   from them the bound on a pull that verifies while it streams: the cores over the CPU seconds per GiB that
   client and registry spend together, and no faster than sha256 on one core (a digest is one sequential hash).

The work folder (registry storage, the blob, the bundles) is deleted at the end (--keep keeps it).
Usage: .venv/bin/python benchmarks/registry.py [--gib 1.5] [--rounds 5] [--work DIR] [--json OUT] [--keep]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from registry import Registry  # noqa: E402  (tests/registry.py: starts docker-registry on a free port)


def cpu_name() -> str:
    try:
        return next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "?"


def precast(*args) -> tuple[float, dict]:
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "precast.runtime.cli", *map(str, args), "--json"],
                          capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"precast {args[0]} failed: {proc.stderr}")
    return time.perf_counter() - t, json.loads(proc.stdout)


def bundle_rows(work: Path, host: str) -> list[dict]:
    env = {**os.environ, "PRECAST_CACHE": str(work / "cache")}
    subprocess.run([sys.executable, "-m", "precast.runtime.cli", "build", "tiny-sd15-rtx", "--out", work / "bundle"],
                   check=True, capture_output=True, env=env)
    ref, rows = f"oci://{host}/bench/tiny:v1", []
    for what, args in (("push (cold)", ("push", work / "bundle", ref)), ("push (unchanged)", ("push", work / "bundle", ref)),
                       ("pull (this machine)", ("pull", ref, "--out", work / "pulled")),
                       ("pull --all", ("pull", ref, "--out", work / "all", "--all"))):
        seconds, r = precast(*args)
        moved = r.get("bytes_uploaded", r.get("bytes_downloaded"))
        rows.append({"what": what, "seconds": round(seconds, 2), "bytes": moved, "of": r["bytes_total"]})
    return rows


def _cpu_seconds(pid: int | None = None) -> float:
    """CPU seconds (user + system) of this process and its finished children, or of process `pid`."""
    if pid is None:
        t = os.times()
        return t.user + t.system + t.children_user + t.children_system
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def sha256_speed(mib: int = 512) -> int:
    """MB/s of hashlib's sha256 on one core, from memory (what precast's pull hashes with)."""
    block, h = os.urandom(1 << 20), hashlib.sha256()
    t = time.perf_counter()
    for _ in range(mib):
        h.update(block)
    return round(mib * (1 << 20) / (time.perf_counter() - t) / 1e6)


def throughput(work: Path, host: str, gib: float, rounds: int, server_pid: int) -> dict:
    import numpy as np
    import requests
    from precast.runtime.oci.client import Registry as Client
    size, path, h = int(gib * (1 << 30)), work / "blob.bin", hashlib.sha256()
    rng = np.random.default_rng(0)
    with open(path, "wb") as f:
        left = size
        while left:
            block = rng.integers(0, 256, min(left, 64 << 20), dtype=np.uint8).tobytes()
            f.write(block)
            h.update(block)
            left -= len(block)
    digest, repo, client = "sha256:" + h.hexdigest(), "bench/blob", Client(host, loopback=True)
    t = time.perf_counter()
    client.push_blob(repo, digest, size, path, "blob")
    push_s = time.perf_counter() - t
    path.unlink()
    url, best = f"http://{host}/v2/{repo}/blobs/{digest}", {"precast": 1e9, "requests": 1e9, "curl": 1e9}
    cpu = {k: [] for k in best}
    for i in range(rounds):
        for name in (list(best) if i % 2 == 0 else list(best)[::-1]):      # alternate who goes first
            out = work / f"got-{name}"
            c0, s0 = _cpu_seconds(), _cpu_seconds(server_pid)
            t = time.perf_counter()
            if name == "precast":
                client.fetch_blob(repo, digest, size, out, "blob")
            elif name == "requests":
                with requests.get(url, stream=True) as r, open(out, "wb") as f:
                    for chunk in r.iter_content(1 << 20):
                        f.write(chunk)
            else:
                subprocess.run(["curl", "-sSf", "-o", out, url], check=True)
            best[name] = min(best[name], time.perf_counter() - t)
            cpu[name].append(((_cpu_seconds() - c0) * (1 << 30) / size, (_cpu_seconds(server_pid) - s0) * (1 << 30) / size))
            out.unlink()
    mbs = {k: round(size / v / 1e6) for k, v in best.items()}
    sha = sha256_speed()
    per_gib = {k: (sorted(c for c, _ in v)[len(v) // 2], sorted(r for _, r in v)[len(v) // 2]) for k, v in cpu.items()}
    # What bounds a verified pull here: the CPU seconds per GiB of the client and the registry together, spread over
    # every core, and the sha256, which runs on one core (a digest is one sequential hash): MB/s at best.
    bound = min(os.cpu_count() / sum(per_gib["precast"]), sha * 1e6 / (1 << 30)) * (1 << 30) / 1e6
    return {"bytes": size, "push_seconds": round(push_s, 2), "MB/s": mbs, "sha256_MB/s": sha, "verified_bound_MB/s": round(bound),
            "cpu_s_per_GiB": {k: {"client": round(c, 2), "registry": round(r, 2)} for k, (c, r) in per_gib.items()},
            "load_average": os.getloadavg()[0],
            "ratio_vs_requests": round(mbs["precast"] / mbs["requests"], 2),
            "bound_vs_requests": round(bound / mbs["requests"], 2), "of_bound": round(mbs["precast"] / bound, 2),
            "ratio_vs_curl": round(mbs["precast"] / mbs["curl"], 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.5)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--work", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--keep", action="store_true")
    a = ap.parse_args()
    work = Path(a.work or tempfile.mkdtemp(prefix="precast-registry-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    reg = Registry.start(work / "registry")
    try:
        rows = bundle_rows(work, reg.host)
        blob = throughput(work, reg.host, a.gib, a.rounds, reg.proc.pid)
    finally:
        reg.stop()
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(f"CPU: {cpu_name()} ({os.cpu_count()} cores)")
    for r in rows:
        print(f"{r['what']:<22} {r['seconds']:6.2f} s  {r['bytes'] / 1e6:7.1f} MB moved of {r['of'] / 1e6:.1f} MB")
    m = blob["MB/s"]
    print(f"pull {blob['bytes'] / 2**30:.1f} GiB blob: precast {m['precast']} MB/s, requests GET {m['requests']} MB/s, "
          f"curl {m['curl']} MB/s; ratio {blob['ratio_vs_requests']:.2f}x vs requests (floor 0.8x), "
          f"{blob['ratio_vs_curl']:.2f}x vs curl; push {blob['push_seconds']} s (64 MiB chunks)")
    c = blob["cpu_s_per_GiB"]
    print("CPU s/GiB (median; client + registry): " + ", ".join(f"{k} {v['client']:.2f} + {v['registry']:.2f}"
                                                                for k, v in c.items())
          + f"; sha256 on one core {blob['sha256_MB/s']} MB/s; load average {blob['load_average']:.1f} on "
          f"{os.cpu_count()} cores")
    print(f"bound for a pull that hashes what it receives, on these {os.cpu_count()} cores: {blob['verified_bound_MB/s']} MB/s "
          f"= {blob['bound_vs_requests']:.2f}x the GET (precast reaches {blob['of_bound']:.2f} of it)")
    if a.json:
        Path(a.json).write_text(json.dumps({"cpu": cpu_name(), "bundle": rows, "blob": blob}, indent=2))


if __name__ == "__main__":
    main()
