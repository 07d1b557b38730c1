"""A batch job's output file as {record id: record}, failing on any id written twice (no line may be doubled)."""

from __future__ import annotations

import json


def records(path) -> dict[str, dict]:
    out = {}
    with open(path, "rb") as f:
        for raw in f:
            r = json.loads(raw)
            assert r["id"] not in out, f"{r['id']} written twice"
            out[r["id"]] = r
    return out
