"""Write the golden logs of format version 1 and their expected decoded content.

Usage (from the repository root)::

    .venv/bin/python tests/golden/make_golden.py               # writes only the scenarios that are missing
    .venv/bin/python tests/golden/make_golden.py --regenerate  # overwrites: a deliberate format decision

Golden logs freeze the on-disk format: once committed they are never regenerated silently, and every
later trainrec must still replay them (``tests/test_golden.py`` does, on every test run). A format
change that breaks them needs a new format version (a new ``v2/`` folder here) and a read-time upgrade,
not a regeneration.

Each scenario is one log file ``v1/<name>.trl`` and one ``v1/<name>.json`` beside it holding what a
reader must get back: the events (every field, bytes as hex, non-finite floats spelled out), the
damage it must report (byte offset and bytes skipped), sequence gaps, torn-tail bytes and whether
the file closed cleanly, or the error it must raise. The expected content is computed from the events
this script encodes and the bytes it damages, never by decoding the file.

All scenarios but one are built byte by byte with ``trainrec.schema.framing`` and ``codec`` (fixed
wall times, run id, host and pid: fully deterministic; records from other writer versions are packed
with msgpack directly, as such a writer would). The ``logwriter`` scenario goes through the real
:class:`LogWriter`; the fields it stamps itself (host, pid, times, versions) are listed under
``masked`` in its expected file and ignored by the comparison.

The scenarios are in ``golden_records.py`` (intact records) and ``golden_damage.py`` (damaged and cut
files), built with ``golden_builder.py``, beside this script; this script lists them, writes them and
computes their expected JSON form.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import sys
from collections.abc import Callable

from golden_builder import Built
from golden_damage import (
    flipped_header_bit,
    flipped_payload_bit,
    future_version,
    header_only,
    not_a_log,
    reliability,
    torn_header,
    torn_tail,
)
from golden_records import (
    api_calls,
    api_calls_backward,
    compat,
    every_event,
    flight,
    logwriter,
    placeholders,
    step_index,
)
from trainrec.schema import framing
from trainrec.schema.events import Event, FileClosed

HERE = os.path.dirname(os.path.abspath(__file__))
VERSION_DIR = os.path.join(HERE, "v1")
MASK = "<masked>"


# ---------------------------------------------------------------------------------------------- JSON form
def value_to_json(v):
    """A decoded field value as JSON: bytes as {"hex": ...}, non-finite floats as {"float": "nan"}."""
    if isinstance(v, bool) or v is None or isinstance(v, (int, str)):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else {"float": repr(v)}
    if isinstance(v, (bytes, bytearray, memoryview)):
        return {"hex": bytes(v).hex()}
    if isinstance(v, (tuple, list)):
        return [value_to_json(x) for x in v]
    if isinstance(v, dict):
        return {"map": [[value_to_json(k), value_to_json(x)] for k, x in v.items()]}
    raise TypeError(f"no JSON form for {type(v).__name__}")


def event_to_json(ev: Event) -> dict:
    """``{"type": class name, "fields": {every field, envelope first}}``."""
    fields = {f.name: value_to_json(getattr(ev, f.name)) for f in dataclasses.fields(ev)}
    return {"type": type(ev).__name__, "fields": fields}


SCENARIOS: dict[str, Callable[[], Built]] = {
    "every_event": every_event,
    "compat": compat,
    "torn_tail": torn_tail,
    "torn_header": torn_header,
    "flipped_payload_bit": flipped_payload_bit,
    "flipped_header_bit": flipped_header_bit,
    "header_only": header_only,
    "future_version": future_version,
    "not_a_log": not_a_log,
    "logwriter": logwriter,
    "placeholders": placeholders,
    "flight": flight,
    "reliability": reliability,
    "api_calls": api_calls,
    "api_calls_backward": api_calls_backward,
    "step_index": step_index,
}


def apply_mask(event_json: dict, masked: dict) -> dict:
    """``event_json`` with the fields listed for its type in ``masked`` replaced by MASK."""
    names = masked.get(event_json["type"], ())
    if not names:
        return event_json
    fields = {k: (MASK if k in names else v) for k, v in event_json["fields"].items()}
    return {"type": event_json["type"], "fields": fields}


def expected_json(name: str, b: Built) -> dict:
    doc = {
        "scenario": name,
        "description": " ".join(SCENARIOS[name].__doc__.split()),
        "log": f"{name}.trl",
        "format_version": framing.FORMAT_VERSION,
    }
    if b.error:
        doc["error"] = b.error
        return doc
    doc.update(
        {
            "events": [apply_mask(event_to_json(e), b.masked) for e in b.events],
            "problems": b.problems,
            "gaps": b.gaps,
            "pending_bytes": b.pending_bytes,
            "closed_cleanly": any(isinstance(e, FileClosed) for e in b.events),
            "masked": b.masked,
        }
    )
    return doc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--regenerate", action="store_true",
                        help="overwrite existing golden files (a deliberate format decision, never routine)")
    parser.add_argument("--out", default=VERSION_DIR, help="folder to write into (default: %(default)s)")
    parser.add_argument("scenarios", nargs="*", help=f"scenarios to write (default: all of {', '.join(SCENARIOS)})")
    args = parser.parse_args(argv)
    unknown = [s for s in args.scenarios if s not in SCENARIOS]
    if unknown:
        parser.error(f"unknown scenario(s) {unknown}")
    os.makedirs(args.out, exist_ok=True)
    refused = []
    for name in args.scenarios or SCENARIOS:
        paths = [os.path.join(args.out, f"{name}{ext}") for ext in (".trl", ".json")]
        if not args.regenerate and any(os.path.exists(p) for p in paths):
            refused.append(name)
            continue
        built = SCENARIOS[name]()
        tmp = paths[0] + ".tmp"
        with open(tmp, "wb") as f:
            f.write(built.data)
        shutil.move(tmp, paths[0])
        with open(paths[1], "w", encoding="utf-8") as f:
            json.dump(expected_json(name, built), f, indent=1, sort_keys=False)
            f.write("\n")
        print(f"wrote {paths[0]} ({len(built.data)} bytes) and {os.path.basename(paths[1])}")
    if refused:
        print(
            f"not overwritten (golden logs are frozen; pass --regenerate only for a deliberate format "
            f"decision): {', '.join(refused)}",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
