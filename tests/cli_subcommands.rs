//! The binary lists its subcommands, and explains itself.

use std::process::Command;

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_decode-node"))
}

#[test]
fn help_lists_every_subcommand() {
    let out = bin().arg("--help").output().unwrap();
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    for sub in [
        "serve",
        "prefill",
        "generate",
        "demo",
        "bench",
        "make-model",
    ] {
        assert!(text.contains(sub), "--help misses {sub}:\n{text}");
    }
}

#[test]
fn serve_help_names_the_design_flags() {
    let out = bin().args(["serve", "--help"]).output().unwrap();
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    for flag in [
        "--model",
        "--grpc-addr",
        "--metrics-addr",
        "--device",
        "--attention",
        "--block-size",
        "--budget-tokens",
        "--host-kv-bytes",
        "--device-kv-bytes",
        "--auth-token-file",
        "--tls-cert",
        "--tls-key",
        "--tls-client-ca",
    ] {
        assert!(text.contains(flag), "serve --help misses {flag}");
    }
    assert!(
        text.contains("DECODE_NODE_GRPC_ADDR"),
        "flags read env vars"
    );
}

#[test]
fn bad_flag_is_a_usage_error() {
    let out = bin()
        .args(["serve", "--host-kv-bytes", "lots"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a byte count"));
}
