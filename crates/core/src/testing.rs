//! For cairn's tests only.

use std::io::Write;

/// Records that `test` could not run here (not root, a tool or library missing): one line
/// `SKIP <test>: <reason>` on stderr and appended to the file named by `$CAIRN_SKIP_LOG`,
/// which scripts/test.sh counts as skipped instead of passed.
pub fn skip(test: &str, reason: &str) {
    let line = format!("SKIP {test}: {reason}");
    eprintln!("{line}");
    if let Some(path) = std::env::var_os("CAIRN_SKIP_LOG") {
        let appended = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .and_then(|mut f| f.write_all(format!("{line}\n").as_bytes()));
        if let Err(e) = appended {
            eprintln!("cannot append to CAIRN_SKIP_LOG {}: {e}", path.display());
        }
    }
}
