"""The runtime's CLIP tokenizer against transformers' and against CLIP's own algorithm."""
import hashlib
import json
import random
import subprocess
import sys
import unicodedata

import numpy as np
import pytest

from precast.runtime.tokenizer import SHIPPED_MERGES, ClipTokenizer, pretokenize

BOS, EOS = 49406, 49407
SHIPPED_SHA256 = "924691ac288e54409236115652ad4aa250f48203de50a9e4722a6ecd48d6804a"

PROMPTS = [
    "a photo of a cat",
    "A Photo Of A CAT",
    "an astronaut riding a horse on mars, 4k, highly detailed",
    "(masterpiece:1.2), best quality, ((ultra detailed)), [blurry:0.5], {a|b}",
    "masterpiece,best quality,1girl,solo",
    "1234567890 3.14159 1e-10 2024/05/17 $19.99 50% #1",
    "it's they're we've i'm you'll he'd isn't IT'S We'LL",
    "  lots   of \t\n whitespace \r\n around  ",
    "UPPER lower MiXeD",
    "café naïve ærøskøbing straße façade",
    "e\u0301cole vs \u00e9cole",                         # NFC: decomposed and composed alike
    "日本語のプロンプト, 猫の写真",
    "Привет, мир! Ελληνικά. مرحبا. हिन्दी",
    "emoji 🙂🐱🔥 👨‍👩‍👧 🏳️‍🌈 ❤️",
    "superscripts x² y³, fractions ½ ¾, roman Ⅻ, circled ①②",
    "snake_case__words and-dashes -- em—dash… ellipsis",
    "quotes 'single' \"double\" ‘curly’ “curly” `back`",
    "<|startoftext|>hi there<|endoftext|>",
    "url https://example.com/a?b=c&d=e path C:\\dir\\file.png",
    "",
    "   ",
]


@pytest.fixture(scope="module")
def ours():
    return ClipTokenizer.shipped()


@pytest.fixture(scope="module")
def files(ours, tmp_path_factory):
    folder = tmp_path_factory.mktemp("clip-tokenizer")
    ours.write_files(folder)
    return folder


@pytest.fixture(scope="module")
def hf(files):
    transformers = pytest.importorskip("transformers")
    # CLIPTokenizerFast is transformers 5's CLIPTokenizer; on 4.x it avoids the slow class's
    # BERT-style fallback (used when ftfy is missing), which is not CLIP's cleaning.
    return transformers.CLIPTokenizerFast(str(files / "vocab.json"), str(files / "merges.txt"))


def hf_ids(hf, text):
    return hf(text, add_special_tokens=False)["input_ids"]


def test_shipped_data_file_is_the_published_one():
    assert hashlib.sha256(SHIPPED_MERGES.read_bytes()).hexdigest() == SHIPPED_SHA256


def test_vocabulary_and_hand_known_ids(ours):
    assert ours.vocab_size == 49408
    assert ours.encoder["<|startoftext|>"] == BOS and ours.encoder["<|endoftext|>"] == EOS
    assert ours.encoder["!"] == 0 and ours.encoder["a</w>"] == 320
    # Ids published for CLIP's vocabulary by many ports (and checked during development
    # against OpenAI's reference tokenizer with ftfy), not derived from our files.
    assert ours.encode("a photo of a cat") == [320, 1125, 539, 320, 2368]
    assert ours.encode("Hello, world!") == [3306, 267, 1002, 256]
    assert [ours.encode(w) for w in ("cat", "dog", "car")] == [[2368], [1929], [1615]]
    assert ours("a photo of a cat")[:8].tolist() == [BOS, 320, 1125, 539, 320, 2368, EOS, EOS]


@pytest.mark.parametrize("text", PROMPTS)
def test_matches_transformers(ours, hf, text):
    assert ours.encode(text) == hf_ids(hf, text)
    padded = hf(text, padding="max_length", max_length=77, truncation=True)["input_ids"]
    assert ours(text).tolist() == padded


def test_matches_transformers_on_random_unicode(ours, hf):
    """Random strings of assigned code points (all planes) mixed with ASCII that exercises the
    contractions, digits and spacing. Excluded: the characters where transformers itself
    departs from CLIP (test_where_transformers_differs_from_clip)."""
    rng = random.Random(1234)
    skip = {"&", "\u0345", "\u03a3"} | {chr(c) for c in range(0x1C, 0x20)}

    def char():
        if rng.random() < 0.5:
            return rng.choice("ab 's'T1.,;\t'llX")
        while True:
            c = chr(rng.randrange(0x20, 0x110000))
            if unicodedata.category(c) not in ("Cn", "Cs") and c not in skip:
                return c
    texts = ["".join(char() for _ in range(rng.randint(1, 16))) for _ in range(1500)]
    want = hf(texts, add_special_tokens=False)["input_ids"]
    bad = [(t, ours.encode(t), w) for t, w in zip(texts, want) if ours.encode(t) != w]
    assert not bad, [ascii(t) for t, _, _ in bad[:5]]


# transformers' CLIPTokenizer has no ftfy/html step and lower-cases and splits in Rust; on these
# inputs it departs from OpenAI's CLIP tokenizer (simple_tokenizer.py: html.unescape twice,
# Python's str.strip/str.lower, `regex` with IGNORECASE), which is what the runtime follows.
# Each case states CLIP's result as transformers' ids of the text CLIP actually tokenizes; all
# were checked during development against OpenAI's reference code (ftfy reduced to NFC).
@pytest.mark.parametrize("text, clip_sees", [
    # CLIP unescapes HTML entities, twice
    ("rock &amp; roll", "rock & roll"),
    ("&lt;lora&gt; &amp;amp; &#39;x&#39; &quot;q&quot;", "<lora> & 'x' \"q\""),
    # Python's str.lower applies Unicode's final-sigma rule (Σ ending a word -> ς); the
    # tokenizers Lowercase normalizer maps each character alone (Σ -> σ)
    ("ΟΔΟΣ ΚΑΛΟΣ", "οδος καλος"),
    # str.strip() strips U+001C..U+001F (str.isspace), though `regex`'s \s does not match them
    ("\x1fsunset\x1c", "sunset"),
    # U+0345 case-folds to iota: under IGNORECASE, `regex` keeps it out of [^\s\p{L}\p{N}], so
    # CLIP's pattern matches nothing there and the character is dropped
    ("a\u0345b", "a b"),
])
def test_where_transformers_differs_from_clip(ours, hf, text, clip_sees):
    # (transformers 5.23 gives different ids for `text`; not asserted, so a fix there is no failure)
    assert ours.encode(text) == hf_ids(hf, clip_sees)


def test_pretokenize_matches_clip_pattern():
    """Our `re` emulation of CLIP's \\p{L}/\\p{N} pattern against the pattern itself, run by the
    `regex` module (a transformers dependency; test-only), over every character Python knows in
    planes 0-1 and 14 (planes 2-3 are CJK ideographs, all \\p{L}; 15-16 are private use)."""
    regex = pytest.importorskip("regex")
    clip = regex.compile(r"""<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|"""
                         r"""[^\s\p{L}\p{N}]+""", regex.IGNORECASE)
    seps = ["a", " ", "1", "'s", "'", "_", "'ll ", "<|endoftext|>", "\x1c", "x'ſ", "."]
    codes = [*range(0x20000), *range(0x20000, 0x40000, 97), *range(0xE0000, 0xE0200), 0xF0000, 0x10FFFD]
    chars = [chr(c) for c in codes if unicodedata.category(chr(c)) not in ("Cn", "Cs")]
    text = "".join(c + seps[i % len(seps)] for i, c in enumerate(chars)).lower()
    assert pretokenize(text) == clip.findall(text)


def test_long_prompt_truncates_to_77(ours, hf):
    text = ", ".join(f"detail number {i}" for i in range(60))
    ids = ours.encode(text)
    assert len(ids) > 75
    row = ours(text)
    assert row.dtype == np.int32 and row.shape == (77,)
    assert row[0] == BOS and row[-1] == EOS and row[1:-1].tolist() == ids[:75]
    assert row.tolist() == hf(text, padding="max_length", max_length=77, truncation=True)["input_ids"]
    assert ours(text, max_length=10).tolist() == [BOS, *ids[:8], EOS]


def test_pad_id_sd1_vs_openclip(files, hf):
    transformers = pytest.importorskip("transformers")
    sd1, sd2 = ClipTokenizer.shipped(), ClipTokenizer.shipped(pad_id=0)
    a, b = sd1("a photo of a cat"), sd2("a photo of a cat")
    assert a[:7].tolist() == b[:7].tolist() == [BOS, 320, 1125, 539, 320, 2368, EOS]
    assert (a[7:] == EOS).all() and (b[7:] == 0).all()
    # SD2/XL's OpenCLIP tokenizer folders say pad_token "!" (id 0)
    hf0 = transformers.CLIPTokenizerFast(str(files / "vocab.json"), str(files / "merges.txt"), pad_token="!")
    assert b.tolist() == hf0("a photo of a cat", padding="max_length", max_length=77)["input_ids"]
    batch = sd2(["a photo of a cat", "dog"])
    assert batch.shape == (2, 77) and batch.dtype == np.int32 and batch[1, :3].tolist() == [BOS, 1929, EOS]


def test_textual_inversion_trigger_words(ours, files):
    tok = ClipTokenizer.shipped()
    new = tok.add_tokens("<my-style>", 3)
    assert new == [49408, 49409, 49410] and tok.vocab_size == 49411
    assert tok.add_tokens("mystyle", 1) == [49411] and tok.vocab_size == 49412
    base = ours.encode
    assert tok.encode("a painting in <My-Style>, detailed") == [*base("a painting in"), *new, *base(", detailed")]
    assert tok.encode("MYSTYLE portrait") == [49411, *base("portrait")]
    assert tok.encode("mystyles mystyle2 my_mystyle") == base("mystyles mystyle2 my_mystyle")  # whole words only
    assert tok.encode("(mystyle:1.1)") == [*base("("), 49411, *base(":1.1)")]
    with pytest.raises(ValueError):
        tok.add_tokens("mystyle", 2)
    with pytest.raises(ValueError):
        tok.add_tokens("two words", 1)
    # diffusers' convention for a 3-vector embedding: "<my-style> <my-style>_1 <my-style>_2"
    transformers = pytest.importorskip("transformers")
    hf_ti = transformers.CLIPTokenizerFast(str(files / "vocab.json"), str(files / "merges.txt"))
    added = ["<my-style>", "<my-style>_1", "<my-style>_2"]
    hf_ti.add_tokens(added)
    assert hf_ti.convert_tokens_to_ids(added) == new
    assert tok.encode("a painting in <my-style>, detailed") == \
        hf_ids(hf_ti, "a painting in <my-style> <my-style>_1 <my-style>_2, detailed")
    row = tok("<my-style> cat")
    assert row[:6].tolist() == [BOS, *new, 2368, EOS]
    assert ours.vocab_size == 49408                          # shipped() instances do not share triggers
    assert tok.decode(row) == "<my-style> cat"


def test_files_round_trip(tmp_path, ours):
    tok = ClipTokenizer.shipped()
    tok.add_tokens("<ti>", 2)
    tok.write_files(tmp_path)
    assert json.loads((tmp_path / "vocab.json").read_text(encoding="utf-8")) == ours.encoder
    lines = (tmp_path / "merges.txt").read_text(encoding="utf-8").split("\n")
    assert lines[0].startswith("#version") and len(lines) == 1 + 48894 + 1
    assert "# #</w>" in lines                                # a merge that starts with "#" is kept
    back = ClipTokenizer.from_files(tmp_path / "vocab.json", tmp_path / "merges.txt")
    assert back.ranks == ours.ranks and back.vocab_size == 49408
    folder = ClipTokenizer.from_folder(tmp_path)
    assert folder.trigger_words == {"<ti>": [49408, 49409]} and folder.pad_id == EOS
    for text in PROMPTS + ["<ti> on a hill"]:
        assert folder(text).tolist() == tok(text).tolist()
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"pad_token": "!"}))
    assert ClipTokenizer.from_folder(tmp_path).pad_id == 0
    empty = ClipTokenizer.from_folder(tmp_path / "missing")
    assert empty.vocab_size == 49408 and empty.encode("a photo of a cat") == [320, 1125, 539, 320, 2368]


def test_decode(ours):
    assert ours.decode(ours("A photo of a CAT, &amp; 2 dogs!")) == "a photo of a cat , & 2 dogs !"
    assert ours.decode(ours.encode("héllo 🙂")) == "héllo 🙂"


def test_bad_input():
    with pytest.raises(ValueError):
        ClipTokenizer.shipped()("cat", max_length=1)
    with pytest.raises(ValueError):
        ClipTokenizer.shipped().add_tokens("x", 0)


def test_runtime_import_is_thin_and_loads_fast():
    code = (
        "import sys, time\n"
        "t = time.perf_counter()\n"
        "from precast.runtime.tokenizer import ClipTokenizer\n"
        "t1 = time.perf_counter()\n"
        "tok = ClipTokenizer.shipped()\n"
        "t2 = time.perf_counter()\n"
        "assert tok('a photo of a cat')[:7].tolist() == [49406, 320, 1125, 539, 320, 2368, 49407]\n"
        "bad = [m for m in ('transformers', 'tokenizers', 'regex', 'ftfy', 'torch') if m in sys.modules]\n"
        "print(bad, t2 - t1)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[0] == "[]", out
    assert float(out[1]) < 1.0, f"shipped() took {out[1]} s"
