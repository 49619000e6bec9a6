"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter: LoRA adapters loaded and unloaded while
the server runs (vLLM's endpoints and bodies).

Off unless `ferry serve --allow-runtime-lora-updating DIR [DIR ...]` names the directories adapters
may be loaded from: vLLM turns these on with `VLLM_ALLOW_RUNTIME_LORA_UPDATING` and reads any path
a client sends; here a path must resolve (symbolic links followed) inside one of those directories,
so a client cannot make the server read files elsewhere. `--api-key` covers both routes, as every
`/v1/` route. The core loads an adapter between steps; how many may be loaded at once is
`--max-cpu-loras`. Unloading, or loading in place (`load_inplace`: the old version stays if the new
one fails), is refused (409) while requests still run under the adapter.
"""

from __future__ import annotations

import asyncio
import os

from pydantic import Field
from starlette.responses import PlainTextResponse

from ferry.engine.core_client import EngineDeadError
from ferry.engine.messages import LoRAInUseError
from ferry.entrypoints.openai.protocol import OpenAIError, Strict
from ferry.entrypoints.openai.serving import ServerState, ready_engine
from ferry.sampling_params import InvalidParameterError

MAX_ADAPTER_NAME = 256


class LoadLoRAAdapterRequest(Strict):
    lora_name: str = Field(min_length=1, max_length=MAX_ADAPTER_NAME)
    lora_path: str = Field(min_length=1, max_length=4096)
    load_inplace: bool = False  # vLLM's: replace an adapter of that name (a new version)


class UnloadLoRAAdapterRequest(Strict):
    lora_name: str = Field(min_length=1, max_length=MAX_ADAPTER_NAME)
    lora_int_id: int | None = None  # vLLM's; ferry knows adapters by name


def allowed_adapter_dir(path: str, roots: list[str]) -> str:
    """`path` resolved, if it lies inside one of `roots` (resolved already) and holds a PEFT
    adapter; else a 400 that names only what the client sent."""
    if "\0" in path:
        raise OpenAIError(400, "lora_path must not hold a NUL character", param="lora_path", code=400)
    real = os.path.realpath(path)
    if not any(os.path.commonpath([real, root]) == root for root in roots):
        raise OpenAIError(400, f"lora_path {path!r} is not under a directory this server loads adapters from "
                               "(--allow-runtime-lora-updating)", param="lora_path", code=400)  # fmt: skip
    if not os.path.isfile(os.path.join(real, "adapter_config.json")):
        raise OpenAIError(400, f"lora_path {path!r} holds no adapter_config.json (a PEFT LoRA adapter's)",
                          param="lora_path", code=400)  # fmt: skip
    return real


def _updating(state: ServerState):
    if not state.lora_update_dirs:
        raise OpenAIError(404, "loading LoRA adapters at run time is off; start the server with "
                               "--allow-runtime-lora-updating DIR", "NotFoundError", code=404)  # fmt: skip
    return ready_engine(state)


def _in_use(e: InvalidParameterError) -> OpenAIError:
    """The core's refusal as the client's error: 409 while requests run under the adapter, else 400."""
    status = 409 if isinstance(e, LoRAInUseError) else 400
    return OpenAIError(status, str(e), param=e.param, code=status)


async def load_lora_adapter(state: ServerState, body: LoadLoRAAdapterRequest) -> PlainTextResponse:
    engine = _updating(state)
    name = body.lora_name
    if name in state.served_model_names:
        raise OpenAIError(400, f"{name!r} is the base model's name; give the adapter another", param="lora_name",
                          code=400)  # fmt: skip
    path = allowed_adapter_dir(body.lora_path, state.lora_update_dirs)
    async with state.lora_lock:  # one change at a time: a load and an unload of a name never cross
        replace = name in state.lora_modules
        if replace and not body.load_inplace:
            raise OpenAIError(400, f"The lora adapter '{name}' has already been loaded.", param="lora_name", code=400)
        try:
            await engine.add_lora(name, path, replace=replace)  # in place: the old version stays if this fails
        except InvalidParameterError as e:
            raise _in_use(e) from None
        except (EngineDeadError, asyncio.TimeoutError) as e:
            raise OpenAIError(503, f"the engine did not answer: {e}", "service_unavailable", code=503) from None
        state.lora_modules[name] = path
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(state: ServerState, body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
    engine = _updating(state)
    name = body.lora_name
    async with state.lora_lock:
        if name not in state.lora_modules:
            raise OpenAIError(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError", param="lora_name",
                              code=404)  # fmt: skip
        try:
            await engine.remove_lora(name)
        except InvalidParameterError as e:
            raise _in_use(e) from None
        except (EngineDeadError, asyncio.TimeoutError) as e:
            raise OpenAIError(503, f"the engine did not answer: {e}", "service_unavailable", code=503) from None
        del state.lora_modules[name]
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
