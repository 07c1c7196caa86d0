//! What both graph plans ([`super::graph_conv::GraphConv`], [`super::graph_bn::GraphBn`])
//! share: the per-Context plan cache (a plan, or why cuDNN cannot build one, remembered so
//! that a caller's fallback does not pay a rebuild every call) and the start of every
//! execution (the plan's own cuDNN handle, the workspace, the pinned pack's lock).

use std::hash::Hash;
use std::sync::{Arc, Mutex, MutexGuard};

use cudarc::cudnn::sys;
use cudarc::driver::sys::CUdeviceptr;

use crate::context::{Context, Locked};
use crate::error::{Error, Result};

/// The plan cache's value: the plan, or why cuDNN cannot build one.
pub(super) struct Slot<P>(pub(super) std::result::Result<Arc<P>, String>);

/// Whether a build failure means "cuDNN cannot do this problem" (cached, so that the caller's
/// fallback is not slowed down by a rebuild every call) rather than a transient or a bug.
pub fn is_unsupported(e: &Error) -> bool {
    matches!(e, Error::NotSupported(_)) || e.is_cudnn_not_supported()
}

/// The plan of `key` from the Context's plan cache, made by `build` on first use. A key cuDNN
/// cannot run is remembered too (`remembered` told why): later lookups return the same
/// [`Error::NotSupported`] at once. `hit` runs when the cache already held the key.
pub(super) fn cached<K, P>(
    ctx: &Context,
    key: K,
    build: impl FnOnce() -> Result<P>,
    remembered: impl FnOnce(&Error),
    hit: impl FnOnce(),
) -> Result<Arc<P>>
where
    K: Clone + Hash + Eq + Send + Sync + 'static,
    P: Send + Sync + 'static,
{
    let mut built = false;
    let slot = ctx.memo(key, || {
        built = true;
        match build() {
            Ok(p) => Ok(Arc::new(Slot(Ok(Arc::new(p))))),
            Err(e) if is_unsupported(&e) => {
                remembered(&e);
                Ok(Arc::new(Slot(Err(e.to_string()))))
            }
            Err(e) => Err(e),
        }
    })?;
    if !built {
        hit();
    }
    match &slot.0 {
        Ok(p) => Ok(p.clone()),
        Err(why) => Err(Error::NotSupported(why.clone())),
    }
}

/// The locked Context's cuDNN handle, refused unless it is `built_on` (the handle the plan
/// was built on: executions must use the same one), and a workspace of `bytes`.
pub(super) fn handle_and_workspace(
    g: &mut Locked<'_>,
    built_on: usize,
    bytes: usize,
) -> Result<(sys::cudnnHandle_t, CUdeviceptr)> {
    let handle = g.cudnn()?;
    if handle as usize != built_on {
        return Err(Error::invalid(
            "ctx",
            "this plan was built on another Context's cuDNN handle",
        ));
    }
    Ok((handle, g.workspace(bytes)?))
}

/// A plan's pinned pack, locked (a poisoned lock still holds a pack that is rebuilt or
/// matched before use).
pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::CudnnStatus;

    #[test]
    fn unsupported_errors_are_the_cacheable_ones() {
        assert!(is_unsupported(&Error::NotSupported("x".into())));
        assert!(is_unsupported(&Error::Cudnn {
            call: "c",
            status: CudnnStatus(sys::cudnnStatus_t::CUDNN_STATUS_NOT_SUPPORTED),
        }));
        assert!(is_unsupported(&Error::Cudnn {
            call: "c",
            status: CudnnStatus(sys::cudnnStatus_t::CUDNN_STATUS_NOT_SUPPORTED_SHAPE),
        }));
        assert!(!is_unsupported(&Error::Cudnn {
            call: "c",
            status: CudnnStatus(sys::cudnnStatus_t::CUDNN_STATUS_BAD_PARAM),
        }));
        assert!(!is_unsupported(&Error::invalid("x", "y")));
    }
}
