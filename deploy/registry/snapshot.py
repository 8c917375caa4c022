"""Full weights: snapshots in the registry, and memory-mapped model files.

A snapshot is a ``deploy.registry.container`` blob with one zstd frame per tensor (bytes split into planes, most
significant first), each tensor's checksum and the whole-state checksum; decoding verifies all of them.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping

import numpy as np
import torch
import zstandard

from deploy.registry.container import (
    DTYPES,
    SNAPSHOT_MAGIC,
    Blob,
    DeltaError,
    byte_view,
    combine_checksums,
    dtype_name,
    from_planes,
    open_container,
    pack_container,
    tensor_checksum,
    to_planes,
    zstd_compress,
)


def encode_snapshot(state: Mapping[str, torch.Tensor], version: int | None = None, level: int = 3) -> bytearray:
    """Full weights: byte planes + zstd per tensor, per-tensor and whole-state checksums."""
    entries, frames, offset, sums = [], [], 0, {}
    for name in sorted(state):
        t = state[name]
        dtype = dtype_name(t)
        sums[name] = tensor_checksum(t)
        frame = zstd_compress(to_planes(byte_view(t), t.element_size()), level)
        entries.append(
            {
                "name": name,
                "dtype": dtype,
                "shape": list(t.shape),
                "digest": sums[name],
                "offset": offset,
                "length": len(frame),
            }
        )
        frames.append(frame)
        offset += len(frame)
    header = {
        "kind": "snapshot",
        "codec": "byteplanes-zstd",
        "version": version,
        "checksum": combine_checksums(sums),
        "tensors": entries,
    }
    return pack_container(SNAPSHOT_MAGIC, header, frames)


def decode_snapshot(blob: Blob) -> dict[str, torch.Tensor]:
    """Decode and verify a snapshot; every tensor and the whole-state checksum are checked."""
    header, payload = open_container(blob, SNAPSHOT_MAGIC, "snapshot")
    out, sums = {}, {}
    try:
        for e in header["tensors"]:
            dtype, shape = e["dtype"], [int(x) for x in e["shape"]]
            if dtype not in DTYPES:
                raise DeltaError(f"snapshot uses unsupported dtype {dtype!r}")
            dt = DTYPES[dtype]
            nbytes = int(np.prod(shape, dtype=np.int64)) * dt.bits // 8
            if e["offset"] + e["length"] > len(payload):
                raise DeltaError(f"snapshot corrupted: tensor {e['name']!r} lies outside the payload")
            try:
                raw = zstandard.ZstdDecompressor().decompress(
                    payload[e["offset"] : e["offset"] + e["length"]], max_output_size=nbytes
                )
            except zstandard.ZstdError as err:
                raise DeltaError(f"snapshot corrupted: tensor {e['name']!r} does not decompress ({err})") from None
            if len(raw) != nbytes:
                raise DeltaError(f"snapshot corrupted: tensor {e['name']!r} decompressed to {len(raw)} bytes")
            flat = from_planes(np.frombuffer(raw, np.uint8), dt.bits // 8).copy()
            t = torch.from_numpy(flat).view(dt.torch).reshape(shape) if nbytes else torch.empty(shape, dtype=dt.torch)
            out[e["name"]] = t
            sums[e["name"]] = tensor_checksum(t)
            if sums[e["name"]] != e["digest"]:
                raise DeltaError(f"snapshot corrupted: tensor {e['name']!r} decodes to the wrong checksum")
        if combine_checksums(sums) != header["checksum"]:
            raise DeltaError("snapshot corrupted: tensors do not add up to the recorded checksum")
    except (KeyError, TypeError) as e:
        raise DeltaError(f"snapshot corrupted: malformed header ({e!r})") from None
    return out


def open_safetensors(path: str | os.PathLike, writable: bool = False) -> dict[str, torch.Tensor]:
    """The tensors of a ``.safetensors`` file as memory-mapped CPU tensors: nothing is read until used.

    This is how a model larger than RAM goes through the codec: ``encode_delta`` and
    ``apply_delta_inplace`` walk tensors chunk by chunk, so only the chunks in flight are resident and
    the page cache holds the rest. ``writable=True`` maps the file for ``apply_delta_inplace`` to update in
    place (writes go to the file); otherwise the mapping is copy-on-write and the file never changes.
    """
    with open(path, "rb") as f:
        try:
            (hlen,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(hlen))
            if not isinstance(header, dict):
                raise ValueError("the header is not a JSON object")  # noqa: TRY004 -- bad file content, caught below
        except (struct.error, ValueError, MemoryError) as e:
            raise ValueError(f"{path} is not a safetensors file ({e})") from None
    kinds = {
        "BF16": "bfloat16",
        "F16": "float16",
        "F32": "float32",
        "F8_E4M3": "float8_e4m3fn",
        "F8_E5M2": "float8_e5m2",
    }
    out: dict[str, torch.Tensor] = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        if meta["dtype"] not in kinds:
            raise TypeError(f"{path}: tensor {name!r} is {meta['dtype']}; deltas support {sorted(kinds)}")
        dt = DTYPES[kinds[meta["dtype"]]]
        lo, hi = meta["data_offsets"]
        shape = tuple(meta["shape"])
        if hi == lo:
            out[name] = torch.empty(shape, dtype=dt.torch)
            continue
        arr = np.memmap(
            path,
            dtype=dt.uint,
            mode="r+" if writable else "c",
            offset=8 + hlen + lo,
            shape=((hi - lo) // (dt.bits // 8),),
        )
        out[name] = torch.from_numpy(arr).view(dt.torch).reshape(shape)
    return out
