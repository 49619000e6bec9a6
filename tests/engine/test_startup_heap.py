"""The cyclic garbage collector around start-up (ferry/utils/process.py): paused while a model loads,
and the heap alive after an engine is built frozen out of its reach; later garbage is still collected."""

from __future__ import annotations

import gc
import weakref

import pytest
from conftest import engine_over

from ferry.config import EngineArgs
from ferry.engine.llm_engine import LLMEngine
from ferry.utils.process import cyclic_gc_paused


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def _frozen_cycle() -> weakref.ref:
    """A dropped cycle frozen out of the collector's reach, as if an earlier engine's build had
    frozen it while it was alive."""
    gc.unfreeze()
    dropped = _Cycle()
    ref = weakref.ref(dropped)
    gc.freeze()
    del dropped
    gc.collect()
    assert ref() is not None  # frozen: out of the collector's reach
    return ref


@pytest.fixture(autouse=True)
def _thawed_after():
    """Each test leaves the heap thawed: an engine over the shared model no longer thaws it."""
    yield
    gc.unfreeze()


def test_an_engine_that_loads_its_model_freezes_the_heap_and_reclaims_dropped_cycles(smollm, monkeypatch):
    """As a server's engine core or `LLM` builds one (its load here hands back the session's model)."""
    import ferry.engine.builder

    monkeypatch.setattr(ferry.engine.builder, "load_model", lambda *args, **kwargs: smollm)
    ref = _frozen_cycle()
    engine = LLMEngine(EngineArgs(model=smollm.path, device="cpu", dtype="float32", num_kv_blocks=8))
    assert gc.isenabled() and gc.get_freeze_count() > 0
    assert ref() is None  # thawed and collected before the new freeze
    # Garbage made after the freeze is collected as usual.
    later = _Cycle()
    later_ref = weakref.ref(later)
    del later
    gc.collect()
    assert later_ref() is None
    assert engine.core.scheduler is not None


def test_an_engine_over_a_shared_model_freezes_only_when_asked(smollm):
    """Tests and benchmarks build engine after engine over one loaded model: by default no full
    collection (each walked the whole heap), unless asked (a benchmark's timed engine)."""
    ref = _frozen_cycle()
    engine_over(smollm)
    assert ref() is not None  # neither thawed nor collected
    LLMEngine(EngineArgs(model=smollm.path, device="cpu", dtype="float32", num_kv_blocks=8), model=smollm.model,
              tokenizer=smollm.tokenizer, device=smollm.device, dtype=smollm.dtype, freeze_heap=True)  # fmt: skip
    assert ref() is None and gc.get_freeze_count() > 0  # thawed, collected, frozen again


def test_collection_is_paused_inside_and_restored_after_an_error():
    assert gc.isenabled()
    with pytest.raises(RuntimeError):
        with cyclic_gc_paused():
            assert not gc.isenabled()
            raise RuntimeError("a load that fails")
    assert gc.isenabled()
    gc.disable()
    try:
        with cyclic_gc_paused():
            pass
        assert not gc.isenabled()  # a caller's own disable is left as it was
    finally:
        gc.enable()


def test_the_loads_cyclic_garbage_is_freed_before_the_heap_is_trimmed():
    """release_free_heap collects only the youngest generation: all a load made while collection was
    paused, its reader's cycles included."""
    from ferry.worker.cpu_allocator import release_free_heap

    with cyclic_gc_paused():
        reader = _Cycle()  # (a checkpoint reader's metadata, dropped once the weights are built)
        ref = weakref.ref(reader)
        del reader
        release_free_heap()
        assert ref() is None
