//! Prometheus metrics: every `decode_node_*` name of the design card, plus process metrics.
//!
//! Handles are cheap clones of shared atomics; the engine and the services update them, and
//! [`Metrics::render`] refreshes the gauges that are read from state (pool bytes, process)
//! before encoding the text format.

use std::collections::VecDeque;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use kv_transfer::IngestMetrics;

/// What this node serves (the labels of `decode_node_model_info`).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModelInfoLabels {
    /// The model's id (what KV pushes must name).
    pub model_id: String,
    /// The name routers and dashboards know it by (`--served-model-name`).
    pub served_model_name: String,
    /// `scout`, `full`, `hgca` or `recall`.
    pub attention: String,
    /// `cpu` or `cuda:N`.
    pub device: String,
}

/// `outcome` label.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabel {
    /// `stop`, `length`, `eos`, `cancelled`, `error`, …
    pub outcome: String,
}

/// `reason` label.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    /// `client`, `disconnect`, `drain`, …
    pub reason: String,
}

/// `state` label.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StateLabel {
    /// `used`, `reserved`, `capacity`.
    pub state: &'static str,
}

/// `event` label.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EventLabel {
    /// `lent`, `called_back`.
    pub event: &'static str,
}

/// `how` label of a step piece's run.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct HowLabel {
    /// `replayed`, `captured`, `queued`.
    pub how: &'static str,
}

/// `layer` label (a model layer's index).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LayerLabel {
    /// Layer index.
    pub layer: u32,
}

/// Cosine buckets for the layer-ahead prediction: fine where the guard decides (0.8-1).
const COSINE_BUCKETS: [f64; 12] = [
    0.0, 0.25, 0.5, 0.7, 0.8, 0.85, 0.9, 0.925, 0.95, 0.975, 0.99, 1.0,
];

type FloatCounter = Counter<f64, AtomicU64>;
type FloatGauge = Gauge<f64, AtomicU64>;

/// vLLM's TTFT buckets (seconds).
const TTFT_BUCKETS: [f64; 17] = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0,
];
/// vLLM's inter-token latency buckets (seconds), and past 1 s: a large batch or a model
/// on the CPU backend can take longer per token.
const ITL_BUCKETS: [f64; 18] = [
    0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0,
    2.5, 5.0, 10.0,
];
/// Request-level latency buckets (seconds).
const E2E_BUCKETS: [f64; 14] = [
    0.01, 0.05, 0.1, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0,
];

/// How far back the ratio gauges look: a ratio since start would hide today's load behind
/// last week's.
const RATIO_WINDOW: Duration = Duration::from_secs(60);

/// Marks of the attention counters, at most one a second, spanning [`RATIO_WINDOW`]: the
/// ratio gauges are taken over the counts since the oldest mark still needed.
#[derive(Debug, Default)]
struct RatioWindow {
    marks: VecDeque<(Instant, [u64; 4])>,
}

impl RatioWindow {
    /// The counts of the last window: `totals` less the mark at its start. `before` (the
    /// totals before this update) becomes a mark when the newest is a second old.
    fn since(&mut self, now: Instant, before: [u64; 4], totals: [u64; 4]) -> [u64; 4] {
        let second = Duration::from_secs(1);
        if self
            .marks
            .back()
            .is_none_or(|(t, _)| now.saturating_duration_since(*t) >= second)
        {
            self.marks.push_back((now, before));
        }
        // The front stays the newest mark at least a window old.
        while self
            .marks
            .get(1)
            .is_some_and(|(t, _)| now.saturating_duration_since(*t) >= RATIO_WINDOW)
        {
            self.marks.pop_front();
        }
        let base = self.marks.front().map_or([0; 4], |m| m.1);
        std::array::from_fn(|i| totals[i].saturating_sub(base[i]))
    }
}

/// All metric handles.
#[derive(Debug, Clone)]
pub struct Metrics {
    /// Finished requests by outcome.
    pub requests: Family<OutcomeLabel, Counter>,
    /// Generate arrival → first token.
    pub ttft: Histogram,
    /// Between consecutive tokens of a request.
    pub itl: Histogram,
    /// Generate arrival → finish.
    pub e2e: Histogram,
    /// Waiting in the engine queue before admission.
    pub queue_time: Histogram,
    /// Tokens generated.
    pub generation_tokens: Counter,
    /// Prompt tokens of the requests admitted to decode.
    pub prompt_tokens: Counter,
    /// 1, labelled with what this node serves.
    pub model_info: Family<ModelInfoLabels, Gauge>,
    /// Requests decoding.
    pub running: Gauge,
    /// Requests admitted to the engine queue but not yet decoding.
    pub waiting: Gauge,
    /// Requests in the last step's batch.
    pub batch_size: Gauge,
    /// Cancellations by reason.
    pub cancellations: Family<ReasonLabel, Counter>,
    /// Host pool bytes by state.
    pub host_kv_bytes: Family<StateLabel, Gauge>,
    /// The fuller of the host pool (used + reserved) and the device KV, as a fraction: what
    /// a router's endpoint picker reads as KV-cache utilization.
    pub kv_cache_usage: FloatGauge,
    /// Device KV bytes by state.
    pub device_kv_bytes: Family<StateLabel, Gauge>,
    /// 1 when the host pool could not be page-locked for the device, so copies are staged.
    pub device_kv_copies_staged: Gauge,
    /// Loans of spare device KV by event: lent, called back.
    pub device_kv_loans: Family<EventLabel, Counter>,
    /// Share of selected tokens attended on the CPU (last minute; totals in the counters).
    pub attention_cpu_ratio: FloatGauge,
    /// Blocks recalled host → device.
    pub recall_blocks: Counter,
    /// Bytes recalled.
    pub recall_bytes: Counter,
    /// Recalled blocks that their layer selected at its next step.
    pub recall_used_blocks: Counter,
    /// Seconds the device side waited on CPU attention results.
    pub device_wait_seconds: FloatCounter,
    /// Seconds the device had nothing queued during decode steps (device backends).
    pub device_idle_seconds: FloatCounter,
    /// Step pieces run through CUDA graphs, by how.
    pub graph_pieces: Family<HowLabel, Counter>,
    /// Seconds per decode step.
    pub step_duration: Histogram,
    /// Share of the real selection found by the predicted query (over the last minute).
    pub query_prediction_hit_ratio: FloatGauge,
    /// Cosine of predicted and real query per layer (the lowest over its KV heads).
    pub query_cosine: Family<LayerLabel, Histogram>,
    /// Layers whose layer-ahead CPU part the guard redid with the real query.
    pub guard_fallbacks: Family<LayerLabel, Counter>,
    /// Ingest metrics (kv-transfer).
    pub ingest: IngestMetrics,
    /// KV tokens selected for attention in sparse modes.
    pub selected_tokens: Counter,
    /// Of those, tokens attended on the CPU.
    pub cpu_tokens: Counter,
    /// Blocks of the real selection the predicted query found.
    pub prediction_hits: Counter,
    /// Blocks of the real selection, where the prediction was sampled.
    pub predictions: Counter,
    ratio_window: Arc<Mutex<RatioWindow>>,
    process_rss: Gauge,
    process_cpu: FloatCounter,
    process_fds: Gauge,
    process_start: FloatGauge,
    registry: Arc<Registry>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

fn hist(b: &[f64]) -> Histogram {
    Histogram::new(b.iter().copied())
}

impl Metrics {
    /// Creates and registers every metric.
    pub fn new() -> Self {
        let mut root = Registry::default();
        let m = Self {
            requests: Family::default(),
            ttft: hist(&TTFT_BUCKETS),
            itl: hist(&ITL_BUCKETS),
            e2e: hist(&E2E_BUCKETS),
            queue_time: hist(&E2E_BUCKETS),
            generation_tokens: Counter::default(),
            prompt_tokens: Counter::default(),
            model_info: Family::default(),
            running: Gauge::default(),
            waiting: Gauge::default(),
            batch_size: Gauge::default(),
            cancellations: Family::default(),
            host_kv_bytes: Family::default(),
            kv_cache_usage: FloatGauge::default(),
            device_kv_bytes: Family::default(),
            device_kv_copies_staged: Gauge::default(),
            device_kv_loans: Family::default(),
            attention_cpu_ratio: FloatGauge::default(),
            recall_blocks: Counter::default(),
            recall_bytes: Counter::default(),
            recall_used_blocks: Counter::default(),
            device_wait_seconds: FloatCounter::default(),
            device_idle_seconds: FloatCounter::default(),
            graph_pieces: Family::default(),
            step_duration: hist(&ITL_BUCKETS),
            query_prediction_hit_ratio: FloatGauge::default(),
            query_cosine: Family::new_with_constructor(|| hist(&COSINE_BUCKETS)),
            guard_fallbacks: Family::default(),
            ingest: IngestMetrics::default(),
            selected_tokens: Counter::default(),
            cpu_tokens: Counter::default(),
            prediction_hits: Counter::default(),
            predictions: Counter::default(),
            ratio_window: Arc::default(),
            process_rss: Gauge::default(),
            process_cpu: FloatCounter::default(),
            process_fds: Gauge::default(),
            process_start: FloatGauge::default(),
            registry: Arc::new(Registry::default()),
        };
        let r = root.sub_registry_with_prefix("decode_node");
        m.register_decode(r);
        m.ingest.register(r);
        m.register_process(&mut root);
        m.create_labels();
        Self {
            registry: Arc::new(root),
            ..m
        }
    }

    /// The node's own metrics, under the `decode_node_` prefix.
    fn register_decode(&self, r: &mut Registry) {
        r.register(
            "requests",
            "Finished requests by outcome",
            self.requests.clone(),
        );
        r.register(
            "time_to_first_token_seconds",
            "Generate arrival to first token",
            self.ttft.clone(),
        );
        r.register(
            "inter_token_latency_seconds",
            "Time between consecutive tokens",
            self.itl.clone(),
        );
        r.register(
            "e2e_request_latency_seconds",
            "Generate arrival to finish",
            self.e2e.clone(),
        );
        r.register(
            "request_queue_time_seconds",
            "Time waiting for admission",
            self.queue_time.clone(),
        );
        r.register(
            "generation_tokens",
            "Tokens generated",
            self.generation_tokens.clone(),
        );
        r.register(
            "kv_cache_usage_ratio",
            "Fraction of KV memory in use: the fuller of the host pool (used + reserved) and the device KV (not counting spare device KV on loan, which goes back as soon as a request needs it)",
            self.kv_cache_usage.clone(),
        );
        r.register(
            "prompt_tokens",
            "Prompt tokens of the requests admitted to decode",
            self.prompt_tokens.clone(),
        );
        r.register(
            "model_info",
            "What this node serves (always 1)",
            self.model_info.clone(),
        );
        r.register(
            "num_requests_running",
            "Requests decoding",
            self.running.clone(),
        );
        r.register(
            "num_requests_waiting",
            "Requests waiting for admission",
            self.waiting.clone(),
        );
        r.register(
            "batch_size",
            "Requests in the last decode step",
            self.batch_size.clone(),
        );
        r.register(
            "cancellations",
            "Cancelled requests by reason",
            self.cancellations.clone(),
        );
        r.register(
            "host_kv_bytes",
            "Host KV pool bytes by state",
            self.host_kv_bytes.clone(),
        );
        r.register(
            "device_kv_bytes",
            "Device KV bytes by state: used (resident blocks), capacity (what admission counts against), lent (of used, the blocks running requests hold on loans of spare device KV, past what admission counted for them)",
            self.device_kv_bytes.clone(),
        );
        r.register(
            "device_kv_loans",
            "Loans of spare device KV (--spare-device-kv) by event: lent (a running request was lent more device slots) or called_back (a loan shrank so a waiting request could start); many of both mean the device is near full and loans come and go",
            self.device_kv_loans.clone(),
        );
        r.register(
            "device_kv_copies_staged",
            "1 when the host KV pool could not be page-locked, so every copy to the device is staged by the driver (the slow path); 0 otherwise",
            self.device_kv_copies_staged.clone(),
        );
        r.register(
            "attention_cpu_ratio",
            "Share of selected KV tokens attended on the CPU over the last minute",
            self.attention_cpu_ratio.clone(),
        );
        r.register(
            "attention_selected_tokens",
            "KV tokens selected for attention in sparse modes",
            self.selected_tokens.clone(),
        );
        r.register(
            "attention_cpu_tokens",
            "Selected KV tokens attended on the CPU",
            self.cpu_tokens.clone(),
        );
        r.register(
            "query_prediction_hits",
            "Blocks of the real selection the predicted query found (sampled steps)",
            self.prediction_hits.clone(),
        );
        r.register(
            "query_predictions",
            "Blocks of the real selection on the steps the prediction was sampled",
            self.predictions.clone(),
        );
        r.register(
            "recall_blocks",
            "KV blocks recalled to the device",
            self.recall_blocks.clone(),
        );
        r.register(
            "recall_bytes",
            "KV bytes recalled to the device",
            self.recall_bytes.clone(),
        );
        r.register(
            "recall_used_blocks",
            "Recalled KV blocks that their layer selected at its next step",
            self.recall_used_blocks.clone(),
        );
        r.register(
            "device_wait_seconds",
            "Seconds the device side waited on CPU attention",
            self.device_wait_seconds.clone(),
        );
        r.register(
            "device_idle_seconds",
            "Seconds the device had nothing queued while decode steps ran on the host (a lower bound: gaps between queued launches are not counted); 0 on the CPU backend",
            self.device_idle_seconds.clone(),
        );
        r.register(
            "graph_pieces",
            "Pieces of decode steps (a resident layer's first or second half) by how they ran with CUDA graphs on (DECODE_NODE_GRAPHS=on): replayed from a graph, captured into one, or queued as they are (a shape's first step, or a capture the device refused); none while graphs are off",
            self.graph_pieces.clone(),
        );
        r.register(
            "step_duration_seconds",
            "Seconds per decode step",
            self.step_duration.clone(),
        );
        r.register(
            "query_prediction_hit_ratio",
            "Share of the real top-k selection found by the predicted query over the last minute",
            self.query_prediction_hit_ratio.clone(),
        );
        r.register(
            "query_prediction_cosine",
            "Cosine of the layer-ahead predicted query with the real one, per layer",
            self.query_cosine.clone(),
        );
        r.register(
            "prediction_guard_fallbacks",
            "Layers whose layer-ahead prediction the accuracy guard rejected (selection, and a CPU part started ahead, redone with the real query), per layer",
            self.guard_fallbacks.clone(),
        );
    }

    /// The standard process metrics (no prefix).
    fn register_process(&self, root: &mut Registry) {
        root.register(
            "process_resident_memory_bytes",
            "Resident memory",
            self.process_rss.clone(),
        );
        root.register(
            "process_cpu_seconds",
            "User and system CPU seconds",
            self.process_cpu.clone(),
        );
        root.register(
            "process_open_fds",
            "Open file descriptors",
            self.process_fds.clone(),
        );
        root.register(
            "process_start_time_seconds",
            "Start time since the epoch",
            self.process_start.clone(),
        );
        let start = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        self.process_start.set(start);
    }

    /// Creates every label value we emit, so rate() works from the first scrape (an empty
    /// family is not exported at all).
    fn create_labels(&self) {
        for outcome in [
            "length",
            "stop",
            "eos",
            "cancelled",
            "context_full",
            "rejected",
            "error",
        ] {
            let _ = self.requests.get_or_create(&OutcomeLabel {
                outcome: outcome.into(),
            });
        }
        for reason in ["client", "disconnect", "shutdown"] {
            let _ = self.cancellations.get_or_create(&ReasonLabel {
                reason: reason.into(),
            });
        }
        for code in [
            "invalid_argument",
            "failed_precondition",
            "resource_exhausted",
            "already_exists",
            "cancelled",
            "unavailable",
        ] {
            let _ = self
                .ingest
                .errors
                .get_or_create(&kv_transfer::CodeLabel { code: code.into() });
        }
    }

    /// Adds a finished layer's token counts and prediction hits: counters and last-minute ratios.
    pub fn add_attention(&self, selected: u64, cpu: u64, pred_hits: u64, pred_total: u64) {
        self.add_attention_at(Instant::now(), [selected, cpu, pred_hits, pred_total]);
    }

    fn add_attention_at(&self, now: Instant, add: [u64; 4]) {
        let counters = [
            &self.selected_tokens,
            &self.cpu_tokens,
            &self.prediction_hits,
            &self.predictions,
        ];
        let before = counters.map(|c| c.get());
        for (c, n) in counters.iter().zip(add) {
            c.inc_by(n);
        }
        let totals = counters.map(|c| c.get());
        let Ok(mut w) = self.ratio_window.lock() else {
            return;
        };
        let [s, c, h, t] = w.since(now, before, totals);
        if s > 0 {
            self.attention_cpu_ratio.set(c as f64 / s as f64);
        }
        if t > 0 {
            self.query_prediction_hit_ratio.set(h as f64 / t as f64);
        }
    }

    /// Records one guard check of `layer`.
    pub fn observe_guard(&self, layer: usize, cosine: f32, fell_back: bool) {
        let l = LayerLabel {
            layer: layer as u32,
        };
        // A NaN cosine (zero query) counts as the lowest bucket rather than none.
        let c = if cosine.is_nan() { 0.0 } else { cosine as f64 };
        self.query_cosine.get_or_create(&l).observe(c);
        if fell_back {
            self.guard_fallbacks.get_or_create(&l).inc();
        }
    }

    /// Counts the step pieces graphs ran between two readings of their stats.
    pub fn graph_pieces(
        &self,
        before: crate::backend::graphs::GraphStats,
        after: crate::backend::graphs::GraphStats,
    ) {
        for (how, a, b) in [
            ("replayed", before.replays, after.replays),
            ("captured", before.captures, after.captures),
            ("queued", before.queued, after.queued),
        ] {
            if b > a {
                self.graph_pieces
                    .get_or_create(&HowLabel { how })
                    .inc_by(b - a);
            }
        }
    }

    /// Counts a loan of spare device KV `event` (`lent`, `called_back`).
    pub fn loan(&self, event: &'static str) {
        self.device_kv_loans
            .get_or_create(&EventLabel { event })
            .inc();
    }

    /// Sets a `{state}` gauge family.
    pub fn set_bytes(fam: &Family<StateLabel, Gauge>, state: &'static str, v: u64) {
        fam.get_or_create(&StateLabel { state })
            .set(v.min(i64::MAX as u64) as i64);
    }

    /// Prometheus text of every metric.
    pub fn render(&self) -> String {
        self.refresh_process();
        let mut out = String::new();
        if prometheus_client::encoding::text::encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }

    /// The same metrics in the Prometheus text format 0.0.4, for scrapers and tools that do
    /// not ask for OpenMetrics (curl, older agents, `promtool check metrics`).
    pub fn render_text(&self) -> String {
        openmetrics_to_text(&self.render())
    }

    fn refresh_process(&self) {
        // Linux /proc; elsewhere these stay at 0.
        if let Ok(statm) = std::fs::read_to_string("/proc/self/statm")
            && let Some(rss_pages) = statm
                .split_whitespace()
                .nth(1)
                .and_then(|x| x.parse::<i64>().ok())
        {
            self.process_rss.set(rss_pages * page_size());
        }
        if let Ok(stat) = std::fs::read_to_string("/proc/self/stat")
            && let Some(rest) = stat.rsplit_once(')').map(|x| x.1)
        {
            let f: Vec<&str> = rest.split_whitespace().collect();
            // Fields 14 and 15 (utime, stime) are the 12th and 13th after the command name.
            if let (Some(u), Some(s)) = (f.get(11), f.get(12))
                && let (Ok(u), Ok(s)) = (u.parse::<f64>(), s.parse::<f64>())
            {
                // A counter only goes up: add what the kernel counted since the last scrape.
                let total = (u + s) / clock_ticks_per_second();
                let seen = self.process_cpu.get();
                if total > seen {
                    self.process_cpu.inc_by(total - seen);
                }
            }
        }
        if let Ok(d) = std::fs::read_dir("/proc/self/fd") {
            self.process_fds.set(d.count() as i64);
        }
    }
}

/// Bytes per page of `/proc/self/statm` (4 KiB on x86-64, often 64 KiB on arm64).
fn page_size() -> i64 {
    // SAFETY: sysconf only reads a system constant.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 { p as i64 } else { 4096 }
}

/// Ticks per second of `/proc/self/stat`'s CPU times (USER_HZ; 100 on most kernels).
fn clock_ticks_per_second() -> f64 {
    // SAFETY: sysconf only reads a system constant.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 { t as f64 } else { 100.0 }
}

/// Every metric name the design card requires (as exposed).
pub const REQUIRED: &[&str] = &[
    "decode_node_requests_total",
    "decode_node_time_to_first_token_seconds",
    "decode_node_inter_token_latency_seconds",
    "decode_node_e2e_request_latency_seconds",
    "decode_node_request_queue_time_seconds",
    "decode_node_generation_tokens_total",
    "decode_node_prompt_tokens_total",
    "decode_node_num_requests_running",
    "decode_node_num_requests_waiting",
    "decode_node_batch_size",
    "decode_node_cancellations_total",
    "decode_node_kv_ingest_bytes_total",
    "decode_node_kv_ingest_chunks_total",
    "decode_node_kv_ingest_errors_total",
    "decode_node_kv_push_duration_seconds",
    "decode_node_kv_leases_expired_total",
    "decode_node_kv_push_ends_total",
    "decode_node_kv_prefix_reused_tokens_total",
    "decode_node_host_kv_bytes",
    "decode_node_device_kv_bytes",
    "decode_node_attention_cpu_ratio",
    "decode_node_recall_blocks_total",
    "decode_node_recall_bytes_total",
    "decode_node_device_wait_seconds_total",
    "decode_node_step_duration_seconds",
    "decode_node_query_prediction_hit_ratio",
    "decode_node_query_prediction_cosine",
    "decode_node_prediction_guard_fallbacks_total",
    "process_resident_memory_bytes",
    "process_cpu_seconds_total",
    "process_open_fds",
];

/// Rewrites OpenMetrics text as Prometheus text 0.0.4: a counter family is named with its
/// `_total` suffix there, info becomes a gauge named `_info`, `unknown` is `untyped`; `# UNIT`,
/// `# EOF` and exemplars have no place in it. Samples are otherwise the same lines.
fn openmetrics_to_text(open: &str) -> String {
    let mut out = String::with_capacity(open.len());
    // HELP comes before TYPE, and only TYPE says how the family's name changes.
    let mut help: Option<(&str, &str)> = None;
    for line in open.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            help = Some(rest.split_once(' ').unwrap_or((rest, "")));
        } else if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap_or((rest, "untyped"));
            let (name, kind) = match kind {
                "counter" => (format!("{name}_total"), "counter"),
                "info" => (format!("{name}_info"), "gauge"),
                "unknown" | "stateset" | "gaugehistogram" => (name.to_string(), "untyped"),
                k => (name.to_string(), k),
            };
            if let Some((_, text)) = help
                .take()
                .filter(|(h, _)| *h == rest.split(' ').next().unwrap_or(""))
            {
                out.push_str(&format!("# HELP {name} {text}\n"));
            }
            out.push_str(&format!("# TYPE {name} {kind}\n"));
        } else if line.starts_with("# UNIT ") || line == "# EOF" {
            continue;
        } else {
            // An exemplar follows " # " after the value.
            let sample = line.split_once(" # ").map_or(line, |(s, _)| s);
            out.push_str(sample);
            out.push('\n');
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ratios_are_taken_over_the_last_minute() {
        let m = Metrics::new();
        let t0 = Instant::now();
        // A first minute all on the CPU, then a quiet hour, then a minute all on the device.
        for i in 0..60 {
            m.add_attention_at(t0 + Duration::from_secs(i), [100, 100, 10, 10]);
        }
        assert_eq!(m.attention_cpu_ratio.get(), 1.0);
        assert_eq!(m.query_prediction_hit_ratio.get(), 1.0);
        let later = t0 + Duration::from_secs(3600);
        for i in 0..61 {
            m.add_attention_at(later + Duration::from_secs(i), [100, 0, 10, 0]);
        }
        assert_eq!(
            m.attention_cpu_ratio.get(),
            0.0,
            "the old minute has left the window"
        );
        assert_eq!(m.cpu_tokens.get(), 6000, "the counters keep everything");
        assert!(m.ratio_window.lock().unwrap().marks.len() <= 62);
        // Half and half within one window.
        let m = Metrics::new();
        m.add_attention_at(t0, [100, 0, 0, 0]);
        m.add_attention_at(t0 + Duration::from_secs(30), [100, 100, 0, 0]);
        assert_eq!(m.attention_cpu_ratio.get(), 0.5);
    }

    #[test]
    fn text_format_names_counters_with_their_suffix() {
        let open = "# HELP a_requests Finished requests.\n# TYPE a_requests counter\n\
                    a_requests_total{outcome=\"eos\"} 3 # {trace=\"x\"} 1.0\n\
                    # HELP a_bytes Bytes.\n# TYPE a_bytes gauge\n# UNIT a_bytes bytes\na_bytes 5\n\
                    # TYPE a_build info\na_build_info{v=\"1\"} 1\n# EOF\n";
        assert_eq!(
            openmetrics_to_text(open),
            "# HELP a_requests_total Finished requests.\n# TYPE a_requests_total counter\n\
             a_requests_total{outcome=\"eos\"} 3\n\
             # HELP a_bytes Bytes.\n# TYPE a_bytes gauge\na_bytes 5\n\
             # TYPE a_build_info gauge\na_build_info{v=\"1\"} 1\n"
        );
        let text = Metrics::new().render_text();
        assert!(!text.contains("# EOF"));
        assert!(
            text.contains("# TYPE decode_node_requests_total counter"),
            "{text}"
        );
    }

    #[test]
    fn renders_openmetrics_text() {
        // The /metrics content type says OpenMetrics: the body must be that format.
        let body = Metrics::new().render();
        assert!(body.ends_with("# EOF\n"), "{body}");
        assert!(page_size() >= 4096 && clock_ticks_per_second() >= 1.0);
    }

    #[test]
    fn renders_every_required_name() {
        let m = Metrics::new();
        m.requests
            .get_or_create(&OutcomeLabel {
                outcome: "stop".into(),
            })
            .inc();
        m.cancellations
            .get_or_create(&ReasonLabel {
                reason: "client".into(),
            })
            .inc();
        Metrics::set_bytes(&m.host_kv_bytes, "used", 1);
        Metrics::set_bytes(&m.device_kv_bytes, "used", 1);
        m.ingest.error("invalid_argument");
        m.observe_guard(3, 0.5, true);
        let text = m.render();
        for name in crate::metrics::REQUIRED {
            assert!(text.contains(name), "missing {name}\n{text}");
        }
        // Beyond the card: a device whose host pool is not page-locked says so.
        assert!(
            text.contains("decode_node_device_kv_copies_staged 0"),
            "{text}"
        );
        m.device_kv_copies_staged.set(1);
        assert!(m.render().contains("decode_node_device_kv_copies_staged 1"));
    }
}
