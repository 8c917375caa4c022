"""Fixtures for the deploy tests: tiny bf16 "models", registries on SQLite and PostgreSQL, a Redis namespace."""

from __future__ import annotations

import pytest
import redis
import torch

from deploy.blobstore import LocalBlobStore
from deploy.registry import Registry


def tiny_model(seed: int = 0) -> dict[str, torch.Tensor]:
    """A few bf16 tensors shaped like a (very) small transformer, plus odd shapes."""
    g = torch.Generator().manual_seed(seed)
    shapes = {"model.embed_tokens.weight": (64, 32), "model.layers.0.mlp.up_proj.weight": (48, 32),
              "model.layers.0.input_layernorm.weight": (32,), "lm_head.weight": (64, 32), "odd": (7, 3, 5)}
    return {k: (torch.randn(s, generator=g) * 0.05).to(torch.bfloat16) for k, s in shapes.items()}


def perturb(state: dict[str, torch.Tensor], frac: float, seed: int = 1) -> dict[str, torch.Tensor]:
    """Like one small optimizer step: about ``frac`` of the elements move by a little."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, t in state.items():
        f = t.float()
        mask = torch.rand(f.shape, generator=g) < frac
        out[k] = (f + mask * f.abs().clamp_min(1e-3) * 0.05 * torch.randn(f.shape, generator=g)).to(t.dtype)
    return out


@pytest.fixture(params=["sqlite", "postgresql"])
def registry(request, tmp_path):
    """A fresh Registry on SQLite (WAL file) or PostgreSQL (a throwaway database), snapshot every 3 versions."""
    url = f"sqlite:///{tmp_path / 'registry.db'}" if request.param == "sqlite" else request.getfixturevalue("pg_url")
    reg = Registry(url, LocalBlobStore(tmp_path / "blobs"), snapshot_every=3)
    yield reg
    reg.close()


@pytest.fixture
def rds(cfg):
    """The test's Redis (decoded strings); every key under the test's prefix is deleted afterwards."""
    r = redis.Redis.from_url(cfg.redis.url, decode_responses=True)
    yield r
    for key in r.scan_iter(match=f"{cfg.topics.prefix}:*"):
        r.delete(key)
    r.close()
