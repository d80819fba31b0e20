"""A GGUF file's header, read with plain file reads: its string metadata (`gguf_strings`), its architecture and its
tensors' places (`gguf_tensors`), in milliseconds and without mapping the file (the `gguf` package's reader maps and
parses all of it). engine.loader refuses an unknown architecture with it before any conversion; engine.gguf_weights
finds the blocks it keeps packed with it."""

from __future__ import annotations

from pathlib import Path

_GGUF_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF value types
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def gguf_strings(gguf: Path, keys: tuple[str, ...]) -> dict[str, str]:
    """The string values of `keys` in a GGUF file's header metadata (read up to the last one found; no
    tensor is touched, so this takes milliseconds where the `gguf` package's reader maps every tensor)."""
    import struct

    found: dict[str, str] = {}
    with open(gguf, "rb") as f:
        _, kv_count = _gguf_counts(f, gguf)
        for _ in range(kv_count):
            key = _gguf_string(f).decode()
            kind = struct.unpack("<I", f.read(4))[0]
            if key in keys and kind == _GGUF_STRING:
                found[key] = _gguf_string(f).decode()
                if len(found) == len(keys):
                    break
            else:
                _gguf_skip(f, kind)
    return found


def _gguf_counts(f, gguf: Path) -> tuple[int, int]:
    """(tensors, metadata pairs) from a GGUF file's first 24 bytes; ValueError if it is not a GGUF file."""
    import struct

    magic, version = f.read(4), struct.unpack("<I", f.read(4))[0]
    if magic != b"GGUF" or version < 2:
        raise ValueError(f"{str(gguf)!r} is not a GGUF file (version 2 or later)")
    return struct.unpack("<QQ", f.read(16))


def _gguf_string(f) -> bytes:
    import struct

    return f.read(struct.unpack("<Q", f.read(8))[0])


def _gguf_skip(f, kind: int) -> None:
    """Skip one header value of GGUF value type `kind`."""
    import struct

    if kind == _GGUF_STRING:
        f.seek(struct.unpack("<Q", f.read(8))[0], 1)
    elif kind == _GGUF_ARRAY:
        item, count = struct.unpack("<IQ", f.read(12))
        if item in _GGUF_SCALAR_BYTES:
            f.seek(_GGUF_SCALAR_BYTES[item] * count, 1)
        else:
            for _ in range(count):
                _gguf_skip(f, item)
    else:
        f.seek(_GGUF_SCALAR_BYTES[kind], 1)


def gguf_tensors(gguf: Path) -> dict[str, tuple[int, tuple[int, ...], int]]:
    """Every tensor of a GGUF file: name -> (ggml type id, dims as ggml orders them (fastest first), the byte
    offset of its data in the file), from the header alone (the `gguf` package's reader maps and touches the
    whole file: ~150 MB of resident memory for SmolLM2's)."""
    import struct

    alignment = 32  # general.alignment's default
    tensors = {}
    with open(gguf, "rb") as f:
        n_tensors, kv_count = _gguf_counts(f, gguf)
        for _ in range(kv_count):
            key = _gguf_string(f).decode()
            kind = struct.unpack("<I", f.read(4))[0]
            if key == "general.alignment" and kind == 4:  # uint32
                alignment = struct.unpack("<I", f.read(4))[0]
            else:
                _gguf_skip(f, kind)
        for _ in range(n_tensors):
            name = _gguf_string(f).decode()
            n_dims = struct.unpack("<I", f.read(4))[0]
            dims = struct.unpack(f"<{n_dims}Q", f.read(8 * n_dims))
            type_id, offset = struct.unpack("<IQ", f.read(12))
            tensors[name] = (type_id, dims, offset)
        start = -(-f.tell() // alignment) * alignment
    return {name: (t, dims, start + off) for name, (t, dims, off) in tensors.items()}


def gguf_architecture(gguf: Path) -> str:
    """The `general.architecture` of a GGUF file, read from its header (nothing is converted)."""
    arch = gguf_strings(gguf, ("general.architecture",)).get("general.architecture")
    if arch is None:
        raise ValueError(f"GGUF file {str(gguf)!r} names no general.architecture")
    return arch
