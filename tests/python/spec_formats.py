"""An independent implementation of docs/SPEC.md §1 (number formats and KV records), in numpy.

Written from the spec's words, not from the Rust code, and on purpose by different means:
E2M1 and E4M3 round by searching the table of representable values (nearest value, ties to the
even code) instead of comparing against midpoints or scaling to an integer; ceil(log2) comes from
numpy.frexp. Where docs/SPEC.md §1 is silent the choices are stated in the docstrings (NaN ignored
by the block amax, an infinite amax saturates the exponent to 127, NaN bf16 keeps its top bits
with the quiet bit set).
"""

import numpy as np

F32 = np.float32

# ---- element formats ---------------------------------------------------------------------------

E2M1_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float64)


def _e4m3_magnitudes():
    """Values of codes 0x00..0x7E (bias 7; exponent field 0 is subnormal: m * 2^-9)."""
    out = []
    for code in range(0x7F):
        e, m = code >> 3, code & 7
        out.append(m * 2.0 ** -9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return np.array(out, dtype=np.float64)


E4M3_GRID = _e4m3_magnitudes()  # increasing; E4M3_GRID[0x7E] == 448


def _nearest_even(a, grid):
    """Index of the grid value nearest to a (float64, finite, within the grid's span); a tie
    between two neighbours goes to the even index."""
    hi = np.clip(np.searchsorted(grid, a, side="left"), 1, len(grid) - 1)
    lo = hi - 1
    dlo = a - grid[lo]
    dhi = grid[hi] - a
    pick_hi = (dhi < dlo) | ((dhi == dlo) & (hi % 2 == 0))
    return np.where(pick_hi, hi, lo)


def e2m1_encode(x):
    """float32 array -> uint8 codes 0..15 (RNE on the grid, saturate at 6, NaN -> 0x7, sign kept)."""
    x = np.asarray(x, dtype=F32)
    a = np.abs(x.astype(np.float64))
    nan = np.isnan(a)
    a = np.where(nan, 0.0, np.minimum(a, 6.0))
    code = _nearest_even(a, E2M1_GRID).astype(np.uint8)
    code |= np.where(np.signbit(x), 8, 0).astype(np.uint8)
    return np.where(nan, 0x7, code).astype(np.uint8)


def e2m1_decode(code):
    code = np.asarray(code, dtype=np.uint8)
    mag = E2M1_GRID[code & 7].astype(F32)
    return np.where(code & 8, -mag, mag).astype(F32)


def e4m3_encode(x):
    """float32 array -> uint8 (OCP E4M3fn, RNE, saturating at 448, NaN -> 0x7F)."""
    x = np.asarray(x, dtype=F32)
    a = np.abs(x.astype(np.float64))
    nan = np.isnan(a)
    a = np.where(nan, 0.0, np.minimum(a, 448.0))
    code = _nearest_even(a, E4M3_GRID).astype(np.uint8)
    code |= np.where(np.signbit(x), 0x80, 0).astype(np.uint8)
    return np.where(nan, 0x7F, code).astype(np.uint8)


def e4m3_decode(b):
    b = np.asarray(b, dtype=np.uint8)
    low = b & 0x7F
    mag = np.where(low == 0x7F, np.nan, E4M3_GRID[np.minimum(low, 0x7E)])
    return np.where(b & 0x80, -mag, mag).astype(F32)


def ceil_log2(v):
    """Exact ceil(log2 v) for float32 v > 0 (frexp: v = f * 2^e, f in [0.5, 1));
    +Inf -> 128 (saturates the E8M0 exponent later)."""
    v = np.asarray(v, dtype=np.float64)
    f, e = np.frexp(np.where(np.isfinite(v), v, 1.0))
    r = np.where(f == 0.5, e - 1, e)
    return np.where(np.isfinite(v), r, 128).astype(np.int64)


def e8m0_decode(b):
    b = np.asarray(b, dtype=np.int64)
    return np.where(b == 0xFF, np.nan, np.ldexp(1.0, b - 127)).astype(F32)


# ---- bf16 -----------------------------------------------------------------------------------------


def bf16_bits(x):
    """float32 -> bf16 bit patterns (uint16): round to nearest, ties to even; NaN keeps its top
    16 bits with the quiet bit (0x40) set."""
    u = np.asarray(x, dtype=F32).view(np.uint32).astype(np.uint64)
    top = u >> 16
    rest = u & 0xFFFF
    up = (rest > 0x8000) | ((rest == 0x8000) & (top & 1 == 1))
    r = (top + up) & 0xFFFF
    nan = np.isnan(np.asarray(x, dtype=F32))
    return np.where(nan, top | 0x40, r).astype(np.uint16)


def bf16_to_f32(bits):
    bits = np.asarray(bits, dtype=np.uint16).astype(np.uint32)
    nan = (bits & 0x7FFF) > 0x7F80
    bits = np.where(nan, bits | 0x40, bits)
    return (bits << 16).astype(np.uint32).view(F32)


def bf16_round(x):
    return bf16_to_f32(bf16_bits(x))


# ---- records ----------------------------------------------------------------------------------------


def _amax(blocks):
    """max |x| per block (last axis), NaN ignored, 0 for an all-NaN block."""
    a = np.abs(blocks)
    return np.where(np.isnan(a), F32(0), a).max(axis=-1).astype(F32)


def _pack_nibbles(codes):
    codes = codes.reshape(codes.shape[0], -1, 2)
    return (codes[..., 0] | (codes[..., 1] << 4)).astype(np.uint8)


def _unpack_nibbles(data):
    out = np.empty(data.shape[:-1] + (data.shape[-1] * 2,), dtype=np.uint8)
    out[..., 0::2] = data & 0xF
    out[..., 1::2] = data >> 4
    return out


def _pow2(e):
    return np.ldexp(np.float64(1.0), np.asarray(e, dtype=np.int64)).astype(F32)


def _mx_exponent(amax, floor, elem_max, lo=-127):
    a = np.maximum(amax, F32(floor)).astype(F32)
    return np.clip(ceil_log2((a / F32(elem_max)).astype(F32)), lo, 127)


def _e4m3_blocks(x, block):
    """MX-style E4M3 blocks (docs/SPEC.md §1.5 MXFP8 rule) -> (data uint8 (rows, n), scale bytes (rows, n/block))."""
    rows = x.shape[0]
    b = x.reshape(rows, -1, block)
    e = _mx_exponent(_amax(b), 1e-4, 448.0)
    scaled = (b * _pow2(-e)[..., None]).astype(F32)
    q = e4m3_encode(np.clip(scaled, F32(-448), F32(448)))
    return q.reshape(rows, -1), (e + 127).astype(np.uint8)


def encode(fmt, x):
    """x: float32 (rows, dim) -> uint8 (rows, record bytes), each record data then scales."""
    with np.errstate(over="ignore", invalid="ignore"):  # Inf / NaN inputs are part of the domain
        return _encode(fmt, x)


def _encode(fmt, x):
    x = bf16_round(np.asarray(x, dtype=F32))
    rows = x.shape[0]
    if fmt == "nvfp4":
        b = x.reshape(rows, 32, 16)
        s_code = e4m3_encode(np.clip((_amax(b) / F32(6)).astype(F32), F32(2.0 ** -9), F32(448)))
        s = e4m3_decode(s_code)
        q = e2m1_encode((b / s[..., None]).astype(F32)).reshape(rows, 512)
        return np.concatenate([_pack_nibbles(q), s_code], axis=1)
    if fmt == "mxfp4":
        b = x.reshape(rows, 4, 32)
        e = _mx_exponent(np.maximum(_amax(b), F32(6 * 2.0 ** -126)), 0.0, 6.0)
        q = e2m1_encode((b * _pow2(-e)[..., None]).astype(F32)).reshape(rows, 128)
        return np.concatenate([_pack_nibbles(q), (e + 127).astype(np.uint8)], axis=1)
    if fmt == "mxfp8":
        d, s = _e4m3_blocks(x, 32)
        return np.concatenate([d, s], axis=1)
    if fmt == "v4":
        d, s = _e4m3_blocks(x[:, :448], 64)
        rope = bf16_bits(x[:, 448:]).astype("<u2").view(np.uint8).reshape(rows, 128)
        pad = np.zeros((rows, 1), dtype=np.uint8)
        return np.concatenate([d, rope, s, pad], axis=1)
    if fmt == "fp8index":
        e = _mx_exponent(_amax(x[:, None, :]), 1e-4, 448.0, lo=-126)[:, 0]
        scaled = (x * _pow2(-e)[:, None]).astype(F32)
        q = e4m3_encode(np.clip(scaled, F32(-448), F32(448)))
        scale = _pow2(e).astype("<f4").view(np.uint8).reshape(rows, 4)
        return np.concatenate([q, scale], axis=1)
    raise ValueError(fmt)


DIM = {"nvfp4": 512, "mxfp4": 128, "mxfp8": 512, "v4": 512, "fp8index": 128}
RECORD = {"nvfp4": 288, "mxfp4": 68, "mxfp8": 528, "v4": 584, "fp8index": 132}


def decode(fmt, rec):
    """uint8 (rows, record bytes) -> float32 (rows, dim)."""
    with np.errstate(over="ignore", invalid="ignore"):  # arbitrary bytes may overflow or be NaN
        return _decode(fmt, rec)


def _decode(fmt, rec):
    rec = np.asarray(rec, dtype=np.uint8)
    rows = rec.shape[0]
    if fmt == "nvfp4":
        q = e2m1_decode(_unpack_nibbles(rec[:, :256])).reshape(rows, 32, 16)
        s = e4m3_decode(rec[:, 256:288])
        return (q * s[..., None]).astype(F32).reshape(rows, 512)
    if fmt == "mxfp4":
        q = e2m1_decode(_unpack_nibbles(rec[:, :64])).reshape(rows, 4, 32)
        s = e8m0_decode(rec[:, 64:68])
        return (q * s[..., None]).astype(F32).reshape(rows, 128)
    if fmt == "mxfp8":
        q = e4m3_decode(rec[:, :512]).reshape(rows, 16, 32)
        s = e8m0_decode(rec[:, 512:528])
        return (q * s[..., None]).astype(F32).reshape(rows, 512)
    if fmt == "v4":
        q = e4m3_decode(rec[:, :448]).reshape(rows, 7, 64)
        s = e8m0_decode(rec[:, 576:583])
        nope = (q * s[..., None]).astype(F32).reshape(rows, 448)
        rope = bf16_to_f32(rec[:, 448:576].copy().view("<u2").reshape(rows, 64))
        return np.concatenate([nope, rope], axis=1)
    if fmt == "fp8index":
        q = e4m3_decode(rec[:, :128])
        s = rec[:, 128:132].copy().view("<f4").reshape(rows, 1)
        return (q * s).astype(F32)
    raise ValueError(fmt)
