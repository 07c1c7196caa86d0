//! Device addresses of a convolution's operands, already checked by the dispatcher (lengths,
//! device, aliasing): what a path function takes.

/// Device addresses of one cuDNN call's operands, by the roles cuDNN gives them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct CudnnPtrs {
    /// x (forward, filter gradient) or dx (data gradient).
    pub x: u64,
    /// w (forward, data gradient) or dw (filter gradient).
    pub w: u64,
    /// y (forward) or dy (gradients).
    pub y: u64,
}

/// Device addresses of a forward convolution's operands (checked by the dispatcher).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(dead_code)] // filled in by the convolution paths
pub(crate) struct FwdPtrs {
    /// Input, `shape.x_len()` elements.
    pub x: u64,
    /// Filter, `shape.w_len()` elements.
    pub w: u64,
    /// Output, `shape.y_len()` elements.
    pub y: u64,
}

/// Device addresses of a data-gradient convolution's operands (checked by the dispatcher).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(dead_code)] // filled in by the convolution paths
pub(crate) struct BwdDataPtrs {
    /// Output gradient, `shape.y_len()` elements.
    pub dy: u64,
    /// Filter, `shape.w_len()` elements.
    pub w: u64,
    /// Input gradient (overwritten), `shape.x_len()` elements.
    pub dx: u64,
}

/// Device addresses of a filter-gradient convolution's operands (checked by the dispatcher).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(dead_code)] // filled in by the convolution paths
pub(crate) struct BwdFilterPtrs {
    /// Input, `shape.x_len()` elements.
    pub x: u64,
    /// Output gradient, `shape.y_len()` elements.
    pub dy: u64,
    /// Filter gradient, `shape.w_len()` elements (overwritten, or added to with `accumulate`).
    pub dw: u64,
}
