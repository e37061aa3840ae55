"""codec.decode of one 50-row stats record: this checkout's codec against another commit's (argument: the commit), side by side in one process."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
import timeit

import numpy as np
from trainrec.schema import codec
from trainrec.schema.events import TensorStatsRecorded, pack_array

base = sys.argv[1]
src = subprocess.run(["git", "show", f"{base}:schema/codec.py"], capture_output=True, text=True, check=True).stdout
path = os.path.join(tempfile.mkdtemp(), "codec_base.py")
with open(path, "w") as f:
    f.write(src.replace("from .", "from trainrec.schema."))
spec = importlib.util.spec_from_file_location("codec_base", path)
old = importlib.util.module_from_spec(spec)
spec.loader.exec_module(old)
n = 50
ev = TensorStatsRecorded(seq=5, rank=1, step=3, wall=1.0, kind="grad_reduced",
                         ops=("min", "max", "norm", "mean", "zeros", "nans"), dtype="f", name_ids=pack_array("I", list(range(n))), values=np.random.rand(n * 6).astype("f4").tobytes())
p = codec.encode(ev)
assert codec.decode(p) == old.decode(p) == ev
N = 100000
for r in range(3):
    a = min(timeit.repeat(lambda: old.decode(p), number=N, repeat=3)) / N * 1e6
    b = min(timeit.repeat(lambda: codec.decode(p), number=N, repeat=3)) / N * 1e6
    print(f"round {r}: {base}: {a:.2f} us   this: {b:.2f} us   ratio {a / b:.2f}x")
