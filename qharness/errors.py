"""User-facing errors: one clear line (what, where, how to fix), exit code 2."""

# Control characters (a newline in a path, a tab in a value) shown escaped, so the error stays one line.
_ONE_LINE = {c: repr(chr(c))[1:-1] for c in (*range(32), 127)}


class UserError(Exception):
    """Bad input: the CLI prints ``error: <what>. fix: <how>`` and exits with code 2."""

    def __init__(self, what: str, fix: str | None = None):
        self.what = what.translate(_ONE_LINE)
        self.fix = fix.translate(_ONE_LINE) if fix else fix
        super().__init__(f"{self.what}. fix: {self.fix}" if self.fix else self.what)


class ParityError(RuntimeError):
    """The ``.pte`` disagrees with the converted model past the configured tolerance (exit code 1)."""


class DiskFullError(UserError):
    """A write ran out of space (or quota): ``path`` is the file that was being written (its old content, if any,
    is intact); the message says about how much it needed and how much is free (``qharness.io.disk_full_error``)."""

    def __init__(self, what: str, fix: str | None = None, path=None):
        super().__init__(what, fix)
        self.path = path
