//! A training chain's buffers on the device (the shortcut is the input), and its forward and
//! backward arguments over them: what `block_chain` and `host_overhead` time.

use cudarc::driver::CudaSlice;
use nnfuse::block::{AddendGrad, ChainArgs, ChainBackwardArgs, ChainBn};
use nnfuse::conv::ConvShape;
use nnfuse::{Context, Element};

pub struct Bufs<T> {
    x: CudaSlice<T>,
    w: Vec<CudaSlice<T>>,
    g: Vec<CudaSlice<f32>>,
    b: Vec<CudaSlice<f32>>,
    rm: Vec<CudaSlice<f32>>,
    rv: Vec<CudaSlice<f32>>,
    y: CudaSlice<T>,
    dy: CudaSlice<T>,
    dx: CudaSlice<T>,
    dw: Vec<CudaSlice<T>>,
    dg: Vec<CudaSlice<f32>>,
    db: Vec<CudaSlice<f32>>,
}

fn random<T: Element>(ctx: &Context, n: usize, seed: u64) -> anyhow::Result<CudaSlice<T>> {
    let mut state = seed | 1;
    let v: Vec<T> = (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            T::from_f64((state % 2001) as f64 / 1000.0 - 1.0)
        })
        .collect();
    Ok(ctx.stream().clone_htod(&v)?)
}

impl<T: Element> Bufs<T> {
    /// Random input and filters, unit BatchNorm parameters, zeroed outputs.
    pub fn new(ctx: &Context, shapes: &[ConvShape]) -> anyhow::Result<Self> {
        let s = ctx.stream();
        let c = |f: f32| -> anyhow::Result<Vec<CudaSlice<f32>>> {
            shapes
                .iter()
                .map(|sh| Ok(s.clone_htod(&vec![f; sh.c_out])?))
                .collect()
        };
        let yn = shapes[shapes.len() - 1].y_len()?;
        Ok(Bufs {
            x: random(ctx, shapes[0].x_len()?, 1)?,
            w: shapes
                .iter()
                .enumerate()
                .map(|(i, sh)| random(ctx, sh.w_len().unwrap(), 7 + i as u64))
                .collect::<anyhow::Result<_>>()?,
            g: c(1.0)?,
            b: c(0.1)?,
            rm: c(0.0)?,
            rv: c(1.0)?,
            y: s.alloc_zeros(yn)?,
            dy: random(ctx, yn, 3)?,
            dx: s.alloc_zeros(shapes[0].x_len()?)?,
            dw: shapes
                .iter()
                .map(|sh| Ok(s.alloc_zeros(sh.w_len().unwrap())?))
                .collect::<anyhow::Result<_>>()?,
            dg: c(0.0)?,
            db: c(0.0)?,
        })
    }

    /// The forward's arguments (the addend is x).
    pub fn fwd(&mut self) -> ChainArgs<'_, T> {
        ChainArgs {
            x: self.x.as_view(),
            w: self.w.iter().map(|w| w.as_view()).collect(),
            bn: self
                .g
                .iter()
                .zip(&self.b)
                .zip(self.rm.iter_mut().zip(self.rv.iter_mut()))
                .map(|((g, b), (m, v))| ChainBn {
                    gamma: g.as_view(),
                    beta: b.as_view(),
                    running_mean: m.as_view_mut(),
                    running_var: v.as_view_mut(),
                })
                .collect(),
            addend: Some(self.x.as_view()),
            y: self.y.as_view_mut(),
            momentum: 0.1,
            eps: 1e-5,
        }
    }

    /// The backward's arguments (the addend's gradient into dx).
    pub fn bwd(&mut self) -> ChainBackwardArgs<'_, T> {
        ChainBackwardArgs {
            x: self.x.as_view(),
            w: self.w.iter().map(|w| w.as_view()).collect(),
            gamma: self.g.iter().map(|v| v.as_view()).collect(),
            beta: self.b.iter().map(|v| v.as_view()).collect(),
            y: self.y.as_view(),
            dy: self.dy.as_view(),
            dx: Some(self.dx.as_view_mut()),
            accumulate_dx: false,
            dw: self.dw.iter_mut().map(|d| d.as_view_mut()).collect(),
            dgamma: self.dg.iter_mut().map(|d| d.as_view_mut()).collect(),
            dbeta: self.db.iter_mut().map(|d| d.as_view_mut()).collect(),
            d_addend: AddendGrad::IntoDx,
        }
    }
}
