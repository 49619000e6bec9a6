"""Prefill/decode disaggregation in the gateway: which worker prefills, which decodes, and the bodies.

The gateway runs a disaggregated request in two hops (vLLM's proxy does the
same): first to a prefill worker, with `max_tokens` 1, not streamed, and
`kv_transfer_params.do_remote_decode` naming the decode worker's receiver:
it computes the prompt, samples the first token, pushes the prompt's KV
blocks (only those the decode worker lacks) and answers with that token and
a digest of the prompt's token ids. Then the client's own body goes to the
decode worker with `kv_transfer_params.do_remote_prefill` and the token; it
finds the prompt in its prefix cache, continues from the token, and its
response (streamed or not) is passed through to the client.

Choices:
- decode worker: by load alone (requests in flight or running + waiting, and
  KV-cache use): decode is memory-bound, and the prompt's blocks will be sent
  to whichever worker is chosen;
- prefill worker: the kv-aware score over the prefill pool (Router), so
  prompts sharing a prefix meet the worker that caches it;
- conditional disaggregation: when the part of the prompt the decode worker
  does not cache (from its KV events) is shorter than `min_prefill_tokens`,
  the decode worker prefills it itself: a transfer would cost more than it
  saves.
- aggregation: prefill pools are per model (a worker's served names) and,
  with `--prefill NAME=URL`, per name: an API key's `prefill_pool` sends its
  requests to that pool; every pool feeds the model's one decode pool, whose
  workers batch all of them together.
"""

from __future__ import annotations

import msgspec

from ferry.gateway.replicas import Worker

DISAGGREGATED, LOCAL, FALLBACK = "disaggregated", "local", "fallback"


def parse_prefill_spec(spec: str) -> tuple[str | None, str]:
    """`[POOL=]URL` -> (pool or None, url)."""
    name, sep, url = spec.partition("=")
    if sep and not name.startswith("http") and "/" not in name:
        if not name or not url:
            raise ValueError(f"--prefill expects [POOL=]URL, got {spec!r}")
        return name, url
    return None, spec


def choose_decode(workers: list[Worker], turn: int, kv_usage_weight: float = 0.5) -> Worker:
    """The least loaded decode worker: relative load plus weighted KV-cache use; ties rotate."""
    loads = [w.load for w in workers]
    scale = max(loads) + 1.0
    n = len(workers)
    best = min(range(n), key=lambda i: (loads[i] / scale + kv_usage_weight * workers[i].kv_usage, (i - turn) % n))
    return workers[best]


def why_not_disaggregated(data: dict, kind: str) -> str | None:
    """Why a body must be prefilled where it decodes (None: it can be split)."""
    if kind in ("embeddings", "score", "rerank"):
        return "an embedding"  # a prompt's pass and nothing after it: the decode worker runs it whole
    if kind == "responses":
        return "the Responses API"  # its body takes no kv_transfer_params: the decode worker runs it whole
    if data.get("use_beam_search"):
        return "beam search"  # rounds of one-token requests: the decode worker runs them all
    if data.get("prompt_logprobs") is not None:
        return "prompt logprobs"  # every prompt position's logits: the decode worker computes the prompt whole
    n = data.get("n", 1)
    if n not in (None, 1):
        return "n > 1"
    if kind == "completions":
        prompt = data.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) and len(prompt) > 1:
            return "several prompts"
        if data.get("echo"):
            return "echo"
    return None


def prefill_body(data: dict, receiver: str | None) -> bytes:
    """The client's body as a prefill-only request: one token, not streamed, blocks sent to `receiver`."""
    body = dict(data)
    body["stream"] = False
    body.pop("stream_options", None)
    body["max_tokens"] = 1
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    if isinstance(body.get("min_tokens"), int) and body["min_tokens"] > 1:
        body["min_tokens"] = 1  # still no EOS as the first token, as the client asked
    params = {"do_remote_decode": True}
    if receiver:
        params["decode_receiver"] = receiver
    body["kv_transfer_params"] = params
    return msgspec.json.encode(body)


def decode_body(data: dict, prefill_answer: dict | None) -> bytes:
    """The client's body for the decode worker, continuing from the prefill worker's token."""
    body = dict(data)
    body.pop("kv_transfer_params", None)  # never the client's own
    if prefill_answer is not None:
        body["kv_transfer_params"] = {
            "do_remote_prefill": True,
            "first_token_ids": prefill_answer["first_token_ids"],
            "prompt_digest": prefill_answer["prompt_digest"],
        }
    return msgspec.json.encode(body)


def receiver_of(worker: Worker) -> str | None:
    """The decode worker's KV receiver address as the prefill workers can reach it."""
    kv = (worker.info or {}).get("kv_transfer") or {}
    addr = kv.get("receiver")
    if not addr:
        return None
    from urllib.parse import urlparse

    host = addr.split("://", 1)[1].rsplit(":", 1)[0]
    if host in ("0.0.0.0", "*", "[::]", ""):  # bound to every interface: reach it where its HTTP is
        addr = addr.replace(host, urlparse(worker.url).hostname or "127.0.0.1", 1)
    return addr
