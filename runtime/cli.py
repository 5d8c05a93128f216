"""The `precast` command: the group, its dispatch and its exit codes.

Owns: the top-level command group (`doctor`, `generate` -- runtime/doctor_command.py,
runtime/run_commands.py -- need only the runtime's dependencies; `push`, `pull` -- runtime/remote_commands.py -- the remote extra, imported when run; `export`, `build`, `bundle`, ... are imported from precast.compiler.cli only
when invoked, and a build command on a runtime-only install is one line naming the extra to
install), usage errors as one line, the exit codes: 0 ok, 1 failure, 2 bad input (one line, no
traceback), and errors as {"error", "exit"} on stdout under --json (run_cli, shared with the
compiler's commands: runtime/cli_support.py).
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import signal

import click

from .cli_support import EXTRA_OF, command_path, fail, missing_dependency, run_cli, wants_json  # noqa: F401 (run_cli: the compiler's commands)
from .doctor_command import doctor_cmd
from .errors import Terminated
from .remote_commands import pull_cmd, push_cmd
from .run_commands import generate_cmd

BUILD_COMMANDS = ("bundle", "build", "cache", "compile", "demo-model", "export", "export-openvino-genai", "plan")
# checked before any build command starts (onnxsim only where an ONNX Runtime target needs it)
COMPILER_MODULES = tuple(m for m, extra in EXTRA_OF.items() if extra == "compiler" and m != "onnxsim")


class PrecastGroup(click.Group):
    def list_commands(self, ctx):
        return sorted(set(super().list_commands(ctx)) | set(BUILD_COMMANDS))

    def parse_args(self, ctx, args):
        ctx.meta["precast.json"] = wants_json(args)
        ctx.meta["precast.help"] = "--help" in args
        return super().parse_args(ctx, args)

    def invoke(self, ctx):
        """Usage errors (a value outside an option's choices, a missing option) as one line, exit 2."""
        try:
            return super().invoke(ctx)
        except click.UsageError as e:
            if isinstance(e, getattr(click.exceptions, "NoArgsIsHelpError", ())):
                raise
            where = command_path(e.ctx or ctx)
            fail(f"{e.format_message()} (see `{where} --help`)", e.exit_code, ctx.meta.get("precast.json", False))

    def get_command(self, ctx, name):
        if name in self.commands or name not in BUILD_COMMANDS:
            return super().get_command(ctx, name)
        # A runtime-only install (pip install precast onnxruntime) lacks the build side's modules:
        # say which extra to install before the command starts (`bundle` verify/inspect/pack/unpack
        # need none; its other subcommands are caught by run_cli when they import one).
        missing = [] if name == "bundle" else [m for m in COMPILER_MODULES if importlib.util.find_spec(m) is None]
        if missing and ctx.meta.get("precast.help"):   # --help needs only click: show it, the extra comes later
            missing = []
        why = None
        if missing:
            why = missing_dependency(ModuleNotFoundError(name=missing[0]), f"precast {name}")
        else:
            try:
                compiler_cli = importlib.import_module("precast.compiler.cli")
            except ModuleNotFoundError as e:
                why = missing_dependency(e, f"precast {name}") or f"`precast {name}` cannot load the build side ({e})"
            except ImportError as e:
                why = (f"`precast {name}` is a build command and needs the compiler's dependencies "
                       f"(pip install 'precast[compiler]'): {e}")
        if why is None:
            return compiler_cli.main.get_command(ctx, name)

        @click.command(name, context_settings={"ignore_unknown_options": True, "allow_extra_args": True,
                                               "help_option_names": []}, add_help_option=False)
        @click.pass_context
        def missing_cmd(c):
            fail(why, 2, wants_json(c.args))
        return missing_cmd


@click.group(cls=PrecastGroup)
@click.version_option(package_name="precast")
def main() -> None:
    """precast: compile diffusion models ahead of time; run them with a thin runtime."""
    clean_up_on_termination()


_fork_hooked = False


def clean_up_on_termination() -> None:
    """SIGTERM and SIGHUP raise Terminated (a KeyboardInterrupt), so they clean up as Ctrl+C does; a second
    one while that runs is ignored (SIGKILL still ends the process: runtime/staging.py recovers after it)."""
    def handler(signum, frame):
        signal.signal(signum, signal.SIG_IGN)
        raise Terminated(signum)
    names = [getattr(signal, n) for n in ("SIGTERM", "SIGHUP") if hasattr(signal, n)]
    for signum in names:
        signal.signal(signum, handler)
    global _fork_hooked
    if hasattr(os, "register_at_fork") and not _fork_hooked:
        _fork_hooked = True
        # A forked child (OpenVINO's telemetry sender, forked from a thread when openvino is imported) must die
        # on SIGTERM: stuck in C -- an OpenSSL lock another thread held at the fork, while a pull's transfers
        # run -- it would never run this Python handler, and its parent's terminate() and exit would wait forever.
        os.register_at_fork(after_in_child=lambda: [signal.signal(s, signal.SIG_DFL) for s in names])


main.add_command(doctor_cmd)
main.add_command(generate_cmd)
main.add_command(push_cmd)
main.add_command(pull_cmd)


if __name__ == "__main__":   # `python -m precast.runtime.cli`: the package's module holds the commands
    from precast.runtime.cli import main as package_main
    package_main()
