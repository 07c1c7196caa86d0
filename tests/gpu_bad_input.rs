//! The bad-input table (issue 11): one row per bad call across BatchNorm, the bitmask
//! activations, GEMM and convolution — wrong lengths, aliasing, zero and overflowing dims, bad scalars, a
//! `BnSaved` from another op, another Context or another x, buffers on another device — each
//! asserting a typed `Error::InvalidArgument` that names the argument, and that **every** buffer
//! (outputs, running statistics, inputs) is bitwise unchanged: nothing reached the GPU.
//!
//! A few calls that look suspicious but are legitimate are checked to succeed ("accepted" rows):
//! buffers from another Context on the same device (one CUDA context per device, so the memory
//! is valid there; cudarc orders the streams), and a NaN GEMM alpha (IEEE semantics, as BLAS:
//! the result is NaN, not an error). An f16-compute alpha that overflows f16 is bad input.
//!
//! Rows with a buffer on another device are their own test,
//! `buffers_on_a_second_gpu_are_refused_and_change_nothing`: it needs two visible GPUs, and with
//! fewer it says SKIPPED (on stderr) and passes, unless `NNFUSE_REQUIRE_TWO_GPUS=1`, which makes
//! that a failure. The pure device check (`validate::expect_device`, which every operation calls)
//! is tested on any machine by the table's test.
//!
//! GPU test, ignored without a GPU (`.gpu/run` runs it). On failure it lists every failing row
//! with what it got, and the buffers that changed with their first differing element.

mod common;

use std::mem::ManuallyDrop;

use common::{f64s, gpu, square_conv, Rng};
use cudarc::driver::{CudaSlice, DevicePtr};
use half::f16;
use nnfuse::activation::{self, mask_words, NoMask};
use nnfuse::batchnorm::{BackwardArgs, BatchNorm, BnSaved, Fuse, InferenceArgs, TrainArgs};
use nnfuse::conv::{Conv2d, ConvShape, FilterLayout};
use nnfuse::gemm::{self, Compute, Problem};
use nnfuse::internals::validate::{expect_device, BufInfo};
use nnfuse::{Config, Context, Error};

/// BatchNorm shape (channels-last, channel axis 3): elements and channels.
const SHAPE: [usize; 4] = [4, 8, 8, 16];
const N: usize = 4 * 8 * 8 * 16;
const C: usize = 16;
/// Activation length (not a multiple of 32: the mask has a partial word).
const A: usize = 1000;
/// GEMM: 4 matrices of 16x16.
const G: usize = 4 * 256;
/// Convolution: NHWC 2x9x9x8 -> 16 filters 3x3, pad 1 (x, w and y elements).
const CX: usize = 2 * 9 * 9 * 8;
const CW: usize = 16 * 3 * 3 * 8;
const CY: usize = 2 * 9 * 9 * 16;

/// The convolution problem of the conv rows.
fn conv_shape() -> ConvShape {
    square_conv(2, 8, 9, 16, 3, nnfuse::TensorFormat::Nhwc)
}

/// f32 poison of outputs: a quiet NaN with a payload no computation produces.
const POISON: u32 = 0x7fc0_5a5a;
const MASK_POISON: u32 = 0xdead_beef;

/// Second handles on memory owned elsewhere (made through raw pointers, never freed by us).
struct Aliases {
    /// Over `x` (N).
    y_is_x: ManuallyDrop<CudaSlice<f32>>,
    /// Over `zz` from element 8 (N): partially overlaps the addend `zz[0..N]`.
    y_over_addend: ManuallyDrop<CudaSlice<f32>>,
    /// Over `g` (C).
    rm_is_g: ManuallyDrop<CudaSlice<f32>>,
    /// Over `rm` (C).
    rv_is_rm: ManuallyDrop<CudaSlice<f32>>,
    /// Over `dy` (N).
    dx_is_dy: ManuallyDrop<CudaSlice<f32>>,
    /// Over `dg` (C).
    db_is_dg: ManuallyDrop<CudaSlice<f32>>,
    /// Over `dx` (N).
    dz_is_dx: ManuallyDrop<CudaSlice<f32>>,
    /// Over `abig` from element 2 (A): partially overlaps `abig[0..A]`.
    ay_shifted: ManuallyDrop<CudaSlice<f32>>,
    /// Over `abig` from element 4, as mask words.
    amask_in_x: ManuallyDrop<CudaSlice<u32>>,
    /// Over `adx` (A).
    adz_is_adx: ManuallyDrop<CudaSlice<f32>>,
    /// Over `ga` (G).
    gc_is_ga: ManuallyDrop<CudaSlice<f32>>,
    /// Over `gbig` from byte 2 (G): not aligned to f32.
    ga_misaligned: ManuallyDrop<CudaSlice<f32>>,
    /// Over `cbig` from element 0 (CX): a valid conv input.
    cx_in_big: ManuallyDrop<CudaSlice<f32>>,
    /// Over `cbig` from element 1000 (CY): overlaps `cx_in_big`.
    cy_over_x: ManuallyDrop<CudaSlice<f32>>,
    /// Over `cdy` (CX elements): the data gradient's output on top of dy.
    cdx_in_dy: ManuallyDrop<CudaSlice<f32>>,
    /// Over `cx` (CW elements): the filter gradient's output on top of x.
    cdw_in_x: ManuallyDrop<CudaSlice<f32>>,
}

/// Buffers on a second device, when there is one.
struct Device1 {
    ctx: Context,
    g: CudaSlice<f32>,
    ay: CudaSlice<f32>,
    gb: CudaSlice<f32>,
}

struct Fx {
    ctx: Context,
    other: Context,
    bn_add: BatchNorm<f32>,
    bn_relu: BatchNorm<f32>,
    bn_one: BatchNorm<f32>,
    saved_add: BnSaved,
    saved_relu: BnSaved,
    saved_other_ctx: BnSaved,
    // BatchNorm buffers.
    x: CudaSlice<f32>,
    z: CudaSlice<f32>,
    zz: CudaSlice<f32>,
    dy: CudaSlice<f32>,
    y: CudaSlice<f32>,
    dx: CudaSlice<f32>,
    dz: CudaSlice<f32>,
    x_short: CudaSlice<f32>,
    y_short: CudaSlice<f32>,
    dy_short: CudaSlice<f32>,
    dx_short: CudaSlice<f32>,
    dz_short: CudaSlice<f32>,
    g: CudaSlice<f32>,
    b: CudaSlice<f32>,
    g_short: CudaSlice<f32>,
    b_long: CudaSlice<f32>,
    rm: CudaSlice<f32>,
    rv: CudaSlice<f32>,
    rm_short: CudaSlice<f32>,
    rv_long: CudaSlice<f32>,
    dg: CudaSlice<f32>,
    db: CudaSlice<f32>,
    dg_short: CudaSlice<f32>,
    db_long: CudaSlice<f32>,
    x1: CudaSlice<f32>,
    y1: CudaSlice<f32>,
    g_other_ctx: CudaSlice<f32>,
    b_other_ctx: CudaSlice<f32>,
    // Activation buffers.
    ax: CudaSlice<f32>,
    az: CudaSlice<f32>,
    ady: CudaSlice<f32>,
    ay: CudaSlice<f32>,
    adx: CudaSlice<f32>,
    adz: CudaSlice<f32>,
    ay_short: CudaSlice<f32>,
    az_short: CudaSlice<f32>,
    adx_short: CudaSlice<f32>,
    adz_short: CudaSlice<f32>,
    amask: CudaSlice<u32>,
    amask_short: CudaSlice<u32>,
    abig: CudaSlice<f32>,
    // GEMM buffers.
    ga: CudaSlice<f32>,
    gb: CudaSlice<f32>,
    gc: CudaSlice<f32>,
    ga_short: CudaSlice<f32>,
    gc_short: CudaSlice<f32>,
    gbig: CudaSlice<f32>,
    ha: CudaSlice<f16>,
    hb: CudaSlice<f16>,
    hc: CudaSlice<f16>,
    ga_other_ctx: CudaSlice<f32>,
    gb_other_ctx: CudaSlice<f32>,
    // Convolution.
    conv: Conv2d<f32>,
    cx: CudaSlice<f32>,
    cw: CudaSlice<f32>,
    cy: CudaSlice<f32>,
    cdy: CudaSlice<f32>,
    cdx: CudaSlice<f32>,
    cdw: CudaSlice<f32>,
    cx_short: CudaSlice<f32>,
    cw_short: CudaSlice<f32>,
    cy_short: CudaSlice<f32>,
    cdy_short: CudaSlice<f32>,
    cdw_short: CudaSlice<f32>,
    cbig: CudaSlice<f32>,
    al: Aliases,
    dev1: Option<Device1>,
}

/// A second handle on `len` elements of `buf` starting `off_bytes` in.
fn alias<T, U: cudarc::driver::DeviceRepr>(
    ctx: &Context,
    buf: &CudaSlice<T>,
    off_bytes: u64,
    len: usize,
) -> ManuallyDrop<CudaSlice<U>> {
    let (p, _g) = buf.device_ptr(ctx.stream());
    // SAFETY: every alias lies inside `buf`'s allocation (checked by the callers' sizes); it is
    // never dropped (ManuallyDrop), so the memory is freed once, by its owner.
    ManuallyDrop::new(unsafe { ctx.stream().upgrade_device_ptr::<U>(p + off_bytes, len) })
}

impl Fx {
    fn new(rng: &mut Rng) -> Fx {
        let ctx = gpu();
        let other = gpu();
        let s = ctx.stream().clone();
        let up = |v: Vec<f32>| s.clone_htod(&v).unwrap();
        let rand = |rng: &mut Rng, n: usize| up(rng.vec::<f32>(n, -1.0, 1.0));
        let poison = |n: usize| up(vec![f32::from_bits(POISON); n]);
        let mpoison = |n: usize| s.clone_htod(&vec![MASK_POISON; n]).unwrap();

        let bn_add = BatchNorm::<f32>::new(&ctx, &SHAPE, 3, Fuse::AddRelu).unwrap();
        let bn_relu = BatchNorm::<f32>::new(&ctx, &SHAPE, 3, Fuse::Relu).unwrap();
        let bn_one = BatchNorm::<f32>::new(&ctx, &[1, C], 1, Fuse::None).unwrap();
        let bn_add_other = BatchNorm::<f32>::new(&other, &SHAPE, 3, Fuse::AddRelu).unwrap();
        let x = up(rng.vec::<f32>(N, -2.0, 3.0));
        let z = rand(rng, N);
        let g = up(rng.vec::<f32>(C, 0.5, 1.5));
        let b = rand(rng, C);

        // The states the backward rows use, made with scratch outputs.
        let forward = |bn: &BatchNorm<f32>, addend: Option<&CudaSlice<f32>>| {
            let (mut y, mut rm, mut rv) = (poison(N), up(vec![0.0; C]), up(vec![1.0; C]));
            bn.forward_train(TrainArgs {
                x: x.as_view(),
                addend: addend.map(|a| a.as_view()),
                gamma: g.as_view(),
                beta: b.as_view(),
                running_mean: rm.as_view_mut(),
                running_var: rv.as_view_mut(),
                y: y.as_view_mut(),
                momentum: 0.1,
                eps: 1e-5,
            })
            .unwrap()
        };
        let saved_add = forward(&bn_add, Some(&z));
        let saved_relu = forward(&bn_relu, None);
        let saved_other_ctx = forward(&bn_add_other, Some(&z));
        let y = poison(N);
        let zz = rand(rng, 2 * N);
        let dy = rand(rng, N);
        let dx = poison(N);
        let abig = rand(rng, 2 * A + 8);
        let ga = rand(rng, G);
        let gbig = rand(rng, G + 2);
        let rm = up(rng.vec::<f32>(C, -0.1, 0.1));
        let dg = poison(C);
        let adx = poison(A);
        let cx = rand(rng, CX);
        let cdy = rand(rng, CY);
        let cbig = rand(rng, 1000 + CY);
        let al = Aliases {
            y_is_x: alias(&ctx, &x, 0, N),
            y_over_addend: alias(&ctx, &zz, 8 * 4, N),
            rm_is_g: alias(&ctx, &g, 0, C),
            rv_is_rm: alias(&ctx, &rm, 0, C),
            dx_is_dy: alias(&ctx, &dy, 0, N),
            db_is_dg: alias(&ctx, &dg, 0, C),
            dz_is_dx: alias(&ctx, &dx, 0, N),
            ay_shifted: alias(&ctx, &abig, 2 * 4, A),
            amask_in_x: alias(&ctx, &abig, 4 * 4, mask_words(A)),
            adz_is_adx: alias(&ctx, &adx, 0, A),
            gc_is_ga: alias(&ctx, &ga, 0, G),
            ga_misaligned: alias(&ctx, &gbig, 2, G),
            cx_in_big: alias(&ctx, &cbig, 0, CX),
            cy_over_x: alias(&ctx, &cbig, 1000 * 4, CY),
            cdx_in_dy: alias(&ctx, &cdy, 0, CX),
            cdw_in_x: alias(&ctx, &cx, 0, CW),
        };

        let dev1 = match cudarc::driver::CudaContext::device_count() {
            Ok(n) if n >= 2 => {
                let c1 = Context::with_config(1, Config::default()).unwrap();
                let s1 = c1.stream().clone();
                Some(Device1 {
                    g: s1.clone_htod(&[1.0f32; C]).unwrap(),
                    ay: s1.alloc_zeros::<f32>(A).unwrap(),
                    gb: s1.alloc_zeros::<f32>(G).unwrap(),
                    ctx: c1,
                })
            }
            _ => None,
        };
        let os = other.stream().clone();
        let hrand = |rng: &mut Rng, n: usize| s.clone_htod(&rng.vec::<f16>(n, -1.0, 1.0)).unwrap();
        Fx {
            g_other_ctx: os.clone_htod(&s.clone_dtoh(&g).unwrap()).unwrap(),
            b_other_ctx: os.clone_htod(&s.clone_dtoh(&b).unwrap()).unwrap(),
            ga_other_ctx: os.clone_htod(&rng.vec::<f32>(G, -1.0, 1.0)).unwrap(),
            gb_other_ctx: os.clone_htod(&rng.vec::<f32>(G, -1.0, 1.0)).unwrap(),
            bn_add,
            bn_relu,
            bn_one,
            saved_add,
            saved_relu,
            saved_other_ctx,
            x,
            z,
            zz,
            dy,
            y,
            dx,
            dz: poison(N),
            x_short: rand(rng, N - 1),
            y_short: poison(N - 1),
            dy_short: rand(rng, N - 1),
            dx_short: poison(N - 1),
            dz_short: poison(N - 1),
            g,
            b,
            g_short: rand(rng, C - 1),
            b_long: rand(rng, C + 1),
            rm,
            rv: up(rng.vec::<f32>(C, 0.5, 1.5)),
            rm_short: rand(rng, C - 1),
            rv_long: up(rng.vec::<f32>(C + 1, 0.5, 1.5)),
            dg,
            db: poison(C),
            dg_short: poison(C - 1),
            db_long: poison(C + 1),
            x1: rand(rng, C),
            y1: poison(C),
            ax: rand(rng, A),
            az: rand(rng, A),
            ady: rand(rng, A),
            ay: poison(A),
            adx,
            adz: poison(A),
            ay_short: poison(A - 1),
            az_short: rand(rng, A - 1),
            adx_short: poison(A - 1),
            adz_short: poison(A - 1),
            amask: mpoison(mask_words(A)),
            amask_short: mpoison(mask_words(A) - 1),
            abig,
            ga,
            gb: rand(rng, G),
            gc: poison(G),
            ga_short: rand(rng, G - 256),
            gc_short: poison(G - 256),
            gbig,
            ha: hrand(rng, G),
            hb: hrand(rng, G),
            hc: s.clone_htod(&vec![f16::from_bits(0x7e5a); G]).unwrap(),
            conv: Conv2d::<f32>::new(&ctx, &conv_shape()).unwrap(),
            cx,
            cw: rand(rng, CW),
            cy: poison(CY),
            cdy,
            cdx: poison(CX),
            cdw: poison(CW),
            cx_short: rand(rng, CX - 1),
            cw_short: rand(rng, CW - 1),
            cy_short: poison(CY - 1),
            cdy_short: rand(rng, CY - 1),
            cdw_short: poison(CW - 1),
            cbig,
            al,
            dev1,
            other,
            ctx,
        }
    }

    /// The bits of every buffer the fixture owns (aliases are views of these).
    fn snapshot(&self) -> Vec<(&'static str, Vec<u32>)> {
        let s = self.ctx.stream();
        let f = |v: &CudaSlice<f32>| -> Vec<u32> {
            s.clone_dtoh(v)
                .unwrap()
                .iter()
                .map(|x| x.to_bits())
                .collect()
        };
        let h = |v: &CudaSlice<f16>| -> Vec<u32> {
            s.clone_dtoh(v)
                .unwrap()
                .iter()
                .map(|x| x.to_bits() as u32)
                .collect()
        };
        let u = |v: &CudaSlice<u32>| -> Vec<u32> { s.clone_dtoh(v).unwrap() };
        let mut out = vec![
            ("x", f(&self.x)),
            ("z", f(&self.z)),
            ("zz", f(&self.zz)),
            ("dy", f(&self.dy)),
            ("y", f(&self.y)),
            ("dx", f(&self.dx)),
            ("dz", f(&self.dz)),
            ("x_short", f(&self.x_short)),
            ("y_short", f(&self.y_short)),
            ("dy_short", f(&self.dy_short)),
            ("dx_short", f(&self.dx_short)),
            ("dz_short", f(&self.dz_short)),
            ("g", f(&self.g)),
            ("b", f(&self.b)),
            ("g_short", f(&self.g_short)),
            ("b_long", f(&self.b_long)),
            ("running_mean", f(&self.rm)),
            ("running_var", f(&self.rv)),
            ("rm_short", f(&self.rm_short)),
            ("rv_long", f(&self.rv_long)),
            ("dgamma", f(&self.dg)),
            ("dbeta", f(&self.db)),
            ("dg_short", f(&self.dg_short)),
            ("db_long", f(&self.db_long)),
            ("x1", f(&self.x1)),
            ("y1", f(&self.y1)),
            ("ax", f(&self.ax)),
            ("az", f(&self.az)),
            ("ady", f(&self.ady)),
            ("ay", f(&self.ay)),
            ("adx", f(&self.adx)),
            ("adz", f(&self.adz)),
            ("ay_short", f(&self.ay_short)),
            ("az_short", f(&self.az_short)),
            ("adx_short", f(&self.adx_short)),
            ("adz_short", f(&self.adz_short)),
            ("amask", u(&self.amask)),
            ("amask_short", u(&self.amask_short)),
            ("abig", f(&self.abig)),
            ("ga", f(&self.ga)),
            ("gb", f(&self.gb)),
            ("gc", f(&self.gc)),
            ("ga_short", f(&self.ga_short)),
            ("gc_short", f(&self.gc_short)),
            ("gbig", f(&self.gbig)),
            ("ha", h(&self.ha)),
            ("hb", h(&self.hb)),
            ("hc", h(&self.hc)),
            ("conv x", f(&self.cx)),
            ("conv w", f(&self.cw)),
            ("conv y", f(&self.cy)),
            ("conv dy", f(&self.cdy)),
            ("conv dx", f(&self.cdx)),
            ("conv dw", f(&self.cdw)),
            ("conv x_short", f(&self.cx_short)),
            ("conv w_short", f(&self.cw_short)),
            ("conv y_short", f(&self.cy_short)),
            ("conv dy_short", f(&self.cdy_short)),
            ("conv dw_short", f(&self.cdw_short)),
            ("conv big", f(&self.cbig)),
        ];
        let os = self.other.stream();
        for (name, v) in [
            ("g_other_ctx", &self.g_other_ctx),
            ("b_other_ctx", &self.b_other_ctx),
            ("ga_other_ctx", &self.ga_other_ctx),
            ("gb_other_ctx", &self.gb_other_ctx),
        ] {
            out.push((
                name,
                os.clone_dtoh(v)
                    .unwrap()
                    .iter()
                    .map(|x| x.to_bits())
                    .collect(),
            ));
        }
        // The second GPU's buffers, read through its own Context's stream.
        if let Some(d) = &self.dev1 {
            let s1 = d.ctx.stream();
            for (name, v) in [
                ("device 1 g", &d.g),
                ("device 1 ay", &d.ay),
                ("device 1 gb", &d.gb),
            ] {
                out.push((
                    name,
                    s1.clone_dtoh(v)
                        .unwrap()
                        .iter()
                        .map(|x| x.to_bits())
                        .collect(),
                ));
            }
        }
        out
    }
}

/// One bad call: what it is, the argument its error must name, the call.
struct Row {
    name: &'static str,
    arg: &'static str,
    call: fn(&mut Fx) -> nnfuse::Result<()>,
}

fn row(name: &'static str, arg: &'static str, call: fn(&mut Fx) -> nnfuse::Result<()>) -> Row {
    Row { name, arg, call }
}

/// A training forward of `bn_add` with good arguments (fields can be replaced before the call).
macro_rules! train {
    ($f:ident) => {
        TrainArgs {
            x: $f.x.as_view(),
            addend: Some($f.z.as_view()),
            gamma: $f.g.as_view(),
            beta: $f.b.as_view(),
            running_mean: $f.rm.as_view_mut(),
            running_var: $f.rv.as_view_mut(),
            y: $f.y.as_view_mut(),
            momentum: 0.1,
            eps: 1e-5,
        }
    };
}

/// A backward of `bn_add` with `saved` and otherwise good arguments.
macro_rules! backward {
    ($f:ident, $saved:expr) => {
        BackwardArgs {
            x: $f.x.as_view(),
            y: $f.y.as_view(),
            dy: $f.dy.as_view(),
            gamma: $f.g.as_view(),
            beta: $f.b.as_view(),
            saved: $saved,
            dx: $f.dx.as_view_mut(),
            d_addend: Some($f.dz.as_view_mut()),
            dgamma: $f.dg.as_view_mut(),
            dbeta: $f.db.as_view_mut(),
        }
    };
}

/// An inference forward of `bn_add` with good arguments.
macro_rules! inference {
    ($f:ident) => {
        InferenceArgs {
            x: $f.x.as_view(),
            addend: Some($f.z.as_view()),
            gamma: $f.g.as_view(),
            beta: $f.b.as_view(),
            running_mean: $f.rm.as_view(),
            running_var: $f.rv.as_view(),
            y: $f.y.as_view_mut(),
            eps: 1e-5,
        }
    };
}

/// The packed GEMM of the fixture: 4 x 16x16x16.
fn gp() -> Problem {
    Problem::packed(4, 16, 16, 16)
}

fn gemm_f32(f: &mut Fx, p: Problem) -> nnfuse::Result<()> {
    gemm::strided_batched(&f.ctx, &p, &f.ga, &f.gb, &mut f.gc)
}

fn table() -> Vec<Row> {
    vec![
        // ---------------------------------------------------------------- BatchNorm: planning
        row("new: empty shape", "shape", |f| {
            BatchNorm::<f32>::new(&f.ctx, &[], 0, Fuse::None).map(drop)
        }),
        row("new: a zero dim", "shape[1]", |f| {
            BatchNorm::<f32>::new(&f.ctx, &[4, 0, 8], 1, Fuse::None).map(drop)
        }),
        row("new: axis past the rank", "axis", |f| {
            BatchNorm::<f32>::new(&f.ctx, &[4, 8], 2, Fuse::None).map(drop)
        }),
        row("new: element count overflows i32", "shape", |f| {
            BatchNorm::<f32>::new(&f.ctx, &[65536, 65536, 2], 1, Fuse::None).map(drop)
        }),
        row("new: dims whose product overflows usize", "shape", |f| {
            BatchNorm::<f32>::new(&f.ctx, &[usize::MAX, 2, 2], 1, Fuse::Relu).map(drop)
        }),
        // ---------------------------------------------------------------- BatchNorm: training
        row("train: x one element short", "x", |f| {
            let mut a = train!(f);
            a.x = f.x_short.as_view();
            f.bn_add.forward_train(a).map(drop)
        }),
        row("train: y one element short", "y", |f| {
            let mut a = train!(f);
            a.y = f.y_short.as_view_mut();
            f.bn_add.forward_train(a).map(drop)
        }),
        row("train: addend one element short", "addend", |f| {
            let mut a = train!(f);
            a.addend = Some(f.x_short.as_view());
            f.bn_add.forward_train(a).map(drop)
        }),
        row("train: addend missing for Add+ReLU", "addend", |f| {
            let mut a = train!(f);
            a.addend = None;
            f.bn_add.forward_train(a).map(drop)
        }),
        row("train: addend given to ReLU", "addend", |f| {
            let a = train!(f);
            f.bn_relu.forward_train(a).map(drop)
        }),
        row("train: gamma one short", "gamma", |f| {
            let mut a = train!(f);
            a.gamma = f.g_short.as_view();
            f.bn_add.forward_train(a).map(drop)
        }),
        row("train: beta one long", "beta", |f| {
            let mut a = train!(f);
            a.beta = f.b_long.as_view();
            f.bn_add.forward_train(a).map(drop)
        }),
        row("train: running_mean one short", "running_mean", |f| {
            let mut a = train!(f);
            a.running_mean = f.rm_short.as_view_mut();
            f.bn_add.forward_train(a).map(drop)
        }),
        row("train: running_var one long", "running_var", |f| {
            let mut a = train!(f);
            a.running_var = f.rv_long.as_view_mut();
            f.bn_add.forward_train(a).map(drop)
        }),
        row("train: eps = 0", "eps", |f| {
            let mut a = train!(f);
            a.eps = 0.0;
            f.bn_add.forward_train(a).map(drop)
        }),
        row("train: eps < 0", "eps", |f| {
            let mut a = train!(f);
            a.eps = -1e-5;
            f.bn_add.forward_train(a).map(drop)
        }),
        row("train: eps NaN", "eps", |f| {
            let mut a = train!(f);
            a.eps = f64::NAN;
            f.bn_add.forward_train(a).map(drop)
        }),
        row("train: eps infinite", "eps", |f| {
            let mut a = train!(f);
            a.eps = f64::INFINITY;
            f.bn_add.forward_train(a).map(drop)
        }),
        row("train: momentum NaN", "momentum", |f| {
            let mut a = train!(f);
            a.momentum = f64::NAN;
            f.bn_add.forward_train(a).map(drop)
        }),
        row("train: momentum < 0", "momentum", |f| {
            let mut a = train!(f);
            a.momentum = -0.1;
            f.bn_add.forward_train(a).map(drop)
        }),
        row("train: momentum > 1", "momentum", |f| {
            let mut a = train!(f);
            a.momentum = 1.5;
            f.bn_add.forward_train(a).map(drop)
        }),
        row("train: y is x", "y", |f| {
            let mut a = train!(f);
            a.y = f.al.y_is_x.as_view_mut();
            f.bn_add.forward_train(a).map(drop)
        }),
        row("train: y partially overlaps the addend", "y", |f| {
            let mut a = train!(f);
            a.addend = Some(f.zz.slice(0..N));
            a.y = f.al.y_over_addend.as_view_mut();
            f.bn_add.forward_train(a).map(drop)
        }),
        row("train: running_mean is gamma", "running_mean", |f| {
            let mut a = train!(f);
            a.running_mean = f.al.rm_is_g.as_view_mut();
            f.bn_add.forward_train(a).map(drop)
        }),
        row("train: running_var is running_mean", "running_var", |f| {
            let mut a = train!(f);
            a.running_var = f.al.rv_is_rm.as_view_mut();
            f.bn_add.forward_train(a).map(drop)
        }),
        row("train: one value per channel (n*h*w = 1)", "shape", |f| {
            f.bn_one
                .forward_train(TrainArgs {
                    x: f.x1.as_view(),
                    addend: None,
                    gamma: f.g.as_view(),
                    beta: f.b.as_view(),
                    running_mean: f.rm.as_view_mut(),
                    running_var: f.rv.as_view_mut(),
                    y: f.y1.as_view_mut(),
                    momentum: 0.1,
                    eps: 1e-5,
                })
                .map(drop)
        }),
        // ---------------------------------------------------------------- BatchNorm: backward
        row("backward: BnSaved from another op (ReLU)", "saved", |f| {
            let a = backward!(f, &f.saved_relu);
            f.bn_add.backward(a)
        }),
        row("backward: BnSaved from another Context", "saved", |f| {
            let a = backward!(f, &f.saved_other_ctx);
            f.bn_add.backward(a)
        }),
        row("backward: BnSaved of another x", "x", |f| {
            let mut a = backward!(f, &f.saved_add);
            a.x = f.z.as_view();
            f.bn_add.backward(a)
        }),
        row("backward: d_addend missing for Add+ReLU", "d_addend", |f| {
            let mut a = backward!(f, &f.saved_add);
            a.d_addend = None;
            f.bn_add.backward(a)
        }),
        row("backward: d_addend given to ReLU", "d_addend", |f| {
            let a = backward!(f, &f.saved_relu);
            f.bn_relu.backward(a)
        }),
        row("backward: y one short", "y", |f| {
            let mut a = backward!(f, &f.saved_add);
            a.y = f.x_short.as_view();
            f.bn_add.backward(a)
        }),
        row("backward: dy one short", "dy", |f| {
            let mut a = backward!(f, &f.saved_add);
            a.dy = f.dy_short.as_view();
            f.bn_add.backward(a)
        }),
        row("backward: gamma one short", "gamma", |f| {
            let mut a = backward!(f, &f.saved_add);
            a.gamma = f.g_short.as_view();
            f.bn_add.backward(a)
        }),
        row("backward: dx one short", "dx", |f| {
            let mut a = backward!(f, &f.saved_add);
            a.dx = f.dx_short.as_view_mut();
            f.bn_add.backward(a)
        }),
        row("backward: d_addend one short", "d_addend", |f| {
            let mut a = backward!(f, &f.saved_add);
            a.d_addend = Some(f.dz_short.as_view_mut());
            f.bn_add.backward(a)
        }),
        row("backward: dgamma one short", "dgamma", |f| {
            let mut a = backward!(f, &f.saved_add);
            a.dgamma = f.dg_short.as_view_mut();
            f.bn_add.backward(a)
        }),
        row("backward: dbeta one long", "dbeta", |f| {
            let mut a = backward!(f, &f.saved_add);
            a.dbeta = f.db_long.as_view_mut();
            f.bn_add.backward(a)
        }),
        row("backward: dx is dy", "dx", |f| {
            let mut a = backward!(f, &f.saved_add);
            a.dx = f.al.dx_is_dy.as_view_mut();
            f.bn_add.backward(a)
        }),
        row("backward: dbeta is dgamma", "dbeta", |f| {
            let mut a = backward!(f, &f.saved_add);
            a.dbeta = f.al.db_is_dg.as_view_mut();
            f.bn_add.backward(a)
        }),
        row("backward: d_addend is dx", "d_addend", |f| {
            let mut a = backward!(f, &f.saved_add);
            a.d_addend = Some(f.al.dz_is_dx.as_view_mut());
            f.bn_add.backward(a)
        }),
        // ---------------------------------------------------------------- BatchNorm: inference
        row("inference: eps = 0", "eps", |f| {
            let mut a = inference!(f);
            a.eps = 0.0;
            f.bn_add.forward_inference(a)
        }),
        row("inference: running_var one long", "running_var", |f| {
            let mut a = inference!(f);
            a.running_var = f.rv_long.as_view();
            f.bn_add.forward_inference(a)
        }),
        row("inference: y is x", "y", |f| {
            let mut a = inference!(f);
            a.y = f.al.y_is_x.as_view_mut();
            f.bn_add.forward_inference(a)
        }),
        row("inference: addend missing for Add+ReLU", "addend", |f| {
            let mut a = inference!(f);
            a.addend = None;
            f.bn_add.forward_inference(a)
        }),
        // ---------------------------------------------------------------- activation
        row("relu fwd: y one short", "y", |f| {
            activation::relu_mask_fwd(&f.ctx, &f.ax, &mut f.ay_short, Some(&mut f.amask))
        }),
        row("relu fwd: mask one word short", "mask", |f| {
            activation::relu_mask_fwd(&f.ctx, &f.ax, &mut f.ay, Some(&mut f.amask_short))
        }),
        row("relu fwd: y partially overlaps x", "y", |f| {
            let x = f.abig.slice(0..A);
            activation::relu_mask_fwd(&f.ctx, &x, &mut *f.al.ay_shifted, Some(&mut f.amask))
        }),
        row("relu fwd: mask inside x", "mask", |f| {
            let x = f.abig.slice(0..A);
            activation::relu_mask_fwd(&f.ctx, &x, &mut f.ay, Some(&mut *f.al.amask_in_x))
        }),
        row("add-relu fwd: z one short", "z", |f| {
            activation::add_relu_mask_fwd(&f.ctx, &f.ax, &f.az_short, &mut f.ay, Some(&mut f.amask))
        }),
        row("add-relu fwd: y one short, no mask", "y", |f| {
            activation::add_relu_mask_fwd(
                &f.ctx,
                &f.ax,
                &f.az,
                &mut f.ay_short,
                None::<&mut NoMask>,
            )
        }),
        row("add-relu in place: z one short", "z", |f| {
            activation::add_relu_mask_fwd_inplace(
                &f.ctx,
                &mut f.ay,
                &f.az_short,
                None::<&mut NoMask>,
            )
        }),
        row("mask bwd: dx one short", "dx", |f| {
            activation::relu_mask_bwd(&f.ctx, &f.ady, &f.amask, &mut f.adx_short)
        }),
        row("mask bwd: mask one word short", "mask", |f| {
            activation::relu_mask_bwd(&f.ctx, &f.ady, &f.amask_short, &mut f.adx)
        }),
        row("mask bwd dual: dz one short", "dz", |f| {
            activation::relu_mask_bwd_dual(&f.ctx, &f.ady, &f.amask, &mut f.adx, &mut f.adz_short)
        }),
        row("mask bwd dual: dz is dx", "dz", |f| {
            activation::relu_mask_bwd_dual(
                &f.ctx,
                &f.ady,
                &f.amask,
                &mut f.adx,
                &mut *f.al.adz_is_adx,
            )
        }),
        row("mask bwd in place: mask one word short", "mask", |f| {
            activation::relu_mask_bwd_inplace(&f.ctx, &mut f.adx, &f.amask_short)
        }),
        // ---------------------------------------------------------------- GEMM
        row("gemm: A's batches run past its end", "stride_a", |f| {
            gemm::strided_batched(&f.ctx, &gp(), &f.ga_short, &f.gb, &mut f.gc)
        }),
        row("gemm: B holds less than one matrix", "b", |f| {
            gemm::strided_batched(&f.ctx, &gp(), &f.ga, &f.gb.slice(..100), &mut f.gc)
        }),
        row("gemm: C's batches run past its end", "stride_c", |f| {
            gemm::strided_batched(&f.ctx, &gp(), &f.ga, &f.gb, &mut f.gc_short)
        }),
        row("gemm: lda < m", "lda", |f| {
            gemm_f32(f, Problem { lda: 8, ..gp() })
        }),
        row("gemm: ldb < k", "ldb", |f| {
            gemm_f32(f, Problem { ldb: 15, ..gp() })
        }),
        row("gemm: ldc < m", "ldc", |f| {
            gemm_f32(f, Problem { ldc: 1, ..gp() })
        }),
        row("gemm: k = 0 with a non-empty C", "k", |f| {
            gemm_f32(f, Problem { k: 0, ..gp() })
        }),
        row(
            "gemm: stride_c = 0 with batch 4 (write race)",
            "stride_c",
            |f| {
                gemm_f32(
                    f,
                    Problem {
                        stride_c: 0,
                        ..gp()
                    },
                )
            },
        ),
        row("gemm: stride_c makes C matrices overlap", "stride_c", |f| {
            gemm_f32(
                f,
                Problem {
                    stride_c: 8,
                    ..gp()
                },
            )
        }),
        row("gemm: m beyond cuBLAS's int", "m", |f| {
            let m = i32::MAX as usize + 1;
            gemm_f32(f, Problem { m, ldc: m, ..gp() })
        }),
        row("gemm: batch beyond cuBLAS's int", "batch", |f| {
            gemm_f32(
                f,
                Problem {
                    batch: i32::MAX as usize + 1,
                    ..gp()
                },
            )
        }),
        row("gemm: A's batch extent overflows usize", "stride_a", |f| {
            gemm_f32(
                f,
                Problem {
                    stride_a: i64::MAX as usize,
                    ..gp()
                },
            )
        }),
        row("gemm: stride beyond cuBLAS's long long", "stride_b", |f| {
            gemm_f32(
                f,
                Problem {
                    stride_b: usize::MAX,
                    ..gp()
                },
            )
        }),
        row("gemm: f16 compute with f32 data", "compute", |f| {
            gemm_f32(f, gp().with_compute(Compute::F16))
        }),
        row("gemm: f16 compute, alpha overflows f16", "alpha", |f| {
            let p = gp().with_compute(Compute::F16).with_scalars(1e6, 0.0);
            gemm::strided_batched(&f.ctx, &p, &f.ha, &f.hb, &mut f.hc)
        }),
        row("gemm: C is A", "c", |f| {
            gemm::strided_batched(&f.ctx, &gp(), &f.ga, &f.gb, &mut *f.al.gc_is_ga)
        }),
        row("gemm: A not aligned to its element", "a", |f| {
            gemm::strided_batched(&f.ctx, &gp(), &*f.al.ga_misaligned, &f.gb, &mut f.gc)
        }),
        // ---------------------------------------------------------------- convolution
        row("conv forward: x one element short", "x", |f| {
            f.conv.forward(&f.cx_short, &f.cw, &mut f.cy)
        }),
        row("conv forward: w one element short", "w", |f| {
            f.conv.forward(&f.cx, &f.cw_short, &mut f.cy)
        }),
        row("conv forward: y one element short", "y", |f| {
            f.conv.forward(&f.cx, &f.cw, &mut f.cy_short)
        }),
        row("conv forward: y overlaps x", "y", |f| {
            f.conv
                .forward(&*f.al.cx_in_big, &f.cw, &mut *f.al.cy_over_x)
        }),
        row("conv backward_data: dy one element short", "dy", |f| {
            f.conv.backward_data(&f.cdy_short, &f.cw, &mut f.cdx)
        }),
        row("conv backward_data: dx lies on dy", "dx", |f| {
            f.conv.backward_data(&f.cdy, &f.cw, &mut *f.al.cdx_in_dy)
        }),
        row("conv backward_filter: dw one element short", "dw", |f| {
            f.conv
                .backward_filter(&f.cx, &f.cdy, &mut f.cdw_short, false)
        }),
        row("conv backward_filter: dw lies on x", "dw", |f| {
            f.conv
                .backward_filter(&f.cx, &f.cdy, &mut *f.al.cdw_in_x, true)
        }),
        row("conv plan: batch of 0", "n", |f| {
            let s = ConvShape {
                n: 0,
                ..conv_shape()
            };
            Conv2d::<f32>::new(&f.ctx, &s).map(drop)
        }),
        row("conv plan: stride (0, 1)", "stride", |f| {
            let s = ConvShape {
                stride: (0, 1),
                ..conv_shape()
            };
            Conv2d::<f32>::new(&f.ctx, &s).map(drop)
        }),
        row("conv plan: dilation (1, 0)", "dilation", |f| {
            let s = ConvShape {
                dilation: (1, 0),
                ..conv_shape()
            };
            Conv2d::<f32>::new(&f.ctx, &s).map(drop)
        }),
        row(
            "conv plan: 13x13 filter over a padded 11x11 input",
            "kh",
            |f| {
                let s = ConvShape {
                    kh: 13,
                    kw: 13,
                    ..conv_shape()
                };
                Conv2d::<f32>::new(&f.ctx, &s).map(drop)
            },
        ),
        row("conv plan: element counts overflow", "shape", |f| {
            let s = ConvShape {
                n: usize::MAX / 64,
                ..conv_shape()
            };
            Conv2d::<f32>::new(&f.ctx, &s).map(drop)
        }),
        row(
            "conv plan: KCRS filter with NHWC data",
            "filter_layout",
            |f| {
                Conv2d::<f32>::with_filter_layout(&f.ctx, &conv_shape(), FilterLayout::Kcrs)
                    .map(drop)
            },
        ),
    ]
}

/// Rows with a buffer on device 1 (only when a second GPU exists).
fn device1_rows() -> Vec<Row> {
    vec![
        row(
            "device 1: BatchNorm gamma on another device",
            "gamma",
            |f| {
                let g1 = &f.dev1.as_ref().unwrap().g;
                let mut a = train!(f);
                a.gamma = g1.as_view();
                f.bn_add.forward_train(a).map(drop)
            },
        ),
        row("device 1: activation y on another device", "y", |f| {
            let d = f.dev1.as_mut().unwrap();
            activation::relu_mask_fwd(&f.ctx, &f.ax, &mut d.ay, None::<&mut NoMask>)
        }),
        row("device 1: GEMM B on another device", "b", |f| {
            let d = f.dev1.as_ref().unwrap();
            gemm::strided_batched(&f.ctx, &gp(), &f.ga, &d.gb, &mut f.gc)
        }),
    ]
}

/// What one row did wrong, if anything.
fn check_row(f: &mut Fx, r: &Row) -> Option<String> {
    f.ctx.synchronize().unwrap();
    let before = f.snapshot();
    let result = (r.call)(f);
    f.ctx.synchronize().unwrap();
    let after = f.snapshot();
    let mut problems = Vec::new();
    match &result {
        Err(e @ Error::InvalidArgument { .. }) if e.argument() == Some(r.arg) => {}
        Err(e) => problems.push(format!("got error `{e}` (argument {:?})", e.argument())),
        Ok(()) => problems.push("the call succeeded".into()),
    }
    for ((name, b), (_, a)) in before.iter().zip(&after) {
        if b != a {
            let i = b.iter().zip(a).position(|(x, y)| x != y).unwrap_or(0);
            problems.push(format!(
                "`{name}` changed (first at element {i}: {:#010x} -> {:#010x})",
                b[i], a[i]
            ));
        }
    }
    let shown = match &result {
        Err(e) => e.to_string(),
        Ok(()) => "Ok".into(),
    };
    println!("{:<52} {:<13} {}", r.name, r.arg, shown);
    (!problems.is_empty())
        .then(|| format!("{} (want `{}`): {}", r.name, r.arg, problems.join("; ")))
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn every_bad_call_is_named_and_changes_nothing() {
    let mut rng = Rng::fresh("bad input table");
    let mut f = Fx::new(&mut rng);

    // Controls: the good calls succeed, so each row fails for its own reason only.
    let saved = f
        .bn_add
        .forward_train(train!(f))
        .expect("good training forward");
    f.bn_add
        .backward(backward!(f, &saved))
        .expect("good backward");
    f.bn_add
        .forward_inference(inference!(f))
        .expect("good inference");
    activation::relu_mask_fwd(&f.ctx, &f.ax, &mut f.ay, Some(&mut f.amask)).expect("good relu");
    activation::relu_mask_bwd_dual(&f.ctx, &f.ady, &f.amask, &mut f.adx, &mut f.adz)
        .expect("good dual backward");
    gemm_f32(&mut f, gp()).expect("good GEMM");
    f.conv
        .forward(&f.cx, &f.cw, &mut f.cy)
        .expect("good conv forward");
    f.conv
        .backward_data(&f.cdy, &f.cw, &mut f.cdx)
        .expect("good conv backward_data");
    f.conv
        .backward_filter(&f.cx, &f.cdy, &mut f.cdw, false)
        .expect("good conv backward_filter");
    drop(saved);

    let rows = table();
    let gpu_rows = rows.len();
    println!("{:<52} {:<13} error", "row", "argument");
    let failures: Vec<String> = rows.iter().filter_map(|r| check_row(&mut f, r)).collect();

    // The device check every operation makes, on plain numbers.
    let on1 = BufInfo {
        name: "gamma",
        ptr: 0x1000,
        len: C,
        elem: 4,
        ordinal: 1,
    };
    let e = expect_device(&on1, 0).unwrap_err();
    assert_eq!(e.argument(), Some("gamma"), "{e}");
    assert!(expect_device(&on1, 1).is_ok());

    assert!(
        gpu_rows >= 40,
        "the table has {gpu_rows} rows; the issue asks for at least 40"
    );
    assert!(
        failures.is_empty(),
        "{} of {} rows failed:\n{}",
        failures.len(),
        rows.len(),
        failures.join("\n")
    );
}

/// The rows with a buffer on a second GPU (device 1 while the operation runs on device 0): each a
/// typed error naming the argument, every buffer of both devices unchanged. Needs two visible
/// GPUs; with fewer it says SKIPPED and passes, unless `NNFUSE_REQUIRE_TWO_GPUS=1`.
#[test]
#[ignore = "needs two CUDA GPUs"]
fn buffers_on_a_second_gpu_are_refused_and_change_nothing() {
    let n = cudarc::driver::CudaContext::device_count().unwrap_or(0);
    if n < 2 {
        let required = std::env::var("NNFUSE_REQUIRE_TWO_GPUS").is_ok_and(|v| v == "1");
        assert!(
            !required,
            "NNFUSE_REQUIRE_TWO_GPUS=1 but {n} GPU(s) are visible"
        );
        eprintln!("SKIPPED: {n} GPU(s) visible; the other-device rows need two");
        return;
    }
    let mut rng = Rng::fresh("bad input on a second GPU");
    let mut f = Fx::new(&mut rng);
    assert!(
        f.dev1.is_some(),
        "{n} GPUs visible but no buffers on device 1"
    );
    let rows = device1_rows();
    println!("{:<52} {:<13} error", "row", "argument");
    let failures: Vec<String> = rows.iter().filter_map(|r| check_row(&mut f, r)).collect();
    assert!(
        failures.is_empty(),
        "{} of {} rows failed:\n{}",
        failures.len(),
        rows.len(),
        failures.join("\n")
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn legitimate_lookalikes_are_accepted() {
    let mut rng = Rng::fresh("bad input lookalikes");
    let mut f = Fx::new(&mut rng);
    // Parameters from another Context on the same device: valid memory, a correct result
    // (the same call with this Context's own copies gives the same y).
    let mut a = train!(f);
    a.gamma = f.g_other_ctx.as_view();
    a.beta = f.b_other_ctx.as_view();
    f.bn_add
        .forward_train(a)
        .expect("BatchNorm with gamma/beta from another Context on the same device");
    let y_other = f.ctx.stream().clone_dtoh(&f.y).unwrap();
    let rm0 = f.ctx.stream().clone_dtoh(&f.rm).unwrap();
    assert!(
        y_other.iter().all(|v| v.is_finite()),
        "y has non-finite values"
    );
    assert!(rm0.iter().all(|v| v.is_finite()));

    // GEMM operands from another Context on the same device.
    gemm::strided_batched(&f.ctx, &gp(), &f.ga_other_ctx, &f.gb_other_ctx, &mut f.gc)
        .expect("GEMM with A and B from another Context on the same device");
    let os = f.other.stream();
    let (a_h, b_h) = (
        f64s(&os.clone_dtoh(&f.ga_other_ctx).unwrap()),
        f64s(&os.clone_dtoh(&f.gb_other_ctx).unwrap()),
    );
    let mut want = vec![0.0; G];
    nnfuse::reference::gemm::gemm_strided_batched(
        &nnfuse::reference::gemm::GemmProblem::packed(4, 16, 16, 16),
        &a_h,
        &b_h,
        &mut want,
    )
    .unwrap();
    let got = f64s(&f.ctx.stream().clone_dtoh(&f.gc).unwrap());
    common::assert_close("GEMM across Contexts", &got, &want, 1e-5);

    // A NaN alpha is arithmetic, not bad input: C becomes NaN.
    let p = gp().with_scalars(f32::NAN, 0.0);
    gemm::strided_batched(&f.ctx, &p, &f.ga, &f.gb, &mut f.gc).expect("NaN alpha");
    let c = f.ctx.stream().clone_dtoh(&f.gc).unwrap();
    assert!(c.iter().all(|v| v.is_nan()), "NaN alpha: C is not all NaN");
}
