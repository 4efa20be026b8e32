//! The subcommands' bodies; `main` maps their errors to exit codes.

use std::io::{IsTerminal, Write};
use std::time::Instant;

use anyhow::Context;
use attention::KvDType;
use decode_node_proto::v1 as pb;

use crate::cli::{DemoArgs, GenerateArgs, MakeModelArgs, PrefillArgs, SelftestArgs, ServeArgs};
use crate::client;
use crate::model::random::{SplitMix, preset, random_weights};
use crate::model::{Arch, ModelConfig};
use crate::node::Node;
use crate::service::{InProcess, serve};

/// Resolves on SIGTERM or SIGINT.
pub async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        ) {
            (Ok(mut term), Ok(mut int)) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = int.recv() => {}
                }
            }
            _ => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// `serve`.
pub async fn run_serve(args: ServeArgs) -> anyhow::Result<()> {
    serve(args, shutdown_signal(), None).await
}

/// A prompt's token ids from text or a synthetic length.
fn prompt_ids(
    node: &Node,
    text: Option<&str>,
    tokens: Option<u32>,
    seed: u64,
) -> anyhow::Result<Vec<u32>> {
    match (text, tokens) {
        (Some(t), _) => Ok(node.model.tokenizer.encode(t)?),
        (None, Some(n)) => {
            anyhow::ensure!(n > 0, "--prompt-tokens must be > 0");
            let vocab = node.model.model.cfg.vocab_size as u64;
            let mut rng = SplitMix(seed);
            Ok((0..n)
                .map(|_| (rng.next_u64() % vocab.clamp(1, 256)) as u32)
                .collect())
        }
        (None, None) => anyhow::bail!("give --prompt TEXT or --prompt-tokens N"),
    }
}

fn new_request_id() -> String {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!(
        "req-{:016x}",
        SplitMix(t as u64 ^ std::process::id() as u64).next_u64()
    )
}

/// `prefill`: a reference prefill node.
pub async fn run_prefill(args: PrefillArgs) -> anyhow::Result<()> {
    let node = Node::build(&args.model)?;
    let ids = prompt_ids(&node, args.prompt.as_deref(), args.prompt_tokens, 1)?;
    let id = args.request_id.clone().unwrap_or_else(new_request_id);
    let model = node.model.clone();
    let dtype = node.wire_dtype();
    let idc = id.clone();
    let mut kv = tokio::task::spawn_blocking(move || client::prefill_kv(&model, &ids, &idc, dtype))
        .await??;
    kv.header.reuse_prefix = args.reuse_prefix;
    let total: u64 = kv
        .layers
        .iter()
        .map(|(k, v)| (k.len() + v.len()) as u64)
        .sum();
    let bar = std::io::stderr().is_terminal().then(|| {
        let b = indicatif::ProgressBar::new(total);
        if let Ok(style) = indicatif::ProgressStyle::with_template(
            "{bar:40} {bytes}/{total_bytes} {bytes_per_sec}",
        ) {
            b.set_style(style);
        }
        b
    });
    let channel = client::connect_with(&args.target, &args.tls).await?;
    let token = client::read_token(args.auth_token_file.as_deref())?;
    let ack = client::push(channel, &kv, token, |n| {
        if let Some(b) = &bar {
            b.set_position(n);
        }
    })
    .await?;
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    tracing::info!(
        bytes = ack.bytes_received,
        chunks = ack.chunks_received,
        reused_tokens = ack.reused_tokens,
        lease = %ack.lease,
        "pushed"
    );
    println!("{id}");
    Ok(())
}

/// `generate`: streams a generation to stdout.
pub async fn run_generate(args: GenerateArgs) -> anyhow::Result<()> {
    let channel = client::connect_with(&args.target, &args.tls).await?;
    let token = client::read_token(args.auth_token_file.as_deref())?;
    let req = pb::GenerateRequest {
        request_id: args.request_id.clone(),
        sampling: Some(pb::SamplingParams {
            temperature: args.temperature,
            top_p: args.top_p,
            top_k: args.top_k,
            seed: args.seed,
            repetition_penalty: args.repetition_penalty,
            presence_penalty: args.presence_penalty,
            frequency_penalty: args.frequency_penalty,
        }),
        max_new_tokens: args.max_new_tokens,
        stop_token_ids: Vec::new(),
        ignore_eos: args.ignore_eos,
        kv_timeout_ms: args.kv_timeout_ms,
        lease: args.lease.clone().unwrap_or_default(),
        min_tokens: args.min_tokens,
        stop: args.stop.clone(),
        top_logprobs: 0,
    };
    let mut stdout = std::io::stdout();
    let ids = args.ids;
    let out = client::generate(channel, token, req, |t| {
        if ids {
            let _ = writeln!(stdout, "{}", t.id);
        } else {
            let _ = write!(stdout, "{}", t.text);
        }
        let _ = stdout.flush();
    })
    .await?;
    if !ids {
        println!();
    }
    if let Some(f) = out.finish {
        eprintln!(
            "finish: {:?}, {} tokens",
            pb::FinishReason::try_from(f.reason).unwrap_or(pb::FinishReason::Unspecified),
            f.generated_tokens
        );
    }
    Ok(())
}

/// `demo`: serve, prefill and generate in one process on the embedded model.
pub async fn run_demo(args: DemoArgs) -> anyhow::Result<()> {
    let mut serve_args = InProcess::loopback_args(args.model.clone(), 256 << 20, 64 << 20);
    serve_args.drain_timeout = 5.0;
    let server = InProcess::start(serve_args).await?;
    let target = server.target();
    let node = Node::build(&args.model)?;
    let ids = node.model.tokenizer.encode(&args.prompt)?;
    let dtype = node.wire_dtype();
    let model = node.model.clone();
    let t0 = Instant::now();
    let kv = tokio::task::spawn_blocking(move || client::prefill_kv(&model, &ids, "demo-1", dtype))
        .await??;
    let prefill_s = t0.elapsed().as_secs_f64();
    let first = node
        .model
        .tokenizer
        .text_state(&[])
        .step(&node.model.tokenizer, kv.header.next_token_id);
    let channel = client::connect(&target).await?;
    let ack = client::push(channel.clone(), &kv, None, |_| {}).await?;
    println!("prompt: {}", args.prompt);
    print!("output: {first}");
    let _ = std::io::stdout().flush();
    let t1 = Instant::now();
    let req = pb::GenerateRequest {
        request_id: "demo-1".into(),
        sampling: Some(pb::SamplingParams::default()),
        max_new_tokens: args.max_new_tokens,
        ..Default::default()
    };
    let out = client::generate(channel, None, req, |t| {
        print!("{}", t.text);
        let _ = std::io::stdout().flush();
    })
    .await?;
    let gen_s = t1.elapsed().as_secs_f64();
    println!();
    let f = out.finish.unwrap_or_default();
    let s = f.stats.unwrap_or_default();
    println!("---");
    println!(
        "prefill: {} tokens in {:.3}s, pushed {} KB ({} chunks)",
        kv.header.num_tokens,
        prefill_s,
        ack.bytes_received / 1024,
        ack.chunks_received
    );
    println!(
        "decode:  {} tokens in {:.3}s = {:.1} tokens/s, finish {:?}, first token {:.1} ms",
        f.generated_tokens,
        gen_s,
        f.generated_tokens as f64 / gen_s.max(1e-9),
        pb::FinishReason::try_from(f.reason).unwrap_or(pb::FinishReason::Unspecified),
        s.first_token_seconds * 1e3
    );
    let prediction = if node.attention.mode == attention::Mode::Scout && node.attention.precompute {
        format!(
            "prediction hit ratio {:.1}%",
            s.prediction_hit_ratio * 100.0
        )
    } else {
        "no layer-ahead prediction".to_string()
    };
    println!(
        "attention: mode {}, scorer {}, block {}, budget {} tokens; CPU share {:.1}%, recalled blocks {}, {prediction}",
        node.attention.mode.name(),
        node.attention.scorer.name(),
        node.layout.geom.block_size,
        node.attention.budget_tokens,
        s.cpu_attention_ratio * 100.0,
        s.recalled_blocks,
    );
    let context = kv.header.num_tokens as usize + f.generated_tokens as usize;
    if context <= node.attention.budget_tokens {
        println!(
            "(the whole {context}-token context fits the {}-token budget, so every block is selected and \
             resident; try --budget-tokens 32 --block-size 8 to see the CPU share and recall at work)",
            node.attention.budget_tokens
        );
    }
    server.stop().await
}

/// `make-model`: random weights in HF format.
pub fn run_make_model(a: MakeModelArgs) -> anyhow::Result<()> {
    let arch = Arch::parse(&a.arch).with_context(|| format!("--arch {:?}", a.arch))?;
    let dtype = KvDType::parse(&a.dtype)
        .filter(|d| !d.scaled())
        .with_context(|| format!("--dtype {:?}: expected f32, f16 or bf16", a.dtype))?;
    let name = a.preset.as_deref().unwrap_or("tiny");
    let mut cfg: ModelConfig = preset(name, arch).with_context(|| {
        format!("--preset {name:?}: expected tiny, small, qwen3-8b, qwen3-14b or llama3-8b")
    })?;
    if let Some(v) = a.hidden_size {
        cfg.hidden_size = v;
    }
    if let Some(v) = a.intermediate_size {
        cfg.intermediate_size = v;
    }
    if let Some(v) = a.num_layers {
        cfg.num_layers = v;
    }
    if let Some(v) = a.num_heads {
        cfg.num_heads = v;
        cfg.head_dim = a.head_dim.unwrap_or(cfg.hidden_size / v.max(1));
    }
    if let Some(v) = a.num_kv_heads {
        cfg.num_kv_heads = v;
    }
    if let Some(v) = a.head_dim {
        cfg.head_dim = v;
    }
    if let Some(v) = a.vocab_size {
        cfg.vocab_size = v;
    }
    if let Some(v) = a.tie_word_embeddings {
        cfg.tie_word_embeddings = v;
    }
    if let Some(v) = a.rope_theta {
        cfg.rope_theta = v;
    }
    cfg.torch_dtype = match dtype {
        KvDType::F32 => "float32",
        KvDType::F16 => "float16",
        KvDType::Bf16 => "bfloat16",
        // Refused above.
        KvDType::I8 | KvDType::F8E4M3 => "float32",
    }
    .into();
    cfg.eos_token_ids.retain(|e| (*e as usize) < cfg.vocab_size);
    cfg.bos_token_id = cfg.bos_token_id.filter(|b| (*b as usize) < cfg.vocab_size);
    // Round-trip through JSON so the written config is validated like a loaded one.
    let json = serde_json::to_string_pretty(&cfg.to_json())?;
    ModelConfig::from_json(&json).context("the requested geometry is invalid")?;
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    std::fs::write(a.out.join("config.json"), json)?;
    random_weights(&cfg, a.seed, dtype).save(&a.out.join("model.safetensors"))?;
    println!("{}", a.out.display());
    Ok(())
}

/// `selftest`: device kernels against the CPU, then end-to-end decodes against the CPU backend.
pub async fn run_selftest(args: SelftestArgs) -> anyhow::Result<()> {
    let device = args.model.device.clone();
    anyhow::ensure!(
        device != "cpu",
        "selftest compares a device backend with the CPU backend: pass --device cuda[:N]"
    );
    let mut failed = 0usize;
    failed += kernel_checks(&device)?;
    // End to end: the same pushed KV decoded greedily on the CPU and on the device.
    let mut cpu_args = args.model.clone();
    cpu_args.device = "cpu".into();
    let cpu_node = Node::build(&cpu_args)?;
    let vocab = cpu_node.model.model.cfg.vocab_size as u64;
    let mut r = SplitMix(0x5e1f);
    let ids: Vec<u32> = (0..args.prompt_tokens.max(1))
        .map(|_| (r.next_u64() % vocab) as u32)
        .collect();
    let dtype = cpu_node.wire_dtype();
    let model = cpu_node.model.clone();
    let kv = tokio::task::spawn_blocking(move || client::prefill_kv(&model, &ids, "st", dtype))
        .await??;
    // `full`, then `scout` with a budget small enough that most blocks go to the CPU and
    // recall runs every step.
    let scout = |m: &mut crate::cli::ModelArgs| {
        m.attention = "scout".into();
        // The same scorer on both (`auto` is the sketch on a GPU only).
        m.block_scorer = "sparq".into();
        m.block_size = 16;
        m.budget_tokens = 128;
        m.device_blocks = 4;
        m.recall_threshold = 0.0;
        // No loan of spare device KV, which would hold every block.
        m.spare_device_kv = "off".into();
    };
    let full = |m: &mut crate::cli::ModelArgs| m.attention = "full".into();
    // Scout again with the sketch scorer: a device scores from the sketch it keeps, the
    // CPU from the keys it reads (the same scores up to float rounding). With the real query
    // only, as a device that scores makes no prediction.
    let sketch = |m: &mut crate::cli::ModelArgs| {
        scout(m);
        m.block_scorer = "sketch".into();
        m.exact = true;
    };
    // Scout lent the spare device KV (of all the free memory): its slot table grows to every
    // block of the request, the blocks the first plan leaves on the host go up within the
    // recall budget (at this size, after the first step), and the CPU part is empty after.
    let whole = |m: &mut crate::cli::ModelArgs| {
        scout(m);
        m.spare_device_kv = "on".into();
    };
    // Both: with DECODE_NODE_DEVICE_PLAN=on, once the prompt is up the device plans each
    // layer alone (its picks laid into the attention's list there, #21 item 4).
    let sketch_whole = |m: &mut crate::cli::ModelArgs| {
        sketch(m);
        m.spare_device_kv = "on".into();
    };
    type Setting<'a> = &'a dyn Fn(&mut crate::cli::ModelArgs);
    // Device KV: 1 GiB, or in the last cases the default (`auto`: the device's free memory)
    // and room for the request's share, the reserve (as much again) and half its other
    // blocks: a loan of part of them, which its slot table grows to, and within which it
    // keeps the blocks it attended most recently.
    let (gib, auto) = (1 << 30, crate::cli::DEVICE_KV_AUTO);
    let part = {
        let mut m = args.model.clone();
        scout(&mut m);
        let request = crate::engine::admission::Request {
            geom: attention::BlockGeometry {
                block_size: m.block_size as usize,
                ..cpu_node.layout.geom
            },
            num_layers: cpu_node.model.model.cfg.num_layers,
            num_tokens: kv.header.num_tokens as usize,
            prompt_bytes: 0,
            max_new_tokens: args.tokens.max(1),
        };
        let share = request.share(
            cpu_node.model.model.cfg.max_context(),
            m.device_blocks as usize,
            None,
        );
        2 * share.base_bytes() + share.per_block * ((share.whole - share.base) / 2) as u64
    };
    // (name, setting, device KV, requests decoded at once: three make batches of 1 to 3,
    // which a device running CUDA graphs pads to buckets of 1, 2 and 4 rows)
    let cases: [(&str, Setting<'_>, u64, usize); 8] = [
        ("full", &full, gib, 1),
        ("scout", &scout, gib, 1),
        ("scout, sketch scorer", &sketch, gib, 1),
        ("scout, spare device KV lent (every block)", &whole, auto, 1),
        (
            "scout, spare device KV lent (half the blocks)",
            &whole,
            part,
            1,
        ),
        (
            "scout, sketch scorer, spare device KV lent (every block)",
            &sketch_whole,
            auto,
            1,
        ),
        ("full, three requests at once", &full, gib, 3),
        ("scout, three requests at once", &scout, gib, 3),
    ];
    for (name, set, device_kv, requests) in cases {
        let mut outs = Vec::new();
        for dev in ["cpu", device.as_str()] {
            let mut m = args.model.clone();
            m.device = dev.into();
            set(&mut m);
            let server = InProcess::start(InProcess::loopback_args(m, 1 << 30, device_kv)).await?;
            let ch = client::connect(&server.target()).await?;
            let mut gens = Vec::with_capacity(requests);
            for r in 0..requests {
                let mut push = kv.clone();
                push.header.request_id = format!("st-{name}-{dev}-{r}");
                client::push(ch.clone(), &push, None, |_| {}).await?;
                let req = pb::GenerateRequest {
                    request_id: push.header.request_id.clone(),
                    sampling: Some(pb::SamplingParams::default()),
                    max_new_tokens: args.tokens.max(1),
                    ignore_eos: true,
                    ..Default::default()
                };
                let ch = ch.clone();
                gens.push(tokio::spawn(async move {
                    client::generate(ch, None, req, |_| {}).await
                }));
            }
            let mut ids = Vec::with_capacity(requests);
            for g in gens {
                ids.push(g.await.map_err(anyhow::Error::from).and_then(|r| r));
            }
            server.stop().await?;
            outs.push(
                ids.into_iter()
                    .map(|r| r.map(|o| o.ids))
                    .collect::<anyhow::Result<Vec<_>>>()?,
            );
        }
        let same = outs[0] == outs[1];
        let agree = outs[0]
            .iter()
            .flatten()
            .zip(outs[1].iter().flatten())
            .take_while(|(a, b)| a == b)
            .count();
        println!(
            "{} decode {name} {} prompt tokens, {} generated: {agree}/{} tokens equal to the CPU backend's",
            if same { "PASS" } else { "FAIL" },
            kv.header.num_tokens,
            outs[1].iter().map(Vec::len).sum::<usize>(),
            outs[0].iter().map(Vec::len).sum::<usize>()
        );
        if !same {
            failed += 1;
        }
    }
    anyhow::ensure!(failed == 0, "{failed} selftest checks failed");
    println!("selftest passed on {device}");
    Ok(())
}

#[cfg(feature = "cuda")]
fn kernel_checks(device: &str) -> anyhow::Result<usize> {
    let ordinal = crate::node::cuda_ordinal(device)?;
    let backend = crate::backend::cuda::CudaBackend::new(ordinal)
        .with_context(|| format!("--device {device}"))?;
    let mut failed = 0;
    let mut checks = crate::backend::cuda::selftest::run(&backend);
    drop(backend);
    checks.push(crate::backend::cuda::selftest::check_device_residual(
        ordinal,
    ));
    checks.push(crate::backend::cuda::selftest::check_device_picks(ordinal));
    checks.push(crate::backend::cuda::selftest::check_resident_layers(
        ordinal,
    ));
    for c in checks {
        let verdict = if c.passed() { "PASS" } else { "FAIL" };
        match &c.error {
            Some(e) => println!("{verdict} {:<48} error: {e}", c.name),
            None => println!(
                "{verdict} {:<48} max rel err {:.2e} (tolerance {:.0e})",
                c.name, c.max_rel_err, c.tolerance
            ),
        }
        failed += usize::from(!c.passed());
    }
    Ok(failed)
}

#[cfg(not(feature = "cuda"))]
fn kernel_checks(device: &str) -> anyhow::Result<usize> {
    anyhow::bail!(
        "--device {device}: this binary was built without CUDA support; rebuild with `--features cuda`"
    )
}
