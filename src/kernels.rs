//! nnfuse's own CUDA sources (`kernels/*.cu`), embedded in the crate and compiled at run time
//! with NVRTC for the device's architecture, and the disk cache of the compiled images. This
//! module compiles and reads/writes image files; loading an image into a device and caching it
//! in memory is [`crate::Context`]'s job.
//!
//! # Disk cache
//! NVRTC takes a few hundred milliseconds per file, paid by every fresh process at its first use
//! of the file (the first GEMM search compiles `gemm_search.cu`, for instance). With a cache
//! directory ([`crate::Config::kernel_cache_dir`]: [`crate::Config::kernel_cache`], else the
//! user's cache directory's `nnfuse` folder when [`crate::Config::tuning_cache`] is set, else
//! none) the images are kept on disk and a later process reads them instead
//! ([`load_or_compile`]). nnfuse runs what it reads there, so the folder is trusted only when
//! no other user can write it:
//!
//! - The folder is created with mode 0700 and its files with 0600; a folder or file another
//!   user owns or may write (or a parent folder that lets another user replace it) is refused
//!   with a `tracing` warning, and the image is compiled in memory.
//! - One file per image, named by its key ([`ImageKey`]): the kernel file, the architecture,
//!   NVRTC's version and a SHA-256 of the embedded source, the compile options, the NVRTC
//!   version, the architecture and the format version. A new nnfuse version or NVRTC version
//!   therefore never reads an old image; old files are simply no longer used (delete the folder
//!   at any time).
//! - Each file starts with a one-line text header repeating the key, the payload's length and
//!   its SHA-256; a file whose header, length or checksum does not match (truncated, corrupt,
//!   foreign) is ignored with a `tracing` warning and replaced by a fresh compile. The
//!   checksum catches damage, not an attacker (who could recompute it): the folder's ownership
//!   and mode are what keep others out.
//! - A file is opened without following a symlink or blocking on a FIFO, must be a regular
//!   file of at most 64 MiB, and its image must pass [`check_image`] (`cuModuleLoadData` takes
//!   no length: ELF tables and contents must lie within the bytes, PTX must end in its NUL).
//! - Writes are atomic (a new, randomly named file created with `O_EXCL` in the same folder,
//!   then a rename), so concurrent processes never read half a file and a planted symlink is
//!   never followed. Any failure to read or write the cache is a warning, never an error: the
//!   compile result is used either way.

use std::ffi::{c_char, CStr, CString};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use cudarc::nvrtc::{result as nvrtc, sys as nvrtc_sys};
use sha2::{Digest, Sha256};

use crate::cache_fs;
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
    // A file that shares headers with other files: prelude, the headers in order, file.
    ($file:literal, $($header:literal),+) => {
        KernelFile {
            name: $file,
            source: concat!(
                include_str!("../kernels/prelude.cuh"),
                $(
                    "\n#line 1 \"",
                    $header,
                    "\"\n",
                    include_str!(concat!("../kernels/", $header)),
                )+
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

/// Convolution: the fused Winograd forward (input transform, tensor-core products, output
/// transform in one kernel; f16/bf16, sm_80+).
pub const WINOGRAD_FUSED: KernelFile = kernel_file!("winograd_fused.cu");

/// BatchNorm: nnfuse's own two-pass training kernels (statistics, apply, backward reduction and
/// apply) and the one-pass inference kernel, after `kernels/common.cuh` and
/// `kernels/batchnorm_common.cuh`.
pub const BATCHNORM: KernelFile =
    kernel_file!("batchnorm.cu", "common.cuh", "batchnorm_common.cuh");

/// BatchNorm: nnfuse's own single-pass persistent (cooperative) training kernels, after
/// `kernels/common.cuh` and `kernels/batchnorm_common.cuh`.
pub const BATCHNORM_PERSISTENT: KernelFile = kernel_file!(
    "batchnorm_persistent.cu",
    "common.cuh",
    "batchnorm_common.cuh"
);

/// Convolution: the dispatcher's numerical check (candidate against reference, reference
/// statistics, widening to f32).
pub const CONV_CHECK: KernelFile = kernel_file!("conv_check.cu");

/// GPU-only timing: the head start that holds the stream while the host queues a sample.
pub const TIMING: KernelFile = kernel_file!("timing.cu");

/// Every kernel file the crate embeds (see [`CI_ARCHS`]).
pub const ALL: &[KernelFile] = &[
    UTIL,
    BITMASK,
    GEMM_SEARCH,
    IM2COL,
    CONV_DIRECT,
    WINOGRAD,
    WINOGRAD_GEMM,
    WINOGRAD_FUSED,
    BATCHNORM,
    CONV_CHECK,
    BATCHNORM_PERSISTENT,
    TIMING,
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

/// The NVRTC options of every compile (part of the disk cache's key).
pub fn compile_options(arch: &str) -> Vec<String> {
    vec![
        format!("--gpu-architecture={arch}"),
        "--std=c++17".to_string(),
        // Exact division/sqrt (no fast math): these kernels are memory-bound, precision is free.
        "--prec-div=true".to_string(),
        "--prec-sqrt=true".to_string(),
        "-default-device".to_string(),
    ]
}

/// Compiles `file` for `arch` (`sm_XY` → CUBIN, `compute_XY` → PTX). Errors carry NVRTC's log.
/// Always compiles; [`load_or_compile`] consults the disk cache first.
pub fn compile(file: &KernelFile, arch: &str) -> Result<Image> {
    let t = Instant::now();
    let r = compile_uncounted(file, arch);
    if r.is_ok() {
        STATS.compiled.fetch_add(1, Ordering::Relaxed);
        STATS.compile_ns.fetch_add(nanos(t), Ordering::Relaxed);
    }
    r
}

fn compile_uncounted(file: &KernelFile, arch: &str) -> Result<Image> {
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
    let opts = compile_options(arch);
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

// ---------------------------------------------------------------------------------------------
// Disk cache of compiled images.

/// Format version of the image files (part of every key: a change makes old files unused).
pub const DISK_FORMAT_VERSION: u32 = 1;

/// First word of every image file.
const MAGIC: &str = "nnfuse-kernel-image";

/// Where an image came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ImageOrigin {
    /// Compiled by NVRTC in this call (no disk cache, no file yet, or an unusable file).
    Compiled,
    /// Read from the disk cache.
    Disk,
}

/// SHA-256 over length-prefixed fields, so that fields cannot run into each other ("ab" + "c"
/// differs from "a" + "bc").
struct Fields(Sha256);

impl Fields {
    fn new() -> Self {
        Fields(Sha256::new())
    }
    fn field(mut self, b: &[u8]) -> Self {
        self.0.update((b.len() as u64).to_le_bytes());
        self.0.update(b);
        self
    }
    fn finish(self) -> [u8; 32] {
        self.0.finalize().into()
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn sha256_hex(b: &[u8]) -> String {
    hex(&Sha256::digest(b))
}

/// What identifies one compiled image in the disk cache.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageKey {
    /// The kernel file (`util.cu`).
    pub file: &'static str,
    /// The target (`sm_90`, `compute_90`).
    pub arch: String,
    /// NVRTC's version.
    pub nvrtc: (i32, i32),
    /// SHA-256 of [`DISK_FORMAT_VERSION`], the NVRTC version, the architecture, the file name,
    /// the embedded source (prelude included) and the compile options, each field preceded by
    /// its length (little-endian `u64`); integers as little-endian bytes.
    pub hash: [u8; 32],
}

impl ImageKey {
    /// The key of `file` compiled for `arch` by NVRTC `nvrtc`.
    pub fn with_version(file: &KernelFile, arch: &str, nvrtc: (i32, i32)) -> ImageKey {
        let mut h = Fields::new()
            .field(&DISK_FORMAT_VERSION.to_le_bytes())
            .field(&nvrtc.0.to_le_bytes())
            .field(&nvrtc.1.to_le_bytes())
            .field(arch.as_bytes())
            .field(file.name.as_bytes())
            .field(file.source.as_bytes());
        for o in compile_options(arch) {
            h = h.field(o.as_bytes());
        }
        ImageKey {
            file: file.name,
            arch: arch.to_string(),
            nvrtc,
            hash: h.finish(),
        }
    }

    /// The key of `file` for `arch` with the loaded NVRTC's version.
    pub fn new(file: &KernelFile, arch: &str) -> Result<ImageKey> {
        Ok(Self::with_version(file, arch, nvrtc_version()?))
    }

    fn kind(&self) -> &'static str {
        if self.arch.starts_with("sm_") {
            "cubin"
        } else {
            "ptx"
        }
    }

    /// The image's file name in the cache folder:
    /// `util.sm_90.nvrtc13.0.<64 hex digits of the key>.cubin`.
    pub fn file_name(&self) -> String {
        let stem = self.file.strip_suffix(".cu").unwrap_or(self.file);
        format!(
            "{stem}.{}.nvrtc{}.{}.{}.{}",
            self.arch,
            self.nvrtc.0,
            self.nvrtc.1,
            hex(&self.hash),
            self.kind()
        )
    }

    /// The header line without the payload's length and checksum.
    fn header_prefix(&self) -> String {
        format!(
            "{MAGIC} {DISK_FORMAT_VERSION} file={} arch={} nvrtc={}.{} kind={} key={}",
            self.file,
            self.arch,
            self.nvrtc.0,
            self.nvrtc.1,
            self.kind(),
            hex(&self.hash)
        )
    }

    /// The whole file for `payload`: header line (with the payload's length and SHA-256), then
    /// the image bytes.
    pub fn encode(&self, payload: &[u8]) -> Vec<u8> {
        let header = format!(
            "{} bytes={} sha256={}\n",
            self.header_prefix(),
            payload.len(),
            sha256_hex(payload)
        );
        let mut out = Vec::with_capacity(header.len() + payload.len());
        out.extend_from_slice(header.as_bytes());
        out.extend_from_slice(payload);
        out
    }

    /// The image in `bytes` (a whole file), or why it cannot be used: the header must describe
    /// this key, the payload's length and SHA-256 must match the header, and the payload must
    /// pass [`check_image`].
    pub fn decode(&self, bytes: &[u8]) -> std::result::Result<Image, String> {
        let nl = bytes
            .iter()
            .take(1024)
            .position(|&b| b == b'\n')
            .ok_or("no header line")?;
        let header = std::str::from_utf8(&bytes[..nl]).map_err(|_| "header is not text")?;
        let payload = &bytes[nl + 1..];
        let prefix = self.header_prefix();
        let rest = header
            .strip_prefix(prefix.as_str())
            .ok_or_else(|| format!("header {header:?} does not describe {prefix:?}"))?;
        let want = format!(" bytes={} sha256={}", payload.len(), sha256_hex(payload));
        if rest != want {
            return Err(format!(
                "payload does not match its header (header says{rest}, file holds{want})"
            ));
        }
        let image = match self.kind() {
            "cubin" => Image::Cubin(payload.to_vec()),
            _ => Image::Ptx(payload.to_vec()),
        };
        check_image(&image)?;
        Ok(image)
    }
}

/// Reads a little-endian integer of `N` bytes at `at`, if the bytes are there.
fn le<const N: usize>(b: &[u8], at: usize) -> Option<u64> {
    let s: [u8; N] = b.get(at..at.checked_add(N)?)?.try_into().ok()?;
    let mut v = [0u8; 8];
    v[..N].copy_from_slice(&s);
    Some(u64::from_le_bytes(v))
}

/// Whether `count` records of `size` bytes from `offset` lie within `len` bytes.
fn table_fits(offset: u64, size: u64, count: u64, len: usize) -> bool {
    size.checked_mul(count)
        .and_then(|n| n.checked_add(offset))
        .is_some_and(|end| end <= len as u64)
}

/// Checks a 64-bit little-endian ELF image (what NVRTC emits) against its own header: the
/// header, the program and section header tables, and every segment's and section's bytes lie
/// within the image. `cuModuleLoadData` takes no length, so it trusts these offsets.
fn check_elf(b: &[u8]) -> std::result::Result<(), String> {
    const EHDR: usize = 64;
    if b.len() < EHDR || !b.starts_with(b"\x7fELF") {
        return Err("payload is not an ELF image".into());
    }
    if b[4] != 2 || b[5] != 1 {
        return Err("payload is not a 64-bit little-endian ELF image".into());
    }
    let bad = |what: &str| format!("ELF {what} lies outside the {}-byte image", b.len());
    let field = |at: usize, n: usize| match n {
        2 => le::<2>(b, at),
        _ => le::<8>(b, at),
    };
    let (phoff, shoff) = (field(0x20, 8), field(0x28, 8));
    let (ehsize, phentsize, phnum) = (field(0x34, 2), field(0x36, 2), field(0x38, 2));
    let (shentsize, shnum) = (field(0x3a, 2), field(0x3c, 2));
    let (
        Some(phoff),
        Some(shoff),
        Some(ehsize),
        Some(phentsize),
        Some(phnum),
        Some(shentsize),
        Some(shnum),
    ) = (phoff, shoff, ehsize, phentsize, phnum, shentsize, shnum)
    else {
        return Err(bad("header"));
    };
    if ehsize as usize > b.len() {
        return Err(bad("header"));
    }
    if phnum > 0 && (phentsize < 0x38 || !table_fits(phoff, phentsize, phnum, b.len())) {
        return Err(bad("program header table"));
    }
    if shnum > 0 && (shentsize < 0x40 || !table_fits(shoff, shentsize, shnum, b.len())) {
        return Err(bad("section header table"));
    }
    for i in 0..phnum {
        let at = (phoff + i * phentsize) as usize;
        let (off, filesz) = (le::<8>(b, at + 0x08), le::<8>(b, at + 0x20));
        if !matches!((off, filesz), (Some(o), Some(n)) if table_fits(o, n, 1, b.len())) {
            return Err(bad(&format!("segment {i}")));
        }
    }
    const SHT_NOBITS: u64 = 8;
    for i in 0..shnum {
        let at = (shoff + i * shentsize) as usize;
        if le::<4>(b, at + 0x04) == Some(SHT_NOBITS) {
            continue;
        }
        let (off, size) = (le::<8>(b, at + 0x18), le::<8>(b, at + 0x20));
        if !matches!((off, size), (Some(o), Some(n)) if table_fits(o, n, 1, b.len())) {
            return Err(bad(&format!("section {i}")));
        }
    }
    Ok(())
}

/// Whether `image` is safe to hand to `cuModuleLoadData` (which takes no length): a CUBIN's
/// ELF tables and contents lie within its bytes; PTX is text ending in its only NUL byte.
pub fn check_image(image: &Image) -> std::result::Result<(), String> {
    match image {
        Image::Cubin(b) => check_elf(b),
        Image::Ptx(b) => match b.iter().position(|&c| c == 0) {
            Some(i) if i + 1 == b.len() => Ok(()),
            Some(i) => Err(format!("PTX holds a NUL byte at {i}, before its end")),
            None => Err("PTX is not NUL-terminated".into()),
        },
    }
}

/// Process-wide counters of compiles and disk-cache use ([`stats`]).
struct Counters {
    compiled: AtomicU64,
    compile_ns: AtomicU64,
    disk_hits: AtomicU64,
    disk_read_ns: AtomicU64,
    disk_rejected: AtomicU64,
    disk_writes: AtomicU64,
    disk_write_failures: AtomicU64,
}

static STATS: Counters = Counters {
    compiled: AtomicU64::new(0),
    compile_ns: AtomicU64::new(0),
    disk_hits: AtomicU64::new(0),
    disk_read_ns: AtomicU64::new(0),
    disk_rejected: AtomicU64::new(0),
    disk_writes: AtomicU64::new(0),
    disk_write_failures: AtomicU64::new(0),
};

fn nanos(t: Instant) -> u64 {
    u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX)
}

/// What this process compiled and read from the disk cache so far.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct KernelCacheStats {
    /// Files NVRTC compiled.
    pub compiled: u64,
    /// Milliseconds spent in those compiles.
    pub compile_ms: f64,
    /// Images read from the disk cache.
    pub disk_hits: u64,
    /// Milliseconds spent reading (and checking) them.
    pub disk_read_ms: f64,
    /// Cache files ignored as unusable (corrupt, truncated, foreign, unreadable).
    pub disk_rejected: u64,
    /// Images written to the disk cache.
    pub disk_writes: u64,
    /// Images that could not be written (a warning each).
    pub disk_write_failures: u64,
}

/// The process's compile and disk-cache counters (for startup measurements and tests).
pub fn stats() -> KernelCacheStats {
    let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
    KernelCacheStats {
        compiled: g(&STATS.compiled),
        compile_ms: g(&STATS.compile_ns) as f64 / 1e6,
        disk_hits: g(&STATS.disk_hits),
        disk_read_ms: g(&STATS.disk_read_ns) as f64 / 1e6,
        disk_rejected: g(&STATS.disk_rejected),
        disk_writes: g(&STATS.disk_writes),
        disk_write_failures: g(&STATS.disk_write_failures),
    }
}

/// Reads the image of `key` from `dir`: `Ok(None)` when there is no file, `Err(reason)` when
/// there is one that cannot be used. The folder and the file must be this user's and writable
/// by nobody else (`cache_fs::private_dir`); the file is opened without following a
/// symlink or blocking on a FIFO, must be a regular file of at most 64 MiB, and must decode
/// ([`ImageKey::decode`]).
pub fn read_cached(dir: &Path, key: &ImageKey) -> std::result::Result<Option<Image>, String> {
    match std::fs::symlink_metadata(dir) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        _ => cache_fs::private_dir(dir, false).map_err(|e| format!("folder refused: {e}"))?,
    }
    let path = dir.join(key.file_name());
    let (file, meta) = match cache_fs::open_regular(&path, true) {
        Ok(Some(f)) => f,
        Ok(None) => return Ok(None),
        Err(e) => return Err(format!("cannot be read: {e}")),
    };
    cache_fs::check_private(&meta, "the file")?;
    let bytes = cache_fs::read_capped(file).map_err(|e| format!("cannot be read: {e}"))?;
    key.decode(&bytes).map(Some)
}

/// Writes `image` for `key` into `dir` (created with mode 0700 if missing; refused when another
/// user could write it), atomically: a new, randomly named file in the same folder (mode 0600),
/// flushed, then renamed over the final name. Returns the file's path.
pub fn write_cached(dir: &Path, key: &ImageKey, image: &Image) -> std::io::Result<PathBuf> {
    let refused = |why: String| std::io::Error::new(std::io::ErrorKind::PermissionDenied, why);
    cache_fs::private_dir(dir, true).map_err(|e| refused(format!("folder refused: {e}")))?;
    check_image(image).map_err(|e| refused(format!("image refused: {e}")))?;
    let path = dir.join(key.file_name());
    cache_fs::write_atomic(&path, &key.encode(image.bytes()), 0o600)?;
    Ok(path)
}

/// The image of `file` for `arch`: read from the disk cache in `dir` when it holds a usable one,
/// else compiled (and then written there). Only a compile error is an error: every problem with
/// the cache (a folder another user could write, an unreadable or corrupt file, an unwritable
/// folder) is a `tracing` warning, and the compiled image is used.
pub fn load_or_compile(
    file: &KernelFile,
    arch: &str,
    dir: Option<&Path>,
) -> Result<(Image, ImageOrigin)> {
    let Some(dir) = dir else {
        return Ok((compile(file, arch)?, ImageOrigin::Compiled));
    };
    if let Err(why) = cache_fs::private_dir(dir, true) {
        STATS.disk_write_failures.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(
            dir = %dir.display(),
            "kernel cache folder refused ({why}); compiling in memory"
        );
        return Ok((compile(file, arch)?, ImageOrigin::Compiled));
    }
    let key = ImageKey::new(file, arch)?;
    let t = Instant::now();
    match read_cached(dir, &key) {
        Ok(Some(image)) => {
            STATS.disk_hits.fetch_add(1, Ordering::Relaxed);
            STATS.disk_read_ns.fetch_add(nanos(t), Ordering::Relaxed);
            tracing::debug!(
                file = file.name,
                arch,
                dir = %dir.display(),
                "kernel image read from the disk cache"
            );
            return Ok((image, ImageOrigin::Disk));
        }
        Ok(None) => {}
        Err(reason) => {
            STATS.disk_rejected.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                path = %dir.join(key.file_name()).display(),
                "kernel cache file ignored ({reason}); compiling again and replacing it"
            );
        }
    }
    let image = compile(file, arch)?;
    match write_cached(dir, &key, &image) {
        Ok(path) => {
            STATS.disk_writes.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(path = %path.display(), "kernel image written to the disk cache");
        }
        Err(e) => {
            STATS.disk_write_failures.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                dir = %dir.display(),
                error = %e,
                "kernel image could not be written to the disk cache; the next process compiles it again"
            );
        }
    }
    Ok((image, ImageOrigin::Compiled))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

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

    static TINY: KernelFile = KernelFile {
        name: "tiny.cu",
        source: "extern \"C\" __global__ void k(float* x) { x[0] = 1.0f; }",
    };

    #[test]
    fn image_keys_change_with_every_input() {
        let base = ImageKey::with_version(&TINY, "sm_90", (13, 0));
        assert_eq!(base, ImageKey::with_version(&TINY, "sm_90", (13, 0)));
        static OTHER_SRC: KernelFile = KernelFile {
            name: "tiny.cu",
            source: "extern \"C\" __global__ void k(float* x) { x[0] = 2.0f; }",
        };
        static OTHER_NAME: KernelFile = KernelFile {
            name: "tiny2.cu",
            source: TINY.source,
        };
        let others = [
            ImageKey::with_version(&TINY, "sm_80", (13, 0)),
            ImageKey::with_version(&TINY, "sm_90", (13, 1)),
            ImageKey::with_version(&TINY, "sm_90", (12, 9)),
            ImageKey::with_version(&OTHER_SRC, "sm_90", (13, 0)),
            ImageKey::with_version(&OTHER_NAME, "sm_90", (13, 0)),
        ];
        for o in &others {
            assert_ne!(o.hash, base.hash, "{o:?}");
            assert_ne!(o.file_name(), base.file_name(), "{o:?}");
        }
        assert!(base.file_name().starts_with("tiny.sm_90.nvrtc13.0."));
        assert!(base.file_name().ends_with(".cubin"));
        assert!(ImageKey::with_version(&TINY, "compute_90", (13, 0))
            .file_name()
            .ends_with(".ptx"));
    }

    /// A 64-bit little-endian ELF header (no program or section headers) and `extra` bytes.
    fn minimal_elf(extra: usize) -> Vec<u8> {
        let mut b = vec![0u8; 64 + extra];
        b[..4].copy_from_slice(b"\x7fELF");
        b[4] = 2; // 64-bit
        b[5] = 1; // little-endian
        b[0x34] = 64; // e_ehsize
        b
    }

    #[test]
    fn elf_tables_must_lie_within_the_image() {
        assert_eq!(check_elf(&minimal_elf(0)), Ok(()));
        // One section header at 64, whose contents are the 16 bytes at 128.
        let mut b = minimal_elf(64 + 16);
        b[0x28..0x30].copy_from_slice(&64u64.to_le_bytes()); // e_shoff
        b[0x3a] = 64; // e_shentsize
        b[0x3c] = 1; // e_shnum
        b[64 + 0x18..64 + 0x20].copy_from_slice(&128u64.to_le_bytes()); // sh_offset
        b[64 + 0x20..64 + 0x28].copy_from_slice(&16u64.to_le_bytes()); // sh_size
        assert_eq!(check_elf(&b), Ok(()));
        let mut past = b.clone();
        past[64 + 0x20..64 + 0x28].copy_from_slice(&17u64.to_le_bytes());
        assert!(check_elf(&past).is_err(), "section past the end");
        let mut wrap = b.clone();
        wrap[64 + 0x18..64 + 0x20].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(check_elf(&wrap).is_err(), "offset that wraps");
        let mut nobits = past.clone();
        nobits[64 + 4] = 8; // SHT_NOBITS: no bytes in the file
        assert_eq!(check_elf(&nobits), Ok(()));
        let mut table = b.clone();
        table[0x3c] = 2; // a second section header past the end
        assert!(check_elf(&table).is_err(), "table past the end");
        let mut ph = minimal_elf(0);
        ph[0x20..0x28].copy_from_slice(&64u64.to_le_bytes()); // e_phoff
        ph[0x36] = 0x38; // e_phentsize
        ph[0x38] = 1; // e_phnum
        assert!(check_elf(&ph).is_err(), "program headers past the end");
        assert!(check_elf(&minimal_elf(0)[..63]).is_err(), "short header");
        let mut elf32 = minimal_elf(0);
        elf32[4] = 1;
        assert!(check_elf(&elf32).is_err(), "32-bit");
    }

    #[test]
    fn ptx_must_end_in_its_only_nul() {
        assert!(check_image(&Image::Ptx(b".version 8.0\0".to_vec())).is_ok());
        assert!(check_image(&Image::Ptx(b".version 8.0".to_vec())).is_err());
        assert!(check_image(&Image::Ptx(b".ver\0sion\0".to_vec())).is_err());
        assert!(check_image(&Image::Ptx(Vec::new())).is_err());
    }

    #[test]
    fn the_key_is_sha256_of_the_length_prefixed_inputs() {
        let key = ImageKey::with_version(&TINY, "sm_90", (13, 0));
        let mut h = Sha256::new();
        let mut field = |b: &[u8]| {
            h.update((b.len() as u64).to_le_bytes());
            h.update(b);
        };
        field(&DISK_FORMAT_VERSION.to_le_bytes());
        field(&13i32.to_le_bytes());
        field(&0i32.to_le_bytes());
        field(b"sm_90");
        field(b"tiny.cu");
        field(TINY.source.as_bytes());
        for o in compile_options("sm_90") {
            field(o.as_bytes());
        }
        let want: [u8; 32] = h.finalize().into();
        assert_eq!(key.hash, want);
        assert!(key.file_name().contains(&hex(&want)));
        // The content's SHA-256 is stored in the header and checked on read.
        let payload = minimal_elf(8);
        let file = key.encode(&payload);
        let header = std::str::from_utf8(&file[..file.len() - payload.len()]).unwrap();
        assert!(header.ends_with(&format!(" sha256={}\n", sha256_hex(&payload))));
    }

    #[test]
    fn encoded_images_round_trip_and_damage_is_detected() {
        let key = ImageKey::with_version(&TINY, "sm_90", (13, 0));
        let payload = minimal_elf(256);
        let file = key.encode(&payload);
        match key.decode(&file) {
            Ok(Image::Cubin(b)) => assert_eq!(b, payload),
            other => panic!("{other:?}"),
        }
        // Truncated, a flipped payload byte, an appended byte, another key's file, garbage.
        let mut flipped = file.clone();
        let last = flipped.len() - 1;
        flipped[last] ^= 1;
        let mut longer = file.clone();
        longer.push(0);
        let other = ImageKey::with_version(&TINY, "sm_80", (13, 0)).encode(&payload);
        let not_elf = key.encode(b"PTX?");
        for (what, bad) in [
            ("truncated", &file[..file.len() - 3]),
            ("flipped", &flipped[..]),
            ("longer", &longer[..]),
            ("other key", &other[..]),
            ("no header", &payload[..]),
            ("empty", &[][..]),
            ("not ELF", &not_elf[..]),
        ] {
            assert!(key.decode(bad).is_err(), "{what} was accepted");
        }
        // PTX keeps its bytes as they are (NUL terminator included).
        let pkey = ImageKey::with_version(&TINY, "compute_90", (13, 0));
        match pkey.decode(&pkey.encode(b".version 8.0\0")) {
            Ok(Image::Ptx(b)) => assert_eq!(b, b".version 8.0\0"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn cache_folder_follows_the_config() {
        let c = Config::default();
        assert_eq!(c.kernel_cache_dir(), None);
        // Never beside the tuning file (which may sit in a folder others can write).
        let c = c.with_tuning_cache(Some(PathBuf::from("/tmp/x/tuning.json")));
        assert_eq!(
            c.kernel_cache_dir(),
            dirs::cache_dir().map(|d| d.join("nnfuse"))
        );
        let c = c.with_kernel_cache(Some(PathBuf::from("/k")));
        assert_eq!(c.kernel_cache_dir(), Some(PathBuf::from("/k")));
    }
}
