//! The engine driven as the service drives it, without a server: jobs in, events out, on the
//! embedded `tiny` model. Tokens are checked against greedy decoding by full prefills (the
//! model's definition), and the pool against its start.

use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use kv_transfer::{HostPool, KvLayout};
use tokio::sync::mpsc;

use super::*;
use crate::client::{ingest_local, prefill_kv};
use crate::metrics::Metrics;
use crate::model::{LoadedModel, Sampling, sampling};
use crate::node::Node;

#[derive(Parser)]
struct Args {
    #[command(flatten)]
    model: crate::cli::ModelArgs,
}

struct Rig {
    model: Arc<LoadedModel>,
    layout: KvLayout,
    pool: HostPool,
    engine: Engine,
    thread: Option<std::thread::JoinHandle<()>>,
    metrics: Metrics,
}

impl Rig {
    fn start(max_batch: usize, device_kv_bytes: u64) -> Self {
        Self::start_on(max_batch, device_kv_bytes, None)
    }

    /// A rig whose engine runs `engine_model` (the same `tiny` on another backend); prefills
    /// and references keep the CPU model.
    fn start_on(
        max_batch: usize,
        device_kv_bytes: u64,
        engine_model: Option<Arc<LoadedModel>>,
    ) -> Self {
        Self::start_with(
            max_batch,
            device_kv_bytes,
            engine_model,
            &["--attention", "full"],
        )
    }

    /// A rig with the node flags `flags` (attention mode and policy).
    fn start_with(
        max_batch: usize,
        device_kv_bytes: u64,
        engine_model: Option<Arc<LoadedModel>>,
        flags: &[&str],
    ) -> Self {
        let args = Args::parse_from(["t", "--model", "tiny"].iter().chain(flags));
        let node = Node::build(&args.model).unwrap();
        let pool = HostPool::new(node.layout.geom, 64 << 20).unwrap();
        let cfg = EngineConfig {
            attention: node.attention.clone(),
            max_batch,
            device_kv_bytes,
            queue_timeout: Duration::from_secs(30),
            cpu_threads: 1,
            prefix_cache: None,
            lend_spare_device: args.model.spare_device_kv == "on",
        };
        let on = engine_model.unwrap_or_else(|| node.model.clone());
        let metrics = Metrics::new();
        let (engine, thread) = Engine::start(on, pool.clone(), cfg, metrics.clone()).unwrap();
        Self {
            model: node.model,
            layout: node.layout,
            pool,
            engine,
            thread: Some(thread),
            metrics,
        }
    }

    fn prompt(seed: u32) -> Vec<u32> {
        (0..40 + seed).map(|i| (i * 31 + seed * 7) % 250).collect()
    }

    /// Submits a greedy job for `prompt`; returns its event stream.
    fn submit(&self, id: &str, prompt: &[u32], max_new: u32) -> mpsc::UnboundedReceiver<Event> {
        self.submit_with(id, prompt, max_new, |_| {})
    }

    /// Submits a greedy job that ignores EOS, after `tune` set what the test needs (sampling,
    /// output options, stop ids); returns its event stream.
    fn submit_with(
        &self,
        id: &str,
        prompt: &[u32],
        max_new: u32,
        tune: impl FnOnce(&mut JobSpec),
    ) -> mpsc::UnboundedReceiver<Event> {
        let (job, rx) = self.job(id, prompt, max_new, tune);
        assert!(self.engine.send(Control::Submit(job)));
        rx
    }

    /// Greedy jobs for `prompts` (ids `r0`, `r1`, ...), every prefill made before the first is
    /// sent, so the engine finds them waiting together and steps them as one batch.
    fn submit_together(
        &self,
        prompts: &[Vec<u32>],
        max_new: u32,
    ) -> Vec<mpsc::UnboundedReceiver<Event>> {
        let jobs: Vec<_> = prompts
            .iter()
            .enumerate()
            .map(|(i, p)| self.job(&format!("r{i}"), p, max_new, |_| {}))
            .collect();
        jobs.into_iter()
            .map(|(job, rx)| {
                assert!(self.engine.send(Control::Submit(job)));
                rx
            })
            .collect()
    }

    /// A greedy job that ignores EOS, tuned by `tune`, and its event stream.
    fn job(
        &self,
        id: &str,
        prompt: &[u32],
        max_new: u32,
        tune: impl FnOnce(&mut JobSpec),
    ) -> (Job, mpsc::UnboundedReceiver<Event>) {
        let kv = prefill_kv(&self.model, prompt, id, self.layout.geom.dtype).unwrap();
        let committed = ingest_local(&self.layout, &self.pool, &kv).unwrap();
        let (tx, rx) = mpsc::unbounded_channel();
        let mut spec = JobSpec {
            request_id: id.into(),
            sampling: Sampling::default(),
            max_new_tokens: max_new,
            stop_ids: Vec::new(),
            ignore_eos: true,
            output: OutputOptions::default(),
            arrived: Instant::now(),
            events: tx,
            span: tracing::Span::none(),
        };
        tune(&mut spec);
        let job = Job {
            kv: Box::new(committed),
            spec,
        };
        (job, rx)
    }

    /// Greedy tokens after `prompt` by full prefills: the token the prefill picks first, then
    /// `n` more, each the argmax of a prefill over everything before it.
    fn reference(&self, prompt: &[u32], n: usize) -> Vec<u32> {
        let mut ctx = prompt.to_vec();
        for _ in 0..=n {
            let logits = self.model.model.prefill(&ctx).unwrap().logits;
            ctx.push(sampling::argmax(&logits) as u32);
        }
        ctx[prompt.len() + 1..].to_vec()
    }

    fn wait_pool_empty(&self) {
        let t = Instant::now();
        while self.pool.usage().used + self.pool.usage().reserved > 0 {
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "{:?}",
                self.pool.usage()
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

impl Drop for Rig {
    fn drop(&mut self) {
        self.engine.send(Control::Shutdown);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Every event of a stream: (token ids, the last event).
fn drain(rx: &mut mpsc::UnboundedReceiver<Event>) -> (Vec<u32>, Event) {
    let (toks, last) = drain_tokens(rx);
    (toks.into_iter().map(|t| t.0).collect(), last)
}

#[test]
fn more_requests_than_the_batch_all_stream_their_greedy_tokens() {
    let rig = Rig::start(2, 1 << 30);
    let prompts: Vec<Vec<u32>> = (0..3).map(Rig::prompt).collect();
    let mut streams: Vec<_> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| rig.submit(&format!("r{i}"), p, 6))
        .collect();
    for (p, rx) in prompts.iter().zip(&mut streams) {
        let (ids, last) = drain(rx);
        assert_eq!(ids, rig.reference(p, 6));
        match last {
            Event::Finish {
                reason, generated, ..
            } => assert_eq!((reason, generated), (FinishReason::Length, 6)),
            e => panic!("{e:?}"),
        }
    }
    rig.wait_pool_empty();
}

/// On the CPU device the whole step runs in the CPU-attention pool: with one thread, the
/// layer-ahead CPU parts queued behind the step must run while it waits for them (a blocking
/// wait would never return). A budget over the whole context keeps scout equal to full.
#[test]
fn scout_on_a_pool_of_one_thread_streams_the_greedy_tokens() {
    let flags = [
        "--attention",
        "scout",
        "--layer-ahead",
        "on",
        "--block-size",
        "8",
        "--budget-tokens",
        "4096",
        "--device-blocks",
        "1",
    ];
    let rig = Rig::start_with(2, 1 << 30, None, &flags);
    let prompts: Vec<Vec<u32>> = (0..2).map(Rig::prompt).collect();
    let mut streams: Vec<_> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| rig.submit(&format!("s{i}"), p, 6))
        .collect();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let got: Vec<Vec<u32>> = streams.iter_mut().map(|s| drain(s).0).collect();
        let _ = tx.send(got);
    });
    let Ok(got) = rx.recv_timeout(Duration::from_secs(60)) else {
        // Its engine thread is stuck: dropping the rig would join it forever.
        std::mem::forget(rig);
        panic!("the step never finished: a wait for a CPU part blocked the pool");
    };
    for (p, ids) in prompts.iter().zip(got) {
        assert_eq!(ids, rig.reference(p, 6));
    }
    rig.wait_pool_empty();
}

/// On a CPU node the sketch scorer keeps each request's sketch in host pool blocks, taken
/// with its growth at admission and freed with its KV: the pool holds exactly those pages
/// more than under sparq while the request runs, and the tokens stay the greedy ones (a
/// budget over the whole context).
#[test]
fn a_cpu_node_keeps_each_sketch_in_pool_blocks_and_frees_them() {
    let prompt = Rig::prompt(60);
    // The pool is read while the request surely runs: it is cancelled once its first tokens
    // are checked, and a cancel (not a finish) proves it still held its pages when they were
    // read. A request that finished first (a starved test thread) is submitted again.
    let max_new = 2000;
    let checked = 12;
    let held = |scorer: &str| {
        let flags = [
            "--attention",
            "scout",
            "--block-size",
            "8",
            "--budget-tokens",
            "4096",
            "--device-blocks",
            "2",
            "--block-scorer",
            scorer,
        ];
        let rig = Rig::start_with(1, 1 << 30, None, &flags);
        let reference = rig.reference(&prompt, checked);
        let u = (0..5)
            .find_map(|_| {
                let mut rx = rig.submit("k", &prompt, max_new);
                let mut ids = Vec::new();
                let mut token = || match rx.blocking_recv() {
                    Some(Event::Token { id, .. }) => id,
                    e => panic!("{scorer}: {e:?} before {checked} tokens"),
                };
                ids.push(token());
                // Taken or promised: constant while the request runs.
                let u = rig.pool.usage();
                while ids.len() < checked {
                    ids.push(token());
                }
                rig.engine.send(Control::Cancel("k".into(), "cancel"));
                let (_, last) = drain(&mut rx);
                assert_eq!(ids, reference, "{scorer}");
                rig.wait_pool_empty();
                let Event::Finish { reason, .. } = last else {
                    panic!("{scorer}: {last:?}")
                };
                (reason == FinishReason::Cancelled).then_some(u)
            })
            .expect("the request finished before it was cancelled, five times");
        let geom = rig.layout.geom;
        let args = Args::parse_from(["t", "--model", "tiny"].iter().chain(&flags));
        let node = Node::build(&args.model).unwrap();
        let layers = rig.model.model.cfg.num_layers;
        let pages = admission::SketchSlots::of_node(&node.attention, &geom, layers, false)
            .map_or(0, |s| {
                s.pool_pages(prompt.len() + max_new as usize + 1, geom.num_kv_heads)
            });
        (
            u.used + u.reserved,
            pages as u64 * geom.block_bytes() as u64,
        )
    };
    let (sparq, no_pages) = held("sparq");
    let (sketch, pages) = held("sketch");
    assert_eq!(no_pages, 0);
    assert!(pages > 0);
    assert_eq!(sketch.checked_sub(sparq), Some(pages));
}

#[test]
fn cancels_end_waiting_and_running_requests_and_free_their_kv() {
    let rig = Rig::start(1, 1 << 30);
    let mut a = rig.submit("a", &Rig::prompt(1), 100_000);
    let mut b = rig.submit("b", &Rig::prompt(2), 4);
    // `a` runs (it streams), `b` waits behind it: cancel `b` first, then `a`.
    assert!(matches!(a.blocking_recv(), Some(Event::Token { .. })));
    rig.engine.send(Control::Cancel("b".into(), "cancel"));
    let (ids, last) = drain(&mut b);
    assert!(ids.is_empty());
    assert!(matches!(
        last,
        Event::Finish {
            reason: FinishReason::Cancelled,
            generated: 0,
            ..
        }
    ));
    rig.engine.send(Control::Cancel("a".into(), "cancel"));
    let (_, last) = drain(&mut a);
    assert!(matches!(
        last,
        Event::Finish {
            reason: FinishReason::Cancelled,
            ..
        }
    ));
    rig.wait_pool_empty();
    // The load is published after the KV is freed: wait for it as for the pool.
    let t = Instant::now();
    while rig.engine.load().running + rig.engine.load().waiting > 0 {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "{:?}",
            rig.engine.load()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn a_request_that_can_never_fit_is_refused_at_once() {
    // Less device KV than one request's prompt.
    let rig = Rig::start(4, 1024);
    let mut rx = rig.submit("big", &Rig::prompt(3), 8);
    let t = Instant::now();
    match drain(&mut rx) {
        (ids, Event::Error(EngineError::Exhausted(m))) => {
            assert!(ids.is_empty());
            assert!(
                m.contains("never fit") && m.contains("capacity 1024"),
                "{m}"
            );
        }
        other => panic!("{other:?}"),
    }
    assert!(t.elapsed() < Duration::from_secs(5));
    rig.wait_pool_empty();
}

/// A device whose arena holds less than `--device-kv-bytes` (free memory ran short) is
/// counted at what it holds: a request past that is refused at admission, not failed by a
/// full arena in a step.
#[test]
fn admission_counts_what_the_device_arena_holds_not_what_was_asked() {
    let dev = Arc::new(TestDevice {
        kv: true,
        arena_bytes: 2048,
        ..TestDevice::default()
    });
    let model = Arc::new(crate::model::load("tiny", dev).unwrap());
    let rig = Rig::start_with(4, 1 << 30, Some(model), &["--attention", "full"]);
    let mut rx = rig.submit("big", &Rig::prompt(3), 8);
    match drain(&mut rx) {
        (ids, Event::Error(EngineError::Exhausted(m))) => {
            assert!(ids.is_empty());
            assert!(m.contains("capacity 2048"), "{m}");
        }
        other => panic!("{other:?}"),
    }
    rig.wait_pool_empty();
}

/// A CPU node has no device memory: `--device-kv-bytes auto` counts nothing against it and
/// reports a capacity of 0; a figure given is counted and reported.
#[test]
fn a_cpu_node_reports_no_device_capacity_unless_one_is_given() {
    let auto = Rig::start(4, crate::cli::DEVICE_KV_AUTO);
    assert_eq!(auto.engine.load().device_capacity, 0);
    let mut rx = auto.submit("a", &Rig::prompt(3), 4);
    assert_eq!(drain(&mut rx).0.len(), 4);
    let given = Rig::start(4, 1 << 30);
    assert_eq!(given.engine.load().device_capacity, 1 << 30);
    auto.wait_pool_empty();
}

#[test]
fn shutdown_cancels_the_running_and_refuses_the_waiting() {
    let mut rig = Rig::start(1, 1 << 30);
    let mut a = rig.submit("a", &Rig::prompt(4), 100_000);
    let mut b = rig.submit("b", &Rig::prompt(5), 4);
    assert!(matches!(a.blocking_recv(), Some(Event::Token { .. })));
    rig.engine.send(Control::Shutdown);
    rig.thread.take().unwrap().join().unwrap();
    assert!(matches!(
        drain(&mut a).1,
        Event::Finish {
            reason: FinishReason::Cancelled,
            ..
        }
    ));
    assert_eq!(drain(&mut b).1, Event::Error(EngineError::ShuttingDown));
    rig.wait_pool_empty();
    assert!(
        !rig.engine.send(Control::Shutdown),
        "the engine has stopped"
    );
}

/// Every token event of a stream (id, text, top logprobs), and the last event.
fn drain_tokens(
    rx: &mut mpsc::UnboundedReceiver<Event>,
) -> (Vec<(u32, String, Vec<TopLogprob>)>, Event) {
    let mut toks = Vec::new();
    while let Some(ev) = rx.blocking_recv() {
        match ev {
            Event::Token {
                id,
                text,
                top_logprobs,
                ..
            } => toks.push((id, text, top_logprobs)),
            last => return (toks, last),
        }
    }
    panic!("the stream ended without a last event");
}

fn finish_reason(ev: &Event) -> FinishReason {
    match ev {
        Event::Finish { reason, .. } => *reason,
        e => panic!("{e:?}"),
    }
}

/// Penalties pick what the definition picks: each step's logits from a full prefill, the
/// repetition penalty over prompt and output, presence and frequency over the output
/// (written out here, apart from the engine's code), then the argmax.
#[test]
fn penalties_change_greedy_tokens_as_defined() {
    let rig = Rig::start(2, 1 << 30);
    let prompt = Rig::prompt(4);
    let (rep, pres, freq) = (1.8f32, 0.7f32, 0.9f32);
    let sampling = Sampling {
        repetition_penalty: rep,
        presence_penalty: pres,
        frequency_penalty: freq,
        ..Sampling::default()
    };
    let n = 12;
    let mut rx = rig.submit_with("p", &prompt, n, |s| s.sampling = sampling);
    let (toks, last) = drain_tokens(&mut rx);
    assert_eq!(finish_reason(&last), FinishReason::Length);
    // The prefill's token (the pushed KV's next token) is the output's first: the penalties
    // count it, and the node streams the tokens after it.
    let mut ctx = prompt.clone();
    ctx.push(sampling::argmax(&rig.model.model.prefill(&ctx).unwrap().logits) as u32);
    let mut out: Vec<u32> = vec![*ctx.last().unwrap()];
    for _ in 0..n {
        let mut l = rig.model.model.prefill(&ctx).unwrap().logits;
        let seen: std::collections::BTreeSet<u32> = prompt.iter().chain(&out).copied().collect();
        for t in seen {
            let v = &mut l[t as usize];
            *v = if *v > 0.0 { *v / rep } else { *v * rep };
        }
        for t in out.iter().collect::<std::collections::BTreeSet<_>>() {
            let c = out.iter().filter(|x| *x == t).count() as f32;
            l[*t as usize] -= freq * c + pres;
        }
        let t = sampling::argmax(&l) as u32;
        out.push(t);
        ctx.push(t);
    }
    let ids: Vec<u32> = toks.iter().map(|t| t.0).collect();
    assert_eq!(ids, out[1..]);
    assert_ne!(
        ids,
        rig.reference(&prompt, n as usize),
        "the penalties changed nothing"
    );
    rig.wait_pool_empty();
}

/// A stop string ends the text before it (FINISH STOP); min_tokens bans stop ids until then;
/// top logprobs are the model's best tokens, greedy's first.
#[test]
fn stop_strings_min_tokens_and_top_logprobs() {
    let rig = Rig::start(2, 1 << 30);
    let prompt = Rig::prompt(5);
    let greedy = rig.reference(&prompt, 16);
    let text = |ids: &[u32]| rig.model.tokenizer.decode(ids);
    // A stop string taken from the middle of the greedy text.
    let full = text(&greedy);
    let stop: String = full.chars().skip(5).take(3).collect();
    let before = &full[..full.find(&stop).unwrap()];
    let out = OutputOptions {
        stop_strings: vec![stop.clone()],
        top_logprobs: 3,
        ..OutputOptions::default()
    };
    let mut rx = rig.submit_with("s", &prompt, 16, |s| s.output = out);
    let (toks, last) = drain_tokens(&mut rx);
    assert_eq!(finish_reason(&last), FinishReason::Stop);
    let streamed: String = toks.iter().map(|t| t.1.as_str()).collect();
    assert_eq!(streamed, before, "stop {stop:?} in {full:?}");
    for (id, _, top) in &toks {
        assert_eq!(top.len(), 3);
        assert_eq!(top[0].id, *id, "greedy picks the most likely token");
        assert!(top.windows(2).all(|w| w[0].logprob >= w[1].logprob));
        assert_eq!(top[0].text, text(&[*id]));
    }
    // min_tokens: the greedy first token as a stop id cannot end it before 3 tokens.
    let first = greedy[0];
    let mut rx = rig.submit_with("m", &prompt, 8, |s| s.output.min_tokens = 3);
    let (plain, _) = drain_tokens(&mut rx);
    assert_eq!(plain[0].0, first);
    let job_stop = |min_tokens| {
        let mut rx = rig.submit_with(&format!("x{min_tokens}"), &prompt, 8, |s| {
            s.stop_ids = vec![first];
            s.output.min_tokens = min_tokens;
        });
        drain_tokens(&mut rx)
    };
    let (toks, last) = job_stop(0);
    assert_eq!((toks.len(), finish_reason(&last)), (1, FinishReason::Stop));
    let (toks, _) = job_stop(3);
    assert!(
        toks.len() >= 3 && toks[..3].iter().all(|t| t.0 != first),
        "{toks:?}"
    );
    rig.wait_pool_empty();
}

/// The CPU backend with a device that can be lost: once `lost` is set, every projection fails
/// as a lost CUDA context does.
#[derive(Debug, Default)]
struct LosableDevice {
    lost: std::sync::atomic::AtomicBool,
    /// Calls refused since.
    refused: std::sync::atomic::AtomicUsize,
}

impl crate::backend::Backend for LosableDevice {
    fn name(&self) -> String {
        "losable".into()
    }

    fn linear(
        &self,
        x: &[f32],
        batch: usize,
        w: &crate::tensor::Tensor,
        bias: Option<&[f32]>,
        y: &mut [f32],
    ) -> Result<(), crate::backend::BackendError> {
        if self.lost.load(std::sync::atomic::Ordering::Acquire) {
            self.refused
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            return Err(crate::backend::BackendError::DeviceLost(
                "sync: CUDA_ERROR_ILLEGAL_ADDRESS".into(),
            ));
        }
        crate::backend::CpuBackend.linear(x, batch, w, bias, y)
    }
}

#[test]
fn a_lost_device_ends_what_runs_and_refuses_what_comes_after() {
    let dev = Arc::new(LosableDevice::default());
    let model = Arc::new(crate::model::load("tiny", dev.clone()).unwrap());
    let rig = Rig::start_on(2, 1 << 30, Some(model));
    let mut a = rig.submit("a", &Rig::prompt(1), 100_000);
    assert!(matches!(a.blocking_recv(), Some(Event::Token { .. })));
    assert!(!rig.engine.load().device_lost);
    dev.lost.store(true, std::sync::atomic::Ordering::Release);
    let (_, last) = drain(&mut a);
    assert!(
        matches!(&last, Event::Error(EngineError::DeviceLost(m)) if m.contains("ILLEGAL_ADDRESS")),
        "{last:?}"
    );
    // Everything after it is refused at once, without touching the device, and says why.
    let mut b = rig.submit("b", &Rig::prompt(2), 4);
    let (ids, last) = drain(&mut b);
    assert!(ids.is_empty());
    assert!(
        matches!(last, Event::Error(EngineError::DeviceLost(_))),
        "{last:?}"
    );
    assert!(rig.engine.load().device_lost);
    let refused = dev.refused.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(
        refused, 1,
        "only the step that found the device lost called it"
    );
    rig.wait_pool_empty();
}

/// A streamed token: id, log-probability, the top list as (id, log-probability).
type Scored = (u32, f32, Vec<(u32, f32)>);

/// Every token event of a stream.
fn drain_scored(rx: &mut mpsc::UnboundedReceiver<Event>) -> Vec<Scored> {
    let mut toks = Vec::new();
    while let Some(ev) = rx.blocking_recv() {
        match ev {
            Event::Token {
                id,
                logprob,
                top_logprobs,
                ..
            } => toks.push((
                id,
                logprob,
                top_logprobs.iter().map(|t| (t.id, t.logprob)).collect(),
            )),
            Event::Finish { .. } => return toks,
            e => panic!("{e:?}"),
        }
    }
    panic!("the stream ended without a last event");
}

/// A batch where the backend picks some rows (greedy with a top list, a seeded draw under
/// top-k and top-p) and the host picks the rest (a repetition penalty, EOS banned under
/// `min_tokens`) streams exactly what the host alone streams: each request's draws are taken
/// in the same order whichever side picks.
#[test]
fn tokens_picked_where_the_logits_are_equal_the_host_picks() {
    let dev = Arc::new(TestDevice {
        picks: true,
        ..TestDevice::default()
    });
    let model = Arc::new(crate::model::load("tiny", dev.clone()).unwrap());
    let host = Rig::start(4, 1 << 30);
    let device = Rig::start_on(4, 1 << 30, Some(model));
    let tunes: [fn(&mut JobSpec); 4] = [
        |s| s.output.top_logprobs = 3,
        |s| {
            s.sampling = Sampling {
                temperature: 0.9,
                top_k: 40,
                top_p: 0.95,
                seed: 7,
                ..Sampling::default()
            };
            s.output.top_logprobs = 2;
        },
        |s| {
            s.sampling = Sampling {
                temperature: 1.1,
                seed: 3,
                repetition_penalty: 1.3,
                ..Sampling::default()
            }
        },
        |s| {
            s.sampling = Sampling {
                temperature: 0.7,
                seed: 11,
                ..Sampling::default()
            };
            s.ignore_eos = false;
            s.output.min_tokens = 4;
        },
    ];
    let run = |rig: &Rig| {
        let mut streams: Vec<_> = tunes
            .iter()
            .enumerate()
            .map(|(i, tune)| rig.submit_with(&format!("r{i}"), &Rig::prompt(i as u32), 12, *tune))
            .collect();
        streams.iter_mut().map(drain_scored).collect::<Vec<_>>()
    };
    let want = run(&host);
    let before = dev.picked.load(std::sync::atomic::Ordering::Relaxed);
    let got = run(&device);
    // Tokens equal; log-probabilities to rounding (how the requests happened to share steps
    // changes the batched projections' summation order).
    let close = |a: f32, b: f32| (a - b).abs() <= 1e-4 * b.abs().max(1.0);
    for (g, w) in got.iter().zip(&want) {
        assert_eq!(g.len(), w.len());
        for (a, b) in g.iter().zip(w) {
            assert_eq!(a.0, b.0, "{got:?}\n{want:?}");
            assert!(close(a.1, b.1), "{a:?} vs {b:?}");
            assert_eq!(a.2.len(), b.2.len());
            for (x, y) in a.2.iter().zip(&b.2) {
                assert!(x.0 == y.0 && close(x.1, y.1), "{a:?} vs {b:?}");
            }
        }
    }
    let picked = dev.picked.load(std::sync::atomic::Ordering::Relaxed) - before;
    // Requests 0 and 1 are picked by the device at every step; 2 (penalty) never, 3 (EOS
    // banned) only after its first 4 tokens.
    let steps = |i: usize| want[i].len().saturating_sub(1);
    assert!(
        picked >= steps(0) + steps(1) && picked <= steps(0) + steps(1) + steps(3),
        "{picked} rows picked on the device"
    );
    host.wait_pool_empty();
    device.wait_pool_empty();
}

/// Device memory for KV that lives on the host: the engine's device path (submit every
/// sequence's part, then collect each) without a GPU. Each part is computed at submit from the
/// blocks the residency table names.
/// With `sketch.on`, it scores blocks for `--block-scorer sketch` as a GPU does, from a sketch
/// of the keys made here (`attention::sketch`), counting the calls (see [`SketchSpy`]).
#[derive(Debug)]
struct HostDeviceKv {
    geom: attention::BlockGeometry,
    collected: Arc<std::sync::atomic::AtomicUsize>,
    sketch: SketchSpy,
    /// Slot counts its sequences were told to hold (`DeviceSeq::set_slots_per_head`),
    /// refused ones too.
    slot_counts: Arc<std::sync::Mutex<Vec<usize>>>,
    /// What it says it holds (`DeviceKv::capacity_bytes`; 0: no limit).
    arena_bytes: u64,
    /// See [`TestDevice::slot_limit`].
    slot_limit: usize,
}

/// A test device's sketch scoring: whether it scores, whether it also queues scores without
/// a wait (`DeviceSeq::queue_sketch_scores`, `queue_sketch_scores_by`), whether it answers a
/// call's picks (`SketchCall::pick`, as a GPU's `top_blocks`; with `wrong_picks`, one too
/// many), and the calls counted: scored when asked, queued, queued ones taken, queued by a
/// resident layer's rows, and answered with picks.
#[derive(Debug, Clone, Default)]
struct SketchSpy {
    on: bool,
    queue: bool,
    picks: bool,
    wrong_picks: bool,
    /// It plans a resident layer alone where every block is on it (`picks_resident`), until
    /// told to stop (`refuse_device_plans`, shared by its sequences).
    alone: Arc<std::sync::atomic::AtomicBool>,
    picked: Arc<std::sync::atomic::AtomicUsize>,
    /// Layers it planned alone whose picks the engine took after the step.
    planned_alone: Arc<std::sync::atomic::AtomicUsize>,
    scored: Arc<std::sync::atomic::AtomicUsize>,
    queued: Arc<std::sync::atomic::AtomicUsize>,
    taken: Arc<std::sync::atomic::AtomicUsize>,
    /// Of the queued, those by the rows a resident layer handed over.
    by_rows: Arc<std::sync::atomic::AtomicUsize>,
}

#[derive(Debug)]
struct HostDeviceSeq {
    geom: attention::BlockGeometry,
    pending: Option<Vec<attention::Partial>>,
    collected: Arc<std::sync::atomic::AtomicUsize>,
    sketch: SketchSpy,
    /// The queued scores and their layer.
    ahead: Option<(usize, crate::backend::Scored)>,
    /// The picks last answered for each layer, for `take_device_picks`.
    made: std::collections::HashMap<usize, Vec<Vec<usize>>>,
    /// Slots per (layer, KV head): a block handed over in a slot past them is refused, as
    /// a GPU's slot table refuses it.
    slots: usize,
    slot_counts: Arc<std::sync::Mutex<Vec<usize>>>,
    slot_limit: usize,
}

impl crate::backend::DeviceKv for HostDeviceKv {
    fn new_seq(
        self: Arc<Self>,
        _num_layers: usize,
        blocks_per_head: usize,
    ) -> Box<dyn crate::backend::DeviceSeq> {
        Box::new(HostDeviceSeq {
            geom: self.geom,
            pending: None,
            collected: self.collected.clone(),
            sketch: self.sketch.clone(),
            ahead: None,
            made: std::collections::HashMap::new(),
            slots: blocks_per_head,
            slot_counts: self.slot_counts.clone(),
            slot_limit: self.slot_limit,
        })
    }

    fn keeps_sketch(&self, _group: usize) -> bool {
        self.sketch.on
    }

    fn capacity_bytes(&self) -> u64 {
        match self.arena_bytes {
            0 => u64::MAX,
            n => n,
        }
    }
}

impl HostDeviceSeq {
    /// Refuses lists with a block in a slot past the sequence's count.
    fn check_slots(
        &self,
        blocks: &[&[attention::DeviceBlock]],
    ) -> Result<(), crate::backend::BackendError> {
        match blocks
            .iter()
            .flat_map(|l| l.iter())
            .find(|b| b.slot as usize >= self.slots)
        {
            Some(b) => Err(crate::backend::BackendError::Unsupported(format!(
                "block {} in slot {} of a sequence with {} slots a head",
                b.block, b.slot, self.slots
            ))),
            None => Ok(()),
        }
    }

    /// `DeviceSeq::sketch_scores` as a GPU computes them, counted nowhere but in `picked`.
    fn sketch_scores_here(
        &self,
        kv: &dyn attention::KvSource,
        q: &[f32],
        call: crate::backend::SketchCall,
    ) -> crate::backend::Scored {
        let crate::backend::SketchCall {
            layer,
            scale,
            how,
            blocks,
            pick,
        } = call;
        use attention::sketch::{nibble_bytes, scores_from_sketch, sketch_tokens};
        let (hk, d, bs) = (
            self.geom.num_kv_heads,
            self.geom.head_dim,
            self.geom.block_size,
        );
        let n = kv.num_tokens();
        let per = q.len() / hk;
        let scores: Vec<Vec<f32>> = (0..hk)
            .map(|h| {
                let mut nib = vec![0u8; n * nibble_bytes(d)];
                let mut scales = vec![0f32; n];
                sketch_tokens(&self.geom, kv, layer, h, 0, n, &mut nib, &mut scales);
                let qg = &q[h * per..(h + 1) * per];
                scores_from_sketch(&nib, &scales, n, bs, d, blocks, qg, scale, how)
            })
            .collect();
        match pick.filter(|_| self.sketch.picks) {
            Some(cut) => {
                self.sketch
                    .picked
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let refs: Vec<&[f32]> = scores.iter().map(Vec::as_slice).collect();
                let mut picks = attention::best_in(&refs, cut);
                if self.sketch.wrong_picks {
                    picks[0].push(cut.to);
                }
                crate::backend::Scored::Picks(picks)
            }
            None => crate::backend::Scored::Scores(scores),
        }
    }
}

impl crate::backend::DeviceSeq for HostDeviceSeq {
    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self
    }

    fn submit(
        &mut self,
        kv: &dyn attention::KvSource,
        layer: usize,
        blocks: &[&[attention::DeviceBlock]],
        q: &[f32],
        scale: f32,
    ) -> Result<(), crate::backend::BackendError> {
        if self.pending.is_some() {
            return Err(crate::backend::BackendError::Unsupported(
                "submitted twice without a collect".into(),
            ));
        }
        self.check_slots(blocks)?;
        let per = q.len() / blocks.len();
        let parts = blocks
            .iter()
            .enumerate()
            .map(|(h, list)| {
                let ids: Vec<usize> = list.iter().map(|d| d.block).collect();
                let hq = attention::HeadQuery {
                    layer,
                    head: h,
                    q: &q[h * per..(h + 1) * per],
                    scale,
                };
                attention::attend_head(&self.geom, kv, hq, &ids, &mut Default::default())
            })
            .collect();
        self.pending = Some(parts);
        Ok(())
    }

    fn collect(&mut self) -> Result<Vec<attention::Partial>, crate::backend::BackendError> {
        self.collected
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.pending
            .take()
            .ok_or_else(|| crate::backend::BackendError::Unsupported("nothing submitted".into()))
    }

    fn recall(
        &mut self,
        _kv: &dyn attention::KvSource,
        _layer: usize,
        blocks: &[&[attention::DeviceBlock]],
    ) -> Result<(), crate::backend::BackendError> {
        self.check_slots(blocks)
    }

    fn set_slots_per_head(
        &mut self,
        blocks_per_head: usize,
    ) -> Result<(), crate::backend::BackendError> {
        if let Ok(mut c) = self.slot_counts.lock() {
            c.push(blocks_per_head);
        }
        if self.slot_limit > 0 && blocks_per_head > self.slot_limit {
            return Err(crate::backend::BackendError::DeviceFull(format!(
                "{blocks_per_head} slots a head, past {}",
                self.slot_limit
            )));
        }
        self.slots = blocks_per_head;
        Ok(())
    }

    fn scores_on_device(&self, _group: usize) -> bool {
        self.sketch.on
    }

    fn sketch_scores(
        &mut self,
        kv: &dyn attention::KvSource,
        q: &[f32],
        call: crate::backend::SketchCall,
    ) -> Result<Option<crate::backend::Scored>, crate::backend::BackendError> {
        if !self.sketch.on {
            return Ok(None);
        }
        self.sketch
            .scored
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let scored = self.sketch_scores_here(kv, q, call);
        if let crate::backend::Scored::Picks(p) = &scored {
            self.made.insert(call.layer, p.clone());
        }
        Ok(Some(scored))
    }

    fn picks_resident(&self, call: &crate::backend::SketchCall) -> bool {
        self.sketch.on
            && self.sketch.picks
            && self.sketch.alone.load(std::sync::atomic::Ordering::Relaxed)
            && call.pick.is_some()
    }

    fn refuse_device_plans(&self) {
        self.sketch
            .alone
            .store(false, std::sync::atomic::Ordering::Relaxed);
    }

    fn take_device_picks(
        &mut self,
        layer: usize,
    ) -> Result<Option<Vec<Vec<usize>>>, crate::backend::BackendError> {
        let made = self.made.remove(&layer);
        if made.is_some() {
            self.sketch
                .planned_alone
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        Ok(made)
    }

    fn queue_sketch_scores(
        &mut self,
        kv: &dyn attention::KvSource,
        q: &[f32],
        call: crate::backend::SketchCall,
    ) -> Result<bool, crate::backend::BackendError> {
        if !(self.sketch.on && self.sketch.queue) {
            return Ok(false);
        }
        self.sketch
            .queued
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let scores = self.sketch_scores_here(kv, q, call);
        self.ahead = Some((call.layer, scores));
        Ok(true)
    }

    fn queue_sketch_scores_by(
        &mut self,
        kv: &dyn attention::KvSource,
        (rows, row): (&dyn std::any::Any, usize),
        call: crate::backend::SketchCall,
    ) -> Result<bool, crate::backend::BackendError> {
        let Some(crate::backend::resident::host::HostQueryRows { q, width }) = rows.downcast_ref()
        else {
            return Ok(false);
        };
        let Some(qb) = q.get(row * width..(row + 1) * width) else {
            return Ok(false);
        };
        if self.sketch.on && self.sketch.queue {
            self.sketch
                .by_rows
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        self.queue_sketch_scores(kv, qb, call)
    }

    fn take_sketch_scores(
        &mut self,
        layer: usize,
    ) -> Result<Option<crate::backend::Scored>, crate::backend::BackendError> {
        match self.ahead.take() {
            Some((l, scores)) if l == layer => {
                self.sketch
                    .taken
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                Ok(Some(scores))
            }
            _ => Ok(None),
        }
    }
}

/// The CPU backend dressed as a device, each part switched on by a test: `picks` picks the LM
/// head's rows where the logits are (by the definition the CUDA kernel meets), `kv` gives it
/// [`HostDeviceKv`] for device memory, and its idle clock advances a millisecond each read.
#[derive(Debug, Default)]
struct TestDevice {
    picks: bool,
    kv: bool,
    /// Layers attend resident ([`ResidentResidual`]) until the start check turns it off.
    resident: std::sync::atomic::AtomicBool,
    /// The resident path attends with twice the softmax scale: wrong, for the start check.
    wrong_resident: bool,
    /// Runs its steps' pieces as graphs until told not to, the resident path wrong while it
    /// does: for the start check.
    wrong_graphs: std::sync::atomic::AtomicBool,
    /// Its device memory scores blocks for `--block-scorer sketch` (see [`HostDeviceKv`]).
    sketch: SketchSpy,
    resident_layers: Arc<std::sync::atomic::AtomicUsize>,
    /// Resident layers that brought their query back, and that merged a CPU part.
    resident_queries: Arc<std::sync::atomic::AtomicUsize>,
    resident_cpu_parts: Arc<std::sync::atomic::AtomicUsize>,
    /// Offers its resident layers a landing for their CPU partials
    /// ([`crate::backend::Residual::cpu_landing`]); the layers that merged one.
    landing: bool,
    resident_landed: Arc<std::sync::atomic::AtomicUsize>,
    picked: Arc<std::sync::atomic::AtomicUsize>,
    collected: Arc<std::sync::atomic::AtomicUsize>,
    idle_reads: std::sync::atomic::AtomicU64,
    graph_reads: std::sync::atomic::AtomicU64,
    /// Slot counts its device memory's sequences were told to hold, refused ones too.
    slot_counts: Arc<std::sync::Mutex<Vec<usize>>>,
    /// What its device memory says it holds (0: no limit).
    arena_bytes: u64,
    /// Most slots per (layer, KV head) a sequence accepts (0: no limit); more is refused.
    slot_limit: usize,
}

impl crate::backend::Backend for TestDevice {
    fn name(&self) -> String {
        "test-device".into()
    }

    fn linear(
        &self,
        x: &[f32],
        batch: usize,
        w: &crate::tensor::Tensor,
        bias: Option<&[f32]>,
        y: &mut [f32],
    ) -> Result<(), crate::backend::BackendError> {
        crate::backend::CpuBackend.linear(x, batch, w, bias, y)
    }

    fn parallel_on_rayon(&self) -> bool {
        // As the CPU backend: the same pool, so the same sums, so the same logits.
        true
    }

    fn residual<'a>(
        &'a self,
        x: Vec<f32>,
        batch: usize,
    ) -> Result<Box<dyn crate::backend::Residual + 'a>, crate::backend::BackendError> {
        let picking = crate::model::pick::PickingResidual {
            inner: crate::backend::HostResidual::new(self, x, batch),
            shift: self.picks.then_some(0),
            picked: self.picked.clone(),
        };
        if !self.attention_on_device() {
            return Ok(Box::new(picking));
        }
        Ok(Box::new(ResidentResidual {
            inner: picking,
            dev: self,
            layers: Default::default(),
        }))
    }

    fn attention_on_device(&self) -> bool {
        self.resident.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn keep_attention_on_host(&self) {
        self.resident
            .store(false, std::sync::atomic::Ordering::Relaxed);
    }

    fn picks_on_device(&self) -> bool {
        self.picks
    }

    fn device_idle_seconds(&self) -> Option<f64> {
        let n = self
            .idle_reads
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Some(n as f64 * 1e-3)
    }

    fn graphs_on(&self) -> bool {
        self.wrong_graphs.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn turn_graphs_off(&self, _why: &str) {
        self.wrong_graphs
            .store(false, std::sync::atomic::Ordering::Relaxed);
    }

    /// Read twice a step: each step replays 3 pieces, captures 1 and queues 2.
    fn graph_stats(&self) -> Option<crate::backend::graphs::GraphStats> {
        let n = self
            .graph_reads
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            .div_ceil(2);
        Some(crate::backend::graphs::GraphStats {
            replays: 3 * n,
            captures: n,
            queued: 2 * n,
            ..Default::default()
        })
    }

    fn device_kv(
        &self,
        geom: attention::BlockGeometry,
        _capacity_bytes: u64,
        _pool: &HostPool,
    ) -> Result<Option<Arc<dyn crate::backend::DeviceKv>>, crate::backend::BackendError> {
        Ok(self.kv.then(|| {
            Arc::new(HostDeviceKv {
                geom,
                collected: self.collected.clone(),
                sketch: self.sketch.clone(),
                slot_counts: self.slot_counts.clone(),
                arena_bytes: self.arena_bytes,
                slot_limit: self.slot_limit,
            }) as Arc<dyn crate::backend::DeviceKv>
        }))
    }
}

/// A residual that runs resident layers through the host calls
/// ([`crate::backend::resident::host::HostLayers`]), counting them.
struct ResidentResidual<'a, R> {
    inner: R,
    dev: &'a TestDevice,
    layers: crate::backend::resident::host::HostLayers,
}

impl<R: crate::backend::Residual> crate::backend::Residual for ResidentResidual<'_, R> {
    fn norm_project(
        &mut self,
        groups: &mut [crate::backend::NormProject<'_, '_>],
    ) -> Result<(), crate::backend::BackendError> {
        self.inner.norm_project(groups)
    }

    fn finish_layer(
        &mut self,
        attn: &[f32],
        w: crate::backend::LayerOut<'_>,
    ) -> Result<(), crate::backend::BackendError> {
        self.inner.finish_layer(attn, w)
    }

    fn lm_head(
        &mut self,
        head: crate::backend::LmHead<'_>,
        picks: &[Option<crate::model::pick::PickSpec>],
    ) -> Result<Vec<crate::model::pick::RowOut>, crate::backend::BackendError> {
        self.inner.lm_head(head, picks)
    }

    fn attends_resident(&self) -> bool {
        true
    }

    fn resident_project(
        &mut self,
        l: &crate::backend::ResidentLayer<'_>,
        next: Option<crate::backend::NextQuery<'_>>,
        bring_back: bool,
        scores: &mut dyn FnMut(&dyn std::any::Any),
    ) -> Result<crate::backend::ResidentQuery, crate::backend::BackendError> {
        self.dev
            .resident_layers
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if bring_back {
            self.dev
                .resident_queries
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        self.layers
            .project(&mut self.inner, self.dev, l, next, bring_back, scores)
    }

    fn resident_attend(
        &mut self,
        l: &crate::backend::ResidentLayer<'_>,
        seqs: &mut [crate::backend::ResidentSeq<'_>],
    ) -> Result<(), crate::backend::BackendError> {
        let wrong = crate::backend::ResidentLayer {
            scale: 2.0 * l.scale,
            ..*l
        };
        let wrong_graphs = self
            .dev
            .wrong_graphs
            .load(std::sync::atomic::Ordering::Relaxed);
        let l = if self.dev.wrong_resident || wrong_graphs {
            &wrong
        } else {
            l
        };
        self.layers.attend(l, seqs)
    }

    fn cpu_landing(
        &mut self,
        l: &crate::backend::ResidentLayer<'_>,
    ) -> Result<Option<Arc<crate::backend::Landing>>, crate::backend::BackendError> {
        if !self.dev.landing {
            return Ok(None);
        }
        let shape = crate::backend::LandingShape::of(l, l.rot.positions());
        let mem = Arc::new(crate::backend::HostLandingMem::new(shape.words()));
        crate::backend::Landing::new(mem, 1, shape).map(Some)
    }

    fn resident_finish(
        &mut self,
        l: &crate::backend::ResidentLayer<'_>,
        cpu: crate::backend::CpuPart<'_>,
    ) -> Result<(), crate::backend::BackendError> {
        let counter = match cpu {
            crate::backend::CpuPart::Ready([]) => None,
            crate::backend::CpuPart::Ready(_) => Some(&self.dev.resident_cpu_parts),
            crate::backend::CpuPart::Landing(_) => Some(&self.dev.resident_landed),
        };
        if let Some(c) = counter {
            c.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        self.layers.finish(&mut self.inner, l, cpu)
    }

    fn resident_kv(
        &mut self,
    ) -> Result<Vec<crate::backend::ResidentKv>, crate::backend::BackendError> {
        Ok(self.layers.take_kv())
    }
}

/// Layers run where the residual is give the greedy tokens of full prefills in every mode:
/// `full` (nothing brought back, no CPU part), `scout` with a budget that leaves blocks to the
/// CPU (its query brought back for planning, the layer-ahead prediction made in the same call,
/// the CPU partials merged where the residual is), and `recall`. The K and V rows they hand
/// back grow the host pool rightly (later steps attend them). A resident path that is wrong
/// is caught by the start check, and the layers then attend through the host.
#[test]
fn layers_run_where_the_residual_is_equal_the_host_path() {
    // A sparse mode on small blocks, so the device holds some of each layer and the CPU the rest.
    let sparse = |mode: &'static str, more: &[&'static str]| -> Vec<&'static str> {
        let mut f = vec![
            "--attention",
            mode,
            "--block-size",
            "8",
            "--budget-tokens",
            "48",
        ];
        // Two blocks a head, and no loan of the spare device KV that would hold them all.
        f.extend(["--device-blocks", "2", "--spare-device-kv", "off"]);
        f.extend(more);
        f
    };
    // (flags, a wrong resident path, CPU partials landed where the residual is)
    let cases: Vec<(Vec<&str>, bool, bool)> = vec![
        (vec!["--attention", "full"], false, false),
        // Every prediction refused: each layer is planned again with the real query.
        (sparse("scout", &["--guard-min-cosine=1"]), false, false),
        (sparse("scout", &["--guard-min-cosine=-1"]), false, false),
        (sparse("recall", &[]), false, false),
        (vec!["--attention", "full"], true, false),
        // The CPU workers land their partials themselves, the layer merging what they landed.
        (sparse("scout", &["--guard-min-cosine=-1"]), false, true),
        (sparse("scout", &["--guard-min-cosine=1"]), false, true),
        (sparse("recall", &[]), false, true),
    ];
    let prompts: Vec<Vec<u32>> = (0..3).map(|i| Rig::prompt(i * 7 + 60)).collect();
    // The same engine with its layers attended through the host.
    let through_host = |flags: &[&str]| -> Vec<Vec<u32>> {
        let dev = Arc::new(TestDevice {
            kv: true,
            ..TestDevice::default()
        });
        greedy_on(dev, flags, &prompts, 6)
    };
    for (flags, wrong, landing) in cases {
        let flags = flags.as_slice();
        let want = through_host(flags);
        let dev = Arc::new(TestDevice {
            kv: true,
            resident: true.into(),
            wrong_resident: wrong,
            landing,
            ..TestDevice::default()
        });
        let model = Arc::new(crate::model::load("tiny", dev.clone()).unwrap());
        let rig = Rig::start_with(3, 1 << 30, Some(model), flags);
        let count =
            |c: &Arc<std::sync::atomic::AtomicUsize>| c.load(std::sync::atomic::Ordering::Relaxed);
        let at_start = [
            count(&dev.resident_layers),
            count(&dev.resident_queries),
            count(&dev.resident_cpu_parts),
            count(&dev.resident_landed),
        ];
        let mut streams: Vec<_> = prompts
            .iter()
            .enumerate()
            .map(|(i, p)| rig.submit(&format!("r{i}"), p, 6))
            .collect();
        for ((p, rx), want) in prompts.iter().zip(&mut streams).zip(&want) {
            let (ids, _) = drain(rx);
            assert_eq!(&ids, want, "{flags:?} wrong={wrong}");
            if flags[1] == "full" {
                assert_eq!(ids, rig.reference(p, 6), "{flags:?} wrong={wrong}");
            }
        }
        let [layers, queries, cpu, landed] = [
            count(&dev.resident_layers) - at_start[0],
            count(&dev.resident_queries) - at_start[1],
            count(&dev.resident_cpu_parts) - at_start[2],
            count(&dev.resident_landed) - at_start[3],
        ];
        let on = crate::backend::Backend::attention_on_device(&*dev);
        let shown = format!("{flags:?} landing={landing}: {layers} {queries} {cpu} {landed}");
        match (flags[1], wrong, landing) {
            ("full", false, _) => assert!(
                on && layers >= 10 && queries == 0 && cpu == 0 && landed == 0,
                "{shown}"
            ),
            (_, false, false) => assert!(
                on && layers >= 10 && queries == layers && cpu > 0 && landed == 0,
                "{shown}"
            ),
            // Every layer with CPU work in flight merges what landed, none a handed list.
            (_, false, true) => assert!(
                on && layers >= 10 && queries == layers && cpu == 0 && landed > 0,
                "{shown}"
            ),
            _ => assert!(!on && layers == 0, "the check turned it off: {on} {layers}"),
        }
        rig.wait_pool_empty();
    }
}

/// Graphs whose resident steps disagree with the host path are turned off at start, and the
/// layers stay resident: the check runs again without them.
#[test]
fn graphs_that_disagree_at_start_go_off_and_layers_stay_resident() {
    let dev = Arc::new(TestDevice {
        kv: true,
        resident: true.into(),
        wrong_graphs: true.into(),
        ..TestDevice::default()
    });
    let model = Arc::new(crate::model::load("tiny", dev.clone()).unwrap());
    let rig = Rig::start_with(3, 1 << 30, Some(model), &["--attention", "full"]);
    let layers = || {
        dev.resident_layers
            .load(std::sync::atomic::Ordering::Relaxed)
    };
    let at_start = layers();
    let p = Rig::prompt(60);
    let (ids, _) = drain(&mut rig.submit("g", &p, 6));
    assert_eq!(ids, rig.reference(&p, 6));
    let b: &dyn crate::backend::Backend = &*dev;
    assert!(!b.graphs_on() && b.attention_on_device());
    assert!(layers() >= at_start + 10, "{} {at_start}", layers());
    rig.wait_pool_empty();
}

/// Spare device KV: a `scout` request alone takes what is spare beside the reserve (one
/// request's share), the next request starts in that reserve without a call-back, the one
/// after takes back just the slots it needs, and they are lent again once it is done. Tokens
/// equal those of the same requests without loans (`--spare-device-kv off`): a loan moves
/// blocks, never the selection.
#[test]
fn spare_device_kv_is_lent_beside_a_reserve_and_shrinks_by_what_a_newcomer_needs() {
    let flags =
        |spare: &'static str| [SMALL_SCOUT.as_slice(), &["--spare-device-kv", spare]].concat();
    let prompts = [Rig::prompt(30), Rig::prompt(31), Rig::prompt(32)];
    // The first long, so it still runs when the others are done; the second long enough to
    // be running when the third arrives however long this thread waits between the two
    // submits on a loaded machine (at 40 tokens, once in a few runs of the lib's tests in
    // parallel it was done first); the two apart, so they end at different steps.
    let max_new = [500u32, 200, 250];
    let geom = attention::BlockGeometry {
        block_size: 8,
        ..Rig::start(1, 1 << 30).layout.geom
    };
    let device = |prompt: &[u32], max_new: u32, per_head: usize| {
        let r = admission::Request {
            geom,
            num_layers: 4,
            num_tokens: prompt.len(),
            prompt_bytes: 0,
            max_new_tokens: max_new,
        };
        Need::of(&r, 32_768, per_head, None).device
    };
    // Each request's share is 2 slots per (layer, KV head); the first's every block takes
    // `whole`. Room for `whole - 1`: alone, the first is lent all but the reserve (2), so
    // it holds `whole - 3`; the second starts in the reserve; the third takes 2 back.
    let whole = geom.blocks_for(prompts[0].len() + max_new[0] as usize + 1);
    let capacity = device(&prompts[0], max_new[0], whole - 1);
    let run = |spare: &'static str, slot_limit: usize| {
        let dev = Arc::new(TestDevice {
            kv: true,
            slot_limit,
            ..TestDevice::default()
        });
        let model = Arc::new(crate::model::load("tiny", dev.clone()).unwrap());
        let rig = Rig::start_with(3, capacity, Some(model), &flags(spare));
        let mut a = rig.submit("a", &prompts[0], max_new[0]);
        let Some(Event::Token { id, .. }) = a.blocking_recv() else {
            panic!("no first token");
        };
        // Two more steps: the load published after the second (the prompt is up by then).
        let mut first = vec![id];
        for _ in 0..2 {
            let Some(Event::Token { id, .. }) = a.blocking_recv() else {
                panic!("no token");
            };
            first.push(id);
        }
        let load = rig.engine.load();
        let held = (load.device_bytes, load.device_lent);
        let mut b = rig.submit("b", &prompts[1], max_new[1]);
        let mut c = rig.submit("c", &prompts[2], max_new[2]);
        let (a_rest, a_end) = drain(&mut a);
        let mut a_ids = first;
        a_ids.extend(a_rest);
        let (b_ids, _) = drain(&mut b);
        let (c_ids, _) = drain(&mut c);
        let Event::Finish { stats, .. } = a_end else {
            panic!("{a_end:?}")
        };
        let counts = dev.slot_counts.lock().unwrap().clone();
        rig.wait_pool_empty();
        let text = rig.metrics.render();
        let loans = |event: &str| {
            let key = format!("decode_node_device_kv_loans_total{{event=\"{event}\"}} ");
            text.lines()
                .find_map(|l| l.strip_prefix(key.as_str()))
                .map_or(0, |n| n.trim().parse::<u64>().unwrap())
        };
        let counts = (counts, loans("lent"), loans("called_back"));
        // The first's tokens while the others run and a while after. Loans change where
        // each block is attended, so the order in which a head's partial sums are added,
        // and the last bits of the attention with it: on this random model a near tie
        // flipped the first's 253rd greedy token in some orders of events.
        a_ids.truncate(150);
        let ids = [a_ids, b_ids, c_ids];
        (ids, stats.cpu_attention_ratio, counts, held)
    };
    let (ids_off, a_cpu_off, counts_off, held_off) = run("off", 0);
    let (ids_on, a_cpu_on, counts_on, held_on) = run("on", 0);
    // GetLoad sees the loan: in use past the share (the prompt is up), that part lent, so
    // not taken to a router, which reads used less lent. Without loans, the share, none lent.
    let share = device(&prompts[0], max_new[0], 2);
    assert_eq!(held_off, (share, 0));
    assert!(
        held_on.0 > share && held_on.0 - held_on.1 == share,
        "{held_on:?} {share}"
    );
    for (ids, n) in ids_on.iter().zip([150, max_new[1], max_new[2]]) {
        assert_eq!(ids.len(), n as usize);
    }
    assert_eq!(ids_on, ids_off);
    assert_eq!(counts_off, (vec![], 0, 0));
    // Lent to the first alone; the second needs no call-back; the third takes 2 slots back;
    // once the others are done, the first is lent them again (the reserve still held). The
    // others' loans would be their own slot counts: none, the reserve being theirs.
    assert_eq!(counts_on, (vec![whole - 3, whole - 5, whole - 3], 2, 1));
    assert!(a_cpu_on < a_cpu_off, "{a_cpu_on} {a_cpu_off}");
    // A device that refuses a loan's slots: each request keeps its share and is asked once
    // (not at every step): the first as above, then the others, each for every block (the
    // room the first could not take), and nothing is counted as lent.
    let (ids_refused, _, counts_refused, held_refused) = run("on", 2);
    assert_eq!(ids_refused, ids_off);
    let whole_of = |i: usize| geom.blocks_for(prompts[i].len() + max_new[i] as usize + 1);
    assert_eq!(
        (counts_refused, held_refused),
        (
            (vec![whole - 3, whole_of(1), whole_of(2)], 0, 0),
            (share, 0)
        )
    );
}

/// With device memory, a step submits every sequence's device part before it collects the
/// first, and each collect gets its own sequence's part: a batch streams the greedy tokens of
/// full prefills, in the dense mode and in scout.
#[test]
fn device_parts_submitted_for_the_whole_batch_give_each_sequence_its_own() {
    for mode in ["full", "scout"] {
        let dev = Arc::new(TestDevice {
            kv: true,
            ..TestDevice::default()
        });
        let model = Arc::new(crate::model::load("tiny", dev.clone()).unwrap());
        let rig = Rig::start_with(3, 1 << 30, Some(model), &["--attention", mode]);
        let prompts: Vec<Vec<u32>> = (0..3).map(|i| Rig::prompt(i * 5)).collect();
        let mut streams: Vec<_> = prompts
            .iter()
            .enumerate()
            .map(|(i, p)| rig.submit(&format!("r{i}"), p, 5))
            .collect();
        for (p, rx) in prompts.iter().zip(&mut streams) {
            let (ids, last) = drain(rx);
            assert_eq!(ids, rig.reference(p, 5), "{mode}");
            // Each step reads the idle clock before and after its forward pass: one
            // millisecond per step the request was in.
            let Event::Finish { stats, .. } = last else {
                panic!("{last:?}")
            };
            let steps = (stats.device_idle_seconds / 1e-3).round() as usize;
            assert!((1..=5).contains(&steps), "{mode}: {stats:?}");
        }
        let collected = dev.collected.load(std::sync::atomic::Ordering::Relaxed);
        assert!(collected > 0, "{mode}: the device path ran");
        rig.wait_pool_empty();
        // What the device's graphs did inside each step, counted by how: this device
        // replays 3 pieces, captures 1 and queues 2 a step.
        let text = rig.metrics.render();
        let value = |key: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(key))
                .map_or(0.0, |n| n.trim().parse::<f64>().unwrap())
        };
        let steps = value("decode_node_step_duration_seconds_count ");
        let how = |h: &str| value(&format!("decode_node_graph_pieces_total{{how=\"{h}\"}} "));
        assert!(steps > 0.0, "{mode}: {text}");
        assert_eq!(
            [how("replayed"), how("captured"), how("queued")],
            [3.0 * steps, steps, 2.0 * steps],
            "{mode}"
        );
    }
}

/// Scout on small blocks: with three requests' worth of prompt, blocks both on the device and
/// left to the CPU.
const SMALL_SCOUT: [&str; 8] = [
    "--attention",
    "scout",
    "--block-size",
    "8",
    "--budget-tokens",
    "48",
    "--device-blocks",
    "2",
];

/// [`SMALL_SCOUT`] with the sketch scorer.
fn sketch_scout() -> Vec<&'static str> {
    [SMALL_SCOUT.as_slice(), &["--block-scorer", "sketch"]].concat()
}

/// Selection scored by the device (`--block-scorer sketch` on a device that keeps the sketch)
/// plans as the host's scores of the same sketch do: the same tokens as a node scoring on the
/// host with the real query only (`--exact`), since a device that scores makes no
/// layer-ahead prediction. Through the host's layers and with layers resident.
#[test]
fn blocks_scored_on_the_device_give_the_host_scores_tokens() {
    let flags = sketch_scout();
    let prompts: Vec<Vec<u32>> = (0..3).map(|i| Rig::prompt(i * 9 + 70)).collect();
    let run = |dev: Arc<TestDevice>, flags: &[&str]| greedy_on(dev, flags, &prompts, 6);
    let mut exact = flags.to_vec();
    exact.push("--exact");
    let host = Arc::new(TestDevice {
        kv: true,
        ..TestDevice::default()
    });
    let want = run(host.clone(), &exact);
    assert_eq!(
        host.sketch
            .scored
            .load(std::sync::atomic::Ordering::Relaxed),
        0
    );
    for resident in [false, true] {
        let dev = Arc::new(TestDevice {
            kv: true,
            sketch: SketchSpy {
                on: true,
                ..SketchSpy::default()
            },
            resident: resident.into(),
            ..TestDevice::default()
        });
        let got = run(dev.clone(), &flags);
        assert_eq!(got, want, "resident {resident}");
        let scored = dev.sketch.scored.load(std::sync::atomic::Ordering::Relaxed);
        // Every sparse layer of every step of every request, at least.
        assert!(
            scored >= 3 * 5,
            "resident {resident}: {scored} device scorings"
        );
        if resident {
            assert!(crate::backend::Backend::attention_on_device(&*dev));
        }
    }
}

/// Device scores queued without a wait (`DeviceSeq::queue_sketch_scores`) and taken when
/// planned give the tokens of scores asked for one wait at a time: every scoring goes through
/// the queue, as many as were asked for. Each sequence of the batch takes its own, with the
/// real query (a GPU's default) and with a layer planned ahead by its predicted query
/// (`--guard-predicted-cpu` makes a device that scores predict; a GPU node plans ahead by
/// default, the test device is told to), whose scores are queued while the device waits for
/// the CPU part. Through resident layers, whose real query is scored by the rows they hand
/// over before those come back, and the host's.
#[test]
fn device_scores_queued_for_the_batch_plan_as_scores_asked_for() {
    let base = sketch_scout();
    let ahead = [
        "--guard-predicted-cpu",
        "--guard-real-query-layers",
        "0",
        "--guard-min-cosine=-1",
        "--layer-ahead",
        "on",
    ];
    let prompts: Vec<Vec<u32>> = (0..3).map(|i| Rig::prompt(i * 9 + 70)).collect();
    let count = |c: &std::sync::atomic::AtomicUsize| c.load(std::sync::atomic::Ordering::Relaxed);
    for predict in [false, true] {
        let mut flags = base.to_vec();
        if predict {
            flags.extend(ahead);
        }
        for resident in [true, false] {
            let device = |queue: bool, picks: bool| sketch_device(queue, picks, resident);
            let (asked, queuing) = (device(false, false), device(true, false));
            let want = greedy_on(asked.clone(), &flags, &prompts, 6);
            let got = greedy_on(queuing.clone(), &flags, &prompts, 6);
            let case = format!("predict {predict}, resident {resident}");
            assert_eq!(got, want, "{case}");
            // A device that picks each head's blocks when asked: the same tokens. It is
            // asked wherever the layer has a cut, unless plans are made ahead (their guard
            // and reselection read every score).
            let picking = device(true, true);
            assert_eq!(
                greedy_on(picking.clone(), &flags, &prompts, 6),
                want,
                "{case}, picks"
            );
            let picked = count(&picking.sketch.picked);
            if predict {
                assert_eq!(picked, 0, "{case}: picks asked for while planning ahead");
            } else {
                assert!(picked >= 3 * 5, "{case}: {picked} picked");
            }
            let scorings = count(&asked.sketch.scored);
            // Every sparse layer of every step of every request, at least.
            assert!(scorings >= 3 * 5, "{case}: {scorings} scorings");
            assert_eq!(count(&queuing.sketch.scored), 0, "{case}: waited for");
            assert_eq!(count(&queuing.sketch.queued), scorings, "{case}: queued");
            assert_eq!(count(&queuing.sketch.taken), scorings, "{case}: taken");
            // A resident layer's real query scored before its rows came back.
            let by_rows = count(&queuing.sketch.by_rows);
            if resident {
                assert!(by_rows >= 3 * 5, "{case}: {by_rows} by the rows");
            } else {
                assert_eq!(by_rows, 0, "{case}");
            }
        }
    }
}

/// A device that answers a sketch call's picks (each head's best blocks, or the layer's with
/// a shared budget: `top_blocks` on a GPU) gives the tokens of one that sends every score
/// back, for a budget split by layer (the default) and by head, waited for and queued.
#[test]
fn device_picks_give_the_tokens_of_scores_sent_back() {
    let prompts: Vec<Vec<u32>> = (0..3).map(|i| Rig::prompt(i * 9 + 70)).collect();
    let count = |c: &std::sync::atomic::AtomicUsize| c.load(std::sync::atomic::Ordering::Relaxed);
    for split in ["layer", "head"] {
        for queue in [false, true] {
            let device = |picks: bool| sketch_device(queue, picks, false);
            let mut flags = sketch_scout();
            flags.extend(["--budget-split", split]);
            let (scores, picks) = (device(false), device(true));
            let want = greedy_on(scores.clone(), &flags, &prompts, 6);
            let got = greedy_on(picks.clone(), &flags, &prompts, 6);
            assert_eq!(got, want, "split {split}, queue {queue}");
            let picked = count(&picks.sketch.picked);
            assert!(picked >= 3 * 5, "split {split}: {picked} picked");
            assert_eq!(count(&scores.sketch.picked), 0);
            // Picks that are not the cut's answer: refused, and the host scores instead.
            let wrong = Arc::new(TestDevice {
                kv: true,
                sketch: SketchSpy {
                    on: true,
                    queue,
                    picks: true,
                    wrong_picks: true,
                    ..SketchSpy::default()
                },
                ..TestDevice::default()
            });
            let got = greedy_on(wrong.clone(), &flags, &prompts, 6);
            assert_eq!(got, want, "split {split}, queue {queue}, wrong picks");
            assert!(count(&wrong.sketch.picked) >= 3 * 5);
        }
    }
}

/// Resident layers a device plans alone (#21 item 4: every block on the device, so its picks
/// go straight into the attention's lists and the query never comes back) give the tokens of
/// the same device planned by the host, for a batch whose requests hold every block on loans
/// of the spare device KV; and once the loans are taken back (`--spare-device-kv off`), the
/// host plans every layer again. The host's bookkeeping from the picks after the step leaves
/// the sequences as the host's own plans do: the next steps agree too.
#[test]
fn layers_a_device_plans_alone_give_the_tokens_of_host_plans() {
    let three: Vec<Vec<u32>> = (0..3).map(|i| Rig::prompt(i * 9 + 70)).collect();
    let count = |c: &std::sync::atomic::AtomicUsize| c.load(std::sync::atomic::Ordering::Relaxed);
    // A request alone (its loans, so its figures, do not depend on when the engine woke),
    // then three.
    for (prompts, spare) in [(&three[..1], "on"), (&three[..], "on"), (&three[..], "off")] {
        let mut flags = sketch_scout();
        flags.extend(["--spare-device-kv", spare]);
        let (host, dev) = (planning_device(false, false), planning_device(true, false));
        // Tokens, and the figures the host's bookkeeping keeps of each request.
        let run = |dev: Arc<TestDevice>| {
            let model = Arc::new(crate::model::load("tiny", dev).unwrap());
            let rig = Rig::start_with(3, 1 << 30, Some(model), &flags);
            let mut streams = rig.submit_together(prompts, 12);
            let out: Vec<_> = streams
                .iter_mut()
                .map(|rx| match drain(rx) {
                    (ids, Event::Finish { stats, .. }) => (
                        ids,
                        stats.cpu_attention_ratio,
                        stats.recalled_blocks,
                        stats.recalled_blocks_used,
                    ),
                    (_, e) => panic!("{e:?}"),
                })
                .collect();
            rig.wait_pool_empty();
            out
        };
        let (want, got) = (run(host.clone()), run(dev.clone()));
        let tokens = |r: &[(Vec<u32>, f64, u64, u64)]| -> Vec<Vec<u32>> {
            r.iter().map(|x| x.0.clone()).collect()
        };
        assert_eq!(tokens(&got), tokens(&want), "spare {spare}");
        if prompts.len() == 1 {
            assert_eq!(got, want, "figures");
        }
        let alone = count(&dev.sketch.planned_alone);
        assert_eq!(count(&host.sketch.planned_alone), 0);
        // Of the resident layers (as many steps as the batch's admissions made), those that
        // brought their query back.
        let [host_q, dev_q] = [&host, &dev]
            .map(|d| count(&d.resident_queries) as f64 / count(&d.resident_layers) as f64);
        if spare == "on" {
            // After the first steps (the prompt going up) most layers plan on the device,
            // and a layer that every request plans there brings no query back.
            assert!(alone >= 3 * 5, "{alone} planned alone");
            assert!(dev_q < host_q, "queries a layer: {dev_q} against {host_q}");
        } else {
            assert_eq!(alone, 0);
        }
    }
}

/// A device that plans layers alone but picks wrong (one block past its cut): the host
/// refuses the picks after the step, and every request of that step ends with an error
/// rather than tokens of an attention over the wrong blocks, its KV given back. The device
/// plans no layer after that: the next requests plan on the host, and their tokens are
/// those of a device that never planned alone.
#[test]
fn wrong_picks_of_a_layer_planned_on_the_device_fail_the_step() {
    let prompts: Vec<Vec<u32>> = (0..2).map(|i| Rig::prompt(i * 9 + 70)).collect();
    let dev = planning_device(true, true);
    let model = Arc::new(crate::model::load("tiny", dev.clone()).unwrap());
    let rig = Rig::start_with(3, 1 << 30, Some(model), &sketch_scout());
    let mut streams = rig.submit_together(&prompts, 12);
    for rx in &mut streams {
        let (ids, last) = drain(rx);
        assert!(
            matches!(last, Event::Error(_)),
            "{} tokens, then {last:?}",
            ids.len()
        );
        assert!(ids.len() < 12);
    }
    rig.wait_pool_empty();
    let count = |c: &std::sync::atomic::AtomicUsize| c.load(std::sync::atomic::Ordering::Relaxed);
    let planned = count(&dev.sketch.planned_alone);
    assert!(planned > 0);
    let mut streams = rig.submit_together(&prompts, 12);
    let got: Vec<Vec<u32>> = streams.iter_mut().map(|rx| drain(rx).0).collect();
    assert_eq!(
        count(&dev.sketch.planned_alone),
        planned,
        "planned alone again"
    );
    let want = greedy_on(planning_device(false, true), &sketch_scout(), &prompts, 12);
    assert_eq!(got, want);
    rig.wait_pool_empty();
}

/// A test device running layers resident that scores with the sketch, queues its scores and
/// picks blocks, planning layers alone where it may (`alone`), its picks wrong (`wrong`: one
/// block past the cut).
fn planning_device(alone: bool, wrong: bool) -> Arc<TestDevice> {
    Arc::new(TestDevice {
        kv: true,
        resident: true.into(),
        sketch: SketchSpy {
            on: true,
            queue: true,
            picks: true,
            alone: Arc::new(alone.into()),
            wrong_picks: wrong,
            ..SketchSpy::default()
        },
        ..TestDevice::default()
    })
}

/// A test device with host KV that scores with the sketch, queuing its scores (`queue`),
/// answering picks (`picks`) and running layers resident as asked.
fn sketch_device(queue: bool, picks: bool, resident: bool) -> Arc<TestDevice> {
    Arc::new(TestDevice {
        kv: true,
        sketch: SketchSpy {
            on: true,
            queue,
            picks,
            ..SketchSpy::default()
        },
        resident: resident.into(),
        ..TestDevice::default()
    })
}

/// The greedy tokens of `prompts` (`n` each, submitted together) on the tiny model over
/// `dev`, with `flags`.
fn greedy_on(dev: Arc<TestDevice>, flags: &[&str], prompts: &[Vec<u32>], n: u32) -> Vec<Vec<u32>> {
    let model = Arc::new(crate::model::load("tiny", dev).unwrap());
    let rig = Rig::start_with(3, 1 << 30, Some(model), flags);
    let mut streams = rig.submit_together(prompts, n);
    let ids = streams.iter_mut().map(|rx| drain(rx).0).collect();
    rig.wait_pool_empty();
    ids
}
