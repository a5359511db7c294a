"""A free list handed out by slicing.

BUG: allocate takes the last n free ids but deletes the first n, so the ids it hands out
stay in the free list (and are handed out again) while others vanish."""


class SimpleAllocator:
    def __init__(self, num_blocks: int):
        self.free_list = list(range(num_blocks))

    def num_free(self) -> int:
        return len(self.free_list)

    def allocate(self, n: int) -> list:
        if n > len(self.free_list):
            raise RuntimeError("out of KV blocks")
        ids = self.free_list[-n:]
        del self.free_list[:n]  # BUG: should delete the same slice it took
        return ids

    def free(self, ids: list) -> None:
        self.free_list.extend(ids)
