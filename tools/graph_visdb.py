"""Writing ``.vis.db``, tb-graph-ascend's SQLite form: compared steps and ranks, for its Step and
Rank dropdowns (tables ``tb_config``, ``tb_nodes``, ``tb_stack``; see docs/graphs.md)."""

from __future__ import annotations

import os
import sqlite3

from trainrec.analyzers.graph import Comparison
from trainrec.analyzers.graph.vis import DB_NODE_COLUMNS, vis_db_rows

from .graph_html import pick_steps

_TYPES = {"graph_id": "INTEGER", "node_order": "INTEGER", "node_type": "INTEGER", "precision_index": "REAL",
          "micro_step_id": "INTEGER", "stack_id": "INTEGER", "modified": "INTEGER", "step": "INTEGER",
          "rank": "INTEGER", "is_distributed": "INTEGER"}


def write_vis_db(comparisons: list[tuple[int, Comparison]], path: str, overflow: bool = False,
                 max_steps: int = 20) -> str:
    """Write ``path`` (replaced atomically) from ``(rank, comparison)`` pairs, with at most ``max_steps``
    compared steps of each (the first, the last, the first divergent one and steps spread between)."""
    chosen = []
    for rank, cmp in comparisons:
        first = [i for i, (d, _) in enumerate(cmp.steps) if cmp.first and d == cmp.first["step"]]
        chosen.append((rank, cmp, pick_steps(len(cmp.steps), first, max_steps)))
    config, stacks, rows = vis_db_rows(chosen, overflow)
    tmp = path + ".tmp"
    if os.path.exists(tmp):
        os.remove(tmp)
    conn = sqlite3.connect(tmp)
    try:
        with conn:
            conn.execute("CREATE TABLE tb_config (id INTEGER PRIMARY KEY, graph_type TEXT, task TEXT, tool_tip TEXT, "
                         "micro_steps INTEGER, overflow_check INTEGER, node_colors TEXT, rank_list TEXT, step_list TEXT)")
            conn.execute("INSERT INTO tb_config VALUES (1, ?, ?, ?, ?, ?, ?, ?, ?)",
                         [config[k] for k in ("graph_type", "task", "tool_tip", "micro_steps", "overflow_check",
                                              "node_colors", "rank_list", "step_list")])
            cols = ", ".join(f"{c} {_TYPES.get(c, 'TEXT')}" for c in DB_NODE_COLUMNS)
            conn.execute(f"CREATE TABLE tb_nodes (id INTEGER PRIMARY KEY AUTOINCREMENT, {cols})")
            conn.executemany(f"INSERT INTO tb_nodes ({', '.join(DB_NODE_COLUMNS)}) VALUES "
                             f"({', '.join('?' * len(DB_NODE_COLUMNS))})", rows)
            conn.execute("CREATE INDEX tb_nodes_lookup ON tb_nodes (step, rank, data_source, node_name)")
            conn.execute("CREATE INDEX tb_nodes_parent ON tb_nodes (step, rank, data_source, up_node)")
            conn.execute("CREATE TABLE tb_stack (id INTEGER PRIMARY KEY, stack_info TEXT)")
            conn.executemany("INSERT INTO tb_stack VALUES (?, ?)", list(enumerate(stacks)))
    finally:
        conn.close()
    os.replace(tmp, path)
    return path
