"""Shared fixtures. GPU tests are marked ``gpu`` and skipped (never faked) without a device."""

from __future__ import annotations

import pytest
import torch


def _cuda_ok() -> bool:
    try:
        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001 - a broken driver means no GPU here
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _cuda_ok():
        return
    skip = pytest.mark.skip(reason="no CUDA device: GPU test not run (not verified here)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def rng() -> torch.Generator:
    return torch.Generator().manual_seed(1234)


def make_cache(layers=3, tokens=37, heads=2, dim=24, dtype=torch.float16, seed=0, mla=False):
    """A random cache with K-like channel offsets (as real K caches have) and token ids."""
    from kvcodec import KVCache

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(layers):
        if mla:
            out.append({"kv": torch.randn(tokens, 1, dim, generator=g).to(dtype)})
            continue
        k = torch.randn(tokens, heads, dim, generator=g) + 3 * torch.randn(1, heads, dim, generator=g)
        v = torch.randn(tokens, heads, dim, generator=g)
        out.append({"k": k.to(dtype), "v": v.to(dtype)})
    return KVCache(layers=out, token_ids=torch.arange(tokens, dtype=torch.int64))


@pytest.fixture
def small_cache():
    return make_cache()


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    """One throwaway redis-server on 127.0.0.1 for the session (tests/servers.py)."""
    pytest.importorskip("redis")
    from servers import redis_server

    with redis_server(str(tmp_path_factory.mktemp("redis"))) as url:
        yield url
