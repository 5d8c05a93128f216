"""The CPU's automatic memory budget (MemAvailable, read under --sysroot) and the expected peak of each plan
(runtime/budgets.py, PEAK_FACTORS): `precast doctor` and `precast generate` on the tiny SD bundle, on trees
whose /proc/meminfo gives a small MemAvailable (this machine's cpuinfo, so its CPU engines fit)."""
import json
from pathlib import Path

import numpy as np
import pytest
from conftest import precast

from precast.runtime.api import open_bundle
from precast.runtime.budgets import AVAILABLE, PEAK_FACTORS

MiB = 1 << 20


def _root(tmp_path, available: int) -> Path:
    """A recorded tree: this machine's CPU, 16 GB of memory of which `available` bytes are available."""
    root = tmp_path / f"avail-{available}"
    (root / "proc").mkdir(parents=True)
    (root / "proc" / "cpuinfo").write_text(Path("/proc/cpuinfo").read_text())
    (root / "proc" / "meminfo").write_text(f"MemTotal:       16000000 kB\nMemAvailable:   {available // 1024} kB\n")
    return root


def _doctor(bundle, root, *args):
    proc = precast("doctor", bundle, "--json", "--sysroot", root, *args)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout), proc.stderr


@pytest.fixture(scope="module")
def roomy(tiny_bundle, tmp_path_factory):
    """doctor on a tree with 8 GiB available: the tiny bundle resident, and the peaks the model expects."""
    root = _root(tmp_path_factory.mktemp("roomy"), 8 << 30)
    report, _ = _doctor(tiny_bundle[0], root)
    return root, report


def test_doctor_reports_the_expected_peak_of_each_plan(tiny_bundle, roomy):
    """Each plan's expected peak is PEAK_FACTORS on the chosen files' bytes (resident: all of them; one at a time:
    the largest's); with the memory available they fit resident, and the budget says where it came from."""
    root, report = roomy
    comps = report["components"]
    cpu = report["memory"]["cpu"]
    assert report["devices"][-1]["available"] == 8 << 30
    assert (cpu["plan"], cpu["fits"], cpu["budget"], cpu["budget_from"]) == ("resident", True, 8 << 30, AVAILABLE)
    assert AVAILABLE == "available memory (MemAvailable)" and cpu["warning"] is None
    assert sorted(cpu["components"]) == ["text_encoder", "unet", "vae_decoder"]
    each = [(PEAK_FACTORS[r["backend"]], r["memory"]["weights"]) for r in comps.values()]
    one = max(f[1] * w for f, w in each)
    assert cpu["peaks"] == {"resident": int(max(sum(f[0] * w for f, w in each), one)), "one-at-a-time": int(one)}
    assert all(r["memory"]["plan"] == "resident" and not r["note"] for r in comps.values())
    assert open_bundle(tiny_bundle[0], sysroot=str(root)).plan().memory == report["memory"]     # the Python API's
    text = precast("doctor", tiny_bundle[0], "--sysroot", root)
    assert text.returncode == 0 and text.stderr == "", text.stderr
    assert "(8.0 GiB available)" in text.stdout
    assert "memory    cpu: expected peak resident " in text.stdout
    assert "8.00 GiB available memory (MemAvailable) -> generate loads them resident" in text.stdout


def test_short_available_memory_loads_one_at_a_time(tiny_bundle, roomy, tmp_path):
    """Available memory between the one-at-a-time and the resident peak: the components switch to one at a time
    by themselves (doctor says so, generate runs so), none is dropped, the image is the same."""
    root, report = roomy
    peaks = report["memory"]["cpu"]["peaks"]
    short = _root(tmp_path, (peaks["resident"] + peaks["one-at-a-time"]) // 2)
    doctor, err = _doctor(tiny_bundle[0], short)
    cpu = doctor["memory"]["cpu"]
    assert (cpu["plan"], cpu["fits"], cpu["warning"], err) == ("one-at-a-time", True, None, "")
    assert "loaded one at a time: their expected peak together is" in doctor["components"]["unet"]["note"]
    outs = {}
    for name, r in (("roomy", root), ("short", short)):
        proc = precast("generate", tiny_bundle[0], "--prompt", "a cat", "--steps", "2", "--out", tmp_path / f"{name}.png",
                       "--sysroot", r, "--json")
        assert proc.returncode == 0 and "memory plan" not in proc.stderr, proc.stderr
        outs[name] = json.loads(proc.stdout)
    assert {c: r["memory"]["plan"] for c, r in outs["short"]["components"].items()} == \
        dict.fromkeys(["text_encoder", "unet", "vae_decoder"], "one-at-a-time")
    assert {r["memory"]["plan"] for r in outs["roomy"]["components"].values()} == {"resident"}
    assert (tmp_path / "short.png").read_bytes() == (tmp_path / "roomy.png").read_bytes()


def test_no_plan_fits_warns_up_front_and_generate_still_runs(tiny_bundle, tmp_path):
    """1 MiB available: below every plan's expected peak. doctor warns first, with the numbers and what to do
    (exit 0: the estimate may be pessimistic); nothing is dropped as too big (the CPU is the last resort);
    generate warns in one line and makes the image."""
    root = _root(tmp_path, MiB)
    text = precast("doctor", tiny_bundle[0], "--sysroot", root)
    assert text.returncode == 0, text.stderr
    first = text.stderr.splitlines()[0]
    assert first.startswith("warning: no memory plan fits cpu: expected peak resident ")
    assert "cpu has 1.0 MiB of available memory (MemAvailable)" in first and "generate still tries" in first
    assert "smaller precision" in first and "winograd: false" in first and "more memory" in first
    report, _ = _doctor(tiny_bundle[0], root)
    assert (report["memory"]["cpu"]["fits"], report["memory"]["cpu"]["plan"]) == (False, "one-at-a-time")
    for comp, r in report["components"].items():
        assert r["device"] == "cpu" and r["memory"]["fits"] is False, comp
        assert "kept on cpu, the last resort" in r["note"]
        assert not any("exceed" in p["reason"] for p in r["passed_over"]), r["passed_over"]
    out = tmp_path / "tight.png"
    proc = precast("generate", tiny_bundle[0], "--prompt", "a cat", "--steps", "2", "--out", out, "--sysroot", root)
    assert proc.returncode == 0, proc.stderr
    assert [line for line in proc.stderr.splitlines() if "memory plan" in line] == [first]
    assert out.stat().st_size > 0


def test_a_user_budget_overrides_the_automatic_one(tiny_bundle, tmp_path):
    """--params-backend cpu:SIZE keeps today's rule whatever is available: weights against the budget (resident
    under 1G though 1 MiB is available; no warning), and a component larger than it passed over as too big."""
    root = _root(tmp_path, MiB)
    report, err = _doctor(tiny_bundle[0], root, "--params-backend", "cpu:1G")
    cpu = report["memory"]["cpu"]
    assert (cpu["plan"], cpu["budget"], cpu["budget_from"], cpu["fits"], err) == \
        ("resident", 1 << 30, "--params-backend budget", None, "")
    assert "peaks" in cpu and all(not r["note"] for r in report["components"].values())
    small, _ = _doctor(tiny_bundle[0], root, "--params-backend", f"cpu:{4 * MiB}")
    te = small["components"]["text_encoder"]          # ~13 MB of weights
    assert te["device"] is None
    assert any("exceed cpu's budget 4.0 MiB (--params-backend budget)" in p["reason"] for p in te["passed_over"])



def test_a_vae_pass_is_budgeted_from_the_available_memory(tiny_bundle, tmp_path):
    """What a VAE pass may take on the CPU (runtime/vae_tiling.py tiles past it) is the memory available when the run
    started less the weights selected there; a user's cpu:SIZE replaces the available memory."""
    for i, (available, params) in enumerate(((300 * MiB, None), (8 << 30, None), (8 << 30, "cpu:500M"))):
        pipe = open_bundle(tiny_bundle[0], sysroot=str(_root(tmp_path / str(i), available))).pipeline(
            "cpu", params_backend=params).pipe
        weights = sum(r["memory"]["weights"] for r in pipe.report()["components"].values())
        budget = 500 * MiB if params else available       # binary units
        assert pipe._vae_budget("vae_decoder") == budget - weights, (available, params)


def test_the_last_call_releases_each_component_after_its_stage(tiny_bundle):
    """A one-shot caller's last call (`precast generate`'s: release_after_use) lets the text encoder go once the
    prompts are encoded and the UNet once denoising ends, before the VAE decodes: the same image as a resident run,
    those sessions gone after it, the report still naming where each ran; a further call loads them again."""
    pipe = open_bundle(tiny_bundle[0]).pipeline("onnxruntime").pipe
    kept = pipe("a cat", steps=2, seed=3)
    assert all(pipe.loaded[c].session is not None for c in ("text_encoder", "unet", "vae_decoder"))
    pipe.release_after_use = True
    released = pipe("a cat", steps=2, seed=3)
    assert np.array_equal(released, kept)
    assert pipe.loaded["text_encoder"].session is None and pipe.loaded["unet"].session is None
    assert pipe.loaded["vae_decoder"].session is not None
    assert pipe.report()["components"]["unet"]["backend"] == "onnxruntime"
    pipe.release_after_use = False
    assert np.array_equal(pipe("a cat", steps=2, seed=3), kept)
    assert pipe.loaded["unet"].session is not None
