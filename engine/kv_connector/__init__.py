"""KV connectors: move whole KV blocks between the paged pool and a tier outside it (see base.py).

`build_kv_connector(config, ...)` makes both sides from `EngineConfig.kv_connector`; this package imports
torch only inside it (the scheduler side stays torch-free).
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import TYPE_CHECKING, Any

from affinity_serve.engine.kv_groups import kv_cache_groups, num_kv_tensors
from affinity_serve.engine.kv_connector.base import (KVConnectorMetadata, KVConnectorOutput, KVConnectorScheduler,
                                      KVConnectorStats, KVConnectorUpdate, KVConnectorWorker, KVLayout,
                                      KVTransfer, PoolChanges)
from affinity_serve.engine.kv_connector.offload import OffloadConnectorScheduler
from affinity_serve.engine.kv_connector.pd import (HeldTransfers, KVTransferError, KVTransport, LocalTransport,
                                    PDConnectorScheduler, RemoteDecode, RemotePrefill, default_local_transport)
from affinity_serve.engine.kv_connector.shared import SharedConnectorScheduler
from affinity_serve.engine.kv_connector.shared_store import (GroupedSharedStore, SharedKVStore, UnsafeSharedStoreError,
                                                             check_shared_root, default_shared_root,
                                                             remove_stale_namespaces)

if TYPE_CHECKING:
    from affinity_serve.engine.config import KVConnectorConfig

__all__ = ["KVConnectorMetadata", "KVConnectorOutput", "KVConnectorScheduler", "KVConnectorStats",
           "KVConnectorUpdate", "KVConnectorWorker", "KVLayout", "KVTransfer", "PoolChanges",
           "OffloadConnectorScheduler", "SharedConnectorScheduler", "SharedKVStore", "GroupedSharedStore",
           "build_kv_connector",
           "model_identity", "model_kv_layout", "default_shared_root", "check_shared_root", "UnsafeSharedStoreError",
           "check_kv_connector", "shared_namespaces",
           "HeldTransfers", "KVTransferError", "KVTransport", "LocalTransport", "PDConnectorScheduler",
           "RemoteDecode", "RemotePrefill", "default_local_transport", "set_pd_transport"]

_DEFAULT_CAPACITY_BYTES = 1 << 30


def model_kv_layout(layer_windows: "list[int | None]", num_kv_heads: int, head_dim: int, block_size: int,
                    dtype: str, element_size: int) -> KVLayout:
    """A model's block layout: one entry per layer, or for a hybrid model (sliding-window layers) one per
    shared KV tensor, with each KV-cache group's window (see KVLayout)."""
    groups = kv_cache_groups(layer_windows)
    hybrid = any(g.window is not None for g in groups)
    return KVLayout(num_kv_tensors(groups), num_kv_heads, head_dim, block_size, dtype, element_size,
                    kv_groups=tuple(g.window for g in groups) if hybrid else ())


def capacity_blocks(config: "KVConnectorConfig", layout: KVLayout) -> int:
    if config.capacity_blocks is not None:
        return config.capacity_blocks
    budget = config.capacity_bytes if config.capacity_bytes is not None else _DEFAULT_CAPACITY_BYTES
    n = budget // layout.block_bytes
    if n < 1:
        raise ValueError(f"kv_connector.capacity_bytes {budget} holds no block of {layout.block_bytes} bytes")
    return int(n)


def model_identity(model_dir: str, override: str | None = None) -> str:
    """Names the weights a KV block was computed with: `override` if given, else a digest of the
    checkpoint's real path, config.json and its weight files' names, sizes and mtimes (cheap; equal for
    every replica on a node loading the same files, different for any other checkpoint)."""
    if override:
        return override
    real = os.path.realpath(model_dir)
    h = hashlib.sha256(real.encode())
    with open(os.path.join(real, "config.json"), "rb") as f:     # the engine has loaded it: it exists
        h.update(f.read())
    files = []
    for name in sorted(os.listdir(real)):
        if name.endswith((".safetensors", ".bin", ".pt")):
            st = os.stat(os.path.join(real, name))
            files.append((name, st.st_size, st.st_mtime_ns))
    h.update(json.dumps(files).encode())
    return h.hexdigest()[:32]


def build_kv_connector(config: "KVConnectorConfig", layout: KVLayout, *, model_identity: str, device: Any,
                       dtype: Any, enable_events: bool = False
                       ) -> tuple[KVConnectorScheduler, KVConnectorWorker] | None:
    """Both sides of the configured connector (None for type 'none'). `device`/`dtype`: torch's."""
    if config.type == "none":
        return None
    if config.type == "pd":
        return _build_pd(config, layout, model_identity, device, dtype)
    from affinity_serve.engine.kv_connector.worker import OffloadWorker, SharedStoreWorker
    n = capacity_blocks(config, layout)
    if config.type == "offload":
        problem = offload_capacity_problem(config, layout)
        if problem is not None:
            raise ValueError(problem)
        sched = OffloadConnectorScheduler(layout, n, store_on=config.store_on, load_timeout_s=config.load_timeout_s,
                                          enable_events=enable_events)
        try:
            worker = OffloadWorker(layout, n, device, dtype)
        except (MemoryError, RuntimeError) as e:      # pinned memory the driver refuses, an address space limit
            raise ValueError(f"engine.kv_connector: the offload tier of {n} blocks of {layout.block_bytes} bytes "
                             f"cannot be allocated ({type(e).__name__}: {e}); lower capacity_bytes or "
                             "capacity_blocks") from None
        return sched, worker
    if config.type == "shared":
        store = _shared_store(config, layout, model_identity, n)
        sched = SharedConnectorScheduler(layout, store, load_timeout_s=config.load_timeout_s,
                                         enable_events=enable_events, share_salted=config.share_salted_requests)
        return sched, SharedStoreWorker(layout, store, device, dtype)
    raise ValueError(f"unknown kv_connector.type {config.type!r}; use none, offload or shared")


def shared_namespaces(layout: KVLayout, identity: str) -> list[str]:
    """The store namespaces a model uses: one, or a hybrid model's one per KV-cache group."""
    groups = layout.kv_groups
    if len(groups) <= 1:
        return [layout.namespace(identity)]
    return [layout.namespace(f"{identity}|group={g}") for g in range(len(groups))]


def _shared_store(config: "KVConnectorConfig", layout: KVLayout, identity: str,
                  capacity: int) -> SharedKVStore | GroupedSharedStore:
    """The node's store; a hybrid model's has a namespace per KV-cache group, each a share of the capacity."""
    root = config.shared_dir or default_shared_root()
    namespaces = shared_namespaces(layout, identity)
    if len(namespaces) == 1:
        store: SharedKVStore | GroupedSharedStore = SharedKVStore(
            root, namespaces[0], layout.block_bytes, capacity, group=config.shared_group, fsync=config.shared_fsync)
    else:
        share = max(1, capacity // len(namespaces))
        store = GroupedSharedStore([SharedKVStore(root, ns, layout.block_bytes, share, group=config.shared_group,
                                                  fsync=config.shared_fsync) for ns in namespaces])
    if config.shared_namespace_ttl_s is not None:      # this replica's namespaces are marked in use: opened
        remove_stale_namespaces(root, namespaces, config.shared_namespace_ttl_s)
    return store


def machine_memory_bytes() -> int | None:
    """This machine's physical memory (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def offload_capacity_problem(config: "KVConnectorConfig", layout: KVLayout) -> str | None:
    """Why an offload tier of this size cannot be allocated (more than the machine's memory), naming the
    key that sized it; None if it may fit. Each replica holds its own tier in host memory."""
    n = capacity_blocks(config, layout)
    need = n * layout.block_bytes
    have = machine_memory_bytes()
    if have is None or need <= have:
        return None
    key = ("capacity_blocks" if config.capacity_blocks is not None
           else "capacity_bytes" if config.capacity_bytes is not None else "capacity_bytes (default 1 GiB)")
    return (f"engine.kv_connector.{key}: an offload tier of {n} blocks of {layout.block_bytes} bytes "
            f"({need / 2**30:.1f} GiB) is more than this machine's memory ({have / 2**30:.1f} GiB); each replica "
            "holds its own tier in host memory: lower it")


def check_kv_connector(engine_config: Any, model_args: Any, model_dir: str | None = None) -> list[str]:
    """Before replicas start: what would make every replica fail at start-up because of
    `engine.kv_connector`, as one-line messages naming the key (empty: nothing found). Checks the shared
    store's root and this model's namespace directories (the same checks a replica makes, creating
    nothing) and that an offload tier fits in this machine's memory.

    `engine_config`: the EngineConfig; `model_args`: `validate_checkpoint(...)`'s result; `model_dir`: the
    local checkpoint directory (default `engine_config.model`; the namespace check is skipped if it is not
    a directory)."""
    config = engine_config.kv_connector
    if config.type not in ("offload", "shared"):
        return []
    if config.type == "shared":
        root = config.shared_dir or default_shared_root()
        try:
            check_shared_root(root, config.shared_group)
        except UnsafeSharedStoreError as e:
            return [f"engine.kv_connector.shared_dir: {e}"]
    layout = _layout_for(engine_config, model_args)
    if config.type == "offload":
        problem = offload_capacity_problem(config, layout)
        return [problem] if problem else []
    model_dir = model_dir or engine_config.model
    if not model_dir or not os.path.isdir(model_dir):
        return []
    from affinity_serve.engine.kv_connector.shared_store import check_namespace_dir
    identity = model_identity(model_dir, config.model_identity)
    problems = []
    for ns in shared_namespaces(layout, identity):
        try:
            check_namespace_dir(root, ns, config.shared_group)
        except UnsafeSharedStoreError as e:
            problems.append(f"engine.kv_connector.shared_dir: {e}")
    return problems


def _layout_for(engine_config: Any, model_args: Any) -> KVLayout:
    """The KV layout a replica would build (engine/build.py), from the configured dtype and device."""
    import torch

    from affinity_serve.engine.build import pick_device, pick_dtype
    dtype = pick_dtype(engine_config.dtype, pick_device(engine_config.device))
    return model_kv_layout(model_args.layer_windows, model_args.num_kv_heads, model_args.head_dim,
                           engine_config.cache.block_size, str(dtype).removeprefix("torch."),
                           torch.empty((), dtype=dtype).element_size())


def _build_pd(config: "KVConnectorConfig", layout: KVLayout, identity: str, device: Any, dtype: Any
              ) -> tuple[PDConnectorScheduler, KVConnectorWorker]:
    """Both sides of P/D disaggregation, joined to the process's LocalTransport until an app sets its own
    (`set_pd_transport`)."""
    import uuid

    from affinity_serve.engine.kv_connector.pd_worker import PDWorker
    engine_id = config.engine_id or f"engine-{uuid.uuid4().hex[:12]}"
    held = HeldTransfers(config.transfer_timeout_s)
    transport = default_local_transport()
    sched = PDConnectorScheduler(layout, layout.namespace(identity), engine_id, held,
                                 load_timeout_s=config.load_timeout_s, transport=transport)
    worker = PDWorker(layout, held, transport, device, dtype, read_timeout_s=config.load_timeout_s)
    transport.register(engine_id, worker)
    return sched, worker


def set_pd_transport(sched: PDConnectorScheduler, worker: Any, transport: KVTransport) -> None:
    """Move a P/D engine's reads to `transport` (the app's Ray transport); it leaves the LocalTransport."""
    default_local_transport().unregister(sched.engine_id)
    bind = getattr(transport, "bind", None)
    if bind is not None:          # a transport that needs its engine's KV tensors and holds (NIXL)
        bind(sched, worker)
    sched.transport = transport
    worker.transport = transport
