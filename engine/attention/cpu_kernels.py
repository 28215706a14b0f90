"""Small C kernels for the CPU path, compiled on first use with the system C compiler and loaded by ctypes.

Why C: decode attention on CPU is memory-bound, and the pure-torch path has to copy every request's
pages into a dense tensor (index_select) before two batched GEMMs read them again. The kernel in
engine/csrc/paged_decode.c reads the pages in place, once. It needs no torch headers, so it builds in
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

SOURCE = Path(__file__).resolve().parents[1] / "csrc" / "paged_decode.c"
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
        proc = subprocess.run([cc, *CFLAGS, str(SOURCE), "-o", tmp, "-lm"], capture_output=True, text=True,
                              timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed: {proc.stderr.strip()[-500:]}")
        os.replace(tmp, out)                       # atomic: concurrent replicas never see half a file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def load() -> PagedDecodeKernel | None:
    """The compiled kernel, or None (with one warning) when it cannot be built or is switched off."""
    if os.environ.get(ENV_SWITCH, "1").lower() in ("0", "false", "no", "off"):
        logger.info("CPU C kernels disabled by %s", ENV_SWITCH)
        return None
    cc = _compiler()
    if cc is None:
        logger.warning("no C compiler found (set CC or install gcc): decode attention stays on pure torch, "
                       "which is slower on CPU")
        return None
    key = hashlib.sha256("\0".join([SOURCE.read_text(), " ".join(CFLAGS), cc, _cpu_signature(),
                                    platform.machine()]).encode()).hexdigest()[:16]
    path = cache_dir() / f"paged_decode-{key}.so"
    try:
        if not path.exists():
            logger.info("compiling the CPU paged-decode kernel with %s ...", cc)
            _build(cc, path)
        return PagedDecodeKernel(ctypes.CDLL(str(path)), path)
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        logger.warning("CPU paged-decode kernel unavailable (%s): decode attention stays on pure torch", e)
        return None
