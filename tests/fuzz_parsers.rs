//! Fuzz properties of everything nnfuse parses from outside the program: environment variables
//! (`Config::from_lookup`, the same function `Config::from_env` uses, so no process environment
//! is touched and the cases run in parallel), the names of policies and types, the tuning file
//! (GEMM sections through `load_file`, convolution entries through `entry_from_json`) and the
//! kernel image cache files — over arbitrary strings, arbitrary JSON, near-valid JSON with one
//! value replaced, and arbitrary or mutated bytes.
//!
//! The property: a typed error (or a warning, for files, which are never fatal) naming what is
//! wrong, or a value that is valid by the same checks a caller's value must pass — never a
//! panic, a hang or an overflow. Bounded cases by default; `PROPTEST_CASES=N` for long runs.

#[path = "fuzz_common/mod.rs"]
mod fuzz_common;

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};

use fuzz_common::{cases, check_all, dim, Outcome, BOUNDARIES};
use nnfuse::batchnorm::{Fuse, OwnVariantChoice};
use nnfuse::config::{parse_bool, parse_count, ALL_VARS};
use nnfuse::conv::{ConvPath, Direction};
use nnfuse::gemm::{Alignment, Choice, Compute, Key, Problem};
use nnfuse::internals::conv::{entry_from_json, entry_to_json};
use nnfuse::internals::gemm::{load_file, save_file, DeviceTag};
use nnfuse::internals::kernels::{self as kernels, Image, ImageKey};
use nnfuse::{BnImpl, BnModePolicy, Config, ConvAlgoPolicy, DType, Error, WinogradGemmPolicy};
use proptest::prelude::*;
use serde_json::{json, Value};

// ---- strings: names and environment values ----

/// Strings near the accepted spellings: the words themselves, their case and whitespace
/// variants, numbers of every size, and arbitrary text.
fn env_value() -> impl Strategy<Value = String> {
    let words = prop::sample::select(vec![
        "",
        " ",
        "0",
        "1",
        "-1",
        "+1",
        "2",
        "true",
        "false",
        "TRUE",
        "yes",
        "no",
        "on",
        "off",
        "auto",
        "oneflow",
        "fast",
        "cudnn",
        "own",
        "im2col",
        "winograd",
        "winograd_f2x3",
        "winograd_f4x3",
        "direct",
        "seed",
        "tensor_core",
        "fused",
        "f32",
        "f16",
        "bf16",
        "4096",
        "18446744073709551615",
        "18446744073709551616",
        "1e3",
        "0x10",
        "١",
        "/tmp/x",
        "\u{0}",
        "nan",
    ]);
    prop_oneof![
        3 => words.clone().prop_map(String::from),
        2 => (words, prop::sample::select(vec!["", " ", "\t", "\n", "x", "0"]), any::<bool>())
            .prop_map(|(w, pad, upper)| {
                let w = if upper { w.to_uppercase() } else { w.to_string() };
                format!("{pad}{w}{pad}")
            }),
        2 => dim().prop_map(|v| v.to_string()),
        2 => any::<String>(),
        1 => "[ -~]{0,40}",
    ]
}

/// A value `var` accepts (most of the time, in any case and with surrounding blanks), else
/// any [`env_value`].
fn env_value_for(var: &'static str) -> BoxedStrategy<String> {
    let words = |w: &[&'static str]| {
        prop::sample::select(w.to_vec())
            .prop_map(String::from)
            .boxed()
    };
    let good = match var {
        "NNFUSE_ENABLE_NHWC"
        | "ONEFLOW_ENABLE_NHWC"
        | "NNFUSE_DISABLE_CUDNN_FUSION"
        | "NNFUSE_GEMM_SEARCH"
        | "NNFUSE_DETERMINISTIC" => words(&["0", "1", "true", "False", "YES", "no", " on ", "off"]),
        "NNFUSE_BN_MODE_POLICY" => words(&["oneflow", "auto", "FAST"]),
        "NNFUSE_BN_IMPL" => words(&["auto", "cudnn", "own"]),
        "NNFUSE_CONV_ALGO" => words(&[
            "auto",
            "cudnn",
            "im2col",
            "winograd",
            "winograd-f2x3",
            "winograd_f4x3",
            "direct",
        ]),
        "NNFUSE_WINOGRAD_GEMM" => words(&["auto", "seed", "tensor-core", "direct", "fused"]),
        "NNFUSE_PLAN_CACHE_CAPACITY" | "NNFUSE_CONV_WORKSPACE_MB" => prop_oneof![
            (1usize..100_000).prop_map(|v| v.to_string()),
            prop::sample::select(BOUNDARIES.to_vec()).prop_map(|v| format!(" {v} ")),
        ]
        .boxed(),
        _ => words(&["/tmp/nnfuse-fuzz-never-written", "relative/path", " x "]),
    };
    prop_oneof![17 => good, 3 => env_value()].boxed()
}

/// The typed error of a value that does not parse: `Error::Config` naming one of the variables
/// that were set, with the value and what would have been accepted.
fn config_error_names(e: &Error, vars: &[&str]) -> Result<(), TestCaseError> {
    match e {
        Error::Config { var, reason, .. } => {
            prop_assert!(vars.contains(&var.as_str()), "{var} was not set");
            prop_assert!(!reason.is_empty());
            prop_assert!(e.to_string().contains(var.as_str()));
            Ok(())
        }
        other => Err(TestCaseError::fail(format!(
            "not an Error::Config: {other:?}"
        ))),
    }
}

proptest! {
    #![proptest_config(cases(3000))]

    /// One variable at a time: a value is accepted exactly when its parser accepts it.
    #[test]
    fn config_one_variable(which in 0..ALL_VARS.len(), value in env_value()) {
        let var = ALL_VARS[which];
        let r = Config::from_lookup(|k| (k == var).then(|| value.clone()));
        if value.trim().is_empty() {
            prop_assert_eq!(r.ok(), Some(Config::default()), "an empty value is unset");
            return Ok(());
        }
        match r {
            Ok(c) => {
                let _ = c.to_string();
            }
            Err(e) => config_error_names(&e, &[var])?,
        }
    }

    #[test]
    fn counts_and_booleans(value in env_value()) {
        match parse_count("V", &value) {
            Ok(v) => prop_assert!(v >= 1 && value.trim().parse::<usize>() == Ok(v)),
            Err(e) => config_error_names(&e, &["V"])?,
        }
        match parse_bool("V", &value) {
            Ok(_) => {}
            Err(e) => config_error_names(&e, &["V"])?,
        }
    }

    /// Every name parser: a value or an `InvalidArgument` naming what it parses.
    #[test]
    fn names_parse_or_name_the_argument(value in env_value()) {
        fn one<T: std::str::FromStr<Err = Error>>(s: &str) -> Result<(), TestCaseError> {
            if let Err(e) = s.parse::<T>() {
                match &e {
                    Error::InvalidArgument { arg, .. } => prop_assert!(!arg.is_empty()),
                    Error::Config { var, .. } => prop_assert!(!var.is_empty()),
                    other => return Err(TestCaseError::fail(format!("{other:?}"))),
                }
                let _ = e.to_string();
            }
            Ok(())
        }
        one::<DType>(&value)?;
        one::<Compute>(&value)?;
        one::<Fuse>(&value)?;
        one::<OwnVariantChoice>(&value)?;
        one::<BnModePolicy>(&value)?;
        one::<BnImpl>(&value)?;
        one::<ConvAlgoPolicy>(&value)?;
        one::<WinogradGemmPolicy>(&value)?;
        one::<Direction>(&value)?;
        one::<ConvPath>(&value)?;
    }
}

/// Every NNFUSE_* variable (and OneFlow's alias) set to arbitrary values at once.
#[test]
fn config_from_any_environment() {
    let values: Vec<_> = ALL_VARS
        .iter()
        .map(|v| prop::option::weighted(0.4, env_value_for(v)))
        .collect();
    check_all(
        "configuration from the environment",
        3000,
        values,
        |values| {
            let set: Vec<(&str, String)> = ALL_VARS
                .iter()
                .zip(&values)
                .filter_map(|(k, v)| v.clone().map(|v| (*k, v)))
                .collect();
            let lookup = |k: &str| set.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone());
            match Config::from_lookup(lookup) {
                Ok(c) => {
                    prop_assert!(c.plan_cache_capacity >= 1);
                    prop_assert!(c.conv_workspace_mb >= 1);
                    prop_assert!(c.conv_workspace_bytes() >= 1 << 20);
                    let _ = c.kernel_cache_dir();
                    let _ = c.to_string();
                    Ok(Outcome::Value)
                }
                Err(e) => {
                    let names: Vec<&str> = set.iter().map(|(k, _)| *k).collect();
                    config_error_names(&e, &names)?;
                    Ok(Outcome::Rejected)
                }
            }
        },
    );
}

// ---- arbitrary JSON and its mutations ----

/// Any JSON value (small, nested a few levels).
fn any_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        prop::sample::select(BOUNDARIES.to_vec()).prop_map(|v| json!(v)),
        any::<i64>().prop_map(Value::from),
        any::<f64>().prop_map(|v| json!(v)),
        prop::sample::select(vec![
            "f32",
            "f16",
            "bf16",
            "nchw",
            "nhwc",
            "forward",
            "backward-data",
            "backward_filter",
            "auto",
            "seed",
            "cudnn",
            "im2col_gemm",
            "winograd_f4x3",
            "winograd_f2x3",
            "direct",
            "tensor_core",
            "fused",
            "find",
            "get",
            "cublas",
            "cublaslt",
            "default",
            "tensor_op",
            "IMPLICIT_PRECOMP_GEMM",
            "WINOGRAD_NONFUSED",
            "CUBLAS_GEMM_DEFAULT",
            "",
        ])
        .prop_map(Value::from),
        any::<String>().prop_map(Value::from),
    ];
    leaf.prop_recursive(3, 24, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::from),
            prop::collection::btree_map("[a-z_]{1,12}", inner, 0..6)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// Replaces (or removes) the value that `path` leads to in `v`: each step picks a member or an
/// element by index modulo the length.
fn mutate(v: &mut Value, path: &[usize], replacement: Option<Value>) {
    let (step, rest) = match path.split_first() {
        Some(x) => x,
        None => {
            *v = replacement.unwrap_or(Value::Null);
            return;
        }
    };
    match v {
        Value::Object(m) if !m.is_empty() => {
            let key = m.keys().nth(step % m.len()).cloned().unwrap_or_default();
            if rest.is_empty() && replacement.is_none() {
                m.remove(&key);
            } else if let Some(child) = m.get_mut(&key) {
                mutate(child, rest, replacement);
            }
        }
        Value::Array(a) if !a.is_empty() => {
            let i = step % a.len();
            if rest.is_empty() && replacement.is_none() {
                a.remove(i);
            } else {
                mutate(&mut a[i], rest, replacement);
            }
        }
        _ => *v = replacement.unwrap_or(Value::Null),
    }
}

/// Byte-level damage: flips, truncation, insertion, or a run of arbitrary bytes spliced in.
fn damage(bytes: &mut Vec<u8>, edits: &[(u8, usize, u8)]) {
    for &(kind, at, b) in edits {
        let len = bytes.len();
        let at = if len == 0 { 0 } else { at % len };
        match kind % 4 {
            0 if len > 0 => bytes[at] ^= b.max(1),
            1 => bytes.truncate(at),
            2 => bytes.insert(at, b),
            _ if len > 0 => {
                bytes.remove(at);
            }
            _ => bytes.push(b),
        }
    }
}

/// A fresh file path under the system's temporary folder (removed by the caller).
fn temp_path(tag: &str) -> PathBuf {
    static N: AtomicU64 = AtomicU64::new(0);
    std::env::temp_dir().join(format!(
        "nnfuse-fuzz-{}-{tag}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ))
}

// ---- the convolution tuning entries ----

/// A well-formed entry as `entry_to_json` writes it.
fn conv_entry() -> Value {
    json!({
        "key": {
            "direction": "backward_data", "dtype": "bf16", "format": "nhwc",
            "n": 2, "c_in": 8, "h": 9, "w": 9, "c_out": 16, "kh": 3, "kw": 3,
            "stride": [1, 2], "pad": [2, 1], "dilation": [1, 1],
            "policy": "auto", "winograd_gemm": "seed", "deterministic": true,
            "workspace_mb": 64, "cudnn_search": "find"
        },
        "choice": {
            "path": "winograd_f4x3", "engine": "direct", "cudnn_algo": null,
            "cudnn_math": null, "origin": "measured"
        },
        "median_us": 12.5, "incumbent_us": null, "candidates": 4
    })
}

fn check_conv_entry(v: &Value) -> Result<Outcome, TestCaseError> {
    Ok(match entry_from_json(v, 7) {
        Ok((key, choice)) => {
            prop_assert_eq!(key.device, 7);
            let shape = key.shape.shape();
            prop_assert!(shape.out_hw().is_ok(), "{shape:?}");
            // Written back and read again, the entry is the same.
            let again = entry_to_json(&key, &choice);
            let (k2, c2) = entry_from_json(&again, 7)
                .map_err(|e| TestCaseError::fail(format!("round trip: {e}")))?;
            prop_assert_eq!(k2, key);
            prop_assert_eq!(c2.route, choice.route);
            Outcome::Value
        }
        Err(why) => {
            prop_assert!(!why.is_empty());
            Outcome::Rejected
        }
    })
}

proptest! {
    #![proptest_config(cases(3000))]

    #[test]
    fn conv_entry_from_any_json(v in any_json()) {
        check_conv_entry(&v)?;
        check_conv_entry(&json!({ "key": v.clone(), "choice": v }))?;
    }

    #[test]
    fn conv_entry_from_any_bytes(bytes in prop::collection::vec(any::<u8>(), 0..256), edits in prop::collection::vec((any::<u8>(), any::<usize>(), any::<u8>()), 0..6)) {
        if let Ok(v) = serde_json::from_slice::<Value>(&bytes) {
            check_conv_entry(&v)?;
        }
        let mut text = serde_json::to_vec(&conv_entry()).unwrap();
        damage(&mut text, &edits);
        if let Ok(v) = serde_json::from_slice::<Value>(&text) {
            check_conv_entry(&v)?;
        }
    }
}

/// JSON paths and replacements (`None`: remove the member or element).
fn json_edits(depth: usize) -> impl Strategy<Value = Vec<(Vec<usize>, Option<Value>)>> {
    prop::collection::vec(
        (
            prop::collection::vec(any::<usize>(), 0..depth),
            prop::option::weighted(0.9, any_json()),
        ),
        1..4,
    )
}

#[test]
fn conv_entry_with_values_replaced() {
    check_all(
        "convolution entry, values replaced",
        3000,
        json_edits(4),
        |edits| {
            let mut v = conv_entry();
            for (path, replacement) in edits {
                mutate(&mut v, &path, replacement);
            }
            check_conv_entry(&v)
        },
    );
}

// ---- the GEMM tuning file ----

fn device_tag() -> DeviceTag {
    DeviceTag {
        name: "fuzz device".into(),
        compute_capability: (9, 0),
        cublas: (13, 1, 0),
        cublaslt: 130100,
    }
}

/// A file with one section for [`device_tag`] holding a few valid entries, as `save_file`
/// writes it (once per process).
fn gemm_file_text() -> &'static str {
    static TEXT: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    TEXT.get_or_init(|| {
        let path = temp_path("gemm-template");
        let tag = device_tag();
        let mut entries = Vec::new();
        for (i, p) in [
            Problem::packed(1, 64, 32, 16),
            Problem::packed_trans(4, 8, 24, 40, true, false),
            Problem::packed(3, 16, 16, 16).with_compute(Compute::F16),
        ]
        .into_iter()
        .enumerate()
        {
            let dtype = if p.compute == Compute::F16 {
                DType::F16
            } else {
                DType::F32
            };
            let key = Key::new(0, &p, dtype, Alignment::MAX).unwrap();
            let mut c = Choice::fallback();
            c.median_us = 10.0 + i as f64;
            entries.push((key, c));
        }
        save_file(&path, &tag, &entries).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        let _ = std::fs::remove_file(&path);
        text
    })
}

/// `Value` when the loader kept at least one entry.
fn check_gemm_file(bytes: &[u8]) -> Result<Outcome, TestCaseError> {
    let path = temp_path("gemm");
    std::fs::write(&path, bytes).unwrap();
    let loaded = load_file(&path, &device_tag(), 5);
    let _ = std::fs::remove_file(&path);
    for (key, choice) in &loaded.entries {
        // Every entry the loader accepts is a key the library itself would make.
        prop_assert_eq!(key.device, 5);
        let again = Key::new(5, &key.problem(), key.dtype, key.align);
        prop_assert_eq!(again.as_ref().ok(), Some(key), "{:?}", again);
        let _ = format!("{key} {choice:?}");
    }
    for w in &loaded.warnings {
        prop_assert!(!w.is_empty());
    }
    Ok(if loaded.entries.is_empty() {
        Outcome::Rejected
    } else {
        Outcome::Value
    })
}

proptest! {
    #![proptest_config(cases(1500))]

    #[test]
    fn gemm_file_from_any_bytes(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        check_gemm_file(&bytes)?;
    }

}

#[test]
fn gemm_file_damaged() {
    let edits = prop::collection::vec((any::<u8>(), any::<usize>(), any::<u8>()), 1..8);
    check_all("GEMM tuning file, bytes damaged", 1500, edits, |edits| {
        let mut bytes = gemm_file_text().as_bytes().to_vec();
        damage(&mut bytes, &edits);
        check_gemm_file(&bytes)
    });
}

#[test]
fn gemm_file_with_values_replaced() {
    // Half the cases edit inside the entries only (members are in name order: "sections" is
    // the second member of the file, "entries" the second of a section).
    let edits = (json_edits(6), any::<bool>());
    check_all(
        "GEMM tuning file, values replaced",
        1500,
        edits,
        |(edits, inside)| {
            let mut v: Value = serde_json::from_str(gemm_file_text()).unwrap();
            for (path, replacement) in edits {
                let path = if inside {
                    [&[1, 0, 1][..], &path].concat()
                } else {
                    path
                };
                mutate(&mut v, &path, replacement);
            }
            check_gemm_file(&serde_json::to_vec(&v).unwrap())
        },
    );
}

// ---- the kernel image cache ----

/// A key, the bytes `write_cached` puts in its file, and the image's own bytes.
type ImageFile = (ImageKey, Vec<u8>, Vec<u8>);

/// The smallest image the cache accepts as ELF: a 64-bit little-endian header with no tables,
/// and a few payload bytes after it.
fn minimal_elf() -> Vec<u8> {
    let mut b = vec![0u8; 64 + 8];
    b[..4].copy_from_slice(b"\x7fELF");
    b[4] = 2; // 64-bit
    b[5] = 1; // little-endian
    b[0x34] = 64; // e_ehsize
    b
}

/// One [`ImageFile`] for a CUBIN and one for a PTX target.
fn image_files() -> &'static [ImageFile] {
    static FILES: std::sync::OnceLock<Vec<ImageFile>> = std::sync::OnceLock::new();
    FILES.get_or_init(|| {
        let dir = temp_path("kernels");
        let mut out = Vec::new();
        for (arch, image) in [
            ("sm_90", Image::Cubin(minimal_elf())),
            (
                "compute_80",
                Image::Ptx(b".version 8.0\n.target sm_80\n\x00".to_vec()),
            ),
        ] {
            let key = ImageKey::with_version(&kernels::UTIL, arch, (13, 0));
            let path = kernels::write_cached(&dir, &key, &image).unwrap();
            let bytes = std::fs::read(&path).unwrap();
            out.push((key, bytes, image.bytes().to_vec()));
        }
        let _ = std::fs::remove_dir_all(&dir);
        out
    })
}

fn check_image(key: &ImageKey, bytes: &[u8]) -> Result<Outcome, TestCaseError> {
    Ok(match key.decode(bytes) {
        // Only a file whose payload is intact (its length and checksum match) is used.
        Ok(image) => {
            prop_assert!(bytes.ends_with(image.bytes()));
            prop_assert!(bytes.len() > image.bytes().len());
            if key.arch.starts_with("sm_") {
                prop_assert!(
                    matches!(image, Image::Cubin(_)) && image.bytes().starts_with(b"\x7fELF")
                );
            }
            Outcome::Value
        }
        Err(why) => {
            prop_assert!(!why.is_empty());
            Outcome::Rejected
        }
    })
}

proptest! {
    #![proptest_config(cases(3000))]

    #[test]
    fn kernel_image_from_any_bytes(which in 0usize..2, bytes in prop::collection::vec(any::<u8>(), 0..2048)) {
        let (key, _, _) = &image_files()[which];
        check_image(key, &bytes)?;
    }

}

#[test]
fn kernel_image_damaged() {
    let edits = prop::collection::vec((any::<u8>(), any::<usize>(), any::<u8>()), 0..6);
    check_all(
        "kernel image file, bytes damaged",
        3000,
        (0usize..2, edits),
        |(which, edits)| {
            let (key, good, payload) = &image_files()[which];
            let mut bytes = good.clone();
            damage(&mut bytes, &edits);
            if let Ok(image) = key.decode(&bytes) {
                // A damaged file is accepted only when the damage cancelled out.
                prop_assert_eq!(image.bytes(), payload.as_slice());
            }
            check_image(key, &bytes)
        },
    );
}

proptest! {
    // Each case hashes every kernel source (about a megabyte in all).
    #![proptest_config(cases(64))]

    /// Any architecture and version gives a key and a plain file name (no folder separators
    /// from nnfuse's side; `arch` comes from the device).
    #[test]
    fn kernel_keys_for_any_device(cc in (any::<i32>(), any::<i32>()), nvrtc in (any::<i32>(), any::<i32>())) {
        let arch = kernels::arch_for(cc);
        for file in kernels::ALL {
            let key = ImageKey::with_version(file, &arch, nvrtc);
            let name = key.file_name();
            prop_assert!(!name.contains('/') && !name.is_empty(), "{name}");
        }
    }
}
