"""The registry of GPU decoders and the entry points that dispatch to them.

A GPU decoder is a function ``(codec, enc, ctx, dev) -> DecodePlan`` registered for a codec id with
:func:`register_gpu_decoder` (each module of :mod:`kvcodec.gpu.decoders` registers its own). It gets
the codec object and calls ``codec.parse_tensor(enc, ctx)``, the CPU decoder's own validation, so
both devices accept and reject the same files; this package never imports the codecs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from ..errors import DeviceError
from . import device as _device  # hooks read at call time (tests patch kvcodec.gpu.device)
from .batch import DecodePlan, _active_batch, _batched_run

if TYPE_CHECKING:
    from ..codec import Codec, EncodedTensor, TensorContext


GpuDecoder = Callable[["Codec", "EncodedTensor", "TensorContext", torch.device], DecodePlan]
_GPU_DECODERS: dict[str, GpuDecoder] = {}


def register_gpu_decoder(codec_id: str) -> Callable[[GpuDecoder], GpuDecoder]:
    """Decorator: register the GPU decode function of a codec id."""

    def deco(fn: GpuDecoder) -> GpuDecoder:
        _GPU_DECODERS[codec_id] = fn
        return fn

    return deco


def gpu_codec_ids() -> list[str]:
    """Codec ids that decode on the GPU."""
    return sorted(_GPU_DECODERS)


def decode_tensor_device(codec: "Codec", enc: "EncodedTensor", ctx: "TensorContext", device: str | torch.device) -> torch.Tensor:
    """Decode one tensor on a CUDA device; the result equals ``codec.decode_tensor`` bit for bit.

    Args:
        codec: the file's codec.
        enc: its coded planes (numpy) and params.
        ctx: the tensor's context (shape, output dtype, globals).
        device: a CUDA device (``"cuda"``, ``"cuda:1"``, ``torch.device``).

    Returns:
        A ``ctx.shape`` tensor of ``ctx.dtype`` on ``device``.

    Raises:
        DeviceError: no GPU, no bindings, or no GPU decoder for this codec (message has a hint).
        FormatError: the planes do not match the declared shape.
    """
    fn = _GPU_DECODERS.get(codec.codec_id)
    if fn is None:
        raise DeviceError(
            f"codec {codec.codec_id!r} has no GPU decoder (GPU codecs: {', '.join(gpu_codec_ids())}); "
            "decode it with device='cpu'"
        )
    dev = _device._resolve_device(device)
    b = _active_batch(dev)
    if b is None:
        return prepare_decode(codec, enc, ctx, dev)()
    return _batched_run(b, lambda: prepare_decode(codec, enc, ctx, dev))


def prepare_decode(codec: "Codec", enc: "EncodedTensor", ctx: "TensorContext", device: str | torch.device) -> DecodePlan:
    """Validate and upload one tensor's planes; return the :class:`DecodePlan` that decodes it.

    Raises:
        DeviceError, FormatError: as :func:`decode_tensor_device`.
    """
    fn = _GPU_DECODERS.get(codec.codec_id)
    if fn is None:
        raise DeviceError(
            f"codec {codec.codec_id!r} has no GPU decoder (GPU codecs: {', '.join(gpu_codec_ids())}); "
            "decode it with device='cpu'"
        )
    return fn(codec, enc, ctx, _device._resolve_device(device))


def _where(ctx: "TensorContext") -> str:
    """A tensor's name in error messages (``layers.3.k``)."""
    return f"layers.{ctx.layer}.{ctx.role}"
