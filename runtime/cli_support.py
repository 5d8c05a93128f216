"""What every precast command shares: errors as one line and the exit codes.

Owns: `run_cli` (a command body run so that user mistakes and paths the OS refuses are one line and
exit 2, a missing build-side module one line naming the extra, a bug a trace and exit 1, SIGTERM /
SIGHUP / Ctrl+C 143 / 129 / 130, a closed stdout 141), `fail`, errors as {"error", "exit"} on stdout
under --json (`wants_json`), and the extra that installs each build-side module (EXTRA_OF,
`missing_dependency`), `registry_options` (--ca / --plain-http for commands that may open oci://
references). Used by the runtime's commands (runtime/run_commands.py, runtime/doctor_command.py),
the group (runtime/cli.py) and the compiler's commands.
"""
from __future__ import annotations

import functools
import json
import os
import signal
import sys
import threading
import traceback

import click

from .errors import Terminated, UserError

# Modules the build side imports, and the pyproject extra that installs each.
EXTRA_OF = {"onnx": "compiler", "safetensors": "compiler", "yaml": "compiler", "platformdirs": "compiler",
            "filelock": "compiler", "ml_dtypes": "compiler", "onnxsim": "compiler", "onnxruntime": "onnxruntime",
            "openvino": "openvino", "tensorrt_rtx": "tensorrt-rtx", "zstandard": "zstd",
            "openvino_tokenizers": "openvino-genai", "gguf": "gguf"}
def fail(message: str, code: int = 2, as_json: bool = False, stopped: bool = False):
    """Report an error and exit: one line on stderr; with `as_json` also {"error", "exit"} on stdout. `stopped`
    (Ctrl+C, SIGTERM): threads still blocked in I/O -- a stalled download's readers, told to stop but waiting for
    their next byte -- are not waited for (the command's own clean-up has run on the way here)."""
    click.echo(f"error: {message}", err=True)
    if as_json:
        click.echo(json.dumps({"error": message, "exit": code}))
    if stopped and any(t is not threading.main_thread() and t.is_alive() and not t.daemon
                       for t in threading.enumerate()):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def command_path(ctx: click.Context | None = None) -> str:
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
    return (f"`{command or command_path()}` needs {what}, not installed here (no module {top!r}): add the "
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
        fail(f"terminated by {signal.Signals(e.signum).name}", 128 + e.signum, as_json, stopped=True)
    except KeyboardInterrupt:
        fail("interrupted", 130, as_json, stopped=True)
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


CA_HELP = ("CA certificate (PEM) a registry's TLS certificate is checked against (default: the system store; "
           "also PRECAST_REGISTRY_CA).")
PLAIN_HELP = ("Talk plain HTTP to the registry (localhost and 127.0.0.1 fall back to it by themselves; also "
              "PRECAST_REGISTRY_PLAIN_HTTP=1, or =HOST:PORT,... for some registries only).")


def registry_options(command):
    """--ca and --plain-http on a command that takes oci:// references anywhere in its work (a bundle opened
    in place, a remote build cache): for this run, the same as PRECAST_REGISTRY_CA and
    PRECAST_REGISTRY_PLAIN_HTTP=1, which every registry client of the process reads."""
    @click.option("--ca", "registry_ca", default=None, type=click.Path(), help=CA_HELP)
    @click.option("--plain-http", "registry_plain_http", is_flag=True, help=PLAIN_HELP)
    @functools.wraps(command)
    def with_registry(*args, registry_ca=None, registry_plain_http=False, **kwargs):
        if registry_ca:
            os.environ["PRECAST_REGISTRY_CA"] = registry_ca
        if registry_plain_http:
            os.environ["PRECAST_REGISTRY_PLAIN_HTTP"] = "1"
        return command(*args, **kwargs)
    return with_registry
