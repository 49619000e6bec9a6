"""The cyclic garbage collector around start-up (ferry/utils/process.py): paused while a model loads,
and the heap alive after an engine is built frozen out of its reach; later garbage is still collected."""

from __future__ import annotations

import gc
import weakref

import pytest

from ferry.utils.process import cyclic_gc_paused


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_building_an_engine_freezes_the_heap_and_reclaims_dropped_cycles(make_engine):
    gc.unfreeze()
    dropped = _Cycle()
    ref = weakref.ref(dropped)
    gc.freeze()  # as if an earlier engine's build had frozen it while it was alive
    del dropped
    gc.collect()
    assert ref() is not None  # frozen: out of the collector's reach

    engine = make_engine()
    assert gc.isenabled() and gc.get_freeze_count() > 0
    assert ref() is None  # thawed and collected before the new freeze
    # Garbage made after the freeze is collected as usual.
    later = _Cycle()
    later_ref = weakref.ref(later)
    del later
    gc.collect()
    assert later_ref() is None
    assert engine.core.scheduler is not None


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
