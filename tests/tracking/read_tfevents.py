#!/usr/bin/env python3
"""Reads a TensorBoard event file independently of libaccel's writer: the TFRecord framing and
its masked CRC-32C checked here (the CRC computed bit by bit from the Castagnoli polynomial), the
records parsed with Python's protobuf from the same event.proto (protoc --python_out at run time).

usage: read_tfevents.py EVENT_PROTO EVENTS_FILE
prints one JSON object per scalar: {"step": S, "tag": NAME, "value": V}
exit 1, with what is wrong, on a damaged file.
"""
import importlib
import json
import os
import struct
import subprocess
import sys
import tempfile


def crc32c(data):
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def masked(crc):
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def records(path):
    with open(path, "rb") as f:
        data = f.read()
    pos = 0
    while pos < len(data):
        if len(data) - pos < 12:
            raise ValueError(f"{path}: {len(data) - pos} stray bytes at offset {pos}")
        header = data[pos:pos + 8]
        (length,) = struct.unpack("<Q", header)
        (header_crc,) = struct.unpack("<I", data[pos + 8:pos + 12])
        if header_crc != masked(crc32c(header)):
            raise ValueError(f"{path}: bad length CRC at offset {pos}")
        body = data[pos + 12:pos + 12 + length]
        if len(body) != length or len(data) < pos + 16 + length:
            raise ValueError(f"{path}: record at offset {pos} is cut short")
        (body_crc,) = struct.unpack("<I", data[pos + 12 + length:pos + 16 + length])
        if body_crc != masked(crc32c(body)):
            raise ValueError(f"{path}: bad data CRC at offset {pos}")
        yield body
        pos += 16 + length


def main():
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    proto, events = sys.argv[1], sys.argv[2]
    with tempfile.TemporaryDirectory() as out:
        subprocess.run(["protoc", f"--proto_path={os.path.dirname(proto)}", f"--python_out={out}",
                        proto], check=True)
        sys.path.insert(0, out)
        event_pb2 = importlib.import_module(os.path.basename(proto)[:-len(".proto")] + "_pb2")
        try:
            for i, body in enumerate(records(events)):
                event = event_pb2.Event()
                event.ParseFromString(body)
                if i == 0:
                    if event.WhichOneof("what") != "file_version" or \
                            not event.file_version.startswith("brain.Event:"):
                        raise ValueError(f"{events}: the first record is not the file version")
                    continue
                if event.WhichOneof("what") != "summary":
                    raise ValueError(f"{events}: record {i} holds no summary")
                for value in event.summary.value:
                    print(json.dumps({"step": event.step, "tag": value.tag,
                                      "value": value.simple_value}))
        except ValueError as e:
            print(f"read_tfevents: {e}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
