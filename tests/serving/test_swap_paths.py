"""The node's swap sequence (``serving.node.swap.EngineSwap``) on a recording engine client: which engine calls each
``via`` makes, in which order, and that the engine always resumes with the weights it reports."""

from __future__ import annotations

import asyncio

import pytest

from serving.node.swap import EngineSwap

DELTAS = [("/d/1.delta", "c1"), ("/d/2.delta", "c2")]
FRM, TO = (3, "c0"), (5, "c2")


class RecordingEngine:
    """An ``AsyncLLM`` stand-in: records every call; ``fail`` names a call that raises."""

    def __init__(self, fail: str | None = None):
        self.calls: list[tuple] = []
        self.fail = fail
        self.engine_core = self
        self.served = FRM[1]

    def _call(self, *call) -> None:
        self.calls.append(call)
        if call[0] == self.fail:
            raise RuntimeError(f"{call[0]} failed")

    async def collective_rpc(self, method: str, timeout=None, args=()):
        self._call(method, *args)
        if method == "liverl_staged":
            return [{"ok": True, "ready": True, "stage_ms": 1.0}]
        if method == "liverl_commit":
            self.served = TO[1]
            return [{"ok": True, "checksum": TO[1], "version": TO[0]}]
        if method == "liverl_apply_delta":
            self.served = args[1]
            return [{"ok": True}]
        if method == "liverl_checksum":
            return [{"ok": True, "checksum": self.served}]
        return [{"ok": True, "t_wall": 0.0}]

    async def pause_scheduler_async(self, mode: str, clear_cache: bool):
        self._call("core.pause", mode, clear_cache)

    async def pause_generation(self, mode: str, clear_cache: bool):
        self._call("pause_generation", mode, clear_cache)

    async def start_weight_update(self):
        self._call("start_weight_update")

    async def update_weights(self, request):
        self._call("update_weights", request.update_info)
        self.served = TO[1]

    async def finish_weight_update(self, weight_version=None):
        self._call("finish_weight_update", weight_version)

    async def update_weight_version(self, version: str):
        self._call("update_weight_version", version)

    async def resume_generation(self):
        self._call("resume_generation")


def _names(engine: RecordingEngine) -> list[str]:
    return [c[0] for c in engine.calls if c[0] != "liverl_version"]  # the probe races the pause: order not fixed


def test_via_vllm_makes_vllms_weight_update_calls_in_order():
    pytest.importorskip("vllm")
    engine = RecordingEngine()
    out = asyncio.run(EngineSwap(engine).run(DELTAS, FRM, TO, via="vllm"))
    assert out["ok"] and out["version"] == TO[0] and out["via"] == "vllm"
    assert _names(engine) == [
        "liverl_stage",
        "liverl_staged",
        "start_weight_update",
        "core.pause",
        "update_weights",
        "finish_weight_update",
        "resume_generation",
        "liverl_checksum",
    ]
    assert ("core.pause", "keep", True) in engine.calls  # vLLM's keep mode, the prefix cache reset
    assert ("update_weights", {"deltas": [list(d) for d in DELTAS], "version": TO[0]}) in engine.calls
    assert ("finish_weight_update", str(TO[0])) in engine.calls


def test_via_liverl_commits_with_liverls_rpc():
    engine = RecordingEngine()
    out = asyncio.run(EngineSwap(engine).run(DELTAS, FRM, TO, via="liverl"))
    assert out["ok"] and out["via"] == "liverl"
    assert _names(engine) == [
        "liverl_stage",
        "liverl_staged",
        "core.pause",
        "liverl_commit",
        "update_weight_version",
        "resume_generation",
        "liverl_checksum",
    ]


def test_via_vllm_a_failed_label_puts_the_old_weights_back_before_resuming():
    pytest.importorskip("vllm")
    engine = RecordingEngine(fail="finish_weight_update")
    out = asyncio.run(EngineSwap(engine).run(DELTAS, FRM, TO, via="vllm"))
    assert not out["ok"] and out["restored"] is True and out["version"] == FRM[0]
    names = _names(engine)
    undo = [c for c in engine.calls if c[0] == "liverl_apply_delta"]
    assert undo == [("liverl_apply_delta", "/d/2.delta", "c1"), ("liverl_apply_delta", "/d/1.delta", "c0")]
    assert names.index("liverl_apply_delta") < names.index("resume_generation")


def test_via_vllm_a_refused_update_resumes_on_the_old_weights():
    pytest.importorskip("vllm")
    engine = RecordingEngine(fail="update_weights")
    engine.served = FRM[1]
    out = asyncio.run(EngineSwap(engine).run(DELTAS, FRM, TO, via="vllm"))
    assert not out["ok"] and out["restored"] is True and "update_weights failed" in out["error"]
    assert "liverl_apply_delta" not in _names(engine)  # the backend wrote nothing it did not put back itself
    assert _names(engine)[-2:] == ["liverl_checksum", "resume_generation"]
