"""Which LoRA adapter a request runs under, as vLLM's `LoRARequest(lora_name, lora_int_id, lora_path)`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """`lora_name` names the adapter (its prefix-cache key too); `lora_path`, its PEFT directory, lets
    the offline engine load it on first use. `lora_int_id` is vLLM's id, kept for its callers: ferry
    gives adapters their slots itself."""

    lora_name: str
    lora_int_id: int = 0
    lora_path: str = ""


def lora_name_of(lora_request: LoRARequest | str | None) -> str | None:
    """The adapter's name from a LoRARequest, a bare name, or None (the base model)."""
    if lora_request is None or isinstance(lora_request, str):
        return lora_request or None
    if isinstance(lora_request, LoRARequest):
        return lora_request.lora_name
    raise TypeError(f"lora_request must be a LoRARequest or an adapter's name, got {type(lora_request).__name__}")
