"""Engine configuration: pydantic models with `extra="forbid"`; each part gets only its own section."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class CacheConfig(_Strict):
    """Paged KV cache: block size, and either an explicit block count or a memory budget."""

    block_size: int = Field(16, ge=1, le=4096, description="tokens per KV block")
    num_blocks: int | None = Field(None, ge=2, description="explicit block count (incl. the null block)")
    memory_budget_bytes: int | None = Field(
        None, ge=1, description="size the pool from this many bytes when num_blocks is unset "
                                "(unset too: 80% of free GPU memory, or 512 MiB on CPU)")
    enable_prefix_caching: bool = Field(True, description="reuse cached KV blocks of identical prompt prefixes")
    enable_kv_cache_events: bool = Field(
        False, description="record block stored/removed events (serving replicas always do)")
    kv_event_buffer_blocks: int = Field(
        100_000, ge=1, description="the async engine keeps its latest KV events for pulling routers up to this "
                                   "many block hashes (about 200 bytes each); a router further behind resyncs "
                                   "from a snapshot")
    prefix_cache_recent_requests: int = Field(
        1000, ge=1, description="the recent prefix-cache hit rate (stats, metrics) covers this many latest "
                                "admissions; the lifetime totals are kept too")


class SchedulerConfig(_Strict):
    """Token-budget scheduler (vLLM v1 model)."""

    max_num_batched_tokens: int = Field(2048, ge=1, description="token budget per step")
    max_num_seqs: int = Field(128, ge=1, description="max running requests")
    long_prefill_token_threshold: int | None = Field(
        None, ge=1, description="cap one request's prefill chunk per step (None = no cap)")
    enable_chunked_prefill: bool = Field(True, description="split long prefills over several steps")
    policy: Literal["fcfs", "priority"] = Field(
        "fcfs", description="fcfs | priority (lower `priority` first; preempts the worst)")


class KVConnectorConfig(_Strict):
    """A tier below the paged KV pool (engine/kv_connector): none, a per-replica offload tier, or the
    node-shared store."""

    type: Literal["none", "offload", "shared", "pd"] = Field(
        "none", description="none | offload (host-memory tier per replica) | shared (one store per node, "
                            "every replica on the node reads and writes it) | pd (prefill/decode "
                            "disaggregation: hold a prefill's KV for a decode engine, read one's; "
                            "docs/disaggregation.md)")
    capacity_blocks: int | None = Field(None, ge=1, description="tier capacity in KV blocks, or ...")
    capacity_bytes: int | None = Field(None, ge=1, description="... in bytes; both unset: 1 GiB")
    store_on: Literal["evict", "finish"] = Field(
        "evict", description="offload: save a cached block when the pool evicts it (evict), or a request's "
                             "blocks when it ends (finish)")
    shared_dir: str | None = Field(
        None, description="shared: the store's directory (default /dev/shm/affinity-serve-kv-<uid>); replicas "
                          "share blocks when they name the same one. It must be owned by the serving user and "
                          "not writable by others (docs/kv-store-safety.md)")
    shared_group: str | None = Field(
        None, description="shared: share the store with this group's members (a name or gid): directories "
                          "02770, files 0660; unset: private to the serving user (0700 / 0600)")
    shared_fsync: bool = Field(
        False, description="shared: fsync each block file before it appears (for a disk-backed shared_dir; "
                           "tmpfs needs none, and a torn file fails its checksum and is recomputed)")
    shared_namespace_ttl_s: float | None = Field(
        7 * 86400.0, ge=3600.0, description="shared: at start-up a replica removes the namespace directories under "
        "shared_dir that no replica has read or written for this long (what a model no longer served leaves "
        "behind: other weights, dtype or block size); null keeps them. Default 7 days; at least 1 hour (a replica "
        "that only reads marks its namespace in use every 10 minutes)")
    share_salted_requests: bool = Field(
        True, description="shared: requests with a cache_salt use the store too (their blocks live under "
                          "salted hashes no other tenant can match); false keeps them to the replica's own pool")
    model_identity: str | None = Field(
        None, description="names the weights in tier keys (default: a digest of the checkpoint's path, "
                          "config.json and weight files)")
    load_timeout_s: float = Field(30.0, gt=0, description="a load not done by then is abandoned: recompute")
    transfer_timeout_s: float = Field(
        30.0, gt=0, description="pd: a prefilled request's KV blocks are held for a decode engine until it has "
                                "read them or this many seconds have passed since the prefill finished")
    engine_id: str | None = Field(
        None, description="pd: this engine's name in its transfers (default: a random one per engine)")

    @model_validator(mode="after")
    def _check(self) -> "KVConnectorConfig":
        if self.capacity_blocks is not None and self.capacity_bytes is not None:
            raise ValueError("set either kv_connector.capacity_blocks or kv_connector.capacity_bytes, not both")
        return self


class PaceConfig(_Strict):
    """Hold every engine step to a modelled accelerator's step time (engine/pacing.py has the model). The
    real model still computes the tokens; the step then waits out the rest of the modelled time. For running
    scaling and routing experiments on CPU machines with replicas that each add capacity like one GPU each;
    off by default, and a step that computes slower than the model is not sped up."""

    enabled: bool = Field(False, description="pace steps to the modelled device (testing only; it only slows "
                                             "a replica down)")
    step_base_s: float = Field(0.0, ge=0, description="fixed cost of every step (weights read once)")
    prefill_per_token_s: float = Field(0.0, ge=0, description="per prompt token computed in the step")
    decode_per_context_token_s: float = Field(0.0, ge=0, description="per context token of each decoding sequence")

    @model_validator(mode="after")
    def _check(self) -> "PaceConfig":
        if self.enabled and not (self.step_base_s or self.prefill_per_token_s or self.decode_per_context_token_s):
            raise ValueError("pace.enabled needs a step time: set pace.step_base_s, pace.prefill_per_token_s "
                             "or pace.decode_per_context_token_s above 0")
        return self


class EngineConfig(_Strict):
    """Everything one engine (one replica) needs."""

    model: str = Field(..., description="a local Hugging Face checkpoint directory, or a hub id org/name[@revision] "
                                        "fetched into the Hugging Face cache (HF_HOME, HF_TOKEN and "
                                        "HF_HUB_OFFLINE honoured; see docs/models.md)")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="auto: float32 on CPU, bfloat16 on GPU")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: cuda when available, else cpu")
    attention_backend: Literal["auto", "torch", "triton", "flash"] = Field(
        "auto", description="auto: flash (CUDA + flash-attn + block_size a multiple of 256), else triton on "
                            "CUDA, else torch")
    linear_backend: Literal["auto", "torch", "onednn", "hybrid"] = Field(
        "auto", description="CPU GEMMs: 'onednn' prepacks weights once (faster decode at 3+ rows), 'hybrid' also "
                            "keeps the plain weights for 1-2 row steps (faster batch-1 decode, twice the Linear "
                            "weights' memory), 'torch' uses F.linear; auto picks hybrid for float32 on CPU when "
                            "the torch build has oneDNN and the plain copy costs <= 1 GiB, else onednn")
    max_model_len: int | None = Field(None, ge=2, description="defaults to the model's max positions")
    seed: int = Field(0, description="seeds the sampler for requests that bring no `seed` of their own")
    num_threads: int | None = Field(None, ge=1, description="torch intra-op threads on CPU")
    enforce_eager: bool = Field(
        False, description="CUDA: run every step eagerly; by default decode-only steps replay CUDA graphs "
                           "captured at start-up for batch sizes up to scheduler.max_num_seqs (<= 256), with the "
                           "triton attention backend")
    overlap_decode: bool = Field(
        True, description="with CUDA-graph decode: a decode step launches the next one on the GPU from its "
                          "sampled ids (still on the device) before the host has them, so the host's per-step work "
                          "overlaps the GPU's; a step that turns out different (a stop token, an arrival) is thrown "
                          "away. Not with a kv_connector")
    cascade_min_tokens: int | None = Field(
        64, ge=1, description="cascade decode: when every request of a decode batch shares at least this many "
                              "leading tokens in the same KV pages (a common system prompt hit in the prefix "
                              "cache), attention reads them once for the whole batch instead of once per request "
                              "(torch and triton backends; with CUDA graphs a cascade graph is captured per size); "
                              "null turns it off")
    cpu_kernels: bool = Field(
        True, description="compile (once, with the system C compiler) and use the C paged-decode attention "
                          "kernel and, in float32, the C fused per-token ops (add + RMSNorm, RoPE, SiLU * up) on "
                          "CPU; falls back to pure torch when no compiler is found")
    skip_tokenizer_init: bool = Field(
        False, description="token ids only: load no tokenizer (none is needed in the checkpoint), return no "
                           "text, reject text prompts and chat messages (vLLM's name)")
    generation_config: Literal["auto", "ignore"] = Field(
        "auto", description="auto: the checkpoint's generation_config.json supplies temperature, top_p, top_k, "
                            "min_p and repetition_penalty where a request leaves them unset (vLLM's "
                            "--generation-config auto); ignore: the neutral defaults (1.0, 1.0, none, 0.0, 1.0). "
                            "Its EOS ids are honoured either way")
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    kv_connector: KVConnectorConfig = KVConnectorConfig()
    pace: PaceConfig = PaceConfig()

    @model_validator(mode="after")
    def _check(self) -> "EngineConfig":
        if self.cache.num_blocks is not None and self.cache.memory_budget_bytes is not None:
            raise ValueError("set either cache.num_blocks or cache.memory_budget_bytes, not both")
        if self.kv_connector.type != "none" and not self.cache.enable_prefix_caching:
            raise ValueError("kv_connector needs cache.enable_prefix_caching: loaded blocks are reused as prefix hits")
        return self
