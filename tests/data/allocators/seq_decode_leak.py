"""Decode blocks kept apart from the prompt's.

BUG: free_sequence gives back the prompt's blocks but forgets the blocks append_token added
during decode: they are never free again (a leak)."""


class DecodeAwareAllocator:
    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.free_ids = list(range(num_blocks))
        self.prompt_blocks: dict = {}
        self.decode_blocks: dict = {}
        self.num_tokens: dict = {}

    def get_num_free_blocks(self) -> int:
        return len(self.free_ids)

    def allocate_sequence(self, seq_id, n_tokens: int):
        need = -(-n_tokens // self.block_size)
        if need > len(self.free_ids):
            return None
        self.prompt_blocks[seq_id] = [self.free_ids.pop() for _ in range(need)]
        self.decode_blocks[seq_id] = []
        self.num_tokens[seq_id] = n_tokens
        return self.prompt_blocks[seq_id]

    def append_token(self, seq_id):
        if self.num_tokens[seq_id] % self.block_size == 0:
            if not self.free_ids:
                return None
            self.decode_blocks[seq_id].append(self.free_ids.pop())
        self.num_tokens[seq_id] += 1
        return True

    def free_sequence(self, seq_id) -> None:
        self.free_ids.extend(self.prompt_blocks.pop(seq_id))
        self.decode_blocks.pop(seq_id)  # BUG: these blocks should go back to free_ids too
        del self.num_tokens[seq_id]

    def get_block_table(self, seq_id):
        return self.prompt_blocks[seq_id] + self.decode_blocks[seq_id]
