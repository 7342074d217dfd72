"""User-facing errors: one clear line (what, where, how to fix), exit code 2."""

# Control characters (a newline in a path, a tab in a value; C1 controls, Unicode line and paragraph separators)
# shown escaped, so the error stays one line.
_ONE_LINE = {
    c: repr(chr(c))[1:-1] if c < 256 else f"\\u{c:04x}" for c in (*range(32), *range(127, 160), 0x2028, 0x2029)
}


def one_line(text: str) -> str:
    """``text`` with its control characters shown escaped (``a\\nb``): one line on a terminal, in a log, a CSV
    cell or a Markdown row, whatever a file or directory name holds."""
    return text.translate(_ONE_LINE)


class UserError(Exception):
    """Bad input: the CLI prints ``error: <what>. fix: <how>`` and exits with code 2."""

    def __init__(self, what: str, fix: str | None = None):
        self.what = one_line(what)
        self.fix = one_line(fix) if fix else fix
        super().__init__(f"{self.what}. fix: {self.fix}" if self.fix else self.what)


class ParityError(RuntimeError):
    """The ``.pte`` disagrees with the converted model past the configured tolerance (exit code 1)."""


class DiskFullError(UserError):
    """A write ran out of space (or quota): ``path`` is the file that was being written (its old content, if any,
    is intact); the message says about how much it needed and how much is free (``qharness.io.disk.disk_full_error``)."""

    def __init__(self, what: str, fix: str | None = None, path=None):
        super().__init__(what, fix)
        self.path = path
