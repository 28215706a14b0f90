"""What moving a prefilled request's KV costs, per transport, on this machine's device (issue 28).

Two engines' KV pools of a model's shape (`--layout demo` or `llama3-8b`: 32 layers, 8 KV heads of 128, bf16 on
CUDA / float32 on CPU, 16-token blocks) are allocated on the device (no model runs); for n held blocks it times,
median of `--reps`:
- `nixl`: the decode side's NIXL READ of the blocks straight out of the prefill pool into its staging area, then
  the scatter into its own pool (NixlTransport, engine/kv_connector/nixl.py), until the blocks are in place;
- `host copy`: what the Ray transport does on the devices: gather the blocks into host memory on the prefill side
  and scatter them from host memory into the decode pool (PDWorker; Ray's put/get between them is left out, so
  this baseline is a lower bound on that path);
- `device copy`: one copy of the same bytes within the device (the floor: a gather from one pool into another).
Both pools are in this process, so NIXL's UCX takes its intra-process path (on one GPU: CUDA IPC or a device
copy); across GPUs or hosts the link sets the rate. Ratios are against the host-copy path.

    python -m benchmarks.kv_transfer [--device cuda] [--layout llama3-8b] [--blocks 16,64,256] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

LAYOUTS = {"demo": (4, 2, 64), "llama3-8b": (32, 8, 128)}       # layers, kv heads, head dim
BLOCK = 16


def _pools(layout: str, device: torch.device, dtype: torch.dtype, num_blocks: int):
    from affinity_serve.engine.attention.torch_paged import TorchPagedAttention
    from affinity_serve.engine.kv_connector.base import KVLayout
    from affinity_serve.engine.kv_connector.worker import block_view_permutation
    layers, heads, dim = LAYOUTS[layout]
    shape = TorchPagedAttention.kv_cache_shape(num_blocks, BLOCK, heads, dim)
    perm = block_view_permutation(TorchPagedAttention.kv_cache_shape)
    kv_layout = KVLayout(layers, heads, dim, BLOCK, str(dtype).removeprefix("torch."),
                         torch.empty((), dtype=dtype).element_size())
    make = lambda: [torch.randn(shape, device=device).to(dtype) for _ in range(layers)]  # noqa: E731
    return make(), make(), perm, kv_layout


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(layout: str, device: torch.device, blocks: list[int], reps: int) -> list[dict]:
    from affinity_serve.engine.kv_connector.nixl import NixlTransport
    from affinity_serve.engine.kv_connector.pd import HeldTransfers, RemotePrefill, RemoteRead
    from affinity_serve.engine.kv_connector.pd_worker import PDWorker
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    num_blocks = max(blocks) * 2 + 1
    p_caches, d_caches, perm, kv_layout = _pools(layout, device, dtype, num_blocks)
    tp, td = NixlTransport(), NixlTransport(staging_bytes=max(blocks) * kv_layout.block_bytes + 4096)
    workers = []
    for caches, t in ((p_caches, tp), (d_caches, td)):
        w = PDWorker(kv_layout, HeldTransfers(60.0), t, device, dtype, read_timeout_s=60.0)
        w.register_kv_caches(caches, perm)
        t.bind(None, w)
        workers.append(w)
    pw, dw = workers
    rows = []
    try:
        for n in blocks:
            src = list(range(1, n + 1))
            dst = list(range(num_blocks - n, num_blocks))
            nbytes = n * kv_layout.block_bytes
            times: dict[str, list[float]] = {"nixl": [], "host copy": [], "device copy": []}
            for k in range(reps + 1):                          # the first round warms up (registration, JIT)
                tid = f"b{n}-{k}"
                pw.held.hold(tid, src)
                addr = tp.hold_address(tid, src, 60.0)
                remote = RemotePrefill("p", tid, "x", n * BLOCK, n, 0, address=addr)
                _sync(device)
                t0 = time.perf_counter()
                h = td.start_read(remote, 0, n)
                while (data := h.poll()) is None:
                    time.sleep(0)              # yield: the agents' progress may need another thread
                data.scatter_into(dw.copier, dst)
                _sync(device)
                t_nixl = time.perf_counter() - t0
                ax = perm[0]
                for i in (0, len(p_caches) - 1):       # the blocks arrived where they belong, bit for bit
                    assert torch.equal(d_caches[i].select(ax, dst[-1]), p_caches[i].select(ax, src[-1]))
                    assert torch.equal(d_caches[i].select(ax, dst[0]), p_caches[i].select(ax, src[0]))
                tid2 = tid + "-h"
                pw.held.hold(tid2, src)
                t0 = time.perf_counter()
                host = pw.read_held_blocks(tid2, 0, n)
                dw._land(RemoteRead(tid2, dst, [], remote=remote), host)
                _sync(device)
                t_host = time.perf_counter() - t0
                t0 = time.perf_counter()
                ids_s = torch.tensor(src, device=device)
                ids_d = torch.tensor(dst, device=device)
                for pc, dc in zip(p_caches, d_caches):
                    dc.index_copy_(perm[0], ids_d, pc.index_select(perm[0], ids_s))
                _sync(device)
                t_dev = time.perf_counter() - t0
                if k:
                    times["nixl"].append(t_nixl)
                    times["host copy"].append(t_host)
                    times["device copy"].append(t_dev)
                pw.held.take_finished()
            base = statistics.median(times["host copy"])
            for path, ts in times.items():
                s = statistics.median(ts)
                rows.append({"path": path, "layout": layout, "device": str(device), "blocks": n,
                             "block_bytes": kv_layout.block_bytes, "request_s": s, "per_block_us": s / n * 1e6,
                             "GB_s": nbytes / s / 1e9, "vs_host_copy": s / base})
                print(f"[kv_transfer] {layout} {n} blocks: {path} {s * 1e3:.3f} ms", file=sys.stderr, flush=True)
    finally:
        tp.close()
        td.close()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--layout", default=None, choices=sorted(LAYOUTS),
                    help="default: llama3-8b on CUDA, demo on CPU")
    ap.add_argument("--blocks", default="16,64,256", help="comma list of blocks per request")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    try:
        blocks = [int(x) for x in args.blocks.split(",")]
        if not blocks or min(blocks) < 1:
            raise ValueError
    except ValueError:
        ap.error(f"--blocks: a comma list of positive integers, not {args.blocks!r}")
    if args.reps < 1:
        ap.error("--reps must be at least 1")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        ap.error(f"--device: cpu or cuda (or cuda:N), not {args.device!r}")
    if device.type not in ("cpu", "cuda"):
        ap.error(f"--device: cpu or cuda (or cuda:N), not {args.device!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here")
    from affinity_serve.engine.kv_connector.nixl import nixl_available
    if not nixl_available():
        ap.error("NIXL's Python package is not installed (pip install 'affinity-serve[nixl]')")
    layout = args.layout or ("llama3-8b" if device.type == "cuda" else "demo")
    if args.json:
        try:
            open(args.json, "a").close()         # fail now, not after the run
        except OSError as e:
            ap.error(f"--json: cannot write {args.json!r}: {e}")
    rows = run(layout, device, blocks, args.reps)
    print(f"\n{'path':<12} {'layout':<10} {'blocks':>6} {'block B':>9} {'request ms':>10} {'us/block':>9} "
          f"{'GB/s':>7} {'vs host':>8}")
    for r in rows:
        print(f"{r['path']:<12} {r['layout']:<10} {r['blocks']:6d} {r['block_bytes']:9d} {r['request_s'] * 1e3:10.3f} "
              f"{r['per_block_us']:9.2f} {r['GB_s']:7.2f} {r['vs_host_copy']:7.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
