"""A service's long-lived objects kept out of the cyclic collector's full collections."""

import gc
import weakref

from rlmesh.common import heap


class Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the cyclic collector frees it


def test_long_lived_objects_leave_the_collectors_sight_and_later_garbage_is_still_freed(monkeypatch):
    monkeypatch.setattr(heap, "_service_process", False)
    built_at_start_up = Node()
    garbage_at_start_up = weakref.ref(Node())
    heap.freeze_long_lived()  # outside a service's process (here, a test's): nothing
    assert any(o is built_at_start_up for o in gc.get_objects())
    heap.mark_service_process()
    heap.freeze_long_lived()
    try:
        assert garbage_at_start_up() is None  # collected before the freeze, not kept for good
        assert not any(o is built_at_start_up for o in gc.get_objects())  # no collection walks it
        made_while_serving = weakref.ref(Node())
        gc.collect()
        assert made_while_serving() is None
        loaded_later = Node()
        heap.freeze_long_lived()  # (again, after what a service loads on first use)
        assert not any(o is loaded_later for o in gc.get_objects())
    finally:
        gc.unfreeze()
