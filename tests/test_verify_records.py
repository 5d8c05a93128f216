"""Verify once per file state (runtime/verified.py): the first open of a bundle hashes its files and
records each match with the file's stat data (device, inode, size, mtime, ctime); a later open trusts
a record only while all of them (and the manifest's digests) are unchanged, and hashes anything else.
Bytes hashed are counted through the runtime's hash functions (manifest.bytes_hashed)."""
import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from conftest import flip_byte, precast
from precast.runtime.errors import UserError
from precast.runtime.manifest import bytes_hashed, read_manifest, verify_bundle
from precast.runtime.families.sd import Txt2Img
from precast.runtime.verified import RACY_NS, RECORD_FILE


def fresh_copy(bundle, dest):
    """An independent copy (new inodes) without records; then past verified.RACY_NS, since a file
    changed only just before it is examined is hashed but not recorded."""
    shutil.copytree(bundle, dest, ignore=shutil.ignore_patterns(RECORD_FILE))
    time.sleep(2 * RACY_NS / 1e9)
    return dest


def open_counting(path, **kw):
    """(report of what ran where, bytes hashed) for one open of the bundle, every component loaded."""
    before = bytes_hashed()
    pipe = Txt2Img(path, **kw)
    report = pipe.report()
    return report, bytes_hashed() - before


def artifact_entry(path, report, component):
    aid = report["components"][component]["artifact"]
    return next(a.entry for a in read_manifest(path).artifacts(component) if a.id == aid)


@pytest.fixture
def copy(tiny_bundle, tmp_path):
    return fresh_copy(tiny_bundle[0], tmp_path / "copy")


def test_second_open_of_an_unchanged_bundle_hashes_nothing(copy):
    _, first = open_counting(copy)
    assert first > 0
    records = json.loads((copy / RECORD_FILE).read_text())
    assert "tokenizer/vocab.json" in records["files"]
    _, second = open_counting(copy)
    assert second == 0
    assert precast("bundle", "verify", copy).returncode == 0   # the record file is the bundle's own


def test_a_byte_flipped_with_its_mtime_restored_is_found(copy):
    """Flipping a byte and putting the mtime back with os.utime still moves the ctime: the record no
    longer matches, the file is hashed again, and the changed engine is passed over with its reason."""
    report, _ = open_counting(copy)
    rel = artifact_entry(copy, report, "unet")
    path = copy / rel
    st = os.stat(path)
    flip_byte(path, st.st_size // 2)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    after = os.stat(path)
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (st.st_size, st.st_mtime_ns, st.st_ino)
    report2, hashed = open_counting(copy)
    assert hashed >= st.st_size
    unet = report2["components"]["unet"]
    assert unet["artifact"] != report["components"]["unet"]["artifact"]
    reasons = [r["reason"] for r in unet["passed_over"] if r["artifact"] == report["components"]["unet"]["artifact"]]
    assert reasons and f"{rel}: sha256 differs from the manifest" in reasons[0], unet["passed_over"]


def test_a_changed_tokenizer_is_refused_after_its_record(copy):
    """A changed file the pipeline cannot do without (content with the mtime restored, or size) is
    refused in one line naming it, although an earlier open recorded it as verified."""
    open_counting(copy)
    vocab, merges = copy / "tokenizer/vocab.json", copy / "tokenizer/merges.txt"
    st = os.stat(vocab)
    flip_byte(vocab, 100, mask=1)
    os.utime(vocab, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(UserError, match="tokenizer/vocab.json: sha256 differs from the manifest"):
        Txt2Img(copy)
    flip_byte(vocab, 100, mask=1)                                # back as it was: verified again, fine
    open_counting(copy)
    with open(merges, "ab") as f:
        f.write(b"\n")
    with pytest.raises(UserError, match=r"tokenizer/merges.txt: size \d+, manifest says \d+"):
        Txt2Img(copy)
    proc = precast("generate", copy, "--prompt", "a cat", "--steps", "1", "--out", copy.parent / "x.png")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "tokenizer/merges.txt: size" in lines[0], proc.stderr


def test_records_of_another_file_state_are_ignored(tiny_bundle, copy, tmp_path):
    _, first = open_counting(copy)
    # Records copied into another copy of the same bundle: other inodes, so every file is hashed.
    other = fresh_copy(tiny_bundle[0], tmp_path / "other")
    shutil.copy(copy / RECORD_FILE, other / RECORD_FILE)
    assert open_counting(other)[1] == first
    # One record's inode edited: that file alone is hashed again.
    data = json.loads((copy / RECORD_FILE).read_text())
    data["files"]["tokenizer/vocab.json"]["state"][1] += 1
    (copy / RECORD_FILE).write_text(json.dumps(data))
    assert open_counting(copy)[1] == os.stat(copy / "tokenizer/vocab.json").st_size
    # A record of other expected digests (a manifest changed since) is no record either.
    data = json.loads((copy / RECORD_FILE).read_text())
    data["files"]["tokenizer/vocab.json"]["sha256"] = "0" * 64
    (copy / RECORD_FILE).write_text(json.dumps(data))
    assert open_counting(copy)[1] == os.stat(copy / "tokenizer/vocab.json").st_size


@pytest.mark.parametrize("damage", [b"{not json", b"", b'{"schema": 1, "files": []}', b"\xff\xfe" * 50])
def test_a_damaged_record_file_means_no_records(copy, damage):
    _, first = open_counting(copy)
    (copy / RECORD_FILE).write_bytes(damage)
    assert open_counting(copy)[1] == first
    json.loads((copy / RECORD_FILE).read_text())               # rewritten whole
    assert open_counting(copy)[1] == 0


def test_verify_full_hashes_everything_again(copy):
    _, first = open_counting(copy)
    assert open_counting(copy, verify="full")[1] == first
    assert open_counting(copy)[1] == 0
    for cmd in (["doctor", copy, "--verify", "full"],
                ["generate", copy, "--prompt", "a cat", "--steps", "1", "--verify", "FULL", "--out", copy.parent / "f.png"]):
        assert precast(*cmd).returncode == 0
    proc = precast("doctor", copy, "--verify", "sometimes")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "'sometimes' is not one of" in proc.stderr


def test_bundle_verify_and_unpack_record_what_they_hashed(tiny_bundle, copy, tmp_path):
    """`bundle verify` always hashes every file (records are not trusted there) and refreshes them;
    `bundle unpack` records what it checked while writing: the next open hashes nothing."""
    before = bytes_hashed()
    assert verify_bundle(copy) == []
    hashed = bytes_hashed() - before
    assert verify_bundle(copy) == [] and bytes_hashed() - before == 2 * hashed
    assert open_counting(copy)[1] == 0
    precast("bundle", "pack", tiny_bundle[0], "--out", tmp_path / "b.tar", check=True)
    precast("bundle", "unpack", tmp_path / "b.tar", "--out", tmp_path / "u", check=True)
    assert json.loads((tmp_path / "u" / RECORD_FILE).read_text())["files"]
    time.sleep(2 * RACY_NS / 1e9)
    assert open_counting(tmp_path / "u")[1] == 0
    assert precast("bundle", "verify", tmp_path / "u").returncode == 0


def test_two_processes_opening_a_fresh_bundle_agree(copy):
    """Two real processes open the same never-opened bundle at once: both hash and run, the record file
    they both write is whole afterwards, and a third open trusts it (hashes nothing)."""
    procs = [subprocess.Popen([sys.executable, "-m", "precast.runtime.cli", "generate", str(copy), "--prompt", "a cat",
                               "--steps", "1", "--out", str(copy.parent / f"{i}.png")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
    data = json.loads((copy / RECORD_FILE).read_text())
    assert "tokenizer/vocab.json" in data["files"]
    assert not [p.name for p in copy.iterdir() if ".tmp-" in p.name]
    assert open_counting(copy)[1] == 0


OPEN_TWICE = """
import json, sys
from precast.runtime.manifest import bytes_hashed
from precast.runtime.families.sd import Txt2Img
counts = []
for _ in range(2):
    before = bytes_hashed()
    Txt2Img(sys.argv[1]).report()
    counts.append(bytes_hashed() - before)
print(json.dumps(counts))
"""


def test_a_read_only_bundle_folder_keeps_its_records_in_the_user_cache(tiny_bundle, tmp_path):
    """A bundle folder that cannot be written (a read-only mount as root, whom permissions do not
    stop; its folders made read-only otherwise): the records go to $PRECAST_CACHE/verified/."""
    bundle = fresh_copy(tiny_bundle[0], tmp_path / "bundle")
    cache = tmp_path / "cache"
    opener = [sys.executable, "-c", OPEN_TWICE, str(bundle)]
    if os.geteuid() == 0:
        if not shutil.which("unshare"):
            pytest.skip("running as root without unshare: no way to make the bundle read-only")
        opener = ["unshare", "--mount", "sh", "-c", 'mount --bind "$1" "$1" && mount -o remount,ro,bind "$1" && '
                  'shift && exec "$@"', "sh", str(bundle), *opener]
    else:
        for folder, _, _ in os.walk(bundle):
            os.chmod(folder, 0o555)
    try:
        proc = subprocess.run(opener, capture_output=True, text=True, env={**os.environ, "PRECAST_CACHE": str(cache)})
    finally:
        for folder, _, _ in os.walk(bundle):
            os.chmod(folder, 0o755)
    if os.geteuid() == 0 and "mount" in proc.stderr and proc.returncode != 0 and not proc.stdout:
        pytest.skip(f"cannot make a read-only mount here: {proc.stderr.strip()}")
    assert proc.returncode == 0, proc.stderr
    first, second = json.loads(proc.stdout)
    assert first > 0 and second == 0
    assert not (bundle / RECORD_FILE).exists()
    stored = list((cache / "verified").iterdir())
    assert len(stored) == 1 and json.loads(stored[0].read_text())["files"]


# ---- bundles the compiler writes: `precast build` and `precast bundle merge` record their files ----------------

TINY_RECIPE = ("model: {source: demo:tiny-sd15}\ncomponents: [text_encoder, unet, vae_decoder]\n"
               "profiles: {batch: 1, height: 64, width: 64}\ntargets: [onnxruntime, {openvino: {device: CPU}}]\n")

COUNT_CLI = """
import atexit, sys
from precast.runtime.manifest import bytes_hashed
atexit.register(lambda: sys.stderr.write(f"\\nHASHED {bytes_hashed()}\\n"))
from precast.runtime.cli import main
main(sys.argv[1:], prog_name="precast")
"""


def cli_counting(*args, env=None):
    """(CompletedProcess, bytes hashed) of one real `precast` command, in its own process."""
    proc = subprocess.run([sys.executable, "-c", COUNT_CLI, *map(str, args)], capture_output=True, text=True,
                          env={**os.environ, **(env or {})})
    counts = [int(line.split()[1]) for line in proc.stderr.splitlines() if line.startswith("HASHED ")]
    assert counts, proc.stderr
    return proc, counts[-1]


@pytest.fixture
def build_env(tmp_path):
    """A recipe and a cache of this test's own (the bundles it builds link the cache's files)."""
    (tmp_path / "tiny.yaml").write_text(TINY_RECIPE)
    return tmp_path / "tiny.yaml", {"PRECAST_CACHE": str(tmp_path / "cache")}


def test_a_freshly_built_bundle_opens_without_hashing(build_env, tmp_path):
    """The build checked every file it placed (cache entries are hashed when served, what it wrote
    it hashed): it records them, taken after the rename into place, and the first `generate` or
    `doctor --load` hashes nothing. So does a rebuild over the same folder (all cache hits; removing
    the old bundle, which shared the cache's inodes, moves their ctime, so the records are taken
    after that)."""
    recipe, env = build_env
    out = tmp_path / "b"
    for attempt in ("misses", "hits"):
        precast("build", recipe, "--out", out, env=env, check=True)
        files = json.loads((out / "manifest.json").read_text())["files"]
        assert set(json.loads((out / RECORD_FILE).read_text())["files"]) == set(files), attempt
        proc, hashed = cli_counting("generate", out, "--prompt", "a cat", "--steps", "1", "--out", tmp_path / "g.png")
        assert proc.returncode == 0 and hashed == 0, (attempt, hashed, proc.stderr)
        proc, hashed = cli_counting("doctor", out, "--load", "--json")
        assert proc.returncode == 0 and hashed == 0, (attempt, hashed, proc.stderr)
    assert precast("bundle", "verify", out).returncode == 0


def test_a_file_changed_after_the_build_is_still_found(build_env, tmp_path):
    """A build's records hold the file states it left: a byte flipped afterwards with the mtime put
    back moves the ctime, and the open hashes that file and passes the engine over."""
    recipe, env = build_env
    out = tmp_path / "b"
    precast("build", recipe, "--out", out, env=env, check=True)
    report, hashed = open_counting(out)
    assert hashed == 0
    rel = artifact_entry(out, report, "unet")
    st = os.stat(out / rel)
    flip_byte(out / rel, st.st_size // 2)
    os.utime(out / rel, ns=(st.st_atime_ns, st.st_mtime_ns))
    report2, hashed = open_counting(out)
    assert hashed >= st.st_size
    reasons = [r["reason"] for r in report2["components"]["unet"]["passed_over"]
               if r["artifact"] == report["components"]["unet"]["artifact"]]
    assert reasons and f"{rel}: sha256 differs from the manifest" in reasons[0]
    vocab = out / "tokenizer/vocab.json"
    st = os.stat(vocab)
    flip_byte(vocab, 100, mask=1)
    os.utime(vocab, ns=(st.st_atime_ns, st.st_mtime_ns))
    proc, _ = cli_counting("generate", out, "--prompt", "a cat", "--steps", "1", "--out", tmp_path / "g.png")
    assert proc.returncode == 2 and "tokenizer/vocab.json: sha256 differs from the manifest" in proc.stderr


def test_a_merged_bundle_opens_without_hashing_and_finds_a_change(build_env, tmp_path):
    recipe, env = build_env
    shards = [tmp_path / f"shard{i}" for i in (1, 2)]
    for i, s in enumerate(shards, 1):
        precast("build", recipe, "--out", s, "--shard", f"{i}/2", env=env, check=True)
    merged = tmp_path / "merged"
    precast("bundle", "merge", *shards, "--out", merged, check=True)
    files = json.loads((merged / "manifest.json").read_text())["files"]
    assert set(json.loads((merged / RECORD_FILE).read_text())["files"]) == set(files)
    proc, hashed = cli_counting("doctor", merged, "--load", "--json")
    assert proc.returncode == 0 and hashed == 0, proc.stderr
    report, hashed = open_counting(merged)
    assert hashed == 0
    rel = artifact_entry(merged, report, "vae_decoder")
    st = os.stat(merged / rel)
    flip_byte(merged / rel, st.st_size // 2)
    os.utime(merged / rel, ns=(st.st_atime_ns, st.st_mtime_ns))
    report2, hashed = open_counting(merged)
    assert hashed >= st.st_size
    assert report2["components"]["vae_decoder"]["artifact"] != report["components"]["vae_decoder"]["artifact"]


def test_files_copied_into_a_build_are_not_recorded(build_env, tmp_path, monkeypatch):
    """Where the cache's files cannot be hard-linked (another file system) they are copied; a copy's
    bytes were never hashed, so it is left unrecorded and the first open hashes exactly those."""
    import precast.compiler.bundle as bundle_mod
    from precast.compiler.cache import Cache
    from precast.compiler.recipe import load_recipe
    recipe, env = build_env

    def no_link(src, dst, *a, **kw):
        raise OSError(18, "Invalid cross-device link")
    monkeypatch.setattr(bundle_mod.os, "link", no_link)
    out = tmp_path / "b"
    bundle_mod.build_bundle(load_recipe(recipe), out, progress=False, cache=Cache(env["PRECAST_CACHE"]))
    monkeypatch.undo()
    files = json.loads((out / "manifest.json").read_text())["files"]
    recorded = set(json.loads((out / RECORD_FILE).read_text())["files"])
    copied = {rel for rel in files if rel.rsplit("/", 1)[1] in ("model.onnx", "model.onnx_data", "model.blob")}
    unrecorded = set(files) - recorded       # the copies (and the cache's config.json files, copied then rewritten)
    assert copied and copied <= unrecorded and all(rel.startswith(("onnx/", "artifacts/")) for rel in unrecorded)
    assert "tokenizer/vocab.json" in recorded and "onnx/model_index.json" in recorded
    time.sleep(2 * RACY_NS / 1e9)
    _, hashed = open_counting(out)
    assert 0 < hashed <= sum(files[rel]["size"] for rel in unrecorded)
    assert open_counting(out)[1] == 0
