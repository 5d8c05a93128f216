"""Benchmark: the full-size SD3.5-large transformer export (issue 16's floors), and the torch exporter's result.

What it measures, in one run:

1. sd35-large-bf16: the full-size SD3.5-large MMDiT (8.1 B parameters: hidden 2432, 38 heads of 64, 38 joint
   blocks, QK norm; SAI key layout, deterministic random weights, compiler/demo_sd3.py) written as one bare
   bf16 .safetensors file (16.3 GB, tensors streamed: the writer's own peak RSS is recorded), then
   - the physical limit: a plain copy of the same bytes in a fresh process, cold page cache, once before and
     once after the export (the mean is the limit);
   - `precast export FILE --component transformer --dtype bf16 --out DIR` in a fresh process: wall time,
     time until its output is on disk, peak RSS (VmHWM and the sampled RSS of its process tree), where its
     time goes; the output checked (onnx.load, every external initializer in bounds and named as a source
     tensor, all weights there, three tensors' bytes equal to the source's) and deleted.
2. peer: torch.onnx.export of diffusers' SD3Transformer2DModel with the full SD3.5-large config, on the same
   file, in a child under a memory watchdog (SIGKILL when its anonymous RSS passes --peer-cap-gib or the
   machine's available memory drops below 1.5 GiB; oom_score_adj 1000) and a time cap (--peer-timeout),
   for up to three ways of getting the weights in: `defaults` (built as diffusers builds it, fp32, then
   load_file + diffusers' SD3 converter + load_state_dict), `from_single_file` (diffusers' documented
   single-file loader, torch_dtype=bfloat16, local config), `mmap` (built on the meta device, bf16
   parameters assigned as zero-copy views of a read-only map of the file). Each records how it ended,
   where (phase, frames), its peak RSS and the time until it ended. The exporters as installed are first
   tried on a 1-block, 32-wide instance of the class (recorded); the real export uses the TorchScript
   exporter (onnxscript, which the dynamo one needs, is not in the venv) with flux_export's symbolic for
   aten::rms_norm registered (Flux needs it; it is unused where diffusers' RMSNorm does not call rms_norm).

Everything generic (the copy, the fresh-process export with its phase timers and sampling, the output
check, the watchdog, the work folder, the machine description) is benchmarks/flux_export.py's, imported;
this file holds only what is SD3-specific (the config, the writer, the peer's model class and inputs).

Floors (the issue): peak RSS <= 1.5 GB (1.5e9 bytes); time <= 2x the plain copy of the same bytes.

Every file lives in one work folder (default benchmarks/results/work/sd3_export), deleted at the end, also
on failure or interrupt. Disk needed at once: ~33 GB (source + one output).

Usage: .venv/bin/python benchmarks/sd3_export.py [--parts export,peer] [--peer-variants defaults,from_single_file,mmap]
       [--peer-cap-gib 18] [--peer-timeout 900] [--work DIR] [--json OUT]
       [--small]   (--small: 2 joint blocks at full width, to try the script in a minute)
"""
from __future__ import annotations

import argparse
import json
import os
import re
import struct
import sys
import time
import traceback
from dataclasses import asdict, replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import flux_export as fe  # noqa: E402  (benchmarks/flux_export.py: copy, export child, check, watchdog)

GB = fe.GB
PARTS = ("export", "peer")
PEER_VARIANTS = fe.PEER_VARIANTS
PART = "sd35-large-bf16"


def sd3_cfg(small: bool):
    from precast.compiler.demo_sd3 import SD35_LARGE
    return replace(SD35_LARGE, depth=2) if small else SD35_LARGE


def diffusers_config(cfg) -> dict:
    """SD3Transformer2DModel's config for this SAI-layout model (as stabilityai/stable-diffusion-3.5-large's
    transformer/config.json for the full size)."""
    return dict(sample_size=128, patch_size=cfg.patch, in_channels=cfg.in_channels, num_layers=cfg.depth,
                attention_head_dim=cfg.head_dim, num_attention_heads=cfg.heads, joint_attention_dim=cfg.context_dim,
                caption_projection_dim=cfg.hidden, pooled_projection_dim=cfg.pooled_dim,
                out_channels=cfg.out_channels, pos_embed_max_size=cfg.pos_embed_max,
                dual_attention_layers=tuple(cfg.dual_attention_layers), qk_norm="rms_norm" if cfg.qk_norm else None)


def vm_hwm() -> int:
    return int(re.search(r"VmHWM:\s+(\d+) kB", open("/proc/self/status").read()).group(1)) * 1024


# ---- the torch peer, inside its own capped process (started by fe.run_peer) ----------------------
def peer_child(variant: str, src: str, out: str, phase_file: str, config_json: str) -> None:
    """torch.onnx.export of diffusers' SD3Transformer2DModel; each phase logged as it starts."""
    t0 = time.perf_counter()
    log = open(phase_file, "a", buffering=1)

    def rss_gb() -> float:
        return round(int(re.search(r"VmRSS:\s+(\d+)", open("/proc/self/status").read()).group(1)) * 1024 / GB, 3)

    def phase(name: str) -> None:
        log.write(json.dumps({"t": round(time.perf_counter() - t0, 2), "phase": name, "rss_gb": rss_gb()}) + "\n")

    cfg = json.loads(config_json)
    try:
        phase("import torch + diffusers")
        import torch
        from diffusers import SD3Transformer2DModel
        from diffusers.loaders.single_file_utils import convert_sd3_transformer_checkpoint_to_diffusers as convert
        log.write(json.dumps({"versions": {"torch": torch.__version__, "diffusers": __import__("diffusers").__version__,
                                           "threads": torch.get_num_threads()}}) + "\n")
        dtype = torch.float32 if variant == "defaults" else torch.bfloat16
        if variant == "defaults":
            phase("instantiate SD3Transformer2DModel(**config) (fp32, on the CPU)")
            model = SD3Transformer2DModel(**cfg)
            phase("load weights (safetensors load_file + diffusers converter + load_state_dict)")
            from safetensors.torch import load_file
            sd = convert(load_file(src))
            model.load_state_dict(sd, strict=True)
            del sd
        elif variant == "from_single_file":
            cfg_dir = Path(out) / "config"
            cfg_dir.mkdir(parents=True, exist_ok=True)
            (cfg_dir / "config.json").write_text(json.dumps({"_class_name": "SD3Transformer2DModel", **cfg}))
            phase("SD3Transformer2DModel.from_single_file(torch_dtype=bfloat16)")
            model = SD3Transformer2DModel.from_single_file(src, config=str(cfg_dir), torch_dtype=torch.bfloat16)
        else:
            import mmap
            import warnings
            phase("instantiate on the meta device (bf16)")
            with torch.device("meta"):
                model = SD3Transformer2DModel(**cfg).to(torch.bfloat16)
            phase("map the file; parameters = zero-copy bf16 views of the map")
            fd = os.open(src, os.O_RDONLY)
            mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
            n = struct.unpack("<Q", mm[:8])[0]
            header = json.loads(mm[8:8 + n])
            sd = {}
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")          # "the given buffer is not writable": read-only by design
                for k, v in header.items():
                    if k == "__metadata__":
                        continue
                    a, b = v["data_offsets"]
                    sd[k] = torch.frombuffer(mm, dtype=torch.bfloat16, count=(b - a) // 2, offset=8 + n + a).view(
                        v["shape"])
            sd = convert(sd)
            phase("load_state_dict(assign=True)")
            model.load_state_dict(sd, strict=True, assign=True)
            del sd
        model.requires_grad_(False).eval()
        log.write(json.dumps({"parameters": sum(p.numel() for p in model.parameters()),
                              "param_dtype": str(next(model.parameters()).dtype)}) + "\n")

        class Wrapped(torch.nn.Module):
            def __init__(self, m):
                super().__init__()
                self.m = m

            def forward(self, hidden_states, encoder_hidden_states, pooled_projections, timestep):
                return self.m(hidden_states=hidden_states, encoder_hidden_states=encoder_hidden_states,
                              pooled_projections=pooled_projections, timestep=timestep, return_dict=False)[0]

        def example(c: dict):      # an 8x8 latent (16 tokens) + 8 text tokens: tiny activations, the real weights
            return (torch.randn(1, c["in_channels"], 8, 8, dtype=dtype),
                    torch.randn(1, 8, c["joint_attention_dim"], dtype=dtype),
                    torch.randn(1, c["pooled_projection_dim"], dtype=dtype), torch.tensor([500.0], dtype=dtype))
        names = ["hidden_states", "encoder_hidden_states", "pooled_projections", "timestep"]
        path = os.path.join(out, "model.onnx")
        import importlib.util
        import io
        tiny_cfg = dict(cfg, num_layers=1, attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                        caption_projection_dim=32, pooled_projection_dim=32, pos_embed_max_size=16, sample_size=16)
        tiny = Wrapped(SD3Transformer2DModel(**tiny_cfg).to(dtype).eval())
        probe = {"onnxscript_installed": importlib.util.find_spec("onnxscript") is not None}
        for dynamo in (True, False):
            try:
                with torch.no_grad():
                    torch.onnx.export(tiny, example(tiny_cfg), io.BytesIO(), dynamo=dynamo, opset_version=17)
                probe[f"dynamo={dynamo}"] = "ok"
            except Exception as e:  # noqa: BLE001
                probe[f"dynamo={dynamo}"] = f"{type(e).__name__}: {str(e)[:200]}"
        from torch.onnx import symbolic_helper as sh

        def rms_norm(g, x, shape, weight, eps):     # x / sqrt(mean(x^2) + eps) * weight, in fp32
            xf = g.op("Cast", x, to_i=1)
            ms = g.op("ReduceMean", g.op("Mul", xf, xf), axes_i=list(range(-len(shape), 0)), keepdims_i=1)
            e = 1e-6 if sh._is_none(eps) else sh._maybe_get_const(eps, "f")
            eps_c = g.op("Constant", value_t=torch.tensor(e, dtype=torch.float32))
            y = g.op("CastLike", g.op("Div", xf, g.op("Sqrt", g.op("Add", ms, eps_c))), x)
            return y if sh._is_none(weight) else g.op("Mul", y, weight)
        torch.onnx.register_custom_op_symbolic("aten::rms_norm", sh.parse_args("v", "is", "v", "v")(rms_norm), 17)
        try:
            with torch.no_grad():
                torch.onnx.export(tiny, example(tiny_cfg), io.BytesIO(), dynamo=False, opset_version=17)
            probe["dynamo=False + rms_norm symbolic"] = "ok"
        except Exception as e:  # noqa: BLE001
            probe["dynamo=False + rms_norm symbolic"] = f"{type(e).__name__}: {str(e)[:200]}"
        del tiny
        log.write(json.dumps({"exporter_probe": probe}) + "\n")
        phase("torch.onnx.export (TorchScript exporter + rms_norm symbolic: trace, passes, serialize)")
        with torch.no_grad():
            torch.onnx.export(Wrapped(model), example(cfg), path, dynamo=False, opset_version=17, input_names=names,
                              output_names=["out"])
        phase("done")
        files = [p for p in Path(out).rglob("*") if p.is_file() and p.parent.name != "config"]
        import onnx
        proto = onnx.load(path, load_external_data=False)
        log.write(json.dumps({"exported_bytes": sum(p.stat().st_size for p in files), "exported_check": {
            "files": len(files), "nodes": len(proto.graph.node), "initializers": len(proto.graph.initializer),
            "external_initializers": sum(t.data_location == onnx.TensorProto.EXTERNAL
                                         for t in proto.graph.initializer)}}) + "\n")
    except BaseException as e:  # noqa: BLE001 (MemoryError, RuntimeError from the allocator, ...)
        frames = traceback.extract_tb(e.__traceback__)
        log.write(json.dumps({"t": round(time.perf_counter() - t0, 2), "error": type(e).__name__,
                              "message": str(e)[:600], "rss_gb": rss_gb(),
                              "where": [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames[-6:]]}) + "\n")
        log.close()
        os._exit(3)


# ---- the report -------------------------------------------------------------------------------
def print_report(res: dict) -> None:
    mach = res["machine"]
    print(f"\nload average (1, 5, 15 min): start {[round(x, 2) for x in res['loadavg_start']]}, end "
          f"{[round(x, 2) for x in res['loadavg_end']]}")
    fe.print_phases(res["parts"])
    rows = res["table"]
    if rows:
        fe.print_table(rows, {}, mach)
    ours = rows[0] if rows else None
    for v, p in res["peer"].items():
        vs = ""
        if ours and p["outcome"].startswith("exported"):
            vs = (f"; precast is {p['wall_s'] / ours['export_durable_s']:.1f}x faster and peaks "
                  f"{p['sampled_peak_rss_gb'] / ours['peak_rss_gb']:.0f}x lower in RSS")
        print(f"peer {v}: {p['outcome']}; wall {p['wall_s']:.1f} s, sampled peak RSS {p['sampled_peak_rss_gb']:.2f} GB "
              f"(anonymous {p['sampled_peak_anon_gb']:.2f} GB), cap {p['cap_gib']:.0f} GiB ({p['cap_mode']}){vs}")
        if p.get("exporter_probe"):
            print(f"  exporters on a 1-block instance: {p['exporter_probe']}")


def main() -> None:
    if len(sys.argv) == 7 and sys.argv[1] == "--peer-child":
        peer_child(*sys.argv[2:])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", default=",".join(PARTS), help="export,peer (the peer exports the same file)")
    ap.add_argument("--peer-variants", default=",".join(PEER_VARIANTS), help="defaults,from_single_file,mmap")
    ap.add_argument("--peer-cap-gib", type=float, default=18.0, help="memory cap of the torch peer (GiB, watchdog)")
    ap.add_argument("--peer-timeout", type=float, default=900.0, help="seconds per peer variant")
    ap.add_argument("--work", type=Path, default=HERE / "results" / "work" / "sd3_export",
                    help="work folder (new or empty; deleted at the end)")
    ap.add_argument("--json", type=Path, default=HERE / "results" / "sd3_export.json", help="results file")
    ap.add_argument("--small", action="store_true", help="2 joint blocks at full width (a quick try of the script)")
    opts = ap.parse_args()
    parts = [p for p in opts.parts.split(",") if p]
    variants = [v for v in opts.peer_variants.split(",") if v]
    bad = [p for p in parts if p not in PARTS] + [v for v in variants if v not in PEER_VARIANTS]
    if bad:
        raise SystemExit(f"unknown part or peer variant: {', '.join(bad)}")
    if "peer" in parts and fe.meminfo()["MemTotal"] / 2**30 < opts.peer_cap_gib + 2:
        raise SystemExit(f"--peer-cap-gib {opts.peer_cap_gib}: leave at least 2 GiB of this machine's memory free")

    # flux_export's generic parts, pointed at this script: its work-folder marker, and its peer runner starts
    # `python <fe.__file__> --peer-child ...`, which must be this file (SD3's peer child above)
    fe.MARKER = ".sd3_export_work"
    fe.PEER_CLASS = "SD3Transformer2DModel"
    fe.__file__ = str(Path(__file__).resolve())

    from precast.compiler import demo_dit as dd
    from precast.compiler import demo_sd3 as ds
    cfg = sd3_cfg(opts.small)
    peer_cfg = diffusers_config(cfg)
    work = opts.work.resolve()
    logs = fe.start_work(work)

    params = dd.parameter_count(ds.sd3_layout(cfg))
    results: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(["python", *sys.argv]),
                     "small": opts.small, "config": asdict(cfg), "peer_config": peer_cfg, "parameters": params,
                     "parts": {}, "peer": {}, "disk_free_gb_start": round(fe.free_bytes(work) / GB, 1),
                     "loadavg_start": os.getloadavg(),
                     "floors": {"peak_rss_max_gb": fe.RSS_FLOOR / GB, "time_max_x_copy": fe.TIME_FLOOR}}
    print(f"work folder {work}; {results['disk_free_gb_start']:.1f} GB free; SD3.5-large"
          f"{' (--small: 2 blocks)' if opts.small else ''} {params / 1e9:.2f} B parameters; load {os.getloadavg()}",
          flush=True)
    t_all = time.perf_counter()
    src_path = work / "sd3.5_large_bf16.safetensors"
    try:
        fe.need_disk(work, 2 * 2 * params, "source + export")
        hwm0 = vm_hwm()
        src = fe.write_source(src_path, lambda p: ds.write_sd3_checkpoint(p, cfg, dtype="bf16", layout="bare"),
                              "SD3.5-large transformer, bf16, bare SAI layout")
        src["writer_vmhwm_gb_before_after"] = [round(hwm0 / GB, 3), round(vm_hwm() / GB, 3)]
        print(f"  writer (this process) VmHWM {hwm0 / GB:.2f} -> {vm_hwm() / GB:.2f} GB: streamed", flush=True)
        plan = src["plan"]
        if "export" in parts:
            print(f"\n== {PART} ==", flush=True)
            results["parts"][PART] = fe.run_part(PART, src, [str(src_path)], "transformer", {"sd3": src_path},
                                                 list(plan), work, logs, plan)
        if "peer" in parts:
            print("\n== peer: torch.onnx.export of the same model ==", flush=True)
            for v in variants:
                results["peer"][v] = fe.run_peer(v, src_path, work, logs, int(opts.peer_cap_gib * 2**30),
                                                 opts.peer_timeout, peer_cfg, "watchdog")
    except BaseException as e:
        fe.aborted(results, e)
    finally:
        fe.finish(results, work, logs, t_all, ("precast", "numpy", "onnx", "ml_dtypes", "safetensors", "torch", "diffusers", "psutil"))
        results["note"] = ("page cache dropped (sync + drop_caches + fadvise) before every copy, export and peer; "
                           "copy and export both pay for writing their output to the disk (fsync)")
        opts.json.parent.mkdir(parents=True, exist_ok=True)
        opts.json.write_text(json.dumps(results, indent=1, default=str) + "\n")
        print_report(results)
        print(f"\nwrote {opts.json}; work folder removed: {results['work_folder_removed']}; "
              f"{results['disk_free_gb_end']:.1f} GB free; total {results['total_s'] / 60:.1f} min")


if __name__ == "__main__":
    main()
