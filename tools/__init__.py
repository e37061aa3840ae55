"""trainrec.tools: the ``trainrec`` command line (:func:`trainrec.tools.cli.main`) and msprobe-compatible
entry points. The public interface is the command line; this package namespace exports nothing."""

from __future__ import annotations

__all__: list[str] = []
