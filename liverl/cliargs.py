"""What the `liverl` subcommands share: the config from the common flags, the model folder, the operator token.

Torch-free: every subcommand's module imports this while `liverl --help` is built.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from core.config import LiverlConfig, load_config, redact_url
from core.services import ServiceError, redis_from_url, redis_url


def cfg_from_args(args: argparse.Namespace) -> LiverlConfig:
    """The config file (--config) with the subcommand's --model, --product and --state-dir applied."""
    cfg = load_config(args.config)
    if getattr(args, "model", None):
        cfg.model.path = args.model
    if getattr(args, "product", None):
        cfg.product = args.product
    if getattr(args, "state_dir", None):
        cfg.state_dir = args.state_dir
    return cfg


def model_dir_for(cfg: LiverlConfig):
    """The base model directory: ``model.path``, else the built-in demo policy (built once, then cached)."""
    if cfg.model.path:
        from learner.model import model_family

        path = Path(cfg.model.path).resolve()
        model_family(path)  # a family liverl does not translate yet is refused here, before anything starts
        return path
    from liverl.demo.base_policy import ensure_base_policy

    return ensure_base_policy(cfg.model_cache_path, seed=cfg.model.seed)


def check_bound(cfg: LiverlConfig, role: str) -> None:
    """A pipeline process refuses to start on a Redis prefix another deployment claims than the one its registry
    belongs to (``liverl.stack.deployment.check_process``)."""
    import redis
    import sqlalchemy.exc

    from liverl.stack.deployment import check_process

    url = redis_url(cfg)
    r = redis_from_url(url)  # connects only when the registry names a deployment to check
    try:
        check_process(cfg, r, role)
    except redis.RedisError as e:
        raise ServiceError(
            f"liverl {role}: cannot check the deployment's Redis namespace at {redact_url(url)}: {e}"
        ) from None
    except sqlalchemy.exc.OperationalError as e:  # the registry's database does not answer (yet)
        raise ServiceError(
            f"liverl {role}: cannot read the deployment's registry at {redact_url(cfg.registry_url)}: {e.orig or e}"
        ) from None
    finally:
        r.close()


def operator_token(args: argparse.Namespace) -> str | None:
    """The operator's token: --token-file, else $LIVERL_TOKEN."""
    if getattr(args, "token_file", None):
        return Path(args.token_file).read_text().strip()
    return os.environ.get("LIVERL_TOKEN")


def add_token_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--token-file", metavar="FILE", help="file holding your operator token (default: $LIVERL_TOKEN)")


def add_model_args(p: argparse.ArgumentParser, product_help: str | None = None) -> None:
    p.add_argument(
        "--model",
        metavar="DIR",
        help="Hugging Face causal-LM directory to serve and train (default: model.path, else the built-in demo policy)",
    )
    p.add_argument(
        "--product",
        metavar="MODULE:ATTR",
        help=product_help
        or "your product's liverl interface "
        "(rewards, evaluation suite; default: product, else rewards from [ingest.rewards] and no suite)",
    )
