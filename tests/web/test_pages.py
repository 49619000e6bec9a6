"""The web pages in a real browser: `ferry serve`'s chat playground and `ferry gateway`'s live
dashboard, driven in headless Chromium (Debian's package) by Playwright, against real servers with the
bundled model on 127.0.0.1."""

from __future__ import annotations

import os
import shutil

import httpx
import openai
import pytest
from server_utils import SIDE_BY_SIDE, GatewayProcess, ServerProcess, path_prefix_proxy, start_together

MODEL = "smol"
# No prefix cache: the playground test asks the page's question again through the API and expects the
# same greedy text, which holds when both compute the prompt whole. A cached prefix rounds apart in the
# last bits, which the GGUF path's int8 activations can grow into another token at a near tie (on an
# AVX2-only EPYC the answers parted after four tokens).
FLAGS = ("--max-model-len", "512", "--num-kv-blocks", "64", "--served-model-name", MODEL, "--no-enable-prefix-caching")
ADMIN = "dashboard-admin-key"
# As the tool library's probe found: without the background-networking flags, Chromium keeps trying
# hosts this machine cannot reach.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]  # fmt: skip


@pytest.fixture(scope="module")
def browser():
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed (.ci/run installs it)")
        pytest.skip("chromium is not installed (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=path, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture(scope="module")
def workers():
    servers = start_together(*[lambda: ServerProcess(*FLAGS, env=SIDE_BY_SIDE)] * 2)
    yield servers
    for s in servers:
        s.stop()


@pytest.fixture
def page(browser):
    # Playwright's waits are given as functions ("() => ..."): the pages' Content-Security-Policy
    # refuses to evaluate strings, and the tests run under it as users do.
    """A fresh page whose console errors and uncaught exceptions (a CSP refusal among them) fail the test."""
    context = browser.new_context()
    p = context.new_page()
    problems: list[str] = []
    p.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
    p.on("pageerror", lambda e: problems.append(str(e)))
    yield p
    context.close()
    # A 401 while the dashboard waits for its key is the page working as meant; nothing else may appear.
    assert [m for m in problems if "401" not in m] == []


def test_playground_streams_a_chat_turn(page, workers):
    server = workers[0]
    r = httpx.get(server.url + "/")
    assert r.status_code == 200 and "text/html" in r.headers["content-type"]
    assert "script-src 'self'" in r.headers["content-security-policy"]
    assert httpx.get(server.url + "/playground/nope.js").status_code == 404

    page.goto(server.url + "/")
    page.wait_for_function("() => document.getElementById('model').options.length > 0")
    assert page.input_value("#model") == MODEL
    page.eval_on_selector("#temperature", "t => { t.value = '0'; t.dispatchEvent(new Event('input')); }")
    assert page.text_content("#temperature-value") == "0"
    page.fill("#max_tokens", "24")
    # Every change of the answer as the page renders it: a streamed answer grows in several steps.
    page.evaluate("""() => {
        window.seen = [];
        new MutationObserver(() => {
            const m = document.querySelector('.message.assistant .content');
            if (m && m.textContent.length) window.seen.push(m.textContent.length);
        }).observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true});
    }""")
    question = "Name three colours of the rainbow."
    page.fill("#prompt", question)
    page.press("#prompt", "Enter")
    page.wait_for_selector(".message.assistant[data-done=true]", timeout=180_000)

    history = page.evaluate("() => window.ferryPlayground.history")
    assert [m["role"] for m in history] == ["user", "assistant"] and history[0]["content"] == question
    grew = sorted(set(page.evaluate("() => window.seen")))
    assert len(grew) >= 3, f"the answer did not stream into the page: lengths seen {grew}"
    # The page's answer is the model's: the same greedy request through the API says the same.
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    direct = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}],
                                            max_tokens=24, temperature=0, top_p=1)  # fmt: skip
    assert history[1]["content"] == direct.choices[0].message.content
    stats = page.text_content(".message.assistant .stats")
    assert "TTFT" in stats and "tok/s" in stats and "24 tokens" in stats and "finish: length" in stats, stats

    # The conversation goes on: the second turn's request carries the first.
    page.fill("#prompt", "And one more?")
    page.press("#prompt", "Enter")
    page.wait_for_function("() => document.querySelectorAll('.message.assistant[data-done=true]').length == 2",
                           timeout=180_000)  # fmt: skip
    assert [m["role"] for m in page.evaluate("() => window.ferryPlayground.history")] == ["user", "assistant"] * 2


MARKDOWN = """## Title
Some **bold**, *italic* and `<code>` text, a [link](https://example.com) and [another](javascript:alert(1)).

- one
- two

1. first
2. second

> a quote

```python
print("<b>not bold</b>")
```
<img src=x onerror="window.pwned=1"><script>window.pwned=2</script>"""


def test_playground_markdown_renders_model_output_and_escapes_html(page, workers):
    page.goto(workers[0].url + "/")
    page.wait_for_function("() => window.ferryMarkdown !== undefined")
    found = page.evaluate("""source => {
        const div = document.createElement('div');
        div.innerHTML = window.ferryMarkdown.render(source);
        document.body.append(div);
        const count = s => div.querySelectorAll(s).length;
        return {h2: count('h2'), strong: count('strong'), em: count('em'), code: count('p code'),
                pre: div.querySelector('pre code.language-python').textContent, ul: count('ul li'),
                ol: count('ol li'), quote: div.querySelector('blockquote').textContent.trim(),
                links: [...div.querySelectorAll('a')].map(a => a.getAttribute('href')),
                img: count('img'), script: count('script'), pwned: window.pwned ?? null,
                text: div.textContent};
    }""", MARKDOWN)  # fmt: skip
    assert found["h2"] == 1 and found["strong"] == 1 and found["em"] == 1 and found["code"] == 1
    assert found["ul"] == 2 and found["ol"] == 2 and found["quote"] == "a quote"
    assert found["pre"] == 'print("<b>not bold</b>")'  # code shown as written, not as markup
    assert found["links"] == ["https://example.com"]  # a javascript: address stays text
    assert found["img"] == 0 and found["script"] == 0 and found["pwned"] is None
    assert '<img src=x onerror="window.pwned=1">' in found["text"]  # the model's text, shown as text


def test_dashboard_shows_a_worker_go_down_and_come_back(page, workers):
    gw = GatewayProcess([w.url for w in workers], "--admin-key", ADMIN, "--health-interval", "0.5",
                        "--cooldown", "1")  # fmt: skip
    try:
        assert httpx.get(gw.url + "/gateway/state").status_code == 401  # its data needs the admin key
        page.goto(gw.url + "/")  # redirects to /dashboard
        assert page.url.endswith("/dashboard")
        page.wait_for_function("() => document.getElementById('error').textContent.includes('admin key')")
        page.fill("#admin-key", ADMIN)
        page.dispatch_event("#admin-key", "change")
        page.wait_for_function("() => document.querySelectorAll('#workers tr[data-healthy=true]').length == 2")
        assert page.text_content("#card-healthy") == "2 / 2"

        # A streamed request through the gateway: a routing decision, and a point on the TTFT chart.
        stream = gw.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi!"}],
                                                   max_tokens=8, temperature=0, stream=True)  # fmt: skip
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        page.wait_for_function("() => document.querySelectorAll('#routing tbody tr').length >= 1")
        assert page.text_content("#routing tbody tr td.worker") in {w.url for w in workers}
        page.wait_for_function("() => Number(document.getElementById('chart-ttft').dataset.points) >= 1")

        down = workers[1]
        row = f"#workers tr[data-url='{down.url}']"
        down.stop()
        page.wait_for_function(f"() => document.querySelector(\"{row}\").dataset.healthy === 'false'")
        assert page.text_content(f"{row} .health") == "down"
        assert page.text_content("#card-healthy") == "1 / 2"

        workers[1] = ServerProcess(*FLAGS, port=down.port, env=SIDE_BY_SIDE)  # the same replica, back where it was
        page.wait_for_function(f"() => document.querySelector(\"{row}\").dataset.healthy === 'true'", timeout=60_000)
        assert page.text_content(f"{row} .health") == "healthy"
        assert page.text_content("#card-healthy") == "2 / 2"
    finally:
        page.close()  # before its gateway goes: its next poll would find nobody there
        gw.stop()


def test_both_pages_work_behind_a_path_prefix_proxy(page, workers):
    """Served under a path prefix by a proxy that strips it (an ingress rewrite): the pages load
    their files and call the API relative to where they are, so the playground answers and the
    dashboard (reached through the gateway's redirect) reads its state, all under the prefix."""
    with path_prefix_proxy(workers[0].url, "/llm") as base:
        page.goto(base + "/")
        page.wait_for_function("() => document.getElementById('model').options.length > 0")
        page.fill("#max_tokens", "4")
        page.fill("#prompt", "Hi!")
        page.press("#prompt", "Enter")
        page.wait_for_selector(".message.assistant[data-done=true]", timeout=180_000)
        assert "finish:" in page.text_content(".message.assistant .stats")
    gw = GatewayProcess([w.url for w in workers], "--admin-key", ADMIN)
    try:
        with path_prefix_proxy(gw.url, "/gw") as base:
            page.goto(base + "/")
            assert page.url == base + "/dashboard"
            page.fill("#admin-key", ADMIN)
            page.dispatch_event("#admin-key", "change")
            page.wait_for_function("() => document.querySelectorAll('#workers tr[data-healthy=true]').length == 2")
    finally:
        gw.stop()
