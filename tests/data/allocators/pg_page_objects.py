"""Pages as objects that own their KV tensors: allocate_page() hands out a page (its
page_id is the block id), free_page(page) takes it back."""
import torch


class Page:
    def __init__(self, page_id: int, page_size: int, num_heads: int, head_dim: int, device: str):
        self.page_id = page_id
        self.used = 0
        self.k = torch.zeros(num_heads, page_size, head_dim, device=device)
        self.v = torch.zeros(num_heads, page_size, head_dim, device=device)


class PageCache:
    def __init__(self, num_pages, page_size, num_heads, head_dim, device):
        self.free_pages = [Page(i, page_size, num_heads, head_dim, device) for i in range(num_pages)]
        self.in_use: dict = {}

    def allocate_page(self) -> Page:
        if not self.free_pages:
            raise RuntimeError("out of pages")
        page = self.free_pages.pop()
        self.in_use[page.page_id] = page
        return page

    def free_page(self, page: Page) -> None:
        self.in_use.pop(page.page_id, None)
        page.used = 0
        self.free_pages.append(page)
