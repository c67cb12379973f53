"""One GPU decoder per codec family; importing this package registers them all.

Each module registers its decoder(s) with :func:`kvcodec.gpu.registry.register_gpu_decoder`. A
decoder gets the codec object and calls ``codec.parse_tensor(enc, ctx)``, the CPU decoder's own
validation, then uploads the parsed planes and returns a :class:`~kvcodec.gpu.batch.DecodePlan`.
To add a codec: write ``decoders/<codec>.py`` and import it here.
"""

from . import cachegen, fp8, kivi, kivi_ans, kvc, nvfp4, raw

__all__ = ["cachegen", "fp8", "kivi", "kivi_ans", "kvc", "nvfp4", "raw"]
