"""`precast pull`: from a registry, the files one machine needs, laid out as an ordinary bundle.

Owns: `choose` (which artifacts and which components' ONNX a pull keeps: what selection -- the same
header-only `select_all` doctor runs, verify=False -- picks on this machine or a recorded one; the
artifacts serving given device fingerprints (`--for`); or everything), `plan_files` (the files that
follow: the chosen artifacts' files, the ONNX of components nothing else serves (or all, --with-onnx),
and what every bundle needs -- tokenizers, configs, embeddings, onnx/'s pipeline JSON -- i.e. every file
no artifact and no component's ONNX owns), `read_remote` (a ref's OCI manifest and manifest.json: all
that choosing needs), `pulled_manifest` (manifest.json listing only what is there, with a `pulled`
record: ref, digest, the files left out with their records, the artifacts left out, `in_store` for a
reference opened in place) and `pull_bundle`.

Where bytes go: blobs download into `.NAME.pull/` beside `--out` (named by digest; `<hex>.partial` while
streaming, resumed with HTTP Range by the next run, renamed only once its sha256 matched), a few at a
time. Files the folder at `--out` already holds with the same record are reused (hashed first), so a
pull that adds --with-onnx or another machine's engines downloads only what is new. The bundle is then
laid out in a staging folder (runtime/staging.py: hard links from `.NAME.pull/`) and put in place whole;
`.NAME.pull/` is removed. One pull into a given `--out` runs at a time (a second waits for the first's
lock). A pull that does not fit the disk's free space is refused before it downloads (one line: the
folder, the bytes needed and free); a disk that fills during it keeps the partial files for the next run
(the error says where and how many bytes are still needed); a blob whose bytes do not match is removed
and refused, never opened. With `store=` (runtime/oci/store.py: references
opened in place) the blobs go to that shared folder instead and stay there, each fetched under a lock
of its own (`.locks/<hex>.lock`, so pulls of two references that share a blob fetch it once), and `.NAME.pull/`
is only the lock.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import threading
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path

from filelock import FileLock

from ..errors import UserError
from ..families import component_requests
from ..fileops import WINDOWS, hold_path
from ..fingerprint import Fingerprint, why_not_serves
from ..image_size import optimal_size
from ..manifest import MANIFEST, Manifest, read_manifest, verify_file
from ..manifest_schema import check_manifest
from ..progress import bar
from ..select import select_all
from ..staging import Staging
from .artifact import Layer, read_oci_manifest
from .client import Registry, RegistryError
from .ref import Ref
from .stream import DiskFull


@dataclass
class PullResult:
    ref: str
    digest: str
    out: str
    artifacts: list[str]            # kept, by id
    onnx: list[str]                 # components whose ONNX was kept
    files: int                      # files in the pulled bundle (manifest.json aside)
    downloaded: int                 # of those, fetched now (distinct blobs)
    bytes_downloaded: int           # bytes received over the network now (resumed parts not counted twice)
    reused: int                     # files taken from the earlier bundle at --out or an earlier run's blobs
    bytes_total: int                # the pulled bundle's files
    left_out: int                   # files not pulled
    bytes_left_out: int
    seconds: float
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


def choose(m: Manifest, machine=None, fingerprints: tuple[str, ...] = (), everything: bool = False,
           with_onnx: bool = False) -> tuple[set[str], set[str]]:
    """(artifact ids, components whose ONNX to keep). `machine`: runtime/api.py's Machine (devices,
    placements, installed backends) whose selection decides; `fingerprints`: device fingerprint strings
    (`backend/version/vendor-type/arch[/driver>=X]`, as `precast doctor --json` shows a device's) whose
    serving artifacts are kept; `everything`: all of it."""
    if everything:
        return {a.id for a in m.artifacts()}, set(m.components)
    arts: set[str] = set()
    onnx = set(m.components) if with_onnx else set()
    if fingerprints:
        devices = []
        for text in fingerprints:
            try:
                devices.append(Fingerprint.from_string(text))
            except ValueError as e:
                raise UserError(f"--for {text!r}: {e}") from None
        for c in m.components:
            serving = [a.id for a in m.artifacts(c) if any(
                why_not_serves(Fingerprint.from_string(a.fingerprint), d) is None for d in devices)]
            arts.update(serving)
            if not serving:
                onnx.add(c)
        return arts, onnx
    w, h = optimal_size(m)
    requests = component_requests(m, 1, h, w)
    for c, sel in select_all(m, machine.placements, machine.devices, requests, machine.installed, False).items():
        if sel.choice is not None and sel.choice.artifact is not None:
            arts.add(sel.choice.artifact.id)
        else:                  # the bundle's ONNX runs it there (or nothing does: the ONNX is the best there is)
            onnx.add(c)
    return arts, onnx


def plan_files(m: Manifest, arts: set[str], onnx: set[str]) -> tuple[dict[str, dict], dict[str, dict]]:
    """(files kept, files left out): path -> record."""
    owned = {rel for a in m.artifacts() for rel in a.files} | {rel for c in m.components.values() for rel in c["files"]}
    keep = {rel for rel in m.files if rel not in owned}
    keep |= {rel for a in m.artifacts() if a.id in arts for rel in a.files}
    keep |= {rel for c in onnx for rel in m.components[c]["files"]}
    return ({rel: m.files[rel] for rel in sorted(keep)},
            {rel: rec for rel, rec in sorted(m.files.items()) if rel not in keep})


def pulled_manifest(data: dict, keep: dict, left_out: dict, arts: set[str], ref: Ref, digest: str,
                    in_store: bool = False) -> dict:
    """`in_store`: laid out in the store for a reference opened in place (runtime/oci/store.py), not by `precast
    pull` (the hints for what was left out differ)."""
    earlier = (data.get("pulled") or {})
    out = {**data, "files": dict(keep), "artifacts": sorted((a for a in data["artifacts"] if a["id"] in arts),
                                                            key=lambda a: a["id"])}
    out["pulled"] = {"ref": str(ref), "digest": digest,
                     "left_out": dict(sorted({**earlier.get("left_out", {}), **left_out}.items())),
                     "artifacts_left_out": sorted({*earlier.get("artifacts_left_out", ()),
                                                   *(a["id"] for a in data["artifacts"] if a["id"] not in arts)})}
    if in_store:
        out["pulled"]["in_store"] = True
    return out


@dataclass
class Remote:
    """A bundle in a registry as its OCI manifest and manifest.json describe it (nothing else downloaded)."""
    ref: Ref
    digest: str                     # the OCI manifest's
    layers: dict[str, Layer]        # by bundle path, with their annotations
    data: dict                      # the bundle's manifest.json, checked


def read_remote(ref: Ref, registry: Registry, store: Path | None = None) -> Remote:
    """The OCI manifest and the bundle's manifest.json of `ref` (its blob taken from, and kept in, the blob
    folder `store` when one is given)."""
    body, media, digest = registry.get_manifest(ref)
    layers = read_oci_manifest(ref, body, media)
    first = layers[MANIFEST]
    kept = store / first.digest.removeprefix("sha256:") if store is not None else None
    if kept is not None and kept.is_file() and kept.stat().st_size == first.size:
        raw = kept.read_bytes()
    else:
        raw = registry.blob_bytes(ref.repository, first.digest, first.size, f"{ref} {MANIFEST}")
        if kept is not None:
            kept.parent.mkdir(parents=True, exist_ok=True)
            temp = kept.with_name(f"{kept.name}.{os.getpid()}-{threading.get_ident()}.tmp")
            temp.write_bytes(raw)
            os.replace(temp, kept)
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        raise RegistryError(f"{ref}: its {MANIFEST} is not JSON; not a bundle precast pushed") from None
    return Remote(ref, digest, layers, check_manifest(data, f"{ref} {MANIFEST}"))


def pull_bundle(ref: Ref, out: str | Path, registry: Registry, *, machine=None, fingerprints: tuple[str, ...] = (),
                everything: bool = False, with_onnx: bool = False, workers: int = 4,
                progress: bool = True, store: Path | None = None, remote: Remote | None = None) -> PullResult:
    """`store`: a blob folder kept across pulls (runtime/oci/store.py's) instead of `.NAME.pull/`; each blob
    is then downloaded under a lock of its own, and the bundle at `out` keeps what it already holds from the
    same OCI manifest (a later pull for other engines adds to it)."""
    t0 = time.perf_counter()
    out = Path(out)
    _check_out(out)
    remote = remote or read_remote(ref, registry, store)
    digest, layers, data = remote.digest, remote.layers, remote.data
    m = Manifest(out, data)
    lock = out.parent / f".{out.name}.pull"
    work = lock if store is None else store
    fd = _lock(lock, out)
    try:
        arts, onnx = choose(m, machine, fingerprints, everything, with_onnx)
        if store is not None:          # under the lock: what a pull beside this one just laid out is kept
            arts, onnx = _with_earlier(out, digest, m, arts, onnx)
        keep, left_out = plan_files(m, arts, onnx)
        for rel, rec in keep.items():
            layer = layers.get(rel)
            if layer is None or layer.digest != "sha256:" + rec["sha256"] or layer.size != rec["size"]:
                raise RegistryError(f"{ref}: the OCI manifest and the bundle's {MANIFEST} disagree about {rel} (missing "
                                    "or another digest); push the bundle again")
        result = PullResult(str(ref), digest, str(out), sorted(arts), sorted(onnx), len(keep), 0, 0, 0,
                            sum(r["size"] for r in keep.values()), len(left_out),
                            sum(r["size"] for r in left_out.values()), 0.0)
        if store is not None and _holds(out, digest, keep):      # a pull beside this one laid it out meanwhile
            result.reused = len(keep)
        else:
            _fetch_and_lay_out(ref, out, registry, work, keep, left_out, data, arts, digest, result, workers, progress,
                               store is not None)
        shutil.rmtree(lock, ignore_errors=True)
    except BaseException:
        try:
            os.rmdir(lock)           # left only when it holds partial files to resume
        except OSError:
            pass
        raise
    finally:
        if fd is not None:
            os.close(fd)
    result.seconds = round(time.perf_counter() - t0, 3)
    return result


def _fetch_and_lay_out(ref, out, registry, work, keep, left_out, data, arts, digest, result, workers, progress,
                       shared) -> None:
    """The missing blobs into `work` (each under its own lock when the folder is `shared` between pulls), then
    the bundle laid out from them in a staging folder and put at `out` whole."""
    (work / ".locks" if shared else work).mkdir(parents=True, exist_ok=True)
    blobs = _gather(work, out, keep, result)
    missing = {rec["sha256"]: (rel, rec["size"]) for rel, rec in keep.items() if not (work / rec["sha256"]).exists()}
    if _left(work, missing) > shutil.disk_usage(work).free:
        raise _no_room(out, work, missing, shared, during=False)

    def fetch(kv):
        hexd, (rel, size) = kv
        with (FileLock(work / ".locks" / f"{hexd}.lock") if shared else nullcontext()):
            if (work / hexd).exists():           # another pull fetched it while this one waited
                return 0
            return registry.fetch_blob(ref.repository, "sha256:" + hexd, size, work / hexd, rel, on_bytes=meter.update)
    with bar(sum(size for _, size in missing.values()), f"pull {ref}", enabled=progress) as meter:
        try:
            got = registry.parallel(fetch, sorted(missing.items(), key=lambda kv: -kv[1][1]), workers)
        except DiskFull:
            raise _no_room(out, work, missing, shared, during=True) from None
    result.downloaded, result.bytes_downloaded = sum(1 for n in got if n), sum(got)
    with Staging(out, "pulling") as stage:
        result.notes += stage.recovered
        for rel, rec in keep.items():
            dest = stage.path / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            _link(blobs.get(rel, work / rec["sha256"]), dest)
        (stage.path / MANIFEST).write_text(json.dumps(pulled_manifest(data, keep, left_out, arts, ref, digest, shared),
                                                      indent=2, sort_keys=True) + "\n")
        stage.commit()


def _left(work: Path, missing: dict) -> int:
    """Bytes still to download of `missing` (hex -> (path, size)): what their .partial files hold is done."""
    def have(hexd: str) -> int:
        try:
            return (work / f"{hexd}.partial").stat().st_size
        except OSError:
            return 0
    return sum(max(size - have(h), 0) for h, (_, size) in missing.items() if not (work / h).exists())


def _no_room(out: Path, work: Path, missing: dict, shared: bool, during: bool) -> UserError:
    """One line: the folder, the bytes still needed there and those free, and what became of the partial files."""
    need, free = _left(work, missing), shutil.disk_usage(work).free
    where, elsewhere = ((f"the store {work}", "point PRECAST_CACHE at") if shared else
                        (f"--out {out}", "give an --out on"))
    return UserError(f"{where}: {'the disk filled during the pull' if during else 'not enough disk space'}: {need} more "
                     f"bytes ({need / 1e6:.1f} MB) are needed there and {free} ({free / 1e6:.1f} MB) are free; free "
                     f"space there or {elsewhere} a disk with room; " + (
                         f"what was downloaded stays in {work} and the same command resumes from it"
                         + ("" if shared else f" (remove {work} to drop it)") if during else "nothing was downloaded"))


def _earlier(out: Path, digest: str) -> Manifest | None:
    """The bundle at `out` when a pull of the same OCI manifest made it, else None."""
    try:
        m = read_manifest(out) if (out / MANIFEST).is_file() else None
    except UserError:
        return None
    return m if m is not None and (m.data.get("pulled") or {}).get("digest") == digest else None


def _with_earlier(out: Path, digest: str, m: Manifest, arts: set[str], onnx: set[str]) -> tuple[set[str], set[str]]:
    """The choice widened by what the bundle at `out` already holds from the same OCI manifest."""
    before = _earlier(out, digest)
    if before is None:
        return arts, onnx
    ids = {a["id"] for a in m.data["artifacts"]}
    return (arts | ({a["id"] for a in before.data["artifacts"]} & ids),
            onnx | {c for c, comp in m.components.items() if comp["files"] and all(r in before.files for r in comp["files"])})


def _holds(out: Path, digest: str, keep: dict) -> bool:
    """Whether the bundle at `out`, pulled from the same OCI manifest, lists exactly `keep`."""
    before = _earlier(out, digest)
    return before is not None and before.files == keep


def _check_out(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out}: is a file; give a folder for the bundle")
    if out.is_dir() and any(out.iterdir()) and not (out / MANIFEST).is_file():
        raise UserError(f"--out {out}: a folder that is not a bundle (no {MANIFEST}); give a new or empty folder, "
                        "or a bundle to replace")


def _lock(work: Path, out: Path) -> int | None:
    """An exclusive lock on `.NAME.pull/` (one pull into `out` at a time; a second waits). None on Windows."""
    said = False
    while True:
        work.mkdir(parents=True, exist_ok=True)
        fd = hold_path(work)
        if fd is None and WINDOWS:
            return None
        if fd is not None:
            try:
                if os.stat(work).st_ino == os.fstat(fd).st_ino:     # not a folder the earlier pull just removed
                    return fd
            except FileNotFoundError:
                pass
            os.close(fd)
            continue
        if not said:
            print(f"waiting for another pull into {out} to finish", file=sys.stderr, flush=True)
            said = True
        time.sleep(0.1)


def _gather(work: Path, out: Path, keep: dict, result: PullResult) -> dict[str, Path]:
    """Files already here: blobs an earlier run finished in `work`, and files of the bundle at `out` whose
    record is the same and whose bytes match it (linked into `work`). rel -> the path to lay out from."""
    found: dict[str, Path] = {}
    try:
        before = read_manifest(out).files if (out / MANIFEST).is_file() else {}
    except UserError:
        before = {}
    for rel, rec in keep.items():
        blob = work / rec["sha256"]
        if blob.exists():
            found[rel] = blob
        elif before.get(rel) == rec and verify_file(out, rel, rec) is None:
            _link(out / rel, blob)
            found[rel] = blob
        else:
            continue
        result.reused += 1
    return found


def _link(src: Path, dest: Path) -> None:
    try:
        os.link(src, dest)
    except FileExistsError:
        pass
    except OSError:
        shutil.copyfile(src, dest)
