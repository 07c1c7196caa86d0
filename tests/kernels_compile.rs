//! Every `kernels/*.cu` compiles under NVRTC for every CI architecture — on a machine without a
//! GPU. Skips (with a message) when NVRTC is absent, unless `NNFUSE_REQUIRE_NVRTC=1` (CI and the
//! README's test script set it), in which case a missing NVRTC fails.

use nnfuse::internals::kernels;

#[test]
fn every_kernel_compiles_for_ci_archs() {
    if !kernels::nvrtc_present() {
        let required = std::env::var("NNFUSE_REQUIRE_NVRTC").is_ok_and(|v| v == "1");
        assert!(
            !required,
            "NNFUSE_REQUIRE_NVRTC=1 but libnvrtc.so.13 cannot be loaded (LD_LIBRARY_PATH?)"
        );
        eprintln!("skipping: NVRTC not found (set NNFUSE_REQUIRE_NVRTC=1 to make this a failure)");
        return;
    }
    let (major, minor) = kernels::nvrtc_version().unwrap();
    eprintln!("NVRTC {major}.{minor}");
    for file in kernels::ALL {
        for arch in kernels::CI_ARCHS.iter().chain(["compute_90"].iter()) {
            let image = kernels::compile(file, arch)
                .unwrap_or_else(|e| panic!("{} for {arch}: {e}", file.name));
            assert!(
                image.bytes().len() > 100,
                "{} for {arch}: empty image",
                file.name
            );
        }
    }
}

#[test]
fn compile_errors_carry_the_log() {
    if !kernels::nvrtc_present() {
        eprintln!("skipping: NVRTC not found");
        return;
    }
    static BAD: kernels::KernelFile = kernels::KernelFile {
        name: "bad.cu",
        source: "extern \"C\" __global__ void k(float* x) { x[0] = undefined_symbol; }",
    };
    let e = kernels::compile(&BAD, "sm_90").unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("bad.cu") && msg.contains("undefined_symbol"),
        "{msg}"
    );
}

/// `build.rs` embeds every `kernels/*.cu` on disk, so a new kernel file cannot be forgotten
/// (and the NVRTC test above compiles it): each one is in `ALL` once, its source starting with
/// the prelude and ending with the file's bytes; no entry of `ALL` names a file that is gone.
/// Needs no NVRTC.
#[test]
fn every_kernel_file_on_disk_is_in_all() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels");
    let prelude = std::fs::read_to_string(dir.join("prelude.cuh")).unwrap();
    let mut on_disk: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.ends_with(".cu"))
        .collect();
    on_disk.sort();
    let listed: Vec<&str> = kernels::ALL.iter().map(|f| f.name).collect();
    assert_eq!(listed, on_disk, "kernels::ALL against kernels/*.cu");
    for f in kernels::ALL {
        let text = std::fs::read_to_string(dir.join(f.name)).unwrap();
        assert!(f.source.starts_with(&prelude), "{}: no prelude", f.name);
        let tail = format!("\n#line 1 \"{}\"\n{text}", f.name);
        assert!(
            f.source.ends_with(&tail),
            "{}: not the file on disk",
            f.name
        );
    }
}
