"""Architecture families: the learner reads and writes each family's files exactly as transformers does.

Every family's tiny model (``liverl.testing.models``) is checked against transformers itself: the file names
and tensors liverl writes are those ``save_pretrained`` writes, and ``from_pretrained`` gives the same logits.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from learner.families import FAMILIES
from learner.model import (
    INDEX_FILE,
    assign_weights,
    load_model,
    load_state_dict,
    model_family,
    save_model_dir,
    state_dict_from_model,
    weight_files,
)
from liverl.testing.models import SPECS, default_cache, ensure_test_model


@pytest.fixture(scope="module")
def cache():
    return default_cache()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_files_round_trip_and_match_transformers(family, cache, tmp_path):
    from transformers import AutoModelForCausalLM

    model_dir = ensure_test_model(family, cache)
    assert model_family(model_dir).model_type == family
    sd = load_state_dict(model_dir)
    assert sd and all(v.dtype == torch.bfloat16 for v in sd.values())
    model = load_model(model_dir)
    back = state_dict_from_model(model)
    assert back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)

    # the names and bytes transformers itself writes for this model
    ref = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16)
    ref.save_pretrained(tmp_path / "hf", safe_serialization=True)
    theirs = {}
    for f in sorted((tmp_path / "hf").glob("*.safetensors")):
        from safetensors.torch import load_file

        theirs.update(load_file(str(f)))
    assert theirs.keys() == sd.keys()
    assert all(torch.equal(theirs[k], sd[k]) for k in sd)

    ids = torch.tensor([[5, 17, 99, 260, 3, 41]])
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, ref.float()(input_ids=ids).logits)


def test_sharded_dir_stays_sharded(cache, tmp_path):
    src = ensure_test_model("mixtral", cache)  # built over two shards
    where = weight_files(src)
    assert len(set(where.values())) == 2
    sd = load_state_dict(src)
    sd2 = {k: (v + 1 if k == "lm_head.weight" else v) for k, v in sd.items()}
    out = save_model_dir(src, sd2, tmp_path / "v1")
    assert weight_files(out) == where  # same shard files, each weight in the same one
    assert sorted(p.name for p in out.glob("*.safetensors")) == sorted(set(where.values()))
    index = json.loads((out / INDEX_FILE).read_text())
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in sd.values())
    assert (out / "tokenizer_config.json").read_bytes() == (src / "tokenizer_config.json").read_bytes()
    loaded = load_state_dict(out)
    assert torch.equal(loaded["lm_head.weight"], sd2["lm_head.weight"])
    with pytest.raises(ValueError, match="missing"):
        save_model_dir(src, {k: v for k, v in sd.items() if k != "lm_head.weight"}, tmp_path / "v2")


def test_tied_embeddings_are_one_weight(cache, tmp_path):
    from transformers import AutoConfig

    assert json.loads((ensure_test_model("qwen3", cache) / "config.json").read_text())["tie_word_embeddings"]
    src = ensure_test_model("llama", cache)  # untied: tie it here
    cfg = json.loads((src / "config.json").read_text())
    cfg["tie_word_embeddings"] = True
    tied = tmp_path / "tied"
    tied.mkdir()
    for p in src.iterdir():
        if p.name != "config.json":
            shutil.copy(p, tied / p.name)
    (tied / "config.json").write_text(json.dumps(cfg))
    assert AutoConfig.from_pretrained(str(tied)).tie_word_embeddings
    sd = {k: v for k, v in load_state_dict(src).items() if k != "lm_head.weight"}
    save_model_dir(tied, sd, tied)
    model = load_model(tied)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    back = state_dict_from_model(model)
    assert back.keys() == sd.keys() and "lm_head.weight" not in back
    new = dict(sd, **{"model.embed_tokens.weight": sd["model.embed_tokens.weight"] * 2})
    assign_weights(model, new)
    assert torch.equal(model.lm_head.weight.to(torch.bfloat16), new["model.embed_tokens.weight"])


def test_unknown_family_is_refused_by_name(cache, tmp_path):
    src = ensure_test_model("qwen3", cache)
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg.update(model_type="gpt_neox", architectures=["GPTNeoXForCausalLM"])
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"model family 'gpt_neox' \(GPTNeoXForCausalLM\) is not handled") as e:
        load_model(bad)
    assert "qwen3_moe (Qwen3MoeForCausalLM)" in str(e.value)  # and it says which ones are
    cfg.update(model_type="qwen3", architectures=["Qwen3ForSequenceClassification"])
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="causal LM"):
        model_family(bad)


def test_weights_must_be_bf16(cache, tmp_path):
    from safetensors.torch import save_file

    src = ensure_test_model("qwen3", cache)
    out = tmp_path / "fp32"
    shutil.copytree(src, out)
    save_file({k: v.float() for k, v in load_state_dict(src).items()}, str(out / "model.safetensors"))
    with pytest.raises(ValueError, match="not bf16"):
        load_state_dict(out)


def test_every_family_has_a_test_model():
    assert set(FAMILIES) <= set(SPECS)
