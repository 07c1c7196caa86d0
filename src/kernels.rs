//! nnfuse's own CUDA sources (`kernels/*.cu`), embedded in the crate and compiled at run time
//! with NVRTC for the device's architecture. This module only compiles; loading the result into
//! a device and caching it is [`crate::Context`]'s job.

use std::ffi::{c_char, CStr, CString};

use cudarc::nvrtc::{result as nvrtc, sys as nvrtc_sys};

use crate::error::{Error, Result};

/// One embedded `.cu` file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KernelFile {
    /// The file name under `kernels/`.
    pub name: &'static str,
    /// Its CUDA C++ source.
    pub source: &'static str,
}

/// Embeds `kernels/<file>` behind the common prelude (`kernels/prelude.cuh`: the 16-bit float
/// types and conversions, since NVRTC ships without `cuda_fp16.h`).
macro_rules! kernel_file {
    ($file:literal) => {
        KernelFile {
            name: $file,
            source: concat!(
                include_str!("../kernels/prelude.cuh"),
                "\n#line 1 \"",
                $file,
                "\"\n",
                include_str!(concat!("../kernels/", $file))
            ),
        }
    };
    // A file that shares a header with other files: prelude, header, file.
    ($file:literal, $header:literal) => {
        KernelFile {
            name: $file,
            source: concat!(
                include_str!("../kernels/prelude.cuh"),
                "\n#line 1 \"",
                $header,
                "\"\n",
                include_str!(concat!("../kernels/", $header)),
                "\n#line 1 \"",
                $file,
                "\"\n",
                include_str!(concat!("../kernels/", $file))
            ),
        }
    };
}

/// Elementwise helpers: fill (poisoning outputs in tests), scaled copy.
pub const UTIL: KernelFile = kernel_file!("util.cu");

/// Bitmask ReLU / Add+ReLU forward and backward (warp-vote masks, 16-byte vector paths), and
/// the two baselines the benchmark compares them with.
pub const BITMASK: KernelFile = kernel_file!("bitmask.cu");

/// The GEMM search: pseudo-random operands and the device-side comparison of candidates.
pub const GEMM_SEARCH: KernelFile = kernel_file!("gemm_search.cu");

/// Convolution: im2col (NCHW Caffe layout, NHWC patch-contiguous layout) and col2im (gather).
pub const IM2COL: KernelFile = kernel_file!("im2col.cu");

/// Convolution: the direct kernel (any shape, f32 accumulation).
pub const CONV_DIRECT: KernelFile = kernel_file!("conv_direct.cu");

/// Convolution: Winograd F(2x2,3x3) and F(4x4,3x3) input, filter and output transforms (NHWC).
pub const WINOGRAD: KernelFile = kernel_file!("winograd.cu");

/// Convolution: the Direct batched multiply of Winograd's transform positions.
pub const WINOGRAD_GEMM: KernelFile = kernel_file!("winograd_gemm.cu");

/// BatchNorm: nnfuse's own two-pass training kernels (statistics, apply, backward reduction and
/// apply) and the one-pass inference kernel, after `kernels/batchnorm_common.cuh`.
pub const BATCHNORM: KernelFile = kernel_file!("batchnorm.cu", "batchnorm_common.cuh");

/// BatchNorm: nnfuse's own single-pass persistent (cooperative) training kernels, after
/// `kernels/batchnorm_common.cuh`.
pub const BATCHNORM_PERSISTENT: KernelFile =
    kernel_file!("batchnorm_persistent.cu", "batchnorm_common.cuh");

/// Every kernel file the crate embeds (see [`CI_ARCHS`]).
pub const ALL: &[KernelFile] = &[
    UTIL,
    BITMASK,
    GEMM_SEARCH,
    IM2COL,
    CONV_DIRECT,
    WINOGRAD,
    WINOGRAD_GEMM,
    BATCHNORM,
    BATCHNORM_PERSISTENT,
];

/// Architectures CI compiles every kernel for (A100, H100).
pub const CI_ARCHS: &[&str] = &["sm_80", "sm_90"];

/// What NVRTC produced.
#[derive(Debug, Clone)]
pub enum Image {
    /// Device code for one `sm_XY` (loaded without JIT).
    Cubin(Vec<u8>),
    /// PTX for a `compute_XY` target (JIT-compiled by the driver at load).
    Ptx(Vec<u8>),
}

impl Image {
    /// The bytes (NUL-terminated for PTX).
    pub fn bytes(&self) -> &[u8] {
        match self {
            Image::Cubin(b) | Image::Ptx(b) => b,
        }
    }
}

/// Whether the NVRTC library can be loaded (cudarc panics at the first call otherwise).
pub fn nvrtc_present() -> bool {
    // SAFETY: only tries to dlopen the library.
    unsafe { nvrtc_sys::is_culib_present() }
}

fn missing_nvrtc() -> Error {
    Error::LibraryMissing {
        lib: "nvrtc",
        hint: "libnvrtc.so.13 was not found; install NVIDIA's wheel \
               (`pip install nvidia-cuda-nvrtc==13.0.*`) or a CUDA toolkit and put the folder \
               holding libnvrtc.so.13 (e.g. site-packages/nvidia/cu13/lib) on LD_LIBRARY_PATH"
            .into(),
    }
}

/// NVRTC's version `(major, minor)`.
pub fn nvrtc_version() -> Result<(i32, i32)> {
    if !nvrtc_present() {
        return Err(missing_nvrtc());
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: two valid out-pointers.
    let r = unsafe { nvrtc_sys::nvrtcVersion(&mut major, &mut minor) };
    r.result().map_err(|e| Error::Nvrtc {
        file: "-",
        arch: "-".into(),
        status: format!("{e:?}"),
        log: "nvrtcVersion failed".into(),
    })?;
    Ok((major, minor))
}

/// The NVRTC target for compute capability `(major, minor)`: CUBIN for `sm_XY`.
pub fn arch_for(cc: (i32, i32)) -> String {
    format!("sm_{}{}", cc.0, cc.1)
}

/// Owns an `nvrtcProgram` and destroys it on every path.
struct Program(nvrtc_sys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: created by create_program, destroyed once here. A failure to destroy only
        // leaks host memory, so it is ignored rather than turned into a panic.
        let _ = unsafe { nvrtc::destroy_program(self.0) };
    }
}

fn log_of(prog: &Program) -> String {
    // SAFETY: valid program.
    match unsafe { nvrtc::get_program_log(prog.0) } {
        Ok(raw) => {
            // SAFETY: NVRTC NUL-terminates the log; an empty vector means no log.
            if raw.is_empty() {
                String::new()
            } else {
                unsafe { CStr::from_ptr(raw.as_ptr() as *const c_char) }
                    .to_string_lossy()
                    .into_owned()
            }
        }
        Err(e) => format!("(no log: {e:?})"),
    }
}

/// Compiles `file` for `arch` (`sm_XY` → CUBIN, `compute_XY` → PTX). Errors carry NVRTC's log.
pub fn compile(file: &KernelFile, arch: &str) -> Result<Image> {
    if !nvrtc_present() {
        return Err(missing_nvrtc());
    }
    let fail = |status: String, log: String| Error::Nvrtc {
        file: file.name,
        arch: arch.to_string(),
        status,
        log,
    };
    let src = CString::new(file.source)
        .map_err(|_| fail("source holds a NUL byte".into(), String::new()))?;
    let name = CString::new(file.name).map_err(|_| fail("bad name".into(), String::new()))?;
    let prog = Program(
        nvrtc::create_program(&src, Some(&name))
            .map_err(|e| fail(format!("{e:?}"), String::new()))?,
    );
    let opts = [
        format!("--gpu-architecture={arch}"),
        "--std=c++17".to_string(),
        // Exact division/sqrt (no fast math): these kernels are memory-bound, precision is free.
        "--prec-div=true".to_string(),
        "--prec-sqrt=true".to_string(),
        "-default-device".to_string(),
    ];
    // SAFETY: valid program; options are plain strings.
    if let Err(e) = unsafe { nvrtc::compile_program(prog.0, &opts) } {
        return Err(fail(format!("{e:?}"), log_of(&prog)));
    }
    let image = if arch.starts_with("sm_") {
        let mut size = 0usize;
        // SAFETY: valid compiled program and out-pointer.
        unsafe { nvrtc_sys::nvrtcGetCUBINSize(prog.0, &mut size) }
            .result()
            .map_err(|e| fail(format!("nvrtcGetCUBINSize: {e:?}"), String::new()))?;
        let mut buf = vec![0u8; size];
        // SAFETY: buf holds `size` bytes.
        unsafe { nvrtc_sys::nvrtcGetCUBIN(prog.0, buf.as_mut_ptr() as *mut c_char) }
            .result()
            .map_err(|e| fail(format!("nvrtcGetCUBIN: {e:?}"), String::new()))?;
        Image::Cubin(buf)
    } else {
        // SAFETY: valid compiled program.
        let ptx = unsafe { nvrtc::get_ptx(prog.0) }
            .map_err(|e| fail(format!("nvrtcGetPTX: {e:?}"), String::new()))?;
        Image::Ptx(ptx.into_iter().map(|c| c as u8).collect())
    };
    tracing::debug!(
        file = file.name,
        arch,
        bytes = image.bytes().len(),
        "compiled kernel file"
    );
    Ok(image)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arch_names() {
        assert_eq!(arch_for((9, 0)), "sm_90");
        assert_eq!(arch_for((8, 6)), "sm_86");
    }

    #[test]
    fn every_file_is_registered_once() {
        let mut names: Vec<_> = ALL.iter().map(|f| f.name).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), ALL.len());
        // Every kernels/*.cu on disk is embedded (a new file must be added to ALL).
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels");
        for entry in std::fs::read_dir(dir).unwrap() {
            let p = entry.unwrap().path();
            if p.extension().is_some_and(|e| e == "cu") {
                let n = p.file_name().unwrap().to_str().unwrap().to_string();
                assert!(names.contains(&n.as_str()), "{n} is not in kernels::ALL");
            }
        }
    }
}
