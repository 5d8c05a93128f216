"""A flow-matching family's schedule as a build records it: the source folder's own scheduler config where it
has one (its fields checked the way the runtime checks a manifest's), else the released model's
(runtime/families/: Family.variants).
"""
from __future__ import annotations

from ...runtime.families import FAMILIES as RUNTIME
from ...runtime.flow import schedule_problem
from ..errors import BadInput

UNSUPPORTED_SCHEDULER_FIELDS = ("use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas",
                                "invert_sigmas", "stochastic_sampling")
SCHEDULER_FIELDS = ("use_dynamic_shifting", "shift", "base_shift", "max_shift", "base_image_seq_len",
                    "max_image_seq_len", "time_shift_type", "shift_terminal")


def flow_defaults(family: str, variant: str, scheduler_json: dict, where: str) -> dict | None:
    """{scheduler, steps, guidance} for a flow-matching family: the folder's scheduler config where it
    has one (its fields checked), else the released model's."""
    flow = RUNTIME[family].variants.get(variant) if family in RUNTIME else None
    if flow is None:
        return None
    sched = dict(flow.scheduler)
    for name in SCHEDULER_FIELDS:
        if name not in scheduler_json or scheduler_json[name] is None:
            continue
        sched[name] = scheduler_json[name]
    for name in UNSUPPORTED_SCHEDULER_FIELDS:      # these change the schedule in ways not sampled here
        if scheduler_json.get(name):
            raise BadInput(f"{where}: {name} = {scheduler_json[name]!r} is not supported yet (leave it out)")
    problem = schedule_problem(sched)     # the runtime checks a manifest's the same way
    if problem:
        raise BadInput(f"{where}: {problem}")
    return {"scheduler": sched, "steps": flow.steps, "guidance": flow.guidance}
