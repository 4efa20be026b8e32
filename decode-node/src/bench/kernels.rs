//! `bench kernels`: CPU sparse attention, KV bytes scanned per second ÷ the read bandwidth
//! of the same threads, measured in the same run.

use super::*; // the shared helpers and imports of `bench`
use attention::attend_blocks_on;

/// CPU sparse attention: KV bytes scanned per second ÷ read bandwidth, per configuration.
pub(super) fn kernels(args: &KernelsBench) -> anyhow::Result<serde_json::Value> {
    if args.common.model.device != "cpu" {
        return device_kernels(args);
    }
    let threads: Vec<usize> = parse_list(&args.threads, "thread count")?;
    let groups: Vec<usize> = parse_list(&args.groups, "group size")?;
    let head_dims: Vec<usize> = parse_list(&args.head_dims, "head dim")?;
    anyhow::ensure!(
        groups
            .iter()
            .chain(&head_dims)
            .all(|&x| (1..=1024).contains(&x)),
        "group sizes and head dims must lie in 1..=1024"
    );
    anyhow::ensure!(
        args.working_set_mib <= 65536,
        "--working-set-mib must lie in 0..=65536"
    );
    let working_set = match args.working_set_mib {
        0 => beyond_cache(256 << 20),
        mib => mib << 20,
    };
    let paths: Vec<String> = parse_list(&args.paths, "kernel path")?;
    anyhow::ensure!(
        paths
            .iter()
            .all(|p| p == "best" || KernelPath::ALL.iter().any(|k| k.name() == p)),
        "--paths takes `best`, `scalar`, `avx2`, `avx512`, `avx512bf16` and/or `amx`"
    );
    // f16 and bf16 (most models' KV) unless `--kv-dtype` names one.
    let dtypes = match args.common.model.kv_dtype.as_str() {
        "auto" => vec![KvDType::F16, KvDType::Bf16],
        flag => vec![crate::node::kv_dtype(flag, "")?],
    };
    let buf = HugeBuf::probe(working_set / 4)?;
    let mut rows = Vec::new();
    for &t in &threads {
        if !args.common.json {
            eprintln!(
                "kernels: {} configurations at {t} thread(s); the rows follow the second probe of the bounds",
                dtypes.len() * groups.len() * head_dims.len() * paths.len()
            );
        }
        let probe = read_passes(buf.floats(), t, args.seconds.min(1.0));
        #[cfg(target_arch = "x86_64")]
        if !args.common.json && paths.iter().any(|p| p == "best" || p == "avx512") {
            eprintln!(
                "kernels: the AVX-512 loops take their factors {} (DECODE_NODE_AVX512_FACTORS=load or fold picks)",
                attention::avx512_factors()
            );
        }
        if !args.common.json {
            eprintln!(
                "kernels: read probe at {t} thread(s) {:.2} GB/s, fastest with {} (the paired reads use it)",
                probe.best / 1e9,
                probe.fastest
            );
        }
        // Per path: the AVX2 path is held to AVX2's FMA rate, the others to the widest, and
        // bf16 blocks that `avx512bf16` multiplies in bf16 pairs to `VDPBF16PS`'s product
        // rate, and those `amx` multiplies to its tiles' (`bf16` in the key).
        let mut peaks: Vec<((KernelPath, bool), f64)> = Vec::new();
        let mut scans: Vec<Scan> = Vec::new();
        for &dtype in &dtypes {
            for &g in &groups {
                for &d in &head_dims {
                    let geom = BlockGeometry {
                        block_size: 32,
                        num_kv_heads: 1,
                        head_dim: d,
                        dtype,
                    };
                    let hb = geom.head_bytes();
                    let nblocks = (working_set / hb).max(1);
                    // On huge pages, as the pool's blocks are.
                    let mut data = HugeBuf::zeroed(nblocks * hb)?;
                    // K and V in [-0.5, 0.5); int8 and fp8 codes of 100x that, each token's
                    // scale 0.01 (the bytes after the codes).
                    let codes = 2 * geom.block_size * d * dtype.size();
                    let (amp, scale) = if dtype.scaled() {
                        (100.0, 0.01f32)
                    } else {
                        (1.0, 1.0)
                    };
                    let vals: Vec<f32> = {
                        let mut r = SplitMix(7);
                        (0..codes / dtype.size())
                            .map(|_| ((r.next_f64() as f32) - 0.5) * amp)
                            .collect()
                    };
                    for blk in data.bytes_mut().chunks_exact_mut(hb) {
                        let (c, scales) = blk.split_at_mut(codes);
                        encode_from_f32(dtype, &vals, c);
                        for sc in scales.chunks_exact_mut(4) {
                            sc.copy_from_slice(&scale.to_le_bytes());
                        }
                    }
                    let q: Vec<f32> = (0..g * d).map(|i| (i % 5) as f32 * 0.1).collect();
                    for name in &paths {
                        let path = KernelPath::ALL
                            .iter()
                            .copied()
                            .find(|k| k.name() == name)
                            .unwrap_or_else(|| KernelPath::best(&geom));
                        if !path.runs(&geom) {
                            eprintln!("kernels: this CPU has no {} path; skipped", path.name());
                            continue;
                        }
                        let key = (path, path.multiplies_bf16(&geom, g));
                        if !peaks.iter().any(|(k, _)| *k == key) {
                            let peak = peak_threads(key, t, args.seconds.min(0.5));
                            peaks.push((key, peak));
                        }
                        let bytes = &data.0[..nblocks * hb];
                        let (best, rounds) =
                            scan_rate(&geom, path, &q, bytes, t, args.seconds, probe.fastest);
                        scans.push(Scan {
                            dtype,
                            g,
                            d,
                            path: key,
                            best,
                            rounds,
                        });
                    }
                }
            }
        }
        // The bounds once more after the rows, the higher of each pair kept: on a shared
        // machine one probe can land in a busy moment (a 2-core VM's read probe moved 32-60
        // GB/s at two threads, its AVX-512 FMA probe 68-118 G/s), and a row then passed its
        // bound (ratios of 1.3-1.5). The rows print once both are in.
        let bw = probe
            .best
            .max(read_bandwidth(buf.floats(), t, args.seconds.min(1.0)));
        for (key, peak) in &mut peaks {
            *peak = peak.max(peak_threads(*key, t, args.seconds.min(0.5)));
        }
        for sc in scans {
            let peak = peaks
                .iter()
                .find(|(p, _)| *p == sc.path)
                .map_or(0.0, |&(_, peak)| peak);
            let mut row = sc.row(t, bw, peak);
            row["read_loop"] = json!(probe.fastest.to_string());
            #[cfg(target_arch = "x86_64")]
            if sc.path.0 == KernelPath::Avx512 {
                row["avx512_factors"] = json!(attention::avx512_factors());
            }
            if !args.common.json {
                eprintln!("{}", sc.line(t, bw, peak));
            }
            rows.push(row);
        }
    }
    Ok(json!({ "bench": "kernels", "goal_ratio_to_roofline": 0.8, "results": rows }))
}

/// Multiply-adds a second of `threads` threads at once: `path`'s FMAs, or with `bf16` its
/// bf16 pair products (`VDPBF16PS`, or AMX tiles on the `amx` path).
fn peak_threads((path, bf16): (KernelPath, bool), threads: usize, seconds: f64) -> f64 {
    if !bf16 {
        return fma_peak_threads(path, threads, seconds);
    }
    #[cfg(target_arch = "x86_64")]
    if path == KernelPath::Amx {
        return summed_over_threads(threads, move || attention::amx_peak(seconds));
    }
    summed_over_threads(threads, move || attention::bf16_dot_peak(seconds))
}

/// One configuration's measured rate, waiting for the bounds it is held to.
struct Scan {
    dtype: KvDType,
    g: usize,
    d: usize,
    /// The path, and whether its multiply-adds are bf16 pair products.
    path: (KernelPath, bool),
    /// KV bytes a second.
    best: f64,
    /// Rounds of a read probe over the bytes the kernel reads, then a pass of the kernel.
    rounds: Vec<Round>,
}

/// Rounds of the FMA burst each thread of [`scan_rate`] runs right after its share of a
/// pass: about 0.1 ms, shorter than the ~10 ms a core's clock took to recover after the
/// kernels on a Xeon VM.
const FMA_BURST: usize = 20_000;

/// One round of [`scan_rate`]: bytes a second.
#[derive(Debug, Clone, Copy)]
struct Round {
    /// The read probe's, over the kernel's bytes with its threads.
    read: f64,
    /// The kernel's.
    kv: f64,
    /// Lane FMAs a second of a short burst each thread ran right after its share of the
    /// pass (at the row's vector width), summed: the clock the cores kept under the kernel.
    fma_after: f64,
}

impl Scan {
    /// FMAs (or bf16 products) per KV byte: every K and V element once per query head.
    fn fmas_per_byte(&self) -> f64 {
        self.g as f64 / self.dtype.size() as f64
    }

    /// Bytes a second the slower of read bandwidth `bw` and the FMA rate `peak` allows.
    fn roofline(&self, bw: f64, peak: f64) -> f64 {
        bw.min(peak / self.fmas_per_byte())
    }

    /// Read-bound rows held to their own rounds: the median over rounds of the kernel's rate
    /// over the lower of the probe read just before it and the FMA rate `peak`, and the
    /// median probe. On a shared host the bandwidth moves between one probe and the next (a
    /// 2-core VM read 34 and 50 GB/s at two threads minutes apart while the kernel held 32):
    /// a ratio from a probe and a pass seconds apart moved with it, one from neighbouring
    /// passes much less. Where the FMA rate is the lower bound, the best pass is held to it
    /// instead, as the unpaired ratio does (the FMA probe is a best of its own passes; a
    /// median pass against it would count the host's stolen cycles against the kernel).
    fn paired(&self, peak: f64) -> (f64, f64) {
        let mut reads: Vec<f64> = self.rounds.iter().map(|r| r.read).collect();
        let read = median(&mut reads);
        let fma = peak / self.fmas_per_byte();
        let ratio = if read <= fma {
            let mut ratios: Vec<f64> = self.rounds.iter().map(|r| r.kv / r.read.min(fma)).collect();
            median(&mut ratios)
        } else {
            self.best / fma
        };
        (ratio, read)
    }

    /// Where the FMAs bound the row (not the read bandwidth `bw`) and they are FMAs (not
    /// bf16 products): the median FMA rate right after a pass, and the best pass over what
    /// that rate allows. The FMA probe runs alone, and on some CPUs at a higher clock than a
    /// core keeps under the kernel (a Xeon VM: 0.86 of it), so this ratio says how near the
    /// kernel runs to the FMAs the core had, the unpaired one how near to the machine's.
    fn after_pass(&self, bw: f64, peak: f64) -> Option<(f64, f64)> {
        if self.path.1 || peak / self.fmas_per_byte() >= bw {
            return None;
        }
        let mut rates: Vec<f64> = self.rounds.iter().map(|r| r.fma_after).collect();
        let fma = median(&mut rates);
        (fma > 0.0).then(|| (fma, self.best * self.fmas_per_byte() / fma))
    }

    /// The JSON row at `threads` threads.
    fn row(&self, threads: usize, bw: f64, peak: f64) -> serde_json::Value {
        let roofline = self.roofline(bw, peak);
        let (paired, paired_read) = self.paired(peak);
        let after = self.after_pass(bw, peak);
        json!({
            "fma_after_pass_g_per_s": after.map(|a| a.0 / 1e9),
            "ratio_to_fma_after_pass": after.map(|a| a.1),
            "dtype": self.dtype.name(), "group": self.g, "head_dim": self.d, "threads": threads,
            "path": self.path.0.name(), "bf16_products": self.path.1,
            "kv_gb_per_s": self.best / 1e9, "read_gb_per_s": bw / 1e9, "ratio": self.best / bw,
            "fma_g_per_s": peak / 1e9, "fmas_per_byte": self.fmas_per_byte(),
            "roofline_gb_per_s": roofline / 1e9, "ratio_to_roofline": self.best / roofline,
            "rounds": self.rounds.len(), "paired_read_gb_per_s": paired_read / 1e9,
            "paired_ratio_to_roofline": paired,
        })
    }

    /// The table's line at `threads` threads.
    fn line(&self, threads: usize, bw: f64, peak: f64) -> String {
        let roofline = self.roofline(bw, peak);
        format!(
            "kernels {:>4} G={} D={:>3} threads={threads} {:>10}: {:6.2} GB/s of KV / {:6.2} GB/s read = {:.2}; roofline {:6.2} GB/s ({} {:.0} G/s) -> {:.2}; paired with the read of the same bytes (median of {}) -> {:.2}",
            self.dtype.name(),
            self.g,
            self.d,
            self.path.0.name(),
            self.best / 1e9,
            bw / 1e9,
            self.best / bw,
            roofline / 1e9,
            if self.path.1 { "bf16 products" } else { "FMA" },
            peak / 1e9,
            self.best / roofline,
            self.rounds.len(),
            self.paired(peak).0,
        ) + &self
            .after_pass(bw, peak)
            .map_or(String::new(), |(fma, ratio)| {
                format!(
                    "; FMA right after a pass {:.0} G/s -> {ratio:.2}",
                    fma / 1e9
                )
            })
    }
}

/// The best KV bytes per second over `seconds` of `threads` threads attending their share of
/// `data` (whole head blocks of `geom`) on `path`, each its share several times a pass where
/// the share is small (a working set sized to a cache); and every round's pair of rates: the
/// same threads reading the same shares with the read probe's fastest loop `how`, then
/// attending them.
fn scan_rate(
    geom: &BlockGeometry,
    path: KernelPath,
    q: &[f32],
    data: &[u8],
    threads: usize,
    seconds: f64,
    how: ReadLoop,
) -> (f64, Vec<Round>) {
    let hb = geom.head_bytes();
    let per = (data.len() / hb).div_ceil(threads.max(1)).max(1);
    let reps = scans_per_pass(per * hb);
    let mut best = 0f64;
    let mut rounds = Vec::new();
    // The probe reads the bytes as floats: the blocks start 4-aligned (a page-aligned
    // mapping, head blocks of whole 4-byte words), any odd tail is left out.
    let floats: &[f32] = bytemuck::cast_slice(&data[..data.len() / 4 * 4]);
    let end = Instant::now() + Duration::from_secs_f64(seconds);
    while Instant::now() < end || best == 0.0 {
        let read = read_pass(floats, per * hb / 4, reps, how);
        let start = Instant::now();
        let (end_pass, fma_after) = std::thread::scope(|s| {
            let hs: Vec<_> = data
                .chunks(per * hb)
                .map(|part| {
                    s.spawn(move || {
                        let mut scratch = Scratch::default();
                        for _ in 0..reps {
                            let blocks = part
                                .chunks_exact(hb)
                                .map(|b| HeadBlock { bytes: b, len: 32 });
                            std::hint::black_box(attend_blocks_on(
                                path,
                                geom,
                                q,
                                0.1,
                                blocks,
                                &mut scratch,
                            ));
                        }
                        let done = Instant::now();
                        (done, attention::fma_burst_on(path, FMA_BURST))
                    })
                })
                .collect();
            hs.into_iter()
                .filter_map(|h| h.join().ok())
                .fold((start, 0.0), |(end, fma), (done, rate)| {
                    (end.max(done), fma + rate)
                })
        });
        let kv = (data.len() * reps) as f64 / (end_pass - start).as_secs_f64();
        best = best.max(kv);
        rounds.push(Round {
            read,
            kv,
            fma_after,
        });
    }
    (best, rounds)
}

/// The middle value (the upper of the two middle ones); 0 for none.
fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// `bench kernels --device cuda`: the device part of attention over every block of a
/// context, per group, head dim, context and CUDA-block target: KV bytes read per second ÷
/// the device's copy bandwidth measured in the same run, and how long the combine and the
/// host's packing of the slot list take of a call.
#[cfg(feature = "cuda")]
fn device_kernels(args: &KernelsBench) -> anyhow::Result<serde_json::Value> {
    use crate::backend::cuda::{AttnBenchSpec, CudaBackend};
    let device = &args.common.model.device;
    let groups: Vec<usize> = parse_list(&args.groups, "group size")?;
    let head_dims: Vec<usize> = parse_list(&args.head_dims, "head dim")?;
    let ctas: Vec<usize> = parse_list(&args.ctas, "CUDA block count")?;
    let contexts: Vec<usize> = args
        .context
        .split(',')
        .map(parse_tokens)
        .collect::<anyhow::Result<_>>()?;
    let block_size = args.common.model.block_size as usize;
    anyhow::ensure!(
        groups.iter().all(|&g| (1..=8).contains(&g))
            && head_dims.iter().all(|&d| (1..=128).contains(&d))
            && (1..=64).contains(&args.kv_heads)
            && ctas.iter().all(|&c| c <= 65535)
            && contexts.iter().all(|&c| (1..=1 << 20).contains(&c))
            && (1..=128).contains(&block_size),
        "with --device cuda: --groups 1..=8, --head-dims 1..=128, --kv-heads 1..=64, \
         --ctas 0..=65535, --context 1..=1M tokens, --block-size 1..=128"
    );
    let dtype = crate::node::kv_dtype(&args.common.model.kv_dtype, "bfloat16")?;
    let backend = CudaBackend::new(crate::node::cuda_ordinal(device)?)
        .with_context(|| format!("--device {device}"))?;
    let bw = backend.copy_bandwidth()?;
    let mut rows = Vec::new();
    for &g in &groups {
        for &d in &head_dims {
            for &context in &contexts {
                for &c in &ctas {
                    let spec = AttnBenchSpec {
                        dtype,
                        block_size,
                        kv_heads: args.kv_heads,
                        group: g,
                        head_dim: d,
                        context,
                        ctas: c,
                        seconds: args.seconds.max(0.05),
                    };
                    let t = backend.bench_attention(&spec)?;
                    let gbps = t.kv_bytes as f64 / t.call_s;
                    let kernel = t.kernel;
                    let pf = if t.prefetch { "+prefetch" } else { "" };
                    if !args.common.json {
                        eprintln!(
                            "device {:>4} G={g} D={d:>3} ctx={context:>6} {kernel}{pf} ctas={:>5} (splits {:>4}): call {:7.1} us, {:7.1} GB/s of KV / {:.0} GB/s copy = {:.2}; combine {:5.1} us, host pack {:5.1} us, list upload queued behind 8 calls {:5.1} us (pinned ring {:5.1} us)",
                            dtype.name(),
                            t.ctas,
                            t.splits,
                            t.call_s * 1e6,
                            gbps / 1e9,
                            bw / 1e9,
                            gbps / bw,
                            t.combine_s * 1e6,
                            t.pack_s * 1e6,
                            t.upload_s * 1e6,
                            t.upload_ring_s * 1e6,
                        );
                    }
                    rows.push(json!({
                        "dtype": dtype.name(), "group": g, "head_dim": d, "context": context,
                        "kv_heads": args.kv_heads, "block_size": block_size, "kernel": kernel, "prefetch": t.prefetch,
                        "ctas": t.ctas, "splits": t.splits, "call_s": t.call_s,
                        "combine_s": t.combine_s, "pack_s": t.pack_s, "upload_s": t.upload_s, "upload_ring_s": t.upload_ring_s, "kv_bytes": t.kv_bytes,
                        "kv_gb_per_s": gbps / 1e9, "copy_gb_per_s": bw / 1e9, "ratio": gbps / bw,
                    }));
                }
            }
        }
    }
    Ok(json!({ "bench": "kernels", "device": device, "results": rows }))
}

#[cfg(not(feature = "cuda"))]
fn device_kernels(args: &KernelsBench) -> anyhow::Result<serde_json::Value> {
    let device = &args.common.model.device;
    crate::node::cuda_ordinal(device)?;
    anyhow::bail!(
        "--device {device}: this binary was built without CUDA support; rebuild with `--features cuda`"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scan(g: usize, rounds: &[(f64, f64)]) -> Scan {
        let rounds: Vec<Round> = rounds
            .iter()
            .map(|&(read, kv)| Round {
                read,
                kv,
                fma_after: 16.0,
            })
            .collect();
        Scan {
            dtype: KvDType::F16,
            g,
            d: 64,
            path: (KernelPath::Scalar, false),
            best: rounds.iter().map(|r| r.kv).fold(0.0, f64::max),
            rounds,
        }
    }

    /// A read-bound row's rounds are each held to their own probe (or the FMA bound, where
    /// lower), and the middle of those ratios is the paired ratio: a fast probe in one round
    /// and a fast pass in another do not pair up. An FMA-bound row is its best pass over the
    /// FMA bound.
    #[test]
    fn paired_ratio_holds_each_round_to_its_own_probe() {
        // Read-bound (a huge FMA rate): ratios 0.5, 0.25, 0.75.
        let s = scan(4, &[(10.0, 5.0), (20.0, 5.0), (40.0, 30.0)]);
        assert_eq!(s.paired(1e12), (0.5, 20.0));
        // Best over best would say 30 / 40.
        assert_eq!(s.best / s.roofline(40.0, 1e12), 0.75);
        // G=4 f16 is 2 FMAs a byte, so 60 FMAs/s allow 30 bytes/s: above the median probe
        // (20), below the last: ratios 0.5, 0.25, 1.0.
        assert_eq!(s.paired(60.0).0, 0.5);
        // 20 FMAs/s allow 10 bytes/s, below the median probe: the best pass over it.
        assert_eq!(s.paired(20.0), (3.0, 20.0));
        // No rounds: zeros, not a panic.
        assert_eq!(scan(1, &[]).paired(1.0), (0.0, 0.0));
    }

    /// The rate after a pass is reported only where FMAs bound the row, and holds the best
    /// pass to the FMAs the core had: 16 FMAs/s at 2 a byte allow 8 bytes/s.
    #[test]
    fn the_rate_after_a_pass_holds_fma_bound_rows_only() {
        let s = scan(4, &[(10.0, 5.0), (20.0, 6.0)]);
        assert_eq!(s.after_pass(100.0, 20.0), Some((16.0, 0.75)));
        // Reads bound it (50 bytes/s of FMAs against 10 of reads).
        assert_eq!(s.after_pass(10.0, 100.0), None);
        let mut products = scan(4, &[(10.0, 5.0)]);
        products.path.1 = true;
        assert_eq!(products.after_pass(100.0, 20.0), None);
    }
}
