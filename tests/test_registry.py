"""Bundles in a real OCI registry (Debian's docker-registry, started by tests/registry.py on 127.0.0.1):
`precast push` then `precast pull` for each recorded machine (only its artifacts cross the wire, the pulled
bundle verifies and generates the original's PNG), pulls killed and resumed, a blob damaged in the
registry's storage refused, concurrent pulls, the registry going away, a disk too small or filling (a real tmpfs),
chunked and skipped uploads, auth + TLS against a second registry with htpasswd (bcrypt) and a CA made here, a
bearer-token registry with its token service, and `oci://` refs opened in place
through the local store (generate, doctor, the Python API; offline; a second model sharing blobs; concurrent opens)."""
import base64
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, build_recipe, flip_byte, precast
from registry import BINARY, Registry, Relay, TokenServer, free_port, htpasswd, make_ca

pytestmark = pytest.mark.skipif(not os.path.exists(BINARY), reason=f"{BINARY} is not installed (Debian's "
                                "docker-registry package: `make test-setup` installs it)")
MACHINES = Path(ROOT) / "tests/data/machines"
USER, PASSWORD = "ci", "s3cret-pw"


@pytest.fixture(scope="session")
def registry(tmp_path_factory):
    reg = Registry.start(tmp_path_factory.mktemp("registry"))
    yield reg
    reg.stop()


@pytest.fixture(scope="session")
def secure(tmp_path_factory):
    """htpasswd (bcrypt) + TLS with a CA made here: (registry, CA file)."""
    folder = tmp_path_factory.mktemp("secure-registry")
    tls = make_ca(folder / "tls")
    reg = Registry.start(folder, auth=htpasswd(folder / "htpasswd", USER, PASSWORD), tls=tls)
    yield reg, tls["ca"]
    reg.stop()


@pytest.fixture
def env(tmp_path):
    """No credentials from this machine's files: an empty Docker config folder, no REGISTRY_AUTH_FILE."""
    (tmp_path / "docker").mkdir()
    return {"DOCKER_CONFIG": str(tmp_path / "docker"), "REGISTRY_AUTH_FILE": "", "PRECAST_REGISTRY_USERNAME": "",
            "PRECAST_REGISTRY_PASSWORD": "", "PRECAST_REGISTRY_CA": ""}


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    """Text encoder, UNet, VAE decoder (64x64) with OpenVINO CPU blobs, TensorRT-RTX sm_86 engines and DirectML
    artifacts (no ONNX Runtime artifacts: ONNX Runtime runs the bundle's ONNX, as on a pulled ONNX-only bundle)."""
    return build_recipe(tmp_path_factory.mktemp("registry-bundle"),
                        "model: {source: demo:tiny-sd15}\ncomponents: [text_encoder, unet, vae_decoder]\n"
                        "profiles: {batch: 1, height: 64, width: 64}\n"
                        "targets: [{openvino: {device: CPU}}, {tensorrt-rtx: {compute_capabilities: [sm_86]}}, directml]\n")


@pytest.fixture(scope="module")
def pushed(bundle, registry, tmp_path_factory):
    ref = f"oci://{registry.host}/tiny/sd15:v1"
    proc = precast("push", bundle, ref, "--json")
    assert proc.returncode == 0, proc.stderr
    return ref


def png(bundle, out, *args, env=None):
    """The pixels `precast generate` writes (the PNG's text chunks name the bundle's path, so they differ)."""
    from precast.runtime.png import read_png
    proc = precast("generate", bundle, "--prompt", "a red fox", "--steps", "2", "--out", out, *args, env=env)
    assert proc.returncode == 0, proc.stderr
    return read_png(out).tobytes()


def one_line_error(proc) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


def recorded(tmp_path, name):
    """A recorded machine's tree; Windows ones with the DirectML wheel installed, the Mac with ONNX Runtime's
    CoreML EP (as tests/test_windows_macos_selection.py declares them)."""
    from precast.runtime.select import installed_backends
    here, tree = installed_backends(), tmp_path / name
    shutil.copytree(MACHINES / name, tree)
    if name.startswith("win-"):
        backends = {"onnxruntime": here["onnxruntime"], "onnxruntime-directml": here["onnxruntime"],
                    "tensorrt-rtx": here["tensorrt-rtx"]}
        (tree / "installed_backends.json").write_text(json.dumps(backends))
    elif name == "m2-mac":
        (tree / "installed_backends.json").write_text(json.dumps({"onnxruntime": here["onnxruntime"],
                                                                  "onnxruntime-coreml": here["onnxruntime"]}))
    return tree


def tree_digests(folder: Path) -> dict:
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != ".precast-verified.json"}


def test_pull_for_each_recorded_machine_downloads_its_artifacts_only(bundle, registry, pushed, tmp_path):
    """Each recorded machine: the pull keeps what `doctor --sysroot` selects there (the same selection,
    run on the manifest alone), the bytes the registry sent through a counting relay are those files'
    and no more, the result verifies, and a pulled bundle this machine can run makes the original's image
    (ONNX-only pulls through ONNX Runtime, against the original through ONNX Runtime)."""
    from precast.runtime.api import machine, open_bundle
    from precast.runtime.assign import COMPONENT_MODULE
    from precast.runtime.manifest import read_manifest, verify_bundle
    from precast.runtime.oci.client import Registry as Client
    from precast.runtime.oci.pull import pull_bundle
    from precast.runtime.oci.ref import parse_ref
    relay = Relay(("127.0.0.1", registry.port))
    ref = parse_ref(pushed.replace(registry.host, relay.host))
    modules = tuple(dict.fromkeys(("te", "diffusion", "vae", *COMPONENT_MODULE.values())))
    kinds = {}
    try:
        for name in sorted(os.listdir(MACHINES)):
            tree = recorded(tmp_path, name)
            plan = open_bundle(bundle, sysroot=str(tree)).plan()
            expect = {c: p.artifact for c, p in plan.components.items()}
            before = relay.received
            res = pull_bundle(ref, tmp_path / f"pulled-{name}", Client.for_ref(ref), progress=False,
                              machine=machine(str(tree), None, None, False, modules))
            wire = relay.received - before
            assert set(res.artifacts) == {a for a in expect.values() if a != "onnx"}, name
            assert set(res.onnx) == {c for c, a in expect.items() if a == "onnx"}, name
            m = read_manifest(tmp_path / f"pulled-{name}")
            blobs = {r["sha256"]: r["size"] for r in m.files.values()}
            assert res.bytes_downloaded == sum(blobs.values()), name
            assert sum(blobs.values()) < wire < sum(blobs.values()) + 64 * 1024 + 8192 * len(blobs), (name, wire)
            assert verify_bundle(m.root) == [], name
            kinds.setdefault(tuple(sorted(expect.values())), name)
    finally:
        relay.close()
    kind = {k: {"onnx" if a == "onnx" else a.split(".", 1)[1].split("/")[0] for a in k} for k in kinds}
    assert sorted(map(sorted, kind.values())) == [["onnx"], ["onnxruntime-directml"], ["openvino-CPU"],
                                                  ["tensorrt-rtx-sm_86"]], kind
    original = {b: png(bundle, tmp_path / f"orig-{b}.png", *(["--backend", "all=onnxruntime"] if b else []))
                for b in ("", "ort")}
    for artifacts, name in kinds.items():
        folder = tmp_path / f"pulled-{name}"
        if kind[artifacts] == {"openvino-CPU"}:        # what this machine selects too
            assert png(folder, tmp_path / f"{name}.png") == original[""], name
        elif kind[artifacts] == {"onnx"}:              # the ONNX through ONNX Runtime, as the original's
            assert png(folder, tmp_path / f"{name}.png", "--backend", "all=onnxruntime") == original["ort"], name
        elif kind[artifacts] == {"tensorrt-rtx-sm_86"}:   # engines for a GPU absent here: their ONNX added
            res = pull_bundle(parse_ref(pushed), folder, Client.for_ref(parse_ref(pushed)), progress=False,
                              with_onnx=True, machine=machine(str(tmp_path / name), None, None, False, modules))
            assert res.onnx == ["text_encoder", "unet", "vae_decoder"] and verify_bundle(folder) == []
            assert res.reused >= len(res.artifacts) and res.bytes_downloaded < res.bytes_total - 3_000_000
            assert png(folder, tmp_path / f"{name}.png", "--backend", "all=onnxruntime") == original["ort"], name


def test_a_pulled_bundle_says_its_onnx_was_left_out(bundle, pushed, tmp_path, env):
    out = tmp_path / "rtx"
    precast("pull", pushed, "--out", out, "--sysroot", recorded(tmp_path, "rtx3060-desktop"), env=env, check=True)
    proc = precast("generate", out, "--prompt", "x", "--steps", "1", "--out", tmp_path / "x.png", env=env)
    assert proc.returncode == 2 and "left out by `precast pull`" in proc.stderr, proc.stderr
    assert f"`precast pull {pushed} --with-onnx --out {out}` adds it" in proc.stderr, proc.stderr
    data = json.loads((out / "manifest.json").read_text())
    assert data["pulled"]["ref"] == pushed and data["pulled"]["digest"].startswith("sha256:")
    assert "onnx/unet/model.onnx" in data["pulled"]["left_out"] and len(data["pulled"]["artifacts_left_out"]) == 6
    again = json.loads(precast("pull", pushed, "--out", out, "--with-onnx", "--json", env=env, check=True).stdout)
    assert again["reused"] >= 3 and again["onnx"] == ["text_encoder", "unet", "vae_decoder"]    # the engines kept
    data = json.loads((out / "manifest.json").read_text())
    assert precast("bundle", "verify", out).returncode == 0
    assert not [r for r in data["pulled"]["left_out"] if r.startswith("onnx/unet/")]
    data["pulled"]["left_out"]["tokenizer/vocab.json"] = data["files"]["tokenizer/vocab.json"]     # both: refused
    (out / "manifest.json").write_text(json.dumps(data))
    line = one_line_error(precast("bundle", "verify", out))
    assert "pulled.left_out['tokenizer/vocab.json'] is also listed in files" in line


def test_push_in_chunks_then_again_uploads_nothing(bundle, registry, tmp_path, env):
    ref = f"oci://{registry.host}/tiny/chunked:v1"
    first = json.loads(precast("push", bundle, ref, "--chunk-size", "1M", "--json", env=env, check=True).stdout)
    assert first["chunked"] >= 6 and first["uploaded"] == first["blobs"] - 1 or first["uploaded"] > 0
    again = json.loads(precast("push", bundle, ref, "--json", env=env, check=True).stdout)
    assert again["uploaded"] == 0 and again["bytes_uploaded"] == 0 and again["digest"] == first["digest"]
    out = tmp_path / "all"
    res = json.loads(precast("pull", ref, "--out", out, "--all", "--json", env=env, check=True).stdout)
    assert res["left_out"] == 0 and tree_digests(out).keys() - {"manifest.json"} == tree_digests(bundle).keys() - {"manifest.json"}
    assert precast("bundle", "verify", out).returncode == 0


def test_a_killed_pull_resumes_and_ends_verified(registry, pushed, tmp_path, env):
    """SIGKILL at random instants of a throttled pull (a real subprocess), each after its partial files
    grew; every next run goes on from the .partial files (HTTP Range), so all runs together receive
    little more than the bundle once."""
    relay = Relay(("127.0.0.1", registry.port), rate=3 << 20)
    ref, out, work = pushed.replace(registry.host, relay.host), tmp_path / "resumed", tmp_path / ".resumed.pull"
    rng, killed = random.Random(31), 0

    def partial_bytes():
        return sum(p.stat().st_size for p in work.glob("*.partial")) if work.exists() else 0
    try:
        for _ in range(3):
            before = partial_bytes()
            p = subprocess.Popen([sys.executable, "-m", "precast.runtime.cli", "pull", ref, "--out", out, "--json"],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, **env})
            deadline = time.time() + 30
            while p.poll() is None and partial_bytes() <= before and time.time() < deadline:
                time.sleep(0.02)
            time.sleep(rng.uniform(0.05, 0.6))
            killed += p.poll() is None
            p.kill()
            p.wait()
        assert killed == 3 and partial_bytes() > 0
        res = json.loads(precast("pull", ref, "--out", out, "--json", env=env, check=True).stdout)
    finally:
        relay.close()
    assert precast("bundle", "verify", out).returncode == 0
    assert relay.received < 1.3 * res["bytes_total"], (relay.received, res)
    assert not work.exists() and {p.name for p in tmp_path.iterdir()} == {"docker", "resumed"}


def test_sigterm_ends_a_pull_whose_blobs_stall(registry, pushed, tmp_path, env):
    """A registry dripping bytes (4 KB/s: a reader waits on a full buffer for minutes): SIGTERM, as `timeout`,
    systemd and `docker stop` send it, ends the pull at once in one line (exit 143); it once waited for the stalled
    transfer threads for ever. The partial files stay for a resume."""
    relay = Relay(("127.0.0.1", registry.port), rate=4096)
    ref, out, work = pushed.replace(registry.host, relay.host), tmp_path / "slow", tmp_path / ".slow.pull"
    try:
        p = subprocess.Popen([sys.executable, "-m", "precast.runtime.cli", "pull", ref, "--out", out],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, **env})
        deadline = time.time() + 60
        while p.poll() is None and not list(work.glob("*.partial")) and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)
        assert p.poll() is None, p.stderr.read()
        p.send_signal(signal.SIGTERM)
        try:
            _, err = p.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            raise AssertionError("the pull was still running 20 s after SIGTERM") from None
    finally:
        relay.close()
    assert p.returncode == 128 + signal.SIGTERM
    assert err.decode().strip().splitlines()[-1] == "error: terminated by SIGTERM"
    assert not out.exists() and list(work.glob("*.partial"))


def test_a_blob_damaged_in_the_registry_is_refused(registry, pushed, bundle, tmp_path, env):
    m = json.loads((bundle / "manifest.json").read_text())
    rel = next(r for r in m["files"] if r.startswith("artifacts/unet/openvino"))
    blob = registry.blob_path(m["files"][rel]["sha256"])
    flip_byte(blob, 1000)
    try:
        proc = precast("pull", pushed, "--out", tmp_path / "bad", env=env)
    finally:
        flip_byte(blob, 1000)
    line = one_line_error(proc)
    assert rel in line and "sha256" in line and "refused" in line
    assert not (tmp_path / "bad").exists()
    assert not [p for p in (tmp_path / ".bad.pull").iterdir() if p.name.startswith(m["files"][rel]["sha256"])]


@pytest.fixture
def small_disk(tmp_path):
    """A real 1 MiB file system (tmpfs; grown with `remount`); skipped where it cannot be mounted (as
    tests/test_bundle.py's)."""
    if shutil.which("mount") is None:
        pytest.skip("no mount command here to make a small tmpfs")
    mnt = tmp_path / "small"
    mnt.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", mnt], capture_output=True, text=True,
                          check=False)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {(proc.stderr or proc.stdout).strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", mnt], check=True)


def test_a_disk_too_small_or_filling_during_a_pull(registry, pushed, small_disk, tmp_path, env):
    """A pull onto a real 1 MiB tmpfs: refused before a byte is downloaded, one line naming --out and the bytes
    needed. Grown to twice that, the disk then filled by another file while a throttled pull streams: one line
    naming --out and the bytes still needed, nothing at --out, the partial files kept in .NAME.pull/; with the
    space back, the same command resumes them and the bundle verifies."""
    out, work = small_disk / "sd15", small_disk / ".sd15.pull"
    line = one_line_error(precast("pull", pushed, "--out", out, env=env))
    assert line.startswith(f"error: --out {out}: not enough disk space: "), line
    need = int(line.split(" more bytes")[0].rsplit(" ", 1)[1])
    assert need > 1 << 20, line
    assert "are free; free space there or give an --out on a disk with room; nothing was downloaded" in line, line
    assert list(small_disk.iterdir()) == []
    subprocess.run(["mount", "-o", f"remount,size={2 * need}", small_disk], check=True)
    relay = Relay(("127.0.0.1", registry.port), rate=2 << 20)
    try:
        p = subprocess.Popen([sys.executable, "-m", "precast.runtime.cli", "pull",
                              pushed.replace(registry.host, relay.host), "--out", out], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, **env})
        deadline = time.time() + 30
        while not any(p.stat().st_size for p in work.glob("*.partial")) and time.time() < deadline:
            time.sleep(0.02)
        with open(small_disk / "filler", "wb") as f:         # another program fills the disk
            try:
                while True:
                    f.write(bytes(1 << 20))
                    f.flush()
            except OSError:
                pass
        _, err = p.communicate(timeout=60)
    finally:
        relay.close()
    line = one_line_error(subprocess.CompletedProcess(p.args, p.returncode, "", err))
    assert line.startswith(f"error: --out {out}: the disk filled during the pull: ") and " more bytes (" in line, line
    assert f"what was downloaded stays in {work} and the same command resumes from it (remove {work} to drop it)" \
        in line, line
    partial = sum(p.stat().st_size for p in work.iterdir())
    assert not out.exists() and 0 < partial < need
    (small_disk / "filler").unlink()
    res = json.loads(precast("pull", pushed, "--out", out, "--json", env=env, check=True).stdout)
    assert need <= res["bytes_total"] and res["bytes_downloaded"] == need - partial, (res, need, partial)
    assert precast("bundle", "verify", out).returncode == 0 and not work.exists()


def test_concurrent_pulls_agree_and_share_an_out_safely(pushed, tmp_path, env):
    def run(*outs):
        ps = [subprocess.Popen([sys.executable, "-m", "precast.runtime.cli", "pull", pushed, "--out", o, "--json"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, **env}) for o in outs]
        for p in ps:
            assert p.wait() == 0, p.stderr.read()
    run(tmp_path / "a", tmp_path / "b")
    assert tree_digests(tmp_path / "a") == tree_digests(tmp_path / "b")
    run(tmp_path / "same", tmp_path / "same")
    assert precast("bundle", "verify", tmp_path / "same").returncode == 0
    assert tree_digests(tmp_path / "same") == tree_digests(tmp_path / "a")


def test_the_registry_going_away_mid_pull_is_one_line_and_a_rerun_resumes(registry, pushed, tmp_path, env):
    relay = Relay(("127.0.0.1", registry.port), rate=8 << 20)
    ref, out = pushed.replace(registry.host, relay.host), tmp_path / "gone"
    try:
        p = subprocess.Popen([sys.executable, "-m", "precast.runtime.cli", "pull", ref, "--out", out],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, **env, "PRECAST_REGISTRY_RETRIES": "1"})
        time.sleep(1.5)
        relay.cut()
        _, err = p.communicate(timeout=60)
        line = one_line_error(subprocess.CompletedProcess(p.args, p.returncode, "", err))
        assert relay.host in line and "went away" in line and "run the same command again" in line
        assert not out.exists()
        relay.resume()
        res = json.loads(precast("pull", ref, "--out", out, "--json", env=env, check=True).stdout)
    finally:
        relay.close()
    assert res["bytes_downloaded"] < res["bytes_total"] and precast("bundle", "verify", out).returncode == 0


def test_errors_are_one_line(registry, pushed, tmp_path, env):
    from precast.runtime.oci.client import Registry as Client
    from precast.runtime.oci.ref import parse_ref
    port = free_port()
    cases = [(f"oci://no-such-registry.invalid/a/b:v1", "unknown host"),
             (f"oci://127.0.0.1:{port}/a/b:v1", "connection refused"),
             (pushed.replace(":v1", ":nope"), "no such tag"),
             ("oci://127.0.0.1/Tiny:v1", "the repository"),
             (f"oci://{registry.host}/tiny/sd15", "the tag is missing")]
    other = parse_ref(f"oci://{registry.host}/tiny/other:v1")       # an OCI artifact of another type
    client = Client.for_ref(other)
    client.push_blob(other.repository, "sha256:" + hashlib.sha256(b"{}").hexdigest(), 2, b"{}", "config")
    client.put_manifest(other, json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                                           "artifactType": "application/vnd.example.thing.v1", "layers": [],
                                           "config": {"mediaType": "application/vnd.oci.empty.v1+json", "size": 2,
                                                      "digest": "sha256:" + hashlib.sha256(b"{}").hexdigest()}}).encode())
    cases.append((str(other), "not a precast bundle (artifactType application/vnd.example.thing.v1"))
    for ref, words in cases:
        line = one_line_error(precast("pull", ref, "--out", tmp_path / "x", env=env))
        assert words in line, (ref, line)
    assert words in one_line_error(precast("pull", str(other), "--out", tmp_path / "x", "--json", env=env))
    assert not (tmp_path / "x").exists()


def test_auth_and_tls(bundle, secure, tmp_path, env):
    reg, ca = secure
    ref = f"oci://{reg.host}/team/sd15:v1"
    line = one_line_error(precast("pull", ref, "--out", tmp_path / "x", env=env))
    assert reg.host in line and "certificate verify failed" in line and "--ca" in line
    line = one_line_error(precast("push", bundle, ref, "--ca", ca, env=env))
    assert reg.host in line and "none were found" in line and f"docker login {reg.host}" in line
    wrong = {**env, "PRECAST_REGISTRY_USERNAME": USER, "PRECAST_REGISTRY_PASSWORD": "wrong"}
    line = one_line_error(precast("push", bundle, ref, "--ca", ca, env=wrong))
    assert "refused the credentials from PRECAST_REGISTRY_USERNAME/PRECAST_REGISTRY_PASSWORD" in line
    right = {**env, "PRECAST_REGISTRY_USERNAME": USER, "PRECAST_REGISTRY_PASSWORD": PASSWORD}
    assert precast("push", bundle, ref, "--ca", ca, env=right).returncode == 0
    # a Docker config file's auths, with the CA from the environment
    (Path(env["DOCKER_CONFIG"]) / "config.json").write_text(json.dumps(
        {"auths": {reg.host: {"auth": base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()}}}))
    assert precast("pull", ref, "--out", tmp_path / "a", env={**env, "PRECAST_REGISTRY_CA": str(ca)}).returncode == 0
    # a credential helper (Docker's protocol: `docker-credential-NAME get`, the registry on stdin)
    helper = tmp_path / "bin" / "docker-credential-precasttest"
    helper.parent.mkdir()
    helper.write_text(f"#!/bin/sh\nread host\n[ \"$host\" = \"{reg.host}\" ] || exit 1\n"
                      f"echo '{{\"ServerURL\": \"{reg.host}\", \"Username\": \"{USER}\", \"Secret\": \"{PASSWORD}\"}}'\n")
    helper.chmod(0o755)
    (Path(env["DOCKER_CONFIG"]) / "config.json").write_text(json.dumps({"credHelpers": {reg.host: "precasttest"}}))
    helped = {**env, "PATH": f"{helper.parent}:{os.environ['PATH']}"}
    proc = precast("pull", ref, "--out", tmp_path / "b", "--ca", ca, env=helped)
    assert proc.returncode == 0, proc.stderr
    assert precast("bundle", "verify", tmp_path / "b").returncode == 0


def test_a_bearer_token_registry(bundle, tmp_path, env):
    """A registry with `auth: token` (the scheme of GHCR, Docker Hub, Harbor) and its token service: without
    credentials the service hands out an anonymous token that grants nothing, and the refusal is one line saying
    how to log in; wrong credentials are refused by the token service, one line naming the source tried; the
    right ones push (chunked: POST, PATCHes and the final PUT under a pull,push token) and pull, and so does an
    identity token from Docker's config (exchanged as an OAuth2 refresh token)."""
    tokens = TokenServer(tmp_path / "tokens", {USER: PASSWORD})
    reg = Registry.start(tmp_path / "registry", token=tokens)
    ref = f"oci://{reg.host}/team/sd15:v1"
    try:
        line = one_line_error(precast("pull", ref, "--out", tmp_path / "x", env=env))
        assert reg.host in line and "none were found" in line and f"docker login {reg.host}" in line, line
        wrong = {**env, "PRECAST_REGISTRY_USERNAME": USER, "PRECAST_REGISTRY_PASSWORD": "wrong"}
        line = one_line_error(precast("push", bundle, ref, env=wrong))
        assert f"refused the credentials from PRECAST_REGISTRY_USERNAME/PRECAST_REGISTRY_PASSWORD, user '{USER}'" \
            in line and f"from {tokens.url}" in line and reg.host in line, line
        right = {**env, "PRECAST_REGISTRY_USERNAME": USER, "PRECAST_REGISTRY_PASSWORD": PASSWORD}
        precast("push", bundle, ref, "--chunk-size", "4M", env=right, check=True)
        pushed = json.loads(precast("push", bundle, ref, "--json", env=right, check=True).stdout)
        assert pushed["uploaded"] == 0
        res = json.loads(precast("pull", ref, "--out", tmp_path / "pulled", "--json", env=right, check=True).stdout)
        assert res["artifacts"] and precast("bundle", "verify", tmp_path / "pulled").returncode == 0
        (Path(env["DOCKER_CONFIG"]) / "config.json").write_text(json.dumps(     # an identity token, as docker login keeps
            {"auths": {reg.host: {"identitytoken": f"refresh-{USER}"}}}))
        precast("pull", ref, "--out", tmp_path / "pulled", "--with-onnx", env=env, check=True)
    finally:
        reg.stop()
        tokens.stop()
    scopes = {s for user, asked in tokens.seen if user == USER for s in asked}
    assert {"repository:team/sd15:pull", "repository:team/sd15:pull,push"} <= scopes, tokens.seen
    assert (None, ["repository:team/sd15:pull"]) in tokens.seen and len(tokens.seen) < 40, tokens.seen
    assert tokens.seen[-1] == (USER, ["repository:team/sd15:pull"])              # the identity token's exchange


def test_bundle_merge_takes_refs_and_pushes_the_merged_bundle(bundle, registry, pushed, tmp_path, env):
    """A shard in the registry and one on disk merged into a registry tag: the blobs the registry has are
    not sent again (only manifest.json and onnx/'s pipeline JSON the merge writes anew)."""
    ref = f"oci://{registry.host}/tiny/sd15:merged"
    r = json.loads(precast("bundle", "merge", pushed, bundle, "--out", ref, "--json", env=env, check=True).stdout)
    assert r["artifacts"] == 9 and r["bytes_uploaded"] < 100_000, r
    res = json.loads(precast("pull", ref, "--out", tmp_path / "m", "--all", "--json", env=env, check=True).stdout)
    assert res["left_out"] == 0 and precast("bundle", "verify", tmp_path / "m").returncode == 0
    assert tree_digests(tmp_path / "m").keys() == tree_digests(bundle).keys()


def test_shards_in_one_registry_merge_there_downloading_nothing(bundle, registry, pushed, tmp_path, env):
    """Two shards pushed to repositories of their own, merged into a third through a relay that counts what the
    registry sends: only manifests and manifest.json files cross it (no artifact's bytes), the blobs are mounted
    across repositories, and the merged reference pulls (--all) into the bundle built unsharded, manifest.json
    byte for byte. A shard missing from the registry is one line naming it."""
    cache = {"PRECAST_CACHE": str(bundle.parent / "cache")}          # the bundle's own cache: shards are hits
    relay = Relay(("127.0.0.1", registry.port))
    refs = [f"oci://{relay.host}/shards/part{i}:v1" for i in (1, 2)]
    try:
        for i, ref in enumerate(refs, 1):
            precast("build", bundle.parent / "bundle.yaml", "--out", tmp_path / f"shard{i}", "--shard", f"{i}/2",
                    env=cache, check=True)
            precast("push", tmp_path / f"shard{i}", ref, env=env, check=True)
        before, out = relay.received, f"oci://{relay.host}/shards/merged:v1"
        proc = precast("bundle", "merge", *refs, "--out", out, env=env, check=True)
        assert "merged in the registry: " in proc.stdout and "0.0 MB downloaded" in proc.stdout, proc.stdout
        shard_manifests = sum((tmp_path / f"shard{i}/manifest.json").stat().st_size for i in (1, 2))
        artifacts = sum(rec["size"] for rec in json.loads((bundle / "manifest.json").read_text())["files"].values())
        got = relay.received - before       # manifest.json twice, the OCI manifests, the HEADs' answers
        assert got < shard_manifests + 50_000 < artifacts // 100, (got, shard_manifests, artifacts)
        r = json.loads(precast("bundle", "merge", *refs, "--out", out, "--json", env=env, check=True).stdout)
        assert r["in_registry"] and r["copied"] == 0 and r["mounted"] > 0 and r["bytes_downloaded"] == 0, r
        precast("pull", out, "--out", tmp_path / "m", "--all", env=env, check=True)
        line = one_line_error(precast("bundle", "merge", refs[0], f"oci://{relay.host}/shards/part3:v1", "--out",
                                      out, env=env))
        assert "shards/part3:v1" in line and "no such tag" in line, line
    finally:
        relay.close()
    pulled = json.loads((tmp_path / "m/manifest.json").read_text())
    pulled.pop("pulled", None)
    assert pulled == json.loads((bundle / "manifest.json").read_text())
    assert tree_digests(tmp_path / "m").keys() - {"manifest.json"} == tree_digests(bundle).keys() - {"manifest.json"}
    assert precast("bundle", "verify", tmp_path / "m").returncode == 0


# ---- oci:// references opened in place: the local store (runtime/oci/store.py) ---------------------------------

def store_blobs(cache: Path) -> dict:
    """The store's finished blobs: name -> size (no .partial, no locks)."""
    folder = cache / "oci/blobs/sha256"
    return {p.name: p.stat().st_size for p in folder.iterdir() if p.is_file() and len(p.name) == 64} \
        if folder.is_dir() else {}


def test_generate_from_a_ref_matches_the_bundle_and_reopens_offline(bundle, registry, pushed, tmp_path, env):
    """`generate oci://...` pulls this machine's files into the store and makes the local bundle's image; with the
    registry gone (the relay it was reached through closed: connection refused) the same ref opens from the store
    with one note and makes the same image; a ref never pulled is one line naming the registry."""
    relay = Relay(("127.0.0.1", registry.port))
    ref, env = pushed.replace(registry.host, relay.host), {**env, "PRECAST_CACHE": str(tmp_path / "cache")}
    try:
        assert png(ref, tmp_path / "ref.png", env=env) == png(bundle, tmp_path / "local.png")
    finally:
        relay.close()
    folder = tmp_path / f"cache/oci/refs/{relay.host.replace(':', '_')}/tiny/sd15/v1"
    pulled = json.loads((folder / "manifest.json").read_text())
    assert pulled["pulled"]["ref"] == ref and precast("bundle", "verify", folder).returncode == 0
    assert sorted(store_blobs(tmp_path / "cache")) == sorted({r["sha256"] for r in pulled["files"].values()} | {
        hashlib.sha256((bundle / "manifest.json").read_bytes()).hexdigest()})
    proc = precast("generate", ref, "--prompt", "a red fox", "--steps", "2", "--out", tmp_path / "offline.png", env=env)
    assert proc.returncode == 0, proc.stderr
    notes = [line for line in proc.stderr.splitlines() if line.startswith("note: ")]
    assert len(notes) == 1 and f"{relay.host} is unreachable (connection refused)" in notes[0] and str(folder) in notes[0]
    from precast.runtime.png import read_png
    assert read_png(tmp_path / "offline.png").tobytes() == read_png(tmp_path / "ref.png").tobytes()
    line = one_line_error(precast("generate", ref.replace(":v1", ":v2"), "--prompt", "x", "--out", tmp_path / "n.png",
                                  env=env))
    assert f"{relay.host} is unreachable" in line and "never pulled" in line


def test_an_onnx_left_out_in_the_store_says_how_to_add_it(bundle, pushed, tmp_path, env, monkeypatch):
    """A ref opened in place keeps only the engines this machine selects; when one then fails (its file damaged in
    the store), the error says how to add the ONNX for a reference (--backend MODULE=onnxruntime, or precast pull
    --with-onnx), not "pull again", and doing what it says runs."""
    from precast.runtime.api import open_bundle
    for k, v in {**env, "PRECAST_CACHE": str(tmp_path / "cache")}.items():
        monkeypatch.setenv(k, v)
    folder = open_bundle(pushed).path
    engine = next(p for p in (folder / "artifacts/unet").rglob("*") if p.is_file() and p.stat().st_size > 1 << 20)
    flip_byte(engine, 1000)
    args = ("generate", pushed, "--prompt", "a red fox", "--steps", "1", "--out", tmp_path / "fox.png")
    proc = precast(*args)
    assert proc.returncode == 2 and proc.stderr.startswith("error: unet: nothing in the bundle can run here"), proc.stderr
    line = next(line for line in proc.stderr.splitlines() if line.strip().startswith("onnx on cpu: "))
    assert f"ONNX was left out when {pushed} was opened in place" in line and "pull again" not in line, line
    assert f"open it with --backend diffusion=onnxruntime (open_bundle's backend=) to add it to the store, or " \
           f"`precast pull {pushed} --with-onnx --out DIR`" in line, line
    proc = precast(*args, "--backend", "diffusion=onnxruntime")
    assert proc.returncode == 0 and (folder / "onnx/unet/model.onnx").is_file(), proc.stderr


def test_doctor_a_ref_says_what_would_download_and_downloads_no_artifact(bundle, registry, pushed, tmp_path, env):
    """doctor oci://: the files this machine's selection needs and their sizes (what `pull` would fetch), from the
    OCI manifest and manifest.json alone: the registry sends no artifact (bytes counted at a relay) and the store
    holds nothing but manifest.json's blob."""
    relay = Relay(("127.0.0.1", registry.port))
    ref, env = pushed.replace(registry.host, relay.host), {**env, "PRECAST_CACHE": str(tmp_path / "cache")}
    try:
        report = json.loads(precast("doctor", ref, "--json", env=env, check=True).stdout)
        text = precast("doctor", ref, env=env, check=True).stdout
    finally:
        relay.close()
    files = json.loads((bundle / "manifest.json").read_text())["files"]
    remote = report["remote"]
    chosen = {c: r["artifact"] for c, r in report["components"].items()}
    assert all(a and "openvino" in a for a in chosen.values()), chosen
    want = {rel for rel in files if rel.startswith("artifacts/") and any(f"/{c}/openvino" in rel for c in chosen)}
    listed = {f["path"]: f for f in remote["files"]}
    assert want <= set(listed) and not [p for p in listed if p.startswith("onnx/") and p.endswith(".onnx_data")]
    assert all(listed[p]["size"] == files[p]["size"] and not listed[p]["stored"] for p in listed)
    assert remote["bytes_needed"] == sum(files[p]["size"] for p in listed) and remote["pulled"] is None
    smallest = min(files[p]["size"] for p in want)
    assert relay.received < 2 * 200_000 < smallest, relay.received            # two doctor runs: manifests only
    assert list(store_blobs(tmp_path / "cache").values()) == [(bundle / "manifest.json").stat().st_size]
    assert not (tmp_path / "cache/oci/refs").exists() or not any((tmp_path / "cache/oci/refs").rglob("manifest.json"))
    shown = [line.split() for line in text.splitlines() if line.startswith("download  ")]
    assert {s[3] for s in shown} == set(listed) and f"downloads {len(listed)} files" in text


def test_a_plain_http_registry_elsewhere_needs_asking_for(bundle, registry, pushed, tmp_path, env):
    """A registry on another host that speaks plain HTTP (here: 127.0.0.2, a loopback address precast does not
    take for one): https is tried and refused in one line naming --plain-http; `doctor --plain-http`,
    PRECAST_REGISTRY_PLAIN_HTTP naming that registry (generate: the local bundle's image) and
    open_bundle(plain_http=True) reach it; the variable naming another registry changes nothing."""
    from precast.runtime.api import open_bundle
    relay = Relay(("127.0.0.1", registry.port), bind="127.0.0.2")
    ref, env = pushed.replace(registry.host, relay.host), {**env, "PRECAST_CACHE": str(tmp_path / "cache")}
    try:
        line = one_line_error(precast("doctor", ref, env=env))
        assert relay.host in line and "TLS failed" in line and "--plain-http" in line, line
        other = {**env, "PRECAST_REGISTRY_PLAIN_HTTP": "127.0.0.2:1,registry.example:5000"}
        assert "--plain-http" in one_line_error(precast("doctor", ref, env=other))
        report = json.loads(precast("doctor", ref, "--plain-http", "--json", env=env, check=True).stdout)
        assert report["remote"]["files"] and report["remote"]["bytes_needed"] > 0
        asked = {**env, "PRECAST_REGISTRY_PLAIN_HTTP": f"registry.example:5000, {relay.host}"}
        assert png(ref, tmp_path / "ref.png", env=asked) == png(bundle, tmp_path / "local.png")
        os.environ["PRECAST_CACHE"] = str(tmp_path / "api-cache")
        try:
            opened = open_bundle(ref, plain_http=True, pull=False)
        finally:
            del os.environ["PRECAST_CACHE"]
        assert opened.remote.bytes_needed == report["remote"]["bytes_needed"]
    finally:
        relay.close()


def test_a_second_ref_sharing_the_vae_downloads_none_of_it(bundle, registry, pushed, tmp_path, env, monkeypatch):
    """A second model (the same checkpoint with a LoRA: other text encoder and UNet, the same VAE, built with the
    first's cache) opened after the first through the Python API: the VAE's engine and every other shared blob come
    from the store; the registry sends only the new files (counted by the client and at a relay)."""
    from precast.compiler.demo_lora import write_demo_lora
    from precast.runtime.api import open_bundle
    write_demo_lora(str(bundle.parent / "lora.safetensors"))
    second = build_recipe(bundle.parent, "model: {source: demo:tiny-sd15}\ncomponents: [text_encoder, unet, vae_decoder]\n"
                          "loras: [{path: lora.safetensors, strength: 0.8}]\nprofiles: {batch: 1, height: 64, width: 64}\n"
                          "targets: [{openvino: {device: CPU}}]\n", name="lora")
    precast("push", second, f"oci://{registry.host}/tiny/sd15-lora:v1", env=env, check=True)
    for k, v in {**env, "PRECAST_CACHE": str(tmp_path / "cache")}.items():
        monkeypatch.setenv(k, v)
    relay = Relay(("127.0.0.1", registry.port))
    try:
        first = open_bundle(pushed.replace(registry.host, relay.host))
        before = relay.received
        other = open_bundle(f"oci://{relay.host}/tiny/sd15-lora:v1")
        wire = relay.received - before
    finally:
        relay.close()
    a, b = first.manifest.files, other.manifest.files
    vae = [rel for rel in b if "vae_decoder" in rel]
    assert vae and all(a.get(rel) == b[rel] for rel in vae)                   # the VAE's engine: one blob for both
    new = {rec["sha256"]: rec["size"] for rel, rec in b.items() if rec["sha256"] not in {r["sha256"] for r in a.values()}}
    assert new and other.remote.pulled.bytes_downloaded == sum(new.values())
    assert sum(new.values()) < wire < sum(new.values()) + 100_000, (wire, new)
    assert other.remote.pulled.reused == len(b) - len(new)
    assert os.stat(first.path / vae[0]).st_ino == os.stat(other.path / vae[0]).st_ino     # linked from one blob
    assert other.txt2img("a red fox", steps=1, size=(64, 64)).size == (64, 64)


def test_cache_gc_reclaims_the_store(bundle, registry, tmp_path, env):
    """`precast cache gc` in the store: a blob no reference holds (the manifest.json doctor read) and a partial
    download go; references' blobs stay and still verify. With an open running (another process holding the
    store's lock shared) it removes nothing and says so. --store-max-size removes the reference opened least
    recently first (the blobs the other still links stay), then the other, and the store is empty."""
    env = {**env, "PRECAST_CACHE": str(tmp_path / "cache")}
    refs = [f"oci://{registry.host}/tiny/gc:{tag}" for tag in ("a", "b")]
    for ref in refs:
        precast("push", bundle, ref, env=env, check=True)
    precast("doctor", refs[0], env=env, check=True)                       # the store: manifest.json's blob only
    for ref in refs:                                                      # a, then b: b is the one opened last
        precast("doctor", ref, "--load", env=env, check=True)
        time.sleep(0.05)
    store = tmp_path / "cache/oci"
    held = {n for n, size in store_blobs(tmp_path / "cache").items()}
    (store / "blobs/sha256" / ("ab" * 32 + ".partial")).write_bytes(b"x" * 1000)
    (store / "blobs/sha256" / ("cd" * 32)).write_bytes(b"y" * 500)       # a blob that nothing links
    holder = subprocess.Popen([sys.executable, "-c", "import sys, pathlib\n"
                               "from precast.runtime.oci.store_gc import store_lock\n"
                               f"with store_lock(pathlib.Path({str(store)!r}), exclusive=False):\n"
                               "    print('held', flush=True); sys.stdin.read()"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        r = json.loads(precast("cache", "gc", "--json", env=env, check=True).stdout)["store"]
        assert r["skipped"].startswith("another precast process has the store open") and r["blobs_removed"] == 0
        assert r["partial_removed"] == 1 and ("cd" * 32) in store_blobs(tmp_path / "cache")
    finally:
        holder.communicate("")
    proc = precast("cache", "gc", env=env, check=True)
    assert "store " in proc.stdout and "removed 2 blobs no reference holds, 0 references" in proc.stdout, proc.stdout
    assert set(store_blobs(tmp_path / "cache")) == held - {hashlib.sha256((bundle / "manifest.json").read_bytes())
                                                           .hexdigest()}
    folders = [store / f"refs/{registry.host.replace(':', '_')}/tiny/gc/{t}" for t in ("a", "b")]
    assert all(precast("bundle", "verify", f).returncode == 0 for f in folders)
    size = json.loads(precast("cache", "gc", "--json", env=env, check=True).stdout)["store"]["size"]
    r = json.loads(precast("cache", "gc", "--store-max-size", str(size - 1), "--json", env=env, check=True).stdout)
    assert r["store"]["references_removed"] == [f"{registry.host.replace(':', '_')}/tiny/gc/a"], r["store"]
    assert r["store"]["blobs_removed"] == 0 and not folders[0].exists()
    assert precast("bundle", "verify", folders[1]).returncode == 0
    r = json.loads(precast("cache", "gc", "--store-max-size", "0", "--json", env=env, check=True).stdout)["store"]
    assert r["size"] == 0 and not store_blobs(tmp_path / "cache") and not folders[1].exists()
    assert png(refs[1], tmp_path / "again.png", env=env) == png(bundle, tmp_path / "local.png")   # pulled again


def test_concurrent_opens_of_one_ref_agree(bundle, registry, pushed, tmp_path, env):
    """Three processes at once (a throttled relay keeps them overlapping): two open the same ref, the third the
    same bundle under another tag (another folder, the same blobs). The first two get the same verified bundle,
    and each blob crosses the wire once in all."""
    precast("push", bundle, pushed.replace(":v1", ":twin"), env=env, check=True)
    relay = Relay(("127.0.0.1", registry.port), rate=40 << 20)
    ref, env = pushed.replace(registry.host, relay.host), {**env, "PRECAST_CACHE": str(tmp_path / "cache")}
    script = ("import json, sys\nfrom precast.runtime.api import open_bundle\nb = open_bundle(sys.argv[1])\n"
              "print(json.dumps({'path': str(b.path), 'bytes': b.remote.pulled.bytes_downloaded, "
              "'files': b.manifest.files}))")
    try:
        ps = [subprocess.Popen([sys.executable, "-c", script, r], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env={**os.environ, **env}) for r in (ref, ref, ref.replace(":v1", ":twin"))]
        outs = [p.communicate(timeout=120) for p in ps]
    finally:
        relay.close()
    assert all(p.returncode == 0 for p in ps), [e for _, e in outs]
    a, b, twin = (json.loads(o) for o, _ in outs)
    assert a["path"] == b["path"] != twin["path"] and a["files"] == b["files"] == twin["files"]
    needed = sum({r["sha256"]: r["size"] for r in a["files"].values()}.values())
    got = [a["bytes"], b["bytes"], twin["bytes"]]
    assert sum(got) == needed and relay.received < needed + 300_000, (got, needed, relay.received)
    assert precast("bundle", "verify", a["path"]).returncode == 0 == precast("bundle", "verify", twin["path"]).returncode
    assert not [p for p in (tmp_path / "cache/oci/blobs/sha256").iterdir() if p.name.endswith(".partial")]


def test_a_ref_without_the_remote_extra_is_one_line(tmp_path):
    """open_bundle("oci://...") without a module of the remote extra (filelock hidden here): one line naming it."""
    script = ("import sys\nsys.modules['filelock'] = None\nfrom precast.runtime.cli import main\n"
              "sys.argv = ['precast', 'generate', 'oci://127.0.0.1:1/a/b:v1', '--prompt', 'x', '--out', sys.argv[1]]\n"
              "main()")
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path / "x.png")], capture_output=True, text=True)
    line = one_line_error(proc)
    assert "remote extra (no module 'filelock')" in line and "precast[remote]" in line


class _Hostile:
    """A registry on 127.0.0.1 that answers what a broken or hostile one might (found by a probe; each was a
    traceback or a misleading line): the first repository name picks the answer."""

    def __init__(self):
        import http.server
        import threading
        port_box = {}

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def _send(self, code, body=b"", headers=None, length=None):
                self.send_response(code)
                for k, v in {"Content-Type": "application/json", **(headers or {})}.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body) if length is None else length))
                self.end_headers()
                self.wfile.write(body)
                self.wfile.flush()

            def do_GET(self):
                path, port = self.path.split("?")[0], port_box["port"]
                parts = path.split("/")           # /v2/MODE/x/manifests/v1, /token/MODE
                mode = parts[2] if len(parts) > 2 and parts[1] in ("v2", "token") else ""
                if path.startswith("/token/"):
                    return self._send(200, {"tokjunk": b"<html>", "toklist": b"[1, 2, 3]",
                                            "tokdeep": b"[" * 100000 + b"]" * 100000}[mode])
                if mode.startswith("tok") and not self.headers.get("Authorization"):
                    return self._send(401, b"{}", {"WWW-Authenticate": f'Bearer realm="http://127.0.0.1:{port}/token/'
                                                                       f'{mode}",service="x"'})
                if mode == "redirect":
                    return self._send(302, b"", {"Location": self.path})
                if mode == "hugelen":
                    self._send(200, b'{"schemaVersion": 2', length=10 ** 15)
                    self.close_connection = True
                    return
                if mode == "drip":                 # a manifest a byte at a time, for ever
                    self.send_response(200)
                    self.send_header("Content-Type", "application/vnd.oci.image.manifest.v1+json")
                    self.send_header("Content-Length", "100000")
                    self.end_headers()
                    try:
                        for _ in range(100000):
                            self.wfile.write(b" ")
                            self.wfile.flush()
                            time.sleep(0.05)
                    except OSError:
                        pass
                    return
                if mode == "cfglist":
                    return self._send(200, json.dumps({"schemaVersion": 2, "config": [1], "layers": []}).encode(),
                                      {"Content-Type": "application/vnd.oci.image.manifest.v1+json"})
                return self._send(404, b"{}")

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        port_box["port"] = self.server.server_address[1]
        self.host = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize("mode, words", [
    ("redirect", "TooManyRedirects"), ("hugelen", "the connection broke while it was read"),
    ("cfglist", "not a precast bundle"), ("tokjunk", "without a token"), ("toklist", "without a token"),
    ("tokdeep", "without a token")])
def test_a_hostile_registry_is_one_line(tmp_path, env, mode, words):
    """Through the CLI and the Python API: one line naming the registry or the reference, exit 2 / UserError."""
    from precast.runtime.api import UserError, open_bundle
    server = _Hostile()
    try:
        ref = f"oci://{server.host}/{mode}/x:v1"
        line = one_line_error(precast("pull", ref, "--out", tmp_path / "x", env=env))
        assert words in line, line
        with pytest.raises(UserError, match=words):
            open_bundle(ref)
    finally:
        server.close()
    assert not (tmp_path / "x").exists()


def test_a_registry_that_drips_its_manifest_is_stopped(tmp_path, env, monkeypatch):
    """A manifest sent a byte at a time restarts the socket's read timeout for ever: past its deadline (120 s +
    1 s per 50 kB; shortened here) the read stops in one line."""
    from precast.runtime.api import UserError, open_bundle
    from precast.runtime.oci import transport
    monkeypatch.setattr(transport, "READ_GRACE_S", 2.0)
    monkeypatch.setattr(transport, "MIN_RATE", 1e9)
    server = _Hostile()
    try:
        t0 = time.time()
        with pytest.raises(UserError, match="still sending: too slow, stopped"):
            open_bundle(f"oci://{server.host}/drip/x:v1")
        assert time.time() - t0 < 12
    finally:
        server.close()
