//! `nnfuse plan`: the BatchNorm plan for a shape, with every reason — on any machine.
//!
//! The NHWC flag, the mode policy, the fusion switch and the BatchNorm implementation come from
//! the same environment variables as the library ([`Config::from_env`]); `--nhwc`, `--policy`,
//! `--no-fusion` and `--impl` override them. No GPU is touched: the cuDNN version is
//! `--cudnn-version`, else the installed cuDNN's when the library can be loaded, else the newest
//! supported one (said "assumed"); `--no-cudnn` plans as on a machine without cuDNN (nnfuse's
//! own kernels for every shape).

use std::process::ExitCode;

use clap::Args;
use serde_json::json;

use nnfuse::batchnorm::{plan, Fuse, OwnVariantChoice, Phase, PlanRequest, ASSUMED_CUDNN_VERSION};
use nnfuse::config::{
    parse_bool, ENV_BN_IMPL, ENV_BN_MODE_POLICY, ENV_CUDNN_API, ENV_DISABLE_CUDNN_FUSION,
    ENV_ENABLE_NHWC, ENV_ONEFLOW_ENABLE_NHWC,
};
use nnfuse::{BnImpl, BnModePolicy, Config, CudnnApi, DType, Error};

/// Arguments of `nnfuse plan`.
#[derive(Args, Debug)]
pub struct PlanArgs {
    /// Tensor shape, row-major: dims separated by commas or `x` (16,32,112,112 or 16x32x112x112).
    #[arg(long, required_unless_present = "conv", allow_hyphen_values = true)]
    shape: Option<String>,
    /// Channel axis; negative counts from the end (-1: the last dim) [default: 1].
    #[arg(long, allow_negative_numbers = true)]
    axis: Option<i64>,
    /// Activation type: f32, f16, bf16.
    #[arg(long, default_value = "f32")]
    dtype: String,
    /// Activation after BatchNorm: none, relu, add-relu.
    #[arg(long, default_value = "none")]
    fuse: String,
    /// Plan the inference forward (running statistics) instead of training.
    #[arg(long)]
    inference: bool,
    /// Print exactly one JSON object on stdout.
    #[arg(long)]
    json: bool,
    /// Mode policy: oneflow, auto, fast (overrides NNFUSE_BN_MODE_POLICY); with --conv the
    /// convolution policy (see below).
    #[arg(long, value_name = "POLICY")]
    policy: Option<String>,
    /// NHWC flag: true or false (overrides NNFUSE_ENABLE_NHWC / ONEFLOW_ENABLE_NHWC).
    #[arg(long, value_name = "BOOL")]
    nhwc: Option<String>,
    /// Never plan cuDNN's fused path (as NNFUSE_DISABLE_CUDNN_FUSION=1).
    #[arg(long)]
    no_fusion: bool,
    /// cuDNN version to plan for: 91900 or 9.19.0 (default: the installed one, else 91900).
    #[arg(long, value_name = "VERSION")]
    cudnn_version: Option<String>,
    /// The convolution plan's arguments (`--conv` and the flags that go with it).
    #[command(flatten)]
    conv: crate::plan_conv::ConvArgs,
    /// BatchNorm implementation: auto, cudnn, own (overrides NNFUSE_BN_IMPL).
    #[arg(long = "impl", value_name = "IMPL")]
    bn_impl: Option<String>,
    /// Variant of nnfuse's own training kernels: auto, two-pass, persistent [default: auto].
    #[arg(long, value_name = "VARIANT")]
    own_variant: Option<String>,
    /// Plan as on a machine without cuDNN (every shape on nnfuse's own kernels).
    #[arg(long, conflicts_with_all = ["cudnn_version", "cudnn"])]
    no_cudnn: bool,
}

/// Where a setting came from.
fn source(flag: bool, flag_name: &str, env: &[&str]) -> String {
    if flag {
        return flag_name.to_string();
    }
    env.iter()
        .find(|v| std::env::var(v).is_ok_and(|s| !s.trim().is_empty()))
        .map_or_else(|| "default".to_string(), |v| v.to_string())
}

/// Parses `16,32,112,112`, `16x32x112x112`, `(16, 32, 112, 112)` or `[16,32]`.
fn parse_shape(s: &str) -> nnfuse::Result<Vec<usize>> {
    let inner = s
        .trim()
        .trim_start_matches(['(', '['])
        .trim_end_matches([')', ']'])
        .trim();
    if inner.is_empty() {
        return Err(Error::invalid(
            "shape",
            "is empty: give the dims separated by commas, e.g. --shape 16,32,112,112",
        ));
    }
    inner
        .split([',', 'x'])
        .enumerate()
        .map(|(i, d)| {
            crate::non_negative::<usize>(d).map_err(|why| {
                Error::invalid(format!("shape[{i}]"), format!("{why} (--shape {s:?})"))
            })
        })
        .collect()
}

/// Rejects a shape whose element count no machine can address, with the true count (the
/// library's own check would see a saturated product).
fn check_count(shape: &[usize]) -> nnfuse::Result<()> {
    let count = shape
        .iter()
        .try_fold(1u128, |p, &d| p.checked_mul(d as u128));
    match count {
        Some(c) if c <= usize::MAX as u128 => Ok(()),
        _ => Err(Error::invalid(
            "--shape",
            format!(
                "{} = {} elements, more than any tensor can hold",
                shape
                    .iter()
                    .map(usize::to_string)
                    .collect::<Vec<_>>()
                    .join(" x "),
                count.map_or_else(|| "over 2^128".to_string(), |c| c.to_string())
            ),
        )),
    }
}

/// The flags that only the other kind of plan reads: an error naming the first one given,
/// never silently ignored.
fn check_kind(args: &PlanArgs) -> nnfuse::Result<()> {
    let c = &args.conv;
    let conv_only = [
        ("--stride", c.stride.is_some()),
        ("--pad", c.pad.is_some()),
        ("--dilation", c.dilation.is_some()),
        ("--format", c.format.is_some()),
        ("--direction", c.direction.is_some()),
        ("--winograd-gemm", c.winograd_gemm.is_some()),
        ("--deterministic", c.deterministic.is_some()),
        ("--workspace-mb", c.workspace_mb.is_some()),
        ("--cudnn", c.cudnn.is_some()),
    ];
    match conv_only.iter().find(|(_, given)| *given) {
        Some((flag, _)) if c.conv.is_none() => Err(Error::invalid(
            *flag,
            format!(
                "applies to the convolution plan only (--conv N,C,H,W,K,R,S){}",
                if *flag == "--cudnn" {
                    "; the BatchNorm plan takes --no-cudnn or --cudnn-version"
                } else {
                    ""
                }
            ),
        )),
        _ => Ok(()),
    }
}

/// A negative axis counts from the end, as in PyTorch; out of range is left to the plan, which
/// names `axis`.
fn resolve_axis(axis: i64, rank: usize) -> nnfuse::Result<usize> {
    let resolved = if axis < 0 { rank as i64 + axis } else { axis };
    usize::try_from(resolved).map_err(|_| {
        Error::invalid(
            "axis",
            format!("{axis} is out of range for a shape of rank {rank}"),
        )
    })
}

/// Parses `91900` or `9.19.0` (cuDNN numbers versions major*1000 + minor*100 + patch before 9,
/// major*10000 + minor*100 + patch from 9 on).
fn parse_cudnn_version(s: &str) -> nnfuse::Result<usize> {
    let bad = || {
        Error::invalid(
            "--cudnn-version",
            format!("{s:?} is not a cuDNN version such as 91900 or 9.19.0"),
        )
    };
    let s = s.trim();
    let parts: Vec<&str> = s.split('.').collect();
    let v = match parts.as_slice() {
        [n] => n.parse().map_err(|_| bad()),
        [major, minor, patch] => {
            let [major, minor, patch] = [major, minor, patch].map(|p| p.parse::<usize>().ok());
            match (major, minor, patch) {
                (Some(a), Some(b), Some(c)) if b < 100 && c < 100 && (a >= 9 || b < 10) => {
                    Ok(if a >= 9 {
                        a * 10_000 + b * 100 + c
                    } else {
                        a * 1000 + b * 100 + c
                    })
                }
                _ => Err(bad()),
            }
        }
        _ => Err(bad()),
    }?;
    // 1.0.0-8.9.99 in the old numbering, 9.0.0 on in the new; anything else names no release.
    if (1000..9000).contains(&v) || (90_000..1_000_000).contains(&v) {
        Ok(v)
    } else {
        Err(Error::invalid(
            "--cudnn-version",
            format!(
                "{s:?} is no cuDNN release: versions before 9 are major*1000 + minor*100 + patch \
                 (1000 to 8999, e.g. 8907), from 9 on major*10000 + minor*100 + patch (e.g. 91900)"
            ),
        ))
    }
}

/// `9.19.0` for 91900, `7.4.1` for 7401.
fn version_string(v: usize) -> String {
    if v >= 90_000 {
        format!("{}.{}.{}", v / 10_000, (v / 100) % 100, v % 100)
    } else {
        format!("{}.{}.{}", v / 1000, (v / 100) % 10, v % 100)
    }
}

/// The cuDNN version to plan for, and where it came from.
fn cudnn_version(given: Option<&str>, no_cudnn: bool) -> nnfuse::Result<(usize, &'static str)> {
    if let Some(s) = given {
        return Ok((parse_cudnn_version(s)?, "given"));
    }
    if no_cudnn {
        return Ok((ASSUMED_CUDNN_VERSION, "none (--no-cudnn)"));
    }
    if nnfuse::context::cudnn_present() {
        if let Ok(v) = nnfuse::context::cudnn_version() {
            return Ok((v, "installed"));
        }
    }
    Ok((ASSUMED_CUDNN_VERSION, "assumed"))
}

/// Prints the plan (text or JSON); invalid input is an error (exit 2, message on stderr).
pub fn run(args: PlanArgs) -> anyhow::Result<ExitCode> {
    check_kind(&args)?;
    if let Some(conv) = &args.conv.conv {
        let policy = args.policy.as_deref();
        return crate::plan_conv::run(&args.conv, conv, &args.dtype, policy, args.json);
    }
    let mut config = Config::from_env()?;
    if let Some(p) = &args.policy {
        config.bn_mode_policy = p.parse::<BnModePolicy>().map_err(|_| {
            Error::invalid(
                "--policy",
                format!("{p:?} is not one of oneflow, auto, fast"),
            )
        })?;
    }
    if let Some(v) = &args.nhwc {
        config.enable_nhwc = parse_bool("--nhwc", v).map_err(|_| {
            Error::invalid(
                "--nhwc",
                format!("{v:?} is not a boolean (true/false, 1/0, yes/no, on/off)"),
            )
        })?;
    }
    if args.no_fusion {
        config.disable_cudnn_fusion = true;
    }
    if let Some(v) = &args.conv.cudnn_api {
        config.cudnn_api = v.parse::<CudnnApi>().map_err(|_| {
            Error::invalid(
                "--cudnn-api",
                format!("{v:?} is not one of auto, graph, legacy"),
            )
        })?;
    }
    if let Some(i) = &args.bn_impl {
        config.bn_impl = i.parse::<BnImpl>().map_err(|_| {
            Error::invalid("--impl", format!("{i:?} is not one of auto, cudnn, own"))
        })?;
    }
    let own_variant = args.own_variant.as_deref().unwrap_or("auto");
    let own_variant: OwnVariantChoice = own_variant.parse().map_err(|_| {
        Error::invalid(
            "--own-variant",
            format!("{own_variant:?} is not one of auto, two-pass, persistent"),
        )
    })?;
    let shape = parse_shape(args.shape.as_deref().unwrap_or_default())?;
    check_count(&shape)?;
    let axis = resolve_axis(args.axis.unwrap_or(1), shape.len())?;
    let dtype: DType = args.dtype.parse()?;
    let fuse: Fuse = args.fuse.parse()?;
    let phase = if args.inference {
        Phase::Inference
    } else {
        Phase::Training
    };
    let (version, version_source) = cudnn_version(args.cudnn_version.as_deref(), args.no_cudnn)?;
    let cudnn_available =
        !args.no_cudnn && (args.cudnn_version.is_some() || nnfuse::context::cudnn_present());
    let p = plan(&PlanRequest {
        shape: &shape,
        axis,
        dtype,
        fuse,
        phase,
        config: &config,
        cudnn_version: version,
        cudnn_available,
        own_variant,
    })?;

    let sources = json!({
        "policy": source(args.policy.is_some(), "--policy", &[ENV_BN_MODE_POLICY]),
        "enable_nhwc": source(args.nhwc.is_some(), "--nhwc", &[ENV_ENABLE_NHWC, ENV_ONEFLOW_ENABLE_NHWC]),
        "disable_cudnn_fusion": source(args.no_fusion, "--no-fusion", &[ENV_DISABLE_CUDNN_FUSION]),
        "bn_impl": source(args.bn_impl.is_some(), "--impl", &[ENV_BN_IMPL]),
        "cudnn_api": source(args.conv.cudnn_api.is_some(), "--cudnn-api", &[ENV_CUDNN_API]),
        "cudnn_version": version_source,
    });
    if args.json {
        let mut j = p.to_json();
        if let Some(obj) = j.as_object_mut() {
            obj.insert("shape".into(), json!(shape));
            obj.insert("axis".into(), json!(axis));
            obj.insert(
                "disable_cudnn_fusion".into(),
                json!(config.disable_cudnn_fusion),
            );
            obj.insert("sources".into(), sources);
        }
        println!("{}", serde_json::to_string(&j)?);
    } else {
        let why = match version_source {
            "given" => "given by --cudnn-version",
            "installed" => "the installed cuDNN",
            "none (--no-cudnn)" => "planned without cuDNN (--no-cudnn)",
            _ => "assumed: no cuDNN found here, so the newest supported",
        };
        println!("shape {shape:?}, axis {axis}");
        println!("cuDNN {} ({version}), {why}", version_string(version));
        println!(
            "config: policy {} ({}), impl {} ({}), NHWC flag {} ({}), cuDNN fusion {} ({})",
            config.bn_mode_policy,
            sources["policy"].as_str().unwrap_or_default(),
            config.bn_impl,
            sources["bn_impl"].as_str().unwrap_or_default(),
            if config.enable_nhwc { "on" } else { "off" },
            sources["enable_nhwc"].as_str().unwrap_or_default(),
            if config.disable_cudnn_fusion {
                "disabled"
            } else {
                "allowed"
            },
            sources["disable_cudnn_fusion"].as_str().unwrap_or_default(),
        );
        println!(
            "cuDNN API: {} ({})",
            config.cudnn_api,
            sources["cudnn_api"].as_str().unwrap_or_default()
        );
        println!("{p}");
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_parse() {
        assert_eq!(parse_shape("16,32,112,112").unwrap(), [16, 32, 112, 112]);
        assert_eq!(parse_shape("16x32x112x112").unwrap(), [16, 32, 112, 112]);
        assert_eq!(parse_shape(" (2, 3) ").unwrap(), [2, 3]);
        assert_eq!(parse_shape("[7]").unwrap(), [7]);
        assert_eq!(parse_shape("2,x").unwrap_err().argument(), Some("shape[1]"));
        assert_eq!(
            parse_shape("2,-1").unwrap_err().argument(),
            Some("shape[1]")
        );
        assert_eq!(parse_shape("").unwrap_err().argument(), Some("shape"));
        assert_eq!(
            parse_shape("2,,3").unwrap_err().argument(),
            Some("shape[1]")
        );
    }

    #[test]
    fn negative_axes_count_from_the_end() {
        assert_eq!(resolve_axis(-1, 4).unwrap(), 3);
        assert_eq!(resolve_axis(-4, 4).unwrap(), 0);
        assert_eq!(resolve_axis(1, 4).unwrap(), 1);
        assert_eq!(resolve_axis(-5, 4).unwrap_err().argument(), Some("axis"));
    }

    #[test]
    fn versions_parse_both_numberings() {
        assert_eq!(parse_cudnn_version("91900").unwrap(), 91900);
        assert_eq!(parse_cudnn_version("9.19.0").unwrap(), 91900);
        assert_eq!(parse_cudnn_version("7.4.1").unwrap(), 7401);
        assert_eq!(parse_cudnn_version("8.9.7").unwrap(), 8907);
        assert_eq!(version_string(91900), "9.19.0");
        assert_eq!(version_string(7401), "7.4.1");
        assert_eq!(version_string(8907), "8.9.7");
        for bad in [
            "9.19", "nine", "7.14.1", "9.1.100", "", "0", "0.0.0", "999", "9000", "12345",
            "1000000",
        ] {
            let e = parse_cudnn_version(bad).unwrap_err();
            assert_eq!(e.argument(), Some("--cudnn-version"), "{bad}");
        }
    }
}
