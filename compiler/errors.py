"""The one error type for user mistakes: it names the file, key or field and says the fix.

The CLI turns a `BadInput` into one line on stderr and exit code 2, never a traceback. It is
the runtime's `UserError`, so one handler serves both sides.
"""
from ..runtime.errors import UserError


class BadInput(UserError):
    """Input the user can fix: a damaged file, an unknown model, a bad option."""
