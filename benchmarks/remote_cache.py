"""Benchmark: the remote build cache and per-machine pulls, full-size SD 1.5, against a local registry
(Debian's docker-registry on 127.0.0.1, as the tests start it: tests/registry.py).

1. `--part cache`: remote-cache hit vs cold build. The full-size SD 1.5 UNet (deterministic random fp16
   weights in the real LDM layout: the checkpoint benchmarks/export_unet.py writes, 2.1 GB) exported fp16
   and compiled for OpenVINO CPU (512x512, batch 1) by `precast build`, three times, each in a fresh cache
   folder: cold with no remote cache, cold with the remote cache (it pushes), and with the remote cache
   holding both entries (it pulls). Wall time of each process; bytes moved; the hit's bundle compared
   with the cold one's (manifest.json and every file's sha256).
2. `--part pull`: bytes a machine downloads vs the whole archive. A bundle of text_encoder, unet,
   vae_encoder and vae_decoder (all fp16: TensorRT-RTX builds no fp32 for sm_75), profiles as
   recipes/sd15.yaml (batch 1-4, 256-768 px), for ONNX Runtime (optimize: false, the shared ONNX),
   TensorRT-RTX sm_75, sm_86, sm_89 and sm_120 (one engine per GPU generation, each built here with no
   GPU), DirectML and OpenVINO CPU; every artifact full size. Its archive is measured (the .tar.zst `bundle
   pack` writes -- the one file a user downloads without a registry -- made by pack's own writer and streamed
   into a byte counter, so that it needs no disk) and the bundle pushed. To hold one copy of the bundle, not
   two, the registry's storage is seeded first with hard links to the bundle's files (distribution's blob and
   layer-link layout), so `precast push` finds each blob by its HEAD and uploads only manifest.json, the config
   and the OCI manifest (push throughput is benchmarks/registry.py's); the pulls are real HTTP downloads.
   Then `precast pull` runs for one device of each kind (`--for` the fingerprint of that target's artifacts)
   and for recorded machines (tests/data/machines, `--sysroot`): bytes downloaded, their ratio to the archive.

Work files (the checkpoint, caches, registry storage, bundles, the archive) live under --work (default
benchmarks/results/work/remote-cache, a folder of its own: other benchmarks share benchmarks/results/work)
and are deleted at the end (--keep keeps them; the checkpoint is reused while it matches). Each step that
writes a copy of the bundle first checks the free disk space (peak about twice the bundle). Usage:
  .venv/bin/python benchmarks/remote_cache.py [--part cache,pull] [--machines rtx3060-desktop,...]
                                              [--work DIR] [--json OUT] [--keep]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "tests"))
from registry import Registry  # noqa: E402  (tests/registry.py: docker-registry on a free port)
from export_unet import ensure_checkpoint  # noqa: E402  (the full-size random SD 1.5 checkpoint)
from machine import describe  # noqa: E402

PROFILES = ("{batch: {min: 1, opt: 1, max: 4}, height: {min: 256, opt: 512, max: 768}, "
            "width: {min: 256, opt: 512, max: 768}, tokens: 77}")
TARGETS = ["onnxruntime: {optimize: false}", *(f"tensorrt-rtx: {{compute_capabilities: [{cc}]}}"
                                              for cc in ("sm_75", "sm_86", "sm_89", "sm_120")),
           "directml", "openvino: {device: CPU}"]
MACHINES = ("rtx3060-desktop", "rtx4070-desktop", "iris-xe-laptop", "m2-mac")


def precast(args: list, env: dict, log: Path) -> tuple[float, dict]:
    """Run `precast ARGS --json` in a fresh process (writeback of earlier files settled first): (seconds, JSON)."""
    os.sync()
    t = time.perf_counter()
    with open(log, "w") as err:
        proc = subprocess.run([sys.executable, "-m", "precast.runtime.cli", *map(str, args), "--json"], env=env,
                              stdout=subprocess.PIPE, stderr=err, text=True)
    seconds = time.perf_counter() - t
    if proc.returncode:
        raise SystemExit(f"precast {args[0]} failed ({proc.returncode}); {log}:\n{log.read_text()[-3000:]}")
    return seconds, json.loads(proc.stdout)


def environment(work: Path, cache: Path, remote: str = "") -> dict:
    (work / "docker").mkdir(exist_ok=True)      # no credentials from this machine
    return {**os.environ, "PRECAST_CACHE": str(cache), "PRECAST_REMOTE_CACHE": remote,
            "DOCKER_CONFIG": str(work / "docker"), "REGISTRY_AUTH_FILE": ""}


def digests(bundle: Path) -> dict[str, str]:
    """sha256 of every file of a bundle by path, manifest.json included (not this machine's verification record)."""
    from precast.runtime.manifest import sha256_file
    return {p.relative_to(bundle).as_posix(): sha256_file(p) for p in sorted(bundle.rglob("*"))
            if p.is_file() and p.name != ".precast-verified.json"}


def archive_size(bundle: Path, fifo: Path) -> int:
    """Bytes of the .tar.zst `precast bundle pack` writes for `bundle` (its own writer, into a FIFO that a
    thread counts), after the same verification pack runs."""
    import threading
    from precast.compiler.bundle_archive import _write_archive
    from precast.runtime.manifest import MANIFEST, read_manifest, verify_bundle
    problems = verify_bundle(bundle)
    if problems:
        raise SystemExit(f"{bundle}: does not verify: {problems[0]}")
    os.mkfifo(fifo)
    counted = [0]

    def count():
        with open(fifo, "rb") as f:
            while block := f.read(1 << 20):
                counted[0] += len(block)
    reader = threading.Thread(target=count)
    reader.start()
    try:
        _write_archive(bundle, [MANIFEST] + sorted(read_manifest(bundle).files), "zst", fifo)
    except BaseException:
        try:                        # a reader still waiting for a writer: let it see the end
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass
        raise
    finally:
        reader.join()
        fifo.unlink()
    return counted[0]


def seed(reg: Registry, repo: str, bundle: Path, m: dict) -> None:
    """Each bundle file linked into the registry's storage as the blob of its digest, and linked into `repo`
    (distribution's filesystem layout): the registry holds no second copy, and its HEAD finds each one."""
    layers = reg.folder / "storage/docker/registry/v2/repositories" / repo / "_layers/sha256"
    for rel, rec in m["files"].items():
        data = reg.blob_path("sha256:" + rec["sha256"])
        data.parent.mkdir(parents=True, exist_ok=True)
        if not data.exists():
            os.link(bundle / rel, data)
        (layers / rec["sha256"]).mkdir(parents=True, exist_ok=True)
        (layers / rec["sha256"] / "link").write_text("sha256:" + rec["sha256"])


def label(artifact: dict) -> str:
    """The target part of an artifact's plan entry: onnxruntime, tensorrt-rtx-sm_86, openvino-CPU, ..."""
    return artifact["plan_entry"].split(".", 1)[1]


def need_space(folder: Path, nbytes: int, what: str) -> None:
    """Stop before `what` when it would leave under 5 GB free (other sessions share the disk)."""
    free = shutil.disk_usage(folder).free
    if free < nbytes + (5 << 30):
        raise SystemExit(f"{what}: {free / 1e9:.1f} GB free, {nbytes / 1e9:.1f} GB needed plus 5 GB to spare; stopped")


def cache_part(work: Path, ckpt: str, px: int) -> dict:
    recipe = work / "sd15-unet.yaml"
    recipe.write_text(f"name: sd15-unet\nmodel: {{source: {ckpt}}}\ncomponents: [unet]\nprecision: fp16\n"
                      f"profiles: {{batch: 1, height: {px}, width: {px}}}\ntargets: [{{openvino: {{device: CPU}}}}]\n")
    reg = Registry.start(work / "registry-cache")
    ref, rows, kept = f"oci://{reg.host}/bench/sd15-cache", [], {}
    try:
        for what, remote in (("cold, no remote cache", ""), ("cold, remote cache (pushes)", ref),
                             ("remote-cache hit (pulls)", ref)):
            cache, out = work / "cache-run", work / "bundle-run"
            shutil.rmtree(cache, ignore_errors=True)
            shutil.rmtree(out, ignore_errors=True)
            print(f"build: {what} ...", flush=True)
            seconds, r = precast(["build", recipe, "--out", out], environment(work, cache, remote),
                                 work / f"build-{len(rows)}.log")
            summary = r.get("remote_cache") or {}
            rows.append({"what": what, "seconds": round(seconds, 1), "reported_s": r["seconds"],
                         "steps": [(a["component"], a["target"], a["cache"], a["seconds"]) for a in r["artifacts"]],
                         "bytes_downloaded": summary.get("bytes_downloaded", 0),
                         "bytes_uploaded": summary.get("bytes_uploaded", 0), "warnings": summary.get("warnings", [])})
            print(f"  {seconds:.1f} s  {rows[-1]['steps']}", flush=True)
            kept[what] = digests(out)
            shutil.rmtree(cache, ignore_errors=True)
            shutil.rmtree(out, ignore_errors=True)
    finally:
        reg.stop()
        shutil.rmtree(work / "registry-cache", ignore_errors=True)
    same = all(d == kept[rows[0]["what"]] for d in kept.values())
    cold, hit = rows[0]["seconds"], rows[2]["seconds"]
    return {"recipe": recipe.read_text(), "rows": rows, "hit_bundle_identical": same,
            "speedup_hit_vs_cold": round(cold / hit, 1)}


def pull_part(work: Path, ckpt: str, profiles: str, machines: tuple[str, ...]) -> dict:
    recipe = work / "sd15-all.yaml"
    recipe.write_text(f"name: sd15\nmodel: {{source: {ckpt}}}\ncomponents: [text_encoder, unet, vae_encoder, "
                      f"vae_decoder]\nprecision: fp16\nprofiles: {profiles}\ntargets:\n"
                      + "".join(f"  - {t}\n" for t in TARGETS))
    cache, bundle = work / "cache-pull", work / "bundle-pull"
    if Path(ckpt).is_file():        # the full-size bundle: about 17 GB, a pulled one up to 4.3 GB more
        need_space(work, 21 << 30, "build")
    print("build: the SD 1.5 bundle for every target ...", flush=True)
    build_s, report = precast(["build", recipe, "--out", bundle], environment(work, cache), work / "build-all.log")
    m = json.loads((bundle / "manifest.json").read_text())
    by_target: dict[str, int] = {}
    for a in m["artifacts"]:
        by_target[label(a)] = by_target.get(label(a), 0) + a["size"]
    onnx = sum(m["files"][rel]["size"] for c in m["components"].values() for rel in c["files"])
    bundle_bytes = sum(r["size"] for r in m["files"].values())
    print("pack (counted) ...", flush=True)
    t = time.perf_counter()
    archive_bytes = archive_size(bundle, work / "archive.fifo")
    pack_s = time.perf_counter() - t
    if Path(ckpt).is_file():        # not needed past the build: its 2.1 GB back before the registry's copy
        Path(ckpt).unlink()
    reg = Registry.start(work / "registry-pull")
    ref = f"oci://{reg.host}/bench/sd15:v1"
    rows = []
    try:
        seed(reg, "bench/sd15", bundle, m)
        print("push ...", flush=True)
        push_s, pushed = precast(["push", bundle, ref], environment(work, cache), work / "push.log")
        shutil.rmtree(bundle)
        shutil.rmtree(cache)
        fingerprints = {}
        for a in m["artifacts"]:
            fingerprints.setdefault(label(a), a["fingerprint"])
        pulls = [(f"--for {name}", ["--for", fp]) for name, fp in fingerprints.items()]
        pulls += [(f"--sysroot {name}", ["--sysroot", ROOT / "tests/data/machines" / name]) for name in machines]
        for what, args in pulls:
            out = work / "pulled"
            print(f"pull {what} ...", flush=True)
            seconds, r = precast(["pull", ref, "--out", out, *args], environment(work, cache), work / "pull.log")
            rows.append({"what": what, "seconds": round(seconds, 1), "bytes_downloaded": r["bytes_downloaded"],
                         "artifacts": r["artifacts"], "onnx": r["onnx"],
                         "ratio_to_archive": round(r["bytes_downloaded"] / archive_bytes, 3)})
            shutil.rmtree(out, ignore_errors=True)
    finally:
        reg.stop()
        shutil.rmtree(work / "registry-pull", ignore_errors=True)
    return {"recipe": recipe.read_text(), "build_seconds": round(build_s, 1), "pack_seconds": round(pack_s, 1),
            "push_seconds_seeded": round(push_s, 1), "bundle_bytes": bundle_bytes, "archive_bytes": archive_bytes,
            "onnx_bytes": onnx, "artifact_bytes_by_target": by_target, "pushed": pushed, "pulls": rows,
            "build_report": report["artifacts"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--part", default="cache,pull")
    ap.add_argument("--machines", default=",".join(MACHINES))
    ap.add_argument("--work", default=str(HERE / "results" / "work" / "remote-cache"))
    ap.add_argument("--json", default=None)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="the tiny demo model at 64 px: checks the script in a minute")
    a = ap.parse_args()
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    ckpt = work / "sd15_random_fp16.safetensors"
    results = {"machine": describe(("openvino", "onnxruntime", "tensorrt_rtx", "requests")),
               "load_before": os.getloadavg()}
    try:
        if a.smoke:
            source, px, profiles = "demo:tiny-sd15", 64, "{batch: 1, height: 64, width: 64}"
        else:
            ensure_checkpoint(ckpt)
            source, px, profiles = str(ckpt), 512, PROFILES
        parts = a.part.split(",")
        if "cache" in parts:
            results["cache"] = cache_part(work, source, px)
        if "pull" in parts:
            results["pull"] = pull_part(work, source, profiles, tuple(n for n in a.machines.split(",") if n))
    finally:
        results["load_after"] = os.getloadavg()
        if a.json:
            Path(a.json).write_text(json.dumps(results, indent=2, default=str))
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    report(results)


def report(r: dict) -> None:
    m = r["machine"]
    print(f"\nCPU: {m['cpu']} ({m['cores']} cores, {m['ram_gib']} GiB); load {r['load_before'][0]:.1f} before, "
          f"{r['load_after'][0]:.1f} after")
    if "cache" in r:
        c = r["cache"]
        print("full-size SD 1.5 UNet, fp16 export + OpenVINO CPU engine (512x512):")
        for row in c["rows"]:
            print(f"  {row['what']:<30} {row['seconds']:7.1f} s   down {row['bytes_downloaded'] / 1e9:5.2f} GB   "
                  f"up {row['bytes_uploaded'] / 1e9:5.2f} GB   {[(s[0], s[2], s[3]) for s in row['steps']]}")
        print(f"  hit vs cold (no remote cache): {c['speedup_hit_vs_cold']}x; hit bundle byte-identical: "
              f"{c['hit_bundle_identical']}")
    if "pull" in r:
        p = r["pull"]
        print(f"SD 1.5 bundle (fp16, 4 components): {p['bundle_bytes'] / 1e9:.2f} GB in the bundle, archive .tar.zst "
              f"{p['archive_bytes'] / 1e9:.2f} GB; ONNX {p['onnx_bytes'] / 1e9:.2f} GB; artifacts: "
              + ", ".join(f"{k} {v / 1e9:.2f} GB" for k, v in p["artifact_bytes_by_target"].items()))
        print(f"  build {p['build_seconds']} s, pack (counted) {p['pack_seconds']} s, push (seeded) "
              f"{p['push_seconds_seeded']} s: {p['pushed']['bytes_uploaded']} bytes uploaded")
        for row in p["pulls"]:
            print(f"  pull {row['what']:<42} {row['bytes_downloaded'] / 1e9:6.2f} GB  ratio {row['ratio_to_archive']:.3f}"
                  f"  {row['seconds']:6.1f} s  onnx: {','.join(row['onnx']) or '-'}")


if __name__ == "__main__":
    main()
