//! GPU tests of `nnfuse::gemm`: every case runs on fresh random inputs (seed printed) and is
//! compared element by element with the f64 reference (`nnfuse::reference::gemm`); C is
//! poisoned with NaN when beta == 0, and elements of C's buffer that no matrix covers must come
//! back untouched. Tolerances are `nnfuse::gemm::tolerance`: relative L2 1e-5 for f32 (k <= 4096),
//! 1e-2 for f16/bf16, `max(1e-2, 1e-3 sqrt(k))` for f16 compute.
//!
//! Ignored without a GPU; `.gpu/run` runs them (`cargo test --test gpu_gemm -- --include-ignored`).

mod common;

use std::collections::HashSet;

use common::*;
use half::{bf16, f16};
use nnfuse::gemm::{
    self, Algo, Alignment, Compute, CublasAlgo, Origin, Outcome, Problem, Validated,
};
use nnfuse::internals::util;
use nnfuse::{reference, Config, Context, DType, Element};

/// The sizes of the issue, combined so that the f64 reference stays fast in debug builds.
const SHAPES: [(usize, usize, usize); 10] = [
    (1, 1, 1),
    (7, 7, 7),
    (64, 64, 64),
    (127, 64, 7),
    (7, 127, 513),
    (513, 7, 64),
    (1, 513, 127),
    (513, 1, 1),
    (64, 127, 127),
    (127, 127, 64),
];

const TRANSPOSES: [(bool, bool); 4] = [(false, false), (true, false), (false, true), (true, true)];

/// Tests that look at or reset the process-wide tuning cache run one at a time.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

fn spans(p: &Problem, dt: DType) -> gemm::Spans {
    match p.check(dt).unwrap() {
        Validated::Spans(s) => s,
        Validated::Empty => panic!("empty problem"),
    }
}

/// Random inputs for `p`: A, B and the initial C (None: beta == 0, C poisoned with NaN).
struct Inputs<T> {
    a: Vec<T>,
    b: Vec<T>,
    c: Option<Vec<T>>,
    c_len: usize,
}

fn inputs<T: Element>(p: &Problem, rng: &mut Rng, extra: usize) -> Inputs<T> {
    let s = spans(p, T::DTYPE);
    Inputs {
        a: rng.vec(s.a + extra, -1.0, 1.0),
        b: rng.vec(s.b + extra, -1.0, 1.0),
        c: (p.beta != 0.0).then(|| rng.vec(s.c + extra, -1.0, 1.0)),
        c_len: s.c + extra,
    }
}

/// Runs `p` on the device (operands start `off` elements into their buffers) and returns C.
fn run_on<T: Element>(ctx: &Context, p: &Problem, x: &Inputs<T>, off: usize) -> Vec<T> {
    let s = ctx.stream();
    let a = s.clone_htod(&x.a).unwrap();
    let b = s.clone_htod(&x.b).unwrap();
    let mut c = match &x.c {
        Some(c0) => s.clone_htod(c0).unwrap(),
        None => {
            let mut c = s.alloc_zeros::<T>(x.c_len).unwrap();
            util::fill(ctx, &mut c, T::from_f64(f64::NAN)).unwrap();
            c
        }
    };
    {
        let av = a.slice(off..);
        let bv = b.slice(off..);
        let mut cv = c.slice_mut(off..);
        gemm::strided_batched(ctx, p, &av, &bv, &mut cv).unwrap();
    }
    s.clone_dtoh(&c).unwrap()
}

/// Offsets (from the operand's start) of every element of C's matrices.
fn written(p: &Problem) -> Vec<usize> {
    let mut v = Vec::with_capacity(p.batch * p.m * p.n);
    for bt in 0..p.batch {
        for j in 0..p.n {
            for i in 0..p.m {
                v.push(bt * p.stride_c + i + j * p.ldc);
            }
        }
    }
    v
}

/// Checks the device result against the f64 reference, and that the rest of C is untouched.
fn check<T: Element>(what: &str, p: &Problem, x: &Inputs<T>, off: usize, got: &[T]) {
    let a = f64s(&x.a[off..]);
    let b = f64s(&x.b[off..]);
    let mut want = match &x.c {
        Some(c0) => f64s(&c0[off..]),
        None => vec![f64::NAN; x.c_len - off],
    };
    reference::gemm::gemm_strided_batched(&p.to_reference(), &a, &b, &mut want).unwrap();
    let idx = written(p);
    let g: Vec<f64> = idx.iter().map(|&i| got[off + i].to_f64()).collect();
    let w: Vec<f64> = idx.iter().map(|&i| want[i]).collect();
    let tol = gemm::tolerance(T::DTYPE, p.compute, p.k);
    assert_close(what, &g, &w, tol);
    let set: HashSet<usize> = idx.into_iter().map(|i| i + off).collect();
    for (i, v) in got.iter().enumerate() {
        if set.contains(&i) {
            continue;
        }
        let before = x.c.as_ref().map(|c| c[i].to_f64());
        match before {
            Some(b) => assert!(
                v.to_f64() == b || (b.is_nan() && v.to_f64().is_nan()),
                "{what}: element {i} outside C's matrices changed"
            ),
            None => assert!(
                v.to_f64().is_nan(),
                "{what}: element {i} outside C's matrices was written"
            ),
        }
    }
}

fn case<T: Element>(ctx: &Context, p: &Problem, rng: &mut Rng, off: usize, what: &str) {
    let x = inputs::<T>(p, rng, off);
    let got = run_on(ctx, p, &x, off);
    check(what, p, &x, off, &got);
}

fn for_each_type(mut f: impl FnMut(DType)) {
    for dt in DType::ALL {
        f(dt);
    }
}

fn case_dyn(ctx: &Context, dt: DType, p: &Problem, rng: &mut Rng, off: usize, what: &str) {
    match dt {
        DType::F32 => case::<f32>(ctx, p, rng, off, what),
        DType::F16 => case::<f16>(ctx, p, rng, off, what),
        DType::BF16 => case::<bf16>(ctx, p, rng, off, what),
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn odd_sizes_every_type_and_transpose_tuned() {
    let ctx = gpu();
    let mut rng = Rng::fresh("gemm odd sizes");
    for_each_type(|dt| {
        for (m, n, k) in SHAPES {
            for (ta, tb) in TRANSPOSES {
                let p = Problem::packed_trans(2, m, n, k, ta, tb);
                let what = format!("{dt} {m}x{n}x{k} trans ({ta}, {tb})");
                case_dyn(&ctx, dt, &p, &mut rng, 0, &what);
            }
        }
    });
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn odd_sizes_with_search_off() {
    let ctx = gpu_with(Config::default().with_gemm_search(false));
    let mut rng = Rng::fresh("gemm search off");
    for_each_type(|dt| {
        for (m, n, k) in SHAPES {
            let (ta, tb) = TRANSPOSES[(m + n + k) % 4];
            let p = Problem::packed_trans(3, m, n, k, ta, tb);
            case_dyn(
                &ctx,
                dt,
                &p,
                &mut rng,
                0,
                &format!("{dt} {m}x{n}x{k} default"),
            );
        }
    });
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn padded_leading_dims_odd_strides_alpha_beta() {
    let ctx = gpu();
    let mut rng = Rng::fresh("gemm padded");
    for_each_type(|dt| {
        for (m, n, k) in [(7, 127, 64), (64, 64, 64), (127, 7, 513)] {
            for (ta, tb) in TRANSPOSES {
                let mut p = Problem::packed_trans(3, m, n, k, ta, tb).with_scalars(0.75, -1.5);
                p.lda += 3;
                p.ldb += 5;
                p.ldc += 1;
                let (ra, ca) = p.a_dims();
                let (rb, cb) = p.b_dims();
                // Odd strides: every batch after the first starts misaligned.
                p.stride_a = (ca - 1) * p.lda + ra + 7;
                p.stride_b = (cb - 1) * p.ldb + rb + 3;
                p.stride_c = (n - 1) * p.ldc + m + 1;
                let what = format!("{dt} padded {m}x{n}x{k} trans ({ta}, {tb})");
                case_dyn(&ctx, dt, &p, &mut rng, 0, &what);
            }
        }
    });
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn broadcast_with_stride_zero() {
    let ctx = gpu();
    let mut rng = Rng::fresh("gemm broadcast");
    for_each_type(|dt| {
        for (m, n, k) in [(64, 127, 7), (127, 64, 513)] {
            let base = Problem::packed(4, m, n, k);
            for (sa, sb) in [(0, base.stride_b), (base.stride_a, 0), (0, 0)] {
                let p = Problem {
                    stride_a: sa,
                    stride_b: sb,
                    ..base
                }
                .with_scalars(1.25, 0.5);
                let what = format!("{dt} broadcast {m}x{n}x{k} strides ({sa}, {sb})");
                case_dyn(&ctx, dt, &p, &mut rng, 0, &what);
            }
        }
    });
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn f16_compute() {
    let ctx = gpu();
    let mut rng = Rng::fresh("gemm f16 compute");
    for (m, n, k) in [(64, 64, 64), (127, 7, 513), (7, 127, 127), (513, 64, 7)] {
        for (ta, tb) in TRANSPOSES {
            for beta in [0.0, 0.5] {
                let p = Problem::packed_trans(2, m, n, k, ta, tb)
                    .with_compute(Compute::F16)
                    .with_scalars(0.5, beta);
                let what = format!("f16 compute {m}x{n}x{k} ({ta}, {tb}) beta {beta}");
                case::<f16>(&ctx, &p, &mut rng, 0, &what);
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn misaligned_operands() {
    // Views one element into their buffers: 2-byte (f16/bf16) or 4-byte (f32) alignment, which
    // rules out cuBLASLt kernels that need 16 bytes; results must still be right.
    let ctx = gpu();
    let mut rng = Rng::fresh("gemm misaligned");
    for_each_type(|dt| {
        for (m, n, k) in [(64, 64, 64), (127, 64, 7)] {
            let p = Problem::packed(3, m, n, k).with_scalars(1.0, 1.0);
            case_dyn(
                &ctx,
                dt,
                &p,
                &mut rng,
                1,
                &format!("{dt} misaligned {m}x{n}x{k}"),
            );
        }
    });
}

/// The same inputs through the tuned path and the cuBLAS default agree within tolerance, for a
/// shape with many cuBLASLt candidates.
fn tuned_vs_default<T: Element>(tuned: &Context, plain: &Context, p: &Problem, rng: &mut Rng) {
    let x = inputs::<T>(p, rng, 0);
    let g1 = f64s(&run_on(tuned, p, &x, 0));
    let g2 = f64s(&run_on(plain, p, &x, 0));
    let idx = written(p);
    let a: Vec<f64> = idx.iter().map(|&i| g1[i]).collect();
    let b: Vec<f64> = idx.iter().map(|&i| g2[i]).collect();
    let tol = gemm::tolerance(T::DTYPE, p.compute, p.k);
    assert_close(&format!("{} tuned vs default", T::DTYPE), &a, &b, tol);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn tuned_equals_default() {
    let tuned = gpu();
    let plain = gpu_with(Config::default().with_gemm_search(false));
    let mut rng = Rng::fresh("gemm tuned vs default");
    let p = Problem::packed(8, 512, 384, 1024).with_scalars(1.0, 0.5);
    tuned_vs_default::<f32>(&tuned, &plain, &p, &mut rng);
    tuned_vs_default::<f16>(&tuned, &plain, &p, &mut rng);
    tuned_vs_default::<bf16>(&tuned, &plain, &p, &mut rng);
    let h = Problem::packed_trans(4, 256, 256, 2048, true, false).with_compute(Compute::F16);
    tuned_vs_default::<f16>(&tuned, &plain, &h, &mut rng);
}

/// The f64 reference of single elements `(batch, i, j)` of C (beta == 0): a dot product each,
/// so that large problems are checked in milliseconds.
fn reference_at(p: &Problem, a: &[f64], b: &[f64], at: &[(usize, usize, usize)]) -> Vec<f64> {
    at.iter()
        .map(|&(bt, i, j)| {
            let (oa, ob) = (bt * p.stride_a, bt * p.stride_b);
            let mut acc = 0.0;
            for l in 0..p.k {
                let av = if p.trans_a {
                    a[oa + l + i * p.lda]
                } else {
                    a[oa + i + l * p.lda]
                };
                let bv = if p.trans_b {
                    b[ob + j + l * p.ldb]
                } else {
                    b[ob + l + j * p.ldb]
                };
                acc += av * bv;
            }
            p.alpha as f64 * acc
        })
        .collect()
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn search_report_and_every_candidate_is_correct() {
    let _serial = serial();
    let ctx = gpu();
    let mut rng = Rng::fresh("gemm search report");
    let p = Problem::packed(16, 1024, 1024, 1024);
    let r = gemm::search(&ctx, &p, DType::F16, Alignment::MAX).unwrap();
    println!(
        "search {:.1} ms ({:?}), setup {:.1} ms, {} candidates, {} rounds, winner #{} {}",
        r.wall_ms,
        r.phases,
        r.setup_ms,
        r.candidates.len(),
        r.rounds,
        r.winner,
        r.choice.label()
    );
    for (i, c) in r.candidates.iter().enumerate() {
        println!(
            "  {i:2} {:<70} {:?} {:?}",
            c.label(),
            c.median_ms(),
            c.vs_default().map(|v| v.median)
        );
    }
    assert_eq!(r.candidates[0].algo, Algo::CUBLAS_DEFAULT);
    assert!(
        r.rounds >= nnfuse::internals::gemm::MIN_ROUNDS
            && r.rounds <= nnfuse::internals::gemm::MAX_ROUNDS
    );
    for c in &r.candidates {
        if let Outcome::Timed { timing, burst, .. } = &c.outcome {
            // Every timed candidate has one sample per round (interleaved).
            assert_eq!(timing.iters, r.rounds, "{}", c.label());
            assert!(*burst >= 1);
        }
    }
    // The winner is the default, or a candidate that passed the rule against it.
    if r.winner != 0 {
        let v = r.candidates[r.winner].vs_default().unwrap();
        assert!(nnfuse::internals::gemm::beats_default(&v), "winner {v:?}");
        assert!(r.winner_ms().unwrap() < r.default_ms().unwrap());
    }
    let cc = ctx.info().compute_capability;
    if cc.0 >= 8 {
        assert!(!r.explicit_cublas);
        let lt = r
            .candidates
            .iter()
            .filter(|c| matches!(c.algo, Algo::Lt(_)))
            .count();
        assert!(lt >= 2, "only {lt} cuBLASLt candidates: {:?}", r.lt_note);
        assert!(r
            .candidates
            .iter()
            .all(|c| !matches!(c.algo, Algo::Cublas(a) if a != CublasAlgo::DEFAULT)));
    }
    // The 200 ms target is measured by benches/gemm.rs on an idle GPU; other tests share the
    // GPU here (this binary's 15 tests run in parallel), so this only catches a runaway search:
    // one full run on the H100 read 2514 ms here.
    assert!(
        r.wall_ms < 10_000.0 || under_sanitizer(),
        "search took {:.0} ms",
        r.wall_ms
    );
    // The stored choice is what the report says, and what the next call finds.
    let key = gemm::Key::new(ctx.info().ordinal as u32, &p, DType::F16, Alignment::MAX).unwrap();
    let cached = gemm::lookup(&key).unwrap();
    assert_eq!(cached.algo, r.choice.algo);
    assert_eq!(cached.origin, Origin::Searched);

    // Every timed candidate (and the explicit cuBLAS algorithms), prepared once and run on the
    // searched shape, gives the cuBLAS default's result within tolerance (whole C), and the
    // default matches the f64 reference on 2048 sampled elements.
    let x = inputs::<f16>(&p, &mut rng, 0);
    let s = ctx.stream();
    let a = s.clone_htod(&x.a).unwrap();
    let b = s.clone_htod(&x.b).unwrap();
    let run = |algo: &Algo| -> Vec<f64> {
        let prepared = gemm::Prepared::new(&ctx, &p, DType::F16, algo, Alignment::MAX).unwrap();
        let mut c = s.alloc_zeros::<f16>(x.c_len).unwrap();
        util::fill(&ctx, &mut c, f16::NAN).unwrap();
        prepared.run(&ctx, &a, &b, &mut c).unwrap();
        f64s(&s.clone_dtoh(&c).unwrap())
    };
    let want = run(&Algo::CUBLAS_DEFAULT);
    let at: Vec<(usize, usize, usize)> = (0..2048)
        .map(|_| {
            let pick = |n: usize, rng: &mut Rng| (rng.next_u64() % n as u64) as usize;
            (
                pick(p.batch, &mut rng),
                pick(p.m, &mut rng),
                pick(p.n, &mut rng),
            )
        })
        .collect();
    let exact = reference_at(&p, &f64s(&x.a), &f64s(&x.b), &at);
    let got: Vec<f64> = at
        .iter()
        .map(|&(bt, i, j)| want[bt * p.stride_c + i + j * p.ldc])
        .collect();
    let tol = gemm::tolerance(DType::F16, p.compute, p.k);
    assert_close("cuBLAS default vs f64 reference", &got, &exact, tol);
    let mut algos: Vec<Algo> = r
        .candidates
        .iter()
        .skip(1)
        .filter(|c| matches!(c.outcome, Outcome::Timed { .. }))
        .map(|c| c.algo)
        .collect();
    for i in [0, 5, 23] {
        algos.push(Algo::Cublas(CublasAlgo::algo(i).unwrap()));
    }
    algos.push(Algo::Cublas(CublasAlgo::DEFAULT_TENSOR_OP));
    for algo in &algos {
        let got = run(algo);
        assert_close(&format!("{algo:?} vs the default"), &got, &want, tol);
    }

    // A prepared cuBLASLt algorithm refuses operands less aligned than it needs (a view one
    // element in: 2-byte alignment), with an error rather than a launch; and the wrong dtype.
    if let Some(lt) = algos.iter().find(|a| matches!(a, Algo::Lt(_))) {
        let prepared = gemm::Prepared::new(&ctx, &p, DType::F16, lt, Alignment::MAX).unwrap();
        let big = s.alloc_zeros::<f16>(x.c_len + 1).unwrap();
        let mut c = s.alloc_zeros::<f16>(x.c_len + 1).unwrap();
        let mut cv = c.slice_mut(1..);
        match prepared.run(&ctx, &big.slice(1..), &b, &mut cv) {
            Ok(()) => {} // an algorithm that needs only 2 bytes
            Err(e) => assert!(e.to_string().contains("alignment"), "{e}"),
        }
        let a32 = s.alloc_zeros::<f32>(x.c_len).unwrap();
        let mut c32 = s.alloc_zeros::<f32>(x.c_len).unwrap();
        let e = prepared.run(&ctx, &a32, &a32, &mut c32).unwrap_err();
        assert_eq!(e.argument(), Some("a"), "{e}");
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn search_off_runs_the_default_and_caches_nothing() {
    let _serial = serial();
    let ctx = gpu_with(Config::default().with_gemm_search(false));
    let mut rng = Rng::fresh("gemm search off cache");
    let p = Problem::packed(3, 33, 65, 17); // a shape no other test uses
    let x = inputs::<f32>(&p, &mut rng, 0);
    let got = run_on(&ctx, &p, &x, 0);
    check("search off", &p, &x, 0, &got);
    // The key these operands have (4-byte aligned batches: 33 * 17 * 4 bytes apart).
    let s = ctx.stream();
    let (a, b, c) = (
        s.clone_htod(&x.a).unwrap(),
        s.clone_htod(&x.b).unwrap(),
        s.alloc_zeros::<f32>(x.c_len).unwrap(),
    );
    let key = gemm::key_for(&ctx, &p, &a, &b, &c).unwrap();
    assert_eq!(key.align.a, 4);
    assert!(gemm::lookup(&key).is_none());
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn tuning_cache_file_is_written_and_reused() {
    let _serial = serial();
    let dir = std::env::temp_dir().join(format!("nnfuse-gpu-gemm-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("tuning.json");
    let _ = std::fs::remove_file(&file);
    let cfg = Config::default().with_tuning_cache(Some(file.clone()));
    let mut rng = Rng::fresh("gemm cache file");
    let p = Problem::packed(5, 96, 80, 112); // a shape no other test uses
    let key = gemm::Key::new(0, &p, DType::BF16, Alignment::MAX).unwrap();
    {
        let ctx = gpu_with(cfg.clone());
        case::<bf16>(&ctx, &p, &mut rng, 0, "cache file, first process");
        assert_eq!(gemm::lookup(&key).unwrap().origin, Origin::Searched);
    }
    let text = std::fs::read_to_string(&file).unwrap();
    assert!(text.contains("\"m\": 96"), "{text}");
    let tag = nnfuse::internals::gemm::device_tag(&gpu()).unwrap();
    let loaded = nnfuse::internals::gemm::load_file(&file, &tag, 0);
    assert!(loaded.warnings.is_empty(), "{:?}", loaded.warnings);
    assert!(loaded.entries.iter().any(|(k, _)| *k == key));

    // "A later process": forget the memory, open a new Context on the same file.
    nnfuse::internals::gemm::clear();
    {
        let ctx = gpu_with(cfg.clone());
        case::<bf16>(&ctx, &p, &mut rng, 0, "cache file, second process");
        assert_eq!(gemm::lookup(&key).unwrap().origin, Origin::File);
    }

    // A corrupted file is ignored (warned), the problem searched again, the file replaced.
    std::fs::write(&file, "{ this is not json").unwrap();
    nnfuse::internals::gemm::clear();
    {
        let ctx = gpu_with(cfg);
        case::<bf16>(&ctx, &p, &mut rng, 0, "cache file, corrupted");
        assert_eq!(gemm::lookup(&key).unwrap().origin, Origin::Searched);
    }
    assert!(!nnfuse::internals::gemm::load_file(&file, &tag, 0)
        .entries
        .is_empty());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn bad_arguments_never_reach_the_gpu() {
    let ctx = gpu();
    let s = ctx.stream();
    let p = Problem::packed(4, 16, 16, 16);
    let a = s.alloc_zeros::<f32>(4 * 256).unwrap();
    let short = s.alloc_zeros::<f32>(3 * 256).unwrap();
    let mut c = s.alloc_zeros::<f32>(4 * 256).unwrap();
    util::fill(&ctx, &mut c, 7.0).unwrap();
    let e = gemm::strided_batched(&ctx, &p, &short, &a, &mut c).unwrap_err();
    assert_eq!(e.argument(), Some("stride_a"), "{e}");
    let e = gemm::strided_batched(&ctx, &p, &a, &a.slice(..100), &mut c).unwrap_err();
    assert_eq!(e.argument(), Some("b"), "{e}");
    let bad = Problem { stride_c: 8, ..p };
    let e = gemm::strided_batched(&ctx, &bad, &a, &a, &mut c).unwrap_err();
    assert_eq!(e.argument(), Some("stride_c"), "{e}");
    let h = Problem {
        compute: Compute::F16,
        ..p
    };
    let e = gemm::strided_batched(&ctx, &h, &a, &a, &mut c).unwrap_err();
    assert_eq!(e.argument(), Some("compute"), "{e}");
    // Nothing was written.
    assert!(s.clone_dtoh(&c).unwrap().iter().all(|&v| v == 7.0));
    // Empty problems are no-ops.
    gemm::strided_batched(&ctx, &Problem::packed(0, 16, 16, 16), &a, &a, &mut c).unwrap();
    assert!(s.clone_dtoh(&c).unwrap().iter().all(|&v| v == 7.0));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn many_threads_share_the_cache() {
    let ctx = gpu();
    std::thread::scope(|sc| {
        for t in 0..4u64 {
            let ctx = ctx.clone();
            sc.spawn(move || {
                let mut rng = Rng::new(t + 1);
                for i in 0..3 {
                    let p = Problem::packed(2, 48 + 16 * i, 40, 72);
                    case::<f16>(&ctx, &p, &mut rng, 0, &format!("thread {t} shape {i}"));
                }
            });
        }
    });
}

// ------------------------------------------------------------------------------------------
// The search on the caller's operands, its fallback to scratch operands, and the scratch kept
// between searches.

/// Bit patterns, so that "unchanged" includes NaNs and signed zeros.
fn bits<T: Element>(v: &[T]) -> Vec<u64> {
    v.iter().map(|x| x.to_f64().to_bits()).collect()
}

/// A shape with gaps in C (ldc > m) and padded A and B, for `search_on` checks.
fn padded(batch: usize, m: usize, n: usize, k: usize, beta: f32) -> Problem {
    let mut p = Problem::packed(batch, m, n, k).with_scalars(1.5, beta);
    p.lda += 2;
    p.ldb += 1;
    p.ldc += 3;
    p.stride_a = p.lda * k + 5;
    p.stride_b = p.ldb * n;
    p.stride_c = p.ldc * n + 7;
    p
}

/// `search_on` on the caller's buffers: A and B are never written; with beta != 0 C is left as
/// it was, with beta == 0 C's matrices hold the default's result and its gaps are untouched; the
/// tuned call that follows computes the right result on the same buffers.
fn caller_buffers_case<T: Element>(ctx: &Context, p: &Problem, rng: &mut Rng, what: &str) {
    let x = inputs::<T>(p, rng, 0);
    let s = ctx.stream();
    let a = s.clone_htod(&x.a).unwrap();
    let b = s.clone_htod(&x.b).unwrap();
    let c0: Vec<T> = match &x.c {
        Some(c) => c.clone(),
        None => vec![T::from_f64(f64::NAN); x.c_len],
    };
    let mut c = s.clone_htod(&c0).unwrap();
    let r = gemm::search_on(ctx, p, &a, &b, &mut c).unwrap();
    assert_eq!(r.operands, gemm::SearchOperands::Caller, "{what}");
    let elem = T::DTYPE.size();
    let c_bytes = x.c_len * elem;
    // Scratch: one C (beta == 0) or two, never A or B.
    let want_scratch = if p.beta == 0.0 { c_bytes } else { 2 * c_bytes };
    assert!(
        r.scratch_bytes >= want_scratch && r.scratch_bytes < want_scratch + 2048,
        "{what}: {} bytes of scratch for C of {c_bytes} bytes",
        r.scratch_bytes
    );
    assert!(r.allocated_bytes == 0 || r.allocated_bytes >= r.scratch_bytes);
    assert!(gemm::search_scratch_bytes(ctx).unwrap() >= r.scratch_bytes);
    println!(
        "{what}: search {:.1} ms ({:?}), winner {}",
        r.wall_ms,
        r.phases,
        r.choice.label()
    );
    assert_eq!(
        bits(&s.clone_dtoh(&a).unwrap()),
        bits(&x.a),
        "{what}: A changed"
    );
    assert_eq!(
        bits(&s.clone_dtoh(&b).unwrap()),
        bits(&x.b),
        "{what}: B changed"
    );
    let after = s.clone_dtoh(&c).unwrap();
    if p.beta != 0.0 {
        assert_eq!(bits(&after), bits(&c0), "{what}: C changed (beta != 0)");
    } else {
        // The default's result in the matrices, the gaps untouched (still NaN).
        check(&format!("{what}: C after the search"), p, &x, 0, &after);
    }
    // The call with the stored choice, on the same buffers: the right result.
    let mut c = s.clone_htod(&c0).unwrap();
    gemm::strided_batched(ctx, p, &a, &b, &mut c).unwrap();
    check(
        &format!("{what}: tuned call"),
        p,
        &x,
        0,
        &s.clone_dtoh(&c).unwrap(),
    );
    assert_eq!(
        bits(&s.clone_dtoh(&a).unwrap()),
        bits(&x.a),
        "{what}: A changed"
    );
    assert_eq!(
        bits(&s.clone_dtoh(&b).unwrap()),
        bits(&x.b),
        "{what}: B changed"
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn search_on_caller_buffers_leaves_inputs_alone() {
    let ctx = gpu();
    let mut rng = Rng::fresh("gemm search on caller buffers");
    for beta in [0.0, 0.5] {
        let p = Problem::packed(4, 256, 192, 128).with_scalars(1.0, beta);
        caller_buffers_case::<f16>(&ctx, &p, &mut rng, &format!("f16 packed beta {beta}"));
        let p = padded(3, 127, 65, 96, beta);
        caller_buffers_case::<bf16>(&ctx, &p, &mut rng, &format!("bf16 padded beta {beta}"));
        caller_buffers_case::<f32>(&ctx, &p, &mut rng, &format!("f32 padded beta {beta}"));
    }
    // The first strided_batched call of a key (a shape no other test uses) searches on the
    // caller's buffers too: A and B come back bit for bit, C right, gaps untouched.
    let _serial = serial(); // no cache clearing meanwhile
    for beta in [0.0, 1.0] {
        let p = padded(2, 129, 67, 33, beta);
        let x = inputs::<f16>(&p, &mut rng, 0);
        let s = ctx.stream();
        let a = s.clone_htod(&x.a).unwrap();
        let b = s.clone_htod(&x.b).unwrap();
        let mut c = match &x.c {
            Some(c0) => s.clone_htod(c0).unwrap(),
            None => s.clone_htod(&vec![f16::NAN; x.c_len]).unwrap(),
        };
        let key = gemm::key_for(&ctx, &p, &a, &b, &c).unwrap();
        assert!(gemm::lookup(&key).is_none(), "another test uses {key}");
        gemm::strided_batched(&ctx, &p, &a, &b, &mut c).unwrap();
        assert_eq!(gemm::lookup(&key).unwrap().origin, Origin::Searched);
        let what = format!("first call, beta {beta}");
        check(&what, &p, &x, 0, &s.clone_dtoh(&c).unwrap());
        assert_eq!(
            bits(&s.clone_dtoh(&a).unwrap()),
            bits(&x.a),
            "{what}: A changed"
        );
        assert_eq!(
            bits(&s.clone_dtoh(&b).unwrap()),
            bits(&x.b),
            "{what}: B changed"
        );
    }
}

/// NaN-aware comparison: the same elements are NaN in both, the rest within `tol`.
fn assert_same_nans_else_close(what: &str, got: &[f64], want: &[f64], tol: f64) -> usize {
    assert_eq!(got.len(), want.len());
    let mut nans = 0;
    let (mut g, mut w) = (Vec::new(), Vec::new());
    for (i, (&x, &y)) in got.iter().zip(want).enumerate() {
        assert_eq!(
            x.is_nan(),
            y.is_nan(),
            "{what}: element {i}: got {x}, want {y}"
        );
        if x.is_nan() {
            nans += 1;
        } else {
            g.push(x);
            w.push(y);
        }
    }
    assert_close(what, &g, &w, tol);
    nans
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn unsuitable_caller_data_falls_back_to_scratch_operands() {
    let ctx = gpu();
    let plain = gpu_with(Config::default().with_gemm_search(false));
    let mut rng = Rng::fresh("gemm search fallback");
    let s = ctx.stream();
    let p = Problem::packed(3, 96, 80, 64);
    let tol = gemm::tolerance(DType::F16, p.compute, p.k);
    let sp = spans(&p, DType::F16);
    let full_scratch = (sp.a + sp.b + 2 * sp.c) * 2;

    // A NaN in A (batch 1, row 5, column 7): row 5 of C[1] is NaN whatever the algorithm.
    let mut x = inputs::<f16>(&p, &mut rng, 0);
    x.a[p.stride_a + 5 + 7 * p.lda] = f16::NAN;
    let a = s.clone_htod(&x.a).unwrap();
    let b = s.clone_htod(&x.b).unwrap();
    let mut c = s.alloc_zeros::<f16>(x.c_len).unwrap();
    let r = gemm::search_on(&ctx, &p, &a, &b, &mut c).unwrap();
    println!("NaN in A: {}; winner {}", r.operands, r.choice.label());
    assert_eq!(
        r.operands,
        gemm::SearchOperands::Fallback(gemm::Unsuitable::NonFinite { count: p.n as u64 })
    );
    assert!(
        r.scratch_bytes >= full_scratch,
        "{} < {full_scratch}",
        r.scratch_bytes
    );
    // The candidates were checked on the pseudo-random scratch operands (A, B, two C's) above.
    assert!(r.default_ms().is_some());
    assert_eq!(bits(&s.clone_dtoh(&a).unwrap()), bits(&x.a), "A changed");
    assert_eq!(bits(&s.clone_dtoh(&b).unwrap()), bits(&x.b), "B changed");
    // The tuned call on the NaN data: NaN where the cuBLAS default (and the f64 reference) put
    // it, the rest right.
    let mut tuned = s.alloc_zeros::<f16>(x.c_len).unwrap();
    gemm::strided_batched(&ctx, &p, &a, &b, &mut tuned).unwrap();
    let mut dflt = s.alloc_zeros::<f16>(x.c_len).unwrap();
    gemm::strided_batched(&plain, &p, &a, &b, &mut dflt).unwrap();
    let tuned = f64s(&s.clone_dtoh(&tuned).unwrap());
    let dflt = f64s(&s.clone_dtoh(&dflt).unwrap());
    let nans = assert_same_nans_else_close("NaN input: tuned vs default", &tuned, &dflt, tol);
    assert_eq!(nans, p.n);
    let mut want = vec![0.0; x.c_len];
    reference::gemm::gemm_strided_batched(&p.to_reference(), &f64s(&x.a), &f64s(&x.b), &mut want)
        .unwrap();
    assert_same_nans_else_close("NaN input: tuned vs f64 reference", &tuned, &want, tol);

    // All-zero operands (buffers fresh from alloc_zeros): mostly zero.
    let z = s.alloc_zeros::<f16>(x.a.len()).unwrap();
    let mut c = s.alloc_zeros::<f16>(x.c_len).unwrap();
    let r = gemm::search_on(&ctx, &p, &z, &b, &mut c).unwrap();
    println!("zero A: {}", r.operands);
    assert!(
        matches!(
            r.operands,
            gemm::SearchOperands::Fallback(gemm::Unsuitable::MostlyZero { nonzero: 0, .. })
        ),
        "{:?}",
        r.operands
    );

    // beta * C dominates (tiny A and B, C of order 1): the product's share is negligible.
    let q = p.with_scalars(1.0, 1.0);
    let y = Inputs::<f16> {
        a: rng.vec(x.a.len(), -0.01, 0.01),
        b: rng.vec(x.b.len(), -0.01, 0.01),
        c: Some(rng.vec(x.c_len, -1.0, 1.0)),
        c_len: x.c_len,
    };
    let a = s.clone_htod(&y.a).unwrap();
    let b = s.clone_htod(&y.b).unwrap();
    let c0 = y.c.clone().unwrap();
    let mut c = s.clone_htod(&c0).unwrap();
    let r = gemm::search_on(&ctx, &q, &a, &b, &mut c).unwrap();
    println!("beta C dominates: {}", r.operands);
    assert!(
        matches!(
            r.operands,
            gemm::SearchOperands::Fallback(gemm::Unsuitable::ProductNegligible { share })
                if share < nnfuse::internals::gemm::MIN_PRODUCT_SHARE
        ),
        "{:?}",
        r.operands
    );
    assert_eq!(
        bits(&s.clone_dtoh(&c).unwrap()),
        bits(&c0),
        "C changed (beta != 0)"
    );
    let mut c = s.clone_htod(&c0).unwrap();
    gemm::strided_batched(&ctx, &q, &a, &b, &mut c).unwrap();
    check(
        "beta C dominates: tuned call",
        &q,
        &y,
        0,
        &s.clone_dtoh(&c).unwrap(),
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn search_scratch_is_kept_between_searches() {
    let ctx = gpu(); // a Context of its own: its scratch starts empty
    assert_eq!(gemm::search_scratch_bytes(&ctx).unwrap(), 0);
    let big = Problem::packed(4, 512, 512, 256);
    let small = Problem::packed(2, 128, 96, 64);
    let r1 = gemm::search(&ctx, &big, DType::F16, Alignment::MAX).unwrap();
    assert_eq!(r1.operands, gemm::SearchOperands::Scratch);
    let sp = spans(&big, DType::F16);
    assert!(r1.scratch_bytes >= (sp.a + sp.b + 2 * sp.c) * 2);
    assert!(r1.allocated_bytes >= r1.scratch_bytes);
    let held = gemm::search_scratch_bytes(&ctx).unwrap();
    assert_eq!(held, r1.allocated_bytes);
    println!(
        "first search: {:?}, allocated {}",
        r1.phases, r1.allocated_bytes
    );
    // Smaller, other types, other alignments, the same again: no allocation.
    for (p, dt, align) in [
        (small, DType::F16, Alignment::MAX),
        (small, DType::F32, Alignment { a: 4, b: 8, c: 16 }),
        (big, DType::BF16, Alignment::MAX),
        (big, DType::F16, Alignment::MAX),
    ] {
        let r = gemm::search(&ctx, &p, dt, align).unwrap();
        // No allocation is the property; the phase's wall time is only printed (it read 200 ms
        // once on the H100 while another test thread of this binary held the context).
        assert_eq!(r.allocated_bytes, 0, "{dt} {p:?}");
        println!("{dt} {p:?}: {:?}", r.phases);
        if dt == DType::F16 {
            // The handle's first query for this kind of problem was made by the first search.
            assert_eq!(r.setup_first_query_ms, 0.0);
        }
        assert!(r.default_ms().is_some());
    }
    assert_eq!(gemm::search_scratch_bytes(&ctx).unwrap(), held);
    // The caller's operands in between (their C regions overwrite part of the scratch), then
    // scratch operands again (patterns written again where they were overwritten).
    let mut rng = Rng::fresh("gemm scratch reuse");
    caller_buffers_case::<f16>(&ctx, &small.with_scalars(1.0, 0.25), &mut rng, "between");
    let r = gemm::search(&ctx, &big, DType::F16, Alignment::MAX).unwrap();
    assert_eq!(r.allocated_bytes, 0);
    assert_eq!(r.operands, gemm::SearchOperands::Scratch);
    // Released: the next search allocates again.
    assert_eq!(gemm::release_search_scratch(&ctx).unwrap(), held);
    assert_eq!(gemm::search_scratch_bytes(&ctx).unwrap(), 0);
    let r = gemm::search(&ctx, &small, DType::F16, Alignment::MAX).unwrap();
    assert!(r.allocated_bytes > 0);
}
