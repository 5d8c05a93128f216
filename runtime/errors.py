"""The runtime's error for user mistakes (a bad --backend string, a bundle that does not fit).

The command line turns it into one line on stderr and exit code 2. The compiler's `BadInput`
is the same kind of error, so one handler serves both sides.
"""


class UserError(Exception):
    """Input the user can fix; the message names the file, field or value and the fix."""
