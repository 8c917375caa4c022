"""Tiny model dirs of several architecture families, built locally: random weights, a locally trained tokenizer.

Why built here rather than downloaded: tests and benchmarks run offline, and a model small enough for two
CPU cores must still be a normal Hugging Face dir that transformers and vLLM load as they would a product's
model. Each dir holds config.json (one family, a few layers of width 64), bf16 weights drawn from a seed
(a few hundred kB; ``shards > 1`` splits them over several files with an index, like large checkpoints),
generation_config.json, and a byte-level BPE tokenizer trained with the ``tokenizers`` library on seeded
made-up text, whose tokenizer_config.json carries a ChatML chat template.

Weights are written under the file names of ``learner.families`` and checked, when built, against
transformers' own ``from_pretrained`` (same logits). Builds are cached in ``cache_dir/<family>-<hash>``,
bit-reproducible from the seed, and safe when two processes build at once (lock, temp dir, rename).

``python -m liverl.testing.models [--cache DIR] [FAMILY ...]`` builds them and prints their paths.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import random
import shutil
import tempfile
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from learner.families import FAMILIES
from learner.model import _seeded, load_model, state_dict_from_model

BUILD_VERSION = 1

COMMON: dict = {
    "vocab_size": 512,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
    "initializer_range": 0.1,  # wider than the usual 0.02: attention and expert routing are far from uniform
}
LM_HEAD_STD = 0.5
"""The output layer is redrawn with this std so next-token distributions are peaked (entropy ~3 nats, not ~6)."""

SPECS: dict[str, dict] = {
    "qwen3_moe": {
        "model_type": "qwen3_moe",
        "head_dim": 32,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "intermediate_size": 128,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "rms_norm_eps": 1e-6,
    },
    "mixtral": {
        "model_type": "mixtral",
        "head_dim": 32,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "intermediate_size": 64,
        "rms_norm_eps": 1e-6,
        "shards": 2,
    },
    "qwen2_moe": {
        "model_type": "qwen2_moe",
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 64,
        "intermediate_size": 128,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "rms_norm_eps": 1e-6,
    },
    "olmoe": {
        "model_type": "olmoe",
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "intermediate_size": 64,
        "rms_norm_eps": 1e-6,
    },
    "granitemoe": {
        "model_type": "granitemoe",
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "intermediate_size": 64,
        "rms_norm_eps": 1e-6,
        "attention_multiplier": 32**-0.5,
    },  # the config's default (1.0) skips the 1/sqrt(d) scaling
    "phimoe": {
        "model_type": "phimoe",
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "intermediate_size": 64,
        "attention_bias": True,
        "lm_head_bias": True,
    },  # as Phi-3.5-MoE (vLLM's PhiMoE always has them)
    "qwen3": {
        "model_type": "qwen3",
        "head_dim": 32,
        "intermediate_size": 128,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
    },  # as the small Qwen3 models: the LM head is the embedding
    "llama": {"model_type": "llama", "head_dim": 32, "intermediate_size": 128, "rms_norm_eps": 1e-6},
}
"""Per family: the transformers config fields (``shards``: how many safetensors files hold the weights)."""

TESTED = ("qwen3_moe", "mixtral", "qwen2_moe", "qwen3")
"""The families the full-path tests run on: Qwen3-MoE, two other MoE families, one dense family."""

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
PAD_TOKEN, EOS_TOKEN = "<|endoftext|>", "<|im_end|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def spec_hash(family: str, seed: int) -> str:
    blob = json.dumps(
        {
            "v": BUILD_VERSION,
            "family": family,
            "architecture": FAMILIES[family].architecture,
            "seed": seed,
            "common": COMMON,
            "lm_head": LM_HEAD_STD,
            "spec": SPECS[family],
            "chat_template": CHAT_TEMPLATE,
        },
        sort_keys=True,
    ).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def default_cache() -> Path:
    return Path(os.environ.get("LIVERL_TEST_MODEL_CACHE") or Path(tempfile.gettempdir()) / "liverl-test-models")


def ensure_test_model(family: str, cache_dir: str | os.PathLike | None = None, seed: int = 0) -> Path:
    """The tiny model dir of ``family`` (built once per seed and spec, then cached); returns its path."""
    if family not in SPECS:
        raise ValueError(f"no test model spec for {family!r}; known: {', '.join(SPECS)}")
    cache = Path(cache_dir) if cache_dir is not None else default_cache()
    cache.mkdir(parents=True, exist_ok=True)
    final = cache / f"{family}-{spec_hash(family, seed)}"
    if (final / "config.json").exists():
        return final
    with open(cache / f".{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second builder waits here, then finds the finished dir
        if (final / "config.json").exists():
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=cache))
        try:
            _build(tmp, family, seed)
            os.chmod(tmp, 0o755)
            for f in tmp.iterdir():
                os.chmod(f, 0o644)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


# ---------------------------------------------------------------------------------------------- tokenizer

_ONSETS = ("", "b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "st", "tr", "pl", "sh", "ch")
_NUCLEI = ("a", "e", "i", "o", "u", "ai", "ou", "ee")


def made_up_text(seed: int, n_sentences: int = 3000) -> list[str]:
    """Seeded sentences over a made-up lexicon (Zipf-like word frequencies, digits, punctuation)."""
    rng = random.Random(seed)
    lexicon = ["".join(rng.choice(_ONSETS) + rng.choice(_NUCLEI) for _ in range(rng.randint(1, 3))) for _ in range(400)]
    weights = [1.0 / (i + 1) for i in range(len(lexicon))]
    out = []
    for _ in range(n_sentences):
        words = rng.choices(lexicon, weights, k=rng.randint(3, 12))
        if rng.random() < 0.2:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 999)))
        s = " ".join(words)
        out.append(s[0].upper() + s[1:] + rng.choice(".?!,;:"))
    return out


def build_tokenizer(seed: int, vocab_size: int):
    """A byte-level BPE tokenizer trained on ``made_up_text(seed)``, with ChatML special tokens and template."""
    from transformers import PreTrainedTokenizerFast  # noqa: PLC0415 transformers: a cached model needs none

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(made_up_text(seed), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        bos_token=None,
        unk_token=None,
        clean_up_tokenization_spaces=False,
        model_max_length=COMMON["max_position_embeddings"],
    )


def _save_tokenizer(tokenizer, out: Path) -> None:
    tokenizer.save_pretrained(out)
    (out / "chat_template.jinja").unlink(missing_ok=True)  # the template lives in tokenizer_config.json
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(
        tokenizer_class="PreTrainedTokenizerFast",
        chat_template=CHAT_TEMPLATE,
        add_bos_token=False,
        add_eos_token=False,
        clean_up_tokenization_spaces=False,
    )
    cfg_path.write_text(json.dumps(cfg, indent=2))


# ---------------------------------------------------------------------------------------------- build


@contextlib.contextmanager
def _one_thread():
    import torch  # noqa: PLC0415 torch: a cached model needs none

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _build(out: Path, family: str, seed: int) -> None:
    import torch  # noqa: PLC0415 torch: a cached model needs none
    from safetensors.torch import save_file  # noqa: PLC0415 torch: a cached model needs none
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM, GenerationConfig  # noqa: PLC0415 transformers: a cached model needs none

    spec = dict(SPECS[family])
    shards = spec.pop("shards", 1)
    model_type = spec.pop("model_type")
    tokenizer = build_tokenizer(seed, COMMON["vocab_size"])
    pad_id, eos_id = tokenizer.convert_tokens_to_ids(PAD_TOKEN), tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    config = CONFIG_MAPPING[model_type](
        **{**COMMON, **spec}, pad_token_id=pad_id, eos_token_id=eos_id, bos_token_id=None
    )
    config.architectures = [FAMILIES[model_type].architecture]  # without it vLLM falls back to its Transformers backend
    config.dtype = "bfloat16"
    with _one_thread(), _seeded(seed):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            model.get_output_embeddings().weight.normal_(0.0, LM_HEAD_STD)
    model.liverl_family = FAMILIES[model_type]
    sd = state_dict_from_model(model, dtype=torch.bfloat16)

    config.save_pretrained(out)
    GenerationConfig(
        eos_token_id=eos_id, pad_token_id=pad_id, do_sample=True, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=32
    ).save_pretrained(out)
    _save_tokenizer(tokenizer, out)
    names = sorted(sd)
    if shards == 1:
        save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i in range(shards):
            fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            part = names[i * len(names) // shards : (i + 1) * len(names) // shards]
            save_file({k: sd[k] for k in part}, str(out / fname), metadata={"format": "pt"})
            weight_map.update({k: fname for k in part})
        total = sum(t.numel() * t.element_size() for t in sd.values())
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
        )
    (out / "liverl_test_model.json").write_text(
        json.dumps(
            {
                "family": family,
                "seed": seed,
                "spec_hash": spec_hash(family, seed),
                "build_version": BUILD_VERSION,
                "parameters": sum(t.numel() for t in sd.values()),
            },
            indent=2,
            sort_keys=True,
        )
    )

    # the files mean to transformers what they mean to liverl: its own loader gives the same logits
    ids = torch.tensor([tokenizer("Ba ke lou 12 stree.")["input_ids"]])
    with _one_thread(), torch.no_grad():
        ours = load_model(out)(input_ids=ids).logits
        theirs = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)(input_ids=ids).logits
    if not torch.equal(ours, theirs):
        raise RuntimeError(
            f"{family}: transformers reads the written files differently from liverl "
            f"(max logit difference {float((ours - theirs).abs().max()):.3g})"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("families", nargs="*", default=list(TESTED), help=f"families to build (of {', '.join(SPECS)})")
    ap.add_argument("--cache", default=None, help="cache dir (default $LIVERL_TEST_MODEL_CACHE or a temp dir)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    for fam in args.families:
        print(fam, ensure_test_model(fam, args.cache, args.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
