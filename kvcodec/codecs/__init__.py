"""The named codecs users pick. Importing this package registers them all.

Each module registers its codec classes (pinned ids) and presets (user-facing names).
"""

from . import raw  # noqa: F401
from . import fp8, kivi, nvfp4  # noqa: F401  (H1: quantizing codecs)
from . import cachegen, entropy_variants  # noqa: F401  (H3: entropy-coded codecs)
from . import kvc  # noqa: F401  (H6: transform codec)
