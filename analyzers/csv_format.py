"""Vectorised number formatting for the CSV export: the text pandas writes, without a Python call per value.

Every number is printed as the reference prints it: ``repr`` of numpy's ``round(v, ndigits)``
(docs/exports.md). The text is built from integer digits with numpy; tiny values come from a table
of precomputed ``repr`` strings, and anything else (NaN, infinities, huge values, more than 18
decimals) falls back to ``repr``. A float32 value is first taken as its shortest decimal
(:func:`float32_as_decimal`). :func:`value_chars` gives a byte matrix and mask per value, which
:func:`render_rows` joins with the row prefixes into the CSV body. The tests compare the result with
``repr`` and pandas.
"""

from __future__ import annotations

import numpy as np

__all__ = ["float32_as_decimal", "prefix_block", "render_frames", "render_rows", "round_like_reference",
           "value_chars"]

_FALLBACK_WIDTH = 24  # longest repr of a double: '-1.2345678901234567e-100'
_TINY_TABLE_MAX_DIGITS = 9
_tiny_tables: dict[int, np.ndarray] = {}
_POW10 = [10**i for i in range(20)]
_SIMPLE_MAX_DIGITS = 18  # the integer path's k / 10**d needs 10**d in an int64
_ROUND_NAN_FROM = 309  # 10.0**d overflows: numpy's round gives nan for every value from here on


def round_like_reference(values: np.ndarray, ndigits: int) -> np.ndarray:
    """``pd.DataFrame(values).round(ndigits)`` as float64: numpy's ``round`` of any ``ndigits >= 0``
    (above 308 all of them give nan, so they are computed as 309: a C long need not hold them)."""
    d = int(ndigits)
    if d < 0:
        raise ValueError(f"ndigits must be >= 0, not {d}")
    with np.errstate(over="ignore", invalid="ignore"):
        return np.round(values.astype(np.float64, copy=False), min(d, _ROUND_NAN_FROM))


_F32_MAX_SEARCH = 22  # powers of ten used in the search stay exact doubles (10**22 is the last)
_F32_MAX_DECIMAL = 1e22  # larger values keep their exact doubles
# 10**0..10**23: exact to 10**22; 10**23 serves the one pass past it (float32(1e22) reads back as 1e22,
# and no multiple of 10**23 below 1e22 but 0 does, so the search ends there)
_POW10_F = np.array([10.0**i for i in range(_F32_MAX_SEARCH + 2)])
_E2_OFFSET = 160  # frexp exponents of float32 values, -148..128, as table indices
_Q_START = np.array([int(np.ceil(-(e2 - 25) * np.log10(2.0))) for e2 in range(-_E2_OFFSET, 160)])


def float32_as_decimal(values: np.ndarray, ndigits: int) -> np.ndarray:
    """``values`` as float64; a float32 array's values replaced by the shortest decimal that reads back
    to each, where that decimal has at most ``ndigits`` fraction digits (at most 22, value below 1e22).

    Vectorised: the search goes down from 9 significant digits (or ``ndigits``), over only the values
    that ``ndigits`` decimals resolve finer than float32 does."""
    x = values.astype(np.float64)
    if values.dtype != np.float32 or not x.size:
        return x
    flat32 = values.reshape(-1)
    flat = x.reshape(-1)
    d = min(int(ndigits), _F32_MAX_SEARCH)
    # the smallest power of two whose float32 spacing exceeds 10**-d
    lowest = 2.0 ** (np.floor(np.log2(10.0**-d * 2.0**23)) + 1)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        a = np.abs(flat)
        cand = np.flatnonzero((a >= lowest) & (a < _F32_MAX_DECIMAL))
        if not len(cand):
            return x
        v, v32 = flat[cand], flat32[cand]
        # start where a decimal step is at most half of float32's spacing there (reads back for sure):
        # q = ceil(-log10(2**(e2 - 25))) for v = m * 2**e2, 0.5 <= m < 1; then one digit less a pass
        q = np.minimum(d, _Q_START[np.frexp(v32)[1] + _E2_OFFSET])
        while len(cand):  # each pass keeps the values whose decimal of q fraction digits reads back
            p = _POW10_F[np.abs(q)]  # exact powers of ten (10**22 the last)
            if q.min() >= 0:
                r = np.rint(v * p) / p
            else:
                r = np.where(q >= 0, np.rint(v * p) / p, np.rint(v / p) * p)
            ok = r.astype(np.float32) == v32  # (0 or a power of ten too many never reads back)
            cand, v, v32, q = cand[ok], v[ok], v32[ok], q[ok] - 1
            flat[cand] = r[ok]  # a shorter one in a later pass overwrites it
    return x


def _tiny_table(d: int) -> np.ndarray:
    """``repr(k / 10**d)`` for 0 <= k < 10**(d-4), then ``repr(-k / 10**d)``, as fixed-width bytes."""
    t = _tiny_tables.get(d)
    if t is None:
        n = _POW10[d - 4] if d > 4 else 1
        pos = [repr(k / _POW10[d]).encode() for k in range(n)]
        t = np.array(pos + [b"-" + p for p in pos], dtype=f"S{_FALLBACK_WIDTH}")
        _tiny_tables[d] = t
    return t


_DIGITS4 = np.frombuffer(b"".join(f"{i:04d}".encode() for i in range(10000)), dtype=np.uint32)
_TZ4 = np.array([4 if i == 0 else len(f"{i:04d}") - len(f"{i:04d}".rstrip("0")) for i in range(10000)], np.int64)
_INT_GROUPS = 5  # 20 integer digits, more than the 16 a simple value can have


def value_chars(values: np.ndarray, ndigits: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Text of every value (flattened, row-major): ``(chars uint8 (m, W), mask bool (m, W))``."""
    flat = np.ascontiguousarray(values).reshape(-1)
    if ndigits is None:
        # Shortest text that reads back to the stored value (float32 stays float32-short).
        text = flat.astype(str).astype(f"S{_FALLBACK_WIDTH + 8}")
        chars = text.view(np.uint8).reshape(len(flat), -1)
        return chars, chars != 0
    d = int(ndigits)
    x = round_like_reference(float32_as_decimal(flat, d), d)
    m = len(x)
    if d > _SIMPLE_MAX_DIGITS:
        text = np.array([repr(v).encode() for v in x.tolist()], dtype=f"S{_FALLBACK_WIDTH}")
        chars = text.view(np.uint8).reshape(m, _FALLBACK_WIDTH)
        return chars, chars != 0
    groups = -(-d // 4) if d else 1
    # byte layout, in 4-byte words: [sign][20 integer digits][.][4*groups fraction digits]
    width = 4 * (1 + _INT_GROUPS + 1 + groups)
    words = np.zeros((m, width // 4), dtype=np.uint32)
    mask = np.zeros((m, width), dtype=bool)
    if m == 0:
        return words.view(np.uint8), mask
    ax = np.abs(x)
    with np.errstate(invalid="ignore", over="ignore"):
        scaled = np.rint(ax * float(_POW10[d]))
        simple = np.isfinite(x) & ((ax == 0) | ((ax >= 1e-4) & (ax < 1e16))) & (scaled < 2.0**50)
    neg = np.signbit(x)
    k = np.where(simple, scaled, 0).astype(np.int64)
    ip, fp = np.divmod(k, _POW10[d])
    # sign
    words[:, 0] = ord("-")
    mask[:, 0] = neg
    # integer digits, least significant group last; only as many groups as the largest value needs
    top = int(ip.max())
    n_int = len(str(top))
    rem = ip
    for g in range(_INT_GROUPS - 1, _INT_GROUPS - 1 - -(-n_int // 4), -1):
        rem, grp = np.divmod(rem, 10000)
        words[:, 1 + g] = _DIGITS4[grp]
    last = 4 + 4 * _INT_GROUPS - 1  # the units digit, always shown
    mask[:, last] = True
    for j in range(1, n_int):  # the digit for 10**j is shown when the value has one
        mask[:, last - j] = ip >= _POW10[j]
    dot = 4 * (1 + _INT_GROUPS)
    words[:, dot // 4] = ord(".")
    mask[:, dot] = True
    # fraction digits, padded on the right to whole groups; keep them up to the last non-zero one
    if d == 0:
        words[:, dot // 4 + 1] = _DIGITS4[0]
        mask[:, dot + 4] = True
    else:
        fpp = fp * _POW10[4 * groups - d]
        tz = np.zeros(m, dtype=np.int64)
        done = np.zeros(m, dtype=bool)
        rem = fpp
        for g in range(groups - 1, -1, -1):
            rem, grp = np.divmod(rem, 10000)
            words[:, dot // 4 + 1 + g] = _DIGITS4[grp]
            t = _TZ4[grp]
            tz += np.where(done, 0, t)
            done |= t < 4
        keep = np.maximum(1, 4 * groups - tz)
        mask[:, dot + 4] = True
        for j in range(1, min(d, 4 * groups)):
            mask[:, dot + 4 + j] = keep > j
    chars = words.view(np.uint8).reshape(m, width)
    # ---- the rest: tiny values from a table, everything else through repr
    rest = np.flatnonzero(~simple)
    if len(rest):
        out = np.zeros(len(rest), dtype=f"S{_FALLBACK_WIDTH}")
        xr = x[rest]
        axr = ax[rest]
        if 4 < d <= _TINY_TABLE_MAX_DIGITS:
            with np.errstate(invalid="ignore"):
                tiny = np.isfinite(xr) & (axr > 0) & (axr < 1e-4)
            if tiny.any():
                table = _tiny_table(d)
                kt = scaled[rest][tiny].astype(np.int64) + neg[rest][tiny] * (len(table) // 2)
                out[tiny] = table[kt]
            other = np.flatnonzero(~tiny)
        else:
            other = np.arange(len(rest))
        if len(other):
            out[other] = [repr(v).encode() for v in xr[other].tolist()]
        rc = out.view(np.uint8).reshape(len(rest), _FALLBACK_WIDTH)
        chars[rest] = 0
        chars[rest, :_FALLBACK_WIDTH] = rc
        mask[rest] = False
        mask[rest, :_FALLBACK_WIDTH] = rc != 0
    return chars, mask


def prefix_block(prefixes: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Row prefixes (``"0,embed.weight,"``) as a UTF-8 byte matrix and mask, for :func:`render_rows`."""
    enc = [p.encode("utf-8") for p in prefixes]
    width = max((len(e) for e in enc), default=0)
    if width == 0:
        return np.zeros((len(enc), 0), np.uint8), np.zeros((len(enc), 0), bool)
    arr = np.array(enc, dtype=f"S{width}")
    chars = arr.view(np.uint8).reshape(len(enc), width)
    lens = np.array([len(e) for e in enc])
    mask = np.arange(width)[None, :] < lens[:, None]
    return chars, mask


def render_rows(prefix: tuple[np.ndarray, np.ndarray], middle: bytes, values: np.ndarray, ndigits: int | None) -> bytes:
    """CSV lines ``{prefix[i]}{middle}{v0},{v1},...\\n`` for each row of the 2-D ``values``."""
    return render_frames([(prefix, middle, values)], ndigits)[0]


def render_frames(frames: list[tuple[tuple[np.ndarray, np.ndarray], bytes, np.ndarray]],
                  ndigits: int | None) -> list[bytes]:
    """:func:`render_rows` of each ``(prefix, middle, values)``, with all their numbers formatted at once
    (numpy's cost is per call, so a live export renders the steps of one poll together). Frames with
    different numbers of columns go in separate passes."""
    out: list[bytes] = [b""] * len(frames)
    by_k: dict[int, list[int]] = {}
    for i, (_, _, values) in enumerate(frames):
        if len(values):
            by_k.setdefault(values.shape[1], []).append(i)
    for k, idx in by_k.items():
        for i, body in zip(idx, _render_same_k([frames[i] for i in idx], k, ndigits), strict=True):
            out[i] = body
    return out


def _render_same_k(frames, k: int, ndigits: int | None) -> list[bytes]:
    counts = [len(values) for _, _, values in frames]
    n = sum(counts)
    values = frames[0][2] if len(frames) == 1 else np.concatenate([v for _, _, v in frames])
    vchars, vmask = value_chars(values, ndigits)
    w = vchars.shape[1]
    # each row's prefix and middle, side by side in one block as wide as the widest of them
    pw = max(p[0].shape[1] for p, _, _ in frames)
    sw = max(len(m) for _, m, _ in frames)
    total = pw + sw + k * (w + 1)
    out = np.zeros((n, total), dtype=np.uint8)
    keep = np.zeros((n, total), dtype=bool)
    r = 0
    for ((pchars, pmask), middle, _), c in zip(frames, counts, strict=True):
        if c != len(pchars):
            raise ValueError(f"{c} rows of values for {len(pchars)} row prefixes")
        out[r : r + c, : pchars.shape[1]] = pchars
        keep[r : r + c, : pchars.shape[1]] = pmask
        if middle:
            out[r : r + c, pw : pw + len(middle)] = np.frombuffer(middle, dtype=np.uint8)
            keep[r : r + c, pw : pw + len(middle)] = True
        r += c
    v = out[:, pw + sw :].reshape(n, k, w + 1)
    vk = keep[:, pw + sw :].reshape(n, k, w + 1)
    v[:, :, :w] = vchars.reshape(n, k, w)
    vk[:, :, :w] = vmask.reshape(n, k, w)
    v[:, :, w] = ord(",")
    if k:
        v[:, k - 1, w] = ord("\n")
    vk[:, :, w] = True
    text = out[keep].tobytes()
    if len(frames) == 1:
        return [text]
    # each frame's bytes: its rows' lengths summed
    ends = np.cumsum(keep.sum(axis=1))[np.cumsum(counts) - 1].tolist()
    return [text[a:b] for a, b in zip([0, *ends[:-1]], ends, strict=True)]
