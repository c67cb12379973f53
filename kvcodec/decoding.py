"""The decoding reader: a validated container plus the codec that turns its planes into values.

This is the one place that chooses between the CPU decoders (each codec's ``decode_tensor``:
native C where built, else the reference) and the GPU kernels (:mod:`kvcodec.gpu`). It takes the
codec as an object, so it depends on no registry: :func:`kvcodec.open` resolves the codec a file
names, :meth:`kvcodec.Codec.decode` passes itself.

Example:
    >>> import torch, kvcodec
    >>> c = kvcodec.KVCache.from_tensors([(torch.ones(3, 1, 4), torch.ones(3, 1, 4))] * 4)
    >>> r = kvcodec.open(kvcodec.get_codec("fp16").encode(c))
    >>> [t["v"].shape[0] for t in r.read_layers(range(1, 3))]
    [3, 3]
"""

from __future__ import annotations

import os
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np
import torch

from .cache import KVCache, ModelIdentity
from .errors import FormatError, InputError, KVCodecError
from .format import safetensors_io as sio
from .format.container import ContainerReader
from .format.manifest import MAX_ELEMENTS_PER_BYTE
from .planes import EncodedTensor, TensorContext

#: how many layers :meth:`KVCReader.read_layers` decodes ahead of the one it finishes, where the
#: codec decodes on several threads
DECODE_AHEAD_LAYERS = 2

#: resolves a file's codec config to a codec object (the registry's get_codec, or a fixed codec)
Resolver = Callable[[dict[str, Any]], Any]


def _copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t``; on the CPU through numpy (a torch copy called from several decode threads
    starts an OpenMP team in each, whose spinning doubled a vLLM worker's chunk decoding)."""
    if t.device.type != "cpu":
        return t.clone()
    view = {torch.bfloat16: torch.int16}.get(t.dtype)
    a = (t.view(view) if view is not None else t).numpy().copy()
    out = torch.from_numpy(a)
    return out.view(t.dtype) if view is not None else out


class KVCReader(ContainerReader):
    """A validated KVC file opened for lazy decoding. Create it with :func:`kvcodec.open`.

    Everything of :class:`~kvcodec.format.container.ContainerReader` (manifest, sizes, planes),
    plus ``codec`` and the ``read_*`` methods that decode: each reads only the bytes it needs,
    checks their CRC-32 and decodes one layer at a time.

    Attributes:
        codec: the codec that decodes this file (None when it is not installed and the reader
            was opened for inspection only; decoding then raises ``codec_error``).
    """

    def __init__(self, source: sio.Source, resolve: Resolver, require_codec: bool = True,
                 max_elements_per_byte: int = MAX_ELEMENTS_PER_BYTE, profiles: Sequence[Any] = ()) -> None:
        from .errors import UnknownCodecError

        super().__init__(source, max_elements_per_byte)
        #: profile files or directories to look in for a file coded with prediction across layers
        self.profiles = [str(p) for p in profiles]
        self._last: tuple[Any, dict[str, torch.Tensor]] | None = None  # the last layer decoded
        #: True while :meth:`read_cache` collects every layer: no caller can change a decoded
        #: layer before the next one is predicted from it, so it is kept without a copy
        self._own_layers = False
        self.codec: Any = None
        self.codec_error: KVCodecError | None = None
        try:
            self.codec = resolve(self.manifest["codec"])
        except UnknownCodecError as e:
            if require_codec:
                self.close()
                raise
            self.codec_error = e  # inspection (kvcodec info) still works; decoding raises this
        except KVCodecError:
            self.close()
            raise
        except Exception as e:  # noqa: BLE001 - a codec constructor choking on hostile params
            self.close()
            raise FormatError(f"codec config {str(self.manifest['codec'])[:80]} is unusable: "
                              f"{type(e).__name__}: {e}") from None

    # ------------------------------------------------------------------ decoding
    def _decode_chunk(self, i: int, role: str, j: int, enc: EncodedTensor, device: str) -> torch.Tensor:
        if self.codec is None:
            assert self.codec_error is not None
            raise self.codec_error
        ctx = self.chunk_context(i, role, j)
        where = self.chunk_label(i, role, j)
        try:
            if device == "cpu":
                t = self.codec.decode_tensor(enc, ctx)
            else:
                from .gpu import decode_tensor_device

                t = decode_tensor_device(self.codec, enc, ctx, device)
        except KVCodecError:
            raise
        except Exception as e:  # noqa: BLE001 - hostile input must only ever raise our errors
            raise FormatError(
                f"{where}: codec {self.codec.codec_id!r} failed to decode: {type(e).__name__}: {str(e)[:200]}"
            ) from None
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != ctx.shape or t.dtype != self.dtype:
            got = f"{list(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise FormatError(f"{where}: codec returned {got}, expected {list(ctx.shape)} {self.dtype}")
        return t

    def read_layer(self, i: int, chunks: Sequence[int] | range | None = None, device: str = "cpu") -> dict[str, torch.Tensor]:
        """Decode layer ``i`` (optionally only some chunks, concatenated along tokens).

        Reads only that layer's bytes (plus the file-level planes once), verifying every CRC-32
        before decoding.
        """
        return self._read_layer(i, chunks, device, split=True)

    def _read_layer(self, i: int, chunks: Sequence[int] | range | None, device: str,
                    split: bool) -> dict[str, torch.Tensor]:
        """:meth:`read_layer`; ``split``: the prediction pass may use a second thread."""
        planes = self.read_layer_planes(i, chunks)
        parts = {role: [self._decode_chunk(i, role, j, enc, device) for j, enc in encs] for role, encs in planes.items()}
        return self._finish_layer(i, chunks, planes, parts, device, split)

    def _finish_layer(self, i: int, chunks: Sequence[int] | range | None,
                      planes: dict[str, list[tuple[int, EncodedTensor]]], parts: dict[str, list[torch.Tensor]],
                      device: str, split: bool) -> dict[str, torch.Tensor]:
        """Layer ``i`` from its decoded chunks ``parts`` (per role, in the order of ``planes``):
        the chunks concatenated, then the prediction from the layer before added where the file
        has one (``split``: as for :meth:`_read_layer`)."""
        key = (i, None if chunks is None else tuple(chunks), device)
        out: dict[str, torch.Tensor] = {}
        predicted = {role: [bool(enc.params.get("xp")) for _, enc in encs] for role, encs in planes.items()}
        rows_of = getattr(self.codec, "predicted_rows", None)
        for role, encs in planes.items():
            got = parts[role]
            if any(predicted[role]) and rows_of is not None:  # which rows of each chunk take the prediction
                predicted[role] = [rows_of(enc, self.chunk_context(i, role, j)) for j, enc in encs]
            if len(got) == 1:
                out[role] = got[0]
            elif got:
                if device != "cpu":  # the parts may still be decoding on other CUDA streams
                    from .gpu import sync_batch_streams

                    sync_batch_streams()
                out[role] = torch.cat(got, dim=0)
            else:
                _, h, d = self.tensor_shape(i, role)
                out[role] = torch.empty((0, h, d), dtype=self.dtype, device=device if device != "cpu" else None)
        if any(any(bool(np.any(f)) for f in v) for v in predicted.values()):
            out = self._add_predictions(i, chunks, out, predicted, device, split)
        if self._predicts:  # what layer i + 1 predicts from (a copy unless no caller sees the layer first)
            self._last = (key, dict(out) if self._own_layers else {r: _copy(t) for r, t in out.items()})
        return out

    def _read_layers_threaded(self, layers: Sequence[int], threads: int) -> Iterator[dict[str, torch.Tensor]]:
        """:meth:`read_layers` on the CPU with ``threads`` decoding tensors at once: this thread
        reads each layer's bytes (and checks them), the pool decodes its tensors (the native
        decoders release the GIL) up to :data:`DECODE_AHEAD_LAYERS` layers ahead, and this
        thread finishes the layers in order (concatenation, prediction across layers). The same
        values as one thread, bit for bit."""
        from collections import deque
        from concurrent.futures import ThreadPoolExecutor

        self.globals()  # read once here, not raced for by the pool
        todo = iter(layers)
        with ThreadPoolExecutor(threads, thread_name_prefix="kvcodec-decode") as pool:
            ahead: deque = deque()

            def start() -> None:
                i = next(todo, None)
                if i is None:
                    return
                planes = self.read_layer_planes(i)
                futs = {role: [pool.submit(self._decode_chunk, i, role, j, enc, "cpu") for j, enc in encs]
                        for role, encs in planes.items()}
                ahead.append((i, planes, futs))

            try:
                for _ in range(DECODE_AHEAD_LAYERS):
                    start()
                while ahead:
                    i, planes, futs = ahead.popleft()
                    start()
                    parts = {role: [f.result() for f in fs] for role, fs in futs.items()}
                    yield self._finish_layer(i, None, planes, parts, "cpu", True)
            finally:  # an error (or a consumer that stops): nothing more starts, what runs ends
                for _, _, futs in ahead:
                    for fs in futs.values():
                        for f in fs:
                            f.cancel()

    @property
    def _predicts(self) -> bool:
        """Whether any tensor of the file is predicted from the layer before (param ``xp``): only
        then does the reader keep the last layer it decoded."""
        if not hasattr(self, "_predicts_cache"):
            self._predicts_cache = any(c["params"].get("xp") for layer in self.manifest["layers"]
                                       for t in layer["tensors"].values() for c in t["chunks"])
        return self._predicts_cache

    def _add_predictions(self, i: int, chunks: Sequence[int] | range | None, out: dict[str, torch.Tensor],
                         predicted: dict[str, list[bool]], device: str, split: bool) -> dict[str, torch.Tensor]:
        """Layer ``i``'s residuals plus the codec's prediction from layer ``i - 1`` (decoded first,
        the same chunks): prediction across layers (kvc ``xpred``, formats/codecs/kvc.md §13)."""
        where = f"layers.{i}"
        add = getattr(self.codec, "add_predictions", None)
        if add is None or getattr(self.codec, "predicted_rows", None) is None or i == 0:
            raise FormatError(f"{where}: tensors marked as predicted from the layer before (xp), which "
                              f"{'layer 0 has not' if i == 0 else 'codec ' + repr(self.codec.codec_id) + ' does not do'}")
        key = (i - 1, None if chunks is None else tuple(chunks), device)
        prev = self._last[1] if self._last is not None and self._last[0] == key else self._read_layer(i - 1, chunks, device, split)
        lm = self._layer(i)
        n_chunks = len(next(iter(lm.tensors.values())).chunks)
        sel = list(range(n_chunks)) if chunks is None else list(chunks)
        counts = [int(next(iter(lm.tensors.values())).chunks[j].tokens) for j in range(n_chunks)]
        starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        rows = np.concatenate([np.arange(starts[j], starts[j + 1]) for j in sel]) if sel else np.zeros(0, np.int64)
        if not hasattr(self, "_positions_np"):  # read (and checked) once per reader
            pos = self.positions()
            self._positions_np = None if pos is None else pos.numpy()
        positions = rows if self._positions_np is None else self._positions_np[rows]
        masks = {role: np.concatenate([np.full(counts[j], flag, dtype=bool) if isinstance(flag, bool) else flag
                                       for j, flag in zip(sel, flags)])
                 if flags else np.zeros(0, bool) for role, flags in predicted.items()}
        try:
            return add(i, out, prev, positions, masks, self.profiles, where, threads=2 if split else 1)
        except KVCodecError:
            raise
        except Exception as e:  # noqa: BLE001 - hostile input must only ever raise our errors
            raise FormatError(f"{where}: prediction across layers failed: {type(e).__name__}: {str(e)[:200]}") from None

    def read_layers(self, layers: Iterable[int] | None = None, device: str = "cpu",
                    threads: int | None = None) -> Iterator[dict[str, torch.Tensor]]:
        """Decode layers in order (default: all), yielding each layer's tensor dict. On the CPU,
        a codec whose ``decode_threads`` is over 1 decodes the tensors of the next layers on
        that many threads (at most the CPUs) while this one finishes each layer; ``threads``
        caps that (1: everything on this thread, for callers that decode files side by side)."""
        todo = list(range(self.num_layers) if layers is None else layers)
        n = self._cpu_threads(threads)
        if device == "cpu" and n > 1 and len(todo) > 1:
            yield from self._read_layers_threaded(todo, n)
            return
        for i in todo:  # threads=1: the prediction pass (kvc xpred) too stays on this thread
            yield self._read_layer(i, None, device, split=threads != 1)

    def _cpu_threads(self, threads: int | None) -> int:
        """The CPU threads a decode uses: the codec's ``decode_threads``, at most the CPUs and
        at most ``threads``."""
        n = min(int(getattr(self.codec, "decode_threads", 1)), os.cpu_count() or 1)
        if threads is not None:
            if type(threads) is not int or threads < 1:
                raise InputError(f"threads must be an integer >= 1, got {threads!r}")
            n = min(n, threads)
        return n

    def staged_cache(self, split: bool = False) -> Callable[[], KVCache]:
        """:meth:`read_cache` on one CPU thread, in two halves. This call reads and checks every
        layer and queues the native decoders' work (:func:`kvcodec.native.kvc.deferred_decodes`;
        checking is Python, which holds the interpreter's lock); the callable it returns runs
        that work in one native call (which lets go of the lock) and builds the cache. A caller
        with several small files checks the next file while another thread runs the last one's
        call (:func:`kvcodec.decode_many`): per tensor, threads mostly waited for the lock. The
        same values as :meth:`read_layers`, bit for bit; errors of checking come before errors
        of decoding. Keep the reader open until the callable has run. ``split``: the prediction
        pass (kvc xpred) may use a second thread.

        Raises:
            KVCodecError: as :meth:`read_cache` (this call: the checks; the callable: the decoding).
        """
        from .native.kvc import deferred_decodes, run_decodes

        self.check_padding()
        staged = []
        with deferred_decodes() as jobs:
            for i in range(self.num_layers):
                planes = self.read_layer_planes(i)
                parts = {role: [self._decode_chunk(i, role, j, enc, "cpu") for j, enc in encs]
                         for role, encs in planes.items()}
                staged.append((i, planes, parts))

        def finish() -> KVCache:
            try:
                run_decodes(jobs)
            except (KVCodecError, MemoryError):
                raise
            except Exception as e:  # noqa: BLE001 - hostile input must only ever raise our errors
                raise FormatError(f"codec {self.codec.codec_id!r} failed to decode: {type(e).__name__}: "
                                  f"{str(e)[:200]}") from None
            self._own_layers = True  # every layer is ours until the cache is returned: no copies
            try:
                layers = [self._finish_layer(i, None, planes, parts, "cpu", split) for i, planes, parts in staged]
            finally:
                self._own_layers = False
            return self._cache_of(layers)

        return finish

    def read_cache(self, device: str = "cpu", threads: int | None = None) -> KVCache:
        """Decode the whole file into a :class:`KVCache`, one layer at a time (``threads``: as
        for :meth:`read_layers`)."""
        if device == "cpu" and self._cpu_threads(threads) == 1:
            return self.staged_cache(split=threads != 1)()
        self.check_padding()
        if device == "cpu":
            self._own_layers = True
            try:
                layers = list(self.read_layers(device=device, threads=threads))
            finally:
                self._own_layers = False
        else:  # every tensor's kernels launched without waiting, on several CUDA streams; checked at the end
            from .gpu import batched_decode

            with batched_decode(device):
                layers = list(self.read_layers(device=device))
        return self._cache_of(layers)

    def _cache_of(self, layers: list[dict[str, torch.Tensor]]) -> KVCache:
        """The file's :class:`KVCache` of its decoded ``layers`` (with its layer kinds, tokens,
        positions, model and RoPE state)."""
        m = self.manifest
        rope = m["rope"]
        return KVCache(
            layers=layers,
            layer_info=[self.layer_info(i) for i in range(self.num_layers)],
            token_ids=self.token_ids(),
            positions=self.positions(),
            model=ModelIdentity.from_dict(m["model"]),
            rope_applied=bool(rope["applied"]),
            rope=dict(rope["params"]),
        )

    def verify(self, decode: bool = True) -> dict[str, Any]:
        """Check every CRC-32 and the padding; with ``decode``, also decode every layer and check
        that the values are finite. Returns a summary; raises a :class:`KVCodecError` on failure."""
        if not decode:
            return super().verify()
        return self._verify(self._check_decoded_layer, decoded=True)

    def _check_decoded_layer(self, i: int) -> None:
        for role, t in self.read_layer(i).items():
            if t.is_floating_point() and t.numel() and not bool(torch.isfinite(t.abs().amax())):
                raise FormatError(f"layers.{i}.{role} decodes to NaN or Inf values")

    def __enter__(self) -> "KVCReader":
        return self


def open_with(src: Any, resolve: Resolver, require_codec: bool = True,
              max_elements_per_byte: int = MAX_ELEMENTS_PER_BYTE, profiles: Sequence[Any] = ()) -> KVCReader:
    """Open ``src`` (path, bytes, or seekable binary file object) with ``resolve`` choosing the codec."""
    return KVCReader(sio.as_source(src), resolve, require_codec=require_codec,
                     max_elements_per_byte=max_elements_per_byte, profiles=profiles)


def read_with(data: Any, codec: Any, device: str = "cpu", profiles: Sequence[Any] = ()) -> KVCache:
    """Decode a whole file that ``codec`` wrote (FormatError if the file names another codec id)."""

    def resolve(config: dict[str, Any]) -> Any:
        cid = config.get("id") if isinstance(config, dict) else None
        if cid != codec.codec_id:
            raise FormatError(f"file was written by codec {cid!r}, not {codec.codec_id!r}")
        return type(codec).from_config(config)  # the file's own parameters decode it

    with open_with(data, resolve, profiles=profiles) as r:
        return r.read_cache(device=device)


__all__ = ["KVCReader", "open_with", "read_with"]
