"""Fixtures for the deploy tests: tiny bf16 "models", registries on SQLite and PostgreSQL, a Redis namespace."""

from __future__ import annotations

import pytest
import torch

from deploy.registry.blobstore import LocalBlobStore
from deploy.registry.registry import Registry


def tiny_model(seed: int = 0) -> dict[str, torch.Tensor]:
    """A few bf16 tensors shaped like a (very) small transformer, plus odd shapes."""
    g = torch.Generator().manual_seed(seed)
    shapes = {
        "model.embed_tokens.weight": (64, 32),
        "model.layers.0.mlp.up_proj.weight": (48, 32),
        "model.layers.0.input_layernorm.weight": (32,),
        "lm_head.weight": (64, 32),
        "odd": (7, 3, 5),
    }
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


@pytest.fixture(scope="session")
def s3_endpoint():
    """An S3 endpoint for the session: moto's ThreadedMotoServer on a free local port.

    A stand-in for S3: this machine has no S3 service (and reaches no network), while moto's server speaks
    the S3 HTTP wire protocol, so boto3's real request path (signing, HTTP, XML, errors, pagination) runs.
    """
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3_env(s3_endpoint, monkeypatch):
    """Fake AWS credentials and the moto endpoint in the environment (as a deployment would set them)."""
    for k, v in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_SESSION_TOKEN": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": s3_endpoint,
    }.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    return s3_endpoint


@pytest.fixture
def s3_bucket(s3_env):
    """A fresh bucket of the test's own (name unique to the test) on the moto endpoint."""
    import uuid

    import boto3

    name = f"liverl-test-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_env).create_bucket(Bucket=name)
    return name
