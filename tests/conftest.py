"""Set-up shared by every test folder."""

from __future__ import annotations

import os

# The Triton statistics engine's kernels run on CPU tensors under Triton's interpreter (how its values
# are checked without a GPU); on a machine with a GPU, TRITON_INTERPRET=0 runs them compiled there.
os.environ.setdefault("TRITON_INTERPRET", "1")
