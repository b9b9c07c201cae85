"""Exception types whose message is meant for the user: what is wrong and how to fix it.

The CLI prints these as one line (exit code 2) instead of a traceback; bad
configuration and inputs raise ``ValueError`` (or ``ConfigError``) and are
treated the same way. ``--log-level DEBUG`` shows the traceback as well.
"""


class SaoError(RuntimeError):
    """A run-time failure explained to the user (engines unreachable, diverged loss, ...)."""
