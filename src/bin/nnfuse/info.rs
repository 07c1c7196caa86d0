//! `nnfuse info`: what nnfuse finds on this machine.

use std::process::ExitCode;

use nnfuse::context::{
    cublas_version, cublaslt_version, cudnn_present, cudnn_version, driver_version, Context,
};
use nnfuse::internals::kernels;
use nnfuse::{BnImpl, Config};

/// Prints one line per component; exits 1 when the device or a library is missing.
pub fn run() -> anyhow::Result<ExitCode> {
    let mut ok = true;
    let mut line = |what: &str, r: Result<String, nnfuse::Error>| match r {
        Ok(v) => println!("{what:<10} {v}"),
        Err(e) => {
            ok = false;
            println!("{what:<10} MISSING: {e}");
        }
    };
    line(
        "driver",
        driver_version().map(|(a, b)| format!("CUDA {a}.{b}")),
    );
    line(
        "cuDNN",
        cudnn_version().map(|v| format!("{}.{}.{} ({v})", v / 10000, (v / 100) % 100, v % 100)),
    );
    line(
        "cuBLAS",
        cublas_version().map(|(a, b, c)| format!("{a}.{b}.{c}")),
    );
    line("cuBLASLt", cublaslt_version().map(|v| v.to_string()));
    line(
        "NVRTC",
        kernels::nvrtc_version().map(|(a, b)| format!("{a}.{b}")),
    );
    let config = Config::from_env_once();
    let device = match &config {
        Ok(c) => Context::with_config(0, c.clone()).map(|ctx| ctx.info().to_string()),
        Err(e) => Err(nnfuse::Error::NotSupported(format!("configuration: {e}"))),
    };
    line("device", device);
    // BatchNorm works without cuDNN (on nnfuse's own kernels): say which side runs.
    let bn = match (&config, cudnn_present()) {
        (_, false) => "nnfuse's own kernels for every shape (cuDNN not found)".to_string(),
        (Ok(c), true) if c.bn_impl == BnImpl::Own => {
            "nnfuse's own kernels for every shape (NNFUSE_BN_IMPL=own)".to_string()
        }
        (Ok(c), true) if c.bn_impl == BnImpl::Cudnn => {
            "cuDNN for every shape (NNFUSE_BN_IMPL=cudnn)".to_string()
        }
        _ => "cuDNN and nnfuse's own kernels, chosen per shape (NNFUSE_BN_IMPL=auto; \
              `nnfuse plan` shows the choice)"
            .to_string(),
    };
    println!("{:<10} {bn}", "BatchNorm");
    match config {
        Ok(c) => println!("config:\n{}", indent(&c.to_string())),
        Err(e) => {
            ok = false;
            println!("config     INVALID: {e}");
        }
    }
    if !ok {
        eprintln!("nnfuse: something is missing (see above); GPU operations will fail");
    }
    Ok(if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

fn indent(s: &str) -> String {
    s.lines()
        .map(|l| format!("  {l}\n"))
        .collect::<String>()
        .trim_end()
        .to_string()
}
