"""Writing ``.vis.db``, tb-graph-ascend's SQLite form: every compared step and rank, for its Step and
Rank dropdowns (tables ``tb_config``, ``tb_nodes``, ``tb_stack``; see docs/graphs.md)."""

from __future__ import annotations

import os
import sqlite3

from trainrec.analyzers.graph import Comparison
from trainrec.analyzers.graph.vis import DB_NODE_COLUMNS, vis_db_rows

_TYPES = {"graph_id": "INTEGER", "node_order": "INTEGER", "node_type": "INTEGER", "precision_index": "REAL",
          "micro_step_id": "INTEGER", "stack_id": "INTEGER", "modified": "INTEGER", "step": "INTEGER",
          "rank": "INTEGER", "is_distributed": "INTEGER"}


def write_vis_db(comparisons: list[tuple[int, Comparison]], path: str, overflow: bool = False) -> str:
    """Write ``path`` (replaced atomically) from ``(rank, comparison)`` pairs."""
    config, stacks, rows = vis_db_rows(comparisons, overflow)
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
