"""`--chat-template` (chat_template.py): a file or the template itself, checked at start. (`ferry
serve` refusing a bad one: tests/test_cli.py; the gateway rendering a worker's:
tests/gateway/test_prompt_tokenizer.py.)"""

from __future__ import annotations

import pytest

from ferry.entrypoints.openai.chat_template import load_chat_template

TEMPLATE = (
    "{% for m in messages %}<<{{ m.role }}>>{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}<<a>>{% endif %}"
)


def test_a_file_or_the_template_itself(tmp_path):
    path = tmp_path / "chat.jinja"
    path.write_text(TEMPLATE + "é 你")
    assert load_chat_template(str(path)) == TEMPLATE + "é 你"
    # Inline, as a shell passes it: `\n` is two characters, decoded; other characters kept.
    assert load_chat_template(TEMPLATE.replace("\n", "\\n") + "é 你") == TEMPLATE + "é 你"
    assert load_chat_template(None) is None


def test_a_missing_file_or_a_syntax_error_is_named():
    with pytest.raises(ValueError, match="looks like a file path, but it cannot be opened"):
        load_chat_template("templates/chatml.jinja")
    with pytest.raises(ValueError, match="line 2: .*endfor"):
        load_chat_template("{% for m in messages %}\n{{ m.content }}")
    with pytest.raises(ValueError, match="backslash escape"):
        load_chat_template("{{ messages }}\\")


def test_the_tags_transformers_renders_are_taken():
    """Loop controls and `{% generation %}` (assistant masks): transformers renders them."""
    text = ("{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}{% generation %}{{ m.content }}"
            "{% endgeneration %}{% endfor %}")  # fmt: skip
    assert load_chat_template(text) == text
