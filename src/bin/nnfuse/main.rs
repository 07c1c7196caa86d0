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
    about = "Fast GPU paths for BatchNorm, batched GEMM and convolution"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Device, library versions and the effective configuration.
    Info,
    /// The BatchNorm plan for a shape (mode, layout, path), or with --conv the convolution plan
    /// (path, candidates, eligibility of every path), and every reason; needs no GPU.
    Plan(Box<plan::PlanArgs>),
    /// Search the fastest GEMM algorithm for one problem and store it in the tuning cache.
    Tune(tune::TuneArgs),
    /// A ResNet-50 bottleneck block's training step through nnfuse, checked against f64 and
    /// timed against plain cuDNN. Exit status: 0 checked and timed, 1 check failed, 2 error,
    /// 3 no GPU (the plans are printed).
    Demo(demo::DemoArgs),
}

fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("NNFUSE_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
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
            std::process::ExitCode::from(2)
        }
    }
}
