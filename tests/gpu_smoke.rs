//! GPU smoke test: a Context opens, NVRTC compiles and a kernel runs on random data, and the
//! cuDNN and cuBLAS handles come up. Ignored without a GPU; `.gpu/run` runs it.

mod common;

use common::*;
use half::{bf16, f16};
use nnfuse::internals::util;
use nnfuse::Element;

fn scale_roundtrip<T: Element>(ctx: &nnfuse::Context, n: usize) {
    let mut rng = Rng::fresh("smoke");
    let x: Vec<T> = rng.vec(n, -4.0, 4.0);
    let s = ctx.stream();
    let xd = s.clone_htod(&x).unwrap();
    let mut yd = s.alloc_zeros::<T>(n).unwrap();
    util::fill(ctx, &mut yd, T::from_f64(f64::NAN)).unwrap(); // poison
    util::scale(ctx, &xd, &mut yd, 0.5).unwrap();
    let y = s.clone_dtoh(&yd).unwrap();
    // 0.5 * x is exact in f32/f64; rounding it to T (f16 subnormals lose their last bit) is
    // the only rounding, and the GPU's round-to-nearest-even must agree bit for bit.
    let want: Vec<f64> = x
        .iter()
        .map(|v| T::from_f64(0.5 * v.to_f64()).to_f64())
        .collect();
    let got = f64s(&y);
    if let Some(i) = (0..n).find(|&i| got[i] != want[i]) {
        panic!(
            "{:?} n={n}: element {i}: x={:?} got {} want {}",
            T::DTYPE,
            x[i],
            got[i],
            want[i]
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn context_kernel_and_handles() {
    let ctx = gpu();
    println!("{}", ctx.info());
    for n in [1, 31, 1000, 1 << 20] {
        scale_roundtrip::<f32>(&ctx, n);
        scale_roundtrip::<f16>(&ctx, n);
        scale_roundtrip::<bf16>(&ctx, n);
    }
    let mut guard = ctx.lock().unwrap();
    guard.cudnn().unwrap();
    guard.cublas().unwrap();
    guard.cublaslt().unwrap();
    drop(guard);
    let v = nnfuse::context::cudnn_version().unwrap();
    println!(
        "cuDNN {v}, cuBLAS {:?}, cuBLASLt {}, NVRTC {:?}, driver {:?}",
        nnfuse::context::cublas_version().unwrap(),
        nnfuse::context::cublaslt_version().unwrap(),
        nnfuse::internals::kernels::nvrtc_version().unwrap(),
        ctx.info().driver
    );
    assert!(v >= 8000, "cuDNN {v} is older than 8");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn context_is_usable_from_many_threads() {
    let ctx = gpu();
    std::thread::scope(|s| {
        for _ in 0..4 {
            let ctx = ctx.clone();
            s.spawn(move || {
                for _ in 0..10 {
                    scale_roundtrip::<f32>(&ctx, 4097);
                    ctx.lock().unwrap().cublas().unwrap();
                }
            });
        }
    });
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn bad_ordinal_is_an_error() {
    let e = nnfuse::Context::with_config(1000, nnfuse::Config::default()).unwrap_err();
    assert_eq!(e.argument(), Some("ordinal"), "{e}");
}
