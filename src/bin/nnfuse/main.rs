//! `nnfuse`: the command-line face of the library (info, plan, tune, demo).

mod demo;
mod info;
mod plan;
mod plan_conv;
mod tune;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "nnfuse",
    version,
    about = "Fast GPU paths for BatchNorm, batched GEMM and convolution",
    after_help = "Exit status: 0 done, 1 a check failed (demo) or a result was not stored (tune), \
                  2 invalid arguments or a failed call, 3 no GPU (no driver, no device or a CUDA \
                  library missing), 4 the step of demo --graph could not be captured."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Device, library versions and the effective configuration. Exit status: 0 all found,
    /// 2 invalid configuration, 3 no GPU or a CUDA library missing (one line each).
    Info,
    /// The BatchNorm plan for a shape (mode, layout, path), or with --conv the convolution plan
    /// (path, candidates, eligibility of every path), and every reason; needs no GPU.
    Plan(Box<plan::PlanArgs>),
    /// Search the fastest GEMM algorithm for one problem and store it in the tuning cache.
    /// Exit status: 0 searched (and stored, with NNFUSE_TUNING_CACHE), 1 not stored, 2 error,
    /// 3 no GPU.
    Tune(tune::TuneArgs),
    /// A ResNet-50 bottleneck block's training step through nnfuse, checked against f64 and
    /// timed against plain cuDNN. Exit status: 0 checked and timed, 1 check failed (or the
    /// --graph replay differs from eager), 2 error, 3 no GPU (the plans are printed), 4 --graph:
    /// the step could not be captured.
    Demo(demo::DemoArgs),
}

/// The log filter: `NNFUSE_LOG` when set (a filter that does not parse is an error naming the
/// variable, not silently the default), else `warn`.
fn log_filter() -> Result<tracing_subscriber::EnvFilter, String> {
    match std::env::var("NNFUSE_LOG") {
        Ok(v) if !v.trim().is_empty() => tracing_subscriber::EnvFilter::try_new(v.trim())
            .map_err(|e| format!("environment variable NNFUSE_LOG={v:?}: {e}")),
        Ok(_) | Err(std::env::VarError::NotPresent) => {
            Ok(tracing_subscriber::EnvFilter::new("warn"))
        }
        Err(std::env::VarError::NotUnicode(v)) => Err(format!(
            "environment variable NNFUSE_LOG={v:?}: not valid UTF-8"
        )),
    }
}

fn main() -> std::process::ExitCode {
    use std::io::IsTerminal;
    let filter = match log_filter() {
        Ok(f) => f,
        Err(e) => {
            eprintln!("nnfuse: error: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // Colour codes only for a terminal: a log file or a pipe gets plain text.
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Info => info::run(),
        Command::Plan(args) => plan::run(*args),
        Command::Tune(args) => tune::run(args),
        Command::Demo(args) => demo::run(args),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("nnfuse: error: {e:#}");
            std::process::ExitCode::from(if no_gpu(&e) { EXIT_NO_GPU } else { 2 })
        }
    }
}

/// The exit status of every subcommand that cannot run for want of a GPU (as the benches).
const EXIT_NO_GPU: u8 = 3;

/// Whether `e` says that this machine cannot run GPU work: no driver, no device, or a CUDA
/// library missing — not a bad argument or a failing call.
fn no_gpu(e: &anyhow::Error) -> bool {
    matches!(
        e.downcast_ref::<nnfuse::Error>(),
        Some(nnfuse::Error::NoDevice(_) | nnfuse::Error::LibraryMissing { .. })
    )
}

/// clap's parser for a count or an index: a negative number gets "must be ≥ 0" (clap alone
/// would take `-1` for an unknown flag). Flags using it set `allow_negative_numbers`.
fn non_negative<T: std::str::FromStr>(s: &str) -> Result<T, String> {
    let t = s.trim();
    if t.starts_with('-') && t[1..].chars().all(|c| c.is_ascii_digit()) && t.len() > 1 {
        return Err(format!("{t} must be ≥ 0"));
    }
    t.parse()
        .map_err(|_| format!("{t:?} is not a non-negative integer that fits"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn negative_counts_say_so() {
        assert_eq!(non_negative::<usize>("-1").unwrap_err(), "-1 must be ≥ 0");
        assert_eq!(non_negative::<usize>(" 7 ").unwrap(), 7);
        assert!(non_negative::<usize>("x")
            .unwrap_err()
            .contains("non-negative"));
        assert!(non_negative::<u64>("-").is_err());
    }
}
