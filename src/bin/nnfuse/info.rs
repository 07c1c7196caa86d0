//! `nnfuse info`: what nnfuse finds on this machine.

use std::process::ExitCode;

use nnfuse::context::{
    cublas_version, cublaslt_version, cudnn_present, cudnn_version, driver_version, Context,
};
use nnfuse::internals::kernels;
use nnfuse::{BnImpl, Config};

/// Prints one line per component, one `MISSING` line per missing piece; the exit status is 0
/// (everything found), 2 (invalid configuration) or 3 (no GPU, or a CUDA library missing).
pub fn run() -> anyhow::Result<ExitCode> {
    let mut missing = false;
    let mut line = |what: &str, r: Result<String, nnfuse::Error>| match r {
        Ok(v) => println!("{what:<10} {v}"),
        Err(e) => {
            missing = true;
            println!("{what:<10} MISSING: {e}");
        }
    };
    let driver = driver_version();
    let driver_found = driver.is_ok();
    line("driver", driver.map(|(a, b)| format!("CUDA {a}.{b}")));
    line(
        "cuDNN",
        cudnn_version().map(|v| format!("{}.{}.{} ({v})", v / 10000, (v / 100) % 100, v % 100)),
    );
    // The graph API is optional (the legacy calls remain): never a missing piece.
    let api = Config::from_env_once().map_or(nnfuse::CudnnApi::Auto, |c| c.cudnn_api);
    match (cudnn_present(), nnfuse::internals::cudnn_graph::available()) {
        (false, _) => println!("{:<10} unavailable (no cuDNN)", "graph API"),
        (true, Ok(_)) if api == nnfuse::CudnnApi::Legacy => println!(
            "{:<10} available, not used (NNFUSE_CUDNN_API=legacy): convolutions take the \
             legacy cuDNN calls",
            "graph API"
        ),
        (true, Ok(_)) => println!(
            "{:<10} available: cuDNN convolutions run as cached execution plans \
             (NNFUSE_CUDNN_API={api})",
            "graph API"
        ),
        (true, Err(e)) => println!(
            "{:<10} unavailable ({e}): cuDNN convolutions take the legacy calls",
            "graph API"
        ),
    }
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
    // Without the driver the device cannot be probed: that is the driver's line, not a second
    // missing piece.
    match &config {
        Ok(c) if driver_found => line(
            "device",
            Context::with_config(0, c.clone()).map(|ctx| ctx.info().to_string()),
        ),
        Ok(_) => println!("{:<10} not probed (no CUDA driver)", "device"),
        Err(_) => println!("{:<10} not probed (invalid configuration, below)", "device"),
    }
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
    if let Ok(c) = &config {
        let cc = driver_found
            .then(|| Context::with_config(0, c.clone()).ok())
            .flatten()
            .map(|ctx| ctx.info().compute_capability);
        print_caches(c, cc);
    }
    let config_ok = match config {
        Ok(c) => {
            println!("config:\n{}", indent(&c.to_string()));
            true
        }
        Err(e) => {
            println!("config     INVALID: {e}");
            // The exit status is 2: say why where errors go, not only in the report.
            eprintln!("nnfuse: invalid configuration: {e}");
            false
        }
    };
    if missing {
        eprintln!("nnfuse: something is missing (see above); GPU operations will fail");
    }
    Ok(if !config_ok {
        ExitCode::from(2)
    } else if missing {
        ExitCode::from(crate::EXIT_NO_GPU)
    } else {
        ExitCode::SUCCESS
    })
}

/// What the disk caches hold: per kernel file, whether its image for this device's architecture
/// (and this NVRTC) is cached (else the first use compiles it: seconds for the larger files);
/// the tuning file's entries per operation (GEMM; convolution per direction).
fn print_caches(c: &Config, cc: Option<(i32, i32)>) {
    match (c.kernel_cache_dir(), cc) {
        (None, _) => println!(
            "{:<10} no disk cache (NNFUSE_KERNEL_CACHE or NNFUSE_TUNING_CACHE unset): every \
             process compiles the kernels it uses",
            "kernels"
        ),
        (Some(dir), None) => println!(
            "{:<10} disk cache {} ({} files; no device to name the architecture)",
            "kernels",
            dir.display(),
            std::fs::read_dir(&dir).map_or(0, |d| d.count())
        ),
        (Some(dir), Some(cc)) => {
            let arch = kernels::arch_for(cc);
            let (mut cached, mut missing) = (Vec::new(), Vec::new());
            for f in kernels::ALL {
                let hit = kernels::ImageKey::new(f, &arch)
                    .is_ok_and(|k| dir.join(k.file_name()).is_file());
                if hit { &mut cached } else { &mut missing }.push(f.name);
            }
            println!(
                "{:<10} disk cache {} for {arch}: {} of {} files cached{}",
                "kernels",
                dir.display(),
                cached.len(),
                kernels::ALL.len(),
                if missing.is_empty() {
                    String::new()
                } else {
                    format!(" (compiled at first use: {})", missing.join(", "))
                }
            );
        }
    }
    let Some(path) = &c.tuning_cache else {
        println!(
            "{:<10} no tuning file (NNFUSE_TUNING_CACHE unset)",
            "tuning"
        );
        return;
    };
    let doc = std::fs::read_to_string(path)
        .ok()
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok());
    let Some(doc) = doc else {
        println!(
            "{:<10} {} (absent or unreadable: written after the first measurement)",
            "tuning",
            path.display()
        );
        return;
    };
    let entries = |sections: Option<&serde_json::Value>| -> Vec<serde_json::Value> {
        sections
            .and_then(|s| s.as_array())
            .into_iter()
            .flatten()
            .filter_map(|sec| sec.get("entries").and_then(|e| e.as_array()))
            .flatten()
            .cloned()
            .collect()
    };
    let gemm = entries(doc.get("sections")).len();
    let conv = entries(doc.get("conv").and_then(|c| c.get("sections")));
    let per = |d: &str| {
        conv.iter()
            .filter(|e| e.pointer("/key/direction").and_then(|v| v.as_str()) == Some(d))
            .count()
    };
    println!(
        "{:<10} {}: gemm {gemm} entries; conv {} entries (forward {}, backward_data {}, \
         backward_filter {}), all devices",
        "tuning",
        path.display(),
        conv.len(),
        per("forward"),
        per("backward_data"),
        per("backward_filter")
    );
}

fn indent(s: &str) -> String {
    s.lines()
        .map(|l| format!("  {l}\n"))
        .collect::<String>()
        .trim_end()
        .to_string()
}
