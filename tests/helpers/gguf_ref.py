"""ggml's block formats decoded by their definition (`dequantize_row_*` in ggml-quants.c, written out here
block by block), independent of gguf's vectorised dequantize, and random blocks of those types whose f16
scales are finite (every bit pattern of the rest is valid)."""

from __future__ import annotations

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T

RNG = np.random.default_rng(0)
IQ4NL = [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113]


def _f16(v):
    return np.array(v, dtype=np.float16)


def _scale_min_k4(j, q):
    if j < 4:
        return q[j] & 63, q[j + 4] & 63
    return (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4)


def ref_q2_k(b):
    scales, qs = b[:16], b[16:80]
    d, dmin = np.float32(b[80:82].view(np.float16)[0]), np.float32(b[82:84].view(np.float16)[0])
    y, i = [], 0
    for n in range(2):
        q = qs[32 * n:32 * n + 32]
        for shift in (0, 2, 4, 6):
            for half in (0, 16):
                sc = scales[i]
                i += 1
                dl, ml = d * np.float32(sc & 0xF), dmin * np.float32(sc >> 4)
                y += [dl * np.float32((q[half + l] >> shift) & 3) - ml for l in range(16)]
    return np.array(y, dtype=np.float32)


def ref_q3_k(b):
    hmask, qs, sc12 = b[:32], b[32:96], b[96:108]
    d = np.float32(b[108:110].view(np.float16)[0])
    aux = np.frombuffer(sc12.tobytes(), dtype=np.uint32).copy()
    tmp = aux[2]
    k1, k2 = np.uint32(0x03030303), np.uint32(0x0F0F0F0F)
    a = [(aux[0] & k2) | (((tmp >> 0) & k1) << 4), (aux[1] & k2) | (((tmp >> 2) & k1) << 4),
         ((aux[0] >> 4) & k2) | (((tmp >> 4) & k1) << 4), ((aux[1] >> 4) & k2) | (((tmp >> 6) & k1) << 4)]
    scales = np.array(a, dtype=np.uint32).view(np.int8)
    y, i, m = [], 0, 1
    for n in range(2):
        q = qs[32 * n:32 * n + 32]
        for shift in (0, 2, 4, 6):
            for half in (0, 16):
                dl = d * np.float32(int(scales[i]) - 32)
                i += 1
                y += [dl * np.float32(int((q[half + l] >> shift) & 3) - (0 if hmask[half + l] & m else 4))
                      for l in range(16)]
            m <<= 1
    return np.array(y, dtype=np.float32)


def ref_q4_k(b):
    d, dmin = np.float32(b[0:2].view(np.float16)[0]), np.float32(b[2:4].view(np.float16)[0])
    scales, qs = b[4:16], b[16:144]
    y = []
    for j in range(4):
        sc1, m1 = _scale_min_k4(2 * j, scales)
        sc2, m2 = _scale_min_k4(2 * j + 1, scales)
        q = qs[32 * j:32 * j + 32]
        y += [d * np.float32(sc1) * np.float32(v & 0xF) - dmin * np.float32(m1) for v in q]
        y += [d * np.float32(sc2) * np.float32(v >> 4) - dmin * np.float32(m2) for v in q]
    return np.array(y, dtype=np.float32)


def ref_q5_k(b):
    d, dmin = np.float32(b[0:2].view(np.float16)[0]), np.float32(b[2:4].view(np.float16)[0])
    scales, qh, qs = b[4:16], b[16:48], b[48:176]
    y = []
    for j in range(4):
        sc1, m1 = _scale_min_k4(2 * j, scales)
        sc2, m2 = _scale_min_k4(2 * j + 1, scales)
        q = qs[32 * j:32 * j + 32]
        u1, u2 = 1 << (2 * j), 2 << (2 * j)
        y += [d * np.float32(sc1) * np.float32((q[l] & 0xF) + (16 if qh[l] & u1 else 0)) - dmin * np.float32(m1)
              for l in range(32)]
        y += [d * np.float32(sc2) * np.float32((q[l] >> 4) + (16 if qh[l] & u2 else 0)) - dmin * np.float32(m2)
              for l in range(32)]
    return np.array(y, dtype=np.float32)


def ref_q6_k(b):
    ql, qh, sc = b[:128], b[128:192], b[192:208].view(np.int8)
    d = np.float32(b[208:210].view(np.float16)[0])
    y = np.zeros(256, dtype=np.float32)
    for n in range(2):
        L, H, S = ql[64 * n:], qh[32 * n:], sc[8 * n:]
        for l in range(32):
            i = l // 16
            q1 = int((L[l] & 0xF) | (((H[l] >> 0) & 3) << 4)) - 32
            q2 = int((L[l + 32] & 0xF) | (((H[l] >> 2) & 3) << 4)) - 32
            q3 = int((L[l] >> 4) | (((H[l] >> 4) & 3) << 4)) - 32
            q4 = int((L[l + 32] >> 4) | (((H[l] >> 6) & 3) << 4)) - 32
            for off, s, q in ((0, 0, q1), (32, 2, q2), (64, 4, q3), (96, 6, q4)):
                y[128 * n + l + off] = d * np.float32(S[i + s]) * np.float32(q)
    return y


def ref_iq4_nl(b):
    d, qs = np.float32(b[0:2].view(np.float16)[0]), b[2:18]
    return np.array([d * np.float32(IQ4NL[v & 0xF]) for v in qs] + [d * np.float32(IQ4NL[v >> 4]) for v in qs],
                    dtype=np.float32)


# type -> (reference decoder, byte offsets of its f16 scale fields, which must be finite)
HAND_PACKED = {T.Q2_K: (ref_q2_k, (80, 82)), T.Q3_K: (ref_q3_k, (108,)), T.Q4_K: (ref_q4_k, (0, 2)),
               T.Q5_K: (ref_q5_k, (0, 2)), T.Q6_K: (ref_q6_k, (208,)), T.IQ4_NL: (ref_iq4_nl, (0,))}


# types packed here without a reference decoder: the byte offsets of their f16 scales
SCALE_ONLY = {T.IQ3_S: (0,), T.IQ2_XS: (0,)}


def pack_blocks(t, n_blocks, rng=None):
    """Random block bytes with finite f16 super-block scales: every bit pattern of the rest is valid."""
    blk, size = gguf.GGML_QUANT_SIZES[t]
    rng = rng if rng is not None else RNG
    b = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    for off in HAND_PACKED[t][1] if t in HAND_PACKED else SCALE_ONLY[t]:
        b[:, off:off + 2] = _f16(rng.uniform(-0.05, 0.05, n_blocks)).view(np.uint8).reshape(n_blocks, 2)
    return b
