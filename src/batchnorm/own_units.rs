//! The own BatchNorm kernels' names and compilation units. NVRTC takes seconds for the whole of
//! `kernels/batchnorm.cu` (42 entry points: 3 types x 14 kernels, most with three vector-width
//! instantiations), so nnfuse compiles it, and `kernels/batchnorm_persistent.cu`, once per
//! (kernel kind, type) instead: the file with `NNF_BN_KERNEL` and `NNF_BN_DT` defined
//! (`kernels/batchnorm_common.cuh`), holding one entry point (and the type-free kernel that runs
//! beside it). A call compiles only the units it launches, and a BatchNorm's plan starts the
//! units it will launch compiling in the background ([`planned_kernels`], `own::prepare`).
//! Pure: names and tables, no GPU.

use std::sync::OnceLock;

use crate::batchnorm::own_launch::Arrangement;
use crate::batchnorm::types::{Fuse, OwnVariant};
use crate::dtype::DType;
use crate::kernels::{self, KernelFile};

/// One own BatchNorm kernel (of any type: [`name`] adds the type).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum K {
    StatsCf,
    StatsCl,
    StatsFinalize,
    ReduceCf,
    ReduceCl,
    /// `bn_bwd_finalize` (type-free), after [`K::ReduceCl`].
    BwdFinalize,
    ApplyFwd(Fuse),
    ApplyFwdLast(Fuse),
    /// `bn_fold` (type-free), before [`K::ApplyFwd`] of the same activation.
    Fold(Fuse),
    ApplyBwd,
    ApplyBwdLast,
    ChannelBwd,
    PersistFwdCf,
    PersistFwdCl,
    PersistBwdCf,
    PersistBwdCl,
}

/// The entry point of kernel `k` for `dt` (`kernels/batchnorm*.cu`).
pub(crate) fn name(k: K, dt: DType) -> &'static str {
    use DType::*;
    use K::*;
    match (k, dt) {
        (StatsCf, F32) => "bn_stats_cf_f32",
        (StatsCf, F16) => "bn_stats_cf_f16",
        (StatsCf, BF16) => "bn_stats_cf_bf16",
        (StatsCl, F32) => "bn_stats_cl_f32",
        (StatsCl, F16) => "bn_stats_cl_f16",
        (StatsCl, BF16) => "bn_stats_cl_bf16",
        (StatsFinalize, F32) => "bn_stats_finalize_f32",
        (StatsFinalize, F16) => "bn_stats_finalize_f16",
        (StatsFinalize, BF16) => "bn_stats_finalize_bf16",
        (ReduceCf, F32) => "bn_bwd_reduce_cf_f32",
        (ReduceCf, F16) => "bn_bwd_reduce_cf_f16",
        (ReduceCf, BF16) => "bn_bwd_reduce_cf_bf16",
        (ReduceCl, F32) => "bn_bwd_reduce_cl_f32",
        (ReduceCl, F16) => "bn_bwd_reduce_cl_f16",
        (ReduceCl, BF16) => "bn_bwd_reduce_cl_bf16",
        (BwdFinalize, _) => "bn_bwd_finalize",
        (ApplyFwd(Fuse::None), F32) => "bn_apply_fwd_none_f32",
        (ApplyFwd(Fuse::None), F16) => "bn_apply_fwd_none_f16",
        (ApplyFwd(Fuse::None), BF16) => "bn_apply_fwd_none_bf16",
        (ApplyFwd(Fuse::Relu), F32) => "bn_apply_fwd_relu_f32",
        (ApplyFwd(Fuse::Relu), F16) => "bn_apply_fwd_relu_f16",
        (ApplyFwd(Fuse::Relu), BF16) => "bn_apply_fwd_relu_bf16",
        (ApplyFwd(Fuse::AddRelu), F32) => "bn_apply_fwd_add_relu_f32",
        (ApplyFwd(Fuse::AddRelu), F16) => "bn_apply_fwd_add_relu_f16",
        (ApplyFwd(Fuse::AddRelu), BF16) => "bn_apply_fwd_add_relu_bf16",
        (ApplyFwdLast(Fuse::None), F32) => "bn_apply_fwd_none_last_f32",
        (ApplyFwdLast(Fuse::None), F16) => "bn_apply_fwd_none_last_f16",
        (ApplyFwdLast(Fuse::None), BF16) => "bn_apply_fwd_none_last_bf16",
        (ApplyFwdLast(Fuse::Relu), F32) => "bn_apply_fwd_relu_last_f32",
        (ApplyFwdLast(Fuse::Relu), F16) => "bn_apply_fwd_relu_last_f16",
        (ApplyFwdLast(Fuse::Relu), BF16) => "bn_apply_fwd_relu_last_bf16",
        (ApplyFwdLast(Fuse::AddRelu), F32) => "bn_apply_fwd_add_relu_last_f32",
        (ApplyFwdLast(Fuse::AddRelu), F16) => "bn_apply_fwd_add_relu_last_f16",
        (ApplyFwdLast(Fuse::AddRelu), BF16) => "bn_apply_fwd_add_relu_last_bf16",
        (Fold(_), _) => "bn_fold",
        (ApplyBwdLast, F32) => "bn_apply_bwd_last_f32",
        (ApplyBwdLast, F16) => "bn_apply_bwd_last_f16",
        (ApplyBwdLast, BF16) => "bn_apply_bwd_last_bf16",
        (ApplyBwd, F32) => "bn_apply_bwd_f32",
        (ApplyBwd, F16) => "bn_apply_bwd_f16",
        (ApplyBwd, BF16) => "bn_apply_bwd_bf16",
        (ChannelBwd, F32) => "bn_bwd_channel_f32",
        (ChannelBwd, F16) => "bn_bwd_channel_f16",
        (ChannelBwd, BF16) => "bn_bwd_channel_bf16",
        (PersistFwdCf, F32) => "bn_persist_fwd_cf_f32",
        (PersistFwdCf, F16) => "bn_persist_fwd_cf_f16",
        (PersistFwdCf, BF16) => "bn_persist_fwd_cf_bf16",
        (PersistFwdCl, F32) => "bn_persist_fwd_cl_f32",
        (PersistFwdCl, F16) => "bn_persist_fwd_cl_f16",
        (PersistFwdCl, BF16) => "bn_persist_fwd_cl_bf16",
        (PersistBwdCf, F32) => "bn_persist_bwd_cf_f32",
        (PersistBwdCf, F16) => "bn_persist_bwd_cf_f16",
        (PersistBwdCf, BF16) => "bn_persist_bwd_cf_bf16",
        (PersistBwdCl, F32) => "bn_persist_bwd_cl_f32",
        (PersistBwdCl, F16) => "bn_persist_bwd_cl_f16",
        (PersistBwdCl, BF16) => "bn_persist_bwd_cl_bf16",
    }
}

/// The unit kinds (`NNF_BN_K_*` in `kernels/batchnorm*.cu`, 1-based) with their labels: index
/// `kind - 1`. Kinds up to [`LAST_TWO_PASS_KIND`] are `batchnorm.cu`'s.
const KINDS: [&str; 17] = [
    "stats_cf",
    "stats_cl",
    "bwd_reduce_cf",
    "bwd_reduce_cl",
    "apply_fwd_none",
    "apply_fwd_relu",
    "apply_fwd_add_relu",
    "apply_fwd_none_last",
    "apply_fwd_relu_last",
    "apply_fwd_add_relu_last",
    "apply_bwd",
    "apply_bwd_last",
    "bwd_channel",
    "persist_fwd_cf",
    "persist_fwd_cl",
    "persist_bwd_cf",
    "persist_bwd_cl",
];

/// The last kind of `kernels/batchnorm.cu` (the persistent file's follow).
const LAST_TWO_PASS_KIND: u32 = 13;

/// The unit kind holding `k` (`NNF_BN_K_*`).
fn kind(k: K) -> u32 {
    let act = |f: Fuse| match f {
        Fuse::None => 0,
        Fuse::Relu => 1,
        Fuse::AddRelu => 2,
    };
    match k {
        K::StatsCf => 1,
        K::StatsCl | K::StatsFinalize => 2,
        K::ReduceCf => 3,
        K::ReduceCl | K::BwdFinalize => 4,
        K::ApplyFwd(f) | K::Fold(f) => 5 + act(f),
        K::ApplyFwdLast(f) => 8 + act(f),
        K::ApplyBwd => 11,
        K::ApplyBwdLast => 12,
        K::ChannelBwd => 13,
        K::PersistFwdCf => 14,
        K::PersistFwdCl => 15,
        K::PersistBwdCf => 16,
        K::PersistBwdCl => 17,
    }
}

/// `NNF_BN_DT` of a type.
fn dt_code(dt: DType) -> u32 {
    match dt {
        DType::F32 => 1,
        DType::F16 => 2,
        DType::BF16 => 3,
    }
}

/// Every unit, built on first use: index `(kind - 1) * 3 + dt_code - 1`.
static UNITS: [OnceLock<KernelFile>; 17 * 3] = [const { OnceLock::new() }; 17 * 3];

/// The compilation unit holding kernel `k` for `dt`: `batchnorm.cu[stats_cf,f32]`, ...
pub(crate) fn unit(k: K, dt: DType) -> &'static KernelFile {
    let (kd, d) = (kind(k), dt_code(dt));
    UNITS[((kd - 1) * 3 + d - 1) as usize].get_or_init(|| {
        let file = if kd <= LAST_TWO_PASS_KIND {
            &kernels::BATCHNORM
        } else {
            &kernels::BATCHNORM_PERSISTENT
        };
        let label = format!("{},{}", KINDS[(kd - 1) as usize], dt.name());
        kernels::unit(file, &label, &[("NNF_BN_KERNEL", kd), ("NNF_BN_DT", d)])
    })
}

/// The kernels the own path launches for a plan, on data whose pointers are 16-byte aligned
/// (what a BatchNorm starts compiling when it is planned; an unaligned call's element-path
/// kernels, or the two-pass kernels a persistent plan falls back to when the device cannot hold
/// the tensor, compile on their first use). `train`: the training forward's and backward's
/// variants when training takes the own path; `inference`: whether inference does. Forward
/// kernels first (a step needs them first), no repeats.
pub(crate) fn planned_kernels(
    arr: Arrangement,
    fuse: Fuse,
    train: Option<(OwnVariant, OwnVariant)>,
    inference: bool,
) -> Vec<K> {
    let first = matches!(arr, Arrangement::First { .. });
    let apply = if first {
        K::ApplyFwd(fuse)
    } else {
        K::ApplyFwdLast(fuse)
    };
    let mut ks = Vec::new();
    if let Some((fwd, bwd)) = train {
        match (fwd, first) {
            (OwnVariant::Persistent, true) => ks.push(K::PersistFwdCf),
            (OwnVariant::Persistent, false) => ks.push(K::PersistFwdCl),
            (_, true) => ks.extend([K::StatsCf, apply]),
            (_, false) => ks.extend([K::StatsCl, apply]),
        }
        match (bwd, first) {
            (OwnVariant::PerChannel, _) => ks.push(K::ChannelBwd),
            (OwnVariant::Persistent, true) => ks.push(K::PersistBwdCf),
            (OwnVariant::Persistent, false) => ks.push(K::PersistBwdCl),
            (_, true) => ks.extend([K::ReduceCf, K::ApplyBwd]),
            (_, false) => ks.extend([K::ReduceCl, K::ApplyBwdLast]),
        }
    }
    if inference && !ks.contains(&apply) {
        ks.push(apply);
    }
    ks
}

/// The units holding `ks` for `dt`, in order, each once.
pub(crate) fn units_of(ks: &[K], dt: DType) -> Vec<&'static KernelFile> {
    let mut out: Vec<&'static KernelFile> = Vec::new();
    for &k in ks {
        let u = unit(k, dt);
        if !out.iter().any(|o| o.name == u.name) {
            out.push(u);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const FUSES: [Fuse; 3] = [Fuse::None, Fuse::Relu, Fuse::AddRelu];

    /// Every kernel of every type (each once).
    fn all_kernels() -> Vec<K> {
        let mut ks = vec![
            K::StatsCf,
            K::StatsCl,
            K::StatsFinalize,
            K::ReduceCf,
            K::ReduceCl,
            K::BwdFinalize,
            K::ApplyBwd,
            K::ApplyBwdLast,
            K::ChannelBwd,
            K::PersistFwdCf,
            K::PersistFwdCl,
            K::PersistBwdCf,
            K::PersistBwdCl,
        ];
        for f in FUSES {
            ks.extend([K::ApplyFwd(f), K::ApplyFwdLast(f), K::Fold(f)]);
        }
        ks
    }

    #[test]
    fn every_kernel_name_is_in_its_file() {
        for dt in DType::ALL {
            // The forward apply kernels come from NNF_BN_APPLY(T, S, <act>, ...).
            for (f, a) in [
                (Fuse::None, "none"),
                (Fuse::Relu, "relu"),
                (Fuse::AddRelu, "add_relu"),
            ] {
                let src = crate::kernels::BATCHNORM.source;
                assert!(src.contains(&format!("NNF_BN_APPLY(T, S, {a}, ")), "{a}");
                assert!(
                    src.contains("bn_apply_fwd_##A##_##S(")
                        && src.contains("bn_apply_fwd_##A##_last_##S(")
                );
                assert_eq!(
                    name(K::ApplyFwd(f), dt),
                    format!("bn_apply_fwd_{a}_{}", dt.name())
                );
                assert_eq!(
                    name(K::ApplyFwdLast(f), dt),
                    format!("bn_apply_fwd_{a}_last_{}", dt.name())
                );
            }
            for k in [
                K::StatsCf,
                K::StatsCl,
                K::StatsFinalize,
                K::ReduceCf,
                K::ReduceCl,
                K::ApplyBwd,
                K::ApplyBwdLast,
                K::ChannelBwd,
            ] {
                let n = name(k, dt);
                let stem = n.trim_end_matches(&format!("_{}", dt.name()));
                assert!(
                    crate::kernels::BATCHNORM.source.contains(stem),
                    "{n} not in kernels/batchnorm.cu"
                );
            }
            for k in [
                K::PersistFwdCf,
                K::PersistFwdCl,
                K::PersistBwdCf,
                K::PersistBwdCl,
            ] {
                let n = name(k, dt);
                let stem = n.trim_end_matches(&format!("_{}", dt.name()));
                assert!(crate::kernels::BATCHNORM_PERSISTENT.source.contains(stem));
            }
        }
        assert!(crate::kernels::BATCHNORM
            .source
            .contains("bn_bwd_finalize("));
        assert!(crate::kernels::BATCHNORM.source.contains("bn_fold("));
    }

    /// The kinds here are the files' `NNF_BN_K_*` (name and value), in the right file.
    #[test]
    fn unit_kinds_match_the_kernel_files() {
        for (i, label) in KINDS.iter().enumerate() {
            let kd = i as u32 + 1;
            let (file, other) = if kd <= LAST_TWO_PASS_KIND {
                (&kernels::BATCHNORM, &kernels::BATCHNORM_PERSISTENT)
            } else {
                (&kernels::BATCHNORM_PERSISTENT, &kernels::BATCHNORM)
            };
            let macro_name = label
                .replace("bwd_reduce", "reduce")
                .replace("bwd_channel", "channel_bwd")
                .to_ascii_uppercase();
            let define = format!("#define NNF_BN_K_{macro_name} {kd}\n");
            assert!(
                file.source.contains(&define),
                "{define:?} not in {}",
                file.name
            );
            assert!(
                !other.source.contains(&define),
                "{define:?} in {}",
                other.name
            );
        }
    }

    #[test]
    fn each_unit_is_named_by_its_kind_and_type_and_selects_it() {
        for dt in DType::ALL {
            for k in all_kernels() {
                let u = unit(k, dt);
                let label = KINDS[(kind(k) - 1) as usize];
                let file = if kind(k) <= LAST_TWO_PASS_KIND {
                    "batchnorm.cu"
                } else {
                    "batchnorm_persistent.cu"
                };
                assert_eq!(u.name, format!("{file}[{label},{}]", dt.name()));
                let head = format!(
                    "#define NNF_BN_KERNEL {}\n#define NNF_BN_DT {}\n",
                    kind(k),
                    dt_code(dt)
                );
                assert!(u.source.starts_with(&head), "{}", u.name);
                // The same unit object every time (built once).
                assert!(std::ptr::eq(u, unit(k, dt)));
                // The label is the unit's kernel's name without `bn_` and the type.
                let stem = name(k, dt)
                    .trim_start_matches("bn_")
                    .trim_end_matches(&format!("_{}", dt.name()));
                assert!(
                    stem == label || matches!(k, K::StatsFinalize | K::BwdFinalize | K::Fold(_)),
                    "{stem} in {}",
                    u.name
                );
            }
        }
    }

    #[test]
    fn planned_kernels_follow_layout_variant_and_activation() {
        use OwnVariant::*;
        let first = Arrangement::First { runs: 8, hw: 3136 };
        let last = Arrangement::Last { rows: 8 * 3136 };
        // The f32 NCHW demo: two-pass both ways, ReLU.
        assert_eq!(
            planned_kernels(first, Fuse::Relu, Some((TwoPass, TwoPass)), true),
            vec![
                K::StatsCf,
                K::ApplyFwd(Fuse::Relu),
                K::ReduceCf,
                K::ApplyBwd
            ]
        );
        assert_eq!(
            planned_kernels(last, Fuse::AddRelu, Some((TwoPass, TwoPass)), false),
            vec![
                K::StatsCl,
                K::ApplyFwdLast(Fuse::AddRelu),
                K::ReduceCl,
                K::ApplyBwdLast
            ]
        );
        assert_eq!(
            planned_kernels(first, Fuse::None, Some((Persistent, Persistent)), false),
            vec![K::PersistFwdCf, K::PersistBwdCf]
        );
        assert_eq!(
            planned_kernels(last, Fuse::Relu, Some((Persistent, PerChannel)), true),
            vec![K::PersistFwdCl, K::ChannelBwd, K::ApplyFwdLast(Fuse::Relu)]
        );
        // Inference only: the apply kernel.
        assert_eq!(
            planned_kernels(first, Fuse::None, None, true),
            vec![K::ApplyFwd(Fuse::None)]
        );
        assert!(planned_kernels(first, Fuse::None, None, false).is_empty());
    }

    #[test]
    fn units_cover_their_kernels_once() {
        let ks = planned_kernels(
            Arrangement::Last { rows: 64 },
            Fuse::Relu,
            Some((OwnVariant::TwoPass, OwnVariant::TwoPass)),
            true,
        );
        let us = units_of(&[ks.clone(), ks.clone()].concat(), DType::F16);
        assert_eq!(us.len(), ks.len());
        // A kernel and its type-free companion share a unit.
        assert!(std::ptr::eq(
            unit(K::StatsCl, DType::F32),
            unit(K::StatsFinalize, DType::F32)
        ));
        assert!(std::ptr::eq(
            unit(K::ReduceCl, DType::BF16),
            unit(K::BwdFinalize, DType::BF16)
        ));
        for f in FUSES {
            assert!(std::ptr::eq(
                unit(K::ApplyFwd(f), DType::F16),
                unit(K::Fold(f), DType::F16)
            ));
        }
    }

    /// Under NVRTC (when present; `NNFUSE_REQUIRE_NVRTC=1` makes its absence a failure): each
    /// unit compiles and defines exactly its kernels, and the units together define every
    /// entry point of the two files.
    #[test]
    fn each_unit_compiles_to_exactly_its_kernels() {
        if !kernels::nvrtc_present() {
            let required = std::env::var("NNFUSE_REQUIRE_NVRTC").is_ok_and(|v| v == "1");
            assert!(
                !required,
                "NNFUSE_REQUIRE_NVRTC=1 but NVRTC cannot be loaded"
            );
            eprintln!("skipping: NVRTC not found");
            return;
        }
        let ks = all_kernels();
        let mut seen = Vec::new();
        for dt in DType::ALL {
            let mut done: Vec<&str> = Vec::new();
            for &k in &ks {
                let u = unit(k, dt);
                if done.contains(&u.name) {
                    continue;
                }
                done.push(u.name);
                // PTX: the front end and NVVM without ptxas, enough to list the entry points.
                let image =
                    kernels::compile(u, "compute_90").unwrap_or_else(|e| panic!("{}: {e}", u.name));
                let ptx = String::from_utf8_lossy(image.bytes()).into_owned();
                let mut entries: Vec<String> = ptx
                    .lines()
                    .filter_map(|l| l.trim().strip_prefix(".visible .entry "))
                    .map(|l| l.trim_end_matches('(').to_string())
                    .collect();
                entries.sort();
                let mut want: Vec<String> = ks
                    .iter()
                    .filter(|&&o| std::ptr::eq(unit(o, dt), u))
                    .map(|&o| name(o, dt).to_string())
                    .collect();
                want.sort();
                want.dedup();
                assert_eq!(entries, want, "{}", u.name);
                seen.extend(entries);
            }
        }
        // Every entry point of the whole files is in some unit.
        for file in [&kernels::BATCHNORM, &kernels::BATCHNORM_PERSISTENT] {
            let ptx = kernels::compile(file, "compute_90").unwrap();
            let text = String::from_utf8_lossy(ptx.bytes()).into_owned();
            for l in text.lines() {
                if let Some(e) = l.trim().strip_prefix(".visible .entry ") {
                    let e = e.trim_end_matches('(');
                    assert!(
                        seen.iter().any(|s| s == e),
                        "{e} of {} in no unit",
                        file.name
                    );
                }
            }
        }
    }
}
