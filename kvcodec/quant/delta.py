"""Delta coding of integer codes across tokens, with anchors (CacheGen paper, section 5.1).

Tokens are cut into consecutive groups of ``anchor_every`` (``N``) tokens along axis 0. The first
token of each group (``t % N == 0``) is the *anchor* and is kept as is; every other token is
coded as its difference **from its group's anchor** (not from the previous token), as the paper
does: ``d[t] = c[t] - c[N * (t // N)]``. Each token then depends on one anchor only, so any token
decodes without a running sum and errors do not propagate inside a group. The last group may be
shorter than ``N``. Decoding adds the anchor back: the exact inverse.

Example:
    >>> import torch
    >>> c = torch.tensor([5, 6, 4, 9, 9, 7])
    >>> d = delta_encode(c, 3)
    >>> d.tolist(), delta_decode(d, 3).tolist()
    ([5, 1, -1, 9, 0, -2], [5, 6, 4, 9, 9, 7])
"""

from __future__ import annotations

import torch

from ..errors import ConfigError, InputError

_I32 = torch.iinfo(torch.int32)


def _check(x: torch.Tensor, anchor_every: int) -> None:
    if not isinstance(anchor_every, int) or isinstance(anchor_every, bool) or anchor_every < 1:
        raise ConfigError(f"anchor_every must be a positive integer, got {anchor_every!r}")
    if x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
        raise InputError(f"delta coding needs integer codes, got {x.dtype}")
    if x.dim() == 0:
        raise InputError("delta coding needs a tensor with a token axis (axis 0)")


def anchor_index(num_tokens: int, anchor_every: int) -> torch.Tensor:
    """Index of each token's anchor: ``N * (t // N)``."""
    t = torch.arange(num_tokens)
    return (t // anchor_every) * anchor_every


def delta_encode(codes: torch.Tensor, anchor_every: int) -> torch.Tensor:
    """Replace every non-anchor token by its difference from its group's anchor.

    Args:
        codes: integer tensor ``[T, ...]`` (axis 0 is the token axis).
        anchor_every: ``N``, tokens per group (1 means every token is an anchor).

    Returns:
        ``int32`` tensor of the same shape: anchors unchanged, others ``c[t] - c[anchor(t)]``.

    Raises:
        InputError: non-integer codes or values (or differences) outside int32.
        ConfigError: ``anchor_every < 1``.
    """
    _check(codes, anchor_every)
    c = codes.to(torch.int64)
    d = c - c[anchor_index(c.shape[0], anchor_every)]
    is_anchor = (torch.arange(c.shape[0]) % anchor_every == 0).reshape(-1, *([1] * (c.dim() - 1)))
    d = torch.where(is_anchor, c, d)
    if d.numel() and (d.min() < _I32.min or d.max() > _I32.max):
        raise InputError("codes or their differences do not fit in int32")
    return d.to(torch.int32)


def delta_decode(deltas: torch.Tensor, anchor_every: int) -> torch.Tensor:
    """Exact inverse of :func:`delta_encode`; returns ``int64``.

    Example:
        >>> import torch
        >>> delta_decode(torch.tensor([[3, 1], [-1, 0]]), 2).tolist()
        [[3, 1], [2, 1]]
    """
    _check(deltas, anchor_every)
    d = deltas.to(torch.int64)
    is_anchor = (torch.arange(d.shape[0]) % anchor_every == 0).reshape(-1, *([1] * (d.dim() - 1)))
    return torch.where(is_anchor, d, d + d[anchor_index(d.shape[0], anchor_every)])


__all__ = ["anchor_index", "delta_decode", "delta_encode"]
