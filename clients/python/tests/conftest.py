"""Shared by the client tests: a real `decode-node serve` on loopback and the golden KV it serves."""
import json
import os
import subprocess
import sys
import threading

import pytest
from safetensors.numpy import load_file

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", "..", ".."))
# The client from this tree, unless CI tests the package as installed (at its floor versions).
if os.environ.get("DECODE_NODE_CLIENT_INSTALLED") != "1":
    sys.path.insert(0, os.path.join(HERE, ".."))

from decode_node.v1 import decode_pb2, decode_pb2_grpc  # noqa: E402

BIN = os.environ.get("DECODE_NODE_BIN", os.path.join(ROOT, "target", "debug", "decode-node"))
GOLDEN = os.path.join(ROOT, "tests", "golden", "qwen3")


def serve(*extra):
    """Yields the gRPC address of a node started with `extra` flags; stops it after."""
    proc = subprocess.Popen(
        [BIN, "--log-format", "json", "serve", "--model", GOLDEN, "--attention", "full",
         "--grpc-addr", "127.0.0.1:0", "--metrics-addr", "127.0.0.1:0", *extra],
        stderr=subprocess.PIPE, text=True)
    found = {}
    ready = threading.Event()

    def read():
        for line in proc.stderr:
            try:
                fields = json.loads(line).get("fields", {})
            except ValueError:
                continue
            if fields.get("message") == "serving":
                found["grpc"] = fields["grpc_addr"]
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    assert ready.wait(60), "decode-node serve did not start"
    yield found["grpc"]
    proc.terminate()
    proc.wait(30)


@pytest.fixture(scope="module")
def node():
    yield from serve()


@pytest.fixture(scope="module")
def leased_node():
    yield from serve("--require-lease")


def golden():
    """The golden prompt's KV per layer ([tokens, kv_heads, head_dim]) and its greedy tokens."""
    g = load_file(os.path.join(GOLDEN, "golden.safetensors"))
    layers = sorted({int(k.split(".")[1]) for k in g if k.startswith("k.")})
    return g, [(g[f"k.{i}"], g[f"v.{i}"]) for i in layers]


def load(target):
    import grpc
    return decode_pb2_grpc.DecodeStub(grpc.insecure_channel(target)).GetLoad(decode_pb2.GetLoadRequest())
