"""The `precast` command: the group, its dispatch and its exit codes.

Owns: the top-level command group (`doctor`, `generate` -- runtime/run_commands.py -- need only the
runtime's dependencies; `export`, `build`, `bundle`, ... are imported from precast.compiler.cli only
when invoked, and a build command on a runtime-only install is one line naming the extra to
install), usage errors as one line, the exit codes: 0 ok, 1 failure, 2 bad input (one line, no
traceback), and errors as {"error", "exit"} on stdout under --json (run_cli, shared with the
compiler's commands).
"""
from __future__ import annotations

import importlib
import importlib.util
import json
import os
import signal
import sys
import traceback

import click

from .errors import Terminated, UserError

BUILD_COMMANDS = ("bundle", "build", "cache", "compile", "demo-model", "export", "export-openvino-genai", "plan")
# Modules the build side imports, and the pyproject extra that installs each.
EXTRA_OF = {"onnx": "compiler", "safetensors": "compiler", "yaml": "compiler", "platformdirs": "compiler",
            "filelock": "compiler", "ml_dtypes": "compiler", "onnxsim": "compiler", "onnxruntime": "onnxruntime",
            "openvino": "openvino", "tensorrt_rtx": "tensorrt-rtx", "zstandard": "zstd",
            "openvino_tokenizers": "openvino-genai", "gguf": "gguf"}
# checked before any build command starts (onnxsim only where an ONNX Runtime target needs it)
COMPILER_MODULES = tuple(m for m, extra in EXTRA_OF.items() if extra == "compiler" and m != "onnxsim")


def fail(message: str, code: int = 2, as_json: bool = False):
    """Report an error and exit: one line on stderr; with `as_json` also {"error", "exit"} on stdout."""
    click.echo(f"error: {message}", err=True)
    if as_json:
        click.echo(json.dumps({"error": message, "exit": code}))
    sys.exit(code)


def _command_path(ctx: click.Context | None = None) -> str:
    """'precast bundle merge': the command as a user types it (whatever the program was started as)."""
    ctx = ctx or click.get_current_context(silent=True)
    names = []
    while ctx is not None and ctx.parent is not None:
        names.append(ctx.info_name)
        ctx = ctx.parent
    return " ".join(["precast", *reversed(names)])


def missing_dependency(e: ModuleNotFoundError, command: str | None = None) -> str | None:
    """The one-line fix for a module the build side needs and this install lacks, or None."""
    top = (e.name or "").split(".")[0]
    extra = EXTRA_OF.get(top)
    if extra is None:
        return None
    what = "the build side's dependencies" if extra == "compiler" else f"the {extra} extra"
    # precast is not on the package index: `precast[X]` resolves only where precast is already installed
    return (f"`{command or _command_path()}` needs {what}, not installed here (no module {top!r}): add the "
            f"{extra} extra to this precast: pip install 'precast[{extra}]' with this environment's pip, "
            f"or pip install -e '.[{extra}]' in a checkout")


def run_cli(fn, as_json=False):
    """Run a command body: user mistakes and paths the OS refuses -> one line + exit 2; a missing
    build-side module -> one line naming the extra to install + exit 2; bugs -> trace + exit 1; a
    closed stdout -> exit 141, silently. With `as_json` (or `--json` on the command line of a command
    started through `precast`), errors are also one JSON object on stdout: {"error": "<message>", "exit": <code>}."""
    ctx = click.get_current_context(silent=True)
    as_json = bool(as_json or (ctx is not None and ctx.meta.get("precast.json")))
    try:
        return fn()
    except UserError as e:
        fail(str(e), 2, as_json)
    except Terminated as e:
        fail(f"terminated by {signal.Signals(e.signum).name}", 128 + e.signum, as_json)
    except KeyboardInterrupt:
        fail("interrupted", 130, as_json)
    except BrokenPipeError:  # the reader went away (`precast cache ls | head -1`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        sys.exit(141)  # 128 + SIGPIPE, as other tools in a pipe report it
    except OSError as e:     # the file system refused a path the user chose (permissions, space, name, /proc)
        where = f"{e.filename}: " if e.filename else ""
        fail(f"{where}{e.strerror or e}; check the path, its permissions and the free space", 2, as_json)
    except ModuleNotFoundError as e:
        hint = missing_dependency(e)
        if hint is None:
            _internal(e, as_json)
        fail(hint, 2, as_json)
    except Exception as e:
        _internal(e, as_json)


def _internal(e: BaseException, as_json: bool):
    traceback.print_exc()
    click.echo("error: internal failure (a bug in precast); please report it with the trace above", err=True)
    if as_json:
        click.echo(json.dumps({"error": f"internal failure (a bug in precast): {type(e).__name__}: {e}", "exit": 1}))
    sys.exit(1)


def wants_json(args) -> bool:
    """Whether a command line asks for JSON on stdout: --json, or `--format json|github` (plan)."""
    formats = [v for k, v in zip(args, args[1:]) if k == "--format"] + [a[9:] for a in args if a.startswith("--format=")]
    return "--json" in args or any(f in ("json", "github") for f in formats)


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
            where = _command_path(e.ctx or ctx)
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


def clean_up_on_termination() -> None:
    """SIGTERM and SIGHUP raise Terminated (a KeyboardInterrupt), so they clean up as Ctrl+C does; a second
    one while that runs is ignored (SIGKILL still ends the process: runtime/staging.py recovers after it)."""
    def handler(signum, frame):
        signal.signal(signum, signal.SIG_IGN)
        raise Terminated(signum)
    for name in ("SIGTERM", "SIGHUP"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), handler)


from . import run_commands  # noqa: E402,F401  (registers doctor and generate on `main`)


if __name__ == "__main__":   # `python -m precast.runtime.cli`: the package's module holds the commands
    from precast.runtime.cli import main as package_main
    package_main()
