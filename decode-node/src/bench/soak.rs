//! `bench soak`: pushers and generators at a fixed rate for `--duration` (random cancels,
//! killed pushes, orchestrators that go away), and one fault injected every second (a stalled
//! pusher, a bad CRC, a DropKv mid-push, a pusher gone mid-push, a wrong lease, a waiter gone
//! before its push). Every fault must be answered with its gRPC code, the pool must come back
//! to its start byte for byte, and RSS is reported against its start after a warm-up.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::Context;
use decode_node_proto::v1 as pb;
use kv_transfer::client::{PromptKv, PushOptions, push_kv, push_messages};
use serde_json::json;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinSet;
use tonic::Code;
use tonic::transport::Channel;

use super::{model_info, synthetic_kv};
use crate::cli::SoakBench;
use crate::client;
use crate::model::random::SplitMix;
use crate::service::InProcess;

/// How long the soak's node holds unclaimed KV: short, so KV of pushes killed after their
/// commit expires within the run.
const SOAK_LEASE_S: f64 = 2.0;
/// The soak node's push idle timeout: stalled pushers are ended within the run.
const SOAK_PUSH_IDLE_S: f64 = 1.0;
/// One fault per this period.
const FAULT_PERIOD: Duration = Duration::from_secs(1);
/// Failed faults kept verbatim in the report (the count is always exact).
const MAX_FAILURE_TEXTS: usize = 8;

pub(super) fn parse_duration(s: &str) -> anyhow::Result<Duration> {
    let s = s.trim();
    let (num, mult) = if let Some(n) = s.strip_suffix('m') {
        (n, 60.0)
    } else if let Some(n) = s.strip_suffix('s') {
        (n, 1.0)
    } else {
        (s, 1.0)
    };
    let v: f64 = num
        .parse()
        .with_context(|| format!("bad duration {s:?} (use e.g. 90s or 10m)"))?;
    anyhow::ensure!(v > 0.0 && v.is_finite(), "bad duration {s:?}");
    Ok(Duration::from_secs_f64(v * mult))
}

/// Resident bytes after handing the allocator's free memory back to the OS, so that what is
/// compared is memory still in use, not glibc's cached free lists.
fn rss_bytes() -> u64 {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim has no preconditions; it only releases free heap pages.
    unsafe {
        libc::malloc_trim(0);
    }
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| {
            s.split_whitespace()
                .nth(1)
                .and_then(|x| x.parse::<u64>().ok())
        })
        .map_or(0, |p| p * 4096)
}

/// Latencies in log-spaced buckets (10 us .. 100 s, ~2% wide): fixed memory, ~2% quantiles.
#[derive(Debug, Clone)]
struct LogHistogram {
    counts: Vec<u64>,
}

impl Default for LogHistogram {
    fn default() -> Self {
        Self {
            counts: vec![0; Self::BUCKETS],
        }
    }
}

impl LogHistogram {
    const BUCKETS: usize = 800;
    const LO: f64 = 1e-5;
    const PER_DECADE: f64 = 114.0;

    fn add(&mut self, s: f64) {
        let i = ((s.max(Self::LO) / Self::LO).log10() * Self::PER_DECADE) as usize;
        self.counts[i.min(Self::BUCKETS - 1)] += 1;
    }

    fn quantile(&self, q: f64) -> f64 {
        let n: u64 = self.counts.iter().sum();
        if n == 0 {
            return 0.0;
        }
        let want = ((n - 1) as f64 * q).round() as u64;
        let mut seen = 0;
        for (i, c) in self.counts.iter().enumerate() {
            seen += c;
            if seen > want {
                return Self::LO * 10f64.powf((i as f64 + 0.5) / Self::PER_DECADE);
            }
        }
        Self::LO * 10f64.powf(Self::BUCKETS as f64 / Self::PER_DECADE)
    }
}

/// Running totals of a soak, fixed in size: the bench's own memory does not grow with the run,
/// so the RSS comparison sees only the node.
#[derive(Debug, Default)]
struct SoakTally {
    requests: u64,
    by_code: BTreeMap<&'static str, u64>,
    ttft: LogHistogram,
    itl: LogHistogram,
    faults: BTreeMap<&'static str, u64>,
    faults_failed: u64,
    failures: Vec<String>,
}

impl SoakTally {
    fn add(&mut self, o: SoakOutcome) {
        self.requests += 1;
        *self.by_code.entry(o.code).or_default() += 1;
        if let Some(t) = o.ttft {
            self.ttft.add(t);
        }
        o.itl.iter().for_each(|t| self.itl.add(*t));
    }

    fn add_fault(&mut self, (fault, result): (Fault, Result<(), String>)) {
        *self.faults.entry(fault.name()).or_default() += 1;
        if let Err(why) = result {
            self.faults_failed += 1;
            if self.failures.len() < MAX_FAILURE_TEXTS {
                self.failures.push(format!("{}: {why}", fault.name()));
            }
        }
    }
}

/// What one soak request ended as.
#[derive(Debug, Default)]
struct SoakOutcome {
    code: &'static str,
    ttft: Option<f64>,
    itl: Vec<f64>,
}

impl SoakOutcome {
    fn code(code: &'static str) -> Self {
        Self {
            code,
            ..Default::default()
        }
    }
}

fn no_retries() -> PushOptions {
    PushOptions {
        retries: 0,
        ..Default::default()
    }
}

fn generate_request(id: &str, lease: &str, max_new_tokens: u32, seed: u64) -> pb::GenerateRequest {
    pb::GenerateRequest {
        request_id: id.to_string(),
        sampling: Some(pb::SamplingParams {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            seed,
            ..Default::default()
        }),
        max_new_tokens,
        ignore_eos: true,
        kv_timeout_ms: 5_000,
        lease: lease.to_string(),
        ..Default::default()
    }
}

/// One soak request: push, then generate under the push's lease; some are cancelled, some
/// pushes are killed, some orchestrators go away mid-stream.
async fn soak_one(target: String, info: pb::ModelInfo, i: u64) -> SoakOutcome {
    let mut r = SplitMix(i ^ 0xABCD);
    let ctx = 16 + (r.next_u64() % 240) as usize;
    let id = format!("soak-{i}");
    let kv = synthetic_kv(&info, &id, ctx, i);
    let fate = r.next_u64() % 10;
    let Ok(ch) = client::connect(&target).await else {
        return SoakOutcome::code("unavailable");
    };
    if fate == 0 {
        // A prefill node that dies mid-push: the push task is killed after it started.
        let ch2 = ch.clone();
        let kv2 = kv.clone();
        let t = tokio::spawn(async move { client::push(ch2, &kv2, None, |_| {}).await });
        tokio::time::sleep(Duration::from_micros(200)).await;
        t.abort();
        return SoakOutcome::code("killed_push");
    }
    let ack = match push_kv(ch.clone(), &kv, &no_retries(), |_| {}).await {
        Ok(a) => a,
        Err(e) => return SoakOutcome::code(kv_transfer::code_label(e.code())),
    };
    let req = generate_request(&id, &ack.lease, 8 + (r.next_u64() % 56) as u32, i);
    let start = Instant::now();
    let mut dc = client::decode_client(ch.clone(), None);
    let mut stream = match dc.generate(req).await {
        Ok(s) => s.into_inner(),
        Err(e) => return SoakOutcome::code(kv_transfer::code_label(e.code())),
    };
    let mut out = SoakOutcome::code("ok");
    let mut last = start;
    let mut n = 0;
    loop {
        match stream.message().await {
            Ok(Some(m)) => match m.event {
                Some(pb::generate_response::Event::Token(_)) => {
                    let now = Instant::now();
                    if out.ttft.is_none() {
                        out.ttft = Some(now.duration_since(start).as_secs_f64());
                    } else {
                        out.itl.push(now.duration_since(last).as_secs_f64());
                    }
                    last = now;
                    n += 1;
                    if fate == 1 && n == 3 {
                        let _ = dc
                            .cancel(pb::CancelRequest {
                                request_id: id.clone(),
                                lease: ack.lease.clone(),
                            })
                            .await;
                        out.code = "cancelled";
                    }
                    if fate == 2 && n == 2 {
                        // An orchestrator that goes away mid-stream.
                        out.code = "disconnected";
                        return out;
                    }
                }
                Some(pb::generate_response::Event::Finish(_)) => return out,
                None => {}
            },
            Ok(None) => return out,
            Err(e) => {
                out.code = kv_transfer::code_label(e.code());
                return out;
            }
        }
    }
}

/// The faults, injected in turn.
#[derive(Debug, Clone, Copy)]
enum Fault {
    /// A header and one chunk, then silence with the stream open: the idle timeout ends it.
    StalledPush,
    /// A chunk whose CRC-32C does not match its bytes.
    BadCrc,
    /// DropKv on a push in flight: the push ends ABORTED, DropKv says it freed something.
    DropMidPush,
    /// A prefill client that goes away after its first chunk.
    PusherGone,
    /// A Generate with another push's lease: refused, the KV stays for its holder.
    WrongLease,
    /// A Generate that waits for KV and goes away before it arrives; the id's real Generate
    /// then streams.
    WaiterGone,
}

const FAULTS: [Fault; 6] = [
    Fault::StalledPush,
    Fault::BadCrc,
    Fault::DropMidPush,
    Fault::PusherGone,
    Fault::WrongLease,
    Fault::WaiterGone,
];

impl Fault {
    fn name(self) -> &'static str {
        match self {
            Fault::StalledPush => "stalled_push",
            Fault::BadCrc => "bad_crc",
            Fault::DropMidPush => "drop_mid_push",
            Fault::PusherGone => "pusher_gone",
            Fault::WrongLease => "wrong_lease",
            Fault::WaiterGone => "waiter_gone",
        }
    }
}

/// A push sent message by message; the call runs on a task. The first ack's lease arrives on
/// `lease`, the call's final code from `done`.
struct RawPush {
    tx: mpsc::Sender<pb::PushKvRequest>,
    lease: oneshot::Receiver<String>,
    done: tokio::task::JoinHandle<Code>,
}

impl RawPush {
    fn start(ch: Channel) -> Self {
        let (tx, rx) = mpsc::channel(64);
        let (lease_tx, lease) = oneshot::channel();
        let done = tokio::spawn(async move {
            let mut c = pb::kv_transfer_client::KvTransferClient::new(ch);
            let mut st = match c
                .push_kv(tokio_stream::wrappers::ReceiverStream::new(rx))
                .await
            {
                Ok(r) => r.into_inner(),
                Err(e) => return e.code(),
            };
            let mut lease_tx = Some(lease_tx);
            loop {
                match st.message().await {
                    Ok(Some(ack)) => {
                        if let Some(t) = lease_tx.take() {
                            let _ = t.send(ack.lease);
                        }
                    }
                    Ok(None) => return Code::Ok,
                    Err(e) => return e.code(),
                }
            }
        });
        Self { tx, lease, done }
    }

    async fn send(&self, msgs: impl IntoIterator<Item = pb::PushKvRequest>) -> Result<(), String> {
        for m in msgs {
            self.tx
                .send(m)
                .await
                .map_err(|_| "the push call ended early".to_string())?;
        }
        Ok(())
    }

    async fn lease(&mut self) -> Result<String, String> {
        within(Duration::from_secs(5), &mut self.lease)
            .await?
            .map_err(|_| "the push ended before its first ack".to_string())
    }

    async fn code(self, limit: Duration) -> Result<Code, String> {
        within(limit, self.done)
            .await?
            .map_err(|e| format!("push task: {e}"))
    }
}

async fn within<F: std::future::IntoFuture>(limit: Duration, f: F) -> Result<F::Output, String> {
    tokio::time::timeout(limit, f)
        .await
        .map_err(|_| format!("no answer within {limit:?}"))
}

fn expect_code(what: &str, got: Code, want: Code) -> Result<(), String> {
    if got == want {
        Ok(())
    } else {
        Err(format!("{what}: {got:?}, expected {want:?}"))
    }
}

/// Injects `fault` on its own request id: Ok when the node answered as it must.
async fn inject(
    fault: Fault,
    target: String,
    info: pb::ModelInfo,
    n: u64,
) -> (Fault, Result<(), String>) {
    let result = inject_inner(fault, &target, &info, n).await;
    (fault, result)
}

async fn inject_inner(
    fault: Fault,
    target: &str,
    info: &pb::ModelInfo,
    n: u64,
) -> Result<(), String> {
    let id = format!("fault-{n}-{}", fault.name());
    let kv: PromptKv = synthetic_kv(info, &id, 64, n ^ 0xFA17);
    let mut msgs = push_messages(&kv, 16).into_iter();
    let ch = client::connect(target)
        .await
        .map_err(|e| format!("connect: {e:#}"))?;
    let mut kc = pb::kv_transfer_client::KvTransferClient::new(ch.clone());
    let mut dc = client::decode_client(ch.clone(), None);
    let idle = Duration::from_secs_f64(SOAK_PUSH_IDLE_S);
    match fault {
        Fault::StalledPush => {
            let p = RawPush::start(ch);
            p.send(msgs.by_ref().take(2)).await?;
            let tx = p.tx.clone();
            let code = p.code(idle + Duration::from_secs(5)).await?;
            drop(tx);
            expect_code("stalled push", code, Code::DeadlineExceeded)
        }
        Fault::BadCrc => {
            let mut all: Vec<_> = msgs.collect();
            if let Some(pb::push_kv_request::Item::Chunk(c)) =
                all.get_mut(2).and_then(|m| m.item.as_mut())
            {
                c.crc32c ^= 1;
            }
            let p = RawPush::start(ch);
            // The node ends the call at the bad chunk; later sends may find it gone.
            let _ = p.send(all).await;
            let code = p.code(Duration::from_secs(10)).await?;
            expect_code("bad CRC", code, Code::InvalidArgument)
        }
        Fault::DropMidPush => {
            let mut p = RawPush::start(ch);
            p.send(msgs.by_ref().take(2)).await?;
            let lease = p.lease().await?;
            let r = kc
                .drop_kv(pb::DropKvRequest {
                    request_id: id.clone(),
                    lease,
                })
                .await
                .map_err(|e| format!("DropKv: {:?} {}", e.code(), e.message()))?
                .into_inner();
            if !r.dropped || r.bytes_freed == 0 {
                return Err(format!("DropKv mid-push freed nothing: {r:?}"));
            }
            expect_code(
                "dropped push",
                p.code(Duration::from_secs(5)).await?,
                Code::Aborted,
            )
        }
        Fault::PusherGone => {
            let mut p = RawPush::start(ch);
            p.send(msgs.by_ref().take(2)).await?;
            p.lease().await?;
            p.done.abort();
            drop(p.tx);
            Ok(())
        }
        Fault::WrongLease => {
            let ack = push_kv(ch.clone(), &kv, &no_retries(), |_| {})
                .await
                .map_err(|e| format!("push: {:?} {}", e.code(), e.message()))?;
            let wrong = "0".repeat(ack.lease.len().max(1));
            let code = match dc.generate(generate_request(&id, &wrong, 4, n)).await {
                Ok(mut s) => match s.get_mut().message().await {
                    Ok(_) => Code::Ok,
                    Err(e) => e.code(),
                },
                Err(e) => e.code(),
            };
            expect_code("Generate with a wrong lease", code, Code::PermissionDenied)?;
            let r = kc
                .drop_kv(pb::DropKvRequest {
                    request_id: id.clone(),
                    lease: ack.lease,
                })
                .await
                .map_err(|e| format!("DropKv: {:?} {}", e.code(), e.message()))?
                .into_inner();
            if r.dropped {
                Ok(())
            } else {
                Err("the KV was gone after a wrong lease was refused".into())
            }
        }
        Fault::WaiterGone => {
            let mut waiter_dc = dc.clone();
            let waiter_req = generate_request(&id, "", 4, n);
            let waiter = tokio::spawn(async move {
                if let Ok(mut s) = waiter_dc.generate(waiter_req).await {
                    while let Ok(Some(_)) = s.get_mut().message().await {}
                }
            });
            tokio::time::sleep(Duration::from_millis(50)).await;
            waiter.abort();
            let _ = waiter.await;
            let ack = push_kv(ch.clone(), &kv, &no_retries(), |_| {})
                .await
                .map_err(|e| format!("push after a waiter left: {:?} {}", e.code(), e.message()))?;
            let mut s = dc
                .generate(generate_request(&id, &ack.lease, 4, n))
                .await
                .map_err(|e| {
                    format!(
                        "Generate after a waiter left: {:?} {}",
                        e.code(),
                        e.message()
                    )
                })?
                .into_inner();
            let mut tokens = 0;
            loop {
                match s.message().await {
                    Ok(Some(m)) => {
                        if let Some(pb::generate_response::Event::Token(_)) = m.event {
                            tokens += 1;
                        }
                    }
                    Ok(None) => break,
                    Err(e) => {
                        return Err(format!(
                            "Generate after a waiter left: {:?} {}",
                            e.code(),
                            e.message()
                        ));
                    }
                }
            }
            if tokens == 4 {
                Ok(())
            } else {
                Err(format!("{tokens} tokens after a waiter left, expected 4"))
            }
        }
    }
}

/// The soak: see the module's doc.
pub(super) async fn soak(args: &SoakBench) -> anyhow::Result<serde_json::Value> {
    let duration = parse_duration(&args.duration)?;
    let mut sa = InProcess::loopback_args(args.common.model.clone(), 512 << 20, 256 << 20);
    sa.max_batch = 32;
    sa.kv_lease = SOAK_LEASE_S;
    sa.host_kv_prefault = true;
    sa.push_idle_timeout = SOAK_PUSH_IDLE_S;
    sa.require_lease = true;
    let node = InProcess::start(sa)
        .await
        .context("the soak's node did not start")?;
    let target = node.target();
    let info = model_info(&target).await?;
    let ch = client::connect(&target).await?;
    let mut dc = client::decode_client(ch, None);
    let load0 = dc.get_load(pb::GetLoadRequest {}).await?.into_inner();
    let period = Duration::from_secs_f64(1.0 / args.rate.max(0.1));
    // Warm up at the same rate, faults included (connections, allocator arenas, buffers reach
    // their working size), then take the baseline RSS.
    let warmup = (duration / 10).clamp(FAULT_PERIOD * 3, Duration::from_secs(30));
    let mut warm = JoinSet::new();
    let mut warm_faults = JoinSet::new();
    let w0 = Instant::now();
    let mut w = 0u64;
    let requests_per_fault = (FAULT_PERIOD.as_secs_f64() / period.as_secs_f64())
        .ceil()
        .max(1.0) as u64;
    while w0.elapsed() < warmup {
        warm.spawn(soak_one(target.clone(), info.clone(), u64::MAX - w));
        if w.is_multiple_of(requests_per_fault) {
            let f = FAULTS[(w as usize) % FAULTS.len()];
            warm_faults.spawn(inject(f, target.clone(), info.clone(), u64::MAX - w));
        }
        w += 1;
        tokio::time::sleep(period).await;
    }
    while warm.join_next().await.is_some() {}
    let mut warm_tally = SoakTally::default();
    while let Some(r) = warm_faults.join_next().await {
        warm_tally.add_fault(r?);
    }
    let rss0 = rss_bytes();

    let started = Instant::now();
    let mut tick = tokio::time::interval(period);
    let mut next_fault = started;
    let mut tasks = JoinSet::new();
    let mut faults = JoinSet::new();
    let mut i = 0u64;
    let mut f = 0u64;
    let mut tally = SoakTally::default();
    while started.elapsed() < duration {
        tick.tick().await;
        tasks.spawn(soak_one(target.clone(), info.clone(), i));
        i += 1;
        if Instant::now() >= next_fault {
            let fault = FAULTS[(f as usize) % FAULTS.len()];
            faults.spawn(inject(fault, target.clone(), info.clone(), f));
            f += 1;
            next_fault += FAULT_PERIOD;
        }
        while let Some(r) = tasks.try_join_next() {
            tally.add(r?);
        }
        while let Some(r) = faults.try_join_next() {
            tally.add_fault(r?);
        }
    }
    while let Some(r) = tasks.join_next().await {
        tally.add(r?);
    }
    while let Some(r) = faults.join_next().await {
        tally.add_fault(r?);
    }
    // Killed pushes and abandoned streams are cleaned up asynchronously, and a push killed
    // after its commit leaves KV held for its claim, as it should: wait that out.
    let mut load1 = dc.get_load(pb::GetLoadRequest {}).await?.into_inner();
    let settle = Instant::now();
    while (load1.host_kv_bytes_used != load0.host_kv_bytes_used
        || load1.running + load1.waiting > 0)
        && settle.elapsed() < Duration::from_secs_f64(SOAK_LEASE_S + SOAK_PUSH_IDLE_S + 10.0)
    {
        tokio::time::sleep(Duration::from_millis(100)).await;
        load1 = dc.get_load(pb::GetLoadRequest {}).await?.into_inner();
    }
    let rss1 = rss_bytes();
    node.stop().await?;
    let SoakTally {
        requests,
        by_code,
        ttft,
        itl,
        faults,
        faults_failed,
        failures,
    } = tally;
    let injected: u64 = faults.values().sum();
    let leaked = load1.host_kv_bytes_used as i64 - load0.host_kv_bytes_used as i64;
    let report = json!({
        "bench": "soak", "seconds": started.elapsed().as_secs_f64(), "requests": requests,
        "outcomes": by_code,
        "faults_injected": injected, "faults": faults, "faults_failed": faults_failed,
        "fault_failures": failures,
        "warmup_faults_failed": warm_tally.faults_failed, "warmup_fault_failures": warm_tally.failures,
        "ttft_p50_s": ttft.quantile(0.5), "ttft_p99_s": ttft.quantile(0.99),
        "itl_p50_s": itl.quantile(0.5), "itl_p99_s": itl.quantile(0.99),
        "warmup_s": warmup.as_secs_f64(), "rss_start_bytes": rss0, "rss_end_bytes": rss1,
        "rss_growth_bytes": rss1 as i64 - rss0 as i64,
        "pool_used_start_bytes": load0.host_kv_bytes_used, "pool_used_end_bytes": load1.host_kv_bytes_used,
        "pool_leaked_bytes": leaked, "pool_returned": leaked == 0,
        "running_end": load1.running, "waiting_end": load1.waiting,
    });
    if !args.common.json {
        eprintln!(
            "soak: {requests} requests in {:.0}s, outcomes {by_code:?}; {injected} faults, {faults_failed} answered wrongly",
            started.elapsed().as_secs_f64()
        );
        eprintln!(
            "soak: pool used {} -> {} bytes; RSS {:.1} -> {:.1} MiB",
            load0.host_kv_bytes_used,
            load1.host_kv_bytes_used,
            rss0 as f64 / 1048576.0,
            rss1 as f64 / 1048576.0
        );
    }
    anyhow::ensure!(
        leaked == 0,
        "the pool did not return to its start: {report}"
    );
    anyhow::ensure!(
        faults_failed == 0 && warm_tally.faults_failed == 0,
        "faults were answered wrongly: {report}"
    );
    anyhow::ensure!(
        load1.running + load1.waiting == 0,
        "requests still running after the soak: {report}"
    );
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_histogram_quantiles_within_two_percent() {
        let mut h = LogHistogram::default();
        for i in 1..=1000 {
            h.add(i as f64 * 1e-3);
        }
        for (q, want) in [(0.5, 0.5005), (0.99, 0.99), (0.0, 0.001)] {
            let got = h.quantile(q);
            assert!((got - want).abs() <= 0.025 * want, "q{q}: {got} vs {want}");
        }
        assert_eq!(LogHistogram::default().quantile(0.5), 0.0);
        h.add(1e9);
        h.add(0.0);
    }

    #[test]
    fn durations_parse() {
        assert_eq!(parse_duration("10m").unwrap(), Duration::from_secs(600));
        assert_eq!(parse_duration("90s").unwrap(), Duration::from_secs(90));
        assert!(parse_duration("soon").is_err());
        assert!(parse_duration("-1s").is_err());
    }
}
