"""trainrec.analyzers: pure consumers of event streams (anomaly rankings, exports, comparisons).

Import the modules themselves (``trainrec.analyzers.export_csv``, ``.export_tb``, ``.anomalies``,
``.ranking``, ...); each declares its public names in its own ``__all__``. This package namespace
exports nothing, so that importing one analyzer does not load the others.
"""

from __future__ import annotations

__all__: list[str] = []
