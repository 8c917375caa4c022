"""Model I/O for the learner: a Hugging Face causal-LM directory in and out of transformers.

The files (config.json, safetensors, tokenizer) are the contract with vLLM, the delta codec and the
registry: every weight is named as it is stored in the files, whether in one ``model.safetensors`` or in
shards listed by ``model.safetensors.index.json``. transformers may keep some weights under other names
in memory (version 5 stacks a MoE layer's experts into ``experts.gate_up_proj`` / ``experts.down_proj``);
the model's ``learner.families.Family`` translates between the two, so the rest of liverl only ever sees
the file names. A family liverl does not handle is refused when the model is loaded, by name.

Weights are bf16 in the files (the dtype vLLM serves and the checksums cover); the learner computes in
float32 on top of them.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from safetensors import safe_open

from learner.families import Family, family_for

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerFast

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack")  # never copied


def load_tokenizer(model_dir: Path) -> PreTrainedTokenizerFast:
    """The model dir's tokenizer, as transformers (and vLLM) load it."""
    from transformers import AutoTokenizer  # noqa: PLC0415 transformers: the CLI loads this module

    return AutoTokenizer.from_pretrained(str(model_dir))


def read_config(model_dir: Path) -> dict:
    """config.json of a model dir, as a dict; ValueError if the dir has none."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"{model_dir} is not a model dir: no config.json")
    return json.loads(path.read_text())


def model_family(model_dir: Path) -> Family:
    """The architecture family of a model dir; ValueError naming it when liverl does not handle it."""
    return family_for(read_config(model_dir))


# ---------------------------------------------------------------------------------------------- the files


def weight_files(model_dir: Path) -> dict[str, str]:
    """Which file holds each weight: {name: file name}, from the shard index or the single file's header."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index} has no weight_map")
        bad = sorted({f for f in weight_map.values() if Path(f).name != f or not f.endswith(".safetensors")})
        if bad:
            raise ValueError(f"{index} names shard files outside the model dir or not safetensors: {bad[:3]}")
        return dict(weight_map)
    single = model_dir / SINGLE_FILE
    if single.is_file():
        with safe_open(str(single), "pt") as f:
            return {name: SINGLE_FILE for name in f.keys()}  # noqa: SIM118 - a safetensors handle, not a dict
    raise ValueError(f"{model_dir} holds neither {SINGLE_FILE} nor {INDEX_FILE}")


def load_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    """The weights of a model dir exactly as stored (bf16, file names), from one file or all shards."""
    import torch  # noqa: PLC0415 torch: the CLI loads this module
    from safetensors.torch import load_file  # noqa: PLC0415 torch: the CLI loads this module

    model_dir = Path(model_dir)
    where = weight_files(model_dir)
    out: dict[str, torch.Tensor] = {}
    for shard in sorted(set(where.values())):
        tensors = load_file(str(model_dir / shard))
        listed = {n for n, f in where.items() if f == shard}
        if set(tensors) != listed:
            raise ValueError(f"{model_dir / shard} holds {sorted(set(tensors) ^ listed)[:3]} unlike {INDEX_FILE}")
        out.update({k: v.contiguous() for k, v in tensors.items()})
    not_bf16 = sorted(k for k, v in out.items() if v.is_floating_point() and v.dtype != torch.bfloat16)
    if not_bf16:
        raise ValueError(
            f"{model_dir}: liverl serves, checksums and trains against bf16 weights, but "
            f"{len(not_bf16)} tensors are not bf16 (e.g. {not_bf16[0]} is {out[not_bf16[0]].dtype}); "
            f"save the model in bfloat16 first"
        )
    return out


def save_model_dir(src_dir: Path, state_dict: Mapping[str, torch.Tensor], dst_dir: Path) -> Path:
    """Write a model dir: the other files of ``src_dir`` (config, tokenizer...), weights from ``state_dict``.

    The weights keep ``src_dir``'s layout: one ``model.safetensors``, or the same shard files with the same
    names in each and a new index. Written as given (callers pass bf16 for served versions), each file to a
    temp name then renamed, the index last, so a reader never sees a half-written file.
    """
    from safetensors.torch import save_file  # noqa: PLC0415 torch: the CLI loads this module

    src_dir, dst_dir = Path(src_dir), Path(dst_dir)
    dst_dir.mkdir(parents=True, exist_ok=True)
    same = src_dir.resolve() == dst_dir.resolve()
    sharded = (src_dir / INDEX_FILE).is_file()
    where = weight_files(src_dir) if sharded else {name: SINGLE_FILE for name in state_dict}
    if set(where) != set(state_dict):
        raise ValueError(
            f"weights differ from {src_dir}'s: missing {sorted(set(where) - set(state_dict))[:3]}, "
            f"extra {sorted(set(state_dict) - set(where))[:3]}"
        )
    if not same:
        for p in sorted(src_dir.iterdir()):
            if p.is_file() and not p.name.endswith(_WEIGHT_SUFFIXES) and p.name != INDEX_FILE:
                shutil.copyfile(p, dst_dir / p.name)
    total = 0
    for shard in sorted(set(where.values())):
        part = {k: state_dict[k].contiguous() for k in sorted(state_dict) if where[k] == shard}
        total += sum(t.numel() * t.element_size() for t in part.values())
        tmp = dst_dir / f"{shard}.tmp"
        save_file(part, str(tmp), metadata={"format": "pt"})
        os.replace(tmp, dst_dir / shard)
    if sharded:
        tmp = dst_dir / f"{INDEX_FILE}.tmp"
        tmp.write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": dict(sorted(where.items()))}, indent=2)
        )
        os.replace(tmp, dst_dir / INDEX_FILE)
    return dst_dir


# ---------------------------------------------------------------------------------------------- transformers


def load_model(model_dir: Path, state_dict: Mapping[str, torch.Tensor] | None = None, dtype=None):
    """The dir's transformers causal LM in ``dtype`` (default float32), with the dir's or the given weights.

    ``state_dict`` uses the file names (as ``load_state_dict`` returns); it must cover every weight.
    ValueError when the dir's architecture family is not handled.
    """
    import torch  # noqa: PLC0415 torch: the CLI loads this module
    from transformers import AutoConfig, AutoModelForCausalLM  # noqa: PLC0415 transformers: the CLI loads this module

    dtype = torch.float32 if dtype is None else dtype
    family = model_family(model_dir)
    config = AutoConfig.from_pretrained(str(model_dir))
    with _seeded(0):  # initial values are overwritten; seeding keeps construction side-effect free
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.liverl_family = family
    assign_weights(model, load_state_dict(model_dir) if state_dict is None else state_dict)
    return model.to(dtype).eval()


def to_module_state(state_dict: Mapping[str, torch.Tensor], family: Family, dtype=None) -> dict[str, torch.Tensor]:
    """File names -> the transformers model's in-memory names (``family``'s translation); optional cast."""
    out = family.to_memory(state_dict)
    return out if dtype is None else {k: v.to(dtype) for k, v in out.items()}


def assign_weights(model, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Copy file-named weights (any dtype) into ``model``'s parameters in place (an optimizer keeps them).

    Every weight must be given, except those tied to another one (an LM head sharing the embedding).
    """
    import torch  # noqa: PLC0415 torch: the CLI loads this module

    family = _family_of(model)
    module_sd = to_module_state(state_dict, family, dtype=torch.float32)
    if _sharded(model):  # FSDP2 (learner.dist): every rank passes the whole state and keeps its shards
        from learner.dist import load_full_state_dict  # noqa: PLC0415 torch: learner.dist imports it

        own = _own_names(model)
        missing, unexpected = sorted(own - set(module_sd)), sorted(set(module_sd) - set(model.state_dict()))
        if not missing and not unexpected:
            load_full_state_dict(model, module_sd)
    else:
        missing, unexpected = model.load_state_dict(module_sd, strict=False)
    missing = [k for k in missing if k in _own_names(model)]  # tied aliases follow their source
    if missing or unexpected:
        raise ValueError(f"state dict does not match the model: missing {missing}, unexpected {unexpected}")


def state_dict_from_model(
    model, dtype=None, module_state: Mapping[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """A transformers model's weights under the file names, detached, contiguous, on CPU.

    ``dtype`` defaults to bfloat16 (the served dtype); pass ``torch.float32`` for fp32 master weights.
    Tied aliases (an LM head sharing the embedding) are left out, as in the files. ``module_state``: the model's
    state already gathered (a sharded model's, ``learner.dist.full_state_dict``) instead of ``model.state_dict()``.
    """
    import torch  # noqa: PLC0415 torch: the CLI loads this module

    dtype = torch.bfloat16 if dtype is None else dtype
    own = _own_names(model)
    source = model.state_dict() if module_state is None else module_state
    memory = {k: t.detach().to("cpu") for k, t in source.items() if k in own}
    files = _family_of(model).to_files(memory)
    return {k: v.to(dtype).contiguous().clone() for k, v in sorted(files.items())}


def _family_of(model) -> Family:
    fam = getattr(model, "liverl_family", None)
    return fam if fam is not None else family_for(model.config)


def _sharded(model) -> bool:
    """Whether ``model`` is sharded with FSDP2 (its parameters are DTensors)."""
    return any(hasattr(p, "full_tensor") for p in model.parameters())


def _own_names(model) -> set[str]:
    """State-dict names that own their tensor: parameters (a tied alias counted once) and persistent buffers."""
    names = {n for n, _ in model.named_parameters()}
    sd_names = set(model.state_dict())
    names |= {n for n, _ in model.named_buffers() if n in sd_names}
    return names


@contextlib.contextmanager
def _seeded(seed: int) -> Iterator[None]:
    import torch  # noqa: PLC0415 torch: the CLI loads this module

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield
