"""The vocabulary the log's events are written in: statistic kinds, ops, slots, directions, the limits
that bound a record's values, and the little-endian packing of its columns."""

from __future__ import annotations

import array
import sys

# Statistic kinds (the reference's CSV prefixes, plus ours).
KIND_ACTV = "actv"
KIND_ACTV_GRAD = "actv_grad"
KIND_GRAD_UNREDUCED = "grad_unreduced"
KIND_GRAD_REDUCED = "grad_reduced"
KIND_PARAM = "param"
KIND_EXP_AVG = "exp_avg"
KIND_EXP_AVG_SQ = "exp_avg_sq"
KIND_UPDATE = "update"
KIND_RATIO = "ratio"
# momentum-gradient sign agreement ((sign(g)·sign(exp_avg)).sum() / numel + 1) / 2, a scalar per
# parameter; the reference's CSV files call it "other" (see CSV_FILE_PREFIX)
KIND_MG_DIRECTION = "mg_direction"
KINDS = (
    KIND_ACTV,
    KIND_ACTV_GRAD,
    KIND_GRAD_UNREDUCED,
    KIND_GRAD_REDUCED,
    KIND_PARAM,
    KIND_EXP_AVG,
    KIND_EXP_AVG_SQ,
    KIND_UPDATE,
    KIND_RATIO,
    KIND_MG_DIRECTION,
)
# The reference's CSV file prefix of a kind, where it is not the kind itself.
CSV_FILE_PREFIX = {KIND_MG_DIRECTION: "other"}

# Statistic ops, in the reference's vocabulary.
OPS = ("min", "max", "norm", "mean", "zeros", "nans")

# Slot codes of a stats row: which side of a module the tensor came from.
SLOT_NONE = 0
SLOT_INPUT = 1
SLOT_OUTPUT = 2
SLOT_INPUT_GRAD = 3
SLOT_OUTPUT_GRAD = 4
SLOTS = ("", "input", "output", "input_grad", "output_grad")
_SLOT_BYTES = bytes(range(len(SLOTS)))  # the valid slot bytes (deleted by translate: what is left is bad)

# Hook directions.
DIR_FORWARD = 0
DIR_BACKWARD = 1
_DIR_BYTES = bytes((DIR_FORWARD, DIR_BACKWARD))
_FLAG_BYTES = b"\x00\x01"  # the valid bytes of a per-row flag column (TensorStatsRecorded.placeholders)

# Bounds of values that size a loop or an allocation when a log is replayed: a record beyond them is
# corrupt (logs are untrusted input), whatever its CRC says.
MAX_WORLD_SIZE = 1 << 20  # ranks (and group mates, pipeline stages) per run
MAX_STEP = 1 << 53  # steps (and resume steps) are below it; -1 is "no step yet"
MAX_NAME_ID = (1 << 32) - 1  # interned name ids are u32
MAX_MICRO_STEPS = 1 << 16  # micro steps are u16

_LITTLE = sys.byteorder == "little"


def pack_array(typecode: str, values) -> bytes:
    """Pack integers or floats as a little-endian array ('I' u32, 'H' u16, 'B' u8, 'i' i32, 'f', 'd')."""
    a = array.array(typecode, values)
    if not _LITTLE:
        a.byteswap()
    return a.tobytes()


def unpack_array(typecode: str, data: bytes) -> array.array:
    a = array.array(typecode)
    a.frombytes(data)
    if not _LITTLE:
        a.byteswap()
    return a
