"""Every digest a manifest carries means something: an artifact record's sha256 and size that disagree
with its files' records are a damaged manifest (one line naming the artifact and the field), and a
damaged engine passed over for a fallback is said on stderr (or, under --strict, refused)."""
import json
import re
import shutil

import pytest

from conftest import flip_byte, precast


def _copy(tiny_bundle, tmp_path):
    copy = tmp_path / "b"
    shutil.copytree(tiny_bundle[0], copy)
    return copy


def _unet_blob(bundle):
    """(index, record) of the UNet's OpenVINO artifact: the engine generate selects on this CPU."""
    arts = json.loads((bundle / "manifest.json").read_text())["artifacts"]
    return next((i, a) for i, a in enumerate(arts) if a["component"] == "unet" and a["backend"] == "openvino")


@pytest.mark.parametrize("field, value", [("sha256", "0" * 64), ("size", 1)], ids=["sha256", "size"])
def test_an_artifact_record_that_disagrees_with_its_files_is_refused(tiny_bundle, tmp_path, field, value):
    """An artifact's `sha256` edited to disagree with files[entry].sha256 passed `bundle verify` and
    `generate --verify full`: nothing read it. Now the manifest is refused where it is read."""
    copy = _copy(tiny_bundle, tmp_path)
    manifest = json.loads((copy / "manifest.json").read_text())
    i, art = _unet_blob(copy)
    manifest["artifacts"][i][field] = value
    (copy / "manifest.json").write_text(json.dumps(manifest))
    out = tmp_path / "x.png"
    for args in (["bundle", "verify", copy],
                 ["generate", copy, "--prompt", "x", "--steps", "1", "--verify", "full", "--out", out]):
        proc = precast(*args)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, (args, proc.stderr)
        assert lines[0].startswith(f"error: {copy}/manifest.json: field artifacts[{i}].{field} (artifact "
                                   f"{art['id']!r}) is ") and "rebuild or re-download the bundle" in lines[0], lines[0]
    assert not out.exists()


def test_a_damaged_engine_falls_back_with_one_warning_and_strict_refuses_it(tiny_bundle, tmp_path):
    """One byte flipped in the selected engine: generate exited 0 on the fallback backend, the reason only
    in a stdout 'passed over' line. Now one warning on stderr names the file and `precast bundle verify`;
    with --strict it is exit 2 and no image."""
    copy = _copy(tiny_bundle, tmp_path)
    _, art = _unet_blob(copy)
    blob = copy / art["entry"]
    flip_byte(blob, blob.stat().st_size // 2, mask=1)
    out = tmp_path / "x.png"
    proc = precast("generate", copy, "--prompt", "x", "--steps", "1", "--out", out)
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("warning:")]
    assert proc.returncode == 0 and out.exists(), proc.stderr
    assert len(warnings) == 1 and re.fullmatch(
        rf"warning: {re.escape(str(blob))}: sha256 differs from the manifest \(changed or damaged\); passed over, so "
        rf"unet runs unet\.onnxruntime/\w+ via onnxruntime on cpu; check the bundle with "
        rf"`precast bundle verify {re.escape(str(copy))}`, then rebuild or re-download it", warnings[0]), proc.stderr
    out.unlink()
    proc = precast("generate", copy, "--prompt", "x", "--steps", "1", "--out", out, "--strict")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0] == (f"error: {blob}: sha256 differs from the manifest (changed or damaged); --strict: no fallback "
                        f"past a damaged file; check the bundle with `precast bundle verify {copy}`, then rebuild or "
                        "re-download it")
    assert not out.exists()


def test_the_python_api_warns_and_refuses_under_strict_too(tiny_bundle, tmp_path, capfd):
    from precast.runtime.api import open_bundle
    from precast.runtime.errors import UserError
    copy = _copy(tiny_bundle, tmp_path)
    _, art = _unet_blob(copy)
    flip_byte(copy / art["entry"], 1000)
    bundle = open_bundle(copy)
    with pytest.raises(UserError, match=r"model\.blob: sha256 differs .*--strict: no fallback past a damaged file"):
        bundle.load("unet", strict=True)
    unet = bundle.load("unet")
    assert unet.plan.backend == "onnxruntime"
    err = capfd.readouterr().err
    assert err.count("warning: ") == 1 and f"{copy / art['entry']}: sha256 differs" in err, err
    assert f"`precast bundle verify {copy}`" in err
