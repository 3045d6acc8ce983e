"""Number formats of the fixture checkpoints, in numpy only (no torch), so the encoders run and are tested anywhere.

Provides BF16 rounding, FP8 E4M3 (float8_e4m3fn) encode/decode, NVFP4 (E2M1 codes + E4M3 block scales per 16 along
the input dim + FP32 multiplier `weight_scale_2`) quantisation exactly as a ModelOpt export stores it (docs/model.md §B.4),
the FP8 n-gram table encoding (docs/model.md §B.5) and a minimal safetensors writer. Used by make_fixtures.py (GPU
machine) and by its self-test (this machine). The independent reader lives in check_fixture.py on purpose.
"""
import json
import struct

import numpy as np

# ----------------------------------------------------------------------------------------------- BF16

def bf16_bits(x):
    """float32 array -> uint16 BF16 bit patterns, round to nearest even (NaN is not expected here)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return u.astype(np.uint16)


def bf16_to_f32(bits):
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def bf16_round(x):
    """float32 array -> float32 array holding the BF16-rounded values."""
    return bf16_to_f32(bf16_bits(x))


# ----------------------------------------------------------------------------------------------- FP8 E4M3 (fn)

def _e4m3_table():
    vals = np.zeros(256, dtype=np.float64)
    for code in range(256):
        s = -1.0 if code & 0x80 else 1.0
        e = (code >> 3) & 0xF
        m = code & 7
        if e == 15 and m == 7:
            vals[code] = np.nan
        elif e == 0:
            vals[code] = s * (m / 8.0) * 2.0 ** -6
        else:
            vals[code] = s * (1.0 + m / 8.0) * 2.0 ** (e - 7)
    return vals


E4M3_VALUES = _e4m3_table()  # float64, exact
E4M3_MAX = 448.0
_POS = E4M3_VALUES[:127]  # codes 0..126: 0 .. 448, strictly increasing


def e4m3_encode(x):
    """float array -> uint8 E4M3 codes, round to nearest, ties to the even code; saturates at +-448."""
    x = np.asarray(x, dtype=np.float64)
    a = np.minimum(np.abs(x), E4M3_MAX)
    hi = np.clip(np.searchsorted(_POS, a, side="left"), 0, 126)
    lo = np.clip(hi - 1, 0, 126)
    dlo = a - _POS[lo]
    dhi = _POS[hi] - a
    pick_hi = (dhi < dlo) | ((dhi == dlo) & (hi % 2 == 0))
    code = np.where(pick_hi, hi, lo).astype(np.uint8)
    neg = (x < 0) & (code != 0)
    return np.where(neg, code | 0x80, code).astype(np.uint8)


def e4m3_decode(codes):
    return E4M3_VALUES[np.asarray(codes, dtype=np.uint8)].astype(np.float32)


# ----------------------------------------------------------------------------------------------- NVFP4

E2M1_MAG = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float64)
E2M1_VALUES = np.concatenate([E2M1_MAG, -E2M1_MAG]).astype(np.float32)  # code 8 is -0


def e2m1_encode(x):
    """float array (already divided by its scale) -> 4-bit codes (bit 3 = sign); nearest magnitude, ties to the
    lower magnitude."""
    x = np.asarray(x, dtype=np.float64)
    mag = np.minimum(np.abs(x), 6.0)
    idx = np.abs(mag[..., None] - E2M1_MAG).argmin(-1)  # argmin takes the first (lower) on a tie
    sign = (x < 0) & (idx > 0)
    return (idx | (sign.astype(np.int64) << 3)).astype(np.uint8)


def nvfp4_quantize(w):
    """w [N, K] float32 -> dict(weight U8 [N, K/2] (low nibble = even element), weight_scale U8 E4M3 codes
    [N, K/16] (linear row-major), weight_scale_2 float32 scalar (multiplier, amax / (6*448)), deq float32 [N, K]).

    Dequantisation (docs/model.md §B.4): W[n, k] = e2m1(code) * e4m3(scale[n, k/16]) * weight_scale_2, evaluated here as
    (e2m1 * e4m3) * weight_scale_2 in float32 (the first product is exact)."""
    w = np.asarray(w, dtype=np.float32)
    n, k = w.shape
    assert k % 16 == 0, "NVFP4 needs the input dim to be a multiple of 16"
    amax = float(np.abs(w).max())
    g = np.float32(amax / (6.0 * 448.0)) if amax > 0 else np.float32(1.0)
    blocks = w.reshape(n, k // 16, 16).astype(np.float64)
    bamax = np.abs(blocks).max(-1)
    scale_code = e4m3_encode(bamax / 6.0 / float(g))
    sf = (e4m3_decode(scale_code).astype(np.float32) * g).astype(np.float32)  # effective block scale, f32
    safe = np.where(sf > 0, sf, np.float32(1.0)).astype(np.float64)
    codes = e2m1_encode(blocks / safe[..., None])
    codes = np.where((sf > 0)[..., None], codes, 0).astype(np.uint8).reshape(n, k)
    deq = nvfp4_dequantize(codes_to_packed(codes), scale_code, g)
    return {"weight": codes_to_packed(codes), "weight_scale": scale_code, "weight_scale_2": g, "deq": deq}


def codes_to_packed(codes):
    codes = np.asarray(codes, dtype=np.uint8)
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)


def nvfp4_dequantize(packed, scale_code, g):
    packed = np.asarray(packed, dtype=np.uint8)
    n = packed.shape[0]
    codes = np.empty((n, packed.shape[1] * 2), dtype=np.uint8)
    codes[:, 0::2] = packed & 0xF
    codes[:, 1::2] = packed >> 4
    k = codes.shape[1]
    vals = E2M1_VALUES[codes].reshape(n, k // 16, 16)
    sc = e4m3_decode(scale_code).astype(np.float32)[..., None]
    return ((vals * sc).astype(np.float32) * np.float32(g)).astype(np.float32).reshape(n, k)


# ----------------------------------------------------------------------------------------------- FP8 n-gram table

def fp8_table(t):
    """t [rows, cols] float32 -> (codes U8 [rows, cols], scale float32 (a power of two, exact in BF16), deq float32).

    The scale is 2^ceil(log2(amax / 448)), i.e. within a factor 2 of amax / 448, and a power of two so that
    bf16(fp8) * scale is exact in BF16 and FP32 alike: an engine that rounds the product to BF16 ([vLLM]/[SGL]) and
    one that keeps FP32 read the same table values."""
    t = np.asarray(t, dtype=np.float32)
    amax = float(np.abs(t).max())
    scale = np.float32(2.0 ** int(np.ceil(np.log2(amax / E4M3_MAX))))
    codes = e4m3_encode(t.astype(np.float64) / float(scale))
    deq = (e4m3_decode(codes) * scale).astype(np.float32)
    assert np.array_equal(bf16_round(deq), deq)
    return codes, scale, deq


# ----------------------------------------------------------------------------------------------- safetensors writer

ST_DTYPES = {"BF16": 2, "F32": 4, "F8_E4M3": 1, "U8": 1, "I64": 8}


def write_safetensors(path, tensors, metadata=None):
    """tensors: {name: (dtype, shape, raw little-endian bytes)}; written in name order, header padded with spaces
    to a multiple of 8 bytes (as the reference writer does)."""
    header = {}
    blobs = []
    off = 0
    for name in sorted(tensors):
        dt, shape, raw = tensors[name]
        n = ST_DTYPES[dt]
        for s in shape:
            n *= s
        assert n == len(raw), (name, dt, shape, len(raw))
        header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [off, off + n]}
        blobs.append(raw)
        off += n
    header["__metadata__"] = dict(metadata or {"format": "pt"})
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)
    return off


def raw_of(dt, arr):
    """numpy values -> raw little-endian bytes of safetensors dtype dt."""
    if dt == "BF16":
        return bf16_bits(arr).astype("<u2").tobytes()
    if dt == "F32":
        return np.asarray(arr, dtype="<f4").tobytes()
    if dt in ("U8", "F8_E4M3"):
        return np.asarray(arr, dtype=np.uint8).tobytes()
    if dt == "I64":
        return np.asarray(arr, dtype="<i8").tobytes()
    raise ValueError(dt)
