#!/usr/bin/env python3
"""An independent safetensors reader (json + numpy only) for checking accel's writer.

  read_safetensors.py PATH           prints each tensor of a file or of a sharded model folder
  read_safetensors.py FILE --json    prints one JSON object: the file's metadata and every
                                     tensor's values, flattened, as float (for tests to compare)
  read_safetensors.py DIR --check    exits 0 only if DIR holds exactly the model that
                                     safetensors_test.cpp (SafetensorsPython) writes
"""
import json
import os
import struct
import sys

import numpy as np

DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "BOOL": np.uint8,
}


class FormatError(Exception):
    pass


def to_array(dtype, shape, raw):
    values = np.frombuffer(raw, dtype=np.dtype(DTYPES[dtype]).newbyteorder("<"))
    if dtype == "BF16":
        values = (values.astype(np.uint32) << 16).view(np.float32)
    elif dtype == "BOOL":
        values = values != 0
    return values.reshape(shape)


def read_file(path):
    """Returns ({name: ndarray}, {name: header entry}, metadata); checks the layout accel writes."""
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < 8:
        raise FormatError(f"{path}: {len(data)} bytes, no header length")
    (n,) = struct.unpack("<Q", data[:8])
    if (8 + n) % 8 != 0:
        raise FormatError(f"{path}: header length {n} does not pad 8+N to a multiple of 8")
    header = json.loads(data[8:8 + n].decode("utf-8"))
    body = data[8 + n:]
    metadata = header.pop("__metadata__", {})
    tensors, entries, covered = {}, {}, 0
    for name, info in sorted(header.items(), key=lambda kv: tuple(kv[1]["data_offsets"])):
        begin, end = info["data_offsets"]
        if begin != covered:
            raise FormatError(f"{path}: {name} starts at {begin}, expected {covered}")
        need = int(np.prod(info["shape"], dtype=np.int64)) * np.dtype(DTYPES[info["dtype"]]).itemsize
        if end - begin != need:
            raise FormatError(f"{path}: {name} holds {end - begin} bytes, shape needs {need}")
        tensors[name] = to_array(info["dtype"], info["shape"], body[begin:end])
        entries[name] = info
        covered = end
    if covered != len(body):
        raise FormatError(f"{path}: {len(body) - covered} bytes after the last tensor")
    return tensors, entries, metadata


def read_model(path):
    """Returns ({name: ndarray}, {name: (file, header entry, metadata)}, index or None) for a
    file or a folder."""
    index_path = os.path.join(path, "model.safetensors.index.json")
    if not os.path.isdir(path) or not os.path.exists(index_path):
        single = path if not os.path.isdir(path) else os.path.join(path, "model.safetensors")
        tensors, entries, metadata = read_file(single)
        return tensors, {k: (os.path.basename(single), entries[k], metadata) for k in tensors}, None
    with open(index_path) as f:
        index = json.load(f)
    tensors, origin = {}, {}
    for file in sorted(set(index["weight_map"].values())):
        part, entries, metadata = read_file(os.path.join(path, file))
        for name, value in part.items():
            if name in tensors:
                raise FormatError(f"{file}: {name} also in {origin[name][0]}")
            tensors[name] = value
            origin[name] = (file, entries[name], metadata)
    return tensors, origin, index


# The model SafetensorsPython writes: name -> (dtype, values), with the same formulas.
def expected_model():
    return {
        "embed.weight": ("F32", np.arange(24, dtype=np.float32).reshape(4, 6) * 0.5 - 3),
        "layer.0.weight": ("BF16", (np.arange(16, dtype=np.float32) * 0.25 - 2).reshape(2, 8)),
        "layer.0.bias": ("F32", np.arange(6, dtype=np.float32) / 4),
        "step": ("I64", np.array(np.int64(1) << 40, dtype=np.int64)),
        "layer.1.index": ("I64", np.arange(12, dtype=np.int64).reshape(3, 4) * 1000000007 - 5),
        "empty": ("F32", np.zeros((0, 3), dtype=np.float32)),
    }


def check(path):
    tensors, origin, index = read_model(path)
    problems = []
    if index is None:
        problems.append("no model.safetensors.index.json: the model was expected to be sharded")
    else:
        total = sum(e["data_offsets"][1] - e["data_offsets"][0] for _, e, _ in origin.values())
        if index["metadata"]["total_size"] != total:
            problems.append(f"total_size {index['metadata']['total_size']}, tensors hold {total}")
        for name, file in index["weight_map"].items():
            if name in origin and origin[name][0] != file:
                problems.append(f"{name}: weight_map says {file}, found in {origin[name][0]}")
    for name, (file, _, metadata) in origin.items():
        if metadata != {"format": "pt"}:
            problems.append(f"{file}: metadata {metadata}, expected {{'format': 'pt'}}")
    expected = expected_model()
    for name in sorted(set(expected) | set(tensors)):
        if name not in tensors:
            problems.append(f"{name}: missing")
        elif name not in expected:
            problems.append(f"{name}: not expected")
        elif origin[name][1]["dtype"] != expected[name][0]:
            problems.append(f"{name}: dtype {origin[name][1]['dtype']}, expected {expected[name][0]}")
        elif tensors[name].shape != expected[name][1].shape:
            problems.append(f"{name}: shape {tensors[name].shape}, expected {expected[name][1].shape}")
        elif not np.array_equal(tensors[name], expected[name][1]):
            problems.append(f"{name}: values {tensors[name].ravel()[:8]}..., "
                            f"expected {expected[name][1].ravel()[:8]}...")
    for p in problems:
        print("MISMATCH", p)
    print(f"checked {len(tensors)} tensors in {len(set(o[0] for o in origin.values()))} files: "
          f"{'OK' if not problems else f'{len(problems)} problems'}")
    return not problems


def main(argv):
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        if "--check" in argv[2:]:
            return 0 if check(argv[1]) else 1
        if "--json" in argv[2:]:
            tensors, _, metadata = read_file(argv[1])
            print(json.dumps({"metadata": metadata,
                              "tensors": {k: [float(x) for x in v.ravel()] for k, v in tensors.items()}}))
            return 0
        tensors, origin, _ = read_model(argv[1])
    except (FormatError, OSError, ValueError, KeyError) as e:
        print(f"error: {e}")
        return 1
    for name, value in tensors.items():
        print(f"{name} [{origin[name][0]}] {value.dtype}{list(value.shape)} {value.ravel()[:8]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
