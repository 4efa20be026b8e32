//! The binary lists its subcommands, and explains itself.

mod common;
use common::{bin, run_json};

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
        "selftest",
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

/// Without a GPU (CI), `--device cuda` fails at start with a message that says why — never a
/// panic — whether or not the binary was built with CUDA. With one, the selftest must pass.
#[test]
fn cuda_device_fails_clearly_or_passes_its_selftest() {
    let out = bin()
        .args([
            "selftest",
            "--device",
            "cuda",
            "--prompt-tokens",
            "64",
            "--tokens",
            "4",
        ])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    if out.status.success() {
        assert!(stdout.contains("selftest passed"), "{stdout}");
        assert!(!stdout.contains("FAIL"), "{stdout}");
    } else {
        assert_failed_for_want_of_a_gpu(&out);
    }
    for args in [
        &["selftest", "--device", "cpu"][..],
        &["serve", "--device", "cuda:x"][..],
        &["serve", "--device", "tpu"][..],
        &["bench", "kernels", "--device", "tpu"][..],
    ] {
        let out = bin().args(args).output().unwrap();
        assert!(!out.status.success(), "{args:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains("--device"), "{args:?}: {stderr}");
    }
}

/// `bench kernels --device cuda` times the device's attention where there is a GPU, and
/// otherwise fails at start saying why (the same reasons as the selftest), never a panic.
#[test]
fn device_kernel_bench_runs_or_fails_clearly() {
    let out = bin()
        .args([
            "bench",
            "kernels",
            "--device",
            "cuda",
            "--json",
            "--groups",
            "2",
            "--head-dims",
            "64",
            "--context",
            "1k",
            "--kv-heads",
            "2",
            "--seconds",
            "0.05",
        ])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    if out.status.success() {
        let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
        let row = &v["results"][0];
        assert_eq!(row["context"], 1024, "{v}");
        assert!(row["call_s"].as_f64().unwrap() > 0.0, "{v}");
        assert!(row["kv_gb_per_s"].as_f64().unwrap() > 0.0, "{v}");
    } else {
        assert_failed_for_want_of_a_gpu(&out);
    }
}

/// `out` is a start-up failure that says why there is no GPU to use (no driver, a binary
/// without CUDA, a driver error, no such device): exit status 1, no panic.
fn assert_failed_for_want_of_a_gpu(out: &std::process::Output) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(
        stderr.contains("no CUDA driver")
            || stderr.contains("built without CUDA support")
            || stderr.contains("CUDA driver error")
            || stderr.contains("does not exist"),
        "{stderr}"
    );
}

/// `bench fidelity --json` on the embedded model: a 300-token context, one passkey prompt,
/// 8 forced tokens, blocks of 16.
const FIDELITY_TINY: [&str; 13] = [
    "bench",
    "fidelity",
    "--json",
    "--model",
    "tiny",
    "--context",
    "300",
    "--prompts",
    "1",
    "--forced",
    "8",
    "--block-size",
    "16",
];

/// [`FIDELITY_TINY`] with `extra` flags, its JSON.
fn fidelity_json(extra: &[&str]) -> serde_json::Value {
    run_json(&[&FIDELITY_TINY[..], extra].concat())
}

/// `bench fidelity` runs end to end on the embedded model: `full` is its own reference, and
/// `scout` with a budget covering the whole context agrees with it on every token.
#[test]
fn bench_fidelity_reports_each_case_against_full() {
    let v = fidelity_json(&[
        "--budgets",
        "64,4096",
        "--modes",
        "full,scout,hgca",
        "--guard",
        "both",
        "--layer-ahead",
        "on",
    ]);
    let rows = v["results"].as_array().unwrap();
    // full, scout x2 budgets x guard on/off (it predicts), hgca x2 budgets.
    assert_eq!(rows.len(), 7, "{rows:?}");
    let case = |name: &str| rows.iter().find(|r| r["case"] == name).unwrap();
    assert_eq!(case("full")["top1_agreement_with_full"], 1.0);
    for name in ["scout b4096 guard", "scout b4096 no-guard", "hgca b4096"] {
        let r = case(name);
        assert_eq!(r["top1_agreement_with_full"], 1.0, "{name}: {r}");
        assert!(
            r["mean_kl_from_full"].as_f64().unwrap() < 1e-6,
            "{name}: {r}"
        );
        assert_eq!(r["generated_equal_to_full"], 1.0, "{name}: {r}");
        // Random weights find no key, so nothing is counted where full found it.
        assert_eq!(
            r.get("generated_equal_to_full_where_full_found"),
            Some(&serde_json::Value::Null),
            "{name}: {r}"
        );
    }
    assert!(case("scout b64 guard")["tokens_per_s"].as_f64().unwrap() > 0.0);
}

/// `bench fidelity --kv-dtypes`: every case on each host dtype, all against `full` on the
/// first; int8 moves the distribution a little (it is measured, not assumed equal), and
/// hgca with a budget over the whole context equals full on the same pool.
#[test]
fn bench_fidelity_compares_host_kv_dtypes() {
    let v = fidelity_json(&[
        "--budgets",
        "4096",
        "--modes",
        "full,hgca",
        "--kv-dtypes",
        "f32,int8",
    ]);
    assert_eq!(v["reference"], "full f32", "{v}");
    let rows = v["results"].as_array().unwrap();
    assert_eq!(rows.len(), 4, "{rows:?}");
    let case = |name: &str| rows.iter().find(|r| r["case"] == name).unwrap();
    assert_eq!(case("full f32")["mean_kl_from_full"], 0.0);
    let (full8, hgca8) = (case("full int8"), case("hgca b4096 int8"));
    assert_eq!(full8["kv_dtype"], "int8");
    let kl = full8["mean_kl_from_full"].as_f64().unwrap();
    assert!(kl > 0.0 && kl < 1e-3, "{full8}");
    let kl_hgca = hgca8["mean_kl_from_full"].as_f64().unwrap();
    assert!((kl_hgca - kl).abs() < 1e-9, "{hgca8} against {full8}");
}

/// `bench fidelity --cpu-paths`: every case on each CPU kernel path, all against `full` on
/// the first; the portable path sums in another order than the SIMD one, so its distribution
/// is measured (near, not assumed, equal). A path this build lacks is refused.
#[test]
fn bench_fidelity_compares_cpu_kernel_paths() {
    let v = fidelity_json(&["--modes", "full", "--cpu-paths", "best,scalar"]);
    assert_eq!(v["reference"], "full f32 best", "{v}");
    let rows = v["results"].as_array().unwrap();
    assert_eq!(rows.len(), 2, "{rows:?}");
    let case = |name: &str| rows.iter().find(|r| r["case"] == name).unwrap();
    assert_eq!(case("full best")["mean_kl_from_full"], 0.0);
    let kl = case("full scalar")["mean_kl_from_full"].as_f64().unwrap();
    assert!((0.0..1e-6).contains(&kl), "{v}");
    assert_eq!(case("full scalar")["top1_agreement_with_full"], 1.0, "{v}");
    let bad = bin()
        .args(
            [
                &FIDELITY_TINY[..],
                &["--modes", "full", "--cpu-paths", "best,sve"],
            ]
            .concat(),
        )
        .output()
        .unwrap();
    assert!(!bad.status.success());
    assert!(
        String::from_utf8_lossy(&bad.stderr).contains("unknown path \"sve\""),
        "{}",
        String::from_utf8_lossy(&bad.stderr)
    );
}

/// A short `bench soak`: requests with random cancels, killed pushes and gone orchestrators,
/// and a fault every second (stalled push, bad CRC, DropKv mid-push, pusher gone, wrong lease,
/// waiter gone) each answered with its code; the pool comes back to its start byte for byte.
#[test]
fn bench_soak_answers_every_fault_and_returns_the_pool() {
    let v = run_json(&[
        "bench",
        "soak",
        "--json",
        "--model",
        "tiny",
        "--duration",
        "7s",
        "--rate",
        "10",
    ]);
    assert_eq!(v["pool_leaked_bytes"], 0, "{v}");
    assert_eq!(v["faults_failed"], 0, "{v}");
    // Every kind of fault ran at least once (six kinds, one a second, seven seconds).
    assert_eq!(v["faults"].as_object().unwrap().len(), 6, "{v}");
    assert!(v["outcomes"]["ok"].as_u64().unwrap() > 0, "{v}");
}

/// `bench multiturn`: with reuse, later turns push only what the node lacks.
#[test]
fn bench_multiturn_pushes_less_with_reuse() {
    let v = run_json(&[
        "bench",
        "multiturn",
        "--json",
        "--turns",
        "3",
        "--first-tokens",
        "100",
        "--reply-tokens",
        "8",
    ]);
    let runs = v["runs"].as_array().unwrap();
    let (without, with) = (&runs[0], &runs[1]);
    assert_eq!(without["reused_tokens"], 0, "{v}");
    assert_eq!(without["bytes_pushed"], without["bytes_full"], "{v}");
    assert_eq!(
        with["bytes_full"], without["bytes_full"],
        "the same conversation: {v}"
    );
    // Turns two and three reuse at least the first prompt's whole 32-token blocks.
    assert!(with["reused_tokens"].as_u64().unwrap() >= 2 * 2 * 96, "{v}");
    let ratio = v["bytes_ratio"].as_f64().unwrap();
    assert!(ratio > 0.0 && ratio < 0.8, "{v}");
}

/// `bench kernels --json` on a 1 MiB working set, one thread, head dim 64, for `groups` and
/// `paths`, with `DECODE_NODE_AVX512` set to `avx512` where given (unset otherwise).
fn kernels_bench(groups: &str, paths: &str, avx512: Option<&str>) -> serde_json::Value {
    kernels_bench_with(groups, paths, &[("DECODE_NODE_AVX512", avx512)], &[])
}

/// The kernel switches these tests set: each is unset unless given, so a suite run under one
/// (`DECODE_NODE_AVX512=0`: the AVX2 paths on an AVX-512 host) leaves the default case alone.
const KERNEL_SWITCHES: [&str; 4] = [
    "DECODE_NODE_AVX512",
    "DECODE_NODE_BF16_DOT",
    "DECODE_NODE_AVX512_FACTORS",
    "DECODE_NODE_AMX",
];

/// [`kernels_bench`] with `switches` (of [`KERNEL_SWITCHES`], set where `Some`) and `extra`
/// arguments.
fn kernels_bench_with(
    groups: &str,
    paths: &str,
    switches: &[(&str, Option<&str>)],
    extra: &[&str],
) -> serde_json::Value {
    let mut cmd = bin();
    cmd.args([
        "bench",
        "kernels",
        "--json",
        "--threads",
        "1",
        "--seconds",
        "0.02",
        "--groups",
        groups,
        "--head-dims",
        "64",
        "--working-set-mib",
        "1",
        "--paths",
        paths,
    ]);
    cmd.args(extra);
    for name in KERNEL_SWITCHES {
        cmd.env_remove(name);
    }
    for (name, value) in switches {
        if let Some(v) = value {
            cmd.env(name, v);
        }
    }
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// `bench kernels --kv-dtype` measures that dtype alone, 8-bit ones with their scales, on
/// the SIMD path as on the scalar one.
#[test]
fn bench_kernels_measures_the_kv_dtype_asked_for() {
    for dtype in ["int8", "fp8", "f32"] {
        let v = kernels_bench_with("4", "best,scalar", &[], &["--kv-dtype", dtype]);
        let rows = v["results"].as_array().unwrap();
        assert_eq!(rows.len(), 2, "{v}");
        for r in rows {
            assert_eq!(r["dtype"], dtype, "{r}");
            assert!(r["kv_gb_per_s"].as_f64().unwrap() > 0.0, "{r}");
        }
    }
}

/// `bench kernels` measures every path asked for against a roofline from the same run.
#[test]
fn bench_kernels_reports_each_path_against_its_roofline() {
    let v = kernels_bench("1,4", "best,scalar,avx2", None);
    let rows = v["results"].as_array().unwrap();
    // 2 dtypes x 2 groups x 3 paths (AVX2 where the CPU has it: CI's does).
    #[cfg(target_arch = "x86_64")]
    let avx2 = std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma");
    #[cfg(not(target_arch = "x86_64"))]
    let avx2 = false;
    assert_eq!(rows.len(), if avx2 { 12 } else { 8 }, "{v}");
    assert!(rows.iter().any(|r| r["path"] == "scalar"));
    for r in rows {
        let (got, roof) = (
            r["kv_gb_per_s"].as_f64().unwrap(),
            r["roofline_gb_per_s"].as_f64().unwrap(),
        );
        assert!(got > 0.0 && roof > 0.0, "{r}");
        assert!((r["ratio_to_roofline"].as_f64().unwrap() - got / roof).abs() < 1e-9);
        // Every round paired a probe of the same bytes with a pass over them.
        assert!(r["rounds"].as_u64().unwrap() >= 1, "{r}");
        assert!(r["paired_read_gb_per_s"].as_f64().unwrap() > 0.0, "{r}");
        assert!(r["paired_ratio_to_roofline"].as_f64().unwrap() > 0.0, "{r}");
        // The read probe's fastest loop, which the paired reads used.
        assert!(r["read_loop"].as_str().is_some(), "{r}");
        // Where the FMAs (not bf16 products) bound the row, the FMA rate right after its
        // passes beside it.
        let fma_bound = roof < r["read_gb_per_s"].as_f64().unwrap() && r["bf16_products"] == false;
        let after = r["fma_after_pass_g_per_s"].as_f64();
        assert_eq!(after.is_some(), fma_bound, "{r}");
        if let Some(fma) = after {
            let ratio = r["ratio_to_fma_after_pass"].as_f64().unwrap();
            let want = got * r["fmas_per_byte"].as_f64().unwrap() / fma;
            assert!(fma > 0.0 && (ratio - want).abs() < 1e-6 * want, "{r}");
        }
    }
    let bad = bin()
        .args(["bench", "kernels", "--paths", "neon"])
        .output()
        .unwrap();
    assert!(!bad.status.success());
}

/// `DECODE_NODE_AVX512=0` makes an AVX-512 host run what a CPU without it runs: its AVX-512
/// kernel path is then skipped like a path the CPU lacks.
#[test]
fn avx512_switch_turns_the_wide_paths_off() {
    let paths = |switch: Option<&str>| -> Vec<String> {
        kernels_bench("4", "avx2,avx512", switch)["results"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["path"].as_str().unwrap().to_string())
            .collect()
    };
    assert!(paths(Some("0")).iter().all(|p| p != "avx512"));
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx512f") && std::is_x86_feature_detected!("avx512bw") {
        assert!(paths(None).iter().any(|p| p == "avx512"));
        assert!(paths(Some("1")).iter().any(|p| p == "avx512"));
    }
}

/// `bench kernels --paths avx512bf16` holds bf16 blocks of groups of 5 to 8 (which it
/// multiplies in bf16 pairs) to the pair products' rate and every other row to the FMAs';
/// `DECODE_NODE_BF16_DOT=0` turns the path off like a path the CPU lacks.
#[test]
fn bf16_products_are_held_to_their_own_rate() {
    let rows = |switch: Option<&str>| -> Vec<serde_json::Value> {
        let v = kernels_bench_with(
            "4,5",
            "avx512bf16",
            &[("DECODE_NODE_BF16_DOT", switch)],
            &[],
        );
        v["results"].as_array().unwrap().clone()
    };
    assert!(rows(Some("0")).is_empty());
    let on = rows(None);
    #[cfg(target_arch = "x86_64")]
    let cpu = std::is_x86_feature_detected!("avx512f")
        && std::is_x86_feature_detected!("avx512bw")
        && std::is_x86_feature_detected!("avx512bf16");
    #[cfg(not(target_arch = "x86_64"))]
    let cpu = false;
    assert_eq!(on.len(), if cpu { 4 } else { 0 }, "{on:?}");
    for r in &on {
        let bf16 = r["dtype"] == "bf16" && r["group"] == 5;
        assert_eq!(r["bf16_products"], bf16, "{r}");
        assert!(r["fma_g_per_s"].as_f64().unwrap() > 0.0, "{r}");
    }
}

/// `--paths best` takes the bf16 pair products for bf16 G=5 blocks where
/// `DECODE_NODE_BF16_DOT=on` forces them (on a CPU that has them) and never where `0` turns
/// them off; left to measure, it takes one of the two AVX-512 paths either way.
#[test]
fn best_path_takes_bf16_products_as_the_switch_says() {
    // AMX tiles, where the CPU has them, take these blocks before the pairs (their own test).
    let best = |switch: Option<&str>| -> Vec<String> {
        let switches = [
            ("DECODE_NODE_BF16_DOT", switch),
            ("DECODE_NODE_AMX", Some("0")),
        ];
        kernels_bench_with("5", "best", &switches, &[])["results"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|r| r["dtype"] == "bf16")
            .map(|r| r["path"].as_str().unwrap().to_string())
            .collect()
    };
    #[cfg(target_arch = "x86_64")]
    let (wide, pairs) = {
        let wide =
            std::is_x86_feature_detected!("avx512f") && std::is_x86_feature_detected!("avx512bw");
        (wide, wide && std::is_x86_feature_detected!("avx512bf16"))
    };
    #[cfg(not(target_arch = "x86_64"))]
    let (wide, pairs) = (false, false);
    let off = best(Some("0"));
    assert_eq!(off.len(), 1, "{off:?}");
    assert_ne!(off[0], "avx512bf16");
    if wide {
        assert_eq!(off[0], "avx512");
    }
    assert_eq!(
        best(Some("on"))[0] == "avx512bf16",
        pairs,
        "pairs on this CPU: {pairs}"
    );
    if pairs {
        assert!(["avx512", "avx512bf16"].contains(&best(None)[0].as_str()));
    }
}

/// `bench kernels --paths amx` holds bf16 blocks of groups of 4 or more (head dim 64), which
/// it multiplies by AMX tiles, to the tiles' product rate and every other row to the FMAs';
/// `--paths best` takes those blocks to the tiles; `DECODE_NODE_AMX=0` turns the path off
/// like a path the CPU lacks, and `all` gives it groups of 3. A CPU without AMX has no rows.
#[test]
fn amx_tiles_are_held_to_their_own_rate_and_taken_by_best() {
    let rows = |paths: &str, switch: Option<&str>| -> Vec<serde_json::Value> {
        let v = kernels_bench_with("3,4", paths, &[("DECODE_NODE_AMX", switch)], &[]);
        v["results"].as_array().unwrap().clone()
    };
    assert!(rows("amx", Some("0")).is_empty());
    let on = rows("amx", None);
    // Four rows (f16 and bf16, G=3 and 4) where the CPU and OS have AMX, none elsewhere.
    assert!(on.is_empty() || on.len() == 4, "{on:?}");
    for r in &on {
        let tiles = r["dtype"] == "bf16" && r["group"] == 4;
        assert_eq!(r["bf16_products"], tiles, "{r}");
        assert!(r["fma_g_per_s"].as_f64().unwrap() > 0.0, "{r}");
    }
    let all = rows("amx", Some("all"));
    assert_eq!(all.len(), on.len());
    for r in &all {
        assert_eq!(r["bf16_products"], r["dtype"] == "bf16", "{r}");
    }
    // As with the pairs, the path names the call; f16 blocks run its FMA loops.
    let best = rows("best", None);
    for r in best.iter().filter(|r| r["group"] == 4) {
        assert_eq!(r["path"] == "amx", !on.is_empty(), "{r}");
        assert_eq!(
            r["bf16_products"],
            !on.is_empty() && r["dtype"] == "bf16",
            "{r}"
        );
    }
    assert!(rows("best", Some("0")).iter().all(|r| r["path"] != "amx"));
}

/// Int8 and fp8 blocks of groups of 6 or more go to the tiles too (their elements widened
/// to bf16 exactly), held to the tiles' rate; groups of 5 stay on the FMA loops, and
/// `DECODE_NODE_AMX=all` gives the tiles those as well.
#[test]
fn amx_tiles_take_8_bit_blocks_of_groups_of_6_or_more() {
    for dtype in ["int8", "fp8"] {
        let rows = |switch: Option<&str>| -> Vec<serde_json::Value> {
            let v = kernels_bench_with(
                "5,6",
                "amx",
                &[("DECODE_NODE_AMX", switch)],
                &["--kv-dtype", dtype],
            );
            v["results"].as_array().unwrap().clone()
        };
        let on = rows(None);
        // Two rows (G=5 and 6) where the CPU and OS have AMX, none elsewhere.
        assert!(on.is_empty() || on.len() == 2, "{on:?}");
        for r in &on {
            assert_eq!(r["dtype"], dtype, "{r}");
            assert_eq!(r["bf16_products"], r["group"] == 6, "{r}");
        }
        for r in &rows(Some("all")) {
            assert_eq!(r["bf16_products"], true, "{r}");
        }
    }
}

/// `bench select --json` on a small shape (2 KV heads of 3 query heads, head dim 64, 2
/// layers, budget 128), with `extra` flags.
fn bench_select_json(extra: &[&str]) -> serde_json::Value {
    let mut args = vec![
        "bench",
        "select",
        "--json",
        "--seconds",
        "0.05",
        "--kv-heads",
        "2",
        "--group",
        "3",
        "--head-dim",
        "64",
        "--layers",
        "2",
        "--budget-tokens",
        "128",
    ];
    args.extend_from_slice(extra);
    run_json(&args)
}

/// `bench select` measures each scorer's host selection against the same threads' read
/// bandwidth: sparq (candidates from the bound, then key rows) reads more than quest alone.
#[test]
fn bench_select_reports_each_scorer_against_read_bandwidth() {
    let v = bench_select_json(&["--context", "1k,2k", "--threads", "1"]);
    let rows = v["results"].as_array().unwrap();
    assert_eq!(rows.len(), 4, "{v}");
    let row = |scorer: &str, ctx: u64| {
        rows.iter()
            .find(|r| r["scorer"] == scorer && r["context"] == ctx)
            .unwrap()
    };
    for ctx in [1024, 2048] {
        let (q, s) = (row("quest", ctx), row("sparq", ctx));
        for r in [q, s] {
            assert!(r["ms_per_layer"].as_f64().unwrap() > 0.0, "{r}");
            let (gbps, read) = (
                r["gb_per_s"].as_f64().unwrap(),
                r["read_gb_per_s"].as_f64().unwrap(),
            );
            assert!(
                (r["ratio"].as_f64().unwrap() - gbps / read).abs() < 1e-9,
                "{r}"
            );
        }
        // Quest reads every older block's digest: 2 heads x (blocks - 1) x 2 x 64 f32.
        let blocks = ctx / 32;
        assert_eq!(
            q["bytes_per_layer"].as_f64().unwrap(),
            (2 * (blocks - 1) * 2 * 64 * 4) as f64,
            "{q}"
        );
        assert!(
            s["bytes_per_layer"].as_f64().unwrap() > q["bytes_per_layer"].as_f64().unwrap(),
            "{s}"
        );
    }
    let bad = bin()
        .args(["bench", "select", "--scorers", "oracle"])
        .output()
        .unwrap();
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("--scorers"));
}

/// `bench select --scorers device` times the host's part of a plan from scores a device
/// made, over steps that open new blocks (1k tokens: the first step's token starts one).
#[test]
fn bench_select_times_the_hosts_part_of_a_device_scored_plan() {
    let v = bench_select_json(&["--scorers", "device", "--context", "1k"]);
    let rows = v["results"].as_array().unwrap();
    assert_eq!(rows.len(), 1, "{v}");
    let r = &rows[0];
    assert_eq!(r["scorer"], "device");
    assert_eq!(r["mode"], "scout");
    assert_eq!(r["threads"], 1);
    assert!(r["ms_per_layer"].as_f64().unwrap() > 0.0, "{r}");
}

/// `bench decode` on the CPU reports the bytes a step moves against read bandwidth, per
/// round against the probes around that round, and the middle round as the row.
#[test]
fn bench_decode_reports_traffic_against_read_bandwidth() {
    let v = run_json(&[
        "bench",
        "decode",
        "--json",
        "--context",
        "64",
        "--modes",
        "full,scout",
        "--tokens",
        "4",
        "--rounds",
        "3",
    ]);
    let rows = v["results"].as_array().unwrap();
    assert_eq!(rows.len(), 2, "{v}");
    for r in rows {
        // Three rounds; the row is the middle one by its ratio to the median pass.
        let rounds = r["rounds"].as_array().unwrap();
        assert_eq!(rounds.len(), 3, "{r}");
        let ratio = |x: &serde_json::Value| {
            x["gb_per_s"].as_f64().unwrap() / x["read_median_gb_per_s"].as_f64().unwrap()
        };
        let mut ratios: Vec<f64> = rounds.iter().map(ratio).collect();
        ratios.sort_by(f64::total_cmp);
        assert!((ratio(r) - ratios[1]).abs() < 1e-9, "{r}");
        assert!(
            rounds.iter().any(|x| x["tokens_per_s"] == r["tokens_per_s"]
                && x["read_gb_per_s"] == r["read_gb_per_s"]),
            "{r}"
        );
        assert!(r["tokens_per_s"].as_f64().unwrap() > 0.0, "{r}");
        // The weights plus the KV the step attends.
        assert!(r["bytes_per_token"].as_f64().unwrap() > 0.0, "{r}");
        let (gbps, bw) = (
            r["gb_per_s"].as_f64().unwrap(),
            r["read_gb_per_s"].as_f64().unwrap(),
        );
        assert!((r["ratio_to_read_bandwidth"].as_f64().unwrap() - gbps / bw).abs() < 1e-9);
        // The median pass of the same probes: no faster than the best, and its own ratio.
        let median = r["read_median_gb_per_s"].as_f64().unwrap();
        assert!(median > 0.0 && median <= bw, "{r}");
        assert!((r["ratio_to_median_read"].as_f64().unwrap() - gbps / median).abs() < 1e-9);
        // The roofline: no faster than streaming the bytes at that bandwidth.
        let roof = r["roofline_tokens_per_s"].as_f64().unwrap();
        let per_token = r["bytes_per_token"].as_f64().unwrap();
        assert!(roof <= bw * 1e9 / per_token * (1.0 + 1e-9), "{r}");
        assert!(r["fmas_per_token"].as_f64().unwrap() > 0.0, "{r}");
        let ratio = r["ratio_to_roofline"].as_f64().unwrap();
        assert!(
            (ratio - r["tokens_per_s"].as_f64().unwrap() / roof).abs() < 1e-9,
            "{r}"
        );
        assert!(
            ["memory", "FMA"].contains(&r["roofline_bound"].as_str().unwrap()),
            "{r}"
        );
    }
}

/// `bench decode --batch` decodes one request alone before each round's batch, on the same
/// node, and reports the batch's speedup over it: the median of the rounds' ratios. Without a
/// batch there is nothing to compare.
#[test]
fn bench_decode_batch_reports_its_speedup_over_one_request() {
    let decode = |extra: &[&str]| {
        let base = [
            "bench",
            "decode",
            "--json",
            "--context",
            "64",
            "--modes",
            "full",
            "--tokens",
            "4",
        ];
        run_json(&[&base[..], extra].concat())
    };
    let v = decode(&["--rounds", "3", "--batch", "2"]);
    let r = &v["results"][0];
    assert_eq!(r["batch"], 2, "{r}");
    let mut ratios: Vec<f64> = r["rounds"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| {
            let alone = x["alone_tokens_per_s"].as_f64().unwrap();
            assert!(alone > 0.0, "{x}");
            x["tokens_per_s"].as_f64().unwrap() / alone
        })
        .collect();
    assert_eq!(ratios.len(), 3, "{r}");
    ratios.sort_by(f64::total_cmp);
    let speedup = r["speedup_over_one_request"].as_f64().unwrap();
    assert!((speedup - ratios[1]).abs() < 1e-9, "{r}");

    let v = decode(&["--rounds", "1"]);
    let r = &v["results"][0];
    assert!(r["speedup_over_one_request"].is_null(), "{r}");
    assert!(r["rounds"][0]["alone_tokens_per_s"].is_null(), "{r}");
}

/// `bench ingest` reports the loopback rate, the store path alone and each of its stages,
/// into a pool of the wire's dtype (copied) and into an int8 one (converted).
#[test]
fn bench_ingest_reports_the_store_path_stage_by_stage() {
    for pool in [&[][..], &["--kv-dtype", "int8"][..]] {
        let v = run_json(&[&["bench", "ingest", "--json", "--gib", "0.01"][..], pool].concat());
        for key in ["gb_per_s", "store_gb_per_s", "memcpy_gb_per_s"] {
            assert!(v[key].as_f64().unwrap() > 0.0, "{key}: {v}");
        }
        let stages = &v["stages_gb_per_s"];
        for key in ["crc32c", "value_rows", "key_transpose_digests"] {
            assert!(stages[key].as_f64().unwrap() > 0.0, "{pool:?} {key}: {v}");
        }
        let ratio = v["store_ratio"].as_f64().unwrap();
        let (store, memcpy) = (&v["store_gb_per_s"], &v["memcpy_gb_per_s"]);
        assert!((ratio - store.as_f64().unwrap() / memcpy.as_f64().unwrap()).abs() < 1e-9);
    }
}

/// `bench capacity`: `full` holds every request's whole KV on the device, the sparse modes
/// only their budget, so on the same memory `full` is bounded by the device and `scout` by
/// the host pool; every request admitted runs alongside the others.
#[test]
fn bench_capacity_bounds_full_by_the_device_and_scout_by_the_host() {
    // tiny: 4 layers, 2 KV heads of 16 dims in f32, so 1 KiB of KV per token. A request of
    // 256 tokens with 32 to generate may hold 289 positions: 19 blocks of 16 tokens, 304 KiB
    // on the device in `full`; 8 blocks (by default twice the 64-token budget's 4), 128 KiB,
    // in `scout`: 920000 bytes hold 2 of the first, 7 of the second. In the host pool it
    // takes 19 blocks of each layer (76 x 4 KiB): 2 MiB holds 6 of them. The 32
    // tokens keep every admitted request running until the last one's first token, however
    // late a loaded machine starts its Generate (with 4, one came after the first had ended
    // and counted as queued).
    let v = run_json(&[
        "bench",
        "capacity",
        "--json",
        "--context",
        "256",
        "--tokens",
        "32",
        "--modes",
        "full,scout",
        "--block-size",
        "16",
        "--budget-tokens",
        "64",
        "--device-kv-bytes",
        "920000",
        "--host-kv-bytes",
        "2Mi",
    ]);
    let rows = v["results"].as_array().unwrap();
    assert_eq!(rows.len(), 2, "{v}");
    let want = [
        ("full", 2, "device KV", 304 << 10),
        ("scout", 6, "host KV", 128 << 10),
    ];
    for (r, (mode, n, bound, device)) in rows.iter().zip(want) {
        assert_eq!(r["mode"], mode, "{r}");
        assert_eq!(r["device_bytes_per_request"], device, "{r}");
        assert_eq!(r["concurrent"], n, "{r}");
        assert_eq!(r["bound"], bound, "{r}");
        assert_eq!(r["queued"], 0, "{r}");
        assert_eq!(r["failed"], 0, "{r}");
        assert!(r["aggregate_tokens_per_s"].as_f64().unwrap() > 0.0, "{r}");
        // No device here: nothing lent, and no more in use than admission counted.
        assert_eq!(r["device_kv_bytes_lent_max"], 0, "{r}");
        assert!(
            r["device_kv_bytes_used_max"].as_u64().unwrap() <= n * device,
            "{r}"
        );
    }
}
