"""`--chat-template`: a Jinja chat template given as a file or inline, as vLLM takes it.

A value that opens as a file is read; one that does not but holds Jinja's characters (`{`, `}` or a
newline) is the template itself, its backslash escapes (`\\n`) decoded as a shell leaves them; any
other value is a path that failed to open, and says so. The template is compiled at start by
transformers, as it will be rendered (its sandbox, with loop controls and `{% generation %}`), so a
syntax error stops the server with its line number instead of failing every chat request.
"""

from __future__ import annotations

import hashlib

_JINJA_CHARS = "{}\n"


def load_chat_template(value: str | None) -> str | None:
    """The template text `--chat-template` names (None: the tokenizer's own)."""
    if value is None:
        return None
    try:
        with open(value, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        if not any(c in value for c in _JINJA_CHARS):
            raise ValueError(f"--chat-template {value!r} looks like a file path, but it cannot be opened: {e}") from e
        # \n and the like decoded; other characters kept as they are (é, 你): through latin-1 with
        # backslash escapes for what it lacks, which unicode_escape turns back.
        try:
            text = value.encode("latin-1", "backslashreplace").decode("unicode_escape")
        except UnicodeDecodeError as e:  # a lone backslash at the end, `\x` without two digits
            raise ValueError(f"--chat-template: a backslash escape it cannot read: {e.reason}") from None
    check_syntax(text)
    return text


def check_syntax(text: str) -> None:
    # transformers' own compile (~0.5 s to import, without torch; only with --chat-template).
    from jinja2 import TemplateSyntaxError
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        _compile_jinja_template(text)
    except TemplateSyntaxError as e:
        raise ValueError(f"--chat-template: line {e.lineno}: {e.message}") from None


def template_digest(text: str | None) -> str | None:
    """What /ferry/info shows of a custom template behind an API key: which one, not its text."""
    return hashlib.sha256(text.encode()).hexdigest() if text is not None else None
