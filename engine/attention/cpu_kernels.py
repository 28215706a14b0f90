"""Small C kernels for the CPU path, compiled on first use with the system C compiler and loaded by ctypes.

Why C: decode attention on CPU is memory-bound, and the pure-torch path has to copy every request's
pages into a dense tensor (index_select) before two batched GEMMs read them again. The kernel in
engine/csrc/paged_decode.c reads the pages in place, once. engine/csrc/cpu_ops.c holds the model's fused
per-token ops (`CpuOps`: residual add + RMSNorm, RoPE, SiLU * up), each one pass instead of several torch
ops; engine/csrc/moe_experts.c the MoE layers' experts (`CpuOps.experts`, engine/models/moe.py
`CpuExperts`). The sources build into one library that needs no torch headers, so it builds in
about a second with `cc -O3 -march=native -fopenmp`; the library is cached under
`$AFFINITY_SERVE_CACHE` (default `~/.cache/affinity-serve`)/kernels, keyed by source, flags, compiler
and CPU. Without a compiler, or with AFFINITY_SERVE_CPU_KERNELS=0, `load()` returns None and the
backend stays on pure torch (a warning says why).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parents[1] / "csrc"
SOURCES = (CSRC / "paged_decode.c", CSRC / "cpu_ops.c", CSRC / "moe_experts.c")
HEADERS = (CSRC / "vec_math.h",)
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno", "-fno-trapping-math",
          "-std=c11"]
ENV_SWITCH = "AFFINITY_SERVE_CPU_KERNELS"


class PagedDecodeKernel:
    """ctypes wrapper around `paged_decode_attention_f32`."""

    def __init__(self, lib: ctypes.CDLL, path: Path):
        self.path = path
        fn = lib.paged_decode_attention_f32
        i64, p = ctypes.c_int64, ctypes.c_void_p
        fn.argtypes = [p, p, p, i64, p, p, i64, i64, i64, i64, i64, i64, ctypes.c_float, ctypes.c_int]
        fn.restype = ctypes.c_int
        self._fn = fn

    def __call__(self, q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
        """q [N, H, D] float32 -> out [N, H, D]. kv_cache [2, KVH, NB, BS, D]; block_tables [N, M] and
        seq_lens [N] int32, on CPU. The caller guarantees block tables cover seq_lens."""
        assert q.dtype == kv_cache.dtype == torch.float32 and q.device.type == "cpu"
        assert block_tables.dtype == seq_lens.dtype == torch.int32 and kv_cache.is_contiguous()
        q = q.contiguous()
        block_tables = block_tables.contiguous()
        seq_lens = seq_lens.contiguous()
        n, heads, d = q.shape
        _, kvh, nb, bs, _ = kv_cache.shape
        out = torch.empty_like(q)
        rc = self._fn(q.data_ptr(), kv_cache.data_ptr(), block_tables.data_ptr(), block_tables.stride(0),
                      seq_lens.data_ptr(), out.data_ptr(), n, heads, kvh, nb, bs, d, float(scale),
                      torch.get_num_threads())
        if rc != 0:
            raise MemoryError("paged decode attention kernel could not allocate its score buffer")
        return out


class CpuOps:
    """ctypes wrappers around engine/csrc/cpu_ops.c, with the signatures of engine/models/fused.py (the
    Triton versions), so the model's fused path runs either. float32 CPU tensors only."""

    def __init__(self, lib: ctypes.CDLL):
        i64, p, f32, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
        self._norm = lib.add_rms_norm_f32
        self._norm.argtypes = [p, p, p, p, i64, i64, i64, i64, i64, f32, i32]
        self._rope = lib.rope_f32
        self._rope.argtypes = [p, p, p, p, i64, i64, i64, i64, i64, i64, i64, i32]
        self._silu = lib.silu_mul_f32
        self._silu.argtypes = [p, p, i64, i64, i64, i64, i32]
        self._norm.restype = self._silu.restype = None
        self._rope.restype = ctypes.c_int
        from affinity_serve.engine.models.moe import CpuExperts
        #: the MoE layers' experts (engine/csrc/moe_experts.c), an `ExpertsFn`; the model uses it with these ops
        self.experts = CpuExperts(lib)

    @staticmethod
    def _check(*ts: torch.Tensor) -> None:
        for t in ts:
            if t.dtype != torch.float32 or t.device.type != "cpu" or t.stride(-1) != 1:
                raise ValueError(f"CPU fused ops take float32 CPU tensors with unit stride in the last dim; got "
                                 f"{t.dtype} on {t.device} with strides {t.stride()}")

    def add_rms_norm(self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        """x: [T, hidden], updated in place to x + delta when delta is given; returns RMSNorm(x) * weight."""
        self._check(x, weight, *(() if delta is None else (delta,)))
        t, n = x.shape
        if weight.shape != (n,) or (delta is not None and delta.shape != x.shape):
            raise ValueError(f"add_rms_norm: x {tuple(x.shape)} needs weight ({n},) and delta of x's shape; got "
                             f"{tuple(weight.shape)} and {None if delta is None else tuple(delta.shape)}")
        y = torch.empty_like(x)
        if t:
            self._norm(x.data_ptr(), None if delta is None else delta.data_ptr(), weight.data_ptr(), y.data_ptr(),
                       t, n, x.stride(0), 0 if delta is None else delta.stride(0), y.stride(0), eps,
                       torch.get_num_threads())
        return y

    def rope_(self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate x [T, heads, head_dim] in place by the float32 [max_pos, rotary_dim] tables at `positions`."""
        self._check(x, cos, sin)
        t, heads, d = x.shape
        if (positions.shape != (t,) or cos.dim() != 2 or cos.shape != sin.shape or cos.stride() != sin.stride()
                or cos.shape[-1] > d):
            raise ValueError(f"rope_: x {tuple(x.shape)} needs ({t},) positions and 2-D cos / sin tables of one shape "
                             f"and layout, no wider than the head; got {tuple(positions.shape)}, "
                             f"{tuple(cos.shape)} {cos.stride()}, {tuple(sin.shape)} {sin.stride()}")
        if positions.dtype != torch.int64 or not positions.is_contiguous():
            positions = positions.to(torch.int64).contiguous()
        if t and self._rope(x.data_ptr(), positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), t, heads,
                            x.stride(0), x.stride(1), cos.stride(0), cos.shape[0], cos.shape[-1] // 2,
                            torch.get_num_threads()):
            raise IndexError(f"rope_: a position is outside the {cos.shape[0]}-row cos / sin tables "
                             f"(positions {int(positions.min())}..{int(positions.max())})")
        return x

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, 2 * n] = [gate | up] -> silu(gate) * up, [T, n]."""
        self._check(x)
        t, two_n = x.shape
        if two_n % 2:
            raise ValueError(f"silu_mul: x is [gate | up], so its last dim must be even; got {tuple(x.shape)}")
        n = two_n // 2
        y = torch.empty(t, n, dtype=x.dtype)
        if t:
            self._silu(x.data_ptr(), y.data_ptr(), t, n, x.stride(0), y.stride(0), torch.get_num_threads())
        return y


def cache_dir() -> Path:
    root = os.environ.get("AFFINITY_SERVE_CACHE") or Path.home() / ".cache" / "affinity-serve"
    return Path(root) / "kernels"


def _cpu_signature() -> str:
    """The CPU's feature flags (the build uses -march=native), or what `platform` knows off Linux."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    flags = next((line for line in text.splitlines() if line.startswith("flags")), None)
    return flags or platform.processor() or platform.machine()


def _compiler() -> str | None:
    cc = os.environ.get("CC")
    if cc and shutil.which(cc):
        return shutil.which(cc)
    return shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def _build(cc: str, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cc, *CFLAGS, "-I", str(CSRC), *map(str, SOURCES), "-o", tmp, "-lm"],
                              capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed: {proc.stderr.strip()[-500:]}")
        os.replace(tmp, out)                       # atomic: concurrent replicas never see half a file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def _library() -> tuple[ctypes.CDLL, Path] | None:
    """The compiled library and its path, or None (with one warning) when it cannot be built or is off."""
    if os.environ.get(ENV_SWITCH, "1").lower() in ("0", "false", "no", "off"):
        logger.info("CPU C kernels disabled by %s", ENV_SWITCH)
        return None
    cc = _compiler()
    if cc is None:
        logger.warning("no C compiler found (set CC or install gcc): decode attention and the per-token ops "
                       "stay on pure torch, which is slower on CPU")
        return None
    text = "\0".join(p.read_text() for p in (*SOURCES, *HEADERS))
    key = hashlib.sha256("\0".join([text, " ".join(CFLAGS), cc, _cpu_signature(),
                                    platform.machine()]).encode()).hexdigest()[:16]
    path = cache_dir() / f"cpu_kernels-{key}.so"
    try:
        if not path.exists():
            logger.info("compiling the CPU kernels with %s ...", cc)
            _build(cc, path)
        return ctypes.CDLL(str(path)), path
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        logger.warning("CPU C kernels unavailable (%s): decode attention and the per-token ops stay on pure "
                       "torch", e)
        return None


def load() -> PagedDecodeKernel | None:
    """The paged-decode attention kernel, or None when the library cannot be built or is switched off."""
    lib = _library()
    return None if lib is None else PagedDecodeKernel(*lib)


def load_ops() -> CpuOps | None:
    """The fused per-token ops, or None when the library cannot be built or is switched off."""
    lib = _library()
    return None if lib is None else CpuOps(lib[0])
