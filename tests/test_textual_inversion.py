"""Textual inversion at run time: every file format read (torch files only through the restricted
loader, which refuses a malicious pickle before it runs), and the text encoder's output with an
embedding equal to diffusers' load_textual_inversion -- through the exported ONNX and through an
engine built before the embedding existed (no rebuild)."""
import bz2
import os
import pickle
import zipfile
import zlib

import numpy as np
import onnxruntime as ort
import pytest
import torch
from safetensors.numpy import save_file

from conftest import rel_err
from precast.compiler.demo_model import TINY
from precast.compiler.errors import BadInput
from precast.compiler.export import export
from precast.compiler.sources.embeddings import assign_encoders, load_torch_restricted, read_embedding
from precast.runtime.embeddings import Embeddings, encoder_feeds, load_bundle_embeddings
from precast.runtime.tokenizer import ClipTokenizer
import reference as ref

PROMPT = "a photo of mystyle in the garden by otherstyle"


@pytest.fixture(scope="module")
def te_export(demo_ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("ti") / "onnx"
    export(demo_ckpt, out, ["text_encoder"], progress=False)
    return out


def _vectors(n, width=TINY.context_dim, seed=0):
    return np.random.default_rng(seed).standard_normal((n, width)).astype(np.float32)


# ---- formats ----------------------------------------------------------------------------------------

def test_formats(tmp_path):
    v = _vectors(3)
    save_file({"emb_params": v}, str(tmp_path / "a.safetensors"))
    save_file({"clip_l": _vectors(2, 768), "clip_g": _vectors(2, 1280)}, str(tmp_path / "xl.safetensors"))
    save_file({"<cat-toy>": v[0]}, str(tmp_path / "learned_embeds.safetensors"))
    torch.save({"<cat-toy>": torch.from_numpy(v[1])}, tmp_path / "learned_embeds.bin")
    torch.save({"string_to_token": {"*": 265}, "string_to_param": {"*": torch.nn.Parameter(torch.from_numpy(v).half())},
                "name": "a1111", "step": 1500, "sd_checkpoint": "abc", "sd_checkpoint_name": "model"},
               tmp_path / "a1111.pt")
    np.testing.assert_array_equal(read_embedding(tmp_path / "a.safetensors")["any"], v)
    xl = read_embedding(tmp_path / "xl.safetensors")
    assert {k: x.shape for k, x in xl.items()} == {"clip_l": (2, 768), "clip_g": (2, 1280)}
    assert {k: x.shape for k, x in assign_encoders("xl", xl, {"text_encoder": 768, "text_encoder_2": 1280}).items()} == \
        {"text_encoder": (2, 768), "text_encoder_2": (2, 1280)}
    np.testing.assert_array_equal(read_embedding(tmp_path / "learned_embeds.safetensors")["any"], v[:1])
    np.testing.assert_array_equal(read_embedding(tmp_path / "learned_embeds.bin")["any"], v[1:2])
    np.testing.assert_array_equal(read_embedding(tmp_path / "a1111.pt")["any"], v.astype(np.float16).astype(np.float32))
    # a non-contiguous view survives the strided rebuild
    torch.save({"emb_params": torch.from_numpy(_vectors(4, 6)).t()}, tmp_path / "t.pt")
    np.testing.assert_array_equal(load_torch_restricted(tmp_path / "t.pt")["emb_params"], _vectors(4, 6).T)
    with pytest.raises(BadInput, match="another model family"):
        assign_encoders("a", {"any": _vectors(1, 1024)}, {"text_encoder": 768})
    bad = v.copy()
    bad[1, 5] = np.nan
    save_file({"emb_params": bad}, str(tmp_path / "nan.safetensors"))
    with pytest.raises(BadInput, match="emb_params holds NaN or infinite values"):
        read_embedding(tmp_path / "nan.safetensors")


class _Evil:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def test_malicious_pickle_is_refused_without_running(tmp_path):
    flag = tmp_path / "pwned"
    payload = pickle.dumps({"string_to_param": {"*": _Evil(flag)}}, protocol=2)
    with zipfile.ZipFile(tmp_path / "evil.pt", "w") as z:   # torch.save's container, evil data.pkl
        z.writestr("evil/data.pkl", payload)
        z.writestr("evil/version", "3\n")
    (tmp_path / "raw.pt").write_bytes(payload)             # a bare pickle
    torch.save({"emb_params": torch.zeros(1, 4), "extra": torch.nn.Linear(1, 1)}, tmp_path / "module.pt")
    for name, match in (("evil.pt", r"refused: the pickle asks for (posix|os|nt)\.system"),
                        ("raw.pt", "non-zip"), ("module.pt", "refused: the pickle asks for torch.nn")):
        with pytest.raises(BadInput, match=match):
            read_embedding(tmp_path / name)
    assert not flag.exists()
    with pytest.raises(BadInput, match="safetensors"):  # the hint says how to convert
        read_embedding(tmp_path / "evil.pt")


# ---- parity with diffusers' load_textual_inversion -------------------------------------------------

def _reference(demo_ckpt, tmp_path, files):
    """diffusers: load_textual_inversion into a pipeline; returns its te output for PROMPT and its ids."""
    import transformers
    from diffusers import PNDMScheduler, StableDiffusionPipeline
    ClipTokenizer.shipped().write_files(tmp_path / "tok")
    tok = transformers.CLIPTokenizerFast(str(tmp_path / "tok/vocab.json"), str(tmp_path / "tok/merges.txt"))
    unet, vae, te = ref.models_from_single_file(demo_ckpt, TINY)
    pipe = StableDiffusionPipeline(vae=vae, text_encoder=te, tokenizer=tok, unet=unet, scheduler=PNDMScheduler(),
                                   safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    for token, path in files:
        pipe.load_textual_inversion(str(path), token=token)
    prompt = pipe.maybe_convert_prompt(PROMPT, pipe.tokenizer)
    ids = pipe.tokenizer(prompt, padding="max_length", max_length=77, return_tensors="np")["input_ids"].astype(np.int32)
    return ref.run_text_encoder(pipe.text_encoder, ids)[0], ids


def test_text_encoder_output_equals_diffusers_load_textual_inversion(demo_ckpt, te_export, tmp_path):
    v1, v2 = _vectors(3, seed=1), _vectors(1, seed=2)
    save_file({"emb_params": v1}, str(tmp_path / "mystyle.safetensors"))
    save_file({"otherstyle": v2}, str(tmp_path / "otherstyle.safetensors"))
    want, want_ids = _reference(demo_ckpt, tmp_path, [("mystyle", tmp_path / "mystyle.safetensors"),
                                                      ("otherstyle", tmp_path / "otherstyle.safetensors")])
    tok = ClipTokenizer.shipped()
    emb = Embeddings(vocab=TINY.vocab)
    for name in ("mystyle", "otherstyle"):
        vec = assign_encoders(name, read_embedding(tmp_path / f"{name}.safetensors"), {"text_encoder": TINY.context_dim})
        emb.add(tok, name, vec)
    ids = tok(PROMPT)[None]
    np.testing.assert_array_equal(ids, want_ids)  # the same ids diffusers' resized tokenizer gives
    sess = ort.InferenceSession(str(te_export / "text_encoder/model.onnx"), providers=["CPUExecutionProvider"])
    got, _ = sess.run(None, emb.feeds("text_encoder", ids, TINY.context_dim))
    assert rel_err(got, want) <= 1e-4
    plain, _ = sess.run(None, Embeddings().feeds("text_encoder", ClipTokenizer.shipped()(PROMPT)[None], TINY.context_dim))
    assert rel_err(plain, want) > 1e-2  # the embedding changed the output


def test_bundle_embeddings_apply_without_rebuilding_the_engine(demo_ckpt, tmp_path):
    """One OpenVINO text-encoder engine serves bundles with and without embeddings (same cache key,
    same blob), and with the embedding it matches diffusers."""
    from precast.compiler.bundle import build_bundle
    from precast.compiler.cache import Cache
    from precast.compiler.recipe import load_recipe
    from precast.runtime.manifest import read_manifest, verify_bundle
    from precast.runtime.sessions import open_artifact
    save_file({"emb_params": _vectors(2, seed=5)}, str(tmp_path / "mystyle.safetensors"))
    cache = Cache(tmp_path / "cache")
    manifests = {}
    for name, extra in (("plain", ""), ("ti", "embeddings: [mystyle.safetensors]\n")):
        (tmp_path / f"{name}.yaml").write_text(
            f"model: {{source: {demo_ckpt}}}\ncomponents: [text_encoder]\n{extra}"
            "profiles: {height: 64, width: 64}\ntargets: [{openvino: {device: CPU}}]\n")
        build_bundle(load_recipe(tmp_path / f"{name}.yaml"), tmp_path / name, progress=False, cache=cache)
        assert verify_bundle(tmp_path / name) == []
        manifests[name] = read_manifest(tmp_path / name)
    (a_plain,), (a_ti,) = manifests["plain"].artifacts(), manifests["ti"].artifacts()
    sha = lambda name, a: manifests[name].files[a.entry]["sha256"]  # noqa: E731
    assert sha("plain", a_plain) == sha("ti", a_ti)  # the engine does not depend on the embeddings
    m = manifests["ti"]
    (entry,) = m.model["embeddings"]
    assert entry["name"] == "mystyle" and entry["vectors"] == 2 and entry["encoders"] == ["text_encoder"]
    tok = ClipTokenizer.from_folder(tmp_path / "ti/tokenizer")
    emb = load_bundle_embeddings(m, tok, m.components["text_encoder"]["config"]["vocab"])
    session = open_artifact(tmp_path / "ti", {"backend": "openvino", "entry": a_ti.entry, **a_ti.metadata})
    # a static profile builds a static engine: the extra rows fixed at the maximum, padded by the runtime
    assert a_ti.metadata["static"] is True and session.input_shapes["token_embeddings_extra"] == [256, TINY.context_dim]
    ids = tok(PROMPT)[None]
    got = session.run(encoder_feeds(session, "text_encoder", ids, emb, TINY.context_dim))["last_hidden_state"]
    want, _ = _reference(demo_ckpt, tmp_path, [("mystyle", tmp_path / "mystyle.safetensors")])
    assert rel_err(got, want) <= 1e-4
    # changed vectors are refused, not applied: the file is checked against the manifest before it is read
    from conftest import flip_byte
    from precast.runtime.errors import UserError
    flip_byte(tmp_path / "ti" / entry["file"], (tmp_path / "ti" / entry["file"]).stat().st_size - 3, mask=1)
    with pytest.raises(UserError, match=r"ti/embeddings/mystyle\.safetensors: sha256 differs from the manifest"):
        load_bundle_embeddings(m, ClipTokenizer.from_folder(tmp_path / "ti/tokenizer"), TINY.vocab)


def test_tensorrt_rtx_builds_the_text_encoder_with_the_extra_input(te_export, tmp_path):
    """AOT build (no GPU needed): the extra input's profile is 256 rows where batch and tokens are
    fixed (a static engine), 1..256 rows where they vary."""
    from precast.compiler.cache import Cache
    from precast.compiler.engines import compile_component, read_export
    from precast.compiler.profiles import ShapeProfile
    from precast.compiler.targets import parse_target
    comp = read_export(te_export)["text_encoder"]
    w = TINY.context_dim
    for profile, want in ((ShapeProfile(), [[256, w]] * 3),
                          (ShapeProfile(batch=(1, 1, 2)), [[1, w], [1, w], [256, w]])):
        rec, entry = compile_component(comp, parse_target("tensorrt-rtx:sm_86", {}), profile, Cache(tmp_path / "c"),
                                       progress=False)
        assert entry.metadata["profile"]["token_embeddings_extra"] == want


@pytest.fixture(scope="module")
def two_embeddings(tmp_path_factory):
    """A tokenizer with `mystyle` (3 vectors) and `otherstyle` (1) registered, and their Embeddings."""
    tok, emb = ClipTokenizer.shipped(), Embeddings(vocab=TINY.vocab)
    emb.add(tok, "mystyle", {"text_encoder": _vectors(3, seed=1)})
    emb.add(tok, "otherstyle", {"text_encoder": _vectors(1, seed=2)})
    return tok, emb


@pytest.mark.parametrize("target", ["openvino", "onnxruntime"])
def test_static_text_encoders_take_the_same_embeddings_as_the_export(te_export, two_embeddings, tmp_path, target):
    """A static profile builds a fully static text encoder (OpenVINO's static-shape path; ONNX Runtime's
    pinned dims): its session declares 256 extra rows, the runtime pads the 5 it has with zeros, and
    the output equals the export's, which matches diffusers (test above). A dynamic profile keeps 1..256."""
    from precast.compiler.cache import Cache
    from precast.compiler.engines import compile_component, read_export
    from precast.compiler.profiles import ShapeProfile
    from precast.compiler.targets import parse_target
    from precast.runtime.sessions import open_artifact
    tok, emb = two_embeddings
    comp = read_export(te_export)["text_encoder"]
    ids = tok(PROMPT)[None]
    ref_session = ort.InferenceSession(str(te_export / "text_encoder/model.onnx"), providers=["CPUExecutionProvider"])
    want = dict(zip(["last_hidden_state", "pooler_output"],
                    ref_session.run(None, emb.feeds("text_encoder", ids, TINY.context_dim))))
    for profile, rows, static in ((ShapeProfile(), 256, True), (ShapeProfile(tokens=(1, 77, 77)), None, False)):
        _, entry = compile_component(comp, parse_target(target, {}), profile, Cache(tmp_path / "c"), progress=False)
        assert bool(entry.metadata["static"]) is static
        session = open_artifact(entry.path, entry.metadata)
        assert session.input_shapes["token_embeddings_extra"] == [rows, TINY.context_dim]
        feeds = encoder_feeds(session, "text_encoder", ids, emb, TINY.context_dim)
        assert feeds["token_embeddings_extra"].shape == (rows or 5, TINY.context_dim)
        got = session.run(feeds)
        for name, ref_out in want.items():
            assert rel_err(got[name], ref_out) <= 1e-5, (profile, name)


def test_an_engine_fixed_at_fewer_rows_than_the_embeddings_is_refused_in_one_line(te_export, two_embeddings,
                                                                                    tmp_path):
    """An OpenVINO engine whose extra rows are fixed at 5 takes 4 vectors (padding none) and refuses a
    fifth, naming the counts and the way out, instead of failing inside the backend."""
    from precast.compiler.engines import read_export
    from precast.compiler.profiles import ShapeProfile
    from precast.compiler.targets import parse_target
    from precast.compiler.targets.base import BuildJob
    from precast.compiler.targets.openvino import OpenVinoTarget
    from precast.runtime.errors import UserError
    from precast.runtime.sessions import open_artifact
    tok, emb = two_embeddings
    comp = read_export(te_export)["text_encoder"]
    shapes = ShapeProfile().input_shapes(comp.name, comp.inputs)
    shapes["token_embeddings_extra"] = ((5, TINY.context_dim),) * 3
    meta = OpenVinoTarget().build(BuildJob(comp.onnx_path, comp.name, comp.inputs, shapes, False),
                                  parse_target("openvino", {}), tmp_path)
    session = open_artifact(tmp_path, {**meta, "backend": "openvino"})
    ids = tok(PROMPT)[None]
    got = session.run(encoder_feeds(session, "text_encoder", ids, emb, TINY.context_dim))
    ref_session = ort.InferenceSession(str(te_export / "text_encoder/model.onnx"), providers=["CPUExecutionProvider"])
    want, _ = ref_session.run(None, emb.feeds("text_encoder", ids, TINY.context_dim))
    assert rel_err(got["last_hidden_state"], want) <= 1e-5
    more = Embeddings(vocab=TINY.vocab)
    more.items = [*emb.items, ("third", {"text_encoder": _vectors(1, seed=3)})]
    with pytest.raises(UserError) as err:
        encoder_feeds(session, "text_encoder", ids, more, TINY.context_dim)
    assert str(err.value) == ("text_encoder: the embeddings bring 5 vectors but this engine was built for at most 4 "
                              "(token_embeddings_extra fixed at 5 rows); use fewer embeddings, or rebuild the bundle "
                              "with this precast version (static text encoders take 255)")


# ---- crafted tensor records: every element must lie inside its storage -------------------------------

class _Storage:
    """Stands for one storage of a crafted torch file; pickled as a persistent id."""


class _TensorRecord:
    """Pickles as torch's own tensor record with chosen (offset, size, stride): what a crafted file can say."""

    def __init__(self, storage, offset, size, stride):
        self.args = (storage, offset, size, stride)

    def __reduce__(self):
        import collections
        return (torch._utils._rebuild_tensor_v2, (*self.args, False, collections.OrderedDict()))


def _crafted_pt(path, offset, size, stride, floats=8):
    storage = _Storage()

    class Pickler(pickle.Pickler):
        def persistent_id(self, obj):
            return ("storage", torch.FloatStorage, "0", "cpu", floats) if obj is storage else None
    import io
    buf = io.BytesIO()
    Pickler(buf, protocol=2).dump({"string_to_param": {"*": _TensorRecord(storage, offset, size, stride)}})
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", buf.getvalue())
        z.writestr("archive/data/0", np.arange(floats, dtype="<f4").tobytes())
        z.writestr("archive/version", "3\n")
    return path


@pytest.mark.parametrize("offset, size, stride, words", [
    (0, (2, 4), (4, 1), None),                                  # the whole storage: fine
    (2, (2, 3), (3, 1), None),                                  # an inner window: fine
    (0, (1, 64), (64, 1), "storage too small for size/stride"),  # reads 56 floats past the end
    (0, (1, 4), (4, 10 ** 8), "storage too small for size/stride"),
    (5, (1, 4), (4, 1), "storage too small for size/stride"),   # the offset pushes it past the end
    (-4, (1, 4), (4, 1), "offset -4 is not a non-negative integer"),
    (0, (2, 4), (4, -1), "negative entry"),
    (0, (2, 4.0), (4, 1), "not a list of integers"),
    ("0", (2, 4), (4, 1), "not a non-negative integer"),
    (0, (2, 4), (1,), "differ in length"),
    (0, (10 ** 12, 64), (0, 0), "over the limit"),
])
def test_tensor_records_outside_their_storage_are_refused(tmp_path, offset, size, stride, words):
    path = _crafted_pt(tmp_path / "crafted.pt", offset, size, stride)
    if words is None:
        want = np.lib.stride_tricks.as_strided(np.arange(8, dtype=np.float32)[offset:], size,
                                               tuple(4 * s for s in stride))
        np.testing.assert_array_equal(read_embedding(path)["any"], want)
        return
    with pytest.raises(BadInput) as e:
        read_embedding(path)
    assert str(e.value).startswith(f"{path}: refused: ") and words in str(e.value) and "\n" not in str(e.value)


def test_build_refuses_an_out_of_bounds_pt_embedding_and_writes_nothing(demo_ckpt, tmp_path):
    """`precast build` with a crafted .pt (a stride reaching far outside its storage) used to crash
    the process (SIGSEGV) and leave its staging folder; now: exit 2, one line, nothing written."""
    from conftest import precast
    emb = _crafted_pt(tmp_path / "oob.pt", 0, (1, 64), (64, 10 ** 8))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model: {{source: {demo_ckpt}}}\ncomponents: [text_encoder]\nembeddings: [{emb}]\n"
                      "profiles: {height: 64, width: 64}\ntargets: [onnxruntime]\n")
    work = tmp_path / "work"
    work.mkdir()
    proc = precast("build", recipe, "--out", work / "b", env={"PRECAST_CACHE": str(tmp_path / "cache")})
    assert proc.returncode == 2, proc.stderr
    assert "storage too small for size/stride" in proc.stderr and str(emb) in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert list(work.iterdir()) == []


# ---- vector counts the runtime can take are checked at build time -------------------------------------

def test_embeddings_outside_the_runtime_row_limit_are_refused_at_build(demo_ckpt, tmp_path):
    """0 vectors built fine and crashed generate ("n must be at least 1"); more than 255 vectors in all
    built fine and generate refused them. Both are now build errors naming the file and the limit."""
    from conftest import precast
    from precast.compiler.sources.embeddings import write_bundle_embeddings
    save_file({"emb_params": np.zeros((0, TINY.context_dim), np.float32)}, str(tmp_path / "empty.safetensors"))
    save_file({"emb_params": _vectors(200)}, str(tmp_path / "big.safetensors"))
    save_file({"emb_params": _vectors(56)}, str(tmp_path / "more.safetensors"))
    save_file({"emb_params": _vectors(55)}, str(tmp_path / "fits.safetensors"))
    for files, words in ((["empty"], "no vectors; an embedding needs at least one"),
                         (["big", "more"], "256 vectors in all, over the runtime's limit of 255")):
        recipe = tmp_path / "r.yaml"
        recipe.write_text(f"model: {{source: {demo_ckpt}}}\ncomponents: [text_encoder]\n"
                          f"embeddings: [{', '.join(str(tmp_path / f'{n}.safetensors') for n in files)}]\n"
                          "profiles: {height: 64, width: 64}\ntargets: [onnxruntime]\n")
        work = tmp_path / "work"
        work.mkdir()
        proc = precast("build", recipe, "--out", work / "b", env={"PRECAST_CACHE": str(tmp_path / "cache")})
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and words in lines[0], proc.stderr
        assert f"{tmp_path / files[-1]}.safetensors" in lines[0]
        assert list(work.iterdir()) == []
        work.rmdir()
    entries, _ = write_bundle_embeddings([tmp_path / "big.safetensors", tmp_path / "fits.safetensors"],
                                         {"text_encoder": TINY.context_dim}, tmp_path / "root")
    assert [e["vectors"] for e in entries] == [200, 55]    # 255 in all: the most the runtime takes


# ---- sizes are checked before anything is inflated ------------------------------------------------------

def _zip(path, members):
    """A zip written by hand, each member's stored bytes, zip method, CRC and stated size as given:
    members = [(name, stored bytes, method, crc, size)]."""
    import struct
    body, central = bytearray(), bytearray()
    for name, data, method, crc, size in members:
        n = name.encode()
        central += struct.pack("<4s6H3L5H2L", b"PK\1\2", 20, 20, 0, method, 0, 0x21, crc, len(data), size,
                               len(n), 0, 0, 0, 0, 0, len(body)) + n
        body += struct.pack("<4s5H3L2H", b"PK\3\4", 20, 0, method, 0, 0x21, crc, len(data), size, len(n), 0) + n + data
    end = struct.pack("<4s4H2LH", b"PK\5\6", 0, 0, len(members), len(members), len(central), len(body), 0)
    path.write_bytes(bytes(body + central + end))
    return path


def _stored(name, data):
    return name, data, zipfile.ZIP_STORED, zlib.crc32(data), len(data)


def _zeros_deflated(mib):
    """Raw deflate data that inflates to `mib` MiB of zeros, made without deflating them all (a
    full flush resets the compressor, so each MiB deflates to the same bytes)."""
    c = zlib.compressobj(9, zlib.DEFLATED, -15)
    one = c.compress(bytes(1 << 20)) + c.flush(zlib.Z_FULL_FLUSH)
    return one * mib + c.flush()


def _storage_pickle(records, numel=8):
    """data.pkl of {"string_to_param": {"*": first tensor}, "more": [the others]}, all on storage 0."""
    import io
    storage = _Storage()

    class Pickler(pickle.Pickler):
        def persistent_id(self, obj):
            return ("storage", torch.FloatStorage, "0", "cpu", numel) if obj is storage else None
    tensors = [_TensorRecord(storage, *r) for r in records]
    buf = io.BytesIO()
    Pickler(buf, protocol=2).dump({"string_to_param": {"*": tensors[0]}, "more": tensors[1:]})
    return buf.getvalue()


_FLOATS = np.arange(8, dtype="<f4").tobytes()
_ONE = [(0, (2, 4), (4, 1))]
_HOSTILE_PT = {   # name: (members, words)
    "storage-bomb": ([_stored("a/data.pkl", _storage_pickle(_ONE)),
                      ("a/data/0", _zeros_deflated(300), zipfile.ZIP_DEFLATED, 0, 300 << 20)],
                     f"a/data/0 inflates to {300 << 20} bytes, over the limit of {256 << 20}"),
    "declared-count": ([_stored("a/data.pkl", _storage_pickle(_ONE, numel=10 ** 12)), _stored("a/data/0", _FLOATS)],
                       "storage 0 declares 1000000000000 elements, more than the limit"),
    "pickle-bomb": ([("a/data.pkl", _zeros_deflated(32), zipfile.ZIP_DEFLATED, 0, 32 << 20)],
                    f"a/data.pkl inflates to {32 << 20} bytes, over the limit of {16 << 20}"),
    "bzip2": ([_stored("a/data.pkl", _storage_pickle(_ONE)),
               ("a/data/0", bz2.compress(_FLOATS), zipfile.ZIP_BZIP2, zlib.crc32(_FLOATS), 32)],
              "a/data/0 is compressed with zip method 12"),
}


@pytest.mark.parametrize("case", sorted(_HOSTILE_PT))
def test_torch_zip_members_are_size_checked_before_they_are_inflated(tmp_path, case):
    """A 300 KB .pt whose storage inflates to 300 MiB (2 GiB took 4.2 GB) was read whole before the
    element limit applied; a storage's declared element count was not looked at; bzip2 members
    inflate without a bound. Each is now refused from the zip's directory and the pickle's record."""
    members, words = _HOSTILE_PT[case]
    path = _zip(tmp_path / "bomb.pt", members)
    with pytest.raises(BadInput) as e:
        read_embedding(path)
    assert str(e.value).startswith(f"{path}: refused: ") and words in str(e.value) and "\n" not in str(e.value)


def test_a_member_is_never_inflated_past_the_size_the_zip_states(tmp_path):
    """A zip directory saying 32 bytes over a deflate stream of 300 MiB: zipfile's read() inflated
    it all before cutting it to 32. Now at most the stated size is inflated."""
    import tracemalloc
    path = _zip(tmp_path / "lying.pt", [_stored("a/data.pkl", _storage_pickle(_ONE)),
                                        ("a/data/0", _zeros_deflated(300), zipfile.ZIP_DEFLATED,
                                         zlib.crc32(bytes(32)), 32)])
    tracemalloc.start()
    try:
        got = read_embedding(path)["any"]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    np.testing.assert_array_equal(got, np.zeros((2, 4), np.float32))
    assert peak < 16 << 20, peak


def test_tensors_sharing_a_storage_count_together_against_the_limit(tmp_path, monkeypatch):
    """Many tensor records on one small storage each made a copy within the per-tensor limit: memory
    without bound. The element limit (here lowered to 100) is now for all of a file's tensors."""
    from precast.compiler.sources import embeddings
    monkeypatch.setattr(embeddings, "MAX_TENSOR_ELEMENTS", 100)
    path = _zip(tmp_path / "many.pt", [_stored("a/data.pkl", _storage_pickle(_ONE * 20)), _stored("a/data/0", _FLOATS)])
    with pytest.raises(BadInput, match="brings the file's tensors over the limit of 100"):
        read_embedding(path)
    few = _zip(tmp_path / "few.pt", [_stored("a/data.pkl", _storage_pickle(_ONE * 12)), _stored("a/data/0", _FLOATS)])
    assert read_embedding(few)["any"].shape == (2, 4)
