"""docs/cli.md: the `--help` of every `precast` command and subcommand, as the real command group prints it.

Run after changing a command, an option or a help text:  .venv/bin/python tests/cli_reference.py
(tests/test_docs.py fails while docs/cli.md differs from what this writes). The help is taken through
click's API (CliRunner on precast.runtime.cli's group, the dispatch `precast` itself uses) at a fixed width,
so the page does not depend on the terminal it was made in.
"""
from __future__ import annotations

import sys
from pathlib import Path

import click
from click.testing import CliRunner

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "cli.md"
WIDTH = 100
REGENERATE = ".venv/bin/python tests/cli_reference.py"


def command_paths() -> list[tuple[str, ...]]:
    """(), ('build',), ('bundle',), ('bundle', 'inspect'), ...: every command and subcommand, sorted."""
    from precast.runtime.cli import main
    paths: list[tuple[str, ...]] = []

    def walk(cmd: click.Command, path: tuple[str, ...], ctx: click.Context) -> None:
        paths.append(path)
        if isinstance(cmd, click.Group):
            for name in cmd.list_commands(ctx):
                sub = cmd.get_command(ctx, name)
                walk(sub, (*path, name), click.Context(sub, info_name=name, parent=ctx))
    walk(main, (), click.Context(main, info_name="precast"))
    return paths


def help_text(path: tuple[str, ...]) -> str:
    """What `precast PATH... --help` prints (exit 0), at WIDTH columns."""
    from precast.runtime.cli import main
    result = CliRunner().invoke(main, [*path, "--help"], prog_name="precast", terminal_width=WIDTH)
    if result.exit_code != 0:
        raise RuntimeError(f"precast {' '.join(path)} --help exited {result.exit_code}: {result.output}")
    return result.output.rstrip() + "\n"


def render() -> str:
    paths = command_paths()
    out = ["# Command-line reference", "",
           f"Generated from the real `--help` of every command by `tests/cli_reference.py`; `{REGENERATE}`",
           "rewrites this page (`tests/test_docs.py` fails while it is out of date). What every command shares",
           "(exit codes, what `--out` may replace, progress, `--json`): [conventions.md](conventions.md).", ""]
    out += [f"- [{' '.join(('precast', *p))}](#{'-'.join(('precast', *p))})" for p in paths]
    for p in paths:
        out += ["", f"## {' '.join(('precast', *p))}", "", "```text", help_text(p).rstrip(), "```"]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    text = render()
    DOC.write_text(text)
    print(f"wrote {DOC.relative_to(ROOT)} ({len(text.splitlines())} lines)", file=sys.stderr)
