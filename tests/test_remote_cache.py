"""The remote build cache against a real registry (tests/registry.py: Debian's docker-registry on 127.0.0.1):
two builds of one recipe in separate cache folders -- the second exports and compiles nothing the first
pushed and writes a byte-identical bundle; a read-only cache pushes nothing; `build --exports-only` then a
shard (CI's plan job and a matrix job); `compile --remote-cache`; a registry that is not there and a blob
damaged in the registry's storage are one warning each and an ordinary build (an error with
--remote-cache-strict); settings that do not parse are one error line."""
import json
import os
import urllib.request
from pathlib import Path

import pytest

from conftest import flip_byte, precast
from registry import BINARY, Registry, free_port

pytestmark = pytest.mark.skipif(not os.path.exists(BINARY), reason=f"{BINARY} is not installed (Debian's "
                                "docker-registry package: `make test-setup` installs it)")
RECIPE = ("model: {source: demo:tiny-sd15}\ncomponents: [text_encoder, unet, vae_decoder]\n"
          "profiles: {batch: 1, height: 64, width: 64}\ntargets: [{openvino: {device: CPU}}, onnxruntime]\n")


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    reg = Registry.start(tmp_path_factory.mktemp("cache-registry"))
    yield reg
    reg.stop()


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    path = tmp_path_factory.mktemp("remote-cache") / "tiny.yaml"
    path.write_text(RECIPE)
    return path


def env(folder: Path, remote: str = "", **more) -> dict:
    """A cache folder of its own, no credentials from this machine, the remote cache `remote`."""
    (folder / "docker").mkdir(parents=True, exist_ok=True)
    return {"PRECAST_CACHE": str(folder / "cache"), "DOCKER_CONFIG": str(folder / "docker"), "REGISTRY_AUTH_FILE": "",
            "PRECAST_REGISTRY_USERNAME": "", "PRECAST_REGISTRY_PASSWORD": "", "PRECAST_REMOTE_CACHE": remote, **more}


def build(recipe, folder: Path, remote: str, *args, **more):
    """(exit code, the --json report or None, stderr) of `precast build` into folder/bundle."""
    proc = precast("build", recipe, "--out", folder / "bundle", "--json", *args, env=env(folder, remote, **more))
    return proc.returncode, (json.loads(proc.stdout) if proc.returncode == 0 else None), proc.stderr


def files(bundle: Path) -> dict[str, bytes]:
    """Every file of a bundle by path (manifest.json too), but .precast-verified.json: this machine's record of
    the inodes and times it hashed (runtime/verified.py), not a part of the bundle."""
    return {p.relative_to(bundle).as_posix(): p.read_bytes() for p in sorted(bundle.rglob("*"))
            if p.is_file() and p.name != ".precast-verified.json"}


def tags(reg, repo: str) -> list[str]:
    try:
        return json.load(urllib.request.urlopen(f"http://{reg.host}/v2/{repo}/tags/list"))["tags"] or []
    except urllib.error.HTTPError:          # no such repository yet
        return []


def warnings(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("warning: remote cache")]


@pytest.fixture(scope="module")
def first(recipe, registry, tmp_path_factory):
    """The first build: every export and engine built here and pushed to oci://HOST/ci/cache."""
    folder = tmp_path_factory.mktemp("first")
    code, report, stderr = build(recipe, folder, f"oci://{registry.host}/ci/cache")
    assert code == 0, stderr
    return folder, report


def test_a_second_cache_folder_builds_nothing_the_first_pushed(first, recipe, registry, tmp_path):
    folder, report = first
    arts = report["artifacts"]
    assert len(arts) == 9 and {(a["cache"], a["remote"]) for a in arts} == {("miss", "pushed")}
    assert report["remote_cache"]["pushed"] == 9 and report["remote_cache"]["warnings"] == []
    assert sorted(tags(registry, "ci/cache")) == sorted(a["key"] for a in arts)       # tagged by cache key

    code, again, stderr = build(recipe, tmp_path, f"oci://{registry.host}/ci/cache")
    assert code == 0, stderr
    assert [(a["component"], a["target"], a["cache"]) for a in again["artifacts"]] == \
        [(a["component"], a["target"], "remote") for a in arts]                    # 3 exports, 6 engines: none built
    summary = again["remote_cache"]
    assert (summary["pulled"], summary["pushed"], summary["warnings"]) == (9, 0, [])
    assert not warnings(stderr) and "compile " not in stderr                        # no backend ran
    assert files(tmp_path / "bundle") == files(folder / "bundle")                   # manifest.json included
    assert precast("bundle", "verify", tmp_path / "bundle").returncode == 0


def test_a_read_only_cache_pulls_and_pushes_nothing(first, recipe, registry, tmp_path):
    """PRECAST_REMOTE_CACHE_PUSH=0 (pull-request builds): the exports come from the registry, the engines of
    another profile are built here and not pushed."""
    other = tmp_path / "other.yaml"
    other.write_text(RECIPE.replace("height: 64", "height: 128"))
    before = tags(registry, "ci/cache")
    code, report, stderr = build(other, tmp_path, f"oci://{registry.host}/ci/cache", "--only", "unet.onnxruntime",
                                 PRECAST_REMOTE_CACHE_PUSH="0")
    assert code == 0, stderr
    assert [(a["component"], a["cache"], a["remote"]) for a in report["artifacts"]] == \
        [("unet", "remote", "hit"), ("unet", "miss", "miss")]
    assert report["remote_cache"]["push"] is False and tags(registry, "ci/cache") == before


def test_exports_only_then_a_shard_exports_nothing(recipe, registry, tmp_path):
    """CI's plan job: `build --exports-only` pushes each component's export and builds no engine; a shard then
    pulls the export it needs and builds only its engine."""
    ref = f"oci://{registry.host}/ci/exports"
    code, report, stderr = build(recipe, tmp_path / "plan", ref, "--exports-only")
    assert code == 0, stderr
    assert [(a["component"], a["backend"], a["remote"]) for a in report["artifacts"]] == \
        [(c, "onnx", "pushed") for c in ("text_encoder", "unet", "vae_decoder")]
    assert json.loads((tmp_path / "plan" / "bundle" / "manifest.json").read_text())["artifacts"] == []
    assert precast("bundle", "verify", tmp_path / "plan" / "bundle").returncode == 0
    code, report, stderr = build(recipe, tmp_path / "shard", ref, "--only", "unet.openvino-CPU")
    assert code == 0, stderr
    assert [(a["backend"], a["cache"], a["remote"]) for a in report["artifacts"]] == \
        [("onnx", "remote", "hit"), ("openvino", "miss", "pushed")]


def test_an_unreachable_registry_is_one_warning_and_a_normal_build(recipe, tmp_path):
    nobody = f"oci://127.0.0.1:{free_port()}/ci/cache"
    code, report, stderr = build(recipe, tmp_path / "a", nobody, "--only", "vae_decoder.onnxruntime")
    assert code == 0, stderr
    said = warnings(stderr)
    assert len(said) == 1 and "connection refused" in said[0] and "everything is built here" in said[0], stderr
    assert [a["cache"] for a in report["artifacts"]] == ["miss", "miss"]
    assert precast("bundle", "verify", tmp_path / "a" / "bundle").returncode == 0

    proc = precast("build", recipe, "--out", tmp_path / "b" / "bundle", "--only", "vae_decoder.onnxruntime",
                   "--remote-cache", nobody, "--remote-cache-strict", env=env(tmp_path / "b"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith(f"error: remote cache {nobody}: 127.0.0.1") and "connection refused" in lines[-1]
    assert not (tmp_path / "b" / "bundle").exists()


def test_a_blob_damaged_in_the_registry_is_refused_and_built_here(first, recipe, tmp_path):
    """A registry of its own (blobs are shared by every repository of a registry's storage): the first build's
    entries pushed to it, then one byte of the UNet export's weights flipped where the registry keeps them."""
    from precast.compiler.cache import Cache
    from precast.compiler.remote_cache import remote_cache
    folder, report = first
    reg = Registry.start(tmp_path / "registry")
    try:
        remote = remote_cache(f"oci://{reg.host}/ci/cache", env=env(tmp_path))
        entries = Cache(folder / "cache").list()
        assert [remote.push(e) for e in entries] == ["pushed"] * 9
        unet = next(e for e in entries if e.metadata.get("kind") == "export" and e.metadata["component"] == "unet")
        name, rec = max(unet.files.items(), key=lambda kv: kv[1]["size"])
        flip_byte(reg.blob_path("sha256:" + rec["sha256"]), rec["size"] // 2)

        code, again, stderr = build(recipe, tmp_path, f"oci://{reg.host}/ci/cache")
        assert code == 0, stderr
        said = warnings(stderr)
        assert len(said) == 1 and f"cache entry {unet.key[:12]} not used" in said[0] and name in said[0] and \
            "sha256" in said[0] and "building it here" in said[0], stderr
        assert {(a["component"], a["target"], a["cache"]) for a in again["artifacts"]
                if a["cache"] != "remote"} == {("unet", "onnx", "miss")}           # the rest came from the registry
        assert files(tmp_path / "bundle") == files(folder / "bundle")

        code, _, stderr = build(recipe, tmp_path / "strict", f"oci://{reg.host}/ci/cache", "--remote-cache-strict")
        assert code == 2 and f"cache entry {unet.key[:12]} not used" in stderr.strip().splitlines()[-1], stderr
    finally:
        reg.stop()


@pytest.mark.parametrize("setting, words", [
    ({"PRECAST_REMOTE_CACHE": "oci://127.0.0.1:5000/ci/cache:v1"}, "PRECAST_REMOTE_CACHE oci://127.0.0.1:5000/ci/cache:v1:"
                                                                   " a remote cache is a repository"),
    ({"PRECAST_REMOTE_CACHE": "oci://127.0.0.1:5000/CI"}, "PRECAST_REMOTE_CACHE: 'oci://127.0.0.1:5000/CI': not a "
                                                          "registry reference for a remote cache: the repository"),
    ({"PRECAST_REMOTE_CACHE": "oci://127.0.0.1:5000/ci", "PRECAST_REMOTE_CACHE_PUSH": "maybe"},
     "PRECAST_REMOTE_CACHE_PUSH='maybe': expected 1 or 0"),
])
def test_settings_that_do_not_parse_are_one_line(recipe, tmp_path, setting, words):
    proc = precast("build", recipe, "--out", tmp_path / "bundle", env={**env(tmp_path), **setting})
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], proc.stderr


def test_compile_shares_its_engines_too(registry, tmp_path):
    """`precast compile EXPORT --remote-cache REF`: the engine built in one cache folder is pulled in another."""
    ckpt, export = tmp_path / "tiny.safetensors", tmp_path / "export"
    assert precast("demo-model", "--out", ckpt).returncode == 0
    assert precast("export", ckpt, "--component", "vae_decoder", "--out", export, env=env(tmp_path)).returncode == 0
    ref = f"oci://{registry.host}/ci/compile"
    runs = []
    for name in ("a", "b"):
        proc = precast("compile", export, "--target", "onnxruntime", "--height", "64", "--width", "64",
                       "--remote-cache", ref, "--json", env=env(tmp_path / name))
        assert proc.returncode == 0, proc.stderr
        runs.append(json.loads(proc.stdout))
    assert [(r["artifacts"][0]["cache"], r["artifacts"][0]["remote"]) for r in runs] == [("miss", "pushed"), ("remote", "hit")]
    assert runs[0]["artifacts"][0]["key"] == runs[1]["artifacts"][0]["key"] and runs[1]["remote_cache"]["pulled"] == 1
    a, b = (Path(r["artifacts"][0]["path"]) for r in runs)
    assert {p.name: p.read_bytes() for p in a.iterdir()} == {p.name: p.read_bytes() for p in b.iterdir()}
