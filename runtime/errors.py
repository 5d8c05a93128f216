"""The runtime's error for user mistakes (a bad --backend string, a bundle that does not fit),
`Cancelled`, raised when an app's cancel hook stops a run (runtime/api.py), and `Terminated`, what the
command line raises on SIGTERM / SIGHUP so that cleanup (`finally`, staging folders) runs before it exits.

The command line turns a UserError into one line on stderr and exit code 2. The compiler's
`BadInput` is the same kind of error, so one handler serves both sides.
"""


class UserError(Exception):
    """Input the user can fix; the message names the file, field or value and the fix."""


class Cancelled(Exception):
    """A run stopped by its caller's cancel hook (runtime/api.py) between denoising steps: not an
    error in the input. `step` steps of `total` had run; nothing was decoded."""

    def __init__(self, step: int, total: int):
        super().__init__(f"cancelled after step {step} of {total} (the cancel hook asked to stop)")
        self.step, self.total = step, total


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP (`timeout`, a CI cancel, `docker stop`, a closed terminal) as an exception, so the
    process cleans up as it does on Ctrl+C; the command line exits 128 + the signal's number."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum
