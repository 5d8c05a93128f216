"""Where a tiled VAE decode's error comes from, and what bounds it (issue 33's tiled-vs-plain floor).

precast's tiled decode (runtime/vae_tiling.py) runs the bundle's VAE decoder engine on each tile alone: its
GroupNorms normalise by the tile's statistics, its mid-block attention sees the tile's latents only, and its
convolutions see zeros past the tile's edge. This measures each of the three on diffusers' AutoencoderKL with
seeded random weights (diffusers' own init), decoding the same latents plainly and in tiles with
runtime/vae_tiling.py's `run_tiled` (the same placement and blend generate uses), four ways:

  per-tile        what precast does (and any engine of fixed shape can do, without a rebuild)
  + global GN     every GroupNorm given the statistics of the plain decode (an oracle: what sharing GroupNorm
                  statistics across tiles would reach at best)
  + attention     also the mid-block attention's output taken from the plain decode (an oracle: attention over
                  the whole latent)
  crop-only       both oracles: what is left is the convolutions' receptive field crossing the tile's edge

PSNR of each against the plain decode (images in [0, 1]). --config tiny: the test suite's tiny SD 1.x VAE
layout (block_out_channels 32, 64; 2 GroupNorm groups... as tests/reference.py builds it from the demo
model); --config sd15: the full-size SD 1.x VAE (1024x1024 from 64-latent tiles takes ~10 GB and minutes).

Usage: .venv/bin/python benchmarks/vae_tiling_limit.py [--config tiny|sd15] [--latents 32] [--tiles 16,24]
           [--seeds 1,2] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def cpu_name() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "?"


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    a, b = (np.clip(x.astype(np.float64) / 2 + 0.5, 0, 1) for x in (a, b))
    return 10 * math.log10(1 / max(float(np.mean((a - b) ** 2)), 1e-20))


def make_vae(config: str):
    import torch
    from diffusers import AutoencoderKL
    torch.manual_seed(0)
    if config == "sd15":
        return AutoencoderKL(block_out_channels=(128, 256, 512, 512), layers_per_block=2, latent_channels=4,
                             down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                             norm_num_groups=32, sample_size=512).eval()
    from precast.compiler.demo_model import SD1Config
    from reference import vae_diffusers_config
    return AutoencoderKL(**vae_diffusers_config(SD1Config())).eval()


class Oracles:
    """Forward hooks on the decoder: record the plain decode's GroupNorm statistics and attention output, then
    feed them to the tiles (the attention's output cropped at the tile's place)."""

    def __init__(self, vae):
        import torch
        self.mode, self.stats, self.attn, self.at = "off", {}, None, (0, 0)
        self.use_gn = self.use_attn = False
        self.hooks = [m.register_forward_hook(self._gn) for m in vae.decoder.modules()
                      if isinstance(m, torch.nn.GroupNorm)]
        self.hooks.append(vae.decoder.mid_block.attentions[0].register_forward_hook(self._attention))

    def remove(self):
        for h in self.hooks:
            h.remove()

    def _gn(self, mod, inp, out):
        x = inp[0]
        xs = x.reshape(x.shape[0], mod.num_groups, -1)
        if self.mode == "record":
            self.stats[id(mod)] = (xs.mean(-1, keepdim=True), xs.var(-1, unbiased=False, keepdim=True))
        elif self.use_gn:
            mean, var = self.stats[id(mod)]
            shape = (1, x.shape[1]) + (1,) * (x.ndim - 2)
            y = ((xs - mean) / (var + mod.eps).sqrt()).reshape_as(x)
            return y * mod.weight.reshape(shape) + mod.bias.reshape(shape)

    def _attention(self, mod, inp, out):
        if self.mode == "record":
            self.attn = out
        elif self.use_attn:
            y, x = self.at
            return self.attn[:, :, y:y + out.shape[2], x:x + out.shape[3]]


def measure(vae, z: np.ndarray, tiles: list[int]) -> list[dict]:
    import torch
    from precast.runtime.vae_tiling import Tiling, run_tiled, starts
    oracle = Oracles(vae)
    with torch.no_grad():
        def decode(t):
            return vae.decode(torch.from_numpy(t)).sample.numpy()
        oracle.mode = "record"
        t0 = time.perf_counter()
        plain = decode(z)
        plain_s = time.perf_counter() - t0
        oracle.mode = "tiles"
        rows = []
        for tile in tiles:
            tiling = Tiling(tile, tile, tile // 4, "limit")
            places = [(y, x) for y in starts(z.shape[2], tile, tiling.overlap)
                      for x in starts(z.shape[3], tile, tiling.overlap)]
            row = {"tile_latents": tile, "grid": f"{len(starts(z.shape[3], tile, tiling.overlap))}x"
                   f"{len(starts(z.shape[2], tile, tiling.overlap))}", "plain_s": round(plain_s, 2)}
            for name, gn, attn in (("per_tile", False, False), ("global_gn", True, False),
                                   ("global_attention", False, True), ("crop_only", True, True)):
                oracle.use_gn, oracle.use_attn = gn, attn
                where = iter(places)

                def run(t):
                    oracle.at = next(where)
                    return decode(t)
                row[name] = round(psnr(run_tiled(run, z, tiling, 8, decode=True), plain), 2)
            rows.append(row)
        oracle.remove()
        return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", choices=("tiny", "sd15"), default="tiny")
    ap.add_argument("--latents", type=int, default=32, help="the latent's side (the image is 8x that)")
    ap.add_argument("--tiles", default="16,24", help="tile sides in latents")
    ap.add_argument("--seeds", default="1,2")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    import torch
    torch.set_num_threads(os.cpu_count() or 1)
    vae = make_vae(a.config)
    out = []
    for seed in map(int, a.seeds.split(",")):
        z = np.random.default_rng(seed).standard_normal((1, 4, a.latents, a.latents)).astype(np.float32)
        for row in measure(vae, z, [int(t) for t in a.tiles.split(",")]):
            out.append({"seed": seed, **row})
    print(f"CPU: {cpu_name()} ({os.cpu_count()} cores); VAE: {a.config}, random weights (diffusers' init, seed 0); "
          f"image {a.latents * 8}x{a.latents * 8}")
    print("PSNR vs the plain decode, dB:  tile  grid  per-tile (precast)  +global GN  +global attention  both (crop only)")
    for r in out:
        print(f"  seed {r['seed']}  {r['tile_latents'] * 8:4d} px  {r['grid']}  {r['per_tile']:8.2f}  {r['global_gn']:10.2f}"
              f"  {r['global_attention']:10.2f}  {r['crop_only']:10.2f}")
    if a.json:
        Path(a.json).write_text(json.dumps({"cpu": cpu_name(), "config": a.config, "rows": out}, indent=2))


if __name__ == "__main__":
    main()
