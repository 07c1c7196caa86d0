//! The disk cache of NVRTC-compiled kernel images, for real, on a machine without a GPU: compile
//! → file written → a second load reads the file and gives identical bytes; a corrupt,
//! truncated, foreign or unreadable file is recompiled and replaced; an unwritable folder only
//! costs the cache. Skips (with a message) when NVRTC is absent, unless
//! `NNFUSE_REQUIRE_NVRTC=1` (CI and `scripts/test.sh` set it).

use std::path::{Path, PathBuf};

use nnfuse::internals::kernels::{self, Image, ImageKey, ImageOrigin};

fn nvrtc_or_skip() -> bool {
    if kernels::nvrtc_present() {
        return true;
    }
    let required = std::env::var("NNFUSE_REQUIRE_NVRTC").is_ok_and(|v| v == "1");
    assert!(
        !required,
        "NNFUSE_REQUIRE_NVRTC=1 but libnvrtc.so.13 cannot be loaded (LD_LIBRARY_PATH?)"
    );
    eprintln!("skipping: NVRTC not found (set NNFUSE_REQUIRE_NVRTC=1 to make this a failure)");
    false
}

/// A fresh, empty folder under the system's temporary folder.
fn fresh_dir(tag: &str) -> PathBuf {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    let d = std::env::temp_dir().join(format!(
        "nnfuse-kernel-cache-{tag}-{}-{t}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn load(dir: &Path, arch: &str) -> (Image, ImageOrigin) {
    kernels::load_or_compile(&kernels::UTIL, arch, Some(dir))
        .unwrap_or_else(|e| panic!("load_or_compile(util.cu, {arch}): {e}"))
}

/// Every file in `dir` (names), sorted.
fn listing(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

#[test]
fn compile_then_read_back_identical_bytes() {
    if !nvrtc_or_skip() {
        return;
    }
    for arch in ["sm_80", "sm_90", "compute_90"] {
        let dir = fresh_dir(arch);
        let key = ImageKey::new(&kernels::UTIL, arch).unwrap();
        let (first, origin) = load(&dir, arch);
        assert_eq!(origin, ImageOrigin::Compiled, "{arch}: empty cache");
        assert_eq!(listing(&dir), vec![key.file_name()], "{arch}: one file");
        let (second, origin) = load(&dir, arch);
        assert_eq!(origin, ImageOrigin::Disk, "{arch}: second load");
        assert_eq!(first.bytes(), second.bytes(), "{arch}: bytes differ");
        assert_eq!(
            std::mem::discriminant(&first),
            std::mem::discriminant(&second),
            "{arch}: image kind differs"
        );
        assert!(matches!(second, Image::Cubin(_)) == arch.starts_with("sm_"));
        // What is on disk decodes to the same image, without NVRTC's help.
        let on_disk = kernels::read_cached(&dir, &key).unwrap().unwrap();
        assert_eq!(on_disk.bytes(), first.bytes());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

#[test]
fn damaged_files_are_recompiled_and_replaced() {
    if !nvrtc_or_skip() {
        return;
    }
    let arch = "sm_90";
    let dir = fresh_dir("damaged");
    let key = ImageKey::new(&kernels::UTIL, arch).unwrap();
    let path = dir.join(key.file_name());
    let (good, _) = load(&dir, arch);
    let file = std::fs::read(&path).unwrap();
    let other_arch = {
        // A valid file of another key under this key's name (a foreign file).
        let d = fresh_dir("foreign");
        kernels::load_or_compile(&kernels::UTIL, "sm_80", Some(&d)).unwrap();
        let k80 = ImageKey::new(&kernels::UTIL, "sm_80").unwrap();
        let bytes = std::fs::read(d.join(k80.file_name())).unwrap();
        std::fs::remove_dir_all(&d).unwrap();
        bytes
    };
    let mut flipped = file.clone();
    let mid = file.len() / 2 + 7;
    flipped[mid] ^= 0x40;
    let damages: Vec<(&str, Vec<u8>)> = vec![
        ("a flipped payload byte", flipped),
        ("truncated", file[..file.len() - 100].to_vec()),
        (
            "header only",
            file[..=file.iter().position(|&b| b == b'\n').unwrap()].to_vec(),
        ),
        ("empty", Vec::new()),
        (
            "garbage",
            (0..5000u32)
                .map(|i| i.wrapping_mul(2654435761) as u8)
                .collect(),
        ),
        ("another key's file", other_arch),
    ];
    for (what, bytes) in damages {
        std::fs::write(&path, &bytes).unwrap();
        assert!(
            kernels::read_cached(&dir, &key).is_err(),
            "{what}: accepted by read_cached"
        );
        let before = kernels::stats().disk_rejected;
        let (img, origin) = load(&dir, arch);
        assert_eq!(origin, ImageOrigin::Compiled, "{what}: not recompiled");
        assert_eq!(
            img.bytes(),
            good.bytes(),
            "{what}: recompiled image differs"
        );
        assert!(
            kernels::stats().disk_rejected > before,
            "{what}: not counted"
        );
        // Replaced by a good file: the next load reads it.
        let (again, origin) = load(&dir, arch);
        assert_eq!(origin, ImageOrigin::Disk, "{what}: file not replaced");
        assert_eq!(again.bytes(), good.bytes(), "{what}");
    }
    // A folder where the file should be: unreadable as a file, unwritable by rename.
    std::fs::remove_file(&path).unwrap();
    std::fs::create_dir(&path).unwrap();
    let (img, origin) = load(&dir, arch);
    assert_eq!(origin, ImageOrigin::Compiled);
    assert_eq!(img.bytes(), good.bytes());
    // No temporary files are left behind, whatever happened.
    assert_eq!(listing(&dir), vec![key.file_name()]);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn an_unusable_cache_folder_only_costs_the_cache() {
    if !nvrtc_or_skip() {
        return;
    }
    // The "folder" is a regular file: nothing can be read or written there.
    let dir = fresh_dir("unusable");
    std::fs::write(&dir, b"not a folder").unwrap();
    let before = kernels::stats().disk_write_failures;
    for _ in 0..2 {
        let (img, origin) = load(&dir, "sm_80");
        assert_eq!(origin, ImageOrigin::Compiled);
        assert!(img.bytes().len() > 100);
    }
    assert!(kernels::stats().disk_write_failures >= before + 2);
    std::fs::remove_file(&dir).unwrap();
    // No folder at all: the cache is off, nothing is written anywhere.
    let (_, origin) = kernels::load_or_compile(&kernels::UTIL, "sm_80", None).unwrap();
    assert_eq!(origin, ImageOrigin::Compiled);
}

#[test]
fn concurrent_processes_share_one_folder() {
    if !nvrtc_or_skip() {
        return;
    }
    // Threads stand in for processes: each compiles or reads, writes atomically, and every
    // result is the same image; the folder ends with exactly one good file per key.
    let dir = fresh_dir("concurrent");
    let images: Vec<Vec<u8>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..4)
            .map(|_| s.spawn(|| load(&dir, "sm_80").0.bytes().to_vec()))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for img in &images[1..] {
        assert_eq!(img, &images[0]);
    }
    let key = ImageKey::new(&kernels::UTIL, "sm_80").unwrap();
    assert_eq!(listing(&dir), vec![key.file_name()]);
    assert_eq!(load(&dir, "sm_80").1, ImageOrigin::Disk);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn every_kernel_file_round_trips_through_the_cache() {
    if !nvrtc_or_skip() {
        return;
    }
    let dir = fresh_dir("all");
    for file in kernels::ALL {
        let t = std::time::Instant::now();
        let (a, o1) = kernels::load_or_compile(file, "sm_90", Some(&dir)).unwrap();
        let compile_ms = t.elapsed().as_secs_f64() * 1e3;
        let t = std::time::Instant::now();
        let (b, o2) = kernels::load_or_compile(file, "sm_90", Some(&dir)).unwrap();
        let read_ms = t.elapsed().as_secs_f64() * 1e3;
        assert_eq!(
            (o1, o2),
            (ImageOrigin::Compiled, ImageOrigin::Disk),
            "{}",
            file.name
        );
        assert_eq!(a.bytes(), b.bytes(), "{}", file.name);
        // Reported, not asserted (timing belongs in benches/startup.rs).
        eprintln!(
            "{:<18} sm_90: compile + write {compile_ms:7.1} ms, read {read_ms:5.2} ms, {} bytes",
            file.name,
            a.bytes().len()
        );
    }
    assert_eq!(listing(&dir).len(), kernels::ALL.len());
    std::fs::remove_dir_all(&dir).unwrap();
}
