"""argparse types for flags that take JSON (vLLM's --allowed-origins, --override-generation-config)."""

from __future__ import annotations

import argparse
import json


def json_list(text: str) -> list[str]:
    """A JSON list of strings, such as '["*"]'."""
    try:
        value = json.loads(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not JSON: {text!r} (a list such as '[\"*\"]')") from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"a JSON list of strings, got {text!r}")
    return value


def json_object(text: str) -> dict:
    """A JSON object, such as '{"temperature": 0.5}'."""
    try:
        value = json.loads(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not JSON: {text!r} (an object such as '{{\"temperature\": 0.5}}')") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"a JSON object, got {text!r}")
    return value
