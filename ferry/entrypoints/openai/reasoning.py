"""Reasoning parsers (`--reasoning-parser NAME`): split a thinking model's output into
`reasoning_content` (between `<think>` and `</think>`) and the answer (`content`).

`deepseek_r1` and `qwen3` models think in the same tags. Either the output opens with `<think>`
(Qwen3) or the chat template put it at the end of the prompt (DeepSeek-R1, Qwen3 thinking-only
releases), so the output starts inside the reasoning and only closes it. A prompt whose last
`<think>` is already closed (Qwen3 with `enable_thinking: false`) has no reasoning to come.
An output cut off before `</think>` is all reasoning.

Structured output and the tool grammars apply after the reasoning (the engine's grammar opens at
`</think>`, StructuredOutputsParams.after_token_ids).
"""

from __future__ import annotations

from ferry.entrypoints.openai.tool_parsers.base import marker_prefix_len

START, END = "<think>", "</think>"
REASONING_PARSERS = ("deepseek_r1", "qwen3")


def reasoning_open_in_prompt(prompt: str) -> bool:
    """Whether the prompt ends inside a `<think>` block (the output continues the reasoning)."""
    i = prompt.rfind(START)
    return i >= 0 and prompt.find(END, i) < 0


def reasoning_ended_in_prompt(prompt: str) -> bool:
    """Whether the prompt itself closed the reasoning (a last `<think>` followed by `</think>`)."""
    i = prompt.rfind(START)
    return i >= 0 and prompt.find(END, i) >= 0


def split_reasoning(text: str, open_in_prompt: bool) -> tuple[str | None, str | None]:
    """A finished output as (reasoning_content, content); None for an empty part."""
    stream = ReasoningStream(open_in_prompt)
    reasoning, content = stream.feed(text, final=True)
    return reasoning if stream.reasoned else None, content or None


class ReasoningStream:
    """One choice's output, fed as deltas: (reasoning delta, content delta) at each step."""

    def __init__(self, open_in_prompt: bool) -> None:
        self.state = "reasoning" if open_in_prompt else "start"  # start | reasoning | answer | content
        self.reasoned = open_in_prompt  # some reasoning was (or is being) produced
        self.pending = ""  # held back: may be the start of a tag

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        text, self.pending = self.pending + delta, ""
        reasoning, content = [], []
        while text:
            if self.state == "start":
                body = text.lstrip()
                if body.startswith(START):
                    self.state, self.reasoned, text = "reasoning", True, body[len(START) :]
                elif not final and (not body or START.startswith(body)):
                    self.pending = text  # may still open with <think>
                    break
                else:
                    self.state = "content"
            elif self.state == "reasoning":
                i = text.find(END)
                if i >= 0:
                    reasoning.append(text[:i])
                    self.state, text = "answer", text[i + len(END) :]
                    continue
                keep = 0 if final else marker_prefix_len(text, END)
                reasoning.append(text[: len(text) - keep])
                self.pending = text[len(text) - keep :]
                break
            elif self.state == "answer":  # the newlines models put after </think> are no content
                text = text.lstrip("\n")
                if text:
                    self.state = "content"
            else:
                content.append(text)
                break
        return "".join(reasoning), "".join(content)
