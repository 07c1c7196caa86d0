//! The one error type of the library.
//!
//! Every CUDA driver, NVRTC, cuDNN, cuBLAS and cuBLASLt status that is not success becomes an
//! [`Error`] naming the call that returned it; every rejected user argument becomes
//! [`Error::InvalidArgument`] naming the argument. Nothing in the library panics on user input.

use std::fmt;

/// Result alias used throughout nnfuse.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in nnfuse.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A caller's argument is wrong; nothing was launched.
    #[error("invalid argument `{arg}`: {reason}")]
    InvalidArgument {
        /// The argument's name as the API spells it (e.g. `running_mean`, `shape[2]`).
        arg: String,
        /// What is wrong with it.
        reason: String,
    },

    /// An environment variable (or config value) could not be parsed.
    #[error("environment variable {var}={value:?}: {reason}")]
    Config {
        /// The variable's name.
        var: String,
        /// The value found.
        value: String,
        /// What would have been accepted.
        reason: String,
    },

    /// A CUDA shared library could not be loaded.
    #[error("the CUDA library `{lib}` could not be loaded: {hint}")]
    LibraryMissing {
        /// Short name (`cuda`, `nvrtc`, `cudnn`, `cublas`, `cublasLt`).
        lib: &'static str,
        /// How to make it findable.
        hint: String,
    },

    /// No usable CUDA device.
    #[error("no CUDA device: {0}")]
    NoDevice(String),

    /// A CUDA driver call failed.
    #[error("CUDA driver call {call} failed: {status}")]
    Driver {
        /// The call's name.
        call: &'static str,
        /// The driver status, as cudarc prints it.
        status: String,
    },

    /// NVRTC failed to compile one of nnfuse's kernels.
    #[error("NVRTC failed to compile kernel file {file} for {arch}: {status}\n{log}")]
    Nvrtc {
        /// The `kernels/*.cu` file.
        file: &'static str,
        /// The target architecture (`sm_90`, `compute_80`, ...).
        arch: String,
        /// The NVRTC status.
        status: String,
        /// The compiler log.
        log: String,
    },

    /// A cuDNN call failed.
    #[error("cuDNN call {call} failed: {status}")]
    Cudnn {
        /// The call's name.
        call: &'static str,
        /// The cuDNN status.
        status: CudnnStatus,
    },

    /// A cuBLAS or cuBLASLt call failed.
    #[error("cuBLAS call {call} failed: {status}")]
    Cublas {
        /// The call's name.
        call: &'static str,
        /// The status, as cudarc prints it.
        status: String,
    },

    /// The requested operation is not supported by this device, library version or
    /// combination of arguments.
    #[error("not supported: {0}")]
    NotSupported(String),

    /// A call would have broken the CUDA-graph capture running on the Context's stream (it
    /// needed an allocation, a synchronisation, a measurement, a kernel compilation or another
    /// call a capture cannot hold): it queued nothing, and the capture can go on or be ended.
    /// See `docs/CAPTURE.md`.
    #[error("{what} is not capture-safe now: {why}")]
    Capture {
        /// The operation refused (e.g. `the first call of a convolution direction`).
        what: &'static str,
        /// What it would have needed, and how to make it capture-safe.
        why: String,
    },

    /// File input/output (tuning cache).
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
}

/// A cuDNN status, kept as the raw enum so callers can tell `NOT_SUPPORTED` from a real failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CudnnStatus(pub cudarc::cudnn::sys::cudnnStatus_t);

impl CudnnStatus {
    /// Whether this is `CUDNN_STATUS_NOT_SUPPORTED` (3000) or one of its sub-codes (3xxx).
    pub fn is_not_supported(self) -> bool {
        let code = self.0 as u32;
        (3000..4000).contains(&code)
    }
}

impl fmt::Display for CudnnStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?} ({})", self.0, self.0 as u32)
    }
}

impl Error {
    /// Shorthand for [`Error::InvalidArgument`].
    pub fn invalid(arg: impl Into<String>, reason: impl Into<String>) -> Self {
        Error::InvalidArgument {
            arg: arg.into(),
            reason: reason.into(),
        }
    }

    /// Whether this is a cuDNN `NOT_SUPPORTED` status (the caller may fall back).
    pub fn is_cudnn_not_supported(&self) -> bool {
        matches!(self, Error::Cudnn { status, .. } if status.is_not_supported())
    }

    /// Whether this is [`Error::Capture`]: a call refused under CUDA-graph capture.
    pub(crate) fn is_capture(&self) -> bool {
        matches!(self, Error::Capture { .. })
    }

    /// The name of the offending argument, for [`Error::InvalidArgument`].
    pub fn argument(&self) -> Option<&str> {
        match self {
            Error::InvalidArgument { arg, .. } => Some(arg),
            _ => None,
        }
    }
}

/// Maps a status-returning result to [`Error`] naming the call.
pub(crate) trait CallExt<T> {
    /// Attach the call's name.
    fn call(self, call: &'static str) -> Result<T>;
}

/// A cudarc error type and how it becomes an [`Error`] naming the call.
trait Status {
    fn into_error(self, call: &'static str) -> Error;
}

impl Status for cudarc::driver::DriverError {
    fn into_error(self, call: &'static str) -> Error {
        Error::Driver {
            call,
            status: format!("{self:?}"),
        }
    }
}

impl Status for cudarc::cudnn::CudnnError {
    fn into_error(self, call: &'static str) -> Error {
        Error::Cudnn {
            call,
            status: CudnnStatus(self.0),
        }
    }
}

impl Status for cudarc::cublas::result::CublasError {
    fn into_error(self, call: &'static str) -> Error {
        Error::Cublas {
            call,
            status: format!("{self:?}"),
        }
    }
}

impl Status for cudarc::cublaslt::result::CublasError {
    fn into_error(self, call: &'static str) -> Error {
        Error::Cublas {
            call,
            status: format!("{self:?}"),
        }
    }
}

impl<T, E: Status> CallExt<T> for std::result::Result<T, E> {
    fn call(self, call: &'static str) -> Result<T> {
        self.map_err(|e| e.into_error(call))
    }
}

/// The name [`Error`] gives a failed call that the caller made through cudarc itself (an
/// allocation, a copy, a handle): nnfuse knows its library, not the function.
const CUDARC_CALL: &str = "cudarc";

/// `?` on a cudarc driver call (e.g. `stream.alloc_zeros`) in a function returning
/// [`Result`]; the call is named `cudarc`.
impl From<cudarc::driver::DriverError> for Error {
    fn from(e: cudarc::driver::DriverError) -> Self {
        e.into_error(CUDARC_CALL)
    }
}

/// `?` on a cudarc cuDNN call; the raw status is kept ([`Error::is_cudnn_not_supported`]).
impl From<cudarc::cudnn::CudnnError> for Error {
    fn from(e: cudarc::cudnn::CudnnError) -> Self {
        e.into_error(CUDARC_CALL)
    }
}

/// `?` on a cudarc cuBLAS call.
impl From<cudarc::cublas::result::CublasError> for Error {
    fn from(e: cudarc::cublas::result::CublasError) -> Self {
        e.into_error(CUDARC_CALL)
    }
}

/// `?` on a cudarc cuBLASLt call.
impl From<cudarc::cublaslt::result::CublasError> for Error {
    fn from(e: cudarc::cublaslt::result::CublasError) -> Self {
        e.into_error("cudarc (cuBLASLt)")
    }
}

/// `?` on a cudarc NVRTC call (`cudarc::nvrtc::result`).
impl From<cudarc::nvrtc::result::NvrtcError> for Error {
    fn from(e: cudarc::nvrtc::result::NvrtcError) -> Self {
        Error::Nvrtc {
            file: CUDARC_PROGRAM,
            arch: "(the caller's options)".into(),
            status: format!("{e:?}"),
            log: String::new(),
        }
    }
}

/// `?` on `cudarc::nvrtc::compile_ptx` and its kin: the compiler log is kept.
impl From<cudarc::nvrtc::CompileError> for Error {
    fn from(e: cudarc::nvrtc::CompileError) -> Self {
        use cudarc::nvrtc::CompileError as C;
        let (status, options, log) = match e {
            C::CompileError {
                nvrtc,
                options,
                log,
            } => (nvrtc, options.join(" "), log.to_string_lossy().into_owned()),
            C::CreationError(s) | C::GetLogError(s) | C::GetPtxError(s) | C::DestroyError(s) => {
                (s, String::new(), String::new())
            }
        };
        Error::Nvrtc {
            file: CUDARC_PROGRAM,
            arch: if options.is_empty() {
                "(the caller's options)".into()
            } else {
                options
            },
            status: format!("{status:?}"),
            log,
        }
    }
}

/// What [`Error::Nvrtc`] names as the file of a program the caller compiled through cudarc.
const CUDARC_PROGRAM: &str = "(a program compiled through cudarc)";

/// Checks a raw cuDNN status.
#[allow(dead_code)] // used by the BatchNorm module
pub(crate) fn cudnn_check(
    status: cudarc::cudnn::sys::cudnnStatus_t,
    call: &'static str,
) -> Result<()> {
    status.result().call(call)
}

#[cfg(test)]
mod tests {
    use super::*;
    use cudarc::cudnn::sys::cudnnStatus_t;

    #[test]
    fn not_supported_is_recognised() {
        let e = cudnn_check(cudnnStatus_t::CUDNN_STATUS_NOT_SUPPORTED, "cudnnX").unwrap_err();
        assert!(e.is_cudnn_not_supported());
        assert!(e.to_string().contains("cudnnX"));
        let e = cudnn_check(cudnnStatus_t::CUDNN_STATUS_BAD_PARAM, "cudnnY").unwrap_err();
        assert!(!e.is_cudnn_not_supported());
        assert!(cudnn_check(cudnnStatus_t::CUDNN_STATUS_SUCCESS, "cudnnZ").is_ok());
    }

    /// A framework author's function: `?` on cudarc's own calls works in an nnfuse::Result.
    fn callers_function(
        alloc: std::result::Result<(), cudarc::driver::DriverError>,
        blas: std::result::Result<(), cudarc::cublas::result::CublasError>,
        dnn: std::result::Result<(), cudarc::cudnn::CudnnError>,
    ) -> Result<()> {
        alloc?;
        blas?;
        dnn?;
        Ok(())
    }

    #[test]
    fn question_mark_works_on_cudarc_errors_and_names_cudarc() {
        // Printing a DriverError asks the driver for its message: only where there is one
        // (a DriverError only ever comes from a driver call).
        if crate::context::driver_present() {
            use cudarc::driver::sys::CUresult;
            let oom = cudarc::driver::DriverError(CUresult::CUDA_ERROR_OUT_OF_MEMORY);
            let e = callers_function(Err(oom), Ok(()), Ok(())).unwrap_err();
            assert!(matches!(e, Error::Driver { call: "cudarc", .. }), "{e:?}");
            assert!(e.to_string().contains("CUDA_ERROR_OUT_OF_MEMORY"), "{e}");
        }
        let blas = cudarc::cublas::result::CublasError(
            cudarc::cublas::sys::cublasStatus_t::CUBLAS_STATUS_ALLOC_FAILED,
        );
        let e = callers_function(Ok(()), Err(blas), Ok(())).unwrap_err();
        assert!(matches!(e, Error::Cublas { call: "cudarc", .. }), "{e:?}");
        let dnn = cudarc::cudnn::CudnnError(cudnnStatus_t::CUDNN_STATUS_NOT_SUPPORTED);
        let e = callers_function(Ok(()), Ok(()), Err(dnn)).unwrap_err();
        assert!(e.is_cudnn_not_supported(), "{e:?}");
        let lt = cudarc::cublaslt::result::CublasError(
            cudarc::cublaslt::sys::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED,
        );
        assert!(Error::from(lt).to_string().contains("cudarc"));
        let nvrtc = cudarc::nvrtc::result::NvrtcError(
            cudarc::nvrtc::sys::nvrtcResult::NVRTC_ERROR_COMPILATION,
        );
        assert!(Error::from(nvrtc)
            .to_string()
            .contains("NVRTC_ERROR_COMPILATION"));
    }

    #[test]
    fn invalid_names_the_argument() {
        let e = Error::invalid("gamma", "length 3, expected 4");
        assert_eq!(e.argument(), Some("gamma"));
        assert_eq!(
            e.to_string(),
            "invalid argument `gamma`: length 3, expected 4"
        );
    }
}
