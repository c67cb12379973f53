"""Streaming: writer and reader work layer by layer, so peak memory stays near one layer's size
(plus the output), not the file's. Measured with tracemalloc (numpy buffers and Python bytes are
traced; the input cache exists before tracing starts)."""

import gc
import tracemalloc

import kvcodec
from kvcodec import format as kvf

from conftest import make_cache

LAYERS, T, H, D = 30, 256, 4, 64
LAYER_BYTES = 2 * T * H * D * 2  # K and V in fp16


def _peak(fn):
    gc.collect()
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_streaming_write_and_read_peak_memory_is_about_one_layer(tmp_path):
    cache = make_cache(layers=LAYERS, tokens=T, heads=H, dim=D)
    codec = kvcodec.get_codec("raw")
    total = LAYERS * LAYER_BYTES
    p = tmp_path / "big.kvc"

    in_memory = _peak(lambda: codec.encode(cache))
    streamed = _peak(lambda: kvf.write_file(codec, cache, p))
    assert p.stat().st_size > total
    # encode() returns the whole file, so it holds at least the output; write_file does not
    assert in_memory > total
    assert streamed < 3 * LAYER_BYTES, (streamed, LAYER_BYTES)

    def read_all_layers():
        with kvcodec.open(p) as r:
            for i, layer in enumerate(r.read_layers()):
                assert layer["k"].shape == (T, H, D)
                del layer

    read_peak = _peak(read_all_layers)
    assert read_peak < 4 * LAYER_BYTES, (read_peak, LAYER_BYTES)

    def verify():
        with kvcodec.open(p) as r:
            r.verify()

    assert _peak(verify) < 4 * LAYER_BYTES
