"""What `--set C.FIELD=V` and a recipe's `model.set` may override: SET_FIELDS (override namespace, i.e. a
Component's config_name or `model`, -> field -> the values it takes) and `set_problem`, the one check both
read. Which fields a family sets by default is the family's (Family.defaults).
"""
from __future__ import annotations

from typing import Callable


def _is_int(v, least: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= least


def _choice(*names):
    return " or ".join(names), lambda v: v in names


POSITIVE = ("a positive integer", lambda v: _is_int(v, 1))
NON_NEGATIVE = ("an integer >= 0", lambda v: _is_int(v, 0))
_THETA = ("a number above 0", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < float("inf"))
_TEXT_FIELDS = {"num_heads": POSITIVE, "clip_skip": POSITIVE, "eos_token_id": NON_NEGATIVE,
                "activation": _choice("quick_gelu", "gelu"),
                "head_dim": POSITIVE, "theta": _THETA}      # LLM text encoders (Qwen, Mistral) without a config
# Override namespace (Component.config_name, plus `model`) -> field -> (what it takes, check).
SET_FIELDS: dict[str, dict[str, tuple[str, Callable]]] = {
    "model": {"prediction": _choice("epsilon", "v_prediction")},
    "text_encoder": _TEXT_FIELDS,
    "text_encoder_2": _TEXT_FIELDS,
    "unet": {"num_heads": ("a positive integer or a list of them (one per level), e.g. 8 or [5, 10, 20]",
                           lambda v: _is_int(v, 1) or (isinstance(v, list) and bool(v) and all(_is_int(h, 1) for h in v))),
             "head_dim": POSITIVE, "time_ids": NON_NEGATIVE, "addition_time_embed_dim": POSITIVE, "groups": POSITIVE},
    "vae": {"groups": POSITIVE},
    "transformer": {"axes_dims_rope": ("a list of even integers summing to the head width, e.g. [16, 56, 56]",
                                       lambda v: isinstance(v, list) and bool(v) and all(_is_int(a, 2) and a % 2 == 0
                                                                                        for a in v)),
                    "theta": _THETA,
                    "num_heads": POSITIVE,      # SD3 without QK norm: heads are not in the weights (SAI: 64 wide)
                    "fp32_blocks": ("a list of joint-block indices computed in fp32 in half exports, e.g. [35]",
                                    lambda v: isinstance(v, list) and all(_is_int(b, 0) for b in v))},
}


def set_problem(component, field, value) -> str | None:
    """Why `component.field = value` is not an override precast reads (None when it is one)."""
    fields = SET_FIELDS.get(component)
    if fields is None:
        return f"unknown component {component!r}; known: {', '.join(sorted(SET_FIELDS))}"
    if field not in fields:
        return f"unknown field {field!r}; known for {component}: {', '.join(sorted(fields))}"
    what, ok = fields[field]
    return None if ok(value) else f"expected {what}, got {value!r}"
