//! Settings that steer nnfuse's choices: read once from the environment, overridable in code.
//!
//! | variable | values | default | effect |
//! |---|---|---|---|
//! | `NNFUSE_ENABLE_NHWC` (alias `ONEFLOW_ENABLE_NHWC`) | boolean | false | BatchNorm uses `SPATIAL_PERSISTENT` for inputs of rank > 2, as OneFlow does with its flag |
//! | `NNFUSE_BN_MODE_POLICY` | `oneflow`, `auto`, `fast` | `auto` | how the cuDNN BatchNorm mode is chosen (see [`BnModePolicy`]) |
//! | `NNFUSE_DISABLE_CUDNN_FUSION` | boolean | false | never use cuDNN's fused BN+ReLU / BN+Add+ReLU |
//! | `NNFUSE_GEMM_SEARCH` | boolean | true | time GEMM algorithm candidates; off = cuBLAS default |
//! | `NNFUSE_TUNING_CACHE` | a file path | unset | where GEMM search results persist |
//!
//! Booleans parse like OneFlow's `ParseBooleanFromEnv`: `1/0`, `true/false`, `yes/no`, `on/off`
//! (any case, surrounding blanks ignored); an empty value counts as unset; anything else is
//! an [`Error::Config`] naming the variable. When both `NNFUSE_ENABLE_NHWC` and
//! `ONEFLOW_ENABLE_NHWC` are set, the `NNFUSE_` one wins.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

use once_cell::sync::OnceCell;

use crate::error::{Error, Result};

/// How the cuDNN BatchNorm mode is chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum BnModePolicy {
    /// Exactly OneFlow's rule: 2-D input → `PER_ACTIVATION`; NHWC flag → `SPATIAL_PERSISTENT`;
    /// otherwise `SPATIAL`.
    OneFlow,
    /// OneFlow's rule minus the traps measured on the H100: 2-D input and channels-last
    /// training inputs use `SPATIAL_PERSISTENT`.
    #[default]
    Auto,
    /// `SPATIAL_PERSISTENT` wherever cuDNN accepts it.
    Fast,
}

impl BnModePolicy {
    /// The spelling used by the environment variable and the CLI.
    pub const fn name(self) -> &'static str {
        match self {
            BnModePolicy::OneFlow => "oneflow",
            BnModePolicy::Auto => "auto",
            BnModePolicy::Fast => "fast",
        }
    }
}

impl fmt::Display for BnModePolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for BnModePolicy {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "oneflow" => Ok(BnModePolicy::OneFlow),
            "auto" => Ok(BnModePolicy::Auto),
            "fast" => Ok(BnModePolicy::Fast),
            _ => Err(Error::Config {
                var: ENV_BN_MODE_POLICY.into(),
                value: s.into(),
                reason: "expected one of oneflow, auto, fast".into(),
            }),
        }
    }
}

/// `NNFUSE_ENABLE_NHWC`.
pub const ENV_ENABLE_NHWC: &str = "NNFUSE_ENABLE_NHWC";
/// OneFlow's name for the same flag, honoured as an alias.
pub const ENV_ONEFLOW_ENABLE_NHWC: &str = "ONEFLOW_ENABLE_NHWC";
/// `NNFUSE_BN_MODE_POLICY`.
pub const ENV_BN_MODE_POLICY: &str = "NNFUSE_BN_MODE_POLICY";
/// `NNFUSE_DISABLE_CUDNN_FUSION`.
pub const ENV_DISABLE_CUDNN_FUSION: &str = "NNFUSE_DISABLE_CUDNN_FUSION";
/// `NNFUSE_GEMM_SEARCH`.
pub const ENV_GEMM_SEARCH: &str = "NNFUSE_GEMM_SEARCH";
/// `NNFUSE_TUNING_CACHE`.
pub const ENV_TUNING_CACHE: &str = "NNFUSE_TUNING_CACHE";

/// Every variable nnfuse reads.
pub const ALL_VARS: [&str; 6] = [
    ENV_ENABLE_NHWC,
    ENV_ONEFLOW_ENABLE_NHWC,
    ENV_BN_MODE_POLICY,
    ENV_DISABLE_CUDNN_FUSION,
    ENV_GEMM_SEARCH,
    ENV_TUNING_CACHE,
];

/// The settings one [`crate::Context`] works with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// OneFlow's NHWC flag: BatchNorm of rank > 2 uses `SPATIAL_PERSISTENT`.
    pub enable_nhwc: bool,
    /// How the BatchNorm mode is chosen.
    pub bn_mode_policy: BnModePolicy,
    /// Never use cuDNN's fused BN+activation paths (forces the fallback; useful to compare).
    pub disable_cudnn_fusion: bool,
    /// Search GEMM algorithms (true) or take the cuBLAS default (false).
    pub gemm_search: bool,
    /// File in which GEMM search results persist between processes.
    pub tuning_cache: Option<PathBuf>,
}

impl Default for Config {
    /// The defaults with no environment variable set.
    fn default() -> Self {
        Config {
            enable_nhwc: false,
            bn_mode_policy: BnModePolicy::Auto,
            disable_cudnn_fusion: false,
            gemm_search: true,
            tuning_cache: None,
        }
    }
}

/// Parses a boolean the way OneFlow's `ParseBooleanFromEnv` does; `var` names the variable in
/// the error.
pub fn parse_bool(var: &str, value: &str) -> Result<bool> {
    match value.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Ok(true),
        "0" | "false" | "no" | "off" => Ok(false),
        _ => Err(Error::Config {
            var: var.into(),
            value: value.into(),
            reason: "expected a boolean: 1/0, true/false, yes/no, on/off".into(),
        }),
    }
}

impl Config {
    /// Reads the variables from the process environment now (not cached).
    pub fn from_env() -> Result<Config> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// The configuration from the environment, read once per process; later changes to the
    /// environment are not seen (use [`Config::from_env`] or set fields in code for that).
    pub fn from_env_once() -> Result<Config> {
        static ONCE: OnceCell<std::result::Result<Config, (String, String, String)>> =
            OnceCell::new();
        let cached = ONCE.get_or_init(|| {
            Config::from_env().map_err(|e| match e {
                Error::Config { var, value, reason } => (var, value, reason),
                other => (String::new(), String::new(), other.to_string()),
            })
        });
        match cached {
            Ok(c) => Ok(c.clone()),
            Err((var, value, reason)) => Err(Error::Config {
                var: var.clone(),
                value: value.clone(),
                reason: reason.clone(),
            }),
        }
    }

    /// Builds a configuration from any variable lookup (tests, embedding applications).
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Config> {
        let get = |k: &str| lookup(k).filter(|v| !v.trim().is_empty());
        let mut c = Config::default();
        if let Some(v) = get(ENV_ENABLE_NHWC) {
            c.enable_nhwc = parse_bool(ENV_ENABLE_NHWC, &v)?;
            // The alias must still parse: a typo in it is an error, not silently ignored.
            if let Some(alias) = get(ENV_ONEFLOW_ENABLE_NHWC) {
                parse_bool(ENV_ONEFLOW_ENABLE_NHWC, &alias)?;
            }
        } else if let Some(v) = get(ENV_ONEFLOW_ENABLE_NHWC) {
            c.enable_nhwc = parse_bool(ENV_ONEFLOW_ENABLE_NHWC, &v)?;
        }
        if let Some(v) = get(ENV_BN_MODE_POLICY) {
            c.bn_mode_policy = v.parse()?;
        }
        if let Some(v) = get(ENV_DISABLE_CUDNN_FUSION) {
            c.disable_cudnn_fusion = parse_bool(ENV_DISABLE_CUDNN_FUSION, &v)?;
        }
        if let Some(v) = get(ENV_GEMM_SEARCH) {
            c.gemm_search = parse_bool(ENV_GEMM_SEARCH, &v)?;
        }
        if let Some(v) = get(ENV_TUNING_CACHE) {
            c.tuning_cache = Some(PathBuf::from(v.trim()));
        }
        Ok(c)
    }

    /// Sets [`Config::enable_nhwc`].
    pub fn with_nhwc(mut self, on: bool) -> Self {
        self.enable_nhwc = on;
        self
    }

    /// Sets [`Config::bn_mode_policy`].
    pub fn with_bn_mode_policy(mut self, p: BnModePolicy) -> Self {
        self.bn_mode_policy = p;
        self
    }

    /// Sets [`Config::disable_cudnn_fusion`].
    pub fn with_cudnn_fusion_disabled(mut self, off: bool) -> Self {
        self.disable_cudnn_fusion = off;
        self
    }

    /// Sets [`Config::gemm_search`].
    pub fn with_gemm_search(mut self, on: bool) -> Self {
        self.gemm_search = on;
        self
    }

    /// Sets [`Config::tuning_cache`].
    pub fn with_tuning_cache(mut self, path: Option<PathBuf>) -> Self {
        self.tuning_cache = path;
        self
    }
}

impl fmt::Display for Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "enable_nhwc          = {}", self.enable_nhwc)?;
        writeln!(f, "bn_mode_policy       = {}", self.bn_mode_policy)?;
        writeln!(f, "disable_cudnn_fusion = {}", self.disable_cudnn_fusion)?;
        writeln!(f, "gemm_search          = {}", self.gemm_search)?;
        match &self.tuning_cache {
            Some(p) => write!(f, "tuning_cache         = {}", p.display()),
            None => write!(f, "tuning_cache         = (none)"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn cfg(vars: &[(&str, &str)]) -> Result<Config> {
        let m: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Config::from_lookup(|k| m.get(k).cloned())
    }

    #[test]
    fn booleans_parse_like_oneflow() {
        for t in ["1", "true", "TRUE", "yes", "On", " on "] {
            assert!(parse_bool("X", t).unwrap(), "{t}");
        }
        for f in ["0", "false", "No", "off", "OFF"] {
            assert!(!parse_bool("X", f).unwrap(), "{f}");
        }
        for bad in ["2", "y", "enable", "truee", "-1"] {
            let e = parse_bool("NNFUSE_X", bad).unwrap_err();
            assert!(e.to_string().contains("NNFUSE_X"), "{e}");
        }
    }

    #[test]
    fn defaults_without_environment() {
        assert_eq!(cfg(&[]).unwrap(), Config::default());
        assert!(Config::default().gemm_search);
        assert_eq!(Config::default().bn_mode_policy, BnModePolicy::Auto);
    }

    #[test]
    fn oneflow_alias_and_precedence() {
        assert!(cfg(&[(ENV_ONEFLOW_ENABLE_NHWC, "1")]).unwrap().enable_nhwc);
        assert!(cfg(&[(ENV_ENABLE_NHWC, "yes")]).unwrap().enable_nhwc);
        let c = cfg(&[(ENV_ENABLE_NHWC, "0"), (ENV_ONEFLOW_ENABLE_NHWC, "1")]).unwrap();
        assert!(!c.enable_nhwc, "NNFUSE_ wins over the alias");
        let e = cfg(&[(ENV_ENABLE_NHWC, "0"), (ENV_ONEFLOW_ENABLE_NHWC, "maybe")]).unwrap_err();
        assert!(e.to_string().contains(ENV_ONEFLOW_ENABLE_NHWC));
        assert!(!cfg(&[(ENV_ENABLE_NHWC, "")]).unwrap().enable_nhwc);
    }

    #[test]
    fn every_variable_is_read() {
        let c = cfg(&[
            (ENV_BN_MODE_POLICY, "Fast"),
            (ENV_DISABLE_CUDNN_FUSION, "on"),
            (ENV_GEMM_SEARCH, "off"),
            (ENV_TUNING_CACHE, "/tmp/t.json"),
        ])
        .unwrap();
        assert_eq!(c.bn_mode_policy, BnModePolicy::Fast);
        assert!(c.disable_cudnn_fusion);
        assert!(!c.gemm_search);
        assert_eq!(c.tuning_cache, Some(PathBuf::from("/tmp/t.json")));
        let e = cfg(&[(ENV_BN_MODE_POLICY, "fastest")]).unwrap_err();
        assert!(e.to_string().contains(ENV_BN_MODE_POLICY));
        let e = cfg(&[(ENV_GEMM_SEARCH, "sometimes")]).unwrap_err();
        assert!(e.to_string().contains(ENV_GEMM_SEARCH));
    }

    #[test]
    fn builders_override() {
        let c = Config::default()
            .with_nhwc(true)
            .with_bn_mode_policy(BnModePolicy::OneFlow)
            .with_cudnn_fusion_disabled(true)
            .with_gemm_search(false);
        assert!(c.enable_nhwc && c.disable_cudnn_fusion && !c.gemm_search);
        assert_eq!(c.bn_mode_policy, BnModePolicy::OneFlow);
        assert!(c.to_string().contains("bn_mode_policy       = oneflow"));
    }
}
