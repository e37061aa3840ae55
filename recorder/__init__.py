"""trainrec.recorder."""
