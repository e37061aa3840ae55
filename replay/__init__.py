"""trainrec.replay."""
