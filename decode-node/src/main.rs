//! `decode-node`: the binary. Errors become exit codes here and only here.

use std::process::ExitCode;

use clap::Parser;
use decode_node::cli::{Cli, Command};

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Serve(_) => not_built("serve"),
        Command::Prefill(_) => not_built("prefill"),
        Command::Generate(_) => not_built("generate"),
        Command::Demo(_) => not_built("demo"),
        Command::Bench(_) => not_built("bench"),
        Command::MakeModel(_) => not_built("make-model"),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("decode-node: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn not_built(what: &str) -> anyhow::Result<()> {
    anyhow::bail!("`{what}` is not built yet in this version (see the open issues)")
}
