"""Model I/O for the learner: a Hugging Face causal-LM directory in and out of transformers.

The files (config.json, safetensors, tokenizer) are the contract with vLLM, the delta codec and the
registry: every weight is named as it is stored in the files. transformers may keep some weights under
other names in memory (version 5 fuses a Qwen3-MoE layer's experts into ``experts.gate_up_proj`` /
``experts.down_proj``); ``to_module_state`` and ``state_dict_from_model`` translate between the two, so
the rest of liverl only ever sees the file names.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerFast

_EXPERT_FILE_RE = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def load_tokenizer(model_dir: Path) -> PreTrainedTokenizerFast:
    """The model dir's tokenizer, as transformers (and vLLM) load it."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def to_module_state(state_dict: dict[str, torch.Tensor], dtype=None) -> dict[str, torch.Tensor]:
    """File names (per-expert) → the in-memory transformers names (fused experts); optional cast."""
    import torch

    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name, t in state_dict.items():
        m = _EXPERT_FILE_RE.match(name)
        if m:
            experts.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = t
        else:
            out[name] = t
    for prefix, by_e in experts.items():
        idx = sorted(by_e)
        if idx != list(range(len(idx))):
            raise ValueError(f"{prefix}: expert indices {idx} are not 0..{len(idx) - 1}")
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([by_e[e]["gate_proj"], by_e[e]["up_proj"]], dim=0) for e in idx])
        out[f"{prefix}.down_proj"] = torch.stack([by_e[e]["down_proj"] for e in idx])
    if dtype is not None:
        out = {k: v.to(dtype) for k, v in out.items()}
    return out


def state_dict_from_model(model, dtype=None) -> dict[str, torch.Tensor]:
    """A transformers model's weights under the file names (per-expert), detached, contiguous, on CPU.

    ``dtype`` defaults to bfloat16 (the served dtype); pass ``torch.float32`` for fp32 master weights.
    """
    import torch

    dtype = torch.bfloat16 if dtype is None else dtype
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        t = t.detach().to("cpu")
        if name.endswith(".mlp.experts.gate_up_proj"):
            prefix = name[: -len(".gate_up_proj")]
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{prefix}.{e}.gate_proj.weight"] = t[e, :inter]
                out[f"{prefix}.{e}.up_proj.weight"] = t[e, inter:]
        elif name.endswith(".mlp.experts.down_proj"):
            prefix = name[: -len(".down_proj")]
            for e in range(t.shape[0]):
                out[f"{prefix}.{e}.down_proj.weight"] = t[e]
        else:
            out[name] = t
    return {k: v.to(dtype).contiguous().clone() for k, v in sorted(out.items())}


def load_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    """The weights of a model dir exactly as stored (bf16, file names)."""
    from safetensors.torch import load_file

    path = Path(model_dir) / "model.safetensors"
    if not path.exists():
        raise ValueError(f"{path} does not exist; build the base with liverl.demo.base_policy.ensure_base_policy")
    return {k: v.contiguous() for k, v in load_file(str(path)).items()}


def load_model(model_dir: Path, state_dict: dict | None = None, dtype=None):
    """A ``Qwen3MoeForCausalLM`` in ``dtype`` (default float32) with the dir's or the given weights.

    ``state_dict`` uses the file names (as ``load_state_dict`` returns); it must cover every weight.
    """
    import torch
    from transformers import AutoConfig, Qwen3MoeForCausalLM

    dtype = torch.float32 if dtype is None else dtype
    config = AutoConfig.from_pretrained(str(model_dir))
    with _seeded(0):  # initial values are overwritten; seeding keeps construction side-effect free
        model = Qwen3MoeForCausalLM(config)
    sd = load_state_dict(model_dir) if state_dict is None else state_dict
    module_sd = to_module_state(sd, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(module_sd, strict=False)
    if missing or unexpected:
        raise ValueError(f"state dict does not match the model: missing {missing}, unexpected {unexpected}")
    return model.to(dtype).eval()


def save_model_dir(src_dir: Path, state_dict: dict, dst_dir: Path) -> Path:
    """Write a model dir: config, generation config and tokenizer from ``src_dir``, weights from ``state_dict``.

    Weights are written as given (callers pass bf16 for served versions); written to a temp file and
    renamed so a reader never sees a half-written model.safetensors.
    """
    from safetensors.torch import save_file

    src_dir, dst_dir = Path(src_dir), Path(dst_dir)
    dst_dir.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json"):
        if (src_dir / name).exists() and src_dir.resolve() != dst_dir.resolve():
            shutil.copyfile(src_dir / name, dst_dir / name)
    tmp = dst_dir / "model.safetensors.tmp"
    save_file({k: v.contiguous() for k, v in sorted(state_dict.items())}, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, dst_dir / "model.safetensors")
    return dst_dir


@contextlib.contextmanager
def _seeded(seed: int) -> Iterator[None]:
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield
