"""Opening one side of a graph command: a trainrec run or the reference's dump directory."""

from __future__ import annotations

import json
import os
import re

from trainrec.analyzers.graph import Graph, GraphInputError, build_from_dump, build_from_run
from trainrec.analyzers.graph.from_dump import FILES
from trainrec.replay.run import open_run
from trainrec.schema.errors import NotARunError


def is_dump_dir(path: str) -> bool:
    """Whether ``path`` looks like the reference's dump (a dump directory, or step*/rank* above one)."""
    if not os.path.isdir(path):
        return False
    names = os.listdir(path)
    if any(f in names for f in FILES):
        return True
    return any(re.fullmatch(r"step\d+|rank\d*", n) and os.path.isdir(os.path.join(path, n)) for n in names)


def load_side(path: str, rank: int | None = None) -> Graph:
    """The graph of ``path`` (a dump directory or a trainrec run). Raises GraphInputError & co."""
    if not os.path.exists(path):
        raise GraphInputError(f"{path}: no such file or directory (expected a trainrec run or a dump directory "
                              f"with {', '.join(FILES)})")
    if is_dump_dir(path):
        return build_from_dump(path, rank)
    try:
        run = open_run(path)
    except NotARunError as exc:
        raise GraphInputError(f"{exc}; nor is it a dump directory ({', '.join(FILES)})") from None
    return build_from_run(run, rank)


def load_mapping_file(path: str, option: str):
    """A mapping file's content (YAML, or JSON when it ends with .json). Raises GraphInputError."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise GraphInputError(f"{option} {path}: cannot be read ({exc.strerror or exc})") from None
    if path.endswith(".json"):
        try:
            return json.loads(text)
        except ValueError as exc:
            raise GraphInputError(f"{option} {path}: not JSON ({exc})") from None
    try:
        import yaml
    except ImportError:
        raise GraphInputError(f"{option} {path}: reading YAML needs PyYAML (pip install pyyaml); "
                              f"or give the mapping as a .json file") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise GraphInputError(f"{option} {path}: not YAML ({exc})".replace("\n", " ")) from None
    if data is None:
        raise GraphInputError(f"{option} {path}: the file is empty; it names nothing to map")
    return data
