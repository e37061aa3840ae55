"""trainrec.analyzers."""
