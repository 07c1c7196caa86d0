//! CPU tests of the GEMM module: validation (every error names its argument), the tuning key,
//! the tuning-cache file (round trip, merging, corrupted and foreign files ignored), and that the
//! search's kernels compile under NVRTC.

mod common;

use std::path::{Path, PathBuf};

use nnfuse::gemm::{
    tolerance, Algo, Alignment, Choice, Compute, CublasAlgo, Key, LtAlgo, LtConfig, Origin,
    Problem, Spans, Validated,
};
use nnfuse::internals::gemm::{
    self as cache, c_batches_overlap, check_pointers, load_file, save_file, DeviceTag, FILE_FORMAT,
};
use nnfuse::DType;

use common::TempDir;

fn arg_of(r: nnfuse::Result<Validated>) -> String {
    match r {
        Ok(v) => panic!("expected an error, got {v:?}"),
        Err(e) => {
            let arg = e.argument().map(String::from);
            arg.unwrap_or_else(|| panic!("error without an argument: {e}"))
        }
    }
}

fn spans(v: Validated) -> Spans {
    match v {
        Validated::Spans(s) => s,
        Validated::Empty => panic!("unexpectedly empty"),
    }
}

// ------------------------------------------------------------------------------------------
// Validation

#[test]
fn packed_problems_pass_with_tight_spans() {
    let p = Problem::packed(3, 5, 7, 11);
    let s = spans(p.check_buffers(DType::F32, 3 * 55, 3 * 77, 3 * 35).unwrap());
    assert_eq!(
        s,
        Spans {
            a: 165,
            b: 231,
            c: 105
        }
    );
    for (ta, tb) in [(true, false), (false, true), (true, true)] {
        let p = Problem::packed_trans(3, 5, 7, 11, ta, tb);
        assert_eq!(p.lda, if ta { 11 } else { 5 });
        assert_eq!(p.ldb, if tb { 7 } else { 11 });
        let s = spans(p.check_buffers(DType::F16, 165, 231, 105).unwrap());
        assert_eq!(
            s,
            Spans {
                a: 165,
                b: 231,
                c: 105
            }
        );
    }
}

#[test]
fn compute_and_scalars() {
    let p = Problem::packed(1, 2, 2, 2).with_compute(Compute::F16);
    assert_eq!(arg_of(p.check(DType::F32)), "compute");
    assert_eq!(arg_of(p.check(DType::BF16)), "compute");
    assert!(p.check(DType::F16).is_ok());
    assert_eq!(arg_of(p.with_scalars(1e5, 0.0).check(DType::F16)), "alpha");
    assert_eq!(arg_of(p.with_scalars(1.0, -7e4).check(DType::F16)), "beta");
    // f32 compute takes any f32 scalar.
    assert!(Problem::packed(1, 2, 2, 2)
        .with_scalars(1e30, -1e30)
        .check(DType::F16)
        .is_ok());
    assert_eq!("f16".parse::<Compute>().unwrap(), Compute::F16);
    assert_eq!(
        "x".parse::<Compute>().unwrap_err().argument(),
        Some("compute")
    );
}

#[test]
fn api_limits_name_the_argument() {
    let big = i32::MAX as usize + 1;
    let base = Problem::packed(1, 4, 4, 4);
    let cases: Vec<(&str, Problem)> = vec![
        ("m", Problem { m: big, ..base }),
        ("n", Problem { n: big, ..base }),
        ("k", Problem { k: big, ..base }),
        ("batch", Problem { batch: big, ..base }),
        ("lda", Problem { lda: big, ..base }),
        ("ldb", Problem { ldb: big, ..base }),
        ("ldc", Problem { ldc: big, ..base }),
        (
            "stride_a",
            Problem {
                stride_a: i64::MAX as usize + 1,
                ..base
            },
        ),
        (
            "stride_b",
            Problem {
                stride_b: usize::MAX,
                ..base
            },
        ),
        (
            "stride_c",
            Problem {
                stride_c: usize::MAX,
                ..base
            },
        ),
    ];
    for (name, p) in cases {
        assert_eq!(arg_of(p.check(DType::F32)), name, "{p:?}");
    }
}

#[test]
fn leading_dimensions() {
    let p = Problem::packed(1, 8, 6, 4);
    assert_eq!(arg_of(Problem { lda: 7, ..p }.check(DType::F32)), "lda");
    assert_eq!(arg_of(Problem { ldb: 3, ..p }.check(DType::F32)), "ldb");
    assert_eq!(arg_of(Problem { ldc: 7, ..p }.check(DType::F32)), "ldc");
    // Transposed A is stored k x m: lda >= k (4) suffices.
    let t = Problem::packed_trans(1, 8, 6, 4, true, true);
    assert!(Problem { lda: 4, ..t }.check(DType::F32).is_ok());
    assert_eq!(arg_of(Problem { lda: 3, ..t }.check(DType::F32)), "lda");
    // Transposed B is stored n x k: ldb >= n (6).
    assert_eq!(arg_of(Problem { ldb: 5, ..t }.check(DType::F32)), "ldb");
    // ld 0 is never valid, even for empty problems.
    let e = Problem { m: 0, lda: 0, ..p };
    assert_eq!(arg_of(e.check(DType::F32)), "lda");
}

#[test]
fn empty_problems_are_no_ops_and_k_zero_is_an_error() {
    let p = Problem::packed(2, 3, 4, 5);
    for e in [
        Problem {
            m: 0,
            ldc: 1,
            lda: 1,
            ..p
        },
        Problem { n: 0, ..p },
        Problem { batch: 0, ..p },
    ] {
        assert_eq!(
            e.check_buffers(DType::F32, 0, 0, 0).unwrap(),
            Validated::Empty
        );
    }
    assert_eq!(arg_of(Problem { k: 0, ..p }.check(DType::F32)), "k");
    // k = 0 with an empty C is still a no-op.
    assert_eq!(
        Problem { k: 0, n: 0, ..p }.check(DType::F32).unwrap(),
        Validated::Empty
    );
}

#[test]
fn c_stride_races() {
    let p = Problem::packed(4, 3, 2, 5);
    assert_eq!(
        arg_of(Problem { stride_c: 0, ..p }.check(DType::F32)),
        "stride_c"
    );
    // stride 3 < 6 elements per matrix with ldc = 3: batch 1 lands in batch 0's column 1.
    assert_eq!(
        arg_of(Problem { stride_c: 3, ..p }.check(DType::F32)),
        "stride_c"
    );
    // Batch 1 alone may use stride 0 for C.
    assert!(Problem {
        stride_c: 0,
        batch: 1,
        ..p
    }
    .check(DType::F32)
    .is_ok());
    // Interleaved heads: C stored (m * batch) x n, head b at row offset b * m.
    let inter = Problem {
        ldc: 3 * 4,
        stride_c: 3,
        ..p
    };
    assert!(inter.check(DType::F32).is_ok());
    assert_eq!(c_batches_overlap(3, 2, 12, 3, 4), None);
    assert_eq!(c_batches_overlap(3, 2, 12, 2, 4), Some(1));
    // Interleaving that wraps around into the next column at batch 4.
    assert_eq!(c_batches_overlap(2, 2, 8, 2, 6), Some(4));
}

#[test]
fn buffers_too_short_name_buffer_or_stride() {
    let p = Problem::packed(3, 4, 5, 6); // A 4x6 (24), B 6x5 (30), C 4x5 (20)
    assert!(p.check_buffers(DType::F16, 72, 90, 60).is_ok());
    assert_eq!(arg_of(p.check_buffers(DType::F16, 23, 90, 60)), "a");
    assert_eq!(arg_of(p.check_buffers(DType::F16, 71, 90, 60)), "stride_a");
    assert_eq!(arg_of(p.check_buffers(DType::F16, 72, 29, 60)), "b");
    assert_eq!(arg_of(p.check_buffers(DType::F16, 72, 89, 60)), "stride_b");
    assert_eq!(arg_of(p.check_buffers(DType::F16, 72, 90, 19)), "c");
    assert_eq!(arg_of(p.check_buffers(DType::F16, 72, 90, 59)), "stride_c");
    // The last column needs only `rows` elements, not a full `ld`.
    let padded = Problem {
        lda: 10,
        stride_a: 60,
        ..p
    };
    let need = 2 * 60 + 5 * 10 + 4;
    assert!(padded.check_buffers(DType::F32, need, 90, 60).is_ok());
    assert_eq!(
        arg_of(padded.check_buffers(DType::F32, need - 1, 90, 60)),
        "stride_a"
    );
}

#[test]
fn broadcast_operands() {
    let p = Problem {
        stride_a: 0,
        stride_b: 0,
        ..Problem::packed(5, 4, 5, 6)
    };
    let s = spans(p.check_buffers(DType::BF16, 24, 30, 100).unwrap());
    assert_eq!(
        s,
        Spans {
            a: 24,
            b: 30,
            c: 100
        }
    );
}

#[test]
fn extents_that_overflow_are_errors() {
    let p = Problem {
        stride_a: i64::MAX as usize,
        ..Problem::packed(3, 4, 4, 4)
    };
    assert_eq!(arg_of(p.check(DType::F32)), "stride_a");
    let q = Problem {
        stride_b: i64::MAX as usize / 2 + 1,
        ..Problem::packed(2, 4, 4, 4)
    };
    // Fits usize, but not the address space in bytes.
    assert_eq!(arg_of(q.check(DType::F32)), "b");
}

#[test]
fn pointers_alignment_and_aliasing() {
    let s = Spans {
        a: 100,
        b: 100,
        c: 100,
    };
    let arg = |r: nnfuse::Result<()>| r.unwrap_err().argument().map(String::from);
    assert!(check_pointers(&s, 2, 0x1000, 0x2000, 0x3000).is_ok());
    assert_eq!(
        arg(check_pointers(&s, 2, 0x1001, 0x2000, 0x3000)).as_deref(),
        Some("a")
    );
    assert_eq!(
        arg(check_pointers(&s, 4, 0x1000, 0x2002, 0x3000)).as_deref(),
        Some("b")
    );
    assert_eq!(
        arg(check_pointers(&s, 2, 0x1000, 0, 0x3000)).as_deref(),
        Some("b")
    );
    // C overlapping A (100 f16 = 200 bytes from 0x1000) or B.
    assert_eq!(
        arg(check_pointers(&s, 2, 0x1000, 0x2000, 0x10c6)).as_deref(),
        Some("c")
    );
    assert_eq!(
        arg(check_pointers(&s, 2, 0x1000, 0x2000, 0x1f40)).as_deref(),
        Some("c")
    );
    // Adjacent is fine; A and B may alias each other (both read).
    assert!(check_pointers(&s, 2, 0x1000, 0x1000, 0x10c8).is_ok());
}

#[test]
fn tolerance_rules() {
    assert_eq!(tolerance(DType::F32, Compute::F32, 513), 1e-5);
    assert_eq!(tolerance(DType::F16, Compute::F32, 4096), 1e-2);
    assert!(tolerance(DType::F16, Compute::F16, 513) > 0.02);
}

// ------------------------------------------------------------------------------------------
// Key

#[test]
fn key_construction() {
    let p = Problem::packed_trans(4, 64, 32, 16, true, false).with_scalars(0.5, 0.0);
    let al = Alignment::of(&p, 2, 0x7000_0000, 0x7000_0100, 0x7000_0008);
    let k = Key::new(3, &p, DType::F16, al).unwrap();
    assert_eq!(k.device, 3);
    assert_eq!((k.m, k.n, k.k, k.batch), (64, 32, 16, 4));
    assert_eq!((k.lda, k.ldb, k.ldc), (16, 16, 64));
    assert_eq!((k.stride_a, k.stride_b, k.stride_c), (1024, 512, 2048));
    assert!(k.trans_a && !k.trans_b && k.beta_zero);
    assert_eq!(
        al,
        Alignment {
            a: 256,
            b: 256,
            c: 8
        }
    );
    assert_eq!(k.align, al);
    // alpha does not matter; beta's zeroness does.
    let k2 = Key::new(3, &p.with_scalars(2.0, 0.0), DType::F16, al).unwrap();
    assert_eq!(k, k2);
    let k3 = Key::new(3, &p.with_scalars(2.0, 1.0), DType::F16, al).unwrap();
    assert_ne!(k, k3);
    assert!(!k3.beta_zero);
    // The key's problem gives the key back.
    assert_eq!(Key::new(3, &k.problem(), DType::F16, al).unwrap(), k);
    // Strides of a single matrix are irrelevant and normalised away.
    let one = Problem {
        stride_a: 12345,
        ..Problem::packed(1, 8, 8, 8)
    };
    let k1 = Key::new(0, &one, DType::F32, Alignment::MAX).unwrap();
    assert_eq!((k1.stride_a, k1.stride_b, k1.stride_c), (0, 0, 0));
    assert_eq!(
        k1,
        Key::new(0, &Problem::packed(1, 8, 8, 8), DType::F32, Alignment::MAX).unwrap()
    );
    // Empty problems and bad alignments have no key.
    let e = Key::new(0, &Problem::packed(0, 8, 8, 8), DType::F32, Alignment::MAX).unwrap_err();
    assert_eq!(e.argument(), Some("m"));
    let bad = Alignment {
        a: 3,
        ..Alignment::MAX
    };
    let e = Key::new(0, &p, DType::F16, bad).unwrap_err();
    assert_eq!(e.argument(), Some("align"));
    let too_small = Alignment {
        a: 2,
        ..Alignment::MAX
    };
    assert_eq!(
        Key::new(0, &one, DType::F32, too_small)
            .unwrap_err()
            .argument(),
        Some("align")
    );
    assert!(
        k.to_string().contains("f16/f32 TN batch 4 m 64 n 32 k 16"),
        "{k}"
    );
}

#[test]
fn alignment_counts_the_batch_stride() {
    // f16, stride 7 elements = 14 bytes: batch 1's matrix is only 2-byte aligned.
    let p = Problem {
        stride_a: 7 * 8 + 7,
        ..Problem::packed(2, 7, 8, 8)
    };
    let al = Alignment::of(&p, 2, 0x1000, 0x1000, 0x1000);
    assert_eq!(al.a, 2);
    assert_eq!(al.b, 128); // stride 64 elements = 128 bytes
    let single = Problem { batch: 1, ..p };
    assert_eq!(Alignment::of(&single, 2, 0x1000, 0x1000, 0x1000).a, 256);
}

// ------------------------------------------------------------------------------------------
// Tuning-cache file

fn tag(name: &str, lt: usize) -> DeviceTag {
    DeviceTag {
        name: name.into(),
        compute_capability: (9, 0),
        cublas: (13, 1, 0),
        cublaslt: lt,
    }
}

/// Folders named `nnfuse-gemm-cpu-…`.
impl TempDir {
    fn new(name: &str) -> TempDir {
        let d = std::env::temp_dir().join(format!(
            "nnfuse-gemm-cpu-{}-{name}-{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or(0)
        ));
        std::fs::create_dir_all(&d).unwrap();
        TempDir(d)
    }
    fn file(&self) -> PathBuf {
        self.0.join("tuning.json")
    }
}

fn sample_entries(device: u32) -> Vec<(Key, Choice)> {
    let p1 = Problem::packed(16, 1024, 1024, 1024);
    let k1 = Key::new(device, &p1, DType::F16, Alignment::MAX).unwrap();
    let c1 = Choice {
        algo: Algo::Lt(LtAlgo([1, 2, 3, 4, 5, 6, 7, u64::MAX])),
        config: Some(LtConfig {
            algo_id: 66,
            tile: 23,
            stages: 35,
            splitk: 1,
            reduction: 0,
            swizzle: 0,
            custom: 0,
            inner_shape: 0,
            cluster_shape: 3,
        }),
        workspace: 1 << 20,
        median_us: 56.5,
        default_us: 57.25,
        candidates: 9,
        origin: Origin::Searched,
    };
    let p2 = Problem::packed_trans(64, 128, 128, 64, false, true).with_scalars(1.0, 1.0);
    let k2 = Key::new(
        device,
        &p2,
        DType::BF16,
        Alignment {
            a: 16,
            b: 2,
            c: 256,
        },
    )
    .unwrap();
    let c2 = Choice {
        algo: Algo::Cublas(CublasAlgo::DEFAULT),
        config: None,
        workspace: 0,
        median_us: 10.0,
        default_us: 10.0,
        candidates: 5,
        origin: Origin::Searched,
    };
    vec![(k1, c1), (k2, c2)]
}

fn as_file(mut v: Vec<(Key, Choice)>) -> Vec<(Key, Choice)> {
    for (_, c) in v.iter_mut() {
        c.origin = Origin::File;
    }
    v.sort_by_key(|e| e.0);
    v
}

fn sorted(mut v: Vec<(Key, Choice)>) -> Vec<(Key, Choice)> {
    v.sort_by_key(|e| e.0);
    v
}

#[test]
fn file_round_trip_is_readable_and_atomic() {
    let d = TempDir::new("roundtrip");
    let f = d.file();
    let t = tag("NVIDIA H100 80GB HBM3", 130100);
    let entries = sample_entries(0);
    save_file(&f, &t, &entries).unwrap();
    // The lock file stays (removing it would let two processes lock different files).
    assert_eq!(
        d.names(),
        vec!["tuning.json".to_string(), "tuning.json.lock".to_string()],
        "temp file left behind"
    );
    let text = std::fs::read_to_string(&f).unwrap();
    assert!(text.contains(FILE_FORMAT));
    assert!(text.contains("\"tile_name\": \"128x256\""), "{text}");
    assert!(text.contains("\"backend\": \"cublaslt\""));
    assert!(text.contains("CUBLAS_GEMM_DEFAULT"));
    assert!(text.contains(&LtAlgo([1, 2, 3, 4, 5, 6, 7, u64::MAX]).to_hex()));
    // Loading for another ordinal gives the same entries with that ordinal.
    let loaded = load_file(&f, &t, 2);
    assert!(loaded.warnings.is_empty(), "{:?}", loaded.warnings);
    assert_eq!(sorted(loaded.entries), as_file(sample_entries(2)));
}

#[test]
fn saving_merges_devices_and_entries() {
    let d = TempDir::new("merge");
    let f = d.file();
    let h100 = tag("NVIDIA H100 80GB HBM3", 130100);
    let a100 = tag("NVIDIA A100-SXM4-80GB", 130100);
    let e = sample_entries(0);
    save_file(&f, &h100, &e[..1]).unwrap();
    save_file(&f, &a100, &e[1..]).unwrap();
    // A second save for the H100 keeps its earlier entry and adds the new one.
    save_file(&f, &h100, &e[1..]).unwrap();
    assert_eq!(sorted(load_file(&f, &h100, 0).entries), as_file(e.clone()));
    assert_eq!(
        sorted(load_file(&f, &a100, 0).entries),
        as_file(e[1..].to_vec())
    );
    // A newer result for the same key replaces the old one.
    let mut newer = e[0];
    newer.1.median_us = 50.0;
    save_file(&f, &h100, &[newer]).unwrap();
    let got = load_file(&f, &h100, 0).entries;
    assert_eq!(got.len(), 2);
    assert!(got.iter().any(|(k, c)| *k == e[0].0 && c.median_us == 50.0));
}

#[test]
fn foreign_device_or_version_is_ignored_with_a_warning() {
    let d = TempDir::new("foreign");
    let f = d.file();
    save_file(
        &f,
        &tag("NVIDIA A100-SXM4-80GB", 130100),
        &sample_entries(0),
    )
    .unwrap();
    for other in [
        tag("NVIDIA H100 80GB HBM3", 130100),
        tag("NVIDIA A100-SXM4-80GB", 130000),
        DeviceTag {
            compute_capability: (8, 6),
            ..tag("NVIDIA A100-SXM4-80GB", 130100)
        },
        DeviceTag {
            cublas: (13, 0, 2),
            ..tag("NVIDIA A100-SXM4-80GB", 130100)
        },
    ] {
        let l = load_file(&f, &other, 0);
        assert!(l.entries.is_empty(), "{other}");
        assert_eq!(l.warnings.len(), 1, "{other}: {:?}", l.warnings);
        assert!(l.warnings[0].contains("A100"), "{:?}", l.warnings);
    }
}

fn write(path: &Path, text: &str) {
    std::fs::write(path, text).unwrap();
}

#[test]
fn corrupted_files_are_ignored_never_trusted() {
    let d = TempDir::new("corrupt");
    let f = d.file();
    let t = tag("NVIDIA H100 80GB HBM3", 130100);
    // Missing: empty, silently.
    let l = load_file(&f, &t, 0);
    assert!(l.entries.is_empty() && l.warnings.is_empty());
    save_file(&f, &t, &sample_entries(0)).unwrap();
    let good = std::fs::read_to_string(&f).unwrap();
    for bad in [
        String::new(),
        "not json at all".to_string(),
        good[..good.len() / 2].to_string(),
        good.replace(FILE_FORMAT, "something-else"),
        good.replace("\"version\": 1", "\"version\": 99"),
        "[1, 2, 3]".to_string(),
        "\u{0}\u{1}\u{2}garbage".to_string(),
    ] {
        write(&f, &bad);
        let l = load_file(&f, &t, 0);
        assert!(l.entries.is_empty(), "{bad:?}");
        assert_eq!(l.warnings.len(), 1, "{bad:?}: {:?}", l.warnings);
    }
    // A bad entry is dropped; the good ones stay.
    let hex = LtAlgo([1, 2, 3, 4, 5, 6, 7, u64::MAX]).to_hex();
    for broken in [
        good.replace(&hex, "zz"),
        good.replace("\"dtype\": \"f16\"", "\"dtype\": \"f64\""),
        good.replace("\"align_a\": 256", "\"align_a\": 3"),
        good.replace("\"lda\": 1024", "\"lda\": 1"),
        good.replace("\"algo\": -1", "\"algo\": 999"),
    ] {
        assert_ne!(broken, good);
        write(&f, &broken);
        let l = load_file(&f, &t, 0);
        assert_eq!(l.entries.len(), 1, "{:?}", l.warnings);
        assert_eq!(l.warnings.len(), 1, "{:?}", l.warnings);
        assert!(l.warnings[0].contains("entry"), "{:?}", l.warnings);
    }
    // Saving over a corrupted file replaces it with a valid one.
    write(&f, "{ corrupted");
    save_file(&f, &t, &sample_entries(0)).unwrap();
    assert_eq!(load_file(&f, &t, 0).entries.len(), 2);
}

#[test]
fn unwritable_location_is_an_io_error() {
    let d = TempDir::new("unwritable");
    let f = d.0.join("no-such-dir").join("tuning.json");
    let e = save_file(&f, &tag("x", 1), &sample_entries(0)).unwrap_err();
    assert!(matches!(e, nnfuse::Error::Io { .. }), "{e}");
}

#[test]
fn in_memory_cache_starts_empty_for_unknown_keys() {
    // Entries only come from searches and files (exercised by the GPU tests); a key nobody
    // searched is absent, and clear() empties the cache.
    let (k, _) = sample_entries(7)[0];
    assert!(nnfuse::gemm::lookup(&k).is_none());
    cache::clear();
    assert!(cache::entries(7).is_empty());
}

// ------------------------------------------------------------------------------------------
// Kernels

#[test]
fn search_kernels_compile() {
    if !nnfuse::internals::kernels::nvrtc_present() {
        let required = std::env::var("NNFUSE_REQUIRE_NVRTC").is_ok_and(|v| v == "1");
        assert!(
            !required,
            "NNFUSE_REQUIRE_NVRTC=1 but NVRTC cannot be loaded"
        );
        eprintln!("skipping: NVRTC not found");
        return;
    }
    for arch in nnfuse::internals::kernels::CI_ARCHS
        .iter()
        .chain(["compute_90"].iter())
    {
        let image = nnfuse::internals::kernels::compile(&nnfuse::internals::gemm::KERNELS, arch)
            .unwrap_or_else(|e| panic!("gemm search kernels for {arch}: {e}"));
        let bytes = image.bytes();
        assert!(bytes.len() > 100);
        // Every entry point the search loads (names are in the PTX text and the CUBIN's
        // symbol table alike).
        for kind in ["uniform", "diff", "stats"] {
            for dt in ["f32", "f16", "bf16"] {
                let name = format!("gemm_{kind}_{dt}");
                assert!(
                    bytes.windows(name.len()).any(|w| w == name.as_bytes()),
                    "{name} missing from the {arch} image"
                );
            }
        }
    }
}

// ------------------------------------------------------------------------------------------
// The search's timing plan and decision rule (pure)

#[test]
fn search_timing_plan_fits_the_budget() {
    use nnfuse::internals::timing::{burst_len, rounds_for};
    let o = nnfuse::internals::gemm::search_timing();
    // The checking run is the warm-up; long GEMMs get the minimum number of rounds.
    assert_eq!(o.warmup_rounds, 0);
    assert!(o.min_rounds >= 3 && o.min_rounds <= o.max_rounds);
    // 16 x 4096^3 f16 on an H100: ~3 ms a GEMM, 9 candidates: one launch a sample, 3 rounds,
    // ~81 ms of timed GPU work (the estimate round counts as the first).
    let t = 3.0;
    let b = burst_len(t, o.min_sample_ms, o.max_burst);
    assert_eq!(b, 1);
    let rounds = rounds_for(&[t * b as f64; 9], o.min_rounds, o.max_rounds, o.budget_ms);
    assert_eq!(rounds, 3);
    assert!(rounds as f64 * 9.0 * t < 100.0);
    // 16 x 512^3: ~12 µs a GEMM: bursts of >= 0.1 ms, every round under ~1 ms, capped rounds.
    let t = 0.012;
    let b = burst_len(t, o.min_sample_ms, o.max_burst);
    assert_eq!(b, 9);
    let rounds = rounds_for(&[t * b as f64; 9], o.min_rounds, o.max_rounds, o.budget_ms);
    assert_eq!(rounds, o.max_rounds);
}

#[test]
fn default_is_replaced_only_by_a_consistent_win() {
    use nnfuse::internals::gemm::{beats_default, KEEP_DEFAULT_MARGIN};
    use nnfuse::internals::timing::Paired;
    let vs = |ratios: &[f64]| {
        Paired::of(
            &vec![2.0; ratios.len()],
            &ratios.iter().map(|r| 2.0 * r).collect::<Vec<_>>(),
        )
        .unwrap()
    };
    assert!(beats_default(&vs(&[0.95, 0.96, 0.94])));
    assert!(!beats_default(&vs(&[1.0 - KEEP_DEFAULT_MARGIN / 2.0; 5])));
    assert!(!beats_default(&vs(&[0.9, 0.9, 1.05])));
    // The drift of bench-run5 (the same kernel measured 2987 and 3286 µs a few seconds apart)
    // cancels in per-round ratios: two equal kernels never beat each other.
    let base = [2987.0, 3100.0, 3286.0];
    let same = Paired::of(&base, &base).unwrap();
    assert_eq!(same.median, 1.0);
    assert!(!beats_default(&same));
}

// ------------------------------------------------------------------------------------------
// When the search may check candidates on the caller's data (pure)

#[test]
fn caller_data_rule() {
    use nnfuse::gemm::Unsuitable;
    use nnfuse::internals::gemm::{
        caller_data_unsuitable, ResultStats, MIN_NONZERO_FRACTION, MIN_PRODUCT_SHARE,
    };
    let ok = ResultStats {
        elements: 1000.0,
        sum_sq: 400.0,
        non_finite: 0.0,
        nonzero: 1000.0,
        product_sq: 400.0,
    };
    assert_eq!(caller_data_unsuitable(&ok), None);
    // Any non-finite element (NaN or Inf in the inputs, overflow): scratch operands.
    let nan = ResultStats {
        non_finite: 3.0,
        ..ok
    };
    assert_eq!(
        caller_data_unsuitable(&nan),
        Some(Unsuitable::NonFinite { count: 3 })
    );
    // Mostly zeros: at least half the elements must be nonzero; all zeros never passes.
    let half = ResultStats {
        nonzero: MIN_NONZERO_FRACTION * 1000.0,
        ..ok
    };
    assert_eq!(caller_data_unsuitable(&half), None);
    let sparse = ResultStats {
        nonzero: 499.0,
        ..ok
    };
    assert_eq!(
        caller_data_unsuitable(&sparse),
        Some(Unsuitable::MostlyZero {
            nonzero: 499,
            elements: 1000
        })
    );
    let zeros = ResultStats {
        sum_sq: 0.0,
        nonzero: 0.0,
        product_sq: 0.0,
        ..ok
    };
    assert!(matches!(
        caller_data_unsuitable(&zeros),
        Some(Unsuitable::MostlyZero { nonzero: 0, .. })
    ));
    // beta * C must not dominate: the product at least half the result's norm.
    let at_share = ResultStats {
        product_sq: 400.0 * MIN_PRODUCT_SHARE * MIN_PRODUCT_SHARE,
        ..ok
    };
    assert_eq!(caller_data_unsuitable(&at_share), None);
    let dominated = ResultStats {
        product_sq: 400.0 * 0.01,
        ..ok
    };
    match caller_data_unsuitable(&dominated) {
        Some(Unsuitable::ProductNegligible { share }) => assert!((share - 0.1).abs() < 1e-12),
        other => panic!("{other:?}"),
    }
    // Sums that were not read back (NaN) never pass, and every reason reads well.
    let missing = ResultStats::from_sums(&[1.0, 0.0], 10.0);
    assert!(caller_data_unsuitable(&missing).is_some());
    let all_nan = ResultStats::from_sums(&[], 10.0);
    assert!(caller_data_unsuitable(&all_nan).is_some());
    assert_eq!(
        ResultStats::from_sums(&[400.0, 0.0, 1000.0, 400.0], 1000.0),
        ok
    );
    for why in [
        caller_data_unsuitable(&nan),
        caller_data_unsuitable(&sparse),
        caller_data_unsuitable(&dominated),
    ] {
        let text = why.unwrap().to_string();
        assert!(text.contains("result"), "{text}");
    }
}
