//! `decode-node bench`: every figure is a ratio against a bound measured in the same run.

use std::time::{Duration, Instant};

use anyhow::Context;
use attention::{BlockGeometry, HeadBlock, KernelPath, KvDType, Scratch, encode_from_f32};
use bytes::Bytes;
use decode_node_proto::v1 as pb;
use kv_transfer::client::{PromptKv, PushOptions, push_kv};
use rayon::prelude::*;
use serde_json::json;

mod capacity;
mod decode;
mod fidelity;
mod ingest;
mod kernels;
mod multiturn;
mod recall_profile;
mod select;
mod soak;
mod step;

use crate::cli::{
    Bench, BenchArgs, DecodeBench, IngestBench, KernelsBench, RecallProfileBench, StepBench,
};
use crate::client;
use crate::model::random::SplitMix;
use crate::service::InProcess;

/// Runs the bench `args` names.
pub async fn run(args: BenchArgs) -> anyhow::Result<()> {
    let report = match args.bench {
        Bench::Kernels(a) => tokio::task::spawn_blocking(move || kernels::kernels(&a)).await??,
        Bench::Ingest(a) => ingest::ingest(&a).await?,
        Bench::Decode(a) => decode::decode(&a).await?,
        Bench::Capacity(a) => capacity::capacity(&a).await?,
        Bench::Step(a) => tokio::task::spawn_blocking(move || step::step(&a)).await??,
        Bench::RecallProfile(a) => {
            tokio::task::spawn_blocking(move || recall_profile::recall_profile(&a)).await??
        }
        Bench::Soak(a) => soak::soak(&a).await?,
        Bench::Multiturn(a) => multiturn::multiturn(&a).await?,
        Bench::Fidelity(a) => tokio::task::spawn_blocking(move || fidelity::fidelity(&a)).await??,
        Bench::Select(a) => tokio::task::spawn_blocking(move || select::select(&a)).await??,
    };
    println!("{}", serde_json::to_string_pretty(&report)?);
    Ok(())
}

/// This CPU's last-level cache in bytes (Linux: from sysfs), if it says.
fn last_level_cache_bytes() -> Option<usize> {
    let dir = std::fs::read_dir("/sys/devices/system/cpu/cpu0/cache").ok()?;
    let read = |p: std::path::PathBuf| std::fs::read_to_string(p).ok();
    dir.filter_map(|e| {
        let p = e.ok()?.path();
        let level: u32 = read(p.join("level"))?.trim().parse().ok()?;
        Some((level, cache_size(&read(p.join("size"))?)?))
    })
    .max()
    .map(|(_, bytes)| bytes)
}

/// A sysfs cache size (`32K`, `491520K`, `4M`) in bytes.
fn cache_size(s: &str) -> Option<usize> {
    let s = s.trim();
    let (n, unit) = s.split_at(s.find(|c: char| !c.is_ascii_digit())?);
    let shift = match unit {
        "K" => 10,
        "M" => 20,
        "G" => 30,
        _ => return None,
    };
    n.parse::<usize>().ok()?.checked_mul(1 << shift)
}

/// Bytes a bandwidth measurement must scan to measure memory, not cache: four times the
/// last-level cache (some server parts hold hundreds of MiB, and keep part of a scan of
/// twice their size), at least `floor`.
fn beyond_cache(floor: usize) -> usize {
    last_level_cache_bytes().map_or(floor, |c| floor.max(4 * c))
}

/// A bench's buffer on huge pages ([`kv_transfer::map_huge`]), as the pool's KV and the CPU
/// backend's weights are: a bound measured on 4 KiB pages would sit below what their reads
/// get (one thread of a 2-core EPYC VM: 20-23 GB/s against 29-31), and a kernel timed over
/// one would be slower than it runs in a node.
struct HugeBuf(memmap2::MmapMut);

impl HugeBuf {
    /// `bytes` zeroed bytes.
    fn zeroed(bytes: usize) -> anyhow::Result<Self> {
        // A zero-length mapping is an error; one page stands for an empty buffer.
        let map = kv_transfer::map_huge(bytes.max(1))
            .with_context(|| format!("mapping a {bytes}-byte bench buffer"))?;
        Ok(Self(map))
    }

    /// `n` floats, value `i % 7` at `i`: what the read probes scan.
    fn probe(n: usize) -> anyhow::Result<Self> {
        let mut b = Self::zeroed(n * 4)?;
        for (i, v) in b.floats_mut().iter_mut().enumerate() {
            *v = (i % 7) as f32;
        }
        Ok(b)
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        let n = self.0.len();
        &mut self.0[..n]
    }

    /// The buffer as floats (a mapping starts page-aligned).
    fn floats(&self) -> &[f32] {
        let whole = self.0.len() / 4 * 4;
        bytemuck::cast_slice(&self.0[..whole])
    }

    fn floats_mut(&mut self) -> &mut [f32] {
        let whole = self.0.len() / 4 * 4;
        bytemuck::cast_slice_mut(&mut self.0[..whole])
    }
}

/// Host read bandwidth of `threads` threads over a buffer beyond the last-level cache.
fn host_read_bandwidth(threads: usize) -> anyhow::Result<f64> {
    Ok(host_read_passes(threads)?.best)
}

/// As [`host_read_bandwidth`], with the median pass beside the best.
fn host_read_passes(threads: usize) -> anyhow::Result<ReadPasses> {
    let buf = HugeBuf::probe(beyond_cache(512 << 20) / 4)?;
    Ok(read_passes(buf.floats(), threads, 1.0))
}

/// Scalar FMAs per second of `threads` threads issuing at once, at `path`'s vector width.
pub(crate) fn fma_peak_threads(path: KernelPath, threads: usize, seconds: f64) -> f64 {
    summed_over_threads(threads, move || attention::fma_peak_on(path, seconds))
}

/// The sum of `rate` measured on `threads` threads at once (a rate probe per thread).
pub(crate) fn summed_over_threads(threads: usize, rate: impl Fn() -> f64 + Copy + Send) -> f64 {
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..threads.max(1)).map(|_| s.spawn(rate)).collect();
        hs.into_iter().map(|h| h.join().unwrap_or(0.0)).sum()
    })
}

/// A note for a figure whose `bytes` per step fit in the last-level cache: its reads may come
/// from the cache, so a ratio to memory bandwidth above 1 says nothing of memory.
fn cache_note(bytes: f64) -> Option<String> {
    let llc = last_level_cache_bytes()?;
    (bytes <= llc as f64).then(|| {
        format!(
            "note: the {:.0} MB read per step fit in this CPU's {:.0} MB last-level cache; the \
             ratio to memory bandwidth may exceed what memory allows",
            bytes / 1e6,
            llc as f64 / 1e6
        )
    })
}

/// Bytes/s of reading `buf` with `threads` threads (best of a few passes).
fn read_bandwidth(buf: &[f32], threads: usize, seconds: f64) -> f64 {
    read_passes(buf, threads, seconds).best
}

/// Times a thread scans its `part_bytes` in one timed pass (the read probe, `bench kernels`):
/// once where the part is memory-sized; where it fits a cache, until the thread has read at
/// least 32 MiB, as starting the threads took a third of a pass over 1 MiB.
fn scans_per_pass(part_bytes: usize) -> usize {
    ((32 << 20) / part_bytes.max(1)).max(1)
}

/// The passes of a read-bandwidth probe, in bytes/s.
#[derive(Debug, Clone, Copy)]
struct ReadPasses {
    /// The fastest pass: the bound every bench divides by.
    best: f64,
    /// The median pass of the loop that gave the fastest. On a shared host a few passes can
    /// read far faster than the rest (a 2-core EPYC VM: 57 GB/s once, 29-40 most runs); a rate
    /// averaged over a whole run, as a decode's is, compares with this one.
    median: f64,
    /// The loop that read fastest: later single passes over the same kind of bytes (`bench
    /// kernels`' paired rounds) read with it.
    fastest: ReadLoop,
}

impl ReadPasses {
    /// A bound known from elsewhere (a device's memory bandwidth), no pass of ours.
    fn known(bw: f64) -> Self {
        Self {
            best: bw,
            median: bw,
            fastest: ReadLoop::Hardware,
        }
    }
}

/// How the read probe asks for lines: the CPU's own prefetchers alone, or a software prefetch
/// of the line a distance ahead as well. Which is fastest depends on the CPU, and by a lot: a
/// 2-core Xeon read 10-15% faster with the lines asked for 8 KiB ahead, where a later 2-core
/// Xeon VM (AVX-512 FP16, AMX) read 10 GB/s with them and 16-18 GB/s with the prefetchers
/// alone (2 KiB ahead: 17-18). A probe slower than the kernels it bounds gave ratios of
/// 1.1-1.6 to it, so it takes the fastest of the three.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ReadLoop {
    /// No software prefetch.
    Hardware,
    /// A prefetch of the line this many f32s (a multiple of 16) ahead.
    Ahead(usize),
}

impl ReadLoop {
    /// Every loop the probe tries, in turn, pass after pass.
    const ALL: [ReadLoop; 3] = [
        ReadLoop::Hardware,
        ReadLoop::Ahead(512),  // 2 KiB
        ReadLoop::Ahead(2048), // 8 KiB
    ];
}

impl std::fmt::Display for ReadLoop {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReadLoop::Hardware => f.write_str("hardware prefetch"),
            ReadLoop::Ahead(n) => write!(f, "prefetch {} KiB ahead", n * 4 / 1024),
        }
    }
}

/// Passes of reading `buf` with `threads` threads for `seconds` (at least one pass of each
/// [`ReadLoop`]), the loops taking turns.
fn read_passes(buf: &[f32], threads: usize, seconds: f64) -> ReadPasses {
    let chunk = buf.len().div_ceil(threads).max(1);
    let reps = scans_per_pass(chunk * 4);
    let mut rates: [Vec<f64>; ReadLoop::ALL.len()] = Default::default();
    let end = Instant::now() + Duration::from_secs_f64(seconds);
    let mut turn = 0;
    while Instant::now() < end || rates.iter().any(Vec::is_empty) {
        let i = turn % ReadLoop::ALL.len();
        rates[i].push(read_pass(buf, chunk, reps, ReadLoop::ALL[i]));
        turn += 1;
    }
    let best_of = |r: &[f64]| r.iter().copied().fold(0.0, f64::max);
    let (i, passes) = rates
        .iter_mut()
        .enumerate()
        .max_by(|a, b| best_of(a.1).total_cmp(&best_of(b.1)))
        .expect("ReadLoop::ALL is not empty");
    passes.sort_by(f64::total_cmp);
    ReadPasses {
        best: passes[passes.len() - 1],
        median: passes[passes.len() / 2],
        fastest: ReadLoop::ALL[i],
    }
}

/// Bytes a second of one pass of a thread per `chunk` floats of `buf`, each reading its part
/// `reps` times with `how`.
fn read_pass(buf: &[f32], chunk: usize, reps: usize, how: ReadLoop) -> f64 {
    let t = Instant::now();
    let sums: f32 = std::thread::scope(|s| {
        let hs: Vec<_> = buf
            .chunks(chunk.max(1))
            .map(|c| s.spawn(move || (0..reps).map(|_| sum(c, how)).sum::<f32>()))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap_or(0.0)).sum()
    });
    std::hint::black_box(sums);
    (buf.len() * 4 * reps) as f64 / t.elapsed().as_secs_f64()
}

/// Sum of `c`, read as fast as this core reads memory, 64 bytes (a line) at a time, the lines
/// asked for as `how` says.
fn sum(c: &[f32], how: ReadLoop) -> f32 {
    let mut acc = [0f32; 16];
    match how {
        ReadLoop::Hardware => {
            for x in c.chunks_exact(16) {
                add_line(&mut acc, x);
            }
        }
        ReadLoop::Ahead(ahead) => {
            for (k, x) in c.chunks_exact(16).enumerate() {
                prefetch_at(c, 16 * k + ahead);
                add_line(&mut acc, x);
            }
        }
    }
    acc.iter().sum::<f32>() + c.chunks_exact(16).remainder().iter().sum::<f32>()
}

#[inline]
fn add_line(acc: &mut [f32; 16], x: &[f32]) {
    for (a, v) in acc.iter_mut().zip(x) {
        *a += v;
    }
}

/// Asks for the line holding `c[i]`, where there is one (x86-64; elsewhere nothing).
#[inline]
fn prefetch_at(c: &[f32], i: usize) {
    #[cfg(target_arch = "x86_64")]
    if let Some(p) = c.get(i) {
        // SAFETY: a prefetch reads nothing the program sees; `p` lies inside `c`.
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                (p as *const f32).cast(),
            )
        };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (c, i);
}

/// CPU seconds this process has used so far, in user space and in the kernel (`getrusage`,
/// to the microsecond): with the clock, whether a phase was bound by the CPUs.
#[derive(Debug, Clone, Copy)]
struct CpuTimes {
    user: f64,
    system: f64,
}

impl CpuTimes {
    fn now() -> Self {
        // SAFETY: `getrusage` fills the zeroed struct it is given and reads nothing else.
        let ru = unsafe {
            let mut ru: libc::rusage = std::mem::zeroed();
            if libc::getrusage(libc::RUSAGE_SELF, &mut ru) != 0 {
                return Self {
                    user: 0.0,
                    system: 0.0,
                };
            }
            ru
        };
        let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
        Self {
            user: secs(ru.ru_utime),
            system: secs(ru.ru_stime),
        }
    }

    /// What was used since `earlier`.
    fn since(self, earlier: Self) -> Self {
        Self {
            user: self.user - earlier.user,
            system: self.system - earlier.system,
        }
    }
}

/// Bytes/s of single-thread memcpy (best of a few passes).
fn memcpy_bandwidth(bytes: usize, seconds: f64) -> anyhow::Result<f64> {
    let mut src = HugeBuf::zeroed(bytes)?;
    src.bytes_mut().fill(1);
    // Written once before timing: the first copy into a fresh mapping also faults its pages
    // in, which took over a second for 256 MiB on a VM (so that copy was the only one timed,
    // and `bench ingest` reported 0.26 GB/s of memcpy and a ratio of 6.3).
    let mut dst = HugeBuf::zeroed(bytes)?;
    dst.bytes_mut().fill(2);
    let mut best = 0f64;
    let end = Instant::now() + Duration::from_secs_f64(seconds);
    while Instant::now() < end || best == 0.0 {
        let t = Instant::now();
        dst.bytes_mut()
            .copy_from_slice(std::hint::black_box(&src.0[..bytes]));
        best = best.max(bytes as f64 / t.elapsed().as_secs_f64());
    }
    std::hint::black_box(&dst.0);
    Ok(best)
}

/// The `q` quantile (0..=1) of ascending `sorted` values, by the nearest rank (0 where there
/// are none).
fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

fn parse_list<T: std::str::FromStr>(s: &str, what: &str) -> anyhow::Result<Vec<T>> {
    s.split(',')
        .map(|x| {
            x.trim()
                .parse()
                .map_err(|_| anyhow::anyhow!("bad {what} {x:?}"))
        })
        .collect()
}

/// Starts an in-process node on loopback for `model` with these serve settings.
async fn start_node(
    model: crate::cli::ModelArgs,
    host_kv_bytes: u64,
    device_kv_bytes: u64,
    max_batch: u32,
    kv_lease: f64,
    prefault: bool,
    cpu_attention_threads: u32,
) -> anyhow::Result<InProcess> {
    let mut sa = InProcess::loopback_args(model, host_kv_bytes, device_kv_bytes);
    sa.max_batch = max_batch;
    sa.cpu_attention_threads = cpu_attention_threads as usize;
    sa.kv_lease = kv_lease;
    sa.host_kv_prefault = prefault;
    InProcess::start(sa)
        .await
        .context("the bench node did not start")
}

/// What a bench's Generate came back with: the stream, when its first token and its end came.
type Timed = (client::Generated, Option<Instant>, Instant);

/// Starts a greedy Generate of `tokens` tokens (EOS ignored) for pushed request `id`.
fn spawn_generate(
    ch: tonic::transport::Channel,
    id: String,
    tokens: u32,
) -> tokio::task::JoinHandle<anyhow::Result<Timed>> {
    let req = pb::GenerateRequest {
        request_id: id,
        sampling: Some(pb::SamplingParams::default()),
        max_new_tokens: tokens,
        ignore_eos: true,
        ..Default::default()
    };
    tokio::spawn(async move {
        let mut first = None;
        let out = client::generate(ch, None, req, |_| {
            first.get_or_insert_with(Instant::now);
        })
        .await;
        out.map(|o| (o, first, Instant::now()))
    })
}

/// Random KV for `info`'s layout, as a push for `id` of `tokens` tokens.
fn synthetic_kv(info: &pb::ModelInfo, id: &str, tokens: usize, seed: u64) -> PromptKv {
    let dtype = match pb::DType::try_from(info.kv_dtype) {
        Ok(pb::DType::DtypeF16) => KvDType::F16,
        Ok(pb::DType::DtypeBf16) => KvDType::Bf16,
        _ => KvDType::F32,
    };
    let n = tokens * info.num_kv_heads as usize * info.head_dim as usize;
    let make = |seed: u64| {
        let mut r = SplitMix(seed);
        let v: Vec<f32> = (0..n).map(|_| (r.next_f64() as f32 - 0.5) * 2.0).collect();
        let mut b = vec![0u8; n * dtype.size()];
        encode_from_f32(dtype, &v, &mut b);
        Bytes::from(b)
    };
    // Layers in parallel: long contexts of large models are gigabytes of random KV.
    let layers = (0..u64::from(info.num_layers))
        .into_par_iter()
        .map(|l| (make(seed ^ (l << 32)), make(seed ^ (l << 32) ^ 1)))
        .collect();
    let mut r = SplitMix(seed);
    let vocab = info.vocab_size.max(1) as u64;
    PromptKv {
        header: pb::KvHeader {
            request_id: id.into(),
            model_id: info.model_id.clone(),
            num_layers: info.num_layers,
            num_kv_heads: info.num_kv_heads,
            head_dim: info.head_dim,
            dtype: info.kv_dtype,
            num_tokens: tokens as u32,
            prompt_token_ids: (0..tokens).map(|_| (r.next_u64() % vocab) as u32).collect(),
            next_token_id: (r.next_u64() % vocab) as u32,
            num_streams: 0,
            reuse_prefix: false,
        },
        layers,
    }
}

async fn model_info(target: &str) -> anyhow::Result<pb::ModelInfo> {
    let ch = client::connect(target).await?;
    Ok(client::decode_client(ch, None)
        .get_model_info(pb::GetModelInfoRequest {})
        .await?
        .into_inner())
}

fn parse_tokens(s: &str) -> anyhow::Result<usize> {
    let s = s.trim().to_ascii_lowercase();
    let (num, mult) = match s.strip_suffix('k') {
        Some(n) => (n, 1024),
        None => (s.as_str(), 1),
    };
    Ok(num
        .parse::<usize>()
        .with_context(|| format!("bad context length {s:?}"))?
        * mult)
}

/// Bytes of KV for `tokens` tokens of `model` in its own dtype (f32 where it names none).
fn kv_bytes_for(cfg: &crate::model::ModelConfig, tokens: usize) -> u64 {
    let es = KvDType::parse(&cfg.torch_dtype).map_or(4, |d| d.size());
    (tokens * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2 * es) as u64
}

/// Bytes of a host-kept key sketch (`--block-scorer sketch` on the CPU) for `tokens` tokens
/// of every layer, not counting its last page's rounding.
fn sketch_bytes_for(cfg: &crate::model::ModelConfig, tokens: usize) -> u64 {
    let per_token = attention::sketch::nibble_bytes(cfg.head_dim) + 4;
    (tokens * cfg.num_layers * cfg.num_kv_heads * per_token) as u64
}

/// The configuration of `model` (`tiny`, a HF directory or a GGUF file, which is read whole:
/// its configuration comes with its tensors).
fn model_config(model: &crate::cli::ModelArgs) -> anyhow::Result<crate::model::ModelConfig> {
    let path = std::path::Path::new(&model.model);
    Ok(if model.model == "tiny" {
        crate::model::random::tiny().0
    } else if crate::model::gguf::is_gguf(path) {
        crate::model::gguf::load(path)?.cfg
    } else {
        crate::model::ModelConfig::from_dir(path)?
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_sizes_read_as_sysfs_writes_them() {
        assert_eq!(cache_size("32K\n"), Some(32 << 10));
        assert_eq!(cache_size("491520K"), Some(491_520 << 10));
        assert_eq!(cache_size("4M"), Some(4 << 20));
        for bad in ["", "K", "12", "12Q", "-1K", "99999999999999999999G"] {
            assert_eq!(cache_size(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn every_read_loop_sums_every_float() {
        // Small integers: every order of the adds gives the same f32.
        let c: Vec<f32> = (0..4099).map(|i| (i % 7) as f32).collect();
        let want: f32 = c.iter().sum();
        for how in ReadLoop::ALL {
            assert_eq!(sum(&c, how), want, "{how}");
            assert_eq!(sum(&c[..5], how), 10.0, "{how}");
        }
    }

    #[test]
    fn the_read_probe_tries_every_loop_and_reports_its_fastest() {
        let c: Vec<f32> = vec![1.0; 1 << 16];
        let p = read_passes(&c, 2, 0.0);
        assert!(ReadLoop::ALL.contains(&p.fastest));
        assert!(p.best > 0.0 && p.median > 0.0 && p.median <= p.best);
    }
}
