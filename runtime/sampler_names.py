"""The names users give samplers and sigma schedules -- precast's, A1111's and ComfyUI's -- read into one
spelling each.

Owns: `SAMPLERS` (precast's sampler names with A1111's and ComfyUI's), `SCHEDULES` (the same for sigma
schedules), `parse_sampler` (a name as typed -> (sampler, the schedule named with it or None): "DPM++ 2M
Karras" -> ("dpm++2m", "karras")) and `parse_schedule`. Case, spaces, "_" and "-" do not matter. Which family
runs which sampler is the family records' (runtime/families/); flow-matching families take "euler", "heun"
and "dpm++2m" as their flow-euler, flow-heun and flow-dpm++2m. Standard library only.
"""
from __future__ import annotations

import re

SAMPLERS = {   # precast's name: (A1111's, ComfyUI's, other spellings)
    "euler": ("Euler", "euler"),
    "euler-a": ("Euler a", "euler_ancestral"),
    "heun": ("Heun", "heun"),
    "dpm2": ("DPM2", "dpm_2"),
    "dpm2-a": ("DPM2 a", "dpm_2_ancestral"),
    "dpm++2m": ("DPM++ 2M", "dpmpp_2m", "dpmsolver++", "dpm2m"),
    "dpm++2m-sde": ("DPM++ 2M SDE", "dpmpp_2m_sde"),
    "dpm++sde": ("DPM++ SDE", "dpmpp_sde"),
    "ddim": ("DDIM", "ddim"),
    "unipc": ("UniPC", "uni_pc"),
    "lcm": ("LCM", "lcm"),
    "flow-euler": ("Euler", "euler"),            # flow matching (Flux, Chroma, SD3): the names above map here
    "flow-heun": ("Heun", "heun"),
    "flow-dpm++2m": ("DPM++ 2M", "dpmpp_2m"),
}
SCHEDULES = {  # precast's name: (A1111's "Schedule type", ComfyUI's scheduler, other spellings)
    "normal": ("Normal", "normal", "automatic", "default"),
    "karras": ("Karras", "karras"),
    "exponential": ("Exponential", "exponential"),
    "sgm-uniform": ("SGM Uniform", "sgm_uniform"),
}


def _key(name: str) -> str:
    return re.sub(r"[\s_\-]", "", name.lower()).replace("pp", "++").replace("ancestral", "a")


_SAMPLER_KEYS = {_key(s): name for name, spellings in SAMPLERS.items() if not name.startswith("flow-")
                 for s in (name, *spellings)}
_SAMPLER_KEYS.update({_key(name): name for name in SAMPLERS})
_SCHEDULE_KEYS = {_key(s): name for name, spellings in SCHEDULES.items() for s in (name, *spellings)}


def parse_schedule(text: str) -> str | None:
    """precast's name of a sigma schedule as typed, or None when it names none."""
    return _SCHEDULE_KEYS.get(_key(text)) if isinstance(text, str) else None


def parse_sampler(text: str) -> tuple[str, str | None] | None:
    """(precast's sampler name, the schedule the name carries or None) for a sampler as typed, A1111's combined
    spelling included ("DPM++ 2M SDE Karras"); None when it names no sampler."""
    if not isinstance(text, str):
        return None
    key = _key(text)
    if key in _SAMPLER_KEYS:
        return _SAMPLER_KEYS[key], None
    for skey, schedule in _SCHEDULE_KEYS.items():
        if key.endswith(skey) and key[:-len(skey)] in _SAMPLER_KEYS:
            return _SAMPLER_KEYS[key[:-len(skey)]], schedule
    return None
