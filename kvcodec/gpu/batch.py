"""A tensor's prepared decode (:class:`DecodePlan`) and the batching of many of them on CUDA streams.

:class:`batched_decode` is a per-thread context: inside it, each tensor's kernels go to the next of
a few CUDA streams without waiting, and the status checks of all of them run once on exit.
:mod:`kvcodec.gpu.registry` consults the active batch (:func:`_active_batch`) for every tensor.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import torch

from . import device as _device  # hooks read at call time (tests patch kvcodec.gpu.device)


class DecodePlan:
    """A tensor's decode prepared on a device: planes validated and uploaded, launches ready.

    Calling it (``plan()``) runs the kernels on torch's current stream and returns the output;
    ``plan(check=False)`` skips the stream-status checks (which synchronise), for timing or to
    check later: ``plan.verify()`` raises what ``plan()`` would have raised for the last run
    (``StreamError``, ``FormatError``...), once its kernels are done.
    """

    def __init__(self, run: Callable[[], torch.Tensor], verify: Callable[[], None] | None = None) -> None:
        self._run = run
        self._verify = verify

    def __call__(self, check: bool = True) -> torch.Tensor:
        out = self._run()
        if check:
            self.verify()
        return out

    def verify(self) -> None:
        """The status checks of the last ``plan(check=False)`` (synchronises; no-op for codecs
        whose kernels cannot fail)."""
        if self._verify is not None:
            self._verify()


class _Batch:
    def __init__(self, dev: torch.device, n_streams: int) -> None:
        self.dev = dev
        self.streams = [torch.cuda.Stream(device=dev) for _ in range(n_streams)] if dev.type == "cuda" else []
        self.next = 0
        self.pending: list[DecodePlan] = []


_BATCH = threading.local()


class batched_decode:
    """Context manager: inside it, :func:`decode_tensor_device` on ``device`` launches each tensor's
    kernels on the next of ``streams`` CUDA streams without waiting, and the stream-status checks
    of all of them run once on exit (after torch's current stream has waited for every stream).

    A tensor whose entropy stage has few streams (kvc: one per 64 rows and 2048 tokens) keeps few
    GPU threads busy, so a file's tensors decode concurrently this way instead of one after the
    other. The returned tensors are safe to use on the current stream after the block; an error of
    any tensor is raised on exit, naming the tensor. ``kvcodec.decode(..., device="cuda")`` uses it.

    Example:
        >>> import kvcodec, torch
        >>> blob = kvcodec.get_codec("fp16").encode(kvcodec.KVCache.from_tensors([(torch.ones(4, 1, 8),) * 2]))
        >>> try:
        ...     with batched_decode("cuda"):
        ...         out = kvcodec.decode(blob, device="cuda")
        ... except kvcodec.errors.DeviceError:   # no GPU here
        ...     out = kvcodec.decode(blob)
    """

    def __init__(self, device: str | torch.device = "cuda", streams: int = 16) -> None:
        self.device, self.n_streams = device, max(1, int(streams))
        self._outer = None

    def __enter__(self) -> "batched_decode":
        self._outer = getattr(_BATCH, "b", None)
        if self._outer is None:  # nested blocks share the outermost batch
            _BATCH.b = _Batch(_device._resolve_device(self.device), self.n_streams)
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if self._outer is not None:
            return
        b, _BATCH.b = _BATCH.b, None
        if b.streams:  # whatever happens, nothing decoded is read before its stream is done
            cur = torch.cuda.current_stream(b.dev)
            for st in b.streams:
                cur.wait_stream(st)
        if exc_type is None:
            for plan in b.pending:
                plan.verify()


def _active_batch(dev: torch.device) -> _Batch | None:
    b = getattr(_BATCH, "b", None)
    return b if b is not None and b.dev == dev else None  # a batch for another device: decode now


def _batched_run(b: _Batch, make: Callable[[], DecodePlan]) -> torch.Tensor:
    """Prepare (uploads) and launch a tensor's decode on the batch's next stream, checks deferred."""
    if not b.streams:  # host runner (tests): no streams, the checks still deferred
        plan = make()
        b.pending.append(plan)
        return plan(check=False)
    st = b.streams[b.next % len(b.streams)]
    b.next += 1
    with torch.cuda.stream(st):  # uploads, scratch and kernels all ordered on st
        plan = make()
        out = plan(check=False)
    b.pending.append(plan)
    out.record_stream(torch.cuda.current_stream(b.dev))  # read there later: not reused before that
    return out


def sync_batch_streams() -> None:
    """Inside :class:`batched_decode`: make torch's current stream wait for every tensor decoded so
    far (before torch ops read them, e.g. concatenating a file's token chunks); else nothing."""
    b = getattr(_BATCH, "b", None)
    if b is not None and b.streams:
        cur = torch.cuda.current_stream(b.dev)
        for st in b.streams:
            cur.wait_stream(st)
