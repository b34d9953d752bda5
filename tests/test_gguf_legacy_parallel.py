"""The legacy GGUF encoders (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) run gguf's own quantize on pieces of a band, on every
core the calling stage has (`ckpt.quant.gguf._quantize_pieces`): the bytes must be exactly gguf.quants.quantize's
of the whole tensor (the oracle), NaN/Inf included, however the pieces fall and however many threads take them."""

from __future__ import annotations

import threading
import time
import warnings

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from ckpt.quant import gguf as G

LEGACY = (T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1)


@pytest.fixture
def threads():
    """torch.set_num_threads for one test (the pool's size follows it), put back after."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.fixture
def workers(monkeypatch):
    """Force the number of workers (CI machines may have one core)."""
    def force(n):
        monkeypatch.setattr(G, "quant_workers", lambda pieces: max(1, min(n, pieces)))
    return force


def oracle(x: torch.Tensor, t) -> np.ndarray:
    with np.errstate(all="ignore"):
        return gguf.quants.quantize(x.float().numpy(), t).reshape(-1)


def awkward(rows: int, cols: int, dtype=torch.float32) -> torch.Tensor:
    """Random values plus the cases gguf's arithmetic treats specially: NaN, +-Inf, whole NaN/Inf/zero rows,
    signed zeros, ties (values on a half step of their block's scale) and constant blocks."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(rows, cols, generator=g)
    x[0, 3] = float("nan")
    x[1, 40] = float("inf")
    x[2, 70] = float("-inf")
    x[3] = float("nan")
    x[4] = float("inf")
    x[5] = 0.0
    x[6, :32] = -0.0
    x[6, 32:64] = torch.tensor([0.0, -0.0] * 16)
    x[7, :32] = torch.arange(32) - 15.5  # ties for Q4/Q5 (d = -16/-8: x*id + .5 on halves)
    x[8, :32] = (torch.arange(32) - 16) * 127 / 32 / 2  # Q8_0: k + .5 steps
    x[9, :64] = 3.0  # constant blocks
    x[10, 32:64] = -2.5
    if rows > 20:
        x[rows // 2, cols // 2] = float("nan")  # a NaN deep inside a piece
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", LEGACY, ids=lambda t: t.name)
def test_pieces_give_gguf_bytes(monkeypatch, workers, dtype, t):
    """Pieces that cut rows anywhere on a block boundary (and end short), taken by 3 threads: gguf's bytes of the
    whole tensor, NaN/Inf, signed zeros and ties included; bf16 widened piece by piece as torch widens it."""
    x = awkward(24, 160, dtype)
    monkeypatch.setattr(G, "PIECE_ELEMS", 96)  # 3 blocks: pieces straddle rows of 5 blocks
    monkeypatch.setattr(G, "PIECE_ELEMS_OF", {})
    workers(3)
    got = G.encode(x, t)
    assert got.dtype == torch.uint8
    assert np.array_equal(got.numpy(), oracle(x, t))


@pytest.mark.parametrize("t", LEGACY, ids=lambda t: t.name)
def test_parallel_bytes_equal_single_thread_on_a_big_tensor(monkeypatch, workers, t):
    """A tensor big enough to spread over the workers (64 pieces): 1 worker and 4 workers write the same bytes,
    which are gguf's."""
    x = awkward(512, 1024)
    monkeypatch.setattr(G, "PIECE_ELEMS", 1 << 13)
    monkeypatch.setattr(G, "PIECE_ELEMS_OF", {})
    workers(1)
    one = G.encode(x, t)
    workers(4)
    four = G.encode(x, t)
    assert torch.equal(one, four)
    assert np.array_equal(four.numpy(), oracle(x, t))


def test_default_pieces_and_stage_threads_give_gguf_bytes(threads):
    """The shipped piece sizes, with the pool sized by torch's threads (2 here, whatever the machine has)."""
    threads(2)
    x = awkward(300, 3072, torch.bfloat16)  # 921,600 values: several pieces of 2^16 / 2^17
    for t in LEGACY:
        assert np.array_equal(G.encode(x, t).numpy(), oracle(x, t)), t.name


def test_helpers_do_take_pieces(monkeypatch, workers):
    """With 2 workers the pool's thread quantizes pieces beside the caller (not the caller alone)."""
    seen, real = set(), gguf.quants.quantize

    def recording(v, t):
        seen.add(threading.get_ident())
        time.sleep(0.002)  # let the other thread get a piece even on a loaded machine
        return real(v, t)

    monkeypatch.setattr(gguf.quants, "quantize", recording)
    monkeypatch.setattr(G, "PIECE_ELEMS_OF", {"Q8_0": 1 << 10})
    workers(2)
    x = torch.randn(64, 1024)
    got = G.encode(x, T.Q8_0)
    assert len(seen) == 2 and threading.get_ident() in seen
    assert np.array_equal(got.numpy(), oracle(x, T.Q8_0))


def test_workers_follow_the_stage_threads(threads):
    """The pool never adds threads to cores another write stage holds: one torch thread, one worker."""
    threads(1)
    assert G.quant_workers(100) == 1
    threads(2)
    assert G.quant_workers(100) == min(2, __import__("os").cpu_count() or 1)
    assert G.quant_workers(1) == 1


def test_nonfinite_values_warn_in_no_thread(monkeypatch, workers):
    """numpy's errstate is per thread: the helpers silence NaN/Inf warnings too (a warning turned into an error
    here would surface as encode's exception)."""
    monkeypatch.setattr(G, "PIECE_ELEMS_OF", {})
    monkeypatch.setattr(G, "PIECE_ELEMS", 64)
    workers(3)
    x = torch.full((16, 256), float("nan"))
    x[1::2] = float("inf")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for t in LEGACY:
            assert np.array_equal(G.encode(x, t).numpy(), oracle(x, t)), t.name


def test_an_error_in_a_helper_is_raised(monkeypatch, workers):
    real = gguf.quants.quantize
    caller = threading.get_ident()

    def failing(v, t):
        if threading.get_ident() != caller:
            raise RuntimeError("helper failed")
        time.sleep(0.002)
        return real(v, t)

    monkeypatch.setattr(gguf.quants, "quantize", failing)
    monkeypatch.setattr(G, "PIECE_ELEMS_OF", {"Q8_0": 1 << 10})
    workers(2)
    with pytest.raises(RuntimeError, match="helper failed"):
        G.encode(torch.randn(64, 1024), T.Q8_0)


def test_small_empty_and_bad_rows():
    one_block = torch.randn(1, 32)
    assert np.array_equal(G.encode(one_block, T.Q4_0).numpy(), oracle(one_block, T.Q4_0))
    assert G.encode(torch.empty(0, 64), T.Q8_0).numel() == 0
    with pytest.raises(ValueError, match="not a whole number of Q8_0 blocks"):
        G.encode(torch.randn(2, 48), T.Q8_0)


@pytest.mark.parametrize("to, busy", [("gguf-q8_0", "compute"), ("gguf-q4_1", "compute"), ("gguf-bf16", None)])
def test_legacy_gguf_plans_give_the_compute_stage_every_core(tmp_path, run_ckpt, monkeypatch, to, busy):
    """A legacy-type GGUF's work is its compute stage's encoding (the reader only reads the source), so its plan
    says so, as the K-quant plans do; a plain-type GGUF only casts: each stage its share."""
    from safetensors.torch import save_file

    from helpers.flux_names import tiny_flux
    from ckpt.io import write_stages

    seen, real = [], write_stages.WriteStages.__init__

    def recording(self, *args, **kw):
        seen.append(kw.get("busy_stage"))
        real(self, *args, **kw)

    monkeypatch.setattr(write_stages.WriteStages, "__init__", recording)
    save_file(tiny_flux(torch.bfloat16), tmp_path / "m.safetensors")
    code, out, err = run_ckpt("convert", tmp_path / "m.safetensors", "--to", to, "-o", tmp_path / "o.gguf", "-q")
    assert code == 0, err
    assert seen == [busy]
