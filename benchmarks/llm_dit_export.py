"""Benchmark: full-size exports of the LLM-conditioned families (issue 32's floors): Z-Image-Turbo and its
Qwen3-4B text encoder, Qwen-Image and its Qwen2.5-VL-7B text model.

What it measures, in one run (each part can be chosen with --parts), every source written with deterministic
random weights in the key layout people share (compiler/demo_zimage.py, demo_qwenimage.py: full-size configs):

1. zimage: the Z-Image-Turbo transformer (dim 3840, 30 + 2 + 2 layers, fused qkv: the original release's names,
   as z_image_turbo_bf16.safetensors), bf16 -> `precast export --component transformer --dtype bf16`.
2. qwen3-4b: Qwen3-4B (HF names under `model.`, as ComfyUI's qwen_3_4b.safetensors), bf16, exported as the
   `text_encoder` (`precast export HOST --text-encoder FILE`; HOST: a tiny Z-Image transformer with the 2560-wide
   caption input, whose own weights are not exported; the tokenizer.json beside it).
3. qwen-image: the Qwen-Image transformer (24 heads of 128, context 3584) from plain fp8 e4m3 (as ComfyUI's
   qwen_image_fp8_e4m3fn.safetensors) -> bf16, with --qwen-image-depth of its 60 blocks (default 28: the whole
   model's bf16 export is 40.9 GB, past this machine's free disk; time and memory per byte are what the floors
   judge, and streaming keeps the peak RSS independent of the depth).
4. qwen25-7b: the Qwen2.5-VL-7B text model in ComfyUI's scaled fp8 (HF names under `model.`, a float32
   scale_weight per Linear, as qwen_2.5_vl_7b_fp8_scaled.safetensors; its bf16 source and output together would
   not fit this disk beside the margin) -> bf16, exported as the `text_encoder` beside a tiny Qwen-Image host.

For each: the physical limit (a plain copy of the same bytes -- read the source, write the export's size,
fsync -- in a fresh process, cold page cache, before and after the export; their mean), the export in a fresh
process (wall, + fsync of its output, peak RSS, where the time goes), its output checked (`check_output`:
onnx.load, every external initializer in bounds and traced to its source tensor by the published name
conversions, as many as expected, a dozen tensors equal to the source cast to the export's dtype) and deleted. No torch peer: diffusers' and transformers' models of these sizes do not fit this
machine's memory in fp32, and the bf16 peers of Flux (benchmarks/flux_export.py) took 7-9x precast's time at
20-24 GB RSS.

Everything generic is benchmarks/flux_export.py's, imported; this file holds the configs and the writers.
Floors (the issue): peak RSS <= 1.5 GB (1.5e9 bytes); time <= 1.2x the plain copy of the same bytes.
Every file lives in one work folder (default benchmarks/results/work/llm_dit_export), deleted at the end,
also on failure or interrupt. Disk needed at once: the largest part's source + output (~29 GB at depth 28).

Usage: .venv/bin/python benchmarks/llm_dit_export.py [--parts zimage,qwen3-4b,qwen-image,qwen25-7b]
       [--qwen-image-depth 28] [--work DIR] [--json OUT] [--small]   (--small: 2 blocks/layers at full width)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import flux_export as fe  # noqa: E402  (benchmarks/flux_export.py: copy, export child, check, work folder)

GB = fe.GB
PARTS = ("zimage", "qwen3-4b", "qwen-image", "qwen25-7b")
TIME_FLOOR = 1.2                  # issue 32: at most 1.2x the plain copy of the same bytes


def configs(small: bool, depth: int) -> dict:
    from precast.compiler import demo_qwenimage as dq
    from precast.compiler import demo_zimage as dz
    qwen_image = dq.QwenImageConfig(heads=24, head_dim=128, depth=depth, context=3584)
    qwen25 = dq.Qwen25Config(vocab=152064, hidden=3584, intermediate=18944, layers=28, heads=28, kv_heads=4)
    cfgs = {"zimage": dz.ZIMAGE_TURBO, "qwen3-4b": dz.QWEN3_4B, "qwen-image": qwen_image, "qwen25-7b": qwen25}
    if small:
        cfgs = {"zimage": replace(dz.ZIMAGE_TURBO, layers=2), "qwen3-4b": replace(dz.QWEN3_4B, layers=2),
                "qwen-image": replace(qwen_image, depth=2), "qwen25-7b": replace(qwen25, layers=2)}
    return cfgs


def sources(name: str, cfg, work: Path):
    """(source file, its writer, what it is, the export's arguments before --out, the component, other files
    the export reads: [(path, writer)])."""
    from precast.compiler import demo_qwenimage as dq
    from precast.compiler import demo_zimage as dz
    from precast.compiler.demo_weights import Component, write_components
    axes = ["--set", "transformer.axes_dims_rope=" + json.dumps(dz.DEMO_AXES).replace(" ", "")]
    if name == "zimage":
        src = work / "z_image_turbo_bf16.safetensors"
        return (src, lambda p: write_components(p, dz.zimage_components(cfg, layout="bare"), 0, "bf16"),
                "Z-Image-Turbo transformer, bf16, original names", [str(src)], "transformer", [])
    if name == "qwen-image":
        src = work / "qwen_image_fp8_e4m3fn.safetensors"
        comps = [Component("transformer", "", dq.qwenimage_layout(cfg), True)]
        return (src, lambda p: write_components(p, comps, 0, "fp8_e4m3"),
                f"Qwen-Image transformer ({cfg.depth} of 60 blocks), plain fp8 e4m3", [str(src)], "transformer", [])
    host, tok = work / "host.safetensors", work / "tokenizer.json"
    tokenizer = (tok, lambda p: p.write_text(dz.tiny_tokenizer_json()))
    if name == "qwen3-4b":
        src = work / "qwen_3_4b.safetensors"
        tiny = replace(dz.TINY_ZIMAGE, cap_dim=cfg.hidden)
        extra = [(host, lambda p: write_components(p, dz.zimage_components(tiny, layout="bare"), 0, "bf16")), tokenizer]
        return (src, lambda p: dz.write_qwen3_file(p, cfg, dtype="bf16"), "Qwen3-4B, bf16, HF names",
                [str(host), "--text-encoder", str(src), *axes], "text_encoder", extra)
    tiny = replace(dq.TINY_QWEN_IMAGE, context=cfg.hidden)
    extra = [(host, lambda p: write_components(p, [Component("transformer", "", dq.qwenimage_layout(tiny), True)], 0,
                                               "bf16")), tokenizer]
    src = work / "qwen_2.5_vl_7b_fp8_scaled.safetensors"
    return (src, lambda p: write_components(p, [Component("qwen25", "model.", dq.qwen25_layout(cfg), True)], 0,
                                            "fp8_e4m3_scaled"),
            "Qwen2.5-VL-7B text model, ComfyUI scaled fp8, HF names", [str(host), "--text-encoder", str(src), *axes], "text_encoder",
            extra)


def layout_of(name: str, cfg) -> dict:
    from precast.compiler import demo_qwenimage as dq
    from precast.compiler import demo_zimage as dz
    return {"zimage": lambda: dz.zimage_layout(cfg), "qwen3-4b": lambda: dz.qwen3_layout(cfg),
            "qwen-image": lambda: dq.qwenimage_layout(cfg), "qwen25-7b": lambda: dq.qwen25_layout(cfg)}[name]()


def source_of(part: str, name: str, layers: int):
    """The source key (and row range, for a cut of a fused weight) an exported initializer comes from, written
    here from the published conversions (diffusers' convert_z_image_transformer_checkpoint_to_diffusers; the text
    models keep HF's names under `model.`), not from precast's tables; None for a name no source tensor gives."""
    if part in ("qwen3-4b", "qwen25-7b"):
        return "model." + name, None
    if part == "qwen-image":
        return name, None
    for old, new in (("x_embedder.", "all_x_embedder.2-1."), ("final_layer.", "all_final_layer.2-1.")):
        if name.startswith(new):
            return old + name[len(new):], None
    for i, n in enumerate(("to_q", "to_k", "to_v")):
        if name.endswith(f".attention.{n}.weight"):
            return name[:-len(f"{n}.weight")] + "qkv.weight", i
    for old, new in ((".attention.out.", ".attention.to_out.0."), (".attention.q_norm.", ".attention.norm_q."),
                     (".attention.k_norm.", ".attention.norm_k.")):
        name = name.replace(new, old)
    return name, None


def expected_names(part: str, plan: dict, layers: int) -> int:
    """How many initializers the export should hold: every source weight, q | k | v cut in three (Z-Image), and
    for Qwen3 under Z-Image the layers up to the one it reads (hidden_states[-2]: not the last layer nor the
    final norm)."""
    keys = [k for k in plan if not k.endswith((".scale_weight", ".scale_input", "scaled_fp8"))]
    if part == "zimage":
        return len(keys) + 2 * sum(k.endswith(".attention.qkv.weight") for k in keys)
    if part == "qwen3-4b":
        return sum(not (k == "model.norm.weight" or k.startswith(f"model.layers.{layers - 1}.")) for k in keys)
    return len(keys)


def check_output(out: Path, component: str, part: str, src_path: Path, plan: dict, layers: int) -> dict:
    """The output loads; every external initializer lies in the data file and comes from a source tensor
    (`source_of`); as many as `expected_names`; a dozen tensors spread over the file (a cut of q | k | v
    among them) equal to their source cast to the export's dtype."""
    import ml_dtypes
    import numpy as np
    import onnx
    from onnx import TensorProto
    from precast.compiler.sources.safetensors_file import SafetensorsFile
    folder = out / component
    model = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    data = folder / "model.onnx_data"
    ext = {t.name: {x.key: x.value for x in t.external_data} | {"dtype": t.data_type}
           for t in model.graph.initializer if t.data_location == TensorProto.EXTERNAL}
    size = data.stat().st_size
    in_bounds = all(int(e["offset"]) + int(e["length"]) <= size for e in ext.values())
    src = SafetensorsFile(src_path)
    unknown = [n for n in ext if source_of(part, n, layers)[0] not in src.tensors]
    names = sorted(ext, key=lambda n: int(ext[n]["offset"]))
    picks = {names[i * (len(names) - 1) // 11] for i in range(12)} if names else set()
    picks |= {next((n for n in names if source_of(part, n, layers)[1] is not None), names[0])} if names else set()
    np_of = {TensorProto.BFLOAT16: ml_dtypes.bfloat16, TensorProto.FLOAT: np.float32, TensorProto.FLOAT16: np.float16}
    equal = {}
    with open(data, "rb") as fd:
        for n in sorted(picks - set(unknown)):
            key, third = source_of(part, n, layers)
            raw = src.read(key, raw=True)
            scale = key[:-len("weight")] + "scale_weight"
            if scale in src.tensors:      # ComfyUI scaled fp8: the stored value times the scale, in float32
                raw = raw.astype(np.float32) * src.read(scale).astype(np.float32).reshape(())
            if third is not None:
                rows = raw.shape[0] // 3
                raw = raw[third * rows:(third + 1) * rows]
            want = np.ascontiguousarray(raw.astype(np_of[ext[n]["dtype"]])).reshape(-1).view(np.uint8)
            fd.seek(int(ext[n]["offset"]))
            got = np.frombuffer(fd.read(int(ext[n]["length"])), np.uint8)
            equal[n] = bool(got.size == want.size and np.array_equal(got, want))
    src.close()
    expected = expected_names(part, plan, layers)
    ok = in_bounds and not unknown and len(ext) == expected and all(equal.values())
    print(f"    check: {'ok' if ok else 'FAILED'} ({len(ext)} weights of {expected} expected, {len(model.graph.node)} "
          f"nodes, bytes equal {sum(equal.values())}/{len(equal)}, unknown names {unknown[:3]})", flush=True)
    return {"ok": ok, "external_initializers": len(ext), "expected": expected, "in_bounds": in_bounds,
            "unknown_names": unknown[:5], "bytes_equal": equal, "data_bytes": size}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", default=",".join(PARTS), help=",".join(PARTS))
    ap.add_argument("--qwen-image-depth", type=int, default=28, help="blocks of the Qwen-Image transformer (60 whole)")
    ap.add_argument("--work", type=Path, default=HERE / "results" / "work" / "llm_dit_export",
                    help="work folder (new or empty; deleted at the end)")
    ap.add_argument("--json", type=Path, default=HERE / "results" / "llm_dit_export.json", help="results file")
    ap.add_argument("--small", action="store_true", help="2 blocks / layers at full width (a quick try)")
    opts = ap.parse_args()
    parts = [p for p in opts.parts.split(",") if p]
    if [p for p in parts if p not in PARTS]:
        raise SystemExit(f"unknown part: {', '.join(p for p in parts if p not in PARTS)}")
    fe.MARKER, fe.TIME_FLOOR = ".llm_dit_export_work", TIME_FLOOR
    from precast.compiler import demo_dit as dd
    cfgs = configs(opts.small, opts.qwen_image_depth)
    work = opts.work.resolve()
    logs = fe.start_work(work)

    params = {n: dd.parameter_count(layout_of(n, cfgs[n])) for n in parts}
    results: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(["python", *sys.argv]),
                     "small": opts.small, "configs": {n: asdict(cfgs[n]) for n in parts}, "parameters": params,
                     "parts": {}, "disk_free_gb_start": round(fe.free_bytes(work) / GB, 1),
                     "loadavg_start": os.getloadavg(),
                     "floors": {"peak_rss_max_gb": fe.RSS_FLOOR / GB, "time_max_x_copy": TIME_FLOOR}}
    print(f"work folder {work}; {results['disk_free_gb_start']:.1f} GB free; "
          + ", ".join(f"{n} {p / 1e9:.2f} B parameters" for n, p in params.items()) + f"; load {os.getloadavg()}",
          flush=True)
    t_all = time.perf_counter()
    try:
        for name in parts:
            print(f"\n== {name} ==", flush=True)
            src_path, writer, what, args, component, extra = sources(name, cfgs[name], work)
            bytes_per = 1 if name in ("qwen-image", "qwen25-7b") else 2
            fe.need_disk(work, (bytes_per + 2) * params[name], f"{name}: source + export")
            try:
                src = fe.write_source(src_path, writer, what)
                for path, write in extra:
                    write(path)
                plan = src["plan"]
                weights = [k for k in plan if not k.endswith((".scale_weight", ".scale_input", "scaled_fp8"))]
                layers = getattr(cfgs[name], "layers", 0)
                fe.check_export = lambda out, comp, _sources, _count, spread=0: check_output(
                    out, comp, name, src_path, plan, layers)      # this file's check, names mapped (source_of)
                results["parts"][name] = fe.run_part(name, src, args, component, {name: src_path}, weights, work,
                                                     logs, plan)
            finally:
                for path in [src_path, *(p for p, _ in extra)]:
                    path.unlink(missing_ok=True)
    except BaseException as e:
        fe.aborted(results, e)
    finally:
        fe.finish(results, work, logs, t_all, ("precast", "numpy", "onnx", "ml_dtypes", "safetensors"))
        opts.json.parent.mkdir(parents=True, exist_ok=True)
        opts.json.write_text(json.dumps(results, indent=1, default=str) + "\n")
        fe.print_phases(results["parts"])
        if results["table"]:
            fe.print_table(results["table"], {}, results["machine"])
        print(f"\nfloors: time <= {TIME_FLOOR}x the copy, peak RSS <= 1.5 GB; wrote {opts.json}; work folder removed: "
              f"{results['work_folder_removed']}; {results['disk_free_gb_end']:.1f} GB free; "
              f"total {results['total_s'] / 60:.1f} min")


if __name__ == "__main__":
    main()
