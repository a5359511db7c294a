"""The model checker's small domains for the cache features (issue 11): Admit variants
(chunk, extra keys, connector tokens), draft tokens, Prefill counts, the longer prompt
a sliding window needs, and how ``Bounds.widened`` takes a repro's own arguments in.

``kvspec.mc.enumerate_ops.enabled_cache_ops`` uses these where the model has the features
(see its module doc); they live apart to keep that module small.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional, Sequence

from kvspec.spec.config import Config
from kvspec.mc.prompts import chunks, default_prompts
from kvspec.spec.ops import Admit, Op, Prefill, Step, Verify


def feature_prompts(block_size: int) -> tuple[tuple[int, ...], ...]:
    """``default_prompts`` and ``A B C``: three blocks, so that at block size 2 a window of
    4 tokens leaves a block behind within one request (window freeing, connector tokens
    behind the window, a hit one group cannot take)."""
    a, b, c = chunks(block_size)
    return default_prompts(block_size) + (a + b + c,)


def default_drafts(block_size: int) -> tuple[tuple[int, ...], ...]:
    """Draft tokens of a Step: one, and a block's worth (at least two; chunk B's tokens, as
    the decode tokens, then C's): enough to fill a block and to need a slot past the table."""
    _, b, c = chunks(block_size)
    return tuple(dict.fromkeys(((b[0],), (b + c)[:max(2, block_size)])))


def default_admit_options(block_size: int) -> tuple[tuple[Optional[int], Optional[str], int], ...]:
    """Admit variants ``(chunk, extra, external)`` besides the plain one, one feature at a
    time: chunks of one token (a block left partly computed) and of one block (then
    Prefill), two extra keys (``lora:A``, ``salt:s``: with the plain one, three requests of
    equal tokens that must not share a block), and one block of connector tokens."""
    sizes = tuple(dict.fromkeys((1, block_size)))
    return tuple((c, None, 0) for c in sizes) + ((None, "lora:A", 0), (None, "salt:s", 0), (None, None, block_size))


def per_request(opts: Sequence, default: bool, n: int, block_size: int) -> Sequence:
    """``opts``, and under the default options (``default``) also connectors that supply
    more than the default's one block of the ``n`` tokens: each further whole number of
    blocks, and all but the last token. (A window's edge falls on one of them for windows
    of whole blocks: ``full,swa:4`` at block size 2 frees one block too early after 4.)"""
    if not (default and opts):
        return opts
    have = {x for _, _, x in opts}
    more = [k * block_size for k in range(2, n) if k * block_size < n - 1] + [n - 1]
    return tuple(opts) + tuple((None, None, x) for x in dict.fromkeys(more) if x > 0 and x not in have)


def useful(chunk: Optional[int], external: int, n: int) -> bool:
    """An Admit variant that differs from the plain one for an ``n``-token request: a chunk
    shorter than it, or connector tokens (at most all but the last token are used)."""
    return (chunk is not None and chunk < n) or (external > 0 and n > 1)


def widened_features(b, steps: Sequence[Op], config: Config):
    """Bounds ``b`` with every Admit variant, draft tuple and Prefill count of ``steps``
    added, and the features on if ``steps`` uses any of them."""
    if config.level != "cache":
        return b
    bs = config.block_size
    opts = list(b.admit_options if b.admit_options is not None else default_admit_options(bs))
    drafts = list(b.drafts if b.drafts is not None else default_drafts(bs))
    prefills = list(b.prefills if b.prefills is not None else (bs,))
    used = False
    for op in steps:
        if isinstance(op, Admit):
            o = (op.chunk, op.extra if op.prompt is not None else None, op.external)
            used = used or o != (None, None, 0)
            if o != (None, None, 0) and o not in opts:
                opts.append(o)
        elif isinstance(op, Step) and op.drafts:
            used = True
            if op.drafts not in drafts:
                drafts.append(op.drafts)
        elif isinstance(op, (Prefill, Verify)):
            used = True
            if isinstance(op, Prefill) and op.n not in prefills:
                prefills.append(op.n)
    return replace(b, admit_options=tuple(opts), drafts=tuple(drafts), prefills=tuple(prefills),
                   features=True if used else b.features)
