"""The runtime's T5 tokenizer against transformers' T5TokenizerFast and `tokenizers`, the shipped
T5 vocabulary files against their README, and the tokenizer_2/ folder writer."""
import gzip
import hashlib
import json
import random
import re
import subprocess
import sys

import numpy as np
import pytest

from precast.compiler.errors import BadInput
from precast.compiler.sources.t5_tokenizer_files import (SHIPPED_TOKENIZER_JSON, build_spiece_model,
                                                         spiece_model_from_tokenizer_json,
                                                         write_t5_tokenizer_folder)
from precast.runtime.errors import UserError
from precast.runtime.sentencepiece_model import graphemes
from precast.runtime.t5_tokenizer import DATA, SHIPPED_MODEL, T5Tokenizer

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
TRANSFORMERS5 = int(transformers.__version__.split(".")[0]) >= 5
LENGTHS = (512, 256, 77)

LONG = ("a highly detailed photograph of an astronaut riding a horse across the surface of mars, dust "
        "clouds, dramatic lighting, 8k, sharp focus, (masterpiece:1.2), best quality, ") * 30
PROMPTS = [
    "a photo of a cat",
    "A Photo Of A CAT, highly detailed, 8k, trending on artstation",
    LONG,                                                  # > 512 tokens: truncated at every length
    LONG[:700],                                            # between 77 and 256 tokens
    "",
    " ", "   ", "\t", "\n",
    "a cat ", " a cat", "  lots   of  \t\n whitespace \r\n around  ",
    "tabs\tand\nnewlines\r\nand\x0bvertical\x0cfeeds",
    "café naïve ærøskøbing straße façade",
    "e\u0301cole vs \u00e9cole",                          # decomposed and composed
    "Vie\u0323\u0302t Nam vs Việt Nam",                    # stacked decomposed marks (shortest match)
    "ＡＢＣ１２３ full-width ｶﾀｶﾅ and Ａ\u0301",
    "日本語のプロンプト, 猫の写真, 東京タワー",
    "한국어 프롬프트 \u1100\u1161\u11a8",
    "Привет, мир! Ελληνικά. مرحبا. हिन्दी ไทย",
    "emoji 🙂🐱🔥 👨‍👩‍👧 🏳️‍🌈 ❤️ 🇺🇸",
    "<extra_id_0>", "fill <extra_id_0> the <extra_id_1> gaps<extra_id_99>", "<extra_id_100> <extra_id_",
    "end</s>middle<pad>and<unk> too", "full-width ＜/s＞ spelled",
    "1234567890 3.14159 1e-10 2024/05/17 $19.99 50% #1",
    "wow!!!!!!! ok....... hmm??? -------- ******** ~~~~~~ ((((masterpiece)))) ′′′′′′",
    "superscripts x² y³, fractions ½ ¾, roman Ⅻ, circled ①②, ligature ﬁ, ℃ ㎏",
    "zero\u200bwidth\u200cjoiners\u200d and\u00a0no-break\u3000spaces ▁ literal",
    "controls \x00\x01\x1f\x7f\x85\u2028\u2029 done",
    "quotes 'single' \"double\" ‘curly’ “curly” `back` «guillemets»",
    "url https://example.com/a?b=c&d=e path C:\\dir\\file.png",
]

# Characters to draw random prompts from: every kind of input the pipeline above treats specially.
_POOLS = [
    [chr(c) for c in range(0x20, 0x7F)],
    [chr(c) for c in range(0xA0, 0x250)],
    [chr(c) for c in range(0x300, 0x370)] * 3,
    [chr(c) for c in range(0x3040, 0x3100)] + [chr(c) for c in range(0xFF00, 0xFFEF)],
    [chr(c) for c in range(0x4E00, 0x4E80)],
    [chr(c) for c in range(0x1100, 0x1200)] + [chr(c) for c in range(0xAC00, 0xAC40)],
    [chr(c) for c in range(0x900, 0x980)] + [chr(c) for c in range(0xE00, 0xE60)],
    [chr(c) for c in range(0x1F300, 0x1F700)] + [chr(c) for c in range(0x1F1E6, 0x1F200)] + ["\u200d", "\ufe0f"],
    [" ", "  ", "\t", "\n", "\r\n", "\u3000", "\u00a0", "\u200b", "\u2581"],
    ["<extra_id_0>", "<extra_id_42>", "</s>", "<pad>", "<unk>", "<extra_id_", "<"],
    [chr(c) for c in range(0x590, 0x700)],
    [chr(c) for c in range(0x2000, 0x2200)] + [chr(c) for c in range(0xFB00, 0xFB50)],
    [chr(c) for c in range(0x1E00, 0x1F00)] + [chr(c) for c in range(0x1DC0, 0x1E00)],
    [chr(c) for c in range(0, 0x20)] + ["\x7f", "\x85", "\x9f", "\xad", "\u2028", "\ufeff"],
    ["-" * n for n in range(2, 12)] + ["!" * n for n in range(2, 9)] + ["." * n for n in range(2, 9)],
]


def _random_prompts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(rng.choice(_POOLS)) for _ in range(rng.randint(1, 14))) for _ in range(n)]


CORPUS = PROMPTS + _random_prompts(400)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture(scope="module")
def json_bytes():
    return gzip.decompress(SHIPPED_TOKENIZER_JSON.read_bytes())


@pytest.fixture(scope="module")
def json_path(json_bytes, tmp_path_factory):
    path = tmp_path_factory.mktemp("t5-json") / "tokenizer.json"
    path.write_bytes(json_bytes)
    return path


@pytest.fixture(scope="module")
def ours():
    return T5Tokenizer.shipped()


@pytest.fixture(scope="module")
def hf_fast(json_path):
    return transformers.T5TokenizerFast(tokenizer_file=str(json_path))


@pytest.fixture(scope="module")
def hf_raw(json_bytes):
    return tokenizers.Tokenizer.from_str(json_bytes.decode("utf-8"))


@pytest.fixture(scope="module")
def shipped_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("t5-folder") / "tokenizer_2"
    write_t5_tokenizer_folder(folder)
    return folder


def _hf(tok, prompt: str, n: int) -> tuple[list[int], list[int]]:
    enc = tok(prompt, padding="max_length", max_length=n, truncation=True, add_special_tokens=True)
    return enc["input_ids"], enc["attention_mask"]


# -- the shipped files --------------------------------------------------------------------------

def _readme_sha256s() -> dict[str, str]:
    """file name -> sha256 from the sha256 row of runtime/data/README.md's T5 section."""
    text = (DATA / "README.md").read_text(encoding="utf-8")
    section = text[text.index("## t5_spiece.model"):]
    row = next(line for line in section.splitlines() if line.startswith("| sha256 |"))
    pairs = dict(re.findall(r"`([\w.]+)` `([0-9a-f]{64})`", row))
    pairs["uncompressed"] = re.search(r"uncompressed `([0-9a-f]{64})`", row).group(1)
    return pairs


def test_shipped_files_match_readme(json_bytes):
    shas = _readme_sha256s()
    assert _sha256(SHIPPED_MODEL.read_bytes()) == shas["t5_spiece.model"]
    assert _sha256(SHIPPED_TOKENIZER_JSON.read_bytes()) == shas["t5_tokenizer.json.gz"]
    assert _sha256(json_bytes) == shas["uncompressed"]
    assert (DATA / "LICENSE-t5-tokenizer.txt").is_file()


def test_tokenizer_json_is_t5s(json_bytes):
    doc = json.loads(json_bytes)
    model = doc["model"]
    assert (model["type"], model["unk_id"], len(model["vocab"])) == ("Unigram", 2, 32100)
    assert [v[0] for v in model["vocab"][:3]] == ["<pad>", "</s>", "<unk>"]
    assert [v[0] for v in model["vocab"][32000:]] == [f"<extra_id_{n}>" for n in range(99, -1, -1)]
    assert [n["type"] for n in doc["normalizer"]["normalizers"]] == ["Precompiled", "Replace"]
    assert doc["pre_tokenizer"]["type"] == "Metaspace"
    assert doc["post_processor"]["single"][-1] == {"SpecialToken": {"id": "</s>", "type_id": 0}}


def test_conversion_reproduces_the_shipped_model(json_bytes):
    assert spiece_model_from_tokenizer_json(json_bytes) == SHIPPED_MODEL.read_bytes()


def test_sentencepiece_reads_the_shipped_model_as_t5(json_bytes):
    spm = pytest.importorskip("sentencepiece")
    sp = spm.SentencePieceProcessor(model_file=str(SHIPPED_MODEL))
    vocab = json.loads(json_bytes)["model"]["vocab"]
    assert sp.get_piece_size() == 32000
    assert (sp.pad_id(), sp.eos_id(), sp.unk_id(), sp.bos_id()) == (0, 1, 2, -1)
    assert sp.is_control(0) and sp.is_control(1) and sp.is_unknown(2) and not sp.is_control(3)
    ids = list(range(32000))
    assert [[p, s] for p, s in zip(sp.id_to_piece(ids), sp.get_score(ids))] == vocab[:32000]
    # sentencepiece's own pipeline agrees with tokenizers' where the two have no known difference
    raw = tokenizers.Tokenizer.from_str(json_bytes.decode())
    for prompt in ("a photo of a cat", "café naïve, 日本語 and 123", "ＡＢＣ ½"):
        assert sp.encode(prompt) + [1] == raw.encode(prompt).ids


# -- ids against transformers / tokenizers ------------------------------------------------------

@pytest.mark.parametrize("n", LENGTHS)
def test_matches_t5_tokenizer_fast(ours, hf_fast, n):
    for prompt in CORPUS:
        ids, mask = ours(prompt, n)
        assert ids.dtype == np.int32 and mask.dtype == np.int32 and ids.shape == mask.shape == (n,)
        want_ids, want_mask = _hf(hf_fast, prompt, n)
        assert ids.tolist() == want_ids, prompt
        assert mask.tolist() == want_mask, prompt


@pytest.mark.parametrize("n", LENGTHS)
def test_matches_tokenizers(ours, hf_raw, n):
    raw = hf_raw
    raw.enable_truncation(max_length=n)
    raw.enable_padding(length=n, pad_id=0, pad_token="<pad>")
    try:
        for prompt in CORPUS:
            enc = raw.encode(prompt)
            ids, mask = ours(prompt, n)
            assert ids.tolist() == enc.ids, prompt
            assert mask.tolist() == enc.attention_mask, prompt
    finally:
        raw.no_truncation()
        raw.no_padding()


def test_token_count_and_truncation(ours, hf_fast):
    for prompt in PROMPTS:
        assert ours.tokens(prompt) == len(hf_fast(prompt)["input_ids"]), prompt
    assert ours.tokens(LONG) > 512
    ids, mask = ours(LONG, 77)
    assert ids[-1] == 1 and mask.all()                    # room kept for </s>
    ids, mask = ours("", 77)
    assert ids[0] == 1 and mask.sum() == 1 and not ids[1:].any()


def test_the_known_sentencepiece_differences_are_tokenizers_behaviour(hf_raw, ours):
    """Each difference the module docstring names, checked against tokenizers itself (so this
    fails if tokenizers changes), and against sentencepiece's own pipeline where it differs."""
    spm = pytest.importorskip("sentencepiece")
    sp = spm.SentencePieceProcessor(model_file=str(SHIPPED_MODEL))
    for prompt in ("a cat ", "x <extra_id_0> y", "cafe\u0301\u0301", "-------", "＜/s＞"):
        want = hf_raw.encode(prompt).ids
        assert ours.encode(prompt) + [1] == want
        assert sp.encode(prompt) + [1] != want, prompt    # what plain sentencepiece would get wrong


def test_graphemes():
    assert graphemes("e\u0301\u0301x\r\n\n") == ["e\u0301\u0301", "x", "\r\n", "\n"]
    assert graphemes("\u1100\u1161\u11a8가") == ["\u1100\u1161\u11a8", "가"]
    assert graphemes("🇺🇸🇫") == ["🇺🇸", "🇫"]
    assert graphemes("\u0600a\u200bb") == ["\u0600a", "\u200b", "b"]


def test_runtime_imports_no_build_or_reference_packages():
    code = ("import sys; from precast.runtime.t5_tokenizer import T5Tokenizer; T5Tokenizer.shipped()('a cat', 8); "
            "print([m for m in sys.modules if m.split('.')[0] in "
            "('google', 'tokenizers', 'transformers', 'onnx', 'torch') or m.startswith('precast.compiler')])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# -- the tokenizer_2/ folder --------------------------------------------------------------------

def test_written_folder_loads_in_transformers_and_ours(shipped_folder):
    assert sorted(p.name for p in shipped_folder.iterdir()) == [
        "special_tokens_map.json", "spiece.model", "tokenizer.json", "tokenizer_config.json"]
    hf = transformers.T5TokenizerFast.from_pretrained(str(shipped_folder))
    assert hf.model_max_length == 512 and (hf.eos_token, hf.pad_token, hf.unk_token) == ("</s>", "<pad>", "<unk>")
    # transformers 5 rebuilds the file's pipeline; flavour="transformers5" is that one (module docstring)
    ours = T5Tokenizer.from_folder(shipped_folder, flavour="transformers5" if TRANSFORMERS5 else "tokenizers")
    for prompt in CORPUS:
        for n in (512, 77):
            assert ours(prompt, n)[0].tolist() == _hf(hf, prompt, n)[0], prompt


@pytest.mark.skipif(not TRANSFORMERS5, reason="transformers 4.x runs tokenizer.json as written")
def test_transformers5_from_pretrained_differs_from_the_file_as_written(shipped_folder, hf_fast):
    """KNOWN DIFFERENCE (module docstring of runtime/t5_tokenizer.py, runtime/data/README.md):
    transformers 5's from_pretrained drops a trailing "▁" and breaks score ties the other way."""
    rebuilt = transformers.T5TokenizerFast.from_pretrained(str(shipped_folder))
    ours = T5Tokenizer.from_folder(shipped_folder)
    for prompt in ("a cat ", "-------"):
        assert ours.encode(prompt) + [1] == hf_fast(prompt)["input_ids"]
        assert ours.encode(prompt) + [1] != rebuilt(prompt)["input_ids"]


def test_folder_with_only_tokenizer_json(json_bytes, ours, hf_fast, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "tokenizer.json").write_bytes(json_bytes)
    written = write_t5_tokenizer_folder(tmp_path / "out", src)
    assert "spiece.model" in written
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == json_bytes
    converted = T5Tokenizer.from_folder(tmp_path / "out")
    for prompt in CORPUS[:120]:
        assert converted(prompt, 77)[0].tolist() == _hf(hf_fast, prompt, 77)[0], prompt
    # transformers 5 reading only the converted spiece.model rebuilds the same tokenizer as from the json
    only_model = tmp_path / "only-model"
    only_model.mkdir()
    (only_model / "spiece.model").write_bytes((tmp_path / "out" / "spiece.model").read_bytes())
    from_model = transformers.T5TokenizerFast.from_pretrained(str(only_model))
    from_json = transformers.T5TokenizerFast.from_pretrained(str(src))
    for prompt in CORPUS[:120]:
        assert from_model(prompt)["input_ids"] == from_json(prompt)["input_ids"], prompt


def test_folder_with_only_spiece_model_gets_the_matching_tokenizer_json(tmp_path, json_bytes):
    src = tmp_path / "src"
    src.mkdir()
    (src / "spiece.model").write_bytes(SHIPPED_MODEL.read_bytes())
    (src / "tokenizer_config.json").write_text('{"model_max_length": 256, "extra_ids": 100}')
    write_t5_tokenizer_folder(tmp_path / "out", src)
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == json_bytes
    assert json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())["model_max_length"] == 256
    assert json.loads((tmp_path / "out" / "special_tokens_map.json").read_text())["eos_token"] == "</s>"


def test_unknown_vocabulary_gets_no_tokenizer_json(tmp_path, ours):
    pieces = [(p, s - 0.5 if i > 2 else s) for i, (p, s) in enumerate(ours.pieces)]
    src = tmp_path / "src"
    src.mkdir()
    (src / "spiece.model").write_bytes(build_spiece_model(pieces, ours.charsmap))
    assert "tokenizer.json" not in write_t5_tokenizer_folder(tmp_path / "out", src)


# -- errors ---------------------------------------------------------------------------------------

def _one_line(err: Exception, name: str) -> str:
    msg = str(err)
    assert "\n" not in msg and name in msg, msg
    return msg


@pytest.mark.parametrize("damage", [lambda b: b[:1000], lambda b: b"not a sentencepiece model" * 10,
                                    lambda b: b[:-300]])
def test_damaged_spiece_model(tmp_path, damage):
    src = tmp_path / "tokenizer_2"
    src.mkdir()
    (src / "spiece.model").write_bytes(damage(SHIPPED_MODEL.read_bytes()))
    with pytest.raises(UserError) as e:
        T5Tokenizer.from_folder(src)
    _one_line(e.value, str(src / "spiece.model"))
    with pytest.raises(BadInput) as e:
        write_t5_tokenizer_folder(tmp_path / "out", src)
    _one_line(e.value, str(src / "spiece.model"))
    assert not (tmp_path / "out").exists()


def test_missing_spiece_model(tmp_path):
    with pytest.raises(UserError) as e:
        T5Tokenizer.from_folder(tmp_path)
    assert "missing" in _one_line(e.value, str(tmp_path / "spiece.model"))


def test_not_a_t5_model(tmp_path, ours):
    swapped = [ours.pieces[1], ours.pieces[0], *ours.pieces[2:]]     # </s> at 0: not T5's layout
    (tmp_path / "spiece.model").write_bytes(build_spiece_model(swapped, ours.charsmap))
    with pytest.raises(UserError) as e:
        T5Tokenizer.from_folder(tmp_path)
    assert "not a T5" in _one_line(e.value, "spiece.model")


@pytest.mark.parametrize("damage", [
    lambda b: b[:len(b) // 2],                                        # truncated JSON
    lambda b: b.replace(b'"type": "Unigram"', b'"type": "BPE"', 1),   # another model type
    lambda b: b.replace(b'"precompiled_charsmap": "', b'"precompiled_charsmap": "%', 1),
    lambda b: b.replace(b'"<extra_id_0>"', b'"<extra_id_x>"'),       # extra ids out of order
    lambda b: b"\xff\xfe" + b,                                        # not UTF-8
])
def test_damaged_tokenizer_json(tmp_path, json_bytes, damage):
    damaged = damage(json_bytes)
    assert damaged != json_bytes
    with pytest.raises(BadInput) as e:
        spiece_model_from_tokenizer_json(damaged, source="tokenizer_2/tokenizer.json")
    _one_line(e.value, "tokenizer_2/tokenizer.json")
    src = tmp_path / "src"
    src.mkdir()
    (src / "tokenizer.json").write_bytes(damaged)
    with pytest.raises(BadInput) as e:
        write_t5_tokenizer_folder(tmp_path / "out", src)
    _one_line(e.value, str(src / "tokenizer.json"))


def test_mismatched_pair_refused(tmp_path, json_bytes):
    doc = json.loads(json_bytes)
    doc["model"]["vocab"][100][1] *= 2          # still a float32 value, another score
    src = tmp_path / "src"
    src.mkdir()
    (src / "tokenizer.json").write_text(json.dumps(doc))
    (src / "spiece.model").write_bytes(SHIPPED_MODEL.read_bytes())
    with pytest.raises(BadInput) as e:
        write_t5_tokenizer_folder(tmp_path / "out", src)
    assert "differ" in _one_line(e.value, str(src / "spiece.model"))


def test_tokenizer_json_saved_by_transformers_converts_to_the_same_model(shipped_folder, tmp_path):
    """transformers writes its own pipeline around the same vocabulary (5.x: WhitespaceSplit and no
    Replace): the spiece.model made from it is the shipped one, byte for byte."""
    transformers.T5TokenizerFast.from_pretrained(str(shipped_folder)).save_pretrained(str(tmp_path))
    assert spiece_model_from_tokenizer_json((tmp_path / "tokenizer.json").read_bytes()) == SHIPPED_MODEL.read_bytes()
