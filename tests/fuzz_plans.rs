//! Fuzz properties of the pure planning and validation surface: the BatchNorm plan, the
//! convolution plan and its size arithmetic, the training unit's plan, GEMM's problem checks
//! and keys, and OneFlow's layout inference, over arbitrary shapes, axes, strides, paddings, dilations, data types,
//! policies and library versions (every integer field includes 0, 1 and values up to
//! `usize::MAX`).
//!
//! The property everywhere: a typed error naming an argument, or a result whose every size is
//! consistent and fits — never a panic, a hang or an overflow. Each property runs a bounded
//! number of cases (CI); `PROPTEST_CASES=N` runs `N` instead (docs/RELIABILITY.md, "Fuzzing").
//! Defects found are kept below as regression tests with their minimal input.

#[path = "fuzz_common/mod.rs"]
mod fuzz_common;

use fuzz_common::{cases, check_all, dim, in_child, small_dim, Outcome};
use nnfuse::batchnorm::{plan as bn_plan, BnPath, Fuse, OwnVariantChoice, Phase, PlanRequest};
use nnfuse::block::{plan_train, TrainPlanRequest, TrainRoute};
use nnfuse::conv::WinogradTile;
use nnfuse::conv::{plan as conv_plan, ConvPath, ConvPlanRequest, ConvShape, Direction};
use nnfuse::gemm::{Alignment, Compute, Key, Problem, Validated};
use nnfuse::internals::conv::{
    balanced_chunks, im2col_chunk, im2col_dims, winograd_chunk, winograd_dims,
};
use nnfuse::internals::gemm::{c_batches_overlap, check_pointers};
use nnfuse::{
    infer_channel_layout, BnImpl, BnModePolicy, Config, ConvAlgoPolicy, DType, Error, TensorFormat,
    WinogradGemmPolicy,
};
use proptest::prelude::*;

const BN_POLICIES: [BnModePolicy; 3] = [
    BnModePolicy::OneFlow,
    BnModePolicy::Auto,
    BnModePolicy::Fast,
];
const BN_IMPLS: [BnImpl; 3] = [BnImpl::Auto, BnImpl::Cudnn, BnImpl::Own];
const OWN_VARIANTS: [OwnVariantChoice; 3] = [
    OwnVariantChoice::Auto,
    OwnVariantChoice::TwoPass,
    OwnVariantChoice::Persistent,
];
const CONV_POLICIES: [&str; 7] = [
    "auto",
    "cudnn",
    "im2col",
    "winograd",
    "winograd_f2x3",
    "winograd_f4x3",
    "direct",
];
const WINOGRAD_POLICIES: [&str; 5] = ["auto", "seed", "tensor_core", "direct", "fused"];

/// An error must be typed and name what is wrong: an argument for [`Error::InvalidArgument`]
/// (and its message must format).
fn names_an_argument(e: &Error) -> Result<(), TestCaseError> {
    let text = e.to_string();
    match e.argument() {
        Some(arg) if !arg.is_empty() => {
            prop_assert!(text.contains(arg), "{text}");
            Ok(())
        }
        _ => Err(TestCaseError::fail(format!(
            "not an InvalidArgument naming one: {e:?}"
        ))),
    }
}

fn checked_product(dims: &[usize]) -> Option<usize> {
    dims.iter().try_fold(1usize, |p, &d| p.checked_mul(d))
}

// ---- layout inference ----

#[test]
fn layout_inference_fits_or_names_the_argument() {
    check_all(
        "layout inference",
        2000,
        shape_and_axis(9),
        |(shape, axis)| match infer_channel_layout(&shape, axis) {
            Ok(l) => {
                prop_assert!(l.n >= 1 && l.c >= 1 && l.h >= 1 && l.w == 1, "{l:?}");
                prop_assert_eq!(l.rank, shape.len());
                prop_assert_eq!(l.c as usize, shape[axis]);
                prop_assert_eq!(Some(l.numel()), checked_product(&shape));
                prop_assert!(l.numel() <= i32::MAX as usize);
                prop_assert_eq!(l.per_channel() * l.c as usize, l.numel());
                Ok(Outcome::Value)
            }
            Err(e) => {
                names_an_argument(&e)?;
                let arg = e.argument().unwrap_or_default().to_string();
                prop_assert!(
                    arg == "shape" || arg == "axis" || arg.starts_with("shape["),
                    "{arg}"
                );
                Ok(Outcome::Rejected)
            }
        },
    );
}

// ---- the BatchNorm plan ----

/// A shape of rank below `max_rank` and an axis: a third plausible (small extents, the axis
/// in range), the rest any extents and any axis.
fn shape_and_axis(max_rank: usize) -> impl Strategy<Value = (Vec<usize>, usize)> {
    let plausible = prop::collection::vec(1usize..=16, 1..max_rank).prop_flat_map(|shape| {
        let rank = shape.len();
        (Just(shape), 0..rank)
    });
    let any_axis = prop_oneof![0usize..9, any::<usize>()];
    prop_oneof![
        plausible,
        (
            prop::collection::vec(small_dim(), 0..max_rank),
            any_axis.clone()
        ),
        (prop::collection::vec(dim(), 0..max_rank), any_axis),
    ]
}

/// Everything a BatchNorm plan depends on besides the shape and axis.
#[derive(Debug, Clone)]
struct BnCase {
    dtype: DType,
    fuse: Fuse,
    phase: Phase,
    config: Config,
    own_variant: OwnVariantChoice,
    cudnn_version: usize,
    cudnn_available: bool,
}

fn bn_case() -> impl Strategy<Value = BnCase> {
    (
        (
            prop::sample::select(DType::ALL.to_vec()),
            prop::sample::select(Fuse::ALL.to_vec()),
            prop::sample::select(Phase::ALL.to_vec()),
        ),
        (
            prop::sample::select(BN_POLICIES.to_vec()),
            prop::sample::select(BN_IMPLS.to_vec()),
            any::<bool>(),
            any::<bool>(),
        ),
        prop::sample::select(OWN_VARIANTS.to_vec()),
        prop_oneof![
            Just(0usize),
            Just(7400),
            Just(7401),
            Just(91900),
            0usize..200_000,
            any::<usize>()
        ],
        any::<bool>(),
    )
        .prop_map(
            |(
                (dtype, fuse, phase),
                (policy, bn_impl, nhwc, no_fusion),
                own_variant,
                cudnn_version,
                cudnn_available,
            )| BnCase {
                dtype,
                fuse,
                phase,
                config: Config::default()
                    .with_bn_mode_policy(policy)
                    .with_bn_impl(bn_impl)
                    .with_nhwc(nhwc)
                    .with_cudnn_fusion_disabled(no_fusion),
                own_variant,
                cudnn_version,
                cudnn_available,
            },
        )
}

#[test]
fn batchnorm_plan_fits_or_names_the_argument() {
    check_all(
        "BatchNorm plan",
        2000,
        (shape_and_axis(9), bn_case()),
        |((shape, axis), c)| {
            let req = PlanRequest {
                shape: &shape,
                axis,
                dtype: c.dtype,
                fuse: c.fuse,
                phase: c.phase,
                config: &c.config,
                cudnn_version: c.cudnn_version,
                cudnn_available: c.cudnn_available,
                own_variant: c.own_variant,
            };
            match bn_plan(&req) {
                Ok(p) => {
                    // The plan's layout is the inference's; every extent fits cuDNN's i32.
                    let inferred = infer_channel_layout(&shape, axis).map_err(|e| e.to_string());
                    prop_assert_eq!(Ok(p.layout), inferred);
                    prop_assert_eq!(Some(p.layout.numel()), checked_product(&shape));
                    prop_assert!(p.layout.numel().checked_mul(c.dtype.size()).is_some());
                    prop_assert_eq!((p.dtype, p.fuse, p.phase), (c.dtype, c.fuse, c.phase));
                    prop_assert!(!p.reasons.is_empty());
                    let own = p.path == BnPath::Own;
                    if !c.cudnn_available {
                        prop_assert!(own);
                    }
                    prop_assert_eq!(p.own_forward.is_some(), own);
                    prop_assert_eq!(p.own_backward.is_some(), own && c.phase == Phase::Training);
                    let _ = format!("{p:?}");
                    Ok(Outcome::Value)
                }
                Err(e) => {
                    names_an_argument(&e)?;
                    Ok(Outcome::Rejected)
                }
            }
        },
    );
}

// ---- the convolution plan ----

/// A convolution problem: mostly small fields (so that plans come out), with every field at
/// times 0, a boundary value or anything up to `usize::MAX`.
fn conv_shape() -> impl Strategy<Value = ConvShape> {
    let pair = || (small_dim(), small_dim());
    let wild = (
        (
            small_dim(),
            small_dim(),
            small_dim(),
            small_dim(),
            small_dim(),
        ),
        (small_dim(), small_dim()),
        (pair(), pair(), pair()),
    );
    // Layers as networks have them (most plan), so that the plan's own checks are reached.
    let plausible = (
        (1usize..9, 1usize..65, 1usize..40, 1usize..40, 1usize..65),
        (1usize..8, 1usize..8),
        (
            (1usize..4, 1usize..4),
            (0usize..4, 0usize..4),
            (1usize..3, 1usize..3),
        ),
    );
    (prop_oneof![plausible, wild], any::<bool>()).prop_map(
        |(((n, c_in, h, w, c_out), (kh, kw), (stride, pad, dilation)), nhwc)| ConvShape {
            n,
            c_in,
            h,
            w,
            c_out,
            kh,
            kw,
            stride,
            pad,
            dilation,
            format: if nhwc {
                TensorFormat::Nhwc
            } else {
                TensorFormat::Nchw
            },
        },
    )
}

fn conv_config() -> impl Strategy<Value = Config> {
    (
        prop::sample::select(CONV_POLICIES.to_vec()),
        prop::sample::select(WINOGRAD_POLICIES.to_vec()),
        any::<bool>(),
        prop_oneof![Just(0usize), Just(1), 1usize..4096, Just(256), dim()],
    )
        .prop_map(|(policy, wg, det, mb)| {
            Config::default()
                .with_conv_algo(policy.parse::<ConvAlgoPolicy>().unwrap())
                .with_winograd_gemm(wg.parse::<WinogradGemmPolicy>().unwrap())
                .with_deterministic(det)
                .with_conv_workspace_mb(mb)
        })
}

/// Everything a convolution plan depends on besides the problem.
fn conv_rest() -> impl Strategy<Value = (DType, Direction, Config, bool)> {
    (
        prop::sample::select(DType::ALL.to_vec()),
        prop::sample::select(Direction::ALL.to_vec()),
        conv_config(),
        any::<bool>(),
    )
}

/// The checks of one plan (or error) for `shape`.
fn check_conv_plan(
    shape: ConvShape,
    (dtype, direction, config, cudnn_present): (DType, Direction, Config, bool),
) -> Result<Outcome, TestCaseError> {
    let req = ConvPlanRequest {
        shape,
        dtype,
        direction,
        config: &config,
        cudnn_present,
        cudnn_graph: cudnn_present,
    };
    let p = match conv_plan(&req) {
        Ok(p) => p,
        Err(e) => {
            names_an_argument(&e)?;
            // Exactly the problems the shape check rejects are rejected (the documented
            // contract of `conv::plan`).
            if nnfuse::conv::plan::check_shape(&shape, dtype).is_ok() {
                prop_assert!(false, "a problem check_shape accepts failed to plan: {e}");
            }
            return Ok(Outcome::Rejected);
        }
    };
    // A plan exists only for a valid problem, whose every size fits.
    prop_assert_eq!(shape.out_hw().ok(), Some(p.out_hw));
    let y = shape.y_len();
    prop_assert!(y.is_ok(), "{:?}", y);
    let y = y.unwrap_or(0);
    let (x, w) = (shape.x_len(), shape.w_len());
    prop_assert!(x.is_ok() && w.is_ok(), "{:?} {:?}", x, w);
    for elems in [y, x.unwrap_or(0), w.unwrap_or(0)] {
        prop_assert!(elems < usize::MAX && elems.checked_mul(dtype.size()).is_some());
    }
    prop_assert_eq!(p.workspace_cap_bytes, config.conv_workspace_bytes());
    prop_assert!(p.flops.is_finite() && p.flops > 0.0, "{}", p.flops);
    prop_assert_eq!(p.paths.len() + p.api_paths.len(), ConvPath::ALL.len());
    prop_assert!(!p.candidates.is_empty());
    for info in &p.paths {
        prop_assert_eq!(info.eligible, info.why_not.is_none(), "{:?}", info);
        if !info.eligible {
            continue;
        }
        if let Some(chunk) = info.chunk {
            // Balanced chunks of at most `chunk` images covering the batch.
            prop_assert!(chunk >= 1 && chunk <= shape.n, "{:?}", info);
            prop_assert_eq!(info.chunks, shape.n.div_ceil(chunk), "{:?}", info);
        }
        let own_scratch = matches!(
            info.path,
            ConvPath::Im2colGemm | ConvPath::WinogradF2x3 | ConvPath::WinogradF4x3
        );
        if own_scratch {
            prop_assert!(info.scratch_bytes <= p.workspace_cap_bytes, "{:?}", info);
        }
    }
    if p.runnable {
        prop_assert!(p.eligible(p.path));
        for r in &p.candidates {
            prop_assert!(p.eligible(r.path), "{r}");
        }
    }
    let _ = p.scratch_bytes();
    for path in ConvPath::ALL {
        let _ = p.fallback_route(path);
    }
    // Text and JSON render.
    let _ = p.to_string();
    let _ = p.to_json().to_string();
    Ok(Outcome::Value)
}

#[test]
fn conv_plan_sizes_fit_or_name_the_argument() {
    check_all(
        "convolution plan",
        2000,
        (conv_shape(), conv_rest()),
        |(shape, rest)| check_conv_plan(shape, rest),
    );
}

/// A training unit's plan (`block::plan_train`): a typed error naming the argument, or a plan
/// whose unfused route is eligible, whose every route has a reason, and whose fused route,
/// where eligible, has ConvStats' plan for the same problem.
#[test]
fn training_unit_plan_is_whole_or_names_the_argument() {
    let fuse = prop::sample::select(Fuse::ALL.to_vec());
    let cudnn = prop_oneof![
        Just(None),
        Just(Some(91900usize)),
        (0usize..100_000).prop_map(Some)
    ];
    check_all(
        "training unit plan",
        1000,
        (conv_shape(), conv_rest(), fuse, cudnn),
        |(shape, (dtype, _, config, _), fuse, cudnn)| {
            let req = TrainPlanRequest {
                shape: &shape,
                dtype,
                fuse,
                config: &config,
                cudnn,
            };
            match plan_train(&req) {
                Err(e) => {
                    names_an_argument(&e)?;
                    Ok(Outcome::Rejected)
                }
                Ok(p) => {
                    prop_assert!(p.eligible(TrainRoute::Unfused), "{p}");
                    for r in TrainRoute::ALL {
                        prop_assert!(!p.reason(r).is_empty(), "{r}: no reason in {p}");
                    }
                    if p.eligible(TrainRoute::Fused) {
                        let stats = p.stats.as_ref();
                        prop_assert!(stats.is_some_and(|st| st.shape == shape), "{p}");
                    }
                    prop_assert!(!p.to_string().is_empty());
                    Ok(Outcome::Value)
                }
            }
        },
    );
}

/// The size helpers on their own, over the whole range (no plan in front of them).
#[test]
fn conv_size_arithmetic_fits_or_errs() {
    let elem = prop_oneof![Just(2usize), Just(4), 0usize..16, any::<usize>()];
    let cap = prop_oneof![Just(256usize << 20), 0usize..4096, any::<usize>()];
    check_all(
        "convolution sizes",
        2000,
        (conv_shape(), elem, cap),
        |(shape, elem, cap)| {
            for (len, name) in [(shape.x_len(), "x"), (shape.w_len(), "w")] {
                if let Err(e) = len {
                    prop_assert_eq!(e.argument(), Some(name));
                }
            }
            if let Ok(d) = im2col_dims(&shape) {
                prop_assert_eq!(Some(d.per_image), d.pixels.checked_mul(d.taps));
            }
            if let Ok(Some(chunk)) = im2col_chunk(&shape, elem, cap) {
                prop_assert!(chunk >= 1 && chunk <= shape.n.max(1));
            }
            for tile in WinogradTile::ALL {
                if let Ok(d) = winograd_dims(&shape, tile) {
                    if let Ok(Some(chunk)) = winograd_chunk(&d, shape.n, elem, cap) {
                        prop_assert!(chunk >= 1 && chunk <= shape.n.max(1));
                    }
                }
            }
            match shape.out_hw() {
                Ok((oh, ow)) => {
                    prop_assert!(oh >= 1 && ow >= 1);
                    let _ = shape.y_len();
                    Ok(Outcome::Value)
                }
                Err(e) => {
                    names_an_argument(&e)?;
                    prop_assert!(shape.y_len().is_err());
                    Ok(Outcome::Rejected)
                }
            }
        },
    );
}

proptest! {
    #![proptest_config(cases(2000))]

    #[test]
    fn balanced_chunks_cover_the_batch(
        n in 0usize..5000,
        max_chunk in prop_oneof![0usize..64, any::<usize>()],
    ) {
        let c = balanced_chunks(n, max_chunk);
        prop_assert_eq!(c.iter().sum::<usize>(), n);
        if let (Some(lo), Some(hi)) = (c.iter().min(), c.iter().max()) {
            prop_assert!(*lo >= 1 && hi - lo <= 1 && *hi <= max_chunk.max(1));
        }
    }
}

// ---- GEMM problems ----

fn gemm_problem() -> impl Strategy<Value = Problem> {
    let scalar = prop_oneof![
        Just(0.0f32),
        Just(1.0),
        Just(f32::NAN),
        Just(f32::INFINITY),
        Just(70000.0),
        any::<f32>()
    ];
    (
        (any::<bool>(), any::<bool>()),
        (small_dim(), small_dim(), small_dim(), small_dim()),
        (small_dim(), small_dim(), small_dim()),
        (dim(), dim(), dim()),
        (scalar.clone(), scalar),
        any::<bool>(),
    )
        .prop_map(
            |(
                (trans_a, trans_b),
                (m, n, k, batch),
                (lda, ldb, ldc),
                (sa, sb, sc),
                (alpha, beta),
                f16,
            )| {
                Problem {
                    trans_a,
                    trans_b,
                    m,
                    n,
                    k,
                    lda,
                    ldb,
                    ldc,
                    stride_a: sa,
                    stride_b: sb,
                    stride_c: sc,
                    batch,
                    alpha,
                    beta,
                    compute: if f16 { Compute::F16 } else { Compute::F32 },
                }
            },
        )
}

/// A problem that is often valid: packed, then some fields replaced.
fn near_valid_gemm_problem() -> impl Strategy<Value = Problem> {
    (
        (1usize..64, 1usize..64, 1usize..64, 1usize..8),
        (any::<bool>(), any::<bool>()),
        prop::option::of((0usize..12, dim())),
    )
        .prop_map(|((m, n, k, b), (ta, tb), poke)| {
            let mut p = Problem::packed_trans(b, m, n, k, ta, tb);
            if let Some((field, v)) = poke {
                match field {
                    0 => p.m = v,
                    1 => p.n = v,
                    2 => p.k = v,
                    3 => p.batch = v,
                    4 => p.lda = v,
                    5 => p.ldb = v,
                    6 => p.ldc = v,
                    7 => p.stride_a = v,
                    8 => p.stride_b = v,
                    9 => p.stride_c = v,
                    10 => p.ldc = p.ldc.saturating_add(v % 7),
                    _ => p.stride_c = p.stride_c.saturating_sub(v % 7),
                }
            }
            p
        })
}

fn check_gemm(
    p: &Problem,
    dtype: DType,
    ptrs: (u64, u64, u64),
    lens: (usize, usize, usize),
) -> Result<Outcome, TestCaseError> {
    let elem = dtype.size();
    match p.check(dtype) {
        Ok(Validated::Empty) => {
            prop_assert!(p.m == 0 || p.n == 0 || p.batch == 0);
            prop_assert!(Key::new(0, p, dtype, Alignment::MAX).is_err());
            Ok(Outcome::Value)
        }
        Ok(Validated::Spans(s)) => {
            for v in [p.m, p.n, p.k, p.batch, p.lda, p.ldb, p.ldc] {
                prop_assert!(v >= 1 && v <= i32::MAX as usize, "{p:?}");
            }
            for span in [s.a, s.b, s.c] {
                prop_assert!(
                    span >= 1
                        && span
                            .checked_mul(elem)
                            .is_some_and(|b| b <= isize::MAX as usize)
                );
            }
            prop_assert!(
                p.batch == 1 || c_batches_overlap(p.m, p.n, p.ldc, p.stride_c, p.batch).is_none()
            );
            let _ = p.flops();
            let align = Alignment::of(p, elem, ptrs.0, ptrs.1, ptrs.2);
            let _ = check_pointers(&s, elem, ptrs.0, ptrs.1, ptrs.2);
            match Key::new(3, p, dtype, align) {
                Ok(key) => {
                    // The key describes the same problem again (the tuning file relies on it).
                    let again = Key::new(3, &key.problem(), dtype, align);
                    prop_assert_eq!(again.as_ref().ok(), Some(&key));
                    let _ = key.to_string();
                }
                Err(e) => names_an_argument(&e)?,
            }
            match p.check_buffers(dtype, lens.0, lens.1, lens.2) {
                Ok(Validated::Spans(s2)) => {
                    prop_assert_eq!(s2, s);
                    prop_assert!(lens.0 >= s.a && lens.1 >= s.b && lens.2 >= s.c);
                }
                Ok(Validated::Empty) => prop_assert!(false, "empty after spans"),
                Err(e) => names_an_argument(&e)?,
            }
            // Buffers of exactly the spans are enough.
            prop_assert_eq!(
                p.check_buffers(dtype, s.a, s.b, s.c).ok(),
                Some(Validated::Spans(s))
            );
            Ok(Outcome::Value)
        }
        Err(e) => {
            names_an_argument(&e)?;
            prop_assert!(p.check_buffers(dtype, lens.0, lens.1, lens.2).is_err());
            Ok(Outcome::Rejected)
        }
    }
}

#[test]
fn gemm_check_fits_or_names_the_argument() {
    let ptrs = (dim(), dim(), dim()).prop_map(|(a, b, c)| (a as u64, b as u64, c as u64));
    check_all(
        "GEMM problem",
        3000,
        (
            prop_oneof![gemm_problem(), near_valid_gemm_problem()],
            prop::sample::select(DType::ALL.to_vec()),
            ptrs,
            (dim(), dim(), dim()),
        ),
        |(p, dtype, ptrs, lens)| check_gemm(&p, dtype, ptrs, lens),
    );
}

proptest! {
    #![proptest_config(cases(3000))]

    /// `c_batches_overlap` against brute force under its precondition (`ldc >= m`).
    #[test]
    fn c_overlap_matches_brute_force(
        m in 1usize..6, n in 1usize..6, extra in 0usize..4, stride in 0usize..40, batch in 1usize..6,
    ) {
        let ldc = m + extra;
        let cells = |t: usize| -> Vec<usize> {
            (0..n).flat_map(|j| (0..m).map(move |i| t * stride + j * ldc + i)).collect()
        };
        let base = cells(0);
        let brute = (1..batch).find(|&t| cells(t).iter().any(|x| base.contains(x)));
        prop_assert_eq!(c_batches_overlap(m, n, ldc, stride, batch), brute);
    }
}

// ---- regressions: defects the fuzzing found (fixed) ----

/// One `Vec` entry per chunk: a batch of `2^62 - 1` one-pixel images (x holds 2^64 - 4 bytes
/// of f32, y as many: `check_shape` accepts it) under a 1 MiB cap is `2^44` chunks, a 128 TiB
/// `Vec` — the allocation fails and the process aborts ("memory allocation of 140737488355328
/// bytes failed"). Smaller batches allocate (and fill) gigabytes. Run in a child process so
/// that the abort is reported; the size is past any address space, so it cannot succeed.
#[test]
fn conv_plan_huge_batch_allocates_per_chunk() {
    let name = "conv_plan_huge_batch_allocates_per_chunk";
    if let Some(out) = in_child(name) {
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success(),
            "the plan did not return: {:?}\n{stderr}",
            out.status
        );
        return;
    }
    let shape = ConvShape {
        n: (1 << 62) - 1,
        c_in: 1,
        h: 1,
        w: 1,
        c_out: 1,
        kh: 1,
        kw: 1,
        stride: (2, 2),
        pad: (0, 0),
        dilation: (1, 1),
        format: TensorFormat::Nchw,
    };
    assert!(nnfuse::conv::plan::check_shape(&shape, DType::F32).is_ok());
    let config = Config::default().with_conv_workspace_mb(1);
    let req = ConvPlanRequest {
        shape,
        dtype: DType::F32,
        direction: Direction::Forward,
        config: &config,
        cudnn_present: false,
        cudnn_graph: false,
    };
    // Whatever the answer (a plan, or an error naming the batch), it must come at once.
    let t = std::time::Instant::now();
    let _ = conv_plan(&req);
    assert!(t.elapsed().as_secs() < 1);
}

/// A valid problem (x, w and y fit; `check_shape` accepts it; cuDNN or the direct kernel could
/// run it) whose im2col column matrix, `(2^61 + 1) * 16` elements, overflows: the whole plan
/// fails with im2col's size error instead of marking im2col ineligible.
#[test]
fn conv_plan_fails_on_a_path_size_overflow() {
    let shape = ConvShape {
        n: 1,
        c_in: 16,
        h: 1,
        w: 1,
        c_out: 1,
        kh: 1,
        kw: 1,
        stride: (1, 1),
        pad: (0, 1 << 60),
        dilation: (1, 1),
        format: TensorFormat::Nchw,
    };
    assert!(nnfuse::conv::plan::check_shape(&shape, DType::F32).is_ok());
    let config = Config::default();
    let req = ConvPlanRequest {
        shape,
        dtype: DType::F32,
        direction: Direction::Forward,
        config: &config,
        cudnn_present: true,
        cudnn_graph: true,
    };
    let p = conv_plan(&req).unwrap_or_else(|e| panic!("{e}"));
    assert!(!p.eligible(ConvPath::Im2colGemm));
}

// ---- the bitmask kernels' launch grid ----

#[test]
fn activation_launch_grid_fits() {
    use nnfuse::internals::activation::{launch_grid, Path, Scheme, MAX_ELEMENTS, THREADS};
    let n = prop_oneof![
        0u64..100_000,
        Just(MAX_ELEMENTS as u64),
        0..=MAX_ELEMENTS as u64
    ];
    let counts = prop_oneof![0u32..200, any::<u32>()];
    check_all(
        "activation launch grid",
        2000,
        (any::<(bool, bool, bool)>(), n, counts.clone(), counts),
        |((naive, vector, f16), n, sms, per_sm)| {
            let scheme = if naive { Scheme::Naive8 } else { Scheme::Warp };
            let path = if vector { Path::Vector } else { Path::Scalar };
            let g = launch_grid(scheme, path, n, if f16 { 2 } else { 4 }, sms, per_sm);
            prop_assert!(g.blocks >= 1 && g.blocks <= i32::MAX as u32, "{g:?}");
            prop_assert_eq!(g.threads, THREADS);
            prop_assert_eq!(g.path, path);
            Ok(Outcome::Value)
        },
    );
}

// ---- the cuDNN graph's layout arithmetic ----

#[test]
fn graph_tensor_specs_fit_or_name_the_argument() {
    use nnfuse::internals::cudnn_graph::{alignment_of, tensor_specs, GraphConvKey};
    let alignment = prop_oneof![Just(16u8), Just(8), Just(4), Just(2), any::<u8>()];
    check_all(
        "cuDNN graph tensors",
        2000,
        (conv_shape(), conv_rest(), alignment, (dim(), dim(), dim())),
        |(shape, (dtype, direction, _, _), alignment, ptrs)| {
            let key = GraphConvKey::new(shape, dtype, direction).with_alignment(alignment);
            let valid = key.validate();
            let _ = alignment_of(&[ptrs.0 as u64, ptrs.1 as u64, ptrs.2 as u64]);
            match tensor_specs(&shape, dtype, alignment) {
                Ok(specs) => {
                    for s in specs {
                        // Every element count and extent fits cuDNN's int64.
                        let mut extent: i64 = 1;
                        for (d, st) in s.dims.iter().zip(s.strides) {
                            prop_assert!(*d >= 1 && st >= 1, "{s:?}");
                            let reach = (d - 1).checked_mul(st);
                            prop_assert!(reach.is_some(), "{s:?}");
                            extent = extent.checked_add(reach.unwrap_or(0)).unwrap_or(-1);
                            prop_assert!(extent >= 1, "{s:?}");
                        }
                    }
                    Ok(Outcome::Value)
                }
                Err(e) => {
                    names_an_argument(&e)?;
                    // The key checks the problem; the specs also refuse what passes usize but
                    // not cuDNN's int64: a dimension (named) or a tensor's element count (x,
                    // w or y).
                    let int64 = matches!(
                        e.argument(),
                        Some("x" | "w" | "y" | "n" | "c_in" | "c_out" | "h" | "w_in" | "kh" | "kw")
                            | Some("oh" | "ow")
                    ) && e.to_string().contains("int64");
                    prop_assert!(
                        valid.is_err() || int64 || e.argument() == Some("alignment"),
                        "{e}"
                    );
                    Ok(Outcome::Rejected)
                }
            }
        },
    );
}

/// Problems `GraphConvKey::validate` accepts whose tensors exceed cuDNN's `int64`: x with
/// `c_in * h * w = 2^62 * 2` elements (y has 2), and y with `2 * (2^62 + 1)` elements (x and w
/// have 1 and 2). Each must be an error naming the argument, not a panic or a spec.
#[test]
fn graph_tensor_specs_overflow_x_strides() {
    use nnfuse::internals::cudnn_graph::{tensor_specs, GraphConvKey};
    let base = ConvShape {
        n: 1,
        c_in: 1,
        h: 1,
        w: 1,
        c_out: 1,
        kh: 1,
        kw: 1,
        stride: (1, 1),
        pad: (0, 0),
        dilation: (1, 1),
        format: TensorFormat::Nchw,
    };
    let big_x = ConvShape {
        c_in: 1 << 62,
        w: 2,
        ..base
    };
    let big_y = ConvShape {
        c_out: 2,
        pad: (0, 1 << 61),
        ..base
    };
    for shape in [big_x, big_y] {
        let key = GraphConvKey::new(shape, DType::F32, Direction::Forward);
        assert!(key.validate().is_ok(), "{shape:?}");
        let r = std::panic::catch_unwind(|| tensor_specs(&shape, DType::F32, 16).map(|_| ()));
        let r = r.unwrap_or_else(|_| panic!("tensor_specs panicked on {shape:?}"));
        assert!(r.unwrap_err().argument().is_some(), "{shape:?}");
    }
}
