"""Bundle manifests: reading them and verifying every file a bundle holds.

Owns: `read_manifest` (manifest.json read and checked: runtime/manifest_schema.py), `Manifest` (its
components, artifacts and files, each file checked against its record through runtime/digests.py and
runtime/verified.py's records), `ModelInfo` (the typed view of the manifest's `model`: what the family
pipelines read), and `verify_bundle`, which re-hashes every file and names every changed, missing or
unexpected file. Standard library only: the runtime is thin.

Which digest protects what: `files[rel].sha256` (and its `pieces`) is the one that protects bytes: each
file is checked against it before it is read, by `bundle verify`, and as it is unpacked. An artifact's
`sha256` and `size` repeat its entry file's sha256 and its files' total size for readers of one record;
check_manifest refuses a manifest where they disagree with `files` (one line naming the artifact and the
field). The model's `source_sha256` and the `sha256` of its vae, text_encoders, controlnets, loras and
embeddings are provenance, not integrity: they name the inputs the bundle was built from (files that are
not in it; `bundle merge` joins only shards whose model records are equal), and nothing here can check
them. manifest.json itself carries no digest of its own; its structure is what check_manifest checks.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from .digests import PIECE, bytes_hashed, file_record, piece_digests, sha256_file, verify_file  # noqa: F401
from .errors import UserError
from .manifest_schema import (MAX_PROFILE_SIDE, PREDICTIONS, SCHEMA, ManifestError, check_manifest,  # noqa: F401
                              path_problem)
from .verified import RECORD_FILE, VerifiedFiles, verify_mode

MANIFEST = "manifest.json"
# digests.py and manifest_schema.py names are re-exported above: a manifest's users take them from here


@dataclass(frozen=True)
class Artifact:
    id: str
    component: str
    backend: str
    fingerprint: str
    entry: str                  # path of the file a session opens, relative to the bundle
    files: tuple[str, ...]      # every file it needs, relative to the bundle
    shapes: dict                # input -> [min, opt, max]
    metadata: dict              # backend details (compile config, CCs, ...)


@dataclass(frozen=True)
class ModelInfo:
    """The manifest's `model` as the runtime reads it (its types checked when the manifest was read): the
    family and variant, how latents are scaled, and, where the build recorded them, the released model's
    schedule and generation defaults (flow-matching families) and T5 length. None: not recorded."""
    family: str | None
    variant: str
    prediction: str
    latent_scale: float | None
    latent_shift: float | None
    scheduler: dict | None
    steps: int | None
    guidance: float | None
    t5_tokens: int | None

    @classmethod
    def of(cls, model: dict) -> "ModelInfo":
        return cls(model.get("family"), model.get("variant") or "", model.get("prediction") or "epsilon",
                   model.get("latent_scale") or None, model.get("latent_shift"), model.get("scheduler") or None,
                   model.get("steps") or None, model.get("guidance"), model.get("t5_tokens") or None)


@dataclass(frozen=True)
class Manifest:
    root: Path
    data: dict
    verified: VerifiedFiles | None = field(default=None, compare=False, repr=False)   # None: records off

    def with_verify(self, verify) -> "Manifest":
        """This manifest with the verification `verify` asks for (runtime/verified.py's verify_mode):
        True/"auto" trusts records of unchanged file states, "full" hashes every file again and
        refreshes the records, False checks no engine or ONNX file at all (callers skip them)."""
        mode = verify_mode(verify)
        return Manifest(self.root, self.data, VerifiedFiles(self.root, full=mode == "full", known=self.files))

    def verify_file(self, rel: str, whole: bool = False) -> str | None:
        """verify_file for a listed file, through (and recording into) this manifest's records."""
        return verify_file(self.root, rel, self.files[rel], whole, self.verified)

    def save_records(self) -> None:
        if self.verified is not None:
            self.verified.save()

    @property
    def model(self) -> dict:
        return self.data["model"]

    @property
    def info(self) -> ModelInfo:
        """The typed view of `model` the pipelines read."""
        return ModelInfo.of(self.data["model"])

    @property
    def components(self) -> dict[str, dict]:
        return self.data["components"]

    @property
    def files(self) -> dict[str, dict]:
        return self.data["files"]

    @property
    def left_out(self) -> dict[str, dict]:
        """Files a pull left out by design (a pulled bundle's `pulled.left_out`): path -> record."""
        return (self.data.get("pulled") or {}).get("left_out") or {}

    def onnx_left_out(self, component: str, module: str = "all") -> str | None:
        """Why the component's ONNX is not in this bundle by design (a pull left it out) and how to add it, or
        None: `precast pull` again with --with-onnx, or for a reference opened in place (the store's), open it
        with `--backend MODULE=onnxruntime` (`module`: the component's, in the --backend grammar)."""
        comp = self.data["components"].get(component) or {}
        if not any(rel in self.left_out for rel in comp.get("files", ())):
            return None
        ref = self.data["pulled"]["ref"]
        if self.data["pulled"].get("in_store"):
            return (f"the bundle's ONNX was left out when {ref} was opened in place (an engine served this component "
                    f"on this machine): open it with --backend {module}=onnxruntime (open_bundle's backend=) to add it "
                    f"to the store, or `precast pull {ref} --with-onnx --out DIR` for a folder that holds it")
        return (f"the bundle's ONNX was left out by `precast pull` from {ref} (an engine served this component on the "
                f"machine it was pulled for): `precast pull {ref} --with-onnx --out {self.root}` adds it")

    def check_file(self, rel: str, required: bool = True) -> None:
        """Raise a UserError naming `rel` unless it matches its record (size, sha256). A file the
        manifest does not list is an error when required or when it is present anyway."""
        where = f"{self.root}/{rel}"
        if rel not in self.files:
            if required or os.path.lexists(self.root / rel):
                raise UserError(f"{where}: not listed in the bundle's manifest, so it cannot be checked; "
                                "the bundle was changed after it was built: rebuild or re-download it")
            return
        problem = self.verify_file(rel)
        self.save_records()
        if problem:
            raise UserError(f"{self.root}/{problem}; refusing to read it: rebuild or re-download the bundle")

    def artifacts(self, component: str | None = None) -> list[Artifact]:
        out = []
        for a in self.data["artifacts"]:
            if component is None or a["component"] == component:
                out.append(Artifact(a["id"], a["component"], a["backend"], a["fingerprint"], a["entry"],
                                    tuple(a["files"]), a.get("shapes", {}), a.get("metadata", {})))
        return out


_NOT_A_FOLDER = ("{root}: not a precast bundle: it is a file, not a folder (a bundle is a folder holding "
                 f"{MANIFEST}; unpack an archive with `precast bundle unpack`)")


def read_manifest(bundle: str | Path) -> Manifest:
    root = Path(bundle)
    path = root / MANIFEST
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        if not os.path.lexists(root):
            raise ManifestError(f"{root}: not a precast bundle: the path does not exist (check it; a bundle is "
                                "the folder `precast build` or `precast bundle unpack` wrote)") from None
        if not root.is_dir():
            raise ManifestError(_NOT_A_FOLDER.format(root=root)) from None
        if (root / "precast_export.json").is_file():
            raise ManifestError(f"{root}: not a precast bundle but an export (ONNX, no {MANIFEST}); make a bundle "
                                "with `precast build RECIPE --out DIR`, or engines with `precast compile`") from None
        raise ManifestError(f"{root}: not a precast bundle (no {MANIFEST})") from None
    except NotADirectoryError:
        raise ManifestError(_NOT_A_FOLDER.format(root=root)) from None
    except RecursionError:
        raise ManifestError(f"{path}: unreadable (nested too deeply)") from None
    except (OSError, ValueError) as e:
        raise ManifestError(f"{path}: unreadable ({e})") from None
    data = check_manifest(data, str(path))
    return Manifest(root, data, VerifiedFiles(root, known=data["files"]))


def verify_bundle(bundle: str | Path) -> list[str]:
    """Problems found, one line each naming the file; empty when the bundle is intact. Every file
    is hashed again (records are not trusted here) and the records are refreshed; the record file
    (verified.RECORD_FILE) is the one file a bundle may hold besides those its manifest lists."""
    m = read_manifest(bundle).with_verify("full")
    problems = [p for rel in sorted(m.files) if (p := m.verify_file(rel, whole=True))]
    m.save_records()
    listed = set(m.files) | {MANIFEST, RECORD_FILE}
    for p in sorted(m.root.rglob("*")):
        rel = p.relative_to(m.root).as_posix()
        if (p.is_file() or p.is_symlink()) and rel not in listed:
            problems.append(f"{rel}: not listed in the manifest")
    return problems
