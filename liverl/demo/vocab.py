"""The demo policy's character tokenizer: its vocabulary, encoding and teacher-forcing batches.

Apart from ``liverl.demo.base_policy`` (which builds the model) so that the scorer (``liverl.demo.score``), which the
base policy's warm start calls, reads the tokenizer without importing the builder: no import circle.
"""

from __future__ import annotations

from liverl.demo import task

PAD_TOKEN = "<|pad|>"
EOS_TOKEN = "<|endoftext|>"
UNK_TOKEN = "<|unk|>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, EOS_TOKEN, UNK_TOKEN)
"""Ids 0, 1, 2. EOS (id 1) ends every completion; there is no BOS and encoding adds no special tokens."""
PAD_ID, EOS_ID, UNK_ID = 0, 1, 2
VOCAB: tuple[str, ...] = SPECIAL_TOKENS + tuple(task.ALPHABET)
CHAR_TO_ID: dict[str, int] = {c: i for i, c in enumerate(VOCAB)}
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
"""The chat template: the messages' contents, concatenated. The model has no role tokens, so a chat request with
one user message reads exactly the tokens of the same text sent as a completion prompt."""


def encode_text(text: str) -> list[int]:
    """Token ids of ``text`` without special tokens (same as the tokenizer, without loading it)."""
    try:
        return [CHAR_TO_ID[c] for c in text]
    except KeyError as e:
        raise ValueError(f"character {e.args[0]!r} is not in the task alphabet {task.ALPHABET!r}") from None


def sft_batch(prompts: list, completions: list[str]):
    """Teacher-forcing tensors for prompt+completion+EOS: (input_ids_BT, labels_BT, attention_mask_BT).

    Labels are -100 on the prompt and padding, so only completion tokens (and EOS) are learned.
    """
    import torch  # noqa: PLC0415 torch: the CLI loads this module

    seqs, n_prompt = [], []
    for p, c in zip(prompts, completions, strict=True):
        ids_p = encode_text(p.text)
        seqs.append(ids_p + encode_text(c) + [EOS_ID])
        n_prompt.append(len(ids_p))
    T = max(len(s) for s in seqs)
    ids_BT = torch.full((len(seqs), T), PAD_ID, dtype=torch.long)
    labels_BT = torch.full((len(seqs), T), -100, dtype=torch.long)
    mask_BT = torch.zeros((len(seqs), T), dtype=torch.long)
    for i, (s, n) in enumerate(zip(seqs, n_prompt, strict=True)):
        ids_BT[i, : len(s)] = torch.tensor(s)
        labels_BT[i, n : len(s)] = torch.tensor(s[n:])
        mask_BT[i, : len(s)] = 1
    return ids_BT, labels_BT, mask_BT
