//! Integration tests for stack files at the `cairn` binary's edge: `cairn check` prints
//! the tree or one error line, `cairn bench STACK.toml` runs verified jobs on stacked
//! devices, `--device NAME` picks a device of the file, and `[tuning]` sets the switches
//! under the command-line flags.
//!
//! Every run is bounded by size; nothing asserts on timing.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;
use tempfile::TempDir;

fn cairn(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_cairn"))
        .args(args)
        .env_remove("RUST_BACKTRACE")
        .env_remove("RUST_LIB_BACKTRACE")
        .output()
        .expect("run cairn")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// A stack file in a fresh temporary directory (kept alive with it).
struct StackFile {
    _dir: TempDir,
    path: PathBuf,
}

impl StackFile {
    fn new(contents: &str) -> StackFile {
        let dir = tempfile::tempdir_in("/dev/shm")
            .or_else(|_| tempfile::tempdir())
            .expect("create a temporary directory");
        let path = dir.path().join("stack.toml");
        std::fs::write(&path, contents).expect("write the stack file");
        StackFile { _dir: dir, path }
    }

    fn dir(&self) -> &Path {
        self._dir.path()
    }

    fn arg(&self) -> &str {
        self.path.to_str().expect("a UTF-8 path")
    }
}

/// `[device.NAME]` tables of mem devices.
fn mems(names: &[&str], size: &str) -> String {
    names
        .iter()
        .map(|n| format!("[device.{n}]\ntype = \"mem\"\nsize = \"{size}\"\n\n"))
        .collect()
}

/// A raid10 `r` of four 5 MiB mem devices `d0..d3`, 64 KiB chunks, with superblocks (the
/// default): 4 MiB of data on each member after its 1 MiB metadata area, 8 MiB in all.
fn raid10() -> String {
    format!(
        "{}[device.r]\ntype = \"raid10\"\nmembers = [\"d0\", \"d1\", \"d2\", \"d3\"]\nchunk = \"64K\"\n",
        mems(&["d0", "d1", "d2", "d3"], "5M")
    )
}

/// Runs `args`, expecting exit status 2, nothing on stdout and exactly one line on stderr
/// (no panic); returns the line.
#[track_caller]
fn bad_input(args: &[&str]) -> String {
    let out = cairn(args);
    let stderr = text(&out.stderr);
    assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    assert_eq!(
        out.status.code(),
        Some(2),
        "{args:?}: exit status; stderr: {stderr}"
    );
    assert_eq!(
        stderr.lines().count(),
        1,
        "{args:?}: one line on stderr, got: {stderr:?}"
    );
    assert!(stderr.starts_with("cairn: "), "{args:?}: {stderr:?}");
    assert!(
        out.stdout.is_empty(),
        "{args:?}: stdout: {}",
        text(&out.stdout)
    );
    stderr
}

/// Runs `args`, expecting exit status 0 and JSON on stdout.
#[track_caller]
fn json_run(args: &[&str]) -> Value {
    let out = cairn(args);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{args:?}: stderr: {}",
        text(&out.stderr)
    );
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{args:?}: stdout is not JSON ({e}): {}", text(&out.stdout)))
}

mod check {
    use super::*;

    /// `cairn check FILE | head -1`: the reader goes away after one line; cairn stops
    /// printing and exits 0, with no panic about a broken pipe.
    #[test]
    fn a_reader_that_goes_away_is_not_an_error() {
        let file = StackFile::new(&raid10());
        let out = std::process::Command::new("sh")
            .arg("-c")
            .arg(format!(
                "'{}' check '{}' | head -c 1 >/dev/null; echo \"status=${{PIPESTATUS:-x}}\"",
                env!("CARGO_BIN_EXE_cairn"),
                file.arg()
            ))
            .output()
            .unwrap();
        let err = text(&out.stderr);
        assert!(
            !err.contains("panicked") && !err.contains("Broken pipe"),
            "{err}"
        );
        // Directly: a closed stdout, then the exit status.
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_cairn"))
            .args(["check", file.arg()])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        drop(child.stdout.take());
        let out = child.wait_with_output().unwrap();
        assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    }

    #[test]
    fn exports_are_listed_and_bad_ones_refused() {
        let file = StackFile::new(&format!(
            "{}[export.vm]\ndevice = \"r\"\nread_only = true\ndefault = true\n",
            raid10()
        ));
        let out = cairn(&["check", file.arg()]);
        let stdout = text(&out.stdout);
        assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
        assert!(
            stdout.contains("export 'vm': device r, read-only, default"),
            "{stdout}"
        );
        // A member cannot be exported: that would bypass the array.
        let file = StackFile::new(&format!("{}[export.bad]\ndevice = \"d0\"\n", raid10()));
        let out = cairn(&["check", file.arg()]);
        assert_eq!(out.status.code(), Some(2));
        let err = text(&out.stderr);
        assert!(
            err.contains("export 'bad'") && err.contains("member"),
            "{err}"
        );
    }

    /// The caches' shared dirty budget is spelled out in bytes (and absent without caches).
    #[test]
    fn the_caches_dirty_budget_is_shown() {
        let file = StackFile::new(
            "[writeback]\nbackground = \"10%\"\nlimit = \"20%\"\n\
             [device.m]\ntype = \"mem\"\nsize = \"64M\"\nblock = 4096\n\
             [device.a]\ntype = \"cache\"\nbase = \"m\"\nmemory = \"60M\"\n\
             [device.n]\ntype = \"mem\"\nsize = \"64M\"\nblock = 4096\n\
             [device.b]\ntype = \"cache\"\nbase = \"n\"\nmemory = \"40M\"\n",
        );
        let out = cairn(&["check", file.arg()]);
        let stdout = text(&out.stdout);
        assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
        assert!(
            stdout.contains(
                "writeback: 2 caches with 100MiB of memory share one budget: flushers write back \
                 over 10MiB, writers are paced from 15MiB (held near 17.5MiB) to 20MiB"
            ),
            "{stdout}"
        );
        let out = cairn(&["check", StackFile::new(&raid10()).arg()]);
        assert!(!text(&out.stdout).contains("writeback:"));
    }

    #[test]
    fn a_valid_raid10_prints_every_device_with_its_size() {
        let file = StackFile::new(&raid10());
        let out = cairn(&["check", file.arg()]);
        let stdout = text(&out.stdout);
        assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
        // The log says what serve or bench would do with the blank members, and nothing
        // else.
        let stderr = text(&out.stderr);
        assert!(
            stderr
                .lines()
                .all(|l| l.contains(" INFO ")
                    && l.ends_with("r: would create a raid10 of 4 members")),
            "{stderr}"
        );
        // The switches as the command line writes them.
        assert!(
            stdout.contains(
                "switches: clock=cached reap=eager stats=on flush=batched dispatch=inline writeback=per-device coalesce=on"
            ),
            "{stdout}"
        );
        let lines: Vec<&str> = stdout.lines().collect();
        assert!(lines[0].starts_with("r (8MiB)"), "{stdout}");
        assert!(lines[0].contains("raid10"), "{stdout}");
        assert!(lines[0].contains("metadata 1, data at 1048576"), "{stdout}");
        for (i, line) in lines[1..5].iter().enumerate() {
            assert!(
                line.starts_with(&format!("  d{i} (5MiB)")),
                "member d{i} indented under r, with its size: {stdout}"
            );
            assert!(line.contains("mem"), "{stdout}");
        }
    }

    #[test]
    fn nested_stacks_and_several_roots() {
        // A mirror of two stripes, plus a spare device nothing uses: two trees. Every
        // array keeps superblocks (the default): each stripe holds 2 x (2 MiB - 1 MiB of
        // metadata), the mirror 2 MiB - 1 MiB.
        let text_ = format!(
            "{}[device.s0]\ntype = \"stripe\"\nmembers = [\"a\", \"b\"]\nchunk = \"4K\"\n\n\
             [device.s1]\ntype = \"stripe\"\nmembers = [\"c\", \"d\"]\nchunk = \"4K\"\n\n\
             [device.m]\ntype = \"mirror\"\nmembers = [\"s0\", \"s1\"]\n",
            mems(&["a", "b", "c", "d", "spare"], "2M")
        );
        let file = StackFile::new(&text_);
        let out = cairn(&["check", file.arg()]);
        let stdout = text(&out.stdout);
        assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
        for line in [
            "m (1MiB)",
            "  s0 (2MiB)",
            "    a (2MiB)",
            "    b (2MiB)",
            "  s1 (2MiB)",
            "    c (2MiB)",
            "    d (2MiB)",
            "spare (2MiB)",
        ] {
            assert!(
                stdout.lines().any(|l| l.starts_with(line)),
                "no line starting {line:?} in:\n{stdout}"
            );
        }
        // --device prints one tree only.
        let out = cairn(&["check", file.arg(), "--device", "s1"]);
        let stdout = text(&out.stdout);
        assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
        assert!(stdout.starts_with("s1 (2MiB)"), "{stdout}");
        assert!(
            !stdout.contains("s0") && !stdout.contains("spare"),
            "{stdout}"
        );
    }

    #[test]
    fn invalid_files_exit_2_with_one_line_naming_device_and_key() {
        let four = mems(&["d0", "d1", "d2", "d3"], "2M");
        let cases: Vec<(String, &str, &str)> = vec![
            (
                format!("{four}[device.r]\ntype = \"raid10\"\nmembers = [\"d0\", \"d1\"]\nstripes = 2\n"),
                "'r'",
                "'stripes'",
            ),
            (
                format!("{four}[device.r]\ntype = \"raid5\"\nmembers = [\"d0\", \"d1\"]\n"),
                "'r'",
                "type",
            ),
            (format!("{four}[device.r]\ntype = \"mirror\"\n"), "'r'", "'members'"),
            (
                format!("{four}[device.r]\ntype = \"linear\"\nmembers = [\"d0\", \"d9\"]\n"),
                "'r'",
                "'members'",
            ),
            (
                format!("{four}[device.r]\ntype = \"stripe\"\nmembers = [\"d0\", \"d1\"]\nchunk = \"48K\"\n"),
                "'r'",
                "'chunk'",
            ),
            (
                format!(
                    "{four}[device.a]\ntype = \"linear\"\nmembers = [\"d0\"]\n\n\
                     [device.b]\ntype = \"linear\"\nmembers = [\"d0\"]\n"
                ),
                "'d0'",
                "members",
            ),
            (
                "[device.a]\ntype = \"linear\"\nmembers = [\"b\"]\n\n\
                 [device.b]\ntype = \"linear\"\nmembers = [\"a\"]\n"
                    .to_string(),
                "'a'",
                "members",
            ),
            (
                "[device.d0]\ntype = \"mem\"\nsize = \"1x\"\n".to_string(),
                "'d0'",
                "'size'",
            ),
            (
                "[device.d0\ntype = \"mem\"\n".to_string(),
                "TOML",
                "line 1",
            ),
        ];
        // Found only when the devices are opened (these lines do not name the file).
        let opened: Vec<(String, &str, &str)> = vec![
            (
                format!("{four}[device.r]\ntype = \"raid10\"\nmembers = [\"d0\", \"d1\", \"d2\", \"d3\"]\ncopies = 5\n"),
                "'r'",
                "copies",
            ),
            (
                format!("{four}[device.r]\ntype = \"stripe\"\nmembers = [\"d0\", \"d1\", \"d2\", \"d3\"]\nchunk = \"2M\"\n"),
                "'r'",
                "members",
            ),
            (
                "[device.d0]\ntype = \"mem\"\nsize = \"1000\"\n".to_string(),
                "'d0'",
                "size",
            ),
        ];
        for (parsed, (contents, device, key)) in cases
            .into_iter()
            .map(|c| (true, c))
            .chain(opened.into_iter().map(|c| (false, c)))
        {
            let file = StackFile::new(&contents);
            let line = bad_input(&["check", file.arg()]);
            assert!(line.contains(device), "names {device}: {line}");
            assert!(line.contains(key), "names {key}: {line}");
            if parsed {
                assert!(line.contains(file.arg()), "names the file: {line}");
            }
        }
    }

    #[test]
    fn a_missing_file_member_is_named() {
        let file = StackFile::new("");
        let img = file.dir().join("absent.img");
        std::fs::write(
            &file.path,
            format!(
                "[device.f]\ntype = \"file\"\npath = \"{}\"\n\n{}\
                 [device.m]\ntype = \"mirror\"\nmembers = [\"f\", \"d0\"]\n",
                img.display(),
                mems(&["d0"], "1M")
            ),
        )
        .unwrap();
        let line = bad_input(&["check", file.arg()]);
        assert!(line.contains("'f'"), "{line}");
        assert!(line.contains("absent.img"), "{line}");
    }

    #[test]
    fn a_stack_file_that_cannot_be_read() {
        let line = bad_input(&["check", "/nonexistent/stack.toml"]);
        assert!(line.contains("/nonexistent/stack.toml"), "{line}");
        bad_input(&["bench", "/nonexistent/stack.toml", "--size", "1M"]);
    }

    #[test]
    fn an_unknown_device_name() {
        let file = StackFile::new(&raid10());
        let line = bad_input(&["check", file.arg(), "--device", "d7"]);
        assert!(line.contains("'d7'"), "{line}");
        let line = bad_input(&["bench", file.arg(), "--device", "d7", "--size", "1M"]);
        assert!(line.contains("'d7'"), "{line}");
    }
}

mod bench {
    use super::*;

    /// Verified random reads and writes over the whole 8 MiB device.
    fn verified(file: &StackFile, extra: &[&str]) -> Value {
        let mut args = vec![
            "bench",
            file.arg(),
            "--rw",
            "randrw",
            "--verify",
            "crc32c",
            "--size",
            "8M",
            "--io_size",
            "8M",
            "--output-format",
            "json",
        ];
        args.extend(extra);
        let json = json_run(&args);
        assert_eq!(json["jobs"][0]["error"], 0, "{args:?}");
        assert!(json["cairn"]["failure"].is_null(), "{args:?}");
        let checked = json["cairn"]["verify"]["blocks_checked"].as_u64().unwrap();
        assert!(checked > 0, "{args:?}: nothing was verified");
        json
    }

    #[test]
    fn verify_passes_on_every_stacked_type() {
        // 8 MiB each, with superblocks (the default): every member 1 MiB larger than the
        // data it holds.
        let stacks = [
            ("raid10", raid10()),
            (
                "stripe",
                format!(
                    "{}[device.s]\ntype = \"stripe\"\nmembers = [\"d0\", \"d1\"]\nchunk = \"4K\"\n",
                    mems(&["d0", "d1"], "5M")
                ),
            ),
            (
                "mirror",
                format!(
                    "{}[device.m]\ntype = \"mirror\"\nmembers = [\"d0\", \"d1\", \"d2\"]\n",
                    mems(&["d0", "d1", "d2"], "9M")
                ),
            ),
            (
                // Requests wait on their reactor's timers, then go on.
                "throttle",
                format!(
                    "{}[device.t]\ntype = \"throttle\"\nbase = \"d0\"\niops = 5000\nbps_write = \"200M\"\n",
                    mems(&["d0"], "8M")
                ),
            ),
            (
                // Unequal members: 3 MiB and 5 MiB of data.
                "linear",
                format!(
                    "{}{}[device.l]\ntype = \"linear\"\nmembers = [\"d0\", \"d1\"]\n",
                    mems(&["d0"], "4M"),
                    mems(&["d1"], "6M")
                ),
            ),
        ];
        for (kind, contents) in stacks {
            let file = StackFile::new(&contents);
            let json = verified(&file, &[]);
            let description = json["cairn"]["device"]["description"].as_str().unwrap();
            assert!(description.contains(kind), "{kind}: {description}");
            let written = json["jobs"][0]["write"]["io_bytes"].as_u64().unwrap();
            assert!(written > 0, "{kind}: nothing was written");
        }
    }

    /// Data verified through crypt devices of both versions, their passphrase file named
    /// relative to the stack file (run from another directory).
    #[test]
    fn verify_passes_through_crypt_with_a_relative_passphrase_file() {
        for format in ["luks2", "luks1"] {
            let file = StackFile::new(&format!(
                "{}[device.c]\ntype = \"crypt\"\nbase = \"d0\"\npassphrase_file = \"pass\"\n\
                 create = true\nformat = \"{format}\"\nkdf = \"pbkdf2\"\nkdf_iterations = 1000\n",
                mems(&["d0"], "24M")
            ));
            std::fs::write(file.dir().join("pass"), b"relative").unwrap();
            let json = verified(&file, &[]);
            let description = json["cairn"]["device"]["description"].as_str().unwrap();
            assert!(
                description.contains(&format!("crypt over d0: {format}")),
                "{description}"
            );
        }
    }

    #[test]
    fn device_picks_a_member() {
        let file = StackFile::new(&raid10());
        let json = json_run(&[
            "bench",
            file.arg(),
            "--device",
            "d2",
            "--rw",
            "randrw",
            "--verify",
            "crc32c",
            "--size",
            "4M",
            "--io_size",
            "4M",
            "--output-format",
            "json",
        ]);
        assert_eq!(json["cairn"]["device"]["name"], "d2", "{}", json["cairn"]);
        let description = json["cairn"]["device"]["description"].as_str().unwrap();
        assert!(description.starts_with("mem"), "{description}");
        // The whole member is 5 MiB: 8 MiB does not fit.
        bad_input(&["bench", file.arg(), "--device", "d2", "--size", "8M"]);
    }

    #[test]
    fn several_top_level_devices_need_a_name() {
        let contents = format!("{}{}", raid10(), mems(&["spare"], "1M"));
        let file = StackFile::new(&contents);
        let line = bad_input(&["bench", file.arg(), "--size", "1M"]);
        assert!(line.contains("r") && line.contains("spare"), "{line}");
        assert!(line.contains("--device"), "{line}");
        let json = json_run(&[
            "bench",
            file.arg(),
            "--device",
            "r",
            "--size",
            "1M",
            "--output-format",
            "json",
        ]);
        assert_eq!(json["cairn"]["device"]["name"], "r");
    }
}

mod tuning {
    use super::*;

    fn with_tuning(tuning: &str) -> StackFile {
        StackFile::new(&format!("[tuning]\n{tuning}\n\n{}", raid10()))
    }

    fn switches(file: &StackFile, flags: &[&str]) -> Value {
        let mut args = vec![
            "bench",
            file.arg(),
            "--size",
            "1M",
            "--output-format",
            "json",
        ];
        args.extend(flags);
        json_run(&args)["cairn"]["switches"].clone()
    }

    #[test]
    fn tuning_sets_the_switches() {
        let file = with_tuning("clock = \"precise\"\nreap = \"lazy\"\nstats = \"off\"");
        let s = switches(&file, &[]);
        assert_eq!(s["clock"], "precise", "{s}");
        assert_eq!(s["reap"], "lazy", "{s}");
        assert_eq!(s["stats"], "off", "{s}");
    }

    #[test]
    fn flags_override_tuning() {
        let file = with_tuning("clock = \"precise\"\nreap = \"lazy\"");
        let s = switches(&file, &["--clock", "cached"]);
        assert_eq!(s["clock"], "cached", "the flag wins: {s}");
        assert_eq!(s["reap"], "lazy", "tuning still applies to the rest: {s}");
        // Before the subcommand too.
        let json = json_run(&[
            "--clock",
            "cached",
            "bench",
            file.arg(),
            "--size",
            "1M",
            "--output-format",
            "json",
        ]);
        assert_eq!(json["cairn"]["switches"]["clock"], "cached");
    }

    #[test]
    fn without_tuning_the_defaults_apply() {
        let file = StackFile::new(&raid10());
        let s = switches(&file, &[]);
        assert_eq!(s["clock"], "cached", "{s}");
        assert_eq!(s["reap"], "eager", "{s}");
        assert_eq!(s["stats"], "on", "{s}");
    }

    #[test]
    fn a_bad_tuning_value_exits_2() {
        for (key, value) in [
            ("clock", "sundial"),
            ("reap", "never"),
            ("stats", "maybe"),
            ("flush", "sometimes"),
            ("dispatch", "carrier-pigeon"),
        ] {
            let file = with_tuning(&format!("{key} = \"{value}\""));
            for args in [
                vec!["check", file.arg()],
                vec!["bench", file.arg(), "--size", "1M"],
            ] {
                let line = bad_input(&args);
                assert!(
                    line.contains(key) && line.contains(value),
                    "{args:?}: {line}"
                );
            }
        }
    }

    #[test]
    fn unknown_tuning_keys_exit_2() {
        let file = with_tuning("clocks = \"cached\"");
        let line = bad_input(&["check", file.arg()]);
        assert!(
            line.contains("tuning") && line.contains("'clocks'"),
            "{line}"
        );
    }
}

mod timeline {
    use super::*;

    /// `--timeline` prints a row per interval on stderr and `--timeline-csv` writes them;
    /// through a cache over a slow base, dirty data and write-back show up.
    #[test]
    fn rows_with_dirty_bytes_and_write_back() {
        let file = StackFile::new(
            "[writeback]\nbackground = \"25%\"\nlimit = \"75%\"\nexpire = \"10s\"\ninterval = \"50ms\"\n\
             [device.m]\ntype = \"mem\"\nsize = \"64M\"\nblock = 4096\n\
             [device.h]\ntype = \"delay\"\nbase = \"m\"\nbandwidth = \"20M\"\n\
             [device.c]\ntype = \"cache\"\nbase = \"h\"\nmemory = \"16M\"\n",
        );
        let dir = tempfile::tempdir().unwrap();
        let csv = dir.path().join("t.csv");
        let svg = dir.path().join("t.svg");
        let out = cairn(&[
            "bench",
            file.arg(),
            "--rw",
            "randwrite",
            "--runtime",
            "1",
            "--time_based",
            "--timeline",
            "200ms",
            "--timeline-csv",
            csv.to_str().unwrap(),
            "--timeline-svg",
            svg.to_str().unwrap(),
        ]);
        assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
        let err = text(&out.stderr);
        assert!(
            err.contains("dirty MiB") && err.contains("writeback MB/s"),
            "{err}"
        );
        let rows = std::fs::read_to_string(&csv).unwrap();
        let mut lines = rows.lines();
        assert_eq!(
            lines.next(),
            Some("seconds,iops,bytes_per_second,dirty_bytes,writeback_bytes_per_second")
        );
        let data: Vec<Vec<f64>> = lines
            .map(|l| l.split(',').map(|v| v.parse().unwrap()).collect())
            .collect();
        assert!(data.len() >= 3, "{rows}");
        assert!(
            data.iter().any(|r| r[3] > 0.0),
            "no dirty data seen: {rows}"
        );
        assert!(
            data.iter().any(|r| r[4] > 0.0),
            "no write-back seen: {rows}"
        );
        assert!(data.iter().all(|r| r.len() == 5));
        let chart = std::fs::read_to_string(&svg).unwrap();
        assert!(
            chart.starts_with("<svg") && chart.contains("--writeback per-device"),
            "{chart}"
        );
    }

    /// A cache over a base whose writes all fail retries its write-back once per
    /// interval (1 s here), not in a loop: the log holds a handful of failures, not one
    /// per round of a spinning flusher (825 in a second before the fix). What it could
    /// not write back at exit is lost, and cairn exits with status 1.
    #[test]
    fn a_failing_base_is_retried_per_interval_not_in_a_loop() {
        let file = StackFile::new(
            "[writeback]\nbackground = \"1%\"\nlimit = \"50%\"\ninterval = \"1s\"\n\
             [device.m]\ntype = \"mem\"\nsize = \"64M\"\nblock = 4096\n\
             [device.f]\ntype = \"fault\"\nbase = \"m\"\nfail = [\"write\"]\n\
             [device.c]\ntype = \"cache\"\nbase = \"f\"\nmemory = \"16M\"\n",
        );
        let out = cairn(&[
            "bench",
            file.arg(),
            "--rw",
            "randwrite",
            "--runtime",
            "1",
            "--time_based",
            "--size",
            "8M",
        ]);
        let err = text(&out.stderr);
        let failures = err.matches("write-back to the base failed").count();
        assert!(failures >= 1, "the failure is reported: {err}");
        assert!(failures < 50, "{failures} failed write-back rounds logged");
        assert!(err.contains("could not be written back at exit"), "{err}");
        // Acknowledged writes are lost: the exit status says so.
        assert!(
            err.contains("of acknowledged writes could not be written back and are lost"),
            "{err}"
        );
        assert_eq!(out.status.code(), Some(1), "{err}");
    }

    #[test]
    fn bad_timeline_flags_are_refused() {
        for (args, needle) in [
            (vec!["--timeline-csv", "/tmp/x.csv"], "--timeline"),
            (vec!["--timeline-svg", "/tmp/x.svg"], "--timeline"),
            (
                vec![
                    "--timeline",
                    "200ms",
                    "--timeline-svg",
                    "/no/such/dir/x.svg",
                ],
                "/no/such/dir/x.svg",
            ),
            (vec!["--timeline", "10ms"], "100ms"),
            (vec!["--timeline", "soon"], "--timeline"),
        ] {
            let mut a = vec!["bench", "--device", "null:1M", "--runtime", "1"];
            a.extend(args.iter().copied());
            let out = cairn(&a);
            assert_eq!(out.status.code(), Some(2), "{args:?}");
            assert!(
                text(&out.stderr).contains(needle),
                "{args:?}: {}",
                text(&out.stderr)
            );
        }
    }
}

mod serve_flags {
    use super::*;

    /// Every bad `serve` flag ends in one line on stderr and exit status 2, before
    /// anything listens.
    #[test]
    fn bad_serve_flags_are_refused_with_one_line() {
        for (args, needle) in [
            (vec!["--max-payload", "1k"], "--max-payload"),
            (vec!["--idle-poll", "1h"], "--idle-poll"),
            (vec!["--idle-poll", "soon"], "--idle-poll"),
            (vec!["--threads", "0"], "--threads"),
            (vec!["--listen", "foo"], "--listen"),
            (vec!["--listen", "tcp:localhost"], "--listen"),
            (vec!["--handshake-timeout", "0s"], "--handshake-timeout"),
            (vec!["--shutdown-timeout", "0s"], "--shutdown-timeout"),
            (vec!["--shutdown-timeout", "later"], "--shutdown-timeout"),
            (vec!["--log-level", "loud"], "--log-level"),
            (vec!["--buffer-memory", "1M"], "--buffer-memory"),
            (vec!["--max-connections", "0"], "--max-connections"),
            (
                vec!["--max-connections-per-address", "0"],
                "--max-connections-per-address",
            ),
            (vec!["--idle-timeout", "soon"], "--idle-timeout"),
            (vec!["--idle-timeout", "0", "--idle-close"], "--idle-close"),
            (vec!["--evict-idle-after", "soon"], "--evict-idle-after"),
            (vec!["--device", "nope:1G"], "--device"),
            (vec!["--tls", "require"], "--tls-certificates"),
        ] {
            let mut a = vec!["serve"];
            a.extend(args.iter().copied());
            let out = cairn(&a);
            let err = text(&out.stderr);
            assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
            assert!(err.contains(needle), "{args:?}: {err}");
            assert_eq!(err.lines().count(), 1, "{args:?}: {err}");
        }
    }
}

/// Stack files that crashed or hung cairn: each is now one line and exit status 2 from
/// `check`, `bench` and `serve` alike, before any device is opened or anything listens.
mod crashes_and_hangs {
    use super::*;

    /// `cairn check`, `bench` and `serve` each refuse `file` with one line naming `device`
    /// and every one of `words`.
    #[track_caller]
    fn refused_everywhere(file: &StackFile, device: &str, words: &[&str]) {
        for args in [
            vec!["check", file.arg()],
            vec![
                "bench",
                file.arg(),
                "--rw",
                "randwrite",
                "--runtime",
                "1",
                "--size",
                "1M",
            ],
            // `serve` on a port nobody uses: it must refuse before it listens, or this
            // test would hang in it (and a kill would show as the wrong exit status).
            vec!["serve", file.arg(), "--listen", "tcp:127.0.0.1:0"],
        ] {
            let line = bad_input(&args);
            assert!(
                line.contains(&format!("'{device}'")),
                "{args:?}: names '{device}': {line}"
            );
            for w in words {
                assert!(line.contains(w), "{args:?}: mentions {w}: {line}");
            }
        }
    }

    fn mem_and(extra: &str) -> StackFile {
        StackFile::new(&format!(
            "[device.m]\ntype = \"mem\"\nsize = \"64M\"\n\n{extra}"
        ))
    }

    /// `memory = "0"` panicked in `check` ("a budget when the file has caches", status 134).
    #[test]
    fn a_cache_with_no_memory() {
        let file = mem_and("[device.c]\ntype = \"cache\"\nbase = \"m\"\nmemory = \"0\"\n");
        refused_everywhere(&file, "c", &["'memory'", "\"0\"", "64KiB"]);
    }

    /// A chain of 20,000 linear devices overflowed the stack in `check` (abort); a
    /// chain within the device count but deeper than 64 levels is refused with the chain.
    /// The chain that runs is of raw linears (`metadata = "none"`): with superblocks, each
    /// level would take 1 MiB of the one below.
    #[test]
    fn a_chain_of_twenty_thousand_linear_devices() {
        let chain = |n: usize| {
            // The line would take the 20,000 past the file's size limit; those chains are
            // refused before any device is opened anyway.
            let metadata = if n < 64 { "metadata = \"none\"\n" } else { "" };
            let mut text: String = (0..n)
                .map(|i| {
                    format!(
                        "[device.l{i}]\ntype = \"linear\"\nmembers = [\"l{}\"]\n{metadata}",
                        i + 1
                    )
                })
                .collect();
            text += &format!("[device.l{n}]\ntype = \"mem\"\nsize = \"1M\"\n");
            StackFile::new(&text)
        };
        let file = chain(20_000);
        let line = bad_input(&["check", file.arg()]);
        assert!(
            line.contains("20001 devices") && line.contains("4096"),
            "{line}"
        );
        let file = chain(100);
        refused_everywhere(
            &file,
            "l64",
            &["65 levels", "at most 64", "'l0' -> 'l1' -> "],
        );
        // 64 levels is allowed, and works: a verified job through every level.
        let file = chain(63);
        let v = json_run(&[
            "bench",
            file.arg(),
            "--rw",
            "randwrite",
            "--verify",
            "crc32c",
            "--size",
            "1M",
            "--output-format",
            "json",
        ]);
        assert!(
            v["jobs"][0]["write"]["total_ios"].as_u64().unwrap_or(0) > 0,
            "{v}"
        );
    }

    /// `bandwidth = "0"` made every I/O wait forever, and `serve` never exited on SIGTERM.
    #[test]
    fn a_delay_with_no_bandwidth() {
        let file = mem_and("[device.d]\ntype = \"delay\"\nbase = \"m\"\nbandwidth = \"0\"\n");
        refused_everywhere(&file, "d", &["'bandwidth'", "\"0\"", "at least 1MiB"]);
        let file = mem_and("[device.d]\ntype = \"delay\"\nbase = \"m\"\nread = \"1h\"\n");
        refused_everywhere(&file, "d", &["'read'", "\"1h\"", "10s"]);
    }

    /// A 100 TiB cache, a 100 GiB limit for a 1 MiB cache, and a stripe over one file
    /// named twice were all accepted.
    #[test]
    fn sizes_beyond_the_machine_and_a_file_used_twice() {
        let file = mem_and("[device.c]\ntype = \"cache\"\nbase = \"m\"\nmemory = \"100T\"\n");
        refused_everywhere(
            &file,
            "c",
            &["'memory'", "\"100T\"", "half of this machine's memory"],
        );
        let file = mem_and(
            "[device.c]\ntype = \"cache\"\nbase = \"m\"\nmemory = \"1M\"\n\n[writeback]\nlimit = \"100G\"\n",
        );
        let line = bad_input(&["check", file.arg()]);
        assert!(
            line.contains("writeback") && line.contains("'limit'") && line.contains("100GiB"),
            "{line}"
        );

        // The same file under three spellings: as written, through `..`, through a
        // symlink, and as a hard link.
        let dir = tempfile::tempdir().expect("a directory");
        let real = dir.path().join("x.img");
        std::fs::write(&real, vec![0u8; 1 << 20]).expect("write x.img");
        std::fs::create_dir(dir.path().join("sub")).expect("mkdir");
        std::os::unix::fs::symlink(&real, dir.path().join("link.img")).expect("symlink");
        std::fs::hard_link(&real, dir.path().join("hard.img")).expect("hard link");
        let original = std::fs::read(&real).expect("read x.img");
        for other in ["sub/../x.img", "link.img", "hard.img"] {
            let stack = StackFile::new(&format!(
                "[device.a]\ntype = \"file\"\npath = \"{}\"\n\n\
                 [device.b]\ntype = \"file\"\npath = \"{}\"\n\n\
                 [device.s]\ntype = \"stripe\"\nmembers = [\"a\", \"b\"]\n",
                real.display(),
                dir.path().join(other).display()
            ));
            refused_everywhere(&stack, "a", &["'b'", "both use the file", other]);
        }
        // Refused before anything was opened or written.
        assert_eq!(std::fs::read(&real).expect("read x.img"), original);
    }

    /// A stack file that never ends, or is not text, is refused without reading it all.
    #[test]
    fn endless_and_binary_stack_files() {
        let line = bad_input(&["check", "/dev/zero"]);
        assert!(line.contains("longer than"), "{line}");
        let file = StackFile::new("");
        std::fs::write(&file.path, [0xff, 0xfe, 0x00, 0x80]).expect("write");
        let line = bad_input(&["check", file.arg()]);
        assert!(line.contains("not UTF-8"), "{line}");
    }
}

/// `cairn check` validates and changes nothing: a file that `size=` would create is not
/// created (nor one that it would extend extended); the tree says what serve or bench
/// will do.
#[test]
fn check_creates_and_extends_no_file() {
    let dir = tempfile::tempdir().expect("a directory");
    let (a, b) = (dir.path().join("a.img"), dir.path().join("b.img"));
    std::fs::write(&b, vec![0u8; 1 << 20]).unwrap();
    let stack = StackFile::new(&format!(
        "[device.a]\ntype = \"file\"\npath = \"{}\"\nsize = \"8M\"\n\
         [device.b]\ntype = \"file\"\npath = \"{}\"\nsize = \"8M\"\n\
         [device.s]\ntype = \"stripe\"\nmembers = [\"a\", \"b\"]\n",
        a.display(),
        b.display()
    ));
    let out = cairn(&["check", stack.arg()]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", text(&out.stderr));
    assert!(
        stdout.contains("to be created by serve or bench"),
        "{stdout}"
    );
    assert!(
        stdout.contains("to be extended by serve or bench"),
        "{stdout}"
    );
    assert!(!a.exists(), "check created {}", a.display());
    assert_eq!(
        std::fs::metadata(&b).unwrap().len(),
        1 << 20,
        "check extended b"
    );
}

/// A relative `path` in a stack file is relative to the stack file, wherever cairn runs.
/// (2 MiB files: the stripe keeps superblocks, 1 MiB of each.)
#[test]
fn relative_paths_are_relative_to_the_stack_file() {
    let stack = StackFile::new(
        "[device.a]\ntype = \"file\"\npath = \"a.img\"\nsize = \"2M\"\n\
         [device.b]\ntype = \"file\"\npath = \"sub/../b.img\"\nsize = \"2M\"\n\
         [device.s]\ntype = \"stripe\"\nmembers = [\"a\", \"b\"]\nchunk = \"64K\"\n",
    );
    std::fs::create_dir(stack.dir().join("sub")).unwrap();
    let elsewhere = tempfile::tempdir().expect("a directory");
    let out = Command::new(env!("CARGO_BIN_EXE_cairn"))
        .current_dir(elsewhere.path())
        .args(["bench", "--rw", "write", "--size", "1M", stack.arg()])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(stack.dir().join("a.img").exists() && stack.dir().join("b.img").exists());
    assert!(!elsewhere.path().join("a.img").exists());
    // check names the files where they are.
    let out = Command::new(env!("CARGO_BIN_EXE_cairn"))
        .current_dir(elsewhere.path())
        .args(["check", stack.arg()])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
}

/// `--log-level` chooses which events reach stderr: an array's creation is logged at info,
/// and nothing at all with `off` or `warn`.
#[test]
fn log_level_chooses_the_events_logged() {
    let stack = StackFile::new(&format!(
        "{}[device.m]\ntype = \"mirror\"\nmembers = [\"a\", \"b\"]\nmetadata = \"1\"\n",
        mems(&["a", "b"], "8M")
    ));
    let run = |level: &str| {
        let out = cairn(&["--log-level", level, "bench", "--size", "1M", stack.arg()]);
        assert!(out.status.success(), "{}", text(&out.stderr));
        text(&out.stderr)
    };
    let info = run("info");
    assert!(
        info.contains(" INFO ") && info.contains("created a mirror"),
        "{info}"
    );
    assert_eq!(run("warn"), "");
    assert_eq!(run("off"), "");
}

/// A bitmap store that could not be made (its directory is missing) or that is the very
/// file a device serves is refused by `cairn check` and by `serve` before anything is
/// created, each with one line that says which key and why.
#[test]
fn a_bitmap_store_that_cannot_be_is_refused_before_anything_is_made() {
    let dir = tempfile::tempdir_in("/dev/shm")
        .or_else(|_| tempfile::tempdir())
        .expect("a directory");
    let data = dir.path().join("d.img");
    let stack = |bitmaps: &str| {
        StackFile::new(&format!(
            "[device.d]\ntype = \"file\"\npath = \"{}\"\nsize = \"64M\"\nbitmaps = \"{bitmaps}\"\n",
            data.display()
        ))
    };
    let missing = stack("/nonexistent/dir/x.bitmaps");
    let sock = dir.path().join("nbd.sock");
    let listen = format!("unix:{}", sock.display());
    for args in [
        vec!["check", missing.arg()],
        vec!["serve", missing.arg(), "--listen", &listen],
    ] {
        let line = bad_input(&args);
        assert!(
            line.contains("bitmap store /nonexistent/dir/x.bitmaps")
                && line.contains("/nonexistent/dir"),
            "{args:?}: {line}"
        );
        assert!(!data.exists(), "{args:?} created {}", data.display());
    }
    // The data file itself, named again as its store (by another spelling).
    let same = stack(&format!("{}/./d.img", dir.path().display()));
    std::fs::write(&data, vec![0u8; 1 << 20]).unwrap();
    for args in [
        vec!["check", same.arg()],
        vec!["serve", same.arg(), "--listen", &listen],
    ] {
        let line = bad_input(&args);
        assert!(
            line.contains("key 'bitmaps'") && line.contains("is the file device 'd' serves"),
            "{args:?}: {line}"
        );
        assert_eq!(std::fs::metadata(&data).unwrap().len(), 1 << 20, "{args:?}");
    }
}

/// Two files on one file system get their engine for one reason: `check` explains it once
/// and refers the second file to the first.
#[test]
fn check_explains_an_engine_once() {
    let stack = StackFile::new(
        "[device.a]\ntype = \"file\"\npath = \"a.img\"\n\
         [device.b]\ntype = \"file\"\npath = \"b.img\"\n\
         [device.s]\ntype = \"stripe\"\nmembers = [\"a\", \"b\"]\nchunk = \"64K\"\n",
    );
    for f in ["a.img", "b.img"] {
        std::fs::write(stack.dir().join(f), vec![0u8; 4 << 20]).unwrap();
    }
    let out = cairn(&["check", stack.arg()]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", text(&out.stderr));
    let line = |name: &str| {
        stdout
            .lines()
            .find(|l| l.trim_start().starts_with(&format!("{name} (")))
            .unwrap_or_else(|| panic!("no line for {name}: {stdout}"))
            .to_string()
    };
    let (a, b) = (line("a"), line("b"));
    let why = a.split("; engine: ").nth(1).expect("a's engine explained");
    assert!(why.len() > 20, "{a}");
    assert!(b.ends_with("; engine: as for a"), "{b}");
}

/// An unknown key's refusal lists `bitmaps` among the keys of a device that takes it (every
/// device but a thin pool).
#[test]
fn an_unknown_key_lists_bitmaps_where_a_device_takes_it() {
    let mem = StackFile::new("[device.m]\ntype = \"mem\"\nsize = \"1M\"\nbogus = 1\n");
    let line = bad_input(&["check", mem.arg()]);
    assert!(
        line.contains("unknown key 'bogus' for type mem")
            && line.trim_end().ends_with(", bitmaps)"),
        "{line}"
    );
    let pool = StackFile::new(
        "[device.m]\ntype = \"mem\"\nsize = \"64M\"\n\
         [device.p]\ntype = \"thin-pool\"\ndata = \"m\"\nbogus = 1\n",
    );
    let line = bad_input(&["check", pool.arg()]);
    assert!(
        line.contains("unknown key 'bogus' for type thin-pool") && !line.contains("bitmaps"),
        "{line}"
    );
}
