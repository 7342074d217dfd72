"""User-facing errors: one clear line (what, where, how to fix), exit code 2."""


class UserError(Exception):
    """Bad input: the CLI prints ``error: <what>. fix: <how>`` and exits with code 2."""

    def __init__(self, what: str, fix: str | None = None):
        self.what = what
        self.fix = fix
        super().__init__(f"{what}. fix: {fix}" if fix else what)


class ParityError(RuntimeError):
    """The ``.pte`` disagrees with the converted model past the configured tolerance (exit code 1)."""
