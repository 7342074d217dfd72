"""User-facing errors: one clear line (what, where, how to fix), exit code 2."""

import re

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


MAX_MESSAGE = 300  # characters of a parser's message kept in the one error line


def usage_error(message: str, prog: str, takes_config: bool = True) -> UserError:
    """A command-line parser's refusal (argparse, jsonargparse) as one ``UserError`` line with a fix, instead of a
    usage dump; ``prog`` is the command (``qharness fit``); ``takes_config``: a run-config command (its fix for an
    unknown argument says where the config goes)."""
    text = " ".join(message.split())
    text = text if len(text) <= MAX_MESSAGE else text[:MAX_MESSAGE] + " ..."
    command = " ".join(["qharness", *prog.split()[1:]]) if prog.split() else "qharness"
    missing = re.search(r"argument (\S+?)(?:/\S+)?: expected (?:one|at least one) argument", text)
    if missing:
        fix = f"give {missing.group(1)} a value (`{command} --help` lists each option's values)"
    elif "unrecognized arguments" in text.lower() and not takes_config:
        fix = f"`{command} --help` lists its options"
    elif "unrecognized arguments" in text.lower():
        fix = f"the config goes first, as a path (`{command} CONFIG.yaml`), then --section.field value pairs; `{command} --help` lists them"
    else:
        fix = f"`{command} --help` lists every option with its type"
    return UserError(f"{command}: {text}", fix=fix)
