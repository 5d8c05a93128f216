"""An LLM text encoder's tokenizer given as a slow tokenizer's files (Qwen/Qwen-Image's tokenizer/: vocab.json,
merges.txt, tokenizer_config.json with added_tokens_decoder, special_tokens_map.json, added_tokens.json,
chat_template.jinja, no tokenizer.json): the tokenizer.json compiler/sources/llm_tokenizer_files.py writes into the
bundle, read by the runtime (runtime/llm_tokenizer.py), gives transformers' ids on a generated corpus; the
refusals are one line. transformers 5 has one Qwen2 tokenizer class (Qwen2TokenizerFast is Qwen2Tokenizer, the
`tokenizers`-backed one, which builds its model from vocab.json + merges.txt with Qwen2's own pre-tokenizer); the
tokenizer the files were written from is a third reference."""
import json

import pytest

from test_zimage import _corpus
from precast.compiler.demo_zimage import tiny_tokenizer_json
from precast.compiler.errors import BadInput
from precast.compiler.sources.llm_tokenizer_files import llm_tokenizer_files, write_llm_tokenizer_folder

TOOL_CALL = "<tool_call>"       # Qwen2.5's added tokens include non-special ones (special: false)


def write_slow_files(tokenizer_json: str, out, decoder: bool = True) -> None:
    """`out` as Qwen/Qwen-Image's tokenizer/ folder looks, from a tokenizer.json: vocab.json, merges.txt (with its
    `#version` line), tokenizer_config.json (its added tokens in added_tokens_decoder, or, `decoder` False, as older
    transformers wrote them: added_tokens.json with special_tokens_map.json), chat_template.jinja."""
    out.mkdir(parents=True, exist_ok=True)
    tj = json.loads(tokenizer_json)
    (out / "vocab.json").write_text(json.dumps(tj["model"]["vocab"], ensure_ascii=False), encoding="utf-8")
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    (out / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
    specials = [t["content"] for t in tj["added_tokens"] if t["special"] and t["content"] != "<|endoftext|>"]
    named = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "additional_special_tokens": specials}
    config = {"add_prefix_space": False, "bos_token": None, "unk_token": None, "errors": "replace",
              "model_max_length": 131072, "split_special_tokens": False, "tokenizer_class": "Qwen2Tokenizer",
              "clean_up_tokenization_spaces": False, **named}
    if decoder:
        config["added_tokens_decoder"] = {str(t["id"]): {k: v for k, v in t.items() if k != "id"}
                                          for t in tj["added_tokens"]}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (out / "special_tokens_map.json").write_text(json.dumps(named, indent=2))
    (out / "added_tokens.json").write_text(json.dumps({t["content"]: t["id"] for t in tj["added_tokens"]}))
    (out / "chat_template.jinja").write_text("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
                                             "<|im_end|>\n{% endfor %}")


@pytest.mark.parametrize("decoder", [True, False], ids=["added_tokens_decoder", "added_tokens.json"])
def test_slow_files_give_transformers_ids(tmp_path, decoder):
    """A diffusers folder whose tokenizer/ has no tokenizer.json: the bundle's tokenizer.json (through the runtime's
    LLMTokenizer) gives, on 300 generated prompts alone and in Qwen-Image's chat template (special tokens, unicode,
    emojis, digits, whitespace runs), the ids of transformers' Qwen2Tokenizer / Qwen2TokenizerFast / AutoTokenizer
    loaded from the same folder and of the tokenizer the files came from; its added tokens are transformers'."""
    from tokenizers import AddedToken, Tokenizer
    from transformers import AutoTokenizer, Qwen2Tokenizer, Qwen2TokenizerFast
    from precast.runtime.families.qwenimage import TEMPLATE
    from precast.runtime.llm_tokenizer import LLMTokenizer
    original = Tokenizer.from_str(tiny_tokenizer_json())
    original.add_tokens([AddedToken(TOOL_CALL, normalized=not decoder, special=False)])
    write_slow_files(original.to_str(), tmp_path / "model" / "tokenizer", decoder)
    files = llm_tokenizer_files(tmp_path / "model")
    assert set(files) == {"tokenizer.json", "tokenizer_config.json"}
    write_llm_tokenizer_folder(tmp_path / "bundle" / "tokenizer", files)
    ours = LLMTokenizer.from_folder(tmp_path / "bundle" / "tokenizer")
    folder = tmp_path / "model" / "tokenizer"
    theirs = [Qwen2Tokenizer.from_pretrained(folder), Qwen2TokenizerFast.from_pretrained(folder),
              AutoTokenizer.from_pretrained(folder)]
    assert not (folder / "tokenizer.json").exists()     # transformers built theirs from vocab.json + merges.txt too
    added = lambda tok: json.loads(tok.to_str())["added_tokens"]
    assert added(ours.tokenizer) == added(theirs[0].backend_tokenizer)
    assert ours.pad_id == theirs[0].pad_token_id == original.token_to_id("<|endoftext|>")
    prompts = _corpus() + [f"{TOOL_CALL}ls -la{TOOL_CALL} <|im_start|>user\n<tool_call >"]
    texts = prompts + [TEMPLATE.replace("{prompt}", p) for p in prompts]
    mismatched, special = [], 0
    for text in texts:
        mine = ours.encode(text)
        special += original.token_to_id("<|im_start|>") in mine
        for name, want in [("original", original.encode(text).ids)] + \
                [(type(hf).__name__, hf(text)["input_ids"]) for hf in theirs]:
            if mine != want:
                mismatched.append((text[:40], name))
    assert not mismatched, mismatched[:5]
    assert len(texts) > 600 and special >= len(prompts)


def test_slow_files_refusals(tmp_path):
    """Neither tokenizer.json nor vocab.json + merges.txt, one of the two, an unreadable merges.txt, an added token
    at an id the vocabulary does not reach: one line naming the folder and the file."""
    folder = tmp_path / "model" / "tokenizer"
    folder.mkdir(parents=True)
    (folder / "tokenizer_config.json").write_text("{}")

    def refusal(*words):
        with pytest.raises(BadInput) as e:
            llm_tokenizer_files(tmp_path / "model")
        message = str(e.value)
        assert len(message.splitlines()) == 1 and all(w in message for w in words), message

    refusal(str(folder), "no tokenizer.json (nor vocab.json + merges.txt)")
    write_slow_files(tiny_tokenizer_json(), folder)
    (folder / "merges.txt").unlink()
    refusal(str(folder), "no merges.txt")
    (folder / "merges.txt").write_text("#version: 0.2\nĠ\n")
    refusal(str(folder), "merges.txt", "not a readable")
    write_slow_files(tiny_tokenizer_json(), folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"]["600"] = {**config["added_tokens_decoder"]["510"], "content": "<extra>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    refusal("tokenizer_config.json", "'<extra>' has id 600")
