"""A vLLM KV connector (v1 API, producer role): each prefilled request's KV streams to a decode-node
layer by layer, during the prefill's forward pass.

vLLM loads it by module path:

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "DecodeNodeConnector",
        "kv_connector_module_path": "decode_node_client.vllm_connector", "kv_role": "kv_producer",
        "kv_connector_extra_config": {"target": "decode-0:50051"}}'

A request opts in with `kv_transfer_params={"decode_node_request_id": "r1"}` (and optionally
`"decode_node_target"` to send it to another node than the configured one, and
`"decode_node_reuse_prefix"` to override the configured `reuse_prefix`), and runs with
`max_tokens=1`; the orchestrator then calls `Generate("r1")` on that node. The scheduler side
tracks which prompt tokens each step computes (chunked prefill included) and, when the request
finishes, the token it sampled; the worker side gathers those tokens out of the paged cache in
`save_kv_layer` and pushes them with a `PushStream`, committing with the sampled token on the next
step (`has_pending_push_work` keeps the engine stepping until then).

`kv_connector_extra_config` keys: `target` (host:port), `token` or `token_file` (bearer token),
`ca_cert`, `client_cert`, `client_key`, `domain` (TLS, as `channel()`), `layout` (the paged
cache's, see `gather_paged`: `auto`, the default, tells them apart by shape and platform;
`flash_attn_hnd` must be named),
`commit_timeout_s` (30), `reuse_prefix` (false): ask the node to keep what its prefix cache holds
of the prompt's start (`decode-node serve --prefix-cache-bytes`); those tokens, whole blocks of an
earlier request's prompt and output, are then neither gathered nor sent, so a conversation's next
turn pushes only its new tokens. The first layer's push waits for the header's acknowledgement
(one round trip per request) to learn how many.

Tensor parallelism: each worker rank opens its own stream of the request's push
(`KvHeader.num_streams`) and pushes the KV heads it holds; the node assembles them and commits when
every rank has. Where there are more ranks than KV heads (heads replicated), one rank per head
pushes. Not supported yet: pipeline parallelism above 1, and a preempted prefill (its push is
aborted; the decode side then finds no KV and the orchestrator retries).
The module imports without vLLM, so it is tested by driving its methods as vLLM calls them.
"""
from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import grpc

from . import DecodeNodeError, PushStream, channel, gather_paged, model_info

try:  # vLLM present: the real base classes, so vLLM's checks of the connector pass.
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                                      KVConnectorRole)
    _VLLM = True
except ImportError:  # pragma: no cover - exercised where vLLM is installed
    _VLLM = False

    class KVConnectorBase_V1:  # type: ignore[no-redef]
        """Stand-in for vLLM's base (metadata binding only), so the module works without vLLM."""

        def __init__(self, vllm_config, role, kv_cache_config=None):
            self._connector_metadata = None

        def bind_connector_metadata(self, connector_metadata) -> None:
            self._connector_metadata = connector_metadata

        def clear_connector_metadata(self) -> None:
            self._connector_metadata = None

        def _get_connector_metadata(self):
            return self._connector_metadata

    class KVConnectorMetadata:  # type: ignore[no-redef]
        pass

    class KVConnectorRole(enum.Enum):  # type: ignore[no-redef]
        SCHEDULER = 0
        WORKER = 1

log = logging.getLogger(__name__)


def _flag(value: Any, name: str) -> bool:
    """A boolean setting given as a bool or as JSON/CLI text would give it."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"{name}: expected a boolean, got {value!r}")


def _detect_layout(shape: Tuple[int, ...]) -> str:
    """The paged cache's layout (see `gather_paged`) from its shape and the platform vLLM runs on.

    vLLM before its [B, H, N, C] per-layer views hands 5-d caches: [2, B, ...] is FlashAttention's
    (token-major; `flash_attn_hnd` must be configured by name), [B, 2, ...] FlashInfer's. A 4-d
    cache is the [B, H, N, C] view: on vLLM's CPU backend each block is packed for the kernel that
    backend picked (resolved per layer, `_cpu_layout`), elsewhere each token's row holds its key
    then its value."""
    if len(shape) == 5:
        return "flashinfer" if shape[1] == 2 and shape[0] != 2 else "flash_attn"
    if len(shape) == 4:
        try:
            from vllm.platforms import current_platform
            on_cpu = bool(current_platform.is_cpu())
        except ImportError:
            on_cpu = False
        return _CPU_BY_ISA if on_cpu else "vllm_bhnc"
    raise ValueError(f"no known paged KV layout has shape {shape}")


# vLLM's CPU backend packs a block by the kernel it picked (the attention layer's `isa`), so that
# layout is resolved per layer when it is first saved.
_CPU_BY_ISA = "vllm_cpu_by_isa"
_CPU_LAYOUTS = {"vec": "vllm_cpu", "vec16": "vllm_cpu", "amx": "vllm_cpu_amx"}


def _cpu_layout(vllm_config, layer_name: str) -> str:
    layers = getattr(getattr(vllm_config, "compilation_config", None), "static_forward_context", None) or {}
    isa = getattr(layers.get(layer_name), "isa", None)
    if isa not in _CPU_LAYOUTS:
        raise ValueError(f"layer {layer_name}: vLLM's CPU attention kernel {isa!r} packs KV in a layout this "
                         f"connector does not read (known: {', '.join(_CPU_LAYOUTS)})")
    return _CPU_LAYOUTS[isa]


def _tp_rank() -> int:
    """This worker's tensor-parallel rank (vLLM's parallel state; 0 without vLLM)."""
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
    except ImportError:
        return 0
    return int(get_tensor_model_parallel_rank())

__all__ = ["DecodeNodeConnector", "DecodeNodeConnectorMetadata", "PUSH_ID", "PUSH_REUSE", "PUSH_TARGET"]

# Keys of a request's kv_transfer_params.
PUSH_ID = "decode_node_request_id"
PUSH_TARGET = "decode_node_target"
PUSH_REUSE = "decode_node_reuse_prefix"


@dataclass
class SaveSpec:
    """Prompt tokens [start, end) of one request, computed in this step, to push from its blocks."""
    req_id: str
    push_id: str
    target: str
    prompt_token_ids: List[int]
    block_ids: List[int]
    start: int
    end: int
    reuse_prefix: bool = False


@dataclass
class DecodeNodeConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> worker, once per step (picklable)."""
    saves: List[SaveSpec] = field(default_factory=list)
    # (vLLM request id, the token its prefill sampled)
    commits: List[Tuple[str, int]] = field(default_factory=list)
    aborts: List[str] = field(default_factory=list)


@dataclass
class _Tracked:
    push_id: str
    target: str
    prompt: List[int]
    reuse_prefix: bool = False
    blocks: List[int] = field(default_factory=list)
    pushed_to: int = 0  # prompt tokens scheduled for pushing so far


class DecodeNodeConnector(KVConnectorBase_V1):
    """Producer-side KV connector pushing prefills to decode-node (see the module's doc)."""

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        self._role_ = role
        self._vllm_config = vllm_config
        extra: Dict[str, Any] = dict(getattr(vllm_config.kv_transfer_config, "kv_connector_extra_config", None) or {})
        self._target: Optional[str] = extra.get("target")
        token = extra.get("token")
        if token is None and extra.get("token_file"):
            with open(extra["token_file"]) as f:
                token = f.read().strip()
        self._token: Optional[str] = token
        self._tls = {k: extra[k] for k in ("ca_cert", "client_cert", "client_key", "domain") if k in extra}
        self._layout: str = extra.get("layout", "auto")
        self._commit_timeout = float(extra.get("commit_timeout_s", 30))
        self._reuse_prefix = _flag(extra.get("reuse_prefix", False), "reuse_prefix")
        parallel = getattr(vllm_config, "parallel_config", None)
        self._tp = int(getattr(parallel, "tensor_parallel_size", 1) or 1)
        if int(getattr(parallel, "pipeline_parallel_size", 1) or 1) != 1:
            raise ValueError("DecodeNodeConnector does not support pipeline_parallel_size above 1 yet")
        model = getattr(vllm_config, "model_config", None)
        total = getattr(model, "get_total_num_kv_heads", None)
        self._total_heads: Optional[int] = int(total()) if callable(total) else None
        # Scheduler side.
        self._tracked: Dict[str, _Tracked] = {}
        self._commits: List[Tuple[str, int]] = []
        self._aborts: List[str] = []
        # Worker side.
        self._layers: Dict[str, int] = {}
        self._layer_layouts: Dict[str, str] = {}
        self._heads = self._head_dim = 0
        # This rank's KV heads: [head_start, head_start + local heads) of the model's total.
        self._head_start = 0
        self._streams_per_push = 1
        self._pushes = True
        self._streams: Dict[str, PushStream] = {}
        self._failed: set = set()  # requests whose push could not start: not retried per layer
        self._channels: Dict[str, grpc.Channel] = {}
        self._node_info: Dict[str, Tuple[str, int]] = {}

    # ---- scheduler side ----

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> Tuple[int, bool]:
        return 0, False  # a producer loads nothing

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        params = getattr(request, "kv_transfer_params", None) or {}
        push_id = params.get(PUSH_ID)
        if not push_id or request.request_id in self._tracked:
            return
        target = params.get(PUSH_TARGET) or self._target
        if not target:
            log.warning("request %s asks for a push but no decode-node target is configured", request.request_id)
            return
        reuse = _flag(params.get(PUSH_REUSE, self._reuse_prefix), PUSH_REUSE)
        self._tracked[request.request_id] = _Tracked(str(push_id), target, list(request.prompt_token_ids), reuse)

    def build_connector_meta(self, scheduler_output) -> DecodeNodeConnectorMetadata:
        meta = DecodeNodeConnectorMetadata(commits=self._commits, aborts=self._aborts)
        self._commits, self._aborts = [], []
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            t = self._tracked.get(new.req_id)
            if t is not None:
                t.blocks = list(new.block_ids[0])
                self._save(meta, new.req_id, t, new.num_computed_tokens, scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            t = self._tracked.get(req_id)
            if t is None:
                continue
            if req_id in getattr(cached, "resumed_req_ids", ()):
                # Preempted mid-prefill: what was pushed may be recomputed differently.
                log.warning("request %s was preempted during its prefill; its push is aborted", req_id)
                del self._tracked[req_id]
                meta.aborts.append(req_id)
                continue
            new_blocks = cached.new_block_ids[i]
            if new_blocks:
                t.blocks.extend(new_blocks[0])
            self._save(meta, req_id, t, cached.num_computed_tokens[i], scheduled.get(req_id, 0))
        return meta

    @staticmethod
    def _save(meta: DecodeNodeConnectorMetadata, req_id: str, t: _Tracked, computed: int, scheduled: int) -> None:
        end = min(computed + scheduled, len(t.prompt))
        start = max(computed, t.pushed_to)
        if end > start:
            meta.saves.append(SaveSpec(req_id, t.push_id, t.target, t.prompt, list(t.blocks), start, end,
                                       t.reuse_prefix))
            t.pushed_to = end

    def request_finished(self, request, block_ids) -> Tuple[bool, Optional[Dict[str, Any]]]:
        t = self._tracked.pop(request.request_id, None)
        if t is None:
            return False, None
        out = list(getattr(request, "output_token_ids", ()) or ())
        if t.pushed_to == len(t.prompt) and out:
            self._commits.append((request.request_id, int(out[0])))
        else:
            self._aborts.append(request.request_id)
        # The KV was copied to the host as each layer was pushed: the blocks can go now.
        return False, {PUSH_ID: t.push_id, PUSH_TARGET: t.target}

    def has_pending_push_work(self) -> bool:
        return bool(self._commits or self._aborts)

    # ---- worker side ----

    def register_kv_caches(self, kv_caches) -> None:
        self._layers = {name: i for i, name in enumerate(kv_caches)}
        self._layer_layouts = {}
        first = next(iter(kv_caches.values()))
        shape = tuple(first.shape)
        if self._layout == "auto":
            self._layout = _detect_layout(shape)
        if self._layout == "flash_attn_hnd" and len(shape) == 5:
            local, self._head_dim = shape[2], shape[4]
        elif self._layout in ("flash_attn", "flashinfer") and len(shape) == 5:
            local, self._head_dim = shape[3], shape[4]
        elif self._layout in ("vllm_bhnc", "vllm_cpu", "vllm_cpu_amx", _CPU_BY_ISA) and len(shape) == 4:
            local, self._head_dim = shape[1], shape[3] // 2
        else:
            raise ValueError(f"layout {self._layout!r} does not fit a KV cache of shape {shape}")
        self._heads = self._total_heads or local * self._tp
        rank = _tp_rank()
        if self._heads >= self._tp:
            # Heads split evenly across the ranks.
            self._head_start, self._streams_per_push, self._pushes = rank * local, self._tp, True
        else:
            # Each head on tp / heads ranks: the first of them pushes it.
            per_head = self._tp // self._heads
            self._head_start, self._streams_per_push = rank // per_head, self._heads
            self._pushes = rank % per_head == 0

    def _channel(self, target: str) -> grpc.Channel:
        if target not in self._channels:
            self._channels[target] = channel(target, **self._tls)
        return self._channels[target]

    def start_load_kv(self, forward_context, **kwargs) -> None:
        meta = self._get_connector_metadata()
        if meta is None:
            return
        for req_id, first in meta.commits:
            self._failed.discard(req_id)
            s = self._streams.pop(req_id, None)
            if s is None:
                continue
            try:
                s.commit(next_token_id=first, timeout=self._commit_timeout)
            except (DecodeNodeError, RuntimeError) as e:
                log.warning("push of request %s did not commit: %s", req_id, e)
        for req_id in meta.aborts:
            self._failed.discard(req_id)
            s = self._streams.pop(req_id, None)
            if s is not None:
                s.abort()
        # Open this step's new pushes now where vLLM calls this before the forward (older vLLM,
        # or a step with synchronous loads), so the header's round trip overlaps the first layer;
        # vLLM 0.32 calls it after the forward, and `save_kv_layer` opens them itself.
        for save in meta.saves:
            self._stream(save)

    def _stream(self, save: SaveSpec) -> Optional[PushStream]:
        """The push stream of `save`'s request, opened on first use (None: this rank does not push,
        or the node could not be reached, which was logged once)."""
        if not self._pushes:
            return None
        s = self._streams.get(save.req_id)
        if s is not None or save.req_id in self._failed:
            return s
        try:
            ch = self._channel(save.target)
            if save.target not in self._node_info:
                info = model_info(ch, self._token)
                self._node_info[save.target] = (info.model_id, info.kv_dtype)
            model_id, dtype = self._node_info[save.target]
            s = self._streams[save.req_id] = PushStream(
                ch, save.push_id, save.prompt_token_ids, num_layers=len(self._layers),
                num_kv_heads=self._heads, head_dim=self._head_dim, model_id=model_id, dtype=dtype,
                token=self._token, num_streams=self._streams_per_push, reuse_prefix=save.reuse_prefix)
        except DecodeNodeError as e:
            log.warning("push of request %s could not start: %s", save.req_id, e)
            self._failed.add(save.req_id)
        return s

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        meta = self._get_connector_metadata()
        if meta is None or not meta.saves:
            return
        layer = self._layers[layer_name]
        layout = self._layout
        if layout == _CPU_BY_ISA:
            try:
                layout = self._layer_layouts.get(layer_name) or self._layer_layouts.setdefault(
                    layer_name, _cpu_layout(self._vllm_config, layer_name))
            except ValueError as e:  # the engine runs on; its requests' pushes fail
                for save in meta.saves:
                    self._fail(save.req_id, e)
                return
        for save in meta.saves:
            s = self._stream(save)
            if s is None:
                continue
            try:
                # Tokens the node already holds (a reused prefix) are neither gathered nor sent.
                start = max(save.start, s.reused_tokens) if save.reuse_prefix else save.start
                if start >= save.end:
                    continue
                k, v = gather_paged(kv_layer, save.block_ids, start, save.end, layout=layout, keep_dtype=True)
                s.push(layer, k, v, token_start=start, head_start=self._head_start)
            except (DecodeNodeError, RuntimeError, ValueError) as e:
                self._fail(save.req_id, e)

    def _fail(self, req_id: str, error: Exception) -> None:
        """Ends a request's push (the node frees what it held); its later layers are not tried."""
        if req_id not in self._failed:
            log.warning("push of request %s failed: %s", req_id, error)
            self._failed.add(req_id)
        s = self._streams.pop(req_id, None)
        if s is not None:
            s.abort()

    def wait_for_save(self) -> None:
        return  # each layer's tokens were copied to the host by save_kv_layer

    def get_finished(self, finished_req_ids) -> Tuple[Optional[set], Optional[set]]:
        return None, None

    def shutdown(self) -> None:
        for s in self._streams.values():
            s.abort()
        self._streams.clear()
        for ch in self._channels.values():
            ch.close()
        self._channels.clear()
