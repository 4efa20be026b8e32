//! `decode-node`: the binary. Errors become exit codes here and only here.

use std::process::ExitCode;

use decode_node::cli::{Cli, Command};
use decode_node::commands;

fn init_tracing(format: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let b = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    if format == "json" {
        b.json().init();
    } else {
        b.init();
    }
}

/// Keeps large allocations (multi-MiB gRPC message buffers) in the heap for reuse instead of
/// fresh `mmap`s: each new mapping is page-faulted and zeroed by the kernel, which was a fifth
/// of KV ingest time. glibc caps the threshold at 32 MiB; memory stays bounded by peak use.
fn tune_allocator() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes allocator parameters; called before any thread starts.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 256 << 20);
    }
}

fn main() -> ExitCode {
    tune_allocator();
    let cli = Cli::parse_with_env();
    init_tracing(&cli.log_format);
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("decode-node: error: starting the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = rt.block_on(async move {
        match cli.command {
            Command::Serve(a) => commands::run_serve(a).await,
            Command::Prefill(a) => commands::run_prefill(a).await,
            Command::Generate(a) => commands::run_generate(a).await,
            Command::Demo(a) => commands::run_demo(a).await,
            Command::Bench(a) => decode_node::bench::run(a).await,
            Command::MakeModel(a) => commands::run_make_model(a),
            Command::Selftest(a) => commands::run_selftest(a).await,
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("decode-node: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
