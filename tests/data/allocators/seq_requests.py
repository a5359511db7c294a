"""Request-keyed, with a block_tables dict and a free-count property."""
from collections import deque


class PagedKVAllocator:
    def __init__(self, num_blocks: int, page_size: int = 16):
        self.page_size = page_size
        self.block_size = page_size
        self._free = deque(range(num_blocks))
        self.block_tables: dict = {}
        self._tokens: dict = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def can_allocate(self, num_tokens: int) -> bool:
        return -(-num_tokens // self.page_size) <= len(self._free)

    def add_request(self, request_id, num_tokens: int) -> None:
        pages = -(-num_tokens // self.page_size)
        self.block_tables[request_id] = [self._free.popleft() for _ in range(pages)]
        self._tokens[request_id] = num_tokens

    def append_slot(self, request_id) -> None:
        t = self._tokens[request_id]
        if t % self.page_size == 0:
            if not self._free:
                raise MemoryError("no free page for the next token")
            self.block_tables[request_id].append(self._free.popleft())
        self._tokens[request_id] = t + 1

    def free_request(self, request_id) -> None:
        for b in reversed(self.block_tables.pop(request_id)):
            self._free.append(b)
        del self._tokens[request_id]
