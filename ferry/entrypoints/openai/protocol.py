"""Request bodies of the OpenAI API (with vLLM's extra sampling fields) and the error body.

Unknown fields are ignored, as OpenAI's server does. Floats reject NaN and
infinity (Python's json accepts them); counts have OpenAI's bounds.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ferry.sampling_params import InvalidParameterError, RequestOutputKind, SamplingParams

MAX_N = 128
MAX_LOGPROBS = 20
MAX_PROMPTS = 1024  # prompts in one /v1/completions request
MAX_INT = 2**31 - 1  # token counts: far above any context, far below what msgspec or torch choke on
# chat_template_kwargs keys that would let a client swap the template or the rendering itself
# (a client-supplied Jinja template can loop for hours: vLLM's CVE-2025-61620).
FORBIDDEN_TEMPLATE_KWARGS = frozenset({"chat_template", "tokenize", "conversation", "tools", "documents",
                                       "return_dict", "return_tensors", "tokenizer_kwargs", "padding",
                                       "truncation", "max_length", "add_generation_prompt",
                                       "continue_final_message"})  # fmt: skip

Finite = Annotated[float, Field(allow_inf_nan=False)]


class OpenAIError(Exception):
    """An error with an HTTP status and OpenAI's error body."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | int | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    include_usage: bool = False


class _GenerationRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: Finite | None = None
    top_p: Finite | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: Finite = 0.0
    frequency_penalty: Finite = 0.0
    logit_bias: dict[str, Finite] | None = None
    user: str | None = None
    # vLLM's extras
    top_k: int | None = Field(None, ge=-1, le=MAX_INT)
    min_p: Finite | None = None
    repetition_penalty: Finite | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=MAX_INT)
    priority: int = Field(0, ge=-(2**31), lt=2**31)  # lower runs first, as in vLLM
    stop_token_ids: list[int] | None = Field(None, max_length=1024)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Prefill/decode disaggregation, set by the gateway (vLLM's field name): {"do_remote_decode": true,
    # "decode_receiver": "tcp://..."} to a prefill worker; {"do_remote_prefill": true, "first_token_ids":
    # [...], "prompt_digest": "..."} to a decode worker (entrypoints/openai/serving.py).
    kv_transfer_params: dict[str, Any] | None = None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """Raises InvalidParameterError naming the field."""
        bias = None
        if self.logit_bias:
            bias = {}
            for key, value in self.logit_bias.items():
                try:
                    token = int(key)
                except ValueError:
                    raise InvalidParameterError(
                        "logit_bias", f"logit_bias keys must be token ids, got {key!r}"
                    ) from None
                if not -100.0 <= value <= 100.0:
                    raise InvalidParameterError("logit_bias", f"logit_bias values must be in [-100, 100], got {value}")
                bias[token] = value
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logprobs=logprobs,
            logit_bias=bias,
            skip_special_tokens=self.skip_special_tokens,
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
        )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_GenerationRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1, le=MAX_INT)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    # vLLM's extra: also return the prompt's and the completion's token ids in each choice.
    # Unset: only when the model has no tokenizer (--load-format dummy), where the text is empty.
    return_token_ids: bool | None = None


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=MAX_INT)  # deprecated by OpenAI, still sent by many clients
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_INT)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
