"""utils/lazy_zeros.py: zeroed CPU tensors (the KV cache's) whose pages cost nothing until written."""

from __future__ import annotations

import gc
import os

import pytest
import torch

from ferry.utils.lazy_zeros import Populator, populate_in_background, zeros


def resident_bytes() -> int:
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.float8_e4m3fn])
def test_lazy_zeros_are_zeros_of_the_asked_shape_and_dtype(dtype):
    t = zeros((64, 16, 3, 128), dtype, "cpu")  # 1.5 MiB or more: the lazy path
    assert t.shape == (64, 16, 3, 128) and t.dtype == dtype and t.is_contiguous()
    assert t.data_ptr() % 64 == 0  # page-aligned: the C++ kernels' vector loads
    assert not t.float().any()
    small = zeros((4, 4), dtype, "cpu")  # below the threshold: torch.zeros
    assert small.shape == (4, 4) and small.dtype == dtype and not small.float().any()


def test_lazy_zeros_cost_no_memory_until_written_and_live_as_long_as_a_view():
    before = resident_bytes()
    t = zeros((512, 1024, 256), torch.float32, "cpu")  # 512 MiB
    assert resident_bytes() - before < 64 << 20  # not written: not resident
    t[7].fill_(1.0)  # 1 MiB written
    assert t.sum().item() == 1024 * 256
    view = t[7, :4]
    del t
    gc.collect()
    view.add_(1.0)  # the mapping outlives the name of the tensor it came from
    assert view.sum().item() == 2 * 4 * 256


def _populate_write_supported() -> bool:
    """MADV_POPULATE_WRITE came with Linux 5.14."""
    major, minor = (int(x) for x in os.uname().release.split(".")[:2])
    return (major, minor) >= (5, 14)


@pytest.mark.skipif(not _populate_write_supported(), reason="MADV_POPULATE_WRITE needs Linux >= 5.14")
def test_populator_faults_pages_in_ahead_without_changing_them():
    """--kv-cache-prefault's thread: every page of the tensors resident once it is done, at idle
    priority, and nothing they hold changed (a written value stays, the rest stays zero)."""
    a = zeros((12 << 20,), torch.uint8, "cpu")  # 12 MiB: six 2 MiB chunks
    b = zeros((3 << 20,), torch.float32, "cpu").view(-1, 1024)  # 12 MiB in another shape
    a[5 << 20] = 7  # one page already written
    before = resident_bytes()
    pop = populate_in_background([a, b])
    assert pop.total_bytes == 24 << 20
    assert pop.wait()
    assert pop.error is None and pop.idle_priority
    assert pop.populated_bytes == 24 << 20
    assert resident_bytes() - before >= 20 << 20  # (the written page was resident already)
    assert a[5 << 20].item() == 7 and a.sum().item() == 7 and not b.any()


def test_populator_stops_when_asked():
    big = zeros((1 << 30,), torch.uint8, "cpu")  # 1 GiB: hundreds of 2 MiB calls, at idle priority
    pop = populate_in_background([big])
    pop.stop()
    assert not pop._thread.is_alive() and pop.populated_bytes < pop.total_bytes
    Populator([big]).stop()  # never started: nothing to wait for


@pytest.mark.skipif(not _populate_write_supported(), reason="MADV_POPULATE_WRITE needs Linux >= 5.14")
def test_engine_prefaults_its_cpu_kv_cache_and_generates_the_same_tokens():
    from ferry.config import EngineArgs
    from ferry.engine.llm_engine import LLMEngine
    from ferry.sampling_params import SamplingParams
    from tests.conftest import run_to_completion, tiny_llama

    def tokens(prefault: bool):
        args = EngineArgs(model="tiny", device="cpu", dtype="float32", num_kv_blocks=512, kv_cache_prefault=prefault)
        engine = LLMEngine(args, model=tiny_llama(), tokenizer=None, device=torch.device("cpu"), dtype=torch.float32)
        pop = engine.runner.kv_populator
        if prefault:  # 2 layers x (K, V) x 512 blocks of 16 tokens x 2 heads x 32 floats: 2 MiB each
            assert pop is not None and pop.wait() and pop.error is None
            assert pop.populated_bytes == pop.total_bytes == 4 * 512 * 16 * 2 * 32 * 4
        else:
            assert pop is None
        engine.add_request("r", {"prompt_token_ids": list(range(10, 40))}, SamplingParams(temperature=0, max_tokens=8))
        out = run_to_completion(engine)["r"].outputs[0].token_ids
        engine.runner.free_kv_cache()
        assert engine.runner.kv_populator is None
        return out

    assert tokens(True) == tokens(False)
