"""``liverl bench delta``: how small and how fast the weight-delta codec is on realistic RL updates.

Two families of cases, each a ``(name, base, target)`` triple of bf16 state dicts:

- ``demo_cases``: the demo policy after 1, 10 and 50 AdamW steps (causal-LM loss on random tokens) at
  RL-typical learning rates; a case is base -> the version after that many steps.
- ``synthetic_cases``: a >= 1 GiB model whose target is one Adam-like step (``lr * sign(noise)`` on the
  fp32 master, rounded to bf16), with ``lr`` bisected so that 1%, 2% or 5% of the elements change.

Both are built in ``liverl.bench.delta_cases``.

``measure`` turns one case into a row: the codec's ratio next to plain zstd, XOR + zstd and two order-0
entropy bounds of the change, encode and decode-apply throughput, and the codec's working memory. ``run``
prints the table (see ``liverl bench delta --help`` for what each column means).
"""

from __future__ import annotations

import ctypes
import gc
import json
import math
import os
import platform
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Self

import numpy as np
import zstandard
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from liverl.bench.delta_cases import (
    DEMO_CADENCES,
    DEMO_LRS,
    SYNTHETIC_FRACTIONS,
    Case,
    demo_cases,
    synthetic_cases,
    synthetic_layout,
)

if TYPE_CHECKING:
    import torch

ROW_KEYS = (
    "case",
    "changed_fraction",
    "ratio_liverl",
    "ratio_zstd",
    "ratio_xor_zstd",
    "ratio_entropy_bound",
    "ratio_conditional_bound",
    "encode_gbps",
    "decode_apply_gbps",
    "peak_rss_bytes",
)
_BOUND_CHUNK = 1 << 24  # elements per step of the entropy counting (a few hundred MiB of scratch at most)


class BenchError(RuntimeError):
    """The codec got a case wrong (not bit-exact): the benchmark stops rather than print a number for it."""


# ------------------------------------------------------------------------------------------------ bounds


def _xlogx(x: np.ndarray | float) -> np.ndarray | float:
    x = np.asarray(x, dtype=np.float64)
    return np.where(x > 0, x * np.log2(np.maximum(x, 1.0)), 0.0)


class ChangeCounter:
    """Counts, chunk by chunk, elements per base exponent field and changed elements per (exponent, XOR value).

    From those counts, ``bits()`` gives the two order-0 bounds of coding the change base -> target:

    - ``order0``: ``n * H2(k / n)`` bits to say which of the n elements changed (k of them), plus
      ``k * H(xor)`` with H the empirical entropy of the changed elements' XOR values (one uint16 symbol each);
    - ``conditional``: the same within each group of elements that share the base element's exponent
      field (``(bits >> 7) & 0xFF``), summed: what a coder that conditions on the base could reach.

    With x*log2(x) written L(x): n*H2(k/n) + k*H = L(n) - L(n-k) - sum_v L(c_v).
    """

    def __init__(self) -> None:
        self.n_e = np.zeros(256, dtype=np.int64)  # elements per base exponent field
        self.joint = np.zeros(256 << 16, dtype=np.int64)  # changed elements per (exponent << 16) | xor
        self._pending: list[np.ndarray] = []
        self._pending_size = 0

    def add(self, base_u16: np.ndarray, target_u16: np.ndarray) -> None:
        base_u16, target_u16 = base_u16.reshape(-1), target_u16.reshape(-1)
        for lo in range(0, base_u16.size, _BOUND_CHUNK):
            b = base_u16[lo : lo + _BOUND_CHUNK]
            xor = np.bitwise_xor(b, target_u16[lo : lo + _BOUND_CHUNK])
            exponent = b >> 7
            exponent &= 0xFF
            self.n_e += np.bincount(exponent, minlength=256)
            changed = xor != 0
            key = exponent[changed].astype(np.int64)
            key <<= 16
            key |= xor[changed]
            self._pending.append(key)
            self._pending_size += key.size
            if self._pending_size >= _BOUND_CHUNK:
                self._flush()

    def _flush(self) -> None:
        if self._pending:
            keys = np.concatenate(self._pending)
            if keys.size >= self.joint.size // 8:
                self.joint += np.bincount(keys, minlength=self.joint.size)
            else:  # few changes: sorting them beats touching all 16M counters
                values, counts = np.unique(keys, return_counts=True)
                self.joint[values] += counts
        self._pending, self._pending_size = [], 0

    def bits(self) -> dict[str, float]:
        self._flush()
        joint = self.joint.reshape(256, 1 << 16)
        n_e = self.n_e.astype(np.float64)
        unchanged_e = n_e - joint.sum(axis=1)
        n, unchanged = n_e.sum(), unchanged_e.sum()
        sum_l_changed_ev = float(_xlogx(joint[joint > 0]).sum())
        order0 = float(_xlogx(n) - _xlogx(unchanged) - _xlogx(joint.sum(axis=0)).sum())
        conditional = float((_xlogx(n_e) - _xlogx(unchanged_e)).sum() - sum_l_changed_ev)
        return {"n": int(n), "k": int(n - unchanged), "order0": max(order0, 0.0), "conditional": max(conditional, 0.0)}


# ------------------------------------------------------------------------------------------------ memory


def _rss_anon() -> int:
    """Resident anonymous memory: private (RssAnon) plus shared anonymous mappings (RssShmem)."""
    found, total = set(), 0
    with open("/proc/self/status") as f:
        for line in f:
            key = line.split(":", 1)[0]
            if key in ("RssAnon", "RssShmem"):
                found.add(key)
                total += int(line.split()[1]) * 1024
    if "RssAnon" not in found:
        raise BenchError("/proc/self/status has no RssAnon line (peak memory needs Linux)")
    return total


def _trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the baseline just includes the allocator's free pages
        pass


class PeakRss:
    """Peak anonymous RSS above the level at entry, sampled every ``interval`` s in a daemon thread."""

    def __init__(self, interval: float = 0.002) -> None:
        self.interval, self.peak_above = interval, 0
        self._stop = threading.Event()

    def __enter__(self) -> Self:
        _trim()
        self.start = self._peak = _rss_anon()
        self._thread = threading.Thread(target=self._sample, name="bench-rss", daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self._peak = max(self._peak, _rss_anon())
            time.sleep(self.interval)

    def __exit__(self, *exc) -> None:
        self._peak = max(self._peak, _rss_anon())
        self._stop.set()
        self._thread.join()
        self.peak_above = max(0, self._peak - self.start)


# ------------------------------------------------------------------------------------------------ measure


def _check_bit_exact(case: str, got: Mapping, target: Mapping) -> None:
    import torch

    if set(got) != set(target):
        raise BenchError(
            f"{case}: decode-apply gave tensors {sorted(set(got) ^ set(target))[:5]} that differ from the target's"
        )
    for name, t in target.items():
        g = got[name]
        if (
            g.dtype != t.dtype
            or g.shape != t.shape
            or not torch.equal(g.contiguous().view(torch.int16), t.contiguous().view(torch.int16))
        ):
            raise BenchError(f"{case}: decode-apply is not bit-exact: tensor {name!r} differs from the target")


def _ratio(raw: float, compressed: float) -> float:
    return raw / compressed if compressed > 0 else math.inf


def _time_encode(base: Mapping[str, torch.Tensor], target: Mapping[str, torch.Tensor], repeat: int) -> tuple:
    """(best seconds, largest peak RSS above entry, the encoded delta) of ``repeat`` encodes."""
    from deploy.registry import delta

    encode_s, encode_peak, blob = math.inf, 0, b""
    for _ in range(repeat):
        blob = b""
        with PeakRss() as mem:
            t0 = time.perf_counter()
            blob = delta.encode_delta(base, target, 0, 1)
            seconds = time.perf_counter() - t0
        encode_s, encode_peak = min(encode_s, seconds), max(encode_peak, mem.peak_above)
    return encode_s, encode_peak, blob


def _time_decode(
    case_name: str, base: Mapping[str, torch.Tensor], target: Mapping[str, torch.Tensor], blob: bytes, repeat: int
) -> tuple[float, int]:
    """(best seconds, largest peak RSS above entry) of ``repeat`` decode-applies of ``blob`` onto copies of ``base``,
    each checked bit-exact against ``target``."""
    from deploy.registry import delta

    decode_s, decode_peak = math.inf, 0
    for _ in range(repeat):
        state = {k: v.clone() for k, v in base.items()}
        with PeakRss() as mem:
            t0 = time.perf_counter()
            delta.apply_delta_inplace(state, blob)
            seconds = time.perf_counter() - t0
        decode_s, decode_peak = min(decode_s, seconds), max(decode_peak, mem.peak_above)
        _check_bit_exact(case_name, state, target)
        del state
    return decode_s, decode_peak


def measure(
    case_name: str,
    base: Mapping[str, torch.Tensor],
    target: Mapping[str, torch.Tensor],
    repeat: int = 1,
    phase: Callable[[str], None] = lambda _: None,
) -> dict:
    """One row: sizes, bounds, throughput and working memory of coding ``base -> target``.

    Timings are the best of ``repeat``; memory peaks the largest. Raises ``BenchError`` when the decoded
    weights are not bit-identical to ``target``. ``phase`` is told what is running (for a progress display).
    """
    import torch

    from deploy.registry import delta

    if repeat < 1:
        raise ValueError(f"--repeat must be >= 1, got {repeat}")
    bad = sorted({str(t.dtype) for t in base.values() if t.dtype != torch.bfloat16})
    if bad:
        raise ValueError(f"the benchmark's bounds are for bf16 weights; {case_name} has {bad}")
    raw_bytes = sum(t.numel() * t.element_size() for t in target.values())
    gc.collect()  # the previous case's garbage, so that it is not freed (or counted) during a measurement

    phase("encode")
    encode_s, encode_peak, blob = _time_encode(base, target, repeat)
    header = delta.read_header(blob)

    phase("decode-apply")
    decode_s, decode_peak = _time_decode(case_name, base, target, blob, repeat)

    phase("baselines")
    zstd_bytes, xor_zstd_bytes = delta.baseline_bytes(base, target)

    phase("entropy bounds")
    counter = ChangeCounter()
    for name in sorted(target):
        counter.add(delta.raw_bytes(base[name]).view(np.uint16), delta.raw_bytes(target[name]).view(np.uint16))
    bits = counter.bits()
    raw_bits = 8.0 * raw_bytes

    row = {
        "case": case_name,
        "changed_fraction": bits["k"] / bits["n"] if bits["n"] else 0.0,
        "ratio_liverl": _ratio(raw_bytes, len(blob)),
        "ratio_zstd": _ratio(raw_bytes, zstd_bytes),
        "ratio_xor_zstd": _ratio(raw_bytes, xor_zstd_bytes),
        "ratio_entropy_bound": _ratio(raw_bits, bits["order0"]),
        "ratio_conditional_bound": _ratio(raw_bits, bits["conditional"]),
        "encode_gbps": raw_bytes / encode_s / 1e9,
        "decode_apply_gbps": raw_bytes / decode_s / 1e9,
        "peak_rss_bytes": max(encode_peak, decode_peak),
        # extras
        "raw_bytes": raw_bytes,
        "delta_bytes": len(blob),
        "payload_bytes": getattr(header, "payload_bytes", None),
        "zstd_bytes": zstd_bytes,
        "xor_zstd_bytes": xor_zstd_bytes,
        "entropy_bound_bytes": bits["order0"] / 8,
        "conditional_bound_bytes": bits["conditional"] / 8,
        "elements": bits["n"],
        "changed_elements": bits["k"],
        "vs_xor_zstd": _ratio(xor_zstd_bytes, len(blob)),
        "vs_entropy_bound": bits["order0"] / 8 / len(blob) if blob else math.inf,
        "encode_s": encode_s,
        "decode_apply_s": decode_s,
        "peak_rss_encode_bytes": encode_peak,
        "peak_rss_decode_apply_bytes": decode_peak,
        "method_bytes": header.method_bytes,
        "repeat": repeat,
    }
    return row


# ------------------------------------------------------------------------------------------------ report


def _size(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _x(r: float) -> str:
    if math.isinf(r):
        return "inf"
    return f"{r:,.0f}x" if r >= 100 else f"{r:.1f}x" if r >= 10 else f"{r:.2f}x"


def machine() -> str:
    """Cores, CPU model, memory, and the versions that the numbers depend on."""
    import torch

    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), model)
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return (
        f"{os.cpu_count()} cores, {model}, {mem / 2**30:.0f} GiB RAM; python {platform.python_version()}, "
        f"torch {torch.__version__}, numpy {np.__version__}, zstandard {zstandard.__version__}"
    )


def _commit() -> str:
    root = Path(__file__).resolve().parent.parent
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10, check=False
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown commit"
    return f"commit {sha or 'unknown'}{' + local changes' if dirty else ''}"


def table(rows: list[dict], title: str):
    """The rich Table of ``rows`` (one per case)."""
    t = Table(title=title, title_justify="left")
    t.add_column("case")
    t.add_column("changed", justify="right")
    t.add_column("raw", justify="right")
    t.add_column("liverl", justify="right", style="bold")
    for col in (
        "zstd",
        "xor+zstd",
        "order-0\nbound",
        "cond.\nbound",
        "liverl vs\nxor+zstd",
        "liverl vs\norder-0",
        "encode\nGB/s",
        "apply\nGB/s",
        "peak RSS\nenc / apply",
        "delta",
    ):
        t.add_column(col, justify="right")
    for i, r in enumerate(rows):
        last_of_group = i + 1 == len(rows) or rows[i + 1]["case"].split()[0] != r["case"].split()[0]
        t.add_row(
            r["case"],
            f"{r['changed_fraction']:.3%}",
            _size(r["raw_bytes"]),
            _x(r["ratio_liverl"]),
            _x(r["ratio_zstd"]),
            _x(r["ratio_xor_zstd"]),
            _x(r["ratio_entropy_bound"]),
            _x(r["ratio_conditional_bound"]),
            _x(r["vs_xor_zstd"]),
            f"{r['vs_entropy_bound']:.2f}",
            f"{r['encode_gbps']:.2f}",
            f"{r['decode_apply_gbps']:.2f}",
            f"{_size(r['peak_rss_encode_bytes'])} / {_size(r['peak_rss_decode_apply_bytes'])}",
            _size(r["delta_bytes"]),
            end_section=last_of_group,
        )
    return t


def _json_safe(row: dict) -> dict:
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}


def _warm_up() -> None:
    """Load (or compile) the codec's kernels first, so one-time costs stay out of the timings."""
    from deploy.registry import delta

    delta.warm_up()


def run(
    cache_dir: Path | None = None,
    seed: int = 0,
    synthetic_gb: float = 1.0,
    skip_demo: bool = False,
    skip_synthetic: bool = False,
    repeat: int = 1,
    json_path: str | None = None,
    command: str = "liverl bench delta",
    console=None,
) -> list[dict]:
    """Measure every case, print the table (with the command and machine under it), optionally write JSON."""
    from deploy.registry import delta

    if skip_demo and skip_synthetic:
        raise ValueError("--skip-demo and --skip-synthetic together leave nothing to measure")
    if not skip_demo and cache_dir is None:
        raise ValueError("the demo cases need the model cache folder (cache_dir)")
    if repeat < 1:
        raise ValueError(f"--repeat must be >= 1, got {repeat}")
    if not skip_synthetic:
        synthetic_layout(synthetic_gb)  # validates gb before minutes of demo cases
    console = console or Console(width=None if sys.stdout.isatty() else 200)  # a file or pipe gets whole rows
    families: list[tuple[int, Callable[[], Iterator[Case]]]] = []
    if not skip_demo:
        families.append((len(DEMO_LRS) * len(DEMO_CADENCES), lambda: demo_cases(cache_dir, seed=seed)))
    if not skip_synthetic:
        families.append((len(SYNTHETIC_FRACTIONS), lambda: synthetic_cases(synthetic_gb, seed=seed)))

    _warm_up()
    rows = _measure_all(families, repeat)
    console.print(table(rows, "liverl delta codec: compression ratio (raw bytes / compressed bytes) and speed"))
    _print_notes(console, rows)
    console.print(f"reproduce: [bold]{command}[/bold]  ({_commit()}, delta format {delta.FORMAT_VERSION})")
    console.print(f"machine: {machine()}")
    if json_path:
        Path(json_path).write_text(json.dumps([_json_safe(r) for r in rows], indent=2) + "\n")
        console.print(f"wrote {len(rows)} rows to {json_path}")
    return rows


def _measure_all(families: list[tuple[int, Callable[[], Iterator[Case]]]], repeat: int) -> list[dict]:
    """``measure`` every case of every family, one at a time (a case's weights are freed before the next is built),
    with a progress bar on stderr."""
    rows: list[dict] = []
    with Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
    ) as progress:
        task = progress.add_task("building the first case", total=sum(n for n, _ in families))
        for _, make in families:
            cases = make()
            while True:
                progress.update(task, description="building the next case")
                case = next(cases, None)
                if case is None:
                    break
                name, base, target = case
                del case
                rows.append(
                    measure(
                        name,
                        base,
                        target,
                        repeat=repeat,
                        phase=lambda p, name=name: progress.update(task, description=f"{name}: {p}"),
                    )
                )
                del base, target
                progress.advance(task)
    return rows


def _print_notes(console, rows: list[dict]) -> None:
    """What the table's columns rest on: the codec's chunk, the apply path, how memory is sampled."""
    from deploy.registry import delta

    chunk = delta.CHUNK_ELEMENTS
    notes = [
        (
            f"codec chunk: {chunk:,} elements ({_size(chunk * 2)} of bf16); working memory should stay "
            f"under 2 x chunk bytes + delta bytes"
        ),
        (
            "apply: apply_delta_inplace, the full safe path: verify the container and the whole base, decode "
            "and apply chunk by chunk, verify every touched tensor"
        ),
    ]
    notes.append(
        "peak RSS: anonymous resident memory above the level before the call (encode / decode-apply), "
        "sampled every 2 ms; every decoded row was checked bit-exact against its target"
    )
    if any(math.isinf(r["ratio_entropy_bound"]) for r in rows):
        notes.append("inf: nothing changed, so the bound is 0 bits (written as null in JSON)")
    for n in notes:
        console.print(f"[dim]{n}[/dim]")
