//! `bench fidelity`: what each attention mode and budget costs in accuracy on a real model,
//! next to its speed, in one run and one process.
//!
//! Two measures, both against `full` (which equals HF transformers; see `tests/model_*`):
//! - **passkey**: a 5-digit key hidden at a seeded depth in filler text, then "What is the pass
//!   key? The pass key is"; the node's own prefill, then a greedy decode in each mode. Reported:
//!   the share of prompts whose answer holds the key, and of generated tokens equal to full's.
//! - **teacher-forced agreement** on real text (a frozen snapshot of the repository's docs and
//!   sources, built into the binary): after a prefill of the context, the text's next tokens are fed one by
//!   one; top-1 agreement with full's next-token distribution and its mean KL divergence.
//! - **full's margin where they differ**: at a passkey answer's first token unlike full's and
//!   at each forced position whose top-1 differs, how much more likely full found its own
//!   token (nats). Near-ties flip with any change to attention's arithmetic, a host dtype's
//!   rounding included; a large margin is information the mode lost.
//!
//! With `--kv-dtypes`, every case runs on a host pool of each dtype, fed the same f32 prefill,
//! and `full` on the first dtype is the reference: what a host dtype costs, next to what a
//! mode and budget cost.
//!
//! Speed is measured on the same steps: tokens/s of the forced decode and the CPU side's
//! seconds per token (every CPU part, redone ones included), with the guard's fallback share.

use std::time::Instant;

use anyhow::Context;
use attention::{AttentionConfig, KernelPath, KvDType, Mode, PredictionGuard};
use kv_transfer::HostPool;
use kv_transfer::client::PromptKv;
use serde_json::json;

use super::{parse_list, parse_tokens, quantile};
use crate::cli::FidelityBench;
use crate::client::{ingest_local, prefill_kv};
use crate::engine::SoloDecoder;
use crate::model::random::SplitMix;
use crate::model::sampling::argmax;
use crate::node::Node;

/// Real text every build carries: a frozen snapshot of the repository's own docs and sources
/// (prose and Rust, ~28k tokens). Frozen so that figures stay comparable across commits: the
/// live files change, and top-1 agreement moves by ±0.2 with the text alone.
const TEXT: &str = include_str!("fidelity_text.txt");

const PASSKEY_INTRO: &str = "There is an important info hidden inside a lot of irrelevant text. \
    Find it and memorize it. I will quiz you about the important information there.\n";
const PASSKEY_FILLER: &str =
    " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.";
const PASSKEY_QUESTION: &str = "\nWhat is the pass key? The pass key is";
/// Tokens generated per passkey prompt (a space and five digits, with room to spare).
const PASSKEY_TOKENS: usize = 8;

/// One configuration under test.
#[derive(Debug, Clone)]
struct Case {
    label: String,
    cfg: AttentionConfig,
    guard: bool,
    /// The CPU kernel path its calls take (`--cpu-paths`); `None`: the best.
    cpu_path: Option<KernelPath>,
}

/// The configurations: `full` first (the reference), then each sparse mode at each budget;
/// `scout` with the guard on and off when `--guard both`, where it predicts (layer-ahead on,
/// not `--exact`: else there is nothing to guard).
fn cases(args: &FidelityBench, base: &AttentionConfig, block: usize) -> anyhow::Result<Vec<Case>> {
    let budgets: Vec<usize> = parse_list(&args.budgets, "--budgets")?;
    let guards: Vec<bool> = match args.guard.as_str() {
        "on" => vec![true],
        "off" => vec![false],
        _ => vec![true, false],
    };
    let mut out = vec![Case {
        label: "full".into(),
        cfg: AttentionConfig {
            mode: Mode::Full,
            ..base.clone()
        },
        guard: false,
        cpu_path: None,
    }];
    for m in args.modes.split(',').map(str::trim) {
        let mode = Mode::parse(m).with_context(|| format!("--modes: unknown mode {m:?}"))?;
        if mode == Mode::Full {
            continue;
        }
        for &b in &budgets {
            let predicts = mode == Mode::Scout && base.precompute && !base.exact;
            let gs: &[bool] = if predicts { &guards } else { &[true] };
            for &g in gs {
                let mut cfg = AttentionConfig {
                    mode,
                    budget_tokens: b.max(2 * block),
                    // At this budget, where `--device-blocks` leaves it to the budget.
                    device_blocks_per_head: crate::node::device_blocks_per_head(
                        args.common.model.device_blocks,
                        b.max(2 * block),
                        block,
                    ),
                    ..base.clone()
                };
                if !g {
                    cfg.guard = PredictionGuard::OFF;
                }
                let guard_label = match (predicts, g) {
                    (true, true) => " guard",
                    (true, false) => " no-guard",
                    _ => "",
                };
                out.push(Case {
                    label: format!("{m} b{b}{guard_label}"),
                    cfg,
                    guard: g,
                    cpu_path: None,
                });
            }
        }
    }
    Ok(out)
}

/// A passkey prompt of about `tokens` tokens with `key` at `depth` (0..1) of the filler.
fn passkey_prompt(
    tok: &crate::model::Tokenizer,
    tokens: usize,
    key: &str,
    depth: f64,
) -> anyhow::Result<Vec<u32>> {
    let len = |s: &str| tok.encode(s).map(|v| v.len());
    let key_line = format!(" The pass key is {key}. Remember it. {key} is the pass key.");
    let fixed = len(PASSKEY_INTRO)? + len(&key_line)? + len(PASSKEY_QUESTION)?;
    let per = len(PASSKEY_FILLER)?.max(1);
    let n = tokens.saturating_sub(fixed) / per;
    let at = ((n as f64) * depth).round() as usize;
    let mut text = String::from(PASSKEY_INTRO);
    for i in 0..n {
        if i == at {
            text.push_str(&key_line);
        }
        text.push_str(PASSKEY_FILLER);
    }
    if at >= n {
        text.push_str(&key_line);
    }
    text.push_str(PASSKEY_QUESTION);
    Ok(tok.encode(&text)?)
}

/// Running totals of one case.
#[derive(Debug, Default, Clone)]
struct Tally {
    passkey_found: usize,
    passkey_prompts: usize,
    gen_equal: usize,
    gen_total: usize,
    /// As `gen_equal` and `gen_total`, over the prompts whose key `full` found: where the
    /// reference's own answer is wrong, its tokens are the model's least certain ones.
    gen_equal_found: usize,
    gen_total_found: usize,
    /// Where a case's choice first differs from full's, in a passkey answer or a forced
    /// position: how much more likely full found its own token than the case's (nats). Small
    /// gaps are near-ties, which any change to attention's arithmetic may flip; large ones are
    /// information the case lost.
    gaps: Vec<f64>,
    top1_equal: usize,
    forced: usize,
    kl_sum: f64,
    steps: usize,
    step_seconds: f64,
    cpu_seconds: f64,
    cpu_ratio_sum: f64,
    runs: usize,
    guard_checks: u64,
    guard_fallbacks: u64,
}

impl Tally {
    /// One passkey answer's tokens against the reference's, position by position.
    fn tally_generated(&mut self, generated: &[u32], reference: &[u32], reference_found: bool) {
        let equal = generated
            .iter()
            .zip(reference)
            .filter(|(a, b)| a == b)
            .count();
        self.gen_total += generated.len();
        self.gen_equal += equal;
        if reference_found {
            self.gen_total_found += generated.len();
            self.gen_equal_found += equal;
        }
    }

    /// Full's preference for its token `want` over `got` at a position where it returned the
    /// log-distribution `reference`.
    fn tally_gap(&mut self, reference: &[f64], want: usize, got: usize) {
        if want != got {
            self.gaps.push(reference[want] - reference[got]);
        }
    }
}

/// The first position where `generated` leaves `reference` (both start with the prefill's
/// token, so a step's logits chose the token one position later).
fn first_divergence(generated: &[u32], reference: &[u32]) -> Option<usize> {
    generated.iter().zip(reference).position(|(a, b)| a != b)
}

/// Log-softmax of `logits` in f64.
fn log_softmax(logits: &[f32]) -> Vec<f64> {
    let m = logits.iter().fold(f32::NEG_INFINITY, |a, b| a.max(*b)) as f64;
    let lse = logits
        .iter()
        .map(|x| (*x as f64 - m).exp())
        .sum::<f64>()
        .ln()
        + m;
    logits.iter().map(|x| *x as f64 - lse).collect()
}

/// KL(p || q) of two log-distributions.
fn kl(p: &[f64], q: &[f64]) -> f64 {
    p.iter()
        .zip(q)
        .map(|(a, b)| if *a > -80.0 { a.exp() * (a - b) } else { 0.0 })
        .sum()
}

/// What one decode of a case produced.
struct Run {
    logits: Vec<Vec<f32>>,
    seconds: f64,
    cpu_seconds: f64,
    cpu_ratio: f64,
    guard: (u64, u64),
}

/// What every decode of the bench shares.
struct Ctx<'a> {
    node: &'a Node,
    cpu_pool: &'a rayon::ThreadPool,
}

/// Ingests `kv` into `store` and decodes from it, feeding `first`, then `feed(i, last_logits)`
/// after step `i`; returns every step's logits.
fn run_case(
    ctx: &Ctx<'_>,
    store: &Store,
    cfg: &AttentionConfig,
    kv: &PromptKv,
    first: u32,
    steps: usize,
    mut feed: impl FnMut(usize, &[f32]) -> u32,
) -> anyhow::Result<Run> {
    let model = &ctx.node.model.model;
    let kv = ingest_local(&store.layout, &store.pool, kv)?;
    let mut dec = SoloDecoder::new(model, cfg, ctx.cpu_pool, &store.pool, kv, steps)?;
    let mut logits = Vec::with_capacity(steps);
    let t = Instant::now();
    let mut tok = first;
    for i in 0..steps {
        let l = dec.step(tok)?;
        tok = feed(i, &l);
        logits.push(l);
    }
    let s = dec.stats();
    Ok(Run {
        logits,
        seconds: t.elapsed().as_secs_f64(),
        cpu_seconds: dec.cpu_seconds(),
        cpu_ratio: s.cpu_ratio(),
        guard: (s.guard_checks, s.guard_fallbacks),
    })
}

/// One host pool under test: `bench fidelity --kv-dtypes` runs every case on each.
struct Store {
    layout: kv_transfer::KvLayout,
    pool: HostPool,
}

/// The host KV dtypes to compare: `--kv-dtypes`, else the node's own pool.
fn kv_dtypes(args: &FidelityBench, node: &Node) -> anyhow::Result<Vec<KvDType>> {
    let Some(list) = &args.kv_dtypes else {
        return Ok(vec![node.layout.geom.dtype]);
    };
    let mut out = Vec::new();
    for s in list.split(',').map(str::trim) {
        let d = KvDType::parse(s).with_context(|| {
            format!("--kv-dtypes: unknown dtype {s:?} (expected f32, f16, bf16, int8 or fp8)")
        })?;
        anyhow::ensure!(!out.contains(&d), "--kv-dtypes: {s} is listed twice");
        out.push(d);
    }
    anyhow::ensure!(!out.is_empty(), "--kv-dtypes is empty");
    Ok(out)
}

/// The CPU kernel paths to compare, as `--cpu-paths` lists them (`best`: the one each call
/// would take, `None`); without it, the best alone.
fn cpu_paths(args: &FidelityBench) -> anyhow::Result<Vec<Option<KernelPath>>> {
    let Some(list) = &args.cpu_paths else {
        return Ok(vec![None]);
    };
    let mut out = Vec::new();
    for s in list.split(',').map(str::trim) {
        let p = if s == "best" {
            None
        } else {
            let p = KernelPath::ALL.iter().copied().find(|p| p.name() == s);
            Some(p.with_context(|| {
                let names: Vec<&str> = KernelPath::ALL.iter().map(|p| p.name()).collect();
                format!(
                    "--cpu-paths: unknown path {s:?} (best, or one this build has: {})",
                    names.join(", ")
                )
            })?)
        };
        anyhow::ensure!(!out.contains(&p), "--cpu-paths: {s} is listed twice");
        out.push(p);
    }
    Ok(out)
}

/// A path's name in labels: `best` for the one each call would take.
fn path_name(p: Option<KernelPath>) -> &'static str {
    p.map_or("best", KernelPath::name)
}

/// `bench fidelity`.
pub(super) fn fidelity(args: &FidelityBench) -> anyhow::Result<serde_json::Value> {
    let node = Node::build(&args.common.model)?;
    let geom = node.layout.geom;
    let base_cases = cases(args, &node.attention, geom.block_size)?;
    let dtypes = kv_dtypes(args, &node)?;
    let contexts: Vec<usize> = args
        .context
        .split(',')
        .map(parse_tokens)
        .collect::<Result<_, _>>()?;
    let max_ctx = node.layout.max_context;
    let forced = args.forced.max(1);
    let longest = contexts.iter().max().copied().unwrap_or(0) + forced + 64;
    anyhow::ensure!(
        longest < max_ctx,
        "context + forced tokens ({longest}) exceed the model's {max_ctx}"
    );
    let tok = &node.model.tokenizer;
    let text_ids = tok
        .encode(TEXT)
        .context("bench fidelity needs a model with a tokenizer")?;
    // Every pool gets the same values: the prefill's own f32 when several are compared.
    let wire = if args.kv_dtypes.is_some() {
        KvDType::F32
    } else {
        node.wire_dtype()
    };
    let stores = dtypes
        .iter()
        .map(|&dtype| {
            let mut layout = node.layout.clone();
            layout.geom.dtype = dtype;
            let g = layout.geom;
            // KV and a host-kept key sketch per token.
            let sketch = attention::sketch::nibble_bytes(g.head_dim) + 4;
            let per_token = (g.block_bytes() * layout.num_layers) as u64 / g.block_size as u64
                + (sketch * g.num_kv_heads * layout.num_layers) as u64;
            // Two live sequences at most (the one decoding, the next being ingested) plus slack.
            let pool = HostPool::new(
                g,
                2 * per_token * (longest as u64 + 2 * g.block_size as u64) + (64 << 20),
            )?;
            Ok(Store { layout, pool })
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let paths = cpu_paths(args)?;
    // Each case on each pool and path; the reference (`full` on the first pool and path) comes
    // first.
    let cases: Vec<(usize, Case)> = (0..stores.len())
        .flat_map(|s| paths.iter().map(move |p| (s, *p)))
        .flat_map(|(s, p)| base_cases.iter().map(move |c| (s, p, c.clone())))
        .map(|(s, p, mut c)| {
            if args.kv_dtypes.is_some() {
                c.label = format!("{} {}", c.label, dtypes[s]);
            }
            if args.cpu_paths.is_some() {
                c.label = format!("{} {}", c.label, path_name(p));
            }
            c.cpu_path = p;
            (s, c)
        })
        .collect();
    // The path is the process's choice (every thread's calls take it), set before each run
    // and restored when the bench returns, however it returns.
    struct Restore;
    impl Drop for Restore {
        fn drop(&mut self) {
            attention::force_kernel_path(None);
        }
    }
    let _restore = Restore;
    let cpu_pool = rayon::ThreadPoolBuilder::new()
        .num_threads(rayon::current_num_threads())
        .thread_name(|i| format!("cpu-attn-{i}"))
        .build()?;
    let cx = Ctx {
        node: &node,
        cpu_pool: &cpu_pool,
    };
    let mut tallies = vec![Tally::default(); cases.len()];
    let mut rows = Vec::new();
    for &ctx in &contexts {
        let mut t_ctx = vec![Tally::default(); cases.len()];
        // Passkey prompts.
        for p in 0..args.prompts {
            let mut r = SplitMix(0x9a55_0000 + p as u64);
            let key = format!("{:05}", 10_000 + r.next_u64() % 90_000);
            let depth = (p as f64 + 0.5) / args.prompts as f64;
            let ids = passkey_prompt(tok, ctx, &key, depth)?;
            let kv = prefill_kv(&node.model, &ids, "fidelity", wire)?;
            let first = kv.header.next_token_id;
            let mut reference: Option<(Vec<u32>, bool, Vec<Vec<f64>>)> = None;
            for (c, (s, case)) in cases.iter().enumerate() {
                let mut generated = vec![first];
                attention::force_kernel_path(case.cpu_path);
                let run = run_case(
                    &cx,
                    &stores[*s],
                    &case.cfg,
                    &kv,
                    first,
                    PASSKEY_TOKENS - 1,
                    |_, l| {
                        let t = argmax(l) as u32;
                        generated.push(t);
                        t
                    },
                )?;
                let answer = tok.decode(&generated);
                let found = answer.contains(&key);
                let t = &mut t_ctx[c];
                t.passkey_prompts += 1;
                t.passkey_found += usize::from(found);
                let (want, want_found, want_lps) = reference.get_or_insert_with(|| {
                    let lps = run.logits.iter().map(|l| log_softmax(l)).collect();
                    (generated.clone(), found, lps)
                });
                t.tally_generated(&generated, want, *want_found);
                // Position 0 is the prefill's token, the same for every case.
                if let Some(i) = first_divergence(&generated, want).filter(|&i| i > 0) {
                    t.tally_gap(&want_lps[i - 1], want[i] as usize, generated[i] as usize);
                }
                if !args.common.json && args.verbose {
                    eprintln!(
                        "passkey ctx={ctx} prompt {p} key {key} {:<20} {answer:?}",
                        case.label
                    );
                }
                tally_speed(t, &run);
            }
        }
        // Teacher-forced agreement on real text.
        anyhow::ensure!(
            text_ids.len() > ctx + forced + 1,
            "the built-in text has {} tokens; context {ctx} + {forced} forced needs more",
            text_ids.len()
        );
        let kv = prefill_kv(&node.model, &text_ids[..ctx], "fidelity", wire)?;
        let feed = &text_ids[ctx..ctx + forced + 1];
        let mut reference: Option<Vec<Vec<f64>>> = None;
        for (c, (s, case)) in cases.iter().enumerate() {
            attention::force_kernel_path(case.cpu_path);
            let run = run_case(&cx, &stores[*s], &case.cfg, &kv, feed[0], forced, |i, _| {
                feed[i + 1]
            })?;
            let lps: Vec<Vec<f64>> = run.logits.iter().map(|l| log_softmax(l)).collect();
            let t = &mut t_ctx[c];
            match &reference {
                None => {
                    t.top1_equal += forced;
                    reference = Some(lps);
                }
                Some(want) => {
                    for (p, q) in want.iter().zip(&lps) {
                        let (a, b) = (argmax_f64(p), argmax_f64(q));
                        t.top1_equal += usize::from(a == b);
                        t.tally_gap(p, a, b);
                        t.kl_sum += kl(p, q);
                    }
                }
            }
            t.forced += forced;
            tally_speed(t, &run);
        }
        for (c, (s, case)) in cases.iter().enumerate() {
            let row = report(
                &format!("{ctx}"),
                case,
                dtypes[*s],
                &t_ctx[c],
                args.common.json,
            );
            rows.push(row);
            merge(&mut tallies[c], &t_ctx[c]);
        }
    }
    if contexts.len() > 1 {
        for (c, (s, case)) in cases.iter().enumerate() {
            rows.push(report(
                "all",
                case,
                dtypes[*s],
                &tallies[c],
                args.common.json,
            ));
        }
    }
    Ok(json!({
        "bench": "fidelity",
        "model": args.common.model.model,
        "block_size": geom.block_size,
        "budget_split": if node.attention.shared_budget { "layer" } else { "head" },
        "prompts": args.prompts,
        "forced_tokens": forced,
        "reference": match &args.cpu_paths {
            Some(_) => format!("full {} {}", dtypes[0], path_name(paths[0])),
            None => format!("full {}", dtypes[0]),
        },
        "results": rows,
    }))
}

fn argmax_f64(v: &[f64]) -> usize {
    v.iter()
        .enumerate()
        .fold((0, f64::NEG_INFINITY), |(bi, bv), (i, x)| {
            if *x > bv { (i, *x) } else { (bi, bv) }
        })
        .0
}

fn tally_speed(t: &mut Tally, run: &Run) {
    t.steps += run.logits.len();
    t.step_seconds += run.seconds;
    t.cpu_seconds += run.cpu_seconds;
    t.cpu_ratio_sum += run.cpu_ratio;
    t.runs += 1;
    t.guard_checks += run.guard.0;
    t.guard_fallbacks += run.guard.1;
}

fn merge(a: &mut Tally, b: &Tally) {
    a.passkey_found += b.passkey_found;
    a.passkey_prompts += b.passkey_prompts;
    a.gen_equal += b.gen_equal;
    a.gen_total += b.gen_total;
    a.gen_equal_found += b.gen_equal_found;
    a.gen_total_found += b.gen_total_found;
    a.gaps.extend_from_slice(&b.gaps);
    a.top1_equal += b.top1_equal;
    a.forced += b.forced;
    a.kl_sum += b.kl_sum;
    a.steps += b.steps;
    a.step_seconds += b.step_seconds;
    a.cpu_seconds += b.cpu_seconds;
    a.cpu_ratio_sum += b.cpu_ratio_sum;
    a.runs += b.runs;
    a.guard_checks += b.guard_checks;
    a.guard_fallbacks += b.guard_fallbacks;
}

fn report(ctx: &str, case: &Case, kv_dtype: KvDType, t: &Tally, quiet: bool) -> serde_json::Value {
    let r = |a: usize, b: usize| {
        if b == 0 {
            f64::NAN
        } else {
            a as f64 / b as f64
        }
    };
    let passkey = r(t.passkey_found, t.passkey_prompts);
    let gen_eq = r(t.gen_equal, t.gen_total);
    let gen_eq_found = r(t.gen_equal_found, t.gen_total_found);
    let top1 = r(t.top1_equal, t.forced);
    let kl = if t.forced == 0 {
        f64::NAN
    } else {
        t.kl_sum / t.forced as f64
    };
    let tps = t.steps as f64 / t.step_seconds.max(1e-9);
    let cpu_ms = t.cpu_seconds / t.steps.max(1) as f64 * 1e3;
    let fallback = if t.guard_checks == 0 {
        0.0
    } else {
        t.guard_fallbacks as f64 / t.guard_checks as f64
    };
    let cpu_share = t.cpu_ratio_sum / t.runs.max(1) as f64;
    let gaps = quantiles(&t.gaps);
    if !quiet {
        // A figure with nothing measured behind it (no prompts, no forced text) prints as "-".
        let show = |v: f64, prec: usize| {
            if v.is_nan() {
                format!("{:>w$}", "-", w = prec + 2)
            } else {
                format!("{v:.prec$}")
            }
        };
        eprintln!(
            "fidelity ctx={ctx:>5} {:<23} passkey {}  generated=full {} (where full found {})  top1=full {}  KL {}  full's margin where they differ {} {}/{}/{} nats  | {tps:6.1} tok/s  CPU part {cpu_ms:6.2} ms/tok  CPU share {:.2}  guard redo {:.2}",
            case.label,
            show(passkey, 2),
            show(gen_eq, 3),
            show(gen_eq_found, 3),
            show(top1, 4),
            show(kl, 5),
            t.gaps.len(),
            show(gaps[0], 2),
            show(gaps[1], 2),
            show(gaps[2], 2),
            cpu_share,
            fallback
        );
    }
    json!({
        "context": ctx, "case": case.label, "mode": case.cfg.mode.name(), "kv_dtype": kv_dtype.name(),
        "budget_tokens": case.cfg.budget_tokens, "guard": case.guard,
        "passkey_accuracy": passkey, "generated_equal_to_full": gen_eq,
        "generated_equal_to_full_where_full_found": gen_eq_found,
        "top1_agreement_with_full": top1, "mean_kl_from_full": kl,
        "differences_from_full": t.gaps.len(),
        "full_margin_where_different_nats": {"median": gaps[0], "p90": gaps[1], "max": gaps[2]},
        "tokens_per_s": tps, "cpu_part_ms_per_token": cpu_ms, "cpu_share": cpu_share,
        "guard_fallback_share": fallback,
    })
}

/// Median, 90th percentile and maximum of `v` (NaN where it is empty, printed as "-").
fn quantiles(v: &[f64]) -> [f64; 3] {
    if v.is_empty() {
        return [f64::NAN; 3];
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    [0.5, 0.9, 1.0].map(|q| quantile(&s, q))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_budget_gets_its_own_device_blocks_unless_they_are_given() {
        #[derive(clap::Parser)]
        struct Args {
            #[command(flatten)]
            bench: FidelityBench,
        }
        let device_blocks = |flags: &[&str]| -> Vec<(String, usize)> {
            use clap::Parser;
            let args = Args::parse_from(
                ["t", "--modes", "scout", "--guard", "on"]
                    .iter()
                    .chain(flags),
            );
            let geom = attention::BlockGeometry {
                block_size: 32,
                num_kv_heads: 2,
                head_dim: 64,
                dtype: KvDType::Bf16,
            };
            let base = crate::node::attention_config(&args.bench.common.model, geom, 4, 2).unwrap();
            cases(&args.bench, &base, 32)
                .unwrap()
                .into_iter()
                .map(|c| (c.label, c.cfg.resident_blocks_per_head()))
                .collect()
        };
        // `full` holds everything; the node's own budget (2048) does not size the cases'.
        let got = device_blocks(&["--budgets", "512,1024"]);
        assert_eq!(got[0].1, usize::MAX);
        assert_eq!(
            got[1..].iter().map(|c| c.1).collect::<Vec<_>>(),
            [32, 64],
            "{got:?}"
        );
        let got = device_blocks(&["--budgets", "512,1024", "--device-blocks", "40"]);
        assert_eq!(
            got[1..].iter().map(|c| c.1).collect::<Vec<_>>(),
            [40, 40],
            "{got:?}"
        );
    }

    #[test]
    fn generated_tokens_count_apart_where_the_reference_missed_the_key() {
        let mut t = Tally::default();
        // The reference found this key: 3 of 4 tokens equal.
        t.tally_generated(&[1, 2, 3, 9], &[1, 2, 3, 4], true);
        // It missed this one: 1 of 4.
        t.tally_generated(&[5, 0, 0, 0], &[5, 6, 7, 8], false);
        assert_eq!((t.gen_equal, t.gen_total), (4, 8));
        assert_eq!((t.gen_equal_found, t.gen_total_found), (3, 4));
        let mut sum = Tally::default();
        merge(&mut sum, &t);
        merge(&mut sum, &t);
        assert_eq!((sum.gen_equal_found, sum.gen_total_found), (6, 8));
    }

    #[test]
    fn a_difference_is_measured_by_how_much_full_preferred_its_own_token() {
        // The prefill's token is shared; the case leaves full's answer at position 2.
        assert_eq!(first_divergence(&[7, 1, 2, 3], &[7, 1, 5, 3]), Some(2));
        assert_eq!(first_divergence(&[7, 1], &[7, 1]), None);
        let mut t = Tally::default();
        let lp = [-0.5f64, -1.25, -3.0];
        t.tally_gap(&lp, 0, 0);
        assert!(t.gaps.is_empty(), "equal choices are no difference");
        t.tally_gap(&lp, 0, 1);
        t.tally_gap(&lp, 0, 2);
        assert_eq!(t.gaps, vec![0.75, 2.5]);
        assert_eq!(quantiles(&[2.5, 0.75, 1.0]), [1.0, 2.5, 2.5]);
        let q = quantiles(&(1..=11).rev().map(f64::from).collect::<Vec<_>>());
        assert_eq!(q, [6.0, 10.0, 11.0]);
        assert!(quantiles(&[]).iter().all(|x| x.is_nan()));
    }
}
