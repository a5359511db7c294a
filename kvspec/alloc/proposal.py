"""The declaration kvspec proposes where it cannot infer a class's API: built from the
methods the class has, by the words in their names and the parameters they take, as a
``[tool.kvspec.alloc]`` table (``kvspec.alloc.shapes.declared`` reads it back), or a
``[tool.kvspec.names]`` table where the class takes nano-vllm Sequences. Printed on stderr
before the one-line refusal, so that the second run works after one paste."""
from __future__ import annotations

import inspect
from typing import Optional

from kvspec.alloc.shapes import FREE_LIST, SEQUENCE, one_id, required

# role -> words that name it (checked against the method name split at "_")
_WORDS: dict[str, tuple[str, ...]] = {
    "allocate": ("alloc", "allocate", "take", "acquire", "grab", "reserve", "claim", "get", "new", "borrow", "lease",
                 "obtain", "request", "checkout"),
    "free": ("free", "release", "put", "return", "give", "dealloc", "deallocate", "recycle", "drop", "unreserve",
             "reclaim", "checkin", "retire", "relinquish"),
    "append_token": ("append", "extend", "grow", "step", "decode", "push", "advance", "add"),
    "block_table": ("table", "blocks", "pages", "mapping", "lookup"),
    "num_free": ("free", "available", "remaining", "left", "spare", "count", "num", "idle"),
    "can_allocate": ("can", "fits", "has", "enough"),
}
_SEQ_PARAMS = ("seq", "sequence")
_SEQ_ID_PARAMS = ("seq_id", "sid", "request_id", "req_id", "rid", "sequence_id", "owner", "key", "handle", "uid")


def _methods(cls: type) -> dict[str, list[inspect.Parameter]]:
    out = {}
    for name in dir(cls):
        if name.startswith("_") or name.startswith("kvspec"):
            continue
        req = required(cls, name)
        if req is not None:
            out[name] = req
    return out


def _score(name: str, role: str) -> int:
    """How many of the name's words speak of ``role``."""
    return sum(any(w.startswith(x) for x in _WORDS[role]) for w in name.lower().split("_") if w)


def _pick(methods: dict, role: str, nargs: tuple[int, ...], taken: set, first: Optional[tuple] = None) -> Optional[str]:
    best = [(_score(n, role), n) for n, req in methods.items() if n not in taken and len(req) in nargs
            and (first is None or (req and req[0].name in first))]
    best = [b for b in best if b[0] > 0]
    return max(best)[1] if best else None


_CAN = ("can", "has", "fits", "check", "is")


def _propose_nano(methods: dict) -> Optional[list[str]]:
    """A ``[tool.kvspec.names]`` table for a manager that takes nano-vllm Sequences under
    other names: can_allocate / allocate / deallocate / can_append / may_append."""
    takes_seq = {n: req for n, req in methods.items() if req and req[0].name in _SEQ_PARAMS}
    def can(n: str) -> bool:
        return n.lower().split("_")[0] in _CAN
    picks: dict[str, Optional[str]] = {}
    taken: set = set()
    # (role, words, a can_/has_ question?, taken without a word: the one question left over)
    for role, words, want_can, fallback in (("can_append", _WORDS["append_token"], True, False),
                                            ("can_allocate", _WORDS["allocate"] + ("admit", "assign"), True, True),
                                            ("may_append", _WORDS["append_token"], False, False),
                                            ("allocate", _WORDS["allocate"] + ("admit", "assign"), False, False),
                                            ("deallocate", _WORDS["free"] + ("evict", "finish", "remove"), False,
                                             False)):
        best = [(sum(any(w.startswith(x) for x in words) for w in n.lower().split("_")) + (0.5 if fallback else 0), n)
                for n in takes_seq if n not in taken and can(n) == want_can]
        best = [b for b in best if b[0] > 0]
        picks[role] = max(best)[1] if best else None
        taken.add(picks[role])
    if not (picks["can_allocate"] and picks["allocate"] and picks["deallocate"]):
        return None
    lines = ["[tool.kvspec.names]"]
    order = ("can_allocate", "allocate", "deallocate", "can_append", "may_append")
    lines += [f'{role} = "{picks[role]}"  # called as {picks[role]}(seq)' for role in order if picks.get(role)]
    return lines


def propose(cls: type) -> Optional[list[str]]:
    """The TOML lines of a declaration for ``cls``, or None where nothing fits at all."""
    methods = _methods(cls)
    if any(req and req[0].name in _SEQ_PARAMS for req in methods.values()):
        return _propose_nano(methods)
    seq_keyed = any(req and req[0].name in _SEQ_ID_PARAMS for req in methods.values())
    lines = ["[tool.kvspec.alloc]"]
    taken: set = set()
    if seq_keyed:
        alloc = _pick(methods, "allocate", (2,), taken, _SEQ_ID_PARAMS)
        taken.add(alloc)
        append = _pick(methods, "append_token", (1,), taken, _SEQ_ID_PARAMS)
        taken.add(append)
        free = _pick(methods, "free", (1,), taken, _SEQ_ID_PARAMS)
        taken.add(free)
        table = _pick(methods, "block_table", (1,), taken, _SEQ_ID_PARAMS)
        taken.add(table)
        if not (alloc and append and free):
            return None
        lines += [f'shape = "{SEQUENCE}"', f'allocate_sequence = "{alloc}"  # called as {alloc}(seq_id, n_tokens)',
                  f'append_token = "{append}"  # called as {append}(seq_id) for each decode token',
                  f'free_sequence = "{free}"  # called as {free}(seq_id)']
        if table:
            lines.append(f'block_table = "{table}"  # called as {table}(seq_id) -> block ids')
        else:
            lines.append('block_table = "<a method(seq_id) -> block ids, or a dict attribute seq_id -> block ids>"')
    else:
        alloc = _pick(methods, "allocate", (1,), taken) or _pick(methods, "allocate", (0,), taken)
        taken.add(alloc)
        free = _pick(methods, "free", (1,), taken)
        taken.add(free)
        if not (alloc and free):
            return None
        per_alloc = not methods[alloc]
        lines += [f'shape = "{FREE_LIST}"',
                  f'allocate = "{alloc}"  # called as ' + (f"{alloc}() once per block" if per_alloc
                                                          else f"{alloc}(n) -> n block ids")]
        if per_alloc:
            lines.append("allocate_per_id = true")
        per_free = one_id(methods[free][0])
        lines.append(f'free = "{free}"  # called as ' + (f"{free}(block_id) per block" if per_free
                                                        else f"{free}(block_ids)"))
        lines.append(f"free_per_id = {'true' if per_free else 'false'}")
    count = _pick(methods, "num_free", (0,), taken)
    if count:
        lines.append(f'num_free = "{count}"  # the free count it reports')
    return lines
