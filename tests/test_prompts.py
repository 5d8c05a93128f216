"""Long and weighted prompts as A1111 reads them (runtime/prompts.py): the parser against A1111's documented
examples; the CLIP chunks (75 tokens, BREAK, the comma rule, embeddings kept whole); the conditioning of a tiny
SD 1.x and SDXL bundle against A1111's algorithm written here over transformers' tokenizer and CLIP (chunks
encoded one by one, hidden states times each token's weight, the chunk's mean restored, the negative prompt
padded with the empty prompt's chunk, SDXL's pooled vector from the first chunk unweighted); a 150-token
prompt end to end on a bundle built for a token range; a prompt past the profile says what it needs."""
import json

import numpy as np
import pytest
import torch

from conftest import build_recipe, precast, rel_err
from precast.compiler.demo_model import TINY, TINY_SDXL, random_tensor, sd1_layout, write_safetensors
from precast.runtime.prompts import clip_chunks, emphasize, parse, t5_input
from precast.runtime.tokenizer import ClipTokenizer
import reference as ref

BOS, EOS = 49406, 49407
LONG = ("masterpiece, (best quality:1.3), [blurry], a \\(small\\) wooden cabin in the ((woods)), "
        + "tall pine tree, " * 18 + "BREAK (red sky:0.8) at dusk")     # 3 chunks, the first cut at a comma
NEGATIVE = "(lowres:1.4), [[jpeg]] artifacts"
CATS_DOGS = "cat " * 75 + "dog " * 75                                   # 150 tokens, 2 chunks


# ---- the parser: A1111's parse_prompt_attention docstring examples, then BREAK and the edges -------------
@pytest.mark.parametrize("text, want", [
    ("normal text", [("normal text", 1.0)]),
    ("an (important) word", [("an ", 1.0), ("important", 1.1), (" word", 1.0)]),
    ("(unbalanced", [("unbalanced", 1.1)]),
    ("\\(literal\\]", [("(literal]", 1.0)]),
    ("(unnecessary)(parens)", [("unnecessaryparens", 1.1)]),
    ("a (((house:1.3)) [on] a (hill:0.5), sun, (((sky))).",
     [("a ", 1.0), ("house", 1.5730000000000004), (" ", 1.1), ("on", 1.0), (" a ", 1.1), ("hill", 0.55),
      (", sun, ", 1.1), ("sky", 1.4641000000000006), (".", 1.1)]),      # its docstring's numbers, exactly
    ("((word))", [("word", 1.1 * 1.1)]),
    ("[word]", [("word", 1 / 1.1)]),
    ("[unbalanced", [("unbalanced", 1 / 1.1)]),
    ("closing) only]", [("closing) only]", 1.0)]),           # a bracket that closes nothing is text
    ("a\\\\b \\", [("a\\b ", 1.0)]),                          # \\ is a backslash, a lone \ is dropped
    ("x:1.2) (y:-0.5)", [("x:1.2) ", 1.0), ("y", -0.5)]),      # a weight needs its "("
    ("(a:1.2.3)", [("a:1.2.3)", 1.1)]),                        # not a number: text (A1111 raises)
    ("", [("", 1.0)]),
    ("BREAKfast", [("BREAKfast", 1.0)]),
])
def test_parse_follows_a1111(text, want):
    (got,) = parse(text)
    assert [t for t, _ in got] == [t for t, _ in want]
    assert np.allclose([w for _, w in got], [w for _, w in want], rtol=1e-12)


def test_break_splits_the_prompt_into_parts():
    assert parse("a cat BREAK a dog") == [[("a cat", 1.0)], [("a dog", 1.0)]]
    assert parse("BREAK a") == [[("", 1.0)], [("a", 1.0)]]
    assert parse("(a BREAK b)") == [[("a", 1.1)], [("b", 1.1)]]    # A1111 would encode "BREAK" at weight -1.1


# ---- CLIP chunks -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tok():
    return ClipTokenizer.shipped()


def test_a_plain_prompt_is_one_chunk_with_todays_ids(tok):
    (chunk,) = clip_chunks(tok, "a photo of a cat, 4k")
    assert (chunk.ids == tok("a photo of a cat, 4k")).all() and not chunk.weighted


def test_long_prompts_are_75_token_chunks_wrapped_bos_eos(tok):
    a, b = clip_chunks(tok, CATS_DOGS)
    cat, dog = tok.encode("cat"), tok.encode("dog")
    assert list(a.ids) == [BOS] + cat * 75 + [EOS] and list(b.ids) == [BOS] + dog * 75 + [EOS]
    first, rest, last = clip_chunks(tok, LONG)      # cut after the comma 2 tokens before the 75th
    text = tok.decode(first.ids)
    assert text.endswith("tall pine tree ,") and list(first.ids).index(EOS) == 74
    assert tok.decode(rest.ids).startswith("tall pine tree") and tok.decode(last.ids) == "red sky at dusk"
    assert np.allclose(first.weights[3:5], 1.3) and np.isclose(first.weights[6], 1 / 1.1)
    assert np.allclose(last.weights[:5], [1, 0.8, 0.8, 1, 1])
    empty, dog_chunk = clip_chunks(tok, "BREAK dog")
    assert (empty.ids == tok("")).all() and (dog_chunk.ids == tok("dog")).all()


def test_an_embeddings_vectors_stay_in_one_chunk():
    tok = ClipTokenizer.shipped()
    ids = tok.add_tokens("<style>", 3)
    a, b = clip_chunks(tok, "cat " * 74 + "<style>")
    assert list(a.ids) == [BOS] + tok.encode("cat") * 74 + [EOS, EOS] and list(b.ids[1:5]) == ids + [EOS]


def test_t5_prompts_are_weighted_whole_and_plain_ones_unchanged():
    from precast.runtime.t5_tokenizer import T5Tokenizer
    t5 = T5Tokenizer.shipped()
    ids, mask, weights = t5_input(t5, "a photo of a cat", 16)
    assert (ids == t5("a photo of a cat", 16)[0]).all() and (mask == t5("a photo of a cat", 16)[1]).all()
    assert (weights == 1).all()
    ids, _, weights = t5_input(t5, "a (red:1.5) cat BREAK on a mat", 32)    # no chunks: BREAK joins
    pieces = [(t5.encode(text), w) for text, w in (("a ", 1.0), ("red", 1.5), (" cat", 1.0), ("on a mat", 1.0))]
    want = [i for p, _ in pieces for i in p] + [1]                          # each fragment by itself, </s>
    assert list(ids[:len(want)]) == want and (ids[len(want):] == 0).all()
    assert list(weights) == [w for p, w in pieces for _ in p] + [1.0] * (32 - len(want) + 1)


def test_emphasis_multiplies_then_restores_the_mean():
    z = np.random.default_rng(0).standard_normal((1, 5, 8)).astype(np.float32) + 0.3
    w = np.float32([1, 1.5, 0.5, 1, 1])
    got = emphasize(z, w)
    scaled = z * w[None, :, None]
    assert np.allclose(got, scaled * z.mean() / scaled.mean(), rtol=1e-5)
    assert np.isclose(got.mean(), z.mean(), rtol=1e-5) and emphasize(z, np.ones(5)) is z


# ---- the conditioning against A1111's algorithm -------------------------------------------------------
def a1111_chunks(hf_tok, prompt: str, pad: int) -> list[tuple[list[int], list[float]]]:
    """A1111's tokenize_line with its defaults (comma_padding_backtrack 20), over transformers' tokenizer:
    (ids [77], multipliers [77]) per chunk; SD 2.x/XL's OpenCLIP pads after the first EOS with its pad id."""
    comma = hf_tok.get_vocab()[",</w>"]
    chunks, tokens, mults, last_comma = [], [], [], -1

    def next_chunk():
        nonlocal tokens, mults, last_comma
        ids = [BOS] + tokens + [EOS] * (75 - len(tokens)) + [EOS]
        end = ids.index(EOS)
        chunks.append((ids[:end + 1] + [pad] * (76 - end), [1.0] + mults + [1.0] * (76 - len(mults))))
        tokens, mults, last_comma = [], [], -1

    for i, part in enumerate(parse(prompt)):
        if i:
            next_chunk()
        for text, weight in part:
            for token in hf_tok(text, add_special_tokens=False)["input_ids"]:
                if token == comma:
                    last_comma = len(tokens)
                elif len(tokens) == 75 and last_comma != -1 and len(tokens) - last_comma <= 20:
                    cut = last_comma + 1
                    moved = tokens[cut:], mults[cut:]
                    tokens, mults = tokens[:cut], mults[:cut]
                    next_chunk()
                    tokens, mults = list(moved[0]), list(moved[1])
                if len(tokens) == 75:
                    next_chunk()
                tokens.append(token)
                mults.append(weight)
    if tokens or not chunks:
        next_chunk()
    return chunks


@torch.no_grad()
def a1111_condition(encoders, prompt: str, n: int):
    """[1, 77 n, C] (each encoder's chunks encoded, z * multipliers * original_mean / new_mean, concatenated
    along the sequence; short prompts padded with the empty prompt's chunk; encoders side by side) and the
    pooled vector of the last encoder's first chunk, unweighted."""
    states, pooled = [], None
    for hf_tok, pad, run in encoders:
        chunks = a1111_chunks(hf_tok, prompt, pad)
        chunks += [a1111_chunks(hf_tok, "", pad)[0]] * (n - len(chunks))
        zs = []
        for ids, mults in chunks:
            z, pool = run(np.array([ids]))
            z = torch.from_numpy(z)
            original = z.mean()
            z = z * torch.tensor(mults).reshape(1, -1, 1)
            zs.append((z * (original / z.mean())).numpy())
            pooled = pooled if len(zs) > 1 else pool
        states.append(np.concatenate(zs, axis=1))
    return np.concatenate(states, axis=-1), pooled


def _hf_tokenizer(bundle, folder="tokenizer", pad=None):
    from transformers import CLIPTokenizer
    extra = {"pad_token": pad} if pad else {}
    return CLIPTokenizer(str(bundle / folder / "vocab.json"), str(bundle / folder / "merges.txt"), **extra)


RANGE = "tokens: {min: 77, opt: 77, max: 231}"


@pytest.fixture(scope="module")
def sd1_range(tmp_path_factory):
    """The tiny SD 1.x demo built for 77..231 tokens (3 chunks), ONNX Runtime and OpenVINO on the CPU."""
    tmp = tmp_path_factory.mktemp("prompts-sd1")
    return build_recipe(tmp, "model: {source: demo:tiny-sd15}\ncomponents: [text_encoder, unet, vae_decoder]\n"
                             f"profiles: {{batch: 1, height: 64, width: 64, {RANGE}}}\n"
                             "targets: [onnxruntime, {openvino: {device: CPU}}]\n")


@pytest.mark.parametrize("backend", ["cpu:onnxruntime", "cpu:openvino"])
def test_sd1_conditioning_equals_a1111(sd1_range, demo_ckpt, backend):
    from precast.runtime.families.sd import Txt2Img
    pipe = Txt2Img(sd1_range, backend, width=64, height=64)
    (ctx, _), (neg, _) = pipe.encode_pair(LONG, NEGATIVE)
    te = ref.models_from_single_file(demo_ckpt, TINY)[2]
    encoders = [(_hf_tokenizer(sd1_range), EOS, lambda ids: (ref.run_text_encoder(te, ids)[0], None))]
    want, _ = a1111_condition(encoders, LONG, 3)
    want_neg, _ = a1111_condition(encoders, NEGATIVE, 3)        # padded to the prompt's 3 chunks
    assert ctx.shape == want.shape == (1, 231, TINY.context_dim) and neg.shape == want_neg.shape
    assert rel_err(ctx, want) <= 1e-4 and rel_err(neg, want_neg) <= 1e-4
    assert rel_err(pipe.encode("a photo of a cat")[0], a1111_condition(encoders, "a photo of a cat", 1)[0]) <= 1e-4


@pytest.fixture(scope="module")
def sdxl_range(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("prompts-sdxl")
    ckpt = tmp / "sdxl.safetensors"
    rng = np.random.default_rng(21)
    write_safetensors(str(ckpt), sd1_layout(TINY_SDXL), "fp32", lambda k, s: random_tensor(rng, k, s))
    bundle = build_recipe(tmp, f"model: {{source: {ckpt}}}\ncomponents: [text_encoder, text_encoder_2, unet, "
                               f"vae_decoder]\nprofiles: {{batch: 1, height: 64, width: 64, {RANGE}}}\n"
                               "targets: [onnxruntime]\n")
    return ckpt, bundle


def test_sdxl_conditioning_equals_a1111_for_both_encoders(sdxl_range):
    from precast.runtime.families.sd import Txt2Img
    ckpt, bundle = sdxl_range
    pipe = Txt2Img(bundle, "cpu:onnxruntime", width=64, height=64)
    (ctx, pooled), (neg, neg_pooled) = pipe.encode_pair(LONG, NEGATIVE)
    models = ref.family_models(ckpt, TINY_SDXL)

    def penultimate(name):
        def run(ids):
            h, out = ref.run_hidden(models[name], ids, 2)
            return h, (out.text_embeds.numpy() if hasattr(out, "text_embeds") else None)
        return run
    encoders = [(_hf_tokenizer(bundle), EOS, penultimate("text_encoder")),
                (_hf_tokenizer(bundle, "tokenizer_2", "!"), 0, penultimate("text_encoder_2"))]
    want, want_pooled = a1111_condition(encoders, LONG, 3)
    want_neg, want_neg_pooled = a1111_condition(encoders, NEGATIVE, 3)
    assert ctx.shape == want.shape == (1, 231, TINY_SDXL.context_dim)
    assert rel_err(ctx, want) <= 1e-4 and rel_err(neg, want_neg) <= 1e-4
    assert rel_err(pooled, want_pooled) <= 1e-4 and rel_err(neg_pooled, want_neg_pooled) <= 1e-4
    (_, _), (zeros, zero_pooled) = pipe.encode_pair(LONG, "")     # SDXL base: an empty negative is zeros
    assert zeros.shape == ctx.shape and not zeros.any() and not zero_pooled.any()


# ---- end to end ----------------------------------------------------------------------------------------
def test_a_150_token_prompt_runs_end_to_end_on_a_token_range(sd1_range, tmp_path):
    from precast.runtime.api import open_bundle
    from precast.runtime.png import read_png
    proc = precast("generate", sd1_range, "--prompt", CATS_DOGS, "--negative", "(blurry:1.2)", "--seed", "3",
                   "--steps", "2", "--backend", "cpu:onnxruntime", "--out", tmp_path / "a.png", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["warnings"] == []
    bundle = open_bundle(sd1_range)
    image = bundle.txt2img(prompt=CATS_DOGS, negative="(blurry:1.2)", seed=3, steps=2, backend="cpu:onnxruntime")
    assert image.warnings == () and (image.to_uint8() == read_png(str(tmp_path / "a.png"))).all()
    first = bundle.txt2img(prompt="cat " * 75, negative="(blurry:1.2)", seed=3, steps=2, backend="cpu:onnxruntime")
    assert (first.to_uint8() != image.to_uint8()).any()         # the second chunk is read


def test_a_prompt_past_the_profile_says_what_it_needs(tiny_bundle, tmp_path):
    from precast.runtime.api import open_bundle
    bundle, _ = tiny_bundle                                     # built for 77 tokens
    proc = precast("generate", bundle, "--prompt", CATS_DOGS, "--steps", "1", "--out", tmp_path / "a.png")
    assert proc.returncode == 0, proc.stderr
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("warning:")]
    assert "the prompt needs 154 tokens" in line and "unet engine takes 77" in line
    assert "rebuild with profiles: {tokens: {min: 77, opt: 77, max: 154}}" in line
    opened = open_bundle(bundle)
    cut = opened.txt2img(prompt=CATS_DOGS, steps=1, backend="cpu:onnxruntime")
    assert cut.warnings == (line.removeprefix("warning: "),)
    first = opened.txt2img(prompt="cat " * 75, steps=1, backend="cpu:onnxruntime")
    assert first.warnings == () and (first.pixels == cut.pixels).all()     # cut to the first chunk
