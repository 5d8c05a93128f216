"""The one error type for user mistakes: it names the file, key or field and says the fix.

The CLI turns a `BadInput` into one line on stderr and exit code 2, never a traceback.
"""


class BadInput(Exception):
    """Input the user can fix: a damaged file, an unknown model, a bad option."""
