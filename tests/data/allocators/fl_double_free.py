"""A free list without a guard on free.

BUG: free() accepts a block that is already free (a double free puts it in the free list
twice, and it is later handed out twice). Only a run with --misuse frees a free block."""


class NaiveAllocator:
    def __init__(self, num_blocks: int):
        self.free_list = list(range(num_blocks))

    def num_free(self) -> int:
        return len(self.free_list)

    def allocate(self, n: int):
        if n > len(self.free_list):
            return None
        ids, self.free_list = self.free_list[:n], self.free_list[n:]
        return ids

    def free(self, ids) -> None:
        self.free_list.extend(ids)
