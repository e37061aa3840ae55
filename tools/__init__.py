"""trainrec.tools."""
