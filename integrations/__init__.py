"""trainrec.integrations: one-line hookups for the trainers people already use.

* :mod:`.transformers`: ``TrainrecCallback`` for Hugging Face's ``Trainer``;
* :mod:`.lightning`: ``TrainrecCallback`` for Lightning's ``Trainer`` (``lightning`` or ``pytorch_lightning``);
* :mod:`.accelerate`: ``record_accelerated`` for a plain accelerate loop.

Each is imported on its own; importing trainrec (or this package) imports none of those libraries.
"""

from __future__ import annotations

__all__: list[str] = []
