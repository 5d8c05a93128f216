"""Engines through the cache: OpenVINO and ONNX Runtime run and agree; TensorRT-RTX AOT engines
carry the compute capabilities asked for; rebuilds are cache hits; MIGraphX without ROCm is a
clear error."""
import ctypes.util
import json

import sys

import numpy as np
import pytest

from conftest import precast, rel_err
from precast.compiler.cache import Cache
from precast.runtime.sessions import OnnxRuntimeSession, map_engine, open_artifact
from precast.runtime.trt_header import read_header


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory):
    from precast.compiler.demo_model import write_demo_model
    tmp = tmp_path_factory.mktemp("engines")
    write_demo_model(str(tmp / "tiny.safetensors"))
    precast("export", tmp / "tiny.safetensors", "--out", tmp / "onnx", check=True)
    return tmp / "onnx"


@pytest.fixture()
def cache_env(tmp_path):
    return {"PRECAST_CACHE": str(tmp_path / "cache")}


def _compile(export_dir, env, *args):
    proc = precast("compile", export_dir, *args, "--height", "64", "--width", "64", "--json", env=env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)["artifacts"]


def _unet_feeds(seed=0):
    rng = np.random.default_rng(seed)
    return {"sample": rng.standard_normal((2, 4, 8, 8)).astype(np.float32), "timestep": np.array([500.0, 20.0], np.float32),
            "encoder_hidden_states": rng.standard_normal((2, 77, 64)).astype(np.float32)}


@pytest.mark.parametrize("component, feeds", [
    ("unet", _unet_feeds()),
    ("vae_decoder", {"latent_sample": np.random.default_rng(1).standard_normal((1, 4, 8, 8)).astype(np.float32)}),
    ("text_encoder", {"input_ids": np.array([[49406, 320, 1125, 49407] + [49407] * 73], np.int32),
                      "token_embeddings_extra": np.zeros((256, 64), np.float32)}),  # a static engine takes 256 rows
])
def test_openvino_end_to_end_matches_onnxruntime(export_dir, cache_env, component, feeds):
    (rec,) = _compile(export_dir, cache_env, "--target", "openvino", "--component", component)
    assert rec["cache"] == "miss" and rec["fingerprint"].startswith("openvino/")
    entry, _ = Cache(cache_env["PRECAST_CACHE"]).get(rec["key"])
    assert entry.metadata["compile_config"]["INFERENCE_PRECISION_HINT"] == "f32"  # no AMX here
    ov_out = open_artifact(entry.path, entry.metadata).run(feeds)
    ref_out = OnnxRuntimeSession(export_dir / component / "model.onnx").run(feeds)
    for name, want in ref_out.items():
        assert rel_err(ov_out[name], want) <= 1e-4, name
    (again,) = _compile(export_dir, cache_env, "--target", "openvino", "--component", component)
    assert again["cache"] == "hit" and again["key"] == rec["key"]


def test_an_openvino_blob_whose_pages_drop_during_its_import_gives_the_same_outputs(export_dir, cache_env,
                                                                                     monkeypatch):
    """The blob's pages dropped every 0.1 ms while import_model reads them (blob_pages.import_blob), as a multi-GB
    UNet's are every 0.2 s: the imported model's outputs are bit-identical to an import that keeps them, and
    the drops did happen (counted)."""
    from precast.runtime import blob_pages
    (rec,) = _compile(export_dir, cache_env, "--target", "openvino", "--component", "unet")
    entry, _ = Cache(cache_env["PRECAST_CACHE"]).get(rec["key"])
    feeds = _unet_feeds(3)
    monkeypatch.setattr(blob_pages, "release_pages", lambda blob: False)          # kept: the plain import
    kept = open_artifact(entry.path, entry.metadata).run(feeds)
    monkeypatch.undo()
    calls, real = [], blob_pages.release_pages
    monkeypatch.setattr(blob_pages, "release_pages", lambda blob: calls.append(1) or real(blob))
    monkeypatch.setattr(blob_pages, "RELEASE_EVERY", 1e-4)
    dropped = open_artifact(entry.path, entry.metadata).run(feeds)
    assert len(calls) >= 2
    for name, want in kept.items():
        np.testing.assert_array_equal(dropped[name], want)


def _mapped_kb(blob, field: str) -> int:
    """kB of `field` (Rss, Private_Dirty, Anonymous) over the mappings of `blob`, from /proc/self/smaps."""
    import re
    from pathlib import Path
    base, end, total = blob.ctypes.data, blob.ctypes.data + blob.nbytes, 0
    for m in re.finditer(r"^([0-9a-f]+)-([0-9a-f]+) [^\n]*\n((?:[A-Z][\w]*:[^\n]*\n)+)", Path("/proc/self/smaps").read_text(),
                         re.MULTILINE):
        if int(m.group(1), 16) < end and int(m.group(2), 16) > base:
            total += int(re.search(rf"^{field}:\s+(\d+)", m.group(3), re.MULTILINE).group(1))
    return total


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/smaps is Linux's")
def test_blob_pages_drop_unless_written_through_the_map(tmp_path):
    """A blob written moments ago (its pages still dirty in the page cache, as right after `precast build`) is
    dropped from RSS: only pages copied on write count as written. A page written through the map keeps its
    mapping (the drop stops at import time; between calls only mappings without one go), its bytes intact."""
    import os
    from precast.runtime.blob_pages import release_pages
    path = tmp_path / "model.blob"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    os.write(fd, np.arange(1 << 20, dtype=np.uint32).tobytes())      # 4 MiB, not synced
    os.close(fd)
    blob = np.memmap(path, dtype=np.uint8, mode="c")
    assert int(blob.view(np.uint32)[::1024].sum()) > 0                # every page read
    assert _mapped_kb(blob, "Rss") >= 4000
    dirty = _mapped_kb(blob, "Private_Dirty")                        # the page cache's, not ours
    assert release_pages(blob), f"not dropped ({dirty} kB dirty in the page cache)"
    assert _mapped_kb(blob, "Rss") == 0
    assert int(blob.view(np.uint32)[1000]) == 1000                    # read back from the page cache
    blob.view(np.uint32)[5] = 77                                       # copied on write: ours now
    assert _mapped_kb(blob, "Anonymous") > 0
    assert not release_pages(blob)                                     # an import could be writing: nothing dropped
    assert not release_pages(blob, clean_parts=True)                   # its one mapping holds a written page: kept
    assert int(blob.view(np.uint32)[5]) == 77 and int(blob.view(np.uint32)[1 << 19]) == 1 << 19


def test_onnxruntime_artifact_is_simplified_optimized_and_equal(export_dir, cache_env):
    """The artifact is ONNX Runtime's own optimized graph (NCHWc convolutions): it serves this
    CPU's ISA level only, opens with graph passes off, and computes what the export computes."""
    import onnx

    from precast.runtime.cpu import cpu_flags, isa_level
    (rec,) = _compile(export_dir, cache_env, "--target", "onnxruntime", "--component", "unet")
    assert rec["fingerprint"].endswith("/any-cpu/" + isa_level(cpu_flags()))
    entry, _ = Cache(cache_env["PRECAST_CACHE"]).get(rec["key"])
    assert entry.metadata["simplified"] is True and entry.metadata["optimized"] == "all"
    domains = {n.domain for n in onnx.load(str(entry.path / "model.onnx"), load_external_data=False).graph.node}
    assert "com.microsoft.nchwc" in domains
    feeds = _unet_feeds(3)
    got = open_artifact(entry.path, entry.metadata).run(feeds)["out_sample"]
    want = OnnxRuntimeSession(export_dir / "unet/model.onnx").run(feeds)["out_sample"]
    assert rel_err(got, want) <= 1e-5
    import onnxruntime as ort
    # the static 64x64 profile's dims are pinned in the graph, so shapes are planned ahead of time
    dims = {i.name: i.shape for i in ort.InferenceSession(str(entry.path / "model.onnx")).get_inputs()}
    assert dims["sample"] == [2, 4, 8, 8] and dims["encoder_hidden_states"] == [2, 77, 64]
    assert entry.metadata["static"] is True
    (plain,) = _compile(export_dir, cache_env, "--target", "onnxruntime", "--option", "optimize=false",
                        "--component", "unet")
    assert plain["fingerprint"].endswith("/any-cpu/any") and plain["key"] != rec["key"]
    entry, _ = Cache(cache_env["PRECAST_CACHE"]).get(plain["key"])
    dims = {i.name: i.shape for i in ort.InferenceSession(str(entry.path / "model.onnx")).get_inputs()}
    assert dims["sample"] == ["batch", 4, "height", "width"]          # the universal graph: any shape


def test_onnxruntime_builds_are_byte_identical(export_dir, tmp_path):
    """ONNX Runtime writes its optimized nodes in an order (and with names) that vary run to run;
    the target puts them in one order, so two builders of one key ship the same bytes."""
    digests = []
    for run in ("a", "b", "c"):
        env = {"PRECAST_CACHE": str(tmp_path / run)}
        (rec,) = _compile(export_dir, env, "--target", "onnxruntime", "--component", "unet")
        digests.append(Cache(env["PRECAST_CACHE"]).get(rec["key"])[0].files)
    assert digests[0] == digests[1] == digests[2]


def test_tensorrt_rtx_engines_for_sm86_and_the_default_set(export_dir, cache_env):
    trt = pytest.importorskip("tensorrt_rtx")
    recs = _compile(export_dir, cache_env, "--target", "tensorrt-rtx:sm_86", "--target", "tensorrt-rtx",
                    "--component", "vae_decoder")
    cache = Cache(cache_env["PRECAST_CACHE"])
    for rec, want in zip(recs, [("sm_86",), ("sm_80", "sm_86", "sm_89", "sm_120", "sm_121")]):
        assert rec["cache"] == "miss"
        entry, _ = cache.get(rec["key"])
        with map_engine(entry.path / "model.engine") as mapped:     # what the runtime deserializes from
            header = read_header(bytes(mapped[:64]))
            validity, _ = trt.Runtime(trt.Logger()).get_engine_validity(mapped)   # takes the map, no copy
        if ctypes.util.find_library("cuda") is None:                 # no driver (as in CI): INVALID
            assert validity == trt.EngineValidity.INVALID
        assert header.compute_capabilities == want
        assert tuple(entry.metadata["compute_capabilities"]) == want
        assert rec["fingerprint"].split("/")[3] == ",".join(want)
        assert header.version == entry.metadata["toolchain"]["tensorrt-rtx"]
        assert header.size == (entry.path / "model.engine").stat().st_size
    again = _compile(export_dir, cache_env, "--target", "tensorrt-rtx:sm_86", "--target", "tensorrt-rtx",
                     "--component", "vae_decoder")
    assert [r["cache"] for r in again] == ["hit", "hit"]
    assert [r["key"] for r in again] == [r["key"] for r in recs]


def test_different_profiles_and_options_are_different_keys(export_dir, cache_env):
    (a,) = _compile(export_dir, cache_env, "--target", "openvino", "--component", "vae_decoder")
    proc = precast("compile", export_dir, "--target", "openvino", "--component", "vae_decoder", "--height", "128",
                   "--width", "64", "--json", env=cache_env)
    (b,) = json.loads(proc.stdout)["artifacts"]
    (c,) = _compile(export_dir, cache_env, "--target", "openvino", "--component", "vae_decoder",
                    "--option", "precision=bf16")
    assert len({a["key"], b["key"], c["key"]}) == 3 and b["cache"] == c["cache"] == "miss"


def test_refittable_tensorrt_build_says_it_needs_a_driver(export_dir, cache_env):
    proc = precast("compile", export_dir, "--target", "tensorrt-rtx:sm_86", "--option", "refittable=true",
                   "--component", "vae_decoder", env=cache_env)
    assert proc.returncode == 2 and "GPU driver" in proc.stderr


def test_migraphx_without_rocm_is_a_clear_error(export_dir, cache_env):
    proc = precast("compile", export_dir, "--target", "migraphx:gfx1100", "--component", "unet", env=cache_env)
    assert proc.returncode == 2 and "ROCm" in proc.stderr and "Traceback" not in proc.stderr


def test_cache_commands(export_dir, cache_env):
    recs = _compile(export_dir, cache_env, "--target", "onnxruntime", "--component", "vae_decoder",
                    "--component", "vae_encoder")
    ls = json.loads(precast("cache", "ls", "--json", env=cache_env, check=True).stdout)
    assert sorted(e["key"] for e in ls["entries"]) == sorted(r["key"] for r in recs)
    show = json.loads(precast("cache", "show", recs[0]["key"][:10], "--json", env=cache_env, check=True).stdout)
    assert show["verified"] is True and show["metadata"]["component"] == "vae_decoder"
    assert precast("cache", "show", "ffffffff", env=cache_env).returncode == 2
    precast("cache", "rm", recs[0]["key"][:10], env=cache_env, check=True)
    gc = json.loads(precast("cache", "gc", "--max-size", "1K", "--json", env=cache_env, check=True).stdout)
    assert gc["removed"] == [recs[1]["key"]] and gc["size"] == 0


def test_tensorrt_engine_write_error_names_the_file(export_dir, tmp_path):
    """The engine is streamed to its file as it is serialized: a full disk is an error naming the file."""
    from precast.compiler.targets import get_target
    from precast.compiler.targets.base import BuildJob, TargetSpec
    shape = (1, 4, 8, 8)
    job = BuildJob(export_dir / "vae_decoder" / "model.onnx", "vae_decoder", [], {"latent_sample": (shape,) * 3},
                   progress=False)
    (tmp_path / "model.engine").symlink_to("/dev/full")      # every write: ENOSPC
    with pytest.raises(OSError, match=r"model\.engine.*No space left"):
        get_target("tensorrt-rtx").build(job, TargetSpec("tensorrt-rtx", (("compute_capabilities", "sm_86"),)),
                                         tmp_path)


def test_onnxruntime_group_norms_become_instance_norms_with_equal_outputs(export_dir, cache_env):
    """ONNX Runtime has no CPU kernel for GroupNormalization (it inlines ~20 nodes per op): the
    artifact computes each with InstanceNormalization, and the VAE decoder's output is unchanged."""
    import onnx
    (rec,) = _compile(export_dir, cache_env, "--target", "onnxruntime", "--component", "vae_decoder")
    entry, _ = Cache(cache_env["PRECAST_CACHE"]).get(rec["key"])
    exported = onnx.load(str(export_dir / "vae_decoder/model.onnx"), load_external_data=False)
    built = onnx.load(str(entry.path / "model.onnx"), load_external_data=False)
    count = sum(n.op_type == "GroupNormalization" for n in exported.graph.node)
    ops = [n.op_type for n in built.graph.node]
    assert count > 0 and entry.metadata["rewrites"] == {"group_norm": count}
    assert ops.count("InstanceNormalization") == count and "GroupNormalization" not in ops
    assert "ReduceMean" not in ops                      # no inlined function bodies left
    feeds = {"latent_sample": np.random.default_rng(5).standard_normal((1, 4, 8, 8)).astype(np.float32)}
    got = open_artifact(entry.path, entry.metadata).run(feeds)["sample"]
    want = OnnxRuntimeSession(export_dir / "vae_decoder/model.onnx").run(feeds)["sample"]
    assert rel_err(got, want) <= 1e-5


def _copy_export(export_dir, dest, component="unet"):
    import shutil
    shutil.copytree(export_dir / component, dest / component)
    shutil.copy(export_dir / "precast_export.json", dest / "precast_export.json")
    return dest


@pytest.mark.parametrize("damage, words", [
    ("delete data", ["unet/model.onnx_data: missing", "export again"]),
    ("truncate data", ["unet/model.onnx_data: ", "bytes, the export wrote", "export again"]),
    ("garbage graph", ["unet/model.onnx: not a readable ONNX model", "export again"]),
    ("graph names a lost file", ["unet/model.onnx_data: missing or shorter than model.onnx says", "export again"]),
])
def test_damaged_export_is_one_line_naming_the_file(export_dir, cache_env, tmp_path, damage, words):
    bad = _copy_export(export_dir, tmp_path / "exp")
    data, graph = bad / "unet" / "model.onnx_data", bad / "unet" / "model.onnx"
    if damage == "delete data":
        data.unlink()
    elif damage == "truncate data":
        data.write_bytes(data.read_bytes()[:1000])
    elif damage == "garbage graph":
        graph.write_bytes(b"\xff" * graph.stat().st_size)        # same size: only parsing can tell
    else:  # the export's record of files lost, and the weights with it
        index = json.loads((bad / "precast_export.json").read_text())
        for c in index["components"]:
            c.pop("files", None)
        (bad / "precast_export.json").write_text(json.dumps(index))
        data.unlink()
    proc = precast("compile", bad, "--target", "onnxruntime", "--component", "unet", env=cache_env)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert all(w in line for w in words), line


@pytest.mark.parametrize("target, option, words", [
    ("openvino", "threads=abc", ["target openvino: threads='abc'", "integer from 0 to 4096"]),
    ("openvino", "threads=[", ["threads='['"]),                     # not YAML: judged as the string it is
    ("openvino", "threads=99999999999999999999", ["integer from 0 to 4096"]),
    ("openvino", "num_streams=0", ["num_streams=0", "integer from 1 to 4096 or AUTO"]),
    ("openvino", "ir=1", ["ir=1", "allowed: true, false"]),
    ("onnxruntime", "optimize=0", ["optimize=0", "allowed: true, false"]),
    ("openvino", "device=CPU.0", ["device CPU.0", "use CPU"]),
])
def test_target_options_are_checked_before_building(export_dir, cache_env, target, option, words):
    proc = precast("compile", export_dir, "--target", target, "--option", option, "--component", "unet",
                   "--height", "64", "--width", "64", env=cache_env)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert all(w in line for w in words), line


@pytest.mark.parametrize("escape", ["location", "component path"])
def test_a_hostile_export_cannot_reach_files_outside_its_folder(export_dir, cache_env, tmp_path, escape):
    """An export folder whose graph names its weights `../../victim` (or whose record puts a component's graph
    outside the folder): refused in one line before anything is read or copied -- a text encoder's build copies
    its weight files, so such a name once let `compile` overwrite a file of the attacker's choosing."""
    import onnx
    victim = tmp_path / "victim.txt"
    victim.write_text("the user's file\n")
    bad = _copy_export(export_dir, tmp_path / "exp", "text_encoder")
    graph = bad / "text_encoder" / "model.onnx"
    if escape == "location":
        model = onnx.load(str(graph), load_external_data=False)
        for t in model.graph.initializer:
            for e in t.external_data:
                if e.key == "location":
                    e.value = "../../victim.txt"
        graph.write_bytes(model.SerializeToString())
        index = json.loads((bad / "precast_export.json").read_text())
        for c in index["components"]:
            c.pop("files", None)        # the record's sizes would refuse the changed graph first
        words = ["text_encoder/model.onnx: tensor", "'../../victim.txt' is not a file name beside the graph"]
    else:
        index = json.loads((bad / "precast_export.json").read_text())
        for c in index["components"]:
            c["path"] = "../exp/" + c["path"]
        words = ["precast_export.json: component", "'../exp/", "leaves the export's folder"]
    (bad / "precast_export.json").write_text(json.dumps(index))
    proc = precast("compile", bad, "--target", "onnxruntime", "--component", "text_encoder", env=cache_env)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert all(w in line for w in words), line
    assert victim.read_text() == "the user's file\n"


def test_a_record_nested_100000_deep_is_one_line(export_dir, cache_env, tmp_path):
    """precast_export.json as 100,000 nested arrays (json's parser recurses): one line naming it, no traceback."""
    bad = _copy_export(export_dir, tmp_path / "exp")
    (bad / "precast_export.json").write_text("[" * 100_000 + "]" * 100_000)
    proc = precast("compile", bad, "--target", "onnxruntime", "--component", "unet", env=cache_env)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert "precast_export.json: damaged" in line and "export again" in line, line


@pytest.mark.parametrize("damage, words", [
    ("inputs a string", ["precast_export.json: damaged", "not a list of name + shape records"]),
    ("tensor bytes disagree", ["unet/model.onnx: tensor", "holds 8 bytes, its shape [1099511627776] says"]),
    ("protobuf but no model", ["unet/model.onnx: not an ONNX model (no IR version or no nodes)"]),
])
def test_an_export_damaged_past_its_size_checks_is_one_line(export_dir, cache_env, tmp_path, damage, words):
    """Damage that keeps the files parseable (found by a probe; each was an onnxsim / OpenVINO / TypeError
    traceback): a record whose inputs are a string, an inline tensor whose dims claim 2^40 values in 8 bytes,
    a protobuf that is no model."""
    import onnx
    bad = _copy_export(export_dir, tmp_path / "exp")
    graph = bad / "unet" / "model.onnx"
    index = json.loads((bad / "precast_export.json").read_text())
    for c in index["components"]:
        c.pop("files", None)                  # the sizes the export wrote would refuse a changed graph first
        if damage == "inputs a string":
            c["inputs"] = "x"
    (bad / "precast_export.json").write_text(json.dumps(index))
    if damage == "tensor bytes disagree":
        model = onnx.load(str(graph), load_external_data=False)
        t = next(t for t in model.graph.initializer if len(t.raw_data) == 8 and len(t.dims) == 1)
        t.dims[0] = 2 ** 40
        graph.write_bytes(model.SerializeToString())
    elif damage == "protobuf but no model":
        graph.write_bytes(b"\x3a\x00")
    proc = precast("compile", bad, "--target", "onnxruntime", "--component", "unet", env=cache_env)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert all(w in line for w in words), line
