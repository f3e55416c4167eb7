"""A small thread-safe LRU map: the loaded plug-ins, memory profiles and neighbour-map queries of a studio."""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Hashable

PLUGIN_CACHE = 8  # loaded plug-ins kept (loading reads safetensors and, for kNN, the memory's keys)


class LRU:
    """At most ``size`` entries; ``get`` makes an entry the newest, ``put`` drops the oldest beyond ``size``."""

    def __init__(self, size: int):
        self.size = int(size)
        self._items: OrderedDict[Hashable, Any] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Hashable, default: Any = None) -> Any:
        with self._lock:
            if key not in self._items:
                return default
            self._items.move_to_end(key)
            return self._items[key]

    def peek(self, key: Hashable, default: Any = None) -> Any:
        """The entry without making it the newest."""
        with self._lock:
            return self._items.get(key, default)

    def put(self, key: Hashable, value: Any) -> Any:
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > self.size:
                self._items.popitem(last=False)
        return value

    def pop(self, key: Hashable) -> Any:
        with self._lock:
            return self._items.pop(key, None)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()

    def __contains__(self, key: Hashable) -> bool:
        with self._lock:
            return key in self._items

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)
