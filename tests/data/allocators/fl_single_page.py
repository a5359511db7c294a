"""One page at a time: alloc() -> page id or None, release(page_id), an `available` property."""
import heapq


class PagePool:
    def __init__(self, num_pages: int):
        self._heap = list(range(num_pages))
        self._used = set()

    @property
    def available(self) -> int:
        return len(self._heap)

    def alloc(self):
        if not self._heap:
            return None
        p = heapq.heappop(self._heap)
        self._used.add(p)
        return p

    def release(self, page_id: int) -> None:
        if page_id not in self._used:
            raise KeyError(page_id)
        self._used.remove(page_id)
        heapq.heappush(self._heap, page_id)
