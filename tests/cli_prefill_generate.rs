//! The reference tools against a real node: `prefill` pushes a prompt's KV and prints the
//! request id; `generate` streams the continuation to stdout; `make-model` writes a model
//! that `serve --model DIR` loads.

mod common;
use common::*;

#[test]
fn prefill_then_generate_with_the_binaries() {
    let s = Served::start(&[]);
    let out = bin()
        .args([
            "prefill",
            "--target",
            &s.target(),
            "--prompt",
            "Hello, decode node",
            "--request-id",
            "cli-1",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "cli-1");
    let out = bin()
        .args([
            "generate",
            "--target",
            &s.target(),
            "--request-id",
            "cli-1",
            "--max-new-tokens",
            "7",
            "--ids",
            "--ignore-eos",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let ids: Vec<u32> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| l.trim().parse().unwrap())
        .collect();
    let prompt = tiny().tokenizer.encode("Hello, decode node").unwrap();
    assert_eq!(ids, reference_greedy(&prompt, 7));
    assert!(String::from_utf8_lossy(&out.stderr).contains("7 tokens"));

    // `--stop` (taken whole) ends the printed text before the stop string, with reason Stop.
    let want = tiny().tokenizer.decode(&reference_greedy(&prompt, 7));
    let stop: String = want.chars().skip(3).take(2).collect();
    let before = &want[..want.find(&stop).unwrap()];
    let pushed = bin()
        .args(["prefill", "--target", &s.target()])
        .args(["--prompt", "Hello, decode node", "--request-id", "cli-2"])
        .output()
        .unwrap();
    assert!(pushed.status.success());
    let out = bin()
        .args(["generate", "--target", &s.target(), "--request-id", "cli-2"])
        .args(["--max-new-tokens", "7", "--ignore-eos", "--stop", &stop])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        format!("{before}\n"),
        "stop {stop:?}"
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("Stop"));

    // A request that does not exist fails with a clear message and a non-zero exit.
    let out = bin()
        .args([
            "generate",
            "--target",
            &s.target(),
            "--request-id",
            "nope",
            "--kv-timeout-ms",
            "50",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("NotFound"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn make_model_writes_a_model_serve_loads() {
    let scratch = tempfile::tempdir().unwrap();
    let dir = scratch.path().join("model");
    let out = bin()
        .args([
            "make-model",
            "--out",
            dir.to_str().unwrap(),
            "--arch",
            "qwen3",
            "--num-layers",
            "2",
            "--dtype",
            "bf16",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(dir.join("config.json").exists() && dir.join("model.safetensors").exists());
    let s = Served::start(&["--model", dir.to_str().unwrap()]);
    let (code, body) = http_get(s.metrics, "/health");
    assert_eq!((code, body.trim()), (200, "serving"));
    // Unknown presets and bad dtypes are usage errors, not panics.
    let out = bin()
        .args(["make-model", "--out", "/tmp/x", "--preset", "gpt5"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--preset"));
}

#[test]
fn recall_profile_feeds_serve() {
    let v = run_json(&[
        "bench",
        "recall-profile",
        "--json",
        "--context",
        "300",
        "--tokens",
        "6",
        "--budget-tokens",
        "64",
        "--block-size",
        "16",
    ]);
    let iv = v["intervals"].as_array().unwrap();
    assert_eq!(iv.len(), tiny().model.cfg.num_layers);
    assert!(iv.iter().all(|x| x.as_u64().unwrap() >= 1));
    let scratch = tempfile::tempdir().unwrap();
    let path = scratch.path().join("profile.json");
    std::fs::write(&path, v.to_string()).unwrap();
    let s = Served::start(&[
        "--recall-profile",
        path.to_str().unwrap(),
        "--budget-tokens",
        "64",
        "--block-size",
        "16",
    ]);
    assert_eq!(http_get(s.metrics, "/health").0, 200);
    // A profile for another model is refused at start-up, naming the mismatch.
    std::fs::write(&path, r#"{"intervals": [1, 2]}"#).unwrap();
    let out = bin()
        .args(["serve", "--recall-profile", path.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("2 intervals for a model of"));
}
