"""The build side's `precast` commands, one group: export, compile, demo-model, export-openvino-genai
(compiler/export_cli.py), plan and build (build_cli.py), bundle ... (bundle_cli.py), cache ...
(cache_cli.py).

Owns: the command group and which commands it has. The top-level `precast` command (precast.runtime.cli)
loads this module only when one of these commands runs, so the runtime's commands work without the
compiler's dependencies; each command imports its work when it runs.
"""
from __future__ import annotations

import click

from .build_cli import build_cmd, plan_cmd
from .bundle_cli import bundle_group
from .cache_cli import cache_group
from .export_cli import compile_cmd, demo_model_cmd, export_cmd, export_openvino_genai_cmd


@click.group()
@click.version_option(package_name="precast")
def main() -> None:
    """precast: compile diffusion models ahead of time."""


for _command in (export_cmd, demo_model_cmd, compile_cmd, cache_group, plan_cmd, build_cmd, bundle_group,
                 export_openvino_genai_cmd):
    main.add_command(_command)


if __name__ == "__main__":
    main()
