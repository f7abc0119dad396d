"""Floor lines: each benchmark prints its floors as one tagged JSON line, ``run_all`` collects them.

    floor("S0", "publish_many vs publish_async", 0.93, ">= 0.9x", met=True)

prints ``@floor {"id": "S0", ...}``; ``run_all.py`` reads those lines from every script's
output and prints one table of all floors at the end.
"""

from __future__ import annotations

import json

TAG = "@floor "


def floor(
    fid: str, what: str, value: str, target: str, *, met: bool | None, note: str = ""
) -> None:
    """Print one floor's figure (``value`` as shown, e.g. "0.93x") for ``run_all.py``."""
    line = {"id": fid, "what": what, "value": value, "target": target, "met": met, "note": note}
    print(TAG + json.dumps(line), flush=True)


def parse(line: str) -> dict[str, object] | None:
    """The floor in one output line, or None when the line is not one."""
    if not line.startswith(TAG):
        return None
    try:
        loaded = json.loads(line[len(TAG) :])
    except ValueError:
        return None
    return loaded if isinstance(loaded, dict) else None
