"""The OpenAI wire format as the gateway speaks it: request models, what a generation record takes from a response
(plain or streamed), and what the client gets back.

A request is validated by a pydantic model (``CompletionRequest``, ``ChatCompletionRequest``); a refusal is a
``BadRequest`` naming the parameter. Fields the gateway has no opinion on (``stop``, ``logit_bias``, ``tools``,
``response_format``, ...) pass through to the node, which validates them itself. The node is always asked for what
the record needs: the token ids of prompt and completion and the sampled token's log-prob (``logprobs`` 0 /
``top_logprobs`` 0). vLLM runs with ``--logprobs-mode processed_logprobs``, so that log-prob is the one of the
distribution actually sampled from, after temperature, top-k/top-p/min-p, penalties, logit bias and any
structured-output mask. What the client did not ask for is removed from its copy of the response.

Trainable: a greedy request (``temperature`` 0, or ``top_k`` 1) is served and logged but is not a sample of the
policy, so its records say ``trainable: false, untrainable_reason: "greedy"``. Beam search and ``best_of`` (a
choice picked among several) are refused; ``n > 1``, with or without a ``seed``, is n samples.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_core import to_json

from core.schemas import SamplingParams
from serving.node.client import SERVED_MODEL_NAME

MAX_PROMPT_CHARS = 100_000
MAX_LOGPROBS = 20
MAX_CHOICES = 64  # prompts x n per request: each choice is one generation record
GREEDY_TEMPERATURE = 1e-5  # vLLM samples greedily below this temperature
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # vLLM's (and OpenAI's) default for /v1/completions

REFUSED: dict[str, str] = {
    "use_beam_search": "beam search is not sampling from the policy",
    "best_of": "best_of picks a choice among several, so it is not a sample of the policy; use n",
    "echo": "echo is not supported (the logged completion would include the prompt)",
    "logprob_token_ids": "logprob_token_ids is not supported (the record needs the sampled token's log-prob)",
    "prompt_embeds": "prompt_embeds is not supported (the record needs the prompt's token ids)",
}
"""Parameters refused whenever they ask for more than the default, with why."""


class BadRequest(ValueError):
    """A client error, answered with its HTTP status and an OpenAI-style error body naming the parameter."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status


def error_body(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_response(
    status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"
) -> web.Response:
    """``error_body`` as the gateway's HTTP answer."""
    return web.Response(
        body=to_json(error_body(status, message, param, kind)), status=status, content_type="application/json"
    )


class _GenerationRequest(BaseModel):
    """What both routes share. Strict types: ``"5"`` is not a number, ``true`` is not 1."""

    model_config = ConfigDict(extra="allow", strict=True)
    route: ClassVar[str]  # the OpenAI path, on the gateway and on the node

    model: str | None = Field(default=None, description="Ignored: the node serves one model.")
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0.0, le=100.0, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0, allow_inf_nan=False)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0, allow_inf_nan=False)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=10.0, allow_inf_nan=False)
    seed: int | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    return_token_ids: bool = False
    use_beam_search: Any = None
    best_of: Any = None
    echo: Any = None
    logprob_token_ids: Any = None
    prompt_embeds: Any = None

    @field_validator(*REFUSED, mode="before")
    @classmethod
    def _refuse(cls, v: Any, info) -> Any:
        if v is None or v is False or (info.field_name == "best_of" and v == 1 and v is not True):
            return v
        raise ValueError(REFUSED[info.field_name])

    @classmethod
    def parse(cls, raw: bytes) -> _GenerationRequest:
        """Validate a request body; raises ``BadRequest`` naming the first bad parameter."""
        try:
            req = cls.model_validate_json(raw)
        except ValidationError as e:
            err = e.errors(include_url=False)[0]
            if err["type"] == "json_invalid":
                raise BadRequest(f"the request body is not valid JSON: {err['msg']}") from None
            param = str(err["loc"][0]) if err["loc"] else None
            msg = err["msg"].removeprefix("Value error, ")
            raise BadRequest(f"'{param}': {msg}" if param else f"the request body: {msg}", param) from None
        if req.n_choices > MAX_CHOICES:
            raise BadRequest(
                f"'n': {req.n_choices} generations (prompts x n) is more than {MAX_CHOICES} per request", "n"
            )
        return req

    # -- what the record needs ---------------------------------------------------------------------------------

    @property
    def n_choices(self) -> int:
        return self.n

    def untrainable_reason(self) -> str | None:
        if (self.temperature is not None and self.temperature < GREEDY_TEMPERATURE) or self.top_k == 1:
            return "greedy"
        return None

    def sampling(self, max_tokens: int) -> SamplingParams:
        """The decoding the node ran: the request's values, vLLM's defaults for the rest."""
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k is None else self.top_k,
            min_p=self.min_p or 0.0,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            seed=self.seed,
            max_tokens=max_tokens,
        )

    def node_body(self) -> dict:
        body = self.model_dump(exclude_unset=True, exclude_none=True)
        body.update(model=SERVED_MODEL_NAME, return_token_ids=True)
        return body


class CompletionRequest(_GenerationRequest):
    route: ClassVar[str] = "/v1/completions"

    prompt: str | list[str]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, v: Any) -> Any:
        prompts = v if isinstance(v, list) else [v]
        if not prompts or not all(isinstance(p, str) for p in prompts):
            raise ValueError("must be a string or a list of strings (token-id prompts are not supported)")
        if not all(0 < len(p) <= MAX_PROMPT_CHARS for p in prompts):
            raise ValueError(f"every prompt must have 1..{MAX_PROMPT_CHARS} characters")
        return v

    @property
    def prompts(self) -> list[str]:
        return self.prompt if isinstance(self.prompt, list) else [self.prompt]

    @property
    def n_choices(self) -> int:
        return len(self.prompts) * self.n

    def node_body(self) -> dict:
        body = super().node_body()
        body["logprobs"] = self.logprobs or 0
        return body

    def max_tokens_for(self, max_model_len: int, n_prompt_tokens: int) -> int:
        return self.max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS


class ChatCompletionRequest(_GenerationRequest):
    route: ClassVar[str] = "/v1/chat/completions"

    messages: list[dict[str, Any]] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    return_prompt_text: bool = False

    def node_body(self) -> dict:
        body = super().node_body()
        body.update(logprobs=True, top_logprobs=self.top_logprobs or 0, return_prompt_text=True)
        return body

    def max_tokens_for(self, max_model_len: int, n_prompt_tokens: int) -> int:
        """vLLM's rule: the request's limit, else what is left of the context."""
        return self.max_completion_tokens or self.max_tokens or max(1, max_model_len - n_prompt_tokens)


# ------------------------------------------------------------------------------------------------ responses


@dataclass
class Choice:
    """One generation as read from the node's response: everything its record needs."""

    prompt: str = ""
    prompt_token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)  # parts, joined at the end (streams arrive in pieces)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None


def completion_choices(req: CompletionRequest, out: dict) -> dict[int, Choice]:
    """Choices of a whole ``/v1/completions`` response (``choices[i]`` is prompt ``i // n``)."""
    acc: dict[int, Choice] = {}
    add_completion_chunk(req, out, acc)
    return acc


def add_completion_chunk(req: CompletionRequest, chunk: dict, acc: dict[int, Choice]) -> list[int]:
    """Fold one response or stream chunk into ``acc``; returns the indices that finished in it."""
    finished = []
    for c in chunk.get("choices") or ():
        i = c["index"]
        ch = acc.get(i)
        if ch is None:
            ch = acc[i] = Choice(prompt=req.prompts[i // req.n])
        if c.get("prompt_token_ids"):
            ch.prompt_token_ids = c["prompt_token_ids"]
        ch.text.append(c.get("text") or "")
        ch.token_ids += c.get("token_ids") or ()
        if c.get("logprobs"):
            ch.logprobs += c["logprobs"]["token_logprobs"]
        if c.get("finish_reason") is not None:
            ch.finish_reason = c["finish_reason"]
            finished.append(i)
    return finished


def chat_choices(req: ChatCompletionRequest, out: dict) -> dict[int, Choice]:
    acc: dict[int, Choice] = {}
    add_chat_chunk(req, out, acc)
    return acc


def add_chat_chunk(req: ChatCompletionRequest, chunk: dict, acc: dict[int, Choice]) -> list[int]:
    """Same for ``/v1/chat/completions``. Prompt ids and text are top-level (in the first chunk of a stream):
    they wait in ``acc[-1]`` and are copied into each choice when it finishes. Content is in ``message``/``delta``."""
    finished = []
    if chunk.get("prompt_token_ids"):
        acc.setdefault(-1, Choice()).prompt_token_ids = chunk["prompt_token_ids"]
    if chunk.get("prompt_text") is not None:
        acc.setdefault(-1, Choice()).prompt = chunk["prompt_text"]
    for c in chunk.get("choices") or ():
        i = c["index"]
        ch = acc.get(i)
        if ch is None:
            ch = acc[i] = Choice()
        message = c.get("message") or c.get("delta") or {}
        ch.text.append(message.get("content") or "")
        ch.token_ids += c.get("token_ids") or ()
        if c.get("logprobs") and c["logprobs"].get("content"):
            ch.logprobs += [t["logprob"] for t in c["logprobs"]["content"]]
        if c.get("finish_reason") is not None:
            prompt = acc.get(-1, Choice())
            ch.prompt, ch.prompt_token_ids = prompt.prompt, prompt.prompt_token_ids
            ch.finish_reason = c["finish_reason"]
            finished.append(i)
    return finished


def for_client(
    req: _GenerationRequest, out: dict, ids: list[str], version: int, edit_keys: list[str] | None = None
) -> dict:
    """The client's copy of a response or chunk: what it did not ask for removed, generation ids (and edit keys, for
    a user the gateway can forget: ``liverl_sdk.edits``) added."""
    chat = isinstance(req, ChatCompletionRequest)
    keep_logprobs = req.logprobs if chat else req.logprobs is not None
    for c in out.get("choices") or ():
        c["generation_id"] = ids[c["index"]]
        if edit_keys:
            c["edit_key"] = edit_keys[c["index"]]
        if not keep_logprobs:
            c.pop("logprobs", None)
        if not req.return_token_ids:
            c.pop("token_ids", None)
            c.pop("prompt_token_ids", None)
    if chat:
        if not req.return_token_ids:
            out.pop("prompt_token_ids", None)
        if not req.return_prompt_text:
            out.pop("prompt_text", None)
    choices = out.get("choices")
    if req.stream and choices:
        first = choices[0]["index"]
        out["liverl"] = {"generation_id": ids[first], "policy_version": version}
        if edit_keys:
            out["liverl"]["edit_key"] = edit_keys[first]
    else:
        out["liverl"] = {"generation_id": ids[0], "generation_ids": ids, "policy_version": version}
        if edit_keys:
            out["liverl"]["edit_key"], out["liverl"]["edit_keys"] = edit_keys[0], edit_keys
    return out
