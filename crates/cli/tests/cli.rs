//! Integration tests for the `cairn` binary: its edge (bad input is one line on stderr and
//! exit status 2, never a panic), its reports (fio-shaped JSON), its exit status for a
//! failed verification, and its help.
//!
//! Every run is bounded by size, or by a one-second `--runtime`; nothing asserts on timing.

use std::process::{Command, Output};

use serde_json::Value;

/// Every `cairn bench` option, as `--help` must list it.
const BENCH_OPTIONS: [&str; 17] = [
    "--idle-poll",
    "--rw",
    "--rwmixread",
    "--bs",
    "--iodepth",
    "--numjobs",
    "--runtime",
    "--ramp_time",
    "--size",
    "--offset",
    "--fsync",
    "--fua-every",
    "--verify",
    "--output-format",
    "--clock",
    "--reap",
    "--stats",
];

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

fn assert_no_panic(args: &[&str], out: &Output) {
    for (name, stream) in [("stdout", &out.stdout), ("stderr", &out.stderr)] {
        let s = text(stream);
        assert!(
            !s.contains("panicked") && !s.contains("RUST_BACKTRACE"),
            "{args:?}: panic text on {name}: {s}"
        );
    }
}

/// Runs `args`, expecting exit status 2 and exactly one line on stderr; returns the line.
fn bad_input(args: &[&str]) -> String {
    let out = cairn(args);
    assert_no_panic(args, &out);
    let stderr = text(&out.stderr);
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
    assert!(stderr.ends_with('\n'), "{args:?}: {stderr:?}");
    assert!(stderr.starts_with("cairn: "), "{args:?}: {stderr:?}");
    assert!(
        out.stdout.is_empty(),
        "{args:?}: stdout: {}",
        text(&out.stdout)
    );
    stderr
}

fn json_of(out: &Output) -> Value {
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("stdout is not JSON ({e}): {}", text(&out.stdout)))
}

mod bad_input {
    use super::*;

    /// A missing argument's error names the argument and the command whose help to see.
    #[test]
    fn missing_arguments_are_named() {
        let line = bad_input(&["check"]);
        assert!(line.contains("<STACK.toml>"), "{line}");
        assert!(line.contains("see cairn check --help"), "{line}");
        let line = bad_input(&["admin"]);
        assert!(line.contains("<SOCKET>"), "{line}");
        let line = bad_input(&["admin", "/tmp/sock"]);
        assert!(
            line.contains("no command given") && line.contains("cairn admin help"),
            "{line}"
        );
        let line = bad_input(&["bench", "--bs"]);
        assert!(line.contains("--bs"), "{line}");
    }

    /// Wording a new user met: a negative duration, a URI without its type, an invalid
    /// value pointing at the command's own help.
    #[test]
    fn wording_points_at_the_fix() {
        let line = bad_input(&["bench", "--device", "null:1M", "--runtime", "-5"]);
        assert!(
            line.contains("--runtime") && line.contains("negative"),
            "{line}"
        );
        for uri in ["nbds://host/x", "nbd+unix:///x?socket=/s", "nbd://host/x"] {
            let line = bad_input(&["bench", "--device", uri]);
            assert!(line.contains(&format!("nbd:{uri}")), "{line}");
        }
        let line = bad_input(&["bench", "--verify", "md5"]);
        assert!(line.contains("see cairn bench --help"), "{line}");
    }

    /// A file size larger than its file system's free space is refused before the file
    /// is created, unless sparse=1 asks for it; a size smaller than an existing file
    /// serves its start with a warning. (1P on a tmpfs was created silently.)
    #[test]
    fn file_sizes_past_the_free_space_or_short_of_the_file_are_said() {
        let dir = tempfile::tempdir_in("/dev/shm")
            .or_else(|_| tempfile::tempdir())
            .expect("a directory");
        let big = dir.path().join("big.img");
        let spec = format!("file:{},size=100T", big.display());
        let line = bad_input(&["bench", "--device", &spec, "--size", "1M"]);
        assert!(line.contains("free") && line.contains("sparse=1"), "{line}");
        assert!(!big.exists(), "the refused file was created");
        let out = cairn(&[
            "bench",
            "--device",
            &format!("{spec},sparse=1"),
            "--size",
            "1M",
            "--rw",
            "write",
        ]);
        assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
        assert_eq!(std::fs::metadata(&big).expect("created").len(), 100 << 40);
        std::fs::remove_file(&big).expect("remove");
        let small = dir.path().join("small.img");
        std::fs::write(&small, vec![1u8; 16 << 20]).expect("write");
        let out = cairn(&[
            "bench",
            "--device",
            &format!("file:{},size=8M", small.display()),
            "--size",
            "1M",
        ]);
        assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
        let err = text(&out.stderr);
        assert!(
            err.contains("holds 16MiB, size=8MiB serves its first 8MiB only"),
            "{err}"
        );
    }

    /// `cairn admin` on a path where no server answers says what the path is.
    #[test]
    fn admin_says_what_the_path_is() {
        let dir = tempfile::tempdir().expect("a directory");
        let file = dir.path().join("plain");
        std::fs::write(&file, b"x").expect("write");
        let p = |path: &std::path::Path| path.to_str().expect("UTF-8").to_string();
        let line = bad_input(&["admin", &p(&file), "status"]);
        assert!(
            line.contains("a regular file, not an admin socket"),
            "{line}"
        );
        let line = bad_input(&["admin", &p(&dir.path().join("none")), "status"]);
        assert!(line.contains("nothing is there"), "{line}");
        let line = bad_input(&["admin", &p(dir.path()), "status"]);
        assert!(line.contains("a directory"), "{line}");
        // A socket whose listener has gone.
        let sock = dir.path().join("stale.sock");
        drop(std::os::unix::net::UnixListener::bind(&sock).expect("bind"));
        let line = bad_input(&["admin", &p(&sock), "status"]);
        assert!(line.contains("nobody listens"), "{line}");
    }

    #[test]
    fn missing_file() {
        let line = bad_input(&["bench", "--device", "file:/nonexistent/x"]);
        assert!(line.contains("/nonexistent/x"), "{line}");
        // With size=, creating it fails instead: still one line.
        bad_input(&["bench", "--device", "file:/nonexistent/x,size=1M"]);
    }

    #[test]
    fn unaligned_block_size() {
        let line = bad_input(&["bench", "--device", "null:64M", "--bs", "1000"]);
        assert!(line.contains("--bs"), "{line}");
        bad_input(&["bench", "--device", "null:64M,block=4k", "--bs", "512"]);
    }

    #[test]
    fn iodepth_zero() {
        let line = bad_input(&["bench", "--device", "null:64M", "--iodepth", "0"]);
        assert!(line.contains("--iodepth"), "{line}");
        bad_input(&["bench", "--device", "null:64M", "--iodepth", "-1"]);
        bad_input(&["bench", "--device", "null:64M", "--numjobs", "0"]);
    }

    #[test]
    fn region_past_the_end() {
        for args in [
            ["--offset", "32M", "--size", "64M"],
            ["--offset", "0", "--size", "65M"],
            ["--offset", "64M", "--size", "4k"],
            ["--offset", "128M", "--size", "4k"],
        ] {
            let mut all = vec!["bench", "--device", "null:64M"];
            all.extend(args);
            bad_input(&all);
        }
        bad_input(&["bench", "--device", "null:64M", "--offset", "1000"]);
    }

    #[test]
    fn unknown_option() {
        let line = bad_input(&["bench", "--device", "null:64M", "--bogus"]);
        assert!(line.contains("--bogus"), "{line}");
        bad_input(&["--bogus", "bench"]);
        bad_input(&["frobnicate"]);
    }

    #[test]
    fn malformed_values() {
        for args in [
            ["--bs", "4x"],
            ["--bs", "-4k"],
            ["--size", "lots"],
            ["--offset", "1.5M"],
            ["--runtime", "5x"],
            ["--runtime", "0"],
            ["--ramp_time", "soon"],
            ["--rwmixread", "101"],
            ["--verify", "md5"],
            ["--output-format", "xml"],
            ["--clock", "sundial"],
            ["--reap", "never"],
            ["--stats", "maybe"],
            ["--randseed", "x"],
            ["--fsync", "-1"],
            ["--fua-every", "-1"],
            ["--fua-every", "often"],
            ["--idle-poll", "11ms"],
            ["--idle-poll", "soon"],
        ] {
            let mut all = vec!["bench", "--device", "null:64M"];
            all.extend(args);
            bad_input(&all);
        }
        let line = bad_input(&["bench", "--device", "null:64M", "--bs", "4x"]);
        assert!(line.contains("4x"), "{line}");
    }

    #[test]
    fn unknown_rw() {
        let line = bad_input(&["bench", "--device", "null:64M", "--rw", "sideways"]);
        assert!(line.contains("sideways"), "{line}");
    }

    #[test]
    fn bad_device() {
        for device in [
            "disk:1G",
            "null",
            "null:",
            "null:0",
            "mem:1000",
            "null:1M,block=1000",
            "mem:1M,colour=red",
            "file:",
            "file:/tmp/x,engine=spdk",
            "file:/tmp/x,direct=yes",
        ] {
            bad_input(&["bench", "--device", device]);
        }
        let line = bad_input(&["bench", "--device", "disk:1G"]);
        assert!(line.contains("disk"), "{line}");
    }

    #[test]
    fn time_based_without_runtime() {
        bad_input(&[
            "bench",
            "--device",
            "null:64M",
            "--size",
            "1M",
            "--time_based",
        ]);
    }
}

mod runs {
    use super::*;

    /// A bench over a cache reports the write-back its base received (the base's own
    /// line counted only the job's requests: ios=0/0), and after Ctrl-C says that the
    /// caches are written back and how much is left, then exits 0 with nothing lost.
    #[test]
    fn caches_write_back_is_reported_and_said_after_ctrl_c() {
        let dir = tempfile::tempdir_in("/dev/shm")
            .or_else(|_| tempfile::tempdir())
            .expect("a directory");
        let stack = dir.path().join("s.toml");
        std::fs::write(
            &stack,
            "[device.f]\ntype = \"file\"\npath = \"f.img\"\nsize = \"64M\"\n\
             [device.d]\ntype = \"delay\"\nbase = \"f\"\nbandwidth = \"20M\"\n\
             [device.c]\ntype = \"cache\"\nbase = \"d\"\nmemory = \"32M\"\n\
             [writeback]\nbackground = \"90%\"\nlimit = \"95%\"\nexpire = \"1h\"\n",
        )
        .expect("write the stack file");
        let child = std::process::Command::new(env!("CARGO_BIN_EXE_cairn"))
            .args(["bench", "--rw", "randwrite", "--bs", "64k", "--time_based"])
            .args(["--runtime", "60"])
            .arg(&stack)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("start cairn bench");
        std::thread::sleep(std::time::Duration::from_millis(1500));
        // SAFETY: signals our own child, not yet waited for.
        unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
        let out = child.wait_with_output().expect("wait");
        let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
        assert_eq!(out.status.code(), Some(0), "{stdout}{stderr}");
        assert!(stderr.contains("SIGINT received"), "{stderr}");
        assert!(
            stderr.contains("writing back the") && stderr.contains("written back in"),
            "{stderr}"
        );
        assert!(!stderr.contains("could not be written back"), "{stderr}");
        let line = stdout
            .lines()
            .skip_while(|l| !l.starts_with("Background I/O"))
            .find(|l| l.trim_start().starts_with("f: "))
            .unwrap_or_else(|| panic!("no background line for f:\n{stdout}"));
        let writes: u64 = line
            .split("ios=0/")
            .nth(1)
            .and_then(|r| r.split(',').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0);
        assert!(writes > 0, "{line}");
    }

    #[test]
    fn json_has_fio_fields() {
        let args = [
            "bench",
            "--device",
            "null:64M",
            "--runtime",
            "1",
            "--output-format",
            "json",
        ];
        let out = cairn(&args);
        assert_no_panic(&args, &out);
        assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
        let json = json_of(&out);
        let job = &json["jobs"][0];
        let read = &job["read"];
        assert!(read["iops"].as_f64().unwrap() > 0.0, "{read}");
        assert!(read["bw"].is_u64(), "{read}");
        assert!(read["io_bytes"].as_u64().unwrap() > 0, "{read}");
        assert_eq!(read["io_bytes"].as_u64().unwrap() % 4096, 0);
        assert!(read["clat_ns"]["mean"].is_f64(), "{read}");
        assert!(
            read["clat_ns"]["percentile"]["99.000000"].is_u64(),
            "{read}"
        );
        assert!(job["usr_cpu"].is_f64(), "{job}");
        assert!(job["sys_cpu"].is_f64(), "{job}");
        assert!(job["ctx"].is_u64(), "{job}");
        assert_eq!(job["error"], 0);
        assert_eq!(job["write"]["io_bytes"], 0);
        let extra = &json["cairn"];
        assert!(extra.is_object(), "{json}");
        assert_eq!(extra["switches"]["clock"], "cached");
        assert_eq!(extra["switches"]["reap"], "eager");
        assert_eq!(extra["switches"]["stats"], "on");
        assert!(extra["failure"].is_null());
        assert!(extra["device"]["description"]
            .as_str()
            .unwrap()
            .contains("null"));
    }

    #[test]
    fn switches_reach_the_report() {
        // Global switches go before or after the subcommand.
        for args in [
            vec![
                "--clock", "precise", "--reap", "lazy", "--stats", "off", "bench",
            ],
            vec![
                "bench", "--clock", "precise", "--reap", "lazy", "--stats", "off",
            ],
        ] {
            let mut all = args.clone();
            all.extend([
                "--device",
                "mem:1M",
                "--size",
                "256k",
                "--output-format",
                "json",
            ]);
            let out = cairn(&all);
            assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
            let json = json_of(&out);
            let switches = &json["cairn"]["switches"];
            assert_eq!(switches["clock"], "precise", "{all:?}");
            assert_eq!(switches["reap"], "lazy", "{all:?}");
            assert_eq!(switches["stats"], "off", "{all:?}");
            assert_eq!(json["jobs"][0]["read"]["total_ios"], 64);
        }
    }

    #[test]
    fn normal_output() {
        let args = ["bench", "--device", "mem:1M", "--size", "256k"];
        let out = cairn(&args);
        assert_no_panic(&args, &out);
        assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
        assert!(out.stderr.is_empty(), "{}", text(&out.stderr));
        let stdout = text(&out.stdout);
        assert!(stdout.contains("read: IOPS="), "{stdout}");
        assert!(stdout.contains("clat percentiles"), "{stdout}");
    }

    #[test]
    fn verify_on_null_exits_1_and_names_the_offset() {
        for format in ["normal", "json"] {
            let args = [
                "bench",
                "--device",
                "null:1M",
                "--verify",
                "crc32c",
                "--rw",
                "randwrite",
                "--size",
                "1M",
                "--output-format",
                format,
            ];
            let out = cairn(&args);
            assert_no_panic(&args, &out);
            let stderr = text(&out.stderr);
            assert_eq!(out.status.code(), Some(1), "{format}: {stderr}");
            let at = stderr
                .find("offset ")
                .unwrap_or_else(|| panic!("{format}: no offset in {stderr:?}"));
            let digits: String = stderr[at + 7..]
                .chars()
                .take_while(char::is_ascii_digit)
                .collect();
            let offset: u64 = digits
                .parse()
                .unwrap_or_else(|_| panic!("{format}: {stderr:?}"));
            assert_eq!(offset % 4096, 0, "{stderr}");
            assert!(offset < 1 << 20, "{stderr}");
            if format == "json" {
                let json = json_of(&out);
                assert_eq!(json["jobs"][0]["error"], libc_eilseq());
                let failure = json["cairn"]["failure"].as_str().unwrap();
                assert!(failure.contains(&format!("offset {offset}")), "{failure}");
            }
        }
    }

    /// EILSEQ on Linux, the error fio reports for a verification failure.
    fn libc_eilseq() -> i64 {
        84
    }

    #[test]
    fn verify_on_files_passes() {
        let dir = tempfile::tempdir_in("/dev/shm")
            .or_else(|_| tempfile::tempdir())
            .unwrap();
        for engine in ["io_uring", "aio", "sync"] {
            let path = dir.path().join(engine);
            let device = format!("file:{},engine={engine},size=1M", path.display());
            let args = [
                "bench",
                "--device",
                &device,
                "--rw",
                "randrw",
                "--verify",
                "crc32c",
                "--size",
                "256k",
                "--io_size",
                "1M",
                "--iodepth",
                "8",
                "--output-format",
                "json",
            ];
            let out = cairn(&args);
            assert_no_panic(&args, &out);
            assert_eq!(
                out.status.code(),
                Some(0),
                "{engine}: {}",
                text(&out.stderr)
            );
            let json = json_of(&out);
            assert!(json["cairn"]["verify"]["blocks_checked"].as_u64().unwrap() > 0);
        }
    }
}

mod help {
    use super::*;

    #[test]
    fn top_level_help() {
        let out = cairn(&["--help"]);
        assert_eq!(out.status.code(), Some(0));
        let stdout = text(&out.stdout);
        for needle in ["bench", "--clock", "--reap", "--stats"] {
            assert!(stdout.contains(needle), "cairn --help lacks {needle}");
        }
        assert_no_panic(&["--help"], &out);
    }

    /// The help speaks to a user: it says cairn serves over NBD, and what each switch
    /// does, leaving the techniques' numbers and history to the README.
    #[test]
    fn help_says_what_cairn_does_without_technique_numbers() {
        let top = text(&cairn(&["--help"]).stdout);
        assert!(top.contains("NBD"), "cairn --help never says NBD:\n{top}");
        for args in [
            vec!["--help"],
            vec!["bench", "--help"],
            vec!["serve", "--help"],
            vec!["check", "--help"],
            vec!["admin", "--help"],
            vec!["stat", "--help"],
            vec!["man", "--help"],
        ] {
            let help = text(&cairn(&args).stdout).to_lowercase();
            assert!(
                !help.contains("technique"),
                "cairn {args:?} speaks of techniques:\n{help}"
            );
        }
    }

    /// The technique switches are listed once, in the top-level help; check and admin,
    /// which they do not shape, do not list them.
    #[test]
    fn switches_are_listed_once_at_the_top() {
        let top = text(&cairn(&["--help"]).stdout);
        for flag in ["--reap", "--stats", "--flush", "--dispatch", "--writeback"] {
            assert_eq!(
                top.matches(flag).count(),
                1,
                "{flag} in cairn --help:\n{top}"
            );
        }
        for cmd in ["check", "admin"] {
            let help = text(&cairn(&[cmd, "--help"]).stdout);
            for flag in ["--clock", "--reap", "--stats", "--flush", "--dispatch"] {
                assert!(
                    !help.contains(flag),
                    "{flag} in cairn {cmd} --help:\n{help}"
                );
            }
        }
        // Still taken before or after the command.
        let out = cairn(&[
            "bench", "--clock", "precise", "--device", "null:1M", "--size", "1M",
        ]);
        assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
        let out = cairn(&[
            "--clock", "precise", "bench", "--device", "null:1M", "--size", "1M",
        ]);
        assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    }

    /// `cairn admin help` lists the commands without a server, as `cairn admin --help`
    /// does, `re-add` included.
    #[test]
    fn admin_help_needs_no_server() {
        let out = cairn(&["admin", "help"]);
        assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
        let listed = text(&out.stdout);
        let long = text(&cairn(&["admin", "--help"]).stdout);
        for command in [
            "devices",
            "status",
            "stats",
            "fail",
            "remove",
            "re-add",
            "add",
            "replace",
            "power-cut",
            "help",
        ] {
            for (what, body) in [("cairn admin help", &listed), ("cairn admin --help", &long)] {
                assert!(
                    body.lines().any(|l| l.trim_start().starts_with(command)),
                    "{what} lacks {command}:\n{body}"
                );
            }
        }
    }

    #[test]
    fn bench_help_lists_every_option() {
        for args in [["bench", "--help"], ["help", "bench"]] {
            let out = cairn(&args);
            assert_eq!(out.status.code(), Some(0), "{args:?}");
            let stdout = text(&out.stdout);
            for option in BENCH_OPTIONS {
                assert!(stdout.contains(option), "{args:?} lacks {option}");
            }
        }
    }

    #[test]
    fn version() {
        let out = cairn(&["--version"]);
        assert_eq!(out.status.code(), Some(0));
        assert!(text(&out.stdout).starts_with("cairn "));
    }
}

/// Exclusive access: a file a running cairn serves cannot be opened by another cairn.
mod exclusive {
    use super::*;
    use std::io::{BufRead, BufReader};
    use std::process::Stdio;

    #[test]
    fn a_file_served_by_one_cairn_is_refused_to_another_naming_the_holder() {
        let dir = tempfile::tempdir().expect("a directory");
        let image = dir.path().join("shared.img");
        let socket = dir.path().join("nbd.sock");
        let spec = format!("file:{},size=1M", image.display());
        let mut server = Command::new(env!("CARGO_BIN_EXE_cairn"))
            .args(["serve", "--device", &spec, "--listen"])
            .arg(format!("unix:{}", socket.display()))
            .stderr(Stdio::piped())
            .spawn()
            .expect("start cairn serve");
        let mut lines = BufReader::new(server.stderr.take().expect("stderr")).lines();
        // The file's engine is said first, then that it is served.
        let engine = lines.next().expect("a line").expect("text");
        assert!(engine.contains("shared.img: engine "), "{engine}");
        let serving = lines.next().expect("a line").expect("text");
        assert!(serving.contains("serving"), "{serving}");

        let holder = format!("in use by pid {} (cairn)", server.id());
        let line = bad_input(&["bench", "--device", &spec, "--runtime", "1"]);
        assert!(
            line.contains(&holder) && line.contains("shared.img"),
            "{line}"
        );
        let stack = dir.path().join("s.toml");
        std::fs::write(
            &stack,
            format!(
                "[device.f]\ntype = \"file\"\npath = \"{}\"\n",
                image.display()
            ),
        )
        .expect("write the stack file");
        let line = bad_input(&["check", stack.to_str().expect("UTF-8")]);
        assert!(line.contains("'f'") && line.contains(&holder), "{line}");

        // SAFETY: a signal to the child this test started and still owns.
        unsafe { libc::kill(server.id() as i32, libc::SIGTERM) };
        assert!(server.wait().expect("wait").success());
        // Free again.
        let out = cairn(&[
            "bench",
            "--device",
            &spec,
            "--runtime",
            "1",
            "--size",
            "64k",
        ]);
        assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    }
}
