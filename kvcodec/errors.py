"""The one exception hierarchy of kvcodec.

Every failure that kvcodec detects on purpose raises a subclass of :class:`KVCodecError`,
with a message that says what is wrong. Callers can catch ``KVCodecError`` alone.

Example:
    >>> from kvcodec.errors import KVCodecError, UnknownCodecError
    >>> issubclass(UnknownCodecError, KVCodecError)
    True
"""

from __future__ import annotations


class KVCodecError(Exception):
    """Base class of every error kvcodec raises on purpose."""


class ConfigError(KVCodecError, ValueError):
    """A codec or stage configuration is invalid (bad parameter, wrong type, out of range)."""


class UnknownCodecError(ConfigError, KeyError):
    """A codec name or id is not registered."""

    def __str__(self) -> str:  # KeyError quotes its message; we want it plain
        return str(self.args[0]) if self.args else ""


class InputError(KVCodecError, ValueError):
    """Input data is unusable: NaN/Inf values, wrong shapes, wrong tensor names, bad dtype."""


class FormatError(KVCodecError):
    """A file or buffer is not a valid KVC container (structure, header, sizes, offsets)."""


class TruncatedError(FormatError):
    """A file or stream ends before the data it declares."""


class VersionError(FormatError):
    """The container's major version or a required feature is not supported."""


class ChecksumError(FormatError):
    """Stored data does not match its recorded checksum."""


class StreamError(FormatError):
    """An entropy-coded stream is corrupt, or was not consumed exactly."""


class DependencyError(KVCodecError, ImportError):
    """An optional dependency is missing; the message names the extra to install."""


class StoreError(KVCodecError, OSError):
    """A store (Redis, Mooncake Store, a filesystem) could not be reached or refused an operation."""


class DeviceError(KVCodecError, RuntimeError):
    """A GPU path was asked for but no usable device or CUDA bindings are present."""
