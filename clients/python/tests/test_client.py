"""The Python client against a real `decode-node serve` (numpy tensors; torch only if present)."""
import subprocess
import time

import grpc
import pytest

from conftest import golden, load, serve  # noqa: E402
from decode_node.v1 import common_pb2  # noqa: E402
from decode_node_client import (DecodeNodeError, cancel, channel, drop_kv, generate, generate_all,  # noqa: E402
                                get_load, model_info, push_kv, watch_load)


def test_vllm_layout_push_streams_transformers_greedy(node):
    g, layers = golden()  # [tokens, kv_heads, head_dim] per layer
    prompt, greedy = g["prompt"].tolist(), g["greedy"].tolist()
    ack = push_kv(node, "py-thd", layers, prompt, greedy[0], chunk_tokens=7)
    assert ack.committed and ack.bytes_received == sum(k.nbytes + v.nbytes for k, v in layers)
    tokens, finish = generate_all(node, "py-thd", max_new_tokens=len(greedy) - 1, ignore_eos=True)
    assert [t.id for t in tokens] == greedy[1:]
    assert finish.generated_tokens == len(greedy) - 1


def test_top_logprobs_and_min_tokens_reach_the_node(node):
    g, layers = golden()
    prompt, greedy = g["prompt"].tolist(), g["greedy"].tolist()
    push_kv(node, "py-top", layers, prompt, greedy[0])
    tokens, finish = generate_all(node, "py-top", max_new_tokens=4, ignore_eos=True, top_logprobs=3,
                                  min_tokens=2)
    assert [t.id for t in tokens] == greedy[1:5]
    assert all(len(t.top_logprobs) == 3 and t.top_logprobs[0].id == t.id for t in tokens)
    with pytest.raises(DecodeNodeError) as e:
        generate_all(node, "py-top-bad", max_new_tokens=2, min_tokens=3, kv_timeout_ms=50)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "min_tokens" in str(e.value)


def test_watch_load_streams_reports(node):
    reports = watch_load(node, interval_ms=10)
    first = next(reports)
    assert first.host_kv_bytes_capacity > 0
    next(reports)
    reports.close()
    with pytest.raises(DecodeNodeError) as e:
        next(watch_load(node, interval_ms=500))
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_hf_layout_push_and_pool_returns_to_zero(node):
    g, layers = golden()
    hf = tuple((k.transpose(1, 0, 2)[None], v.transpose(1, 0, 2)[None]) for k, v in layers)  # [1, H, T, D]
    prompt, greedy = g["prompt"].tolist(), g["greedy"].tolist()
    push_kv(node, "py-hf", hf, prompt, greedy[0])
    got = [t.id for t in generate(node, "py-hf", max_new_tokens=5, ignore_eos=True)]
    assert got == greedy[1:6]
    deadline = time.time() + 10
    while load(node).host_kv_bytes_used != 0 and time.time() < deadline:
        time.sleep(0.02)
    assert load(node).host_kv_bytes_used == 0


def test_f16_push_is_converted_and_errors_carry_codes(node):
    g, layers = golden()
    prompt, greedy = g["prompt"].tolist(), g["greedy"].tolist()
    push_kv(node, "py-f16", layers, prompt, greedy[0], dtype=common_pb2.DTYPE_F16)
    tokens, _ = generate_all(node, "py-f16", max_new_tokens=3, ignore_eos=True)
    assert len(tokens) == 3
    with pytest.raises(DecodeNodeError) as e:
        push_kv(node, "py-bad", layers, prompt, greedy[0], model_id="not-this-model")
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and "model_id" in str(e.value)
    with pytest.raises(DecodeNodeError) as e:
        generate_all(node, "never-pushed", max_new_tokens=2, kv_timeout_ms=50)
    assert e.value.code == grpc.StatusCode.NOT_FOUND


def test_torch_tensors_when_torch_is_installed(node):
    torch = pytest.importorskip("torch")
    g, layers = golden()
    tl = [(torch.from_numpy(k.transpose(1, 0, 2)[None].copy()), torch.from_numpy(v.transpose(1, 0, 2)[None].copy()))
          for k, v in layers]
    prompt, greedy = g["prompt"].tolist(), g["greedy"].tolist()
    push_kv(node, "py-torch", tl, prompt, greedy[0])
    assert [t.id for t in generate(node, "py-torch", max_new_tokens=4, ignore_eos=True)] == greedy[1:5]


def test_a_node_requiring_leases_serves_only_the_pushs_holder(leased_node):
    g, layers = golden()
    prompt, greedy = g["prompt"].tolist(), g["greedy"].tolist()
    ack = push_kv(leased_node, "py-lease", layers, prompt, greedy[0])
    assert len(ack.lease) == 32
    with pytest.raises(DecodeNodeError) as e:
        generate_all(leased_node, "py-lease", max_new_tokens=2, ignore_eos=True)
    assert e.value.code == grpc.StatusCode.PERMISSION_DENIED
    with pytest.raises(DecodeNodeError) as e:
        generate_all(leased_node, "py-lease", max_new_tokens=2, ignore_eos=True, lease="0" * 32)
    assert e.value.code == grpc.StatusCode.PERMISSION_DENIED
    tokens, _ = generate_all(leased_node, "py-lease", max_new_tokens=3, ignore_eos=True, lease=ack.lease)
    assert [t.id for t in tokens] == greedy[1:4]


def test_drop_kv_cancel_and_get_load(node):
    g, layers = golden()
    prompt, greedy = g["prompt"].tolist(), g["greedy"].tolist()
    push_kv(node, "py-drop", layers, prompt, greedy[0])
    assert get_load(node).host_kv_bytes_used > 0
    dropped = drop_kv(node, "py-drop")
    assert dropped.dropped and dropped.bytes_freed > 0
    with pytest.raises(DecodeNodeError) as e:
        drop_kv(node, "py-drop")
    assert e.value.code == grpc.StatusCode.NOT_FOUND
    assert get_load(node).host_kv_bytes_used == 0
    assert not cancel(node, "never-pushed")
    push_kv(node, "py-cancel", layers, prompt, greedy[0])
    assert cancel(node, "py-cancel")
    with pytest.raises(DecodeNodeError) as e:
        generate_all(node, "py-cancel", max_new_tokens=2, kv_timeout_ms=50)
    assert e.value.code == grpc.StatusCode.NOT_FOUND


def openssl(*args):
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def test_channel_speaks_mutual_tls_with_a_token(tmp_path):
    """A node with TLS, client certificates and bearer tokens, reached through `channel()`."""
    p = lambda name: str(tmp_path / name)  # noqa: E731
    openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-days", "2",
            "-subj", "/CN=test-ca", "-keyout", p("ca.key"), "-out", p("ca.pem"))
    for name, cn in (("srv", "localhost"), ("cli", "client")):
        openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-subj", f"/CN={cn}",
                "-keyout", p(f"{name}.key"), "-out", p(f"{name}.csr"))
        (tmp_path / f"{name}.ext").write_text(
            f"basicConstraints=CA:FALSE\nsubjectAltName=DNS:{cn}\n")
        openssl("x509", "-req", "-in", p(f"{name}.csr"), "-CA", p("ca.pem"), "-CAkey", p("ca.key"),
                "-CAcreateserial", "-days", "2", "-extfile", p(f"{name}.ext"), "-out", p(f"{name}.pem"))
    (tmp_path / "tokens").write_text("s3cret\n")
    gen = serve("--tls-cert", p("srv.pem"), "--tls-key", p("srv.key"), "--tls-client-ca", p("ca.pem"),
                "--auth-token-file", p("tokens"))
    addr = next(gen)
    try:
        ch = channel(addr, ca_cert=p("ca.pem"), client_cert=p("cli.pem"), client_key=p("cli.key"),
                     domain="localhost")
        assert model_info(ch, token="s3cret").num_layers > 0
        with pytest.raises(DecodeNodeError) as e:
            get_load(ch)
        assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
        g, layers = golden()
        prompt, greedy = g["prompt"].tolist(), g["greedy"].tolist()
        push_kv(ch, "py-tls", layers, prompt, greedy[0], token="s3cret")
        tokens, _ = generate_all(ch, "py-tls", max_new_tokens=3, ignore_eos=True, token="s3cret")
        assert [t.id for t in tokens] == greedy[1:4]
        # Without a client certificate the handshake fails.
        bare = channel(addr, ca_cert=p("ca.pem"), domain="localhost")
        with pytest.raises(DecodeNodeError) as e:
            model_info(bare, token="s3cret")
        assert e.value.code == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(ValueError):
            channel(addr, client_cert=p("cli.pem"), client_key=p("cli.key"))
        with pytest.raises(ValueError):
            channel(addr, ca_cert=p("ca.pem"), client_cert=p("cli.pem"))
    finally:
        next(gen, None)  # stops the node
