"""References opened in place: a local content-addressed store of blobs, and a pulled bundle per reference.

Owns: the store's layout (the store lives in `$PRECAST_CACHE/oci/`, else `oci/` in the user cache folder
platformdirs names for precast -- the folder the build cache uses: store_gc.store_root), `open_ref` (an `oci://` reference as a bundle
folder: what this machine selects pulled into the store, or found there when the registry cannot be
reached) and `Opened` (what opening it found, downloaded or would download). runtime/api.py's `open_bundle`,
`precast generate oci://...` and `precast doctor oci://...` are built on it.

    blobs/sha256/<hex>              one file per blob: renamed in whole only once its sha256 matched
    blobs/sha256/<hex>.partial      a download in progress (the next open resumes it with HTTP Range)
    blobs/sha256/.locks/<hex>.lock  held while one process downloads that blob
    refs/<host[_port]>/<repository>/<tag | sha256-HEX>/   an ordinary pulled bundle: hard links into blobs/

A blob is stored once whatever the references that hold it: a second model whose VAE is the first's
downloads nothing for it. Opening a reference asks the registry for its manifest (the tag may have moved)
and pulls what is missing (runtime/oci/pull.py, `store=`: the per-reference lock, per-blob locks, staging
put in place whole); a reference whose folder already holds what this machine selects downloads nothing
but the manifest. Registry unreachable: a reference pulled before opens from its folder with a one-line
note; one never pulled is one line naming the registry.

Opens hold the store's lock shared (store_gc.py's `store_lock`), so that `precast cache gc` (store_gc.py's
`collect`) removes nothing an open is using; each open marks its reference's folder as used now (mtime).
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..errors import UserError
from ..manifest import MANIFEST, Manifest, read_manifest
from .client import Registry, Unreachable
from .pull import PullResult, choose, plan_files, pull_bundle, read_remote
from .ref import Ref, parse_ref
from .store_gc import store_lock, store_root


@dataclass
class Opened:
    """An `oci://` reference opened through the store."""
    ref: str
    store: str                          # the store's folder
    folder: str                         # the reference's bundle in the store (absent while nothing was pulled)
    digest: str | None                  # the OCI manifest's (None offline, when the folder does not say)
    data: dict                          # the bundle's manifest.json: the remote one when nothing was pulled
    files: list[dict] = field(default_factory=list)   # what this machine needs: path, size, role, component, stored
    bytes_needed: int = 0               # of those, not in the store yet: what a pull downloads
    pulled: PullResult | None = None    # what opening it downloaded (None: nothing pulled, as for doctor)
    note: str | None = None             # said on stderr (offline)

    @property
    def local(self) -> bool:
        """Whether `folder` holds the bundle (pulled now or before); else only its manifest was read."""
        return self.pulled is not None or self.note is not None

    def manifest(self) -> Manifest:
        """The bundle's manifest: read from `folder` when it is there, else the remote one (no file checked)."""
        return read_manifest(self.folder) if self.local else Manifest(Path(self.folder), self.data)

    def as_dict(self) -> dict:
        out = asdict(self)
        out.pop("data")
        return out

    def lines(self) -> list[str]:
        """What `precast doctor` says about it."""
        head = f"remote    {self.ref}" + (f"@{self.digest[:19]}...: " if self.digest else ": ")
        if self.note is not None:
            return [head + f"the registry is unreachable: opened as pulled before from {self.folder}"]
        if self.pulled is not None:
            return [head + f"pulled into {self.folder}: {_mb(self.pulled.bytes_downloaded)} downloaded, "
                           f"{self.pulled.reused} of {self.pulled.files} files already in the store"]
        need = [f for f in self.files if not f["stored"]]
        return [head + f"a pull for this machine downloads {len(need)} files, {_mb(self.bytes_needed)}; the store "
                       f"({self.store}) has {len(self.files) - len(need)} of the {len(self.files)} it needs"] + [
            f"download  {_mb(f['size']):>9}  {f['path']}  ({f['role']}" + (f" of {f['component']})" if f["component"]
                                                                        else ")") for f in need]


def ref_folder(root: Path, ref: Ref) -> Path:
    name = "sha256-" + ref.digest.removeprefix("sha256:") if ref.digest else ref.tag
    return root / "refs" / ref.registry.replace(":", "_").strip("[]") / ref.repository / name


def open_ref(text: str, machine, *, pull: bool = True, env=os.environ, progress: bool = True, ca: str | None = None,
             plain_http: bool = False) -> Opened:
    """`text` (oci://...) through the store at store_root(): with `pull`, what `machine`'s selection needs is
    downloaded there (a pull's choice, widened by what the folder holds from the same manifest); without,
    nothing but the manifest and manifest.json is read and `Opened.files` says what a pull would fetch.
    `ca`, `plain_http`: the registry's, as --ca / --plain-http (the environment's otherwise)."""
    ref = parse_ref(text)
    root = store_root(env)
    blobs, folder = root / "blobs" / "sha256", ref_folder(root, ref)
    registry = Registry.for_ref(ref, env=env, ca=ca, plain_http=plain_http)
    with store_lock(root, exclusive=False):
        return _open(ref, root, folder, blobs, registry, machine, pull, progress)


def _open(ref: Ref, root: Path, folder: Path, blobs: Path, registry: Registry, machine, pull: bool,
          progress: bool) -> Opened:
    try:
        remote = read_remote(ref, registry, blobs)
    except Unreachable as e:
        return _offline(ref, root, folder, e)
    m = Manifest(folder, remote.data)
    keep, _ = plan_files(m, *choose(m, machine))
    files = [{"path": rel, "size": rec["size"], "role": remote.layers[rel].annotations.get("dev.precast.role"),
              "component": remote.layers[rel].annotations.get("dev.precast.component"),
              "stored": (blobs / rec["sha256"]).is_file()} for rel, rec in keep.items()]
    opened = Opened(str(ref), str(root), str(folder), remote.digest, remote.data, files,
                    sum(f["size"] for f in files if not f["stored"]))
    if pull:
        opened.pulled = pull_bundle(ref, folder, registry, machine=machine, progress=progress, store=blobs,
                                    remote=remote)
        os.utime(folder)                # when it was last opened: what collect's size limit goes by
        if opened.pulled.bytes_downloaded:
            _say(f"pulled {ref} into the store ({root}): {_mb(opened.pulled.bytes_downloaded)} downloaded, "
                 f"{opened.pulled.reused} of {opened.pulled.files} files already there")
    return opened


def _offline(ref: Ref, root: Path, folder: Path, e: Unreachable) -> Opened:
    try:
        data = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError, RecursionError):
        raise UserError(f"{ref.registry} is unreachable ({e.reason}) and {ref} was never pulled into the store "
                        f"({root}): nothing to open offline; check the reference and the network") from None
    digest = (data.get("pulled") or {}).get("digest")
    note = (f"{ref.registry} is unreachable ({e.reason}): opening {ref} as pulled before"
            f"{f' ({digest[:19]}...)' if digest else ''} from the store, {folder}")
    _say(note)
    try:
        os.utime(folder)
    except OSError:
        pass
    return Opened(str(ref), str(root), str(folder), digest, data, note=note)


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def _say(line: str) -> None:
    try:
        print(f"note: {line}", file=sys.stderr, flush=True)
    except (OSError, ValueError):      # stderr closed: a note is not worth failing for
        pass
