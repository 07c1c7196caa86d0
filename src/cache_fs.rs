//! The file-system side of nnfuse's caches (the kernel-image folder, the tuning file), written
//! for folders that other local users may reach: nothing here trusts what a path names.
//!
//! - Reads open the path without blocking (`O_NONBLOCK`, so a FIFO cannot stall the caller),
//!   check the opened handle (`fstat`, not the path) is a regular file of at most
//!   [`MAX_FILE_BYTES`], and read no more than that (a file that grows meanwhile, or a device
//!   such as `/dev/zero`, cannot exhaust memory).
//! - Writes go to a fresh, randomly named file created with `O_EXCL` in the target's folder
//!   ([`tempfile`]), which a planted symlink cannot redirect, flushed, then renamed over the
//!   target.
//! - [`private_dir`] and [`check_private`] refuse a folder or file another user owns or may
//!   write (the kernel cache runs what it reads).
//! - [`FileLock`]: an advisory lock on a file beside the target ([`fs4`]'s `flock`), so that
//!   processes serialise their read-merge-rename.

use std::fs::{File, Metadata, OpenOptions};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use fs4::fs_std::FileExt;

/// The most bytes a cache file may hold (kernel images are a few MiB, tuning files less).
pub(crate) const MAX_FILE_BYTES: u64 = 64 << 20;

/// How long a save waits for another process's lock before giving up (an error, not a hang).
pub(crate) const LOCK_TIMEOUT: Duration = Duration::from_secs(30);

fn invalid(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg)
}

/// Opens `path` for reading without blocking on a FIFO (and, with `nofollow`, without following
/// a symlink); `None` when it does not exist. The handle is checked to be a regular file of at
/// most [`MAX_FILE_BYTES`]; its metadata comes from the handle.
pub(crate) fn open_regular(path: &Path, nofollow: bool) -> io::Result<Option<(File, Metadata)>> {
    let mut opts = OpenOptions::new();
    opts.read(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        let flags = libc::O_NONBLOCK | if nofollow { libc::O_NOFOLLOW } else { 0 };
        opts.custom_flags(flags);
    }
    #[cfg(not(unix))]
    let _ = nofollow;
    let file = match opts.open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    let meta = file.metadata()?;
    if !meta.is_file() {
        return Err(invalid(
            "not a regular file (a folder, FIFO, socket or device)".into(),
        ));
    }
    if meta.len() > MAX_FILE_BYTES {
        return Err(invalid(format!(
            "{} bytes, more than the {} MiB a cache file may hold",
            meta.len(),
            MAX_FILE_BYTES >> 20
        )));
    }
    Ok(Some((file, meta)))
}

/// Reads an opened file, at most [`MAX_FILE_BYTES`] (a longer one is an error).
pub(crate) fn read_capped(file: File) -> io::Result<Vec<u8>> {
    let mut bytes = Vec::new();
    file.take(MAX_FILE_BYTES + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > MAX_FILE_BYTES {
        return Err(invalid(format!(
            "grew past the {} MiB a cache file may hold while being read",
            MAX_FILE_BYTES >> 20
        )));
    }
    Ok(bytes)
}

/// The bytes of the regular file at `path` ([`open_regular`], [`read_capped`]); `None` when it
/// does not exist.
pub(crate) fn read_regular(path: &Path) -> io::Result<Option<Vec<u8>>> {
    match open_regular(path, false)? {
        Some((file, _)) => read_capped(file).map(Some),
        None => Ok(None),
    }
}

/// The effective user id of this process.
#[cfg(unix)]
fn my_uid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// Why `meta` (of `what`) may not be trusted: owned by another user, or writable by group or
/// others. `Ok` on platforms without Unix permissions.
pub(crate) fn check_private(meta: &Metadata, what: &str) -> Result<(), String> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        if meta.uid() != my_uid() {
            return Err(format!(
                "{what} is owned by user {}, not by this process's user {}",
                meta.uid(),
                my_uid()
            ));
        }
        if meta.mode() & 0o022 != 0 {
            return Err(format!(
                "{what} is writable by group or others (mode {:o})",
                meta.mode() & 0o7777
            ));
        }
    }
    #[cfg(not(unix))]
    let _ = (meta, what);
    Ok(())
}

/// Whether an ancestor folder lets another user swap what lies below it: owned by someone other
/// than this user or root, or writable by group/others without the sticky bit (`/tmp` has it).
#[cfg(unix)]
fn check_ancestor(dir: &Path) -> Result<(), String> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    if meta.uid() != my_uid() && meta.uid() != 0 {
        return Err(format!(
            "its parent {} is owned by user {}",
            dir.display(),
            meta.uid()
        ));
    }
    if meta.mode() & 0o022 != 0 && meta.mode() & 0o1000 == 0 {
        return Err(format!(
            "its parent {} is writable by group or others without the sticky bit (mode {:o})",
            dir.display(),
            meta.mode() & 0o7777
        ));
    }
    Ok(())
}

/// Makes sure `dir` is a folder only this user controls: created (mode 0700, parents too) when
/// `create` and missing; refused when it is not a folder, another user owns it, group or others
/// may write it, or one of its parents lets another user replace it.
pub(crate) fn private_dir(dir: &Path, create: bool) -> Result<(), String> {
    if create {
        let mut b = std::fs::DirBuilder::new();
        b.recursive(true);
        #[cfg(unix)]
        {
            use std::os::unix::fs::DirBuilderExt;
            b.mode(0o700);
        }
        b.create(dir)
            .map_err(|e| format!("cannot be created: {e}"))?;
    }
    let meta = std::fs::metadata(dir).map_err(|e| e.to_string())?;
    if !meta.is_dir() {
        return Err("is not a folder".into());
    }
    check_private(&meta, "the folder")?;
    #[cfg(unix)]
    {
        let full = std::fs::canonicalize(dir).map_err(|e| e.to_string())?;
        for a in full.ancestors().skip(1) {
            check_ancestor(a)?;
        }
    }
    Ok(())
}

/// The folder `path` lies in (`.` for a bare file name).
pub(crate) fn folder_of(path: &Path) -> PathBuf {
    match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// Writes `bytes` to `path` atomically: a new file with a random name created with `O_EXCL` in
/// `path`'s folder (permissions `mode` less the umask), flushed, then renamed over `path`. The
/// temporary file is removed on failure.
pub(crate) fn write_atomic(path: &Path, bytes: &[u8], mode: u32) -> io::Result<()> {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let prefix = format!(".{name}.");
    let mut b = tempfile::Builder::new();
    b.prefix(&prefix).suffix(".tmp");
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        b.permissions(std::fs::Permissions::from_mode(mode));
    }
    #[cfg(not(unix))]
    let _ = mode;
    let mut tmp = b.tempfile_in(folder_of(path))?;
    tmp.write_all(bytes)?;
    tmp.as_file().sync_all()?;
    tmp.persist(path).map_err(|e| e.error)?;
    Ok(())
}

/// Renames `path` to `<path>.<label>.<unix seconds>` (a free name: `.1`, `.2`, … appended when
/// taken) and returns the new path.
pub(crate) fn move_aside(path: &Path, label: &str) -> io::Result<PathBuf> {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let base = format!("{}.{label}.{secs}", path.display());
    let mut to = PathBuf::from(&base);
    let mut n = 0;
    while std::fs::symlink_metadata(&to).is_ok() {
        n += 1;
        to = PathBuf::from(format!("{base}.{n}"));
    }
    std::fs::rename(path, &to)?;
    Ok(to)
}

/// An exclusive advisory lock (`flock`) on `<path>.lock`, held until dropped. Every nnfuse
/// process takes it around its read-merge-rename of `path`.
#[derive(Debug)]
pub(crate) struct FileLock(File);

impl FileLock {
    /// The path of the lock file of `path`.
    pub(crate) fn path_for(path: &Path) -> PathBuf {
        let mut s = path.as_os_str().to_os_string();
        s.push(".lock");
        PathBuf::from(s)
    }

    /// Takes the lock of `path`, waiting at most `timeout` for another holder. The lock file is
    /// opened without following a symlink or blocking on a FIFO, and must be a regular file.
    pub(crate) fn acquire(path: &Path, timeout: Duration) -> io::Result<FileLock> {
        let lock_path = Self::path_for(path);
        let mut opts = OpenOptions::new();
        opts.read(true).write(true).create(true).truncate(false);
        #[cfg(unix)]
        {
            use std::os::unix::fs::OpenOptionsExt;
            opts.custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
                .mode(0o644);
        }
        let file = opts.open(&lock_path)?;
        if !file.metadata()?.is_file() {
            return Err(invalid(format!(
                "lock file {} is not a regular file",
                lock_path.display()
            )));
        }
        let start = Instant::now();
        loop {
            if file.try_lock_exclusive()? {
                return Ok(FileLock(file));
            }
            if start.elapsed() >= timeout {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!(
                        "another process has held {} for more than {} s",
                        lock_path.display(),
                        timeout.as_secs()
                    ),
                ));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

impl Drop for FileLock {
    fn drop(&mut self) {
        // Closing the file releases the lock too; unlocking first only makes it explicit.
        let _ = FileExt::unlock(&self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fresh(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("nnfuse-cache-fs-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn a_file_over_the_cap_is_not_read() {
        let d = fresh("cap");
        let f = d.join("big");
        // Sparse: no disk or memory is used until someone reads it.
        File::create(&f)
            .unwrap()
            .set_len(MAX_FILE_BYTES + 1)
            .unwrap();
        let e = read_regular(&f).unwrap_err();
        assert!(e.to_string().contains("64 MiB"), "{e}");
        File::create(&f).unwrap().set_len(10).unwrap();
        assert_eq!(read_regular(&f).unwrap(), Some(vec![0u8; 10]));
        assert_eq!(read_regular(&d.join("absent")).unwrap(), None);
        assert!(read_regular(&d).is_err(), "a folder");
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn moved_aside_files_never_overwrite_each_other() {
        let d = fresh("aside");
        let f = d.join("t.json");
        let mut kept = Vec::new();
        for i in 0..3 {
            std::fs::write(&f, [i]).unwrap();
            kept.push(move_aside(&f, "unreadable").unwrap());
        }
        assert!(!f.exists());
        for (i, k) in kept.iter().enumerate() {
            assert_eq!(std::fs::read(k).unwrap(), [i as u8]);
            let name = k.file_name().unwrap().to_string_lossy().into_owned();
            assert!(name.starts_with("t.json.unreadable."), "{name}");
        }
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn the_file_lock_excludes_a_second_holder_until_dropped() {
        let d = fresh("lock");
        let f = d.join("t.json");
        let first = FileLock::acquire(&f, Duration::ZERO).unwrap();
        // flock belongs to the open file: a second open (as another process would) waits.
        let e = FileLock::acquire(&f, Duration::from_millis(20)).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        drop(first);
        FileLock::acquire(&f, Duration::ZERO).unwrap();
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[cfg(unix)]
    #[test]
    fn private_dir_creates_0700_and_refuses_what_others_can_write() {
        use std::os::unix::fs::PermissionsExt;
        let d = fresh("private");
        let p = d.join("a").join("b");
        private_dir(&p, true).unwrap();
        let m = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o7777;
        assert_eq!(m(&p), 0o700);
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o777)).unwrap();
        assert!(private_dir(&p, true).is_err(), "world-writable folder");
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o700)).unwrap();
        // A parent others can write (without the sticky bit) lets them swap the folder.
        let parent = d.join("a");
        std::fs::set_permissions(&parent, std::fs::Permissions::from_mode(0o777)).unwrap();
        assert!(private_dir(&p, true).is_err(), "world-writable parent");
        std::fs::set_permissions(&parent, std::fs::Permissions::from_mode(0o1777)).unwrap();
        private_dir(&p, true).unwrap();
        std::fs::remove_dir_all(&d).unwrap();
    }
}
