//! `nnfuse plan --conv ...`: the convolution plan of one problem, with every reason — on any
//! machine (no GPU is touched).
//!
//! The policies, the workspace cap, the determinism switch and the cuDNN API come from the
//! library's environment variables ([`Config::from_env`]); the flags override them. Whether
//! cuDNN is present is detected (it can be loaded or not) unless `--cudnn present|absent` says
//! so. Whether it has the graph API is detected when it loads (version 9 or newer exporting the
//! backend entry points); otherwise a present cuDNN is assumed to be 9.19, which has it.

use clap::Args;
use serde_json::json;

use nnfuse::config::{
    parse_bool, ENV_CONV_ALGO, ENV_CONV_WORKSPACE_MB, ENV_CUDNN_API, ENV_DETERMINISTIC,
    ENV_WINOGRAD_GEMM,
};
use nnfuse::conv::{plan, ConvPlanRequest, ConvShape, Direction};
use nnfuse::{Config, ConvAlgoPolicy, CudnnApi, DType, Error, TensorFormat, WinogradGemmPolicy};

/// The convolution arguments of `nnfuse plan` (used with `--conv`).
#[derive(Args, Debug, Default)]
pub struct ConvArgs {
    /// Plan a convolution instead of a BatchNorm: n,c,h,w,k,r,s (batch, input channels, input
    /// height and width, output channels, filter height and width), e.g. 32,64,56,56,64,3,3.
    #[arg(
        long,
        value_name = "N,C,H,W,K,R,S",
        allow_hyphen_values = true,
        conflicts_with_all = [
            "shape", "axis", "fuse", "inference", "nhwc", "no_fusion", "cudnn_version",
            "bn_impl", "own_variant", "no_cudnn",
        ],
        help_heading = "Convolution (--conv)"
    )]
    pub conv: Option<String>,
    /// Stride: sh,sw (or one value for both) [default: 1,1].
    #[arg(
        long,
        value_name = "SH,SW",
        allow_hyphen_values = true,
        help_heading = "Convolution (--conv)"
    )]
    pub stride: Option<String>,
    /// Zero padding on both sides: ph,pw (or one value for both) [default: 0,0].
    #[arg(
        long,
        value_name = "PH,PW",
        allow_hyphen_values = true,
        help_heading = "Convolution (--conv)"
    )]
    pub pad: Option<String>,
    /// Dilation: dh,dw (or one value for both) [default: 1,1].
    #[arg(
        long,
        value_name = "DH,DW",
        allow_hyphen_values = true,
        help_heading = "Convolution (--conv)"
    )]
    pub dilation: Option<String>,
    /// Memory format: nchw (KCRS filter) or nhwc (KRSC filter) [default: nchw].
    #[arg(long, help_heading = "Convolution (--conv)")]
    pub format: Option<String>,
    /// Which computation: forward, backward-data, backward-filter [default: forward].
    #[arg(long, help_heading = "Convolution (--conv)")]
    pub direction: Option<String>,
    /// Winograd's batched multiply: auto, seed, tensor_core, direct, fused (overrides
    /// NNFUSE_WINOGRAD_GEMM). With --conv, --policy takes auto, cudnn, im2col, winograd,
    /// winograd_f2x3, winograd_f4x3, direct (overrides NNFUSE_CONV_ALGO).
    #[arg(long, value_name = "POLICY", help_heading = "Convolution (--conv)")]
    pub winograd_gemm: Option<String>,
    /// Only deterministic algorithms: true or false (overrides NNFUSE_DETERMINISTIC).
    #[arg(long, value_name = "BOOL", help_heading = "Convolution (--conv)")]
    pub deterministic: Option<String>,
    /// Cap on nnfuse's convolution scratch in MiB (overrides NNFUSE_CONV_WORKSPACE_MB).
    #[arg(
        long,
        value_name = "MIB",
        allow_hyphen_values = true,
        help_heading = "Convolution (--conv)"
    )]
    pub workspace_mb: Option<String>,
    /// Plan as if cuDNN were present or absent (default: whether it can be loaded here).
    #[arg(
        long,
        value_name = "present|absent",
        help_heading = "Convolution (--conv)"
    )]
    pub cudnn: Option<String>,
    /// Which cuDNN API the cuDNN candidate uses: auto, graph, legacy (overrides
    /// NNFUSE_CUDNN_API). The graph API is assumed where cuDNN is present and 9 or newer.
    #[arg(
        long,
        value_name = "auto|graph|legacy",
        help_heading = "Convolution (--conv)"
    )]
    pub cudnn_api: Option<String>,
}

/// Whether a present cuDNN has the graph API, and how that is known: detected when the library
/// loads, else assumed from the version nnfuse plans for (9.19, which has it).
fn graph_api(present: bool) -> (bool, &'static str) {
    if !present {
        return (false, "no cuDNN");
    }
    if nnfuse::context::cudnn_present() {
        return (
            nnfuse::internals::cudnn_graph::available().is_ok(),
            "detected",
        );
    }
    (true, "assumed (cuDNN 9.19)")
}

/// Parses one or two non-negative integers (`2` means `2,2`), naming `flag` on error.
fn parse_pair(flag: &str, s: &str) -> nnfuse::Result<(usize, usize)> {
    let bad = || {
        Error::invalid(
            flag,
            format!("{s:?} is not one or two non-negative integers (a,b)"),
        )
    };
    let v: Vec<usize> = s
        .split([',', 'x'])
        .map(|p| {
            crate::non_negative::<usize>(p).map_err(|why| {
                if p.trim().starts_with('-') {
                    Error::invalid(flag, why)
                } else {
                    bad()
                }
            })
        })
        .collect::<nnfuse::Result<_>>()?;
    match v.as_slice() {
        [a] => Ok((*a, *a)),
        [a, b] => Ok((*a, *b)),
        _ => Err(bad()),
    }
}

/// Parses `n,c,h,w,k,r,s`.
fn parse_conv(s: &str) -> nnfuse::Result<[usize; 7]> {
    let parts: Vec<&str> = s
        .trim()
        .trim_start_matches(['(', '['])
        .trim_end_matches([')', ']'])
        .split([',', 'x'])
        .collect();
    if parts.len() != 7 {
        return Err(Error::invalid(
            "--conv",
            format!(
                "{s:?} has {} values; give n,c,h,w,k,r,s (7), e.g. 32,64,56,56,64,3,3",
                parts.len()
            ),
        ));
    }
    let mut out = [0usize; 7];
    const NAMES: [&str; 7] = ["n", "c", "h", "w", "k", "r", "s"];
    for (i, p) in parts.iter().enumerate() {
        out[i] = crate::non_negative(p)
            .map_err(|why| Error::invalid(format!("--conv[{i}] ({})", NAMES[i]), why))?;
    }
    Ok(out)
}

fn parse_format(s: &str) -> nnfuse::Result<TensorFormat> {
    match s.trim().to_ascii_lowercase().as_str() {
        "nchw" => Ok(TensorFormat::Nchw),
        "nhwc" => Ok(TensorFormat::Nhwc),
        _ => Err(Error::invalid(
            "--format",
            format!("{s:?} is not nchw or nhwc"),
        )),
    }
}

/// Where a setting came from: the flag, the variable, or the default.
fn source(flag: bool, flag_name: &str, env: &str) -> String {
    if flag {
        return flag_name.to_string();
    }
    if std::env::var(env).is_ok_and(|s| !s.trim().is_empty()) {
        env.to_string()
    } else {
        "default".to_string()
    }
}

/// The problem and configuration the flags describe.
fn request(
    a: &ConvArgs,
    conv: &str,
    policy: Option<&str>,
) -> nnfuse::Result<(ConvShape, Config, Direction, bool, &'static str)> {
    let [n, c, h, w, k, r, s] = parse_conv(conv)?;
    let shape = ConvShape {
        n,
        c_in: c,
        h,
        w,
        c_out: k,
        kh: r,
        kw: s,
        stride: parse_pair("--stride", a.stride.as_deref().unwrap_or("1,1"))?,
        pad: parse_pair("--pad", a.pad.as_deref().unwrap_or("0,0"))?,
        dilation: parse_pair("--dilation", a.dilation.as_deref().unwrap_or("1,1"))?,
        format: parse_format(a.format.as_deref().unwrap_or("nchw"))?,
    };
    let mut config = Config::from_env()?;
    if let Some(p) = policy {
        config.conv_algo = p.parse::<ConvAlgoPolicy>().map_err(|_| {
            Error::invalid(
                "--policy",
                format!(
                    "{p:?} is not one of auto, cudnn, im2col, winograd, winograd_f2x3, \
                     winograd_f4x3, direct"
                ),
            )
        })?;
    }
    if let Some(p) = &a.winograd_gemm {
        config.winograd_gemm = p.parse::<WinogradGemmPolicy>().map_err(|_| {
            Error::invalid(
                "--winograd-gemm",
                format!("{p:?} is not one of auto, seed, tensor_core, direct, fused"),
            )
        })?;
    }
    if let Some(v) = &a.deterministic {
        config.deterministic = parse_bool("--deterministic", v).map_err(|_| {
            Error::invalid(
                "--deterministic",
                format!("{v:?} is not a boolean (true/false, 1/0, yes/no, on/off)"),
            )
        })?;
    }
    if let Some(v) = &a.workspace_mb {
        config.conv_workspace_mb = match v.trim().parse::<usize>() {
            Ok(m) if m >= 1 => m,
            _ => {
                return Err(Error::invalid(
                    "--workspace-mb",
                    format!("{v:?}: must be an integer ≥ 1"),
                ))
            }
        };
    }
    if let Some(v) = &a.cudnn_api {
        config.cudnn_api = v.parse::<CudnnApi>().map_err(|_| {
            Error::invalid(
                "--cudnn-api",
                format!("{v:?} is not one of auto, graph, legacy"),
            )
        })?;
    }
    let direction = a.direction.as_deref().unwrap_or("forward");
    let direction: Direction = direction.parse().map_err(|_| {
        Error::invalid(
            "--direction",
            format!("{direction:?} is not one of forward, backward-data, backward-filter"),
        )
    })?;
    let (present, present_source) = match a.cudnn.as_deref().map(|s| s.trim().to_ascii_lowercase())
    {
        Some(s) if s == "present" => (true, "--cudnn"),
        Some(s) if s == "absent" => (false, "--cudnn"),
        Some(s) => {
            return Err(Error::invalid(
                "--cudnn",
                format!("{s:?} is not present or absent"),
            ))
        }
        None => (nnfuse::context::cudnn_present(), "detected"),
    };
    Ok((shape, config, direction, present, present_source))
}

/// Prints the convolution plan (text or JSON); invalid input is an error (exit 2), and so is a
/// plan that no path can run (printed, then exit 2 naming why).
pub fn run(
    a: &ConvArgs,
    conv: &str,
    dtype: &str,
    policy: Option<&str>,
    as_json: bool,
) -> anyhow::Result<std::process::ExitCode> {
    let (shape, config, direction, present, present_source) = request(a, conv, policy)?;
    let dtype: DType = dtype.parse()?;
    let (graph, graph_source) = graph_api(present);
    let p = plan(&ConvPlanRequest {
        shape,
        dtype,
        direction,
        config: &config,
        cudnn_present: present,
        cudnn_graph: graph,
    })?;
    let sources = json!({
        "policy": source(policy.is_some(), "--policy", ENV_CONV_ALGO),
        "winograd_gemm": source(a.winograd_gemm.is_some(), "--winograd-gemm", ENV_WINOGRAD_GEMM),
        "deterministic": source(a.deterministic.is_some(), "--deterministic", ENV_DETERMINISTIC),
        "workspace_mb": source(a.workspace_mb.is_some(), "--workspace-mb", ENV_CONV_WORKSPACE_MB),
        "cudnn_present": present_source,
        "cudnn_api": source(a.cudnn_api.is_some(), "--cudnn-api", ENV_CUDNN_API),
        "cudnn_graph": graph_source,
    });
    if as_json {
        let mut j = p.to_json();
        if let Some(obj) = j.as_object_mut() {
            obj.insert("sources".into(), sources);
            obj.insert("cudnn_search".into(), json!(config.cudnn_search.name()));
        }
        println!("{}", serde_json::to_string(&j)?);
    } else {
        println!(
            "config: policy {} ({}), winograd_gemm {} ({}), deterministic {} ({}), workspace \
             cap {} MiB ({}), cuDNN {} ({}), cuDNN API {} ({}; graph API {}: {})",
            config.conv_algo,
            sources["policy"].as_str().unwrap_or_default(),
            config.winograd_gemm,
            sources["winograd_gemm"].as_str().unwrap_or_default(),
            config.deterministic,
            sources["deterministic"].as_str().unwrap_or_default(),
            config.conv_workspace_mb,
            sources["workspace_mb"].as_str().unwrap_or_default(),
            if present { "present" } else { "absent" },
            present_source,
            config.cudnn_api,
            sources["cudnn_api"].as_str().unwrap_or_default(),
            if graph { "available" } else { "unavailable" },
            graph_source,
        );
        print!("{p}");
    }
    if !p.runnable {
        // The plan is printed (it says why each path cannot run); the status tells a script.
        eprintln!(
            "nnfuse: NOT RUNNABLE: no path can compute this problem here: {}",
            p.fallback.as_deref().unwrap_or("every path is ineligible")
        );
        return Ok(std::process::ExitCode::from(2));
    }
    Ok(std::process::ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pairs_and_problems_parse() {
        assert_eq!(parse_pair("--stride", "2").unwrap(), (2, 2));
        assert_eq!(parse_pair("--pad", "1,0").unwrap(), (1, 0));
        assert_eq!(parse_pair("--pad", "3x1").unwrap(), (3, 1));
        for bad in ["", "1,2,3", "-1", "a"] {
            assert_eq!(
                parse_pair("--pad", bad).unwrap_err().argument(),
                Some("--pad"),
                "{bad}"
            );
        }
        assert_eq!(
            parse_conv("32,64,56,56,64,3,3").unwrap(),
            [32, 64, 56, 56, 64, 3, 3]
        );
        assert_eq!(parse_conv("1,2,3").unwrap_err().argument(), Some("--conv"));
        assert_eq!(
            parse_conv("1,2,3,4,q,6,7").unwrap_err().argument(),
            Some("--conv[4] (k)")
        );
        assert_eq!(parse_format("NHWC").unwrap(), TensorFormat::Nhwc);
        assert_eq!(
            parse_format("chwn").unwrap_err().argument(),
            Some("--format")
        );
    }
}
