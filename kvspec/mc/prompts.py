"""The model checker's base cache-level domains: the token chunks, the default prompts
and the decode tokens. Apart from ``enumerate_ops`` so that ``cache_features`` (which
``enumerate_ops`` imports) can build on them without an import cycle."""
from __future__ import annotations


def chunks(block_size: int) -> list[tuple[int, ...]]:
    """Chunk c is the block ``(10c+1, ..., 10c+block_size)``, as in ``stateful.cache``."""
    return [tuple(10 * c + i + 1 for i in range(block_size)) for c in range(3)]


def default_prompts(block_size: int) -> tuple[tuple[int, ...], ...]:
    """Four prompts over chunks A and B, all sharing the prefix A, one with a partial tail:

        A          one full block
        A + B[:1]  a full block and a partial one (for block size 1: A B)
        A B        two full blocks
        A A        two full blocks with equal tokens behind different prefixes

    Together they give prefix hits (A after A, A B or A A after A), a hit that would
    cover a whole prompt (A after A), equal block contents whose hashes must differ
    (A A), a partial block that must not be cached, and tables of one and two blocks.
    Decoding (``default_step_tokens``) turns A + B[:1] into A B, and A into A B."""
    a, b, _ = chunks(block_size)
    out: list[tuple[int, ...]] = []
    for p in (a, a + b[:1], a + b, a + a):
        if p not in out:
            out.append(p)
    return tuple(out)


def default_step_tokens(block_size: int) -> tuple[int, ...]:
    """Decode tokens: the first two tokens of chunk B, so that decoding after ``A + B[:1]``
    (block size 2) completes the block ``A B`` also admitted as a prompt."""
    b = chunks(block_size)[1]
    return tuple(dict.fromkeys((b[0], b[min(1, len(b) - 1)])))
