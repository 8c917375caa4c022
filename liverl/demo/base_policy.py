"""The base policy: a tiny Qwen3-MoE with its own character tokenizer, warm-started on the task.

Why built here rather than downloaded: the demo must run offline on 2 CPU cores, so the policy is a
~0.25M-parameter Qwen3-MoE (8 experts, top-2) whose weights come from a short supervised warm start on
``liverl.demo.task``. The warm start stops as soon as the policy's exact expected acceptance (computed on
the bf16-rounded weights, which is what vLLM serves) reaches ``RECIPE["target_acceptance"]``, so the
base leaves a real but learnable gap for online RL whatever the seed.

The model dir is a normal HF dir (config.json, generation_config.json, bf16 model.safetensors,
tokenizer.json, tokenizer_config.json) that both ``transformers`` and vLLM load. In model.safetensors the
experts are stored per expert (``model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight``, the names vLLM
reads); transformers 5 keeps them fused in memory (``experts.gate_up_proj`` / ``experts.down_proj``).
``learner.model`` translates between the two, so the rest of liverl only ever sees the file names.

Builds are cached in ``cache_dir/<hash of seed + recipe>``, are bit-reproducible from the seed (one
thread, deterministic algorithms), and are safe when two processes build at once (file lock, build in
a temp dir, atomic rename).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

from learner.model import _seeded, load_model, load_state_dict, save_model_dir, state_dict_from_model  # noqa: F401
from liverl.demo import task
from liverl.demo.vocab import (  # noqa: F401 - the tokenizer's names, used here and read from here
    CHAR_TO_ID,
    CHAT_TEMPLATE,
    EOS_ID,
    EOS_TOKEN,
    PAD_ID,
    PAD_TOKEN,
    SPECIAL_TOKENS,
    UNK_ID,
    UNK_TOKEN,
    VOCAB,
    encode_text,
    sft_batch,
)

if TYPE_CHECKING:  # heavy imports stay inside functions (``liverl --help`` must not import torch)
    from transformers import PreTrainedTokenizerFast


RECIPE: dict = {
    "recipe_version": 3,
    "model": {
        "vocab_size": len(VOCAB),
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "max_position_embeddings": 32,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
    },
    "sft": {
        "lr": 3e-3,
        "betas": (0.9, 0.98),
        "weight_decay": 0.0,
        "batch_size": 256,
        "max_steps": 1500,
        "eval_every": 10,
        "eval_prompts": 512,
        "eval_seed": 777,
        "target_acceptance": 0.35,
    },
    "task": {
        "alphabet": task.ALPHABET,
        "suffixes": list(task.SFT_SUFFIXES),
        "preferred_rate": task.SFT_PREFERRED_RATE,
        "max_tokens": task.MAX_TOKENS,
    },
}
"""Everything that determines the built weights; its hash (with the seed) names the cache entry."""


# ----------------------------------------------------------------------------------------------- tokenizer
def build_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer: every character is one token, decoding concatenates (no spaces)."""
    from transformers import PreTrainedTokenizerFast  # noqa: PLC0415 transformers: the CLI loads this module

    tok = Tokenizer(models.WordLevel(vocab=dict(CHAR_TO_ID), unk_token=UNK_TOKEN))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        clean_up_tokenization_spaces=False,
        model_max_length=RECIPE["model"]["max_position_embeddings"],
        chat_template=CHAT_TEMPLATE,
    )


def _save_tokenizer(tokenizer, out: Path) -> None:
    tokenizer.save_pretrained(out)
    # Name the class explicitly: otherwise AutoTokenizer picks the model type's tokenizer (Qwen2Tokenizer).
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(
        tokenizer_class="PreTrainedTokenizerFast",
        add_bos_token=False,
        add_eos_token=False,
        clean_up_tokenization_spaces=False,
    )
    cfg_path.write_text(json.dumps(cfg, indent=2))
    (out / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN, "unk_token": UNK_TOKEN}, indent=2)
    )


# ------------------------------------------------------------------------------------------------ weights
def _model_config():
    from transformers import Qwen3MoeConfig  # noqa: PLC0415 transformers: the CLI loads this module

    m = dict(RECIPE["model"])
    rope_theta = m.pop("rope_theta")
    return Qwen3MoeConfig(
        **m,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        tie_word_embeddings=False,
        bos_token_id=EOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        use_sliding_window=False,
        output_router_logits=False,
    )


# ------------------------------------------------------------------------------------------------- build
def recipe_hash(seed: int) -> str:
    blob = json.dumps({"seed": seed, "recipe": RECIPE}, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def ensure_base_policy(cache_dir: Path, seed: int = 0, progress: bool = True) -> Path:
    """Build (or load from the cache) the base policy model dir for ``seed``; returns its path.

    The same seed and recipe give bit-identical weights. Concurrent callers wait on a file lock, and the
    entry appears atomically (rename), so nobody ever reads a half-built dir.
    """
    if not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    final = cache_dir / f"base-{recipe_hash(seed)}"
    if (final / "model.safetensors").exists() and (final / "chat_template.jinja").exists():
        return final
    with open(cache_dir / f".{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second builder waits here, then finds the finished dir
        if (final / "model.safetensors").exists():
            _add_chat_template(final)
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=cache_dir))
        try:
            _build(tmp, seed, progress)
            os.chmod(tmp, 0o755)
            for f in tmp.iterdir():
                os.chmod(f, 0o644)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


def _add_chat_template(model_dir: Path) -> None:
    """Give a dir cached before the tokenizer had a chat template one (the template is not part of the weights,
    so it does not change the cache key). Atomic: a reader sees no file or the whole file."""
    path = model_dir / "chat_template.jinja"
    if path.exists():
        return
    tmp = model_dir / ".chat_template.jinja.tmp"
    tmp.write_text(CHAT_TEMPLATE)
    os.chmod(tmp, 0o644)
    os.rename(tmp, path)


@contextlib.contextmanager
def _deterministic() -> Iterator[None]:
    """One thread and deterministic kernels for the build, restoring the caller's settings after."""
    import torch  # noqa: PLC0415 torch: the CLI loads this module

    threads, det = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(det)
        torch.set_num_threads(threads)


def _bf16_rounded(model, into):
    """Copy ``model``'s weights, rounded to bf16, into the fp32 model ``into`` (what vLLM will serve)."""
    import torch  # noqa: PLC0415 torch: the CLI loads this module

    with torch.no_grad():
        for (_, p), (_, q) in zip(model.named_parameters(), into.named_parameters(), strict=True):
            q.copy_(p.to(torch.bfloat16).to(torch.float32))
    return into


def _build(out: Path, seed: int, progress: bool) -> None:
    import torch  # noqa: PLC0415 torch: the CLI loads this module
    from transformers import GenerationConfig, Qwen3MoeForCausalLM  # noqa: PLC0415 transformers: the CLI loads this module

    from liverl.demo.score import score_model  # noqa: PLC0415 torch: liverl.demo.score imports it

    sft = RECIPE["sft"]
    t0 = time.monotonic()
    with _deterministic():
        with _seeded(seed):
            model = Qwen3MoeForCausalLM(_model_config())
            eval_model = Qwen3MoeForCausalLM(_model_config()).eval()
        model.train()
        opt = torch.optim.AdamW(
            model.parameters(), lr=sft["lr"], betas=tuple(sft["betas"]), weight_decay=sft["weight_decay"]
        )
        rng = random.Random(seed * 1_000_003 + 17)
        eval_set = task.heldout_prompts(sft["eval_prompts"], seed=sft["eval_seed"])
        score = {"expected_acceptance": 0.0}
        step = 0
        for step in range(1, sft["max_steps"] + 1):
            prompts = [task.sample_prompt(rng) for _ in range(sft["batch_size"])]
            ids_BT, labels_BT, mask_BT = sft_batch(prompts, [task.sft_completion(p, rng) for p in prompts])
            loss = model(input_ids=ids_BT, attention_mask=mask_BT, labels=labels_BT).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if step % sft["eval_every"] == 0:
                score = score_model(_bf16_rounded(model, eval_model), eval_set)
                if progress:
                    print(
                        f"\rbuilding base policy (seed {seed}): step {step:4d}  loss {loss.item():.3f}  "
                        f"acceptance {score['expected_acceptance']:.3f} → target {sft['target_acceptance']:.2f}  "
                        f"{time.monotonic() - t0:5.1f}s",
                        end="",
                        file=sys.stderr,
                        flush=True,
                    )
                if score["expected_acceptance"] >= sft["target_acceptance"]:
                    break
        if progress:
            print(file=sys.stderr)
        if score["expected_acceptance"] < sft["target_acceptance"]:
            raise RuntimeError(
                f"warm start for seed {seed} reached only {score['expected_acceptance']:.3f} expected acceptance "
                f"after {step} steps (target {sft['target_acceptance']}); use another seed or raise max_steps"
            )
        sd = state_dict_from_model(model, dtype=torch.bfloat16)

    config = _model_config()
    config.dtype = "bfloat16"
    config.architectures = ["Qwen3MoeForCausalLM"]  # without it vLLM falls back to its Transformers backend
    config.save_pretrained(out)
    GenerationConfig(
        bos_token_id=EOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        do_sample=True,
        temperature=task.TEMPERATURE,
        top_p=1.0,
        top_k=0,
        max_new_tokens=task.MAX_TOKENS,
    ).save_pretrained(out)
    _save_tokenizer(build_tokenizer(), out)
    save_model_dir(out, sd, out)
    (out / "liverl_base.json").write_text(
        json.dumps(
            {
                "seed": seed,
                "recipe": RECIPE,
                "recipe_hash": recipe_hash(seed),
                "sft_steps": step,
                "build_seconds": round(time.monotonic() - t0, 2),
                "sft_eval": score,
            },
            indent=2,
            sort_keys=True,
        )
    )
