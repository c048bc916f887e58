//! `cairn man DIR`: the manual pages, `cairn.1` and one `cairn-COMMAND.1` per command,
//! rendered from the same clap definitions `--help` prints, so the two never disagree.

use std::io::Write;
use std::path::{Path, PathBuf};

use clap::CommandFactory;

use crate::settings::Cli;

/// Writes every page into `dir` (created if missing) and returns their paths.
pub fn write_pages(dir: &Path) -> Result<Vec<PathBuf>, String> {
    std::fs::create_dir_all(dir)
        .map_err(|e| format!("man: cannot create {}: {e}", dir.display()))?;
    let mut cairn = Cli::command().disable_help_subcommand(true);
    // Building propagates the global options into every command and names each one as
    // its page does (`cairn-serve`, used as `cairn serve`).
    cairn.build();
    let mut pages = vec![cairn.clone()];
    pages.extend(
        cairn
            .get_subcommands()
            .filter(|c| !c.is_hide_set())
            .cloned(),
    );
    let names: Vec<String> = pages.iter().map(page_name).collect();
    let version = cairn.get_version().unwrap_or_default().to_string();
    let mut written = Vec::with_capacity(pages.len());
    for (page, name) in pages.into_iter().zip(&names) {
        let path = dir.join(format!("{name}.1"));
        let text = render(page, name, &names, &version)
            .map_err(|e| format!("man: cannot render {name}: {e}"))?;
        std::fs::File::create(&path)
            .and_then(|mut f| f.write_all(&text))
            .map_err(|e| format!("man: cannot write {}: {e}", path.display()))?;
        written.push(path);
    }
    Ok(written)
}

/// `cairn` for the top page, `cairn-serve` for `cairn serve`.
fn page_name(cmd: &clap::Command) -> String {
    cmd.get_display_name()
        .unwrap_or_else(|| cmd.get_name())
        .to_string()
}

/// One page: clap_mangen's sections, then SEE ALSO naming every other page.
fn render(
    cmd: clap::Command,
    name: &str,
    all: &[String],
    version: &str,
) -> std::io::Result<Vec<u8>> {
    let man = clap_mangen::Man::new(cmd)
        .manual("cairn manual")
        .source(format!("cairn {version}"));
    let mut text = Vec::new();
    man.render(&mut text)?;
    let mut text = kept_as_written(&text);
    let others: Vec<String> = all
        .iter()
        .filter(|n| n.as_str() != name)
        .map(|n| format!("\\fB{n}\\fR(1)"))
        .collect();
    writeln!(text, ".SH \"SEE ALSO\"")?;
    writeln!(
        text,
        "{}; README.md in cairn's source tree for walkthroughs and the reference.",
        others.join(", ")
    )?;
    Ok(text)
}

/// The page with its EXTRA section (the text after the options) as it was laid out: its
/// indented lines (lists in columns, examples, stack file tables) in no-fill mode, so
/// that roff keeps them as they are instead of running them together into fragments,
/// and its prose filled to the page's width.
fn kept_as_written(page: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(page.len() + 256);
    let (mut extra, mut kept) = (false, false);
    for line in page.split_inclusive(|&b| b == b'\n') {
        if line.starts_with(b".SH") {
            if kept {
                out.extend_from_slice(b".fi\n");
            }
            extra = line.starts_with(b".SH EXTRA");
            kept = false;
            out.extend_from_slice(line);
            continue;
        }
        // Fill requests of the section's own, if clap_mangen wrote any: decided per
        // line here.
        if extra && (line == b".nf\n" || line == b".fi\n") {
            continue;
        }
        if extra {
            let indented = line.starts_with(b" ");
            if indented && !kept {
                out.extend_from_slice(b".nf\n");
                kept = true;
            } else if !indented && kept {
                out.extend_from_slice(b".fi\n");
                kept = false;
            }
        }
        out.extend_from_slice(line);
    }
    if kept {
        out.extend_from_slice(b".fi\n");
    }
    out
}
