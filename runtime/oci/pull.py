"""`precast pull`: from a registry, the files one machine needs, laid out as an ordinary bundle.

Owns: `choose` (which artifacts and which components' ONNX a pull keeps: what selection -- the same
header-only `select_all` doctor runs, verify=False -- picks on this machine or a recorded one; the
artifacts serving given device fingerprints (`--for`); or everything), `plan_files` (the files that
follow: the chosen artifacts' files, the ONNX of components nothing else serves (or all, --with-onnx),
and what every bundle needs -- tokenizers, configs, embeddings, onnx/'s pipeline JSON -- i.e. every file
no artifact and no component's ONNX owns), `pulled_manifest` (manifest.json listing only what is there,
with a `pulled` record: ref, digest, the files left out with their records, the artifacts left out) and
`pull_bundle`.

Where bytes go: blobs download into `.NAME.pull/` beside `--out` (named by digest; `<hex>.partial` while
streaming, resumed with HTTP Range by the next run, renamed only once its sha256 matched), a few at a
time. Files the folder at `--out` already holds with the same record are reused (hashed first), so a
pull that adds --with-onnx or another machine's engines downloads only what is new. The bundle is then
laid out in a staging folder (runtime/staging.py: hard links from `.NAME.pull/`) and put in place whole;
`.NAME.pull/` is removed. One pull into a given `--out` runs at a time (a second waits for the first's
lock). A full disk keeps the partial file for the next run (the error says where); a blob whose bytes
do not match is removed and refused, never opened.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..errors import UserError
from ..families import family_of
from ..fileops import WINDOWS, hold_path
from ..fingerprint import Fingerprint, why_not_serves
from ..image_size import optimal_size
from ..manifest import MANIFEST, Manifest, read_manifest, verify_file
from ..manifest_schema import check_manifest
from ..progress import bar
from ..select import select_all
from ..staging import Staging
from .artifact import read_oci_manifest
from .client import Registry, RegistryError
from .ref import Ref


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
    requests = family_of(m).requests(m, 1, h, w)
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


def pulled_manifest(data: dict, keep: dict, left_out: dict, arts: set[str], ref: Ref, digest: str) -> dict:
    earlier = (data.get("pulled") or {})
    out = {**data, "files": dict(keep), "artifacts": sorted((a for a in data["artifacts"] if a["id"] in arts),
                                                            key=lambda a: a["id"])}
    out["pulled"] = {"ref": str(ref), "digest": digest,
                     "left_out": dict(sorted({**earlier.get("left_out", {}), **left_out}.items())),
                     "artifacts_left_out": sorted({*earlier.get("artifacts_left_out", ()),
                                                   *(a["id"] for a in data["artifacts"] if a["id"] not in arts)})}
    return out


def pull_bundle(ref: Ref, out: str | Path, registry: Registry, *, machine=None, fingerprints: tuple[str, ...] = (),
                everything: bool = False, with_onnx: bool = False, workers: int = 4,
                progress: bool = True) -> PullResult:
    t0 = time.perf_counter()
    out = Path(out)
    _check_out(out)
    body, media, digest = registry.get_manifest(ref)
    layers = read_oci_manifest(ref, body, media)
    first = layers[MANIFEST]
    raw = registry.blob_bytes(ref.repository, first.digest, first.size, f"{ref} {MANIFEST}")
    try:
        data = json.loads(raw)
    except ValueError:
        raise RegistryError(f"{ref}: its {MANIFEST} is not JSON; not a bundle precast pushed") from None
    m = Manifest(out, check_manifest(data, f"{ref} {MANIFEST}"))
    arts, onnx = choose(m, machine, fingerprints, everything, with_onnx)
    keep, left_out = plan_files(m, arts, onnx)
    for rel, rec in keep.items():
        layer = layers.get(rel)
        if layer is None or layer.digest != "sha256:" + rec["sha256"] or layer.size != rec["size"]:
            raise RegistryError(f"{ref}: the OCI manifest and the bundle's {MANIFEST} disagree about {rel} (missing or "
                                "another digest); push the bundle again")
    result = PullResult(str(ref), digest, str(out), sorted(arts), sorted(onnx), len(keep), 0, 0, 0,
                        sum(r["size"] for r in keep.values()), len(left_out),
                        sum(r["size"] for r in left_out.values()), 0.0)
    work = out.parent / f".{out.name}.pull"
    fd = _lock(work, out)
    try:
        blobs = _gather(work, out, keep, result)
        missing = {rec["sha256"]: (rel, rec["size"]) for rel, rec in keep.items() if not (work / rec["sha256"]).exists()}
        with bar(sum(size for _, size in missing.values()), f"pull {ref}", enabled=progress) as b:
            got = registry.parallel(lambda kv: registry.fetch_blob(
                ref.repository, "sha256:" + kv[0], kv[1][1], work / kv[0], kv[1][0], on_bytes=b.update),
                sorted(missing.items(), key=lambda kv: -kv[1][1]), workers)
        result.downloaded, result.bytes_downloaded = len(missing), sum(got)
        with Staging(out, "pulling") as stage:
            result.notes += stage.recovered
            for rel, rec in keep.items():
                dest = stage.path / rel
                dest.parent.mkdir(parents=True, exist_ok=True)
                _link(blobs.get(rel, work / rec["sha256"]), dest)
            (stage.path / MANIFEST).write_text(json.dumps(pulled_manifest(data, keep, left_out, arts, ref, digest),
                                                          indent=2, sort_keys=True) + "\n")
            stage.commit()
        shutil.rmtree(work, ignore_errors=True)
    finally:
        if fd is not None:
            os.close(fd)
    result.seconds = round(time.perf_counter() - t0, 3)
    return result


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
