"""`--chat-template` (chat_template.py): a file or the template itself, checked at start, and the
gateway rendering a worker's template as the worker does. (`ferry serve` refusing a bad one:
tests/test_cli.py.)"""

from __future__ import annotations

import pytest

from ferry.entrypoints.openai.chat_prompt import render_chat_prompt
from ferry.entrypoints.openai.chat_template import load_chat_template
from ferry.entrypoints.openai.protocol import ChatCompletionRequest
from ferry.gateway.prompts import PromptTokenizer
from ferry.gateway.replicas import Worker
from ferry.models.paths import default_model_path

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


def test_the_gateway_renders_a_workers_template_when_it_shows_it():
    gguf = default_model_path()
    body = {"model": "m", "messages": [{"role": "user", "content": "Name a colour."}]}
    prompts = PromptTokenizer()
    own = prompts.token_ids("chat", body, Worker("http://w1", info={"tokenizer": gguf}))
    custom = prompts.token_ids("chat", body, Worker("http://w2", info={"tokenizer": gguf, "chat_template": TEMPLATE}))
    tok = prompts._tokenizer(Worker("http://w2", info={"tokenizer": gguf}))
    assert custom == tok.encode("<<user>>Name a colour.\n<<a>>", add_special_tokens=False)
    assert own == render_chat_prompt(tok, ChatCompletionRequest.model_validate(body))["prompt_token_ids"] != custom
