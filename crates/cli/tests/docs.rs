//! The documentation a new user meets is checked like code: every stack file in
//! examples/ passes `cairn check` (changing nothing), every example the README or the
//! examples name exists, the README's links resolve, its two set-up commands open it, the
//! man pages cover every command and render cleanly, and the systemd units verify.

mod common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use common::{skip, text, tmpdir, tool};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn cairn(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_cairn"))
        .args(args)
        .output()
        .expect("run cairn")
}

fn readme() -> String {
    std::fs::read_to_string(repo().join("README.md")).expect("read README.md")
}

/// The names in a directory, to tell that a command changed nothing there.
fn listing(dir: &Path) -> BTreeSet<String> {
    std::fs::read_dir(dir)
        .expect("list a directory")
        .map(|e| {
            e.expect("an entry")
                .file_name()
                .to_string_lossy()
                .into_owned()
        })
        .collect()
}

/// The files of examples/ that belong to the tree: those git tracks in a checkout, else
/// the stack files and units (never what a walkthrough left there: images, bitmap stores,
/// a user's own stack files).
fn examples() -> BTreeSet<String> {
    let dir = repo().join("examples");
    let tracked = Command::new("git")
        .arg("-C")
        .arg(&dir)
        .args(["ls-files", "-z", "."])
        .output();
    match tracked {
        Ok(out) if out.status.success() && !out.stdout.is_empty() => text(&out.stdout)
            .split('\0')
            .filter(|n| !n.is_empty() && !n.contains('/'))
            .map(str::to_string)
            .collect(),
        _ => listing(&dir)
            .into_iter()
            .filter(|n| {
                [".toml", ".service", ".socket"]
                    .iter()
                    .any(|e| n.ends_with(e))
            })
            .collect(),
    }
}

/// Every `examples/NAME` a text mentions.
fn examples_named(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut rest = text;
    while let Some(at) = rest.find("examples/") {
        let tail = &rest[at + "examples/".len()..];
        let name: String = tail
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || "._-".contains(*c))
            .collect();
        let name = name.trim_end_matches('.').to_string();
        if !name.is_empty() {
            names.insert(name);
        }
        rest = tail;
    }
    names
}

#[test]
fn every_example_stack_file_passes_check_and_changes_nothing() {
    // Each is checked as a copy in a directory of its own, where its relative paths lead:
    // what a walkthrough left beside the examples (images, a server holding them) is not
    // what is checked.
    let all = examples();
    let files: Vec<&String> = all.iter().filter(|n| n.ends_with(".toml")).collect();
    assert!(files.len() >= 5, "examples/ has {files:?}");
    for name in files {
        let tmp = tmpdir();
        let dir = tmp.path();
        for f in &all {
            std::fs::copy(repo().join("examples").join(f), dir.join(f)).expect("copy examples");
        }
        let path = dir.join(name);
        let before = listing(dir);
        let out = cairn(&["check", path.to_str().expect("a UTF-8 path")]);
        assert_eq!(
            out.status.code(),
            Some(0),
            "cairn check examples/{name}: {}",
            text(&out.stderr)
        );
        assert!(
            text(&out.stdout).contains("switches:"),
            "cairn check examples/{name} printed no tree:\n{}",
            text(&out.stdout)
        );
        assert_eq!(
            listing(dir),
            before,
            "cairn check examples/{name} created files"
        );
    }
}

/// The walkthroughs' files: every `examples/...` the README, the examples themselves and
/// the help texts name is in the tree.
#[test]
fn every_example_named_exists() {
    let mut sources = vec![("README.md".to_string(), readme())];
    for name in examples() {
        let body = std::fs::read_to_string(repo().join("examples").join(&name)).expect("read");
        sources.push((format!("examples/{name}"), body));
    }
    let mut named = 0;
    for (source, body) in &sources {
        for name in examples_named(body) {
            named += 1;
            assert!(
                repo().join("examples").join(&name).exists(),
                "{source} names examples/{name}, which does not exist"
            );
        }
    }
    // The README's walkthroughs name their files.
    let readme_names = examples_named(&readme());
    for walkthrough in [
        "disk.toml",
        "mirror.toml",
        "cache.toml",
        "raid10.toml",
        "cairn.service",
    ] {
        assert!(
            readme_names.contains(walkthrough),
            "the README does not name examples/{walkthrough}"
        );
    }
    assert!(named > 5);
}

/// Every package scripts/test.sh installs is named where the README says what the test
/// suite installs.
#[test]
fn the_readme_names_every_package_the_test_command_installs() {
    let script = std::fs::read_to_string(repo().join("scripts/test.sh")).expect("read test.sh");
    let packages: Vec<&str> = script
        .lines()
        .filter_map(|l| l.trim().strip_prefix("install_missing "))
        .flat_map(str::split_whitespace)
        .collect();
    assert!(packages.len() >= 10, "{packages:?}");
    let readme = readme();
    let at = readme
        .find("**For the test suite**")
        .expect("the README's requirements for the test suite");
    let paragraph = &readme[at..at + readme[at..].find("\n- **").unwrap_or(readme.len() - at)];
    let words: BTreeSet<&str> = paragraph
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '-'))
        .collect();
    for p in packages {
        assert!(
            words.contains(p),
            "scripts/test.sh installs {p}; the README's list does not name it"
        );
    }
}

/// GitHub's anchor for a heading: lower case, punctuation dropped, spaces as dashes.
fn anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

#[test]
fn readme_links_resolve() {
    let readme = readme();
    let mut anchors = BTreeSet::new();
    let mut in_code = false;
    for line in readme.lines() {
        if line.starts_with("```") {
            in_code = !in_code;
        } else if !in_code && line.starts_with('#') {
            anchors.insert(anchor(line.trim_start_matches('#')));
        }
    }
    let mut links = 0;
    let mut rest = readme.as_str();
    while let Some(at) = rest.find("](") {
        let tail = &rest[at + 2..];
        let end = tail.find(')').expect("a link ends");
        let target = &tail[..end];
        links += 1;
        if let Some(a) = target.strip_prefix('#') {
            assert!(
                anchors.contains(a),
                "README links to #{a}, no heading has it"
            );
        } else if !target.contains("://") {
            let path = target.split('#').next().unwrap_or(target);
            assert!(
                repo().join(path).exists(),
                "README links to {target}, which does not exist"
            );
        }
        rest = tail;
    }
    assert!(links > 20, "only {links} links found");
}

/// The two set-up commands open the README: the main job on its built-in default, and
/// the whole test suite.
#[test]
fn readme_opens_with_the_two_setup_commands() {
    let readme = readme();
    let block = readme
        .split("```")
        .nth(1)
        .expect("a code block near the top");
    let commands: Vec<&str> = block
        .lines()
        .skip(1)
        .filter(|l| !l.trim().is_empty())
        .map(|l| l.split('#').next().unwrap_or("").trim())
        .collect();
    assert_eq!(
        commands,
        ["cargo run --release -- serve", "scripts/test.sh"]
    );
    assert!(
        readme.find("```").expect("a block") < readme.find("\n## ").expect("a section"),
        "the set-up commands must come before the first section"
    );
}

/// The commands `cairn --help` lists (clap's own `help` left out).
fn commands() -> Vec<String> {
    let help = text(&cairn(&["--help"]).stdout);
    let list = help
        .split("Commands:")
        .nth(1)
        .expect("a command list")
        .split("\n\n")
        .next()
        .expect("its lines");
    list.lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|c| *c != "help")
        .map(str::to_string)
        .collect()
}

#[test]
fn man_pages_cover_every_command_and_render_cleanly() {
    let dir = tmpdir();
    let out_dir = dir.path().join("man1");
    let out = cairn(&["man", out_dir.to_str().expect("UTF-8")]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let commands = commands();
    assert!(commands.len() >= 6, "{commands:?}");
    let mut expected: BTreeSet<String> = commands.iter().map(|c| format!("cairn-{c}.1")).collect();
    expected.insert("cairn.1".into());
    assert_eq!(listing(&out_dir), expected);
    for page in &expected {
        let body = std::fs::read_to_string(out_dir.join(page)).expect("read a page");
        for section in [".SH NAME", ".SH SYNOPSIS", ".SH DESCRIPTION", "SEE ALSO"] {
            assert!(body.contains(section), "{page} lacks {section}");
        }
        assert!(
            body.contains("cairn ") && !body.contains("\"cairn \""),
            "{page}: no version in its header"
        );
    }
    // Every option of `cairn serve --help` is in its page.
    let serve_page = std::fs::read_to_string(out_dir.join("cairn-serve.1")).expect("read");
    let serve_help = text(&cairn(&["serve", "--help"]).stdout);
    for word in serve_help.split_whitespace() {
        let flag = word.trim_end_matches(',');
        if flag.starts_with("--")
            && flag.len() > 3
            && flag[2..]
                .chars()
                .all(|c| c.is_ascii_lowercase() || c == '-')
        {
            assert!(
                serve_page.contains(&flag.replace('-', "\\-")) || serve_page.contains(flag),
                "cairn-serve.1 lacks {flag}"
            );
        }
    }
    match tool("man") {
        Some(man) => {
            for page in &expected {
                let out = Command::new(&man)
                    .args(["--warnings", "-l"])
                    .arg(out_dir.join(page))
                    .env("MANWIDTH", "80")
                    .output()
                    .expect("run man");
                assert!(out.status.success(), "man -l {page}: {}", text(&out.stderr));
                assert!(
                    out.stderr.is_empty(),
                    "man warns about {page}: {}",
                    text(&out.stderr)
                );
                // Piped, man emboldens and underlines by overstriking ("N\x08N",
                // "_\x08x"): each backspace takes back the character before it.
                let mut plain = String::new();
                for c in text(&out.stdout).chars() {
                    if c == '\x08' {
                        plain.pop();
                    } else {
                        plain.push(c);
                    }
                }
                assert!(plain.contains("NAME"), "{plain}");
                if page == "cairn-admin.1" {
                    admin_list_whole(&plain);
                }
            }
        }
        None => skip(
            "man_pages_cover_every_command_and_render_cleanly (rendering)",
            "man is not installed",
        ),
    }
    // A directory that cannot be made is one line and exit status 2.
    let blocker = dir.path().join("file");
    std::fs::write(&blocker, b"x").expect("write");
    let out = cairn(&["man", blocker.join("man1").to_str().expect("UTF-8")]);
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(
        text(&out.stderr).lines().count(),
        1,
        "{}",
        text(&out.stderr)
    );
}

/// The admin page shows the list of commands line for line as `cairn admin help` prints
/// it (laid out in columns; roff must not run its lines together into fragments).
fn admin_list_whole(page: &str) {
    let words = |l: &str| l.split_whitespace().collect::<Vec<_>>().join(" ");
    let shown: BTreeSet<String> = page.lines().map(words).collect();
    let help = text(&cairn(&["admin", "help"]).stdout);
    for line in help.lines().skip(1).filter(|l| !l.trim().is_empty()) {
        // Within 80 columns once the page indents it by 7.
        assert!(
            line.len() <= 72,
            "`cairn admin help` runs past 72 columns: {line:?}"
        );
        assert!(
            shown.contains(&words(line)),
            "cairn-admin.1 does not show this line of `cairn admin help` whole: {line:?}"
        );
    }
}

/// The units in examples/ pass `systemd-analyze verify`: the documentation they name
/// exists (the man pages `cairn man` writes) and so does the program. The unit's
/// /usr/local/bin/cairn (where the README installs it) is pointed at the binary under
/// test, the one change made to it.
#[test]
fn systemd_units_verify() {
    let Some(analyze) = tool("systemd-analyze") else {
        skip("systemd_units_verify", "systemd-analyze is not installed");
        return;
    };
    let dir = tmpdir();
    let man = dir.path().join("man");
    let out = cairn(&["man", man.join("man1").to_str().expect("UTF-8")]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let units = dir.path().join("units");
    std::fs::create_dir(&units).expect("mkdir");
    for unit in ["cairn.service", "cairn.socket"] {
        let body =
            std::fs::read_to_string(repo().join("examples").join(unit)).expect("read a unit");
        let body = body.replace("/usr/local/bin/cairn", env!("CARGO_BIN_EXE_cairn"));
        std::fs::write(units.join(unit), body).expect("write a unit");
    }
    let out = Command::new(analyze)
        .arg("verify")
        .arg(units.join("cairn.socket"))
        .arg(units.join("cairn.service"))
        .env("MANPATH", &man)
        .env("SYSTEMD_LOG_LEVEL", "notice")
        .output()
        .expect("run systemd-analyze");
    assert!(
        out.status.success() && out.stderr.is_empty(),
        "systemd-analyze verify: exit {:?}\n{}",
        out.status.code(),
        text(&out.stderr)
    );
}
