//! The [`Context`]: one device, one stream, the vendor-library handles, a growable workspace,
//! the per-device cache of compiled kernels (backed by the disk cache of `kernels.rs`) and
//! the bounded per-Context cache of plans. Everything that touches the GPU goes through it.
//!
//! Threading: `Context` is `Send + Sync` and cheap to clone (an `Arc`). All work runs on the
//! Context's one stream, in the order calls are made. cuDNN, cuBLAS and cuBLASLt allow several
//! threads but not one handle used by two threads at once, so the handles and the workspace sit
//! behind one mutex ([`Context::lock`]); since they all serve the same stream, one lock costs no
//! parallelism that the stream would have given.

use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::fmt;
use std::hash::Hash;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};

use cudarc::cublas::{result as cublas_result, sys as cublas_sys};
use cudarc::cublaslt::{result as lt_result, sys as lt_sys};
use cudarc::cudnn::{result as cudnn_result, sys as cudnn_sys};
use cudarc::driver::{
    result as drv_result, sys as drv, CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream,
};
use once_cell::sync::Lazy;

use crate::config::Config;
use crate::error::{CallExt, Error, Result};
use crate::kernels::{self, KernelFile};
use crate::lru::Lru;

/// Names the library and says how to make it findable.
fn missing(lib: &'static str, file: &str) -> Error {
    let source = if lib == "cuda" {
        "it comes with the NVIDIA driver: install the driver, or on a machine without a GPU \
         expect GPU operations to be unavailable"
    } else {
        "install it (NVIDIA's pip wheels, e.g. nvidia-cudnn-cu13 / nvidia-cublas, or a CUDA \
         toolkit) and put the folder holding it on LD_LIBRARY_PATH"
    };
    Error::LibraryMissing {
        lib,
        hint: format!("{file} was not found by the dynamic loader; {source}"),
    }
}

/// Whether the CUDA driver library (`libcuda.so`) can be loaded.
pub fn driver_present() -> bool {
    // SAFETY: only tries to dlopen the library.
    unsafe { drv::is_culib_present() }
}

/// Whether cuDNN can be loaded.
pub fn cudnn_present() -> bool {
    // SAFETY: as above.
    unsafe { cudnn_sys::is_culib_present() }
}

/// Whether cuBLAS can be loaded.
pub fn cublas_present() -> bool {
    // SAFETY: as above.
    unsafe { cublas_sys::is_culib_present() }
}

/// Whether cuBLASLt can be loaded.
pub fn cublaslt_present() -> bool {
    // SAFETY: as above.
    unsafe { lt_sys::is_culib_present() }
}

/// The CUDA driver's version as `(major, minor)`.
pub fn driver_version() -> Result<(i32, i32)> {
    if !driver_present() {
        return Err(missing("cuda", "libcuda.so.1"));
    }
    let mut v = 0;
    // SAFETY: valid out-pointer; cuDriverGetVersion needs no cuInit.
    unsafe { drv::cuDriverGetVersion(&mut v) }
        .result()
        .call("cuDriverGetVersion")?;
    Ok((v / 1000, (v % 1000) / 10))
}

/// cuDNN's version number (e.g. 91900 for 9.19.0), after checking that it can be loaded.
pub fn cudnn_version() -> Result<usize> {
    if !cudnn_present() {
        return Err(missing("cudnn", "libcudnn.so.9"));
    }
    Ok(cudnn_result::get_version())
}

/// cuBLAS's version as `(major, minor, patch)`.
pub fn cublas_version() -> Result<(i32, i32, i32)> {
    if !cublas_present() {
        return Err(missing("cublas", "libcublas.so.13"));
    }
    let get = |t| {
        let mut v = 0;
        // SAFETY: valid out-pointer; needs no handle.
        unsafe { cublas_sys::cublasGetProperty(t, &mut v) }
            .result()
            .call("cublasGetProperty")
            .map(|_| v)
    };
    use cublas_sys::libraryPropertyType as P;
    Ok((
        get(P::MAJOR_VERSION)?,
        get(P::MINOR_VERSION)?,
        get(P::PATCH_LEVEL)?,
    ))
}

/// cuBLASLt's version number (e.g. 130100).
pub fn cublaslt_version() -> Result<usize> {
    if !cublaslt_present() {
        return Err(missing("cublasLt", "libcublasLt.so.13"));
    }
    // SAFETY: no arguments.
    Ok(unsafe { lt_sys::cublasLtGetVersion() })
}

/// Facts about the device a [`Context`] runs on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Ordinal.
    pub ordinal: usize,
    /// Marketing name.
    pub name: String,
    /// Compute capability.
    pub compute_capability: (i32, i32),
    /// Streaming multiprocessors.
    pub sm_count: i32,
    /// Total memory in bytes.
    pub total_memory: usize,
    /// L2 cache in bytes.
    pub l2_bytes: i32,
    /// CUDA driver version.
    pub driver: (i32, i32),
}

impl fmt::Display for DeviceInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "device {}: {} (sm_{}{}), {} SMs, {:.1} GiB, L2 {} MiB, driver CUDA {}.{}",
            self.ordinal,
            self.name,
            self.compute_capability.0,
            self.compute_capability.1,
            self.sm_count,
            self.total_memory as f64 / (1u64 << 30) as f64,
            self.l2_bytes >> 20,
            self.driver.0,
            self.driver.1
        )
    }
}

/// A raw library handle that may move between threads while the mutex guards it.
struct Handle<H>(H);
// SAFETY: cuDNN/cuBLAS/cuBLASLt handles may be used from any thread, one at a time; the
// Context's mutex guarantees one at a time.
unsafe impl<H> Send for Handle<H> {}

/// A Context's cuDNN handle, shared with the cuDNN graph plans built on it
/// ([`Locked::cudnn_owner`]): cuDNN's execution plans hold their handle, and a Context once
/// destroyed it before the plans it had cached (or a caller kept), whose destruction then used
/// a destroyed handle. The handle now goes with the last of the Context and its plans, with the
/// stream it was made for kept alive until then.
pub(crate) struct CudnnHandle {
    raw: cudnn_sys::cudnnHandle_t,
    stream: Arc<CudaStream>,
}

// SAFETY: as `Handle`: used from any thread, one call at a time (the Context's lock for calls;
// destruction happens once, when the last owner goes).
unsafe impl Send for CudnnHandle {}
unsafe impl Sync for CudnnHandle {}

impl fmt::Debug for CudnnHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CudnnHandle({:p})", self.raw)
    }
}

impl CudnnHandle {
    /// The raw handle.
    pub(crate) fn raw(&self) -> cudnn_sys::cudnnHandle_t {
        self.raw
    }
}

impl Drop for CudnnHandle {
    fn drop(&mut self) {
        // Any thread may drop the last owner: bind the handle's context, let queued work that
        // uses the handle finish, then destroy it. Failures at teardown can only leak.
        let _ = self.stream.context().bind_to_thread();
        let _ = self.stream.synchronize();
        // SAFETY: created once in `Locked::cudnn`, destroyed once, here, by its last owner.
        let _ = unsafe { cudnn_result::destroy_handle(self.raw) };
    }
}

/// The state behind [`Context::lock`].
#[derive(Default)]
struct Shared {
    cudnn: Option<Arc<CudnnHandle>>,
    cublas: Option<Handle<cublas_sys::cublasHandle_t>>,
    cublaslt: Option<Handle<lt_sys::cublasLtHandle_t>>,
    workspace: Option<CudaSlice<u8>>,
    /// The workspace's address, taken once when it was allocated: only nnfuse uses it, on the
    /// Context's stream, so a cached call needs none of cudarc's per-use stream events.
    workspace_ptr: drv::CUdeviceptr,
    /// A stream that only captures, never runs work: cuDNN executions are recorded on it for
    /// replay (`cudnn_graph/replay.rs`), so that no capture takes in work that another thread
    /// queues on the Context's stream meanwhile. Made at the first capture.
    capture_stream: Option<Handle<drv::CUstream>>,
}

/// What the CUDA graphs captured on a stream keep alive, shared by the Contexts on that stream (a
/// Context and its [`Context::with_config_override`] copies): a captured graph holds the
/// addresses of the workspace and scratch arenas its calls used, so an arena that grows, is
/// released or whose Context is dropped while a graph lives is retired here instead of freed.
#[derive(Default)]
pub(crate) struct GraphPins {
    /// Captured graphs alive now.
    live: AtomicUsize,
    /// Arenas replaced while graphs were alive; freed when the last graph goes.
    retired: Mutex<Vec<CudaSlice<u8>>>,
}

impl GraphPins {
    /// Frees `old` in stream order, or keeps it while a captured graph may use it.
    fn retire(&self, old: Option<CudaSlice<u8>>) {
        let Some(buf) = old else { return };
        let mut retired = lock_poisoned(&self.retired);
        if self.live.load(Ordering::Acquire) > 0 {
            retired.push(buf);
        }
    }

    /// A graph was captured: arenas are retired, not freed, until it is unpinned.
    pub(crate) fn pin(&self) {
        let _retired = lock_poisoned(&self.retired);
        self.live.fetch_add(1, Ordering::AcqRel);
    }

    /// A graph went; the last one frees the retired arenas (in stream order) unless `keep`.
    pub(crate) fn unpin(&self, keep: bool) {
        let mut retired = lock_poisoned(&self.retired);
        if self.live.fetch_sub(1, Ordering::AcqRel) == 1 && !keep {
            retired.clear();
        }
    }
}

struct Inner {
    info: DeviceInfo,
    cuda: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    config: Config,
    shared: Mutex<Shared>,
    functions: Mutex<HashMap<(&'static str, &'static str), CudaFunction>>,
    modules: Mutex<HashMap<&'static str, Arc<CudaModule>>>,
    /// Per-Context caches of derived objects (BatchNorm plans + descriptors, ...), one bounded
    /// LRU per key type (see [`Context::memo`]).
    memo: Mutex<HashMap<TypeId, Box<dyn MemoTable>>>,
    /// Scratch memory of nnfuse's own multi-kernel paths (see [`Context::scratch`]).
    /// With its address, taken once at allocation (nnfuse's own memory, used on the Context's
    /// stream only: no per-use stream events).
    scratch: Mutex<Option<(CudaSlice<u8>, drv::CUdeviceptr)>>,
    /// Shared with every Context on the same stream.
    pins: Arc<GraphPins>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        // Work may still be queued that uses the handles or the workspace.
        let _ = self.stream.synchronize();
        let shared = match self.shared.get_mut() {
            Ok(s) => s,
            Err(p) => p.into_inner(),
        };
        // A graph captured on this stream may still use the arenas.
        self.pins.retire(shared.workspace.take());
        let scratch = match self.scratch.get_mut() {
            Ok(s) => s.take(),
            Err(p) => p.into_inner().take(),
        };
        self.pins.retire(scratch.map(|(buf, _)| buf));
        // The cuDNN handle goes when the last plan built on it does (`CudnnHandle`); the cached
        // plans go first, while it lives.
        drop(std::mem::take(match self.memo.get_mut() {
            Ok(m) => m,
            Err(p) => p.into_inner(),
        }));
        drop(shared.cudnn.take());
        // SAFETY: each handle was created once and is destroyed once, here. Failures to destroy
        // at teardown cannot be reported from Drop and only leak.
        unsafe {
            if let Some(h) = shared.cublas.take() {
                let _ = cublas_result::destroy_handle(h.0);
            }
            if let Some(h) = shared.cublaslt.take() {
                let _ = lt_result::destroy_handle(h.0);
            }
            if let Some(s) = shared.capture_stream.take() {
                let _ = drv_result::stream::destroy(s.0);
            }
        }
    }
}

/// A device, its stream and everything nnfuse keeps per device. Clone it freely.
#[derive(Clone)]
pub struct Context {
    inner: Arc<Inner>,
}

impl fmt::Debug for Context {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Context")
            .field("device", &self.inner.info)
            .field("config", &self.inner.config)
            .finish()
    }
}

/// The advice every refusal under CUDA-graph capture ends with ([`Context::refuse_under_capture`]).
const BEFORE_CAPTURE: &str = "make the same call once before the capture (same shapes, same \
     Context and objects): it then decides, compiles and allocates what it needs, and the \
     captured call does none of that (docs/CAPTURE.md)";

/// One (architecture, file)'s image in the process: ready, being compiled (by a background
/// thread or another caller: wait on it), or failed in the background.
enum Slot {
    Ready(Arc<kernels::Image>),
    Compiling(Arc<Pending>),
    Failed(String),
}

/// A compile in progress; its waiters sleep until `finish`. Whoever claims it compiles it: a
/// background thread when its turn comes, or a caller that needs the image before then (a
/// queued compile is taken over instead of waited for behind other files).
#[derive(Default)]
struct Pending {
    done: Mutex<bool>,
    cv: Condvar,
    claimed: std::sync::atomic::AtomicBool,
}

impl Pending {
    /// A compile its creator runs itself (already claimed).
    fn claimed() -> Arc<Pending> {
        let p = Pending::default();
        p.claimed.store(true, std::sync::atomic::Ordering::SeqCst);
        Arc::new(p)
    }

    /// Claims the compile: `true` for the one caller that is to run it.
    fn claim(&self) -> bool {
        !self.claimed.swap(true, std::sync::atomic::Ordering::SeqCst)
    }

    fn wait(&self) {
        let mut done = lock_poisoned(&self.done);
        while !*done {
            done = match self.cv.wait(done) {
                Ok(g) => g,
                Err(p) => p.into_inner(),
            };
        }
    }

    fn finish(&self) {
        *lock_poisoned(&self.done) = true;
        self.cv.notify_all();
    }
}

/// Images per (architecture, file), shared by every Context of the process so that a second
/// Context on the same kind of device does not compile again. Never held while compiling: a
/// compile marks its slot `Compiling` and works unlocked, so other files load meanwhile.
type ImageCache = HashMap<(String, &'static str), Slot>;
static IMAGES: Lazy<Mutex<ImageCache>> = Lazy::new(|| Mutex::new(HashMap::new()));

/// Background compiles running at once: NVRTC is single-threaded per file, and the caller's
/// own thread keeps a core (at most 4, at least 1).
fn background_permits() -> usize {
    std::thread::available_parallelism()
        .map_or(2, |n| n.get())
        .saturating_sub(1)
        .clamp(1, 4)
}

/// The background compiles' queue: running now, tickets handed out, tickets admitted. First
/// come, first compiled, so that what a first call wants soonest (the check's kernels, asked
/// for first) is not queued behind a later candidate's files.
#[derive(Default)]
struct Queue {
    running: usize,
    next: u64,
    admitted: u64,
    /// Tickets whose compile never started (no thread): passed over.
    cancelled: Vec<u64>,
}

impl Queue {
    /// Moves `admitted` past cancelled tickets.
    fn skip_cancelled(&mut self) {
        while let Some(i) = self.cancelled.iter().position(|&t| t == self.admitted) {
            self.cancelled.swap_remove(i);
            self.admitted += 1;
        }
    }
}

static QUEUE: Lazy<(Mutex<Queue>, Condvar)> = Lazy::new(Default::default);

/// Holds one background-compile permit until dropped.
struct Permit;

impl Permit {
    /// Waits for this compile's turn (in the order of [`Permit::ticket`]) and a free permit.
    fn take(ticket: u64) -> Permit {
        let (m, cv) = &*QUEUE;
        let mut q = lock_poisoned(m);
        q.skip_cancelled();
        while !(q.admitted == ticket && q.running < background_permits()) {
            q = match cv.wait(q) {
                Ok(g) => g,
                Err(p) => p.into_inner(),
            };
            q.skip_cancelled();
        }
        q.admitted += 1;
        q.running += 1;
        cv.notify_all();
        Permit
    }

    /// A place in the queue (taken when the compile is asked for, on the caller's thread).
    fn ticket() -> u64 {
        let mut q = lock_poisoned(&QUEUE.0);
        q.next += 1;
        q.next - 1
    }

    /// Gives up `ticket` (its compile never started).
    fn cancel(ticket: u64) {
        let (m, cv) = &*QUEUE;
        lock_poisoned(m).cancelled.push(ticket);
        cv.notify_all();
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        let (m, cv) = &*QUEUE;
        lock_poisoned(m).running -= 1;
        cv.notify_all();
    }
}

/// Ends the compile of `key`: the image goes in, or on error the slot is
/// emptied (a foreground caller retries and gets the typed error) or, from the background,
/// keeps the error's text; waiters wake either way.
fn finish_compile(
    key: (String, &'static str),
    pending: &Pending,
    result: std::result::Result<Arc<kernels::Image>, String>,
    background: bool,
) {
    {
        let mut images = lock_poisoned(&IMAGES);
        match result {
            Ok(image) => {
                images.insert(key, Slot::Ready(image));
            }
            Err(why) if background => {
                images.insert(key, Slot::Failed(why));
            }
            Err(_) => {
                images.remove(&key);
            }
        }
    }
    kernels::compile_finished();
    pending.finish();
}

/// Compiles (or reads from the disk cache) `file` for `arch`; the `info` trace says which file,
/// where it came from and how long it took.
fn compile_traced(
    file: &'static KernelFile,
    arch: &str,
    dir: Option<&std::path::Path>,
    background: bool,
) -> Result<Arc<kernels::Image>> {
    let t = std::time::Instant::now();
    let (image, origin) = kernels::load_or_compile(file, arch, dir)?;
    tracing::info!(
        file = file.name,
        %arch,
        ?origin,
        background,
        ms = t.elapsed().as_secs_f64() * 1e3,
        "kernel image ready"
    );
    Ok(Arc::new(image))
}

/// The size an arena (scratch or workspace) asked for `bytes` is allocated with: the next power
/// of two, at least 1 MiB, so that slowly growing requests do not reallocate every time. A
/// request above `isize::MAX` is an error naming `what` (`next_power_of_two` wraps to 0 in
/// release builds above 2^63, which made such a request "succeed" with 1 MiB).
fn arena_size(bytes: usize, what: &str) -> Result<usize> {
    // No allocation reaches isize::MAX bytes (Rust's and the driver's limit alike).
    if bytes > isize::MAX as usize {
        return Err(Error::invalid(
            what,
            format!("{bytes} bytes requested: more than any device allocation can hold"),
        ));
    }
    // At most 2^63 here: the next power of two fits; `unwrap_or` only guards the invariant.
    Ok(bytes
        .checked_next_power_of_two()
        .unwrap_or(bytes)
        .max(1 << 20))
}

fn lock_poisoned<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic in another thread while holding the lock leaves plain data behind; go on.
    match m.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

/// What a Context's plan caches hold ([`Context::plan_cache_stats`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PlanCacheStats {
    /// Entries cached now, over every kind.
    pub entries: usize,
    /// Most entries kept per kind ([`Config::plan_cache_capacity`]).
    pub capacity: usize,
    /// Kinds of cached objects (one LRU each).
    pub kinds: usize,
    /// Entries evicted (least recently used first) since the Context was made.
    pub evictions: u64,
    /// Evicted values that a caller still holds: they stay valid, and a lookup of their key
    /// returns them again instead of making a second one.
    pub held_elsewhere: usize,
}

/// One kind's cache inside the memo, seen without its types (statistics, downcast).
trait MemoTable: Send + Sync {
    fn as_any_mut(&mut self) -> &mut dyn Any;
    fn len(&self) -> usize;
    fn evictions(&self) -> u64;
    fn held_elsewhere(&self) -> usize;
}

/// The memo of one key type: an LRU of the values, plus weak references to evicted values that
/// callers still hold (so that a key never has two live values at once). The weak list is
/// pruned of dead entries whenever it has doubled since the last pruning, so it stays
/// proportional to what callers hold.
struct MemoMap<K, V> {
    lru: Lru<K, Arc<V>>,
    evicted: HashMap<K, Weak<V>>,
    prune_at: usize,
}

impl<K: Clone + Hash + Eq, V> MemoMap<K, V> {
    fn new(capacity: usize) -> Self {
        MemoMap {
            lru: Lru::new(capacity),
            evicted: HashMap::new(),
            prune_at: capacity.max(64),
        }
    }

    /// The value of `key`: cached, or still held by a caller since its eviction, or made now.
    /// Entries evicted to make room are moved to `dropped` (for the caller to drop unlocked).
    fn get_or_make(
        &mut self,
        key: K,
        make: impl FnOnce() -> Result<Arc<V>>,
        dropped: &mut Vec<(K, Arc<V>)>,
    ) -> Result<Arc<V>> {
        if let Some(v) = self.lru.get(&key) {
            return Ok(v.clone());
        }
        let v = match self.evicted.remove(&key).and_then(|w| w.upgrade()) {
            Some(v) => v,
            None => make()?,
        };
        for (k, old) in self.lru.insert(key, v.clone()) {
            // Someone else holds it: remember it weakly so a lookup revives the same value.
            if Arc::strong_count(&old) > 1 {
                self.evicted.insert(k.clone(), Arc::downgrade(&old));
            }
            dropped.push((k, old));
        }
        if self.evicted.len() > self.prune_at {
            self.evicted.retain(|_, w| w.strong_count() > 0);
            self.prune_at = (2 * self.evicted.len()).max(self.lru.capacity()).max(64);
        }
        Ok(v)
    }
}

impl<K, V> MemoTable for MemoMap<K, V>
where
    K: Clone + Hash + Eq + Send + Sync + 'static,
    V: Send + Sync + 'static,
{
    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
    fn len(&self) -> usize {
        self.lru.len()
    }
    fn evictions(&self) -> u64 {
        self.lru.evictions()
    }
    fn held_elsewhere(&self) -> usize {
        self.evicted
            .values()
            .filter(|w| w.strong_count() > 0)
            .count()
    }
}

impl Context {
    /// Opens device `ordinal` with the configuration from the environment
    /// ([`Config::from_env_once`]).
    pub fn new(ordinal: usize) -> Result<Context> {
        Self::with_config(ordinal, Config::from_env_once()?)
    }

    /// Opens device `ordinal` with an explicit configuration.
    pub fn with_config(ordinal: usize, config: Config) -> Result<Context> {
        if !driver_present() {
            return Err(missing("cuda", "libcuda.so.1"));
        }
        let count = CudaContext::device_count()
            .map_err(|e| Error::NoDevice(format!("cuInit/cuDeviceGetCount failed: {e:?}")))?;
        if count <= 0 {
            return Err(Error::NoDevice("the driver reports no CUDA device".into()));
        }
        if ordinal >= count as usize {
            return Err(Error::invalid(
                "ordinal",
                format!("device {ordinal} requested, but only {count} device(s) exist"),
            ));
        }
        let cuda = CudaContext::new(ordinal).call("cuDevicePrimaryCtxRetain")?;
        let stream = cuda.new_stream().call("cuStreamCreate")?;
        let attr = |a| cuda.attribute(a).call("cuDeviceGetAttribute");
        use drv::CUdevice_attribute as A;
        let info = DeviceInfo {
            ordinal,
            name: cuda.name().call("cuDeviceGetName")?,
            compute_capability: cuda.compute_capability().call("cuDeviceGetAttribute")?,
            sm_count: attr(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?,
            total_memory: cuda.total_mem().call("cuDeviceTotalMem")?,
            l2_bytes: attr(A::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)?,
            driver: driver_version()?,
        };
        tracing::info!(%info, "nnfuse context opened");
        Ok(Context {
            inner: Arc::new(Inner {
                info,
                cuda,
                stream,
                config,
                shared: Mutex::new(Shared::default()),
                functions: Mutex::new(HashMap::new()),
                modules: Mutex::new(HashMap::new()),
                memo: Mutex::new(HashMap::new()),
                scratch: Mutex::new(None),
                pins: Arc::default(),
            }),
        })
    }

    /// A Context on the same device and the same stream (so no synchronisation is needed
    /// between the two) that decides with `config`: its own handles, caches and plans. Use it to
    /// run one operation under another policy, e.g. to compare the fused and fallback paths.
    pub fn with_config_override(&self, config: Config) -> Context {
        Context {
            inner: Arc::new(Inner {
                info: self.inner.info.clone(),
                cuda: self.inner.cuda.clone(),
                stream: self.inner.stream.clone(),
                config,
                shared: Mutex::new(Shared::default()),
                functions: Mutex::new(HashMap::new()),
                modules: Mutex::new(HashMap::new()),
                memo: Mutex::new(HashMap::new()),
                scratch: Mutex::new(None),
                pins: self.inner.pins.clone(),
            }),
        }
    }

    /// The device.
    pub fn info(&self) -> &DeviceInfo {
        &self.inner.info
    }

    /// The configuration this Context decides with.
    pub fn config(&self) -> &Config {
        &self.inner.config
    }

    /// The CUDA context (for allocating buffers).
    pub fn cuda(&self) -> &Arc<CudaContext> {
        &self.inner.cuda
    }

    /// The stream every nnfuse operation of this Context runs on. Allocate buffers on it so that
    /// no cross-stream synchronisation is needed.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.inner.stream
    }

    /// Waits for all work queued on the stream. Refused with [`Error::Capture`] while the stream
    /// is capturing a CUDA graph (a synchronisation would invalidate the capture).
    pub fn synchronize(&self) -> Result<()> {
        self.refuse_under_capture("Context::synchronize", "synchronise the capturing stream")?;
        self.inner.stream.synchronize().call("cuStreamSynchronize")
    }

    /// Whether the Context's stream is capturing a CUDA graph now (also when that capture has
    /// been invalidated and not yet ended). One driver call (`cuStreamIsCapturing`): ask it
    /// only where a call is about to do something a capture cannot hold, never per operation.
    pub(crate) fn is_capturing(&self) -> Result<bool> {
        self.inner.cuda.bind_to_thread().call("cuCtxSetCurrent")?;
        // SAFETY: the Context's stream lives as long as the Context.
        let status = unsafe { drv_result::stream::is_capturing(self.inner.stream.cu_stream()) }
            .call("cuStreamIsCapturing")?;
        Ok(status != drv::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
    }

    /// `Ok` unless the Context's stream is capturing a CUDA graph; then [`Error::Capture`] naming
    /// `what` (the operation) and what it `needs` (phrased after "it would"). Call it right
    /// before an allocation, synchronisation, read-back, measurement or kernel compilation on a
    /// path that a decided call does not take, so that such a call under capture is refused
    /// instead of invalidating the capture.
    pub(crate) fn refuse_under_capture(&self, what: &'static str, needs: &str) -> Result<()> {
        if !self.is_capturing()? {
            return Ok(());
        }
        tracing::debug!(what, needs, "refused under CUDA-graph capture");
        Err(Error::Capture {
            what,
            why: format!("it would {needs}; {BEFORE_CAPTURE}"),
        })
    }

    /// What the graphs captured on this Context's stream keep alive (see `capture.rs`).
    pub(crate) fn pins(&self) -> &Arc<GraphPins> {
        &self.inner.pins
    }

    /// Grows the library workspace ([`Locked::workspace`]: cuDNN and cuBLASLt calls) to at least
    /// `bytes` now, so that no later call grows it: a call under CUDA-graph capture that needs
    /// more than the workspace holds is refused ([`Error::Capture`]). A call made once before the
    /// capture has already grown it to what that call needs.
    pub fn reserve_workspace(&self, bytes: usize) -> Result<()> {
        self.lock()?.workspace(bytes).map(drop)
    }

    /// Grows the scratch arena of nnfuse's own multi-kernel paths (convolution columns,
    /// Winograd's transformed tensors, BatchNorm's partial statistics) to at least `bytes` now;
    /// see [`Context::reserve_workspace`].
    pub fn reserve_scratch(&self, bytes: usize) -> Result<()> {
        self.scratch(bytes).map(drop)
    }

    /// Takes the lock over the library handles and the workspace. Hold the guard across one
    /// library call (and the launches that use the workspace), not longer.
    #[doc(hidden)]
    pub fn lock(&self) -> Result<Locked<'_>> {
        // Make the device current on this thread: cuDNN/cuBLAS calls use the current context.
        self.inner.cuda.bind_to_thread().call("cuCtxSetCurrent")?;
        Ok(Locked {
            ctx: self,
            shared: lock_poisoned(&self.inner.shared),
        })
    }

    /// The kernel `name` from `file` when this Context has loaded it already (never compiles
    /// nor loads: the cached path of [`Context::function`]).
    pub(crate) fn loaded_function(
        &self,
        file: &'static KernelFile,
        name: &'static str,
    ) -> Option<CudaFunction> {
        lock_poisoned(&self.inner.functions)
            .get(&(file.name, name))
            .cloned()
    }

    /// The kernel `name` from `file`, compiling and loading the file on first use (once per
    /// architecture per process, once per Context for loading) and caching the function.
    pub fn function(&self, file: &'static KernelFile, name: &'static str) -> Result<CudaFunction> {
        if let Some(f) = lock_poisoned(&self.inner.functions).get(&(file.name, name)) {
            return Ok(f.clone());
        }
        self.refuse_under_capture(
            "the first use of a kernel",
            &format!(
                "compile or load kernel {name} of {} (NVRTC, cuModuleLoadData)",
                file.name
            ),
        )?;
        let module = self.module(file)?;
        let f = module.load_function(name).map_err(|e| Error::Driver {
            call: "cuModuleGetFunction",
            status: format!("{e:?} (kernel {name} in {})", file.name),
        })?;
        lock_poisoned(&self.inner.functions).insert((file.name, name), f.clone());
        Ok(f)
    }

    /// The value cached under `key`, made by `make` on first use. One lock for all types, held
    /// while `make` runs (so two threads never make the same value twice); `make` must not call
    /// `memo` again.
    ///
    /// Each key type has its own LRU of [`Config::plan_cache_capacity`] entries. Evicting drops
    /// only the cache's `Arc`: a caller that still holds the value keeps using it, and while it
    /// does, a lookup of the same key gets that same value back (never a second one), so that
    /// identity-carrying values (a BatchNorm plan and the states its forward hands out) stay
    /// consistent.
    pub(crate) fn memo<K, V>(&self, key: K, make: impl FnOnce() -> Result<Arc<V>>) -> Result<Arc<V>>
    where
        K: Clone + Hash + Eq + Send + Sync + 'static,
        V: Send + Sync + 'static,
    {
        // Values evicted here are dropped after the lock is released (a value's Drop may be
        // slow, e.g. cuDNN descriptor destruction).
        let mut evicted: Vec<(K, Arc<V>)> = Vec::new();
        let result = {
            let mut all = lock_poisoned(&self.inner.memo);
            let capacity = self.inner.config.plan_cache_capacity;
            let table = all
                .entry(TypeId::of::<MemoMap<K, V>>())
                .or_insert_with(|| Box::new(MemoMap::<K, V>::new(capacity)));
            let Some(map) = table.as_any_mut().downcast_mut::<MemoMap<K, V>>() else {
                return Err(Error::NotSupported("memo cache type mismatch".into()));
            };
            map.get_or_make(key, make, &mut evicted)
        };
        if !evicted.is_empty() {
            tracing::debug!(
                evicted = evicted.len(),
                kind = std::any::type_name::<V>(),
                "plan cache full: least recently used entries evicted"
            );
        }
        drop(evicted);
        result
    }

    /// Entries in this Context's plan caches now (BatchNorm plans and descriptors, convolution
    /// plans, the GEMM search's scratch, ...), over every kind: at most
    /// [`Config::plan_cache_capacity`] per kind.
    pub fn cached_plans(&self) -> usize {
        self.plan_cache_stats().entries
    }

    /// What this Context's plan caches hold and have evicted (diagnostics).
    pub fn plan_cache_stats(&self) -> PlanCacheStats {
        let all = lock_poisoned(&self.inner.memo);
        let mut s = PlanCacheStats {
            capacity: self.inner.config.plan_cache_capacity,
            kinds: all.len(),
            ..PlanCacheStats::default()
        };
        for t in all.values() {
            s.entries += t.len();
            s.evictions += t.evictions();
            s.held_elsewhere += t.held_elsewhere();
        }
        s
    }

    /// Exclusive use of the Context's scratch arena of at least `bytes` bytes (grown, never
    /// shrunk unless [`Context::release_scratch`]): the intermediate tensors of nnfuse's own
    /// multi-kernel paths (convolution columns, Winograd's transformed tensors). It is separate
    /// from the library workspace of [`Locked::workspace`], which a GEMM or cuDNN call inside such
    /// a path uses meanwhile.
    ///
    /// Lock order: take the scratch before [`Context::lock`], never the other way round. Hold the
    /// guard while queuing the work that uses the memory; stream order keeps later users behind
    /// it.
    #[allow(dead_code)] // used by the convolution paths
    pub(crate) fn scratch(&self, bytes: usize) -> Result<Scratch<'_>> {
        let mut guard = lock_poisoned(&self.inner.scratch);
        let too_small = guard.as_ref().is_none_or(|(w, _)| w.len() < bytes);
        if too_small && bytes > 0 {
            self.refuse_under_capture(
                "growing the scratch arena",
                "allocate (reserve it up front with Context::reserve_scratch)",
            )?;
            self.inner.cuda.bind_to_thread().call("cuCtxSetCurrent")?;
            let size = arena_size(bytes, "scratch")?;
            // Dropping the old buffer frees it in stream order, after queued work that uses it.
            self.inner.pins.retire(guard.take().map(|(buf, _)| buf));
            // SAFETY: scratch memory; every user writes before it reads.
            let buf = unsafe { self.inner.stream.alloc::<u8>(size) }.call("cuMemAllocAsync")?;
            tracing::debug!(bytes = size, "scratch arena grown");
            let ptr = cudarc::driver::DevicePtr::device_ptr(&buf, &self.inner.stream).0;
            *guard = Some((buf, ptr));
        }
        let ptr = guard.as_ref().map_or(0, |(_, p)| *p);
        Ok(Scratch {
            _guard: guard,
            ptr,
            bytes,
        })
    }

    /// Bytes the scratch arena holds now.
    pub fn scratch_bytes(&self) -> usize {
        lock_poisoned(&self.inner.scratch)
            .as_ref()
            .map_or(0, |(b, _)| b.len())
    }

    /// Frees the scratch arena (in stream order, after the work queued so far); the next path
    /// that needs it allocates again.
    pub fn release_scratch(&self) {
        let old = lock_poisoned(&self.inner.scratch).take();
        self.inner.pins.retire(old.map(|(buf, _)| buf));
    }

    /// Loads every file of `files` (compiling those not compiled yet, waiting for those
    /// compiling in the background): for callers that want a first call's candidates ready.
    pub(crate) fn load_kernels(&self, files: &[&'static KernelFile]) -> Result<()> {
        for f in files {
            self.module(f)?;
        }
        Ok(())
    }

    fn module(&self, file: &'static KernelFile) -> Result<Arc<CudaModule>> {
        if let Some(m) = lock_poisoned(&self.inner.modules).get(file.name) {
            return Ok(m.clone());
        }
        // Not under the modules lock: a compile takes seconds, and other files load meanwhile;
        // the image slot makes two callers of the same file compile it once.
        let arch = kernels::arch_for(self.inner.info.compute_capability);
        let image = self.image(file, &arch)?;
        let mut modules = lock_poisoned(&self.inner.modules);
        if let Some(m) = modules.get(file.name) {
            return Ok(m.clone());
        }
        // cuModuleLoadData takes no length: it trusts the image's own offsets (ELF) or its NUL
        // (PTX). Checked here for every image, whichever way it came.
        kernels::check_image(&image).map_err(|why| Error::Nvrtc {
            file: file.name,
            arch: arch.clone(),
            status: "image refused before cuModuleLoadData".into(),
            log: why,
        })?;
        let ptx = cudarc::nvrtc::Ptx::from_binary(image.bytes().to_vec());
        let module = self.inner.cuda.load_module(ptx).call("cuModuleLoadData")?;
        modules.insert(file.name, module.clone());
        Ok(module)
    }

    /// The image of `file` for `arch`: the process's, else (waiting for a compile in progress,
    /// whoever started it) compiled or read from the disk cache here.
    fn image(&self, file: &'static KernelFile, arch: &str) -> Result<Arc<kernels::Image>> {
        let key = (arch.to_string(), file.name);
        let pending = loop {
            let waiting = {
                let mut images = lock_poisoned(&IMAGES);
                match images.get(&key) {
                    Some(Slot::Ready(i)) => return Ok(i.clone()),
                    Some(Slot::Compiling(p)) if p.claim() => {
                        tracing::info!(file = file.name, %arch,
                            "kernel file compiling in the foreground: its background compile \
                             was still queued");
                        break p.clone();
                    }
                    Some(Slot::Compiling(p)) => p.clone(),
                    Some(Slot::Failed(why)) => {
                        tracing::warn!(file = file.name, %arch, error = %why,
                            "the background compile of this kernel file failed; compiling it \
                             again in the foreground");
                        let p = Pending::claimed();
                        images.insert(key.clone(), Slot::Compiling(p.clone()));
                        break p;
                    }
                    None => {
                        let p = Pending::claimed();
                        images.insert(key.clone(), Slot::Compiling(p.clone()));
                        break p;
                    }
                }
            };
            let t = std::time::Instant::now();
            waiting.wait();
            tracing::info!(
                file = file.name,
                %arch,
                waited_ms = t.elapsed().as_secs_f64() * 1e3,
                "waited for a kernel file's compile in progress"
            );
        };
        // The disk cache (if configured) spares the NVRTC compile across processes; it never
        // fails the call (a bad cache file is recompiled with a warning).
        let dir = self.inner.config.kernel_cache_dir();
        let r = compile_traced(file, arch, dir.as_deref(), false);
        let kept = r.as_ref().map(Arc::clone).map_err(|e| e.to_string());
        finish_compile(key, &pending, kept, false);
        r
    }

    /// Where `file` stands for this Context's device, without compiling: loaded here, in the
    /// process's images, being compiled, failed in the background, or in the kernel disk cache
    /// (read into the process's images now, so that its use only loads it).
    pub(crate) fn kernel_state(&self, file: &'static KernelFile) -> kernels::KernelState {
        use kernels::KernelState;
        if lock_poisoned(&self.inner.modules).contains_key(file.name) {
            return KernelState::Ready;
        }
        let arch = kernels::arch_for(self.inner.info.compute_capability);
        let key = (arch, file.name);
        match lock_poisoned(&IMAGES).get(&key) {
            Some(Slot::Ready(_)) => return KernelState::Ready,
            Some(Slot::Compiling(_)) => return KernelState::Compiling,
            Some(Slot::Failed(why)) => return KernelState::Failed(why.clone()),
            None => {}
        }
        let Some(dir) = self.inner.config.kernel_cache_dir() else {
            return KernelState::Missing;
        };
        let Some(image) = kernels::read_disk(file, &key.0, &dir) else {
            return KernelState::Missing;
        };
        // Another thread may have filled the slot meanwhile: keep what is there.
        lock_poisoned(&IMAGES)
            .entry(key)
            .or_insert_with(|| Slot::Ready(Arc::new(image)));
        KernelState::Ready
    }

    /// Whether using `file` compiles nothing ([`Context::kernel_state`] is `Ready`).
    pub(crate) fn kernel_ready(&self, file: &'static KernelFile) -> bool {
        self.kernel_state(file) == kernels::KernelState::Ready
    }

    /// Starts compiling, on background threads (one per file, at most a few at once), the
    /// files of `files` that are neither ready nor being compiled; returns how many it started.
    /// The images go into the process's images (and the disk cache when configured); nothing
    /// is loaded into a device (a later [`Context::function`] loads, so no module ever lands
    /// in a capturing stream's context from here). A failure is a warning now and is kept: the
    /// file's next use compiles it in the foreground and returns the typed error.
    pub(crate) fn prepare_kernels(&self, files: &[&'static KernelFile]) -> usize {
        let arch = kernels::arch_for(self.inner.info.compute_capability);
        let mut started = 0;
        for &file in files {
            if self.kernel_state(file) != kernels::KernelState::Missing {
                continue;
            }
            let key = (arch.clone(), file.name);
            let pending = {
                let mut images = lock_poisoned(&IMAGES);
                if images.contains_key(&key) {
                    continue;
                }
                let p = Arc::new(Pending::default());
                images.insert(key.clone(), Slot::Compiling(p.clone()));
                p
            };
            let dir = self.inner.config.kernel_cache_dir();
            let (k, p) = (key.clone(), pending.clone());
            kernels::wait_for_background_compiles_at_exit(&arch);
            kernels::background_started();
            let ticket = Permit::ticket();
            let spawned = std::thread::Builder::new()
                .name(format!("nnfuse-nvrtc-{}", file.name))
                .spawn(move || {
                    let _permit = Permit::take(ticket);
                    if !p.claim() {
                        // A caller needed it first and compiled it in the foreground.
                        kernels::background_finished();
                        return;
                    }
                    // A panic inside NVRTC's binding must still finish the slot and the count
                    // (the exit handler and later callers wait on them).
                    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        if kernels::exiting() {
                            return Err(Error::NotSupported(format!(
                                "{}: not compiled, the process is exiting",
                                file.name
                            )));
                        }
                        compile_traced(file, &k.0, dir.as_deref(), true)
                    }))
                    .unwrap_or_else(|_| {
                        Err(Error::NotSupported(format!(
                            "compiling {} panicked on its background thread",
                            file.name
                        )))
                    });
                    if let Err(e) = &r {
                        tracing::warn!(file = file.name, arch = %k.0, error = %e,
                            "background kernel compile failed; its next use compiles it again");
                    }
                    finish_compile(k, &p, r.map_err(|e| e.to_string()), true);
                    kernels::background_finished();
                });
            match spawned {
                Ok(t) => {
                    kernels::keep_background_thread(t);
                    tracing::info!(file = file.name, %arch, "kernel file compiling in the background");
                    started += 1;
                }
                Err(e) => {
                    tracing::warn!(file = file.name, error = %e,
                        "no thread for a background compile; its first use compiles it");
                    Permit::cancel(ticket);
                    lock_poisoned(&IMAGES).remove(&key);
                    pending.finish();
                    kernels::background_finished();
                }
            }
        }
        started
    }
}

/// Exclusive use of the Context's scratch arena (see [`Context::scratch`]).
#[allow(dead_code)] // used by the convolution paths
pub(crate) struct Scratch<'a> {
    _guard: MutexGuard<'a, Option<(CudaSlice<u8>, drv::CUdeviceptr)>>,
    ptr: drv::CUdeviceptr,
    bytes: usize,
}

impl Scratch<'_> {
    /// Device address of the first byte (0 when 0 bytes were asked for).
    #[allow(dead_code)] // used by the convolution paths
    pub(crate) fn ptr(&self) -> drv::CUdeviceptr {
        self.ptr
    }

    /// Bytes asked for (the arena may hold more).
    #[allow(dead_code)] // used by the convolution paths
    pub(crate) fn len(&self) -> usize {
        self.bytes
    }
}

/// A library handle made by `create` and bound to a stream by `bind`; destroyed by `destroy`
/// when binding fails, so that a failed creation leaks nothing.
fn created_on_stream<H: Copy>(
    create: impl FnOnce() -> Result<H>,
    bind: impl FnOnce(H) -> Result<()>,
    destroy: impl FnOnce(H),
) -> Result<H> {
    let h = create()?;
    if let Err(e) = bind(h) {
        destroy(h);
        return Err(e);
    }
    Ok(h)
}

/// Exclusive access to the Context's library handles and workspace (see `Context::lock`). Raw
/// handles for nnfuse's own operations and tests: not a stable API.
#[doc(hidden)]
pub struct Locked<'a> {
    ctx: &'a Context,
    shared: MutexGuard<'a, Shared>,
}

impl Locked<'_> {
    /// The cuDNN handle, created on first use, bound to the Context's stream. The first creation
    /// also runs cuDNN's version check, so that two mixed cuDNN versions are an error.
    pub fn cudnn(&mut self) -> Result<cudnn_sys::cudnnHandle_t> {
        // Every cached cuDNN call asks: no reference count touched once the handle exists.
        if let Some(h) = &self.shared.cudnn {
            return Ok(h.raw);
        }
        Ok(self.cudnn_owner()?.raw())
    }

    /// The cuDNN handle (made on first use, as [`Locked::cudnn`]) as its shared owner: what a
    /// cuDNN graph plan keeps, so that the handle outlives it.
    pub(crate) fn cudnn_owner(&mut self) -> Result<Arc<CudnnHandle>> {
        if let Some(h) = &self.shared.cudnn {
            return Ok(h.clone());
        }
        self.ctx
            .refuse_under_capture("creating the cuDNN handle", "create a library handle")?;
        let version = cudnn_version()?;
        cudnn_result::version_check().call("cudnnVersionCheck (sub-library versions differ)")?;
        let stream = self.ctx.stream().cu_stream();
        let h = created_on_stream(
            || cudnn_result::create_handle().call("cudnnCreate"),
            // SAFETY: fresh handle, live stream.
            |h| {
                unsafe { cudnn_result::set_stream(h, stream as cudnn_sys::cudaStream_t) }
                    .call("cudnnSetStream")
            },
            // SAFETY: destroys the handle just made, once.
            |h| {
                let _ = unsafe { cudnn_result::destroy_handle(h) };
            },
        )?;
        tracing::info!(version, "cuDNN handle created");
        let owner = Arc::new(CudnnHandle {
            raw: h,
            stream: self.ctx.stream().clone(),
        });
        self.shared.cudnn = Some(owner.clone());
        Ok(owner)
    }

    /// The cuBLAS handle, created on first use, bound to the Context's stream.
    pub fn cublas(&mut self) -> Result<cublas_sys::cublasHandle_t> {
        if let Some(h) = &self.shared.cublas {
            return Ok(h.0);
        }
        self.ctx
            .refuse_under_capture("creating the cuBLAS handle", "create a library handle")?;
        let version = cublas_version()?;
        let stream = self.ctx.stream().cu_stream();
        let h = created_on_stream(
            || cublas_result::create_handle().call("cublasCreate"),
            // SAFETY: fresh handle, live stream.
            |h| {
                unsafe { cublas_result::set_stream(h, stream as cublas_sys::cudaStream_t) }
                    .call("cublasSetStream")
            },
            // SAFETY: destroys the handle just made, once.
            |h| {
                let _ = unsafe { cublas_result::destroy_handle(h) };
            },
        )?;
        tracing::info!(?version, "cuBLAS handle created");
        self.shared.cublas = Some(Handle(h));
        Ok(h)
    }

    /// The cuBLASLt handle, created on first use (cuBLASLt takes the stream per call).
    pub fn cublaslt(&mut self) -> Result<lt_sys::cublasLtHandle_t> {
        if let Some(h) = &self.shared.cublaslt {
            return Ok(h.0);
        }
        self.ctx
            .refuse_under_capture("creating the cuBLASLt handle", "create a library handle")?;
        let version = cublaslt_version()?;
        let h = lt_result::create_handle().call("cublasLtCreate")?;
        tracing::info!(version, "cuBLASLt handle created");
        self.shared.cublaslt = Some(Handle(h));
        Ok(h)
    }

    /// A device workspace of at least `bytes` bytes (grown, never shrunk), as a raw pointer
    /// valid while this guard lives and for work queued on the Context's stream meanwhile.
    /// Returns 0 for a zero-byte request.
    pub fn workspace(&mut self, bytes: usize) -> Result<drv::CUdeviceptr> {
        if bytes == 0 {
            return Ok(0);
        }
        let too_small = self
            .shared
            .workspace
            .as_ref()
            .is_none_or(|w| w.len() < bytes);
        if too_small {
            self.ctx.refuse_under_capture(
                "growing the library workspace",
                "allocate (reserve it up front with Context::reserve_workspace)",
            )?;
            let size = arena_size(bytes, "workspace")?;
            // Dropping the old buffer frees it in stream order, after queued work that uses it.
            self.ctx.inner.pins.retire(self.shared.workspace.take());
            self.shared.workspace_ptr = 0;
            // SAFETY: the workspace is scratch memory; nothing reads it before a writer does.
            let buf = unsafe { self.ctx.stream().alloc::<u8>(size) }.call("cuMemAllocAsync")?;
            tracing::debug!(bytes = size, "workspace grown");
            self.shared.workspace_ptr =
                cudarc::driver::DevicePtr::device_ptr(&buf, self.ctx.stream()).0;
            self.shared.workspace = Some(buf);
        }
        Ok(self.shared.workspace_ptr)
    }

    /// The Context's capture-only stream (see `Shared::capture_stream`), made at first use.
    pub(crate) fn capture_stream(&mut self) -> Result<drv::CUstream> {
        if let Some(s) = &self.shared.capture_stream {
            return Ok(s.0);
        }
        let s = drv_result::stream::create(drv_result::stream::StreamKind::NonBlocking)
            .call("cuStreamCreate")?;
        self.shared.capture_stream = Some(Handle(s));
        Ok(s)
    }

    /// The Context this guard belongs to.
    pub fn context(&self) -> &Context {
        self.ctx
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A request above 2^63 bytes once rounded to 0 (then to 1 MiB) in release builds.
    #[test]
    fn arena_sizes_round_up_and_reject_what_no_allocation_holds() {
        assert_eq!(arena_size(1, "workspace").unwrap(), 1 << 20);
        assert_eq!(arena_size((1 << 20) + 1, "workspace").unwrap(), 2 << 20);
        assert_eq!(arena_size(1 << 30, "scratch").unwrap(), 1 << 30);
        let big = (isize::MAX as usize / 2) + 2;
        assert_eq!(arena_size(big, "scratch").unwrap(), big.next_power_of_two());
        for bytes in [(1usize << 63) + 1, usize::MAX, isize::MAX as usize + 1] {
            let e = arena_size(bytes, "workspace").unwrap_err();
            assert_eq!(e.argument(), Some("workspace"), "{e}");
        }
    }

    /// A queued compile runs once: whoever claims it first (the background thread at its turn,
    /// or a caller that needs it sooner) compiles it; the other one waits or stands down.
    #[test]
    fn a_pending_compile_is_claimed_once() {
        let queued = Pending::default();
        assert!(queued.claim(), "the first claim runs it");
        assert!(!queued.claim(), "a second claim does not");
        assert!(
            !Pending::claimed().claim(),
            "a caller's own compile is claimed already"
        );
    }

    /// A background compile whose thread never started gives its turn up: the queue moves on.
    #[test]
    fn cancelled_tickets_are_passed_over_in_order() {
        let mut q = Queue {
            next: 5,
            admitted: 1,
            cancelled: vec![3, 1, 2],
            ..Queue::default()
        };
        q.skip_cancelled();
        assert_eq!((q.admitted, q.cancelled.len()), (4, 0));
        let mut q = Queue {
            next: 5,
            admitted: 1,
            cancelled: vec![3],
            ..Queue::default()
        };
        q.skip_cancelled();
        assert_eq!((q.admitted, q.cancelled.clone()), (1, vec![3]));
        assert!((1..=4).contains(&background_permits()));
    }

    #[test]
    fn context_is_send_and_sync() {
        fn check<T: Send + Sync>() {}
        check::<Context>();
    }

    /// Counts live values, so that "memory returns" is checked exactly.
    struct Counted(Arc<std::sync::atomic::AtomicUsize>);
    impl Drop for Counted {
        fn drop(&mut self) {
            self.0.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
        }
    }

    #[test]
    fn memo_is_bounded_and_keeps_held_values_unique() {
        use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
        let live = Arc::new(AtomicUsize::new(0));
        let make = |made: &mut usize| {
            *made += 1;
            live.fetch_add(1, SeqCst);
            Ok(Arc::new(Counted(live.clone())))
        };
        let mut m = MemoMap::<u32, Counted>::new(64);
        let mut made = 0;
        let mut dropped = Vec::new();
        let held = m.get_or_make(7, || make(&mut made), &mut dropped).unwrap();
        for k in 100..20_100 {
            m.get_or_make(k, || make(&mut made), &mut dropped).unwrap();
            dropped.clear();
            assert!(m.len() <= 64);
        }
        assert_eq!(m.len(), 64);
        assert_eq!(m.evictions(), 20_001 - 64);
        // Everything evicted was freed except the value a caller holds.
        assert_eq!(live.load(SeqCst), 64 + 1);
        assert_eq!(m.held_elsewhere(), 1);
        // Its key comes back as the same value, not a second one.
        let again = m.get_or_make(7, || make(&mut made), &mut dropped).unwrap();
        assert!(Arc::ptr_eq(&held, &again));
        assert_eq!(made, 20_001);
        dropped.clear();
        drop((held, again));
        // A key whose value nobody holds any more is made afresh.
        for k in 200_000..200_100 {
            m.get_or_make(k, || make(&mut made), &mut dropped).unwrap();
        }
        dropped.clear();
        assert_eq!(live.load(SeqCst), 64);
        m.get_or_make(7, || make(&mut made), &mut dropped).unwrap();
        assert_eq!(made, 20_001 + 100 + 1);
        // The weak list was pruned: it holds no more than what callers could hold.
        assert!(m.evicted.len() <= 2 * 64 + 1, "{}", m.evicted.len());
    }

    #[test]
    fn memo_errors_cache_nothing() {
        let mut m = MemoMap::<u32, u32>::new(4);
        let mut dropped = Vec::new();
        let e = m.get_or_make(1, || Err(Error::invalid("shape", "bad")), &mut dropped);
        assert_eq!(e.unwrap_err().argument(), Some("shape"));
        assert_eq!(m.len(), 0);
        assert_eq!(
            *m.get_or_make(1, || Ok(Arc::new(5)), &mut dropped).unwrap(),
            5
        );
        assert_eq!(
            *m.get_or_make(1, || Ok(Arc::new(6)), &mut dropped).unwrap(),
            5
        );
    }
}
