//! What a training forward hands to its backward. Only the matching backward accepts it: the
//! state records which BatchNorm made it, from which `x`, and by which path.
//!
//! Its buffers (saved statistics, the own path's mean remainder, masks, cuDNN's reserve) are
//! nnfuse's own: recycled through the BatchNorm's [`Spares`] when the state is dropped, so that
//! a cached training step allocates nothing, and addressed by the pointer taken when each was
//! allocated (they are only ever used on the Context's stream, so cudarc's per-use stream events
//! are not taken; a caller that reads one on another stream orders that read itself).

use std::mem::ManuallyDrop;
use std::sync::{Arc, Mutex, MutexGuard};

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DeviceRepr};

use crate::batchnorm::types::{BnPath, OwnVariant};
use crate::error::{CallExt, Result};

/// A device buffer nnfuse owns, with its address taken once, at allocation.
#[derive(Debug)]
pub(crate) struct Owned<T> {
    pub(crate) buf: CudaSlice<T>,
    pub(crate) ptr: u64,
}

impl<T: DeviceRepr> Owned<T> {
    /// `len` elements on `stream`, uninitialised.
    ///
    /// # Safety
    /// Every user writes the buffer before it reads it.
    unsafe fn alloc(stream: &Arc<CudaStream>, len: usize) -> Result<Owned<T>> {
        // SAFETY: the caller's contract.
        let buf = unsafe { stream.alloc::<T>(len) }.call("cuMemAllocAsync")?;
        let ptr = buf.device_ptr(stream).0;
        Ok(Owned { buf, ptr })
    }
}

/// Most spare buffers of one kind a BatchNorm keeps (more are freed): a network rarely holds
/// more live training states of one shape than it has layers of that shape.
pub(crate) const MAX_SPARES: usize = 64;

/// The index of the first spare of `len` elements among spares of lengths `lens` (pure).
fn position(lens: impl IntoIterator<Item = usize>, len: usize) -> Option<usize> {
    lens.into_iter().position(|l| l == len)
}

/// Buffers of a BatchNorm's earlier training states, ready for the next forward. Reused in
/// stream order: a buffer comes back when its state is dropped, after the work that read it was
/// queued on the Context's stream, and the next forward's writes are queued behind that work.
#[derive(Debug, Default)]
pub(crate) struct Spares {
    f32s: Mutex<Vec<Owned<f32>>>,
    u32s: Mutex<Vec<Owned<u32>>>,
    bytes: Mutex<Vec<Owned<u8>>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

fn take<T: DeviceRepr>(
    m: &Mutex<Vec<Owned<T>>>,
    stream: &Arc<CudaStream>,
    len: usize,
) -> Result<Owned<T>> {
    let spare = {
        let mut v = lock(m);
        position(v.iter().map(|o| o.buf.len()), len).map(|i| v.swap_remove(i))
    };
    match spare {
        Some(o) => Ok(o),
        // SAFETY: every BatchNorm buffer is written by the forward (or the backward's first
        // kernel, for a temporary) before anything reads it.
        None => unsafe { Owned::alloc(stream, len) },
    }
}

fn give<T>(m: &Mutex<Vec<Owned<T>>>, o: Owned<T>) {
    let mut v = lock(m);
    if v.len() < MAX_SPARES {
        v.push(o);
    }
}

impl Spares {
    /// `len` f32s (statistics), recycled or allocated.
    pub(crate) fn f32s(&self, stream: &Arc<CudaStream>, len: usize) -> Result<Owned<f32>> {
        take(&self.f32s, stream, len)
    }

    /// `len` u32 words (masks), recycled or allocated.
    pub(crate) fn u32s(&self, stream: &Arc<CudaStream>, len: usize) -> Result<Owned<u32>> {
        take(&self.u32s, stream, len)
    }

    /// `len` bytes (cuDNN's reserve, temporaries), recycled or allocated.
    pub(crate) fn bytes(&self, stream: &Arc<CudaStream>, len: usize) -> Result<Owned<u8>> {
        take(&self.bytes, stream, len)
    }

    /// Gives f32s back.
    pub(crate) fn give_f32s(&self, o: Owned<f32>) {
        give(&self.f32s, o)
    }

    /// Gives u32 words back.
    pub(crate) fn give_u32s(&self, o: Owned<u32>) {
        give(&self.u32s, o)
    }

    /// Gives bytes back.
    pub(crate) fn give_bytes(&self, o: Owned<u8>) {
        give(&self.bytes, o)
    }
}

/// State saved by `BatchNorm::forward_train` for the backward.
#[derive(Debug)]
pub struct BnSaved {
    pub(crate) owner: u64,
    pub(crate) path: BnPath,
    pub(crate) eps: f64,
    pub(crate) x_ptr: u64,
    /// Taken back into `spares` only in `Drop`.
    pub(crate) mean: ManuallyDrop<Owned<f32>>,
    /// Own path: the mean's remainder (`mean + mean_lo` is the mean to about 2^-48 relative),
    /// so that the backward's `x - mean` keeps its precision under a large common offset.
    pub(crate) mean_lo: Option<Owned<f32>>,
    /// Taken back into `spares` only in `Drop`.
    pub(crate) inv_var: ManuallyDrop<Owned<f32>>,
    /// cuDNN's opaque reserve space, when the Ex forward asked for one.
    pub(crate) reserve: Option<Owned<u8>>,
    /// nnfuse's bitmask of the positive outputs (fallback and own paths with an activation).
    pub(crate) mask: Option<Owned<u32>>,
    /// cuDNN's ReLU mask (`BOOLEAN`, 1 byte per element allocated) that the epilogue graph's
    /// forward wrote and its backward graph reads (graph route, path `CudnnFused`).
    pub(crate) graph_mask: Option<Owned<u8>>,
    /// Own path: the variant the forward ran.
    pub(crate) own_variant: Option<OwnVariant>,
    /// The forward's BatchNorm ran through cuDNN's graph API (the backward then tries it too,
    /// and otherwise takes the legacy call that needs no reserve space). With path
    /// `CudnnFused`: the activation ran inside the graph, which wrote `graph_mask`.
    pub(crate) graph: bool,
    /// Where the buffers go when the state is dropped.
    pub(crate) spares: Arc<Spares>,
}

impl Drop for BnSaved {
    fn drop(&mut self) {
        // SAFETY: `mean` and `inv_var` are taken once, here, and never touched afterwards.
        let (mean, inv_var) = unsafe {
            (
                ManuallyDrop::take(&mut self.mean),
                ManuallyDrop::take(&mut self.inv_var),
            )
        };
        let s = &self.spares;
        s.give_f32s(mean);
        s.give_f32s(inv_var);
        if let Some(o) = self.mean_lo.take() {
            s.give_f32s(o);
        }
        if let Some(o) = self.reserve.take() {
            s.give_bytes(o);
        }
        if let Some(o) = self.mask.take() {
            s.give_u32s(o);
        }
        if let Some(o) = self.graph_mask.take() {
            s.give_bytes(o);
        }
    }
}

/// The own path's saved state as device addresses, for a backward that reads it outside
/// [`crate::batchnorm::BatchNorm`] (the folded conv + BatchNorm backward, `block/fold_backward.rs`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct OwnParts {
    /// Saved mean and its remainder (f32 each, one per channel).
    pub mean: u64,
    pub mean_lo: u64,
    /// Saved inverse standard deviation.
    pub inv_std: u64,
    /// The ReLU's bitmask and its length in `u32` words.
    pub mask: u64,
    pub mask_words: usize,
    /// The input the forward read.
    pub x: u64,
}

impl BnSaved {
    /// The own path's state with its mask (None for another path's, or without a mask).
    pub(crate) fn own_parts(&self) -> Option<OwnParts> {
        if self.path != BnPath::Own {
            return None;
        }
        let mask = self.mask.as_ref()?;
        Some(OwnParts {
            mean: self.mean.ptr,
            mean_lo: self.mean_lo.as_ref()?.ptr,
            inv_std: self.inv_var.ptr,
            mask: mask.ptr,
            mask_words: mask.buf.len(),
            x: self.x_ptr,
        })
    }

    /// The path the forward actually took (a fused plan that cuDNN refused at run time shows
    /// `Fallback` here).
    pub fn path(&self) -> BnPath {
        self.path
    }

    /// Batch mean per channel.
    pub fn saved_mean(&self) -> &CudaSlice<f32> {
        &self.mean.buf
    }

    /// `1 / sqrt(var + eps)` per channel (biased batch variance).
    pub fn saved_inv_std(&self) -> &CudaSlice<f32> {
        &self.inv_var.buf
    }

    /// The bitmask of the fallback and own paths with an activation (`None` otherwise). Layout
    /// as [`crate::reference::activation`].
    pub fn mask(&self) -> Option<&CudaSlice<u32>> {
        self.mask.as_ref().map(|m| &m.buf)
    }

    /// On the own path, the variant the forward ran (persistent, or two-pass when the plan or the
    /// device said so); `None` on cuDNN paths.
    pub fn own_variant(&self) -> Option<OwnVariant> {
        self.own_variant
    }

    /// Bytes of cuDNN reserve space this state holds.
    pub fn reserve_bytes(&self) -> usize {
        self.reserve.as_ref().map_or(0, |r| r.buf.len())
    }

    /// Bytes of cuDNN's ReLU mask this state holds: x's element count when the activation ran
    /// inside cuDNN's graph (the mask its backward graph reads), else 0.
    #[doc(hidden)]
    pub fn graph_mask_bytes(&self) -> usize {
        self.graph_mask.as_ref().map_or(0, |m| m.buf.len())
    }

    /// Whether the forward's BatchNorm ran through cuDNN's graph API (`NNFUSE_CUDNN_API`; the
    /// plan's `cudnn_api_used`), rather than a legacy cuDNN call or nnfuse's own kernels. With
    /// [`BnSaved::path`] `CudnnFused`, its activation ran inside the graph too, which wrote
    /// cuDNN's ReLU mask (1 byte per element) for the backward graph.
    pub fn ran_graph(&self) -> bool {
        self.graph
    }

    /// The epsilon the forward used (the backward reuses it).
    pub fn eps(&self) -> f64 {
        self.eps
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spare_is_taken_only_at_its_exact_length() {
        assert_eq!(position([64, 128, 64], 64), Some(0));
        assert_eq!(position([64, 128], 128), Some(1));
        assert_eq!(position([64, 128], 32), None);
        assert_eq!(position(std::iter::empty(), 1), None);
    }
}
