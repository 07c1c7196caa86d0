//! Attacks on nnfuse's on-disk caches by another local user or a hostile file, and what nnfuse
//! does about each (docs/RELIABILITY.md, "Cache attacks", lists them): the kernel-image folder
//! (whose files nnfuse loads into the GPU) and the tuning file (JSON shared by processes).
//!
//! CPU only, no NVRTC needed: images are written with `write_cached` and read with
//! `read_cached`, the tuning file through GEMM's `save_file` / `load_file`. Tests that must
//! survive a hang or a memory blow-up run the attacked call in a thread with a deadline, or in a
//! child process (this test binary again) with a capped address space.

#![cfg(unix)]

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::mpsc;
use std::time::Duration;

use nnfuse::gemm::{Algo, Alignment, Choice, CublasAlgo, Key, Origin, Problem};
use nnfuse::internals::gemm::{load_file, save_file, DeviceTag};
use nnfuse::internals::kernels::{self, Image, ImageKey, KernelFile};
use nnfuse::DType;

use common::TempDir;

/// Folders named `nnfuse-attack-TAG-…`, private to the user.
impl TempDir {
    fn new(tag: &str) -> TempDir {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let d =
            std::env::temp_dir().join(format!("nnfuse-attack-{tag}-{}-{t}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o700)).unwrap();
        TempDir(d)
    }
    fn path(&self) -> &Path {
        &self.0
    }
}

fn mode(p: &Path) -> u32 {
    std::fs::metadata(p).unwrap().permissions().mode() & 0o777
}

fn chmod(p: &Path, m: u32) {
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(m)).unwrap();
}

fn mkfifo(p: &Path) {
    let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0, "mkfifo");
}

/// Runs `f` on a thread and returns its result, or `None` when it has not finished after
/// `secs` seconds (the thread is left behind: it is blocked, which is the failure).
fn within<T: Send + 'static>(secs: u64, f: impl FnOnce() -> T + Send + 'static) -> Option<T> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(Duration::from_secs(secs)).ok()
}

/// Set in a child process started by [`in_capped_child`]: the child's role.
const CHILD: &str = "NNFUSE_ATTACK_CHILD";

/// Starts the test `name` of this binary again in a child process with `CHILD=role` and
/// `envs`.
fn run_child(name: &str, role: &str, envs: &[(&str, &str)]) -> std::process::Child {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([name, "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD, role);
    for (k, v) in envs {
        cmd.env(k, v);
    }
    cmd.stdout(std::process::Stdio::null());
    cmd.spawn().unwrap()
}

/// Runs the test `name` in a child process that caps its own address space first
/// ([`cap_memory`]), so that an unbounded read ends in the child instead of exhausting the
/// machine; returns whether the child succeeded.
fn in_capped_child(name: &str, envs: &[(&str, &str)]) -> bool {
    run_child(name, "capped", envs).wait().unwrap().success()
}

/// The process's peak resident set (`VmHWM` in `/proc/self/status`), in bytes.
fn peak_rss() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    let kb: u64 = s
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    kb << 10
}

/// In a child, after the attacked read: it must not have taken memory (a read that stops only
/// when the 2 GiB cap refuses more memory returns an error too, so the result alone is not
/// proof).
fn assert_little_memory() {
    let peak = peak_rss();
    assert!(peak < 256 << 20, "peak resident set {} MiB", peak >> 20);
}

/// In a child: at most 2 GiB of address space.
fn cap_memory() {
    let lim = libc::rlimit {
        rlim_cur: 2 << 30,
        rlim_max: 2 << 30,
    };
    // SAFETY: a valid rlimit.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_AS, &lim) }, 0);
}

// ---------------------------------------------------------------------------------------------
// The kernel-image folder.

static TINY: KernelFile = KernelFile {
    name: "tiny.cu",
    source: "extern \"C\" __global__ void k(float* x) { x[0] = 1.0f; }",
};

fn key() -> ImageKey {
    ImageKey::with_version(&TINY, "sm_90", (13, 0))
}

/// A 64-bit little-endian ELF header with no program or section headers, and `extra` bytes.
fn elf(extra: usize) -> Vec<u8> {
    let mut b = vec![0u8; 64 + extra];
    b[..4].copy_from_slice(b"\x7fELF");
    b[4] = 2;
    b[5] = 1;
    b[0x34] = 64;
    b
}

/// A cache folder holding a good image for [`key`]; returns the folder and the file's path.
fn cache_with_image(tag: &str) -> (TempDir, PathBuf) {
    let d = TempDir::new(tag);
    let path = kernels::write_cached(d.path(), &key(), &Image::Cubin(elf(64))).unwrap();
    assert!(kernels::read_cached(d.path(), &key()).unwrap().is_some());
    (d, path)
}

#[test]
fn kernel_cache_refuses_a_folder_others_can_write() {
    for m in [0o777, 0o770, 0o702] {
        let (d, _) = cache_with_image("dir-mode");
        chmod(d.path(), m);
        assert!(
            kernels::read_cached(d.path(), &key()).is_err(),
            "an image in a folder of mode {m:o} was used"
        );
        // Nor is anything written there.
        assert!(kernels::write_cached(d.path(), &key(), &Image::Cubin(elf(1))).is_err());
        chmod(d.path(), 0o700);
    }
}

#[test]
fn kernel_cache_refuses_a_file_others_can_write() {
    for m in [0o666, 0o620, 0o602] {
        let (_d, path) = cache_with_image("file-mode");
        chmod(&path, m);
        assert!(
            kernels::read_cached(path.parent().unwrap(), &key()).is_err(),
            "an image file of mode {m:o} was used"
        );
    }
}

#[test]
fn kernel_cache_refuses_a_file_or_folder_of_another_user() {
    // SAFETY: no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipping: only root can give a file to another user");
        return;
    }
    let chown = |p: &Path| std::os::unix::fs::chown(p, Some(65534), Some(65534)).unwrap();
    let (d, path) = cache_with_image("owner-file");
    chown(&path);
    assert!(kernels::read_cached(d.path(), &key()).is_err(), "file");
    let (d, _) = cache_with_image("owner-dir");
    chown(d.path());
    assert!(kernels::read_cached(d.path(), &key()).is_err(), "folder");
}

#[test]
fn kernel_cache_folder_and_files_are_created_private() {
    let d = TempDir::new("created");
    let dir = d.path().join("a").join("nnfuse");
    let path = kernels::write_cached(&dir, &key(), &Image::Cubin(elf(64))).unwrap();
    assert_eq!(mode(&dir), 0o700, "folder");
    assert_eq!(mode(&path), 0o600, "file");
}

#[test]
fn kernel_cache_does_not_block_on_a_fifo() {
    let d = TempDir::new("fifo");
    mkfifo(&d.path().join(key().file_name()));
    let dir = d.path().to_path_buf();
    let r = within(10, move || {
        kernels::read_cached(&dir, &key()).map(|i| i.is_some())
    });
    let r = r.expect("read_cached blocked on a FIFO");
    assert!(r.is_err(), "{r:?}");
}

#[test]
fn kernel_cache_does_not_follow_a_symlink_to_dev_zero() {
    if std::env::var(CHILD).is_ok() {
        cap_memory();
        let d = TempDir::new("zero");
        std::os::unix::fs::symlink("/dev/zero", d.path().join(key().file_name())).unwrap();
        assert!(kernels::read_cached(d.path(), &key()).is_err());
        assert_little_memory();
        return;
    }
    assert!(
        in_capped_child("kernel_cache_does_not_follow_a_symlink_to_dev_zero", &[]),
        "reading a symlink to /dev/zero did not end in a refusal"
    );
}

/// Plants symlinks under every name the old writer's temporary file could take
/// (`.{name}.tmp.{pid}.{counter}`) pointing to a victim file, and returns the victim.
fn plant_tmp_symlinks(dir: &Path, name: &str, victim_dir: &Path) -> PathBuf {
    let victim = victim_dir.join("victim.txt");
    std::fs::write(&victim, b"precious").unwrap();
    for n in 0..256 {
        let link = dir.join(format!(".{name}.tmp.{}.{n}", std::process::id()));
        std::os::unix::fs::symlink(&victim, link).unwrap();
    }
    victim
}

#[test]
fn kernel_cache_temporary_files_do_not_follow_planted_symlinks() {
    let d = TempDir::new("tmp-link");
    let v = TempDir::new("victim");
    let victim = plant_tmp_symlinks(d.path(), &key().file_name(), v.path());
    kernels::write_cached(d.path(), &key(), &Image::Cubin(elf(64))).unwrap();
    assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
    assert!(kernels::read_cached(d.path(), &key()).unwrap().is_some());
}

/// `image` either is refused by `write_cached` or, once written, by `read_cached`: it never
/// comes back to be loaded.
fn never_loaded(arch: &str, image: Image) {
    let d = TempDir::new("bad-image");
    let k = ImageKey::with_version(&TINY, arch, (13, 0));
    if kernels::write_cached(d.path(), &k, &image).is_ok() {
        let r = kernels::read_cached(d.path(), &k);
        assert!(r.is_err(), "{:?}", r.map(|i| i.map(|i| i.bytes().len())));
    }
}

#[test]
fn kernel_cache_refuses_elf_tables_past_the_end() {
    // One section header at 64, claiming 1 MiB of contents in a 128-byte image.
    let mut b = elf(64);
    b[0x28..0x30].copy_from_slice(&64u64.to_le_bytes());
    b[0x3a] = 64;
    b[0x3c] = 1;
    b[64 + 0x18..64 + 0x20].copy_from_slice(&64u64.to_le_bytes());
    b[64 + 0x20..64 + 0x28].copy_from_slice(&(1u64 << 20).to_le_bytes());
    never_loaded("sm_90", Image::Cubin(b));
    // A section header table that starts past the end.
    let mut b = elf(0);
    b[0x28..0x30].copy_from_slice(&4096u64.to_le_bytes());
    b[0x3a] = 64;
    b[0x3c] = 3;
    never_loaded("sm_90", Image::Cubin(b));
}

#[test]
fn kernel_cache_refuses_ptx_without_its_nul() {
    never_loaded(
        "compute_90",
        Image::Ptx(b".version 8.0\n.target sm_90".to_vec()),
    );
}

// ---------------------------------------------------------------------------------------------
// The tuning file.

fn tag() -> DeviceTag {
    DeviceTag {
        name: "NVIDIA H100 80GB HBM3".into(),
        compute_capability: (9, 0),
        cublas: (13, 1, 0),
        cublaslt: 130100,
    }
}

/// A distinct GEMM entry per `i`.
fn entry(i: usize) -> (Key, Choice) {
    let p = Problem::packed(1, 64 + i, 64, 64);
    let k = Key::new(0, &p, DType::F16, Alignment::MAX).unwrap();
    let c = Choice {
        algo: Algo::Cublas(CublasAlgo::DEFAULT),
        config: None,
        workspace: 0,
        median_us: 1.0,
        default_us: 1.0,
        candidates: 1,
        origin: Origin::Searched,
    };
    (k, c)
}

#[test]
fn tuning_file_fifo_does_not_block_load_or_save() {
    let d = TempDir::new("tuning-fifo");
    let f = d.path().join("tuning.json");
    mkfifo(&f);
    let g = f.clone();
    let loaded = within(10, move || load_file(&g, &tag(), 0)).expect("load_file blocked");
    assert!(loaded.entries.is_empty());
    assert!(!loaded.warnings.is_empty());
    let g = f.clone();
    let saved = within(10, move || save_file(&g, &tag(), &[entry(0)]).is_ok());
    // Refused rather than replacing what it cannot read.
    assert_eq!(saved, Some(false), "save_file blocked or replaced a FIFO");
}

#[test]
fn tuning_file_symlink_to_dev_zero_does_not_exhaust_memory() {
    if std::env::var(CHILD).is_ok() {
        cap_memory();
        let d = TempDir::new("tuning-zero");
        let f = d.path().join("tuning.json");
        std::os::unix::fs::symlink("/dev/zero", &f).unwrap();
        let loaded = load_file(&f, &tag(), 0);
        assert!(loaded.entries.is_empty() && !loaded.warnings.is_empty());
        assert_little_memory();
        return;
    }
    assert!(
        in_capped_child(
            "tuning_file_symlink_to_dev_zero_does_not_exhaust_memory",
            &[]
        ),
        "reading /dev/zero as the tuning file did not end in a warning"
    );
}

#[test]
fn tuning_file_temporary_files_do_not_follow_planted_symlinks() {
    let d = TempDir::new("tuning-link");
    let v = TempDir::new("tuning-victim");
    let victim = plant_tmp_symlinks(d.path(), "tuning.json", v.path());
    let f = d.path().join("tuning.json");
    save_file(&f, &tag(), &[entry(0)]).unwrap();
    assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
    assert_eq!(load_file(&f, &tag(), 0).entries.len(), 1);
}

/// The files in `d` whose names start with `prefix`, with their bytes.
fn kept(d: &TempDir, prefix: &str) -> Vec<Vec<u8>> {
    d.names()
        .iter()
        .filter(|n| n.starts_with(prefix))
        .map(|n| std::fs::read(d.path().join(n)).unwrap())
        .collect()
}

#[test]
fn an_unreadable_tuning_file_is_kept_aside() {
    let d = TempDir::new("tuning-utf8");
    let f = d.path().join("tuning.json");
    save_file(&f, &tag(), &[entry(0)]).unwrap();
    // One byte that is not UTF-8, in an otherwise good file holding another device's section.
    let mut bytes = std::fs::read(&f).unwrap();
    let at = bytes.len() - 3;
    bytes.insert(at, 0xff);
    std::fs::write(&f, &bytes).unwrap();
    save_file(&f, &tag(), &[entry(1)]).unwrap();
    assert_eq!(
        kept(&d, "tuning.json.unreadable."),
        vec![bytes],
        "{:?}",
        d.names()
    );
    assert_eq!(load_file(&f, &tag(), 0).entries.len(), 1);
}

#[test]
fn another_versions_tuning_file_is_kept_aside() {
    let d = TempDir::new("tuning-version");
    let f = d.path().join("tuning.json");
    let v2 = br#"{ "format": "nnfuse-gemm-tuning", "version": 2, "sections": [ { "x": 1 } ],
                   "conv": { "version": 1, "sections": [ { "y": 2 } ] } }"#;
    std::fs::write(&f, v2).unwrap();
    save_file(&f, &tag(), &[entry(0)]).unwrap();
    assert_eq!(
        kept(&d, "tuning.json.version-2."),
        vec![v2.to_vec()],
        "{:?}",
        d.names()
    );
    assert_eq!(load_file(&f, &tag(), 0).entries.len(), 1);
}

/// Set in the saver children of the next test: the tuning file and the first entry's index.
const SAVER_FILE: &str = "NNFUSE_ATTACK_SAVER_FILE";
const SAVER_FROM: &str = "NNFUSE_ATTACK_SAVER_FROM";
const SAVES: usize = 40;

#[test]
fn two_processes_saving_at_once_lose_no_entry() {
    if let (Ok(f), Ok(from)) = (std::env::var(SAVER_FILE), std::env::var(SAVER_FROM)) {
        // A child: one save per entry, each a read-merge-rename of the shared file.
        let from: usize = from.parse().unwrap();
        for i in from..from + SAVES {
            save_file(Path::new(&f), &tag(), &[entry(i)]).unwrap();
        }
        return;
    }
    let d = TempDir::new("tuning-race");
    let f = d.path().join("tuning.json");
    let fs = f.to_string_lossy().into_owned();
    let name = "two_processes_saving_at_once_lose_no_entry";
    let children: Vec<_> = ["0", "1000"]
        .iter()
        .map(|from| run_child(name, "saver", &[(SAVER_FILE, &fs), (SAVER_FROM, from)]))
        .collect();
    for mut c in children {
        assert!(c.wait().unwrap().success(), "a saver failed");
    }
    let got = load_file(&f, &tag(), 0).entries.len();
    assert_eq!(got, 2 * SAVES, "entries lost between two saving processes");
}
