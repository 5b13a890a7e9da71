"""The kernels' ARM build, checked on an x86 machine: it compiles with a cross compiler, and, run under
qemu-user through a small harness (emulated/kernel_main.cpp), its paged decode attention (the 8-lane vector
kernel in NEON registers, the generic loop for other head sizes) matches softmax attention on the cases every
x86 build is held to (test_decode_attention_kernels.py) and its dense linear kernel a float64 matmul, each
giving a query or row the same bits alone as in a batch and on one thread as on two.
Debian: `apt-get install g++-aarch64-linux-gnu qemu-user`; skipped without them."""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
from pathlib import Path
from unittest import mock

import pytest
import torch
from decode_attention_cases import LENS, SHAPES, case, chunk_case, naive

from servelm.model.kernels import build as kernel_build
from servelm.model.layers.linear_kernels import pack_dense_weight

CXX, QEMU, SYSROOT = "aarch64-linux-gnu-g++", "qemu-aarch64", "/usr/aarch64-linux-gnu"
HARNESS = Path(__file__).parent / "emulated" / "kernel_main.cpp"
pytestmark = pytest.mark.skipif(shutil.which(CXX) is None or shutil.which(QEMU) is None,
                                reason="needs a cross compiler and qemu-user "
                                       "(Debian: apt-get install g++-aarch64-linux-gnu qemu-user)")
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


@pytest.fixture(scope="module")
def arm_build(tmp_path_factory):
    """The portable variant built for aarch64, and the harness that runs its entry points."""
    out = tmp_path_factory.mktemp("arm")
    with mock.patch.dict(os.environ, {"CXX": CXX}):
        manifest = kernel_build.build(out, machine="aarch64", log=lambda *_: None)
    harness = out / "kernel_main"
    subprocess.run([CXX, "-O1", "-std=c++17", "-o", str(harness), str(HARNESS)], check=True)
    return manifest, out / kernel_build.library_name("portable"), harness


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes() if t.dtype == torch.bfloat16 else t.contiguous().numpy().tobytes()


def run_arm(arm_build, tmp_path, op: str, payload: bytes, shape, dtype, threads: int) -> torch.Tensor:
    """One entry point of the ARM library, under qemu, on this input: its output as a tensor."""
    _, lib, harness = arm_build
    (tmp_path / "in").write_bytes(payload)
    proc = subprocess.run([QEMU, "-L", SYSROOT, str(harness), str(lib), op, str(tmp_path / "in"), str(tmp_path / "out")],
                          capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    assert proc.returncode == 0, proc.stderr
    data = bytearray((tmp_path / "out").read_bytes())
    if dtype == torch.bfloat16:
        return torch.frombuffer(data, dtype=torch.int16).view(torch.bfloat16).view(shape)
    return torch.frombuffer(data, dtype=dtype).view(shape)


def run_decode(arm_build, tmp_path, q, kc, vc, tables, lens, window, threads=2) -> torch.Tensor:
    """servelm_paged_decode_attention of the ARM library."""
    nb, bs, hkv, d = kc.shape
    header = struct.pack("<10qd", _DTYPES[q.dtype], q.shape[0], q.shape[1], hkv, d, bs, nb, tables.shape[1], window,
                         q.element_size(), d**-0.5)
    payload = header + b"".join(_bytes(t) for t in (q, kc, vc, tables, lens))
    return run_arm(arm_build, tmp_path, "decode_attention", payload, q.shape, q.dtype, threads)


def run_dense(arm_build, tmp_path, x, packed, n, bias=None, threads=2) -> torch.Tensor:
    """servelm_dense_linear of the ARM library: x @ w.T (+ bias), rounded to x's dtype."""
    m, k = x.shape
    header = struct.pack("<7q", _DTYPES[x.dtype], m, k, n, 0, x.element_size(), bias is not None)
    payload = header + b"".join(_bytes(t) for t in (x, packed, *([] if bias is None else [bias])))
    return run_arm(arm_build, tmp_path, "dense_linear", payload, (m, n), x.dtype, threads)


def test_the_portable_variant_builds_for_arm(arm_build):
    """The x86 intrinsics are guarded: ARM gets a working portable library."""
    manifest, lib, _ = arm_build
    assert manifest["built"] == ["portable"], manifest["failed"]
    head = lib.read_bytes()[:20]
    assert head[:4] == b"\x7fELF" and int.from_bytes(head[18:20], "little") == 183  # EM_AARCH64


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("window", [0, 10])
@pytest.mark.parametrize("d, hq, hkv", SHAPES)
def test_the_arm_decode_kernel_matches_softmax_attention(arm_build, tmp_path, dtype, tol, window, d, hq, hkv):
    q, kc, vc, tables, lens, bs = case(dtype, d, hq, hkv, seed=d + hq)
    out = run_decode(arm_build, tmp_path, q, kc, vc, tables, lens, window)
    for b, n in enumerate(LENS):
        ref = naive(q[b], kc, vc, tables[b], n, bs, window)
        torch.testing.assert_close(out[b].float(), ref, atol=tol, rtol=tol, msg=lambda m, b=b: f"row {b}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_arm_query_gets_the_same_bits_alone_in_any_batch_and_on_any_thread_count(arm_build, tmp_path, dtype):
    q, kc, vc, tables, lens, _ = case(dtype, 64, 6, 2, seed=3)
    whole = run_decode(arm_build, tmp_path, q, kc, vc, tables, lens, 0)
    for b in (0, 3, 7):
        alone = run_decode(arm_build, tmp_path, q[b:b + 1], kc, vc, tables[b:b + 1], lens[b:b + 1], 0)
        assert torch.equal(alone[0], whole[b]), b
    order = torch.tensor([5, 0, 7, 2])
    assert torch.equal(run_decode(arm_build, tmp_path, q[order], kc, vc, tables[order], lens[order], 0), whole[order])
    assert torch.equal(run_decode(arm_build, tmp_path, q, kc, vc, tables, lens, 0, threads=1), whole)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [0, 50])
def test_an_arm_prompt_chunks_rows_get_the_bits_each_gets_alone(arm_build, tmp_path, dtype, window):
    """A prompt chunk's rows, walked together, as test_decode_attention_kernels.py holds the x86 builds to."""
    q, kc, vc, tables, lens, bs = chunk_case(dtype, 64, 6, 2, seed=5)
    out = run_decode(arm_build, tmp_path, q, kc, vc, tables, lens, window)
    for i in (0, 13, 31, 32, 36):
        alone = run_decode(arm_build, tmp_path, q[i:i + 1], kc, vc, tables[i:i + 1], lens[i:i + 1], window)
        assert torch.equal(out[i], alone[0]), i
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    for i in range(q.shape[0]):
        torch.testing.assert_close(out[i].float(), naive(q[i], kc, vc, tables[i], int(lens[i]), bs, window),
                                   atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "k"), [(40, 64), (96, 77)])  # N padded to a block of 32; any K
def test_the_arm_dense_kernel_matches_a_float64_matmul_and_every_row_is_batch_invariant(arm_build, tmp_path, dtype,
                                                                                        n, k):
    """The linears' kernel on ARM (two 8-lane vectors per 16 columns, fused multiply-adds): as
    test_cpu_kernels.py holds the x86 builds to, 1 to 70 rows (the 6-row micro-kernel, its tails, two 64-row
    passes)."""
    torch.manual_seed(n + k)
    w, b, x = torch.randn(n, k).to(dtype), torch.randn(n).to(dtype), torch.randn(70, k).to(dtype)
    panels = pack_dense_weight(w)
    y = run_dense(arm_build, tmp_path, x, panels, n, b)
    want = x.double() @ w.double().T + b.double()
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(y.double(), want, atol=tol * (k ** 0.5), rtol=tol)
    for m in (1, 5, 7, 65):
        assert torch.equal(run_dense(arm_build, tmp_path, x[:m], panels, n, b), y[:m]), m
    assert torch.equal(run_dense(arm_build, tmp_path, x[3:4], panels, n, b), y[3:4])
    assert torch.equal(run_dense(arm_build, tmp_path, x, panels, n, b, threads=1), y)
