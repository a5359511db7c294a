"""A free list whose names kvspec does not know: grab(count) / put_back(pages) / spare()."""


class Slab:
    def __init__(self, num_blocks: int):
        self.pages = list(range(num_blocks))

    def spare(self) -> int:
        return len(self.pages)

    def grab(self, count: int) -> list:
        if count > len(self.pages):
            raise MemoryError("slab exhausted")
        taken, self.pages = self.pages[:count], self.pages[count:]
        return taken

    def put_back(self, pages: list) -> None:
        self.pages.extend(pages)
