"""Why an entry missed, for the recompile log: which check of a failed guard failed, and the sizes this call has."""
from __future__ import annotations

import re
import reprlib

import torch

_SIZE_READ = re.compile(r"[\w.\[\]'()]+?\.shape(?:\[\d+\])?")


def with_sizes(entry, reason: str, frame_args) -> str:
    """A failed guard on sizes with the sizes this call has (`x.shape[0] <= 4 (now x.shape[0] = 9)`)."""
    now = []
    for read in dict.fromkeys(_SIZE_READ.findall(reason)):
        try:
            value = entry.check(read, frame_args)
        except Exception:
            continue
        now.append(f"{read} = {tuple(value) if isinstance(value, torch.Size) else value}")
    return f"{reason} (now {', '.join(now)})" if now else reason


_TYPE_CHECK = re.compile(r"type\((\((___g\d+) := (.*)\)|.*)\) is ___K\d+")


def failed_check(entry, guard: str, frame_args) -> str:
    """Which check of a failed guard `type(S) is K and ...` (a tensor's, a container's) failed, e.g.
    `x.stride() == (1,)`, with the tensor's source in place of the guard's local: the recompile log says what
    changed rather than the whole guard."""
    parts = guard.split(" and ")
    m = _TYPE_CHECK.fullmatch(parts[0])
    if m is None:
        return guard
    local, source = (m.group(2), m.group(3)) if m.group(2) else (m.group(1), m.group(1))
    for i in range(1, len(parts) + 1):
        try:
            ok = entry.check(" and ".join(parts[:i]), frame_args)
        except Exception:   # a prefix cut inside a string or a call: say the whole guard
            return guard
        if not ok:
            check = parts[i - 1].replace(f"({local} := {source})", source).replace(local, source)
            consts = entry.fn.__globals__   # say what the constants the check compares with are
            named = [f"{k} = {reprlib.repr(consts[k])}" for k in dict.fromkeys(re.findall(r"___K\d+", check))
                     if k in consts]
            return f"{check} ({', '.join(named)})" if named else check
    return guard
