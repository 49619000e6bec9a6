"""The gateway's view of a prompt (gateway/prompts.py): the worker's tokenizer and chat template."""

from __future__ import annotations

from ferry.entrypoints.openai.chat_prompt import render_chat_prompt
from ferry.entrypoints.openai.protocol import ChatCompletionRequest
from ferry.gateway.prompts import PromptTokenizer
from ferry.gateway.replicas import Worker
from ferry.models.paths import default_model_path

TEMPLATE = (
    "{% for m in messages %}<<{{ m.role }}>>{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}<<a>>{% endif %}"
)


def test_the_gateway_renders_a_workers_template_when_it_shows_it():
    gguf = default_model_path()
    body = {"model": "m", "messages": [{"role": "user", "content": "Name a colour."}]}
    prompts = PromptTokenizer()
    own = prompts.token_ids("chat", body, Worker("http://w1", info={"tokenizer": gguf}))
    custom = prompts.token_ids("chat", body, Worker("http://w2", info={"tokenizer": gguf, "chat_template": TEMPLATE}))
    tok = prompts._tokenizer(Worker("http://w2", info={"tokenizer": gguf}))
    assert custom == tok.encode("<<user>>Name a colour.\n<<a>>", add_special_tokens=False)
    assert own == render_chat_prompt(tok, ChatCompletionRequest.model_validate(body))["prompt_token_ids"] != custom


def test_a_tokenizer_the_gateway_cannot_load_routes_by_load_and_is_tried_once(monkeypatch):
    """A worker's tokenizer missing on the gateway's host (or one that is its own code): no ids, no
    500 for a multi-prompt body's token count, and no load attempt per request."""
    import ferry.tokenizer

    calls = []

    def failing(source, *args):
        calls.append(source)
        raise FileNotFoundError(f"tokenizer path {source!r} does not exist")

    monkeypatch.setattr(ferry.tokenizer, "load_tokenizer", failing)
    prompts = PromptTokenizer()
    worker = Worker("http://w", info={"tokenizer": "/models/elsewhere", "max_model_len": 512})
    body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}
    assert prompts.token_ids("chat", body, worker) is None
    assert prompts.token_ids("completions", {"prompt": "Hi"}, worker) is None
    assert prompts.num_prompt_tokens(["Hi", "there"], worker) is None
    assert prompts.num_prompt_tokens([[1, 2], [3]], worker) == 3  # ids need no tokenizer
    assert calls == ["/models/elsewhere"]


def test_a_tokenizer_that_is_its_own_code_loads_with_the_gateways_trust_remote_code(tmp_path):
    from conftest import write_own_code_tokenizer

    from ferry.tokenizer import load_tokenizer

    write_own_code_tokenizer(load_tokenizer(default_model_path()), tmp_path)
    worker = Worker("http://w", info={"tokenizer": str(tmp_path)})
    trusting = PromptTokenizer(trust_remote_code=True)
    own = trusting._tokenizer(worker)
    assert type(own).__name__ == "FerryTestTokenizerFast"
    assert trusting.token_ids("completions", {"prompt": "Hi there"}, worker) == own.encode("Hi there")
    assert PromptTokenizer().token_ids("completions", {"prompt": "Hi there"}, worker) is None  # refused: by load


def test_the_gateway_hashes_the_prompt_the_worker_keeps_after_truncate_prompt_tokens():
    """vLLM's truncate_prompt_tokens: routing looks at the last k tokens, as the worker runs them."""
    worker = Worker("http://w", info={"tokenizer": default_model_path(), "max_model_len": 8})
    prompts = PromptTokenizer()
    ids = list(range(1, 21))
    assert prompts.token_ids("completions", {"prompt": ids, "truncate_prompt_tokens": 5}, worker) == ids[-5:]
    assert prompts.token_ids("completions", {"prompt": ids, "truncate_prompt_tokens": -1}, worker) == ids[-7:]
    text = "a prompt of some tokens, more than five"
    full = prompts.token_ids("completions", {"prompt": text}, worker)
    assert prompts.token_ids("embeddings", {"input": text, "truncate_prompt_tokens": 5}, worker) == full[-5:]
    for junk in (0, -2, "5", 2.5, True, None):  # the worker refuses these (or ignores None): ids as sent
        assert prompts.token_ids("completions", {"prompt": ids, "truncate_prompt_tokens": junk}, worker) == ids
