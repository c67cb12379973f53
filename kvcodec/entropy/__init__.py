"""Entropy coding: integer frequency tables, ANS streams, and a stage usable after any quantizer.

The normative stream layout is formats/ANS.md. Public API (pinned; other modules code against it):

- :func:`build_table` (histogram -> integer table, every symbol >= 1, sum ``2**P``)
- :func:`ans_encode` / :func:`ans_decode` (constriction, exact under the integer table)
- :func:`ans_decode_reference` (pure-integer executable spec)
- :class:`EntropyStage` (many independent streams with an index; planes in, planes out)

Example:
    >>> import numpy as np
    >>> from kvcodec.entropy import build_table, ans_encode, ans_decode, ans_decode_reference
    >>> sym = np.array([0, 1, 1, 3, 0, 0, 2])
    >>> f = build_table(np.bincount(sym, minlength=4), precision=12)
    >>> w = ans_encode(sym, f)
    >>> ans_decode(w, f, 7).tolist() == ans_decode_reference(w, f, 7).tolist() == sym.tolist()
    True
"""

from .ans import ans_decode, ans_decode_segments, ans_encode, ans_encode_segments, constriction_model
from .ans_ref import (
    ans_decode_reference,
    ans_decode_segments_reference,
    ans_encode_reference,
    ans_encode_segments_reference,
)
from .stage import EntropyStage, StageLayout, ideal_bits, side_info_bits
from .tables import (
    CODER_PRECISION,
    build_table,
    build_tables,
    coder_table,
    cross_entropy_bits,
    entropy_bits,
    table_precision,
)

__all__ = [
    "CODER_PRECISION",
    "EntropyStage",
    "StageLayout",
    "ideal_bits",
    "side_info_bits",
    "ans_decode",
    "ans_decode_reference",
    "ans_decode_segments",
    "ans_decode_segments_reference",
    "ans_encode",
    "ans_encode_reference",
    "ans_encode_segments",
    "ans_encode_segments_reference",
    "build_table",
    "build_tables",
    "coder_table",
    "constriction_model",
    "cross_entropy_bits",
    "entropy_bits",
    "table_precision",
]
