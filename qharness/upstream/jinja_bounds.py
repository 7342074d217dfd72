"""Bounds on what a chat template renders: transformers' Jinja sandbox stops code, not size.

``{{ m.content * 10000000 }}`` in a chat template (a training run's ``data.chat_template``, ``generate
--chat_template``) makes one string of gigabytes before anything can see it. ``bound_chat_templates()`` gives
transformers' template compiler (``transformers.utils.chat_template_utils._compile_jinja_template``, which builds an
``ImmutableSandboxedEnvironment`` per template) a subclass of that sandbox that refuses, before allocating, a string
or list repeated (``*``) past ``MAX_OUTPUT`` characters or items, a power (``**``) of more than ``MAX_POWER_BITS``
bits, a ``center`` width past ``MAX_OUTPUT``, and a rendered output (``concat``: a template's, a macro's or a
``{% set %}`` block's) past ``MAX_OUTPUT`` characters. ``range`` is the sandbox's own (``MAX_RANGE``, 100,000 items).
A refusal is a ``jinja2.exceptions.SecurityError`` that the template's caller turns into one line naming the template.
Applied explicitly (``sources/chat.py`` before it renders), once per process; templates compiled earlier are
compiled again.

Example::

    bound_chat_templates()
    tokenizer.apply_chat_template(messages, chat_template="{{ messages[0].content * 10**9 }}")
    # -> SecurityError: the chat template's output would exceed 10,000,000 characters (a string repeated 10**9 times)
"""

from __future__ import annotations

import operator

MAX_OUTPUT = 10_000_000  # characters a chat template may render (a conversation is thousands)
MAX_POWER_BITS = 4096  # bits of a ``**`` result

_installed = False


def _refuse(what: str):
    from jinja2.exceptions import SecurityError

    return SecurityError(f"the chat template's output would exceed {MAX_OUTPUT:,} characters ({what})")


def _repeat(left, right):
    """``left * right``, refused when a string or sequence would pass ``MAX_OUTPUT`` characters or items."""
    for seq, n in ((left, right), (right, left)):
        if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > MAX_OUTPUT:
            raise _refuse(f"a {type(seq).__name__} of {len(seq):,} repeated {n:,} times")
    return operator.mul(left, right)


def _power(left, right):
    if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
        if right * max(1, abs(left).bit_length()) > MAX_POWER_BITS:
            raise _refuse(f"a power of {right:,}: more than {MAX_POWER_BITS} bits")
    return operator.pow(left, right)


def bounded_concat(pieces) -> str:
    """``"".join(pieces)``, refused once the pieces pass ``MAX_OUTPUT`` characters (read a piece at a time)."""
    out, total = [], 0
    for piece in pieces:
        total += len(piece)
        if total > MAX_OUTPUT:
            raise _refuse("its rendered text")
        out.append(piece)
    return "".join(out)


def _center(value, width=80):
    if isinstance(width, int) and width > MAX_OUTPUT:
        raise _refuse(f"center({width:,})")
    return str(value).center(width)


def bounded_sandbox():
    """The subclass of jinja2's ``ImmutableSandboxedEnvironment`` with the bounds above."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedSandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**"})
        concat = staticmethod(bounded_concat)

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.filters["center"] = _center

        def call_binop(self, context, operator_name, left, right):
            if operator_name == "*":
                return _repeat(left, right)
            if operator_name == "**":
                return _power(left, right)
            return super().call_binop(context, operator_name, left, right)

    return BoundedSandbox


def bound_chat_templates() -> None:
    """Make transformers compile chat templates in ``bounded_sandbox()`` (once per process)."""
    global _installed
    if _installed:
        return
    from transformers.utils import chat_template_utils as ctu

    ctu.ImmutableSandboxedEnvironment = bounded_sandbox()
    ctu._compile_jinja_template.cache_clear()
    _installed = True


__all__ = ["MAX_OUTPUT", "bound_chat_templates", "bounded_concat", "bounded_sandbox"]
