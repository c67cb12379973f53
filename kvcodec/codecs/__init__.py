"""The named codecs users pick. Importing this package registers them all.

Each module registers its codec classes (pinned ids) and presets (user-facing names).
"""

from . import raw  # noqa: F401
