"""Extra keys: what besides the tokens decides a block's KV, or who may share it.

Two requests with equal tokens must not share a block when they differ in

* the LoRA adapter (its weights change every K and V): the adapter's name and path go
  into every block's hash (one name may be re-pointed at another adapter's weights);
* the ``cache_salt`` (tenant isolation): it goes into the first block's hash only,
  and the parent chain carries it to every later block;
* a multimodal input (an image's embeddings replace placeholder tokens): its content
  hash goes into the hash of every block its placeholder range overlaps.

A request's extra keys are written as a label, items joined by ``;``:
``lora:NAME`` or ``lora:NAME@PATH`` (the path is the name if left out), ``salt:S``,
``mm:HASH@OFFSET`` or ``mm:HASH@OFFSET+LENGTH`` (length 1 if left out), e.g.
``"lora:A;mm:X@2+3"``. kvspec uses the same labels.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from .errors import InvalidCountError
from .hashing import HASH_FUNCTIONS, HashFn
from .kv_cache_manager import Request


@dataclass(frozen=True)
class MMInput:
    hash: str
    offset: int
    length: int = 1


@dataclass(frozen=True)
class ExtraKeys:
    lora: Optional[str] = None        # the adapter's name
    salt: Optional[str] = None
    mm: tuple[MMInput, ...] = ()      # in offset order
    lora_path: Optional[str] = None   # where its weights come from (the name when not given)

    def block_extra_keys(self, block_index: int, block_size: int) -> Optional[tuple]:
        """The extra keys folded into the hash of logical block ``block_index``."""
        start, end = block_index * block_size, (block_index + 1) * block_size
        keys: list = []
        if self.lora is not None:
            keys.append(("lora", self.lora, self.lora_path))
        if self.salt is not None and block_index == 0:
            keys.append(("salt", self.salt))
        for m in self.mm:
            if m.offset < end and m.offset + m.length > start:
                keys.append(("mm", m.hash, m.offset))
        return tuple(keys) if keys else None


def parse_extra(label: Optional[str]) -> ExtraKeys:
    """``"lora:A@p;salt:s;mm:X@2+3"`` -> ExtraKeys; ValueError on a malformed label."""
    if not label:
        return ExtraKeys()
    lora = salt = path = None
    mm: list[MMInput] = []
    for item in label.split(";"):
        kind, _, value = item.partition(":")
        if not value:
            raise ValueError(f"bad extra key {item!r}: expected lora:NAME[@PATH], salt:S or mm:HASH@OFFSET[+LENGTH]")
        if kind == "lora":
            lora, _, path = value.partition("@")
            if not lora:
                raise ValueError(f"bad LoRA key {item!r}: expected lora:NAME[@PATH]")
            path = path or lora
        elif kind == "salt":
            salt = value
        elif kind == "mm":
            h, _, where = value.partition("@")
            off, _, length = where.partition("+")
            if not h or not off.isdigit() or (length and not length.isdigit()) or (length and int(length) < 1):
                raise ValueError(f"bad multimodal key {item!r}: expected mm:HASH@OFFSET[+LENGTH]")
            mm.append(MMInput(h, int(off), int(length) if length else 1))
        else:
            raise ValueError(f"bad extra key {item!r}: expected lora:NAME[@PATH], salt:S or mm:HASH@OFFSET[+LENGTH]")
    return ExtraKeys(lora, salt, tuple(sorted(mm, key=lambda m: m.offset)), path)


class KeyedRequest(Request):
    """A ``Request`` whose blocks each get their own extra keys (see the module doc),
    and which can carry speculative (draft) tokens at its end until they are verified:
    ``append_spec_tokens`` adds them, ``verify`` keeps the accepted ones and drops the
    rest, with their block hashes."""

    def __init__(self, request_id: str, prompt_token_ids: Sequence[int], block_size: int,
                 hash_fn: HashFn = HASH_FUNCTIONS["sha256"], extra: Optional[ExtraKeys] = None) -> None:
        self.extra = extra or ExtraKeys()
        self.num_spec_tokens = 0
        super().__init__(request_id, prompt_token_ids, block_size, hash_fn)

    @property
    def num_verified_tokens(self) -> int:
        return self.num_tokens - self.num_spec_tokens

    def append_spec_tokens(self, token_ids: Sequence[int]) -> None:
        for t in token_ids:
            self.append_output_token_ids(t)
        self.num_spec_tokens += len(token_ids)

    def verify(self, num_accepted: int) -> int:
        """Keep the first ``num_accepted`` draft tokens; returns how many were dropped."""
        if not 0 <= num_accepted <= self.num_spec_tokens:
            raise InvalidCountError(f"cannot accept {num_accepted} of {self.num_spec_tokens} draft tokens")
        dropped = self.num_spec_tokens - num_accepted
        if dropped:
            del self.output_token_ids[len(self.output_token_ids) - dropped:]
            del self.block_hashes[self.num_tokens // self.block_size:]
        self.num_spec_tokens = 0
        return dropped

    # ``Request._update_hashes`` hashes block i = len(block_hashes) with ``self.extra_keys``:
    # answering with that block's own keys keeps one hashing loop for every request.
    @property
    def extra_keys(self) -> Optional[tuple]:
        return self.extra.block_extra_keys(len(self.block_hashes), self.block_size)

    @extra_keys.setter
    def extra_keys(self, value: Optional[tuple]) -> None:
        if value is not None:
            raise ValueError("a KeyedRequest takes its extra keys as ExtraKeys (extra=...)")
