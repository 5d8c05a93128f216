"""`--set C.FIELD=V`: every value is checked against the fields precast reads (compiler/families.py
SET_FIELDS) before anything is written; a bad one is exit 2 with one line naming the field."""
import json

import pytest

from conftest import precast


@pytest.mark.parametrize("item, says", [
    ("unet.num_heads=abc", "unet.num_heads"), ("unet.num_heads=[a]", "unet.num_heads"),
    ("unet.num_heads=1e400", "unet.num_heads"), ("unet.num_heads=1.0e+400", "unet.num_heads"),
    ("unet.num_heads={a: 1}", "unet.num_heads"), ("unet.num_heads=[a", "unet.num_heads"),
    ("unet.num_heads=true", "unet.num_heads"), ("unet.num_heads=0", "unet.num_heads"),
    ("unet.num_heads=[]", "unet.num_heads"), ("text_encoder.clip_skip=x", "text_encoder.clip_skip"),
    ("vae.groups=-1", "vae.groups"), ("text_encoder.activation=relu", "quick_gelu"),
    ("model.prediction=xyz", "v_prediction"),
    ("foo.bar=1", "unknown component 'foo'"), ("unet.bogus=1", "unknown field 'bogus'; known for unet: "
                                                             "addition_time_embed_dim, groups, head_dim, num_heads"),
])
def test_bad_set_is_one_line_naming_the_field(demo_ckpt, tmp_path, item, says):
    out = tmp_path / "out"
    proc = precast("export", demo_ckpt, "--out", out, "--component", "vae_decoder", "--set", item)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and f"--set {item}" in lines[0] and says in lines[0], proc.stderr
    assert not out.exists() and not list(tmp_path.glob(".out*"))


def test_known_sets_still_apply(demo_ckpt, tmp_path):
    proc = precast("export", demo_ckpt, "--out", tmp_path / "o", "--component", "unet", "--json",
                   "--set", "unet.num_heads=[2, 2, 2]", "--set", "model.prediction=v_prediction")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["prediction"] == "v_prediction" and report["components"][0]["config"]["num_heads"] == [2, 2, 2]
